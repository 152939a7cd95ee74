"""Categorical sampling by inverse CDF: one uniform per row, no per-row setup.

``torch.multinomial`` builds per-row alias state on the CPU and is the slowest op in a decode
step at large batch; a cumulative sum and a binary search do the same job exactly.
"""

from __future__ import annotations

import torch


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs (..., V), rows summing to > 0 -> (...,) indices drawn from each row."""
    cdf = probs.cumsum(-1)  # (..., V)
    u = torch.rand(cdf.shape[:-1] + (1,), device=cdf.device, generator=generator, dtype=cdf.dtype)
    total = cdf[..., -1:]
    # kept strictly below the total even when u * total rounds up to it
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # right=True picks the first token whose cdf exceeds the target: zero-mass tokens never win
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
