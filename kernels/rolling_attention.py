"""Sink-window rolling attention with fused RoPE: a block of queries attends to a StreamingLLM
cache (Xiao et al., 2024: ``sink`` pinned entries plus a window of recent ones) whose keys are
stored *before* RoPE and rotated by their cache-order position while they are read, so the cache
is never re-rotated in memory after an eviction. Rotations are RoFormer's (Su et al., 2021), 1-D
or the (time, height, width) 3-D RoPE of video DiTs (``mmspec.core.rope.Rope3D``).

Layout of one layer's buffers k, v (B, Hkv, C, D):

- slots ``[0, sink)``: the sink; slot i holds cache-order entry i;
- slots ``[sink, sink + window)``: a circular window; cache-order entry ``i >= sink`` sits in slot
  ``sink + (ring_start[b] + i - sink) % window`` (``ring_start`` 0: compact, as
  ``mmspec.core.cache.SinkWindowCache`` keeps it);
- the block: T slots from ``block_start[b]``, entry t at sequence position ``positions[b, t]``
  (a draft tree's depths, or a video chunk's frames), ``tree_mask`` (B, T, T) among them (None:
  causal); they must not overlap a held entry. ``SinkWindowCache`` writes the block right after
  its committed entries (``block_start = lengths``); a ring buffer writes it past the window.

Row b holds ``lengths[b]`` entries before the block, at positions ``0 .. lengths[b] - 1``, all
visible to the block: at most ``sink + window`` in a wrapped ring; the compact layout (ring start
0) may hold more, past the window, at position = slot (a chain of drafts appended before the
cache rolls). Keys are rotated by their position, queries by theirs: exactly
``SinkWindowCache``'s read path (``rope(k, key_positions)``, ``rope(q, positions)``,
``scaled_dot_product_attention`` with its mask), which the reference below reproduces. Short
grids split the C key slots as flash-decoding does and merge the splits by their log-sum-exp
(``mmspec.kernels.splitk``); a row whose entries end early leaves its late splits empty.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Callable

import torch
from torch.nn import functional as F

from mmspec.utils.errors import check, check_int

from . import splitk
from .dispatch import TRITON_AVAILABLE, dtype_problem, interpreted, preferred, use_triton

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .splitk import attend_tile, split_range, store_tile


def slot_table(lengths: torch.Tensor, ring_start: torch.Tensor, block_start: torch.Tensor,
               positions: torch.Tensor, sink: int, window: int, C: int,
               tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> key positions (B, C) and the visibility (B, T, C) of every slot (the module's layout)."""
    B, T = positions.shape
    device = positions.device
    s = torch.arange(C, device=device)
    rel = s - block_start[:, None]  # (B, C)
    in_block = (rel >= 0) & (rel < T)
    t_blk = rel.clamp(0, T - 1)
    ring = ring_start[:, None]
    logical = torch.where(s < sink, s, torch.where(s < sink + window, sink + (s - sink - ring) % window, s))  # (B, C)
    held = ~in_block & (logical < lengths[:, None]) & ((s < sink + window) | (ring == 0))
    key_pos = torch.where(in_block, positions.gather(1, t_blk), logical)
    if tree_mask is None:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
    block_vis = tree_mask.bool().gather(-1, t_blk[:, None, :].expand(B, T, C)) & in_block[:, None, :]
    return key_pos, held[:, None, :] | block_vis


def _check_inputs(q, k, v, lengths, block_start, positions, sink, window, ring_start, tree_mask, values=True):
    """Shapes always; the index tensors' values only with ``values`` (reading them syncs with the
    device, which the kernel path does not do per layer: it trusts the cache that built them)."""
    check(q.dim() == 4 and k.dim() == 4 and v.shape == k.shape, "q, k, v",
          "(B, Hq, T, D), (B, Hkv, C, D) and v shaped like k", (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
    B, Hq, T, D = q.shape
    C = k.shape[2]
    check(k.shape[0] == B and k.shape[3] == D and Hq % k.shape[1] == 0, "k", f"(B={B}, Hkv, C, D={D}) with Hkv "
          f"dividing Hq={Hq} (grouped-query attention)", tuple(k.shape))
    check_int(sink, "sink", 0)
    check_int(window, "window", 1)
    check(sink + window <= C, "sink + window", f"<= the buffer's {C} slots", sink + window)
    for name, t in (("lengths", lengths), ("block_start", block_start), ("ring_start", ring_start)):
        check(t.shape == (B,) and not t.is_floating_point(), name, f"a ({B},) integer tensor",
              (tuple(t.shape), t.dtype))
    check(positions.shape == (B, T) and not positions.is_floating_point(), "positions",
          f"a ({B}, {T}) integer tensor", (tuple(positions.shape), positions.dtype))
    if tree_mask is not None:
        check(tree_mask.shape == (B, T, T), "tree_mask", f"None or a ({B}, {T}, {T}) bool tensor",
              tuple(tree_mask.shape))
    if not values:
        return
    check(bool(((lengths >= 0) & (lengths <= torch.where(ring_start == 0, C, sink + window))).all()), "lengths",
          f"in [0, sink + window = {sink + window}] with a ring (in [0, C = {C}] when compact)", lengths.tolist())
    check(bool(((ring_start >= 0) & (ring_start < window)).all()), "ring_start", f"in [0, window = {window})",
          ring_start.tolist())
    check(bool(((block_start >= 0) & (block_start + T <= C)).all()), "block_start",
          f"in [0, C - T = {C - T}] (the block's {T} slots inside the buffer)", block_start.tolist())


def rolling_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                                block_start: torch.Tensor, positions: torch.Tensor, rope, *, sink: int,
                                window: int, ring_start: torch.Tensor | None = None,
                                tree_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """q (B, Hq, T, D) and k, v (B, Hkv, C, D) before RoPE -> (B, Hq, T, D) (module docstring).

    ``rope(x (B, H, N, D), positions (B, N))``: the core's ``Rope`` (any rotary embedding); the
    keys are rotated in a copy, as ``SinkWindowCache`` does on every read."""
    ring_start = torch.zeros_like(lengths) if ring_start is None else ring_start
    _check_inputs(q, k, v, lengths, block_start, positions, sink, window, ring_start, tree_mask)
    key_pos, visible = slot_table(lengths, ring_start, block_start, positions, sink, window, k.shape[2], tree_mask)
    return F.scaled_dot_product_attention(rope(q, positions), rope(k, key_pos), v, attn_mask=visible[:, None],
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def rope_problem(rope) -> str | None:
    """Why the kernel cannot fuse ``rope`` (None when it can): it takes a core ``RotaryEmbedding``
    whose coordinates are the position on every axis (``Rope1D``, ``MRope`` on (B, T) positions) or
    ``Rope3D`` with a ``frame_shape``."""
    # imported here: mmspec.core imports the kernels while it initialises
    from ..core.rope import Rope3D, RotaryEmbedding

    if not isinstance(rope, RotaryEmbedding):
        return f"the fused RoPE takes mmspec.core.rope rotary embeddings, not {type(rope).__name__}"
    if isinstance(rope, Rope3D):
        return None if rope.frame_shape is not None else "a Rope3D without frame_shape takes explicit coordinates"
    if type(rope).coordinates is not RotaryEmbedding.coordinates:
        return f"{type(rope).__name__} maps positions to coordinates the kernel does not compute"
    return None


def rope_tables(rope, device: torch.device):
    """Per head dimension d: frequency, axis code, sign and partner dimension of its rotation pair,
    and the frame's (h * w, w, h) (1, 1, 1 for 1-D): x'[d] = x[d] cos + sign x[partner] sin with
    angle ``coord(axis[d]) * freq[d]``."""
    memo = _TABLES.setdefault(rope, {})
    if device in memo:
        return memo[device]
    from ..core.rope import Rope3D

    half = rope.head_dim // 2
    d = torch.arange(2 * half)
    if rope.layout == "half":
        pair, partner, sign = d % half, (d + half) % (2 * half), torch.where(d < half, -1.0, 1.0)
    else:
        pair, partner, sign = d // 2, d ^ 1, torch.where(d % 2 == 0, -1.0, 1.0)
    axis_of_pair = torch.repeat_interleave(torch.arange(len(rope.sections)), torch.tensor(rope.sections))
    if isinstance(rope, Rope3D):
        h, w = rope.frame_shape
        axis, frame = axis_of_pair[pair], (h * w, w, h)
    else:  # every axis reads the position itself
        axis, frame = torch.zeros_like(pair), (1, 1, 1)
    tables = tuple(t.to(device).contiguous() for t in (rope.inv_freq[pair].float(), axis.int(), sign.float(),
                                                        partner.int())) + frame
    memo[device] = tables
    return tables


if TRITON_AVAILABLE:

    @triton.jit
    def _rotate(x, xp, pos, freq, axis, sign, HW, FW, FH):
        """RoPE of x (N, BD) fp32 given its pair partners xp at positions pos (N,)."""
        p = pos[:, None]
        a = axis[None, :]
        coord = tl.where(a == 0, p // HW, tl.where(a == 1, (p // FW) % FH, p % FW))
        angle = coord.to(tl.float32) * freq[None, :]
        return x * tl.cos(angle) + sign[None, :] * xp * tl.sin(angle)

    # Memory traffic per (row, head): Q once per key split, each held key/value once per query
    # tile, plus a second (cached) read of the keys for the rotation partner, and D + 1 fp32 per
    # query and split to the workspace and back when split. The reference first writes the rotated
    # copy of every key (read C x D, write C x D per layer and step), then attends over it with a
    # (B, 1, T, C) mask; the fused kernel skips the copy and the mask.
    @triton.jit
    def _rolling_attention_kernel(
        Q, K, V, O, PART, LSE, LENS, RING, BSTART, POS, TMASK, FREQ, AXIS, SIGN, PARTNER,
        sm_scale, T, SINK, WIN, H, GROUP, D, HW, FW, FH, split_keys,
        sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot, spb, smb, smt,
        HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One program per (query tile, row x head, key split): rotate the queries, then online
        softmax over the split's share of the held entries and the block (``splitk``), each key
        tile rotated by its slots' positions on load."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        row_ok = offs_m < T
        d_ok = offs_d < D
        freq = tl.load(FREQ + offs_d, mask=d_ok, other=0.0)
        axis = tl.load(AXIS + offs_d, mask=d_ok, other=0)
        sign = tl.load(SIGN + offs_d, mask=d_ok, other=0.0)
        partner = tl.load(PARTNER + offs_d, mask=d_ok, other=0)

        q_ok = row_ok[:, None] & d_ok[None, :]
        q_row = Q + b * sqb + h * sqh + offs_m[:, None] * sqt
        q = tl.load(q_row + offs_d[None, :], mask=q_ok, other=0.0).to(tl.float32)
        qp = tl.load(q_row + partner[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q_pos = tl.load(POS + b * spb + offs_m, mask=row_ok, other=0)
        # rounded to the input dtype as the reference's rope rounds (then fp32 again where UPCAST)
        q = _rotate(q, qp, q_pos, freq, axis, sign, HW, FW, FH).to(Q.dtype.element_ty)
        if UPCAST:  # bf16 arithmetic is wrong in Triton's interpreter: compute in fp32 there
            q = q.to(tl.float32)

        n_held = tl.load(LENS + b).to(tl.int32)
        ring = tl.load(RING + b).to(tl.int32)
        bstart = tl.load(BSTART + b).to(tl.int32)
        held_end = tl.where(ring == 0, n_held, SINK + WIN)
        lo, hi = split_range(tl.maximum(held_end, bstart + T), split_keys, SPLIT)
        qk_scale = sm_scale * 1.4426950408889634

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            rel = offs_n - bstart
            in_block = (rel >= 0) & (rel < T)
            in_ring = (offs_n >= SINK) & (offs_n < SINK + WIN)
            logical = tl.where(in_ring, SINK + (offs_n - SINK - ring + WIN) % WIN, offs_n)
            held = (~in_block) & (logical < n_held) & ((offs_n < SINK + WIN) | (ring == 0))
            blk_pos = tl.load(POS + b * spb + rel, mask=in_block & n_ok, other=0)
            k_pos = tl.where(in_block, blk_pos, logical)

            kv_ok = n_ok[:, None] & d_ok[None, :]
            k_row = K + b * skb + hk * skh + offs_n[:, None] * sks
            k = tl.load(k_row + offs_d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            kp = tl.load(k_row + partner[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            k = _rotate(k, kp, k_pos, freq, axis, sign, HW, FW, FH).to(K.dtype.element_ty)
            v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :], mask=kv_ok, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if HAS_TREE:
                tm = tl.load(TMASK + b * smb + offs_m[:, None] * smt + rel[None, :],
                             mask=row_ok[:, None] & (in_block & n_ok)[None, :], other=0)
                blk_vis = tm != 0
            else:
                blk_vis = in_block[None, :] & (rel[None, :] <= offs_m[:, None])
            visible = (held[None, :] | blk_vis) & n_ok[None, :]
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, IEEE)
        store_tile(acc, m_i, l_i, O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], PART, LSE, bh,
                   offs_m, offs_d, T, D, q_ok, row_ok, SPLIT)


def rolling_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                             block_start: torch.Tensor, positions: torch.Tensor, rope, *, sink: int,
                             window: int, ring_start: torch.Tensor | None = None,
                             tree_mask: torch.Tensor | None = None, scale: float | None = None,
                             num_splits: int | None = None, workspace=None) -> torch.Tensor:
    """The Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``); same contract as the
    reference for the ropes ``rope_problem`` accepts, with the index tensors' values unchecked.

    ``num_splits``: splits of the buffer's C key slots (flash-decoding split-K,
    ``mmspec.kernels.splitk``); None picks them from the shapes and the GPU's multiprocessors
    (``splitk.choose_num_splits``). ``workspace``: fp32 scratch of at least
    ``splitk.workspace_numel(num_splits, B, Hq, T, D)`` elements for more than one split, or an allocator
    ``workspace(numel) -> tensor`` (None: allocated per call)."""
    ring_start = torch.zeros_like(lengths) if ring_start is None else ring_start
    _check_inputs(q, k, v, lengths, block_start, positions, sink, window, ring_start, tree_mask, values=False)
    check(q.dtype == k.dtype == v.dtype, "q, k, v", "one dtype", (q.dtype, k.dtype, v.dtype))
    problem = rope_problem(rope)
    check(problem is None, "rope", "a rotary embedding the kernel can fuse", problem)
    B, Hq, T, D = q.shape
    check(rope.head_dim == D, "rope", f"a rotary embedding of head dimension {D}", rope.head_dim)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    dev = q.device
    lens, ring, bstart = (t.to(device=dev, dtype=torch.int32).contiguous() for t in (lengths, ring_start, block_start))
    pos = positions.to(device=dev, dtype=torch.int32).contiguous()
    tm = None if tree_mask is None else tree_mask.to(device=dev, dtype=torch.int8).contiguous()
    freq, axis, sign, partner, HW, FW, FH = rope_tables(rope, dev)
    BLOCK_M, BLOCK_N, BLOCK_D = splitk.tile_sizes(T, D)
    split = splitk.plan(q, k.shape[2], BLOCK_M, BLOCK_N, num_splits, workspace)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    grid = (triton.cdiv(T, BLOCK_M), B * Hq, split.count)
    device = torch.cuda.device(dev) if q.is_cuda else contextlib.nullcontext()
    with device:
        _rolling_attention_kernel[grid](
            q, k, v, out, out if split.partial is None else split.partial, out if split.lse is None else split.lse,
            lens, ring, bstart, pos, pos if tm is None else tm, freq, axis, sign, partner,
            scale, T, sink, window, Hq, Hq // k.shape[1], D, HW, FW, FH, split.keys,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), pos.stride(0),
            0 if tm is None else tm.stride(0), 0 if tm is None else tm.stride(1),
            HAS_TREE=tm is not None, SPLIT=split.count > 1, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            UPCAST=q.dtype == torch.bfloat16 and interpreted(), IEEE=q.dtype == torch.float32,
            num_warps=4, num_stages=2)
        if split.count > 1:
            splitk.merge_splits(split.partial, split.lse, out, BLOCK_M, BLOCK_D)
    return out


def rolling_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                      block_start: torch.Tensor, positions: torch.Tensor, rope, *, sink: int, window: int,
                      ring_start: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                      scale: float | None = None, reference: Callable[[], torch.Tensor] | None = None,
                      **kernel_options) -> torch.Tensor:
    """Sink-window attention with fused RoPE (module docstring): the Triton kernel on CUDA where
    auto mode expects it to win (``dispatch.PREFERRED``: blocks of at most 128 queries over at
    most 256 keys, as measured on an H200), the torch path elsewhere, for longer blocks and windows
    or for ropes the kernel cannot fuse (``MMSPEC_KERNELS`` forces either).

    ``reference``: the caller's own torch path for these inputs, called with no arguments (a
    cache's, which reuses its per-step rotary tables); None: ``rolling_attention_reference``.
    ``kernel_options``: ``num_splits``, ``workspace`` (``rolling_attention_triton``)."""
    problem = (dtype_problem(q, k, v) or (None if q.dtype == k.dtype == v.dtype else "q, k, v differ in dtype")
               or rope_problem(rope))
    args = (q, k, v, lengths, block_start, positions, rope)
    kwargs = dict(sink=sink, window=window, ring_start=ring_start, tree_mask=tree_mask, scale=scale)
    if use_triton("rolling attention", q.device, problem,
                  preferred=preferred("rolling attention", q.shape[2], sink + window)):
        return rolling_attention_triton(*args, **kwargs, **kernel_options)
    return reference() if reference is not None else rolling_attention_reference(*args, **kwargs)
