"""The vectorised tree walk of ``SpeculativeSampling`` on a deep hand-built tree.

Deterministic (q = 1) tree of depth 4 over V = 6 tokens with a different target distribution at
every node (seeded), including two siblings that carry the same token. What one verification
emits is the pair (last node of the accepted path, next token); its exact law is

    P(v, y) = P(reach v) * p_v(y) * [y is not a child token of v],
    P(reach v) = prod over v's path of p_parent(tok), where only a token's first sibling counts,

Each test: N = 20,000 rows, one seeded generator, Pearson chi-square against that law, pass at
p >= 1e-3 (``P_THRESHOLD``). Both roads are tested (one draw per node, and the sibling rounds a
rule with its own test takes); the broken controls must fail the same test.
"""

import pytest
import torch

from mmspec.core import SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue
from mmspec.core.tree import DraftTree, Tree

V, N, SEED = 6, 20_000, 7
# node:      1  2  3  4  5  6  7  8  9
PARENTS = [0, 0, 0, 1, 1, 2, 4, 7, 3]
TOKENS = [2, 4, 2, 1, 3, 5, 0, 4, 1]  # nodes 1 and 3 are both token 2 under the root: 3 never wins
_g = torch.Generator().manual_seed(SEED)
P_NODES = torch.softmax(torch.randn(len(PARENTS) + 1, V, generator=_g) * 1.2, -1)  # (10, V)


class SiblingRounds(SpeculativeSampling):
    def accept_prob(self, p, q, x):
        return super().accept_prob(p, q, x)


class FreshCorrection(SpeculativeSampling):
    """Broken: the next token is drawn afresh from p at the path's last node."""

    def _walk(self, draft, p_all, generator):
        acc = super()._walk(draft, p_all, generator)
        last = acc.path.gather(1, acc.num_accepted[:, None]).squeeze(1)
        acc.next_token = self.sample(p_all[torch.arange(len(last)), last], generator)
        return acc


class SecondSiblingWins(SpeculativeSampling):
    """Broken: the last sibling with the drawn token is taken instead of the first."""

    def _walk(self, draft, p_all, generator):
        flipped = torch.tensor([0, 3, 2, 1, 4, 5, 6, 7, 8, 9])  # swap nodes 1 and 3 (same depth, same token)
        acc = super()._walk(draft, p_all, generator)
        acc.path = torch.where(acc.path >= 0, flipped[acc.path.clamp(min=0)], -1)
        return acc


def exact_law() -> torch.Tensor:
    n1 = len(PARENTS) + 1
    tok = [None] + TOKENS
    reach = torch.zeros(n1, dtype=torch.float64)
    reach[0] = 1.0
    law = torch.zeros(n1, V, dtype=torch.float64)
    for v in range(n1):
        kids = [c for c in range(1, n1) if PARENTS[c - 1] == v]
        seen = set()
        for c in kids:
            if tok[c] not in seen:  # only the first sibling with a token can be accepted
                reach[c] = reach[v] * P_NODES[v, tok[c]].double()
            seen.add(tok[c])
        for y in range(V):
            if y not in seen:
                law[v, y] = reach[v] * P_NODES[v, y].double()
    assert abs(law.sum().item() - 1.0) < 1e-6  # float32 rows
    return law.flatten()


def run(rule) -> tuple[torch.Tensor, torch.Tensor]:
    tree = Tree(torch.tensor([PARENTS]).expand(N, -1), max_depth=4, max_children=3)
    draft = DraftTree(tokens=torch.tensor([TOKENS]).expand(N, -1), tree=tree)
    acc = rule(draft, P_NODES.expand(N, -1, -1), torch.Generator().manual_seed(SEED))
    last = acc.path.gather(1, acc.num_accepted[:, None]).squeeze(1)
    return last, acc


@pytest.mark.statistical
@pytest.mark.parametrize("rule", [SpeculativeSampling(), SiblingRounds()], ids=["one-draw", "sibling-rounds"])
def test_deep_tree_walk_is_exact(rule):
    last, acc = run(rule)
    assert not (acc.path == 3).any() and not (acc.path == 9).any()  # the duplicate's subtree
    assert (acc.num_accepted == 4).any()  # the deepest node is reached
    pval = chisquare_pvalue(last * V + acc.next_token, exact_law())
    assert pval >= P_THRESHOLD, f"p = {pval:.2e}"


@pytest.mark.statistical
@pytest.mark.parametrize("rule", [FreshCorrection(), SecondSiblingWins()], ids=lambda r: type(r).__name__)
def test_deep_tree_walk_broken_controls_fail(rule):
    last, acc = run(rule)
    pval = chisquare_pvalue(last * V + acc.next_token, exact_law())
    assert pval < P_THRESHOLD, f"{type(rule).__name__} passed: p = {pval:.2e}"


def test_path_lists_the_nodes_by_depth():
    last, acc = run(SpeculativeSampling())
    for b in range(50):
        n = int(acc.num_accepted[b])
        path = acc.path[b, : n + 1].tolist()
        assert path[0] == 0 and all(PARENTS[c - 1] == p for p, c in zip(path, path[1:]))
        assert (acc.path[b, n + 1:] == -1).all() and path[-1] == int(last[b])


def test_rows_draw_from_their_own_generators():
    """One generator per row: a row of the batch equals that row verified alone (both roads)."""
    tree = Tree(torch.tensor([PARENTS]).expand(3, -1), max_depth=4, max_children=3)
    draft = DraftTree(tokens=torch.tensor([TOKENS]).expand(3, -1), tree=tree)
    one = DraftTree(tokens=torch.tensor([TOKENS]), tree=Tree(torch.tensor([PARENTS]), max_depth=4, max_children=3))
    for rule in (SpeculativeSampling(), SiblingRounds()):
        gens = tuple(torch.Generator().manual_seed(s) for s in (1, 2, 3))
        batch = rule(draft, P_NODES.expand(3, -1, -1), gens)
        for r, s in enumerate((1, 2, 3)):
            alone = rule(one, P_NODES[None], torch.Generator().manual_seed(s))
            assert torch.equal(batch.path[r], alone.path[0]) and batch.next_token[r] == alone.next_token[0]
