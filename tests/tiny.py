"""Tiny random models for tests, built from constructors under fixed seeds."""

import torch

from mmspec.models import TinyCausalLM, TinyLMConfig


def tiny_lm(seed: int, vocab_size: int = 8, dim: int = 16, n_layers: int = 2, init_std: float = 0.5):
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=2, mlp_hidden=2 * dim,
                       init_std=init_std)
    return TinyCausalLM(cfg).eval()
