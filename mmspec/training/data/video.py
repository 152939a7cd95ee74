"""Procedural "moving shapes" video clips: the training data of the tiny streaming video model.

A clip shows one main object (a shape in a palette colour, as in ``shapes.py``) that moves in a
prompted direction over a static textured or gradient background, with small distractor shapes
that bounce off the walls and pass in front of or behind it (occlusion). Its prompt is text-like,
``"a red circle moving right"``, from a closed vocabulary of three fields:

| field     | words                          |
|-----------|--------------------------------|
| colour    | red, green, blue, yellow       |
| shape     | circle, square, triangle, star |
| direction | right, left, up, down          |

64 prompts in all. A model takes a prompt as three ids, one per field (``VideoPrompt.ids``): the
fields are independent factors, so a switch of one field (the colour, or the direction) changes
one id, and each field has its own null id for classifier-free guidance.

Two styles (``STYLES``): "scene", everything below, and "simple", what the video recipes train
on (smooth backgrounds, at most one distractor, upright shapes, faster motion).

Motion: the main object moves along its direction at a constant speed (0.6 to 1.6 pixels per
frame at 32 px; 1.1 to 1.9 in "simple"), drifts slowly across it (at most a third of that speed),
turns slowly (not in "simple"), and wraps around the frame, which is a torus (it leaves on the
right and comes back on the left: a direction can last for an unbounded stream, and a switch
never makes it jump); the distractors bounce off the walls. A clip may follow a *prompt
schedule*, ``[(0, p0), (k, p1), ...]``: from frame k on, the object takes prompt p1's colour,
shape and direction (its position and speed carry over), so a colour or direction switch happens
exactly at frame k.

Colours are chosen so the main object is the only saturated thing in a frame: backgrounds and
distractors are tinted greys (distance >= 0.4 from every palette colour), which makes the object's
colour and centroid measurable from pixels alone (``palette_mask``, ``pixel_centroid``): the
bench's quality metrics read generated frames that way, and the ground truth of every rendered
frame (``ClipTruth``) says what they should find.

Everything is drawn with torch ops from one ``torch.Generator``: a clip depends only on its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.nn import functional as F

from ...core.errors import check, check_int, is_int
from .shapes import COLOURS, PALETTE, SHAPES, _coverage, _grid, _paint, _sdf, item_seed

DIRECTIONS = ("right", "left", "up", "down")
# unit step of each direction in image coordinates (x to the right, y downwards)
DIRECTION_VECTORS = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, -1.0], [0.0, 1.0]])
PROMPT_FIELDS = ("colour", "shape", "direction")
PROMPT_VOCAB = {"colour": COLOURS, "shape": SHAPES, "direction": DIRECTIONS}
NUM_PROMPTS = len(COLOURS) * len(SHAPES) * len(DIRECTIONS)
BACKGROUNDS = ("stripes", "checker", "noise", "gradient")
# "scene": every background, 0-2 distractors, spinning shapes, 0.64-1.6 px per frame at 32 px;
# "simple": smooth backgrounds only (noise, gradient), one distractor in a quarter of the clips (so
# occlusion stays), upright shapes that do not spin, and faster motion (1.1-1.9 px per frame), so a
# tiny model trained in minutes learns the object and its motion rather than the textures
STYLES = ("scene", "simple")
SIMPLE_BACKGROUNDS = ("noise", "gradient")
SWITCH_KINDS = ("colour", "direction")

# a pixel belongs to palette colour k when its RGB (in [0, 1]) is within this distance of it: the
# object's jitter and shading stay within about 0.2, backgrounds and distractors stay >= 0.4 away
PALETTE_RADIUS = 0.3


@dataclass(frozen=True)
class VideoPrompt:
    """One prompt: indices into ``COLOURS``, ``SHAPES`` and ``DIRECTIONS``."""

    colour: int
    shape: int
    direction: int

    def __post_init__(self):
        for name, value in zip(PROMPT_FIELDS, (self.colour, self.shape, self.direction)):
            n = len(PROMPT_VOCAB[name])
            check(is_int(value) and 0 <= value < n, name, f"an int in [0, {n})", value)

    @property
    def ids(self) -> tuple[int, int, int]:
        return (self.colour, self.shape, self.direction)

    @property
    def text(self) -> str:
        return f"a {COLOURS[self.colour]} {SHAPES[self.shape]} moving {DIRECTIONS[self.direction]}"

    @property
    def index(self) -> int:
        """0 .. 63: ``(colour * 4 + shape) * 4 + direction``."""
        return (self.colour * len(SHAPES) + self.shape) * len(DIRECTIONS) + self.direction

    @classmethod
    def from_index(cls, index: int) -> "VideoPrompt":
        check(is_int(index) and 0 <= index < NUM_PROMPTS, "index", f"an int in [0, {NUM_PROMPTS})", index)
        rest, direction = divmod(index, len(DIRECTIONS))
        colour, shape = divmod(rest, len(SHAPES))
        return cls(colour, shape, direction)

    @classmethod
    def parse(cls, text: str) -> "VideoPrompt":
        """``"a red circle moving right"`` (any order, other words ignored): exactly one word of
        each field must appear (the model's parser, ``mmspec.models.video_dit.parse_prompt``)."""
        from ...models.video_dit import parse_prompt

        return cls(*parse_prompt(text, PROMPT_VOCAB))


def prompt_at(schedule: Sequence[tuple[int, VideoPrompt]], frame: int) -> VideoPrompt:
    """The prompt active at ``frame`` under a schedule sorted by start frame."""
    active = schedule[0][1]
    for start, prompt in schedule:
        if start <= frame:
            active = prompt
    return active


def check_schedule(schedule, num_frames: int) -> list[tuple[int, VideoPrompt]]:
    """A prompt schedule: a non-empty list of ``(start frame, VideoPrompt)`` starting at 0, start
    frames strictly increasing and below ``num_frames``."""
    check(isinstance(schedule, (list, tuple)) and len(schedule) >= 1
          and all(isinstance(s, (list, tuple)) and len(s) == 2 and isinstance(s[1], VideoPrompt) for s in schedule),
          "schedule", "a non-empty list of (start frame, VideoPrompt) pairs", schedule)
    starts = [s for s, _ in schedule]
    check(all(is_int(s) for s in starts) and starts[0] == 0
          and all(a < b for a, b in zip(starts, starts[1:])) and starts[-1] < num_frames, "schedule",
          f"start frames strictly increasing from 0 and below num_frames ({num_frames})", starts)
    return [(int(s), p) for s, p in schedule]


@dataclass
class ClipTruth:
    """Ground truth of every frame of a clip (F frames).

    Attributes:
        colour, shape, direction: (F,) long, the active prompt's ids.
        centroid: (F, 2) float, the main object's centre (x, y) in [-1, 1) (y downwards).
        visible: (F,) float, the fraction of the object's area not covered by distractors (and
            inside the frame, always: it wraps instead of leaving).
        switch_frames: start frames of the schedule's prompts after the first.
        distractors: how many distractor shapes the clip has.
    """

    colour: torch.Tensor
    shape: torch.Tensor
    direction: torch.Tensor
    centroid: torch.Tensor
    visible: torch.Tensor
    switch_frames: list[int]
    distractors: int = 0

    @property
    def prompt_ids(self) -> torch.Tensor:
        """(F, 3) per-frame prompt ids (colour, shape, direction)."""
        return torch.stack([self.colour, self.shape, self.direction], 1)


def _tint(rnd, spread: float) -> torch.Tensor:
    """A tinted grey: grey level in [0.25, 0.75], each channel within +-spread/2 of it."""
    g = 0.25 + 0.5 * rnd()
    return torch.tensor([g + spread * (rnd() - 0.5) for _ in range(3)])


def _background(kind: str, x, y, rnd, generator, resolution: int) -> torch.Tensor:
    """A blend weight map in [0, 1], (H, W), with structure a 4x-downsampling autoencoder keeps
    (at most about 3 cycles across the frame)."""
    a = 2 * math.pi * rnd()
    t = x * math.cos(a) + y * math.sin(a)
    if kind == "stripes":
        freq, sharp, phase = 1.0 + 2.0 * rnd(), 1 + 3 * rnd(), 2 * math.pi * rnd()
        return 0.5 + 0.5 * torch.tanh(sharp * torch.sin(math.pi * freq * t + phase))
    if kind == "checker":
        freq, sharp = 1.0 + 1.5 * rnd(), 1 + 3 * rnd()
        s = -x * math.sin(a) + y * math.cos(a)
        return 0.5 + 0.5 * torch.tanh(sharp * torch.sin(math.pi * freq * t) * torch.sin(math.pi * freq * s))
    if kind == "noise":
        cells = 2 + int(3 * rnd())
        z = torch.randn(1, 1, cells, cells, generator=generator)
        z = F.interpolate(z, size=(resolution, resolution), mode="bicubic", align_corners=False)[0, 0]
        return torch.sigmoid((1 + 2 * rnd()) * z)
    if rnd() < 0.5:  # gradient: linear along a random direction, or radial around a random centre
        return (0.5 + (0.3 + 0.4 * rnd()) * t).clamp(0.0, 1.0)
    cx, cy = 2 * rnd() - 1, 2 * rnd() - 1
    return (torch.hypot(x - cx, y - cy) * (0.4 + 0.4 * rnd())).clamp(0.0, 1.0)


def _wrap(v: float) -> float:
    """Into [-1, 1): the frame is a torus along the direction of motion."""
    return (v + 1.0) % 2.0 - 1.0


def render_clip(schedule: Sequence[tuple[int, VideoPrompt]], num_frames: int, generator: torch.Generator,
                resolution: int = 32, style: str = "scene") -> tuple[torch.Tensor, ClipTruth]:
    """Draw a clip that follows a prompt schedule ``[(0, prompt), (start, prompt), ...]`` in a
    ``style`` of ``STYLES`` (see there).

    Returns frames (F, 3, H, W) in [-1, 1] and their ``ClipTruth``. Uses only ``generator``."""
    check_int(num_frames, "num_frames", 1)
    check_int(resolution, "resolution", 16)
    check(style in STYLES, "style", f"one of {', '.join(STYLES)}", style)
    schedule = check_schedule(schedule, num_frames)
    simple = style == "simple"
    rnd = iter(torch.rand(64, generator=generator).tolist()).__next__
    x, y = _grid(resolution)

    # 1. static background: two tinted greys blended by a texture
    c1, c2 = _tint(rnd, 0.15), _tint(rnd, 0.15)
    kinds = SIMPLE_BACKGROUNDS if simple else BACKGROUNDS
    w = _background(kinds[int(len(kinds) * rnd())], x, y, rnd, generator, resolution)
    background = c1[:, None, None] + (c2 - c1)[:, None, None] * w  # (3, H, W)

    # 2. the main object's fixed look and initial motion
    r = 0.3 + 0.14 * rnd()
    pos = [2 * rnd() - 1, 2 * rnd() - 1]
    speed = (0.07 + 0.05 * rnd()) if simple else (0.04 + 0.06 * rnd())  # px per frame at 32 px: x 16
    drift = 0.013 * (2 * rnd() - 1)  # across the direction of motion
    angle, spin = 2 * math.pi * rnd(), 0.04 * (2 * rnd() - 1)
    if simple:
        angle, spin = 0.0, 0.0
    jitter = 0.08 * (torch.tensor([rnd(), rnd(), rnd()]) - 0.5)
    gx, gy = 0.12 * (2 * rnd() - 1), 0.12 * (2 * rnd() - 1)  # shading: +-15% across the object

    # 3. distractors: 0-2 small tinted shapes bouncing around, each in front or behind
    distractors = []
    u = rnd()
    for _ in range(int(u < 0.25) if simple else int(3 * u)):
        d_r = 0.14 + 0.1 * rnd()
        distractors.append(dict(shape=int(len(SHAPES) * rnd()), r=d_r, colour=_tint(rnd, 0.2),
                                pos=[(2 * rnd() - 1) * (1 - d_r), (2 * rnd() - 1) * (1 - d_r)],
                                vel=[0.08 * (2 * rnd() - 1), 0.08 * (2 * rnd() - 1)],
                                angle=2 * math.pi * rnd(), front=rnd() < 0.5))

    frames, centroids, visible, prompts = [], [], [], []
    for f in range(num_frames):
        prompt = prompt_at(schedule, f)
        prompts.append(prompt.ids)
        if f > 0:  # advance along the direction, drift across it; the frame is a torus
            step = DIRECTION_VECTORS[prompt.direction].tolist()
            cross = [abs(step[1]), abs(step[0])]
            pos = [_wrap(pos[a] + speed * step[a] + drift * cross[a]) for a in (0, 1)]
            angle += spin
            for d in distractors:
                for a in (0, 1):
                    d["pos"][a] += d["vel"][a]
                    if abs(d["pos"][a]) > 1.0 - d["r"]:
                        d["pos"][a] = math.copysign(2 * (1.0 - d["r"]), d["pos"][a]) - d["pos"][a]
                        d["vel"][a] = -d["vel"][a]
                d["angle"] += 0.05
        # coverage of the object and of its copies one frame-width away where they reach in
        mask = torch.zeros(resolution, resolution)
        reach = 1.0 + 1.3 * r  # the star's tips are the farthest point, at 1.25 r
        offsets = [[o for o in (-2.0, 0.0, 2.0) if abs(pos[a] + o) < reach] for a in (0, 1)]
        for ox in offsets[0]:
            for oy in offsets[1]:
                sdf = _sdf(prompt.shape, x - pos[0] - ox, y - pos[1] - oy, r, angle)
                mask = torch.maximum(mask, _coverage(sdf, resolution))
        base = PALETTE[prompt.colour] + jitter
        # shading relative to the nearest copy's centre
        dx, dy = (torch.remainder(c - p + 1.0, 2.0) - 1.0 for c, p in ((x, pos[0]), (y, pos[1])))
        shade = 1.0 + (gx * dx + gy * dy) / r  # (H, W)
        colour = (base[:, None, None] * shade).clamp(0.0, 1.0)

        image = background.clone()
        layers = [(d, _coverage(_sdf(d["shape"], x - d["pos"][0], y - d["pos"][1], d["r"], d["angle"]), resolution))
                  for d in distractors]
        for d, cov in layers:
            if not d["front"]:
                image = _paint(image, d["colour"], cov)
        image = _paint(image, colour, mask)
        covered = torch.zeros_like(mask)
        for d, cov in layers:
            if d["front"]:
                image = _paint(image, d["colour"], cov)
                covered = torch.maximum(covered, cov)
        area = mask.sum().clamp(min=1e-6)
        visible.append(float((mask * (1 - covered)).sum() / area))
        centroids.append((pos[0], pos[1]))
        frames.append(image.clamp(0.0, 1.0) * 2.0 - 1.0)

    ids = torch.tensor(prompts)  # (F, 3)
    truth = ClipTruth(colour=ids[:, 0], shape=ids[:, 1], direction=ids[:, 2], centroid=torch.tensor(centroids),
                      visible=torch.tensor(visible), switch_frames=[s for s, _ in schedule[1:]],
                      distractors=len(distractors))
    return torch.stack(frames), truth


def switched(prompt: VideoPrompt, kind: str, generator: torch.Generator) -> VideoPrompt:
    """``prompt`` with its colour or direction replaced by another, drawn from ``generator``."""
    check(kind in SWITCH_KINDS, "kind", f"one of {SWITCH_KINDS}", kind)
    field = PROMPT_FIELDS.index(kind)
    ids = list(prompt.ids)
    n = len(PROMPT_VOCAB[kind])
    ids[field] = (ids[field] + 1 + int(torch.randint(n - 1, (1,), generator=generator))) % n
    return VideoPrompt(*ids)


class VideoClipDataset(torch.utils.data.Dataset):
    """``size`` procedural clips of ``num_frames`` frames. Item ``i`` has prompt
    ``VideoPrompt.from_index(i % 64)`` (balanced) and, with probability ``switch_prob``, one
    switch of its colour or direction at a frame that is a multiple of ``switch_multiple`` in
    ``[switch_multiple, num_frames - switch_multiple]``.

    An item is a dict: ``frames`` (F, 3, H, W) in [-1, 1], ``prompt_ids`` (F, 3) per frame,
    ``switch_frame`` (the switch's frame, or -1), ``schedule`` (list of (frame, VideoPrompt)),
    ``truth`` (``ClipTruth``). Each item is drawn from its own generator seeded from
    ``(seed, i)``: the same at any access order. ``style`` as in ``render_clip``.
    """

    def __init__(self, size: int, seed: int, num_frames: int = 24, resolution: int = 32,
                 switch_prob: float = 0.0, switch_multiple: int = 1, style: str = "scene"):
        check_int(size, "size", 1)
        check_int(seed, "seed", 0)
        check_int(num_frames, "num_frames", 1)
        check_int(resolution, "resolution", 16)
        check(isinstance(switch_prob, (int, float)) and 0.0 <= switch_prob <= 1.0, "switch_prob",
              "a number in [0, 1]", switch_prob)
        check_int(switch_multiple, "switch_multiple", 1)
        check(switch_prob == 0 or num_frames >= 2 * switch_multiple, "num_frames",
              f"at least 2 * switch_multiple ({2 * switch_multiple}) when clips switch", num_frames)
        check(style in STYLES, "style", f"one of {', '.join(STYLES)}", style)
        self.size, self.seed, self.num_frames, self.resolution = size, seed, num_frames, resolution
        self.style = style
        self.switch_prob, self.switch_multiple = float(switch_prob), switch_multiple

    def __len__(self) -> int:
        return self.size

    def schedule(self, i: int, generator: torch.Generator) -> list[tuple[int, VideoPrompt]]:
        prompt = VideoPrompt.from_index(i % NUM_PROMPTS)
        u, kind_u = torch.rand(2, generator=generator).tolist()
        if u >= self.switch_prob:
            return [(0, prompt)]
        m = self.switch_multiple
        choices = self.num_frames // m - 1  # multiples m, 2m, ... <= num_frames - m
        frame = m * (1 + int(torch.randint(choices, (1,), generator=generator)))
        kind = SWITCH_KINDS[int(kind_u * len(SWITCH_KINDS))]
        return [(0, prompt), (frame, switched(prompt, kind, generator))]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(f"index {i} out of range for a dataset of size {self.size}")
        generator = torch.Generator().manual_seed(item_seed(self.seed, i))
        schedule = self.schedule(i, generator)
        frames, truth = render_clip(schedule, self.num_frames, generator, self.resolution, self.style)
        return dict(frames=frames, prompt_ids=truth.prompt_ids, switch_frame=truth.switch_frames[0]
                    if truth.switch_frames else -1, schedule=schedule, truth=truth)


# -- measuring frames (ground truth for generated clips) --------------------------------------------
def palette_mask(frames: torch.Tensor) -> torch.Tensor:
    """(..., 4, H, W) bool: pixels within ``PALETTE_RADIUS`` of each palette colour, for frames
    (..., 3, H, W) in [-1, 1]."""
    rgb = (frames + 1) / 2
    dist = (rgb.unsqueeze(-4) - PALETTE.to(frames)[:, :, None, None]).norm(dim=-3)  # (..., 4, H, W)
    return dist < PALETTE_RADIUS


def frame_colour(frames: torch.Tensor, min_pixels: int = 4) -> torch.Tensor:
    """(...,) the palette colour with the most pixels in each frame, -1 where fewer than
    ``min_pixels`` pixels match any."""
    counts = palette_mask(frames).flatten(-2).sum(-1)  # (..., 4)
    best = counts.argmax(-1)
    return torch.where(counts.max(-1).values >= min_pixels, best, -1)


def pixel_centroid(frames: torch.Tensor, colour: int | torch.Tensor | None = None) -> torch.Tensor:
    """(..., 2) the centroid (x, y) in [-1, 1) of the pixels of palette ``colour`` (default:
    each frame's ``frame_colour``) in frames (..., 3, H, W); NaN where there are none.

    Circular means on both axes, so an object wrapping around an edge gets one centre (a plain
    mean would put it in the middle of the frame)."""
    H, W = frames.shape[-2:]
    masks = palette_mask(frames)  # (..., 4, H, W)
    if colour is None:
        colour = frame_colour(frames).clamp(min=0)
    colour = torch.as_tensor(colour, device=frames.device).expand(frames.shape[:-3])
    mask = masks.gather(-3, colour[..., None, None, None].expand(*colour.shape, 1, H, W))[..., 0, :, :].float()
    xs, ys = _grid(W)
    n = mask.flatten(-2).sum(-1)  # (...,)
    out = []
    for coord in (xs, ys):
        phase = math.pi * coord  # one frame width = one turn
        c = (mask * torch.cos(phase)).flatten(-2).sum(-1)
        s = (mask * torch.sin(phase)).flatten(-2).sum(-1)
        out.append(torch.atan2(s, c) / math.pi)
    centroid = torch.stack(out, -1)
    return torch.where((n > 0)[..., None], centroid, float("nan"))


def motion_direction(centroids: torch.Tensor) -> torch.Tensor:
    """(F-1,) the direction id (index into ``DIRECTIONS``) of each frame-to-frame step of (F, 2)
    centroids: the dominant axis and its sign, displacements unwrapped on the torus."""
    step = torch.remainder(centroids[1:] - centroids[:-1] + 1.0, 2.0) - 1.0  # (F-1, 2)
    return (step[:, None, :] * DIRECTION_VECTORS).sum(-1).argmax(-1)
