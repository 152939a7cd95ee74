"""The video recipes (``train_video_ae``, ``train_video``): tiny smoke runs that save loadable
folders with a documented train_log.json and a sample strip, atomically, bit-identically for one
seed; the two-stream loss's switch handling; and the ``mmspec train video-ae | video`` CLI."""

import json

import pytest
import torch

from mmspec.models import load_checkpoint
from mmspec.models.video_ae import FrameAutoencoder
from mmspec.models.video_dit import VideoDiTModel
from mmspec.training.recipes import train_video, train_video_ae
from mmspec.training.recipes.video import DEFAULT_VIDEO_CONFIG, TwoStreamLoss, rollout, rollout_metrics
from mmspec.training.data.video import VideoPrompt, render_clip

pytestmark = pytest.mark.slow

WEIGHTS = "diffusion_pytorch_model.safetensors"
AE_RUN = dict(steps=3, batch_size=4, lr=1e-3, dataset_size=8, clip_frames=4, heldout_size=2, log_every=2)
TINY_DIT = dict(dim=32, n_layers=1, n_heads=2, mlp_hidden=64, chunk_frames=2, sink_frames=2, window_frames=4)
DIT_RUN = dict(steps=3, batch_size=2, lr=1e-3, dataset_size=4, clip_frames=8, heldout_size=2, eval_frames=8,
               eval_clips=3, log_every=2, model_config=TINY_DIT)
AE_KEYS = {"recipe", "seed", "steps", "config", "train", "final_loss", "heldout_recon_mse", "heldout_psnr_db",
           "heldout", "latent_mean", "latent_std", "wall_time_s", "cpu_time_s"}
DIT_KEYS = {"recipe", "seed", "steps", "config", "train", "ae_dir", "final_loss", "heldout_loss", "rollout",
            "heldout", "wall_time_s", "cpu_time_s"}


def quiet(msg):
    pass


def read_log(folder):
    return json.loads((folder / "train_log.json").read_text())


@pytest.fixture(scope="module")
def ae_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("video") / "ae"
    train_video_ae(out, log=quiet, **AE_RUN)
    return out


def test_ae_recipe_saves_a_loadable_folder(ae_dir):
    record = read_log(ae_dir)
    assert AE_KEYS <= record.keys() and record["recipe"] == "video-ae" and record["steps"] == 3
    assert sorted(p.name for p in ae_dir.iterdir()) == sorted(["config.json", WEIGHTS, "train_log.json"])
    ae = load_checkpoint(FrameAutoencoder, ae_dir)
    assert record["heldout_recon_mse"] > 0 and record["heldout"]["seed"] != record["seed"]
    # the latent statistics measured after training are saved with the weights (fp16-rounded)
    assert torch.allclose(ae.latent_std, torch.tensor(record["latent_std"]), rtol=1e-3)
    assert ae.encode(torch.zeros(1, 3, 32, 32)).shape == (1, 4, 8, 8)


def test_video_recipe_saves_a_loadable_folder_and_samples(tmp_path, ae_dir):
    lines = []
    out = tmp_path / "dit"
    record = train_video(out, ae_dir=ae_dir, log=lines.append, first_chunk_prob=0.5, **DIT_RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dit"]  # no temp folder left
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", WEIGHTS, "train_log.json", "samples.png"])
    assert read_log(out) == json.loads(json.dumps(record))
    assert DIT_KEYS <= record.keys() and record["recipe"] == "video"
    assert [line.split()[2] for line in lines if " step " in line] == ["2/3", "3/3"]
    model = load_checkpoint(VideoDiTModel, out)
    assert model.config.latent_size == 8 and model.config.dim == 32 and model.config.chunk_frames == 2
    assert model.config.conv_head == DEFAULT_VIDEO_CONFIG["conv_head"] and model.head_conv is not None
    assert record["train"]["windows"] == [2, 4] and record["train"]["first_chunk_prob"] == 0.5
    assert 0 <= record["rollout"]["colour_acc"] <= 1 and len(record["rollout"]["schedules"]) == 3
    from PIL import Image

    assert Image.open(out / "samples.png").size == (2 * 4 * 32, 2 * 3 * 32)  # every other frame, 2x


def test_same_seed_gives_bit_identical_weights(tmp_path, ae_dir):
    for name in ("a", "b"):
        train_video_ae(tmp_path / f"ae_{name}", log=quiet, **AE_RUN)
        train_video(tmp_path / f"dit_{name}", ae_dir=ae_dir, log=quiet, **DIT_RUN)
    train_video(tmp_path / "dit_c", ae_dir=ae_dir, log=quiet, seed=1, **DIT_RUN)
    read = lambda name: (tmp_path / name / WEIGHTS).read_bytes()  # noqa: E731
    assert read("ae_a") == read("ae_b")
    assert read("dit_a") == read("dit_b") != read("dit_c")


def test_switched_clips_learn_from_the_switch_on():
    """A clip switching its prompt at frame 6 (of 8) is trained under the new prompt on every
    frame (context included) and its loss is the velocity error of frames 6 and 7 only
    (recomputed from the forward's own inputs; an all-frames loss differs)."""
    torch.manual_seed(0)
    model = VideoDiTModel(**TINY_DIT, prompt_dropout_prob=0.0)
    x0 = torch.randn(1, 8, 4, 8, 8)
    prompt = torch.tensor([[[0, 0, 0]] * 6 + [[1, 0, 0]] * 2])
    fn = TwoStreamLoss(model, 8, [4], torch.Generator().manual_seed(0), noisy_context_prob=0.0, self_context_prob=0.0)
    seen = {}
    original = model.forward

    def spy(latents, t, prompt, **kwargs):
        seen.update(latents=latents, t=t, prompt=prompt, v=original(latents, t, prompt, **kwargs))
        return seen["v"]

    model.forward = spy
    loss = fn(model, (x0, prompt, torch.tensor([6])))["loss"]
    model.forward = original
    assert (seen["prompt"] == torch.tensor([1, 0, 0])).all()  # the new prompt on all 16 frames
    t = seen["t"][0, 8:, None, None, None]
    noise = (seen["latents"][0, 8:] - (1 - t) * x0[0]) / t
    err = (seen["v"][0, 8:] - (noise - x0[0])).pow(2).mean(dim=(1, 2, 3))  # (8,) per frame
    assert torch.isclose(loss, err[6:].mean(), rtol=1e-4) and not torch.isclose(loss, err.mean(), rtol=1e-2)


def test_rollout_metrics_read_pixels():
    """Rendered clips as 'generated' streams score 1.0; the same clips judged against another
    colour and the opposite direction score 0."""
    schedules = [[(0, VideoPrompt(c, 0, d))] for c, d in ((0, 0), (2, 3))]
    frames = torch.stack([render_clip(s, 6, torch.Generator().manual_seed(i))[0] for i, s in enumerate(schedules)])
    good = rollout_metrics(frames, schedules)
    assert good["colour_acc"] == 1.0 and good["direction_acc"] == 1.0
    wrong = [[(0, VideoPrompt(1, 0, 1))], [(0, VideoPrompt(3, 0, 2))]]
    bad = rollout_metrics(frames, wrong)
    assert bad["colour_acc"] == 0.0 and bad["direction_acc"] == 0.0


def test_rollout_switches_and_recaches(tmp_path, ae_dir):
    """A rollout whose prompt switches at frame 4 runs the re-cache (sink re-cached or kept) and
    returns frames of the right shape; with the same generator seed, its first 4 frames equal
    those of a rollout without the switch."""
    torch.manual_seed(0)
    model = VideoDiTModel(**TINY_DIT)
    ae = load_checkpoint(FrameAutoencoder, ae_dir)
    a, b = VideoPrompt(0, 0, 0), VideoPrompt(2, 0, 0)
    plain = rollout(model, ae, [[(0, a)]], 8, torch.Generator().manual_seed(0))
    for recache_sink in (True, False):
        switched = rollout(model, ae, [[(0, a), (4, b)]], 8, torch.Generator().manual_seed(0), recache_sink=recache_sink)
        assert switched.shape == (1, 8, 3, 32, 32)
        assert torch.equal(switched[:, :4], plain[:, :4])


def test_ema_saves_and_measures_the_average(tmp_path, ae_dir):
    """``ema_decay``: the same run (EMA draws nothing from the generators) with and without it. The
    averaged run's ``heldout_loss_raw`` is the plain run's held-out loss exactly (same trained
    weights), while the folder holds different weights, whose held-out loss it records."""
    plain = train_video(tmp_path / "plain", ae_dir=ae_dir, log=quiet, **DIT_RUN)
    ema = train_video(tmp_path / "ema", ae_dir=ae_dir, log=quiet, ema_decay=0.5, **DIT_RUN)
    assert "heldout_loss_raw" not in plain and plain["train"]["ema_decay"] is None
    assert ema["train"]["ema_decay"] == 0.5 and ema["heldout_loss_raw"] == plain["heldout_loss"]
    assert ema["heldout_loss"] != plain["heldout_loss"]
    assert (tmp_path / "ema" / WEIGHTS).read_bytes() != (tmp_path / "plain" / WEIGHTS).read_bytes()
    for bad in (1.0, 0.0, 1):
        with pytest.raises(ValueError, match="ema_decay must be None or a float in \\(0, 1\\)"):
            train_video(tmp_path / "x", ae_dir=ae_dir, ema_decay=bad, **DIT_RUN)


def test_bad_arguments_name_the_argument(tmp_path, ae_dir):
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        train_video_ae(tmp_path / "x", **{**AE_RUN, "steps": 0})
    with pytest.raises(ValueError, match="ae_dir must be"):
        train_video(tmp_path / "x", ae_dir=tmp_path / "missing", **DIT_RUN)
    with pytest.raises(ValueError, match="clip_frames must be a multiple of chunk_frames"):
        train_video(tmp_path / "x", ae_dir=ae_dir, **{**DIT_RUN, "clip_frames": 6})
    with pytest.raises(ValueError, match="model_config must be free of latent_channels"):
        train_video(tmp_path / "x", ae_dir=ae_dir, **{**DIT_RUN, "model_config": {"latent_channels": 3}})
    with pytest.raises(ValueError, match="autocast must be one of fp32, bf16"):
        train_video(tmp_path / "x", ae_dir=ae_dir, **{**DIT_RUN, "autocast": "half"})
    with pytest.raises(ValueError, match="first_chunk_prob must be a number in \\[0, 1\\]"):
        train_video(tmp_path / "x", ae_dir=ae_dir, **{**DIT_RUN, "first_chunk_prob": 2})
    assert not (tmp_path / "x").exists()


def test_cli_parses_the_video_recipes(tmp_path, ae_dir, capsys):
    from mmspec import commands

    args = commands.build_parser().parse_args(["train", "video", "--ae", str(ae_dir), "--out", str(tmp_path / "v")])
    from mmspec.commands.train import TRAIN_DEFAULTS, VIDEO_ROLLOUT

    assert (args.recipe, args.ae, args.steps, args.batch_size) == ("video", str(ae_dir),
                                                                    TRAIN_DEFAULTS["video"]["steps"], 8)
    assert args.first_chunk_prob == VIDEO_ROLLOUT["first_chunk_prob"]
    from mmspec.commands.common import UsageError

    with pytest.raises(UsageError, match="--first-chunk-prob: must be a number in \\[0, 1\\], got 1.5"):
        commands.build_parser().parse_args(["train", "video", "--ae", str(ae_dir), "--out", str(tmp_path / "v"),
                                            "--first-chunk-prob", "1.5"])
    assert args.ema_decay is None
    parsed = commands.build_parser().parse_args(["train", "video", "--ae", str(ae_dir), "--out", str(tmp_path / "v"),
                                                 "--ema-decay", "0.999"])
    assert parsed.ema_decay == 0.999
    for bad in ("0", "1", "1.5"):  # the recipe's range (0, 1): refused by the parser, before any work
        with pytest.raises(UsageError, match=f"--ema-decay: must be a number in \\(0, 1\\), got {float(bad)}"):
            commands.build_parser().parse_args(["train", "video", "--ae", str(ae_dir), "--out", str(tmp_path / "v"),
                                                "--ema-decay", bad])
    with pytest.raises(SystemExit):
        commands.main(["train", "video", "--out", str(tmp_path / "v")])
    assert "the following arguments are required: --ae" in capsys.readouterr().err
    threads = torch.get_num_threads()
    try:
        assert commands.main(["train", "video-ae", "--out", str(tmp_path / "ae"), "--steps", "1", "--batch-size", "2",
                              "--dataset-size", "4", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "saved" in capsys.readouterr().out and read_log(tmp_path / "ae")["steps"] == 1
