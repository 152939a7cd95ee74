"""A small Llama-style causal LM (RMSNorm, RoPE, SwiGLU) that speaks the core's cache protocol.

Used as the target and draft of the core's tests and synthetic benchmarks, and as the reference
"from scratch" model: ``forward`` without a cache recomputes full causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..core.cache import SinkWindowCache, StaticKVCache
from ..core.types import ModelOutput


@dataclass
class TinyLMConfig:
    vocab_size: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_hidden: int = 128
    rope_theta: float = 10000.0
    init_std: float = 0.02


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Su et al., "RoFormer"): x (B, H, T, D), positions (B, T)."""
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # (B, 1, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.theta = layer, cfg.n_heads, cfg.rope_theta
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x, positions, step):
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if step is None:  # reference path: full causal attention over the given tokens
            q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k, v = step.update(self.layer, q, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, C))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyCausalLM(nn.Module):
    """``forward(tokens, positions, cache, tree_mask) -> ModelOutput(logits, hidden)``: the core's
    ``Target`` protocol. ``hidden`` is the final normed hidden state (the LM head's input)."""

    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=cfg.init_std)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate(x, positions, self.config.rope_theta)

    def new_cache(self, batch_size: int, max_len: int, *, sink: int | None = None,
                  window: int | None = None) -> StaticKVCache:
        """A static cache of ``max_len`` slots, or with ``window`` a sink+window rolling cache whose
        extra ``max_len`` slots hold the largest block a forward may append."""
        cfg = self.config
        p = next(self.parameters())
        shape = (cfg.n_layers, batch_size, cfg.n_heads, cfg.dim // cfg.n_heads)
        if window is not None:
            return SinkWindowCache(*shape, sink=sink or 0, window=window, max_block=max_len,
                                   rope=self.rope, dtype=p.dtype, device=p.device)
        return StaticKVCache(*shape, max_len=max_len, rope=self.rope, dtype=p.dtype, device=p.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: StaticKVCache | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        step = None if cache is None else cache.step(positions, tree_mask)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, step)
        hidden = self.norm(x)
        return ModelOutput(logits=self.head(hidden), hidden=hidden)
