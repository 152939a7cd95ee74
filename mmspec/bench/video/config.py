"""The video bench's settings."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import check, is_int
from ...training.data.video import PROMPT_VOCAB

ASSETS = Path(__file__).resolve().parents[3] / "assets"
METHODS = ("rolling", "window-recompute", "full-cache", "no-sink")
SWITCH_FIELDS = ("colour", "direction")
DEFAULT_PROMPTS = ("a red circle moving right", "a green square moving left", "a blue triangle moving up",
                   "a yellow star moving down")
# every colour x shape once, the default four first, directions taking turns: ``--prompts N`` runs
# the first N (more streams per row: narrower intervals on the quality columns, slower rows)
_DEFAULT_PAIRS = {tuple(p.split()[1:3]) for p in DEFAULT_PROMPTS}
PROMPT_SET = DEFAULT_PROMPTS + tuple(
    f"a {c} {s} moving {d}" for (c, s), d in zip(
        [(c, s) for c in PROMPT_VOCAB["colour"] for s in PROMPT_VOCAB["shape"] if (c, s) not in _DEFAULT_PAIRS],
        itertools.cycle(PROMPT_VOCAB["direction"])))


@dataclass
class VideoBenchConfig:
    pipeline_dir: str = str(ASSETS / "video")
    judge_dir: str | None = str(ASSETS / "video_judge")  # None: no shape judge (class/shape columns empty)
    frames: tuple = (100, 1000, 10000)
    methods: tuple = METHODS
    windows: tuple = (2, 4, 8, 16)  # window sweep, in chunks
    sweep_frames: int = 180  # 42 steady chunks at the largest window (16 chunks)
    switches: tuple = SWITCH_FIELDS
    switch_at: int = 48
    switch_frames: int = 144
    multi_switches: int = 2  # prompt switches per stream in the multi-switch group; 0 skips it
    multi_switch_every: int = 48  # frames per prompt segment there
    prompts: tuple = DEFAULT_PROMPTS
    seed: int = 0
    guidance_scale: float | None = None  # None: the transformer config's
    steps: int | None = None  # None: the transformer config's sample_steps
    quality_frames: int = 100
    hold_frames: int = 3  # the judge must report the new value this many frames in a row
    warmup: bool = True
    reference_frames: int = 96  # frames per prompt of the real clips in the setup's ceiling
    rss_limit_mb: float = 8192.0  # a stream whose process passes this is stopped and says so
    bootstrap_resamples: int = 1000
    bootstrap_seed: int = 0
    wan_frames: int = 600  # the tiny Wan group's latent frames per stream; 0 skips the group
    wan_windows: tuple = (2, 4)  # its windows, in chunks of 3 latent frames, after a sink of one chunk
    wan_size: int = 128  # its frames' side in pixels (latent frames of size / 8, tokens of 2 x 2 latents)

    @classmethod
    def quick(cls, **kw) -> "VideoBenchConfig":
        """The showcase's size: 100 and 300 frames, a 90-frame sweep, 2 prompts, 48 frames per switch,
        90 tiny-Wan frames."""
        kw = {"frames": (100, 300), "sweep_frames": 90, "switch_at": 24, "switch_frames": 48,
              "prompts": DEFAULT_PROMPTS[:2], "reference_frames": 48, "bootstrap_resamples": 300, "wan_frames": 90,
              **kw}
        return cls(**kw)

    def check(self) -> None:
        """Bad settings raise ``ValueError`` naming them, before anything loads."""
        pos = lambda x: is_int(x) and x >= 1  # noqa: E731
        check(isinstance(self.frames, (tuple, list)) and all(pos(n) for n in self.frames), "frames",
              "a sequence of ints >= 1", self.frames)
        check(isinstance(self.methods, (tuple, list)) and set(self.methods) <= set(METHODS), "methods",
              f"a sequence of {', '.join(METHODS)}", self.methods)
        check(isinstance(self.windows, (tuple, list)) and all(pos(w) for w in self.windows), "windows",
              "a sequence of ints >= 1 (chunks)", self.windows)
        check(isinstance(self.switches, (tuple, list)) and set(self.switches) <= set(SWITCH_FIELDS), "switches",
              f"a sequence of {', '.join(SWITCH_FIELDS)}", self.switches)
        check(isinstance(self.prompts, (tuple, list)) and len(self.prompts) >= 1, "prompts",
              "a non-empty sequence of prompts", self.prompts)
        check(is_int(self.multi_switches) and self.multi_switches >= 0, "multi_switches",
              "an int >= 0 (0 skips the multi-switch group)", self.multi_switches)
        for name in ("sweep_frames", "switch_frames", "quality_frames", "hold_frames", "reference_frames",
                     "multi_switch_every"):
            check(pos(getattr(self, name)), name, "an int >= 1", getattr(self, name))
        check(pos(self.switch_at) and self.switch_at < self.switch_frames, "switch_at",
              f"an int in [1, switch_frames ({self.switch_frames}))", self.switch_at)
        check(self.rss_limit_mb > 0, "rss_limit_mb", "> 0", self.rss_limit_mb)
        check(is_int(self.wan_frames) and self.wan_frames >= 0, "wan_frames",
              "an int >= 0 (0 skips the tiny Wan group)", self.wan_frames)
        check(is_int(self.wan_size) and self.wan_size >= 16 and self.wan_size % 16 == 0, "wan_size",
              "a multiple of 16 pixels", self.wan_size)
        check(isinstance(self.wan_windows, (tuple, list)) and len(self.wan_windows) >= 1
              and all(pos(w) for w in self.wan_windows), "wan_windows", "a non-empty sequence of ints >= 1 (chunks)",
              self.wan_windows)
