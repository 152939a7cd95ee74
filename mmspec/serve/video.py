"""The streaming video runner: one video from a prompt schedule through ``StreamingVideoPipeline``
(a cache mode of the ``"video"`` registry modality), streamed chunk by chunk as uint8 frames, with
the stream's stats; every input checked against the bundled model's config before it loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..core.errors import check, check_int, is_int
from .base import ASSETS, JobField, ModalitySpec, Models, Result, check_seed, register, resolve

VIDEO_MAX_FRAMES = 10_000
"""Frames one ``stream_video`` call (a batch job) may ask for; the pipeline itself streams without end."""


def video_config(assets: str | Path = ASSETS) -> dict:
    """The bundled video transformer's config (prompt vocabulary, chunk, trained sink and window),
    read from its folder without loading the model."""
    path = Path(assets) / "video" / "transformer" / "config.json"
    check(path.is_file(), "assets", "a folder holding video/transformer/config.json", str(path))
    return json.loads(path.read_text())


def video_schedule(prompt: str, switches=(), num_frames: int | None = None,
                   assets: str | Path = ASSETS) -> list[tuple[int, str]]:
    """The prompt schedule ``[(0, prompt), (frame, text), ...]`` of ``prompt`` and ``switches``
    (``(frame, text)`` pairs, any order), checked against the bundled model's config before any
    model loads: each text names one word of each prompt field (colour, shape, direction); switch
    frames are distinct ints > 0, below ``num_frames``, at chunk boundaries (the pipeline
    switches prompts between chunks, LongLive's re-cache)."""
    from ..models.video_dit import parse_prompt

    cfg = video_config(assets)
    C, vocab = cfg["chunk_frames"], cfg["prompt_vocab"]
    check(isinstance(prompt, str) and prompt.strip() != "", "prompt", "a non-empty prompt such as "
          "'a red circle moving right'", prompt)
    parse_prompt(prompt, vocab)
    check(isinstance(switches, (list, tuple)) and all(isinstance(s, (list, tuple)) and len(s) == 2 for s in switches),
          "switches", "a list of (frame, prompt) pairs", switches)
    schedule = [(0, prompt)]
    for frame, text in sorted(switches, key=lambda s: s[0] if isinstance(s[0], int) else -1):
        check(is_int(frame) and frame > 0, "switch frame", "an int > 0 (frame 0 is the prompt's)", frame)
        low = frame // C * C
        check(frame % C == 0, "switch frame", f"a multiple of the model's chunk ({C} frames): prompts switch at "
              f"chunk boundaries, e.g. {low or C} or {low + C}", frame)
        check(num_frames is None or frame < num_frames, "switch frame", f"below the number of frames ({num_frames})",
              frame)
        check(frame != schedule[-1][0], "switch frame", "distinct frames (one prompt per switch)", frame)
        check(isinstance(text, str) and text.strip() != "", "switch prompt", "a non-empty prompt", text)
        parse_prompt(text, vocab)
        schedule.append((frame, text))
    return schedule


def video_batchable(method: str, temperature: float) -> bool:
    """Video jobs run one per call: a batched row equals the video alone only within float
    rounding (``tests/test_video_pipeline.py``), which can move a uint8 pixel, and a job's file
    must not depend on the batch it ran in."""
    return False


def check_video_knobs(method: str, knobs: dict | None, assets: str | Path = ASSETS) -> dict:
    """The pipeline's ``stream`` keyword arguments of a cache mode and its knobs (the registry's
    ``"video"`` modality), with sink and window checked against the model's chunk; the RoPE-range
    bound (sink + window + chunk) is the pipeline's check."""
    from ..methods.video import stream_kwargs

    kwargs = stream_kwargs(resolve("video", method, knobs))
    C = video_config(assets)["chunk_frames"]
    for name in ("sink_frames", "window_frames"):
        value = kwargs.get(name)
        check(value is None or value % C == 0, name, f"None or a multiple of the model's chunk ({C} frames)", value)
    return kwargs


@dataclass
class VideoPiece:
    """One chunk of a stream as it arrives: ``frames`` (n, H, W, 3) uint8, ``start`` the index
    of its first frame, ``total`` the frames asked for, ``prompt`` in force, and the chunk's
    ``stats`` (``latency_s``, ``cache_frames``, ``cache_bytes``, ``switched``, ``nfe``)."""

    frames: np.ndarray
    start: int
    total: int
    prompt: str
    stats: dict


def stream_video(models: Models, prompt: str, seed: int, num_frames: int, method: str = "rolling",
                 knobs: dict | None = None, switches=()) -> Iterator[tuple[VideoPiece | None, Result | None]]:
    """Stream one video: yields ``(piece, None)`` for every chunk as it is decoded, then
    ``(None, result)`` once, ``result.frames`` (F, H, W, 3) uint8 and ``result.stats``
    (``video_stats``). ``method`` is a cache mode (``methods.names("video")``) with its
    ``knobs``; ``switches`` ``(frame, prompt)`` pairs. Every input is checked here, before any
    model loads; the pipeline's own checks (the RoPE range) run before its first chunk."""
    check_int(num_frames, "num_frames", 1, VIDEO_MAX_FRAMES)
    schedule = video_schedule(prompt, switches, num_frames, models.assets)
    kwargs = check_video_knobs(method, knobs, models.assets)
    seed = check_seed(seed)
    return _stream_video(models, schedule, seed, num_frames, kwargs)


def _stream_video(models: Models, schedule, seed: int, num_frames: int, kwargs: dict):
    pipe = models.pipeline("video")
    call = dict(prompts=schedule, num_frames=num_frames, **kwargs)
    setup = pipe.check_inputs(None, schedule, num_frames, None, kwargs["guidance_scale"],
                              kwargs["num_inference_steps"], kwargs.get("sink_frames"), kwargs.get("window_frames"),
                              kwargs["cache_mode"], kwargs["recache_sink"], "np", None, ["latents"])
    pieces = []
    for chunk in pipe.stream(**call, generator=torch.Generator().manual_seed(seed), output_type="np"):
        frames = (np.asarray(chunk.frames[0]) * 255).round().astype(np.uint8)  # (n, H, W, 3)
        piece = VideoPiece(frames, chunk.frame_indices.start, num_frames, chunk.prompts[0], dict(chunk.stats))
        pieces.append(piece)
        yield piece, None
    settings = dict(cache_mode=setup.cache_mode, sink_frames=setup.sink, window_frames=setup.window,
                    num_inference_steps=setup.steps, guidance_scale=setup.guidance_scale,
                    recache_sink=setup.recache_sink, chunk_frames=pipe.chunk_frames)
    frames = np.concatenate([p.frames for p in pieces])
    yield None, Result(stats=video_stats(pieces, settings), frames=frames)


def run_video(models: Models, prompt: str, seed: int, num_frames: int, method: str = "rolling",
              knobs: dict | None = None, switches=()) -> Result:
    """``stream_video`` to its end: the whole video's ``Result``."""
    for _, result in stream_video(models, prompt, seed, num_frames, method, knobs, switches):
        if result is not None:
            return result


def video_stats(pieces: list[VideoPiece], settings: dict) -> dict:
    """A stream's stats: ``frames``, ``chunks``, ``wall_seconds`` (the chunks' summed latency:
    the pipeline's time, not the caller's between chunks), ``fps`` (frames over it),
    ``latency_ms_median`` / ``latency_ms_p95`` per chunk, ``nfe``, ``cache_frames`` (after the
    last chunk), ``cache_kib`` (the largest), ``switch_frames`` (where a re-cache ran), and the
    resolved ``settings`` (cache mode, sink, window, steps, guidance, ...)."""
    latency = np.array([p.stats["latency_s"] for p in pieces])
    frames = sum(len(p.frames) for p in pieces)
    wall = float(latency.sum())
    return {"frames": frames, "chunks": len(pieces), "wall_seconds": round(wall, 4),
            "fps": round(frames / wall, 2) if wall > 0 else None,
            "latency_ms_median": round(1000 * float(np.median(latency)), 2),
            "latency_ms_p95": round(1000 * float(np.percentile(latency, 95)), 2),
            "nfe": int(sum(p.stats["nfe"] for p in pieces)), "cache_frames": int(pieces[-1].stats["cache_frames"]),
            "cache_kib": round(max(p.stats["cache_bytes"] for p in pieces) / 1024, 1),
            "switch_frames": [p.start for p in pieces if p.stats["switched"]], **settings}


def write_video(frames: np.ndarray, path: str | Path, fps: int = 16, scale: int = 8) -> Path:
    """(F, H, W, 3) uint8 frames to ``path`` (``.mp4`` or ``.gif``) through the pipeline's writer
    (``save_video``: ``scale`` times larger, nearest neighbour; a temporary file renamed into place)."""
    import PIL.Image

    from ..pipelines import save_video

    check(isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.shape[-1] == 3 and frames.dtype == np.uint8,
          "frames", "an (F, H, W, 3) uint8 array", getattr(frames, "shape", frames))
    return save_video([PIL.Image.fromarray(f) for f in frames], path, fps=fps, scale=scale)


VIDEO_FORMATS = ("mp4", "gif")
"""A video job's ``format``: its file's type."""


def _check_job(params: dict, method: str, knobs: dict, base) -> None:
    """A batch video job's length, prompt switches (as ``(frame, prompt)`` pairs after the first
    prompt, in place), cache-mode knobs, file format, fps and scale."""
    check(1 <= params["frames"] <= VIDEO_MAX_FRAMES, "frames", f"an int in [1, {VIDEO_MAX_FRAMES}]", params["frames"])
    params["switches"] = video_schedule(params["prompt"], params["switches"], params["frames"])[1:]
    check_video_knobs(method, knobs)
    check(params["format"] in VIDEO_FORMATS, "format", "one of " + ", ".join(map(repr, VIDEO_FORMATS)),
          params["format"])
    check(1 <= params["fps"] <= 120, "fps", "an int in [1, 120]", params["fps"])
    check(1 <= params["scale"] <= 32, "scale", "an int in [1, 32]", params["scale"])


def _run_jobs(models: Models, jobs: list[dict], seeds: list[int], method: str, knobs: dict | None) -> list[Result]:
    return [run_video(models, j["prompt"], seed, j["frames"], method, knobs, j["switches"])
            for j, seed in zip(jobs, seeds)]


register(ModalitySpec(
    "video", title="Streaming video", pipeline="StreamingVideoPipeline", batchable=video_batchable,
    run_jobs=_run_jobs,
    job_fields={"prompt": JobField(str, required=True), "frames": JobField(int, 48), "switches": JobField(list, ()),
                "format": JobField(str, "mp4"), "fps": JobField(int, 16), "scale": JobField(int, 8)},
    per_job=("prompt", "switches"), output_ext=".mp4", default_method="rolling", check_job=_check_job,
    generate="mmspec.commands.generate:VIDEO", demo_tab="video_tab", device_check="mmspec.bench.gpu_check:VideoCheck"))
