"""KV caches for speculation: append a block, keep part of it, optionally roll.

The decoder talks to every cache through three calls:

- ``next_positions()`` -> (B,) the position the next token of each row takes;
- ``keep_block(block_size, idx, n)``: of the block just appended, keep entries ``idx[b, :n[b]]``
  (``idx=None``: the first ``n[b]``, a plain truncation, as for chains);
- ``truncate(lengths)``.

Native models additionally call ``step(positions, tree_mask)`` once per forward and
``step.update(layer, q, k, v)`` in every attention layer (see ``CacheStep``). The HF adapter
(``mmspec.adapters.hf``) implements the decoder-facing calls over transformers' ``DynamicCache``.

Attention visibility of a block of T new tokens with an optional tree mask (B, T, R + T): every
committed entry before the last ``R + T`` slots is visible; the last ``R + T`` (R earlier tree
nodes appended this round plus the block itself) are visible where the mask says so. Without a
mask the block is causal and R = 0.
"""

from __future__ import annotations

from typing import Callable

import torch

Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``rope(x (B, H, T, D), positions (B, T)) -> x`` rotated by position."""


def visibility_mask(ends: torch.Tensor, T: int, S: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, T, S) bool attention mask for a block ending at slot ``ends[b]`` (exclusive).

    Slots below ``ends - width`` (width = T, or the tree mask's width) are fully visible; the
    last ``width`` slots follow the tree mask (causal when it is None); later slots are hidden.
    """
    B = ends.shape[0]
    device = ends.device
    if tree_mask is None:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
    width = tree_mask.shape[-1]
    rel = torch.arange(S, device=device) - (ends - width)[:, None]  # (B, S)
    in_tree = (rel >= 0) & (rel < width)
    picked = tree_mask.gather(-1, rel.clamp(0, width - 1)[:, None, :].expand(B, T, S))
    return ((rel < 0)[:, None, :] | (in_tree[:, None, :] & picked)).unsqueeze(1)


class CacheStep:
    """One forward's view of a native cache: where the block goes and what it may see."""

    def __init__(self, cache: "StaticKVCache", positions: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor, key_positions: torch.Tensor | None):
        self.cache = cache
        self.positions = positions  # (B, T)
        self.slots = slots  # (B, T)
        self.mask = mask  # (B, 1, T, S)
        self.key_positions = key_positions  # (B, S) for caches that rotate keys on read

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store this block's k, v (B, H, T, D) for ``layer``; return rotated q and all keys/values."""
        return self.cache._update(self, layer, q, k, v)


class StaticKVCache:
    """A preallocated, position-indexed cache (gpt-fast's ``KVCache.update(input_pos, k, v)``).

    Rows keep their own lengths, so rows that accepted different numbers of tokens need no padding:
    the next block of row b is written at ``lengths[b]``, and stale slots past it are overwritten.
    Keys are stored already rotated (RoPE applied at write).

    Args:
        num_layers, batch_size, num_heads, head_dim: the buffer shape. ``num_layers=0`` gives a
            cache that only tracks lengths (for table models with no attention).
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

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def next_positions(self) -> torch.Tensor:
        return self.lengths.clone()

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def step(self, positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> CacheStep:
        T = positions.shape[1]
        slots = self.lengths[:, None] + torch.arange(T, device=positions.device)
        ends = self.lengths + T
        S = int(ends.max())
        if S > self.max_len:
            raise ValueError(f"cache overflow: a block needs {S} slots, the cache has max_len={self.max_len}")
        mask = visibility_mask(ends, T, S, tree_mask)
        step = CacheStep(self, positions, slots, mask, self._key_positions(slots, positions, S))
        self.lengths = ends
        return step

    def _key_positions(self, slots, positions, S):
        return None

    def _rotate(self, x, positions):
        return x if self.rope is None else self.rope(x, positions)

    def _write(self, layer, step, k, v):
        B, H, T, D = k.shape
        index = step.slots[:, None, :, None].expand(B, H, T, D)
        self.k[layer].scatter_(2, index, k.to(self.k.dtype))
        self.v[layer].scatter_(2, index, v.to(self.v.dtype))

    def _update(self, step, layer, q, k, v):
        S = step.mask.shape[-1]
        self._write(layer, step, self._rotate(k, step.positions), v)
        return self._rotate(q, step.positions), self.k[layer, :, :, :S], self.v[layer, :, :, :S]

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
    Attention Sinks"): keep the first ``sink`` tokens and the last ``window`` tokens.

    Keys are stored *before* RoPE and rotated on read by their position inside the cache, so after
    an eviction the kept tokens sit at consecutive positions ``0 .. sink + window - 1`` and the
    next token continues from there: positions stay bounded and consistent for unbounded streams.
    Memory is fixed at ``sink + window + max_block`` slots.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int, sink: int,
                 window: int, max_block: int, rope: Rope | None = None, dtype=torch.float32, device=None):
        if sink < 0 or window < 1:
            raise ValueError(f"sink must be >= 0 and window >= 1, got sink={sink}, window={window}")
        super().__init__(num_layers, batch_size, num_heads, head_dim, sink + window + max_block,
                         rope, dtype, device)
        self.sink, self.window = sink, window
        # position of every slot: committed slots are compact, so slot index == position; only
        # uncommitted draft-tree entries (depth-based positions) differ until the next commit
        self._arange = torch.arange(self.max_len, device=self.lengths.device).expand(batch_size, -1)
        self.pos = self._arange.clone()

    def _key_positions(self, slots, positions, S):
        self.pos.scatter_(1, slots, positions)
        return self.pos[:, :S]

    def _update(self, step, layer, q, k, v):
        S = step.mask.shape[-1]
        self._write(layer, step, k, v)
        keys = self._rotate(self.k[layer, :, :, :S], step.key_positions)
        return self._rotate(q, step.positions), keys, self.v[layer, :, :, :S]

    def _evict(self) -> None:
        cap = self.sink + self.window
        over = self.lengths > cap
        if not bool(over.any()):
            return
        j = torch.arange(cap, device=self.lengths.device)
        tail = self.lengths[:, None] - self.window + (j - self.sink)  # (B, cap)
        src = torch.where(over[:, None] & (j >= self.sink), tail, j)
        L, B, H, _, D = self.k.shape
        index = src[None, :, None, :, None].expand(L, B, H, cap, D)
        for buf in (self.k, self.v):
            buf[:, :, :, :cap] = buf.gather(3, index)
        self.lengths = self.lengths.clamp(max=cap)

    def truncate(self, lengths: torch.Tensor) -> None:
        super().truncate(lengths)
        self._evict()
        self.pos.copy_(self._arange)

    def gather(self, start, idx, n) -> None:
        super().gather(start, idx, n)
        self._evict()
        self.pos.copy_(self._arange)


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
        if int(positions.max()) >= S:
            raise ValueError(f"cache overflow: position {int(positions.max())} >= max_len={S}")
        if tree_mask is None:
            tree_mask = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril().expand(B, T, T)
        slots = torch.arange(S, device=positions.device)
        seen = self.written[:, None, :S] & (slots < positions[..., None])  # (B, T, S)
        mask = torch.cat([seen, tree_mask], -1).unsqueeze(1)
        L = self.k.shape[0]
        self._pending = (positions, [None] * L, [None] * L)
        return CacheStep(self, positions, positions, mask, None)

    def _update(self, step, layer, q, k, v):
        S = self.max_len
        k = self._rotate(k, step.positions)
        _, pk, pv = self._pending
        pk[layer], pv[layer] = k, v
        keys = torch.cat([self.k[layer, :, :, :S], k.to(self.k.dtype)], 2)
        values = torch.cat([self.v[layer, :, :, :S], v.to(self.v.dtype)], 2)
        return self._rotate(q, step.positions), keys, values

    def commit(self, keep: torch.Tensor) -> None:
        """Write the pending block's entries where ``keep`` (B, T) is True into their slots."""
        check_pending = self._pending
        if check_pending is None:
            raise RuntimeError("commit() without a pending block: call step() (a forward) first")
        positions, pk, pv = check_pending
        slots = torch.where(keep, positions, self.max_len)  # dropped entries -> the spare slot
        if self.k.shape[0]:
            B, H, T, D = pk[0].shape
            index = slots[:, None, :, None].expand(B, H, T, D)
            for layer in range(self.k.shape[0]):
                self.k[layer].scatter_(2, index, pk[layer].to(self.k.dtype))
                self.v[layer].scatter_(2, index, pv[layer].to(self.v.dtype))
        self.written.scatter_(1, slots, True)
        self.written[:, self.max_len] = False
        self._pending = None
