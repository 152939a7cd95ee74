"""Running and timing the streams: a group in lockstep, per-chunk latency and resident memory, the
machine's speed index, and the frames kept for the quality measures."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ..machine import peak_rss_mb, rss_mb, trim_heap  # noqa: F401  (the video bench's names)
from .config import VideoBenchConfig


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
    from ...pipelines.video import CacheLimitError

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
    from ...pipelines.video import CacheLimitError

    try:
        for chunk in pipe.stream(**{**kwargs, "num_frames": None, "num_latent_frames": None}):
            if chunk.frame_indices.stop >= frames:
                break
    except CacheLimitError:
        pass
