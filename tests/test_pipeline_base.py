"""The diffusers contract of ``pipelines.base.SpeculativePipeline``, held by both pipelines.

AR: tiny random components built here (a default TinyVQModel, one-layer LlamaGen target and
draft, an EAGLE head). VLM: the bundled tiny VLM (assets/vlm). No network.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from mmspec.core import LogitsProcessor, NullDrafter, SpeculativeDecoder
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativePipeline, SpeculativeVLMPipeline

ROOT = Path(__file__).resolve().parents[1]
N = 256  # tokens per image (16 x 16 grid)


def _ar(seed, vq):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32,
                         n_layers=1, n_heads=2, mlp_hidden=64, initializer_range=0.3,
                         id2label={str(i): f"class {i}" for i in range(16)}).eval()


@pytest.fixture(scope="module")
def ar():
    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    target = _ar(1, vq)
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq, draft_model=_ar(2, vq),
                                      eagle_head=EagleDraftHead.from_target(target).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def vlm():
    pipe = SpeculativeVLMPipeline.from_pretrained(ROOT / "assets" / "vlm")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def image():
    return np.full((32, 32, 3), 0.5, dtype=np.float32)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _modules(pipe):
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


class _Forwards:
    """Records the forward calls of every module inside every component of a pipeline (so a
    ``vqvae.decode`` counts through its layers)."""

    def __init__(self, pipe):
        self.calls = []
        self.hooks = [m.register_forward_pre_hook(lambda *a, n=name: self.calls.append(n))
                      for name, component in _modules(pipe).items() for m in component.modules()]

    def __enter__(self):
        return self.calls

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


# -- check_inputs before any model runs -------------------------------------------------------------

AR_BAD = [
    (dict(class_labels=[0], method="hydra"), "method must be one of the ar-image methods"),
    (dict(class_labels=[0, 1], generator=[gen(), gen(), gen()]), "generator must be a torch.Generator, None, or a list of 2"),
    (dict(class_labels=[0], num_images_per_prompt=2, generator=[gen()]), "a list of 2 torch.Generators"),
    (dict(class_labels=[0], generator=7), "generator must be a torch.Generator or None"),
    (dict(class_labels=[0], callback_on_step_end_tensor_inputs=["latents"]),
     "callback_on_step_end_tensor_inputs must be a list of names among ['tokens', 'next_tokens']"),
    (dict(class_labels=[0], method="zipar", callback_on_step_end_tensor_inputs=["tokens"]),
     "callback_on_step_end_tensor_inputs must be [] with method 'zipar'"),
    (dict(class_labels=[0], return_dict=1), "return_dict must be True or False"),
    (dict(class_labels=[0], output_type="jpeg"), "output_type must be one of"),
    (dict(prompt="class 99"), "prompt must be one of the class prompts: class 0, class 1"),
]


@pytest.mark.parametrize("kwargs, message", AR_BAD)
def test_ar_bad_input_runs_no_component(ar, kwargs, message):
    with _Forwards(ar) as calls, pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ar(**kwargs)
    assert calls == [] and set(_modules(ar)) == {"transformer", "vqvae", "draft_model", "eagle_head"}


def test_the_forward_counter_counts(ar):
    with _Forwards(ar) as calls:
        ar(class_labels=[0], method="eagle", generator=gen())
    assert {"transformer", "eagle_head", "vqvae"} <= set(calls)


@pytest.mark.parametrize("method, missing", [("sd", "draft_model"), ("eagle", "eagle_head"),
                                             ("lantern", "eagle_head")])
def test_a_method_whose_component_is_missing_is_refused_in_check_inputs(ar, method, missing):
    bare = SpeculativeARImagePipeline(transformer=ar.transformer, vqvae=ar.vqvae)
    with _Forwards(bare) as calls, pytest.raises(
            ValueError, match=f"method must be a method whose parts this pipeline holds \\(it has no {missing}\\)"):
        bare(class_labels=[0], method=method)
    assert calls == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="vispec", method_knobs={"tree_depth": 0}), "tree_depth"),
    (dict(generator=[gen(), gen()]), "generator must be a torch.Generator, None, or a list of 1"),
    (dict(callback_on_step_end_tensor_inputs=["latents"]), "callback_on_step_end_tensor_inputs"),
    (dict(callback_on_step_end=print, return_dict="yes"), "return_dict"),
])
def test_vlm_bad_input_runs_no_component(vlm, image, kwargs, message):
    with _Forwards(vlm) as calls, pytest.raises(ValueError, match=message):
        vlm(images=[image], prompts=["what is in the image ?"], max_new_tokens=4, **kwargs)
    assert calls == []


def test_vlm_method_without_its_head_is_refused(vlm, image):
    bare = SpeculativeVLMPipeline(target=vlm.target, processor=vlm.processor)
    with pytest.raises(ValueError, match=r"it has no vispec_head"):
        bare(images=[image], prompts=["what ?"], method="vispec")
    with pytest.raises(ValueError, match=r"it has no draft_model"):
        bare(images=[image], prompts=["what ?"], method="sd")


# -- callbacks ---------------------------------------------------------------------------------------

def test_callback_signature_and_tensor_inputs(ar):
    seen = []

    def callback(pipe, step, timestep, kwargs):
        seen.append((pipe, step, timestep, kwargs["tokens"].clone(), kwargs["next_tokens"].clone()))
        return {}

    out = ar(class_labels=[3, 4], temperature=0.0, output_type="latent", callback_on_step_end=callback,
             callback_on_step_end_tensor_inputs=["tokens", "next_tokens"])
    flat = out.tokens.flatten(1)  # (2, N)
    assert len(seen) == out.stats["nfe"] - 1 == N - 1 and all(s[0] is ar for s in seen)
    for i, (_, step, timestep, tokens, next_tokens) in enumerate(seen):
        # the prefill's token, then one per pass (method "none")
        assert step == i and timestep == i + 2 and tokens.shape == (2, i + 2)
        assert torch.equal(tokens, flat[:, : i + 2]) and torch.equal(next_tokens, tokens[:, -1])


def test_tokens_of_rows_that_accept_different_lengths(ar):
    seen = []
    out = ar(class_labels=[3, 4], method="sd", generator=gen(), output_type="latent",
             callback_on_step_end=lambda p, i, t, kw: seen.append((t, kw["tokens"].clone())) or {},
             callback_on_step_end_tensor_inputs=["tokens"])
    flat = out.tokens.flatten(1)
    widths = [tokens.shape[1] for _, tokens in seen]
    assert widths == sorted(widths) and widths[-1] == N and torch.equal(seen[-1][1], flat)
    for timestep, tokens in seen:  # the longer row is a prefix of the output; timestep = mean length
        assert timestep <= tokens.shape[1] and any(torch.equal(tokens[r], flat[r, : tokens.shape[1]]) for r in (0, 1))


def test_a_returned_next_tokens_takes_effect(ar):
    """The replaced token is in the output and the target continues from it: the rest equals a
    greedy decode of the prompt [class, t0, v] (computed with the core directly)."""
    base = ar(class_labels=[6], temperature=0.0, guidance_scale=None, output_type="latent").tokens.flatten()
    V = ar.transformer.vocab_size
    forced = (base[1] + 17) % V

    def force(pipe, step, timestep, kwargs):
        return {"next_tokens": torch.full_like(kwargs["next_tokens"], int(forced))} if step == 0 else {}

    out = ar(class_labels=[6], temperature=0.0, guidance_scale=None, output_type="latent", callback_on_step_end=force,
             callback_on_step_end_tensor_inputs=["next_tokens"]).tokens.flatten()
    assert out[0] == base[0] and out[1] == forced
    ref = SpeculativeDecoder(ar.transformer, NullDrafter(), processor=LogitsProcessor(temperature=0.0)).generate(
        [[6, int(base[0]), int(forced)]], N - 2).sequences[0]
    assert torch.equal(out[2:], ref)
    assert not torch.equal(out[2:], base[2:])  # the replacement mattered


@pytest.mark.parametrize("returned, message", [
    (None, "callback_on_step_end must be a callable returning a dict"),
    ({"tokens": torch.zeros(1, 1)}, "callback_on_step_end must be a callable returning only requested tensor inputs"),
    ({"next_tokens": torch.tensor([1.5])}, "next_tokens must be a \\(1,\\) integer tensor"),
    ({"next_tokens": torch.tensor([10**6])}, "next_tokens must be a \\(1,\\) integer tensor of token ids in \\[0, 512\\)"),
])
def test_a_bad_callback_return_is_refused(ar, returned, message):
    with pytest.raises(ValueError, match=message):
        ar(class_labels=[0], output_type="latent", callback_on_step_end=lambda *a: returned,
           callback_on_step_end_tensor_inputs=["tokens", "next_tokens"])


@pytest.mark.parametrize("method", ["none", "sjd", "zipar"])
def test_interrupt_stops_after_the_current_pass(ar, method):
    steps = []

    def stop_at_3(pipe, step, timestep, kwargs):
        steps.append(step)
        if step == 2:
            pipe._interrupt = True
        return {}

    out = ar(class_labels=[1], method=method, generator=gen(), output_type="latent", callback_on_step_end=stop_at_3)
    assert steps == [0, 1, 2] and out.stats["nfe"] == 4 and ar.interrupt  # the prefill and three passes
    full = ar(class_labels=[1], method=method, generator=gen(), output_type="latent")
    assert not ar.interrupt and full.stats["nfe"] > 4  # every call starts uninterrupted


def test_vlm_interrupt_and_callback(vlm, image):
    seen = []

    def callback(pipe, step, timestep, kwargs):
        seen.append((step, timestep, kwargs["tokens"].shape))
        pipe._interrupt = step == 1
        return {}

    out = vlm(images=[image], prompts=["describe the image in detail ."], max_new_tokens=64, method="eagle",
              callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["tokens"])
    assert [s[0] for s in seen] == [0, 1] and out.stats["nfe"] == 3
    assert len(out.tokens[0]) == seen[-1][1] == seen[-1][2][1] < 64


# -- outputs -----------------------------------------------------------------------------------------

def test_return_dict_false_is_a_one_tuple(ar, vlm, image):
    images = ar(class_labels=[2], generator=gen(), return_dict=False)
    assert isinstance(images, tuple) and len(images) == 1 and isinstance(images[0][0], PIL.Image.Image)
    texts = vlm(images=[image], prompts=["what ?"], max_new_tokens=4, return_dict=False)
    assert isinstance(texts, tuple) and len(texts) == 1 and isinstance(texts[0][0], str)


def test_output_types_go_through_the_vae_image_processor(ar):
    kw = dict(class_labels=[5, 9], generator=None, temperature=0.0)
    latent = ar(output_type="latent", **kw).images
    with torch.no_grad():
        pixels = ar.vqvae.decode(latent)
    processor = VaeImageProcessor(do_resize=False)
    pt, np_, pil = (ar(output_type=t, **kw).images for t in ("pt", "np", "pil"))
    assert torch.equal(pt, processor.postprocess(pixels, output_type="pt"))
    assert np.array_equal(np_, processor.postprocess(pixels, output_type="np"))
    assert np.array_equal(np.stack([np.asarray(im) for im in pil]), (np_ * 255).round().astype(np.uint8))
    assert pt.shape == (2, 3, 64, 64) and 0 <= pt.min() and pt.max() <= 1 and latent.shape == (2, 16, 16)


def test_maybe_free_model_hooks_ends_every_call(ar, vlm, image, monkeypatch):
    calls = []
    monkeypatch.setattr(SpeculativePipeline, "maybe_free_model_hooks", lambda self: calls.append(type(self)))
    ar(class_labels=[0], output_type="latent", generator=gen())
    vlm(images=[image], prompts=["what ?"], max_new_tokens=2)
    assert calls == [SpeculativeARImagePipeline, SpeculativeVLMPipeline]


@pytest.mark.parametrize("fixture", ["ar", "vlm"])
def test_offload_sequence_chains_the_target_then_its_output_model(request, fixture):
    # drafts and heads run between the target's passes: chained, their hooks would offload it every
    # pass; onload_models relies on the target leading the chain (tests/test_offload.py runs it)
    pipe = request.getfixturevalue(fixture)
    seq = pipe.model_cpu_offload_seq.split("->")
    assert seq[0] == pipe._method_components.get("target", "target") and len(seq) == len(set(seq))
    assert set(seq) <= set(_modules(pipe)) and not set(seq) & set(pipe._optional_components)


# -- generator lists and num_images_per_prompt ------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "sd", "sjd"])
def test_generator_list_row_r_equals_row_r_alone(ar, method):
    batch = ar(class_labels=[3, 8], num_images_per_prompt=2, method=method, output_type="latent",
               generator=[gen(10), gen(11), gen(12), gen(13)]).tokens
    assert batch.shape == (4, 16, 16)
    for r, (label, seed) in enumerate(zip([3, 3, 8, 8], [10, 11, 12, 13])):
        alone = ar(class_labels=[label], method=method, output_type="latent", generator=gen(seed)).tokens
        assert torch.equal(batch[r], alone[0]), r
    assert not torch.equal(batch[0], batch[1])  # two images of one prompt differ


def test_vlm_generator_list(vlm, image):
    other = np.full((32, 32, 3), 0.2, dtype=np.float32)
    kw = dict(prompts=["describe the image in detail ."] * 2, max_new_tokens=12, temperature=1.0, method="eagle")
    batch = vlm(images=[image, other], generator=[gen(1), gen(2)], **kw).tokens
    for r, (im, seed) in enumerate(((image, 1), (other, 2))):
        alone = vlm(images=[im], prompts=[kw["prompts"][r]], max_new_tokens=12, temperature=1.0, method="eagle",
                    generator=gen(seed)).tokens
        assert batch[r] == alone[0]


# -- progress ----------------------------------------------------------------------------------------

def test_progress_bar_follows_set_progress_bar_config(ar, capsys):
    ar.set_progress_bar_config(disable=False)
    try:
        ar(class_labels=[0], output_type="latent", generator=gen(), method="sjd")
        shown = capsys.readouterr().err
        assert f"{N}/{N}" in shown
        ar.set_progress_bar_config(disable=True)
        ar(class_labels=[0], output_type="latent", generator=gen())
        assert capsys.readouterr().err == ""
    finally:
        ar.set_progress_bar_config(disable=True)


# -- the import rules: runtime never imports training or the benches ---------------------------------

RUNTIME = [ROOT / "pipelines", ROOT / "kernels"] + [ROOT / "mmspec" / d for d in (
    "adapters", "core", "models", "serve", "methods")]
"""What generation runs on: the pipelines, kernels, adapters, core, models, the serving runners and
the method registry. Labels, vocabularies, chat templates and demo inputs live in the saved
artifacts (assets/), so none of these imports training code or a bench."""
RULES = [(RUNTIME, ("mmspec.training", "mmspec.bench"), ()),
         ([ROOT / "mmspec" / "training"], ("mmspec.bench",), ()),
         ([ROOT / "mmspec" / "eval"], ("mmspec.bench", "mmspec.training"), ("mmspec.training.data",))]
"""(folders, packages their modules must not import, the exceptions). The metrics and judges
(``mmspec.eval``) import no bench and no training code, only the data definitions they judge
against (``mmspec.training.data``: the palette and prompt vocabulary of the rendered videos)."""


def _package(path: Path) -> str:
    parts = path.parent.relative_to(ROOT).parts
    return ".".join(("mmspec",) + parts if parts[0] in ("pipelines", "kernels") else parts)  # mmspec.pipelines


def _imports_of(source: str, package: str, banned, allowed=()) -> list[str]:
    """Imports of the packages ``banned`` (or their modules) but not of ``allowed`` in a module of
    ``package``, absolute or relative, at any depth (``ast.walk``: imports inside functions count)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        under = lambda n, pkgs: any(n == p or n.startswith(p + ".") for p in pkgs)  # noqa: E731
        bad += [n for n in names if under(n, banned) and not under(n, allowed)]
    return bad


def _training_imports(source: str, package: str) -> list[str]:
    """Imports of ``mmspec.training`` in a module of ``package`` (absolute or relative)."""
    return _imports_of(source, package, ("mmspec.training",))


def _offenders(folders, banned, allowed=()) -> dict[str, list[str]]:
    files = [f for d in folders for f in d.rglob("*.py")]
    assert len(files) >= 3, folders
    out = {}
    for f in files:
        found = _imports_of(f.read_text(), _package(f), banned, allowed)
        if found:
            out[str(f.relative_to(ROOT))] = found
    return out


@pytest.mark.parametrize("rule", range(len(RULES)), ids=["runtime", "training", "eval"])
def test_import_rules_hold(rule):
    """Runtime imports neither training nor the benches; training imports no bench; the metrics
    import no bench and no training code but its data definitions."""
    assert len([f for d in RUNTIME for f in d.rglob("*.py")]) > 20
    assert _offenders(*RULES[rule]) == {}


def test_the_import_walker_finds_training_imports():
    assert _package(ROOT / "pipelines" / "ar_image.py") == "mmspec.pipelines"
    assert _package(ROOT / "kernels" / "splitk.py") == "mmspec.kernels"
    assert _package(ROOT / "mmspec" / "models" / "vlm.py") == "mmspec.models"
    assert _package(ROOT / "mmspec" / "training" / "recipes" / "classifier.py") == "mmspec.training.recipes"
    assert _training_imports("from ..training.data.shapes import CLASS_NAMES", "mmspec.pipelines")[0] == \
        "mmspec.training.data.shapes"
    assert _training_imports("from .. import training", "mmspec.core") == ["mmspec.training"]
    assert _training_imports("import mmspec.training.data as d", "mmspec.core") == ["mmspec.training.data"]
    assert _training_imports("from .data import x", "mmspec.training") != []
    assert _training_imports("from ..core import check\nimport mmspec.trainingless", "mmspec.models") == []


def test_the_import_walker_catches_the_old_offending_imports():
    """The imports the split of the bench removed (issue 48), each caught by its rule, inside a
    function as at module level."""
    runtime, training, metrics = ((banned, allowed) for _, banned, allowed in RULES)
    old = [("def scene(i):\n    from ..bench.vlm import bench_prompts\n", "mmspec.serve", runtime,
            ["mmspec.bench.vlm", "mmspec.bench.vlm.bench_prompts"]),
           ("def ar_prompts():\n    from ..training.data.shapes import CLASS_PROMPTS\n", "mmspec.serve", runtime,
            ["mmspec.training.data.shapes", "mmspec.training.data.shapes.CLASS_PROMPTS"]),
           ("def train(out, **kw):\n    from ..training.recipes import train_ar_draft\n", "mmspec.methods", runtime,
            ["mmspec.training.recipes", "mmspec.training.recipes.train_ar_draft"]),
           ("from ...bench.quality import class_accuracy, reconstruct\n", "mmspec.training.recipes", training,
            ["mmspec.bench.quality", "mmspec.bench.quality.class_accuracy", "mmspec.bench.quality.reconstruct"]),
           ("def f():\n    from ...bench.quality import class_accuracy\n", "mmspec.training.recipes", training,
            ["mmspec.bench.quality", "mmspec.bench.quality.class_accuracy"]),
           ("from .. import bench\n", "mmspec.pipelines", runtime, ["mmspec.bench"]),
           ("import mmspec.bench.stats\n", "mmspec.kernels", runtime, ["mmspec.bench.stats"]),
           ("from ..training.recipes.video import VIDEO_DATA_STYLE\n", "mmspec.eval", metrics,
            ["mmspec.training.recipes.video", "mmspec.training.recipes.video.VIDEO_DATA_STYLE"]),
           ("from ..bench.video.config import VideoBenchConfig\n", "mmspec.eval", metrics,
            ["mmspec.bench.video.config", "mmspec.bench.video.config.VideoBenchConfig"]),
           ("from .. import training\n", "mmspec.eval", metrics, ["mmspec.training"])]
    for source, package, rule, found in old:
        assert _imports_of(source, package, *rule) == found, source
    # what the split put in their place passes
    assert _imports_of("from ..eval.quality import class_accuracy\n", "mmspec.training.recipes", *training) == []
    assert _imports_of("from .base import ASSETS\n", "mmspec.serve", *runtime) == []
    assert _imports_of("from ..training.data.video import frame_colour\n", "mmspec.eval", *metrics) == []
    assert _imports_of("import mmspec.benchmarks\n", "mmspec.core", *runtime) == []
