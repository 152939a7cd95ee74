"""What every EAGLE draft head shares (Li et al., 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty").

The head drafts at the feature level, one step ahead of the target: its entry at sequence
position ``p`` reads the target's feature at ``p - 1`` and the token at ``p``, and predicts the
target's feature at ``p``, which the target's own LM head turns into logits for ``p + 1``::

    entry p:  fc([embed(x_p); f_{p-1}]) -> one Llama decoder layer (RoPE at p) -> f^_p -> lm_head(f^_p)

The target's token embedding and LM head are borrowed at ``bind`` and never registered as the
head's modules: a saved head holds ``fc``, the layer (``block``) and whatever a subclass adds.

A subclass says how to reach its target (``embed``, ``logits``, ``_target_config``), builds its
RoPE, and keeps what differs (a visual part, a training loss): ``EagleDraftHead`` for LlamaGen
(``mmspec.models.eagle``), ``VLMDraftHead`` for transformers VLMs (``mmspec.models.vlm_draft``).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..core.cache import StaticKVCache
from ..core.rope import RotaryEmbedding
from ..core.types import ModelOutput
from .binding import BoundToTarget
from .llamagen import LlamaGenBlock


class EagleHead(BoundToTarget, ModelMixin, ConfigMixin):
    """The EAGLE structure: ``fc`` (2 dim -> dim), one ``LlamaGenBlock`` as the decoder layer, a
    RoPE, a binding to the target, a one-layer cache, and the plain ``forward`` of the core's
    ``FeatureHead`` (``mmspec.core.types``).

    Args (from the subclass's ``__init__``, which holds the config):
        dim, n_heads, mlp_hidden, norm_eps: the layer's width, heads, SwiGLU width, RMSNorm eps.
        rope: the layer's rotary embedding (the target's positions).
        input_norm: keep the layer's input RMSNorm (EAGLE-1 drops it: ``fc`` feeds attention).
        initializer_range: std of the normal init of ``fc``'s and the layer's matrices.
    """

    config_name = "config.json"
    cache_class = StaticKVCache

    def __init__(self, dim: int, n_heads: int, mlp_hidden: int, norm_eps: float, rope: RotaryEmbedding,
                 input_norm: bool, initializer_range: float):
        super().__init__()
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.block = LlamaGenBlock(0, dim, n_heads, mlp_hidden, norm_eps)
        if not input_norm:
            self.block.attention_norm = nn.Identity()
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=initializer_range)
        self.rope = rope
        self._bound_to = ()

    # -- binding: ``BoundToTarget`` (``_target_config`` from the subclass) --------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(R, T) tokens -> (R, T, dim) through the target's embedding."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, T, dim) features -> (R, T, V) through the target's LM head."""
        raise NotImplementedError

    # -- the layer -------------------------------------------------------------------------------
    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``fc([embed(x_p); f_{p-1}])``: (R, T, dim) each -> (R, T, dim)."""
        return self.fc(torch.cat([embeds, features.to(self.fc.weight.dtype)], -1))

    def decoder_layer(self, x: torch.Tensor, positions: torch.Tensor, step) -> torch.Tensor:
        """The decoder layer over x (R, T, dim) at positions (R, T), through a cache ``step`` or
        causally over x alone (``step=None``)."""
        return self.block(x, step, self.rope, self.rope.tables(positions) if step is None else None)

    # -- the core's FeatureHead ------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> StaticKVCache:
        heads = self.block.n_heads
        w = self.fc.weight
        return self.cache_class(1, batch_size, heads, w.shape[0] // heads, max_len=max_len, rope=self.rope,
                                dtype=w.dtype, device=w.device)

    def start(self, cache: StaticKVCache, state) -> None:
        """``FeatureHead.start``: nothing to prepare per prompt unless a subclass says so."""

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: StaticKVCache | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """Entries ``(f_{p-1}, x_p)`` at positions p: features (R, T, dim), tokens (R, T), positions
        (R, T). With a cache the entries are appended to it (``tree_mask`` as in
        ``mmspec.core.types.Target``); without one, causal attention over the given entries.

        Returns the predicted features f^_p as ``hidden`` (R, T, dim) and ``logits`` (R, T, V)
        from the target's LM head: the draft distribution of the token at ``p + 1``.
        """
        if cache is None and tree_mask is not None:
            raise ValueError("tree_mask needs a cache: the reference path (cache=None) is causal")
        x = self.fuse(self.embed(tokens), features)  # (R, T, dim)
        step = None if cache is None else cache.step(positions, tree_mask)
        x = self.decoder_layer(x, positions, step)
        return ModelOutput(logits=self.logits(x), hidden=x)
