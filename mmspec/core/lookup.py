"""Prompt lookup: drafts copied from the context (A. Saxena, 2023, "Prompt Lookup Decoding";
transformers' ``PromptLookupCandidateGenerator``, ``generate(prompt_lookup_num_tokens=...)``).

No model: the last n committed tokens of a row are searched for earlier in the same row (prompt
and generated text alike), longest n first, and the tokens that followed the match are the draft.
Drafts are deterministic (``q=None``: proposal probability 1), so the core's exact rule keeps
decoding lossless under sampling as well as greedy.
"""

from __future__ import annotations

import torch

from .errors import check, check_int
from .tree import DraftTree, Tree
from .types import DecodeState, DrafterBase

__all__ = ["PromptLookupDrafter", "lookup_draft"]


def lookup_draft(seq: torch.Tensor, num_tokens: int, max_ngram: int, min_ngram: int = 1) -> torch.Tensor:
    """The prompt-lookup draft for one row's committed tokens ``seq`` (1-D): for n from
    ``max_ngram`` down to ``min_ngram``, the *first* earlier occurrence of the last n tokens that
    is followed by at least one token (transformers' choice) gives up to ``num_tokens`` of the
    tokens after it. An empty tensor when nothing matches."""
    L = seq.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if L <= n:
            continue
        windows = seq.unfold(0, n, 1)[:-1]  # (L - n, n): every earlier n-gram (not the suffix itself)
        hits = torch.nonzero((windows == seq[L - n :]).all(1)).flatten()
        if len(hits):
            start = int(hits[0]) + n  # the continuation is never empty: the match ends before L
            return seq[start : start + num_tokens]
    return seq[:0]


class PromptLookupDrafter(DrafterBase):
    """Drafts up to ``num_tokens`` tokens per row by n-gram lookup in the row's own context
    (``max_ngram`` down to ``min_ngram``; transformers' defaults are 10 proposed tokens in its
    examples and ``max_matching_ngram_size=2``).

    Rows draft independently; a batch's chain is as long as its longest row's draft, and shorter
    rows are padded by repeating their last token (any deterministic proposal is verified
    exactly, so padding costs verify width, never correctness). No match anywhere: an empty draft,
    and the pass emits the target's token alone.

    Under sampling, a row's chain length depends on the other rows' drafts (the batch's chain is
    as long as its longest), so with a list of generators a row of a batch follows the same
    distribution as that row decoded alone but not the same random stream (greedy: identical)."""

    reads_target_probs = False  # update reads features, or nothing

    vocab_size = None
    lane_safe = True

    def __init__(self, num_tokens: int = 10, max_ngram: int = 2, min_ngram: int = 1):
        for name, value in (("num_tokens", num_tokens), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            check_int(value, name, 1)
        check(min_ngram <= max_ngram, "min_ngram", f"an int <= max_ngram ({max_ngram})", min_ngram)
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_block = num_tokens + 1

    restarts_rows = True  # reads only each row's history: nothing to forget

    def restart_rows(self, state: DecodeState, rows, alone) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        B = state.batch_size
        lengths = state.lengths[:B].tolist()
        drafts = [lookup_draft(state.tokens[r, : lengths[r]], self.num_tokens, self.max_ngram, self.min_ngram)
                  for r in range(B)]
        K = max(len(d) for d in drafts)
        tokens = torch.zeros(B, K, dtype=torch.long, device=state.tokens.device)
        for r, d in enumerate(drafts):
            if K:
                pad = d[-1] if len(d) else state.tokens[r, lengths[r] - 1]
                tokens[r] = pad
                tokens[r, : len(d)] = d
        return DraftTree(tokens, Tree.chain(B, K, tokens.device))
