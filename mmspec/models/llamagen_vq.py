"""LlamaGen's image tokenizer (its ``VQ_8`` / ``VQ_16`` ``VQModel``: a VQGAN in the taming /
MaskGIT shape; Sun et al., 2024, "Autoregressive Model Beats Diffusion") with the parameter names
of its checkpoints, so a released tokenizer loads into mmspec as it is and decodes the ids a
LlamaGen GPT samples.

The network, as LlamaGen's ``tokenizer/tokenizer_image/vq_model.py`` defines it (our own code):
an encoder of ``conv_in``, one level per ``encoder_ch_mult`` entry (``num_res_blocks`` residual
blocks, self-attention after each block of the last level, a stride-2 downsampling conv with
(0, 1, 0, 1) padding between levels), a middle (residual block, attention, residual block),
GroupNorm(32, eps 1e-6), SiLU and ``conv_out`` to ``z_channels``; ``quant_conv`` to the
``codebook_embed_dim``-channel code space; a codebook looked up by cosine similarity when
``codebook_l2_norm`` (entries and encodings l2-normalised, LlamaGen's default); then
``post_quant_conv`` and the mirrored decoder (``num_res_blocks + 1`` blocks per level, nearest
upsampling and a conv between levels). ``LlamaGenVQModel`` keeps the interface of
``TinyVQModel`` (``encode`` images to ids, ``decode`` ids to images, ``codebook``,
``grid_size``), so ``SpeculativeARImagePipeline`` takes it as its ``vqvae``.

``load_llamagen_vq`` builds one from a checkpoint's state dict (a ``.safetensors`` file or an
in-memory dict, optionally under ``"model"`` as LlamaGen saves them; read as ``load_llamagen_gpt``
reads GPT checkpoints), refusing a missing,
unexpected or misshapen key in one line that names it. The released files are PyTorch pickles
(``vq_ds16_c2i.pt``); mmspec loads weights with safetensors only, so convert once, outside
mmspec, in a session that trusts the file::

    import torch
    from safetensors.torch import save_file
    sd = torch.load("vq_ds16_c2i.pt", map_location="cpu", weights_only=True)["model"]
    save_file({k: v.contiguous() for k, v in sd.items()}, "vq_ds16_c2i.safetensors")

    from mmspec.models.llamagen_vq import load_llamagen_vq
    vq = load_llamagen_vq("vq_ds16_c2i.safetensors", config="VQ-16", sample_size=256)
    images = vq.decode(ids)  # ids (B, 16, 16) from a LlamaGen GPT
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import nn
from torch.nn import functional as F

from ..core.errors import check, check_choice, check_int, is_int
from .llamagen_convert import read_checkpoint, unwrap_state_dict
from .vq import IdGridMixin

__all__ = ["LLAMAGEN_VQ_CONFIGS", "LlamaGenVQModel", "load_llamagen_vq"]

# LlamaGen's named tokenizers (``VQ_8``, ``VQ_16``): channel multipliers of the encoder and decoder
LLAMAGEN_VQ_CONFIGS = {
    "VQ-8": dict(encoder_ch_mult=[1, 2, 2, 4], decoder_ch_mult=[1, 2, 2, 4]),
    "VQ-16": dict(encoder_ch_mult=[1, 1, 2, 2, 4], decoder_ch_mult=[1, 1, 2, 2, 4]),
}


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class _ResBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, twice; a 1x1 ``nin_shortcut`` when the width changes."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = _norm(c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x):
        h = self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class _AttnBlock(nn.Module):
    """Single-head self-attention over the h * w positions, 1x1 convs for q, k, v and the output."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = _norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (m(h).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))  # (B, HW, C)
        y = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(C)) v
        return x + self.proj_out(y.transpose(1, 2).reshape(B, C, H, W))


class _Resample(nn.Module):
    """Stride-2 conv after (0, 1, 0, 1) zero padding (down), or nearest x2 then a conv (up)."""

    def __init__(self, c: int, down: bool):
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(c, c, 3, stride=2 if down else 1, padding=0 if down else 1)

    def forward(self, x):
        if self.down:
            return self.conv(F.pad(x, (0, 1, 0, 1)))
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _level(c_in: int, c_out: int, blocks: int, attention: bool, resample: bool | None) -> nn.Module:
    """One resolution level: ``res`` blocks, ``attn`` after each when ``attention``, and a
    ``downsample`` (resample True) or ``upsample`` (False) conv (None: neither)."""
    level = nn.Module()
    level.res = nn.ModuleList(_ResBlock(c_in if i == 0 else c_out, c_out) for i in range(blocks))
    level.attn = nn.ModuleList(_AttnBlock(c_out) for _ in range(blocks if attention else 0))
    if resample is True:
        level.downsample = _Resample(c_out, down=True)
    elif resample is False:
        level.upsample = _Resample(c_out, down=False)
    return level


def _run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for i, block in enumerate(level.res):
        h = block(h)
        if len(level.attn):
            h = level.attn[i](h)
    for name in ("downsample", "upsample"):
        if hasattr(level, name):
            h = getattr(level, name)(h)
    return h


def _mid(c: int) -> nn.ModuleList:
    return nn.ModuleList([_ResBlock(c, c), _AttnBlock(c), _ResBlock(c, c)])


class _Encoder(nn.Module):
    def __init__(self, in_channels: int, ch: int, ch_mult: Sequence[int], blocks: int, z_channels: int):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        widths = [ch] + [ch * m for m in ch_mult]
        last = len(ch_mult) - 1
        self.conv_blocks = nn.ModuleList(
            _level(widths[i], widths[i + 1], blocks, attention=i == last, resample=True if i != last else None)
            for i in range(len(ch_mult)))
        self.mid = _mid(widths[-1])
        self.norm_out = _norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = _run_level(level, h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class _Decoder(nn.Module):
    def __init__(self, out_channels: int, ch: int, ch_mult: Sequence[int], blocks: int, z_channels: int):
        super().__init__()
        n = len(ch_mult)
        top = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, top, 3, padding=1)
        self.mid = _mid(top)
        levels, c_in = [], top
        for i in reversed(range(n)):  # the deepest level first, as LlamaGen builds them
            c_out = ch * ch_mult[i]
            levels.append(_level(c_in, c_out, blocks + 1, attention=i == n - 1, resample=False if i != 0 else None))
            c_in = c_out
        self.conv_blocks = nn.ModuleList(levels)
        self.norm_out = _norm(c_in)
        self.conv_out = nn.Conv2d(c_in, out_channels, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = _run_level(level, h)
        return self.conv_out(F.silu(self.norm_out(h)))


class _Quantizer(nn.Module):
    def __init__(self, codebook_size: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(codebook_size, embed_dim)


class LlamaGenVQModel(IdGridMixin, ModelMixin, ConfigMixin):
    """LlamaGen's VQ tokenizer with its checkpoints' parameter names (module docstring).

    Args:
        codebook_size, codebook_embed_dim: K codes of D channels (LlamaGen: 16384, 8).
        codebook_l2_norm: look codes up by cosine similarity on l2-normalised entries (LlamaGen's
            default, True) or by Euclidean distance on the raw entries.
        encoder_ch_mult, decoder_ch_mult: width multipliers per level (``LLAMAGEN_VQ_CONFIGS``).
        z_channels: the encoder's output width (256).
        ch: the base width (128); every width must be a multiple of 32 (GroupNorm's groups).
        num_res_blocks: residual blocks per encoder level (the decoder has one more).
        in_channels: image channels.
        sample_size: the image side the pipeline generates (a multiple of the downsampling factor).
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, codebook_size: int = 16384, codebook_embed_dim: int = 8, codebook_l2_norm: bool = True,
                 encoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4), decoder_ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
                 z_channels: int = 256, ch: int = 128, num_res_blocks: int = 2, in_channels: int = 3,
                 sample_size: int = 256):
        super().__init__()
        for name, value in (("codebook_size", codebook_size), ("codebook_embed_dim", codebook_embed_dim),
                            ("z_channels", z_channels), ("ch", ch), ("num_res_blocks", num_res_blocks),
                            ("in_channels", in_channels), ("sample_size", sample_size)):
            check_int(value, name, 1)
        for name, mult in (("encoder_ch_mult", encoder_ch_mult), ("decoder_ch_mult", decoder_ch_mult)):
            check(isinstance(mult, Sequence) and len(mult) >= 1 and all(
                is_int(m) and m >= 1 and (ch * m) % 32 == 0 for m in mult), name,
                  f"a non-empty list of ints m >= 1 with ch * m a multiple of 32 (ch = {ch})", mult)
        check(len(encoder_ch_mult) == len(decoder_ch_mult), "decoder_ch_mult",
              f"as many levels as encoder_ch_mult ({len(encoder_ch_mult)})", decoder_ch_mult)
        factor = 2 ** (len(encoder_ch_mult) - 1)
        check(sample_size % factor == 0, "sample_size", f"a multiple of the downsampling factor {factor}", sample_size)
        self.encoder = _Encoder(in_channels, ch, list(encoder_ch_mult), num_res_blocks, z_channels)
        self.decoder = _Decoder(in_channels, ch, list(decoder_ch_mult), num_res_blocks, z_channels)
        self.quantize = _Quantizer(codebook_size, codebook_embed_dim)
        self.quant_conv = nn.Conv2d(z_channels, codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(codebook_embed_dim, z_channels, 1)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.encoder_ch_mult) - 1)

    @apply_forward_hook
    def codebook(self) -> torch.Tensor:
        """The code embeddings the ids index, (K, D): l2-normalised when ``codebook_l2_norm``."""
        w = self.quantize.embedding.weight
        return F.normalize(w, dim=-1) if self.config.codebook_l2_norm else w

    @apply_forward_hook
    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [-1, 1] -> ids (B, H / f, W / f), long: the nearest code of each
        encoding (cosine similarity on unit vectors when ``codebook_l2_norm``)."""
        self._check_images(images)
        z = self.quant_conv(self.encoder(images))  # (B, D, h, w)
        B, D, h, w = z.shape
        z = z.permute(0, 2, 3, 1).reshape(-1, D)
        codebook = self.codebook()
        if self.config.codebook_l2_norm:  # on unit vectors |z - e|^2 = 2 - 2 z.e
            ids = (F.normalize(z, dim=-1) @ codebook.T).argmax(-1)
        else:
            ids = torch.cdist(z, codebook).argmin(-1)
        return ids.view(B, h, w)

    @apply_forward_hook
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, h, w) -> images (B, C, h * f, w * f), roughly in [-1, 1] (not clamped)."""
        self._check_ids(ids)
        z_q = self.codebook()[ids].permute(0, 3, 1, 2)  # (B, D, h, w)
        return self.decoder(self.post_quant_conv(z_q))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``decode(encode(images))``."""
        return self.decode(self.encode(images))


# checkpoint keys the model does not hold: LlamaGen's codebook-usage statistics (training only)
_IGNORED = ("quantize.codebook_used",)


def load_llamagen_vq(checkpoint, *, config: str | Mapping = "VQ-16", codebook_size: int | None = None,
                     sample_size: int = 256, **overrides) -> LlamaGenVQModel:
    """A ``LlamaGenVQModel`` from a LlamaGen VQ checkpoint.

    Args:
        checkpoint: a path to a ``.safetensors`` file, or a state dict (optionally under ``"model"``).
        config: ``"VQ-8"``, ``"VQ-16"`` or a dict of ``LlamaGenVQModel`` arguments.
        codebook_size: K (default: read from ``quantize.embedding.weight``); codebook_embed_dim
            likewise, and z_channels and ch from the encoder's convs.
        sample_size: the generated image side (256 for LlamaGen's 256 px models).
        overrides: further ``LlamaGenVQModel`` arguments.

    Every model parameter must be in the checkpoint with the model's shape, and the checkpoint
    may hold nothing else (but LlamaGen's ``quantize.codebook_used`` usage buffer): otherwise a
    ``ValueError`` names the first offending key."""
    state = dict(unwrap_state_dict(read_checkpoint(checkpoint))[0])
    if isinstance(config, str):
        check_choice("config", config, LLAMAGEN_VQ_CONFIGS)
        args = dict(LLAMAGEN_VQ_CONFIGS[config])
    else:
        check(isinstance(config, Mapping), "config", f"one of {', '.join(LLAMAGEN_VQ_CONFIGS)} or a dict", config)
        args = dict(config)
    for key in ("quantize.embedding.weight", "quant_conv.weight", "encoder.conv_in.weight"):
        check(key in state, "checkpoint", f"a LlamaGen VQ state dict (it has no '{key}')", sorted(state)[:3])
    K, D = state["quantize.embedding.weight"].shape
    args.setdefault("codebook_size", codebook_size or K)
    args.setdefault("codebook_embed_dim", D)
    args.setdefault("z_channels", state["quant_conv.weight"].shape[1])
    args.setdefault("ch", state["encoder.conv_in.weight"].shape[0])
    model = LlamaGenVQModel(**{**args, "sample_size": sample_size, **overrides})
    expected = model.state_dict()
    for key, value in expected.items():
        check(key in state, "checkpoint", f"a state dict with '{key}' (this config's parameters)", "missing")
        check(tuple(state[key].shape) == tuple(value.shape), "checkpoint",
              f"'{key}' of shape {tuple(value.shape)} (config {args})", tuple(state[key].shape))
    extra = [k for k in state if k not in expected and k not in _IGNORED]
    check(not extra, "checkpoint", "no keys beyond this config's parameters", f"unexpected '{extra[0]}'"
          if extra else None)
    model.load_state_dict({k: state[k].to(torch.float32) for k in expected})
    return model.eval()
