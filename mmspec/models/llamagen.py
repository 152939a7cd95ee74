"""A LlamaGen-style class-conditional AR image model over VQ token grids (Sun et al., 2024,
"Autoregressive Model Beats Diffusion: Llama for Scalable Image Generation").

The sequence is ``[class, x_0, ..., x_{N-1}]`` with ``N = grid_size**2`` image tokens in raster
order (LlamaGen's c2i layout, ``cls_token_num=1``). Position 0 carries a class id, embedded by the
class table, whose extra row ``num_classes`` is the unconditional (null) class used for CFG;
positions ``1 + i`` carry image token ids. The logit at position p predicts image token p.

The model is directly a core ``Target``: ``new_cache`` and
``forward(tokens, positions, cache, tree_mask) -> ModelOutput(logits, hidden)``; without a cache
``forward`` recomputes full causal attention (the reference path). So class-to-image generation
with guidance is a plain core call::

    SpeculativeDecoder(model, drafter, processor=LogitsProcessor(guidance_scale=4.0)).generate(
        model.class_prompts(labels), model.num_image_tokens,
        uncond_input_ids=model.uncond_prompts(len(labels)))
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from torch.nn import functional as F

from ..core.cache import StaticKVCache
from ..core.errors import check, check_choice, check_int
from ..core.rope import PREFIX_ROPES, GridRope2D, RopeTables, RotaryEmbedding
from ..core.types import ModelOutput


class LlamaGenBlock(nn.Module):
    """Pre-norm Llama block: RMSNorm, attention with RoPE, RMSNorm, SwiGLU; no biases.

    ``forward(x, step, rope, tables)``: with a cache ``step`` the cache rotates q and k (it calls
    ``rope``); without one (the reference path) the block applies the forward's ``tables``."""

    def __init__(self, layer: int, dim: int, n_heads: int, mlp_hidden: int, norm_eps: float):
        super().__init__()
        self.layer, self.n_heads = layer, n_heads
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.w1 = nn.Linear(dim, mlp_hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, mlp_hidden, bias=False)  # up
        self.w2 = nn.Linear(mlp_hidden, dim, bias=False)  # down

    def forward(self, x, step, rope: RotaryEmbedding, tables: RopeTables | None):
        B, T, C = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if step is None:  # reference path: full causal attention over the given tokens
            y = F.scaled_dot_product_attention(rope.apply(q, tables), rope.apply(k, tables), v, is_causal=True)
        else:
            y = step.attend(self.layer, q, k, v)  # the cache's kernels where dispatch picks them
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ClassPromptsMixin:
    """Class conditioning by a class token at position 0, for a model whose config has
    ``num_classes``: id ``num_classes`` is the null (unconditional) class."""

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    def class_prompts(self, labels) -> list[list[int]]:
        """One single-token prompt per label: the class id at position 0."""
        labels = torch.as_tensor(labels).flatten().tolist()
        check(all(0 <= c < self.config.num_classes for c in labels), "labels",
              f"class ids in [0, {self.config.num_classes})", labels)
        return [[c] for c in labels]

    def uncond_prompts(self, batch_size: int) -> list[list[int]]:
        """The unconditional half of a guided batch: the null class for every row."""
        return [[self.null_class]] * batch_size


class LlamaGenModel(ClassPromptsMixin, ModelMixin, ConfigMixin):
    """Class-conditional AR transformer over a ``grid_size x grid_size`` VQ token grid.

    Args:
        vocab_size: VQ codebook size; logits are over it at every position.
        grid_size: tokens per side; an image is ``grid_size**2`` tokens in raster order.
        num_classes: class labels ``0 .. num_classes - 1``; id ``num_classes`` is the null class.
        dim, n_layers, n_heads, mlp_hidden: transformer width, depth, heads, SwiGLU width.
            The head dimension ``dim / n_heads`` must be a multiple of 4 (row and column pairs).
        class_dropout_prob: probability that ``loss`` replaces a label by the null class while
            training, so one model learns both halves of classifier-free guidance.
        rope_base: rotary base of both grid axes.
        norm_eps: RMSNorm epsilon.
        initializer_range: std of the normal init of every linear and embedding weight.
        id2label: ``{"0": "a red circle, red circle", ...}``: each class id's names, comma-separated
            (diffusers' DiT convention); saved with the config so a pipeline maps prompts to ids.
        cls_rope: what the RoPE does to the class token's query and key: ``"identity"`` (no
            rotation) or ``"zero"`` (zeroed, as LlamaGen's released code does;
            ``mmspec.models.llamagen_convert`` sets it for LlamaGen checkpoints).
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, vocab_size: int = 512, grid_size: int = 16, num_classes: int = 16, dim: int = 256,
                 n_layers: int = 4, n_heads: int = 4, mlp_hidden: int = 688, class_dropout_prob: float = 0.1,
                 rope_base: float = 10000.0, norm_eps: float = 1e-5, initializer_range: float = 0.02,
                 id2label: dict[str, str] | None = None, cls_rope: str = "identity"):
        super().__init__()
        sizes = dict(vocab_size=vocab_size, grid_size=grid_size, num_classes=num_classes, dim=dim,
                     n_layers=n_layers, n_heads=n_heads, mlp_hidden=mlp_hidden)
        for name, value in sizes.items():
            check_int(value, name, 1)
        check(dim % n_heads == 0, "n_heads", f"a divisor of dim ({dim})", n_heads)
        check((dim // n_heads) % 4 == 0, "n_heads", f"such that dim / n_heads is a multiple of 4 (dim={dim})",
              n_heads)
        check(0.0 <= class_dropout_prob <= 1.0, "class_dropout_prob", "a float in [0, 1]", class_dropout_prob)
        check(rope_base > 0, "rope_base", "> 0", rope_base)
        check(initializer_range >= 0, "initializer_range", ">= 0", initializer_range)
        check(id2label is None or (isinstance(id2label, dict) and sorted(map(str, id2label)) == sorted(
            str(i) for i in range(num_classes)) and all(isinstance(v, str) and v.strip() for v in id2label.values())),
              "id2label", f"None or a dict of names for every class id '0' .. '{num_classes - 1}'", id2label)
        check_choice("cls_rope", cls_rope, PREFIX_ROPES)
        self.cls_embedding = nn.Embedding(num_classes + 1, dim)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(LlamaGenBlock(i, dim, n_heads, mlp_hidden, norm_eps)
                                    for i in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=initializer_range)
        # the 2-D RoPE, also the caches' ``rope(x (B, H, T, D), positions (B, T))``
        self.rope = GridRope2D(dim // n_heads, grid_size, rope_base, prefix_rope=cls_rope)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_image_tokens(self) -> int:
        return self.config.grid_size ** 2

    # -- conditioning ---------------------------------------------------------------------------
    def embed_classes(self, labels: torch.Tensor) -> torch.Tensor:
        """(B,) class ids (``num_classes`` = null) -> (B, dim) class-token embeddings."""
        return self.cls_embedding(labels)

    def drop_labels(self, labels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Replace each label by the null class with probability ``class_dropout_prob``."""
        u = torch.rand(labels.shape, device=labels.device, generator=generator)
        return torch.where(u < self.config.class_dropout_prob, self.null_class, labels)

    # -- the core's Target protocol -------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> StaticKVCache:
        cfg = self.config
        p = next(self.parameters())
        shape = (cfg.n_layers, batch_size, cfg.n_heads, cfg.dim // cfg.n_heads)
        return StaticKVCache(*shape, max_len=max_len, rope=self.rope, dtype=p.dtype, device=p.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: StaticKVCache | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """Score a block: tokens (B, T) at sequence positions (B, T) (default ``0 .. T-1``).

        Entries at position 0 are class ids, all others image token ids. With a cache the block is
        appended to it (``tree_mask`` as in ``mmspec.core.types.Target``); without one, full causal
        attention over ``tokens``. Returns logits (B, T, vocab_size) and the final normed hidden.
        """
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        if cache is None and tree_mask is not None:
            raise ValueError("tree_mask needs a cache: the reference path (cache=None) is causal")
        is_cls = positions == 0
        x = torch.where(is_cls[..., None], self.embed_classes(torch.where(is_cls, tokens, 0)),
                        self.tok_embeddings(torch.where(is_cls, 0, tokens)))  # (B, T, dim)
        step = None if cache is None else cache.step(positions, tree_mask)
        tables = self.rope.tables(positions) if cache is None else None  # the cache rotates otherwise
        for layer in self.layers:
            x = layer(x, step, self.rope, tables)
        hidden = self.norm(x)
        return ModelOutput(logits=self.output(hidden), hidden=hidden)

    # -- training -------------------------------------------------------------------------------
    def loss(self, labels: torch.Tensor, image_ids: torch.Tensor,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """Next-token cross-entropy of (B, grid_size**2) image tokens given (B,) labels.

        In training mode (``self.train()``) labels are dropped to the null class with probability
        ``class_dropout_prob`` first (LlamaGen's ``LabelEmbedder``); in eval mode they are kept.
        """
        N = self.num_image_tokens
        check(image_ids.dim() == 2 and image_ids.shape[1] == N, "image_ids", f"a (batch, {N}) tensor",
              tuple(image_ids.shape))
        check(labels.shape == image_ids.shape[:1], "labels", f"a ({image_ids.shape[0]},) tensor",
              tuple(labels.shape))
        if self.training:
            labels = self.drop_labels(labels, generator)
        tokens = torch.cat([labels[:, None], image_ids[:, :-1]], 1)  # (B, N): [class, x_0 .. x_{N-2}]
        logits = self(tokens).logits  # (B, N, V): position p predicts x_p
        return F.cross_entropy(logits.flatten(0, 1).float(), image_ids.flatten())
