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
from ..core.rope import Rope1D, RopeTables, RotaryEmbedding
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


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig, layer: int):
        super().__init__()
        self.layer, self.n_heads = layer, cfg.n_heads
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x, step, rope: RotaryEmbedding, tables: RopeTables | None):
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if step is None:  # reference path: full causal attention over the given tokens
            q, k = rope.apply(q, tables), rope.apply(k, tables)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = step.attend(self.layer, q, k, v)  # the cache's kernels where dispatch picks them
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
        self.rope = Rope1D(cfg.dim // cfg.n_heads, cfg.rope_theta)  # the caches' ``rope(x, positions)``

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

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
        tables = self.rope.tables(positions) if cache is None else None  # the cache rotates otherwise
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, step, self.rope, tables)
        hidden = self.norm(x)
        return ModelOutput(logits=self.head(hidden), hidden=hidden)
