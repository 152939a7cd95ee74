"""Tiny random models for tests, built from constructors under fixed seeds."""

import torch

from mmspec.models import TinyCausalLM, TinyLMConfig


def tiny_lm(seed: int, vocab_size: int = 8, dim: int = 16, n_layers: int = 2, init_std: float = 0.5):
    torch.manual_seed(seed)
    cfg = TinyLMConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=2, mlp_hidden=2 * dim,
                       init_std=init_std)
    return TinyCausalLM(cfg).eval()


def spread(model, std: float = 0.4, seed: int = 0):
    """Redraw every matrix with a wider spread than transformers' init, so greedy outputs vary."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.eval()


def noisy_copy(model, scale: float = 0.15, seed: int = 1):
    """A draft that agrees with ``model`` often but not always: a copy plus seeded relative noise."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return draft


def reference_greedy(model, prompt, n):
    """Greedy decoding from scratch: no cache, the whole sequence recomputed for every token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
