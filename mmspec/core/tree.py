"""Draft trees: structure, attention masks, and EAGLE-2's dynamic expansion.

A draft is a tree whose node 0 is the *root*: the last emitted token, not yet in the target's
cache. Nodes ``1..N`` are drafted tokens; ``parents[:, i - 1]`` is the index of node ``i``'s parent
(always ``< i``). A chain is the tree whose node ``i`` has parent ``i - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from .distributions import Draw, TokenDist
from .sampling import Generators, sample


def node_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root (0) to ``node``, where ``parents[i - 1]`` is node i's parent."""
    path = [node]
    while path[-1] != 0:
        parent = parents[path[-1] - 1]
        if not 0 <= parent < path[-1]:
            raise ValueError(f"node {path[-1]} has parent {parent}: parents must precede children")
        path.append(parent)
    return path[::-1]


@dataclass
class Tree:
    """The shape of a batch of draft trees (one tree per row, same node count).

    Args:
        parents: (B, N) parent index of nodes 1..N, each in ``[0, i)``.
        max_depth: the deepest node's depth (the root has depth 0); bounds the accept walk.
        max_children: the most children any node has; bounds the sibling loop.
    """

    parents: torch.Tensor
    max_depth: int
    max_children: int

    @classmethod
    def chain(cls, batch_size: int, length: int, device=None) -> "Tree":
        parents = torch.arange(length, device=device).expand(batch_size, length)
        return cls(parents, max_depth=length, max_children=1 if length else 0)

    @property
    def is_chain(self) -> bool:
        return self.max_children <= 1 and self.max_depth == self.parents.shape[1]

    def path(self, row: int, node: int) -> list[int]:
        """Node indices from the root to ``node`` in tree ``row`` (for inspection and tests)."""
        return node_path(self.parents[row].tolist(), node)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """(B, N+1, N+1) bool: ``[b, i, j]`` is True when j is i or an ancestor of i."""
        B, N = self.parents.shape
        device = self.parents.device
        mask = torch.eye(N + 1, dtype=torch.bool, device=device).repeat(B, 1, 1)
        up = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), self.parents], 1)  # the root's is itself
        above = up
        for _ in range(self.max_depth):  # level by level (not node by node): above[i] is i's ancestor d up
            mask.scatter_(2, above[..., None], True)
            above = up.gather(1, above)
        return mask

    @cached_property
    def depths(self) -> torch.Tensor:
        """(B, N+1) depth of every node; the target sees node i at position ``L + depth[i]``."""
        if self.is_chain:  # the common case needs no mask (the decoder passes none for chains)
            B, N = self.parents.shape
            return torch.arange(N + 1, device=self.parents.device).expand(B, N + 1)
        return self.ancestor_mask.sum(-1) - 1

    @cached_property
    def children(self) -> torch.Tensor:
        """(B, N+1, max_children) children of each node in index order, -1 where absent."""
        B, N = self.parents.shape
        K = self.max_children
        if K == 0:
            return torch.full((B, N + 1, 0), -1, dtype=torch.long, device=self.parents.device)
        is_child = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=self.parents.device)
        is_child[:, 1:].scatter_(-1, self.parents.unsqueeze(-1), True)  # [b, child, parent]
        is_child = is_child.transpose(1, 2)  # [b, parent, child]
        # a stable sort on "not a child" lists each node's children first, in index order
        order = (~is_child).to(torch.int8).sort(dim=-1, stable=True).indices[..., :K]
        present = torch.arange(K, device=order.device) < is_child.sum(-1, keepdim=True)
        return torch.where(present, order, -1)


StepFn = Callable[[torch.Tensor, int, torch.Tensor | None], torch.Tensor]
"""``step(tokens (B, k), depth, mask (B, k, R + k)) -> scores source (B, k, V)``.

Runs the draft on the k frontier nodes at tree depth ``depth`` (all siblings of one level share
it), where ``mask`` tells which of the R earlier-fed tree nodes plus the k new ones each frontier
node may attend to (None when the tree builder was told the draft reads no tree: ``masks=False``),
and returns its log-probabilities over the vocabulary."""


@dataclass
class DraftTree:
    """A drafted tree: tokens, shape, and (for sampled drafts) the distribution of every node.

    ``q[:, i - 1]`` is the distribution node i was drawn from *given its earlier siblings*
    (so sampling without replacement is described exactly); ``q=None`` marks deterministic drafts,
    whose proposal probability is 1 (EAGLE's form).

    Continuous tokens: ``tokens`` (B, N, *token_shape), ``q`` a (B, N) ``TokenDist`` and ``draws``
    the (B, N) ``Draw`` (tokens with their aux and log q) the rule scores.
    """

    tokens: torch.Tensor  # (B, N[, *token_shape])
    tree: Tree
    q: torch.Tensor | TokenDist | None = None  # (B, N, V)
    draws: Draw | None = None


def _frontier_mask(fed_anc: torch.Tensor | None, parent_slot: torch.Tensor | None, k: int, B: int,
                   device) -> torch.Tensor:
    """Ancestor mask of a new frontier over all tree nodes fed to the draft so far plus itself."""
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k)
    if fed_anc is None:
        return eye.clone()
    inherited = torch.gather(fed_anc, 1, parent_slot.unsqueeze(-1).expand(B, k, fed_anc.shape[-1]))
    return torch.cat([inherited, eye], dim=-1)


def dynamic_tree(root_logp: torch.Tensor, step: StepFn, top_k: int, depth: int,
                 total_tokens: int, masks: bool = True) -> DraftTree:
    """EAGLE-2's dynamic draft tree (Li et al., 2024, "EAGLE-2"), deterministic form.

    Expand: at every level each frontier node proposes its ``top_k`` children; the ``top_k``
    children with the highest cumulative log-probability (the product of draft probabilities along
    the path, "confidence") become the next frontier and are fed to the draft. Rerank: keep the
    ``total_tokens - 1`` best candidates over all levels. A node never outranks its ancestors, so
    the kept set is a tree; a stable sort breaks ties towards ancestors (lower candidate ids).

    Args:
        root_logp: (B, V) draft log-probabilities for the root's children.
        step: runs the draft on a frontier; see ``StepFn``.
        top_k: EAGLE-2's children per frontier node.
        depth: EAGLE-2's depth; the tree has ``depth + 1`` levels at most.
        total_tokens: EAGLE-2's node budget (the root included).
        masks: build the frontier masks ``step`` receives (False: it gets None, for drafts that
            read no tree, such as parallel heads; the tree is the same).
    """
    B, V = root_logp.shape
    device = root_logp.device
    scores, tokens = root_logp.topk(top_k, dim=-1)  # (B, k)
    cand_tokens, cand_scores = [tokens], [scores]
    cand_parent = [torch.full((B, top_k), -1, dtype=torch.long, device=device)]  # -1 = root
    frontier_ids = torch.arange(top_k, device=device).expand(B, top_k)
    fed_anc, parent_slot, fed = None, None, 0
    for level in range(depth):
        anc = _frontier_mask(fed_anc, parent_slot, top_k, B, device) if masks else None  # (B, k, fed + k)
        logp = step(tokens, level + 1, anc)  # (B, k, V)
        if masks:
            fed_anc = anc if fed_anc is None else torch.cat(
                [torch.nn.functional.pad(fed_anc, (0, top_k)), anc], dim=1)
        child_logp, child_tok = logp.topk(top_k, dim=-1)  # (B, k, k)
        child_scores = (scores.unsqueeze(-1) + child_logp).flatten(1)  # (B, k*k)
        base = sum(t.shape[1] for t in cand_tokens)
        cand_tokens.append(child_tok.flatten(1))
        cand_scores.append(child_scores)
        cand_parent.append(frontier_ids.repeat_interleave(top_k, dim=1))
        if level == depth - 1:
            break
        scores, pick = child_scores.topk(top_k, dim=-1)  # (B, k) next frontier
        tokens = child_tok.flatten(1).gather(1, pick)
        frontier_ids = base + pick
        parent_slot = fed + pick // top_k  # row of each new node's parent in fed_anc
        fed += top_k

    all_tokens = torch.cat(cand_tokens, 1)
    all_scores = torch.cat(cand_scores, 1)
    all_parent = torch.cat(cand_parent, 1)
    n = min(total_tokens - 1, all_tokens.shape[1])
    keep = all_scores.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    keep = keep.sort(dim=-1).values  # ancestors before descendants
    parent_cand = all_parent.gather(1, keep)
    # parent's index among kept nodes, +1 for the root at node 0
    parents = torch.searchsorted(keep, parent_cand.clamp(min=0)) + 1
    parents = torch.where(parent_cand < 0, 0, parents)
    tree = Tree(parents, max_depth=depth + 1, max_children=min(n, top_k))
    return DraftTree(all_tokens.gather(1, keep), tree)


def sample_without_replacement(q: torch.Tensor, k: int, generator: Generators):
    """Draw k distinct tokens from each row of q (B, ..., V) one after another (row b from
    generator b of a per-row tuple).

    Returns tokens (..., k) and the conditional distributions they were drawn from (..., k, V):
    the i-th is q with the first i-1 draws removed and renormalised. Where q has fewer than k
    tokens of positive mass the remaining draws are empty: token 0 with an all-zero distribution,
    which acceptance rules treat as "nothing to try".
    """
    q = q.clone()
    toks, dists = [], []
    for _ in range(k):
        mass = q.sum(-1, keepdim=True)
        cond = torch.where(mass > 0, q / mass.clamp_min(1e-30), torch.zeros_like(q))
        empty = cond.sum(-1) <= 0  # (...,)
        # row-major draws with the leading (row) dim kept, so a per-row generator list applies
        x = sample(torch.where(empty[..., None], 1.0, cond), generator)
        x = torch.where(empty, 0, x)
        toks.append(x)
        dists.append(cond)
        q = q.scatter(-1, x.unsqueeze(-1), 0.0)
    return torch.stack(toks, -1), torch.stack(dists, -2)


def sampled_tree(root_q: torch.Tensor, step: Callable, branching: int, depth: int,
                 generator: Generators) -> DraftTree:
    """A dynamic tree whose nodes are *sampled* from the draft (lossless with recursive rejection).

    Every expanded node draws ``branching`` children without replacement from its processed
    draft distribution; the ``branching`` children of a level with the highest cumulative draft
    probability are expanded next (EAGLE-2's selection). Unlike ``dynamic_tree`` there is no
    rerank: dropping a sampled sibling because of its own value would bias the accept test, so
    every drawn node is kept (N = b + depth * b * b).

    ``step(tokens, depth, mask)`` returns processed draft *probabilities* (B, b, V) here.
    """
    B, V = root_q.shape
    device = root_q.device
    tokens, dists = sample_without_replacement(root_q, branching, generator)  # (B,b), (B,b,V)
    scores = dists.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp_min(1e-30).log()
    cand_tokens, cand_q = [tokens], [dists]
    cand_parent = [torch.full((B, branching), -1, dtype=torch.long, device=device)]
    frontier_ids = torch.arange(branching, device=device).expand(B, branching)
    fed_anc, parent_slot, fed, base = None, None, 0, branching
    for level in range(depth):
        anc = _frontier_mask(fed_anc, parent_slot, branching, B, device)
        q = step(tokens, level + 1, anc)  # (B, b, V)
        fed_anc = anc if fed_anc is None else torch.cat(
            [torch.nn.functional.pad(fed_anc, (0, branching)), anc], dim=1)
        child_tok, child_q = sample_without_replacement(q, branching, generator)  # (B,b,b), (B,b,b,V)
        child_scores = scores.unsqueeze(-1) + child_q.gather(
            -1, child_tok.unsqueeze(-1)).squeeze(-1).clamp_min(1e-30).log()
        cand_tokens.append(child_tok.flatten(1))
        cand_q.append(child_q.flatten(1, 2))
        cand_parent.append(frontier_ids.repeat_interleave(branching, dim=1))
        if level < depth - 1:
            scores, pick = child_scores.flatten(1).topk(branching, dim=-1)
            tokens = child_tok.flatten(1).gather(1, pick)
            frontier_ids = base + pick
            parent_slot = fed + pick // branching
            fed += branching
        base += branching * branching
    parent_cand = torch.cat(cand_parent, 1)
    parents = torch.where(parent_cand < 0, 0, parent_cand + 1)
    tree = Tree(parents, max_depth=depth + 1, max_children=branching)
    return DraftTree(torch.cat(cand_tokens, 1), tree, torch.cat(cand_q, 1))
