"""Relaxed (lossy) acceptance rules: they accept more drafts than the target's distribution allows.

Each is a ``SpeculativeSampling`` with a different ``accept_prob``; the walk, the residual on
rejection and the bookkeeping are shared. Their knobs trade quality for speed, so benchmarks
report quality beside speed for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import SpeculativeSampling
from .errors import check


@dataclass(frozen=True)
class GroupedAcceptanceConfig:
    """Grouped Speculative Decoding's knobs (So et al., 2025, "Grouped Speculative Decoding for
    Autoregressive Image Generation"); defaults from its reference code (``test_GSD.py``).

    Args:
        p_threshold: a group member y needs ``|p(y) - p(x)| < p_threshold``. 0 gives plain SJD.
        d_threshold: and ``||e_y - e_x||^2 < d_threshold`` on the target's input embeddings.
        half_width: candidates are the tokens ranked ``[r(x) - half_width, r(x) + half_width)``
            by target probability.
    """

    p_threshold: float = 0.15
    d_threshold: float = 0.5
    half_width: int = 7

    def __post_init__(self):
        check(self.p_threshold >= 0, "p_threshold", ">= 0", self.p_threshold)
        check(self.d_threshold >= 0, "d_threshold", ">= 0", self.d_threshold)
        check(isinstance(self.half_width, int) and self.half_width >= 1, "half_width", "an int >= 1",
              self.half_width)


class GroupedAcceptance(SpeculativeSampling):
    """GSD's dynamic grouped accept test: a draft x is accepted with
    ``min(1, sum_{y in G} p(y) / sum_{y in G} q(y))``, where the group G holds x and the tokens of
    nearby target rank whose probability and embedding are both close to x's. Clustering visually
    interchangeable tokens raises acceptance where image models spread mass over many of them.

    On rejection it resamples from the token-level residual ``norm(max(p - q, 0))``, as the
    reference code does (SJD's rule). With ``p_threshold = 0`` (or ``d_threshold = 0``) the group
    is ``{x}`` and the rule is exactly ``SpeculativeSampling``. Deterministic drafts (``q=None``)
    count as one-hot, which the reference code uses for freshly initialised Jacobi tokens.

    Args:
        embeddings: (V, D) the target's input token embeddings (the reference uses these, squared
            L2 distances).
        config: the thresholds and window.
    """

    def __init__(self, embeddings: torch.Tensor, config: GroupedAcceptanceConfig | None = None):
        self.embeddings = embeddings.detach().float()
        self.config = config or GroupedAcceptanceConfig()

    def group(self, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(N, V) target probabilities, (N,) drafts -> (N, 2w) candidate ids, -1 outside G."""
        cfg = self.config
        N, V = p.shape
        order = p.argsort(dim=-1, stable=True)  # (N, V) ascending, as the reference ranks logits
        rank = order.argsort(dim=-1).gather(1, x[:, None])  # (N, 1)
        offsets = torch.arange(-cfg.half_width, cfg.half_width, device=p.device)
        slots = rank + offsets  # (N, 2w)
        inside = (slots >= 0) & (slots < V)
        cand = order.gather(1, slots.clamp(0, V - 1))  # (N, 2w)
        px = p.gather(1, x[:, None])
        close_p = (p.gather(1, cand) - px).abs() < cfg.p_threshold
        e = self.embeddings.to(p.device)
        close_e = (e[cand] - e[x][:, None]).pow(2).sum(-1) < cfg.d_threshold
        member = inside & ((close_p & close_e) | (cand == x[:, None]))
        return torch.where(member, cand, -1)

    def accept_prob(self, p, q, x):
        g = self.group(p, x)  # (N, 2w)
        present = g >= 0
        g = g.clamp(min=0)
        p_mass = (p.gather(1, g) * present).sum(-1)
        if q is None:  # one-hot q: the group's draft mass is q(x) = 1
            return p_mass.clamp(max=1.0)
        q_mass = (q.gather(1, g) * present).sum(-1)
        qx = q.gather(1, x[:, None]).squeeze(-1)
        # a draft the proposal could not have produced is never accepted (empty tree slots)
        return torch.where(qx > 0, (p_mass / q_mass.clamp_min(1e-30)).clamp(max=1.0), 0.0)
