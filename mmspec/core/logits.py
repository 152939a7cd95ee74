"""The logits processor: classifier-free guidance, temperature, top-k, top-p.

Draft and target logits go through the same pipeline, so the accept test compares the two
distributions the user actually asked for; that is what keeps lossless rules lossless with CFG,
temperature and filtering on.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..kernels.torch_ops import cfg_merge, greedy_one_hot, logits_to_probs
from .errors import check, is_int

__all__ = ["LogitsProcessor", "argmax_ids", "cfg_merge", "greedy_one_hot"]


@dataclass(frozen=True)
class LogitsProcessor:
    """Turns raw logits into the sampling distribution.

    Order follows every reference code base we read (LlamaGen, SJD, LANTERN, GSD): CFG merge
    ``l = l_u + s * (l_c - l_u)`` first, then temperature, top-k, top-p, softmax. The result is
    transformers' ``ClassifierFreeGuidanceLogitsProcessor``, ``TemperatureLogitsWarper``,
    ``TopKLogitsWarper`` and ``TopPLogitsWarper`` followed by a softmax, bit for bit on random
    logits (``tests/test_logits_hf.py``), except at exact ties on the top-p boundary (we keep the
    lower token ids) and for ``guidance_scale <= 1``, which transformers refuses.

    Args:
        temperature: ``0`` means greedy (the distribution is one-hot at the argmax).
        top_k: keep the k most likely tokens (``None`` keeps all).
        top_p: nucleus mass in ``(0, 1]`` (``None`` keeps all).
        guidance_scale: CFG scale ``s``; ``None`` turns guidance off. With guidance the logits
            carry a doubled batch ``[cond; uncond]`` and the output has half the rows.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    guidance_scale: float | None = None

    def __post_init__(self):
        check(_real(self.temperature) and self.temperature >= 0, "temperature", ">= 0 (0 means greedy)",
              self.temperature)
        if self.top_k is not None:
            check(is_int(self.top_k) and self.top_k >= 1, "top_k", "an int >= 1 or None", self.top_k)
        if self.top_p is not None:
            check(_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "a float in (0, 1] or None", self.top_p)
        if self.guidance_scale is not None:
            check(_real(self.guidance_scale) and self.guidance_scale >= 0, "guidance_scale", ">= 0 or None",
                  self.guidance_scale)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale is not None

    def merge_guidance(self, logits: torch.Tensor) -> torch.Tensor:
        """(2B, ..., V) as [cond; uncond] -> (B, ..., V); identity without guidance."""
        if not self.uses_guidance:
            return logits
        return cfg_merge(*logits.chunk(2, dim=0), self.guidance_scale)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B or 2B, ..., V) raw logits -> (B, ..., V) float32 probabilities
        (``mmspec.kernels.torch_ops.logits_to_probs``)."""
        return logits_to_probs(logits, self.guidance_scale, self.temperature, self.top_k, self.top_p)

    # -- the token space the decoder asks (token ids here; ``DensityProcessor``: continuous tokens) ----
    def check_eos(self, eos: tuple[int, ...] | None, given) -> None:
        """Refuse a ``generate`` call's ``eos_token_id`` this token space has none of: ids have."""

    def prompt_tokens(self, ids: torch.Tensor, target) -> torch.Tensor:
        """(R, S) prompt ids -> the history's prompt tokens: the ids themselves."""
        return ids

    def new_meters(self) -> None:
        """Per-call head counters (``DecodeState.meters``, ``Stats.heads``): none for logits."""
        return None

    def last_distribution(self, state, out, rows: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """(B, V) probabilities of each row's first token, from the prompt pass's logits at
        ``(rows, at)`` (each prompt's last position)."""
        return self(out.logits[rows, at])

    def pass_distribution(self, state, out, positions: torch.Tensor) -> None:
        """A verify pass's distributions as the rule reads them: None for logits, whose (B, T, V)
        probabilities are built when read (the fused acceptance kernel decides from raw logits)."""
        return None

    def record_tests(self, stats, drafted: int, accepted: torch.Tensor, emitting: torch.Tensor) -> None:
        """Count a pass's accept tests (``accepted`` (B,) prefix lengths, of the ``emitting`` (B,)
        rows) in ``stats`` where this token space reports them per test (``Stats.record_tests``):
        token ids report acceptance per pass instead, so this does nothing."""


def argmax_ids(p: torch.Tensor) -> torch.Tensor:
    """``p.argmax(-1)``, read from ``greedy_one_hot``'s ``argmax_ids`` when ``p`` carries them."""
    ids = getattr(p, "argmax_ids", None)
    return ids if ids is not None and ids.shape == p.shape[:-1] else p.argmax(-1)


def _real(x) -> bool:
    """A finite real number (int, float, numpy scalar; not a bool): what the knobs compare against."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
