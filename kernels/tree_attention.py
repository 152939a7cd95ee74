"""Tree-verify attention: a draft tree's nodes attend to their row's cached prefix and to their
own ancestors in the tree, in one pass (SpecInfer's tree attention, Miao et al., 2024; EAGLE-2's
verification, Li et al., 2024), with FlashAttention's online softmax (Dao et al., 2022).

Layout (the core's ``StaticKVCache`` after ``step``): row b's keys sit in slots ``0 .. S - 1``;
slots ``[0, prefix_lens[b])`` are its committed prefix, visible to every query; the next ``W``
slots are the block (the tree's nodes) and follow ``tree_mask[b]`` (B, T, W) (query t sees block
slot j where it is True; None: causal, W = T); later slots are hidden. This is
``mmspec.core.cache.visibility_mask(prefix_lens + W, T, S, tree_mask)``, which the models hand to
``F.scaled_dot_product_attention``; the kernel builds the mask from ``prefix_lens`` and the
(B, T, W) tree mask tile by tile instead of reading a (B, 1, T, S) one, and stops each row's key
loop at its own end. Short grids (few rows and heads over many keys) split the keys as
flash-decoding does and merge the splits by their log-sum-exp (``mmspec.kernels.splitk``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch.nn import functional as F

from . import splitk
from .torch_ops import visibility_mask
from mmspec.utils.errors import check

from .dispatch import TRITON_AVAILABLE, dtype_problem, interpreted, preferred, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .splitk import attend_tile, split_range, store_tile


def visibility(prefix_lens: torch.Tensor, T: int, S: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, T, S) bool: the mask the kernel applies, materialised (the reference's input): the
    core's ``visibility_mask`` for a block that ends ``W`` slots past ``prefix_lens``."""
    W = T if tree_mask is None else tree_mask.shape[-1]
    return visibility_mask(prefix_lens + W, T, S, None if tree_mask is None else tree_mask.bool())


def _check_inputs(q, k, v, prefix_lens, tree_mask):
    check(q.dim() == 4 and k.dim() == 4 and v.shape == k.shape, "q, k, v",
          "(B, Hq, T, D), (B, Hkv, S, D) and v shaped like k", (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    B, Hq, T, D = q.shape
    check(k.shape[0] == B and k.shape[3] == D and Hq % k.shape[1] == 0, "k", f"(B={B}, Hkv, S, D={D}) with Hkv "
          f"dividing Hq={Hq} (grouped-query attention)", tuple(k.shape))
    check(prefix_lens.shape == (B,) and not prefix_lens.is_floating_point(), "prefix_lens",
          f"a ({B},) integer tensor", (tuple(prefix_lens.shape), prefix_lens.dtype))
    W = T if tree_mask is None else tree_mask.shape[-1]
    if tree_mask is not None:
        check(tree_mask.dim() == 3 and tree_mask.shape[:2] == (B, T) and W >= 1, "tree_mask",
              f"None or a (B={B}, T={T}, W) bool tensor", tuple(tree_mask.shape))
    return W


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                             tree_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """q (B, Hq, T, D), k and v (B, Hkv, S, D), prefix_lens (B,) -> (B, Hq, T, D): what the models
    compute today, ``scaled_dot_product_attention`` with the dense mask ``visibility(...)``.

    Every query must see at least one key (true for ancestor masks, which hold the diagonal)."""
    _check_inputs(q, k, v, prefix_lens, tree_mask)
    mask = visibility(prefix_lens, q.shape[2], k.shape[2], tree_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


if TRITON_AVAILABLE:

    # Memory traffic per (row, head): Q and O once (Q once per key split, plus D + 1 fp32 per query
    # and split to the workspace and back when split), each key/value tile of the row's visible
    # range once per query tile (one query tile when T <= BLOCK_M, the usual tree), the tree mask
    # tiles that overlap the block. The reference reads a (B, 1, T, S) mask and, on the math path,
    # writes and re-reads (B, H, T, S) scores and probabilities; here scores live in registers.
    @triton.jit
    def _tree_attention_kernel(
        Q, K, V, O, PART, LSE, PREFIX, TMASK, sm_scale, T, S, W, H, GROUP, D, split_keys,
        sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot, smb, smt,
        HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One program per (query tile, row x head, key split): online softmax over the split's
        share of the row's visible keys (``splitk``)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // GROUP  # grouped-query attention: GROUP query heads share a key/value head
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < T
        d_ok = offs_d < D
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # bf16 arithmetic is wrong in Triton's interpreter: compute in fp32 there
            q = q.to(tl.float32)
        prefix = tl.load(PREFIX + b).to(tl.int32)
        end = tl.minimum(prefix + W, S)  # this row's last visible slot + 1
        lo, hi = split_range(end, split_keys, SPLIT)
        qk_scale = sm_scale * 1.4426950408889634  # exp2 below: fold log2(e) into the scale

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            rel = offs_n - prefix  # (BLOCK_N,) slot relative to the block
            visible = (rel < 0)[None, :]
            if HAS_TREE:
                in_tree = (rel >= 0) & (rel < W)
                tm = tl.load(TMASK + b * smb + offs_m[:, None] * smt + rel[None, :],
                             mask=row_ok[:, None] & in_tree[None, :], other=0)
                visible = visible | (tm != 0)
            else:  # causal inside the block
                visible = visible | ((rel >= 0)[None, :] & (rel[None, :] <= offs_m[:, None]))
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, visible & n_ok[None, :], qk_scale, IEEE)
        store_tile(acc, m_i, l_i, O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], PART, LSE, bh,
                   offs_m, offs_d, T, D, row_ok[:, None] & d_ok[None, :], row_ok, SPLIT)


def tree_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                          tree_mask: torch.Tensor | None = None, scale: float | None = None, *,
                          num_splits: int | None = None, workspace=None) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``); same contract as the
    reference, output in q's dtype.

    ``num_splits``: key splits (flash-decoding split-K, ``mmspec.kernels.splitk``); None picks
    them from the shapes and the GPU's multiprocessors (``splitk.choose_num_splits``). ``workspace``:
    fp32 scratch of at least ``splitk.workspace_numel(num_splits, B, Hq, T, D)`` elements for more
    than one split, or an allocator ``workspace(numel) -> tensor`` (None: allocated per call)."""
    W = _check_inputs(q, k, v, prefix_lens, tree_mask)
    check(q.dtype == k.dtype == v.dtype, "q, k, v", "one dtype", (q.dtype, k.dtype, v.dtype))
    B, Hq, T, D = q.shape
    S = k.shape[2]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (B, Hq, T, D)
    if out.numel() == 0:
        return out
    prefix = prefix_lens.to(device=q.device, dtype=torch.int32).contiguous()
    tm = None if tree_mask is None else tree_mask.to(device=q.device, dtype=torch.int8).contiguous()
    # tl.dot needs K >= 16 for fp16/bf16 on a GPU (the interpreter accepts less): both the head-dim
    # tile (q k^T) and the key tile (p v) stay >= 16
    BLOCK_M, BLOCK_N, BLOCK_D = splitk.tile_sizes(T, D)
    split = splitk.plan(q, S, BLOCK_M, BLOCK_N, num_splits, workspace)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    grid = (triton.cdiv(T, BLOCK_M), B * Hq, split.count)
    device = torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext()
    with device:
        _tree_attention_kernel[grid](
            q, k, v, out, out if split.partial is None else split.partial, out if split.lse is None else split.lse,
            prefix, prefix if tm is None else tm, scale, T, S, W, Hq, Hq // k.shape[1], D, split.keys,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            0 if tm is None else tm.stride(0), 0 if tm is None else tm.stride(1),
            HAS_TREE=tm is not None, SPLIT=split.count > 1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            UPCAST=q.dtype == torch.bfloat16 and interpreted(), IEEE=q.dtype == torch.float32,
            num_warps=4, num_stages=2)
        if split.count > 1:
            splitk.merge_splits(split.partial, split.lse, out, BLOCK_M, BLOCK_D)
    return out


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                   tree_mask: torch.Tensor | None = None, scale: float | None = None, *,
                   reference: Callable[[], torch.Tensor] | None = None, **kernel_options) -> torch.Tensor:
    """Tree-verify attention (module docstring): the Triton kernel where auto mode expects it to
    win (``dispatch.PREFERRED``: nowhere, as measured on an H200) or ``MMSPEC_KERNELS=triton``
    forces it, the torch path otherwise (``mmspec.kernels.dispatch``).

    ``reference``: the caller's own torch path for these inputs, called with no arguments (a
    cache's, on the mask it already built); None: ``tree_attention_reference``.
    ``kernel_options``: ``num_splits``, ``workspace`` (``tree_attention_triton``)."""
    problem = dtype_problem(q, k, v) or (None if q.dtype == k.dtype == v.dtype else "q, k, v differ in dtype")
    if use_triton("tree attention", q.device, problem, preferred=preferred("tree attention", q.shape[2], k.shape[2])):
        return tree_attention_triton(q, k, v, prefix_lens, tree_mask, scale, **kernel_options)
    return reference() if reference is not None else tree_attention_reference(q, k, v, prefix_lens, tree_mask, scale)
