"""Tiny random models for tests, built from constructors under fixed seeds."""

import torch

from mmspec.models import TinyCausalLM, TinyLMConfig


def tiny_lm(seed: int, vocab_size: int = 8, dim: int = 16, n_layers: int = 2, init_std: float = 0.5):
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=2, mlp_hidden=2 * dim,
                       init_std=init_std)
    return TinyCausalLM(cfg).eval()


def perturbed_copy(model: TinyCausalLM, noise: float, seed: int) -> TinyCausalLM:
    """A draft that agrees with ``model`` often: its weights plus Gaussian noise."""
    draft = TinyCausalLM(model.config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, src in zip(draft.parameters(), model.parameters()):
            p.copy_(src + noise * src.std().clamp_min(1e-3) * torch.randn(src.shape, generator=g))
    return draft


