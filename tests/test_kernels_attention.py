"""Tree-verify and sink-window rolling attention: the Triton kernels against their torch references
in Triton's interpreter on the CPU (odd shapes, GQA, ragged rows, one-node trees, window
wrap-around, sink 0), the references against what the core's caches and models compute today, and
the dispatchers' choice. Compiled-kernel tests run only with CUDA. The kernels pick their key splits
here (several where a case spans several key tiles); tests/test_kernels_splitk.py forces them.

Tolerances: fp32 within 2e-6 of the fp32 reference; fp16 and bf16 within twice torch's own error at
that precision against the fp32 reference (flash-attn's criterion) plus a floor of a quarter ulp
at the outputs' scale (bf16 in the interpreter runs the kernel's fp32 upcast path)."""

from __future__ import annotations

import importlib

import pytest
import torch

from mmspec.adapters.video import VideoChunkCache
from mmspec.core.cache import SinkWindowCache, StaticKVCache, visibility_mask
from mmspec.core.rope import GridRope2D, Rope1D, Rope3D
from mmspec.core.tree import Tree
from mmspec.kernels import dispatch
from mmspec.kernels.interpret import run_interpreted
from mmspec.kernels.rolling_attention import rolling_attention, rolling_attention_reference
from mmspec.kernels.tree_attention import tree_attention, tree_attention_reference, visibility

# the modules (``mmspec.kernels.tree_attention`` the attribute is the dispatcher function)
tree_mod = importlib.import_module("mmspec.kernels.tree_attention")
rolling_mod = importlib.import_module("mmspec.kernels.rolling_attention")
needs_triton = pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
FLOOR = {torch.float16: 2.5e-4, torch.bfloat16: 2e-3}
# compiled fp32 runs IEEE dots (no tf32): its error against the CPU reference is summation order only
CUDA_FP32_SLACK = 1e-5


def _random_tree(B: int, T: int, g: torch.Generator) -> Tree:
    """B random trees of T nodes (node 0 the root; each node's parent drawn among earlier ones)."""
    parents = torch.stack([torch.randint(0, i, (B,), generator=g) for i in range(1, T)], 1) if T > 1 else \
        torch.zeros(B, 0, dtype=torch.long)
    return Tree(parents, max_depth=T - 1, max_children=max(T - 1, 0))


def _qkv(B, Hq, Hkv, T, S, D, g):
    return (torch.randn(B, Hq, T, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


def _tree_cases() -> dict:
    """name -> kwargs of tree_attention (fp32; the dtype is applied per test)."""
    g = torch.Generator().manual_seed(0)
    cases = {}
    # chain (causal block), 6 query heads over 3 key/value heads, head dim 24, ragged prefixes
    q, k, v = _qkv(2, 6, 3, 17, 60, 24, g)
    cases["chain-gqa-T17"] = dict(q=q, k=k, v=v, prefix_lens=torch.tensor([43, 3]), tree_mask=None)
    # a random 17-node tree, 5 heads, one row with an empty prefix
    q, k, v = _qkv(3, 5, 5, 17, 130, 16, g)
    cases["tree-T17"] = dict(q=q, k=k, v=v, prefix_lens=torch.tensor([0, 17, 113]),
                             tree_mask=_random_tree(3, 17, g).ancestor_mask)
    # a tree of one node (the root alone) over a 255-token prefix and over a 1-token one
    q, k, v = _qkv(2, 3, 1, 1, 256, 32, g)
    cases["one-node-S255"] = dict(q=q, k=k, v=v, prefix_lens=torch.tensor([255, 1]),
                                  tree_mask=torch.ones(2, 1, 1, dtype=torch.bool))
    # a mask wider than the block (a draft model's frontier: 5 earlier nodes + 4 new ones)
    q, k, v = _qkv(2, 2, 2, 4, 40, 16, g)
    mask = torch.rand(2, 4, 9, generator=g) < 0.5
    mask[:, :, 5:] |= torch.eye(4, dtype=torch.bool)
    cases["wide-mask"] = dict(q=q, k=k, v=v, prefix_lens=torch.tensor([20, 31]), tree_mask=mask)
    return cases


def _as_layout(cache_k, cache_v, lengths, sink, window, ring):
    """The compact SinkWindowCache buffers with every full row's window turned into a ring whose
    oldest entry sits ``ring`` slots in (rows not yet full keep the compact layout)."""
    k, v = cache_k.clone(), cache_v.clone()
    full = lengths == sink + window
    ring_start = torch.where(full, ring, 0)
    for b in range(k.shape[0]):
        if full[b]:
            src = torch.arange(sink, sink + window)
            dst = sink + (src - sink + ring) % window
            k[b, :, dst], v[b, :, dst] = cache_k[b, :, src], cache_v[b, :, src]
    return k, v, ring_start


def _stream_cache(cache: SinkWindowCache, rounds: list, g, H: int, D: int, final_T: int, tree=None):
    """Append random K/V blocks (``rounds``: (T, kept per row) per round) through the core's step /
    update / keep_block, then one last block of ``final_T``; returns the models' attention output
    for it and what the kernels take."""
    B = cache.batch_size
    for T, keep in rounds:
        pos = cache.next_positions()[:, None] + torch.arange(T)
        step = cache.step(pos)
        step.update(0, *(torch.randn(B, H, T, D, generator=g) for _ in range(3)))
        cache.keep_block(T, None, torch.tensor(keep))
    lengths = cache.lengths.clone()
    depths = torch.arange(final_T).expand(B, final_T) if tree is None else tree.depths
    positions = cache.next_positions()[:, None] + depths
    step = cache.step(positions, None if tree is None else tree.ancestor_mask)
    q, k, v = (torch.randn(B, H, final_T, D, generator=g) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(*step.update(0, q, k, v), attn_mask=step.mask)
    S = step.mask.shape[-1]
    return expected, dict(q=q, k=cache.k[0, :, :, :S].clone(), v=cache.v[0, :, :, :S].clone(), lengths=lengths,
                          block_start=lengths.clone(), positions=positions)


def _rolling_cases() -> dict:
    """name -> (kwargs of rolling_attention, the core's output for them or None)."""
    g = torch.Generator().manual_seed(1)
    cases = {}
    # tokens, 1-D RoPE: 3 rows evicting at different times (one full, one not), a causal 3-token block
    D, H = 16, 4
    cache = SinkWindowCache(1, 3, H, D, sink=2, window=13, max_block=3, rope=Rope1D(D))
    expected, kw = _stream_cache(cache, [(3, [3, 1, 2])] * 6 + [(3, [3, 2, 0])], g, H, D, 3)
    k, v, ring = _as_layout(kw["k"], kw["v"], kw["lengths"], 2, 13, 5)
    cases["tokens-1d-ring5"] = (dict(kw, k=k, v=v, ring_start=ring, rope=cache.rope, sink=2, window=13), expected)
    cases["tokens-1d-compact"] = (dict(kw, rope=cache.rope, sink=2, window=13), expected)
    # sink 0, interleaved 1-D RoPE, a 5-node tree block, the ring wrapped one short of its end
    rope = Rope1D(D, layout="interleaved")
    cache = SinkWindowCache(1, 2, H, D, sink=0, window=7, max_block=5, rope=rope)
    tree = _random_tree(2, 5, g)
    expected, kw = _stream_cache(cache, [(4, [4, 3])] * 4, g, H, D, 5, tree)
    k, v, ring = _as_layout(kw["k"], kw["v"], kw["lengths"], 0, 7, 6)
    cases["sink0-tree-ring6"] = (dict(kw, k=k, v=v, ring_start=ring, rope=rope, sink=0, window=7,
                                      tree_mask=tree.ancestor_mask), expected)
    # frames of 2 x 3 tokens, 3-D RoPE: a Self-Forcing chunk (bidirectional) over 1 sink + 3 window frames
    D, H, fs = 24, 3, 6
    rope = Rope3D(D, frame_shape=(2, 3))
    cache = VideoChunkCache(1, 2, H, D, sink=1, window=3, frame_size=fs, chunk=1, rope=rope)
    for _ in range(6):
        cache.begin_chunk()
        pos = cache.next_positions()[:, None] + torch.arange(fs)
        cache.step(pos).update(0, *(torch.randn(2, H, fs, D, generator=g) for _ in range(3)))
        cache.commit()
    lengths = cache.lengths.clone()
    cache.begin_chunk()
    pos = cache.next_positions()[:, None] + torch.arange(fs)
    step = cache.step(pos)
    q, k, v = (torch.randn(2, H, fs, D, generator=g) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(*step.update(0, q, k, v), attn_mask=step.mask)
    S = step.mask.shape[-1]
    k, v, ring = _as_layout(cache.k[0, :, :, :S], cache.v[0, :, :, :S], lengths, fs, 3 * fs, 2 * fs)
    cases["frames-3d-ring2"] = (dict(q=q, k=k, v=v, lengths=lengths, block_start=lengths.clone(), positions=pos,
                                     ring_start=ring, rope=rope, sink=fs, window=3 * fs,
                                     tree_mask=torch.ones(2, fs, fs, dtype=torch.bool)), expected)
    # compact rows holding more than sink + window: a chain of drafts appended after a full window,
    # before the cache rolls (a draft model's chain steps); entries past the window at position = slot
    D, H = 16, 2
    cache = SinkWindowCache(1, 2, H, D, sink=2, window=5, max_block=8, rope=Rope1D(D))
    _stream_cache(cache, [(4, [4, 3])] * 3, g, H, D, 3)  # leaves a 3-token block unkept
    expected, kw = _stream_cache(cache, [], g, H, D, 2)
    assert bool((kw["lengths"] > 7).all())
    cases["compact-past-window"] = (dict(kw, rope=cache.rope, sink=2, window=5), expected)
    # one query over a full 255-entry cache (4 sink + 251 window), GQA 6 over 2 heads; ring layout
    D = 32
    rope = Rope1D(D, theta=500.0)
    q, k, v = _qkv(2, 6, 2, 1, 256, D, g)
    lengths = torch.tensor([255, 1])
    cases["one-query-255"] = (dict(q=q, k=k, v=v, lengths=lengths, block_start=torch.tensor([255, 1]),
                                   positions=lengths[:, None].clone(), ring_start=torch.tensor([250, 0]), rope=rope,
                                   sink=4, window=251), None)
    return cases


TREE_CASES = _tree_cases()
ROLLING_CASES = _rolling_cases()
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _cast(kwargs: dict, dtype: torch.dtype) -> dict:
    return {key: val.to(dtype) if key in ("q", "k", "v") else val for key, val in kwargs.items()}


def _calls() -> dict:
    calls = {}
    for name, kw in TREE_CASES.items():
        for tag, dtype in DTYPES.items():
            calls[f"tree/{name}/{tag}"] = ("tree_attention_triton", (), _cast(kw, dtype))
    calls["tree/tree-T17/bf16"] = ("tree_attention_triton", (), _cast(TREE_CASES["tree-T17"], torch.bfloat16))
    for name, (kw, _) in ROLLING_CASES.items():
        for tag, dtype in DTYPES.items():
            calls[f"rolling/{name}/{tag}"] = ("rolling_attention_triton", (), _cast(kw, dtype))
    calls["rolling/frames-3d-ring2/bf16"] = ("rolling_attention_triton", (),
                                             _cast(ROLLING_CASES["frames-3d-ring2"][0], torch.bfloat16))
    return calls


CALLS = _calls()


@pytest.fixture(scope="module")
def kernel_outputs() -> dict:
    """Every kernel call, run once in Triton's interpreter in a child process."""
    if not dispatch.TRITON_AVAILABLE:
        pytest.skip("triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
    return run_interpreted(CALLS)


def _assert_close(out: torch.Tensor, reference, kw: dict, dtype: torch.dtype, slack: float = 0.0):
    """fp32: 2e-6 of the fp32 reference; lower precisions: flash-attn's 2x-of-torch criterion."""
    assert out.dtype == dtype and out.shape == kw["q"].shape
    exact = reference(**kw)  # fp32 inputs: the ground truth
    err = (out.float() - exact).abs().max().item()
    if dtype == torch.float32:
        assert err <= 2e-6 + slack, err
        return
    torch_err = (reference(**_cast(kw, dtype)).float() - exact).abs().max().item()
    assert err <= 2 * torch_err + FLOOR[dtype] * exact.abs().max().item() + slack, (err, torch_err)


@needs_triton
@pytest.mark.parametrize("call", [c for c in CALLS if c.startswith("tree/")])
def test_tree_kernel_matches_reference(kernel_outputs, call):
    _, name, tag = call.split("/")
    out = kernel_outputs[call]
    assert isinstance(out, torch.Tensor), out
    _assert_close(out, tree_attention_reference, TREE_CASES[name], DTYPES.get(tag, torch.bfloat16))


@needs_triton
@pytest.mark.parametrize("call", [c for c in CALLS if c.startswith("rolling/")])
def test_rolling_kernel_matches_reference(kernel_outputs, call):
    _, name, tag = call.split("/")
    out = kernel_outputs[call]
    assert isinstance(out, torch.Tensor), out
    _assert_close(out, rolling_attention_reference, ROLLING_CASES[name][0], DTYPES.get(tag, torch.bfloat16))


# -- the references are what the core computes today --------------------------------------------
def test_visibility_is_the_core_mask():
    g = torch.Generator().manual_seed(2)
    for T, W, prefix in [(1, 1, [0, 7]), (5, 5, [3, 0]), (4, 9, [10, 2])]:
        mask = torch.rand(2, T, W, generator=g) < 0.5
        prefix = torch.tensor(prefix)
        assert torch.equal(visibility(prefix, T, 20, mask), visibility_mask(prefix + W, T, 20, mask))
    prefix = torch.tensor([4, 9])
    assert torch.equal(visibility(prefix, 6, 15, None), visibility_mask(prefix + 6, 6, 15, None))


def test_tree_reference_is_the_static_cache_path():
    """A tree verified through StaticKVCache (the models' path) equals the reference on its buffers."""
    g = torch.Generator().manual_seed(3)
    H, D = 3, 16
    cache = StaticKVCache(1, 2, H, D, max_len=40, rope=Rope1D(D))
    pos = torch.arange(9).expand(2, 9)
    cache.step(pos).update(0, *(torch.randn(2, H, 9, D, generator=g) for _ in range(3)))
    cache.truncate(torch.tensor([9, 4]))  # ragged prefixes
    tree = _random_tree(2, 6, g)
    prefix = cache.lengths.clone()
    step = cache.step(prefix[:, None] + tree.depths, tree.ancestor_mask)
    q, k, v = step.update(0, *(torch.randn(2, H, 6, D, generator=g) for _ in range(3)))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)
    assert torch.equal(tree_attention_reference(q, k, v, prefix, tree.ancestor_mask), expected)


@pytest.mark.parametrize("name", [n for n, (_, expected) in ROLLING_CASES.items() if expected is not None])
def test_rolling_reference_is_the_sink_window_cache(name):
    """The reference on the cache's pre-RoPE buffers (compact, or as a wrapped ring) equals what
    SinkWindowCache + scaled_dot_product_attention compute in the models."""
    kw, expected = ROLLING_CASES[name]
    torch.testing.assert_close(rolling_attention_reference(**kw), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["static", "rolling", "slot"])
def test_attend_on_cpu_is_the_models_former_path(kind, monkeypatch):
    """``CacheStep.attend`` (the models' call) is ``update`` + SDPA with ``step.mask``, bit for bit,
    wherever the dispatch takes the torch path."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    H, D = 2, 16
    make = {"static": lambda: StaticKVCache(1, 2, H, D, max_len=30, rope=Rope1D(D)),
            "rolling": lambda: SinkWindowCache(1, 2, H, D, sink=2, window=5, max_block=6, rope=Rope1D(D)),
            "slot": lambda: importlib.import_module("mmspec.core.cache").SlotKVCache(1, 2, H, D, max_len=30,
                                                                                   rope=Rope1D(D))}[kind]
    a, b = make(), make()
    g = torch.Generator().manual_seed(7)
    tree = _random_tree(2, 6, g)
    for T, mask in [(9, None), (6, tree.ancestor_mask), (1, None)]:
        pos = a.next_positions()[:, None] + torch.arange(T) if kind != "slot" else torch.arange(T).expand(2, T)
        q, k, v = (torch.randn(2, H, T, D, generator=g) for _ in range(3))
        step_a, step_b = a.step(pos, mask), b.step(pos, mask)
        got = step_a.attend(0, q, k, v)
        expected = torch.nn.functional.scaled_dot_product_attention(*step_b.update(0, q, k, v), attn_mask=step_b.mask)
        assert torch.equal(got, expected)
        if kind == "slot":
            a.commit(torch.ones(2, T, dtype=torch.bool))
            b.commit(torch.ones(2, T, dtype=torch.bool))
        else:
            a.keep_block(T, None, torch.tensor([T, T - 1 if T > 1 else 1]))
            b.keep_block(T, None, torch.tensor([T, T - 1 if T > 1 else 1]))


def test_rolling_reference_bites():
    """A ring read as if compact, or keys at the wrong positions, is caught by these comparisons."""
    kw, expected = ROLLING_CASES["tokens-1d-ring5"]
    assert (rolling_attention_reference(**dict(kw, ring_start=torch.zeros(3, dtype=torch.long))) - expected
            ).abs().max() > 1e-3
    assert (rolling_attention_reference(**dict(kw, positions=kw["positions"] + 1)) - expected).abs().max() > 1e-3


# -- dispatch -----------------------------------------------------------------------------------
def test_dispatchers_take_the_reference_on_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the dispatcher chose the Triton kernel for CPU tensors")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # auto mode never picks the interpreter
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(tree_mod, "tree_attention_triton", no_kernel)
    monkeypatch.setattr(rolling_mod, "rolling_attention_triton", no_kernel)
    kw = TREE_CASES["tree-T17"]
    assert torch.equal(tree_attention(**kw), tree_attention_reference(**kw))
    kw = ROLLING_CASES["frames-3d-ring2"][0]
    assert torch.equal(rolling_attention(**kw), rolling_attention_reference(**kw))


def test_forced_triton_on_cpu_fails_clearly(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(dispatch.ENV, "triton")
    with pytest.raises(dispatch.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        tree_attention(**TREE_CASES["tree-T17"])
    with pytest.raises(dispatch.KernelUnavailableError, match="rolling attention"):
        rolling_attention(**ROLLING_CASES["frames-3d-ring2"][0])


def test_forced_triton_refuses_inputs_the_kernel_cannot_take(monkeypatch):
    """float64, and ropes whose coordinates the kernel does not compute (LlamaGen's 2-D grid)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(dispatch.ENV, "triton")
    with pytest.raises(dispatch.KernelUnavailableError, match="float64"):
        tree_attention(**_cast(TREE_CASES["chain-gqa-T17"], torch.float64))
    kw = dict(ROLLING_CASES["tokens-1d-compact"][0], rope=GridRope2D(16, grid_size=4))
    with pytest.raises(dispatch.KernelUnavailableError, match="GridRope2D"):
        rolling_attention(**kw)
    monkeypatch.setenv(dispatch.ENV, "auto")  # auto falls back silently, to the reference
    assert torch.equal(rolling_attention(**kw), rolling_attention_reference(**kw))


def test_forced_triton_is_used_under_the_interpreter(monkeypatch):
    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setattr(tree_mod, "tree_attention_triton", lambda *a, **k: calls.append("tree"))
    monkeypatch.setattr(rolling_mod, "rolling_attention_triton", lambda *a, **k: calls.append("rolling"))
    tree_attention(**TREE_CASES["tree-T17"])
    rolling_attention(**ROLLING_CASES["tokens-1d-ring5"][0])
    assert calls == ["tree", "rolling"]


@pytest.mark.parametrize("env,device,interpret,available,unsupported,expected", [
    ({}, "cuda", False, True, None, True),
    ({}, "cpu", True, True, None, False),
    ({}, "cuda", False, False, None, False),
    ({}, "cuda", False, True, "float64", False),
    ({"MMSPEC_KERNELS": "torch"}, "cuda", False, True, None, False),
    ({"MMSPEC_DISABLE_KERNELS": "1"}, "cuda", False, True, None, False),
    ({"MMSPEC_KERNELS": "triton"}, "cuda", False, True, None, True),
    ({"MMSPEC_KERNELS": "TRITON"}, "cpu", True, True, None, True),
    ({"MMSPEC_KERNELS": "triton"}, "cpu", False, True, None, "TRITON_INTERPRET=1"),
    ({"MMSPEC_KERNELS": "triton"}, "cuda", False, False, None, "triton is not installed"),
    ({"MMSPEC_KERNELS": "triton"}, "cuda", False, True, "float64", "float64"),
])
def test_use_triton(monkeypatch, env, device, interpret, available, unsupported, expected):
    for name in ("MMSPEC_KERNELS", "MMSPEC_DISABLE_KERNELS", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ("op", torch.device(device), unsupported, available)
    if isinstance(expected, bool):
        assert dispatch.use_triton(*args) is expected
    else:
        with pytest.raises(dispatch.KernelUnavailableError, match=expected):
            dispatch.use_triton(*args)


def test_long_rolling_blocks_take_the_reference_unless_forced(monkeypatch):
    """Auto mode keeps the fused rotation to blocks of at most 128 queries (``dispatch.PREFERRED``; longer
    ones re-rotate every key per query tile); forcing Triton runs the kernel anyway."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    cuda = torch.device("cuda")
    assert dispatch.use_triton("op", cuda, None, True, preferred=True)
    assert not dispatch.use_triton("op", cuda, None, True, preferred=False)
    monkeypatch.setenv(dispatch.ENV, "triton")
    assert dispatch.use_triton("op", cuda, None, True, preferred=False)
    calls = []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(rolling_mod, "rolling_attention_triton", lambda *a, **k: calls.append(a[0].shape[2]))
    g = torch.Generator().manual_seed(6)
    T = dispatch.PREFERRED["rolling attention"]["max_queries"] + 1
    q, k, v = _qkv(1, 2, 2, T, T + 8, 16, g)
    lengths = torch.tensor([8])
    rolling_attention(q, k, v, lengths, lengths, 8 + torch.arange(T)[None], Rope1D(16), sink=0, window=8)
    assert calls == [T]


def test_auto_mode_follows_the_h200_measurements(monkeypatch):
    """The GPU check (H200, 2026-11-28): SDPA beat the tree kernel at every fp16/bf16 shape, and
    the rolling kernel beat SDPA only over short windows. The one table (``dispatch.PREFERRED``)
    says so: auto mode asks for the tree kernel with preferred=False (so it takes the reference)
    and for the rolling kernel only for blocks of at most 128 queries over at most 256 keys;
    cache and functional paths ask alike, through the dispatchers."""
    preferred = dispatch.preferred
    assert not preferred("tree attention", 60, 4096) and not preferred("tree attention", 1, 1)
    Q, K = dispatch.PREFERRED["rolling attention"]["max_queries"], dispatch.PREFERRED["rolling attention"]["max_keys"]
    assert (Q, K) == (128, 256)
    assert preferred("rolling attention", 4, 4 + 251) and preferred("rolling attention", Q, K)
    assert not preferred("rolling attention", Q + 1, 8)
    assert not preferred("rolling attention", 60, 4 + 4092) and not preferred("rolling attention", 4, 1 + K)
    assert preferred("guided acceptance") and preferred("residual")
    with pytest.raises(ValueError, match="op must be one of"):
        preferred("attention")
    asked = []
    record = lambda op, device, unsupported=None, available=True, preferred=True: asked.append((op, preferred))  # noqa: E731
    monkeypatch.setattr(tree_mod, "use_triton", record)
    monkeypatch.setattr(rolling_mod, "use_triton", record)
    tree_attention(**TREE_CASES["tree-T17"])
    case = ROLLING_CASES["tokens-1d-ring5"][0]
    rolling_attention(**case)
    with pytest.raises(ValueError, match="sink \\+ window"):  # asked first; the small buffer then refuses it
        rolling_attention(**dict(case, window=K + 1 - case["sink"]))
    assert asked == [("tree attention", False), ("rolling attention", True), ("rolling attention", False)]


def test_considered_never_hides_a_kernel_use_triton_would_pick(monkeypatch):
    monkeypatch.delenv("MMSPEC_DISABLE_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for mode, cpu, cuda in [("auto", False, True), ("torch", False, False), ("triton", True, True)]:
        monkeypatch.setenv(dispatch.ENV, mode)
        assert dispatch.considered(torch.device("cpu")) is cpu
        assert dispatch.considered(torch.device("cuda")) is cuda
        for device in ("cpu", "cuda"):
            if dispatch.use_triton("op", torch.device(device), None, True):
                assert dispatch.considered(torch.device(device))


def test_bad_switch_values(monkeypatch):
    monkeypatch.setenv("MMSPEC_KERNELS", "cuda")
    with pytest.raises(ValueError, match="MMSPEC_KERNELS must be one of 'auto', 'triton', 'torch'"):
        dispatch.mode()
    monkeypatch.setenv("MMSPEC_KERNELS", "triton")
    monkeypatch.setenv("MMSPEC_DISABLE_KERNELS", "1")
    with pytest.raises(ValueError, match="MMSPEC_DISABLE_KERNELS=1"):
        dispatch.mode()


@pytest.mark.parametrize("bad,message", [
    (dict(prefix_lens=torch.tensor([1.0, 2.0])), "prefix_lens must be"),
    (dict(k=torch.zeros(2, 4, 60, 24), v=torch.zeros(2, 4, 60, 24)), "k must be"),
    (dict(tree_mask=torch.ones(2, 16, 17, dtype=torch.bool)), "tree_mask must be"),
])
def test_tree_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        tree_attention_reference(**dict(TREE_CASES["chain-gqa-T17"], **bad))


@pytest.mark.parametrize("bad,message", [
    (dict(ring_start=torch.tensor([13, 0, 0])), "ring_start must be in"),
    (dict(lengths=torch.tensor([16, 0, 0])), "lengths must be in"),
    (dict(block_start=torch.tensor([100, 0, 0])), "block_start must be in"),
    (dict(window=0), "window must be an int >= 1"),
])
def test_rolling_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        rolling_attention_reference(**dict(ROLLING_CASES["tokens-1d-ring5"][0], **bad))


# -- compiled kernels on a GPU --------------------------------------------------------------------
# The interpreter hides two GPU-only failure modes: tl.dot refusing K < 16 for fp16/bf16 (head dims
# 8 and 24 and one-query tiles below make the launcher's padding matter), and bf16 arithmetic,
# which the interpreter gets wrong and the GPU path runs natively (no upcast). Shapes are realistic
# so that several key tiles, query tiles and ragged ends are crossed.
@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D,T,Hq,Hkv", [(8, 1, 4, 4), (24, 17, 6, 3), (128, 60, 32, 8), (64, 129, 12, 12)])
def test_tree_kernel_on_cuda(monkeypatch, dtype, D, T, Hq, Hkv):
    monkeypatch.setenv(dispatch.ENV, "triton")
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(2, Hq, Hkv, T, 4096 + T, D, g)
    kw = dict(q=q, k=k, v=v, prefix_lens=torch.tensor([4096, 1000]), tree_mask=_random_tree(2, T, g).ancestor_mask)
    out = tree_attention(**_cast({**kw, **{n: kw[n].cuda() for n in kw if kw[n] is not None}}, dtype))
    _assert_close(out.cpu(), tree_attention_reference, kw, dtype, slack=CUDA_FP32_SLACK if dtype == torch.float32
                  else 0.0)


@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(ROLLING_CASES))
def test_rolling_kernel_on_cuda(monkeypatch, dtype, name):
    monkeypatch.setenv(dispatch.ENV, "triton")
    kw = ROLLING_CASES[name][0]
    moved = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    out = rolling_attention(**_cast(moved, dtype))
    _assert_close(out.cpu(), rolling_attention_reference, kw, dtype, slack=CUDA_FP32_SLACK if dtype == torch.float32
                  else 0.0)


@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(TREE_CASES))
def test_tree_kernel_on_cuda_at_the_interpreter_cases(monkeypatch, dtype, name):
    """The interpreter's tree cases compiled: among them the causal block (no tree mask), the only
    one that takes the kernel's HAS_TREE=False path, and a mask wider than the block."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    kw = TREE_CASES[name]
    moved = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    out = tree_attention(**_cast(moved, dtype))
    _assert_close(out.cpu(), tree_attention_reference, kw, dtype, slack=CUDA_FP32_SLACK if dtype == torch.float32
                  else 0.0)


@pytest.mark.cuda
@needs_triton
@needs_cuda
def test_rolling_kernel_on_cuda_at_video_scale(monkeypatch):
    """A 3-frame chunk of 8 x 8 tokens over a 1 + 7 frame cache, Wan's head dim 128, bf16: large
    positions and every RoPE axis, several tiles in both directions."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    g = torch.Generator().manual_seed(5)
    fs, D = 64, 128
    rope = Rope3D(D, frame_shape=(8, 8))
    T, sink, window = 3 * fs, fs, 7 * fs
    q, k, v = _qkv(1, 12, 12, T, sink + window + T, D, g)
    kw = dict(q=q, k=k, v=v, lengths=torch.tensor([sink + window]), block_start=torch.tensor([sink + window]),
              positions=(sink + window + torch.arange(T))[None], ring_start=torch.tensor([3 * fs]), rope=rope,
              sink=sink, window=window, tree_mask=torch.ones(1, T, T, dtype=torch.bool))
    moved = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    _assert_close(rolling_attention(**_cast(moved, torch.bfloat16)).cpu(), rolling_attention_reference, kw,
                  torch.bfloat16)
