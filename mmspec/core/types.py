"""The core's roles as protocols, and the records they exchange: the seams, in one place.

Names follow the speculative decoding papers: the *target* p, the *draft* q, a *proposal*
(chain or tree) verified in one target pass, an *acceptance* per row.

Imports point one way: ``errors``, ``sampling``, ``tokens``, ``distributions``, ``logits``, ``tree`` ->
``types`` -> the drafters,
rules, schedules and the decoder. Nothing here imports the decoder.

| protocol | implementations |
|---|---|
| ``Target`` | ``TinyCausalLM``, the HF adapters, ``LlamaGen`` (``mmspec.models``, ``mmspec.adapters``) |
| ``Drafter`` (defaults: ``DrafterBase``) | ``mmspec.core.drafters``, ``PromptLookupDrafter`` |
| ``FeatureHead`` | EAGLE heads (``mmspec.models.eagle``, ``mmspec.models.vlm_draft``) |
| ``AcceptanceRule`` | ``GreedyMatch``, ``SpeculativeSampling``, the relaxed rules |
| ``TokenHead`` -> ``TokenDist`` | continuous heads (``mmspec.models.continuous_heads``) |
| ``DecodingSchedule`` -> ``SchedulePlan`` | ``RasterSchedule``, ``NextSetSchedule`` |
| ``KVCache`` | ``mmspec.core.cache``, the HF cache adapter |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from .distributions import DensityProcessor, HeadMeter, TokenDist
from .logits import LogitsProcessor
from .sampling import Generators
from .tokens import gather_tokens
from .tree import DraftTree


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # (B, T, V); None for continuous tokens
    hidden: torch.Tensor | None = None  # (B, T, H): the LM head's input, for feature drafters
    # (B, T, E) the input embeddings a prompt pass actually fed (a VLM's image features scattered
    # into its placeholders): what vision-aware drafters read from ``DecodeState.prefill``
    prompt_embeds: torch.Tensor | None = None
    # continuous tokens: the features z (B, T, H) the per-token heads read, and those heads by name
    # (``TokenHead``s; ``DensityProcessor(head=...)`` picks one)
    cond: torch.Tensor | None = None
    heads: Mapping[str, Any] | None = None


@dataclass
class Acceptance:
    """What one verification accepted, per row.

    Attributes:
        path: (B, D+1) node indices from the root (0) along the accepted path, -1 past it.
        num_accepted: (B,) accepted draft tokens (the root and the next token not counted).
        next_token: (B, *token_shape) the token the target adds: correction after a rejection,
            bonus otherwise.
        tokens: (B, D, *token_shape) the tokens emitted at depths 1..D of the accepted path when
            they differ from the drafts (a diffusion head's ``path`` rule emits the target's own
            last denoising step); None emits the drafted tokens.
        log_p: (B, D) float64 log target density of each drafted chain token, where a density rule
            computed it (continuous tokens; a Jacobi drafter reuses it); None otherwise.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    next_token: torch.Tensor
    tokens: torch.Tensor | None = None
    log_p: torch.Tensor | None = None


@dataclass
class DecodeState:
    """What drafters may read: every target row's token history and the sampling setup.

    With guidance the target runs ``R = 2B`` rows, ``[cond; uncond]``; both halves receive the same
    generated tokens, so ``tokens[:B]`` and ``tokens[B:]`` differ only in their prompts.

    ``generator`` is None, one ``torch.Generator``, or a tuple of ``batch_size`` generators (one
    per row, the lanes of one image sharing theirs); draw through ``mmspec.core.sampling`` so that
    row r uses generator r.

    Continuous tokens (a target with a non-empty ``token_shape``) make ``tokens`` (R, capacity,
    *token_shape) floats (prompt ids broadcast over the token shape), ``processor`` a
    ``DensityProcessor`` and ``meters`` the call's head counters (``"target"``, ``"draft"``).
    """

    tokens: torch.Tensor  # (R, capacity[, *token_shape]) prompt then generated tokens, garbage past lengths
    lengths: torch.Tensor  # (R,)
    batch_size: int
    processor: LogitsProcessor | DensityProcessor  # how the call turns model outputs into distributions
    generator: Generators
    max_len: int  # slots a cache needs for this call (prompt + new tokens + two blocks)
    # the target's prefill output, set only while ``Drafter.start`` runs (feature drafters read
    # its ``hidden``); cleared afterwards so the prompt's logits are not held while decoding
    prefill: ModelOutput | None = None
    prompt_lengths: torch.Tensor | None = None  # (R,) where each row's generated tokens start
    # the call's conditioning (``generate(conditioning=...)``): fed with the prompt pass of the
    # target, and of any draft model that sees the prompt the same way (``_DraftModelRunner``)
    conditioning: Mapping[str, Any] = field(default_factory=dict)
    new_tokens: int = 0  # the call's max_new_tokens (MAR's linear guidance schedule counts in it)
    meters: Mapping[str, HeadMeter] | None = None  # continuous tokens: head work of target and draft
    # host copy of each row's generated-token count (``batch_size`` ints, ``lengths - prompt_lengths``),
    # read with the pass's stop flag in the loop's one host read: progress bars read it, not the device
    generated: list[int] | None = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def token_shape(self) -> tuple[int, ...]:
        """``()`` for token ids, the trailing shape of continuous tokens."""
        return tuple(self.tokens.shape[2:])

    @property
    def continuous(self) -> bool:
        return self.tokens.dim() > 2

    def distribution(self, out: ModelOutput, positions: torch.Tensor, meter: HeadMeter | None = None) -> TokenDist:
        """Continuous tokens: the (B, T) distributions of a model output scored at (R, T)
        ``positions``, through the call's ``DensityProcessor`` (each output predicts the token
        after its position)."""
        B = self.batch_size
        index = positions[:B] - self.prompt_lengths[:B, None] + 1  # generated index of the predicted token
        return self.processor(out, index, self.new_tokens, meter)

    def history(self, index: torch.Tensor) -> torch.Tensor:
        """``tokens[r, index[r, w]]`` for (R, W) ``index``, any token shape."""
        return gather_tokens(self.tokens, index)

    @property
    def roots(self) -> torch.Tensor:
        """(B,) each row's last token: emitted, but not yet in the target's cache."""
        B = self.batch_size
        return self.tokens[torch.arange(B, device=self.tokens.device), self.lengths[:B] - 1]

    def target_rows(self, b: int) -> list[int]:
        """The target rows of batch row ``b``: ``[b]``, or ``[b, b + B]`` with guidance."""
        return [b] if self.rows == self.batch_size else [b, b + self.batch_size]

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) -> (R, ...): the uncond half of a guided batch mirrors the cond half."""
        return x if self.rows == self.batch_size else torch.cat([x, x], 0)


@runtime_checkable
class KVCache(Protocol):
    """What the decoder needs of a cache (see ``mmspec.core.cache``)."""

    def next_positions(self) -> torch.Tensor: ...

    def truncate(self, lengths: torch.Tensor) -> None: ...

    def keep_block(self, block_size: int, idx: torch.Tensor | None, n: torch.Tensor) -> None: ...


@runtime_checkable
class Target(Protocol):
    """The model whose distribution is reproduced. One call scores a whole block.

    ``tree_mask`` (B, T, R + T) bool says which of the block's tokens (and R earlier uncommitted
    ones) each token sees; ``None`` means causal. The block is appended to ``cache``.

    ``conditioning`` is what the caller passed to ``SpeculativeDecoder.generate(conditioning=...)``
    (a VLM's ``pixel_values``, ...): it reaches the target with the prompt pass (the prefill) only,
    and is never stored on the model, so one model object serves any number of calls.

    The decoder puts its tensors on ``target.device`` when the target has that attribute, else
    on the device of its first parameter (CPU for a target with neither).
    """

    vocab_size: int

    def new_cache(self, batch_size: int, max_len: int) -> KVCache: ...

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 tree_mask: torch.Tensor | None = None, **conditioning) -> ModelOutput: ...


@runtime_checkable
class Drafter(Protocol):
    """Proposes drafts; verification lives in the decoder, once (transformers'
    ``CandidateGenerator`` shape: one interface, many drafters). Inherit ``DrafterBase`` for the
    defaults of every member but ``propose``.

    Attributes:
        vocab_size: the draft's vocabulary (``None``: the drafter copies tokens, any vocabulary).
        max_block: the largest number of tokens the target verifies in one pass (root + draft).
        forwards: the draft model's passes so far (0 for model-free drafters).
        lane_safe: True when the drafter reads nothing but each row's own root and its own state,
            so a schedule may run it on lanes (ZipAR's rows) instead of raster sequences.

    Optional, for continuous batching (``SpeculativeDecoder.serve``): ``restarts_rows = True`` and
    ``restart_rows(state, rows, alone)`` (``DrafterBase`` documents it; its default refuses).
    """

    vocab_size: int | None
    max_block: int
    forwards: int
    lane_safe: bool

    def start(self, state: DecodeState) -> None:
        """Called once after the target's prefill (the first token is already sampled)."""

    def propose(self, state: DecodeState) -> DraftTree:
        """Draft continuations of each row's last token (the root)."""

    def update(self, state: DecodeState, draft: DraftTree, acceptance: Acceptance,
               target_probs: torch.Tensor, target_out: ModelOutput) -> None:
        """See what the target accepted (and its processed probabilities (B, N+1, V))."""


class DrafterBase:
    """The documented defaults of ``Drafter``: no vocabulary of its own, nothing drafted beyond
    the root, no model passes, not lane-safe, and no-op ``start`` / ``update``. A drafter sets
    what differs and implements ``propose``."""

    vocab_size: int | None = None
    max_block: int = 1
    forwards: int = 0
    lane_safe: bool = False
    reads_target_probs: bool = True
    """Whether ``update`` reads ``target_probs``. The decoder builds the (B, T, V) probabilities only
    when a rule or ``update`` reads them (the fused acceptance kernel reads raw logits); a drafter
    that sets False may get ``target_probs=None``."""

    restarts_rows: bool = False
    """Whether ``restart_rows`` is implemented: ``SpeculativeDecoder.serve`` refuses drafters
    without it (``ValueError`` naming ``drafter``)."""

    def start(self, state: DecodeState) -> None:
        pass

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        """Continuous batching: rows ``rows`` (batch rows b < ``state.batch_size``; with guidance
        b + B is b's uncond row) now hold new prompts. ``state`` already has their history (prompt
        and first token), lengths, prompt lengths and generators; the drafter forgets what it kept
        of the old rows and starts them afresh. ``alone[i]`` is row ``rows[i]`` as it would be
        decoded alone right after its prefill: a batch-1 ``DecodeState`` of the same capacity
        whose ``prefill`` is its prompt pass's output and ``conditioning`` its own (a VLM's
        pixels), so that a drafter can run its ``start`` on it and copy the row in. Called between
        passes, after ``start``. The default refuses (``restarts_rows`` is False)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart rows (continuous batching): "
                                  "implement restart_rows and set restarts_rows = True")

    def propose(self, state: DecodeState) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} must implement propose(state)")

    def update(self, state: DecodeState, draft: DraftTree, acceptance: Acceptance,
               target_probs: torch.Tensor, target_out: ModelOutput) -> None:
        pass


@runtime_checkable
class FeatureHead(Protocol):
    """What ``EagleTreeDrafter`` needs of a feature draft head (``mmspec.models.eagle``).

    ``head(features, tokens, positions, cache, tree_mask)`` scores entries ``(f_{p-1}, x_p)`` at
    positions p: the target's (or the head's own predicted) feature (R, T, H) at p - 1 and the
    token at p; it appends them to ``cache`` and returns the predicted feature at p as ``hidden``
    (R, T, H) and the draft logits of the token at p + 1 (R, T, V).

    ``head.start(cache, state)`` runs once per generation, right after the target's prefill
    (``state.prefill`` is set), before the first feed; a head with nothing to prepare makes it a
    no-op, one that prepares per-prompt inputs (``mmspec.models.vlm_draft``: the prompt's images)
    keeps them in its cache.
    """

    vocab_size: int

    def new_cache(self, batch_size: int, max_len: int) -> KVCache: ...

    def start(self, cache: KVCache, state: DecodeState) -> None: ...

    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache, tree_mask: torch.Tensor | None = None) -> ModelOutput: ...


@runtime_checkable
class ParallelHeads(Protocol):
    """What ``ParallelHeadsDrafter`` needs of parallel draft heads (``mmspec.models.medusa``).

    ``heads(features, root, inputs)``: the target's feature (R, H) before each row's root, the
    root tokens (R,) and the pass's inputs -> (R, K, V) logits, head k for the token k + 1 after
    the root. All K heads run in that one call. ``heads.start(state)`` runs once after the
    prompt pass and returns what stays per generation (an image feature, or None);
    ``heads.step_inputs(state, started)`` turns it into each pass's ``inputs`` (the VLM heads:
    ``started`` itself; the AR image heads: the committed tokens one grid row above the drafts).
    """

    vocab_size: int
    num_heads: int

    def start(self, state: DecodeState) -> Any: ...

    def step_inputs(self, state: DecodeState, started: Any) -> Any: ...

    def __call__(self, features: torch.Tensor, root: torch.Tensor, inputs: Any = None) -> torch.Tensor: ...


@runtime_checkable
class TokenHead(Protocol):
    """A continuous model's per-token head (``ModelOutput.heads``): features -> ``TokenDist``.

    ``head.distribution(cond, uncond, scale, pipeline, meter)``: ``cond`` (B, T, H) features,
    ``uncond`` the unconditional half's (or None without guidance), ``scale`` (B, T) float64 CFG
    scales (or None), ``pipeline`` the ``DensityProcessor`` (temperature, residual cap), ``meter``
    where head calls are counted. Tokens have shape ``token_shape``.
    """

    token_shape: tuple[int, ...]

    def distribution(self, cond: torch.Tensor, uncond: torch.Tensor | None, scale: torch.Tensor | None,
                     pipeline: DensityProcessor, meter: HeadMeter | None) -> TokenDist: ...


@runtime_checkable
class AcceptanceRule(Protocol):
    """Verifies a draft against the target's processed distributions (``mmspec.core.acceptance``).

    ``rule(draft, p_all, generator)``: ``p_all`` (B, N+1, V) is the target's distribution after
    every node (root first); returns each row's accepted path and next token. ``rule.sample(p,
    generator)`` draws (B,) tokens from (B, V) (the prefill's first token). ``generator`` is as in
    ``DecodeState``: row r draws from generator r of a per-row tuple. For continuous tokens
    ``p_all`` is a (B, N+1) ``TokenDist`` and ``sample`` draws (B, *token_shape) from a (B,) one;
    rules that handle them set ``continuous = True``.
    """

    def __call__(self, draft: DraftTree, p_all: torch.Tensor, generator: Generators = None) -> Acceptance: ...

    def sample(self, p: torch.Tensor, generator: Generators = None) -> torch.Tensor: ...


@runtime_checkable
class SchedulePlan(Protocol):
    """One ``generate`` call of a ``DecodingSchedule``: everything that call's order needs, held
    here and not on the schedule, so one schedule object serves concurrent or nested calls.

    The decoder runs over *lanes*: sequences that each grow by "root + drafts -> accepted tokens +
    next token" every pass; a schedule with ``lanes = L`` runs L lanes per prompt row.

    Attributes:
        input_ids, lengths: (R * L, S) the lanes' prompts and (R * L,) their lengths.
        lane_tokens: tokens each lane generates at most (sizes the history).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    lane_tokens: int

    def bind(self, target: Target, state: DecodeState) -> tuple[Target, KVCache]:
        """The target view and cache the loop talks to for this call."""

    def prefill_rows(self, state: DecodeState) -> torch.Tensor | None:
        """(n,) lanes that sample a first token after the prefill (None: all)."""

    def step(self, state: DecodeState, done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fed, emitting) (B,) bool lanes for this pass; may start new lanes in ``state``."""

    def emitting_rows(self, emitting: torch.Tensor) -> torch.Tensor | None:
        """(n,) lanes whose acceptance is drawn this pass (None: all lanes, no selection)."""

    def per_output(self, emitted: torch.Tensor) -> torch.Tensor:
        """(B,) tokens emitted per lane -> per output row (for ``Stats``)."""

    def finished(self, state: DecodeState) -> torch.Tensor:
        """(B,) bool lanes that need no further pass."""

    def collect(self, state: DecodeState, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sequences (B_out, max_new_tokens), lengths (B_out,)) of the call's output rows."""


@runtime_checkable
class DecodingSchedule(Protocol):
    """Which positions each pass decodes (``mmspec.core.schedule``): a stateless factory.

    ``lanes`` lanes per prompt row; ``check_drafter`` refuses drafters the order cannot run (at
    decoder construction); ``start`` checks one call's arguments and returns its ``SchedulePlan``.
    """

    lanes: int

    def check_drafter(self, drafter: Drafter) -> None: ...

    def start(self, input_ids: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int,
              eos_token_id: tuple[int, ...] | None) -> SchedulePlan: ...
