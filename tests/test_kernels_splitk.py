"""Split-K (flash-decoding) in the attention kernels: both kernels against their torch references in
Triton's interpreter with 1, 2 and 3 forced key splits and the automatic count, over ragged rows
whose late splits are empty, GQA, a head dim that is not a power of two, fp32, fp16 and bf16; the
split-count rule; which launches one and several splits make; and a combine without its
log-sum-exp rescale, which these comparisons catch. Tolerances are tests/test_kernels_attention.py's."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from test_kernels_attention import _assert_close, _cast, _random_tree

from mmspec import kernels
from mmspec.core.rope import Rope1D, Rope3D
from mmspec.kernels import dispatch, splitk
from mmspec.kernels.interpret import run_interpreted
from mmspec.kernels.rolling_attention import rolling_attention_reference
from mmspec.kernels.tree_attention import tree_attention_reference

needs_triton = pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SPLITS = (1, 2, 3, None)  # None: the automatic count (3 here: every case has 3 key tiles of 64)
HALF_SPLITS = (2, None)  # fp16 and bf16, to keep the interpreter's time down


def _cases() -> dict:
    """name -> (function, reference, fp32 kwargs, dtypes). Every case spans 3 key tiles of 64 slots
    and has rows that end in the first or second tile, so 2 or 3 splits leave them empty splits."""
    g = torch.Generator().manual_seed(11)
    cases = {}
    # a 7-node tree, 4 query heads over 2 key/value heads, head dim 24; rows end at 150, 67 and 7
    q, k, v = torch.randn(3, 4, 7, 24, generator=g), torch.randn(3, 2, 150, 24, generator=g), \
        torch.randn(3, 2, 150, 24, generator=g)
    cases["tree-gqa-ragged"] = ("tree_attention_triton", tree_attention_reference,
                                dict(q=q, k=k, v=v, prefix_lens=torch.tensor([143, 60, 0]),
                                     tree_mask=_random_tree(3, 7, g).ancestor_mask), ("fp32", "fp16", "bf16"))
    # a causal 20-token block (no tree mask); rows end at 140 and 30
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (20, 140, 140))
    cases["tree-causal-ragged"] = ("tree_attention_triton", tree_attention_reference,
                                   dict(q=q, k=k, v=v, prefix_lens=torch.tensor([120, 10]), tree_mask=None),
                                   ("fp32", "bf16"))
    # tokens, 1-D RoPE, GQA 4 over 2: a full wrapped ring (sink 4 + window 125) and two compact rows
    # (50 and 3 entries) under a causal 4-token block; rows end at 133, 54 and 7
    lengths = torch.tensor([129, 50, 3])
    q, k, v = torch.randn(3, 4, 4, 16, generator=g), torch.randn(3, 2, 133, 16, generator=g), \
        torch.randn(3, 2, 133, 16, generator=g)
    cases["rolling-gqa-ragged"] = ("rolling_attention_triton", rolling_attention_reference,
                                   dict(q=q, k=k, v=v, lengths=lengths, block_start=lengths.clone(),
                                        positions=lengths[:, None] + torch.arange(4), rope=Rope1D(16), sink=4,
                                        window=125, ring_start=torch.tensor([37, 0, 0])), ("fp32", "fp16", "bf16"))
    # frames of 2 x 3 tokens, 3-D RoPE, head dim 24, a 6-node tree block; rows end at 132 and 36
    lengths = torch.tensor([126, 30])
    q, k, v = (torch.randn(2, 2, n, 24, generator=g) for n in (6, 132, 132))
    cases["rolling-3d-tree"] = ("rolling_attention_triton", rolling_attention_reference,
                                dict(q=q, k=k, v=v, lengths=lengths, block_start=lengths.clone(),
                                     positions=lengths[:, None] + torch.arange(6), rope=Rope3D(24, frame_shape=(2, 3)),
                                     sink=6, window=120, ring_start=torch.tensor([17, 0]),
                                     tree_mask=_random_tree(2, 6, g).ancestor_mask), ("fp32", "fp16"))
    return cases


CASES = _cases()


def _calls() -> dict:
    calls = {}
    for name, (fn, _, kw, tags) in CASES.items():
        for tag in tags:
            for splits in SPLITS if tag == "fp32" else HALF_SPLITS:
                calls[f"{name}/{tag}/{splits}"] = (fn, (), dict(_cast(kw, DTYPES[tag]), num_splits=splits))
    # a caller's workspace, larger than needed and full of NaN: every split program writes its part
    need = splitk.workspace_numel(3, *CASES["tree-gqa-ragged"][2]["q"].shape)
    calls["tree-gqa-ragged/fp32/3/workspace"] = (
        "tree_attention_triton", (), dict(CASES["tree-gqa-ragged"][2], num_splits=3,
                                          workspace=torch.full((need + 5,), float("nan"))))
    return calls


CALLS = _calls()


@pytest.fixture(scope="module")
def kernel_outputs() -> dict:
    """Every call, run once in Triton's interpreter in a child process."""
    if not dispatch.TRITON_AVAILABLE:
        pytest.skip("triton is not installed")
    return run_interpreted(CALLS)


@needs_triton
@pytest.mark.parametrize("call", list(CALLS))
def test_split_kernels_match_reference(kernel_outputs, call):
    name, tag = call.split("/")[:2]
    _, reference, kw, _ = CASES[name]
    out = kernel_outputs[call]
    assert isinstance(out, torch.Tensor), out
    assert bool(out.isfinite().all())
    _assert_close(out, reference, kw, DTYPES[tag])


# -- the split count --------------------------------------------------------------------------------
def test_split_count_fills_two_waves():
    """A 60-node tree over 4,096 keys with 32 heads (head dim 128: key tiles of 32) at batch 1 is
    32 programs on an H100's 132 multiprocessors: split until two waves (264 programs) are full."""
    assert splitk.DEFAULT_SM_COUNT == 132 and splitk.sm_count(torch.device("cpu")) == 132
    n = splitk.choose_num_splits(32, 4096, 32)
    assert n == 9 and 32 * n >= 2 * 132 > 32 * (n - 1)
    assert splitk.choose_num_splits(32, 4096, 32, sm_count=16) == 1  # 32 programs fill 2 waves of 16
    assert splitk.choose_num_splits(264, 4096, 64) == 1  # a grid that fills two waves alone
    assert splitk.choose_num_splits(8 * 32 * 2, 4096, 64) == 1
    assert splitk.choose_num_splits(1, 200, 64) == 4  # never more splits than key tiles
    assert splitk.choose_num_splits(6, 60, 64) == 1  # one key tile
    assert splitk.choose_num_splits(12, 150, 64) == 3  # the interpreter cases above
    for tiles in range(1, 300, 7):
        for keys in range(0, 5000, 97):
            for block_n, sms in ((32, 132), (64, 132), (64, 78)):
                n = splitk.choose_num_splits(tiles, keys, block_n, sms)
                key_tiles = max(1, -(-keys // block_n))
                assert 1 <= n <= key_tiles
                assert n == 1 if tiles >= 2 * sms else (tiles * n >= 2 * sms or n == key_tiles)
                assert (n - 1) * -(-key_tiles // n) < key_tiles  # no split is empty for a full row


def test_an_allocator_workspace_is_asked_only_when_splitting():
    """``workspace`` may be the caller's allocator (the caches' ``workspace``): called with the
    elements the split needs, not at all for one split; a cache keeps one buffer per size."""
    from mmspec.core.cache import StaticKVCache

    q = torch.zeros(1, 4, 7, 24)
    asked = []
    alloc = lambda n: asked.append(n) or torch.empty(n)  # noqa: E731
    assert splitk.plan(q, 150, 16, 64, 1, alloc).partial is None and asked == []
    split = splitk.plan(q, 150, 16, 64, 3, alloc)
    assert asked == [splitk.workspace_numel(3, 1, 4, 7, 24)] and split.partial.shape == (3, 1, 4, 7, 24)
    cache = StaticKVCache(1, 1, 4, 24, max_len=8)
    a = cache.workspace(100)
    assert a is cache.workspace(100) and a.dtype == torch.float32 and a.numel() == 100
    assert cache.workspace(50) is not a


def test_split_count_rejects_bad_input():
    with pytest.raises(ValueError, match="tiles, keys, block_n, sm_count"):
        splitk.choose_num_splits(0, 100, 64)


# -- launches (compiled mode, nothing run) -------------------------------------------------------
@pytest.fixture
def launches(monkeypatch) -> list:
    """Every Triton launch recorded instead of run: (kernel name, grid, args)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("under TRITON_INTERPRET=1 the kernels were decorated for the interpreter")
    from triton.runtime import jit

    calls = []
    monkeypatch.setattr(jit.JITFunction, "run",
                        lambda self, *args, grid, warmup, **kw: calls.append((self.fn.__name__, grid, args)))
    return calls


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_one_split_stores_directly_and_more_go_through_the_workspace(launches, name):
    fn, _, kw, _ = CASES[name]
    B, H, T, D = kw["q"].shape
    getattr(kernels, fn)(**kw, num_splits=1)
    kernel = "_" + fn.removesuffix("_triton") + "_kernel"
    assert [(n, grid[2]) for n, grid, _ in launches] == [(kernel, 1)]
    launches.clear()
    workspace = torch.empty(splitk.workspace_numel(3, B, H, T, D))
    getattr(kernels, fn)(**kw, num_splits=3, workspace=workspace)
    (name, grid, args), (merge, merge_grid, merge_args) = launches
    assert name == kernel and grid[1:] == (B * H, 3) and merge == "_merge_splits_kernel" and merge_grid == (1, B * H)
    partial, lse = args[4], args[5]  # the kernel's PART and LSE: views of the caller's workspace
    assert partial.data_ptr() == workspace.data_ptr() and lse.data_ptr() == workspace.data_ptr() + 4 * 3 * B * H * T * D
    assert merge_args[0] is partial and merge_args[1] is lse


@needs_triton
def test_a_bad_workspace_is_refused(launches):
    kw = CASES["tree-gqa-ragged"][2]
    need = splitk.workspace_numel(2, *kw["q"].shape)
    for bad in (torch.empty(need - 1), torch.empty(need, dtype=torch.float16), torch.empty(need, 2)[:, 0]):
        with pytest.raises(ValueError, match="workspace must be a contiguous float32 tensor"):
            kernels.tree_attention_triton(**kw, num_splits=2, workspace=bad)
    with pytest.raises(ValueError, match="num_splits must be None or an int >= 1"):
        kernels.rolling_attention_triton(**CASES["rolling-gqa-ragged"][2], num_splits=0)
    assert launches == []


# -- the comparisons catch a broken combine -------------------------------------------------------
_CHILD = textwrap.dedent('''
    import pickle, sys
    import torch
    from mmspec import kernels
    from mmspec.kernels import splitk

    torch.set_num_threads(1)

    def lse_merge(partial, lse, out, block_m, block_d):
        """The combine in torch: each split weighted by exp2(lse - max lse)."""
        w = torch.exp2(lse - lse.amax(0).clamp_min(-1e30))  # (S, B, H, T)
        out.copy_((w[..., None] * partial).sum(0) / w.sum(0).clamp_min(1e-30)[..., None])

    def no_rescale(partial, lse, out, block_m, block_d):
        """The combine without its rescale: every split that saw a key weighted alike."""
        w = (lse > float("-inf")).float()
        out.copy_((w[..., None] * partial).sum(0) / w.sum(0).clamp_min(1)[..., None])

    calls = pickle.load(open(sys.argv[1], "rb"))
    results = {}
    for merge in (lse_merge, no_rescale):
        splitk.merge_splits = merge
        results.update({(merge.__name__, name): getattr(kernels, fn)(**kw) for name, (fn, kw) in calls.items()})
    pickle.dump(results, open(sys.argv[2], "wb"))
''')


@needs_triton
def test_a_combine_without_the_rescale_is_caught(tmp_path):
    """The kernels' split outputs merged in torch: by their lse they match the reference, weighted
    alike (the max / lse rescale dropped) they miss it by far more than the tolerance."""
    names = ("tree-gqa-ragged", "rolling-gqa-ragged")
    calls = {name: (CASES[name][0], dict(CASES[name][2], num_splits=n)) for name, n in zip(names, (2, 3))}
    (tmp_path / "child.py").write_text(_CHILD)
    (tmp_path / "calls.pkl").write_bytes(pickle.dumps(calls))
    env = {**os.environ, "TRITON_INTERPRET": "1", "MMSPEC_KERNELS": "triton"}
    proc = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "calls.pkl"),
                           str(tmp_path / "out.pkl")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = pickle.loads((tmp_path / "out.pkl").read_bytes())
    for name in names:
        _, reference, kw, _ = CASES[name]
        _assert_close(results["lse_merge", name], reference, kw, torch.float32)
        with pytest.raises(AssertionError):
            _assert_close(results["no_rescale", name], reference, kw, torch.float32)
        assert (results["no_rescale", name] - reference(**kw)).abs().max() > 1e-2


# -- compiled on a GPU ---------------------------------------------------------------------------
@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_split_kernels_on_cuda(monkeypatch, dtype, splits):
    """The issue's shape: a 60-node tree over 4,096 keys, 32 query heads over 8, head dim 128, with
    a second row that ends after 1,000 keys; and a rolling window of the same length."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    g = torch.Generator().manual_seed(12)
    T, S, D = 60, 4096 + 60, 128
    q, k, v = torch.randn(2, 32, T, D, generator=g), torch.randn(2, 8, S, D, generator=g), \
        torch.randn(2, 8, S, D, generator=g)
    kw = dict(q=q, k=k, v=v, prefix_lens=torch.tensor([4096, 1000]), tree_mask=_random_tree(2, T, g).ancestor_mask)
    moved = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    out = kernels.tree_attention_triton(**_cast(moved, dtype), num_splits=splits)
    _assert_close(out.cpu(), tree_attention_reference, kw, dtype, slack=1e-5 if dtype == torch.float32 else 0.0)
    lengths = torch.tensor([4096, 1000])
    kw = dict(q=q[:, :, :4], k=k, v=v, lengths=lengths, block_start=lengths.clone(),
              positions=lengths[:, None] + torch.arange(4), rope=Rope1D(D), sink=4, window=4092,
              ring_start=torch.tensor([1234, 0]))
    moved = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    out = kernels.rolling_attention_triton(**_cast(moved, dtype), num_splits=splits)
    _assert_close(out.cpu(), rolling_attention_reference, kw, dtype, slack=1e-5 if dtype == torch.float32 else 0.0)
