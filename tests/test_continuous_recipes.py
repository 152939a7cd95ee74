"""Continuous-token recipes on tiny configs (a few steps each): the PCA tokenizer, the AR target and
its draft (plain and distilled), checkpoints as fp16 safetensors with train_log.json."""

import json

import pytest
import torch
from safetensors import safe_open

from mmspec import methods
from mmspec.models import load_checkpoint
from mmspec.models.continuous import ContinuousARModel
from mmspec.models.continuous_tokenizer import PatchPCATokenizer
from mmspec.training.recipes import train_continuous_ar, train_continuous_draft, train_continuous_tokenizer
from mmspec.training.recipes.continuous import distill_loss, encode_dataset

pytestmark = pytest.mark.slow

TINY = dict(dim=16, n_layers=1, n_heads=2, mlp_hidden=32, mixture_components=2, mixture_hidden=16,
            diffusion_width=16, diffusion_blocks=1)
RUN = dict(steps=2, batch_size=4, lr=1e-3, dataset_size=8, heldout_size=4, log_every=1, warmup=1)


def fp16_only(folder) -> bool:
    with safe_open(str(folder / "diffusion_pytorch_model.safetensors"), "pt") as f:
        return all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())


def test_tokenizer_full_rank_is_lossless_and_components_are_ordered():
    tok = PatchPCATokenizer(sample_size=16, patch_size=4, latent_dim=48)
    x = torch.rand(6, 3, 16, 16) * 2 - 1
    tok.fit(x)
    torch.testing.assert_close(tok(x), x, atol=1e-4, rtol=0)  # a full orthonormal basis reconstructs exactly
    var = tok.encode(x).var((0, 1))
    assert (var[:-1] >= var[1:] - 1e-5).all()  # principal directions by decreasing variance
    assert tok.encode(x).shape == (6, 16, 48)
    with pytest.raises(ValueError, match="latent_dim must be an int in \\[1, 48\\]"):
        PatchPCATokenizer(sample_size=16, patch_size=4, latent_dim=49)
    with pytest.raises(ValueError, match="images must be a \\(batch, 3, 16, 16\\) tensor"):
        tok.encode(torch.zeros(1, 3, 8, 8))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    record = train_continuous_tokenizer(out, kind="pca", dataset_size=64, heldout_size=16, log=lambda s: None)
    return out, record


def test_tokenizer_recipe(tokenizer_dir):
    out, record = tokenizer_dir
    assert json.loads((out / "train_log.json").read_text())["recipe"] == "continuous-tokenizer"
    assert fp16_only(out)
    assert 0 < record["heldout_recon_mse"] < 0.02 and 0.8 < record["latent_std"] < 1.2
    assert record["recon_accuracy"] is None
    tok = load_checkpoint(PatchPCATokenizer, out)
    labels, latents = encode_dataset(tok, 4, 0)
    assert latents.shape == (4, 64, 16) and labels.tolist() == [0, 1, 2, 3]


def test_target_and_drafts(tokenizer_dir, tmp_path):
    tok, _ = tokenizer_dir
    logs = []
    rec = train_continuous_ar(tmp_path / "ar", tokenizer_dir=tok, model_config=TINY, log=logs.append, **RUN)
    assert fp16_only(tmp_path / "ar") and (tmp_path / "ar" / "train_log.json").is_file()
    assert set(rec["heldout_losses"]) == {"mixture", "diffusion", "loss"} and rec["s_per_step"] > 0
    assert any("continuous-ar step 2/2" in line for line in logs)
    target = load_checkpoint(ContinuousARModel, tmp_path / "ar")
    assert target.config.token_dim == 16 and target.config.grid_size == 8 and target.config.id2label["0"]
    assert int(target.heads["diffusion"].schedule.timesteps.max()) == 946  # MAR's chain without its t = 999 step

    rec = train_continuous_draft(tmp_path / "draft", tokenizer_dir=tok, target_dir=tmp_path / "ar", distill=0.5,
                                 model_config={**TINY, "dim": 8, "mlp_hidden": 16}, log=lambda s: None, **RUN)
    assert rec["train"]["distill"] == 0.5
    draft = load_checkpoint(ContinuousARModel, tmp_path / "draft")
    assert draft.config.diffusion_timesteps == target.config.diffusion_timesteps
    methods.build(methods.resolve("continuous", "path"), {"target": target, "draft_model": draft})  # compatible
    rec = train_continuous_draft(tmp_path / "plain", tokenizer_dir=tok, input_noise=0.25,  # data only, no target
                                 model_config={**TINY, "dim": 8, "mlp_hidden": 16}, log=lambda s: None, **RUN)
    assert rec["train"]["distill"] == 0 and rec["train"]["input_noise"] == 0.25 and rec["train"]["target_dir"] is None

    with pytest.raises(ValueError, match="target_dir must be a folder written by 'mmspec train continuous-ar' when "
                                         "distill > 0"):
        train_continuous_draft(tmp_path / "x", tokenizer_dir=tok, distill=0.5, **RUN)
    with pytest.raises(ValueError, match="model_config must be free of token_dim"):
        train_continuous_ar(tmp_path / "x", tokenizer_dir=tok, model_config={"token_dim": 4}, **RUN)
    with pytest.raises(ValueError, match="model_config must be free of diffusion_sampling_steps"):
        train_continuous_draft(tmp_path / "x", tokenizer_dir=tok, target_dir=tmp_path / "ar",
                               model_config={"diffusion_sampling_steps": 10}, **RUN)
    with pytest.raises(ValueError, match="tokenizer_dir must be a folder saved by"):
        train_continuous_ar(tmp_path / "x", tokenizer_dir=tmp_path / "missing", **RUN)
    assert not (tmp_path / "x").exists()


def test_distillation_pulls_the_draft_towards_the_target():
    torch.manual_seed(0)
    cfg = dict(token_dim=3, grid_size=2, num_classes=2, diffusion_timesteps=[50, 300, 600], **TINY)
    target = ContinuousARModel(**cfg).eval().requires_grad_(False)
    with torch.no_grad():  # heads away from their (zero-output) init, so there is something to learn
        for p in target.heads.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    draft = ContinuousARModel(**{**cfg, "dim": 8, "mlp_hidden": 16})
    labels, latents = torch.tensor([0, 1] * 4), torch.randn(8, 4, 3)

    def kd() -> tuple[float, float]:  # the two distillation terms on fixed noise, averaged over 20 draws
        draft.eval()
        g = torch.Generator().manual_seed(123)
        with torch.no_grad():
            outs = [distill_loss(draft, target, labels, latents, g, distill=1.0) for _ in range(20)]
        draft.train()
        return tuple(sum(o[k].item() for o in outs) / 20 for k in ("kd_mixture", "kd_eps"))

    before = kd()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(60):
        out = distill_loss(draft, target, labels, latents, g, distill=1.0)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    after = kd()
    assert after[0] < before[0] - 0.3 and after[1] < 0.5 * before[1], (before, after)


def test_input_noise_widens_the_teacher_forced_states():
    """``input_noise`` n widens the state noise of the teacher-forced inputs from b to sqrt(b^2 + n^2)
    (measured std over 256 x 12 x 64 values within 3%); the class row and the latents are untouched,
    and 0 gives the kernel's own states."""
    torch.manual_seed(0)
    model = ContinuousARModel(token_dim=12, grid_size=8, num_classes=3, dim=32, n_layers=1, n_heads=2, mlp_hidden=64)
    a, b = model.state_kernel
    labels, latents = torch.tensor([0, 1, 2, 0] * 64), torch.randn(256, 64, 12)
    for n in (0.0, 0.25):
        tok = model.tokens_from_latents(labels, latents, torch.Generator().manual_seed(1), input_noise=n)
        assert torch.equal(tok[:, 1:, 1], latents[:, :-1]) and torch.equal(tok[:, 0, 0, 0], labels.float())
        std = (tok[:, 1:, 0] - a * latents[:, :-1]).std().item()
        assert abs(std / (b * b + n * n) ** 0.5 - 1) < 0.03, (n, std)
