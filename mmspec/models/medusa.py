"""Parallel draft heads for transformers VLM targets: the whole draft tree from one pass.

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): K heads read the target's last feature ``f_t`` (the one whose LM-head output
gave the token at t + 1, the tree's root) and head k predicts the token at t + 2 + k, each through
a residual SiLU block and the target's own LM head (Medusa-1: the target frozen, each block's
weight zero at init so every head starts as the LM head). One pass of all heads costs a few
(R, H) x (H, H) products, against EAGLE's one decoder layer per tree level.

Two inputs Medusa does not have, both zero at init:
- the **root token** (``root_in``: its target embedding, added to the feature). The root is the
  token the target just drew; at temperature > 0 it is often not the argmax the feature points
  at, and every later token depends on it (Hydra, Ankner et al., 2024, makes each head read all
  earlier drafts; this is its first step only, so the heads stay one parallel pass);
- the **image** (``image_in``: the mean of the prompt's image embeddings, the target's projector
  output at the image placeholders, added likewise): ViSpec's global image feature (Kang et al.,
  2025), so the heads see the image directly and not only through the target's feature.

The target's token embedding and LM head are borrowed at ``bind`` (never saved), as for
``mmspec.models.vlm_draft.VLMDraftHead``. The core drives the heads through
``mmspec.core.ParallelHeadsDrafter`` (``ParallelHeads`` protocol).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from torch.nn import functional as F

from ..core.errors import check


class MedusaHeads(ModelMixin, ConfigMixin):
    """K parallel draft heads bound to a ``VLMTarget`` (see the module docstring).

    Build with ``MedusaHeads.from_target(vlm_target)``, or load a trained one with
    ``load_checkpoint(MedusaHeads, path).bind(vlm_target)``.

    Args:
        hidden_size, vocab_size, image_token_id: the target language model's (checked at ``bind``).
        num_heads: K, the tree's depth below the root.
        num_layers: residual SiLU blocks per head (Medusa: 1).
        root_token, image: use the root token / the image (both on by default).
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, hidden_size: int = 192, vocab_size: int = 128, image_token_id: int = 4, num_heads: int = 6,
                 num_layers: int = 1, root_token: bool = True, image: bool = True):
        super().__init__()
        for name, value in dict(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                num_layers=num_layers).items():
            check(isinstance(value, int) and value >= 1, name, "an int >= 1", value)
        H, K = hidden_size, num_heads
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(H, H) for _ in range(num_layers)) for _ in range(K))
        self.root_in = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(K)) if root_token else None
        self.image_in = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(K)) if image else None
        for p in self.parameters():  # Medusa-1: every head starts as the target's LM head
            nn.init.zeros_(p)
        self._bound_to = ()

    # -- binding ---------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, **overrides) -> "MedusaHeads":
        """Fresh heads sized like ``target``'s (a ``VLMTarget``) language model, bound to it."""
        text = target.model.config.text_config
        args = dict(hidden_size=text.hidden_size, vocab_size=text.vocab_size, image_token_id=target.image_token_id)
        return cls(**{**args, **overrides}).bind(target)

    def bind(self, target) -> "MedusaHeads":
        """Use ``target``'s token embedding and LM head (shared, not copied); returns self."""
        text = target.model.config.text_config
        for key, value in dict(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                               image_token_id=target.image_token_id).items():
            check(value == self.config[key], "target", f"a VLM with {key}={self.config[key]} (the heads')", value)
        self._bound_to = (target,)
        return self

    @property
    def target(self):
        if not self._bound_to:
            raise RuntimeError("MedusaHeads is not bound to a target: call heads.bind(vlm_target) first")
        return self._bound_to[0]

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    # -- inputs ----------------------------------------------------------------------------------
    def image_feature(self, tokens: torch.Tensor, embeds: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(R, S) prompt ids, (R, S, H) the target's merged input embeddings, (R,) prompt lengths
        -> (R, H): the mean embedding over each row's image placeholders (zeros without images)."""
        S = embeds.shape[1]
        valid = torch.arange(S, device=tokens.device) < lengths[:, None]
        is_image = ((tokens[:, :S] == self.config.image_token_id) & valid).to(embeds.dtype)
        total = (embeds * is_image[..., None]).sum(1)
        return total / is_image.sum(1, keepdim=True).clamp(min=1)

    def start(self, state) -> torch.Tensor | None:
        """After the target's prompt pass: the image feature of each row (``state.prefill``'s
        ``prompt_embeds``), or None when the heads do not read the image."""
        self.target  # noqa: B018 -- drafting needs the bound target (raises otherwise)
        if self.image_in is None:
            return None
        embeds = state.prefill.prompt_embeds
        check(embeds is not None, "state.prefill", "a VLMTarget's prompt pass output (with prompt_embeds)", None)
        return self.image_feature(state.tokens, embeds, state.prompt_lengths)

    # -- the heads -------------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, root: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """features (..., H) the target's feature before the root, root (...) the root tokens,
        image (..., H) or None -> (..., K, V) logits, head k for the token k + 1 after the root."""
        dtype = self.blocks[0][0].weight.dtype
        f = features.to(dtype)
        e = self.target.model.get_input_embeddings()(root).to(dtype) if self.root_in is not None else None
        outs = []
        for k, layers in enumerate(self.blocks):
            x = f
            if e is not None:
                x = x + self.root_in[k](e)
            if self.image_in is not None and image is not None:
                x = x + self.image_in[k](image.to(dtype))
            for layer in layers:
                x = x + F.silu(layer(x))
            outs.append(x)
        hidden = torch.stack(outs, -2)  # (..., K, H)
        head = self.target.model.lm_head
        return F.linear(hidden.to(head.weight.dtype), head.weight).float()

    def distill_loss(self, features: torch.Tensor, ids: torch.Tensor, embeds: torch.Tensor, logits: torch.Tensor,
                     lengths: torch.Tensor, mask: torch.Tensor, rollout_steps: int = 1, decay: float = 0.8) -> dict:
        """Online-logit distillation on a teacher-forced batch, called as ``VLMDraftHead``'s: at
        every drafted position t (``mask``: the next token is an answer token, so the root t + 1
        is one), head k's cross-entropy to the target's own distribution of the token at
        t + 2 + k (its logits at t + 1 + k, a drafted position too), weighted ``decay ** k``
        (Medusa's 0.8).

        features (R, S, H), ids (R, S), embeds (R, S, H), logits (R, S, V): the frozen target's
        on the batch; lengths (R,) valid tokens (image placeholders are read within them);
        mask (R, S) the drafted positions (``vlm_draft.answer_mask``). The heads read the target's
        features only, so ``rollout_steps`` must be 1. Returns ``loss``, per-head teacher top-1
        agreement ``top1`` (K,) on those positions, their number ``count`` (K,) and head 0's
        agreement as ``step0_top1``."""
        check(rollout_steps == 1, "rollout_steps", "1 (parallel heads read the target's features only)",
              rollout_steps)
        R, S, _ = features.shape
        K = self.num_heads
        image = None
        if self.image_in is not None:
            image = self.image_feature(ids, embeds, lengths)[:, None].expand(-1, S - 1, -1)
        out = self(features[:, :-1], ids[:, 1:], image)  # (R, S-1, K, V): roots at 1 .. S-1
        t = torch.arange(S - 1, device=ids.device)
        total, weight, top1, count = 0.0, 0.0, [], []
        for k in range(K):
            src = t + 1 + k  # the teacher's position for head k's token
            ok = mask[:, :-1] & mask.gather(1, src.clamp(max=S - 1).expand(R, -1)) & (src < S)  # (R, S-1)
            count.append(ok.sum())
            if not ok.any():
                top1.append(torch.tensor(float("nan")))
                continue
            teach = logits[:, src.clamp(max=S - 1)].float().softmax(-1)  # (R, S-1, V)
            logp = out[:, :, k].log_softmax(-1)
            ce = -(teach * logp).sum(-1)
            total = total + decay ** k * (ce * ok).sum() / ok.sum()
            weight += decay ** k
            top1.append(((out[:, :, k].argmax(-1) == teach.argmax(-1)) & ok).sum() / ok.sum())
        top1 = torch.stack([x.detach().float() for x in top1])
        return {"loss": total / max(weight, 1e-12), "top1": top1, "count": torch.stack(count), "step0_top1": top1[0]}
