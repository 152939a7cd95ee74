"""A small CNN classifier of the procedural shapes: the feature extractor of the AR image bench.

It plays the role Inception-v3 plays for FID: ``features`` (the penultimate activations) feed the
Frechet distance, ``forward`` (logits over the 16 classes) the class accuracy. Trained by
``mmspec.training.recipes.train_classifier`` on real ``ShapesDataset`` images.

Inputs are images (B, 3, H, W) in [-1, 1], the convention of ``ShapesDataset`` and of
``TinyVQModel.decode`` (whose output is not clamped: the bench clamps it first, as
``mmspec.eval.quality.reconstruct`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn
from torch.nn import functional as F

from ..core.errors import check, check_int, is_int


class ConvStage(nn.Module):
    """conv 3x3 -> BatchNorm -> ReLU, twice; the first conv halves the resolution."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ShapesClassifier(ModelMixin, ConfigMixin):
    """Image -> class logits, with ``features`` exposing the ``feature_dim`` activations before
    the linear head. ``save_pretrained(dir)`` / ``load_checkpoint(ShapesClassifier, dir)`` as
    ``TinyVQModel``. Call ``.eval()`` before measuring: BatchNorm then uses its running stats,
    so an image's features do not depend on the rest of its batch."""

    @register_to_config
    def __init__(self, in_channels: int = 3, sample_size: int = 64,
                 block_out_channels: Sequence[int] = (32, 64, 96, 128), feature_dim: int = 128,
                 num_classes: int = 16):
        super().__init__()
        check_int(in_channels, "in_channels", 1)
        check(isinstance(block_out_channels, Sequence) and len(block_out_channels) >= 1
              and all(is_int(c) and c >= 1 for c in block_out_channels), "block_out_channels",
              "a non-empty sequence of ints >= 1", block_out_channels)
        factor = 2 ** len(block_out_channels)
        check(is_int(sample_size) and sample_size >= factor and sample_size % factor == 0, "sample_size",
              f"a positive multiple of the downsampling factor {factor}", sample_size)
        check_int(feature_dim, "feature_dim", 1)
        check_int(num_classes, "num_classes", 2)
        widths = [in_channels, *block_out_channels]
        self.stages = nn.Sequential(*(ConvStage(a, b) for a, b in zip(widths, widths[1:])))
        self.feature = nn.Linear(widths[-1], feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def _check_images(self, images: torch.Tensor) -> None:
        c, s = self.config.in_channels, self.config.sample_size
        check(images.dim() == 4 and tuple(images.shape[1:]) == (c, s, s), "images",
              f"a (B, {c}, {s}, {s}) tensor", tuple(images.shape))

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [-1, 1] -> (B, feature_dim): the penultimate activations."""
        self._check_images(images)
        h = self.stages(images).mean(dim=(2, 3))  # (B, block_out_channels[-1]): global average pool
        return F.relu(self.feature(h))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [-1, 1] -> logits (B, num_classes)."""
        return self.head(self.features(images))
