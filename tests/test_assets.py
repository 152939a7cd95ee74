"""The bundled checkpoints: present, fp16, within budget, loadable offline, consistent, and working."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mmspec.models import load_checkpoint
from mmspec.models.classifier import ShapesClassifier
from mmspec.pipelines import SpeculativeARImagePipeline

pytestmark = pytest.mark.slow

ASSETS = Path(__file__).resolve().parents[1] / "assets"
AR = ASSETS / "ar-image"


def test_weights_are_fp16_and_within_budget():
    files = sorted(AR.glob("*/diffusion_pytorch_model.safetensors"))
    assert [f.parent.name for f in files] == ["draft_model", "eagle_head", "medusa_head", "transformer", "vqvae"]
    assert sum(f.stat().st_size for f in files) <= 50 * 2**20
    for f in files + [ASSETS / "classifier" / "diffusion_pytorch_model.safetensors"]:
        with safe_open(f, "pt") as st:
            dtypes = {st.get_tensor(k).dtype for k in st.keys()}
        assert dtypes <= {torch.float16, torch.int64, torch.long}, (f, dtypes)
    for name in ("draft_model", "eagle_head", "medusa_head", "transformer", "vqvae"):
        log = json.loads((AR / name / "train_log.json").read_text())
        assert log["seed"] == 0 and log["wall_time_s"] > 0


def test_bundled_pipeline_generates_offline():
    pipe = SpeculativeARImagePipeline.from_pretrained(AR)
    pipe.set_progress_bar_config(disable=True)
    t = pipe.transformer
    assert t.vocab_size == pipe.vqvae.config.codebook_size and t.config.grid_size == pipe.vqvae.grid_size
    assert pipe.draft_model.vocab_size == t.vocab_size and pipe.eagle_head.vocab_size == t.vocab_size
    assert pipe.medusa_head.vocab_size == t.vocab_size and pipe.medusa_head.target is t
    out = pipe(prompt="a yellow star", method="zipar+gsd", method_knobs={"zipar_window": 4},
               generator=torch.Generator().manual_seed(0), output_type="pt")
    assert out.images.shape == (1, 3, 64, 64) and out.stats["nfe"] < 256
    classifier = load_checkpoint(ShapesClassifier, ASSETS / "classifier")
    assert classifier(out.images * 2 - 1).shape == (1, 16)


CONT = ASSETS / "continuous"


def test_bundled_continuous_pipeline():
    """assets/continuous: fp16 safetensors within the issue's 30 MB, seed-0 train logs (target and
    drafts trained with the recipes' default input noise, the target for its default steps), the
    tokenizer's 8x8 grid of 16-dim latents, and lossless ``sd`` running offline with the bundled
    draft (fewer backbone passes than tokens); the distilled draft shares the target's schedule."""
    from mmspec.models.continuous import ContinuousARModel
    from mmspec.pipelines import SpeculativeContinuousARPipeline

    files = sorted(CONT.glob("*/diffusion_pytorch_model.safetensors"))
    assert [f.parent.name for f in files] == ["draft_distilled", "draft_model", "tokenizer", "transformer"]
    assert sum(f.stat().st_size for f in files) <= 30 * 2**20
    for f in files:
        with safe_open(f, "pt") as st:
            assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.float16}, f
        assert json.loads((f.parent / "train_log.json").read_text())["seed"] == 0
    # the recipes' defaults are what the bundled target and drafts were trained with
    from mmspec.commands.train import TRAIN_DEFAULTS
    from mmspec.methods.continuous import INPUT_NOISE

    logs = {name: json.loads((CONT / name / "train_log.json").read_text())
            for name in ("transformer", "draft_model", "draft_distilled")}
    assert {name: log["train"]["input_noise"] for name, log in logs.items()} == dict.fromkeys(logs, INPUT_NOISE)
    assert logs["transformer"]["steps"] == TRAIN_DEFAULTS["continuous-ar"]["steps"]
    pipe = SpeculativeContinuousARPipeline.from_pretrained(CONT)
    pipe.set_progress_bar_config(disable=True)
    t = pipe.transformer
    assert type(pipe.tokenizer).__name__ == "ConvTokenizer"  # the learned tokenizer (issue 27)
    assert (t.config.grid_size, t.config.token_dim) == (pipe.tokenizer.grid_size, pipe.tokenizer.token_dim) == (8, 8)
    distilled = load_checkpoint(ContinuousARModel, CONT / "draft_distilled")
    assert distilled.config.diffusion_timesteps == t.config.diffusion_timesteps
    for method in ("sd", "sjd"):
        out = pipe(prompt="a red circle", method=method, guidance_scale=3.0, guidance_schedule="constant",
                   generator=torch.Generator().manual_seed(0), output_type="pt")
        assert out.images.shape == (1, 3, 64, 64) and out.stats["nfe"] < t.num_image_tokens, method
