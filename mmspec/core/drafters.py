"""Drafters: where proposals come from. Verification never lives here.

- ``NullDrafter``: nothing (target-only decoding, the baseline).
- ``ModelChainDrafter``: a small draft model samples gamma tokens (Leviathan et al., 2023).
- ``ModelTreeDrafter``: a small draft model grows an EAGLE-2 dynamic tree (deterministic top-k
  nodes) or a sampled tree (nodes drawn without replacement).
- ``EagleTreeDrafter``: EAGLE's feature head grows the same EAGLE-2 trees from the target's own
  features (any head meeting the small ``FeatureHead`` protocol).
- ``ParallelHeadsDrafter``: parallel heads on the target's features (Medusa) score every level of
  an EAGLE-2 tree in one pass.
- ``JacobiDrafter``: the previous iteration's samples and the distributions they came from
  (Speculative Jacobi Decoding, Teng et al., 2025), optionally maximally coupled with the
  previous drafts (MC-SJD, So et al., 2025); no draft model at all.
- ``JacobiDensityDrafter``: the same window on continuous tokens (densities), redrafts independent
  (SJD) or maximally coupled through the exact residual sampler (MC-SJD on densities).
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch

from ..kernels import residual_distribution
from .distributions import Draw, Residual, TokenDist
from .errors import check, check_choice, check_int, is_int
from .sampling import rand, randint, sample, select_rows
from .tree import DraftTree, Tree, dynamic_tree, sampled_tree
from .types import DecodeState, DrafterBase, FeatureHead, ModelOutput, ParallelHeads

__all__ = ["DrafterBase", "NullDrafter", "ModelChainDrafter", "ModelTreeDrafter", "EagleTreeDrafter",
           "FeatureHead", "JacobiDensityDrafter", "JacobiDrafter", "ParallelHeads", "ParallelHeadsDrafter",
           "maximal_coupling"]


class NullDrafter(DrafterBase):
    """Proposes nothing: the loop then decodes one target token per pass (the baseline)."""

    reads_target_probs = False  # update reads features, or nothing

    lane_safe = True  # works under any schedule
    restarts_rows = True  # keeps nothing per row

    def restart_rows(self, state: DecodeState, rows, alone) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        return _empty_draft(state)


def _empty_draft(state: DecodeState) -> DraftTree:
    """No draft: the root alone (tokens (B, 0, *token_shape) in the history's dtype)."""
    B = state.batch_size
    empty = torch.zeros(B, 0, dtype=torch.long, device=state.tokens.device)
    tokens = empty if not state.continuous else state.tokens.new_zeros((B, 0) + state.token_shape)
    return DraftTree(tokens, Tree(empty, max_depth=0, max_children=0))


class _DraftModelRunner:
    """Runs a small causal LM beside the target: its own cache, the same rows (CFG halves too).

    ``cached[r]`` counts the history tokens whose draft keys/values are in the cache at their
    slots. Drafting appends draft tokens (and, for trees, whole levels of siblings) past that
    point, so each round cuts the cache back to ``cached`` and feeds the history from there: the
    root and whatever drafts were accepted since.

    ``conditioned``: the draft's prompt pass takes the call's conditioning, as the target's prefill
    did (a draft VLM sees the images); False for a draft that reads tokens only. That pass is the
    prompts alone, padded as the prefill pads them: conditioning describes the prompts, and a
    generated token must never be read as part of it (a VLM's generated image-placeholder id as one
    more image).
    """

    def __init__(self, model, conditioned: bool = True):
        check(isinstance(conditioned, bool), "conditioned", "True or False", conditioned)
        self.model = model
        self.conditioned = conditioned
        self.vocab_size = model.vocab_size
        self.forwards = 0
        self.cache = self.cached = self.fed_at = None
        self.tree_slots = 0  # cache slots a proposal's tree nodes take past the history (tree drafters)
        self.catch_up = 1  # history entries one decode pass can add at most (the drafter sets it)

    def start(self, state: DecodeState) -> None:
        self.cache = self.model.new_cache(state.rows, state.max_len + self.tree_slots)
        self.cached = torch.zeros_like(state.lengths)
        self.fed_at = None  # host: each row's generated count at the last feed (None: nothing fed yet)

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        """``Drafter.restart_rows``: each row's prompt pass alone (``_prompt_pass`` on its batch-1
        state, with its own conditioning where ``conditioned``) into a cache of the prompt's size,
        copied into the row's slot of the draft cache; the next feed then starts at its root."""
        for b, sub in zip(rows, alone):
            prompts = sub.prompt_lengths  # (R1,)
            S = int(prompts.max())
            cache = self.model.new_cache(sub.rows, S)
            positions = torch.arange(S, device=prompts.device).expand(sub.rows, S)
            ids = sub.tokens[:, :S].clone()
            ids[positions >= prompts[:, None]] = 0
            self.model(ids, positions, cache, **(sub.conditioning if self.conditioned else {}))
            self.forwards += 1
            cache.truncate(prompts)
            for i, r in enumerate(state.target_rows(b)):
                self.cache.load_row(r, cache, i)
                self.cached[r] = prompts[i]
            if self.fed_at is not None:  # the feed's host counts: the row has fed nothing it generated
                self.fed_at = list(self.fed_at)
                self.fed_at[b] = 0

    def _feed_history(self, state: DecodeState):
        """Feed the history the cache lacks (at least the root): (output (R, W, ...), (R,) the
        root's column in it)."""
        if self.conditioned and state.conditioning and self.fed_at is None:
            self._prompt_pass(state)
        self.cached = torch.minimum(self.cached, state.lengths - 1)  # always re-feed at least the root
        self.cache.truncate(self.cached)
        width = catch_up_width(state, self.fed_at, lambda: state.lengths - self.cached, self.cache, self.catch_up)
        positions = self.cached[:, None] + torch.arange(width, device=self.cached.device)  # (R, W)
        feed = state.history(positions.clamp(max=state.tokens.shape[1] - 1))
        out = self.model(feed, positions, self.cache)
        self.forwards += 1
        last = state.lengths - 1 - self.cached
        self.cache.truncate(state.lengths)  # right padding of shorter rows is not history
        self.cached = state.lengths.clone()
        self.fed_at = state.generated
        return out, last

    def _prompt_pass(self, state: DecodeState) -> None:
        """The prompts with the call's conditioning, exactly the target's prefill: zero-padded to
        the longest prompt, at positions from 0; the padding is then cut from the cache."""
        prompts = state.prompt_lengths
        S = int(prompts.max())
        positions = torch.arange(S, device=prompts.device).expand(prompts.shape[0], S)  # (R, S)
        ids = state.tokens[:, :S].clone()
        ids[positions >= prompts[:, None]] = 0  # a short row's first generated tokens are not its prompt
        self.model(ids, positions, self.cache, **state.conditioning)
        self.forwards += 1
        self.cache.truncate(prompts)
        self.cached = prompts.clone()
        self.fed_at = [0] * state.batch_size

    def root_logits(self, state: DecodeState) -> torch.Tensor:
        """(R, V) draft logits after each row's root, feeding the history the cache lacks."""
        out, last = self._feed_history(state)
        logits = out.logits  # (R, W, V)
        return logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1])).squeeze(1)

    def root_output(self, state: DecodeState) -> ModelOutput:
        """Continuous drafts: the draft model's output at each row's root, features (R, 1, H)."""
        out, last = self._feed_history(state)
        rows = torch.arange(last.shape[0], device=last.device)
        return ModelOutput(logits=None, cond=out.cond[rows, last][:, None], heads=out.heads)

    def run(self, state: DecodeState, tokens: torch.Tensor, depths: torch.Tensor,
            tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed (B, T) tokens at (B, T) depths below each row's root; returns (R, T, V) logits.

        Positions are per target row: the two CFG halves share tokens but not prompt lengths."""
        return self.run_output(state, tokens, depths, tree_mask).logits

    def run_output(self, state: DecodeState, tokens: torch.Tensor, depths: torch.Tensor,
                   tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """``run``'s whole model output (continuous drafts read its ``cond``)."""
        self.forwards += 1
        positions = (state.lengths - 1)[:, None] + state.expand(depths)
        mask = None if tree_mask is None else state.expand(tree_mask)
        return self.model(state.expand(tokens), positions, self.cache, mask)


def catch_up_width(state: DecodeState, fed_at: list[int] | None, missing: Callable[[], torch.Tensor],
                   cache, bound: int) -> int:
    """The widest catch-up feed of a drafter's cache: ``max(missing())`` over rows, at least 1.

    After a feed the cache lacks exactly what the rows generated since (``state.generated``, the
    host counts the loop read with its stop flag, against ``fed_at``, those of the last feed), so
    the width needs no device read; the first feed (``fed_at`` None), or a state without host
    counts, reads ``missing()`` (R,). ``bound``: the drafter's most entries a pass adds, fed
    whatever the rows need when ``cache`` keeps static shapes (rows needing less feed history
    entries past their end, which the drafter then cuts from its cache), so a compiled draft step
    sees one width."""
    if fed_at is not None and state.generated is not None:
        width = max(1, max(now - then for now, then in zip(state.generated, fed_at)))
        return max(width, bound) if getattr(cache, "static", False) else width
    return int(missing().max())


class _ModelDrafter(DrafterBase):
    """What drafters built on a small draft model share: its runner and pass count (not lane-safe:
    the draft model reads each row's raster history)."""

    reads_target_probs = False  # update reads features, or nothing

    def __init__(self, model, conditioned: bool = True):
        self.runner = _DraftModelRunner(model, conditioned)
        self.vocab_size = model.vocab_size
        self.token_shape = tuple(getattr(model, "token_shape", ()))  # () for token ids

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    restarts_rows = True

    def start(self, state: DecodeState) -> None:
        self.runner.start(state)  # ``update`` stays a no-op: the runner re-syncs at the next proposal

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        check(not state.continuous, "drafter", "a token-id draft model for continuous batching", "continuous")
        self.runner.restart_rows(state, rows, alone)


class ModelChainDrafter(_ModelDrafter):
    """Chain speculative decoding with a small draft model.

    Samples ``gamma`` tokens from the draft's processed distribution q (same logits processor as
    the target, so with guidance the draft is guided too) and hands q to the acceptance rule.
    ``conditioned=False`` keeps the call's conditioning (e.g. images) from the draft model.

    Continuous tokens (a draft model with a ``token_shape``): q is the draft head's ``TokenDist``
    through the call's ``DensityProcessor``, and the draws (with their denoising paths and log q)
    go to the rule with the tokens.

    ``warmup``: the first ``ceil(warmup * max_new_tokens)`` tokens of every row come from the
    target alone (nothing is drafted before; CSpD's token pre-filling, Wang et al., 2025). Exact.
    """

    def __init__(self, model, gamma: int = 4, conditioned: bool = True, warmup: float = 0.0):
        check_int(gamma, "gamma", 1)
        check(isinstance(warmup, (int, float)) and not isinstance(warmup, bool) and 0.0 <= warmup < 1.0, "warmup",
              "a fraction in [0, 1) of the tokens to generate", warmup)
        super().__init__(model, conditioned)
        self.gamma = gamma
        self.warmup = float(warmup)
        self.max_block = self.runner.catch_up = gamma + 1

    def warming_up(self, state: DecodeState) -> bool:
        """True while some row has generated fewer than ``ceil(warmup * max_new_tokens)`` tokens
        (rows advance in lockstep then: every pass emits one token per row)."""
        if self.warmup == 0.0:
            return False
        B = state.batch_size
        generated = int((state.lengths[:B] - state.prompt_lengths[:B]).min())
        return generated < math.ceil(self.warmup * state.new_tokens)

    def propose(self, state: DecodeState) -> DraftTree:
        if self.warming_up(state):
            return _empty_draft(state)
        if state.continuous:
            return self._propose_densities(state)
        logits = self.runner.root_logits(state)  # (R, V)
        toks, qs = [], []
        for i in range(self.gamma):
            q = state.processor(logits[:, None])[:, 0]  # (B, V)
            x = sample(q, state.generator)
            toks.append(x)
            qs.append(q)
            if i + 1 < self.gamma:
                logits = self.runner.run(state, x[:, None], torch.full_like(x[:, None], i + 1))[:, 0]
        tokens = torch.stack(toks, 1)
        return DraftTree(tokens, Tree.chain(tokens.shape[0], self.gamma, tokens.device), torch.stack(qs, 1))

    def _propose_densities(self, state: DecodeState) -> DraftTree:
        """The same chain on continuous tokens: q is a ``TokenDist``, x a ``Draw``."""
        out = self.runner.root_output(state)  # (R, 1, H) features after the root
        meter = None if state.meters is None else state.meters["draft"]
        root = (state.lengths - 1)[:, None]  # (R, 1)
        draws, qs = [], []
        for i in range(self.gamma):
            q = state.distribution(out, root + i, meter)[:, 0]  # (B,)
            x = q.sample(state.generator)
            draws.append(x)
            qs.append(q)
            if i + 1 < self.gamma:
                depth = torch.full((state.batch_size, 1), i + 1, dtype=torch.long, device=root.device)
                out = self.runner.run_output(state, x.token[:, None].to(state.tokens.dtype), depth)
        x = Draw.stack(draws, 1)  # (B, gamma)
        B = x.token.shape[0]
        return DraftTree(x.token.to(state.tokens.dtype), Tree.chain(B, self.gamma, x.token.device),
                         type(qs[0]).stack(qs, 1), draws=x)


class ModelTreeDrafter(_ModelDrafter):
    """EAGLE-2 dynamic draft trees grown by a small draft model.

    ``mode="topk"`` is EAGLE-2's deterministic tree (``top_k``, ``depth``, ``total_tokens``;
    verified with q = 1); ``mode="sample"`` draws ``top_k`` children per expanded node without
    replacement and keeps every drawn node (verified with their q). The draft model here is a
    stand-in for EAGLE's feature head, which plugs into the same ``dynamic_tree`` machinery.
    """

    def __init__(self, model, top_k: int = 4, depth: int = 4, total_tokens: int = 16,
                 mode: str = "topk", conditioned: bool = True):
        check(not getattr(model, "token_shape", ()), "model",
              "a token-id model: continuous tokens are drafted in chains (ModelChainDrafter), since recursive "
              "rejection among siblings needs the residual's normalised density, whose normaliser 1 - beta has "
              "no closed form", type(model).__name__)
        super().__init__(model, conditioned)
        self.top_k, self.depth, self.total_tokens, self.mode = top_k, depth, total_tokens, mode
        self.max_block = _tree_block(model.vocab_size, top_k, depth, total_tokens, mode)
        self.runner.tree_slots = _tree_slots(top_k, depth)
        self.runner.catch_up = _tree_catch_up(self.max_block, depth)

    def propose(self, state: DecodeState) -> DraftTree:
        logits = self.runner.root_logits(state)

        def step(tokens, depth, mask):
            out = self.runner.run(state, tokens, torch.full_like(tokens, depth), mask)  # (R, k, V)
            return _node_scores(state, out, self.mode)

        return _grow_tree(state, _node_scores(state, logits, self.mode), step, self)


def _tree_block(vocab_size, top_k, depth, total_tokens, mode) -> int:
    """Check the tree knobs; returns the largest block the target verifies (root included)."""
    check_choice("mode", mode, ("topk", "sample"))
    check(is_int(top_k) and 1 <= top_k <= vocab_size, "top_k", f"an int in [1, {vocab_size}]", top_k)
    check_int(depth, "depth", 0)
    check_int(total_tokens, "total_tokens", 2)
    nodes = top_k + depth * top_k * top_k
    return 1 + (min(nodes, total_tokens - 1) if mode == "topk" else nodes)


def _tree_catch_up(max_block: int, depth: int) -> int:
    """History entries a tree's pass adds at most: its accepted path (at most ``depth + 1``
    levels, at most the tree's nodes) plus the target's own token."""
    return min(max_block, depth + 2)


def _tree_slots(top_k: int, depth: int) -> int:
    """Draft-cache slots one proposal's tree takes past the committed history: every level feeds
    its ``top_k`` frontier nodes, all of them, before the tree is cut to ``total_tokens`` (so a
    row whose history fills the decoder's capacity, ``state.max_len``, still has room)."""
    return top_k * depth


def _node_scores(state: DecodeState, logits: torch.Tensor, mode: str) -> torch.Tensor:
    """(R, ..., V) draft logits -> what the tree builder ranks (B, ..., V)."""
    if mode == "topk":  # confidence: the draft's guided log-probabilities
        return state.processor.merge_guidance(logits.float()).log_softmax(-1)
    return state.processor(logits)  # sampled nodes come from the processed distribution


def _grow_tree(state: DecodeState, root_scores: torch.Tensor, step, knobs) -> DraftTree:
    if knobs.mode == "topk":
        return dynamic_tree(root_scores, step, knobs.top_k, knobs.depth, knobs.total_tokens)
    return sampled_tree(root_scores, step, knobs.top_k, knobs.depth, state.generator)


class EagleTreeDrafter(DrafterBase):
    """EAGLE-2's dynamic draft tree grown by an EAGLE feature head (Li et al., 2024, "EAGLE" and
    "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees").

    The head drafts from the target's features, not its tokens: its entry at position p pairs the
    target's feature at p - 1 with the token at p (EAGLE's shift by one). The drafter keeps every
    committed feature; after each verification ``update`` stores the target's features along the
    accepted path (the root and the accepted nodes), and the next proposal feeds the head the
    entries its cache lacks, pairing them with the accepted tokens and the next token. Inside the
    tree a node's entry uses its parent's *predicted* feature, as in EAGLE.

    ``mode``, ``top_k``, ``depth`` and ``total_tokens`` are ``ModelTreeDrafter``'s: ``"topk"`` is
    EAGLE-2's deterministic tree (verified with q = 1), ``"sample"`` the sampled tree. With
    guidance the head runs both CFG halves on their own features and its logits are merged.
    The target must return features (``ModelOutput.hidden``) from its prefill and verify passes.
    """

    reads_target_probs = False  # update reads features, or nothing

    def __init__(self, head: FeatureHead, top_k: int = 4, depth: int = 4, total_tokens: int = 16,
                 mode: str = "topk"):
        self.head = head
        self.vocab_size = head.vocab_size
        self.top_k, self.depth, self.total_tokens, self.mode = top_k, depth, total_tokens, mode
        self.max_block = _tree_block(head.vocab_size, top_k, depth, total_tokens, mode)
        self.catch_up = _tree_catch_up(self.max_block, depth)
        self.forwards = 0
        self.cache = self.features = self.cached = self.fed_at = None

    def start(self, state: DecodeState) -> None:
        out = state.prefill
        if out is None or out.hidden is None:
            raise ValueError("EagleTreeDrafter needs the target's features: its forward must return "
                             "ModelOutput.hidden (and the decoder must set state.prefill)")
        R, S, H = out.hidden.shape
        self.features = out.hidden.new_zeros(R, state.tokens.shape[1], H)  # [r, j]: feature at position j
        self.features[:, :S] = out.hidden
        self.cache = self.head.new_cache(R, state.max_len + _tree_slots(self.top_k, self.depth))
        self.head.start(self.cache, state)  # the head's per-prompt preparation (a no-op for most)
        self.cached = torch.zeros_like(state.lengths)  # history entries in the head cache: positions 1 .. cached
        self.fed_at = None  # host: each row's generated count at the last feed (None: nothing fed yet)

    restarts_rows = True

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        """``Drafter.restart_rows``: each row started alone (``start`` on its batch-1 state: its
        features, the head's plan of its prompt, e.g. its images) and fed once (the first feed,
        which consumes the plan), then copied into the row: features, head cache row, cached count.
        A batch not fed yet is fed first, so that what ``head.start`` prepared for the batch's
        first feed is consumed before rows are replaced."""
        if self.fed_at is None:
            self.root_output(state)
        for b, sub in zip(rows, alone):
            fresh = copy.copy(self)  # the same head and knobs; start gives it its own cache and features
            fresh.start(sub)
            fresh.root_output(sub)
            self.forwards = fresh.forwards
            for i, r in enumerate(state.target_rows(b)):
                self.features[r] = fresh.features[i]
                self.cache.load_row(r, fresh.cache, i)
                self.cached[r] = fresh.cached[i]
            if self.fed_at is not None:
                self.fed_at = list(self.fed_at)
                self.fed_at[b] = fresh.fed_at[0]

    def root_output(self, state: DecodeState) -> ModelOutput:
        """The head's entry at each row's root (position L - 1): its predicted feature (R, H) and
        the draft logits of the root's children (R, V). Feeds the committed history the head's
        cache lacks (always at least the root's entry, so repeated calls agree)."""
        L = state.lengths
        self.cached = torch.minimum(self.cached, L - 2)
        self.cache.truncate(self.cached)
        width = catch_up_width(state, self.fed_at, lambda: L - 1 - self.cached, self.cache, self.catch_up)
        positions = self.cached[:, None] + 1 + torch.arange(width, device=L.device)  # (R, W)
        last = state.tokens.shape[1] - 1  # shorter rows read (and later cut) garbage past their end
        tokens = state.tokens.gather(1, positions.clamp(max=last))
        H = self.features.shape[-1]
        feats = self.features.gather(1, (positions - 1).clamp(max=last)[..., None].expand(-1, -1, H))
        out = self.head(feats, tokens, positions, self.cache)
        self.forwards += 1
        at = L - 2 - self.cached  # (R,) the root's column in the block
        self.cache.truncate(L - 1)
        self.cached = L - 1
        self.fed_at = state.generated
        rows = torch.arange(len(at), device=at.device)
        return ModelOutput(logits=out.logits[rows, at], hidden=out.hidden[rows, at])

    def propose(self, state: DecodeState) -> DraftTree:
        root = self.root_output(state)
        fed = [root.hidden[:, None]]  # predicted features of the root and every tree node fed so far
        roots = (state.lengths - 1)[:, None]

        def step(tokens, depth, mask):
            k = tokens.shape[1]
            parent = _parent_slot(state.expand(mask), k)  # (R, k): 0 = root, i = i-th fed node
            known = torch.cat(fed, 1)
            feats = known.gather(1, parent[..., None].expand(-1, -1, known.shape[-1]))
            out = self.head(feats, state.expand(tokens), (roots + depth).expand(-1, k), self.cache,
                            state.expand(mask))
            self.forwards += 1
            fed.append(out.hidden)
            return _node_scores(state, out.logits, self.mode)

        return _grow_tree(state, _node_scores(state, root.logits, self.mode), step, self)

    def update(self, state, draft, acceptance, target_probs, target_out):
        if target_out.hidden is None:
            raise ValueError("EagleTreeDrafter needs the target's features (ModelOutput.hidden)")
        hidden = target_out.hidden  # (R, T, H), root first
        path = state.expand(acceptance.path).clamp(min=0)  # (R, D+1); slots past the path are garbage
        H = hidden.shape[-1]
        on_path = hidden.gather(1, path[..., None].expand(-1, -1, H))
        # node j of the path sits at position L - 1 + j; entries past the accepted ones are written
        # where the next round's features will overwrite them before they are read
        positions = (state.lengths - 1)[:, None] + torch.arange(path.shape[1], device=path.device)
        positions = positions.clamp(max=self.features.shape[1] - 1)
        self.features.scatter_(1, positions[..., None].expand(-1, -1, H), on_path.to(self.features.dtype))


class ParallelHeadsDrafter(DrafterBase):
    """A whole EAGLE-2 tree from one pass of parallel draft heads (Medusa, Cai et al., 2024).

    The heads (``ParallelHeads``: ``mmspec.models.medusa``) read the target's feature before the
    root, whose LM-head output the root was drawn from, and score the K tokens after the root at
    once. The tree is EAGLE-2's dynamic tree over those K distributions (``dynamic_tree``: every
    frontier node at depth d proposes head d's ``top_k`` tokens, ranked by the product of head
    probabilities along the path, ``total_tokens`` kept): a node's children do not depend on its
    token, since the heads do not read drafts (only the root). Deterministic nodes, verified with
    q = 1, so lossless under ``SpeculativeSampling`` and ``GreedyMatch``.

    One head call per verification (``forwards`` counts them), where ``EagleTreeDrafter`` makes
    one per tree level. After each verification ``update`` keeps the target's feature at the last
    accepted node, the one the next root comes from.

    Args:
        heads: the parallel heads (K = ``heads.num_heads`` levels below the root).
        top_k: children per frontier node and frontier width.
        total_tokens: nodes verified, root included.
        depth: levels used (default K, at most K).
    """

    reads_target_probs = False  # update reads features, or nothing

    def __init__(self, heads: ParallelHeads, top_k: int = 4, total_tokens: int = 16, depth: int | None = None):
        K = heads.num_heads
        depth = K if depth is None else depth
        check(is_int(depth) and 1 <= depth <= K, "depth", f"an int in [1, {K}] (the heads' count)", depth)
        self.heads = heads
        self.vocab_size = heads.vocab_size
        self.top_k, self.depth, self.total_tokens, self.mode = top_k, depth, total_tokens, "topk"
        self.max_block = _tree_block(heads.vocab_size, top_k, depth - 1, total_tokens, "topk")
        self.forwards = 0
        self.features = self.inputs = None

    def start(self, state: DecodeState) -> None:
        out = state.prefill
        if out is None or out.hidden is None:
            raise ValueError("ParallelHeadsDrafter needs the target's features: its forward must return "
                             "ModelOutput.hidden (and the decoder must set state.prefill)")
        rows = torch.arange(out.hidden.shape[0], device=out.hidden.device)
        self.features = out.hidden[rows, state.lengths - 2]  # (R, H): the root came from this feature
        self.inputs = self.heads.start(state)

    restarts_rows = True

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        """``Drafter.restart_rows``: each row's ``start`` alone (its root's feature and the heads'
        per-generation inputs, e.g. its image feature), copied into the row."""
        for b, sub in zip(rows, alone):
            fresh = copy.copy(self)
            fresh.start(sub)
            check(fresh.inputs is None or (isinstance(fresh.inputs, torch.Tensor) and isinstance(
                self.inputs, torch.Tensor)), "heads", "heads whose start returns None or a per-row tensor "
                  "(continuous batching copies it row by row)", type(fresh.inputs).__name__)
            for i, r in enumerate(state.target_rows(b)):
                self.features[r] = fresh.features[i]
                if fresh.inputs is not None:
                    self.inputs[r] = fresh.inputs[i]

    def propose(self, state: DecodeState) -> DraftTree:
        root = state.tokens.gather(1, (state.lengths - 1)[:, None]).squeeze(1)  # (R,)
        inputs = self.heads.step_inputs(state, self.inputs)
        logp = _node_scores(state, self.heads(self.features, root, inputs), self.mode)  # (B, K, V)
        self.forwards += 1

        def step(tokens, depth, mask):  # head ``depth`` for every frontier node alike
            return logp[:, depth, None].expand(-1, tokens.shape[1], -1)

        return dynamic_tree(logp[:, 0], step, self.top_k, self.depth - 1, self.total_tokens, masks=False)

    def update(self, state, draft, acceptance, target_probs, target_out):
        if target_out.hidden is None:
            raise ValueError("ParallelHeadsDrafter needs the target's features (ModelOutput.hidden)")
        last = acceptance.path.gather(1, acceptance.num_accepted[:, None])  # (B, 1) the last accepted node
        hidden = target_out.hidden  # (R, T, H), root first
        last = state.expand(last)
        self.features = hidden.gather(1, last[..., None].expand(-1, -1, hidden.shape[-1])).squeeze(1)


def _parent_slot(mask: torch.Tensor, k: int) -> torch.Tensor:
    """(R, k) each frontier node's parent among the fed tree nodes (1-based, 0 = the root).

    ``mask`` (R, k, fed + k) marks each new node's ancestors among the nodes fed so far; they are
    fed level by level, so the parent is the ancestor fed last."""
    anc = mask[..., : mask.shape[-1] - k]
    order = torch.arange(1, anc.shape[-1] + 1, device=mask.device)
    return (anc * order).amax(-1) if anc.shape[-1] else mask.new_zeros(mask.shape[:2], dtype=torch.long)


class JacobiDrafter(DrafterBase):
    """Speculative Jacobi Decoding's drafter (Teng et al., 2025, "Accelerating Auto-regressive
    Text-to-Image Generation with Training-free Speculative Jacobi Decoding").

    Keeps a window of ``window - 1`` draft tokens after the root. After a pass that accepted n
    drafts, the outputs the target sampled at the unaccepted positions (with the distributions
    they came from) become the next drafts, and new tokens are initialised at the end with a
    one-hot q:

    - ``init="random"`` draws uniformly from ``init_range`` (the whole vocabulary by default; the
      reference's default for Lumina-mGPT);
    - ``init="repeat"`` copies the last known token (the reference's ``repeat_horizon``, its
      LlamaGen default: the left neighbour in a raster grid);
    - ``init="spatial"`` copies the token one grid row above (``grid_width`` tokens back; the
      paper's vertical repeat, Fig. 9), falling back to ``repeat`` in the first image row.

    ``coupling`` says how a position's draft is refreshed after a pass: ``"independent"`` draws it
    afresh from the target's new distribution p_new (SJD); ``"maximal"`` couples it with the draft
    x the same position had, drawn from p_old (MC-SJD, So et al., 2025, "MC-SJD: Maximal Coupling
    Speculative Jacobi Decoding for Autoregressive Visual Generation Acceleration": keep x with probability
    ``min(1, p_new(x) / p_old(x))``, else draw from ``norm(max(p_new - p_old, 0))``). Either way
    the new draft is distributed as p_new, its q, so verification is unchanged and lossless; the
    maximal coupling keeps x with the largest possible probability, ``sum min(p_new, p_old)``, so
    successive iterations agree more often and a later pass can accept more.

    ``interval=(l, r)`` reproduces the reference's ``jacobi_loop_interval`` (its LlamaGen script:
    ``(1, N - L - 2)`` for N image tokens): with g the tokens generated before a pass, the pass
    *after* it drafts ``min(window, 1 + r - g) - 1`` tokens while ``1 + l <= g < 1 + r`` and none
    otherwise, and the first pass drafts none; so the first tokens and the last L + 2 or so come
    from single-token passes, as in the reference. ``None`` drafts a full window on every pass.
    At batch > 1 the chain is as long as the longest row's and shorter rows get empty slots
    (q = 0), which the sampling rules never accept (``GreedyMatch`` ignores q: under greedy a row
    may accept such a slot when it holds the target's own token).
    """

    def __init__(self, vocab_size: int, window: int = 16, init: str = "random",
                 init_range: tuple[int, int] | None = None, grid_width: int | None = None,
                 coupling: str = "independent", interval: tuple[int, int] | None = None):
        check_int(window, "window", 2)
        check_choice("init", init, ("random", "repeat", "spatial"))
        check_choice("coupling", coupling, ("independent", "maximal"))
        check(interval is None or (isinstance(interval, tuple) and len(interval) == 2
                                   and all(is_int(i) for i in interval)
                                   and interval[0] >= 0), "interval",
              "None or a tuple (l, r) of ints with l >= 0 (the reference's jacobi_loop_interval)", interval)
        lo, hi = init_range if init_range is not None else (0, vocab_size)
        check(0 <= lo < hi <= vocab_size, "init_range", f"(lo, hi) with 0 <= lo < hi <= {vocab_size}",
              init_range)
        if init == "spatial":
            check(is_int(grid_width) and grid_width >= 1, "grid_width",
                  "an int >= 1 (the token grid's width) with init='spatial'", grid_width)
        self.vocab_size, self.window, self.init, self.init_range = vocab_size, window, init, (lo, hi)
        self.grid_width, self.coupling, self.interval = grid_width, coupling, interval
        self.max_block = window
        self.forwards = 0
        # 'spatial' reads the raster history, the interval counts a raster sequence's tokens
        self.lane_safe = init != "spatial" and interval is None
        self.drafts = self.q = self.count = self.before = None

    def start(self, state: DecodeState) -> None:
        B, device = state.batch_size, state.tokens.device
        self.drafts = torch.zeros(B, self.window - 1, dtype=torch.long, device=device)
        self.q = torch.zeros(B, self.window - 1, self.vocab_size, device=device)
        self.count = torch.zeros(B, dtype=torch.long, device=device)
        self.before = torch.zeros(B, dtype=torch.long, device=device)  # tokens generated before the last pass

    restarts_rows = True

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        """``Drafter.restart_rows``: the rows' windows as ``start`` leaves them (no drafts yet)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.drafts.device)
        for buf in (self.drafts, self.q, self.count, self.before):
            buf[index] = 0

    def propose(self, state: DecodeState) -> DraftTree:
        B, n = state.batch_size, self.window - 1
        device = self.drafts.device
        fresh = torch.arange(n, device=device) >= self.count[:, None]  # (B, n)
        known = torch.cat([state.roots[:, None], self.drafts], 1)  # (B, n + 1): root, then drafts
        repeat = known.gather(1, self.count[:, None]).expand(B, n)
        if self.init == "random":
            init = randint(*self.init_range, (B, n), state.generator, device)
        elif self.init == "repeat":
            init = repeat
        else:  # the token one grid row above draft j (history index lengths + j)
            hist = state.lengths[:B, None] + torch.arange(n, device=device) - self.grid_width  # (B, n)
            start = state.prompt_lengths[:B, None]
            from_history = state.tokens[:B].gather(1, hist.clamp(min=0))
            j_above = (hist - state.lengths[:B, None] + 1).clamp(0, n)  # index into known (root = 0)
            above = torch.where(hist <= state.lengths[:B, None] - 1, from_history, known.gather(1, j_above))
            init = torch.where(hist >= start, above, repeat)
        tokens = torch.where(fresh, init, self.drafts)
        onehot = torch.nn.functional.one_hot(tokens, self.vocab_size).to(self.q.dtype)
        q = torch.where(fresh[..., None], onehot, self.q)
        if self.interval is not None:
            tokens, q = self._reference_interval(state, tokens, q)
        return DraftTree(tokens, Tree.chain(B, tokens.shape[1], device), q)

    def _reference_interval(self, state: DecodeState, tokens: torch.Tensor, q: torch.Tensor):
        """Cut the window to what the reference's interval allows; slots past a row's allowance
        are empty (q = 0: never accepted)."""
        B = state.batch_size
        l, r = self.interval
        g = self.before  # the reference decides a pass's window from the length one pass earlier
        inside = (g >= 1 + l) & (g < 1 + r)
        width = torch.where(inside, (1 + r - g).clamp(max=self.window), 1) - 1  # (B,) drafts allowed
        self.before = state.lengths[:B] - state.prompt_lengths[:B]
        G = int(width.max())
        empty = torch.arange(G, device=tokens.device) >= width[:, None]  # (B, G)
        return tokens[:, :G], torch.where(empty[..., None], 0.0, q[:, :G])

    def redraft(self, prev: torch.Tensor, p_old: torch.Tensor, p_new: torch.Tensor, generator) -> torch.Tensor:
        """(B, G) new drafts distributed as ``p_new`` (B, G, V), one per position whose previous
        draft ``prev`` (B, G) was drawn from ``p_old`` (B, G, V; all zero where there was none)."""
        if self.coupling == "independent":
            return sample(p_new, generator)
        return maximal_coupling(prev, p_old, p_new, generator)[0]

    def update(self, state, draft, acceptance, target_probs, target_out):
        n = self.window - 1
        G = draft.tokens.shape[1]
        a = acceptance.num_accepted  # (B,)
        if G == 0:  # a single-token pass: the next window starts afresh
            self.count = torch.zeros_like(a)
            return
        ahead = target_probs[:, 1:]  # (B, G, V): the target at the positions of d_2 .. d_G and one past
        B, _, V = ahead.shape
        # ahead[:, k] is the position old draft k + 1 held (none for the last): couple with it
        prev = torch.cat([draft.tokens[:, 1:], draft.tokens.new_zeros(B, 1)], 1)  # (B, G)
        p_old = torch.cat([draft.q[:, 1:], draft.q.new_zeros(B, 1, V)], 1).to(ahead.dtype)  # (B, G, V)
        y = self.redraft(prev, p_old, ahead, state.generator)  # (B, G)
        # the Jacobi update: samples after the accepted prefix become the next drafts
        src = (a[:, None] + torch.arange(n, device=y.device)).clamp(max=G - 1)
        self.drafts = y.gather(1, src)
        self.q = ahead.gather(1, src[..., None].expand(B, n, V))
        self.count = G - a


class JacobiDensityDrafter(DrafterBase):
    """Speculative Jacobi Decoding on densities: ``JacobiDrafter`` for continuous tokens, no draft
    model (SJD, Teng et al., 2025; the maximal coupling of MC-SJD, So et al., 2025, carried from
    categorical distributions to densities).

    Keeps a window of ``window - 1`` draft tokens after the root, each with the ``TokenDist`` q it
    was drawn from. After a pass that accepted n drafts, the target's distributions computed in that
    pass at the unaccepted positions (conditioned on the old drafts before them) become the q of
    the next window, and the draft at each such position is redrawn from its new q:

    - ``coupling="independent"`` (SJD): a fresh draw from q_new;
    - ``coupling="maximal"`` (MC-SJD): keep the old draft x, drawn from q_old, with probability
      ``min(1, q_new(x) / q_old(x))`` (float64 log space), else draw from the residual
      ``(q_new - q_old)^+ / (1 - beta)`` (``TokenDist.residual``'s exact sampler, its tries counted
      on the ``"draft"`` meter). The result has density q_new and equals x with probability
      ``beta = int min(q_new, q_old)``, the most any coupling achieves, so successive passes agree
      more often;
    - ``coupling="noise"``: each position keeps the noise it was first drawn with
      (``TokenDist.noise``) until it is committed, and every redraft is ``q_new.from_noise`` of
      that noise: fixed-noise Jacobi iteration (Song et al., 2021, "Accelerating Feedforward
      Computation via Parallel Nonlinear Equation Solving", which samples autoregressive models
      this way), here under the exact test. A position's noise only ever feeds its own draws, and
      its q is computed from earlier positions alone, so the draft has density q_new given
      everything the rule conditions on; the draft moves smoothly with q (the same component and
      normals) instead of jumping to a residual draw, and no residual is drawn to redraft. When
      the context before a position stops changing, its draft stops changing too.

    Fresh positions, which no target pass has scored yet (the slots past the last pass's bonus
    position, the whole window after an all-accepted pass, and the first window), have no
    distribution of their own: they reuse the nearest one, the target's distribution at the last
    position it scored (the last pass's bonus position; before the first pass the root's, from the
    prefill's features, one head call counted on the ``"draft"`` meter), and draw from it
    independently. A point mass would not do: a density ratio needs q to be a density.

    Every draft is drawn from the q handed to the rule, with fresh randomness or a coupling that
    does not look at the draft's own position in the pass that scored it (an untested draft never
    influenced that pass's decisions), so ``SpeculativeSampling`` on densities keeps the target's
    law exactly; a poor q only lowers acceptance. Every row drafts a full window each pass; rows
    accept different lengths.

    Heads: tokens must be their own draws (the mixture head). A diffusion head's draws carry their
    denoising path (``Draw.aux``), which the residual sampler does not return: refused at ``start``.

    Args:
        token_shape: the target's token shape (the decoder checks it against the target's).
        window: L, tokens verified per pass (root included): ``window - 1`` drafts.
        coupling: ``"noise"`` (fixed noise per position, the default; the head's distribution must
            implement ``noise`` / ``from_noise``), ``"maximal"`` (MC-SJD) or ``"independent"`` (SJD).
    """

    COUPLINGS = ("independent", "maximal", "noise")

    def __init__(self, token_shape: tuple[int, ...], window: int = 8, coupling: str = "noise"):
        check(isinstance(token_shape, tuple) and len(token_shape) > 0 and all(
            is_int(n) and n >= 1 for n in token_shape), "token_shape",
              "a non-empty tuple of ints >= 1 (continuous tokens)", token_shape)
        check_int(window, "window", 2)
        check_choice("coupling", coupling, self.COUPLINGS)
        self.token_shape, self.window, self.coupling = token_shape, window, coupling
        self.max_block = window
        self.draws = self.q = self.noise = self._chain = None

    def start(self, state: DecodeState) -> None:
        out = state.prefill
        if out is None or out.cond is None:
            raise ValueError("JacobiDensityDrafter needs the target's prefill features (ModelOutput.cond): "
                             "a continuous-token target and the decoder's state.prefill")
        R = out.cond.shape[0]
        rows, at = torch.arange(R, device=out.cond.device), state.prompt_lengths - 1
        root = ModelOutput(logits=None, cond=out.cond[rows, at][:, None], heads=out.heads)
        meter = None if state.meters is None else state.meters["draft"]
        q = state.distribution(root, at[:, None], meter)  # (B, 1): the root's own distribution
        n = self.window - 1
        src = torch.zeros(state.batch_size, n, dtype=torch.long, device=state.lengths.device)
        self.noise = None
        if self.coupling == "noise" and type(q).noise is not TokenDist.noise:
            self._noise_draws(state, q, src)
        else:
            self.q, self.draws = self._fresh(state, q, src)
        check(not self.draws.aux and self.draws.log_prob is not None and (
            self.coupling != "noise" or self.noise is not None), "the head",
              "one whose tokens are their own draws (the mixture head): a diffusion head's draws carry their "
              "denoising path, which Jacobi redraws (fixed noise, residuals) do not keep; use the mixture head "
              "with JacobiDensityDrafter", type(q).__name__)

    @staticmethod
    def _gather(state: DecodeState, dists: TokenDist, src: torch.Tensor):
        """``dists[b, src[b, k]]`` for (B, n) ``src``: as (B, n) and flat (B n,) TokenDists, with the
        flat entries' generators (entry (b, k) draws from row b's)."""
        B, n = src.shape
        rows = torch.arange(B, device=src.device)[:, None].expand(B, n)
        return dists[rows, src], dists[rows.reshape(-1), src.reshape(-1)], select_rows(state.generator,
                                                                                      rows.reshape(-1))

    def _noise_draws(self, state: DecodeState, dists: TokenDist, src: torch.Tensor, held: torch.Tensor | None = None,
                     keep: torch.Tensor | None = None) -> None:
        """The noise coupling's window: q = ``dists[b, src[b, k]]``, each slot's noise fresh (entry
        (b, k) from row b's generator) or, where ``keep`` (B, n), the ``held`` (B, n, k) noise of
        its position, and the draws ``q.from_noise(noise)``."""
        self.q, flat, gen = self._gather(state, dists, src)
        noise = flat.noise(gen).unflatten(0, src.shape)
        self.noise = noise if held is None else torch.where(keep[..., None], held, noise)
        self.draws = _unflatten(flat.from_noise(self.noise.flatten(0, 1)), *src.shape)

    def _fresh(self, state: DecodeState, dists: TokenDist, src: torch.Tensor) -> tuple[TokenDist, Draw]:
        """Independent draws from ``dists[b, src[b, k]]``: ((B, n) q, (B, n) draws with log q)."""
        q, flat, gen = self._gather(state, dists, src)
        x = flat.sample(gen)
        if x.log_prob is None:
            x.log_prob = flat.log_prob(x)
        return q, _unflatten(x, *src.shape)

    def propose(self, state: DecodeState) -> DraftTree:
        x = self.draws
        B, n = x.token.shape[:2]
        if self._chain is None or self._chain.parents.shape != (B, n) or self._chain.parents.device != x.token.device:
            self._chain = Tree.chain(B, n, x.token.device)  # the same chain every pass (and its cached depths)
        return DraftTree(x.token.to(state.tokens.dtype), self._chain, self.q, draws=x)

    def update(self, state, draft, acceptance, target_probs, target_out):
        B, n = state.batch_size, self.window - 1
        G = draft.tokens.shape[1]  # n, or 0 after a pass without a draft (GatedDrafter off)
        device = acceptance.num_accepted.device
        # slot k of the next window is old draft a + 1 + k; the target scored it at index a + 1 + k
        # of target_probs (root first), and nothing past index G (the bonus position)
        pos = acceptance.num_accepted[:, None] + 1 + torch.arange(n, device=device)  # (B, n)
        src = pos.clamp(max=G)
        # G == 0: the pass had no draft (GatedDrafter held drafting off), so no slot holds an old draft
        if self.coupling == "noise":  # held slots keep their position's noise, the others get fresh noise
            rows = torch.arange(B, device=device)[:, None]
            held = None if G == 0 else self.noise[rows, pos.clamp(max=G - 1)]
            self._noise_draws(state, target_probs, src, held, pos < G)
            return
        if self.coupling == "independent" or G == 0:
            self.q, self.draws = self._fresh(state, target_probs, src)
            return
        q2, q_new, gen = self._gather(state, target_probs, src)  # (B, n) and (B n,)
        old = (pos < G).reshape(-1)  # slots that held a draft (drawn from q_old)
        at = pos.clamp(max=G - 1)
        rows = torch.arange(B, device=device)[:, None]
        x = _flatten(draft.draws[rows, at])  # (B n,) old drafts (garbage where not old)
        q_old = draft.q[rows.expand(B, n).reshape(-1), at.reshape(-1)]
        log_old = x.log_prob if x.log_prob is not None else q_old.log_prob(x)
        if acceptance.log_p is not None:  # the rule scored every old draft under q_new already
            log_new = acceptance.log_p.gather(1, at).reshape(-1)
        else:
            log_new = q_new.log_prob(x)
        u = rand((B * n,), gen, device, torch.float64)
        keep = old & (u.log() < (log_new - log_old).clamp(max=0.0))
        tokens, logq = x.token.clone(), torch.where(keep, log_new, 0.0)
        meter = None if state.meters is None else state.meters["draft"]
        i = (old & ~keep).nonzero().squeeze(1)
        if i.numel():  # the coupling's residual draws, with their log q_new from the tries
            y, log_p = Residual(q_new[i], q_old[i], q_new.max_tries, meter).sample_with_log_p(select_rows(gen, i))
            tokens[i], logq[i] = y.token.to(tokens.dtype), log_p
        i = (~old).nonzero().squeeze(1)
        if i.numel():  # fresh slots: independent draws
            qi = q_new[i]
            y = qi.sample(select_rows(gen, i))
            tokens[i] = y.token.to(tokens.dtype)
            logq[i] = y.log_prob if y.log_prob is not None else qi.log_prob(y)
        self.q = q2
        self.draws = _unflatten(Draw(tokens, log_prob=logq), B, n)


def _flatten(x: Draw) -> Draw:
    """(B, n) draws -> (B n,)."""
    return Draw(x.token.flatten(0, 1), {k: v.flatten(0, 1) for k, v in x.aux.items()},
                None if x.log_prob is None else x.log_prob.flatten(0, 1))


def _unflatten(x: Draw, B: int, n: int) -> Draw:
    """(B n,) draws -> (B, n)."""
    return Draw(x.token.unflatten(0, (B, n)), {k: v.unflatten(0, (B, n)) for k, v in x.aux.items()},
                None if x.log_prob is None else x.log_prob.unflatten(0, (B, n)))


def maximal_coupling(x: torch.Tensor, p_old: torch.Tensor, p_new: torch.Tensor, generator=None):
    """A draw from ``p_new`` maximally coupled with ``x`` drawn from ``p_old`` (MC-SJD).

    Keeps x with probability ``min(1, p_new(x) / p_old(x))``, else draws from the residual
    ``norm(max(p_new - p_old, 0))``; the result is distributed as p_new and equals x with
    probability ``sum min(p_new, p_old)``, the most any coupling achieves. Where ``p_old`` is all
    zero (no previous draft) it draws from p_new.

    Args:
        x: (B, ...) previous tokens; p_old, p_new: (B, ..., V). Row b draws from generator b of a
            per-row tuple (one uniform, then one categorical draw, per entry).

    Returns:
        (tokens (B, ...), kept (B, ...) bool).
    """
    px_new = p_new.gather(-1, x[..., None]).squeeze(-1)
    px_old = p_old.gather(-1, x[..., None]).squeeze(-1)
    keep_prob = torch.where(px_old > 0, (px_new / px_old.clamp_min(1e-30)).clamp(max=1.0), 0.0)
    kept = rand(x.shape, generator, x.device, p_new.dtype) < keep_prob
    redrawn = sample(residual_distribution(p_new, p_old), generator)  # p_new itself where p_old is 0
    return torch.where(kept, x, redrawn), kept
