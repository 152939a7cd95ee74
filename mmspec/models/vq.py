"""A tiny VQ image tokenizer in the style of LlamaGen's VQ-16, small enough to train on a CPU.

Conv encoder (ResNet blocks, GroupNorm, SiLU; each level after the first halves the resolution),
a vector quantizer whose codebook is low-dimensional and l2-normalised at lookup (LlamaGen's
``codebook_l2_norm=True``), and a conv decoder mirroring the encoder. With the default three
levels a 64x64 image becomes a 16x16 grid of ids in ``[0, codebook_size)``.

Differences from LlamaGen's VQ-16, for size: no attention blocks, the encoder's last conv maps
straight to the codebook dimension (no separate ``quant_conv``), and training uses MSE only (no
perceptual or GAN loss).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import nn
from torch.nn import functional as F

from ..core.errors import check, check_int, is_int


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> conv, twice, plus a (1x1 conv when the width changes) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels, eps=1e-6)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, out_channels, eps=1e-6)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.shortcut = nn.Identity() if in_channels == out_channels else nn.Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.shortcut(x) + h


class Encoder(nn.Module):
    """(B, in_channels, H, W) -> (B, embed_dim, H / f, W / f), f = 2 ** (len(channels) - 1)."""

    def __init__(self, in_channels: int, channels: Sequence[int], layers_per_block: int, groups: int,
                 embed_dim: int):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        blocks, width = [], channels[0]
        for level, out in enumerate(channels):
            for _ in range(layers_per_block):
                blocks.append(ResnetBlock(width, out, groups))
                width = out
            if level < len(channels) - 1:
                blocks.append(nn.Conv2d(width, width, 3, stride=2, padding=1))
        blocks.append(ResnetBlock(width, width, groups))  # middle
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = nn.GroupNorm(groups, width, eps=1e-6)
        self.conv_out = nn.Conv2d(width, embed_dim, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(self.blocks(self.conv_in(x)))))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(nn.Module):
    """(B, embed_dim, h, w) -> (B, out_channels, h * f, w * f): the encoder in reverse."""

    def __init__(self, out_channels: int, channels: Sequence[int], layers_per_block: int, groups: int,
                 embed_dim: int):
        super().__init__()
        width = channels[-1]
        self.conv_in = nn.Conv2d(embed_dim, width, 3, padding=1)
        blocks = [ResnetBlock(width, width, groups)]  # middle
        for level in reversed(range(len(channels))):
            for _ in range(layers_per_block):
                blocks.append(ResnetBlock(width, channels[level], groups))
                width = channels[level]
            if level > 0:
                blocks.append(Upsample(width))
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = nn.GroupNorm(groups, width, eps=1e-6)
        self.conv_out = nn.Conv2d(width, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv_out(F.silu(self.norm_out(self.blocks(self.conv_in(z)))))


class VectorQuantizer(nn.Module):
    """Nearest-neighbour lookup in an l2-normalised codebook, with VQ-VAE's codebook and
    commitment losses and the straight-through estimator (as LlamaGen's ``VectorQuantizer`` with
    ``codebook_l2_norm=True``)."""

    def __init__(self, codebook_size: int, embed_dim: int, beta: float):
        super().__init__()
        self.beta = beta
        self.embedding = nn.Embedding(codebook_size, embed_dim)
        nn.init.normal_(self.embedding.weight)  # isotropic: uniform directions on the sphere

    def codebook(self) -> torch.Tensor:
        """The l2-normalised codebook, (K, D)."""
        return F.normalize(self.embedding.weight, dim=-1)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """z (B, D, h, w) -> (z_q (B, D, h, w), ids (B, h, w), {"codebook", "commit"} losses)."""
        B, D, h, w = z.shape
        z = F.normalize(z, dim=1)
        codebook = self.codebook()  # (K, D)
        # on unit vectors |z - e|^2 = 2 - 2 z.e: the nearest code is the most similar one
        ids = (z.permute(0, 2, 3, 1).reshape(-1, D) @ codebook.T).argmax(dim=-1).view(B, h, w)
        z_q = codebook[ids].permute(0, 3, 1, 2)  # (B, D, h, w)
        losses = {
            "codebook": F.mse_loss(z_q, z.detach()),  # moves the codes towards the encoder
            "commit": self.beta * F.mse_loss(z, z_q.detach()),  # keeps the encoder near its codes
        }
        # straight-through: the decoder's gradient w.r.t. z_q is passed to z unchanged
        return z + (z_q - z).detach(), ids, losses


class IdGridMixin:
    """What an image <-> id-grid VQ model shares: ``grid_size`` and the checks of ``encode``'s
    images and ``decode``'s ids (from ``downsample_factor`` and ``config.sample_size`` /
    ``config.in_channels``)."""

    @property
    def grid_size(self) -> int:
        """Side of the id grid of a ``sample_size`` image (16 for TinyVQModel's default 64 px)."""
        return self.config.sample_size // self.downsample_factor

    def _check_images(self, images: torch.Tensor) -> None:
        f, c = self.downsample_factor, self.config.in_channels
        check(images.dim() == 4 and images.shape[1] == c and images.shape[2] % f == 0
              and images.shape[3] % f == 0, "images", f"a (B, {c}, H, W) tensor with H and W multiples of {f}",
              tuple(images.shape))

    @staticmethod
    def _check_ids(ids: torch.Tensor) -> None:
        check(ids.dim() == 3 and not ids.is_floating_point(), "ids", "a (B, h, w) integer tensor",
              f"{tuple(ids.shape)} {ids.dtype}")


class TinyVQModel(IdGridMixin, ModelMixin, ConfigMixin):
    """Image <-> grid of VQ token ids. ``save_pretrained(dir)`` writes ``config.json`` and
    safetensors weights; ``TinyVQModel.from_pretrained(dir, use_safetensors=True)`` reads them
    back from a local folder without the network."""

    @register_to_config
    def __init__(self, in_channels: int = 3, sample_size: int = 64,
                 block_out_channels: Sequence[int] = (16, 32, 64), layers_per_block: int = 1,
                 norm_num_groups: int = 8, codebook_size: int = 512, codebook_embed_dim: int = 8,
                 commit_loss_beta: float = 0.25):
        super().__init__()
        check_int(in_channels, "in_channels", 1)
        check_int(norm_num_groups, "norm_num_groups", 1)
        check(isinstance(block_out_channels, Sequence) and len(block_out_channels) >= 1
              and all(is_int(c) and c >= 1 and c % norm_num_groups == 0 for c in block_out_channels),
              "block_out_channels", f"a non-empty sequence of multiples of norm_num_groups ({norm_num_groups})",
              block_out_channels)
        factor = 2 ** (len(block_out_channels) - 1)
        check(is_int(sample_size) and sample_size >= factor and sample_size % factor == 0, "sample_size",
              f"a positive multiple of the downsampling factor {factor}", sample_size)
        check_int(layers_per_block, "layers_per_block", 1)
        check_int(codebook_size, "codebook_size", 2)
        # a 1-d vector normalises to +-1: the codebook would collapse to two points
        check_int(codebook_embed_dim, "codebook_embed_dim", 2)
        check(isinstance(commit_loss_beta, (int, float)) and commit_loss_beta >= 0, "commit_loss_beta",
              "a number >= 0", commit_loss_beta)
        channels = list(block_out_channels)
        self.encoder = Encoder(in_channels, channels, layers_per_block, norm_num_groups, codebook_embed_dim)
        self.quantizer = VectorQuantizer(codebook_size, codebook_embed_dim, float(commit_loss_beta))
        self.decoder = Decoder(in_channels, channels, layers_per_block, norm_num_groups, codebook_embed_dim)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config.block_out_channels) - 1)

    # codebook, encode and decode read the weights outside forward: under model offload the hook
    # must move the model first
    @apply_forward_hook
    def codebook(self) -> torch.Tensor:
        """The l2-normalised code embeddings the ids index, (K, D)."""
        return self.quantizer.codebook()

    @apply_forward_hook
    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [-1, 1] -> ids (B, H / f, W / f), long."""
        self._check_images(images)
        return self.quantizer(self.encoder(images))[1]

    @apply_forward_hook
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, h, w) -> images (B, C, h * f, w * f), roughly in [-1, 1] (not clamped)."""
        self._check_ids(ids)
        z_q = self.codebook()[ids].permute(0, 3, 1, 2)  # (B, D, h, w)
        return self.decoder(z_q)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Reconstruct ``images`` through the quantizer: ``(recon, losses)`` with losses
        ``recon`` (MSE), ``codebook``, ``commit`` and their sum ``loss``."""
        self._check_images(images)
        z_q, _, losses = self.quantizer(self.encoder(images))
        recon = self.decoder(z_q)
        losses["recon"] = F.mse_loss(recon, images)
        losses["loss"] = losses["recon"] + losses["codebook"] + losses["commit"]
        return recon, losses
