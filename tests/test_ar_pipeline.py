"""SpeculativeARImagePipeline: diffusers conventions, every method, and bad input before any work.

Tiny random components built here (no assets, no network): a default TinyVQModel (16x16 grid of
512 codes), a one-layer LlamaGen target and draft, and an EAGLE head bound to the target.
"""

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec import methods
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.medusa import GridMedusaHeads
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline


COLOURS, SHAPES = ("red", "green", "blue", "yellow"), ("circle", "square", "triangle", "star")
ID2LABEL = {str(4 * i + j): f"a {c} {s}, {c} {s}" for i, c in enumerate(COLOURS) for j, s in enumerate(SHAPES)}
METHODS = methods.names("ar-image")


def _ar(seed, vq, id2label=None):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32,
                         n_layers=1, n_heads=2, mlp_hidden=64, initializer_range=0.3, id2label=id2label).eval()


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    target = _ar(1, vq, ID2LABEL)
    head = EagleDraftHead.from_target(target).eval()
    medusa = GridMedusaHeads.from_target(target, num_heads=3).eval()
    with torch.no_grad():  # random heads: zero-initialised ones would all propose the root's argmax
        for p in medusa.parameters():
            p.normal_(0, 0.3)
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq, draft_model=_ar(2, vq), eagle_head=head,
                                      medusa_head=medusa)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_makes_images(pipe, method):
    out = pipe(prompt=["a red circle", "Blue  Star"], method=method, generator=gen())
    assert len(out.images) == 2 and all(isinstance(im, PIL.Image.Image) and im.size == (64, 64) for im in out.images)
    assert out.tokens.shape == (2, 16, 16) and int(out.tokens.max()) < 512
    assert 1 <= out.stats["nfe"] <= 256
    if method != "none":
        assert out.stats["tau"] > 1.0  # every method emits more than one token per pass here


@pytest.mark.parametrize("method", ["sd", "eagle", "medusa", "sjd"])
def test_greedy_lossless_methods_equal_the_baseline(pipe, method):
    ref = pipe(class_labels=[3, 7], temperature=0.0, output_type="latent")
    knobs = {"sjd_init": "spatial"} if method == "sjd" else {}
    out = pipe(class_labels=[3, 7], method=method, method_knobs=knobs, temperature=0.0, output_type="latent")
    assert torch.equal(out.tokens, ref.tokens)


def test_lantern_without_relaxation_is_eagle(pipe):
    kw = dict(class_labels=[1, 2], output_type="latent")
    eagle = pipe(method="eagle", generator=gen(3), **kw)
    lantern = pipe(method="lantern", method_knobs={"lantern_delta": 0.0}, generator=gen(3), **kw)
    assert torch.equal(lantern.tokens, eagle.tokens)


def test_output_types_callback_and_tuple(pipe):
    calls = []
    out = pipe(class_labels=4, num_images_per_prompt=3, method="gsd", output_type="np", generator=gen(),
               callback_on_step_end=lambda p, i, t, kw: calls.append((i, t)) or {})
    assert isinstance(out.images, np.ndarray) and out.images.shape == (3, 64, 64, 3)
    assert 0.0 <= out.images.min() and out.images.max() <= 1.0
    assert [i for i, _ in calls] == list(range(out.stats["nfe"] - 1))  # one call per decode pass, from 0
    assert calls[-1][1] == 256
    images = pipe(class_labels=[0], output_type="pt", return_dict=False, generator=gen())
    assert isinstance(images, tuple) and len(images) == 1 and images[0].shape == (1, 3, 64, 64)


def test_round_trip_through_a_local_folder(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    assert (tmp_path / "model_index.json").is_file() and (tmp_path / "eagle_head").is_dir()
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert next(loaded.transformer.parameters()).dtype == torch.float32
    a = pipe(class_labels=[5], method="eagle", generator=gen(1), output_type="latent")
    b = loaded(class_labels=[5], method="eagle", generator=gen(1), output_type="latent")
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kwargs, match", [
    (dict(class_labels=[0], method="hydra"), "method"),
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
            pipe(**kwargs)
    finally:
        hook.remove()
    assert calls == []


def test_prompts_map_through_the_saved_id2label(pipe):
    assert pipe.get_label_ids(["a red circle", "Red  Circle", " BLUE star ", "yellow star"]) == [0, 0, 11, 15]
    assert pipe.labels["green square"] == 5 and pipe.labels["a green square"] == 5 and len(pipe.labels) == 32
    with pytest.raises(ValueError, match="label must be one of the class prompts: a red circle, a red square"):
        pipe.get_label_ids("a purple hexagon")
    a = pipe(prompt=["a blue star", "Green Circle"], temperature=0.0, output_type="latent")
    b = pipe(class_labels=[11, 4], temperature=0.0, output_type="latent")
    assert torch.equal(a.tokens, b.tokens)


def test_a_transformer_without_labels_takes_class_labels_only(pipe):
    bare = SpeculativeARImagePipeline(transformer=_ar(1, pipe.vqvae), vqvae=pipe.vqvae)
    with pytest.raises(ValueError, match="prompt must be class_labels: this transformer's config has no id2label"):
        bare(prompt="a red circle")
    assert bare.labels == {}
