"""A tiny convolutional autoencoder for video frames: the latent space of the streaming video model.

Frames (N, 3, H, W) in [-1, 1] map to latents (N, C, H/f, W/f) with ``f = 2 ** len(channels)``
and back, one frame at a time (no temporal compression, so a stream decodes frame by frame with
no decoder state). ``encode`` returns *normalized* latents, ``(z - latent_mean) / latent_std``
per channel, the statistics measured on training frames after training and stored as buffers
(the role of Stable Diffusion's ``scaling_factor``): a diffusion model over them sees
unit-variance data. ``decode`` takes normalized latents.

Training (``loss``) is a plain reconstruction loss with two regularisers that keep the latent
space friendly to a diffusion model: a small L2 penalty on the latents (no drift to large
values) and Gaussian noise added to them before decoding (the decoder tolerates the small errors
of generated latents).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import nn
from torch.nn import functional as F

from ..core.errors import check, is_int


class ResBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, twice, plus a (1x1 when the width changes) skip."""

    def __init__(self, c_in: int, c_out: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Identity() if c_in == c_out else nn.Conv2d(c_in, c_out, 1)

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class FrameAutoencoder(ModelMixin, ConfigMixin):
    """Per-frame conv autoencoder.

    Args:
        in_channels: image channels.
        latent_channels: C of the latents.
        channels: widths of the lower resolution levels; each level halves the resolution.
        stem_channels: width of the full-resolution convolutions.
        sample_size: frame side in pixels (a multiple of the downsampling factor).
        norm_groups: GroupNorm groups (divides every width).
        latent_noise: std of the noise added to the latents before decoding in ``loss``, relative
            to the latents' RMS.
        latent_l2: weight of the latents' mean square in ``loss``.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, in_channels: int = 3, latent_channels: int = 4, channels: tuple = (32, 64),
                 stem_channels: int = 16, sample_size: int = 32, norm_groups: int = 8, latent_noise: float = 0.1, latent_l2: float = 1e-4):
        super().__init__()
        channels = [int(c) for c in channels]
        check(len(channels) >= 1 and all(c >= 1 and c % norm_groups == 0 for c in channels), "channels",
              f"a non-empty list of widths divisible by norm_groups ({norm_groups})", channels)
        factor = 2 ** len(channels)
        check(is_int(sample_size) and sample_size % factor == 0, "sample_size",
              f"an int divisible by the downsampling factor {factor}", sample_size)
        check(latent_noise >= 0 and latent_l2 >= 0, "latent_noise", ">= 0 (and latent_l2 >= 0)",
              (latent_noise, latent_l2))
        g = norm_groups
        # full resolution is where convolutions cost most: only a thin stem works there
        enc = [nn.Conv2d(in_channels, stem_channels, 3, padding=1), nn.SiLU()]
        prev = stem_channels
        for c in channels:
            enc += [nn.Conv2d(prev, c, 3, stride=2, padding=1), ResBlock(c, c, g)]
            prev = c
        enc += [ResBlock(prev, prev, g), nn.GroupNorm(g, prev), nn.SiLU(), nn.Conv2d(prev, latent_channels, 1)]
        self.encoder = nn.Sequential(*enc)
        dec = [nn.Conv2d(latent_channels, prev, 3, padding=1), ResBlock(prev, prev, g)]
        for c in reversed(channels):
            dec += [ResBlock(prev, prev, g), nn.Upsample(scale_factor=2, mode="nearest"),
                    nn.Conv2d(prev, c, 3, padding=1)]
            prev = c
        dec += [nn.Conv2d(prev, stem_channels, 3, padding=1), nn.SiLU(),
                nn.Conv2d(stem_channels, in_channels, 3, padding=1)]
        self.decoder = nn.Sequential(*dec)
        # per-channel statistics of the raw latents, set by ``set_latent_stats`` after training
        self.register_buffer("latent_mean", torch.zeros(latent_channels))
        self.register_buffer("latent_std", torch.ones(latent_channels))

    @property
    def downsample_factor(self) -> int:
        return 2 ** len(self.config.channels)

    @property
    def latent_size(self) -> int:
        return self.config.sample_size // self.downsample_factor

    def _check_frames(self, frames: torch.Tensor) -> None:
        s = self.config.sample_size
        check(frames.dim() == 4 and tuple(frames.shape[1:]) == (self.config.in_channels, s, s), "frames",
              f"a (N, {self.config.in_channels}, {s}, {s}) tensor", tuple(frames.shape))

    def encode_raw(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [-1, 1] -> un-normalized latents (N, C, h, w)."""
        self._check_frames(frames)
        return self.encoder(frames)

    # encode and decode read the weights outside forward: under model offload the hook moves them first
    @apply_forward_hook
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [-1, 1] -> normalized latents (N, C, h, w)."""
        z = self.encode_raw(frames)
        return (z - self.latent_mean[:, None, None]) / self.latent_std[:, None, None]

    @apply_forward_hook
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents (N, C, h, w) -> frames (N, 3, H, W) (not clamped)."""
        h = self.latent_size
        check(latents.dim() == 4 and tuple(latents.shape[1:]) == (self.config.latent_channels, h, h), "latents",
              f"a (N, {self.config.latent_channels}, {h}, {h}) tensor", tuple(latents.shape))
        z = latents * self.latent_std[:, None, None] + self.latent_mean[:, None, None]
        return self.decoder(z)

    @torch.no_grad()
    def set_latent_stats(self, frames: torch.Tensor, batch_size: int = 256) -> None:
        """Measure the raw latents' per-channel mean and std over ``frames`` and store them."""
        z = torch.cat([self.encode_raw(chunk) for chunk in frames.split(batch_size)])  # (N, C, h, w)
        self.latent_mean.copy_(z.mean(dim=(0, 2, 3)))
        self.latent_std.copy_(z.std(dim=(0, 2, 3)).clamp(min=1e-6))

    def loss(self, frames: torch.Tensor, generator: torch.Generator | None = None) -> dict:
        """Reconstruction MSE of ``frames`` through noisy raw latents, plus the L2 penalty."""
        z = self.encode_raw(frames)
        rms = z.detach().pow(2).mean().sqrt()
        noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
        recon = F.mse_loss(self.decoder(z + self.config.latent_noise * rms * noise), frames)
        return {"loss": recon + self.config.latent_l2 * z.pow(2).mean(), "recon": recon}

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """Reconstruct frames (no noise): ``decode(encode(frames))``."""
        return self.decode(self.encode(frames))
