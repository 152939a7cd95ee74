"""Draft trees: structure tables, EAGLE-2's dynamic expansion, and sampling without replacement.

Expected values are computed independently: hand-written tables for tree structure, a plain
Python enumeration of EAGLE-2's expansion for ``dynamic_tree``, the exact without-replacement
formulas for ``sample_without_replacement``.
"""

import pytest
import torch

from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue
from mmspec.core.tree import Tree, dynamic_tree, node_path, sample_without_replacement, sampled_tree


# -- structure -------------------------------------------------------------------------------------

def test_chain():
    tree = Tree.chain(2, 4)
    assert tree.is_chain
    assert torch.equal(tree.ancestor_mask, torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5))
    assert torch.equal(tree.depths, torch.arange(5).expand(2, 5))
    assert tree.children.tolist() == [[[1], [2], [3], [4], [-1]]] * 2


def test_empty_chain():
    tree = Tree.chain(3, 0)
    assert tree.parents.shape == (3, 0) and tree.is_chain
    assert tree.ancestor_mask.tolist() == [[[True]]] * 3
    assert tree.depths.tolist() == [[0]] * 3
    assert tree.children.shape == (3, 1, 0)


def test_ancestor_mask_of_random_deep_trees():
    """Level-by-level masks equal the definition (``node_path``) on 20 random trees of 60 nodes
    and depth up to 12, 3 rows each (seed 0), with ``max_depth`` the deepest node's depth."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        parents = torch.stack([torch.tensor([int(torch.randint(max(0, i - 5), i, (1,), generator=g))
                                             for i in range(1, 61)]) for _ in range(3)])
        depth = max(len(node_path(row.tolist(), i)) - 1 for row in parents for i in range(61))
        mask = Tree(parents, max_depth=depth, max_children=60).ancestor_mask
        for b, row in enumerate(parents.tolist()):
            for i in range(61):
                assert mask[b, i].nonzero().flatten().tolist() == sorted(node_path(row, i)), (b, i)


def test_hand_built_trees():
    # row 0:  0 -> 1 -> 3        row 1:  0 -> 1 -> 2 -> 3 -> 6
    #           |    -> 4 -> 6             -> 4
    #           -> 2 -> 5                  -> 5
    tree = Tree(torch.tensor([[0, 0, 1, 1, 2, 4], [0, 1, 2, 0, 0, 3]]), max_depth=4, max_children=3)
    assert not tree.is_chain
    ancestors = [
        [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 4}, {0, 2, 5}, {0, 1, 4, 6}],
        [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 4}, {0, 5}, {0, 1, 2, 3, 6}],
    ]
    expected = torch.tensor([[[j in anc for j in range(7)] for anc in row] for row in ancestors])
    assert torch.equal(tree.ancestor_mask, expected)
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 2, 3], [0, 1, 2, 3, 1, 1, 4]]
    assert tree.children.tolist() == [
        [[1, 2, -1], [3, 4, -1], [5, -1, -1], [-1, -1, -1], [6, -1, -1], [-1, -1, -1], [-1, -1, -1]],
        [[1, 4, 5], [2, -1, -1], [3, -1, -1], [6, -1, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]],
    ]


# -- EAGLE-2 dynamic tree -----------------------------------------------------------------------------

class TableDraft:
    """A deterministic fake draft: scores from a fixed table indexed by (depth, token),
    log-probabilities for ``dynamic_tree`` and probabilities for ``sampled_tree``.

    Records every call so the test can check the frontier masks the draft was given."""

    def __init__(self, table):
        self.table = table  # (B, depth + 1, V, V); [b, d, t] scores the children of token t at depth d
        self.calls = []

    def __call__(self, tokens, depth, mask):
        self.calls.append((tokens.clone(), depth, mask.clone()))
        rows = torch.arange(tokens.shape[0])[:, None]
        return self.table[rows, depth, tokens]  # (B, k, V)


def eagle2_candidates(root_logp, table, top_k, depth):
    """EAGLE-2's expansion for one row, in plain Python: every candidate path (token tuple) with its
    cumulative log-probability, and the frontier expanded at each level."""

    def top(logp):
        return sorted(range(len(logp)), key=lambda t: -logp[t])[:top_k]

    root = root_logp.tolist()
    scores = {(t,): root[t] for t in top(root)}
    frontiers = [list(scores)]
    for d in range(1, depth + 1):
        children = {}
        for path in frontiers[-1]:
            logp = table[d, path[-1]].tolist()
            for t in top(logp):
                children[path + (t,)] = scores[path] + logp[t]  # same order of additions as the code
        scores.update(children)
        frontiers.append(sorted(children, key=children.get, reverse=True)[:top_k])
    return scores, frontiers[:depth]  # the last level is scored but never fed


def kept_paths(draft, b):
    parents, tokens = draft.tree.parents[b].tolist(), draft.tokens[b].tolist()
    return [tuple(tokens[j - 1] for j in node_path(parents, i)[1:]) for i in range(1, len(tokens) + 1)]


def check_frontier_masks(calls, frontiers, top_k, B):
    """Each call's mask is (B, k, fed + k): row r marks the fed nodes that are ancestors of frontier
    node r, and itself. The check rebuilds each frontier node's path from the marked ancestors, so
    a mask pointing at the wrong parent yields a path outside EAGLE-2's frontier."""
    assert len(calls) == len(frontiers[0])
    fed = [[] for _ in range(B)]  # paths of the nodes fed so far, in feeding order
    for level, (tokens, depth, mask) in enumerate(calls):
        assert depth == level + 1
        n_fed = len(fed[0])
        assert tokens.shape == (B, top_k)
        assert mask.shape == (B, top_k, n_fed + top_k) and mask.dtype == torch.bool
        for b in range(B):
            assert torch.equal(mask[b, :, n_fed:], torch.eye(top_k, dtype=torch.bool))
            new = []
            for r in range(top_k):
                marked = [fed[b][j] for j in range(n_fed) if mask[b, r, j]]
                assert [len(p) for p in marked] == list(range(1, depth)), "one ancestor per depth"
                assert all(child[:-1] == anc for anc, child in zip(marked, marked[1:]))
                new.append((marked[-1] if marked else ()) + (int(tokens[b, r]),))
            assert set(new) == set(frontiers[b][level])
            fed[b] += new


@pytest.mark.parametrize("top_k,depth,total_tokens", [(3, 3, 10), (2, 4, 7), (3, 2, 50), (4, 0, 3)])
def test_dynamic_tree_matches_eagle2_enumeration(top_k, depth, total_tokens):
    B, V = 2, 12
    g = torch.Generator().manual_seed(top_k * 10 + depth)
    # double precision makes the enumeration's sums bit-identical to the code's (no rounding ties)
    root_logp = torch.randn(B, V, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)
    table = torch.randn(B, depth + 1, V, V, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)
    draft = TableDraft(table)
    out = dynamic_tree(root_logp, draft, top_k, depth, total_tokens)

    n_candidates = top_k + depth * top_k * top_k
    N = min(total_tokens - 1, n_candidates)
    assert out.q is None
    assert out.tokens.shape == (B, N) and out.tree.parents.shape == (B, N)
    index = torch.arange(1, N + 1)
    assert bool(((out.tree.parents >= 0) & (out.tree.parents < index)).all()), "parents come first"
    frontiers = []
    for b in range(B):
        scores, fronts = eagle2_candidates(root_logp[b], table[b], top_k, depth)
        frontiers.append(fronts)
        assert len(scores) == n_candidates
        paths = kept_paths(out, b)
        assert all(p in scores for p in paths), "every node is a candidate under its stated parent"
        assert len(set(paths)) == N
        assert all(p[:-1] in paths for p in paths if len(p) > 1), "the kept set is ancestor-closed"
        best = sorted(scores, key=scores.get, reverse=True)[:N]
        assert set(paths) == set(best), "the kept nodes are the top total_tokens - 1 candidates"
        assert out.tree.depths[b, 1:].tolist() == [len(p) for p in paths]
    assert int(out.tree.depths.max()) <= out.tree.max_depth
    assert int((out.tree.children >= 0).sum(-1).max()) <= out.tree.max_children
    if depth:
        check_frontier_masks(draft.calls, frontiers, top_k, B)
    assert len(draft.calls) == depth
    if depth and total_tokens - 1 < n_candidates:
        assert len({len(p) for p in kept_paths(out, 0)}) > 1, "the rerank must keep several levels"


def test_dynamic_tree_ties_keep_ancestors():
    """A child with draft probability 1 ties its parent; the rerank must keep the parent."""
    B, V, top_k, depth = 2, 8, 2, 3
    g = torch.Generator().manual_seed(7)
    root_logp = torch.randn(B, V, generator=g, dtype=torch.float64).log_softmax(-1)
    peak = torch.nn.functional.one_hot(torch.randint(V, (B, depth + 1, V), generator=g), V)
    noise = torch.randn(B, depth + 1, V, V, generator=g, dtype=torch.float64)  # no ties among the rest
    table = (200 * peak + noise).log_softmax(-1)
    assert bool((table.max(-1).values == 0).all()), "the top child's log-probability is exactly 0"
    for total_tokens in range(2, 10):  # cuts through every tie group
        out = dynamic_tree(root_logp, TableDraft(table), top_k, depth, total_tokens)
        for b in range(B):
            scores, _ = eagle2_candidates(root_logp[b], table[b], top_k, depth)
            paths = kept_paths(out, b)
            assert len(set(paths)) == total_tokens - 1
            assert all(p in scores for p in paths)
            assert all(p[:-1] in paths for p in paths if len(p) > 1)
            cut = min(scores[p] for p in paths)
            assert all(scores[p] <= cut for p in scores if p not in paths)


# -- sampling without replacement -----------------------------------------------------------------

def test_sample_without_replacement_renormalises():
    g = torch.Generator().manual_seed(0)
    q = torch.rand(2, 3, 9, generator=g) * (torch.rand(2, 3, 9, generator=g) > 0.3)
    q[..., :5] += 0.01  # at least 5 positive entries per row
    tokens, dists = sample_without_replacement(q, 4, g)
    assert tokens.shape == (2, 3, 4) and dists.shape == (2, 3, 4, 9)
    for row_q, row_tok, row_d in zip(q.reshape(-1, 9), tokens.reshape(-1, 4), dists.reshape(-1, 4, 9)):
        assert len(set(row_tok.tolist())) == 4
        for i in range(4):
            left = row_q.clone()
            left[row_tok[:i]] = 0
            torch.testing.assert_close(row_d[i], left / left.sum())
            assert row_d[i, row_tok[i]] > 0


def test_sample_without_replacement_empty_draws():
    q = torch.zeros(3, 6)
    q[0, [1, 4]] = torch.tensor([0.3, 0.7])  # two positive entries, four draws
    q[1] = 1.0 / 6
    tokens, dists = sample_without_replacement(q, 4, torch.Generator().manual_seed(1))
    assert set(tokens[0, :2].tolist()) == {1, 4}
    assert tokens[0, 2:].tolist() == [0, 0] and bool((dists[0, 2:] == 0).all())
    assert torch.equal(dists[0, :2].sum(-1), torch.ones(2))
    assert len(set(tokens[1].tolist())) == 4
    assert tokens[2].tolist() == [0] * 4 and bool((dists[2] == 0).all())  # nothing to draw at all


N_DRAWS = 20_000
Q = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])


def second_draw_law(q):
    """P(second draw = y) = q(y) * sum_{x != y} q(x) / (1 - q(x)) without replacement."""
    ratio = q / (1 - q)
    return q * (ratio.sum() - ratio)


def draw_pvalues(sampler):
    """Chi-square p-values (N_DRAWS rows, fixed seed) of the first draw against q and of the second
    draw against the without-replacement law."""
    tokens, _ = sampler(Q.expand(N_DRAWS, -1), 2, torch.Generator().manual_seed(0))
    return chisquare_pvalue(tokens[:, 0], Q), chisquare_pvalue(tokens[:, 1], second_draw_law(Q))


def with_replacement(q, k, generator):
    """Broken: k independent draws from q."""
    tokens = torch.multinomial(q.reshape(-1, q.shape[-1]), k, replacement=True, generator=generator)
    dists = (q / q.sum(-1, keepdim=True)).unsqueeze(-2).expand(*q.shape[:-1], k, q.shape[-1])
    return tokens.reshape(*q.shape[:-1], k), dists


@pytest.mark.statistical
def test_sample_without_replacement_marginals():
    torch.testing.assert_close(second_draw_law(Q).sum(), torch.tensor(1.0))
    first, second = draw_pvalues(sample_without_replacement)
    assert first >= P_THRESHOLD, f"first draw vs q: p={first:.2e}"
    assert second >= P_THRESHOLD, f"second draw vs the without-replacement law: p={second:.2e}"


@pytest.mark.statistical
def test_sampling_with_replacement_is_caught():
    first, second = draw_pvalues(with_replacement)
    assert first >= P_THRESHOLD  # its first draw is right, so only the second-draw test can tell
    assert second < P_THRESHOLD, f"a with-replacement sampler passed: p={second:.2e}"


# -- sampled tree -------------------------------------------------------------------------------------

def test_sampled_tree():
    B, V, b, depth = 2, 10, 3, 3
    g = torch.Generator().manual_seed(3)
    table = torch.randn(B, depth + 1, V, V, generator=g).mul(1.5).softmax(-1)
    table[:, :, ::4, 2:] = 0  # the children of tokens 0, 4, 8 have two possible tokens: empty draws
    table = table / table.sum(-1, keepdim=True)
    root_q = torch.randn(B, V, generator=g).softmax(-1)
    root_q[1, 3:] = 0  # row 1's root has three children of positive mass
    root_q[1, 2] = 0  # ... now two: its third child is empty
    root_q = root_q / root_q.sum(-1, keepdim=True)
    draft = TableDraft(table)
    out = sampled_tree(root_q, draft, b, depth, g)

    N = b + depth * b * b
    assert out.tokens.shape == (B, N) and out.q.shape == (B, N, V)
    parents, depths = out.tree.parents, out.tree.depths
    assert bool(((parents >= 0) & (parents < torch.arange(1, N + 1))).all())
    mass = out.q.sum(-1)  # (B, N)
    empty = mass == 0
    torch.testing.assert_close(mass[~empty], torch.ones(int((~empty).sum())))
    assert bool(empty.any()), "the table must produce empty draws for this test to bite"
    assert bool((out.tokens[empty] == 0).all())
    assert bool((out.q.gather(-1, out.tokens[..., None])[~empty] > 0).all())

    for row in range(B):
        par, tok = parents[row].tolist(), out.tokens[row].tolist()
        # every node was drawn from its parent's distribution with its earlier siblings removed
        for i in range(1, N + 1):
            p = par[i - 1]
            base = root_q[row] if p == 0 else table[row, int(depths[row, p]), tok[p - 1]]
            left = base.clone()
            siblings = [j for j in range(1, i) if par[j - 1] == p]
            assert len(siblings) < b
            left[[tok[j - 1] for j in siblings if not empty[row, j - 1]]] = 0
            expect = left / left.sum() if left.sum() > 0 else left
            torch.testing.assert_close(out.q[row, i - 1], expect)
        # the expanded nodes of each level are the b with the highest cumulative draft probability
        score = torch.zeros(N + 1)
        for i in range(1, N + 1):
            score[i] = score[par[i - 1]] + out.q[row, i - 1, tok[i - 1]].clamp_min(1e-30).log()
        for level, (tokens, d, mask) in enumerate(draft.calls):
            first_child = b + level * b * b + 1  # children of frontier row r: b nodes from here + r*b
            frontier = [par[first_child + r * b - 1] for r in range(b)]
            assert all(par[first_child + r * b + j - 1] == frontier[r] for r in range(b) for j in range(b))
            assert tokens[row].tolist() == [tok[f - 1] for f in frontier] and d == level + 1
            level_nodes = [i for i in range(1, N + 1) if int(depths[row, i]) == level + 1]
            if level == 0:
                assert frontier == level_nodes
            else:
                ranked = sorted(level_nodes, key=lambda i: -float(score[i]))
                assert set(frontier) == set(ranked[:b])
            fed = [par[b + lv * b * b + r * b] for lv in range(level) for r in range(b)]
            assert mask.shape == (B, b, len(fed) + b)
            expect = out.tree.ancestor_mask[row][frontier][:, fed]
            assert torch.equal(mask[row, :, : len(fed)], expect)
            assert torch.equal(mask[row, :, len(fed):], torch.eye(b, dtype=torch.bool))


def test_node_path_rejects_cycles():
    assert Tree(torch.tensor([[0, 0, 1, 1, 2, 4]]), 4, 2).path(0, 6) == [0, 1, 4, 6]
    with pytest.raises(ValueError, match="node 2 has parent 2: parents must precede children"):
        node_path([0, 2], 2)


def test_dynamic_tree_without_masks_is_the_same_tree():
    """``masks=False`` (drafts that read no tree: parallel heads) hands ``step`` None and grows
    the same tree as with masks, for a step that ignores them (seed 0, 3 rows, vocab 20)."""
    g = torch.Generator().manual_seed(0)
    levels = torch.randn(3, 4, 20, generator=g).log_softmax(-1)  # one distribution per depth
    seen = []

    def step(tokens, depth, mask):
        seen.append(mask)
        return levels[:, depth, None].expand(-1, tokens.shape[1], -1)

    with_masks = dynamic_tree(levels[:, 0], step, top_k=3, depth=3, total_tokens=10)
    assert all(m is not None for m in seen)
    seen.clear()
    without = dynamic_tree(levels[:, 0], step, top_k=3, depth=3, total_tokens=10, masks=False)
    assert seen == [None, None, None]
    assert torch.equal(without.tokens, with_masks.tokens)
    assert torch.equal(without.tree.parents, with_masks.tree.parents)
