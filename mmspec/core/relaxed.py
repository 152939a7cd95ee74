"""Relaxed (lossy) acceptance rules: they accept more drafts than the target's distribution allows.

Each is a ``SpeculativeSampling`` with a different ``accept_prob``; the walk, the residual on
rejection and the bookkeeping are shared. Their knobs trade quality for speed, so benchmarks
report quality beside speed for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import SpeculativeSampling
from .errors import check, check_choice


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


def latent_neighbours(codebook: torch.Tensor, count: int | None = None, normalize: bool = True) -> torch.Tensor:
    """(V, count) the nearest other codes of every code, nearest first (LANTERN's precomputed
    ``top_{N-1}_indices``: L2 distances between codebook vectors, the code itself excluded).

    ``normalize`` l2-normalises the vectors first, the geometry a tokenizer with an l2-normalised
    codebook (LlamaGen's) actually quantises in; the reference code uses the raw weights."""
    e = codebook.detach().float()
    V = e.shape[0]
    count = V - 1 if count is None else count
    check(isinstance(count, int) and 1 <= count <= V - 1, "count", f"an int in [1, {V - 1}]", count)
    if normalize:
        e = torch.nn.functional.normalize(e, dim=-1)
    d = torch.cdist(e, e)
    d.fill_diagonal_(float("inf"))
    return d.topk(count, dim=-1, largest=False).indices


@dataclass(frozen=True)
class LatentProximityConfig:
    """LANTERN's knobs (Jang et al., 2025, "LANTERN: Accelerating Visual Autoregressive Models
    with Relaxed Speculative Decoding"; LANTERN++, Park et al., 2025). Defaults from the
    reference's ``generate_images.py`` (k=1000, delta=0.1), with k capped at V - 1.

    Args:
        k: neighbours considered per draft token (``None``: min(1000, V - 1)).
        delta: total-variation budget: the proximity set A holds the nearest j <= k neighbours whose
            summed target probability stays <= delta. ``delta=0`` is plain (lossless) verification.
        lam: LANTERN++'s multiplicative bound instead: A's mass stays <= (lam - 1) p(x), so the
            relaxed probability is at most lam * p(x); delta is then unused (keep its default).
        rejection: ``"paper"`` removes x and A(x) from the residual after a rejection (the mass
            the test credited to x); ``"reference"`` follows the reference code: it zeroes the k+1
            nearest neighbours whenever A is non-empty (target mass for q=1 drafts, draft mass for
            drafted q), which removes far more than A.
    """

    k: int | None = None
    delta: float = 0.1
    lam: float | None = None
    rejection: str = "paper"

    def __post_init__(self):
        check(self.k is None or (isinstance(self.k, int) and self.k >= 1), "k", "None or an int >= 1", self.k)
        check(isinstance(self.delta, (int, float)) and 0.0 <= self.delta <= 1.0, "delta", "a float in [0, 1]",
              self.delta)
        check(self.lam is None or (isinstance(self.lam, (int, float)) and self.lam >= 1.0), "lam",
              "None or a float >= 1", self.lam)
        check(self.lam is None or self.delta == 0.1, "delta", "left at its default 0.1 when lam is set "
              "(LANTERN++ bounds the set by lam instead)", self.delta)
        check_choice("rejection", self.rejection, ("paper", "reference"))


class LatentProximityAcceptance(SpeculativeSampling):
    """LANTERN's relaxed accept test over latent proximity sets.

    For a draft x with nearest codes n_1(x), n_2(x), ... and S_j = p(n_1) + ... + p(n_j), the
    proximity set is A = {n_1 .. n_j*} with j* the largest j <= k such that S_j <= delta
    (LANTERN) or S_j <= (lam - 1) p(x) (LANTERN++); the test accepts with
    ``min(1, (p(x) + S_j*) / q(x))`` (q = 1 for EAGLE's top-k tree nodes). Moving A's mass onto x
    changes the distribution by exactly S_j* <= delta in total variation per token.

    Args:
        neighbours: (V, >= k + 1) nearest codes per code, nearest first (``latent_neighbours``).
        config: k, delta or lam, and the rejection variant.
    """

    def __init__(self, neighbours: torch.Tensor, config: LatentProximityConfig | None = None):
        self.config = config or LatentProximityConfig()
        V, avail = neighbours.shape
        k = self.config.k if self.config.k is not None else min(1000, V - 1)
        need = k + 1 if self.config.rejection == "reference" else k
        check(k <= V - 1 and avail >= min(need, V - 1), "k",
              f"an int <= {min(avail, V - 1)} (the neighbour table's width)", self.config.k)
        self.k = k
        self.neighbours = neighbours[:, : min(k + 1, avail)].long()

    def _proximity(self, p: torch.Tensor, x: torch.Tensor):
        """-> (nn (N, k), in_A (N, k) bool, mass of A (N,))."""
        nn = self.neighbours.to(p.device)[x][:, : self.k]
        S = p.gather(1, nn).cumsum(-1)  # (N, k), non-decreasing
        cfg = self.config
        if cfg.lam is not None:
            bound = (cfg.lam - 1.0) * p.gather(1, x[:, None])
        else:
            bound = torch.full_like(S[:, :1], cfg.delta)
        in_A = S <= bound
        mass = (S * in_A).amax(-1)  # S at j*, 0 when A is empty
        return nn, in_A, mass

    def accept_prob(self, p, q, x):
        _, _, mass = self._proximity(p, x)
        relaxed = p.gather(1, x[:, None]).squeeze(-1) + mass
        if q is None:
            return relaxed.clamp(max=1.0)
        qx = q.gather(1, x[:, None]).squeeze(-1)
        return torch.where(qx > 0, (relaxed / qx.clamp_min(1e-30)).clamp(max=1.0), 0.0)

    def reject(self, p, q, x):
        nn, in_A, _ = self._proximity(p, x)
        if self.config.rejection == "paper":
            p = p.scatter(1, nn, p.gather(1, nn) * ~in_A)  # A's mass was credited to x
            return super().reject(p, q, x)
        # the reference: zero the k+1 nearest codes whenever A is non-empty, then take the residual
        # (uniform when nothing is left)
        wide = self.neighbours.to(p.device)[x]
        hit = in_A.any(-1, keepdim=True)
        if q is None:
            q = torch.nn.functional.one_hot(x, p.shape[-1]).to(p.dtype)
            p = p.scatter(1, wide, p.gather(1, wide) * ~hit)
        else:
            q = q.scatter(1, wide, q.gather(1, wide) * ~hit)
        r = (p - q).clamp(min=0)
        total = r.sum(-1, keepdim=True)
        return torch.where(total > 0, r / total.clamp_min(1e-30), 1.0 / p.shape[-1])
