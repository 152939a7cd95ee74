"""EAGLE's feature draft head for the LlamaGen target (Li et al., 2024, "EAGLE: Speculative
Sampling Requires Rethinking Feature Uncertainty"); the structure shared with the VLM heads is
``mmspec.models.eagle_base.EagleHead``::

    entry p:  fc([embed(x_p); f_{p-1}]) -> one Llama block (2-D RoPE at p) -> f^_p -> output(f^_p)

The token at ``p`` is the one the feature at ``p - 1`` was sampled into, which resolves the
feature's uncertainty. *Features* are the LM head's input: the target's final *normed* hidden,
which is what ``LlamaGenModel`` returns and what EAGLE uses (HF ``LlamaModel``'s last hidden state
is already normed), so a predicted feature goes straight into the target's ``output`` layer. As in
EAGLE, the head's block has no input norm: ``fc``'s output feeds the attention directly.

The token embedding and the LM head are the target's, borrowed at ``bind`` time and never
registered as the head's modules: a saved head holds only ``fc`` and the block.
"""

from __future__ import annotations

import torch
from diffusers import ModelMixin  # noqa: F401  (diffusers finds a component's loader by base-class name here)
from diffusers.configuration_utils import register_to_config
from torch.nn import functional as F

from ..core.errors import check, check_int
from ..core.rope import GridRope2D
from ..core.types import ModelOutput
from .eagle_base import EagleHead
from .llamagen import LlamaGenModel

# the config keys a head must share with its target
_TARGET_KEYS = ("vocab_size", "grid_size", "dim", "rope_base")


class EagleDraftHead(EagleHead):
    """EAGLE's one-layer feature drafter over a ``LlamaGenModel``'s features.

    Build it with ``EagleDraftHead.from_target(target)`` (the target's width and RoPE, bound to
    it), or load a trained one with ``load_checkpoint(EagleDraftHead, path).bind(target)``.
    ``forward(features, tokens, positions, cache, tree_mask)`` (``EagleHead.forward``; positions
    >= 1, image tokens) is what ``mmspec.core.EagleTreeDrafter`` calls.

    Args:
        vocab_size, grid_size, dim, rope_base: the target's (checked at ``bind``).
        n_heads, mlp_hidden: the block's attention heads and SwiGLU width.
        norm_eps: the block's post-attention RMSNorm epsilon.
        initializer_range: std of the normal init of ``fc`` and the block's linear weights.
    """

    target_kind = "LlamaGenModel"

    @register_to_config
    def __init__(self, vocab_size: int = 512, grid_size: int = 16, dim: int = 128, n_heads: int = 4,
                 mlp_hidden: int = 344, rope_base: float = 10000.0, norm_eps: float = 1e-5,
                 initializer_range: float = 0.02):
        sizes = dict(vocab_size=vocab_size, grid_size=grid_size, dim=dim, n_heads=n_heads, mlp_hidden=mlp_hidden)
        for name, value in sizes.items():
            check_int(value, name, 1)
        check(dim % n_heads == 0 and (dim // n_heads) % 4 == 0, "n_heads",
              f"a divisor of dim ({dim}) leaving a head dimension that is a multiple of 4", n_heads)
        check(initializer_range >= 0, "initializer_range", ">= 0", initializer_range)
        super().__init__(dim, n_heads, mlp_hidden, norm_eps, GridRope2D(dim // n_heads, grid_size, rope_base),
                         input_norm=False, initializer_range=initializer_range)

    @classmethod
    def from_target(cls, target: LlamaGenModel, **overrides) -> "EagleDraftHead":
        """A fresh head shaped like one of ``target``'s layers (``overrides`` change any argument),
        stamped with it (``stamp``) and bound to it."""
        cfg = target.config
        args = dict(vocab_size=cfg.vocab_size, grid_size=cfg.grid_size, dim=cfg.dim, n_heads=cfg.n_heads,
                    mlp_hidden=cfg.mlp_hidden, rope_base=cfg.rope_base, norm_eps=cfg.norm_eps,
                    initializer_range=cfg.initializer_range)
        return cls(**{**args, **overrides}).stamp(target).bind(target)

    def _target_config(self, target: LlamaGenModel) -> dict:
        return {key: target.config[key] for key in _TARGET_KEYS}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.tok_embeddings(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.output(hidden)

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

