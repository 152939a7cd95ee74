"""The core's roles as protocols and the records they exchange.

Names follow the speculative decoding papers: the *target* p, the *draft* q, a *proposal*
(chain or tree) verified in one target pass, an *acceptance* per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from .decoder import DecodeState
    from .tree import DraftTree


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, V)
    hidden: torch.Tensor | None = None  # (B, T, H): the LM head's input, for feature drafters
    # (B, T, E) the input embeddings a prompt pass actually fed (a VLM's image features scattered
    # into its placeholders): what vision-aware drafters read from ``DecodeState.prefill``
    prompt_embeds: torch.Tensor | None = None


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
    """

    vocab_size: int

    def new_cache(self, batch_size: int, max_len: int) -> KVCache: ...

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                 tree_mask: torch.Tensor | None = None, **conditioning) -> ModelOutput: ...


class Drafter(Protocol):
    """Proposes drafts; verification lives in the decoder, once (transformers'
    ``CandidateGenerator`` shape: one interface, many drafters).

    ``max_block`` is the largest number of tokens the target verifies in one pass (root + draft);
    ``forwards`` counts the draft model's passes so far (0 for model-free drafters).
    """

    vocab_size: int | None
    max_block: int
    forwards: int

    def start(self, state: "DecodeState") -> None:
        """Called once after the target's prefill (the first token is already sampled)."""

    def propose(self, state: "DecodeState") -> "DraftTree":
        """Draft continuations of each row's last token (the root)."""

    def update(self, state: "DecodeState", draft: "DraftTree", acceptance: "Acceptance",
               target_probs: torch.Tensor, target_out: ModelOutput) -> None:
        """See what the target accepted (and its processed probabilities (B, N+1, V))."""


@dataclass
class Acceptance:
    """What one verification accepted, per row.

    Attributes:
        path: (B, D+1) node indices from the root (0) along the accepted path, -1 past it.
        num_accepted: (B,) accepted draft tokens (the root and the next token not counted).
        next_token: (B,) the token the target adds: correction after a rejection, bonus otherwise.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    next_token: torch.Tensor
