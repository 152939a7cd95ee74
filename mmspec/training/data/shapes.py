"""Procedural "coloured shapes" images: the training data of the tiny AR image models.

Each scene is one labelled main object (a shape in a palette colour, at a random position, size,
rotation and shading) over a random texture (stripes, checker, smooth noise or a gradient) with a
few small distractor shapes underneath it. One class covers very different images on purpose: an
AR model over their VQ tokens stays uncertain about which token comes next, which is the regime
the relaxed acceptance rules (LANTERN, GSD) are about.

Everything is drawn with plain torch ops on a coordinate grid from signed distances (edges are
anti-aliased over one pixel), from a ``torch.Generator``, so an image depends only on its seed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from functools import lru_cache

import torch
from torch.nn import functional as F

from ...core.errors import check, check_int, is_int

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = ("red", "green", "blue", "yellow")
# RGB in [0, 1]; pairwise distances are >= 0.7, far above the jitter and shading of one object.
PALETTE = torch.tensor([[0.90, 0.12, 0.12],
                        [0.12, 0.75, 0.20],
                        [0.15, 0.30, 0.95],
                        [0.95, 0.85, 0.10]])
# label = colour * len(SHAPES) + shape
CLASS_NAMES = [f"{colour} {shape}" for colour in COLOURS for shape in SHAPES]
CLASS_PROMPTS = [f"a {name}" for name in CLASS_NAMES]
NUM_CLASSES = len(CLASS_NAMES)
TEXTURES = ("stripes", "checker", "noise", "gradient")
# "scene": the VLM's and the classifier's data (main object radius 0.28-0.58, 0-3 distractors);
# "bold": radius 0.45-0.62, at most one distractor, where the shape covers enough tokens to carry a
# real share of the loss (issue 10: on "scene" data the first AR target learned colour but not shape);
# "upright": the AR image target's data: bold's sizes with the shapes upright (angle 0), no
# distractors, only the smooth textures (noise, gradient) and no sensor noise. A tiny AR model
# trained on "bold" still drew blobs: every rotation of a star is another set of token edges, and
# stripes, checkers and per-pixel noise spend its capacity on tokens that say nothing of the class
STYLES = ("scene", "bold", "upright")
SMOOTH_TEXTURES = ("noise", "gradient")

_N_UNIFORMS = 64  # enough for the main object, the texture and 3 distractors


@lru_cache(maxsize=8)
def _grid(resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel centres in [-1, 1]: x grows to the right, y downwards, each (H, W)."""
    c = (torch.arange(resolution, dtype=torch.float32) + 0.5) * (2.0 / resolution) - 1.0
    y, x = torch.meshgrid(c, c, indexing="ij")
    return x, y


def _sdf(shape: int, x: torch.Tensor, y: torch.Tensor, r: float, angle: float) -> torch.Tensor:
    """Signed distance (negative inside) to a shape of radius ``r`` centred at the origin."""
    if SHAPES[shape] == "circle":
        return torch.hypot(x, y) - r
    c, s = math.cos(angle), math.sin(angle)
    u, v = c * x + s * y, c * y - s * x  # (H, W) each, in the shape's own frame
    if SHAPES[shape] == "square":
        # 0.85 r half-side: roughly the circle's area, so size does not give the shape away
        return torch.maximum(u.abs(), v.abs()) - 0.85 * r
    if SHAPES[shape] == "triangle":
        # equilateral, circumradius 1.3 r: the max over three edge half-planes is exact near edges
        d = None
        for k in range(3):
            a = math.pi / 2 + 2 * math.pi * k / 3
            e = u * math.cos(a) + v * math.sin(a)
            d = e if d is None else torch.maximum(d, e)
        return d - 0.65 * r
    # five-pointed star: fold the plane into the half-sector next to a tip, then measure the
    # distance to the edge from the tip A to the inner vertex B (the origin is on the inside).
    outer, inner = 1.25 * r, 0.5 * r
    sector = 2 * math.pi / 5
    t = torch.remainder(torch.atan2(v, u), sector)
    phi = torch.minimum(t, sector - t)  # angle to the nearest tip, in [0, pi / 5]
    rho = torch.hypot(u, v)
    qx, qy = rho * torch.cos(phi), rho * torch.sin(phi)
    ax, bx, by = outer, inner * math.cos(sector / 2), inner * math.sin(sector / 2)
    ex, ey = bx - ax, by
    h = (((qx - ax) * ex + qy * ey) / (ex * ex + ey * ey)).clamp(0.0, 1.0)
    dist = torch.hypot(qx - ax - h * ex, qy - h * ey)
    inside = ex * qy - ey * (qx - ax) > 0
    return torch.where(inside, -dist, dist)


def _coverage(sdf: torch.Tensor, resolution: int) -> torch.Tensor:
    """Anti-aliased coverage in [0, 1]: a linear ramp one pixel wide across the edge."""
    return (0.5 - sdf * (resolution / 2.0)).clamp(0.0, 1.0)


def _texture(kind: str, x: torch.Tensor, y: torch.Tensor, rnd: Callable[[], float],
             generator: torch.Generator, resolution: int) -> torch.Tensor:
    """A blend weight map in [0, 1], (H, W)."""
    a = 2 * math.pi * rnd()
    t = x * math.cos(a) + y * math.sin(a)
    if kind == "stripes":
        freq, sharp, phase = 1.5 + 5 * rnd(), 1 + 9 * rnd(), 2 * math.pi * rnd()
        return 0.5 + 0.5 * torch.tanh(sharp * torch.sin(math.pi * freq * t + phase))
    if kind == "checker":
        freq, sharp = 1.5 + 4 * rnd(), 1 + 9 * rnd()
        s = x * math.cos(a + math.pi / 2) + y * math.sin(a + math.pi / 2)
        return 0.5 + 0.5 * torch.tanh(sharp * torch.sin(math.pi * freq * t) * torch.sin(math.pi * freq * s))
    if kind == "noise":
        cells = 3 + int(10 * rnd())
        z = torch.randn(1, 1, cells, cells, generator=generator)
        z = F.interpolate(z, size=(resolution, resolution), mode="bicubic", align_corners=False)[0, 0]
        return torch.sigmoid((1 + 2 * rnd()) * z)
    # gradient: linear along a random direction, or radial around a random centre
    if rnd() < 0.5:
        return (0.5 + (0.3 + 0.7 * rnd()) * t).clamp(0.0, 1.0)
    cx, cy = 2 * rnd() - 1, 2 * rnd() - 1
    return (torch.hypot(x - cx, y - cy) * (0.4 + 0.6 * rnd())).clamp(0.0, 1.0)


def _paint(image: torch.Tensor, colour: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Alpha-composite ``colour`` ((3,) or (3, H, W)) over ``image`` (3, H, W)."""
    if colour.dim() == 1:
        colour = colour[:, None, None]
    return image + (colour - image) * alpha


def render(label: int, generator: torch.Generator, resolution: int = 64,
           return_mask: bool = False, return_meta: bool = False, style: str = "scene"):
    """Draw one scene of class ``label``: an image (3, H, W) in [-1, 1], and with ``return_mask``
    also the main object's coverage (H, W) in [0, 1]. Uses only ``generator`` for randomness.

    With ``return_meta`` a dict describing the scene comes last: ``label``, ``texture``,
    ``background`` (two RGB triples), ``distractors`` (a list of ``(shape name, RGB, cx, cy, r)``)
    and the main object's ``cx``, ``cy`` (in [-1, 1], y downwards), ``r`` and ``angle``. Asking for
    it draws nothing more: the image is the same either way. ``style`` is one of ``STYLES``: "bold"
    draws a larger main object (radius 0.45-0.62 instead of 0.28-0.58) over at most one distractor;
    "upright" draws bold's object at angle 0 with no distractor over a smooth texture (noise or
    gradient) and without sensor noise."""
    check(is_int(label) and 0 <= label < NUM_CLASSES, "label", f"an int in [0, {NUM_CLASSES})", label)
    check(style in STYLES, "style", f"one of {', '.join(STYLES)}", style)
    upright = style == "upright"
    bold = style == "bold" or upright
    check_int(resolution, "resolution", 16)
    # one draw of uniforms for all scalar choices keeps the per-image op count (and time) low
    rnd = iter(torch.rand(_N_UNIFORMS, generator=generator).tolist()).__next__
    x, y = _grid(resolution)

    # 1. background: two random colours (kept off black and white) blended by a random texture
    c1 = torch.tensor([0.1 + 0.7 * rnd() for _ in range(3)])
    c2 = torch.tensor([0.1 + 0.7 * rnd() for _ in range(3)])
    textures = SMOOTH_TEXTURES if upright else TEXTURES
    texture = textures[int(len(textures) * rnd())]
    w = _texture(texture, x, y, rnd, generator, resolution)
    image = c1[:, None, None] + (c2 - c1)[:, None, None] * w  # (3, H, W)
    distractors = []

    # 2. distractors: 0-3 small shapes of any colour, under the main object
    for _ in range(0 if upright else int((2 if bold else 4) * rnd())):
        shape, r = int(len(SHAPES) * rnd()), 0.06 + 0.08 * rnd()
        cx, cy, angle = 1.6 * rnd() - 0.8, 1.6 * rnd() - 0.8, 2 * math.pi * rnd()
        colour = torch.tensor([rnd(), rnd(), rnd()])
        distractors.append((SHAPES[shape], colour.tolist(), cx, cy, r))
        image = _paint(image, colour, _coverage(_sdf(shape, x - cx, y - cy, r, angle), resolution))

    # 3. main object: palette colour with a little jitter and a linear shading across it
    colour_id, shape = divmod(label, len(SHAPES))
    r = 0.45 + 0.17 * rnd() if bold else 0.28 + 0.3 * rnd()
    cx, cy = (2 * rnd() - 1) * (0.95 - r), (2 * rnd() - 1) * (0.95 - r)
    angle = 2 * math.pi * rnd()  # drawn for "upright" too: later draws, and so the bundled data, stay as trained
    if upright:
        angle = 0.0
    mask = _coverage(_sdf(shape, x - cx, y - cy, r, angle), resolution)  # (H, W)
    base = PALETTE[colour_id] + 0.12 * (torch.tensor([rnd(), rnd(), rnd()]) - 0.5)
    # brightness varies by up to about +-25% across the object
    gx, gy = 0.15 * (2 * rnd() - 1), 0.15 * (2 * rnd() - 1)
    shade = 1.0 + (gx * (x - cx) + gy * (y - cy)) / r  # (H, W)
    image = _paint(image, (base[:, None, None] * shade).clamp(0.0, 1.0), mask)

    # 4. sensor noise of a random strength
    sigma = 0.0 if upright else 0.05 * rnd()
    image = image + sigma * torch.randn(image.shape, generator=generator)
    image = image.clamp(0.0, 1.0) * 2.0 - 1.0
    out = (image,) + ((mask,) if return_mask else ())
    if return_meta:
        out += (dict(label=label, texture=texture, background=(c1.tolist(), c2.tolist()),
                     distractors=distractors, cx=cx, cy=cy, r=r, angle=angle),)
    return out[0] if len(out) == 1 else out


def item_seed(seed: int, index: int) -> int:
    """A 63-bit seed for item ``index`` of the dataset with ``seed``: a hash, so (seed, index)
    pairs do not collide the way ``seed * n + index`` would."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShapesDataset(torch.utils.data.Dataset):
    """``size`` procedural scenes; item ``i`` is ``(image (3, H, W) in [-1, 1], label)`` with
    ``label = i % 16``, so classes are balanced. Each item is drawn from its own generator seeded
    from ``(seed, i)``: the same at any access order, in any worker. ``style`` as in ``render``."""

    def __init__(self, size: int, seed: int, resolution: int = 64, style: str = "scene"):
        check_int(size, "size", 1)
        check_int(seed, "seed", 0)
        check_int(resolution, "resolution", 16)
        check(style in STYLES, "style", f"one of {', '.join(STYLES)}", style)
        self.size, self.seed, self.resolution, self.style = size, seed, resolution, style

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of range for a dataset of size {self.size}")
        label = i % NUM_CLASSES
        generator = torch.Generator().manual_seed(item_seed(self.seed, i))
        return render(label, generator, self.resolution, style=self.style), label
