"""Acceptance rules: walk a verified draft tree and decide what the target keeps.

One walk serves chains and trees. At the current node with distribution ``p`` the rule tries
the node's children in order: child x, drawn from ``q``, is accepted with probability
``accept_prob(p, q, x)``; after a rejection ``p`` becomes ``reject(p, q, x)`` and the next
sibling is tried. When a child is accepted the walk moves to it and ``p`` becomes the target's
distribution there; when all children are rejected (or a leaf is reached) the walk stops and
``next_token`` is drawn from ``p``: the correction or the bonus token.

Chains take a vectorised path with the same semantics (all accept tests at once, the first
rejection ends the chain), and so do trees: every node's sibling tests at once, then a path
search (``SpeculativeSampling._walk``, ``accepted_path``). A new rule (LANTERN's relaxed test,
GSD's groups) overrides ``accept_prob`` / ``reject``; the walk, the batching and the bookkeeping
stay here.

Continuous tokens (``p_all`` a ``TokenDist``) take the same chain path on densities: accept with
``exp(min(0, log p(x) - log q(x)))``, on rejection draw from ``p.residual(q)``.
"""

from __future__ import annotations

import torch

from ..kernels import residual_distribution
from .distributions import TokenDist
from .logits import argmax_ids
from .sampling import Generators, rand, sample, select_rows
from .tree import DraftTree
from .types import Acceptance


class SpeculativeSampling:
    """Lossless speculative sampling (Leviathan et al., 2023; Chen et al., 2023), generalised to
    trees by recursive rejection among siblings (SpecInfer, Miao et al., 2024).

    Drafted form: x was drawn from q; accept with ``min(1, p(x) / q(x))``; on rejection
    ``p <- norm(max(p - q, 0))``. Siblings drawn without replacement carry their conditional q, so
    the same recursion stays exact. Deterministic form (``q is None``, EAGLE's top-k trees): q is
    the point mass at x, so accept with ``p(x)`` and on rejection zero ``p(x)`` and renormalise.
    A numerically zero residual falls back to ``p`` (SJD issue #7).

    Densities (continuous tokens, ``p_all`` a ``TokenDist``): x drawn from q is accepted with
    ``min(1, p(x) / q(x))`` in float64 log space, the first rejection ends the chain and the
    correction is drawn from ``p.residual(q)`` (exact, ``mmspec.core.distributions.Residual``);
    the output has density p (the discrete proof with integrals). Accepted drafts are emitted as
    ``p.score`` says (a diffusion head's ``path`` rule: the target's last denoising step). Trees
    are refused: sibling recursion would need the residual's normalised density.
    """

    continuous = True  # verifies TokenDist targets too

    def accept_prob(self, p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        px = p.gather(-1, x[:, None]).squeeze(-1)
        if q is None:
            return px
        qx = q.gather(-1, x[:, None]).squeeze(-1)
        return torch.where(qx > 0, (px / qx.clamp_min(1e-30)).clamp(max=1.0), 0.0)

    def reject(self, p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if isinstance(p, TokenDist):
            return p.residual(q)
        if q is None:
            q = torch.nn.functional.one_hot(x, p.shape[-1]).to(p.dtype)
        return residual_distribution(p, q)

    def sample(self, p: torch.Tensor, generator: Generators = None) -> torch.Tensor:
        """(B, V) -> (B,) tokens; row b draws from generator b of a per-row tuple. A (B,)
        ``TokenDist`` gives (B, *token_shape) tokens."""
        if not isinstance(p, torch.Tensor):
            return p.sample(generator).token
        return sample(p, generator)

    def score(self, p: TokenDist, x) -> tuple[torch.Tensor, torch.Tensor]:
        """Densities: ``(log p(x), the tokens the target emits for x)``."""
        return p.score(x)

    def uniform(self, shape: tuple[int, ...], device, generator: Generators) -> torch.Tensor:
        """(B, ...) uniforms for the accept tests; row b's from generator b of a per-row tuple."""
        return rand(shape, generator, device)

    def __call__(self, draft: DraftTree, p_all: torch.Tensor, generator: Generators = None) -> Acceptance:
        """``p_all`` (B, N+1, V): the target's processed distribution after every node."""
        if isinstance(p_all, TokenDist):
            return self._chain_density(draft, p_all, generator)
        if draft.tree.is_chain and draft.tokens.shape[1] > 0:
            return self._chain(draft, p_all, generator)
        return self._walk(draft, p_all, generator)

    def _chain_density(self, draft: DraftTree, p_all: TokenDist, generator) -> Acceptance:
        """The chain walk on densities: float64 log-ratio tests at once, the first rejection ends
        the chain; only the rows that need it draw a correction (residual) or a bonus."""
        check_chain(draft)
        B, G = p_all.batch_shape[0], draft.tokens.shape[1]
        device = p_all.device
        rows = torch.arange(B, device=device)
        n = torch.zeros(B, dtype=torch.long, device=device)
        emitted = logp = None
        if G > 0:
            x = draft.draws
            logp, emitted = self.score(p_all[:, :G], x)  # (B, G)
            logq = x.log_prob if x.log_prob is not None else draft.q.log_prob(x)
            u = rand((B, G), generator, device, torch.float64)
            ok = u.log() < (logp - logq).clamp(max=0.0)
            n = ok.long().cumprod(1).sum(1)  # (B,) accepted prefix length
        bonus = n == G

        def correct(r):  # the residual at each row's first rejection
            return self.reject(p_all[r, n[r]], draft.q[r, n[r]], None)

        def extra(r):  # the target's distribution after an all-accepted chain
            return p_all[r, torch.full_like(r, G)]

        settled = int(bonus.sum())
        if settled in (0, B):  # every row draws from the same kind (always at batch 1): no split
            dist = extra(rows) if settled else correct(rows)
            next_token = dist.sample(generator).token.to(p_all.token_dtype)
        else:
            next_token = torch.zeros((B,) + tuple(p_all.token_shape), dtype=p_all.token_dtype, device=device)
            for take, dist in ((~bonus, correct), (bonus, extra)):
                r = rows[take]
                next_token[r] = dist(r).sample(select_rows(generator, r)).token.to(next_token.dtype)
        depth = torch.arange(G + 1, device=device)
        path = torch.where(depth <= n[:, None], depth, -1)
        return Acceptance(path=path, num_accepted=n, next_token=next_token, tokens=emitted, log_p=logp)

    def _chain(self, draft: DraftTree, p_all: torch.Tensor, generator) -> Acceptance:
        """The walk for a chain, all positions at once: the first rejection ends it."""
        x = draft.tokens  # (B, G)
        B, G = x.shape
        V = p_all.shape[-1]
        p = p_all[:, :G].reshape(B * G, V)
        q = None if draft.q is None else draft.q.reshape(B * G, V)
        a = self.accept_prob(p, q, x.reshape(-1)).view(B, G)
        ok = self.uniform((B, G), p.device, generator) < a
        n = ok.long().cumprod(1).sum(1)  # (B,) accepted prefix length
        rows = torch.arange(B, device=p.device)
        at = n.clamp(max=G - 1)  # the rejected position (unused where all were accepted)
        residual = self.reject(p_all[rows, at], None if draft.q is None else draft.q[rows, at], x[rows, at])
        last = torch.where((n == G)[:, None], p_all[:, G], residual)  # bonus or correction
        depth = torch.arange(G + 1, device=p.device)
        path = torch.where(depth <= n[:, None], depth, -1)
        return Acceptance(path=path, num_accepted=n, next_token=self.sample(last, generator))

    @property
    def draws_decide(self) -> bool:
        """Whether a deterministic (q = 1) tree may be verified by one target draw per node: true
        for this rule's own test and residual; a subclass that changes either walks the siblings."""
        cls = type(self)
        return cls.accept_prob is SpeculativeSampling.accept_prob and cls.reject is SpeculativeSampling.reject

    def _walk(self, draft: DraftTree, p_all: torch.Tensor, generator) -> Acceptance:
        """Trees, every node at once.

        The target's distribution at a node does not depend on how the walk got there, so each
        node's sibling tests can run before the path is known: ``max_children`` rounds over all
        nodes decide which child (if any) each node accepts and leave the residual there, then a
        path search keeps the accepted prefix (``accepted_path``) and the correction or bonus is
        drawn from the residual of its last node. Same rule and same output distribution as
        trying the children depth by depth; the random numbers are drawn per node (B, N+1, K)
        instead of per step, so seeded runs differ from a depth-by-depth walk.

        Deterministic trees under this rule's own test take a shorter road (``draws_decide``):
        trying children x_1, x_2, ... with ``p(x_i)`` and zeroing each rejected one accepts x_i
        with probability exactly ``p(x_i)`` and otherwise emits a draw from p without the
        children, which is what one draw y ~ p per node does: accept the child equal to y, or
        emit y (SpecInfer's multi-round rule with q = 1, Miao et al., 2024)."""
        tree, tokens = draft.tree, draft.tokens
        B, N1, V = p_all.shape
        device = p_all.device
        rows = torch.arange(B, device=device)
        if N1 == 1:  # nothing drafted (target-only decoding): the target's own draw
            zeros = torch.zeros(B, dtype=torch.long, device=device)
            return Acceptance(path=zeros[:, None], num_accepted=zeros, next_token=self.sample(p_all[:, 0], generator))
        children = tree.children  # (B, N+1, K), -1 where absent
        K = children.shape[-1]
        node_tok = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), tokens], 1)  # (B, N+1)
        kid = children.clamp(min=0)
        kid_tok = node_tok.gather(1, kid.reshape(B, -1)).view(B, N1, K)
        if draft.q is None and self.draws_decide:
            y = self.sample(p_all, generator)  # (B, N+1): one draw per node
            match = (kid_tok == y[..., None]) & (children >= 0)
            first = match.to(torch.int8).argmax(-1, keepdim=True)  # the first sibling with that token
            chosen = torch.where(match.any(-1), kid.gather(-1, first).squeeze(-1), -1)
            path, n, last = accepted_path(tree, chosen)
            return Acceptance(path=path, num_accepted=n, next_token=y[rows, last])
        u = self.uniform((B, N1, K), device, generator)
        p = p_all.reshape(B * N1, V)
        chosen = torch.full((B, N1), -1, dtype=torch.long, device=device)
        q_all = None if draft.q is None else torch.cat([draft.q.new_zeros(B, 1, V), draft.q], 1)
        for s in range(K):
            # the nodes with an s-th child whose earlier children were all rejected. Finding them
            # syncs once per round; running every round on all nodes with children instead (one
            # sync per pass) measured slower on captured AR eagle trees (docs/costs.md), since
            # accepted siblings end most nodes' rounds early
            live = ((children[..., s] >= 0) & (chosen < 0)).reshape(-1).nonzero().squeeze(1)
            if live.numel() == 0:
                break
            c = kid[..., s].reshape(-1)[live]
            x = kid_tok[..., s].reshape(-1)[live]
            r = live // N1
            q = None if q_all is None else q_all[r, c]
            ps = p[live]
            ok = u[..., s].reshape(-1)[live] < self.accept_prob(ps, q, x)
            p = p.index_copy(0, live, torch.where(ok[:, None], ps, self.reject(ps, q, x)))
            chosen.view(-1)[live] = torch.where(ok, c, -1)
        path, n, last = accepted_path(tree, chosen)
        return Acceptance(path=path, num_accepted=n, next_token=self.sample(p.view(B, N1, V)[rows, last], generator))


def accepted_path(tree, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, N+1) the child each node accepted (-1: none) -> the accepted path.

    A node is on it when every node from the root down to it was chosen by its parent; the path
    ends at the deepest such node (at most one child per node is chosen, so that node is unique).
    Returns ``path`` (B, max_depth + 1) node indices by depth (-1 past the end), ``n`` (B,)
    accepted drafts and ``last`` (B,) the path's last node."""
    B, N1 = chosen.shape
    device = chosen.device
    ok = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=device),
                    chosen.gather(1, tree.parents) == torch.arange(1, N1, device=device)], 1)
    return _deepest(tree, ok)


def _deepest(tree, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, N+1) whether each node passed its own test -> (path, n, last) of the deepest node whose
    ancestors all passed (the first by index among equals)."""
    B, N1 = ok.shape
    device = ok.device
    anc = tree.ancestor_mask  # (B, N+1, N+1): [b, i, j] j is i or an ancestor of i
    accepted = ~(anc & ~ok[:, None, :]).any(-1)
    depth = anc.sum(-1) - 1
    last = torch.where(accepted, depth, -1).argmax(-1)  # (B,)
    rows = torch.arange(B, device=device)
    n = depth[rows, last]
    D = tree.max_depth
    slots = torch.where(anc[rows, last], depth, D + 1)  # depth d -> path[d]; others to a spare column
    path = torch.full((B, D + 2), -1, dtype=torch.long, device=device)
    path.scatter_(1, slots, torch.arange(N1, device=device).expand(B, N1))
    return path[:, : D + 1], n, last


def check_chain(draft: DraftTree) -> None:
    """Continuous tokens are verified in chains only; say why otherwise."""
    if not draft.tree.is_chain:
        raise ValueError("continuous tokens need chain drafts, got a tree: recursive rejection among "
                         "siblings scores the next sibling under the residual (p - q)^+ / (1 - beta), "
                         "whose normaliser 1 - beta has no closed form for densities")


class GreedyMatch(SpeculativeSampling):
    """Greedy verification: accept a child iff it is the target's argmax; no randomness.

    Equivalent to speculative sampling with the one-hot greedy distribution, and bit-identical to
    greedy target-only decoding.
    """

    continuous = False

    def uniform(self, shape, device, generator):
        return torch.zeros(shape, device=device)  # accept probability is exactly 0 or 1

    def accept_prob(self, p, q, x):
        return (argmax_ids(p) == x).to(p.dtype)

    def reject(self, p, q, x):
        return p

    def sample(self, p, generator):
        return argmax_ids(p)

    def _walk(self, draft: DraftTree, p_all: torch.Tensor, generator) -> Acceptance:
        """The greedy tree walk without a per-depth loop: a node is accepted iff its token is the
        target's argmax after its parent and every ancestor is accepted; the path ends at the
        deepest accepted node (siblings are distinct tokens, so at most one matches per parent;
        should two match, the first by index wins, as in the sequential walk)."""
        tree, tokens = draft.tree, draft.tokens
        B, N1, _ = p_all.shape
        device = p_all.device
        if N1 == 1:  # nothing drafted: the target's token alone
            zeros = torch.zeros(B, dtype=torch.long, device=device)
            return Acceptance(path=zeros[:, None], num_accepted=zeros, next_token=argmax_ids(p_all)[:, 0])
        best_tok = argmax_ids(p_all)  # (B, N+1): the target's token after every node
        ok = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=device),
                        tokens == best_tok.gather(1, tree.parents)], 1)  # (B, N+1)
        path, n, last = _deepest(tree, ok)
        return Acceptance(path=path, num_accepted=n, next_token=best_tok[torch.arange(B, device=device), last])
