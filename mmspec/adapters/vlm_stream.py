"""A VLM answering questions about a live frame stream, on one bounded cache: StreamingVLM's policy
(Xu et al., 2025, "StreamingVLM: Real-Time Understanding for Infinite Video Streams";
mit-han-lab/streaming-vlm, ``streaming_vlm/inference/inference.py::process_past_kv``), with every
answer decoded speculatively by the core.

The cache holds, in order: the **sink** (the chat frame's first tokens, kept for ever), the
**previous text** (answers that left the text window, moved here: its first ``text_sink`` and last
``text_sliding_window`` tokens are kept, the middle pruned), then the rounds still in a window,
each a **vision** part (the round's frames: image placeholders) and a **text** part (question,
``assistant :``, answer). StreamingVLM's rules, at the start of round ``i`` (a round = one chunk of
frames and the question asked after it):

- ``i >= text_window`` (its ``text_round``): the oldest round still holding text moves its answer
  into the previous text and drops its question (with the frame words around the answer: our chat
  frame's ``assistant :`` and ``</s>``, what its ``assistant_start_bias`` / ``end_bias`` cut);
- ``i >= vision_window`` (its ``visual_round``): the oldest round still holding frames drops them;
- a round with neither is gone; the previous text is trimmed to its sink and window.

Positions are re-indexed after every pruning, as StreamingVLM's default ``pos_mode="shrink"``
does: the kept entries take the positions the model's own rule gives the kept tokens in cache
order (LLaVA: ``0 .. n - 1``; Qwen2-VL / Qwen2.5-VL: ``get_rope_index`` over them, each kept
image's grid ids starting at the text position before it), so positions stay bounded for an
unbounded stream. StreamingVLM caches keys before RoPE and rotates the whole cache on every pass;
the core's cache holds keys after RoPE (transformers rotates them before ``Cache.update``), so each
kept key is instead rotated once by its position change, axis by axis for M-RoPE
(``R(p') = R(p' - p) R(p)``, through the model's own rotary embedding), which gives the same keys
up to float rounding.

Each answer is one ``SpeculativeDecoder.generate`` call whose prompt is the question alone: the
target's view (``ContextTarget``) and cache (``ContextCache``) show the core the context's slots as
a prefix it cannot see past (core positions start at 0 after it, and its truncations stay past
it), so drafts, verification and rollback work as on a fresh cache while the target attends to the
whole stream. Drafters see the question and answer only (the heads' own caches start empty each
answer; lookup drafts from the answer's tokens), so every method stays lossless.

Limits: frames are images (a Qwen model's video input is not streamed); one stream per cache
(batch 1); a draft model with its own cache (``sd``) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.cache import StaticKVCache
from ..core.errors import check, check_int, is_int
from .vlm import VLMTarget, _VLMCache

__all__ = ["ContextCache", "ContextTarget", "StreamPolicy", "VLMStream"]


class ContextCache(_VLMCache):
    """A VLM target's cache whose first ``base`` slots are a context the core does not manage: the
    core's lengths and positions count from ``base`` (``next_positions``, ``truncate``), so a
    ``generate`` call decodes after the context as after an empty prompt."""

    base: int = 0

    def next_positions(self) -> torch.Tensor:
        return self.lengths - self.base

    def truncate(self, lengths: torch.Tensor) -> None:
        super().truncate(lengths.to(self.lengths) + self.base)

    def keep_block(self, block_size: int, idx: torch.Tensor | None, n: torch.Tensor) -> None:
        start = self.lengths - block_size  # slots, not core lengths
        if idx is None:
            StaticKVCache.truncate(self, start + n)
        else:
            self.gather(start, idx, n)


class ContextTarget:
    """The core's view of a ``VLMTarget`` decoding after a ``VLMStream``'s context: ``new_cache``
    hands out the stream's cache (its context in front, the prompt pass next), and every pass's
    positions are shifted past the context. Everything else is the target's."""

    def __init__(self, stream: "VLMStream"):
        self.stream, self.target = stream, stream.target

    def __getattr__(self, name):
        return getattr(self.target, name)

    def new_cache(self, batch_size: int, max_len: int) -> ContextCache:
        check(batch_size == 1, "batch_size", "1 (a stream is one row)", batch_size)
        return self.stream.open_answer(max_len)

    def __call__(self, tokens, positions, cache, tree_mask=None, **conditioning):
        check(cache is self.stream.cache, "cache", "the stream's cache (ContextTarget.new_cache)", type(cache).__name__)
        ids = positions + self.stream.answer_id  # text after the context: one id on every axis
        return self.target(tokens, ids.expand(3, *ids.shape) if self.target.mrope else ids, cache, tree_mask,
                           **conditioning)


@dataclass(frozen=True)
class StreamPolicy:
    """What a ``VLMStream`` keeps (StreamingVLM's defaults, for one-second chunks of a 7B model:
    ``visual_round`` 16, ``text_round`` 16, ``text_sink`` 512, ``text_sliding_window`` 512).

    Args:
        vision_window: rounds whose frames stay in the cache.
        text_window: rounds whose question and answer stay in place.
        text_sink: first tokens of the previous text kept.
        text_sliding_window: last tokens of the previous text kept.
    """

    vision_window: int = 4
    text_window: int = 4
    text_sink: int = 32
    text_sliding_window: int = 32

    def __post_init__(self):
        for name in ("vision_window", "text_window"):
            value = getattr(self, name)
            check_int(value, name, 1)
        for name in ("text_sink", "text_sliding_window"):
            value = getattr(self, name)
            check_int(value, name, 0)


@dataclass
class _Round:
    vision: list = field(default_factory=list)  # cache slots of the round's frames
    grids: object = None  # M-RoPE: the frames' (images, 3) patch grids
    question: list = field(default_factory=list)  # slots of the question and its chat frame
    answer: list = field(default_factory=list)  # slots of the answer's tokens
    frame: list = field(default_factory=list)  # slots of the answer's frame words (the end mark)


class VLMStream:
    """A stream's context on one cache of fixed size.

    Args:
        target: a ``VLMTarget`` (LLaVA, Qwen2-VL, Qwen2.5-VL).
        sink_ids: the chat frame's opening tokens (kept for ever: the attention sink).
        policy: a ``StreamPolicy``.
        capacity: cache slots (the context's longest, plus a round's frames, question and answer).
    """

    def __init__(self, target: VLMTarget, sink_ids: list[int], policy: StreamPolicy, capacity: int):
        check(isinstance(target, VLMTarget), "target", "a VLMTarget (LLaVA, Qwen2-VL, Qwen2.5-VL)",
              type(target).__name__)
        rotary = target.language_model.rotary_emb
        check(getattr(rotary, "attention_scaling", 1.0) == 1.0, "target",
              "a language model whose RoPE has no attention scaling (a rotation by a position change is then "
              "a rotary embedding of that change)", getattr(rotary, "attention_scaling", None))
        check(isinstance(policy, StreamPolicy), "policy", "a StreamPolicy", type(policy).__name__)
        check(is_int(capacity) and capacity > len(sink_ids), "capacity",
              f"an int > the sink's {len(sink_ids)} tokens", capacity)
        self.target, self.policy = target, policy
        self.cache = ContextCache(target.model.config, 1, capacity, target.model.dtype, target.device)
        self.tokens: list[int] = []  # the token id of every slot, in cache order
        self.sink: list[int] = []
        self.previous: list[int] = []  # slots of the previous text
        self.rounds: list[_Round] = []
        self.round_index = -1  # rounds started so far - 1
        self.evictions = 0
        self.ids = torch.zeros(3 if target.mrope else 1, 0, dtype=torch.long)  # every slot's position ids
        self.next_id = 0  # the id the next text token gets
        self.answer_id = 0  # the first answer token's id in the current answer (ContextTarget)
        self.feed(sink_ids)
        self.sink = list(range(len(sink_ids)))

    # -- feeding -----------------------------------------------------------------------------------
    def feed(self, ids: list[int], **conditioning) -> list[int]:
        """Append ``ids`` (with the pixels of their image placeholders, as ``vision_inputs``
        returns them) past the context with the target alone; returns their slots."""
        n = len(self.tokens)
        if not ids:
            return []
        check(n + len(ids) <= self.cache.max_len, "the stream's capacity",
              f"room for {len(ids)} more tokens after {n}", self.cache.max_len)
        cache = self.cache
        cache.base, cache.passes = n, 0  # a prompt pass after the context: the pixels go with it
        tokens = torch.tensor([ids], device=self.target.device)
        block, after = self._rope_ids(list(ids), conditioning.get("image_grid_thw"))
        block = block + self.next_id
        positions = (block[:, None] if self.target.mrope else block).to(tokens.device)  # (3, 1, T) or (1, T)
        self.target(tokens, positions, cache, **conditioning)
        self.tokens += list(ids)
        self.ids = torch.cat([self.ids, block], 1)
        self.next_id += after
        return list(range(n, n + len(ids)))

    def _rope_ids(self, tokens: list[int], grids) -> tuple[torch.Tensor, int]:
        """``tokens``' position ids from 0 by the model's rule ((1, T), or (3, T) for M-RoPE) and the
        id the next text token gets."""
        if not self.target.mrope:
            return torch.arange(len(tokens))[None], len(tokens)
        ids = torch.tensor([tokens + tokens[-1:]])  # one more text column: the id after them
        kinds = (ids == self.target.image_token_id).int()
        kinds[:, -1] = 0
        rope = self.target.model.model.get_rope_index(
            ids.to(self.target.device), image_grid_thw=None if grids is None else grids.to(self.target.device),
            mm_token_type_ids=kinds.to(self.target.device))[0]  # (3, 1, T + 1)
        return rope[:, 0, :-1].cpu(), int(rope[0, 0, -1])

    def new_round(self, frame_ids: list[int], **conditioning) -> None:
        """Start a round: prune by the policy, then feed the round's frames (their placeholders and
        ``VLMTarget.vision_inputs`` of their pixels)."""
        self.round_index += 1
        self._prune()
        grids = conditioning.get("image_grid_thw")
        self.rounds.append(_Round(vision=self.feed(frame_ids, **conditioning),
                                  grids=None if grids is None else grids.cpu()))

    def open_answer(self, max_len: int) -> ContextCache:
        """The cache for one ``generate`` call after the context (``ContextTarget.new_cache``)."""
        n = len(self.tokens)
        check(n + max_len <= self.cache.max_len, "the stream's capacity",
              f"room for a {max_len}-slot answer after {n} context tokens", self.cache.max_len)
        self.cache.base, self.cache.passes = n, 0
        self.cache.lengths = torch.full_like(self.cache.lengths, n)
        self.answer_id = self.next_id
        return self.cache

    def close_answer(self, question: list[int], answer: list[int], frame: list[int]) -> None:
        """After ``generate``: the round's question and answer join the context. The decode cached
        the question and part of the answer (the last emitted token is never cached; tokens past an
        end-of-answer in the last pass's block are dropped here); the rest of the answer and the
        ``frame`` words after it (the end-of-turn mark) are fed now."""
        check(bool(self.rounds) and not self.rounds[-1].question, "the stream",
              "one question per round, asked after new_round", "a second question" if self.rounds else "no round")
        n = len(self.tokens)
        text = question + answer
        cached = min(int(self.cache.lengths[0]) - n, len(text))
        check(cached >= len(question), "the decode", "one that cached the question", cached)
        self.cache.lengths = torch.full_like(self.cache.lengths, n + cached)
        self.tokens += text[:cached]
        self.ids = torch.cat([self.ids, (self.next_id + torch.arange(cached)).expand(len(self.ids), -1)], 1)
        self.next_id += cached
        self.feed(text[cached:] + frame)
        r = self.rounds[-1]
        r.question = list(range(n, n + len(question)))
        r.answer = list(range(n + len(question), n + len(text)))
        r.frame = list(range(n + len(text), n + len(text) + len(frame)))

    def discard_answer(self) -> None:
        """After ``generate``: forget the question and answer it cached, so the context is what it
        was at ``open_answer`` (an answer that does not join the stream)."""
        self.cache.lengths = torch.full_like(self.cache.lengths, len(self.tokens))

    # -- StreamingVLM's pruning ------------------------------------------------------------------
    def _prune(self) -> None:
        i, p = self.round_index, self.policy
        moved: list[int] = []
        drop: set[int] = set()
        if i >= p.text_window:
            old = next((r for r in self.rounds if r.question or r.answer), None)
            if old is not None:
                moved = old.answer
                drop |= set(old.question) | set(old.frame)
                old.question, old.answer, old.frame = [], [], []
        if i >= p.vision_window:
            old = next((r for r in self.rounds if r.vision), None)
            if old is not None:
                drop |= set(old.vision)
                old.vision = []
        self.rounds = [r for r in self.rounds if r.vision or r.question or r.answer]
        previous = self.previous + moved
        cut = len(previous) - p.text_sink - p.text_sliding_window
        if cut > 0:
            drop |= set(previous[p.text_sink : p.text_sink + cut])
            previous = previous[: p.text_sink] + previous[p.text_sink + cut :]
        order = self.sink + previous + [s for r in self.rounds for s in r.vision + r.question + r.answer + r.frame
                                        if s not in drop]
        if not moved and not drop:
            return
        self._compact(order)
        where = {old: new for new, old in enumerate(order)}
        self.previous = [where[s] for s in previous]
        for r in self.rounds:
            for name in ("vision", "question", "answer", "frame"):
                setattr(r, name, [where[s] for s in getattr(r, name) if s in where])

    @torch.no_grad()
    def _compact(self, order: list[int]) -> None:
        """Keep the slots ``order``, in that order, at the positions the model's rule gives the kept
        tokens: each key rotated by its position change."""
        cache = self.cache
        tokens = [self.tokens[s] for s in order]
        grids = [r.grids for r in self.rounds if r.vision and r.grids is not None]
        new, self.next_id = self._rope_ids(tokens, torch.cat(grids) if grids else None)
        src = torch.tensor(order)
        delta = (new - self.ids[:, src]).to(cache.k.device)  # per axis: new position - old position
        keys = cache.k[:, :, :, src.to(cache.k.device)]  # (L, 1, H, n, D)
        rotary = self.target.language_model.rotary_emb
        cos, sin = rotary(keys[0], delta[:, None] if self.target.mrope else delta)  # the model's own tables
        half = keys.shape[-1] // 2
        rotated = torch.cat([-keys[..., half:], keys[..., :half]], -1)  # rotate_half, as the model's RoPE
        cache.k[:, :, :, : len(order)] = keys * cos[:, None] + rotated * sin[:, None]
        cache.v[:, :, :, : len(order)] = cache.v[:, :, :, src.to(cache.k.device)]
        cache.lengths = torch.full_like(cache.lengths, len(order))
        self.tokens, self.ids = tokens, new
        self.evictions += 1

    def context_tokens(self) -> int:
        return len(self.tokens)

    def fork(self) -> "VLMStream":
        """An independent copy of this stream (its cache's keys and values copied): the same
        context, to decode another way (the exactness tests' reference)."""
        new = object.__new__(VLMStream)
        new.__dict__.update(self.__dict__)
        cache = self.cache
        new.cache = ContextCache(self.target.model.config, 1, cache.max_len, cache.k.dtype, cache.k.device)
        new.cache.k.copy_(cache.k)
        new.cache.v.copy_(cache.v)
        new.cache.lengths = cache.lengths.clone()
        new.tokens, new.sink, new.previous = list(self.tokens), list(self.sink), list(self.previous)
        new.rounds = [_Round(list(r.vision), r.grids, list(r.question), list(r.answer), list(r.frame))
                      for r in self.rounds]
        return new
