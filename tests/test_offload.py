"""``enable_model_cpu_offload`` on the four pipelines, on CPU, with a simulated second device.

On CPU the real offload moves nothing, so accelerate's ``CpuOffload`` (the class
``cpu_offload_with_hook`` builds, looked up in ``accelerate.big_modeling``) is replaced by one where
"offloaded" means the module's floating parameters and buffers are float64 and "onloaded" means
they are float32 again (the pipelines compute in float32): the round trip is lossless, so a pipeline that only
touches onloaded models gives bit-identical outputs, while a weight read from an offloaded model
brings float64 into float32 work (an error or different numbers). Everything around it is the real
diffusers and accelerate code: the hook chain of ``model_cpu_offload_seq``, ``apply_forward_hook``,
``maybe_free_model_hooks``. A ledger records every move, so a test also sees which models a call
moved and how often.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from pathlib import Path

import accelerate.big_modeling
import numpy as np
import pytest
import torch
from accelerate.hooks import CpuOffload, UserCpuOffloadHook
from accelerate.utils import send_to_device

from mmspec.bench.wan_tiny import tiny_wan_pipeline
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import (SpeculativeARImagePipeline, SpeculativeContinuousARPipeline, SpeculativePipeline,
                              SpeculativeVLMPipeline, StreamingVideoPipeline)

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def _floating(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()]


class Residency:
    """The simulation's ledger: which modules are offloaded, and every move in order. A move is
    ``Module.to`` (as accelerate's), so what a module does on ``.to`` happens here too."""

    def __init__(self):
        self.away: set[int] = set()  # id(module) while offloaded
        self.moves: list[tuple[torch.nn.Module, str]] = []

    def offloaded(self, module) -> bool:
        return id(module) in self.away

    def offload(self, module) -> None:
        if not self.offloaded(module):
            # float32 -> float64 -> float32 is exact; other dtypes would not come back
            assert {t.dtype for t in _floating(module)} == {torch.float32}, type(module).__name__
            torch.nn.Module.to(module, torch.float64)
            self.away.add(id(module))
            self.moves.append((module, "out"))

    def onload(self, module) -> None:
        if self.offloaded(module):
            torch.nn.Module.to(module, torch.float32)
            self.away.discard(id(module))
            self.moves.append((module, "in"))

    def moves_by_name(self, pipe) -> dict[str, list[str]]:
        names = {id(m): name for name, m in _models(pipe).items()}
        out: dict[str, list[str]] = {}
        for module, move in self.moves:
            out.setdefault(names[id(module)], []).append(move)
        return out


def simulated_offload(residency: Residency) -> type:
    """accelerate's ``CpuOffload`` with the simulation's moves; ``pre_forward`` keeps its duties:
    offload the chained previous model, send the inputs to the execution device."""

    class SimulatedOffload(CpuOffload):
        def init_hook(self, module):
            residency.offload(module)
            return module

        def pre_forward(self, module, *args, **kwargs):
            prev = self.prev_module_hook
            if isinstance(prev, UserCpuOffloadHook) and not residency.offloaded(prev.model):
                prev.offload()
            residency.onload(module)
            return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    return SimulatedOffload


def _models(pipe) -> dict[str, torch.nn.Module]:
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


@pytest.fixture
def residency(monkeypatch):
    ledger = Residency()
    monkeypatch.setattr(accelerate.big_modeling, "CpuOffload", simulated_offload(ledger))
    return ledger


@contextmanager
def offloaded(pipe, residency: Residency, seq: str | None = None):
    """``pipe`` under model offload (optionally with another ``model_cpu_offload_seq``); on exit
    hooks removed and every model back in float32, for the module-scoped pipelines."""
    if seq is not None:
        pipe.model_cpu_offload_seq = seq  # an instance attribute: the class keeps its own
    pipe.enable_model_cpu_offload(device="cpu")
    try:
        assert all(residency.offloaded(m) for m in _models(pipe).values())  # the simulation is in force
        residency.moves.clear()
        yield
    finally:
        pipe.remove_all_hooks()
        for m in _models(pipe).values():
            residency.onload(m)
        if seq is not None:
            del pipe.model_cpu_offload_seq


# -- the pipelines and one short call of each ---------------------------------------------------------

def _load(cls, folder):
    pipe = cls.from_pretrained(ASSETS / folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipes():
    return {"ar": _load(SpeculativeARImagePipeline, "ar-image"), "vlm": _load(SpeculativeVLMPipeline, "vlm"),
            "continuous": _load(SpeculativeContinuousARPipeline, "continuous"),
            "video": _load(StreamingVideoPipeline, "video"), "wan": tiny_wan_pipeline()}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


IMAGE = np.linspace(0, 1, 32 * 32 * 3, dtype=np.float32).reshape(32, 32, 3)


def call(pipe, kind: str, method: str) -> list[torch.Tensor]:
    """One short call; the tensors that must not change under offload."""
    if kind == "ar":  # greedy, except LANTERN's relaxed test, which samples
        temperature = 1.0 if method == "lantern" else 0.0
        out = pipe(class_labels=[1, 6], method=method, temperature=temperature, output_type="pt", generator=gen())
        return [out.tokens, out.images]
    if kind == "vlm":
        out = pipe(images=[IMAGE], prompts=["describe the image in detail ."], method=method, max_new_tokens=8,
                   temperature=0.0)
        return [torch.tensor(out.tokens[0])]
    if kind == "continuous":  # MAR's temperature is > 0: a seeded sample instead of greedy
        out = pipe(class_labels=[2], method=method, output_type="pt", generator=gen())
        return [out.latents, out.images]
    if kind == "wan":  # Wan's causal VAE decodes outside its forward (WanStreamingDecoder), chunk by chunk
        return [pipe(prompt="a red cat walks", num_latent_frames=2 * pipe.chunk_frames, output_type="pt",
                     generator=gen()).frames]
    C = pipe.chunk_frames  # video, two chunks; "switch" changes the prompt at the second (LongLive's re-cache)
    prompts = [(0, "a red circle moving right"), (C, "a blue square moving up")]
    kw = dict(prompts=prompts) if method == "switch" else dict(prompt="a red circle moving right")
    mode = "window-recompute" if method == "window-recompute" else "rolling"
    return [pipe(num_frames=2 * C, cache_mode=mode, output_type="pt", generator=gen(), **kw).frames]


# (pipeline, method, the models the call moves: in once and out once)
CASES = [
    ("ar", "none", {"transformer", "vqvae"}),
    ("ar", "sd", {"transformer", "vqvae", "draft_model"}),
    ("ar", "eagle", {"transformer", "vqvae", "eagle_head"}),
    ("ar", "medusa", {"transformer", "vqvae", "medusa_head"}),
    ("ar", "lantern", {"transformer", "vqvae", "eagle_head"}),  # EAGLE drafts; the rule reads the VQ's codebook
    ("vlm", "none", {"target"}),
    ("vlm", "sd", {"target", "draft_model"}),
    ("vlm", "eagle", {"target", "eagle_head"}),
    ("vlm", "medusa", {"target", "medusa_head"}),
    ("continuous", "none", {"transformer", "tokenizer"}),
    ("continuous", "sd", {"transformer", "tokenizer", "draft_model"}),
    ("video", "rolling", {"transformer", "vae"}),
    ("video", "window-recompute", {"transformer", "vae"}),
    ("video", "switch", {"transformer", "vae"}),
    # the GPU check (H200, 2026-11-28) found the offloaded Wan stream decoding on the CPU
    ("wan", "rolling", {"text_encoder", "transformer", "vae"}),
]


def _assert_all_offloaded(pipe, residency):
    for name, model in _models(pipe).items():
        assert residency.offloaded(model) and {t.dtype for t in _floating(model)} == {torch.float64}, name


@pytest.mark.parametrize("kind, method, used", CASES, ids=[f"{k}-{m}" for k, m, _ in CASES])
def test_offload_keeps_outputs_and_moves_each_used_model_once(pipes, residency, kind, method, used):
    pipe = pipes[kind]
    reference = call(pipe, kind, method)
    with offloaded(pipe, residency):
        for _ in range(2):  # the second call runs on the hooks maybe_free_model_hooks rebuilt
            outputs = call(pipe, kind, method)
            for got, want in zip(outputs, reference):
                assert got.dtype == want.dtype and torch.equal(got, want)
            # the target (and every model the method uses) in once, before anything reads it, and out
            # once; the models it does not use never leave the CPU
            assert residency.moves_by_name(pipe) == {name: ["in", "out"] for name in used}
            _assert_all_offloaded(pipe, residency)
            residency.moves.clear()


def test_offloaded_medusa_heads_keep_no_stacked_copy(pipes, residency):
    # the VLM heads stack copies of their weights for decoding; kept across an offload, the copies
    # would stay on the device
    pipe = pipes["vlm"]
    with offloaded(pipe, residency):
        call(pipe, "vlm", "medusa")
        assert residency.offloaded(pipe.medusa_head) and getattr(pipe.medusa_head, "_stack", None) is None


def test_a_stream_closed_early_offloads_its_models(pipes, residency):
    pipe = pipes["video"]
    with offloaded(pipe, residency):
        stream = pipe.stream("a red circle moving right", num_frames=None, generator=gen())
        next(stream)
        assert not residency.offloaded(pipe.transformer) and not residency.offloaded(pipe.vae)
        stream.close()
        _assert_all_offloaded(pipe, residency)


# -- the simulation bites: deliberately wrong variants ------------------------------------------------

MIXED = r"same dtype, but got .*(?i:double)"  # float32 work meeting an offloaded (float64) tensor


@pytest.mark.parametrize("kind", ["ar", "continuous"])
def test_without_the_onload_caches_are_made_from_offloaded_weights(pipes, residency, monkeypatch, kind):
    # new_cache reads the offloaded target's dtype (on a GPU: its device) before the first forward
    monkeypatch.setattr(SpeculativePipeline, "onload_models", lambda self, recipe: None)
    with offloaded(pipes[kind], residency), pytest.raises(RuntimeError, match=MIXED):
        call(pipes[kind], kind, "none")


def test_without_the_onload_a_vlm_target_runs_offloaded(pipes, residency, monkeypatch):
    # VLMTarget calls the model's parts, never its forward: nothing else would move it. The
    # simulation computes such a run in float64 without an error (on a GPU it fails: CPU weights,
    # CUDA inputs); the ledger sees it
    monkeypatch.setattr(SpeculativePipeline, "onload_models", lambda self, recipe: None)
    pipe = pipes["vlm"]
    with offloaded(pipe, residency):
        call(pipe, "vlm", "sd")
        assert residency.moves_by_name(pipe) == {}


def test_without_the_onload_a_stream_starts_from_offloaded_weights(pipes, residency, monkeypatch):
    # the cache, the noise and the recompute context take the offloaded transformer's dtype
    monkeypatch.setattr("mmspec.pipelines.video.onload", lambda *modules: None)
    with offloaded(pipes["video"], residency), pytest.raises(RuntimeError, match=MIXED):
        call(pipes["video"], "video", "rolling")


def test_drafts_in_the_chain_move_the_target_every_pass(pipes, residency):
    # the old sequence: the draft's hook offloads the target before every draft pass, and the
    # target's next pass brings it back: correct, but one round trip per target pass
    pipe = pipes["ar"]
    kw = dict(class_labels=[1, 6], method="sd", temperature=0.0, output_type="latent")
    reference = pipe(**kw).tokens
    with offloaded(pipe, residency, seq="transformer->draft_model->eagle_head->medusa_head->vqvae"):
        out = pipe(**kw)
        moves = residency.moves_by_name(pipe)["transformer"]
    assert torch.equal(out.tokens, reference)
    assert out.stats["nfe"] > 10 and moves == ["in", "out"] * out.stats["nfe"]


def test_a_decode_outside_forward_needs_its_hook(pipes, residency, monkeypatch):
    # without apply_forward_hook (on decode and on the codebook it reads) the VQ decodes with its
    # offloaded weights (float64): other pixels
    pipe = pipes["ar"]
    reference = call(pipe, "ar", "none")
    for name in ("decode", "codebook"):
        monkeypatch.setattr(TinyVQModel, name, getattr(TinyVQModel, name).__wrapped__)
    with offloaded(pipe, residency):
        tokens, images = call(pipe, "ar", "none")
        assert "vqvae" not in residency.moves_by_name(pipe)
    assert torch.equal(tokens, reference[0]) and not torch.equal(images, reference[1])
