"""Relaxed (lossy) acceptance rules: they accept more drafts than the target's distribution allows.

On token ids (GSD's groups, LANTERN's proximity sets) each is a ``SpeculativeSampling`` with a
different ``accept_prob``; the walk, the residual on rejection and the bookkeeping are shared. On
densities, ``CSpDAcceptance`` tests the coupled outputs of draft and target along an aligned
denoising chain (CSpD's reference rule) on chains. Their knobs trade quality for speed, so
benchmarks report quality beside speed for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .acceptance import SpeculativeSampling, check_chain
from .distributions import TokenDist, normal_log_prob, state_latent_token
from .errors import check, check_choice, check_int, is_int
from .sampling import Generators, rand, randn, select_rows
from .tree import DraftTree
from .types import Acceptance


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
        check_int(self.half_width, "half_width", 1)


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

    continuous = False  # token ids and their embeddings only

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
    check(is_int(count) and 1 <= count <= V - 1, "count", f"an int in [1, {V - 1}]", count)
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
        delta: total-variation budget per emitted token: the proximity sets hold the nearest
            neighbours whose summed target probability stays within it. ``delta=0`` is plain
            (lossless) verification.
        lam: LANTERN++'s multiplicative bound instead: A's mass stays <= (lam - 1) p(x), so the
            relaxed probability is at most lam * p(x); delta is then unused (keep its default).
        rejection: ``"paper"`` removes x and A(x) from the residual after a rejection (the mass
            the test credited to x); ``"reference"`` follows the reference code: it zeroes the k+1
            nearest neighbours whenever A is non-empty (target mass for q=1 drafts, draft mass for
            drafted q), which removes far more than A.
        budget: ``"per-token"``: one budget per emitted token, spent across a node's siblings and
            bounded for drafted q (the emitted token is within delta of the target in total
            variation; see ``LatentProximityAcceptance``); ``"per-test"``: the papers' rule, delta
            per accept test (siblings and drafted q exceed delta). ``None``: per-token with the
            paper's rejection, per-test with the reference's (whose over-zeroing has no bound).
    """

    k: int | None = None
    delta: float = 0.1
    lam: float | None = None
    rejection: str = "paper"
    budget: str | None = None

    BUDGETS = ("per-token", "per-test")

    def __post_init__(self):
        check_int(self.k, "k", 1, optional=True)
        check(isinstance(self.delta, (int, float)) and 0.0 <= self.delta <= 1.0, "delta", "a float in [0, 1]",
              self.delta)
        check(self.lam is None or (isinstance(self.lam, (int, float)) and self.lam >= 1.0), "lam",
              "None or a float >= 1", self.lam)
        check(self.lam is None or self.delta == 0.1, "delta", "left at its default 0.1 when lam is set "
              "(LANTERN++ bounds the set by lam instead)", self.delta)
        check_choice("rejection", self.rejection, ("paper", "reference"))
        if self.budget is not None:
            check_choice("budget", self.budget, self.BUDGETS)
        check(not (self.budget == "per-token" and self.rejection == "reference"), "budget",
              "'per-test' or None with rejection='reference' (its over-zeroing moves mass the budget "
              "does not count)", self.budget)

    @property
    def resolved_budget(self) -> str:
        if self.budget is not None:
            return self.budget
        return "per-token" if self.rejection == "paper" else "per-test"


# drafted q: credits go to the tokens q most under-covers (q - p largest); bounds the (N, C, k) work
DRAFTED_CANDIDATES = 32


class LatentProximityAcceptance(SpeculativeSampling):
    """LANTERN's relaxed verification over latent proximity sets.

    **The papers' test** (``budget="per-test"``). For a draft x with nearest codes n_1(x), n_2(x),
    ... and S_j = p(n_1) + ... + p(n_j), the proximity set is A = {n_1 .. n_j*} with j* the largest
    j <= k such that S_j <= delta (LANTERN) or S_j <= (lam - 1) p(x) (LANTERN++); the test accepts
    with ``min(1, (p(x) + S_j*) / q(x))`` (q = 1 for EAGLE's top-k tree nodes) and a rejection
    leaves ``p`` without x and A (``rejection="paper"``). One such test with q = 1 moves A's mass
    onto x: the emitted distribution is within S_j* <= delta of p in total variation. It does not
    stay there when a node has several children or when q is drafted: each rejected sibling's
    residual is relaxed by delta again (after siblings x_1..x_m the moved mass is
    sum_i delta * Z_i, Z_i the residual's mass before sibling i: up to m * delta), and with drafted
    q every candidate y of q gets its own credit S(y), so the output drifts towards q (when
    q(y) <= p(y) + S(y) for all y, everything is accepted and the output *is* q).

    **Per emitted token** (``budget="per-token"``, the default). The rule first builds, at every
    tree node, a relaxed target ``p*`` with ``TV(p*, p) <= delta``, then verifies the draft
    *exactly* against ``p*`` (``SpeculativeSampling``: recursive rejection over siblings). Exact
    verification emits ``p*`` (given whatever ``p*`` was built from, as long as the drafts are
    distributed as their q given it), so every emitted token, accepted draft, correction or bonus,
    is within delta of the target. How ``p*`` is built:

    - q = 1 (deterministic drafts; children x_1, x_2, ... of a node tried in order): one budget b
      (= delta) per node. Sibling i's set A_i is LANTERN's, on the node's mass not yet moved and
      not on earlier siblings, with the cumulative bound ``S <= b - (sum of S_j, j < i)`` instead of
      delta; A_i's mass moves onto x_i. Then ``TV(p*, p) <= sum_i S_i <= delta``. Verifying p*
      exactly tries x_1 with ``p(x_1) + S_1`` (LANTERN's first test, unchanged), and after a
      rejection the residual is p* without x_1, which lacks A_1 (the paper's rejection): the
      siblings' sets share one budget instead of spending delta each.
    - drafted q (Jacobi windows, sampled trees; p* may depend on q but not on the drawn token):
      every token y that q under-covers gets a credit ``c(y) = min(S(y), q(y) - p(y))`` (S(y) its
      LANTERN set's mass at delta; more than q(y) - p(y) raises no acceptance), taken from A(y)
      in proportion (A(y)'s member z gives ``p(z) c(y) / S(y)``). One factor
      ``s = min(1, delta / sum c, 1 / max_z load(z))`` (load: the fraction of z's mass the
      credits would take, summed over the sets that hold z) keeps every p* >= 0 and the moved mass
      ``s sum c <= delta``, so ``TV(p*, p) <= delta``; the test is ``min(1, p*(x) / q(x))`` and
      the residual ``norm(max(p* - q, 0))``. A node's siblings all verify against the p* of its
      first child's q. Credits go to the ``DRAFTED_CANDIDATES`` tokens with the largest q - p.
      A one-hot q (a fresh Jacobi token) gets the q = 1 credit, A's whole mass when it fits.
    - lam (LANTERN++): no delta budget; sets are bounded by ``(lam - 1)`` times the candidate's
      remaining mass, so ``p*(y) <= lam * p(y)`` for every y, per emitted token, with siblings and
      drafted q alike (debits only lower p*).

    At ``delta = 0`` (or ``lam = 1``) p* = p bit for bit and the rule is ``SpeculativeSampling``
    (EAGLE's verification) draw for draw. ``rejection="reference"`` has only the per-test form.

    **Temperature 0.** The decoder hands the rule the greedy one-hot distribution, so a proximity
    set can only hold zero-mass codes (unless delta = 1 reaches the argmax) and ``lantern`` is
    exactly greedy EAGLE: nothing is relaxed. The reference's greedy branch instead reads the
    softmax of the guided logits, replaces p(x) by p(x) + S_j* in that vector and accepts x iff it
    is then the argmax; that needs the untempered probabilities, which a greedy ``LogitsProcessor``
    does not pass, so it is not offered (the maintainers advise temperature 1 for LANTERN, issue #6).

    Args:
        neighbours: (V, >= k + 1) nearest codes per code, nearest first (``latent_neighbours``).
        config: k, delta or lam, the rejection variant and the budget.
    """

    continuous = False  # proximity sets over a codebook's ids

    def __init__(self, neighbours: torch.Tensor, config: LatentProximityConfig | None = None):
        self.config = config or LatentProximityConfig()
        V, avail = neighbours.shape
        k = self.config.k if self.config.k is not None else min(1000, V - 1)
        need = k + 1 if self.config.rejection == "reference" else k
        check(k <= V - 1 and avail >= min(need, V - 1), "k",
              f"an int <= {min(avail, V - 1)} (the neighbour table's width)", self.config.k)
        self.k = k
        self.neighbours = neighbours[:, : min(k + 1, avail)].long()
        self.budget = self.config.resolved_budget
        self._exact = SpeculativeSampling()

    # -- the papers' single test -----------------------------------------------------------------
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
        """The papers' test of one draft (``budget="per-test"``; one q = 1 test of either budget)."""
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

    # -- per emitted token: relax the target, then verify exactly ------------------------------------
    def __call__(self, draft: DraftTree, p_all: torch.Tensor, generator: Generators = None) -> Acceptance:
        if self.budget == "per-test" or draft.tokens.shape[1] == 0:
            return super().__call__(draft, p_all, generator)
        return self._exact(draft, self.relaxed_targets(draft, p_all), generator)

    def relaxed_targets(self, draft: DraftTree, p_all: torch.Tensor) -> torch.Tensor:
        """(B, N+1, V) -> (B, N+1, V): p* at every node, built from its children (q = 1) or its
        first child's q (drafted), each within delta of p in total variation."""
        B, N1, V = p_all.shape
        children = draft.tree.children  # (B, N+1, K), -1 where absent
        if children.shape[-1] == 0:
            return p_all
        p = p_all.reshape(B * N1, V)
        rows = torch.arange(B, device=p_all.device)[:, None, None]
        tok = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=p_all.device), draft.tokens], 1)  # (B, N+1)
        kid_tok = torch.where(children >= 0, tok[rows, children.clamp(min=0)], -1)  # (B, N+1, K)
        if draft.q is None:
            return self._relax_siblings(p, kid_tok.reshape(B * N1, -1)).view(B, N1, V)
        first = children[..., 0]  # (B, N+1)
        q_nodes = torch.cat([draft.q.new_zeros(B, 1, V), draft.q], 1)  # (B, N+1, V), node 0 has none
        q = q_nodes[torch.arange(B, device=p_all.device)[:, None], first.clamp(min=0)]
        has = (first >= 0).reshape(-1)
        relaxed = self._relax_drafted(p, q.reshape(B * N1, V))
        return torch.where(has[:, None], relaxed, p).view(B, N1, V)

    def _bound(self, mu_x: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """(M,) candidate's remaining mass, (M,) budget left -> (M, 1) bound on its set's mass."""
        if self.config.lam is not None:
            return ((self.config.lam - 1.0) * mu_x)[:, None]
        return left[:, None]

    def _relax_siblings(self, p: torch.Tensor, kids: torch.Tensor) -> torch.Tensor:
        """(M, V) node targets, (M, K) children tokens (-1: none), tried in order -> (M, V) p*."""
        star = p.clone()
        mu = p.clone()  # mass still movable: not moved yet, not on an earlier sibling
        left = torch.full_like(p[:, 0], self.config.delta)
        table = self.neighbours.to(p.device)
        for s in range(kids.shape[1]):
            x = kids[:, s]
            present = x >= 0
            xc = x.clamp(min=0)
            nn = table[xc][:, : self.k]  # (M, k)
            mu_nn = mu.gather(1, nn)
            S = mu_nn.cumsum(-1)  # (M, k)
            in_A = (S <= self._bound(mu.gather(1, xc[:, None]).squeeze(-1), left)) & present[:, None]
            mass = (S * in_A).amax(-1)  # (M,)
            # A's movable mass leaves its members (an earlier sibling in A keeps its own: mu = 0 there)
            star = star.scatter(1, nn, star.gather(1, nn) - mu_nn * in_A)
            star = star.scatter_add(1, xc[:, None], mass[:, None])
            mu = mu.scatter(1, nn, mu_nn * ~in_A)
            mu = mu.scatter(1, xc[:, None], torch.where(present[:, None], 0.0, mu.gather(1, xc[:, None])))
            left = left - mass
        return star

    def _relax_drafted(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """(M, V) node targets, (M, V) the draft's q there -> (M, V) p*, independent of the draw."""
        M, V = p.shape
        if M == 0:  # no drafted node in this block (e.g. every ZipAR lane is at a row's start)
            return p.clone()
        C = min(DRAFTED_CANDIDATES, V)
        gap, y = (q - p).topk(C, dim=-1)  # (M, C) the most under-covered tokens
        gap = gap.clamp(min=0)
        nn = self.neighbours.to(p.device)[y][..., : self.k]  # (M, C, k)
        p_nn = p.gather(1, nn.reshape(M, -1)).view(M, C, -1)
        S = p_nn.cumsum(-1)
        if self.config.lam is not None:
            bound = (self.config.lam - 1.0) * p.gather(1, y)[..., None]
        else:
            bound = torch.full_like(S[..., :1], self.config.delta)
        in_A = S <= bound
        mass = (S * in_A).amax(-1)  # (M, C)
        credit = torch.minimum(mass, gap) * (gap > 0)
        frac = torch.where(mass > 0, credit / mass.clamp_min(1e-30), 0.0)  # share of each member taken
        load = torch.zeros_like(p).scatter_add(1, nn.reshape(M, -1), (frac[..., None] * in_A).reshape(M, -1))
        total = credit.sum(-1)
        scale = torch.ones_like(total)
        if self.config.lam is None:
            scale = torch.minimum(scale, self.config.delta / total.clamp_min(1e-30))
        scale = torch.minimum(scale, 1.0 / load.amax(-1).clamp_min(1e-30))  # no member goes below 0
        moved = total > 0
        star = p - scale[:, None] * load * p
        star = star.scatter_add(1, y, scale[:, None] * credit)
        return torch.where(moved[:, None], star.clamp(min=0), p)


class CSpDAcceptance:
    """CSpD's accept test and residual (Wang et al., 2025, "Continuous Speculative Decoding for
    Autoregressive Image Generation"; reference code MarkXCloud/CSpD @ d91f721a,
    ``DistributionProcessor.judge_accept`` / ``sample_distribution``), a named **lossy** option.

    What it needs of the target's ``TokenDist`` (a diffusion head's ``DiffusionTokens`` has it):
    ``aligned(draw)``, its own denoising chain rerun with the draw's noise, giving ``state`` (the
    chain's last state), ``mu0`` (its emitted latent), ``sigma0`` (the last step's tempered std)
    and ``log_sigma`` (the other steps' summed untempered log std), each (*batch, d); draws whose
    ``aux`` holds the draft's ``sigma0`` and ``log_sigma``; and two-row tokens
    (``state_latent_token``: state, then emitted latent).

    The draft's chain for a token is rerun by the target with the same noise (``aligned``: K
    sequential head calls per verify pass). With ``mu_q0 = x`` the draft's emitted latent, sigma_0
    the last step's (tempered) std, L the summed untempered log sigma of the other steps and
    ``tau = inner_temperature``, a drafted token is accepted when

        u < exp(sum(L_p - L_q)) * prod(sigma_q0 / sigma_p0) * exp(-1/2 ||(x - mu_p0) / (tau sigma_p0)||^2)

    a Gaussian kernel on the distance between the *coupled* outputs of draft and target, not a
    density ratio: its bias grows with the tolerance ``tau sigma_0`` (at tau = 1 almost nothing
    is accepted; the reference uses 42). On rejection ``y ~ N(mu_p0, sigma_p0^2)`` is accepted with
    ``(p(y) - q(y) / fixed)^+ / p(y)`` (``fixed = exp(sum(L_p - L_q))``, Gaussians at the last
    step, untempered by tau), at most ``max_tries`` times. Deviations forced by a causal loop:
    each drafted token is conditioned on the drafted prefix (the reference verifies a block on
    stale context), the chain ends at the first rejection (the reference tests every token), and
    after ``max_tries`` failures the target's aligned output is emitted (the reference leaves zero
    latents); fallbacks are counted in the target meter. CFG scale and temperature are the
    pipeline's, the same for draft and target at every token (the reference verifies a block with
    the draft's latest scale). Accepted tokens are the draft's own (state and latent); a corrected
    token takes the target's aligned state.
    """

    continuous = True

    def __init__(self, inner_temperature: float = 42.0, max_tries: int = 100):
        check(isinstance(inner_temperature, (int, float)) and not isinstance(inner_temperature, bool)
              and math.isfinite(inner_temperature) and inner_temperature > 0, "inner_temperature", "a float > 0",
              inner_temperature)
        check_int(max_tries, "max_tries", 1)
        self.inner_temperature, self.max_tries = float(inner_temperature), max_tries

    def sample(self, p: TokenDist, generator: Generators = None) -> torch.Tensor:
        return p.sample(generator).token

    def __call__(self, draft: DraftTree, p_all: TokenDist, generator: Generators = None) -> Acceptance:
        check(callable(getattr(p_all, "aligned", None)), "p_all",
              "a TokenDist with aligned(draw) (a denoising chain rerun with a draw's noise: the cspd rule needs "
              "a diffusion head)", type(p_all).__name__)
        check_chain(draft)
        B, G = p_all.batch_shape[0], draft.tokens.shape[1]
        device = p_all.device
        rows = torch.arange(B, device=device)
        n = torch.zeros(B, dtype=torch.long, device=device)
        next_token = torch.zeros((B,) + tuple(p_all.token_shape), dtype=p_all.token_dtype, device=device)
        if G > 0:
            x = draft.draws
            al = p_all[:, :G].aligned(x)  # (B, G, d) each
            mu_q, sig_q = x.token[..., 1, :].double(), x.aux["sigma0"]
            log_fixed = (al["log_sigma"] - x.aux["log_sigma"]).sum(-1)  # (B, G)
            tau = self.inner_temperature
            log_r = (log_fixed + (sig_q.log() - al["sigma0"].log()).sum(-1)
                     - 0.5 * ((mu_q - al["mu0"]) / (tau * al["sigma0"])).pow(2).sum(-1))
            ok = rand((B, G), generator, device, torch.float64).log() < log_r
            n = ok.long().cumprod(1).sum(1)
            r = rows[n < G]
            if r.numel():
                at = n[r]
                pick = lambda t: t[r, at]  # noqa: E731
                latent = self._residual(pick(al["mu0"]), pick(al["sigma0"]), pick(mu_q), pick(sig_q),
                                        pick(log_fixed), select_rows(generator, r), p_all.meter)
                next_token[r] = state_latent_token(pick(al["state"]), latent, next_token.dtype)
        r = rows[n == G]
        if r.numel():
            next_token[r] = p_all[r, torch.full_like(r, G)].sample(select_rows(generator, r)).token.to(next_token.dtype)
        depth = torch.arange(G + 1, device=device)
        return Acceptance(path=torch.where(depth <= n[:, None], depth, -1), num_accepted=n, next_token=next_token)

    def _residual(self, mu_p, sig_p, mu_q, sig_q, log_fixed, generator, meter):
        """CSpD's residual sampler on the last step's Gaussians, capped; the target's aligned
        output ``mu_p`` where every try failed."""
        m, d = mu_p.shape
        out = mu_p.clone()
        pending = torch.arange(m, device=mu_p.device)
        for _ in range(self.max_tries):
            if pending.numel() == 0:
                break
            gen = select_rows(generator, pending)
            mp, sp, mq, sq = mu_p[pending], sig_p[pending], mu_q[pending], sig_q[pending]
            y = mp + sp * randn((pending.numel(), d), gen, mu_p.device, torch.float64)
            logp = normal_log_prob(y, mp, sp).sum(-1)
            logq = normal_log_prob(y, mq, sq).sum(-1)
            ok = rand((pending.numel(),), gen, mu_p.device, torch.float64) < -torch.expm1(
                logq - log_fixed[pending] - logp)
            if meter is not None:
                meter.residual_tries += pending.numel()
            out[pending[ok]] = y[ok]
            pending = pending[~ok]
        if meter is not None:
            meter.residual_rows += m
            meter.residual_fallbacks += pending.numel()
        return out
