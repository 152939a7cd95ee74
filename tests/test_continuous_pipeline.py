"""SpeculativeContinuousARPipeline on tiny random-init components built in code (no assets).

Batch rows vs single rows: with a generator list, image r of a batch equals that class generated
alone with generator r to float rounding (atol 1e-4), not bit for bit: the batched backbone's
matrix products may round differently, and a rounding difference can move a later accept test."""

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec.models.continuous import ContinuousARModel
from mmspec.models.continuous_tokenizer import PatchPCATokenizer
from mmspec.pipelines import ContinuousARPipelineOutput, SpeculativeContinuousARPipeline

NAMES = {"0": "a red circle, red circle", "1": "a blue square, blue square", "2": "a green star"}
TIMESTEPS = [50, 300, 600]  # a short chain (the spec's toy starts low, so the path rule can accept)


def tiny_model(seed: int, dim: int = 16, layers: int = 1) -> ContinuousARModel:
    torch.manual_seed(seed)
    model = ContinuousARModel(token_dim=3, grid_size=4, num_classes=3, dim=dim, n_layers=layers, n_heads=2,
                              mlp_hidden=32, mixture_components=2, mixture_hidden=16, diffusion_width=16,
                              diffusion_blocks=1, diffusion_timesteps=TIMESTEPS, id2label=NAMES).eval()
    with torch.no_grad():  # the diffusion head's zero-initialised output layers would make every head agree
        for p in model.heads["diffusion"].parameters():
            p.add_(0.05 * torch.randn(p.shape))
    return model


def tiny_pipeline() -> SpeculativeContinuousARPipeline:
    torch.manual_seed(0)
    tokenizer = PatchPCATokenizer(sample_size=16, patch_size=4, latent_dim=3).fit(torch.rand(8, 3, 16, 16) * 2 - 1)
    pipe = SpeculativeContinuousARPipeline(tokenizer=tokenizer, transformer=tiny_model(1, 24, 2),
                                           draft_model=tiny_model(2))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_output_types_and_stats(pipe):
    out = pipe(prompt="a red circle", method="sd", generator=gen(0))
    assert isinstance(out, ContinuousARPipelineOutput)
    assert isinstance(out.images[0], PIL.Image.Image) and out.images[0].size == (16, 16)
    assert out.latents.shape == (1, 16, 3)
    for key in ("nfe", "draft_nfe", "tau", "alpha", "target_head_calls", "draft_head_rows", "residual_tries",
                "residual_fallbacks"):
        assert key in out.stats
    assert out.stats["residual_fallbacks"] == 0
    assert out.stats["nfe"] < 16 + 1  # target passes: at most one per token plus the prefill
    path = pipe(class_labels=[0, 1, 2, 0], method="path", generator=gen(0), output_type="latent").stats
    assert 0 < path["alpha"] < 1 and path["residual_rows"] > 0  # the tiny heads differ: accepts and rejections
    arr = pipe(class_labels=0, method="sd", generator=gen(0), output_type="np").images
    assert isinstance(arr, np.ndarray) and arr.shape == (1, 16, 16, 3) and 0 <= arr.min() and arr.max() <= 1
    pt = pipe(class_labels=0, method="sd", generator=gen(0), output_type="pt").images
    assert pt.shape == (1, 3, 16, 16)
    assert np.allclose(pt.permute(0, 2, 3, 1).numpy(), arr, atol=1e-6)  # the same image, other containers
    lat = pipe(class_labels=0, method="sd", generator=gen(0), output_type="latent").images
    assert torch.equal(lat, out.latents)  # "a red circle" is class 0
    (images,) = pipe(class_labels=[1, 2], generator=gen(0), return_dict=False)
    assert len(images) == 2


@pytest.mark.parametrize("method", ["none", "sd", "sd-warmup", "path", "cspd", "none-diffusion"])
def test_reproducible_with_a_fixed_generator(pipe, method):
    a = pipe(class_labels=[0, 2], method=method, generator=gen(3), output_type="latent")
    b = pipe(class_labels=[0, 2], method=method, generator=gen(3), output_type="latent")
    assert torch.equal(a.latents, b.latents) and a.stats["nfe"] == b.stats["nfe"]
    c = pipe(class_labels=[0, 2], method=method, generator=gen(4), output_type="latent")
    assert not torch.equal(a.latents, c.latents)


@pytest.mark.parametrize("method", ["none", "sd", "path"])
def test_batch_rows_equal_single_rows(pipe, method):
    classes = [0, 1, 2, 0]
    batch = pipe(class_labels=classes, method=method, generator=[gen(10 + i) for i in range(4)], output_type="latent")
    for i, c in enumerate(classes):
        one = pipe(class_labels=c, method=method, generator=gen(10 + i), output_type="latent")
        torch.testing.assert_close(batch.latents[i], one.latents[0], atol=1e-4, rtol=0)


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = SpeculativeContinuousARPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    a = pipe(class_labels=1, method="sd", generator=gen(5), output_type="latent")
    b = loaded(class_labels=1, method="sd", generator=gen(5), output_type="latent")
    assert torch.equal(a.latents, b.latents)
    assert loaded.labels == pipe.labels and loaded.labels["blue square"] == 1
    torch.testing.assert_close(loaded.tokenizer.basis, pipe.tokenizer.basis)


def test_callback_sees_growing_latents_and_can_interrupt(pipe):
    seen = []

    def callback(p, step, timestep, kwargs):
        seen.append((step, timestep, kwargs["latents"].shape[1]))
        if step == 1:
            p._interrupt = True
        return {}

    out = pipe(class_labels=0, method="none", generator=gen(0), output_type="latent", callback_on_step_end=callback,
               callback_on_step_end_tensor_inputs=["latents"])
    assert [s for s, _, _ in seen] == [0, 1]
    (_, t0, n0), (_, t1, n1) = seen
    assert n0 == t0 and n1 == t1 == t0 + 1  # 'none' decodes one token per pass (the prefill's first)
    assert (out.latents[0, n1:] == 0).all() and (out.latents[0, :n1] != 0).all(-1).all()

    with pytest.raises(ValueError, match="latents must be a finite float tensor"):  # edits: tests/test_callbacks.py
        pipe(class_labels=0, generator=gen(0), callback_on_step_end=lambda *a: {"latents": None},
             callback_on_step_end_tensor_inputs=["latents"])


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "a purple moon"}, "prompt must be one of the class prompts"),
    ({"prompt": "a red circle", "class_labels": 0}, "prompt must be exactly one of prompt and class_labels"),
    ({"class_labels": 3}, "class_labels must be an int in \\[0, 3\\)"),
    ({"class_labels": 0, "method": "gsd"}, "method must be one of"),
    ({"class_labels": 0, "method": "sd", "method_knobs": {"sd_gamma": 0}}, "sd_gamma must be"),
    ({"class_labels": 0, "temperature": 0}, "temperature must be a number > 0"),
    ({"class_labels": 0, "guidance_scale": -1.0}, "guidance_scale must be None or a number >= 0"),
    ({"class_labels": 0, "guidance_schedule": "cosine"}, "guidance_schedule must be one of 'constant', 'linear'"),
    ({"class_labels": 0, "output_type": "jpeg"}, "output_type must be one of"),
    ({"class_labels": [0, 1], "generator": [torch.Generator()]}, "generator must be"),
    ({"class_labels": 0, "generator": 7}, "generator must be"),
    ({"class_labels": 0, "callback_on_step_end_tensor_inputs": ["tokens"]}, "callback_on_step_end_tensor_inputs"),
    ({"class_labels": 0, "residual_max_tries": 0}, "residual_max_tries must be None \\(no cap\\) or an int >= 1"),
])
def test_bad_input_refused_before_any_model_runs(kwargs, message):
    pipe = tiny_pipeline()
    calls = []
    for module in (pipe.transformer, pipe.draft_model, pipe.tokenizer):
        module.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=message):
        pipe(**kwargs)
    assert calls == []


def test_method_needing_a_draft_refused_without_one():
    pipe = tiny_pipeline()
    pipe.register_modules(draft_model=None)
    with pytest.raises(ValueError, match="method must be a method whose parts this pipeline holds"):
        pipe(class_labels=0, method="sd")
    assert pipe(class_labels=0, method="none", generator=gen(0), output_type="latent").latents.shape == (1, 16, 3)


def test_cli_generate_continuous(tmp_path, capsys):
    from mmspec import commands

    tiny_pipeline().save_pretrained(tmp_path / "pipe")
    code = commands.main(["generate", "continuous", "--method", "sd", "--prompt", "a red circle", "--out",
                          str(tmp_path / "out"), "--model", str(tmp_path / "pipe"), "--quiet"])
    assert code == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["a_red_circle-sd-0.png"]
    assert PIL.Image.open(tmp_path / "out" / "a_red_circle-sd-0.png").size == (16, 16)
    assert "method sd" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:  # refused before any model loads
        commands.main(["generate", "continuous", "--method", "gsd", "--prompt", "a red circle", "--out",
                       str(tmp_path / "out"), "--model", str(tmp_path / "pipe")])
    assert err.value.code == 2 and "method must be one of the continuous methods" in capsys.readouterr().err
