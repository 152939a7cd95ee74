"""What the attention kernels share: FlashAttention's online-softmax tile (Dao et al., 2022) and
flash-decoding's split-K (Dao, Haziza, Massa and Sizov, "Flash-Decoding for long-context
inference", 2023), with the splits merged by their log-sum-exp as FlashInfer's ``merge_state``
and cascade attention merge partial attention states (Ye et al., 2025).

One program per (query tile, row x head) walks all of its row's keys alone: a 60-query tree over
4,096 keys with 32 heads is 32 programs, a quarter of an H100's 132 multiprocessors. Split-K adds
a third grid axis: split ``s`` walks key slots ``[s * split_keys, (s + 1) * split_keys)`` (whole
key tiles) of every row, clipped to the row's own end, so a row whose keys end early leaves its
late splits empty. Each split program writes its output normalised by its own softmax sum and
that sum's log-sum-exp (base 2, in the kernels' scaled-score domain) to an fp32 workspace; a small
combine kernel weights each split by ``exp2(lse_s - max_s lse_s)`` and writes the output. A split
that saw no key holds a zero output and lse ``-inf``: weight 0, never a NaN. One split stores the
output directly, as before (no workspace, no combine).

Workspace (fp32, contiguous, at least ``workspace_numel`` elements; the caller may preallocate it,
or pass an allocator ``workspace(numel) -> tensor`` that keeps one per size, as the core's caches
do, so a captured step replays on the same buffer): partial outputs (splits, B, H, T, D), then lse (splits, B, H, T).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mmspec.utils.errors import check, check_int

from .dispatch import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

DEFAULT_SM_COUNT = 132
"""Multiprocessors assumed off CUDA (Triton's interpreter, compile checks): an H100 or H200 SXM."""
WAVES = 2
"""Split until the grid holds at least this many programs per multiprocessor."""


def choose_num_splits(tiles: int, keys: int, block_n: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Key splits for a grid of ``tiles`` (rows x heads x query tiles) programs over ``keys`` key
    slots in tiles of ``block_n``: 1 when the grid already fills ``WAVES`` waves of ``sm_count``
    multiprocessors, else the fewest splits of equally many whole key tiles (the last one shorter)
    that fill them, never more splits than key tiles.

    ``sm_count`` defaults to ``DEFAULT_SM_COUNT`` so that the choice off CUDA is deterministic;
    the kernels pass ``sm_count(device)``."""
    check(tiles >= 1 and keys >= 0 and block_n >= 1 and sm_count >= 1, "tiles, keys, block_n, sm_count",
          "tiles, block_n, sm_count >= 1 and keys >= 0", (tiles, keys, block_n, sm_count))
    target = WAVES * sm_count
    key_tiles = max(1, -(-keys // block_n))
    if tiles >= target:
        return 1
    wanted = -(-target // tiles)  # >= 2
    if wanted >= key_tiles:
        return key_tiles
    per_split = (key_tiles - 1) // (wanted - 1)  # the most key tiles per split that still make >= wanted splits
    return -(-key_tiles // per_split)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The multiprocessors of ``device`` on CUDA, ``DEFAULT_SM_COUNT`` elsewhere."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def tile_sizes(T: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) of both attention kernels for T queries of head size D: query
    tiles of 16 to 64, key tiles of 64 (32 for head sizes over 64), the head padded to a power of
    two of at least 16 (``tl.dot``'s K for fp16/bf16 on a GPU)."""
    block_d = max(16, 1 << (D - 1).bit_length())
    return min(64, max(16, 1 << (T - 1).bit_length())), 64 if block_d <= 64 else 32, block_d


def auto_splits(q_shape: tuple[int, int, int, int], keys: int, device: torch.device) -> int:
    """The split count the launchers choose on ``device`` for queries of ``q_shape`` (B, Hq, T, D)
    over ``keys`` key slots (``choose_num_splits`` on ``tile_sizes``)."""
    B, H, T, D = q_shape
    block_m, block_n, _ = tile_sizes(T, D)
    return choose_num_splits(B * H * -(-T // block_m), keys, block_n, sm_count(device))


def workspace_numel(num_splits: int, B: int, H: int, T: int, D: int) -> int:
    """fp32 elements the workspace needs for ``num_splits`` splits of a (B, H, T, D) output."""
    return num_splits * B * H * T * (D + 1)


class SplitPlan(NamedTuple):
    """``count`` splits of ``keys`` key slots each; ``partial`` (count, B, H, T, D) and ``lse``
    (count, B, H, T) are views of the fp32 workspace (None for one split)."""

    count: int
    keys: int
    partial: torch.Tensor | None
    lse: torch.Tensor | None


def plan(q: torch.Tensor, keys: int, block_m: int, block_n: int, num_splits: int | None,
         workspace) -> SplitPlan:
    """The split of ``keys`` key slots for queries q (B, H, T, D): ``num_splits`` (None:
    ``choose_num_splits`` for q's device), over ``workspace``: a tensor, an allocator
    ``workspace(numel) -> tensor`` (called only when splitting), or None (allocated here)."""
    B, H, T, D = q.shape
    key_tiles = max(1, -(-keys // block_n))
    if num_splits is None:
        num_splits = choose_num_splits(B * H * -(-T // block_m), keys, block_n, sm_count(q.device))
    check_int(num_splits, "num_splits", 1, optional=True)
    if num_splits == 1:
        return SplitPlan(1, key_tiles * block_n, None, None)
    need = workspace_numel(num_splits, B, H, T, D)
    if workspace is None:
        workspace = torch.empty(need, device=q.device, dtype=torch.float32)
    elif callable(workspace):
        workspace = workspace(need)
    check(workspace.dtype == torch.float32 and workspace.device == q.device and workspace.is_contiguous()
          and workspace.numel() >= need, "workspace", f"a contiguous float32 tensor on {q.device} of at least "
          f"{need} elements (workspace_numel({num_splits}, {B}, {H}, {T}, {D}))",
          (workspace.dtype, workspace.device, workspace.numel()))
    flat = workspace.view(-1)
    n = num_splits * B * H * T
    # a forced count above the key tiles leaves its last splits empty; the combine weighs them 0
    per_split = -(-key_tiles // num_splits) * block_n
    return SplitPlan(num_splits, per_split, flat[:n * D].view(num_splits, B, H, T, D),
                     flat[n * D:n * (D + 1)].view(num_splits, B, H, T))


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, block_m: int, block_d: int) -> None:
    """out (B, H, T, D) <- the splits' partial outputs (S, B, H, T, D) weighted by their lse (S, B, H, T)."""
    S, B, H, T, D = partial.shape
    grid = (triton.cdiv(T, block_m), B * H)
    _merge_splits_kernel[grid](partial, lse, out, T, H, D, S, out.stride(0), out.stride(1), out.stride(2),
                               BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)


if TRITON_AVAILABLE:

    @triton.jit
    def split_range(end, split_keys, SPLIT: tl.constexpr):
        """The key slots [lo, hi) this program walks: its split's share of [0, end) (all of it for one split)."""
        if SPLIT:
            lo = tl.program_id(2) * split_keys
            hi = tl.minimum(end, lo + split_keys)
        else:
            lo = end * 0
            hi = end
        return lo, hi

    @triton.jit
    def attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, IEEE: tl.constexpr):
        """One key tile of the online softmax: q (M, BD), k and v (N, BD), visible (M, N) ->
        (acc (M, BD), running max m_i (M,), running sum l_i (M,)), in base 2 (``qk_scale`` holds
        log2(e)). A row that has seen no key keeps m_i = -inf, l_i = 0, acc = 0."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)  # fp16/bf16 operands, fp32 accumulation
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_i

    @triton.jit
    def store_tile(acc, m_i, l_i, o_ptrs, PART, LSE, bh, offs_m, offs_d, T, D, mask, row_ok, SPLIT: tl.constexpr):
        """The tile's output to ``o_ptrs`` (one split), or its partial output and lse to the
        workspace at (split, row x head ``bh``, query ``offs_m``)."""
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SPLIT:
            ws = (tl.program_id(2).to(tl.int64) * tl.num_programs(1) + bh) * T + offs_m  # (M,)
            tl.store(PART + ws[:, None] * D + offs_d[None, :], out, mask=mask)
            tl.store(LSE + ws, tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf")), mask=row_ok)
        else:
            tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _merge_splits_kernel(PART, LSE, O, T, H, D, NUM_SPLITS, sob, soh, sot,
                             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per (query tile, row x head): out = sum_s w_s o_s / sum_s w_s with
        w_s = exp2(lse_s - max lse), read from the workspace (S x (D + 1) floats per query)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        n_bh = tl.num_programs(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < T
        mask = row_ok[:, None] & (offs_d < D)[None, :]
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in range(NUM_SPLITS):
            m = tl.maximum(m, tl.load(LSE + (s * n_bh + bh) * T + offs_m, mask=row_ok, other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0, output 0
        den = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            ws = (s * n_bh + bh) * T + offs_m
            w = tl.exp2(tl.load(LSE + ws, mask=row_ok, other=float("-inf")) - m)
            acc += w[:, None] * tl.load(PART + ws[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
            den += w
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        b = bh // H
        h = bh % H
        tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask)
