"""A tiny frame classifier of the streaming video model's prompt: the video bench's judge of what a
generated frame shows.

Per frame (3, 32, 32) in [-1, 1] it predicts the main object's colour and shape (two heads over
the words of its ``labels``, stored with the weights so runtime code never imports training data).
Colour is also measurable from pixels alone (``mmspec.training.data.video.frame_colour``); shape
is not, which is why this network exists. Motion direction is a property of consecutive frames and
is measured from pixel centroids instead (``motion_direction``).

Trained by ``mmspec.training.recipes.train_video_judge`` on rendered procedural frames (ground
truth from ``render_clip``), never on the generator's outputs, so it judges the generator from
outside. Its held-out accuracy on real frames is in its ``train_log.json``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from ..core.errors import check, check_int, is_int

FIELDS = ("colour", "shape")


class FrameJudge(ModelMixin, ConfigMixin):
    """Frames -> colour and shape logits.

    Args:
        in_channels, sample_size: frames are (in_channels, sample_size, sample_size).
        block_out_channels: widths of the stride-2 conv stages (each halves the resolution).
        feature_dim: width before the two heads.
        labels: ``{"colour": [...words], "shape": [...words]}``, the heads' classes in order.
        palette: RGB in [0, 1] of each colour word: besides the pixels, the network sees one soft
            map per palette colour, ``exp(-(d / palette_radius) ** 2)`` of each pixel's RGB
            distance d to it (the object's silhouette, whatever its colour; no parameters).
        palette_radius: the maps' length scale in RGB distance.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, in_channels: int = 3, sample_size: int = 32, block_out_channels: Sequence[int] = (24, 48, 64),
                 feature_dim: int = 64, labels: dict | None = None, palette: Sequence | None = None,
                 palette_radius: float = 0.3):
        super().__init__()
        check_int(in_channels, "in_channels", 1)
        check(isinstance(block_out_channels, Sequence) and len(block_out_channels) >= 1
              and all(is_int(c) and c >= 1 for c in block_out_channels), "block_out_channels",
              "a non-empty sequence of ints >= 1", block_out_channels)
        factor = 2 ** len(block_out_channels)
        check(is_int(sample_size) and sample_size >= factor and sample_size % factor == 0, "sample_size",
              f"a positive multiple of the downsampling factor {factor}", sample_size)
        check_int(feature_dim, "feature_dim", 1)
        if labels is None:
            labels = {"colour": ["red", "green", "blue", "yellow"], "shape": ["circle", "square", "triangle", "star"]}
        check(isinstance(labels, dict) and sorted(labels) == sorted(FIELDS)
              and all(isinstance(labels[f], (list, tuple)) and len(labels[f]) >= 2 for f in FIELDS), "labels",
              f"a dict of at least two words for each of {', '.join(FIELDS)}", labels)
        self.labels = {f: list(labels[f]) for f in FIELDS}
        self.register_to_config(labels=self.labels)
        if palette is None:
            palette = [[0.90, 0.12, 0.12], [0.12, 0.75, 0.20], [0.15, 0.30, 0.95], [0.95, 0.85, 0.10]]
        check(len(palette) == len(self.labels["colour"]) and all(len(c) == in_channels for c in palette), "palette",
              f"one RGB triple per colour word ({len(self.labels['colour'])})", palette)
        check(palette_radius > 0, "palette_radius", "> 0", palette_radius)
        palette = [[float(v) for v in c] for c in palette]
        self.register_to_config(palette=palette)  # saved with the weights, as the labels
        self.register_buffer("palette_rgb", torch.tensor(palette, dtype=torch.float32), persistent=False)
        layers, prev = [nn.Conv2d(in_channels + len(palette), block_out_channels[0], 3, padding=1, bias=False),
                        nn.BatchNorm2d(block_out_channels[0]), nn.ReLU(inplace=True)], block_out_channels[0]
        for c in block_out_channels:
            layers += [nn.Conv2d(prev, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True),
                       nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            prev = c
        self.stages = nn.Sequential(*layers)
        # max-pool beside the mean: the object may be a small or split (wrapped) part of the frame
        self.feature = nn.Sequential(nn.Linear(2 * prev, feature_dim), nn.ReLU(inplace=True))
        self.heads = nn.ModuleDict({f: nn.Linear(feature_dim, len(self.labels[f])) for f in FIELDS})

    def _check_frames(self, frames: torch.Tensor) -> None:
        c, s = self.config.in_channels, self.config.sample_size
        check(frames.dim() == 4 and tuple(frames.shape[1:]) == (c, s, s), "frames",
              f"a (N, {c}, {s}, {s}) tensor", tuple(frames.shape))

    def forward(self, frames: torch.Tensor) -> dict[str, torch.Tensor]:
        """frames (N, C, H, W) in [-1, 1] -> ``{"colour": (N, n_colours), "shape": (N, n_shapes)}`` logits."""
        self._check_frames(frames)
        rgb = (frames + 1) / 2
        dist = (rgb[:, None] - self.palette_rgb.to(frames)[None, :, :, None, None]).norm(dim=2)  # (N, K, H, W)
        maps = torch.exp(-(dist / self.config.palette_radius) ** 2)
        h = self.stages(torch.cat([frames, maps], 1))  # (N, c, h, w)
        h = self.feature(torch.cat([h.mean(dim=(2, 3)), h.amax(dim=(2, 3))], -1))  # (N, feature_dim)
        return {f: head(h) for f, head in self.heads.items()}

    @torch.no_grad()
    def predict(self, frames: torch.Tensor, batch_size: int = 512) -> dict[str, torch.Tensor]:
        """``{"colour": (N,), "shape": (N,)}`` class ids of frames (N, C, H, W) in [-1, 1] (call
        ``.eval()`` first: BatchNorm then uses its running statistics)."""
        self._check_frames(frames)
        outs = [self(chunk) for chunk in frames.split(batch_size)] if len(frames) else [
            {f: torch.zeros(0, len(self.labels[f])) for f in FIELDS}]
        return {f: torch.cat([o[f] for o in outs]).argmax(-1) for f in FIELDS}
