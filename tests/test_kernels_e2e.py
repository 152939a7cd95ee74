"""End to end, with the kernels forced on (``MMSPEC_KERNELS=triton`` in Triton's interpreter, a
child process) against the torch path (``MMSPEC_KERNELS=torch``), the same script in both:

- greedy decoding equals token for token: a tree method (EAGLE-2-style trees from a draft model;
  the target's verify and the draft's frontiers go through the tree-verify attention kernel) and
  rolling-cache streams (the sink-window kernel with fused RoPE, evicting as they go, plain and
  with trees);
- chain decoding, greedy and seeded-sampled (T = 1, top-k, CFG), equals token for token with every
  accept step in the fused guided-acceptance kernel: ``sd`` from a draft model, SJD and GSD
  (Jacobi chains), target-only, and ZipAR lanes with SJD;
- a ``VideoDiTModel`` stream (rolling eviction, a prompt switch's re-cache) equals within 1e-5
  with every attention in the rolling kernel (the tolerance is argued in its test).

The child counts the kernel calls, so a run that silently took the torch path fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmspec.kernels import dispatch

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent

# Builds the models from seeds and decodes; run here (torch path) and in the child (kernels forced).
_SCRIPT = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import importlib
rolling_mod = importlib.import_module("mmspec.kernels.rolling_attention")  # the package's names are the dispatchers
tree_mod = importlib.import_module("mmspec.kernels.tree_attention")
from mmspec.core import LogitsProcessor, ModelTreeDrafter, SpeculativeDecoder
from mmspec.models import TinyCausalLM
from tiny import tiny_lm
from mmspec.bench.synthetic import perturbed_copy

calls = {"tree": 0, "rolling": 0}
for name, mod, attr in (("tree", tree_mod, "tree_attention_triton"),
                        ("rolling", rolling_mod, "rolling_attention_triton")):
    def counted(*a, _f=getattr(mod, attr), _n=name, **k):
        calls[_n] += 1
        return _f(*a, **k)
    setattr(mod, attr, counted)  # the dispatchers' kernel launchers, which the caches reach through them

V = 48
PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
greedy = LogitsProcessor(temperature=0)
target = tiny_lm(0, vocab_size=V, dim=32, n_layers=2, init_std=0.5)
draft = perturbed_copy(target, noise=0.05, seed=1)


def rolling(model, sink, window):
    """The model with a sink-window cache (its extra slots hold the largest block)."""
    model.new_cache = lambda batch, max_len: TinyCausalLM.new_cache(model, batch, max_len, sink=sink, window=window)
    return model


out = {}
tree = lambda: ModelTreeDrafter(draft, top_k=3, depth=3, total_tokens=12)
out["tree"] = SpeculativeDecoder(target, tree(), processor=greedy).generate(PROMPTS, 20).sequences
out["calls-tree"] = dict(calls)
stream = rolling(tiny_lm(0, vocab_size=V, dim=32, n_layers=2, init_std=0.5), 2, 9)
out["rolling"] = SpeculativeDecoder(stream, processor=greedy).generate(PROMPTS, 24).sequences
out["rolling-tree"] = SpeculativeDecoder(stream, tree(), processor=greedy).generate(PROMPTS, 20).sequences
out["calls"] = dict(calls)
out["static"] = SpeculativeDecoder(target, processor=greedy).generate(PROMPTS, 24).sequences
torch.save(out, sys.argv[2])
'''


TORCH = {"MMSPEC_KERNELS": "torch"}
TRITON = {"MMSPEC_KERNELS": "triton", "TRITON_INTERPRET": "1"}


def _run(tmp_path: Path, env: dict, script: str = _SCRIPT) -> dict:
    dst = tmp_path / f"out-{env.get('MMSPEC_KERNELS')}.pt"
    proc = subprocess.run([sys.executable, "-c", script, str(TESTS), str(dst)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"decoding failed ({env}):\n{proc.stderr[-4000:]}", pytrace=False)
    return torch.load(dst, weights_only=False)  # our own child's tensors, dicts and ints


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
def test_greedy_with_kernels_forced_equals_the_torch_path(tmp_path):
    torch_path = _run(tmp_path, TORCH)
    kernels = _run(tmp_path, TRITON)
    assert torch_path["calls"] == {"tree": 0, "rolling": 0}
    # the tree method's passes all went through the tree kernel, the rolling streams through the rolling one
    assert kernels["calls-tree"]["tree"] > 20 and kernels["calls-tree"]["rolling"] == 0
    assert kernels["calls"]["rolling"] > 40
    for name in ("tree", "rolling", "rolling-tree"):
        assert torch.equal(kernels[name], torch_path[name]), name
    # the streams really rolled (2 + 9 kept tokens; prompts of 3 and 10, 24 new tokens): both rows
    # differ from decoding with everything kept
    assert all(r != s for r, s in zip(torch_path["rolling"].tolist(), torch_path["static"].tolist()))


# Chain methods through the decoder; every accept step of a chain is the fused kernel's when forced.
_ACCEPT_SCRIPT = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import mmspec.core.fused as fused_mod
from mmspec.core import (GroupedAcceptance, GroupedAcceptanceConfig, JacobiDrafter, LogitsProcessor,
                         ModelChainDrafter, NextSetSchedule, SpeculativeDecoder)
from tiny import tiny_lm
from mmspec.bench.synthetic import perturbed_copy

calls = [0]
def counted(*a, _f=fused_mod.guided_accept_triton, **k):
    calls[0] += 1
    return _f(*a, **k)
fused_mod.guided_accept_triton = counted

V, N = 48, 16
PROMPTS, UNCOND = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], [[0], [0, 0]]
target = tiny_lm(0, vocab_size=V, dim=32, n_layers=2, init_std=0.5)
draft = perturbed_copy(target, noise=0.05, seed=1)
greedy = LogitsProcessor(temperature=0, guidance_scale=2.0)
sampled = LogitsProcessor(temperature=1.0, guidance_scale=2.0)
top_k = LogitsProcessor(temperature=0.8, top_k=12, guidance_scale=2.0)
# groups wide enough to hold other tokens (the tiny LM's embeddings are ~16 apart, squared)
gsd = GroupedAcceptance(target.embed.weight, GroupedAcceptanceConfig(p_threshold=0.1, d_threshold=24.0,
                                                                     half_width=4))
per_row = lambda: [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
RUNS = {
    "sd-greedy": (dict(drafter=ModelChainDrafter(draft, gamma=4), processor=greedy), lambda: None),
    "sd-sampled": (dict(drafter=ModelChainDrafter(draft, gamma=4), processor=sampled), per_row),
    "sd-top-k": (dict(drafter=ModelChainDrafter(draft, gamma=3), processor=top_k),
                 lambda: torch.Generator().manual_seed(3)),
    "sjd": (dict(drafter=JacobiDrafter(V, window=5), processor=sampled), per_row),
    "gsd": (dict(drafter=JacobiDrafter(V, window=5), rule=gsd, processor=sampled), per_row),
    "target-only": (dict(processor=sampled), per_row),
}
out = {}
for name, (kw, generator) in RUNS.items():
    before = calls[0]
    res = SpeculativeDecoder(target, **kw).generate(PROMPTS, N, uncond_input_ids=UNCOND, generator=generator())
    out[name] = (res.sequences, res.stats.target_forwards, calls[0] - before)
zipar = SpeculativeDecoder(target, JacobiDrafter(V, window=3, init="repeat"), processor=sampled,
                           schedule=NextSetSchedule(3, 4, 2))
before = calls[0]
res = zipar.generate([[5, 9, 2]], 12, uncond_input_ids=[[0]], generator=torch.Generator().manual_seed(4))
out["zipar+sjd"] = (res.sequences, res.stats.target_forwards, calls[0] - before)
torch.save(out, sys.argv[2])
'''


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
def test_chain_decoding_with_fused_acceptance_equals_the_torch_path(tmp_path):
    """Greedy and seeded sampling (T = 1 and 0.8 with top-k, CFG, one generator per row), through
    ``SpeculativeDecoder``: the fused kernel decides every pass after the prefill and draws the
    same tokens as the rule objects from the same uniforms."""
    torch_path = _run(tmp_path, TORCH, _ACCEPT_SCRIPT)
    kernels = _run(tmp_path, TRITON, _ACCEPT_SCRIPT)
    for name, (tokens, nfe, calls) in kernels.items():
        want, want_nfe, torch_calls = torch_path[name]
        assert torch_calls == 0, name
        assert calls == nfe - 1, (name, calls, nfe)  # every decode pass; the prefill samples alone
        assert torch.equal(tokens, want) and nfe == want_nfe, name
    # the chains accepted drafts (fewer passes than tokens) and rejected some (more than the minimum)
    for name in ("sd-greedy", "sd-sampled", "sd-top-k", "sjd", "gsd"):
        nfe = torch_path[name][1]
        assert 16 / 5 + 1 < nfe < 16, (name, nfe)
    # GSD's groups changed decisions: with {x} groups it is SJD draw for draw
    assert not torch.equal(torch_path["gsd"][0], torch_path["sjd"][0])


# A tiny streaming video pipeline: 7 chunks of 2 frames, sink 2 + window 8 frames (eviction from the
# 6th chunk), a prompt switch at frame 12 whose re-cache recomputes all 10 cached frames (160 queries:
# a block auto mode would keep on the reference; forced, the kernel takes it).
_VIDEO_SCRIPT = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import importlib
rolling_mod = importlib.import_module("mmspec.kernels.rolling_attention")  # the package's names are the dispatchers
from mmspec.models.video_ae import FrameAutoencoder
from mmspec.models.video_dit import VideoDiTModel
from mmspec.pipelines import StreamingVideoPipeline

calls = []
def counted(q, *a, _f=rolling_mod.rolling_attention_triton, **k):
    calls.append(q.shape[2])
    return _f(q, *a, **k)
rolling_mod.rolling_attention_triton = counted

torch.manual_seed(0)
vae = FrameAutoencoder(channels=(8, 16), stem_channels=8).eval()
model = VideoDiTModel(dim=32, n_layers=2, n_heads=2, mlp_hidden=64, chunk_frames=2, sink_frames=2,
                      window_frames=4).eval()
with torch.no_grad():  # off adaLN-Zero's zeros, so that every block (and its attention) counts
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))
pipe = StreamingVideoPipeline(vae=vae, transformer=model)
pipe.set_progress_bar_config(disable=True)
out = pipe(prompts=[(0, "a red circle moving right"), (12, "a blue square moving up")], num_frames=14,
           window_frames=8, num_inference_steps=2, generator=torch.Generator().manual_seed(1), output_type="latent")
torch.save({"latents": out.frames, "stats": out.stats, "calls": calls}, sys.argv[2])
'''


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
def test_video_stream_with_the_rolling_kernel_matches_the_torch_path(tmp_path):
    """``VideoDiTModel`` attends through ``CacheStep.attend``: forced, every attention of the
    stream (denoising passes, clean commits, the re-cache) is the rolling kernel's, 3-D RoPE fused.

    Tolerance 1e-5 on latents of magnitude ~4 (fp32; observed <= 8e-7): the kernel's online
    softmax sums in another order than SDPA (each attention within 2e-6, tests/test_kernels_
    attention.py), and the difference passes through 2 layers, CFG at scale 3 (which amplifies a
    velocity difference up to 5x) and, via the cached K/V, every later chunk."""
    torch_path = _run(tmp_path, TORCH, _VIDEO_SCRIPT)
    kernels = _run(tmp_path, TRITON, _VIDEO_SCRIPT)
    stats = torch_path["stats"]
    assert stats["nfe"] == 22 and stats["switch_frames"] == [12]
    assert stats["cache_frames"] == 10 < stats["frames"] == 14  # the stream rolled
    assert torch_path["calls"] == []
    # 22 passes x 2 layers: 21 of a 2-frame chunk (32 queries), the re-cache's 10 frames (160)
    assert sorted(kernels["calls"]) == [32] * 42 + [160] * 2
    torch.testing.assert_close(kernels["latents"], torch_path["latents"], atol=1e-5, rtol=0)
