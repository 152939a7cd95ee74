"""``mmspec bench video``: the streaming video pipeline's cache modes, one run, same prompts and seeds.

Every stream is one batched call of ``StreamingVideoPipeline.stream`` over the same ``prompts``
(one video per prompt, video i from ``torch.Generator().manual_seed(seed + i)``), at the model's
guidance and steps unless set. Four groups of rows:

- ``frames`` (one group per count in ``frames``): ``rolling`` (ours: sinks + window, cached),
  ``window-recompute`` (StreamingLLM's sliding window with recompute, Xiao et al., 2024: every
  denoising step re-encodes sink + window from scratch), ``no-sink`` (the window alone: the attention-sink
  ablation) and ``full-cache`` (no eviction; it stops where the transformer's RoPE range ends,
  288 frames for the bundled model, and the row says where and why instead of failing), all at
  the trained sink and window.
- ``window-sweep``: ``rolling`` and ``window-recompute`` at windows of ``windows`` chunks, for the
  measured speed-up against the compute ratio ``S (C + K + W) / ((S + 1) C)`` (S steps, C frames
  per chunk, K sink and W window frames: the recompute re-encodes the K + W visible frames with
  the chunk in each of S steps, the cached stream encodes the chunk S times plus one commit). The
  bundled model was trained with a window of 9 frames (3 chunks): larger windows are outside its
  training distribution, so their quality says little; their cost comparison holds.
- ``prompt-switch``: ``rolling`` streams whose prompts change one field (``colour`` or
  ``direction``) at frame ``switch_at`` (LongLive's re-cache, Yang et al., 2025): frames until
  the judge reports the new value, and the frame-to-frame pixel change at the switch against the
  stream's median (and the same ratio on real rendered clips with that switch).
- ``multi-switch``: ``rolling`` streams of ``multi_switches + 1`` prompts, the colour moving on
  to the next palette colour every ``multi_switch_every`` frames: the colour accuracy of every
  prompt segment (``colour_min_segment``: the worst segment of any stream; judge and pixels
  agreeing, as the colour switch measures) and, per switch, frames until the new colour holds
  (``multi_switch_within_2_chunks``: the share of switches that took hold within two chunks).

- ``wan-tiny``: diffusers' Wan classes through ``StreamingVideoPipeline.from_wan``, tiny and
  random (``mmspec.bench.wan_tiny``, ``wan_size`` pixels; ``WAN_NOTE`` says the shape):
  ``rolling`` against ``window-recompute`` at the windows ``wan_windows``, ``wan_frames`` latent
  frames, the transformer's stream (the VAE decode left out): the ratio to recompute and the
  flatness of latency and memory, no quality (random weights draw noise).

A stream that stops early (full-cache's ``CacheLimitError``, a ``MemoryError``, or the process's
RSS past ``rss_limit_mb``) keeps its row: ``stopped`` says what and at which frame,
``stop_reason`` the full message. With a JSON path the result is rewritten after every group
(``setup.complete`` False until the end), so an interrupted run keeps the groups it finished.

Timing: inside a group the streams advance in lockstep, one chunk each in turn (the order rotated
every chunk), after an untimed warm-up stream per setting, so a slow stretch of the machine lands
on every row alike; wall ratios are measured in that one run. A chunk's latency is the wall time of
one ``next()`` on its stream (re-cache, denoising, commit, decode). ``fps`` counts the frames of all
``len(prompts)`` videos. Slopes are least-squares fits of per-chunk latency (ms) over the chunk's
first frame index, in ms per 1,000 frames, over the chunks after the cache has filled
(``fit_from_frame``), with the slope's standard error and a moving-block bootstrap 95% interval
(blocks of about ``n ** (1/3)`` chunks, so the chunks' autocorrelation is kept).
``latency_slope_adj`` is the same fit after dividing each chunk's latency by its lockstep round's
``speed_index`` (the median of the relative latencies, in that round, of the group's streams
whose cost per chunk is constant by design, i.e. all but full-cache; three or more of them): a
drift of the machine's speed during the run, which the raw slope takes for growth, cancels; a
row's own growth does not (a row that grows within the other rows' spread moves the median a
little: the others then show a small negative slope).

Memory: the process's resident set from ``/proc/self/statm``, read before and after every chunk
call, the C heap's free memory returned to the OS before each group (``trim_heap``: otherwise
memory an earlier group freed is reused unseen). The change across a call is attributed to the
stream that made it (in lockstep several rows share one process): ``peak_rss_mb`` is the largest
cumulative growth attributed to the row since its group started (peaks inside one call are not
seen; memory another stream of the group freed can still be reused unseen), ``rss_slope`` its
fitted slope in MB per 1,000 frames. ``cache_mb`` is what the stream's cache object holds (the
pipeline's ``cache_bytes``), exactly.

Quality, over the first and the last ``quality_frames`` frames of each stream: ``class_acc``
(the judge, a ``FrameJudge`` trained on rendered frames, reports the prompt's shape and colour,
and the pixels show that colour), ``shape_acc``, ``colour_acc`` (``frame_colour`` from pixels), ``direction_acc`` (the
motion of the prompt colour's pixel centroid between consecutive frames, ``motion_direction``);
``*_drift`` is last minus first in points. The setup gives the same figures on real rendered
clips of the bench's prompts and on their autoencoder reconstructions: the ceiling a perfect
generator would reach through this decoder.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..core.errors import check

ASSETS = Path(__file__).resolve().parents[2] / "assets"
METHODS = ("rolling", "window-recompute", "full-cache", "no-sink")
SWITCH_FIELDS = ("colour", "direction")
DEFAULT_PROMPTS = ("a red circle moving right", "a green square moving left", "a blue triangle moving up",
                   "a yellow star moving down")
# a direction switch turns a quarter: the centroid measure tells perpendicular motions apart best
_TURN = {"right": "up", "up": "left", "left": "down", "down": "right"}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
        pos = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1  # noqa: E731
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
        check(isinstance(self.multi_switches, int) and not isinstance(self.multi_switches, bool)
              and self.multi_switches >= 0, "multi_switches", "an int >= 0 (0 skips the multi-switch group)",
              self.multi_switches)
        for name in ("sweep_frames", "switch_frames", "quality_frames", "hold_frames", "reference_frames",
                     "multi_switch_every"):
            check(pos(getattr(self, name)), name, "an int >= 1", getattr(self, name))
        check(pos(self.switch_at) and self.switch_at < self.switch_frames, "switch_at",
              f"an int in [1, switch_frames ({self.switch_frames}))", self.switch_at)
        check(self.rss_limit_mb > 0, "rss_limit_mb", "> 0", self.rss_limit_mb)
        check(isinstance(self.wan_frames, int) and not isinstance(self.wan_frames, bool) and self.wan_frames >= 0,
              "wan_frames", "an int >= 0 (0 skips the tiny Wan group)", self.wan_frames)
        check(isinstance(self.wan_size, int) and not isinstance(self.wan_size, bool) and self.wan_size >= 16
              and self.wan_size % 16 == 0, "wan_size", "a multiple of 16 pixels", self.wan_size)
        check(isinstance(self.wan_windows, (tuple, list)) and len(self.wan_windows) >= 1
              and all(pos(w) for w in self.wan_windows), "wan_windows", "a non-empty sequence of ints >= 1 (chunks)",
              self.wan_windows)


# -- measurements --------------------------------------------------------------------------------
def trim_heap() -> bool:
    """Hand the C heap's free memory back to the OS (glibc's ``malloc_trim(0)``), so the RSS
    reads live memory rather than what earlier work freed; False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def rss_mb() -> float:
    """This process's resident set size in MB (``/proc/self/statm``; the peak from
    ``resource.getrusage`` where there is no /proc, which only grows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def compute_ratio(steps: int, chunk: int, visible: int) -> float:
    """Frame-passes per chunk of the window recompute over the cached stream's:
    ``S (C + V) / ((S + 1) C)`` with V = sink + window frames (StreamingLLM's cost argument,
    Xiao et al., 2024, at chunk granularity: attention itself is not counted)."""
    for name, v in (("steps", steps), ("chunk", chunk)):
        check(isinstance(v, int) and v >= 1, name, "an int >= 1", v)
    check(isinstance(visible, int) and visible >= 0, "visible", "an int >= 0", visible)
    return steps * (chunk + visible) / ((steps + 1) * chunk)


def _ols(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    xc = x - x.mean()
    sxx = float((xc * xc).sum())
    slope = float((xc * (y - y.mean())).sum() / sxx)
    resid = y - y.mean() - slope * xc
    se = math.sqrt(float((resid * resid).sum()) / (len(x) - 2) / sxx) if len(x) > 2 else float("nan")
    return slope, se


def fit_slope(x, y, per: float = 1000.0, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """Least-squares slope of ``y`` over ``x`` times ``per`` (e.g. ms per 1,000 frames), with its
    classical standard error (``se``) and a moving-block bootstrap interval (``ci_low``,
    ``ci_high``: ``resamples`` series of ceil(n / b) random runs of b = round(n ** (1/3))
    consecutive points, numpy ``default_rng(seed)``; serially correlated noise widens it as it
    should). ``n``: the points. Fewer than 3 points, or one x value: every figure None."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    check(x.shape == y.shape and x.ndim == 1, "y", f"a series as long as x ({x.shape})", y.shape)
    n = len(x)
    out = dict(slope=None, se=None, ci_low=None, ci_high=None, n=n)
    if n < 3 or np.ptp(x) == 0:
        return out
    slope, se = _ols(x, y)
    out.update(slope=slope * per, se=se * per)
    if resamples:
        b = max(1, round(n ** (1 / 3)))
        starts = np.random.default_rng(seed).integers(0, n - b + 1, size=(resamples, -(-n // b)))
        reps = []
        step = max(1, 2_000_000 // n)  # resamples per batch: bounded memory for 100,000-frame streams
        for r0 in range(0, resamples, step):
            idx = (starts[r0:r0 + step, :, None] + np.arange(b)).reshape(len(starts[r0:r0 + step]), -1)[:, :n]
            xs, ys = x[idx], y[idx]  # (R', n)
            xc = xs - xs.mean(1, keepdims=True)
            sxx = (xc * xc).sum(1)
            ok = sxx > 0
            reps.append((xc * (ys - ys.mean(1, keepdims=True))).sum(1)[ok] / sxx[ok] * per)
        lo, hi = np.quantile(np.concatenate(reps), [(1 - level) / 2, (1 + level) / 2])
        out.update(ci_low=float(lo), ci_high=float(hi))
    return out


def frames_until(reports, start: int, hold: int = 1) -> int | None:
    """Frames from ``start`` until ``reports`` (F,) bool is True ``hold`` frames in a row (0: at
    ``start`` itself); None if it never is."""
    r = torch.as_tensor(reports, dtype=torch.bool).flatten()
    check(isinstance(hold, int) and hold >= 1, "hold", "an int >= 1", hold)
    check(isinstance(start, int) and 0 <= start <= len(r), "start", f"an int in [0, {len(r)}]", start)
    run = 0
    for f in range(start, len(r)):
        run = run + 1 if bool(r[f]) else 0
        if run == hold:
            return f - hold + 1 - start
    return None


def pixel_changes(frames: torch.Tensor) -> torch.Tensor:
    """(..., F - 1) mean absolute change of each frame from the previous, for frames (..., F, 3, H,
    W) (any range; the bench passes [0, 1])."""
    return (frames[..., 1:, :, :, :].float() - frames[..., :-1, :, :, :].float()).abs().mean(dim=(-3, -2, -1))


def switch_jump(changes: torch.Tensor, switch_at: int, span: int = 1) -> dict:
    """The change entering frame ``switch_at`` (``changes[switch_at - 1]``) and the largest over
    the ``span`` frames from it, each over the median change of the stream outside that span."""
    c = torch.as_tensor(changes, dtype=torch.float64).flatten()
    check(isinstance(switch_at, int) and 1 <= switch_at <= len(c), "switch_at", f"an int in [1, {len(c)}]",
          switch_at)
    inside = torch.zeros(len(c), dtype=torch.bool)
    inside[switch_at - 1: switch_at - 1 + span] = True
    median = float(c[~inside].median()) if bool((~inside).any()) else float("nan")
    at, peak = float(c[switch_at - 1]), float(c[inside].max())
    ratio = lambda v: v / median if median > 0 else None  # noqa: E731
    return dict(jump=at, jump_max=peak, median=median, jump_ratio=ratio(at), jump_max_ratio=ratio(peak))


@torch.no_grad()
def judge_frames(frames: torch.Tensor, want: torch.Tensor, judge=None) -> dict:
    """What a stream shows, per frame, for frames (F, 3, H, W) in [0, 1] asked to show prompt ids
    ``want`` (F, 3) (colour, shape, direction): ``colour`` (F,) ``frame_colour`` from pixels;
    ``judge_colour``, ``judge_shape`` (F,) the judge's ids (None without a judge); ``direction``
    (F - 1,) the motion of the wanted colour's centroid between consecutive frames (-1 where that
    colour is missing in either frame)."""
    from ..training.data.video import frame_colour, motion_direction, pixel_centroid

    x = frames.float() * 2 - 1
    out = {"colour": frame_colour(x)}
    if judge is not None:
        pred = judge.predict(x)
        out.update(judge_colour=pred["colour"], judge_shape=pred["shape"])
    else:
        out.update(judge_colour=None, judge_shape=None)
    centroids = pixel_centroid(x, want[:, 0])  # (F, 2), NaN where the colour is absent
    seen = ~centroids.isnan().any(-1)
    d = motion_direction(centroids) if len(x) > 1 else torch.zeros(0, dtype=torch.long)
    out["direction"] = torch.where(seen[1:] & seen[:-1], d, -1)
    return out


def accuracy(seen: dict, want: torch.Tensor, frames: slice) -> dict:
    """Accuracies over ``frames`` (a slice of frame indices) of ``judge_frames`` output against
    ``want`` (F, 3): ``class_acc`` (the prompt's colour, the judge's colour head and the pixels
    agreeing on it, and the prompt's shape from the judge; a head forced to pick a colour does not
    count on a frame without the object), ``shape_acc`` (the judge), ``colour_acc`` (pixels),
    ``direction_acc`` (steps whose later frame is in ``frames``)."""
    idx = torch.arange(len(want))[frames]
    mean = lambda t: float(t.float().mean()) if t.numel() else None  # noqa: E731
    colour_ok = seen["colour"][idx] == want[idx, 0]
    out = {"colour_acc": mean(colour_ok)}
    if seen["judge_shape"] is not None:
        shape_ok = seen["judge_shape"][idx] == want[idx, 1]
        both_colour = colour_ok & (seen["judge_colour"][idx] == want[idx, 0])
        out.update(shape_acc=mean(shape_ok), class_acc=mean(shape_ok & both_colour))
    else:
        out.update(shape_acc=None, class_acc=None)
    steps = idx[idx >= 1]
    out["direction_acc"] = mean(seen["direction"][steps - 1] == want[steps, 2])
    return out


class FrameBuffer:
    """The first ``first`` and the last ``last`` frames of a stream as uint8 (constant memory
    however long the stream): (B, n, 3, H, W) chunks in [0, 1] in, ``frames()`` out."""

    def __init__(self, first: int, last: int):
        self.first_n, self.last_n = first, last
        self.head: list[torch.Tensor] = []
        self.tail: deque[torch.Tensor] = deque()
        self.count = self._head_count = self._tail_count = 0

    def add(self, chunk: torch.Tensor) -> None:
        q = (chunk.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # (B, n, 3, H, W)
        n = q.shape[1]
        if self._head_count < self.first_n:
            take = min(n, self.first_n - self._head_count)
            self.head.append(q[:, :take].clone())
            self._head_count += take
        self.tail.append(q)
        self._tail_count += n
        while self._tail_count - self.tail[0].shape[1] >= self.last_n:
            self._tail_count -= self.tail.popleft().shape[1]
        self.count += n

    def frames(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(first frames (B, a, 3, H, W), last frames (B, b, 3, H, W), index of the first of the
        last frames), floats in [0, 1]."""
        head = torch.cat(self.head, 1).float() / 255
        tail = torch.cat(list(self.tail), 1)
        tail = tail[:, tail.shape[1] - min(self.last_n, tail.shape[1]):].float() / 255
        return head, tail, self.count - tail.shape[1]


# -- streams in lockstep -------------------------------------------------------------------------
@dataclass
class _Run:
    """One timed stream: its settings, the generator it is pulled from, and what it recorded."""

    label: dict
    kwargs: dict
    frames: int
    keep: tuple[int, int]
    gen: object = None
    latency: list = field(default_factory=list)  # s per chunk
    starts: list = field(default_factory=list)  # first frame index per chunk
    rss: list = field(default_factory=list)  # attributed cumulative MB after each chunk
    rounds: list = field(default_factory=list)  # lockstep round of each chunk
    adjusted: list | None = None  # s per chunk over the round's speed index (None: not computed)
    cache: list = field(default_factory=list)  # cache bytes after each chunk
    switched: list = field(default_factory=list)
    grown: float = 0.0
    done: int = 0
    stopped: str | None = None  # short: what stopped the stream and where
    stop_reason: str | None = None  # the error's full message
    buffer: FrameBuffer | None = None


def _lockstep(pipe, runs: list[_Run], cfg: VideoBenchConfig, say) -> None:
    from ..pipelines.video import CacheLimitError

    trim_heap()  # memory earlier groups freed would hide this group's growth from the RSS
    for r in runs:
        r.buffer = FrameBuffer(*r.keep)
        r.gen = iter(pipe.stream(**r.kwargs))
    live = list(runs)
    k = 0
    while live:
        order = live[k % len(live):] + live[:k % len(live)]  # rotated every chunk
        for r in order:
            before = rss_mb()
            start = time.perf_counter()
            try:
                chunk = next(r.gen)
            except StopIteration:
                live.remove(r)
                continue
            except (CacheLimitError, MemoryError) as err:  # where full-cache stops, recorded not raised
                r.stopped, r.stop_reason = f"{type(err).__name__} at {r.done} frames", f"{type(err).__name__}: {err}"
                live.remove(r)
                continue
            seconds = time.perf_counter() - start
            after = rss_mb()
            r.grown += after - before
            r.latency.append(seconds)
            r.rounds.append(k)
            r.starts.append(chunk.frame_indices.start)
            r.rss.append(r.grown)
            r.cache.append(chunk.stats["cache_bytes"])
            r.switched.append(bool(chunk.stats["switched"]))
            r.buffer.add(chunk.frames)
            r.done = chunk.frame_indices.stop
            if r.done >= r.frames:
                live.remove(r)
            elif after > cfg.rss_limit_mb:
                r.stopped = f"memory at {r.done} frames"
                r.stop_reason = f"process RSS {after:.0f} MB > rss_limit_mb ({cfg.rss_limit_mb:.0f})"
                live.remove(r)
        k += 1
        if k % 200 == 0:
            say(f"  chunk {k}: " + ", ".join(f"{_name(r)} {r.done}" for r in runs))
    for r in runs:
        r.gen.close()
        r.gen = None
    _adjust(runs)


def _adjust(runs: list[_Run]) -> None:
    """Every run's latencies over its rounds' ``speed_index`` (NaN where a round has none), the
    index taken from the streams whose cost per chunk is constant by design (not full-cache)."""
    steady = [r for r in runs if r.label.get("method") != "full-cache"]
    index = speed_index([r.latency for r in steady], [r.rounds for r in steady])
    for r in runs:
        r.adjusted = [t / index[k] if k in index else float("nan") for t, k in zip(r.latency, r.rounds)]


def speed_index(latencies: list[list[float]], rounds: list[list[int]], min_streams: int = 3) -> dict[int, float]:
    """The machine's speed in each lockstep round: the median, over the streams that ran a chunk in
    it, of that chunk's latency over the stream's own median latency (1: a typical round; 2: the
    machine ran at half speed). Rounds with fewer than ``min_streams`` streams get none. Dividing
    a stream's latencies by it removes what all streams of the group share (another process
    loading the machine) and keeps what is the stream's own (a cache that grows): a median of
    three or more is not moved by one stream."""
    ratios: dict[int, list[float]] = {}
    for lat, rnd in zip(latencies, rounds):
        if not lat:
            continue
        med = float(np.median(lat))
        for t, k in zip(lat, rnd):
            ratios.setdefault(k, []).append(t / med)
    return {k: float(np.median(v)) for k, v in ratios.items() if len(v) >= min_streams}


def _name(r: _Run) -> str:
    label = r.label
    extra = f" w{label['window']}" if label.get("group") == "window-sweep" else ""
    extra += f" {label['switch']}" if "switch" in label else ""
    return label["method"] + extra


def _warm(pipe, kwargs: dict, frames: int) -> None:
    """One untimed stream of ``frames`` frames with these settings (allocator, plans, caches)."""
    from ..pipelines.video import CacheLimitError

    try:
        for chunk in pipe.stream(**{**kwargs, "num_frames": None}):
            if chunk.frame_indices.stop >= frames:
                break
    except CacheLimitError:
        pass


# -- the bench ---------------------------------------------------------------------------------
def _schedules(cfg: VideoBenchConfig, vocab: dict) -> dict[str, list]:
    """The switch rows' prompt texts: per field, ``(first prompts, switched prompts)``."""
    from ..training.data.video import VideoPrompt

    out = {}
    for fld in cfg.switches:
        new = []
        for text in cfg.prompts:
            p = VideoPrompt.parse(text)
            ids = list(p.ids)
            if fld == "colour":
                ids[0] = (ids[0] + 1) % len(vocab["colour"])
            else:
                ids[2] = vocab["direction"].index(_TURN[vocab["direction"][ids[2]]])
            new.append(VideoPrompt(*ids).text)
        out[fld] = new
    return out


def _want(texts: list[str], schedule: list | None, n_frames: int) -> torch.Tensor:
    """(B, F, 3) the prompt ids each video should show at each frame."""
    from ..training.data.video import VideoPrompt

    base = torch.tensor([VideoPrompt.parse(t).ids for t in texts])  # (B, 3)
    want = base[:, None].expand(-1, n_frames, 3).clone()
    for start, new in schedule or []:
        want[:, start:] = torch.tensor([VideoPrompt.parse(t).ids for t in new])[:, None]
    return want


def _quality(run: _Run, texts: list[str], schedule, judge, cfg: VideoBenchConfig) -> dict:
    """First/last ``quality_frames`` accuracies (mean over videos), pixel change medians, and the
    judged frames of the head (the switch rows need them)."""
    head, tail, tail_start = run.buffer.frames()
    q = cfg.quality_frames
    total = run.done
    want = _want(texts, schedule, total)
    rows = {"first": [], "last": []}
    seen_head = []
    for b in range(head.shape[0]):
        sh = judge_frames(head[b], want[b, :head.shape[1]], judge)
        st = judge_frames(tail[b], want[b, tail_start:], judge)
        seen_head.append(sh)
        rows["first"].append(accuracy(sh, want[b, :head.shape[1]], slice(0, min(q, head.shape[1]))))
        rows["last"].append(accuracy(st, want[b, tail_start:], slice(max(0, tail.shape[1] - q), tail.shape[1])))
    out = {}
    for when, accs in rows.items():
        for key in ("class_acc", "shape_acc", "colour_acc", "direction_acc"):
            vals = [a[key] for a in accs if a[key] is not None]
            out[f"{key}_{when}"] = float(np.mean(vals)) if vals else None
    for key in ("class_acc", "direction_acc"):  # drift: last minus first, in points
        a, z = out[f"{key}_first"], out[f"{key}_last"]
        out[f"{key}_drift"] = None if a is None or z is None else 100 * (z - a)
    out["change_first"] = float(pixel_changes(head[:, :q]).median()) if head.shape[1] > 1 else None
    out["change_last"] = float(pixel_changes(tail[:, -q:]).median()) if tail.shape[1] > 1 else None
    return out | {"_head": head, "_seen_head": seen_head}


def _row(run: _Run, cfg: VideoBenchConfig, fit_from: int, steps: int, chunk: int, batch: int) -> dict:
    lat_ms = np.asarray(run.latency) * 1000
    starts = np.asarray(run.starts)
    steady = starts >= fit_from
    seconds = float(np.sum(run.latency))
    lat = fit_slope(starts[steady], lat_ms[steady], resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed)
    mem = fit_slope(starts[steady], np.asarray(run.rss)[steady], resamples=cfg.bootstrap_resamples,
                    seed=cfg.bootstrap_seed)
    adj_ms = np.asarray(run.adjusted if run.adjusted is not None else [np.nan] * len(lat_ms)) * 1000
    ok = steady & np.isfinite(adj_ms)
    adj = fit_slope(starts[ok], adj_ms[ok], resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed)
    med = float(np.median(lat_ms)) if len(lat_ms) else None
    # every column in every row, None where it does not apply
    row = dict(switch=None, speedup_vs_recompute=None, compute_ratio=None, switch_frames_to_new=None,
               switch_jump_ratio=None, colour_min_segment=None)
    row.update(run.label)
    row.update(frames=run.frames, frames_done=run.done, chunk=chunk, steps=steps, batch=batch,
               fps=batch * run.done / seconds if seconds else None, latency_ms_median=med,
               latency_ms_p95=float(np.percentile(lat_ms, 95)) if len(lat_ms) else None,
               latency_slope=lat["slope"], latency_slope_se=lat["se"], latency_slope_ci_low=lat["ci_low"],
               latency_slope_ci_high=lat["ci_high"], latency_slope_adj=adj["slope"], latency_slope_adj_se=adj["se"],
               latency_slope_adj_ci_low=adj["ci_low"], latency_slope_adj_ci_high=adj["ci_high"],
               latency_drift_pct=(100 * lat["slope"] * run.done / 1000 / med) if lat["slope"] is not None and med
               else None,
               peak_rss_mb=max(0.0, max(run.rss)) if run.rss else None,
               rss_slope=mem["slope"], rss_slope_se=mem["se"], rss_slope_ci_low=mem["ci_low"],
               rss_slope_ci_high=mem["ci_high"], cache_mb=max(run.cache) / 2**20 if run.cache else None,
               fit_from_frame=fit_from, fit_chunks=lat["n"], stopped=run.stopped, stop_reason=run.stop_reason)
    return row


def _speedups(rows_runs: list[tuple[dict, _Run]], recompute: _Run, fit_from: int, cfg: VideoBenchConfig,
              steps: int, chunk: int, visible: int) -> None:
    """``speedup_vs_recompute``: the recompute's median steady-state chunk latency over the row's,
    over the chunks both streams ran (lockstep pairs), with a paired moving-block bootstrap
    interval; ``compute_ratio`` beside it and the share of it reached."""
    base = np.asarray(recompute.latency)
    base_starts = np.asarray(recompute.starts)
    ratio = compute_ratio(steps, chunk, visible)
    rng = np.random.default_rng(cfg.bootstrap_seed)
    for row, run in rows_runs:
        lat = np.asarray(run.latency)
        n = min(len(lat), len(base))
        keep = np.asarray(run.starts[:n]) >= fit_from
        keep &= base_starts[:n] >= fit_from
        a, b = base[:n][keep], lat[:n][keep]
        row["compute_ratio"] = ratio
        if len(a) == 0:
            row.update(speedup_vs_recompute=None, speedup_ci_low=None, speedup_ci_high=None, speedup_of_compute=None)
            continue
        speed = float(np.median(a) / np.median(b))
        lo = hi = None
        if cfg.bootstrap_resamples and len(a) >= 3:
            m = len(a)
            blk = max(1, round(m ** (1 / 3)))
            starts = rng.integers(0, m - blk + 1, size=(cfg.bootstrap_resamples, -(-m // blk)))
            idx = (starts[..., None] + np.arange(blk)).reshape(cfg.bootstrap_resamples, -1)[:, :m]
            reps = np.median(a[idx], 1) / np.median(b[idx], 1)
            lo, hi = (float(v) for v in np.quantile(reps, [0.025, 0.975]))
        row.update(speedup_vs_recompute=speed, speedup_ci_low=lo, speedup_ci_high=hi,
                   speedup_of_compute=speed / ratio)


def _load(cfg: VideoBenchConfig):
    from ..models import load_checkpoint
    from ..models.video_judge import FrameJudge
    from ..pipelines import StreamingVideoPipeline

    check(Path(cfg.pipeline_dir).is_dir(), "pipeline_dir", "a StreamingVideoPipeline folder (e.g. assets/video)",
          cfg.pipeline_dir)
    if cfg.judge_dir is not None:
        check(Path(cfg.judge_dir).is_dir(), "judge_dir",
              "None or a FrameJudge folder (build it: mmspec train video-judge --out assets/video_judge)",
              cfg.judge_dir)
    pipe = StreamingVideoPipeline.from_pretrained(cfg.pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    judge = None if cfg.judge_dir is None else load_checkpoint(FrameJudge, cfg.judge_dir)
    return pipe, judge


@torch.no_grad()
def _ceiling(pipe, judge, cfg: VideoBenchConfig) -> dict:
    """Judge and direction accuracies on real rendered clips of the bench's prompts (one per
    prompt, ``reference_frames`` frames, generator ``seed + i``) and on the pipeline's
    autoencoder reconstructions of them: what a perfect generator reaches, before and after the
    decoder."""
    from ..training.data.video import VideoPrompt, render_clip
    from ..training.recipes.video import VIDEO_DATA_STYLE

    out = {}
    real, recon, wants = [], [], []
    for i, text in enumerate(cfg.prompts):
        p = VideoPrompt.parse(text)
        frames, _ = render_clip([(0, p)], cfg.reference_frames, torch.Generator().manual_seed(cfg.seed + i),
                                pipe.vae.config.sample_size, style=VIDEO_DATA_STYLE)
        real.append((frames + 1) / 2)
        recon.append((pipe.vae(frames).clamp(-1, 1) + 1) / 2)
        wants.append(torch.tensor(p.ids).expand(cfg.reference_frames, 3))
    for name, clips in (("real", real), ("recon", recon)):
        accs = [accuracy(judge_frames(c, w, judge), w, slice(None)) for c, w in zip(clips, wants)]
        for key in ("class_acc", "shape_acc", "colour_acc", "direction_acc"):
            vals = [a[key] for a in accs if a[key] is not None]
            out[f"{name}_{key}"] = float(np.mean(vals)) if vals else None
    return out


def run(cfg: VideoBenchConfig, progress=None, json_path: str | os.PathLike | None = None) -> dict:
    """The three groups (module docstring). With ``json_path`` the result so far is written there
    (atomically, ``report.write_json``) after every group, ``setup.complete`` False until the end:
    an interrupted run leaves the finished groups."""
    from .report import write_json

    say = progress or (lambda msg: None)
    cfg.check()
    pipe, judge = _load(cfg)
    model = pipe.transformer
    mcfg = model.config
    C, K, W = mcfg.chunk_frames, mcfg.sink_frames, mcfg.window_frames
    steps = mcfg.sample_steps if cfg.steps is None else cfg.steps
    texts = list(cfg.prompts)
    B = len(texts)
    for t in texts:  # bad prompts fail before any stream
        model.encode_prompts(t)
    base = dict(guidance_scale=cfg.guidance_scale, num_inference_steps=cfg.steps, output_type="pt")
    gens = lambda: [torch.Generator().manual_seed(cfg.seed + i) for i in range(B)]  # noqa: E731
    warm_frames = K + W + 3 * C
    full_limit = pipe.max_frames("full-cache")

    say("judge and direction ceilings on real clips and their reconstructions")
    ceiling = _ceiling(pipe, judge, cfg)
    judge_log = None
    if cfg.judge_dir is not None and (Path(cfg.judge_dir) / "train_log.json").is_file():
        import json

        log = json.loads((Path(cfg.judge_dir) / "train_log.json").read_text())
        judge_log = {"heldout_accuracy": log.get("heldout_accuracy"), "heldout": log.get("heldout")}
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    setup = dict(pipeline=cfg.pipeline_dir, judge=cfg.judge_dir, judge_train_log=judge_log, prompts=texts,
                 batch=B, seeds=[cfg.seed + i for i in range(B)], chunk=C, sink=K, window=W,
                 trained_window=W, steps=steps,
                 guidance_scale=float(mcfg.guidance_scale if cfg.guidance_scale is None else cfg.guidance_scale),
                 full_cache_limit_frames=full_limit, rope_frames=model.rope_frames,
                 quality_frames=cfg.quality_frames, hold_frames=cfg.hold_frames,
                 ceiling=ceiling, torch_threads=torch.get_num_threads(), loadavg_start=load_start,
                 rss_method="/proc/self/statm resident pages before and after every chunk call; the change "
                            "attributed to the stream called; glibc malloc_trim(0) before each group "
                            + ("(done)" if trim_heap() else "(not available here)"),
                 timing="groups of streams in lockstep, one chunk each in turn, order rotated per chunk; one untimed "
                        "warm-up stream per setting first" if cfg.warmup else "lockstep, no warm-up",
                 slope="least squares over chunks from fit_from_frame, x 1000 frames; se classical, 95% interval "
                       "moving-block bootstrap",
                 speedup="median steady-state chunk latency of window-recompute over the row's, same window, same "
                         "lockstep group; 95% interval paired moving-block bootstrap",
                 window_note=f"the model was trained with sink {K} and window {W} frames ({W // C} chunks); "
                             "other windows are out of its training distribution (quality), not of the cost model",
                 complete=False)
    rows: list[dict] = []
    result = dict(bench="video", setup=setup, rows=rows)

    def save():
        if json_path is not None:
            write_json(json_path, public(result))

    # 1. the window sweep: rolling against window-recompute at each window
    if cfg.windows and cfg.sweep_frames:
        say(f"window sweep: windows {', '.join(str(w) for w in cfg.windows)} chunks, {cfg.sweep_frames} frames")
        made = _window_pairs(pipe, dict(base, prompt=texts), cfg.windows, cfg.sweep_frames, "window-sweep", cfg, say,
                             gens, C, K, steps, B, (cfg.quality_frames, cfg.quality_frames))
        for row, r in made:
            row.update({k: v for k, v in _quality(r, texts, None, judge, cfg).items() if not k.startswith("_")})
            rows.append(row)
        save()

    # 2. prompt switches (rolling, LongLive re-cache)
    if cfg.switches:
        say(f"prompt switches ({', '.join(cfg.switches)}) at frame {cfg.switch_at} of {cfg.switch_frames}")
        new = _schedules(cfg, model.prompt_vocab)
        runs = []
        for fld in cfg.switches:
            kw = dict(base, prompts=[(0, texts), (cfg.switch_at, new[fld])], num_frames=cfg.switch_frames)
            if cfg.warmup:
                _warm(pipe, dict(kw, generator=gens()), cfg.switch_at + 2 * C)
            runs.append(_Run(dict(method="prompt-switch", group="prompt-switch", switch=fld, window=W, sink=K),
                             dict(kw, generator=gens()), cfg.switch_frames, (cfg.switch_frames, cfg.quality_frames)))
        _lockstep(pipe, runs, cfg, say)
        for fld, r in zip(cfg.switches, runs):
            row = _row(r, cfg, K + W + C, steps, C, B)
            schedule = [(cfg.switch_at, new[fld])]
            quality = _quality(r, texts, schedule, judge, cfg)
            row.update({k: v for k, v in quality.items() if not k.startswith("_")})
            row.update(_switch_measures(r, quality, texts, new[fld], fld, cfg, C, judge is not None))
            rows.append(row)
        save()

    # 2b. several switches per stream: the colour moves on every multi_switch_every frames
    if cfg.multi_switches:
        n_seg, every = cfg.multi_switches + 1, cfg.multi_switch_every
        say(f"multi-switch: {n_seg} prompts per stream, the colour switching every {every} frames")
        schedule = _colour_cycle(texts, n_seg, every, model.prompt_vocab)
        kw = dict(base, prompts=schedule, num_frames=n_seg * every)
        if cfg.warmup:
            _warm(pipe, dict(kw, generator=gens()), every + 2 * C)
        r = _Run(dict(method="prompt-switch", group="multi-switch", switch=f"colour x{cfg.multi_switches}", window=W,
                      sink=K), dict(kw, generator=gens()), n_seg * every, (n_seg * every, cfg.quality_frames))
        _lockstep(pipe, [r], cfg, say)
        row = _row(r, cfg, K + W + C, steps, C, B)
        quality = _quality(r, texts, schedule[1:], judge, cfg)
        row.update({k: v for k, v in quality.items() if not k.startswith("_")})
        row.update(_segment_measures(quality, schedule, n_seg * every, cfg, C, judge is not None))
        row["switched_at"] = [start for start, sw in zip(r.starts, r.switched) if sw]  # re-cached chunks
        rows.append(row)
        save()

    # 3. per frame count: every method at the trained sink and window
    for n in cfg.frames:
        say(f"{n} frames: {', '.join(cfg.methods)} in lockstep")
        runs = []
        for mode in cfg.methods:
            kw = dict(base, prompt=texts, cache_mode=mode, num_frames=n)
            if mode == "full-cache" and n > full_limit:
                kw["num_frames"] = None  # unbounded: it yields what fits, then raises CacheLimitError
            if cfg.warmup:
                _warm(pipe, dict(kw, generator=gens()), min(warm_frames, full_limit))
            sink = 0 if mode in ("no-sink", "full-cache") else K
            runs.append(_Run(dict(method=mode, group="frames", window=None if mode == "full-cache" else W, sink=sink),
                             dict(kw, generator=gens()), n, (cfg.quality_frames, cfg.quality_frames)))
        _lockstep(pipe, runs, cfg, say)
        fit_from = K + W + C
        made = [(_row(r, cfg, fit_from, steps, C, B), r) for r in runs]
        rec = [r for r in runs if r.label["method"] == "window-recompute"]
        if rec:
            _speedups(made, rec[0], fit_from, cfg, steps, C, K + W)
        for row, r in made:
            row.update({k: v for k, v in _quality(r, texts, None, judge, cfg).items() if not k.startswith("_")})
            rows.append(row)
        save()

    # 4. diffusers' Wan (tiny, random): rolling against window-recompute at two windows
    if cfg.wan_frames:
        rows += _wan_group(cfg, B, say)
        setup["wan"] = dict(WAN_NOTE, size_px=cfg.wan_size, latent_hw=cfg.wan_size // 8,
                            tokens_per_frame=(cfg.wan_size // 16) ** 2, windows_frames=[3 * w for w in cfg.wan_windows])
        save()

    setup["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    setup["process_peak_rss_mb"] = _peak_rss_mb()
    setup["complete"] = True
    save()
    return result


WAN_NOTE = dict(
    model="diffusers WanTransformer3DModel, 2 layers, 2 heads x 12, ffn 32, text 16-d; AutoencoderKLWan (z 4); "
          "UMT5 (1 layer, 16-d); random weights (mmspec.bench.wan_tiny)",
    stream="chunks of 3 latent frames, sink 3, Self-Forcing's 4-step renoise sampler, no guidance, cache-order "
           "positions; frames and fps count latent frames (each decodes to 4 video frames, the first to 1); "
           "latency is the transformer's stream (output_type='latent'): the VAE decode, the same for both modes, "
           "is left out",
    note="random weights draw noise: these rows measure cost and flatness, not quality (no quality columns)")
"""What the Wan rows ran: the setup's ``wan`` entry."""


def _wan_group(cfg: VideoBenchConfig, batch: int, say) -> list[dict]:
    """The tiny random Wan stream, rolling and window-recompute at each of ``wan_windows`` (chunks),
    ``wan_frames`` latent frames, ``batch`` videos, in lockstep like the other groups."""
    from .wan_tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(cfg.seed, height=cfg.wan_size, width=cfg.wan_size)
    C, K = pipe.chunk_frames, pipe.stream_defaults()["sink_frames"]
    steps = pipe.stream_defaults()["num_inference_steps"]
    texts = ["a red cat walks on grass", "the blue dog runs left", "a ball jumps", "the cat runs right"]
    prompts = [texts[i % len(texts)] for i in range(batch)]
    gens = lambda: [torch.Generator().manual_seed(cfg.seed + i) for i in range(batch)]  # noqa: E731
    say(f"tiny Wan: windows {', '.join(str(w) for w in cfg.wan_windows)} chunks, {cfg.wan_frames} latent frames")
    made = _window_pairs(pipe, dict(prompt=prompts, output_type="latent"), cfg.wan_windows, cfg.wan_frames,
                         "wan-tiny", cfg, say, gens, C, K, steps, batch, (1, 1))
    return [row for row, _ in made]


def _window_pairs(pipe, kwargs: dict, windows, frames: int, group: str, cfg: VideoBenchConfig, say, gens, C: int,
                  K: int, steps: int, batch: int, keep: tuple[int, int]) -> list[tuple[dict, "_Run"]]:
    """``rolling`` and ``window-recompute`` streams of ``frames`` frames at each window of ``windows``
    (chunks), in lockstep after a warm-up each: (row, run) pairs with each window's speed-up over its
    recompute beside the compute ratio."""
    runs = []
    for w in windows:
        for mode in ("rolling", "window-recompute"):
            kw = dict(kwargs, cache_mode=mode, window_frames=w * C, num_frames=frames)
            if cfg.warmup:
                _warm(pipe, dict(kw, generator=gens()), K + w * C + 3 * C)
            runs.append(_Run(dict(method=mode, group=group, window=w * C, sink=K), dict(kw, generator=gens()), frames,
                             keep))
    _lockstep(pipe, runs, cfg, say)
    made = []
    for w in windows:
        pair = [r for r in runs if r.label["window"] == w * C]
        fit_from = K + w * C + C
        rows = [(_row(r, cfg, fit_from, steps, C, batch), r) for r in pair]
        _speedups(rows, next(r for r in pair if r.label["method"] == "window-recompute"), fit_from, cfg, steps, C,
                  K + w * C)
        made += rows
    return made


def _switch_measures(r: _Run, quality: dict, old: list[str], new: list[str], fld: str, cfg: VideoBenchConfig,
                     C: int, judged: bool) -> dict:
    """Per video: frames from the switch until the stream shows the new value of the switched
    field ``hold_frames`` frames in a row (colour: the judge's colour head and ``frame_colour``
    from pixels agree on it, pixels alone without a judge: a head forced to pick a colour does
    not count on a frame without one; direction: the centroid's motion into the frame), the share
    of the frames before the switch showing the old value, and the pixel change at the switch."""
    from ..training.data.video import VideoPrompt

    head, seen = quality["_head"], quality["_seen_head"]
    s = cfg.switch_at
    until, before, jumps = [], [], []
    for b in range(head.shape[0]):
        o, nw = VideoPrompt.parse(old[b]), VideoPrompt.parse(new[b])
        if fld == "colour":
            shown = _shown_colour(seen[b], judged)
            reports_new, reports_old = shown == nw.colour, shown[:s] == o.colour
        else:
            d = seen[b]["direction"]  # step f-1 -> f reported at frame f
            reports_new = torch.cat([torch.zeros(1, dtype=torch.bool), d == nw.direction])
            reports_old = d[: s - 1] == o.direction
        until.append(frames_until(reports_new, s, cfg.hold_frames))
        before.append(float(reports_old.float().mean()) if reports_old.numel() else None)
        jumps.append(switch_jump(pixel_changes(head[b]), s, span=2 * C))
    got = [u for u in until if u is not None]
    ratios = [j["jump_ratio"] for j in jumps if j["jump_ratio"] is not None]
    peaks = [j["jump_max_ratio"] for j in jumps if j["jump_max_ratio"] is not None]
    return dict(switch_at=s, switch_frames_to_new=float(np.mean(got)) if got else None,
                switch_frames_to_new_max=max(got) if got else None, switch_frames_to_new_each=until,
                switch_within_2_chunks=float(np.mean([u is not None and u < 2 * C for u in until])),
                switch_old_before=float(np.mean([v for v in before if v is not None])) if any(
                    v is not None for v in before) else None,
                switch_jump=float(np.mean([j["jump"] for j in jumps])),
                switch_median_change=float(np.mean([j["median"] for j in jumps])),
                switch_jump_ratio=float(np.mean(ratios)) if ratios else None,
                switch_jump_max_ratio=float(np.mean(peaks)) if peaks else None,
                switch_latency_ms=1000 * float(np.mean([t for t, sw in zip(r.latency, r.switched) if sw]))
                if any(r.switched) else None,
                switch_real_jump_ratio=_real_jump(old, new, cfg, C))


def _shown_colour(seen: dict, judged: bool) -> torch.Tensor:
    """(F,) the colour each frame shows (``judge_frames`` output): the pixels' colour where the
    judge's colour head agrees (a head forced to pick a colour does not count on a frame without
    one), -1 elsewhere; the pixels alone without a judge."""
    shown = seen["colour"]
    return torch.where(seen["judge_colour"] == shown, shown, -1) if judged else shown


def _colour_cycle(texts: list[str], segments: int, every: int, vocab: dict) -> list:
    """A schedule ``[(0, texts), (every, texts'), ...]``: each segment's prompts take the next
    palette colour (shape and direction kept)."""
    from ..training.data.video import VideoPrompt

    schedule = []
    for k in range(segments):
        new = []
        for text in texts:
            p = VideoPrompt.parse(text)
            new.append(VideoPrompt((p.colour + k) % len(vocab["colour"]), p.shape, p.direction).text)
        schedule.append((k * every, new))
    return schedule


def _segment_measures(quality: dict, schedule: list, n_frames: int, cfg: VideoBenchConfig, C: int,
                      judged: bool) -> dict:
    """Per stream and prompt segment of a colour-cycling schedule: the share of the segment's
    frames showing its colour (judge and pixels agreeing, pixels alone without a judge), and per
    switch the frames until the new colour holds ``hold_frames`` frames in a row."""
    from ..training.data.video import VideoPrompt

    seen = quality["_seen_head"]
    bounds = [start for start, _ in schedule] + [n_frames]
    segment_acc, until = [], []
    for b, frames_seen in enumerate(seen):
        shown = _shown_colour(frames_seen, judged)
        accs = []
        for k, (start, texts) in enumerate(schedule):
            want = VideoPrompt.parse(texts[b]).colour
            accs.append(float((shown[start:bounds[k + 1]] == want).float().mean()))
            if k:
                until.append(frames_until(shown == want, start, cfg.hold_frames))
        segment_acc.append(accs)
    return dict(multi_switch_every=cfg.multi_switch_every, colour_segments=segment_acc,
                colour_min_segment=min(min(a) for a in segment_acc),
                colour_mean_segment=float(np.mean(segment_acc)),
                switch_frames_to_new=float(np.mean([u for u in until if u is not None])) if any(
                    u is not None for u in until) else None,
                switch_frames_to_new_each=until,
                multi_switch_within_2_chunks=float(np.mean([u is not None and u < 2 * C for u in until])))


def _real_jump(old: list[str], new: list[str], cfg: VideoBenchConfig, C: int) -> float | None:
    """``switch_jump_ratio`` of real rendered clips with the same switch (mean over prompts): the
    jump a switch makes in the data itself (a colour switch repaints the object in one frame)."""
    from ..training.data.video import VideoPrompt, render_clip
    from ..training.recipes.video import VIDEO_DATA_STYLE

    ratios = []
    for i, (o, n) in enumerate(zip(old, new)):
        frames, _ = render_clip([(0, VideoPrompt.parse(o)), (cfg.switch_at, VideoPrompt.parse(n))], cfg.switch_frames,
                                torch.Generator().manual_seed(cfg.seed + i), style=VIDEO_DATA_STYLE)
        j = switch_jump(pixel_changes((frames + 1) / 2), cfg.switch_at, span=2 * C)["jump_ratio"]
        if j is not None:
            ratios.append(j)
    return float(np.mean(ratios)) if ratios else None


def _peak_rss_mb() -> float | None:
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024
    except (ImportError, OSError):
        return None


def public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


VIDEO_COLUMNS = [
    ("method", "method"), ("group", "group"), ("switch", "switch"), ("frames_done", "frames"), ("sink", "sink"),
    ("window", "window"), ("chunk", "chunk"), ("steps", "steps"), ("fps", "fps"),
    ("latency_ms_median", "ms/chunk"), ("latency_ms_p95", "p95 ms"), ("latency_slope", "ms/1k fr"),
    ("latency_slope_se", "+-se"), ("latency_slope_adj", "adj ms/1k"), ("peak_rss_mb", "RSS MB"),
    ("rss_slope", "MB/1k fr"), ("cache_mb", "cache MB"),
    ("speedup_vs_recompute", "x recompute"), ("compute_ratio", "compute x"), ("class_acc_first", "class first"),
    ("class_acc_last", "class last"), ("direction_acc_first", "dir first"), ("direction_acc_last", "dir last"),
    ("switch_frames_to_new", "switch frames"), ("switch_jump_ratio", "jump/median"),
    ("colour_min_segment", "colour worst seg"), ("stopped", "stopped"),
]

__all__ = ["VideoBenchConfig", "VIDEO_COLUMNS", "accuracy", "compute_ratio", "fit_slope", "frames_until",
           "judge_frames", "pixel_changes", "public", "rss_mb", "run", "speed_index", "switch_jump",
           "FrameBuffer"]
