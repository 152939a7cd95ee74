"""Compiled decoding steps (issue 42, item 4): ``pipe.enable_compiled_steps()`` compiles the target's
and every draft's forward with ``torch.compile(fullgraph=True, dynamic=False)`` and decodes with
static shapes, so each (batch, block width) bucket is one graph, compiled once.

Checked on the CPU with dynamo's counters (``torch._dynamo.utils.counters``): after one warm-up
call, further calls (at least 100 decode passes in all, on the pooled caches) compile nothing new
(no ``unique_graphs``) and break no graph (``fullgraph=True`` would raise on one), for every
registered ar-image method on a tiny random LlamaGen pipeline, for the bundled AR target
(``eagle``: target, head, tree), and for continuous tokens (``none``, ``sd``, ``sjd``). Outputs
are bit-identical to the eager forwards with the same static shapes, sampled with the same
generator (greedy on the bundled target), since the ``eager`` backend runs the traced aten ops as
they are; Inductor's code (``slow``) is checked for greedy identity with the CPU's eager widths on
``sd`` (target and draft model).
The VLM pipeline compiles its transformers language models (target and draft VLM: every pass but
the prompt's, whose shape is the call's) and its heads (all but a head's first, planned feed),
checked the same way for every registered vlm method on a tiny random LLaVA, for the bundled VLM
(``eagle``) and for a tiny random Qwen2-VL (M-RoPE; ``none`` and ``lookup``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from contract_util import VLM_QUESTION, tiny_ar_pipeline, tiny_vlm_pipeline
from mmspec import methods
from mmspec.core.shapes import forced_static_shapes

ASSETS = Path(__file__).resolve().parents[1] / "assets"
MIN_PASSES = 100


def _ar_call(pipe, method, temperature):
    knobs = {"zipar_window": 2} if "zipar" in method else None
    return lambda: pipe(class_labels=[1, 2], method=method, temperature=temperature, guidance_scale=2.0,
                        output_type="latent", method_knobs=knobs, generator=torch.Generator().manual_seed(0)).tokens


def _no_new_graphs(pipe, call, backend="eager"):
    """(eager output, compiled output, passes after the warm-up, dynamo's counters after it)."""
    pipe.disable_compiled_steps()
    with forced_static_shapes():
        eager = call()
    pipe.enable_compiled_steps(backend=backend)
    try:
        call()  # warm-up: compiles every bucket this call meets
        counters.clear()
        passes, out = 0, None
        while passes < MIN_PASSES:
            got = call()
            out = got if out is None else out
            assert torch.equal(got, out)  # calls agree with each other
            passes += pipe._last_nfe
        seen = {k: dict(v) for k, v in counters.items() if v}
    finally:
        pipe.disable_compiled_steps()
    return eager, out, passes, seen


@pytest.fixture(scope="module")
def tiny_ar():
    pipe = tiny_ar_pipeline(grid_size=10)
    _count_passes(pipe)
    return pipe


def _count_passes(pipe):
    """Keep the target passes of the pipeline's last decode in ``pipe._last_nfe``."""
    decode = pipe.decode

    def counting(*args, **kwargs):
        out = decode(*args, **kwargs)
        pipe._last_nfe = out.stats.target_forwards
        return out

    pipe.decode = counting


@pytest.mark.parametrize("method", methods.names("ar-image"))
def test_ar_steps_compile_once(tiny_ar, method):
    """Sampled (temperature 1, a seeded generator): the compiled region is the models' forwards,
    whose shapes greedy decoding shares."""
    eager, compiled, passes, seen = _no_new_graphs(tiny_ar, _ar_call(tiny_ar, method, 1.0))
    assert passes >= MIN_PASSES
    assert "unique_graphs" not in seen.get("stats", {}) and not seen.get("graph_break"), seen
    assert torch.equal(eager, compiled), method


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle"])  # the target and a head, a tree (every method: the tiny pipeline)
def test_the_bundled_ar_target_compiles_once(method):
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(ASSETS / "ar-image")
    pipe.set_progress_bar_config(disable=True)
    _count_passes(pipe)
    eager, compiled, passes, seen = _no_new_graphs(pipe, _ar_call(pipe, method, 0.0))
    assert passes >= MIN_PASSES
    assert "unique_graphs" not in seen.get("stats", {}) and not seen.get("graph_break"), seen
    assert torch.equal(eager, compiled), method


@pytest.mark.parametrize("method", ["none", "sd", "sjd"])
def test_continuous_steps_compile_once(method):
    from mmspec.pipelines import SpeculativeContinuousARPipeline

    pipe = SpeculativeContinuousARPipeline.from_pretrained(ASSETS / "continuous")
    pipe.set_progress_bar_config(disable=True)
    _count_passes(pipe)
    call = lambda: pipe(class_labels=[0, 1], method=method, guidance_scale=2.0, output_type="latent",
                        generator=torch.Generator().manual_seed(0)).images
    eager, compiled, passes, seen = _no_new_graphs(pipe, call)
    assert passes >= MIN_PASSES
    assert "unique_graphs" not in seen.get("stats", {}) and not seen.get("graph_break"), seen
    assert torch.equal(eager, compiled), method


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd"])
def test_inductor_steps_decode_the_eager_tokens(method):
    pipe = tiny_ar_pipeline(grid_size=10)
    call = _ar_call(pipe, method, 0.0)
    reference = call()  # eager, the CPU's own widths
    pipe.enable_compiled_steps()  # Inductor, reduce-overhead
    try:
        assert torch.equal(call(), reference)
        assert pipe.compiled_steps == ["transformer", "draft_model", "eagle_head", "medusa_head"]
    finally:
        pipe.disable_compiled_steps()


def _vlm_call(pipe, method, images, questions, temperature=1.0):
    return lambda: torch.tensor([row + [-1] * (24 - len(row)) for row in pipe(
        images=images, prompts=questions, method=method, temperature=temperature, max_new_tokens=24,
        generator=torch.Generator().manual_seed(0)).tokens])


def _vlm_images(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(3, 16, 16, generator=gen) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_vlm():
    pipe = tiny_vlm_pipeline()
    pipe.set_progress_bar_config(disable=True)
    _count_passes(pipe)
    return pipe


@pytest.mark.parametrize("method", methods.names("vlm"))
def test_vlm_steps_compile_once(tiny_vlm, method):
    call = _vlm_call(tiny_vlm, method, _vlm_images(2), [VLM_QUESTION] * 2)
    eager, compiled, passes, seen = _no_new_graphs(tiny_vlm, call)
    assert passes >= MIN_PASSES
    assert "unique_graphs" not in seen.get("stats", {}) and not seen.get("graph_break"), seen
    assert torch.equal(eager, compiled), method


def test_vlm_compiled_steps_name_the_language_models(tiny_vlm):
    tiny_vlm.enable_compiled_steps(backend="eager")
    try:
        assert tiny_vlm.compiled_steps == ["target.language_model", "draft_model.language_model", "eagle_head",
                                           "specvlm_head", "vispec_head", "medusa_head"]
        assert "forward" in vars(tiny_vlm.target.model.language_model)
        target, draft = tiny_vlm.views()
        assert target.new_cache(2, 30) is target.new_cache(2, 30)  # pooled
    finally:
        tiny_vlm.disable_compiled_steps()
    assert "forward" not in vars(tiny_vlm.target.model.language_model)
    assert "new_cache" not in vars(tiny_vlm.views()[0])


@pytest.mark.slow
def test_the_bundled_vlm_compiles_once():
    from mmspec.pipelines import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline.from_pretrained(ASSETS / "vlm")
    pipe.set_progress_bar_config(disable=True)
    _count_passes(pipe)
    call = _vlm_call(pipe, "eagle", _vlm_images(1), ["describe the image in detail ."], temperature=0.0)
    eager, compiled, passes, seen = _no_new_graphs(pipe, call)
    assert passes >= MIN_PASSES
    assert "unique_graphs" not in seen.get("stats", {}) and not seen.get("graph_break"), seen
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("method", ["none", "lookup"])
def test_a_qwen2_vl_compiles_once(method):
    """M-RoPE positions (three axes, a per-row offset) through the compiled language model."""
    from test_vlm_inputs import QUESTIONS, qwen_images, qwen_pipe

    pipe = qwen_pipe("qwen2-vl")
    pipe.target.generation_config.eos_token_id = None  # every answer runs its full length
    _count_passes(pipe)
    eager, compiled, passes, seen = _no_new_graphs(pipe, _vlm_call(pipe, method, qwen_images(), QUESTIONS))
    assert passes >= MIN_PASSES
    assert "unique_graphs" not in seen.get("stats", {}) and not seen.get("graph_break"), seen
    assert torch.equal(eager, compiled), method


def test_disable_restores_the_eager_forwards(tiny_ar):
    tiny_ar.enable_compiled_steps(backend="eager")
    assert "forward" in vars(tiny_ar.transformer)
    tiny_ar.disable_compiled_steps()
    assert tiny_ar.compiled_steps is None
    for name in ("transformer", "draft_model", "eagle_head", "medusa_head"):
        assert "forward" not in vars(getattr(tiny_ar, name)) and "new_cache" not in vars(getattr(tiny_ar, name))


def test_compiled_steps_reuse_their_caches(tiny_ar):
    """One cache per (batch, length) while compiled: the same buffers every call (a CUDA graph
    replays on the addresses it recorded), emptied each time; a rolling cache is never pooled."""
    from mmspec.core.cache import SinkWindowCache

    tiny_ar.enable_compiled_steps(backend="eager")
    try:
        a = tiny_ar.transformer.new_cache(2, 30)
        a.lengths += 5
        b = tiny_ar.transformer.new_cache(2, 30)
        assert b is a and b.k is a.k and int(b.lengths.sum()) == 0
        assert tiny_ar.transformer.new_cache(2, 31) is not a
    finally:
        tiny_ar.disable_compiled_steps()
    assert tiny_ar.transformer.new_cache(2, 30) is not a
    assert SinkWindowCache.reset is None


def test_bad_settings_are_refused(tiny_ar):
    with pytest.raises(ValueError, match="mode must be one of"):
        tiny_ar.enable_compiled_steps(mode="fast")
    with pytest.raises(ValueError, match="fullgraph must be True or False"):
        tiny_ar.enable_compiled_steps(fullgraph="yes")
    assert tiny_ar.compiled_steps is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_the_readme_snippet_compiles_and_keeps_the_eager_tokens():
    """README's GPU snippet: the bundled AR pipeline on CUDA, CUDA graphs (reduce-overhead), a CPU
    generator; greedy tokens equal the eager forwards' with the same static shapes."""
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(ASSETS / "ar-image").to("cuda")
    pipe.set_progress_bar_config(disable=True)
    call = lambda: pipe(prompt="a red circle", method="eagle", temperature=0.0, output_type="latent",
                        generator=torch.Generator().manual_seed(0)).tokens
    with forced_static_shapes():
        eager = call()
    pipe.enable_compiled_steps()
    try:
        call()
        assert torch.equal(call(), eager)
    finally:
        pipe.disable_compiled_steps()
