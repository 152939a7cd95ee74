"""Which decode pass committed each generated token (``Result.commit_pass``; 0 is the prefill).

In raster order (every AR method without ZipAR's next-set schedule, and every VLM method) the step
callback asks for the ``"tokens"`` tensor input, each row's generated tokens so far after every
pass (``pipelines.base``). The tokens a pass added are the ones after the previous pass's, so the
map is exact; a pass that adds ``k`` tokens committed ``k - 1`` accepted drafts and one token of
the target's own (the correction or bonus token). The tensor is right-padded with 0 (a valid token
id), so in a batch a row's length after a pass is read from its tokens against its final ones
(``_row_lengths``); the rare row whose length that leaves open (its next tokens are 0s) gets
``commit_pass = None`` rather than a guess. One row alone is always exact (the tensor is as wide as
the row). ZipAR's lanes fill several grid rows per pass and the pipelines refuse tensor inputs
there (nothing says which positions a pass filled), so ``commit_pass`` is ``None`` for ZipAR
methods. The continuous-token pipeline decodes in raster order and its callback's ``timestep`` is
the tokens per image so far: exact for one image, a mean over a batch, so ``run_continuous`` gives
``commit_pass`` for a single prompt and ``None`` for each row of a batch.
"""

from __future__ import annotations

import numpy as np
import torch


def commit_passes(counts: list[int], total: int) -> np.ndarray:
    """(total,) pass index per token from the token count after the prefill and each pass."""
    passes = np.zeros(total, dtype=np.int32)
    prev = 0
    for step, done in enumerate(counts):
        done = min(done, total)
        passes[prev:done] = step
        prev = max(prev, done)
    passes[prev:] = len(counts)  # anything the last callback did not report
    return passes


def _row_lengths(snapshot: torch.Tensor, finals: list[list[int]], previous: list[int | None]) -> list[int | None]:
    """Each row's length after one pass, counted in its final tokens, from the ``"tokens"`` input
    ``snapshot`` ((B, w): the rows so far, right-padded with 0) and each row's final tokens; ``None``
    where it is not determined. A row may run past its final tokens (drafts accepted beyond its
    EOS, or past ``max_new_tokens``, are cut from the output): its length is then all of them. Else
    a row of length n holds ``final[:n]`` then 0s, so n is at least one past its last non-zero
    token and at least the previous pass's length (``lo``), and can only extend over final tokens
    that are 0. One row alone: n is ``w`` exactly (capped at its final length)."""
    B, w = snapshot.shape
    if B == 1:
        return [min(w, len(finals[0]))]
    out: list[int | None] = []
    for row, final, prev in zip(snapshot.tolist(), finals, previous):
        L = len(final)
        nz = [k for k, t in enumerate(row) if t != 0]
        lo = max(prev or 0, nz[-1] + 1 if nz else 0)
        if prev is None or row[:min(lo, L)] != final[:min(lo, L)]:
            out.append(None)
        elif lo >= L:
            out.append(L)
        else:
            hi = lo
            while hi < min(w, L) and final[hi] == 0:
                hi += 1
            out.append(lo if hi == lo else None)
    return out


def passes_from_tokens(snapshots: list[torch.Tensor], finals: list[list[int]]) -> list[np.ndarray | None]:
    """Per row, the pass that committed each of its final tokens (0: the prefill's one token),
    from the ``"tokens"`` input after every pass; ``None`` for a row whose lengths are not
    determined (see ``_row_lengths``)."""
    counts: list[list[int | None]] = [[1] * len(finals)]  # the prefill emits each row's first token
    for snap in snapshots:
        counts.append(_row_lengths(snap, finals, counts[-1]))
    out = []
    for r, final in enumerate(finals):
        row = [c[r] for c in counts]
        out.append(None if any(n is None for n in row) else commit_passes(row, len(final)))
    return out
