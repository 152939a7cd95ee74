"""Synthetic draft/target pairs for the core's tests and ``mmspec bench core``.

- ``IIDTarget`` / ``IIDDrafter``: context-free distributions p and q with a chosen acceptance
  rate ``alpha = sum(min(p, q))``, the setting of Leviathan et al.'s expected-length formula.
- ``layer_skip_pair``: a tiny transformer target and a draft made of its first layers plus its
  head (self-speculation, as in LayerSkip), so acceptance and relative costs are realistic.
- ``small_vocab_pair``: an 8-token target and a noisy copy as draft, small enough for the exact
  distribution test (``mmspec.core.exactness``).
"""

from __future__ import annotations

import torch

from ..core.cache import StaticKVCache
from ..core.errors import check, check_int
from ..core.sampling import sample
from ..core.tree import DraftTree, Tree
from ..core.types import ModelOutput
from ..models.tiny_lm import TinyCausalLM, TinyLMConfig


def iid_pair_distributions(alpha: float, vocab_size: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """p uniform on ``[0, m)``, q uniform on ``[s, s + m)`` with ``m = vocab_size // 2``: the two
    overlap on ``m - s`` tokens, so ``sum(min(p, q)) = (m - s) / m``. Returns (p, q)."""
    m = vocab_size // 2
    s = round(m * (1 - alpha))
    check(0 <= s <= m and abs((m - s) / m - alpha) < 1e-9, "alpha",
          f"a multiple of 1/{m} in [0, 1]", alpha)
    p = torch.zeros(vocab_size)
    q = torch.zeros(vocab_size)
    p[:m] = 1.0 / m
    q[s : s + m] = 1.0 / m
    return p, q


class IIDTarget:
    """A target whose next-token distribution ignores the context: logits = log p everywhere."""

    def __init__(self, p: torch.Tensor):
        self.log_p = p.clamp_min(1e-30).log()
        self.vocab_size = p.shape[0]
        self.device = p.device

    def new_cache(self, batch_size: int, max_len: int) -> StaticKVCache:
        return StaticKVCache(0, batch_size, 1, 1, max_len, device=self.device)  # lengths only

    def __call__(self, tokens, positions, cache, tree_mask=None) -> ModelOutput:
        cache.step(positions, tree_mask)
        return ModelOutput(self.log_p.expand(*tokens.shape, -1))


class IIDDrafter:
    """Drafts a chain of ``gamma`` independent samples from q (no model, no forward passes)."""

    lane_safe = True  # context-free: any schedule may run it per lane (``mmspec.core.types.Drafter``)

    def __init__(self, q: torch.Tensor, gamma: int):
        check_int(gamma, "gamma", 1)
        self.q, self.gamma = q, gamma
        self.vocab_size = q.shape[0]
        self.max_block = gamma + 1
        self.forwards = 0

    def start(self, state):
        pass

    def propose(self, state) -> DraftTree:
        B = state.batch_size
        x = sample(self.q.expand(B, self.gamma, -1), state.generator)  # (B, gamma)
        return DraftTree(x, Tree.chain(B, self.gamma, x.device), self.q.expand(B, self.gamma, -1))

    def update(self, state, draft, acceptance, target_probs, target_out):
        pass


def expected_tau(alpha: float, gamma: int) -> float:
    """Mean tokens per target pass for i.i.d. acceptance (Leviathan et al., 2023, Eq. 1)."""
    if alpha == 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def layer_skip_pair(vocab_size: int = 256, dim: int = 192, n_layers: int = 12, draft_layers: int = 2,
                    seed: int = 0, block_scale: float = 0.3, head_std: float = 0.3
                    ) -> tuple[TinyCausalLM, TinyCausalLM]:
    """A random target and a draft sharing its embedding, first ``draft_layers`` blocks and head.

    Random residual blocks (weights ``block_scale / sqrt(dim)``) perturb the residual stream a
    little each, so the early exit often agrees with the full model while costing
    ``draft_layers / n_layers`` of it: the regime where speculation pays off. ``head_std`` sets
    how peaked the target is (0.3 gives a mean top-1 probability near 0.5, LLM-like).
    """
    check(1 <= draft_layers < n_layers, "draft_layers", f"an int in [1, {n_layers - 1}]", draft_layers)
    g = torch.Generator().manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=4, mlp_hidden=2 * dim)
    target = TinyCausalLM(cfg)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() == 2:
                std = 1.0 if name.startswith("embed") else head_std if name.startswith("head") \
                    else block_scale / dim ** 0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
    draft = TinyCausalLM(TinyLMConfig(**{**cfg.__dict__, "n_layers": draft_layers}))
    draft.embed, draft.norm, draft.head = target.embed, target.norm, target.head
    draft.blocks = torch.nn.ModuleList(list(target.blocks)[:draft_layers])
    return target.eval(), draft.eval()


def perturbed_copy(model: TinyCausalLM, noise: float, seed: int) -> TinyCausalLM:
    """A draft that agrees with ``model`` often: its weights plus ``noise`` times their std."""
    draft = TinyCausalLM(model.config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, src in zip(draft.parameters(), model.parameters()):
            p.copy_(src + noise * src.std().clamp_min(1e-3) * torch.randn(src.shape, generator=g))
    return draft


def small_vocab_pair(seed: int = 0) -> tuple[TinyCausalLM, TinyCausalLM]:
    """An 8-token target (top-1 probability ~0.4) and a noisy copy (acceptance ~0.7), so that
    both acceptances and rejections are common in the distribution test."""
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=8, dim=16, n_layers=2, n_heads=2, mlp_hidden=32, init_std=0.2)
    target = TinyCausalLM(cfg).eval()
    return target, perturbed_copy(target, noise=0.5, seed=seed + 1)
