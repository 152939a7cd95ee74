"""SpeculativeARImagePipeline: diffusers conventions, every method, and bad input before any work.

Tiny random components built here (no assets, no network): a default TinyVQModel (16x16 grid of
512 codes), a one-layer LlamaGen target and draft, and an EAGLE head bound to the target.
"""

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec.adapters.ar_image import METHODS, method_knobs, parse_method
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline


def _ar(seed, vq):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32,
                         n_layers=1, n_heads=2, mlp_hidden=64, initializer_range=0.3).eval()


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    target = _ar(1, vq)
    head = EagleDraftHead.from_target(target).eval()
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq, draft_model=_ar(2, vq), eagle_head=head)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_makes_images(pipe, method):
    out = pipe(prompt=["a red circle", "Blue  Star"], method=method, generator=gen(), show_progress=False)
    assert len(out.images) == 2 and all(isinstance(im, PIL.Image.Image) and im.size == (64, 64) for im in out.images)
    assert out.tokens.shape == (2, 16, 16) and int(out.tokens.max()) < 512
    assert 1 <= out.stats["nfe"] <= 256
    if method != "none":
        assert out.stats["tau"] > 1.0  # every method emits more than one token per pass here


@pytest.mark.parametrize("method", ["sd", "eagle", "sjd"])
def test_greedy_lossless_methods_equal_the_baseline(pipe, method):
    ref = pipe(class_labels=[3, 7], temperature=0.0, output_type="latent", show_progress=False)
    knobs = {"sjd_init": "spatial"} if method == "sjd" else {}
    out = pipe(class_labels=[3, 7], method=method, method_knobs=knobs, temperature=0.0, output_type="latent",
               show_progress=False)
    assert torch.equal(out.tokens, ref.tokens)


def test_lantern_without_relaxation_is_eagle(pipe):
    kw = dict(class_labels=[1, 2], output_type="latent", show_progress=False)
    eagle = pipe(method="eagle", generator=gen(3), **kw)
    lantern = pipe(method="lantern", method_knobs={"lantern_delta": 0.0}, generator=gen(3), **kw)
    assert torch.equal(lantern.tokens, eagle.tokens)


def test_output_types_callback_and_tuple(pipe):
    calls = []
    out = pipe(class_labels=4, num_images_per_prompt=3, method="gsd", output_type="np", generator=gen(),
               callback_on_step_end=lambda p, i, t, kw: calls.append((i, kw["tokens_done"])) or {},
               show_progress=False)
    assert isinstance(out.images, np.ndarray) and out.images.shape == (3, 64, 64, 3)
    assert 0.0 <= out.images.min() and out.images.max() <= 1.0
    assert len(calls) == out.stats["nfe"] - 1 and calls[-1][1] == 256  # one call per decode pass
    images, stats = pipe(class_labels=[0], output_type="pt", return_dict=False, generator=gen(), show_progress=False)
    assert images.shape == (1, 3, 64, 64) and stats["nfe"] == 256  # the prefill samples the first token


def test_round_trip_through_a_local_folder(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    assert (tmp_path / "model_index.json").is_file() and (tmp_path / "eagle_head").is_dir()
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert next(loaded.transformer.parameters()).dtype == torch.float32
    a = pipe(class_labels=[5], method="eagle", generator=gen(1), output_type="latent", show_progress=False)
    b = loaded(class_labels=[5], method="eagle", generator=gen(1), output_type="latent", show_progress=False)
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kwargs, match", [
    (dict(class_labels=[0], method="medusa"), "method"),
    (dict(class_labels=[0], method="gsd+lantern"), "method"),
    (dict(class_labels=[0], method="zipar+eagle"), "method"),
    (dict(class_labels=[0], method="sjd", method_knobs={"sjd_window": 1}), "sjd_window"),
    (dict(class_labels=[0], method="sjd", method_knobs={"gsd_p_threshold": 0.1}), "method knobs"),
    (dict(class_labels=[0], method="zipar", method_knobs={"zipar_window": 17}), "zipar_window"),
    (dict(class_labels=[0], method="lantern", method_knobs={"lantern_delta": 2.0}), "delta"),
    (dict(prompt="a purple hexagon"), "prompt"),
    (dict(class_labels=[16]), "class_labels"),
    (dict(prompt="a red circle", class_labels=[0]), "prompt"),
    (dict(class_labels=[0], output_type="jpeg"), "output_type"),
    (dict(class_labels=[0], num_images_per_prompt=0), "num_images_per_prompt"),
    (dict(class_labels=[0], temperature=-1.0), "temperature"),
])
def test_bad_input_fails_before_any_work(pipe, kwargs, match):
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            pipe(show_progress=False, **kwargs)
    finally:
        hook.remove()
    assert calls == []


def test_method_grammar():
    assert parse_method("gsd").drafter == "sjd" and parse_method("lantern").drafter == "eagle"
    assert parse_method("zipar+gsd").components == ("zipar", "sjd", "gsd")
    assert parse_method("sjd").lossless and not parse_method("zipar").lossless
    assert set(method_knobs("zipar+gsd")) == {"zipar_window", "sjd_window", "sjd_init", "gsd_p_threshold",
                                              "gsd_d_threshold", "gsd_half_width"}
