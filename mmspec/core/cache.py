"""KV caches for speculation: append a block, keep part of it, optionally roll.

The decoder talks to every cache through three calls:

- ``next_positions()`` -> (B,) the position the next token of each row takes;
- ``keep_block(block_size, idx, n)``: of the block just appended, keep entries ``idx[b, :n[b]]``
  (``idx=None``: the first ``n[b]``, a plain truncation, as for chains);
- ``truncate(lengths)``.

Native models additionally call ``step(positions, tree_mask)`` once per forward and, in every
attention layer, ``step.attend(layer, q, k, v)`` (store the block, attend: the tree-verify or
rolling attention kernel of ``mmspec.kernels`` where its dispatch picks Triton,
``scaled_dot_product_attention`` with ``step.attn_mask`` otherwise: ``step.mask``, or None where it
is all true, so a GPU can take its flash kernels) or ``step.update(layer, q, k, v)`` and their own
attention (see ``CacheStep``). The HF adapter
(``mmspec.adapters.hf``) hands transformers models a ``Cache`` whose layers write into a
``StaticKVCache``, so they decode on the same buffers and calls.

Attention visibility of a block of T new tokens with an optional tree mask (B, T, R + T): every
committed entry before the last ``R + T`` slots is visible; the last ``R + T`` (R earlier tree
nodes appended this round plus the block itself) are visible where the mask says so. Without a
mask the block is causal and R = 0.

``SinkWindowCache`` rolls: sink frames pinned, a window of recent ones, keys rotated by their
position in the cache. Write protocols other than the decoder's block live with the modality that
needs them, on top of it (``mmspec.adapters.video.VideoChunkCache``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from ..kernels import dispatch as kernel_dispatch
from ..kernels.rolling_attention import rolling_attention
from ..kernels.torch_ops import visibility_mask
from ..kernels.tree_attention import tree_attention
from .errors import check, is_int
from .shapes import static_shapes

Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``rope(x (B, H, T, D), positions (B, T)) -> x`` rotated by position."""


class CacheStep:
    """One forward's view of a native cache: where the block goes and what it may see."""

    def __init__(self, cache: "StaticKVCache", positions: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor, key_positions: torch.Tensor | None, tree_mask: torch.Tensor | None = None,
                 dense: bool = False):
        self.cache = cache
        self.positions = positions  # (B, T)
        self.slots = slots  # (B, T)
        self.mask = mask  # (B, 1, T, S)
        # SDPA's mask: None when the cache knows from host-side counts that ``mask`` is all true
        # (``dense``), so a GPU can take its flash kernels (they take no mask)
        self.attn_mask = None if dense else mask
        self.key_positions = key_positions  # (B, S) for caches that rotate keys on read
        self.tree_mask = tree_mask  # (B, T, W) the mask's block part (None: causal), for the kernels
        self.rope_tables: dict = {}  # id(positions) -> (positions, tables): every layer reuses them

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``cache.rope(x, positions)`` with the rope's tables computed once per step and positions
        tensor (``positions`` is this step's ``positions`` or ``key_positions``), so every layer's
        q and k share them also under ``torch.inference_mode``, where ``RotaryEmbedding.tables``
        cannot tell an unchanged tensor (inference tensors have no version counter)."""
        rope = self.cache.rope
        if rope is None:
            return x
        if not hasattr(rope, "tables"):  # a plain ``Rope`` callable
            return rope(x, positions)
        if torch.compiler.is_compiling():  # the compiled graph shares the tables itself
            return rope.apply(x, rope.tables(positions))
        seen = self.rope_tables.get(id(positions))
        if seen is None:  # keep the tensor alive with its tables, so its id is not reused
            seen = self.rope_tables[id(positions)] = (positions, rope.tables(positions))
        return rope.apply(x, seen[1])

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store this block's k, v (B, H, T, D) for ``layer``; return rotated q and all keys/values."""
        return self.cache._update(self, layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this block's k, v (B, H, T, D) for ``layer`` and return the block's attention output
        (B, H, T, D): ``scaled_dot_product_attention(*update(...), attn_mask=attn_mask)``, through
        the op dispatcher of ``mmspec.kernels`` wherever a kernel could run (it alone decides kernel
        or this torch path)."""
        out = self.cache._kernel_attention(self, layer, q, k, v)
        if out is not None:
            return out
        q, k, v = self.update(layer, q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask)


class StaticKVCache:
    """A preallocated, position-indexed cache (gpt-fast's ``KVCache.update(input_pos, k, v)``).

    Rows keep their own lengths, so rows that accepted different numbers of tokens need no padding:
    the next block of row b is written at ``lengths[b]``, and stale slots past it are overwritten.
    Keys are stored already rotated (RoPE applied at write).

    Args:
        num_layers: layers in the buffer; ``num_layers=0`` gives a cache that only tracks lengths
            (for table models with no attention).
        batch_size: rows.
        num_heads: key/value heads.
        head_dim: channels per head.
        max_len: slots per row; a write past it raises.
        rope: rotary embedding applied to queries and keys; ``None`` for no rotation.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int,
                 max_len: int, rope: Rope | None = None, dtype=torch.float32, device=None):
        # one spare slot past max_len absorbs the unused entries of a gather; it is never visible
        shape = (num_layers, batch_size, num_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.rope = rope
        self.static = static_shapes(self.lengths.device)  # decided once: nothing is read inside a compiled step
        self.overflowed = torch.zeros((), dtype=torch.bool, device=device)  # static widths' deferred check

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def next_positions(self) -> torch.Tensor:
        return self.lengths.clone()

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def step(self, positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> CacheStep:
        """Open a block of ``positions.shape[1]`` entries past each row's length. With static shapes
        (``self.static``, from ``mmspec.core.shapes`` when built) the block sees every slot,
        masked, and nothing is read from the device: an overflowing write lands in the
        never-visible spare slot and ``check_overflow`` reports it; otherwise the key range ends at
        the longest row and an overflow raises here."""
        T = positions.shape[1]
        slots = self.lengths[:, None] + torch.arange(T, device=positions.device)
        ends = self.lengths + T
        if self.static:
            S = self.max_len
            self.overflowed.logical_or_((ends > S).any())
            slots = slots.clamp(max=S)
        else:
            S = int(ends.max())
            if S > self.max_len:
                raise ValueError(f"cache overflow: a block needs {S} slots, the cache has max_len={self.max_len}")
        mask = visibility_mask(ends, T, S, tree_mask)
        step = CacheStep(self, positions, slots, mask, self._key_positions(slots, positions, S), tree_mask)
        self.lengths = ends
        return step

    def _key_positions(self, slots, positions, S):
        return None

    def _write(self, layer, step, k, v):
        B, H, T, D = k.shape
        index = step.slots[:, None, :, None].expand(B, H, T, D)
        self.k[layer].scatter_(2, index, k.to(self.k.dtype))
        self.v[layer].scatter_(2, index, v.to(self.v.dtype))

    def _update(self, step, layer, q, k, v):
        S = step.mask.shape[-1]
        self._write(layer, step, step.rotate(k, step.positions), v)
        return step.rotate(q, step.positions), self.k[layer, :, :, :S], self.v[layer, :, :, :S]

    def _kernel_attention(self, step, layer, q, k, v) -> torch.Tensor | None:
        """The block's attention through ``mmspec.kernels.tree_attention`` (the kernel where the
        dispatcher picks it: it applies ``step.mask``'s rule from the block's prefix length and
        its tree mask; this cache's SDPA on ``step.mask`` otherwise), or None, before anything is
        written, where no kernel is considered (``dispatch.considered``: the caller's SDPA)."""
        if step.positions.shape[1] == 0 or not kernel_dispatch.considered(q.device):
            return None
        width = step.positions.shape[1] if step.tree_mask is None else step.tree_mask.shape[-1]
        q, keys, values = self._update(step, layer, q, k, v)
        return tree_attention(q, keys, values, step.slots[:, -1] + 1 - width, step.tree_mask, workspace=self.workspace,
                              reference=lambda: F.scaled_dot_product_attention(q, keys, values,
                                                                                attn_mask=step.attn_mask))

    def workspace(self, numel: int) -> torch.Tensor:
        """The split attention kernels' fp32 scratch of ``numel`` elements (``mmspec.kernels.
        splitk``), one buffer per size kept on the cache: every pass of a (batch, block width)
        bucket reuses it, as a captured step must, and nothing is allocated unless a kernel splits."""
        pool = self.__dict__.setdefault("_workspaces", {})
        buf = pool.get(numel)
        if buf is None:
            buf = pool[numel] = torch.empty(numel, dtype=torch.float32, device=self.k.device)
        return buf

    def reset(self) -> None:
        """Empty the cache for a new call, keeping its buffers where they are (compiled steps pool
        caches: a CUDA graph replays on the addresses it recorded)."""
        self.lengths = torch.zeros_like(self.lengths)
        self.overflowed.zero_()
        self.static = static_shapes(self.lengths.device)

    def check_overflow(self) -> None:
        """Raise if a block was written past ``max_len`` under static shapes (one host read)."""
        if bool(self.overflowed):
            raise ValueError(f"cache overflow: a block needed more than max_len={self.max_len} slots")

    def load_row(self, row: int, other: "StaticKVCache", other_row: int) -> None:
        """Make row ``row`` a copy of ``other``'s row ``other_row``: its keys, values and length
        (continuous batching: a job prefilled alone, in a cache of the same kind, enters a slot of
        the batch's cache; ``SpeculativeDecoder.serve``). ``other`` holds at most as many slots
        as this cache (a batch-1 cache sized to the prompt), and the same layers, heads and head
        size; slots past its length are copied too (never visible)."""
        check(type(other) is type(self), "other", f"a {type(self).__name__} (the same kind of cache)",
              type(other).__name__)
        check(other.k.shape[0] == self.k.shape[0] and other.k.shape[2:3] + other.k.shape[4:]
              == self.k.shape[2:3] + self.k.shape[4:] and other.k.shape[3] <= self.k.shape[3], "other",
              f"a cache of {self.k.shape[0]} layers, {self.k.shape[2]} heads of {self.k.shape[4]} and at most "
              f"{self.max_len} slots", tuple(other.k.shape))
        check(0 <= row < self.batch_size and 0 <= other_row < other.batch_size, "row",
              f"a row < {self.batch_size} (and other_row < {other.batch_size})", (row, other_row))
        W = other.k.shape[3]
        self.k[:, row, :, :W] = other.k[:, other_row]
        self.v[:, row, :, :W] = other.v[:, other_row]
        self.lengths = self.lengths.clone()
        self.lengths[row] = other.lengths[other_row]

    # -- decoder-facing -------------------------------------------------------------------------
    def truncate(self, lengths: torch.Tensor) -> None:
        """Forget everything at or past ``lengths[b]`` (rejected drafts, prompt padding)."""
        self.lengths = torch.minimum(self.lengths, lengths.to(self.lengths))

    def gather(self, start: torch.Tensor, idx: torch.Tensor, n: torch.Tensor) -> None:
        """Move slots ``start + idx[b, j]`` to ``start + j`` for ``j < n[b]`` and cut after them
        (keeps an accepted tree path; -1 entries in idx past n are ignored)."""
        if self.k.shape[0]:
            B, K = idx.shape
            L, _, H, _, D = self.k.shape
            j = torch.arange(K, device=idx.device)
            dst = torch.where(j < n[:, None], start[:, None] + j, self.max_len)  # unused -> spare slot
            src = (start[:, None] + idx.clamp(min=0))[None, :, None, :, None].expand(L, B, H, K, D)
            dst = dst[None, :, None, :, None].expand(L, B, H, K, D)
            for buf in (self.k, self.v):
                buf.scatter_(3, dst, buf.gather(3, src))
        self.lengths = start + n

    def keep_block(self, block_size: int, idx: torch.Tensor | None, n: torch.Tensor) -> None:
        start = self.lengths - block_size
        if idx is None:
            self.truncate(start + n)
        else:
            self.gather(start, idx, n)


class SinkWindowCache(StaticKVCache):
    """StreamingLLM's rolling cache (Xiao et al., 2024, "Efficient Streaming Language Models with
    Attention Sinks") at token or frame granularity: keep the first ``sink`` frames and the last
    ``window`` frames, a frame being ``frame_size`` tokens that enter and leave together
    (``frame_size=1``: tokens, as for LMs).

    Keys are stored *before* RoPE and rotated on read by their position inside the cache, so after
    an eviction the kept entries sit at consecutive positions ``0 .. (sink + window) * frame_size
    - 1`` (sink first) and the next block continues from there: positions stay bounded for
    unbounded streams. Position p of a token is ``frame * frame_size + j`` (j its place in the
    frame): a ``Rope3D`` with ``frame_shape`` (h, w), ``h * w == frame_size``, reads the first axis
    as the frame's cache order and the other two as the token's place in the frame. Rolling evicts
    whole frames. Memory is fixed at ``capacity`` frames (default ``sink + window + max_block``).

    Decoder blocks (LMs, speculation): ``step`` writes the block past the committed entries and
    advances; ``keep_block`` / ``truncate`` keep part of it and roll. Subclasses add other write
    protocols on the same slots and positions (``mmspec.adapters.video.VideoChunkCache``: chunks
    that denoising passes overwrite, and re-caches), through ``_roll`` and ``_evict``.

    Args:
        sink: pinned frames (``frame_size`` tokens each), >= 0.
        window: recent frames, >= 0.
        max_block: frames of the largest block appended past them (a draft tree).
        frame_size: tokens per frame.
        capacity: frame slots of the cache; ``sink + window + max_block`` when None.
    """

    reset = None  # rolling state (positions, and a subclass's open block): built anew per stream, never pooled

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int, sink: int,
                 window: int, max_block: int | None = None, rope: Rope | None = None, dtype=torch.float32,
                 device=None, *, frame_size: int = 1, capacity: int | None = None):
        # every check before any buffer is allocated
        check(is_int(frame_size) and frame_size >= 1, "frame_size", "an int >= 1 (tokens per frame)", frame_size)
        check(is_int(sink) and sink >= 0, "sink", "an int >= 0 (pinned frames)", sink)
        check(is_int(window) and window >= 0, "window", "an int >= 0 (recent frames kept)", window)
        check(is_int(max_block) and max_block >= 1, "max_block", "an int >= 1 (frames of the largest block)", max_block)
        if capacity is None:
            capacity = sink + window + max_block
        check(is_int(capacity) and capacity >= 1, "capacity", "None or an int >= 1 (frame slots)", capacity)
        check(sink + window <= capacity, "sink + window", f"<= capacity ({capacity} frames)", sink + window)
        check(sink + window + max_block <= capacity, "max_block",
              f"<= capacity - sink - window ({capacity - sink - window} frames): room for a block past the "
              "kept frames", max_block)
        shape = getattr(rope, "frame_shape", None)
        if frame_size > 1 and shape is not None:
            check(shape[0] * shape[1] == frame_size, "frame_size",
                  f"the rope's frame_shape {tuple(shape)} token count {shape[0] * shape[1]}", frame_size)

        super().__init__(num_layers, batch_size, num_heads, head_dim, capacity * frame_size, rope, dtype, device)
        self.frame_size, self.capacity = frame_size, capacity
        self.sink, self.window = sink * frame_size, window * frame_size  # tokens
        # position of every slot: committed slots are compact, so slot index == position; only
        # uncommitted draft-tree entries (depth-based positions) differ until the next commit
        self._arange = torch.arange(self.max_len, device=self.lengths.device).expand(batch_size, -1)
        self.pos = self._arange.clone()

    @property
    def sink_frames(self) -> int:
        return self.sink // self.frame_size

    @property
    def window_frames(self) -> int:
        return self.window // self.frame_size

    def num_frames(self) -> torch.Tensor:
        """(B,) committed frames held (sink included), at most ``sink + window``."""
        return self.lengths // self.frame_size

    def grow(self, window_frames: int) -> None:
        """Widen the window to ``window_frames`` frames, keeping every committed entry where it is
        (same slots, same positions): a cache that grows instead of evicting (a full cache) calls
        it before the block that would roll. Buffers are reallocated once per call, so double the
        window each time for amortised constant cost."""
        old = self.window_frames
        check(is_int(window_frames) and window_frames >= old,
              "window_frames", f"an int >= the current window ({old} frames)", window_frames)
        extra = window_frames - old  # frames
        if extra == 0:
            return
        tokens = extra * self.frame_size
        # the spare slot past max_len becomes an ordinary (unwritten, invisible) slot; a new one follows
        self.k = F.pad(self.k, (0, 0, 0, tokens))
        self.v = F.pad(self.v, (0, 0, 0, tokens))
        self.max_len += tokens
        self.capacity += extra
        self.window += tokens
        self._arange = torch.arange(self.max_len, device=self.lengths.device).expand(self.batch_size, -1)
        self.pos = self._arange.clone()

    # -- the core's step --------------------------------------------------------------------------
    def step(self, positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> CacheStep:
        """``StaticKVCache.step`` on whole frames: write the block past the committed entries and
        advance."""
        T = positions.shape[1]
        check(T % self.frame_size == 0, "positions", f"whole frames of {self.frame_size} tokens", T)
        return super().step(positions, tree_mask)

    def _key_positions(self, slots, positions, S):
        self.pos.scatter_(1, slots, positions)
        return self.pos[:, :S]

    def _update(self, step, layer, q, k, v):
        self._write(layer, step, k, v)
        return self._read(step, layer, q)

    def _read(self, step, layer, q):
        """Rotated q and the keys (rotated by their cache positions) and values the block sees."""
        S = step.mask.shape[-1]
        keys = step.rotate(self.k[layer, :, :, :S], step.key_positions)
        return step.rotate(q, step.positions), keys, self.v[layer, :, :, :S]

    def _kernel_attention(self, step, layer, q, k, v) -> torch.Tensor | None:
        """The block's attention through ``mmspec.kernels.rolling_attention`` (the kernel where the
        dispatcher picks it: keys rotated as they are read, nothing re-rotated in memory; this
        cache's read path and SDPA otherwise), or None, before anything is written, where no
        kernel is considered or the block's tree mask reaches earlier tree nodes (a draft's
        frontier): the caller's SDPA. The block sits right after the entries it sees
        (``block_start`` = the slots' start, this cache's compact layout, ring start 0)."""
        T = step.positions.shape[1]
        if T == 0 or (step.tree_mask is not None and step.tree_mask.shape[-1] != T) or \
                not kernel_dispatch.considered(q.device):
            return None
        self._write(layer, step, k, v)
        start = step.slots[:, 0]
        return rolling_attention(q, self.k[layer], self.v[layer], start, start, step.positions, self.rope,
                                 sink=self.sink, window=self.window, tree_mask=step.tree_mask,
                                 workspace=self.workspace,
                                 reference=lambda: F.scaled_dot_product_attention(*self._read(step, layer, q),
                                                                                  attn_mask=step.attn_mask))

    def _evict(self) -> torch.Tensor | None:
        """Keep the sink frames and the last ``window`` frames of every row. Returns (B, sink +
        window) the source frame of every kept frame slot when a row rolled (a subclass moves what
        it keeps per frame the same way), None when nothing was evicted."""
        cap = self.sink + self.window
        over = self.lengths > cap
        if not bool(over.any()):
            return None
        fs = self.frame_size
        sink_f, cap_f = self.sink // fs, cap // fs
        j = torch.arange(cap_f, device=self.lengths.device)
        tail = self.lengths[:, None] // fs - self.window // fs + (j - sink_f)  # (B, cap_f) source frames
        src_f = torch.where(over[:, None] & (j >= sink_f), tail, j)
        src = (src_f[..., None] * fs + torch.arange(fs, device=j.device)).flatten(1)  # (B, cap) tokens
        L, B, H, _, D = self.k.shape
        index = src[None, :, None, :, None].expand(L, B, H, cap, D)
        for buf in (self.k, self.v):
            buf[:, :, :, :cap] = buf.gather(3, index)
        self.lengths = self.lengths.clamp(max=cap)
        return src_f

    def _roll(self) -> None:
        """Evict down to sink + window and reset every slot's position to its index (committed
        entries are compact)."""
        self._evict()
        self.pos.copy_(self._arange)

    def load_row(self, row: int, other: "StaticKVCache", other_row: int) -> None:
        raise ValueError("SinkWindowCache cannot load a row from another cache (its entries roll by position): "
                         "continuous batching needs a StaticKVCache")

    def truncate(self, lengths: torch.Tensor) -> None:
        if self.frame_size > 1:
            check(bool((lengths % self.frame_size == 0).all()), "lengths",
                  f"whole frames (multiples of {self.frame_size} tokens)", lengths.tolist())
        super().truncate(lengths)
        self._roll()

    def gather(self, start, idx, n) -> None:
        super().gather(start, idx, n)
        self._roll()


class SlotKVCache(StaticKVCache):
    """A position-addressed cache with a written mask, for schedules that decode out of order
    (ZipAR's next-set decoding: several image rows in flight).

    An entry at sequence position p lives in slot p. A query at position p sees every *written*
    slot below p (slots not generated yet stay hidden: the ZipAR paper's semantics; its reference
    code attends to their zeros) plus the entries of its own block that ``block_mask`` allows. A
    block stays pending until ``commit(keep)`` writes the kept entries into their slots.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int,
                 max_len: int, rope: Rope | None = None, dtype=torch.float32, device=None):
        super().__init__(num_layers, batch_size, num_heads, head_dim, max_len, rope, dtype, device)
        self.written = torch.zeros(batch_size, max_len + 1, dtype=torch.bool, device=device)
        self._pending: tuple[torch.Tensor, list, list] | None = None

    def step(self, positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> CacheStep:
        """``tree_mask`` (B, T, T) is the in-block visibility (causal when None)."""
        B, T = positions.shape
        S = self.max_len
        if self.static:  # no read: commit drops an overflow into the spare slot, check_overflow reports it
            self.overflowed.logical_or_((positions >= S).any())
        elif int(positions.max()) >= S:
            raise ValueError(f"cache overflow: position {int(positions.max())} >= max_len={S}")
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril().expand(B, T, T)
        slots = torch.arange(S, device=positions.device)
        seen = self.written[:, None, :S] & (slots < positions[..., None])  # (B, T, S)
        mask = torch.cat([seen, tree_mask], -1).unsqueeze(1)
        L = self.k.shape[0]
        self._pending = (positions, [None] * L, [None] * L)
        return CacheStep(self, positions, positions, mask, None)

    def load_row(self, row: int, other: "StaticKVCache", other_row: int) -> None:
        raise ValueError("SlotKVCache cannot load a row from another cache (next-set lanes share one "
                         "prompt's slots): continuous batching needs the raster schedule")

    def reset(self) -> None:
        super().reset()
        self.written.zero_()
        self._pending = None

    def _kernel_attention(self, step, layer, q, k, v):
        return None  # written-slot masks are not a prefix + tree: SDPA with step.mask

    def _update(self, step, layer, q, k, v):
        S = self.max_len
        k = step.rotate(k, step.positions)
        _, pk, pv = self._pending
        pk[layer], pv[layer] = k, v
        keys = torch.cat([self.k[layer, :, :, :S], k.to(self.k.dtype)], 2)
        values = torch.cat([self.v[layer, :, :, :S], v.to(self.v.dtype)], 2)
        return step.rotate(q, step.positions), keys, values

    def commit(self, keep: torch.Tensor) -> None:
        """Write the pending block's entries where ``keep`` (B, T) is True into their slots."""
        check_pending = self._pending
        if check_pending is None:
            raise RuntimeError("commit() without a pending block: call step() (a forward) first")
        positions, pk, pv = check_pending
        slots = torch.where(keep, positions, self.max_len).clamp(max=self.max_len)  # dropped -> the spare slot
        if self.k.shape[0]:
            B, H, T, D = pk[0].shape
            index = slots[:, None, :, None].expand(B, H, T, D)
            for layer in range(self.k.shape[0]):
                self.k[layer].scatter_(2, index, pk[layer].to(self.k.dtype))
                self.v[layer].scatter_(2, index, pv[layer].to(self.v.dtype))
        self.written.scatter_(1, slots, True)
        self.written[:, self.max_len] = False
        self._pending = None
