"""End to end: greedy decoding through the core with the kernels forced on (``MMSPEC_KERNELS=triton``
in Triton's interpreter, a child process) equals the torch path token for token: a tree method
(EAGLE-2-style trees from a draft model; the target's verify and the draft's frontiers go through
the tree-verify attention kernel) and rolling-cache streams (the sink-window kernel with fused
RoPE, evicting as they go, plain and with trees). The child counts the kernel calls, so a run that
silently took the torch path fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmspec.kernels import dispatch

TESTS = Path(__file__).resolve().parent

# Builds the models from seeds and decodes; run here (torch path) and in the child (kernels forced).
_SCRIPT = r'''
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import mmspec.core.cache as cache_mod
from mmspec.core import LogitsPipeline, ModelTreeDrafter, SpeculativeDecoder
from mmspec.models import TinyCausalLM
from tiny import tiny_lm
from mmspec.bench.synthetic import perturbed_copy

calls = {"tree": 0, "rolling": 0}
for name, attr in (("tree", "tree_attention_triton"), ("rolling", "rolling_attention_triton")):
    def counted(*a, _f=getattr(cache_mod, attr), _n=name, **k):
        calls[_n] += 1
        return _f(*a, **k)
    setattr(cache_mod, attr, counted)

V = 48
PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
greedy = LogitsPipeline(temperature=0)
target = tiny_lm(0, vocab_size=V, dim=32, n_layers=2, init_std=0.5)
draft = perturbed_copy(target, noise=0.05, seed=1)


def rolling(model, sink, window):
    """The model with a sink-window cache (its extra slots hold the largest block)."""
    model.new_cache = lambda batch, max_len: TinyCausalLM.new_cache(model, batch, max_len, sink=sink, window=window)
    return model


out = {}
tree = lambda: ModelTreeDrafter(draft, top_k=3, depth=3, total_tokens=12)
out["tree"] = SpeculativeDecoder(target, tree(), logits=greedy).generate(PROMPTS, 20).sequences
out["calls-tree"] = dict(calls)
stream = rolling(tiny_lm(0, vocab_size=V, dim=32, n_layers=2, init_std=0.5), 2, 9)
out["rolling"] = SpeculativeDecoder(stream, logits=greedy).generate(PROMPTS, 24).sequences
out["rolling-tree"] = SpeculativeDecoder(stream, tree(), logits=greedy).generate(PROMPTS, 20).sequences
out["calls"] = dict(calls)
out["static"] = SpeculativeDecoder(target, logits=greedy).generate(PROMPTS, 24).sequences
torch.save(out, sys.argv[2])
'''


def _run(tmp_path: Path, env: dict) -> dict:
    dst = tmp_path / f"out-{env.get('MMSPEC_KERNELS')}.pt"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(TESTS), str(dst)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"decoding failed ({env}):\n{proc.stderr[-4000:]}", pytrace=False)
    return torch.load(dst)


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
def test_greedy_with_kernels_forced_equals_the_torch_path(tmp_path):
    torch_path = _run(tmp_path, {"MMSPEC_KERNELS": "torch"})
    kernels = _run(tmp_path, {"MMSPEC_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    assert torch_path["calls"] == {"tree": 0, "rolling": 0}
    # the tree method's passes all went through the tree kernel, the rolling streams through the rolling one
    assert kernels["calls-tree"]["tree"] > 20 and kernels["calls-tree"]["rolling"] == 0
    assert kernels["calls"]["rolling"] > 40
    for name in ("tree", "rolling", "rolling-tree"):
        assert torch.equal(kernels[name], torch_path[name]), name
    # the streams really rolled (2 + 9 kept tokens; prompts of 3 and 10, 24 new tokens): both rows
    # differ from decoding with everything kept
    assert all(r != s for r, s in zip(torch_path["rolling"].tolist(), torch_path["static"].tolist()))
