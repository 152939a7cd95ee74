"""Parallel draft heads: the whole draft tree from one pass. ``MedusaHeads`` for transformers VLM
targets, ``GridMedusaHeads`` for LlamaGen-style AR image targets (below).

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): K heads read the target's last feature ``f_t`` (the one whose LM-head output
gave the token at t + 1, the tree's root) and head k predicts the token at t + 2 + k, each through
a residual SiLU block and the target's own LM head (Medusa-1: the target frozen, each block's
weight zero at init so every head starts as the LM head). One pass of all heads costs a few
(R, H) x (H, H) products, against EAGLE's one decoder layer per tree level.

Two inputs Medusa does not have, both zero at init (``MedusaHeads``; ``GridMedusaHeads`` reads
the root token too, and the grid's neighbours in place of the image):
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

from ..core.errors import check, check_int
from .binding import BoundToTarget


class _ParallelHeads(BoundToTarget, ModelMixin, ConfigMixin):
    """What both head families share: the config file, ``from_target`` (the target's sizes from
    ``_target_config``, then bound to it) and ``num_heads``."""

    config_name = "config.json"
    whose = "the heads'"

    @classmethod
    def from_target(cls, target, **overrides):
        """Fresh heads sized like ``target``'s, stamped with it (``stamp``) and bound to it
        (``overrides`` change any argument)."""
        return cls(**{**cls._target_config(target), **overrides}).stamp(target).bind(target)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads


class MedusaHeads(_ParallelHeads):
    """K parallel draft heads bound to a ``VLMTarget`` (see the module docstring).

    Build with ``MedusaHeads.from_target(vlm_target)``, or load a trained one with
    ``load_checkpoint(MedusaHeads, path).bind(vlm_target)``.

    Args:
        hidden_size, vocab_size, image_token_id: the target language model's (checked at ``bind``).
        num_heads: K, the tree's depth below the root.
        num_layers: residual SiLU blocks per head (Medusa: 1).
        root_token, image: use the root token / the image (both on by default).
    """

    target_kind, bind_hint = "VLM", "vlm_target"

    @register_to_config
    def __init__(self, hidden_size: int = 192, vocab_size: int = 128, image_token_id: int = 4, num_heads: int = 6,
                 num_layers: int = 1, root_token: bool = True, image: bool = True):
        super().__init__()
        for name, value in dict(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                num_layers=num_layers).items():
            check_int(value, name, 1)
        H, K = hidden_size, num_heads
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(H, H) for _ in range(num_layers)) for _ in range(K))
        self.root_in = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(K)) if root_token else None
        self.image_in = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(K)) if image else None
        for p in self.parameters():  # Medusa-1: every head starts as the target's LM head
            nn.init.zeros_(p)
        self._bound_to = ()

    @staticmethod
    def _target_config(target) -> dict:  # a ``VLMTarget``'s language model
        text = target.model.config.text_config
        return dict(hidden_size=text.hidden_size, vocab_size=text.vocab_size, image_token_id=target.image_token_id)

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

    def step_inputs(self, state, started):
        """``ParallelHeads.step_inputs``: the image feature ``start`` returned, every pass."""
        return started

    # -- the heads -------------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, root: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """features (..., H) the target's feature before the root, root (...) the root tokens,
        image (..., H) or None -> (..., K, V) logits, head k for the token k + 1 after the root.

        Without gradients (decoding) all K heads run as batched products over weights stacked
        once (``_stacked``, rebuilt whenever a weight changes); with gradients (training) head by
        head. Both compute the same function (``tests/test_medusa.py`` compares them)."""
        if not torch.is_grad_enabled():
            return self._forward_stacked(features, root, image)
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
        return self._logits(torch.stack(outs, -2))  # (..., K, H) -> (..., K, V)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.target.model.lm_head
        return F.linear(hidden.to(head.weight.dtype), head.weight).float()

    def _stack_key(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.parameters())

    def eager_for(self, *args, **kwargs) -> bool:
        """Whether compiled steps (``SpeculativePipeline.enable_compiled_steps``) run this call
        eagerly: when the stacked weights are missing or stale (a weight moved or changed), so
        the compiled forward reads them as they are."""
        cached = getattr(self, "_stack", None)
        return torch.is_grad_enabled() or cached is None or cached[0] != self._stack_key()

    def _stacked(self) -> dict:
        """The heads' weights stacked per kind: each block layer's (K, H, H) and (K, H), the root's
        and the image's inputs as one (H, K * H) product each."""
        if torch.compiler.is_compiling():  # ``eager_for`` rebuilt them before any compiled call
            return self._stack[1]
        key = self._stack_key()
        cached = getattr(self, "_stack", None)
        if cached is None or cached[0] != key:
            K, H = self.num_heads, self.config.hidden_size
            layers = range(self.config.num_layers)
            wide = (lambda mods: torch.stack([m.weight for m in mods]).permute(2, 0, 1).reshape(H, K * H))
            stack = {"weight": [torch.stack([b[i].weight for b in self.blocks]) for i in layers],
                     "bias": [torch.stack([b[i].bias for b in self.blocks]) for i in layers],
                     "root": None if self.root_in is None else wide(self.root_in),
                     "image": None if self.image_in is None else wide(self.image_in)}
            object.__setattr__(self, "_stack", (key, stack))  # a plain attribute, not a submodule
        return self._stack[1]

    def _apply(self, fn, *args, **kwargs):
        # moved or cast (``.to``, model offload): the stacked copies would stay where they were
        self.__dict__.pop("_stack", None)
        return super()._apply(fn, *args, **kwargs)

    def _forward_stacked(self, features, root, image):
        w = self._stacked()
        K, H = self.num_heads, self.config.hidden_size
        dtype = w["weight"][0].dtype
        lead = features.shape[:-1]
        x = features.to(dtype).reshape(-1, 1, H)
        extra = None
        if w["root"] is not None:
            e = self.target.model.get_input_embeddings()(root).to(dtype).reshape(-1, H)
            extra = e @ w["root"]
        if w["image"] is not None and image is not None:
            g = image.to(dtype).expand(*lead, H).reshape(-1, H) @ w["image"]
            extra = g if extra is None else extra + g
        x = x.expand(-1, K, H) if extra is None else x + extra.view(-1, K, H)
        for weight, bias in zip(w["weight"], w["bias"]):
            x = x + F.silu(_per_head(x, weight) + bias)
        return self._logits(x.view(*lead, K, H))

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


class GridMedusaHeads(_ParallelHeads):
    """K parallel draft heads bound to a ``LlamaGenModel`` (AR images over a VQ token grid).

    Head k reads the target's feature before the root (as ``MedusaHeads``), the root token's
    embedding, and two inputs that only a raster grid has (both zero at init, so every head
    starts as the target's LM head, Medusa-1):

    - the **token one grid row above** the token it predicts (``above_in``): raster index
      ``i - grid_size`` for the token at raster index i, committed whenever ``k < grid_size``;
      in the top row a zero embedding. Images are locally smooth, so the token above is a strong
      guess from the target's causal history (SJD's ``spatial`` initialisation and ZipAR's
      next-set schedule rest on the same locality; the README measures what it adds);
    - the **column** of the token it predicts (``column``, one learned vector per head and
      column): where a raster row wraps, the left neighbour is no neighbour at all.

    The heads' weights are stacked per head (one batched product per block for all K heads).
    The target's token embedding and LM head are borrowed at ``bind``, never saved.

    Args:
        dim, vocab_size, grid_size: the target's (checked at ``bind``).
        num_heads: K, the tree's depth below the root (less than ``grid_size``).
        num_layers: residual SiLU blocks per head (Medusa: 1).
        root_token, spatial: use the root token / the token above and the column.
    """

    target_kind, bind_hint = "LlamaGenModel", "llamagen_model"

    @register_to_config
    def __init__(self, dim: int = 128, vocab_size: int = 512, grid_size: int = 16, num_heads: int = 4,
                 num_layers: int = 1, root_token: bool = True, spatial: bool = True):
        super().__init__()
        for name, value in dict(dim=dim, vocab_size=vocab_size, grid_size=grid_size, num_heads=num_heads,
                                num_layers=num_layers).items():
            check_int(value, name, 1)
        check(num_heads < grid_size, "num_heads", f"an int in [1, {grid_size - 1}] (below the grid's width, so the "
              "token above every drafted one is committed)", num_heads)
        H, K, W = dim, num_heads, grid_size
        self.block_weight = nn.Parameter(torch.zeros(num_layers, K, H, H))  # (out, in) per head, as nn.Linear
        self.block_bias = nn.Parameter(torch.zeros(num_layers, K, H))
        self.root_in = nn.Parameter(torch.zeros(K, H, H)) if root_token else None
        self.above_in = nn.Parameter(torch.zeros(K, H, H)) if spatial else None
        self.column = nn.Parameter(torch.zeros(K, W, H)) if spatial else None
        self._bound_to = ()

    @staticmethod
    def _target_config(target) -> dict:  # a ``LlamaGenModel``
        return {key: target.config[key] for key in ("dim", "vocab_size", "grid_size")}

    # -- inputs ----------------------------------------------------------------------------------
    def spatial_inputs(self, raster: torch.Tensor, image_ids: torch.Tensor) -> dict | None:
        """(R, T) raster index of each root and (R, N') the row's image ids in raster order (every
        one the heads read committed) -> ``above`` (R, T, K): the id one grid row above each of
        the K tokens after the root (-1 in the top row), and their ``column`` (R, T, K); None
        when the heads do not read them."""
        if self.column is None:
            return None
        return self._spatial(raster + 1, image_ids, 0)

    def start(self, state) -> None:
        """``ParallelHeads.start``: nothing per prompt (the spatial inputs change every pass)."""
        self.target  # noqa: B018 -- drafting needs the bound target (raises otherwise)

    def step_inputs(self, state, started) -> dict | None:
        """Per verification: ``spatial_inputs`` of every row's root, read from the decode history
        in place (a row's image tokens start after its prompt, LlamaGen's one class token)."""
        if self.column is None:
            return None
        P = state.prompt_lengths if state.prompt_lengths is not None else torch.ones_like(state.lengths)
        out = self._spatial((state.lengths - P)[:, None], state.tokens, P[:, None, None])
        return {key: value[:, 0] for key, value in out.items()}  # (R, K)

    def _spatial(self, first: torch.Tensor, ids: torch.Tensor, offset) -> dict:
        """``first`` (R, T) the raster index of each head-0 token; ``ids`` (R, S) holds raster index
        r at column ``offset + r`` (an int, or (R, 1, 1) per row) -> ``above`` and ``column`` (R, T, K)."""
        W = self.config.grid_size
        i = first[..., None] + torch.arange(self.num_heads, device=first.device)  # raster index of head k's token
        up = i - W
        cols = (up + offset).clamp(0, ids.shape[1] - 1)
        above = ids.gather(1, cols.flatten(1)).view(up.shape)
        return {"above": torch.where(up >= 0, above, -1), "column": i % W}

    # -- the heads -------------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, root: torch.Tensor, inputs: dict | None = None) -> torch.Tensor:
        """features (..., H) the target's feature before the root, root (...) the root tokens,
        inputs ``step_inputs``' dict (or None) -> (..., K, V) logits, head k for the token k + 1
        after the root."""
        w = self.block_weight
        K, H = self.num_heads, w.shape[-1]
        lead = features.shape[:-1]
        x = features.to(w.dtype).reshape(-1, 1, H)  # (N, 1, H): N = every leading index
        embed = self.target.tok_embeddings
        if self.root_in is not None:  # one product for all heads: (N, H) x (H, K * H)
            e = embed(root).to(w.dtype).reshape(-1, H)
            x = x + (e @ self.root_in.permute(2, 0, 1).reshape(H, K * H)).view(-1, K, H)
        else:
            x = x.expand(-1, K, H)
        if self.column is not None and inputs is not None:
            above = inputs["above"].reshape(-1, K)
            e = embed(above.clamp(min=0)).to(w.dtype) * (above >= 0)[..., None]  # (N, K, H)
            x = x + _per_head(e, self.above_in)
            x = x + self.column[torch.arange(K, device=x.device), inputs["column"].reshape(-1, K)]
        for layer in range(w.shape[0]):
            x = x + F.silu(_per_head(x, w[layer]) + self.block_bias[layer])
        x = x.view(*lead, K, H)
        head = self.target.output
        return F.linear(x.to(head.weight.dtype), head.weight).float()

    # -- training --------------------------------------------------------------------------------
    def loss(self, labels: torch.Tensor, image_ids: torch.Tensor, generator: torch.Generator | None = None,
             decay: float = 0.8) -> dict:
        """Online-logit distillation, teacher-forced: for every root (raster index j of (B, N)
        ``image_ids``, j < N - 1), head k's cross-entropy to the frozen target's own distribution of
        the token at j + 1 + k (while that is in the grid), weighted ``decay ** k`` (Medusa's 0.8).
        In training mode labels are dropped to the null class with the target's
        ``class_dropout_prob`` first, so the unconditional half of CFG is learned too.

        Returns ``loss``, per-head teacher top-1 agreement ``top1`` (K,) and ``count`` (K,)."""
        if self.training:
            labels = self.target.drop_labels(labels, generator)
        B, N = image_ids.shape
        K = self.num_heads
        tokens = torch.cat([labels[:, None], image_ids[:, :-1]], 1)  # (B, N): logits at p give raster p
        with torch.no_grad():
            ref = self.target(tokens)
        j = torch.arange(N - 1, device=image_ids.device)
        out = self(ref.hidden[:, :-1], image_ids[:, :-1], self.spatial_inputs(j.expand(B, -1), image_ids))
        total, weight, top1, count = 0.0, 0.0, [], []
        for k in range(K):
            n = N - 1 - k  # roots whose head-k token is in the grid
            teach = ref.logits[:, 1 + k:].float().softmax(-1)  # (B, n, V)
            logits = out[:, :n, k]
            ce = -(teach * logits.log_softmax(-1)).sum(-1).mean()
            total = total + decay ** k * ce
            weight += decay ** k
            top1.append((logits.argmax(-1) == teach.argmax(-1)).float().mean().detach())
            count.append(torch.tensor(B * n))
        return {"loss": total / weight, "top1": torch.stack(top1), "count": torch.stack(count)}


def _per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, K, H) inputs, (K, G, H) per-head weights (nn.Linear's (out, in)) -> (N, K, G): head k's
    rows times its own matrix, one batched product."""
    return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)
