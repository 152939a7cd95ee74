"""A causal continuous-token AR image model: LlamaGen's layout with a linear token input and MAR-style
per-token heads (Sun et al., 2024, "Autoregressive Model Beats Diffusion"; Li et al., 2024,
"Autoregressive Image Generation without Vector Quantization"; Tschannen et al., 2024, "GIVT").

The sequence is ``[class, x_0, ..., x_{N-1}]`` with ``N = grid_size**2`` tokens in raster order.
Position 0 carries a class id (the extra class ``num_classes`` is the null class of CFG, and
``class_dropout_prob`` drops labels to it while training); positions ``1 + i`` carry tokens of
shape ``(2, token_dim)``: row 0 the state the backbone reads (through ``Linear(token_dim, dim)``),
row 1 the latent (see ``mmspec.models.continuous_heads`` for why the two differ). Every position
also adds a second embedding of its row's class (``class_in``, DiT-style conditioning of every
token): read through attention to position 0 alone, the class went almost unlearnt (a
3,000-step target scored 256 held-out images 0.5 nats per image better under their true class
than under the next one; with ``class_in`` (then normally initialised) at the same 3,000 steps,
3.25 nats; the bundled 9,000-step target, 28.2; README, "Continuous-token image generation"). A cached
decode remembers each row's class from its prompt pass (``ClassKVCache``). The feature z
at position p (``ModelOutput.cond``) conditions token p; two heads read it: ``"mixture"``
(``GaussianMixtureHead``, exact densities) and ``"diffusion"`` (``DiffusionHead``, MAR's).

The model is a core ``Target`` for continuous tokens (``token_shape``, ``token_dtype``,
``new_cache``, ``forward``), so class-to-image generation is a plain core call::

    SpeculativeDecoder(model, drafter, processor=DensityProcessor(guidance_scale=2.0, head="mixture")).generate(
        model.class_prompts(labels), model.num_image_tokens, uncond_input_ids=model.uncond_prompts(len(labels)))

whose ``sequences[..., 1, :]`` are the (B, N, token_dim) latents in raster order.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..core.cache import StaticKVCache
from ..core.errors import check, check_int
from ..core.rope import GridRope2D
from ..core.types import ModelOutput
from .continuous_heads import DiffusionHead, GaussianMixtureHead
from .llamagen import ClassPromptsMixin, LlamaGenBlock

__all__ = ["ClassKVCache", "ContinuousARModel"]


class ClassKVCache(StaticKVCache):
    """A ``StaticKVCache`` that also keeps each row's class id (``labels``, (B,) long): None until
    the prompt pass (the cache's first, which holds every row's position 0) sets it; the passes
    after it read it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.labels: torch.Tensor | None = None

    def reset(self) -> None:
        super().reset()
        self.labels = None


class ContinuousARModel(ClassPromptsMixin, ModelMixin, ConfigMixin):
    """Class-conditional causal AR transformer over a grid of continuous tokens, with a
    Gaussian-mixture head and a diffusion head on its features.

    Args:
        token_dim: d, the latent channels of one token.
        grid_size: tokens per side; an image is ``grid_size**2`` tokens in raster order.
        num_classes: class labels ``0 .. num_classes - 1``; id ``num_classes`` is the null class.
        dim, n_layers, n_heads, mlp_hidden: transformer width, depth, heads, SwiGLU width (the
            head dimension ``dim / n_heads`` must be a multiple of 4).
        class_dropout_prob: probability that ``loss`` replaces a label by the null class in training.
        rope_base, norm_eps, initializer_range: 2-D RoPE base, RMSNorm epsilon, normal init std of the
            backbone's matrices.
        mixture_components, mixture_hidden, mixture_sigma_min: the mixture head's M, MLP width and
            std floor (latent units).
        diffusion_width, diffusion_blocks, diffusion_learn_sigma: the diffusion head's
            ``SimpleMLPAdaLN`` width, residual blocks and learned-range variance.
        diffusion_train_steps, diffusion_sampling_steps, diffusion_timesteps: its cosine schedule's
            steps, the K sampling steps (IDDPM respacing) or explicit ascending original steps.
        id2label: ``{"0": "a red circle, ...", ...}``: each class id's names (saved with the config).
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, token_dim: int = 16, grid_size: int = 8, num_classes: int = 16, dim: int = 128,
                 n_layers: int = 4, n_heads: int = 4, mlp_hidden: int = 344, class_dropout_prob: float = 0.1,
                 rope_base: float = 10000.0, norm_eps: float = 1e-5, initializer_range: float = 0.02,
                 mixture_components: int = 16, mixture_hidden: int = 128, mixture_sigma_min: float = 1e-2,
                 diffusion_width: int = 128, diffusion_blocks: int = 3, diffusion_learn_sigma: bool = True,
                 diffusion_train_steps: int = 1000, diffusion_sampling_steps: int = 20,
                 diffusion_timesteps: list[int] | None = None, id2label: dict[str, str] | None = None):
        super().__init__()
        sizes = dict(token_dim=token_dim, grid_size=grid_size, num_classes=num_classes, dim=dim, n_layers=n_layers,
                     n_heads=n_heads, mlp_hidden=mlp_hidden)
        for name, value in sizes.items():
            check_int(value, name, 1)
        check(dim % n_heads == 0 and (dim // n_heads) % 4 == 0, "n_heads",
              f"a divisor of dim ({dim}) leaving a head dimension that is a multiple of 4", n_heads)
        check(0.0 <= class_dropout_prob <= 1.0, "class_dropout_prob", "a float in [0, 1]", class_dropout_prob)
        check(id2label is None or (isinstance(id2label, dict) and sorted(map(str, id2label)) == sorted(
            str(i) for i in range(num_classes))), "id2label",
              f"None or a dict of names for every class id '0' .. '{num_classes - 1}'", id2label)
        self.cls_embedding = nn.Embedding(num_classes + 1, dim)
        self.token_in = nn.Linear(token_dim, dim)
        self.layers = nn.ModuleList(LlamaGenBlock(i, dim, n_heads, mlp_hidden, norm_eps) for i in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=initializer_range)
        self.heads = nn.ModuleDict({
            "mixture": GaussianMixtureHead(dim, token_dim, mixture_components, mixture_hidden, mixture_sigma_min),
            "diffusion": DiffusionHead(token_dim, dim, diffusion_width, diffusion_blocks, diffusion_learn_sigma,
                                       diffusion_train_steps, diffusion_sampling_steps, diffusion_timesteps),
        })
        # the class at every position, zero at init (DiT's adaLN-zero idea): a fresh model scores as
        # without it, and the random draws of the other weights' init are unchanged
        self.class_in = nn.Embedding(num_classes + 1, dim)
        nn.init.zeros_(self.class_in.weight)
        # one backbone serves both heads: the mixture draws states with the diffusion chain's kernel
        self.heads["mixture"].state_kernel = self.heads["diffusion"].state_kernel
        self.rope = GridRope2D(dim // n_heads, grid_size, rope_base)

    # -- what the core reads ----------------------------------------------------------------------
    vocab_size = None  # continuous tokens: no vocabulary

    @property
    def token_shape(self) -> tuple[int, int]:
        return (2, self.config.token_dim)

    @property
    def token_dtype(self) -> torch.dtype:
        return self.token_in.weight.dtype

    @property
    def num_image_tokens(self) -> int:
        return self.config.grid_size ** 2

    @property
    def state_kernel(self) -> tuple[float, float]:
        """(a, b): training feeds the backbone ``a x_0 + b eps`` for each latent x_0."""
        return self.heads["diffusion"].state_kernel

    # -- conditioning ---------------------------------------------------------------------------
    def drop_labels(self, labels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Replace each label by the null class with probability ``class_dropout_prob``."""
        u = torch.rand(labels.shape, generator=generator).to(labels.device)
        return torch.where(u < self.config.class_dropout_prob, self.null_class, labels)

    # -- the core's Target protocol -------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> ClassKVCache:
        cfg = self.config
        p = self.token_in.weight
        return ClassKVCache(cfg.n_layers, batch_size, cfg.n_heads, cfg.dim // cfg.n_heads, max_len=max_len,
                            rope=self.rope, dtype=p.dtype, device=p.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: StaticKVCache | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """Score a block: tokens (B, T, 2, d) at positions (B, T) (default ``0 .. T-1``).

        Position 0 reads a class id from ``tokens[..., 0, 0]`` (the decoder broadcasts prompt ids
        over the token shape), the others the state row. Returns ``cond`` (B, T, dim), the
        features of the token after each position (also ``hidden``), and the heads. Every row's
        class embedding (``class_in``) is added at every position: from position 0 of this block,
        or, in a cached pass, from the cache (``ClassKVCache``, set by the row's prompt pass)."""
        check(tokens.dim() == 4 and tuple(tokens.shape[2:]) == self.token_shape, "tokens",
              f"a (batch, length, 2, {self.config.token_dim}) tensor", tuple(tokens.shape))
        B, T = tokens.shape[:2]
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        if cache is None and tree_mask is not None:
            raise ValueError("tree_mask needs a cache: the reference path (cache=None) is causal")
        is_cls = positions == 0
        cls_ids = torch.where(is_cls, tokens[..., 0, 0].round().long(), 0)
        x = torch.where(is_cls[..., None], self.cls_embedding(cls_ids),
                        self.token_in(tokens[..., 0, :].to(self.token_dtype)))  # (B, T, dim)
        if cache is not None:
            check(isinstance(cache, ClassKVCache), "cache", "a ClassKVCache (ContinuousARModel.new_cache)",
                  type(cache).__name__)
        if cache is None or cache.labels is None:  # a block that starts every row: its class is at position 0
            # checked eagerly (a compiled step's graph cannot branch on a value it computes)
            if not torch.compiler.is_compiling() and not bool(is_cls.any(1).all()):
                raise ValueError("the first pass needs position 0 (the class) in every row"
                                 + ("" if cache is None else ": a cached pass came before the prompt pass"))
            row_cls = cls_ids.gather(1, is_cls.long().argmax(1, keepdim=True))[:, 0]  # (B,)
            if cache is not None:
                cache.labels = row_cls
        else:  # later cached passes: no host sync, the class from the prompt pass
            row_cls = cache.labels
        x = x + self.class_in(row_cls)[:, None]
        step = None if cache is None else cache.step(positions, tree_mask)
        tables = self.rope.tables(positions) if cache is None else None
        for layer in self.layers:
            x = layer(x, step, self.rope, tables)
        z = self.norm(x)
        return ModelOutput(logits=None, hidden=z, cond=z, heads=self.heads)

    # -- training -------------------------------------------------------------------------------
    def tokens_from_latents(self, labels: torch.Tensor, latents: torch.Tensor,
                            generator: torch.Generator | None = None, input_noise: float = 0.0) -> torch.Tensor:
        """Teacher-forcing input (B, N, 2, d): ``[class, x_0 .. x_{N-2}]`` with states drawn from
        the kernel ``a x + b eps`` (what sampling feeds back); ``input_noise`` > 0 (training only)
        widens the state noise to ``sqrt(b^2 + input_noise^2)``, so the backbone learns to read
        its own imperfect samples rather than copy an exact left neighbour."""
        a, b = self.state_kernel
        noise = torch.randn(latents.shape, generator=generator).to(latents.device, latents.dtype)
        states = a * latents + (b * b + input_noise * input_noise) ** 0.5 * noise
        tok = torch.stack([states, latents], -2)  # (B, N, 2, d)
        cls = labels.to(tok.dtype)[:, None, None, None].expand(-1, 1, 2, tok.shape[-1])
        return torch.cat([cls, tok[:, :-1]], 1)

    def loss(self, labels: torch.Tensor, latents: torch.Tensor, generator: torch.Generator | None = None,
             diffusion_positions: int = 64, input_noise: float = 0.0) -> dict[str, torch.Tensor]:
        """Training losses of (B, N, d) latents given (B,) labels: ``"mixture"`` (mean NLL per
        token, nats), ``"diffusion"`` (the head's hybrid loss on ``diffusion_positions`` random
        positions per image, MAR's subsampled rows) and their sum ``"loss"``. In training mode
        labels are dropped to the null class with ``class_dropout_prob`` first."""
        N, d = self.num_image_tokens, self.config.token_dim
        check(latents.dim() == 3 and latents.shape[1:] == (N, d), "latents", f"a (batch, {N}, {d}) tensor",
              tuple(latents.shape))
        check(labels.shape == latents.shape[:1], "labels", f"a ({latents.shape[0]},) tensor", tuple(labels.shape))
        if self.training:
            labels = self.drop_labels(labels, generator)
        z = self(self.tokens_from_latents(labels, latents, generator, input_noise)).cond  # (B, N, dim)
        mixture = self.heads["mixture"].nll(z, latents).mean()
        B = latents.shape[0]
        k = min(diffusion_positions, N)
        pos = torch.rand(B, N, generator=generator).argsort(1)[:, :k].to(latents.device)  # (B, k)
        zk = z.gather(1, pos[..., None].expand(-1, -1, z.shape[-1])).flatten(0, 1)
        xk = latents.gather(1, pos[..., None].expand(-1, -1, d)).flatten(0, 1)
        diffusion = self.heads["diffusion"].loss(zk, xk, generator).mean()
        return {"mixture": mixture, "diffusion": diffusion, "loss": mixture + diffusion}
