"""Streaming video generation (``"video"``): the cache modes of ``StreamingVideoPipeline`` as the
modality's methods, so the demo, ``mmspec batch`` and the CLI take their names and knobs from the
registry like every other modality.

Methods (one part each, listed first the default): ``rolling`` (attention sinks + a rolling
window: the video adapter's ``VideoChunkCache``, the core's ``SinkWindowCache`` with Self-Forcing's
chunk writes on top; StreamingLLM's sinks),
``window-recompute`` (no K/V kept: every denoising step re-encodes sinks + window from scratch,
StreamingLLM's recompute baseline), ``full-cache`` (the cache grows; stops short of the RoPE
range) and ``no-sink`` (the window alone: the attention-sink ablation). ``pipelines/video.py``
says what each does. Knobs keep the pipeline's argument names (``sink_frames``, ...), so
``stream_kwargs(recipe)`` is the pipeline call's keyword arguments. ``None`` means the model's
own value (its config: the sizes it was trained with, its sampling steps and guidance).

The registry's part kinds are the speculation core's (schedule, drafter, rule); a cache mode is
none of them exactly. It is registered as a ``"schedule"`` part, the kind that decides what each
step computes (the architecture lists the video chunk order there), and composing two modes is
refused by the one-part-per-kind rule. No mode is marked lossless: they are not speculative
decoding, and they differ in what each chunk sees (``window-recompute`` equals ``rolling`` only
for a one-layer model or before the first eviction). Components: ``target`` (the
``VideoDiTModel``); ``build`` returns the same dict as ``stream_kwargs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.errors import check
from .knobs import check_config, knob
from .registry import MethodRecipe, register_method, register_modality, register_part

MODALITY = "video"
register_modality(MODALITY, components=("target",),
                  doc="streaming video: chunk-causal video diffusion over the core's attention-sink rolling cache")


@dataclass(frozen=True)
class FullCacheConfig:
    """A cache that keeps every frame (no eviction), up to the transformer's RoPE range.

    Args:
        num_inference_steps: Euler steps per chunk (None: the model's, 8 for the bundled one).
        guidance_scale: classifier-free guidance, 1 disables it (None: the model's, 3.5 for the bundled one).
        recache_sink: at a prompt switch, re-encode the sink frames under the new prompt too
            (LongLive's re-cache; True, as trained) or keep their old K/V (False).
    """

    num_inference_steps: int | None = knob(None, min=1)
    guidance_scale: float | None = knob(None, min=0.0)
    recache_sink: bool = True

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class NoSinkConfig:
    """A rolling window without sink frames (the attention-sink ablation).

    Args:
        window_frames: recent frames kept, a multiple of the model's chunk (None: as trained, 9).
        num_inference_steps: Euler steps per chunk (None: the model's, 8 for the bundled one).
        guidance_scale: classifier-free guidance, 1 disables it (None: the model's, 3.5 for the bundled one).
        recache_sink: at a prompt switch, re-encode the kept frames under the new prompt (True)
            or keep their old K/V (False).
    """

    window_frames: int | None = knob(None, min=1)
    num_inference_steps: int | None = knob(None, min=1)
    guidance_scale: float | None = knob(None, min=0.0)
    recache_sink: bool = True

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class SinkWindowConfig:
    """Sink frames plus a window of recent frames (StreamingLLM's attention sinks).

    Args:
        sink_frames: first frames kept for the whole stream, a multiple of the model's chunk
            (None: as trained, 3).
        window_frames: recent frames kept, a multiple of the model's chunk (None: as trained, 9).
        num_inference_steps: Euler steps per chunk (None: the model's, 8 for the bundled one).
        guidance_scale: classifier-free guidance, 1 disables it (None: the model's, 3.5 for the bundled one).
        recache_sink: at a prompt switch, re-encode the sink frames under the new prompt too
            (LongLive's re-cache; True, as trained) or keep their old K/V (False).
    """

    sink_frames: int | None = knob(None, min=0)
    window_frames: int | None = knob(None, min=1)
    num_inference_steps: int | None = knob(None, min=1)
    guidance_scale: float | None = knob(None, min=0.0)
    recache_sink: bool = True

    def __post_init__(self):
        check_config(self)


CACHE_MODES = {
    "rolling": (SinkWindowConfig, "the core's SinkWindowCache with the video adapter's chunk writes on top: "
                "sink frames + a rolling window, K/V cached (Self-Forcing's chunk writes, StreamingLLM's sinks); "
                "flat latency and memory"),
    "window-recompute": (SinkWindowConfig, "no K/V kept: every denoising step re-encodes sinks + window "
                         "(StreamingLLM's sliding window with recompute baseline)"),
    "full-cache": (FullCacheConfig, "every frame kept, up to the transformer's RoPE range (288 frames for "
                   "the bundled model)"),
    "no-sink": (NoSinkConfig, "the rolling window without sink frames (the attention-sink ablation)"),
}
"""Cache mode -> (its config, one line); the pipeline's ``CACHE_MODES``, the default first."""


def stream_kwargs(recipe: MethodRecipe) -> dict:
    """``StreamingVideoPipeline.stream`` keyword arguments of a resolved video recipe:
    ``cache_mode`` and the mode's knobs (``None`` knobs are left to the pipeline's defaults)."""
    check(isinstance(recipe, MethodRecipe) and recipe.modality == MODALITY, "recipe", "a resolved 'video' recipe",
          recipe)
    mode = recipe.part("schedule")
    check(mode in CACHE_MODES, "method", "one of the cache modes " + ", ".join(map(repr, CACHE_MODES)),
          recipe.name)
    return {"cache_mode": mode, **dataclasses.asdict(recipe.configs[mode])}


for _mode, (_config, _doc) in CACHE_MODES.items():
    register_part(name=_mode, kind="schedule", config=_config, prefixed=False, lossless=False, doc=_doc,
                  build=lambda cfg, c, mode=_mode: {"cache_mode": mode, **dataclasses.asdict(cfg)},
                  modalities=(MODALITY,))
    register_method(_mode, doc=_doc, modalities=(MODALITY,))
