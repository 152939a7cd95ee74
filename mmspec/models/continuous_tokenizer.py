"""Continuous image tokenizers for the 64x64 procedural images: a learned convolutional one
(``ConvTokenizer``, the default) and PCA of non-overlapping patches (``PatchPCATokenizer``).

Both map images (B, 3, H, W) in [-1, 1] to (B, N, d) latents in raster order and back, and expose
``grid_size``, ``num_tokens`` and ``token_dim``; a pipeline takes either.

``PatchPCATokenizer``:

An image (B, 3, H, W) in [-1, 1] is cut into ``patch_size`` x ``patch_size`` patches (3 p^2 values
each, raster order); each patch minus the data mean is projected on the first ``latent_dim``
principal directions and divided by one global scale (MAR's scalar latent scale), giving
(B, (H / p) (W / p), latent_dim) latents of roughly unit variance. Decoding is the transpose. The
basis is fitted in closed form (``fit``: SVD of the centred patches), no gradient training; a
diffusers ``ModelMixin`` so it saves and loads as safetensors in a pipeline folder.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import nn

from ..core.errors import check, check_int
from .video_ae import FrameAutoencoder

__all__ = ["ConvTokenizer", "PatchPCATokenizer"]


class PatchPCATokenizer(ModelMixin, ConfigMixin):
    """PCA of ``patch_size`` x ``patch_size`` patches -> ``latent_dim`` coefficients per patch.

    Args:
        sample_size: image side in pixels (a multiple of ``patch_size``).
        patch_size: p, the patch side; the grid is ``sample_size / p`` per side.
        latent_dim: d, coefficients kept per patch (at most ``3 p^2``).
        in_channels: image channels.

    Until ``fit`` runs the basis is the identity's first d directions, mean 0 and scale 1.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, sample_size: int = 64, patch_size: int = 8, latent_dim: int = 16, in_channels: int = 3):
        super().__init__()
        for name, value in (("sample_size", sample_size), ("patch_size", patch_size), ("latent_dim", latent_dim),
                            ("in_channels", in_channels)):
            check_int(value, name, 1)
        check(sample_size % patch_size == 0, "patch_size", f"a divisor of sample_size ({sample_size})", patch_size)
        D = in_channels * patch_size ** 2
        check(latent_dim <= D, "latent_dim", f"an int in [1, {D}] (3 * patch_size**2)", latent_dim)
        # fitted, not trained: parameters without gradients (so they save, load and cast like weights)
        self.mean = nn.Parameter(torch.zeros(D), requires_grad=False)
        self.basis = nn.Parameter(torch.eye(D)[:latent_dim].clone(), requires_grad=False)  # (d, D), orthonormal rows
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)

    @property
    def grid_size(self) -> int:
        return self.config.sample_size // self.config.patch_size

    @property
    def num_tokens(self) -> int:
        return self.grid_size ** 2

    @property
    def token_dim(self) -> int:
        """d, the channels of one token."""
        return self.config.latent_dim

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, C p^2) patches in raster order."""
        cfg = self.config
        S, p = cfg.sample_size, cfg.patch_size
        check(images.dim() == 4 and tuple(images.shape[1:]) == (cfg.in_channels, S, S), "images",
              f"a (batch, {cfg.in_channels}, {S}, {S}) tensor", tuple(images.shape))
        B, C, g = images.shape[0], cfg.in_channels, self.grid_size
        x = images.reshape(B, C, g, p, g, p).permute(0, 2, 4, 1, 3, 5)  # (B, g, g, C, p, p)
        return x.reshape(B, g * g, C * p * p)

    def unpatch(self, patches: torch.Tensor) -> torch.Tensor:
        """(B, N, C p^2) -> (B, C, H, W)."""
        cfg = self.config
        B, g, p, C = patches.shape[0], self.grid_size, cfg.patch_size, cfg.in_channels
        x = patches.reshape(B, g, g, C, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, C, g * p, g * p)

    @torch.no_grad()
    def fit(self, images: torch.Tensor) -> "PatchPCATokenizer":
        """Fit mean, basis (top right-singular vectors of the centred patches, sign fixed so each
        direction's largest entry is positive) and the global scale (std of all coefficients)."""
        x = self.patches(images.to(torch.float64)).flatten(0, 1)  # (B N, D)
        mean = x.mean(0)
        _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
        basis = vh[: self.config.latent_dim]
        sign = basis.gather(1, basis.abs().argmax(1, keepdim=True)).sign()
        basis = basis * sign
        scale = ((x - mean) @ basis.T).std()
        self.mean.copy_(mean)
        self.basis.copy_(basis)
        self.scale.copy_(scale)
        return self

    # encode and decode read the weights outside forward: under model offload the hook moves them first
    @apply_forward_hook
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) in [-1, 1] -> (B, N, d) latents (raster order, unit-scale)."""
        x = self.patches(images.to(self.basis.dtype))
        return (x - self.mean) @ self.basis.T / self.scale

    @apply_forward_hook
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, N, d) latents -> (B, C, H, W) pixels (not clamped)."""
        N, d = self.num_tokens, self.config.latent_dim
        check(latents.dim() == 3 and tuple(latents.shape[1:]) == (N, d), "latents", f"a (batch, {N}, {d}) tensor",
              tuple(latents.shape))
        x = latents.to(self.basis.dtype) * self.scale @ self.basis + self.mean
        return self.unpatch(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``decode(encode(images))``."""
        return self.decode(self.encode(images))



class ConvTokenizer(FrameAutoencoder):
    """A learned continuous tokenizer: ``FrameAutoencoder``'s convolutional encoder and decoder,
    its (C, g, g) latents read as ``g * g`` tokens of ``C`` channels in raster order.

    Why not PCA: an AR model's samples are never exactly on the data's latent manifold. GIVT
    (Tschannen et al., 2024) models a beta-VAE's latent and reports that regularising the latent
    trades reconstruction against how easily a transformer models it; unregularised PCA
    coefficients sit at the hard end of that trade, and their linear decoder shows every sampling
    error as a blotch. This autoencoder is trained with Gaussian noise on its latents before
    decoding (``latent_noise``, relative to their RMS) and a small L2 penalty, so its decoder
    turns a nearby latent into a clean shape, and its latents are low-dimensional (the bundled
    one: 8 channels per 8x8 patch, against PCA's 16). ``encode`` returns per-channel normalised
    latents (``set_latent_stats``), unit scale like ``PatchPCATokenizer``'s. Config as
    ``FrameAutoencoder`` (``sample_size`` the image side; ``2 ** len(channels)`` the patch side).
    """

    @property
    def grid_size(self) -> int:
        return self.latent_size

    @property
    def num_tokens(self) -> int:
        return self.grid_size ** 2

    @property
    def token_dim(self) -> int:
        """d, the channels of one token."""
        return self.config.latent_channels

    def _check_images(self, images: torch.Tensor) -> None:
        s, c = self.config.sample_size, self.config.in_channels
        check(images.dim() == 4 and tuple(images.shape[1:]) == (c, s, s), "images",
              f"a (batch, {c}, {s}, {s}) tensor", tuple(images.shape))

    # the hook first (an offloaded model is onloaded, in its compute dtype, before its dtype is read)
    @apply_forward_hook
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) in [-1, 1] -> (B, N, d) normalised latents in raster order (the frame
        autoencoder's normalised (B, d, g, g) grid, cell (r, c) as token r * g + c)."""
        self._check_images(images)
        return super().encode(images.to(self.latent_std.dtype)).flatten(2).transpose(1, 2)

    @apply_forward_hook
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, N, d) normalised latents -> (B, C, H, W) pixels (not clamped)."""
        N, d, g = self.num_tokens, self.token_dim, self.grid_size
        check(latents.dim() == 3 and tuple(latents.shape[1:]) == (N, d), "latents", f"a (batch, {N}, {d}) tensor",
              tuple(latents.shape))
        return super().decode(latents.to(self.latent_std.dtype).transpose(1, 2).reshape(-1, d, g, g))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """The reconstruction ``decode(encode(images))``."""
        return self.decode(self.encode(images))
