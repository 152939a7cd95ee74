"""EAGLE's feature draft head for the LlamaGen target (Li et al., 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty").

The head drafts at the feature level, one step ahead of the target: its entry at sequence position
``p`` reads the target's feature at ``p - 1`` together with the token at ``p`` (the token the
feature was sampled into, which resolves the feature's uncertainty) and predicts the target's
feature at ``p``; the target's own LM head turns that into logits for the token at ``p + 1``::

    entry p:  fc([embed(x_p); f_{p-1}]) -> one Llama block (2-D RoPE at p) -> f^_p -> output(f^_p)

*Features* are the LM head's input: the target's final *normed* hidden, which is what
``LlamaGenModel`` returns and what EAGLE uses (HF ``LlamaModel``'s last hidden state is already
normed), so a predicted feature goes straight into the target's ``output`` layer. As in EAGLE, the
head's block has no input norm: ``fc``'s output feeds the attention directly.

The token embedding and the LM head are the target's, borrowed at ``bind`` time and never
registered as the head's modules: a saved head holds only ``fc`` and the block.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from torch.nn import functional as F

from ..core.cache import StaticKVCache
from ..core.errors import check
from ..core.rope import GridRope2D
from ..core.types import ModelOutput
from .llamagen import LlamaGenBlock, LlamaGenModel

# the config keys a head must share with its target
_TARGET_KEYS = ("vocab_size", "grid_size", "dim", "rope_base")


class EagleDraftHead(ModelMixin, ConfigMixin):
    """EAGLE's one-layer feature drafter over a ``LlamaGenModel``'s features.

    Build it with ``EagleDraftHead.from_target(target)`` (the target's width and RoPE, bound to
    it), or load a trained one with ``load_checkpoint(EagleDraftHead, path).bind(target)``.
    ``forward(features, tokens, positions, cache, tree_mask)`` is what
    ``mmspec.core.EagleTreeDrafter`` calls.

    Args:
        vocab_size, grid_size, dim, rope_base: the target's (checked at ``bind``).
        n_heads, mlp_hidden: the block's attention heads and SwiGLU width.
        norm_eps: the block's post-attention RMSNorm epsilon.
        initializer_range: std of the normal init of ``fc`` and the block's linear weights.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, vocab_size: int = 512, grid_size: int = 16, dim: int = 128, n_heads: int = 4,
                 mlp_hidden: int = 344, rope_base: float = 10000.0, norm_eps: float = 1e-5,
                 initializer_range: float = 0.02):
        super().__init__()
        sizes = dict(vocab_size=vocab_size, grid_size=grid_size, dim=dim, n_heads=n_heads, mlp_hidden=mlp_hidden)
        for name, value in sizes.items():
            check(isinstance(value, int) and value >= 1, name, "an int >= 1", value)
        check(dim % n_heads == 0 and (dim // n_heads) % 4 == 0, "n_heads",
              f"a divisor of dim ({dim}) leaving a head dimension that is a multiple of 4", n_heads)
        check(initializer_range >= 0, "initializer_range", ">= 0", initializer_range)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.block = LlamaGenBlock(0, dim, n_heads, mlp_hidden, norm_eps)
        self.block.attention_norm = nn.Identity()  # EAGLE: the first layer's input norm is dropped
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=initializer_range)
        self.rope = GridRope2D(dim // n_heads, grid_size, rope_base)  # the target's 2-D RoPE
        self._bound_to = ()  # (target,): a tuple keeps the target out of the head's modules

    @classmethod
    def from_target(cls, target: LlamaGenModel, **overrides) -> "EagleDraftHead":
        """A fresh head shaped like one of ``target``'s layers (``overrides`` change any argument),
        bound to it."""
        cfg = target.config
        args = dict(vocab_size=cfg.vocab_size, grid_size=cfg.grid_size, dim=cfg.dim, n_heads=cfg.n_heads,
                    mlp_hidden=cfg.mlp_hidden, rope_base=cfg.rope_base, norm_eps=cfg.norm_eps,
                    initializer_range=cfg.initializer_range)
        return cls(**{**args, **overrides}).bind(target)

    def bind(self, target: LlamaGenModel) -> "EagleDraftHead":
        """Use ``target``'s token embedding and LM head (shared, not copied); returns self."""
        for key in _TARGET_KEYS:
            check(target.config[key] == self.config[key], "target",
                  f"a LlamaGenModel with {key}={self.config[key]} (the head's)", target.config[key])
        self._bound_to = (target,)
        return self

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def target(self) -> LlamaGenModel:
        """The bound target, whose embedding and LM head the head uses."""
        if not self._bound_to:
            raise RuntimeError("EagleDraftHead is not bound to a target: call head.bind(target) first")
        return self._bound_to[0]

    def new_cache(self, batch_size: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        p = self.fc.weight
        return StaticKVCache(1, batch_size, cfg.n_heads, cfg.dim // cfg.n_heads, max_len=max_len,
                             rope=self.rope, dtype=p.dtype, device=p.device)

    def start(self, cache: StaticKVCache, state) -> None:
        """``FeatureHead.start``: nothing to prepare per prompt (class labels are tokens)."""

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: StaticKVCache | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """Entries ``(f_{p-1}, x_p)`` at positions p: features (B, T, dim), image tokens (B, T),
        positions (B, T), all >= 1. With a cache the entries are appended to it (``tree_mask`` as in
        ``mmspec.core.types.Target``); without one, causal attention over the given entries.

        Returns the predicted features f^_p as ``hidden`` (B, T, dim) and ``logits`` (B, T, V)
        from the target's LM head: the draft distribution of the token at ``p + 1``.
        """
        target = self.target
        if cache is None and tree_mask is not None:
            raise ValueError("tree_mask needs a cache: the reference path (cache=None) is causal")
        x = torch.cat([target.tok_embeddings(tokens), features.to(self.fc.weight.dtype)], -1)  # (B, T, 2 dim)
        x = self.fc(x)  # (B, T, dim)
        step = None if cache is None else cache.step(positions, tree_mask)
        x = self.block(x, step, self.rope, self.rope.tables(positions) if step is None else None)
        return ModelOutput(logits=target.output(x), hidden=x)

    # -- training -------------------------------------------------------------------------------
    def teacher_forced(self, labels: torch.Tensor, image_ids: torch.Tensor) -> tuple[ModelOutput, ModelOutput]:
        """The target's pass over ``[label, x_0 .. x_{N-2}]`` and the head's pass over its true
        features: ``(head_out, target_out)`` where ``head_out`` (B, N-1, ...) predicts the target's
        features ``target_out.hidden[:, 1:]`` and next-token logits ``target_out.logits[:, 1:]``."""
        N = image_ids.shape[1]
        tokens = torch.cat([labels[:, None], image_ids[:, :-1]], 1)  # (B, N)
        with torch.no_grad():
            target_out = self.target(tokens)
        positions = torch.arange(1, N, device=tokens.device).expand(len(tokens), N - 1)
        return self(target_out.hidden[:, :-1], tokens[:, 1:], positions), target_out

    def loss(self, labels: torch.Tensor, image_ids: torch.Tensor, generator: torch.Generator | None = None,
             cls_weight: float = 0.1) -> torch.Tensor:
        """EAGLE's loss: smooth-L1 regression onto the target's next features plus ``cls_weight``
        times the cross-entropy of the target's LM head on the predicted features against the
        target's own next-token distribution (EAGLE's soft labels), teacher-forced with the
        target's true features. In training mode labels are dropped to the null class with the
        target's ``class_dropout_prob`` first, so the unconditional half of CFG is learned too.

        Gradients reach the head through the target's LM head and embedding: freeze the target
        (``target.requires_grad_(False)``) and give the optimizer ``head.parameters()`` only."""
        if self.training:
            labels = self.target.drop_labels(labels, generator)
        out, ref = self.teacher_forced(labels, image_ids)
        regression = F.smooth_l1_loss(out.hidden.float(), ref.hidden[:, 1:].float())
        p = ref.logits[:, 1:].float().softmax(-1)
        classification = -(p * out.logits.float().log_softmax(-1)).sum(-1).mean()
        return regression + cls_weight * classification

