"""The training recipes: tiny smoke runs that save loadable folders with a documented
train_log.json, atomically, bit-identically for one seed; the ``mmspec train`` CLI; and the one
training loop they share (``mmspec.training.loop``), bit for bit the plain torch loop in one process."""

import json

import pytest
import torch

from mmspec import commands
from mmspec.models import load_checkpoint
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.training.data import NUM_CLASSES
from mmspec.training.recipes import train_ar_image, train_vq

pytestmark = pytest.mark.slow

WEIGHTS = "diffusion_pytorch_model.safetensors"
VQ_KEYS = {"recipe", "seed", "steps", "config", "train", "final_loss", "heldout_recon_mse", "heldout",
           "wall_time_s"}
AR_KEYS = {"recipe", "seed", "steps", "config", "train", "vq_dir", "final_loss", "heldout_loss", "heldout",
           "wall_time_s"}
TINY_RUN = dict(steps=3, batch_size=2, lr=1e-3, dataset_size=8, heldout_size=4, log_every=2)
TINY_AR = dict(dim=32, n_layers=1, n_heads=2, mlp_hidden=64)


def run_vq(out, seed=0, log=None):
    return train_vq(out, seed=seed, log=log or (lambda msg: None), **TINY_RUN)


def run_ar(out, vq_dir, seed=0, log=None):
    return train_ar_image(out, vq_dir=vq_dir, seed=seed, model_config=TINY_AR, log=log or (lambda msg: None),
                          **TINY_RUN)


def read_log(folder):
    return json.loads((folder / "train_log.json").read_text())


@pytest.fixture(scope="module")
def vq_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vq") / "vq"
    run_vq(out)
    return out


def test_vq_recipe_saves_a_loadable_folder(tmp_path):
    lines = []
    out = tmp_path / "vq"
    record = run_vq(out, log=lines.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vq"]  # no temp folder left behind
    assert read_log(out) == json.loads(json.dumps(record))
    assert VQ_KEYS <= record.keys() and record["recipe"] == "vq" and record["steps"] == 3
    assert record["config"]["codebook_size"] == TinyVQModel().config.codebook_size  # the default config
    assert record["heldout"]["seed"] != record["seed"] and record["heldout_recon_mse"] > 0
    assert [line.split()[2] for line in lines if " step " in line] == ["2/3", "3/3"]  # every 2 steps, and the last
    model = load_checkpoint(TinyVQModel, out)
    assert model.encode(torch.zeros(1, 3, 64, 64)).shape == (1, 16, 16)


def test_ar_recipe_trains_on_the_vq_ids(tmp_path, vq_dir):
    out = tmp_path / "ar"
    record = run_ar(out, vq_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ar"]
    assert read_log(out) == json.loads(json.dumps(record))
    assert AR_KEYS <= record.keys() and record["recipe"] == "ar-image"
    model = load_checkpoint(LlamaGenModel, out)
    vq = load_checkpoint(TinyVQModel, vq_dir)
    assert model.vocab_size == vq.config.codebook_size and model.config.grid_size == vq.grid_size
    assert model.config.num_classes == NUM_CLASSES and model.config.dim == TINY_AR["dim"]
    assert 0 < record["heldout_loss"] < 2 * torch.log(torch.tensor(float(model.vocab_size))).item()


def test_ar_data_is_upright_scenes_tokenized_in_chunks(vq_dir):
    """``token_data`` draws the AR target's "upright" scenes and tokenizes them chunk by chunk; the ids
    are those of the whole set encoded at once, and the record says which style was used."""
    from mmspec.training.data import ShapesDataset
    from mmspec.training.recipes.ar_image import AR_DATA_STYLE, token_data, tokenize
    from mmspec.training.recipes.common import stack

    vq = load_checkpoint(TinyVQModel, vq_dir)
    labels, ids, held_labels, held_ids, _ = token_data(vq, 7, 3, seed=5, chunk=2)
    images, want_labels = stack(ShapesDataset(7, 5, 64, style="upright"))
    assert AR_DATA_STYLE == "upright" and torch.equal(labels, want_labels) and torch.equal(ids, tokenize(vq, images))
    assert ids.shape == (7, 256) and held_ids.shape == (3, 256) and held_labels.tolist() == [0, 1, 2]
    scene, _ = stack(ShapesDataset(7, 5, 64))
    assert not torch.equal(ids, tokenize(vq, scene))


def test_same_seed_gives_bit_identical_weights(tmp_path, vq_dir):
    run_vq(tmp_path / "a")
    run_vq(tmp_path / "b")
    run_vq(tmp_path / "c", seed=1)
    weights = {name: (tmp_path / name / WEIGHTS).read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] and weights["a"] != weights["c"]
    run_ar(tmp_path / "ar1", vq_dir)
    run_ar(tmp_path / "ar2", vq_dir)
    assert (tmp_path / "ar1" / WEIGHTS).read_bytes() == (tmp_path / "ar2" / WEIGHTS).read_bytes()


def test_existing_folder_replaced_only_by_a_complete_one(tmp_path, monkeypatch):
    out = tmp_path / "vq"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def broken_save(self, save_directory, **kwargs):  # fails half-way through writing
        (save_directory / "partial.safetensors").write_text("")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(TinyVQModel, "save_pretrained", broken_save)
        with pytest.raises(OSError, match="disk full"):
            run_vq(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vq"]
    assert [p.name for p in out.iterdir()] == ["old.txt"] and (out / "old.txt").read_text() == "old"

    run_vq(out)  # a successful run replaces the folder as a whole
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", WEIGHTS, "train_log.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vq"]


def test_bad_arguments_name_the_argument(tmp_path, vq_dir):
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        train_vq(tmp_path / "x", **{**TINY_RUN, "steps": 0})
    with pytest.raises(ValueError, match="dataset_size must be"):
        train_vq(tmp_path / "x", **{**TINY_RUN, "dataset_size": 1})
    with pytest.raises(ValueError, match="vq_dir must be"):
        train_ar_image(tmp_path / "x", vq_dir=tmp_path / "missing", **TINY_RUN)
    with pytest.raises(ValueError, match="model_config must be free of vocab_size"):
        train_ar_image(tmp_path / "x", vq_dir=vq_dir, model_config={"vocab_size": 7}, **TINY_RUN)
    assert not (tmp_path / "x").exists()


def test_cli_parses_train_commands(tmp_path, vq_dir):
    parser = commands.build_parser()
    args = parser.parse_args(["train", "vq", "--out", str(tmp_path / "vq")])
    assert (args.command, args.recipe, args.seed, args.threads) == ("train", "vq", 0, 2)
    assert args.steps == commands.train.TRAIN_DEFAULTS["vq"]["steps"]
    args = parser.parse_args(["train", "ar-image", "--vq", str(vq_dir), "--out", "ar", "--steps", "7",
                              "--seed", "3", "--batch-size", "5", "--lr", "0.01"])
    assert (args.recipe, args.vq, args.steps, args.seed, args.batch_size, args.lr) == \
        ("ar-image", str(vq_dir), 7, 3, 5, 0.01)


@pytest.mark.parametrize("argv, message", [
    (["train", "vq", "--out", "x", "--steps", "0"], "argument --steps: must be an int >= 1, got 0"),
    (["train", "vq", "--out", "x", "--lr", "0"], "argument --lr: must be a number > 0"),
    (["train", "ar-image", "--vq", "/no/such/vq", "--out", "x"], "argument --vq: no such folder"),
    (["train", "ar-image", "--out", "x"], "the following arguments are required: --vq"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        commands.main(argv)
    assert message in capsys.readouterr().err


def test_cli_train_runs_end_to_end(tmp_path, vq_dir, capsys):
    threads = torch.get_num_threads()
    try:
        assert commands.main(["train", "ar-image", "--vq", str(vq_dir), "--out", str(tmp_path / "ar"), "--steps", "1",
                              "--batch-size", "2", "--dataset-size", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "saved" in capsys.readouterr().out
    assert read_log(tmp_path / "ar")["steps"] == 1


# -- the one training loop (mmspec.training.loop) -------------------------------------------------

def _plain_torch_loop(model, optimizer, schedule, batches, steps, clip):
    """What every recipe ran before the shared loop: zero_grad, backward, clip, step, schedule."""
    for _, (x, y) in zip(range(steps), batches):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        schedule.step()
    return loss.item()


def _toy_run(use_loop: bool, clip: float = 0.05, steps: int = 6):
    from mmspec.training.loop import new_accelerator, train_loop
    from mmspec.training.recipes.common import warmup_cosine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup=2, steps=steps))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]
    if use_loop:
        lines = []
        final = train_loop(model, optimizer, batches, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                           steps=steps, accelerator=new_accelerator("toy"), schedule=schedule, grad_clip=clip,
                           name="toy", log=lines.append, log_every=4)
    else:
        final, lines = _plain_torch_loop(model, optimizer, schedule, batches, steps, clip), None
    return model.state_dict(), final, lines


def test_train_loop_equals_the_plain_torch_loop_bit_for_bit():
    """One process: accelerate's prepare/backward/clip change nothing, so the recipes' weights are
    the ones their hand-written loops gave. The clip (0.05) acts at every step (gradient norms
    0.7-1.6 here): a loop that skipped it would differ, as the run with a huge clip shows."""
    ref, ref_loss, _ = _toy_run(False)
    got, loss, lines = _toy_run(True)
    assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert loss == ref_loss
    assert [line.split()[:3] for line in lines] == [["toy", "step", "4/6"], ["toy", "step", "6/6"]]
    unclipped, _, _ = _toy_run(True, clip=1e9)
    assert not all(torch.equal(unclipped[k], ref[k]) for k in ref), "the clip must matter in this test"


def test_ema_follows_its_formula_and_the_loop_calls_it_each_step():
    """``EMA``: after update n each float average moves by 1 - min(decay, (1 + n) / (10 + n)) toward
    the module (checked against that sum written out over 6 updates of a module whose weight takes
    known values); integer buffers are not averaged; ``copy_to`` writes the averages back in the
    module's dtype; ``train_loop`` calls ``on_step`` once per step, after the optimizer step."""
    from mmspec.training.loop import EMA, new_accelerator, train_loop

    module = torch.nn.BatchNorm1d(1)  # weight, bias, running stats, and an int64 step counter
    values = [3.0, -1.0, 2.0, 0.5, 4.0, -2.0]
    ema = EMA(module, 0.6)
    expected = 1.0  # BatchNorm's initial weight
    for n, v in enumerate(values, start=1):
        module.weight.data.fill_(v)
        ema.update(module)
        d = min(0.6, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * v
    assert ema.updates == 6 and "num_batches_tracked" not in ema.shadow
    assert abs(float(ema.shadow["weight"]) - expected) < 1e-6
    plain = 1.0  # without the warm-up the average is elsewhere: the check can fail
    for v in values:
        plain = 0.6 * plain + 0.4 * v
    assert abs(plain - expected) > 0.1
    module.half()
    ema.copy_to(module)
    assert module.weight.dtype == torch.float16 and float(module.weight) == float(torch.tensor(expected).half())
    with pytest.raises(ValueError, match="decay must be a float in \\(0, 1\\)"):
        EMA(module, 1.0)

    steps, seen = [], []
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.ones(1, 2)] * 3
    start = model.bias.item()
    train_loop(model, optimizer, batches, lambda m, b: m(b).sum(), steps=3, accelerator=new_accelerator("toy"),
               log=lambda line: None, on_step=lambda step: (steps.append(step), seen.append(model.bias.item())))
    assert steps == [1, 2, 3]
    assert [b - start for b in seen] == pytest.approx([-0.1, -0.2, -0.3], abs=1e-6)  # after each SGD step


def test_single_process_recipes_refuse_a_multi_process_launch(tmp_path, monkeypatch):
    """Under ``accelerate launch`` with N > 1 only vlm-draft splits its batches; the others would
    train N identical copies into one folder, so they stop before any data is made."""
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    with pytest.raises(ValueError, match="processes must be 1 for train_vq .* got 2"):
        run_vq(tmp_path / "vq")
    assert list(tmp_path.iterdir()) == []


def test_train_loop_logs_the_losses_extra_scalars(tmp_path):
    lines = []
    record = run_vq(tmp_path / "vq", log=lines.append)
    steps = [line for line in lines if " step " in line]
    assert steps[-1].startswith("vq step 3/3  loss ") and "  recon " in steps[-1]
    assert f"loss {record['final_loss']:.4f}" in steps[-1]
