"""Drafters: where proposals come from. Verification never lives here.

- ``NullDrafter``: nothing (target-only decoding, the baseline).
- ``ModelChainDrafter``: a small draft model samples gamma tokens (Leviathan et al., 2023).
- ``ModelTreeDrafter``: a small draft model grows an EAGLE-2 dynamic tree (deterministic top-k
  nodes) or a sampled tree (nodes drawn without replacement).
- ``JacobiDrafter``: the previous iteration's samples and the distributions they came from
  (Speculative Jacobi Decoding, Teng et al., 2025); no draft model at all.
"""

from __future__ import annotations

import torch

from .decoder import DecodeState, NullDrafter
from .errors import check, check_choice
from .sampling import sample
from .tree import DraftTree, Tree, dynamic_tree, sampled_tree

__all__ = ["NullDrafter", "ModelChainDrafter", "ModelTreeDrafter", "JacobiDrafter"]


class _DraftModelRunner:
    """Runs a small causal LM beside the target: its own cache, the same rows (CFG halves too).

    ``exact[r]`` counts the history tokens whose draft keys/values are in the cache at their
    slots. Drafting appends draft tokens (and, for trees, whole levels of siblings) past that
    point, so each round cuts the cache back to ``exact`` and feeds the history from there: the
    root and whatever drafts were accepted since.
    """

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.vocab_size
        self.forwards = 0
        self.cache = self.exact = None

    def start(self, state: DecodeState) -> None:
        self.cache = self.model.new_cache(state.rows, state.max_len)
        self.exact = torch.zeros_like(state.lengths)

    def root_logits(self, state: DecodeState) -> torch.Tensor:
        """(R, V) draft logits after each row's root, feeding the history the cache lacks."""
        self.exact = torch.minimum(self.exact, state.lengths - 1)  # always re-feed at least the root
        self.cache.truncate(self.exact)
        width = int((state.lengths - self.exact).max())
        positions = self.exact[:, None] + torch.arange(width, device=self.exact.device)  # (R, W)
        feed = state.tokens.gather(1, positions.clamp(max=state.tokens.shape[1] - 1))
        logits = self.model(feed, positions, self.cache).logits  # (R, W, V)
        self.forwards += 1
        last = (state.lengths - 1 - self.exact)[:, None, None].expand(-1, 1, logits.shape[-1])
        self.cache.truncate(state.lengths)  # right padding of shorter rows is not history
        self.exact = state.lengths.clone()
        return logits.gather(1, last).squeeze(1)

    def run(self, state: DecodeState, tokens: torch.Tensor, depths: torch.Tensor,
            tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed (B, T) tokens at (B, T) depths below each row's root; returns (R, T, V) logits.

        Positions are per target row: the two CFG halves share tokens but not prompt lengths."""
        self.forwards += 1
        positions = (state.lengths - 1)[:, None] + state.expand(depths)
        mask = None if tree_mask is None else state.expand(tree_mask)
        return self.model(state.expand(tokens), positions, self.cache, mask).logits


class _ModelDrafter:
    """What drafters built on a small draft model share: its runner and pass count."""

    def __init__(self, model):
        self.runner = _DraftModelRunner(model)
        self.vocab_size = model.vocab_size

    @property
    def forwards(self) -> int:
        return self.runner.forwards

    def start(self, state):
        self.runner.start(state)

    def update(self, state, draft, acceptance, target_probs, target_out):
        pass  # the runner re-syncs from the history at the next proposal


class ModelChainDrafter(_ModelDrafter):
    """Chain speculative decoding with a small draft model.

    Samples ``gamma`` tokens from the draft's processed distribution q (same logits pipeline as
    the target, so with guidance the draft is guided too) and hands q to the acceptance rule.
    """

    def __init__(self, model, gamma: int = 4):
        check(isinstance(gamma, int) and gamma >= 1, "gamma", "an int >= 1", gamma)
        super().__init__(model)
        self.gamma = gamma
        self.max_block = gamma + 1

    def propose(self, state: DecodeState) -> DraftTree:
        logits = self.runner.root_logits(state)  # (R, V)
        toks, qs = [], []
        for i in range(self.gamma):
            q = state.logits(logits[:, None])[:, 0]  # (B, V)
            x = sample(q, state.generator)
            toks.append(x)
            qs.append(q)
            if i + 1 < self.gamma:
                logits = self.runner.run(state, x[:, None], torch.full_like(x[:, None], i + 1))[:, 0]
        tokens = torch.stack(toks, 1)
        return DraftTree(tokens, Tree.chain(tokens.shape[0], self.gamma, tokens.device), torch.stack(qs, 1))


class ModelTreeDrafter(_ModelDrafter):
    """EAGLE-2 dynamic draft trees grown by a small draft model.

    ``mode="topk"`` is EAGLE-2's deterministic tree (``top_k``, ``depth``, ``total_tokens``;
    verified with q = 1); ``mode="sample"`` draws ``top_k`` children per expanded node without
    replacement and keeps every drawn node (verified with their q). The draft model here is a
    stand-in for EAGLE's feature head, which plugs into the same ``dynamic_tree`` machinery.
    """

    def __init__(self, model, top_k: int = 4, depth: int = 4, total_tokens: int = 16,
                 mode: str = "topk"):
        check_choice("mode", mode, ("topk", "sample"))
        check(isinstance(top_k, int) and 1 <= top_k <= model.vocab_size, "top_k",
              f"an int in [1, {model.vocab_size}]", top_k)
        check(isinstance(depth, int) and depth >= 0, "depth", "an int >= 0", depth)
        check(isinstance(total_tokens, int) and total_tokens >= 2, "total_tokens", "an int >= 2", total_tokens)
        super().__init__(model)
        self.top_k, self.depth, self.total_tokens, self.mode = top_k, depth, total_tokens, mode
        nodes = top_k + depth * top_k * top_k
        self.max_block = 1 + (min(nodes, total_tokens - 1) if mode == "topk" else nodes)

    def propose(self, state: DecodeState) -> DraftTree:
        logits = self.runner.root_logits(state)

        def step(tokens, depth, mask):
            out = self.runner.run(state, tokens, torch.full_like(tokens, depth), mask)  # (R, k, V)
            return self._scores(state, out)

        if self.mode == "topk":
            return dynamic_tree(self._scores(state, logits), step, self.top_k, self.depth, self.total_tokens)
        return sampled_tree(self._scores(state, logits), step, self.top_k, self.depth, state.generator)

    def _scores(self, state, logits):
        if self.mode == "topk":  # confidence: the draft's guided log-probabilities
            return state.logits.merge_guidance(logits.float()).log_softmax(-1)
        return state.logits(logits)  # sampled nodes come from the processed distribution


class JacobiDrafter:
    """Speculative Jacobi Decoding's drafter (Teng et al., 2025, "Accelerating Auto-regressive
    Text-to-Image Generation with Training-free Speculative Jacobi Decoding").

    Keeps a window of ``window - 1`` draft tokens after the root. After a pass that accepted n
    drafts, the outputs the target sampled at the unaccepted positions (with the distributions
    they came from) become the next drafts, and new tokens are initialised at the end with a
    one-hot q: ``init="random"`` draws uniformly from ``init_range`` (the whole vocabulary by
    default); ``init="repeat"`` copies the last known token.
    """

    def __init__(self, vocab_size: int, window: int = 16, init: str = "random",
                 init_range: tuple[int, int] | None = None):
        check(isinstance(window, int) and window >= 2, "window", "an int >= 2", window)
        check_choice("init", init, ("random", "repeat"))
        lo, hi = init_range if init_range is not None else (0, vocab_size)
        check(0 <= lo < hi <= vocab_size, "init_range", f"(lo, hi) with 0 <= lo < hi <= {vocab_size}",
              init_range)
        self.vocab_size, self.window, self.init, self.init_range = vocab_size, window, init, (lo, hi)
        self.max_block = window
        self.forwards = 0
        self.drafts = self.q = self.count = None

    def start(self, state: DecodeState) -> None:
        B, device = state.batch_size, state.tokens.device
        self.drafts = torch.zeros(B, self.window - 1, dtype=torch.long, device=device)
        self.q = torch.zeros(B, self.window - 1, self.vocab_size, device=device)
        self.count = torch.zeros(B, dtype=torch.long, device=device)

    def propose(self, state: DecodeState) -> DraftTree:
        B, n = state.batch_size, self.window - 1
        device = self.drafts.device
        fresh = torch.arange(n, device=device) >= self.count[:, None]  # (B, n)
        if self.init == "random":
            init = torch.randint(*self.init_range, (B, n), device=device, generator=state.generator)
        else:
            known = torch.cat([state.roots[:, None], self.drafts], 1)
            init = known.gather(1, self.count[:, None]).expand(B, n)
        tokens = torch.where(fresh, init, self.drafts)
        onehot = torch.nn.functional.one_hot(tokens, self.vocab_size).to(self.q.dtype)
        q = torch.where(fresh[..., None], onehot, self.q)
        return DraftTree(tokens, Tree.chain(B, n, device), q)

    def update(self, state, draft, acceptance, target_probs, target_out):
        n = self.window - 1
        ahead = target_probs[:, 1:]  # (B, n, V): distributions after d_1 .. d_n
        B, _, V = ahead.shape
        y = sample(ahead, state.generator)  # (B, n)
        # the Jacobi update: samples after the accepted prefix become the next drafts
        src = (acceptance.num_accepted[:, None] + torch.arange(n, device=y.device)).clamp(max=n - 1)
        self.drafts = y.gather(1, src)
        self.q = ahead.gather(1, src[..., None].expand(B, n, V))
        self.count = n - acceptance.num_accepted
