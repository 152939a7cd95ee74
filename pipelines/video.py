"""``StreamingVideoPipeline``: prompt-conditioned streaming video generation, chunk by chunk, over
the core's attention-sink rolling KV cache (diffusers conventions).

::

    pipe = StreamingVideoPipeline.from_pretrained("assets/video")
    out = pipe("a red circle moving right", num_frames=96, generator=torch.Generator().manual_seed(0))
    export_to_video(out.frames[0], "clip.mp4", fps=16)
    for chunk in pipe.stream(prompts=[(0, "a red circle moving right"), (48, "a blue square moving up")],
                             num_frames=None):  # unbounded: stop when you like
        show(chunk.frames)

The one loop is ``stream``; ``__call__`` collects it. Per chunk of ``chunk_frames`` latent frames
(for the bundled model one latent frame per video frame: its autoencoder does not compress time;
Wan's VAE decodes the first latent frame to 1 and each later one to 4): fresh noise, a few
denoising steps through the ``scheduler`` (diffusers' ``FlowMatchEulerDiscreteScheduler``: Euler
steps of the flow ODE, or Self-Forcing's re-noising for Wan) with classifier-free guidance when
the scale is not 1 (``mmspec.adapters.video.FlowSampler``), then the cache commit, then the
decoder decodes the chunk and it is yielded. ``StreamingVideoPipeline.from_wan`` streams diffusers'
Wan classes through ``mmspec.adapters.video_wan``. The sampler, the cache contexts and the
re-cache live in ``mmspec.adapters.video``, written once for every video model. How a chunk sees
the past is the ``cache_mode``:

- ``"rolling"`` (default): the video adapter's ``VideoChunkCache`` on the core's
  ``SinkWindowCache`` (``sample_chunk``): Self-Forcing's
  write semantics (every denoising step overwrites the chunk's slots, a clean t = 0 pass leaves
  its K/V), StreamingLLM's sink frames (the first ``sink_frames``) plus a window of the last
  ``window_frames``, keys stored before RoPE and rotated by cache order, so positions stay below
  sink + window + one chunk however long the stream: latency and memory per chunk are flat.
- ``"window-recompute"``: no K/V kept between denoising steps; every step re-encodes the same
  visible frames (sink + window, their clean latents) from scratch together with the chunk
  (StreamingLLM's sliding window with recompute baseline). Same positions and visibility as
  ``"rolling"``; a one-layer model gives the same outputs (within float rounding), a deeper one
  too until the first eviction (after it the cached K/V of deeper layers still carry evicted
  frames, the recompute's do not).
- ``"full-cache"``: the cache grows without eviction, keys at their absolute frame index. It
  stops at ``max_frames("full-cache")`` frames (288 for the bundled model): one more chunk would
  put keys past the model's ``rope_frames``, where the time rotation wraps around. A ``num_frames``
  past that is refused up front; an unbounded stream yields every chunk that fits, then raises
  ``CacheLimitError``. Its storage doubles whenever it fills (``VideoChunkCache.grow``; ``cache_bytes``
  grows with the stream).
- ``"no-sink"``: the window alone (``sink_frames`` 0): the attention-sink ablation.

A prompt schedule ``prompts=[(0, text), (start, text), ...]`` switches prompts at chunk
boundaries, starts counted in video frames (a start off the boundaries is refused, naming the two
nearest). At a switch, LongLive's re-cache (``recache``) recomputes the kept frames' K/V from
their clean latents under the new prompt, so the new prompt takes hold within a chunk or two
without a jump; ``recache_sink`` says whether the sink is recomputed too (default True: the
recipe trains switched clips under the new prompt on every frame, context included, which is
what a re-cache of the whole visible set gives) or keeps the old prompt's K/V. Wan's
``"longlive"`` preset re-caches as LongLive's code does instead (``CachedStream``'s
``recache_rule``).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from ..adapters.video import (RECACHE_RULES, SAMPLERS, CacheLimitError, CachedStream, FlowSampler, RecomputeStream,
                              frame_limit)
from ..adapters.video_wan import POSITION_POLICIES, WanStreamingDecoder, WanVideoModel, check_window, encode_prompts
from ..core.errors import check, check_choice
from . import checks
from .base import PipelineBase, onload
# diffusers loads components only from modules already imported: name them here
from ..models import video_ae as _video_ae, video_dit as _video_dit  # noqa: F401

CACHE_MODES = ("rolling", "window-recompute", "full-cache", "no-sink")
OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclass
class VideoChunk:
    """One chunk of a stream.

    Attributes:
        frames: by ``output_type``: ``"pt"`` (B, n, 3, H, W) float in [0, 1], ``"np"`` (B, n, H,
            W, 3) float in [0, 1], ``"pil"`` B lists of n images, ``"latent"`` the latents.
        frame_indices: the indices of these n frames in the whole video: video frames (Wan: the
            first chunk's 3 latent frames decode to frames 0 .. 8, each later chunk to 12 more),
            latent frames for ``output_type="latent"``.
        latents: (B, n, C, h, w) the clean latents.
        prompts: the prompt text of each row in force for this chunk.
        stats: ``latency_s`` (wall time of this chunk: re-cache, denoising, commit, decode and
            conversion), ``cache_frames`` (frames the cache holds after it), ``cache_bytes``
            (bytes the cache object holds between chunks: K/V buffers and kept clean latents;
            ``"window-recompute"`` keeps only latents and prompt ids), ``switched`` (a prompt
            switch re-cache ran before this chunk), ``nfe`` (transformer passes for this chunk, a
            guided pass over both halves counting once).
    """

    frames: list | np.ndarray | torch.Tensor
    frame_indices: range
    latents: torch.Tensor
    prompts: list[str]
    stats: dict


@dataclass
class StreamingVideoPipelineOutput(BaseOutput):
    """``frames``: ``"pil"`` B lists of PIL images, ``"np"`` (B, F, H, W, 3) and ``"pt"`` (B, F, 3,
    H, W) floats in [0, 1], ``"latent"`` (B, F, C, h, w). ``stats``: ``frames``, ``chunks``,
    ``wall_seconds``, ``latency_s`` (per chunk), ``nfe``, ``cache_frames`` (after the last chunk),
    ``cache_bytes`` (the largest), ``switch_frames`` (frames where a re-cache ran), and the
    resolved ``cache_mode``, ``sink_frames``, ``window_frames``, ``num_inference_steps``,
    ``guidance_scale``, ``recache_sink``."""

    frames: list | np.ndarray | torch.Tensor
    stats: dict = field(default_factory=dict)


@dataclass
class _Setup:
    """The checked, resolved arguments of one stream."""

    schedule: list[tuple[int, list[str]]]  # (start frame, texts)
    num_frames: int | None
    generator: torch.Generator | list[torch.Generator] | None
    guidance_scale: float
    steps: int
    sink: int
    window: int | None  # None: every frame so far (Wan's window_frames=-1)
    cache_mode: str
    recache_sink: bool
    output_type: str
    callback: Callable | None
    tensor_inputs: tuple[str, ...]
    latent_shape: tuple[int, int, int]  # (C, h, w) of one latent frame
    sampler: str  # FlowSampler's rule
    sigmas: list[float] | None  # explicit sigmas (None: uniform, shifted by the scheduler)
    model_times: list[float] | None = None  # flow times the model is told, where not the sigmas (CausVid)
    video_latents: torch.Tensor | None = None  # (B, F, C, h, w) clean latents to start chunks from
    strength: float = 1.0
    latents: torch.Tensor | None = None  # (B, F, C, h, w) the chunks' initial noise, given
    recache_rule: str = "prefill"  # CachedStream's prompt-switch re-cache (Wan's stream settings)

    @property
    def batch_size(self) -> int:
        return len(self.schedule[0][1])


WAN_STREAM_DEFAULTS = dict(position_policy="cache-order", sink_frames=3, window_frames=12, num_inference_steps=4,
                           guidance_scale=1.0, sampler="renoise", sigmas=[1.0, 0.9375, 0.8333, 0.625], height=480,
                           width=832, max_text_length=512, recache_rule="prefill", model_times=None)
"""``from_wan``'s stream settings without a ``preset`` (``chunk_frames`` has no default there):
this project's choice for unbounded streams, not any released setting: cache-order positions (the
stream never runs out of RoPE positions), a sink of 3 and a window of 12 latent frames, and
Self-Forcing's four-step sampler (its warped sigmas, rounded to 4 digits; distilled, so no
guidance), 480 x 832 pixels, 512 text tokens, a prompt switch re-caching the kept frames as a
fresh prefill would. The released settings are ``WAN_STREAM_PRESETS``."""

_SIGMAS_SHIFT5 = [1.0, 0.9375, 5 / 6, 0.625]
"""Self-Forcing's and LongLive's ``denoising_step_list`` [1000, 750, 500, 250] warped
(``warp_denoising_step: true``: ``timesteps[1000 - t]`` of ``FlowMatchScheduler(shift=5.0,
extra_one_step=True)``'s 1,000-step table): timesteps 1000, 937.5, 833.33, 625."""

WAN_STREAM_PRESETS = {
    # guandeh17/Self-Forcing @ 33593df: configs/self_forcing_dmd.yaml (num_frame_per_block: 3 l.48;
    # denoising_step_list l.7-11, warp_denoising_step: true l.12, timestep_shift: 5.0 l.15/51);
    # no sink or window in the configs, so utils/wan_wrapper.py's defaults local_attn_size=-1,
    # sink_size=0 (l.121-122): a KV cache of 32760 tokens = 21 frames of 1560
    # (pipeline/causal_inference.py l.288, l.34), chunk included: sink 0, window 18; absolute
    # frame positions (wan/modules/causal_model.py l.195); the clean pass at context_noise 0
    # (configs/default_config.yaml l.10); no unconditional pass in pipeline/causal_inference.py
    # (distilled: guidance 1).
    "self-forcing": dict(chunk_frames=3, sink_frames=0, window_frames=18, position_policy="absolute",
                         num_inference_steps=4, sigmas=_SIGMAS_SHIFT5, guidance_scale=1.0, sampler="renoise",
                         height=480, width=832, max_text_length=512),
    # NVlabs/LongLive, branch v1.0 @ e52d9ef: configs/longlive_inference.yaml (denoising_step_list
    # l.1-5, warp l.6, num_frame_per_block: 3 l.7, local_attn_size: 12 l.10, timestep_shift: 5.0
    # l.11, sink_size: 3 l.12, context_noise: 0 l.25): a chunk attends to the 3 sink frames and the
    # last 12 - 3 = 9 frames of the cache, itself included (wan/modules/causal_model.py l.323-333):
    # sink 3, window 6; absolute positions (l.207). A prompt switch re-caches as
    # pipeline/interactive_causal_inference.py l.34-96 does with global_sink: true (l.24 of the
    # config): its last local_attn_size frames in one pass with no mask (CachedStream's "longlive").
    "longlive": dict(chunk_frames=3, sink_frames=3, window_frames=6, position_policy="absolute",
                     num_inference_steps=4, sigmas=_SIGMAS_SHIFT5, guidance_scale=1.0, sampler="renoise",
                     height=480, width=832, max_text_length=512, recache_rule="longlive"),
    # tianweiy/CausVid @ ca21150: configs/wan_causal_dmd.yaml (denoising_step_list 1000, 757, 522,
    # 0 l.14-18, the 0 dropped by causvid/models/wan/causal_inference.py l.27; num_frame_per_block:
    # 3 l.52; warp_denoising_step: false l.53); no sink or window: global attention over a
    # 32760-token (21-frame) cache (causal_inference.py l.56; causal_model.py l.136-143), so sink
    # 0, window 18 (CausVid itself stops at 21 frames; this stream rolls past them); absolute
    # positions. CausVid feeds the model timesteps 757 and 522 (causal_inference.py l.147-150) but
    # converts to x0 and re-noises with its scheduler's nearest table sigma
    # (models/wan/wan_wrapper.py l.104-107: FlowMatchScheduler(shift=8.0, sigma_min=0.0,
    # extra_one_step=True) over 1,000 steps; l.135-137 and flow_match.py's add_noise take the
    # argmin): 8 s / (1 + 7 s) at s = 0.28 and 0.12, i.e. 28/37 = 0.756757 and 12/23 = 0.521739.
    "causvid": dict(chunk_frames=3, sink_frames=0, window_frames=18, position_policy="absolute",
                    num_inference_steps=3, sigmas=[1.0, 28 / 37, 12 / 23], model_times=[1.0, 0.757, 0.522],
                    guidance_scale=1.0, sampler="renoise", height=480, width=832, max_text_length=512),
}
"""Named stream settings of the released causal Wan2.1-T2V-1.3B fine-tunes, from their code and
configs (each value's file and line in the comment above): ``from_wan(..., preset=name)``. Sink
and window count latent frames a chunk sees besides itself."""


class StreamingVideoPipeline(PipelineBase):
    """Chunk-causal video diffusion over latent frames, streamed.

    Two families behind one adapter (``mmspec.adapters.video``), as the AR image pipeline serves
    several model families:

    - the bundled model: ``vae`` (``FrameAutoencoder``: frames <-> normalized latents, one frame
      at a time) and ``transformer`` (``VideoDiTModel``: the chunk-causal flow-matching DiT; its
      config holds the prompt vocabulary and the stream defaults);
    - diffusers' Wan (``from_wan``): ``transformer`` (``WanTransformer3DModel``, a causal
      fine-tune: Self-Forcing, CausVid, LongLive), ``vae`` (``AutoencoderKLWan``, decoded chunk by
      chunk with its causal feature cache: the first latent frame gives 1 video frame, each later
      one 4), ``text_encoder`` (UMT5) and ``tokenizer``, streamed by
      ``mmspec.adapters.video_wan.WanVideoModel``; the stream settings the checkpoint was trained
      with are the pipeline's ``stream_config`` (saved in ``model_index.json``).

    ``scheduler``: diffusers' ``FlowMatchEulerDiscreteScheduler`` (its ``shift`` shifts the
    sigmas; default: one with the bundled transformer's ``time_shift``, or shift 1 for Wan).
    ``num_frames`` and the prompt schedule count video frames, as diffusers does (for Wan
    ``4k + 1``, 81 frames being 21 latent frames; ``num_latent_frames`` takes latent frames);
    ``sink_frames`` and ``window_frames`` count latent frames (what the cache holds). The bundled
    model's autoencoder codes each video frame alone: one latent frame per video frame. The module
    docstring describes the loop, the cache modes and the prompt switch.
    """

    # the text encoder, then the transformer: the VAE decodes every chunk between the transformer's
    # chunks, so chained it would send the transformer out and back every chunk; unchained, it joins
    # at its first decode and everything leaves when the stream ends
    model_cpu_offload_seq = "text_encoder->transformer"
    _optional_components = ["scheduler", "text_encoder", "tokenizer"]
    _callback_tensor_inputs = ["latents"]

    def __init__(self, vae, transformer, scheduler: FlowMatchEulerDiscreteScheduler | None = None,
                 text_encoder=None, tokenizer=None, stream_config: dict | None = None):
        super().__init__()
        wan = isinstance(transformer, WanTransformer3DModel)
        if wan:
            stream_config = _check_wan_parts(vae, text_encoder, tokenizer, stream_config, transformer)
        else:
            check(stream_config is None, "stream_config",
                  "None for the bundled VideoDiTModel (its config holds the stream defaults)", stream_config)
            for name, part in (("text_encoder", text_encoder), ("tokenizer", tokenizer)):
                check(part is None, name, "None for the bundled VideoDiTModel (prompts are parsed to ids)",
                      type(part).__name__)
        if scheduler is None:
            scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0 if wan else float(transformer.config.time_shift))
        check(isinstance(scheduler, FlowMatchEulerDiscreteScheduler), "scheduler",
              "a FlowMatchEulerDiscreteScheduler (flow-matching sigmas)", type(scheduler).__name__)
        self.register_modules(vae=vae, transformer=transformer, scheduler=scheduler, text_encoder=text_encoder,
                              tokenizer=tokenizer)
        self.register_to_config(stream_config=stream_config)
        # the adapter's video model: the DiT itself, or Wan behind its cache processors
        self.video_model = WanVideoModel(transformer, chunk_frames=stream_config["chunk_frames"],
                                         position_policy=stream_config["position_policy"]) if wan else transformer
        self.video_processor = VideoProcessor(do_resize=False, do_normalize=True)

    @classmethod
    def from_wan(cls, transformer, vae, text_encoder, tokenizer, scheduler=None, *, preset: str | None = None,
                 chunk_frames: int | None = None, **stream_config) -> "StreamingVideoPipeline":
        """A stream over diffusers' Wan classes, e.g. a Self-Forcing checkpoint
        (``load_original_wan`` reads its original key names). ``preset``: the released settings of
        ``"self-forcing"``, ``"longlive"`` or ``"causvid"`` (``WAN_STREAM_PRESETS``), chunk
        included. ``chunk_frames``: the latent frames per chunk the checkpoint was trained with
        (3 for Self-Forcing, CausVid and LongLive), required without a preset: a bidirectional Wan
        (Wan2.1-T2V itself) cannot stream chunk by chunk. ``stream_config`` overrides the preset
        or ``WAN_STREAM_DEFAULTS`` (``position_policy``, ``sink_frames``, ``window_frames``,
        ``num_inference_steps``, ``guidance_scale``, ``sampler``, ``sigmas``, ``model_times``
        (``FlowSampler``'s), ``height``, ``width``, ``max_text_length``, ``recache_rule``
        (``CachedStream``'s: ``"prefill"`` or ``"longlive"``)). Every setting is checked here,
        against the transformer too (its RoPE table), before anything is built."""
        check(isinstance(transformer, WanTransformer3DModel), "transformer", "a diffusers WanTransformer3DModel",
              type(transformer).__name__)
        check(preset is None or preset in WAN_STREAM_PRESETS, "preset",
              "None or one of " + ", ".join(repr(p) for p in WAN_STREAM_PRESETS), preset)
        base = dict(WAN_STREAM_DEFAULTS, **WAN_STREAM_PRESETS.get(preset, {}))
        preset_chunk = base.pop("chunk_frames", None)
        chunk_frames = preset_chunk if chunk_frames is None else chunk_frames
        check(chunk_frames is not None, "chunk_frames",
              "the latent frames per chunk the causal checkpoint was trained with (3 for Self-Forcing, CausVid, "
              "LongLive; or a preset): a bidirectional Wan cannot stream", chunk_frames)
        config = dict(base, **stream_config, chunk_frames=chunk_frames)
        return cls(vae=vae, transformer=transformer, scheduler=scheduler, text_encoder=text_encoder,
                   tokenizer=tokenizer, stream_config=config)

    @property
    def is_wan(self) -> bool:
        return isinstance(self.video_model, WanVideoModel)

    @property
    def chunk_frames(self) -> int:
        return self.video_model.chunk_frames if self.is_wan else self.transformer.config.chunk_frames

    def stream_defaults(self) -> dict:
        """The settings a stream takes when an argument is None: ``sink_frames``,
        ``window_frames``, ``num_inference_steps``, ``guidance_scale``, ``sampler``, ``sigmas``
        (None: uniform, shifted by the scheduler), ``height``, ``width`` (pixels)."""
        if self.is_wan:
            return dict(self.config.stream_config)
        cfg, size = self.transformer.config, self.vae.config.sample_size
        return dict(sink_frames=cfg.sink_frames, window_frames=cfg.window_frames,
                    num_inference_steps=cfg.sample_steps, guidance_scale=cfg.guidance_scale, sampler="euler",
                    sigmas=None, height=size, width=size)

    def max_frames(self, cache_mode: str = "rolling") -> int | None:
        """Frames a stream in ``cache_mode`` can produce: None (unbounded) except for
        ``"full-cache"``, which stops one chunk short of the model's ``rope_frames``."""
        check_choice("cache_mode", cache_mode, CACHE_MODES)
        if cache_mode != "full-cache":
            return None
        return frame_limit(self.video_model)

    @property
    def temporal_scale(self) -> int:
        """Video frames per latent frame past the first: Wan's VAE's ``scale_factor_temporal`` (4:
        latent frame 0 decodes to 1 video frame, each later one to 4), 1 for the bundled model
        (its autoencoder codes each video frame alone)."""
        return int(self.vae.config.scale_factor_temporal) if self.is_wan else 1

    def video_frames(self, latent_frames: int) -> int:
        """Video frames ``latent_frames`` latent frames decode to (Wan: 21 -> 81; the bundled
        model: the same count)."""
        return _video_frames(latent_frames, self.temporal_scale)

    def _frames_text(self, latent_frames: int | None) -> str:
        if latent_frames is None or not self.is_wan:
            return str(latent_frames)
        return f"{self.video_frames(latent_frames)} video frames ({latent_frames} latent)"

    def _latent_count(self, num_frames, num_latent_frames) -> int | None:
        """Latent frames from ``num_frames`` (video frames; Wan: ``4k + 1``, as diffusers'
        ``WanPipeline`` counts them) or ``num_latent_frames``, at most one given (None: neither)."""
        checks.check_int(num_frames, "num_frames", 1, optional=True)
        checks.check_int(num_latent_frames, "num_latent_frames", 1, optional=True)
        check(num_frames is None or num_latent_frames is None, "num_latent_frames",
              "None when num_frames is given (one count: video frames, or latent frames)", num_latent_frames)
        if num_frames is None:
            return num_latent_frames
        r = self.temporal_scale
        low = (num_frames - 1) // r * r + 1
        check((num_frames - 1) % r == 0, "num_frames",
              f"{r}k + 1 video frames, as diffusers' WanPipeline takes them (the first latent frame decodes to 1 "
              f"frame, each later one to {r}): e.g. {low} or {low + r}; or num_latent_frames", num_frames)
        return (num_frames - 1) // r + 1

    # -- inputs -----------------------------------------------------------------------------------
    def check_inputs(self, prompt, prompts, num_frames, generator, guidance_scale, num_inference_steps, sink_frames,
                     window_frames, cache_mode, recache_sink, output_type, callback_on_step_end,
                     callback_on_step_end_tensor_inputs, height=None, width=None, video_latents=None,
                     strength=1.0, latents=None, num_latent_frames=None) -> _Setup:
        """Every argument of ``stream``, checked before any model runs: ``ValueError`` naming the
        argument and the allowed values. Returns them resolved (defaults from
        ``stream_defaults``; the bundled model's prompts parsed, which checks their words)."""
        defaults, C = self.stream_defaults(), self.chunk_frames
        check_choice("cache_mode", cache_mode, CACHE_MODES)
        checks.check_output_type(output_type, OUTPUT_TYPES)
        video_frames = num_frames
        num_frames = self._latent_count(num_frames, num_latent_frames)
        if video_frames is None and num_frames is not None:
            video_frames = self.video_frames(num_frames)
        check((prompt is None) != (prompts is None), "prompt", "exactly one of prompt and prompts (a schedule)",
              {"prompt": prompt, "prompts": prompts})
        if prompt is not None:
            schedule = [(0, checks.check_prompts(prompt, "prompt"))]
        else:
            schedule = _check_schedule(prompts, video_frames, C, self.temporal_scale)
        if not self.is_wan:
            for _, texts in schedule:
                self.transformer.encode_prompts(texts)  # refuses words outside the prompt vocabulary
        latent_shape = self._latent_shape(height, width, defaults)
        checks.check_int(num_inference_steps, "num_inference_steps", 1, optional=True)
        checks.check_number(guidance_scale, "guidance_scale", 0, optional=True)
        check(recache_sink is None or isinstance(recache_sink, bool), "recache_sink", "None, True or False",
              recache_sink)
        rule = defaults.get("recache_rule", "prefill")
        check(rule == "prefill" or recache_sink is None, "recache_sink",
              "None under recache_rule='longlive' (LongLive's re-cache decides: the sink keeps its K/V once the "
              "cache has rolled)", recache_sink)
        check(rule == "prefill" or cache_mode != "window-recompute", "cache_mode",
              "'rolling', 'no-sink' or 'full-cache' under recache_rule='longlive' (a re-cache of the rolling cache)",
              cache_mode)
        R = self.video_model.rope_frames
        if cache_mode == "full-cache":
            for name, value in (("sink_frames", sink_frames), ("window_frames", window_frames)):
                check(value is None, name, "None with cache_mode='full-cache' (it keeps every frame)", value)
            sink, window = 0, None
            caps = [(self.max_frames(cache_mode), "with cache_mode='full-cache' (past it keys would leave the "
                     f"{R} frame positions the transformer's RoPE tells apart)")]
        else:
            caps = []
            if cache_mode == "no-sink":
                check(sink_frames in (None, 0), "sink_frames", "None or 0 with cache_mode='no-sink'", sink_frames)
                sink = 0
            else:
                sink = defaults["sink_frames"] if sink_frames is None else sink_frames
            window = defaults["window_frames"] if window_frames is None else window_frames
            if self.is_wan:  # frame-granular, as the released causal Wan fine-tunes count them
                window = check_window(C, sink, window, R)
                if window is None:  # a window of every frame grows as full-cache's cache
                    caps.append((self.max_frames("full-cache"), "with window_frames=-1 (every frame so far: past it "
                                 f"keys would leave the {R} frame positions the transformer's RoPE tells apart)"))
            else:  # the bundled model streams whole chunks (its training windows)
                check(checks.is_int(sink) and sink >= 0 and sink % C == 0, "sink_frames",
                      f"None or a multiple of chunk_frames ({C}), >= 0", sink)
                check(checks.is_int(window) and window >= C and window % C == 0, "window_frames",
                      f"None or a positive multiple of chunk_frames ({C}) (every frame so far, -1, is Wan's; "
                      "here cache_mode='full-cache')", window)
                check(sink + window + C <= R, "sink_frames + window_frames",
                      f"at most {R - C} frames: with a chunk of {C} the frames a chunk sees must stay within the "
                      f"{R} frame positions the transformer's RoPE tells apart", sink + window)
        if self.is_wan and self.video_model.position_policy == "absolute":
            check(cache_mode in ("rolling", "no-sink", "full-cache"), "cache_mode",
                  "'rolling', 'no-sink' or 'full-cache' under position_policy='absolute' (keys stored at their "
                  "absolute frame index; the recompute baseline re-encodes frames at cache-order positions)",
                  cache_mode)
            caps.append((R, "under position_policy='absolute' (the frames Wan's RoPE table holds; 'cache-order' "
                         "streams without bound)"))
        B = len(schedule[0][1])
        checks.check_number(strength, "strength", 0, 1, low_open=True)
        if video_latents is not None:
            check(isinstance(video_latents, torch.Tensor) and video_latents.dim() == 5
                  and video_latents.shape[0] == B and tuple(video_latents.shape[2:]) == tuple(latent_shape)
                  and (num_frames is None or video_latents.shape[1] >= num_frames), "video_latents",
                  f"None or a ({B}, frames, {', '.join(map(str, latent_shape))}) tensor of clean latents with at "
                  "least num_frames frames", getattr(video_latents, "shape", type(video_latents).__name__))
            num_frames = video_latents.shape[1] if num_frames is None else num_frames
        check(strength == 1 or video_latents is not None, "strength",
              "1 without video_latents (a lower strength starts chunks from them)", strength)
        if latents is not None:
            need = None if num_frames is None else -(-num_frames // C) * C
            check(isinstance(latents, torch.Tensor) and latents.dim() == 5 and latents.shape[0] == B
                  and tuple(latents.shape[2:]) == tuple(latent_shape) and latents.shape[1] % C == 0
                  and latents.is_floating_point() and (need is None or latents.shape[1] >= need), "latents",
                  f"None or a ({B}, frames, {', '.join(map(str, latent_shape))}) float tensor of initial noise, frames "
                  f"a multiple of chunk_frames ({C})" + ("" if need is None else f" and at least {need}"),
                  getattr(latents, "shape", type(latents).__name__))
            num_frames = latents.shape[1] if num_frames is None else num_frames
        for cap, why in caps:  # after latents and video_latents, which may set num_frames
            check(num_frames is None or num_frames <= cap, "num_frames", f"None or at most {self._frames_text(cap)} "
                  + why, self._frames_text(num_frames))
        check(num_frames is None or schedule[-1][0] < num_frames, "prompts",
              f"start frames below the video's {self._frames_text(num_frames)}", [start for start, _ in schedule])
        checks.check_generator(generator, B)
        inputs = self.check_callback(callback_on_step_end, callback_on_step_end_tensor_inputs)
        steps = defaults["num_inference_steps"] if num_inference_steps is None else num_inference_steps
        return _Setup(schedule=schedule, num_frames=num_frames, generator=generator,
                      guidance_scale=float(defaults["guidance_scale"] if guidance_scale is None else guidance_scale),
                      steps=steps, sampler=defaults["sampler"],
                      # the configured sigma list is for its own step count; other counts take uniform sigmas
                      sigmas=defaults["sigmas"] if steps == defaults["num_inference_steps"] else None,
                      model_times=defaults.get("model_times") if steps == defaults["num_inference_steps"] else None,
                      sink=sink, window=window, cache_mode=cache_mode,
                      recache_sink=True if recache_sink is None else recache_sink, output_type=output_type,
                      callback=callback_on_step_end, tensor_inputs=tuple(inputs), latent_shape=latent_shape,
                      video_latents=video_latents, strength=float(strength), latents=latents, recache_rule=rule)

    def _latent_shape(self, height, width, defaults: dict) -> tuple[int, int, int]:
        """(C, h, w) of a latent frame for a video of ``height`` x ``width`` pixels (None: the
        default); the bundled model has one size."""
        if not self.is_wan:
            cfg, size = self.transformer.config, defaults["height"]
            for name, value in (("height", height), ("width", width)):
                check(value is None or value == size, name, f"None or {size} (the bundled model's frame size)", value)
            return cfg.latent_channels, cfg.latent_size, cfg.latent_size
        scale, patch = self.vae.config.scale_factor_spatial, self.video_model.patch
        sizes = []
        for name, value in (("height", height), ("width", width)):
            value = defaults[name] if value is None else value
            check(checks.is_int(value) and value >= 1 and value % (scale * patch) == 0, name,
                  f"None or a positive multiple of {scale * patch} (the VAE's {scale}x downsampling times the "
                  f"transformer's {patch}x{patch} patches)", value)
            sizes.append(value // scale)
        return self.video_model.latent_channels, sizes[0], sizes[1]

    # -- the loop ---------------------------------------------------------------------------------
    def stream(self, prompt: str | list[str] | None = None, prompts: list | None = None, num_frames: int | None = None,
               generator: torch.Generator | list[torch.Generator] | None = None, guidance_scale: float | None = None,
               num_inference_steps: int | None = None, sink_frames: int | None = None,
               window_frames: int | None = None, cache_mode: str = "rolling", recache_sink: bool | None = None,
               output_type: str = "pt", callback_on_step_end: Callable | None = None,
               callback_on_step_end_tensor_inputs: list[str] = ("latents",), height: int | None = None,
               width: int | None = None, video_latents: torch.Tensor | None = None,
               strength: float = 1.0, latents: torch.Tensor | None = None,
               num_latent_frames: int | None = None) -> Iterator[VideoChunk]:
        """Generate a video chunk by chunk: returns an iterator of ``VideoChunk`` (frames, their
        indices, latents, prompts, stats), each yielded as soon as it is decoded. Arguments are
        checked now, before any model runs; the work happens as you iterate.

        Args:
            prompt: a prompt such as ``"a red circle moving right"`` (bundled model: one word of
                each field of the transformer's ``prompt_vocab``: colour, shape, direction; Wan:
                any text), or a list of them (one video per prompt). Exclusive with ``prompts``.
            prompts: a schedule ``[(0, text), (start, text), ...]``: start video frames strictly
                increasing from 0, each at a chunk boundary (below ``num_frames`` when it is
                given): the bundled model's multiples of ``chunk_frames``; Wan's 0, 9, 21, 33, ...
                (chunk k starts at the video frame its first latent frame decodes to first:
                ``video_frames(k * chunk_frames)``); a text may be a list with one prompt per video.
            num_frames: video frames to generate (the last chunk is cut to fit); None: unbounded.
                The bundled model makes one video frame per latent frame; Wan counts as diffusers'
                ``WanPipeline`` does: ``4k + 1`` video frames are ``k + 1`` latent frames (81 -> 21),
                other counts are refused naming the nearest two.
            num_latent_frames: the length in latent frames instead (exclusive with
                ``num_frames``): Wan's 21 is 81 video frames.
            generator: a ``torch.Generator``, or one per video (video r then equals that prompt
                generated alone with generator r, to float rounding: a batch's matrix products may
                round differently from one row's).
            guidance_scale: classifier-free guidance ``v_u + s (v_c - v_u)``; 1 disables it;
                None: ``stream_defaults()`` (the bundled transformer's config; 1 for Wan's
                distilled checkpoints).
            num_inference_steps: denoising steps per chunk; None: ``stream_defaults()``. A count
                other than the configured one takes uniform sigmas shifted by the scheduler (an
                explicit sigma list, Self-Forcing's, holds for its own count only).
            sink_frames: frames kept as sink (bundled model: a multiple of ``chunk_frames``; Wan:
                any count, ``video_wan.check_window``); None: the trained number.
            window_frames: frames kept as window (bundled model: a multiple of ``chunk_frames``;
                Wan: any count >= 0, or -1: every frame so far, a cache that grows as
                ``"full-cache"``'s up to ``max_frames("full-cache")``, Self-Forcing's
                ``local_attn_size=-1``); None: the ones the model was trained with. Sink + window +
                one chunk must fit in the model's ``rope_frames``; past the trained sizes the model
                is out of its training distribution.
            cache_mode: ``"rolling"``, ``"window-recompute"``, ``"full-cache"`` or ``"no-sink"``
                (module docstring).
            recache_sink: at a prompt switch, recompute the sink's K/V too (True, default: as
                trained) or keep them (False).
            output_type: ``"pt"`` (default here), ``"np"``, ``"pil"`` or ``"latent"``.
            callback_on_step_end: ``callback(pipe, step, timestep, callback_kwargs) -> dict`` after
                every denoising step; ``step`` counts steps over the stream from 0, ``timestep``
                is the flow time t the step started from, ``callback_kwargs["latents"]`` the
                chunk's (B, chunk_frames, C, h, w) latents after it (a returned ``"latents"`` of that shape
                replaces them); ``pipe._interrupt = True`` ends the stream after the chunk.
            callback_on_step_end_tensor_inputs: among ``"latents"``.
            height: the video's height in pixels (Wan; None: ``stream_defaults()``); the bundled
                model has one size.
            width: the video's width in pixels, as ``height``.
            video_latents: clean latents for streaming video-to-video (with ``strength``).
            strength: streaming video-to-video (diffusers' image-to-image
                ``strength``, applied chunk by chunk): chunk c starts from
                ``video_latents[:, c * chunk_frames ...]`` (B, frames, C, h, w), clean latents in
                the transformer's space, noised to the sigma of step ``first_step(strength)`` of
                ``num_inference_steps``, and takes only the steps from there. The cache, the clean
                commit pass and prompt switches are as without. ``num_frames`` defaults to the
                latents' frames; a last chunk past them starts from their last frame repeated.
                Strength 1 (default) starts from pure noise and ignores them, bit for bit; the
                training recipe's self-rollouts (``mmspec.training.recipes.video``) use this.
            latents: the initial noise of every chunk, as diffusers' ``latents`` (B, frames, C, h,
                w), frames a multiple of ``chunk_frames``: chunk c starts from ``latents[:, c *
                chunk_frames ...]`` instead of a draw from ``generator`` (which still draws the
                re-noising of the ``"renoise"`` sampler). The length defaults to its latent frames.
                With the same noise a stream reproduces the reference code's
                (``tests/test_wan_parity.py``: Self-Forcing's and LongLive's own inference loops).
        """
        setup = self.check_inputs(prompt, prompts, num_frames, generator, guidance_scale, num_inference_steps,
                                  sink_frames, window_frames, cache_mode, recache_sink, output_type,
                                  callback_on_step_end, callback_on_step_end_tensor_inputs, height, width,
                                  video_latents, strength, latents, num_latent_frames)
        return self._stream(setup)

    @torch.no_grad()
    def _stream(self, s: _Setup) -> Iterator[VideoChunk]:
        try:
            yield from self._chunks(s)
        finally:  # exhausted, interrupted, failed or closed early: offload what the stream onloaded
            self.maybe_free_model_hooks()

    def _chunks(self, s: _Setup) -> Iterator[VideoChunk]:
        model, C, B = self.video_model, self.chunk_frames, s.batch_size
        device = self._execution_device
        guided = s.guidance_scale != 1.0
        # the prompts' conditioning rows, every prompt of the schedule once (under model offload the
        # text encoder comes and goes before the transformer)
        onload(self.text_encoder)
        schedule = [(start, self._encode(texts).to(device), texts) for start, texts in s.schedule]
        null = self._encode([None] * B).to(device) if guided else None
        # under model offload: on the device before its cache is made and its dtype read, for the stream
        onload(self.transformer)
        rows = 2 * B if guided else B
        sampler = FlowSampler(self.scheduler, s.steps, s.sampler, s.sigmas, s.model_times)
        cache_kwargs = {"latent_hw": s.latent_shape[1:]} if self.is_wan else {}
        if s.cache_mode == "window-recompute":
            context = RecomputeStream(model, rows, s.sink, s.window, **cache_kwargs)
        else:  # full-cache is sink 0 and a window of every frame: a cache that grows to frame_limit
            context = CachedStream(model, rows, s.sink, s.window, recache_rule=s.recache_rule, **cache_kwargs)
        decoder = WanStreamingDecoder(self.vae) if self.is_wan and s.output_type != "latent" else None
        shape = (B, C) + tuple(s.latent_shape)
        dtype = self.transformer.dtype
        total = None if s.num_frames is None else math.ceil(s.num_frames / C)
        self._interrupt = False
        step = 0

        def on_step(i, t, x):  # t: the flow time (sigma) the step started from
            nonlocal step
            if s.callback is not None:
                kwargs = {"latents": x} if "latents" in s.tensor_inputs else {}
                returned = s.callback(self, step, t, kwargs)
                requested = ", ".join(s.tensor_inputs) or "none"
                check(isinstance(returned, dict) and set(returned) <= set(s.tensor_inputs), "callback_on_step_end",
                      f"a callable returning a dict of requested tensor inputs ({requested})",
                      returned if not isinstance(returned, dict) else f"a dict with {sorted(returned)}")
                if "latents" in returned:
                    new = returned["latents"]
                    check(isinstance(new, torch.Tensor) and new.shape == x.shape, "latents",
                          f"a tensor of shape {tuple(x.shape)} (returned by callback_on_step_end)", new)
                    x = new.to(x)
            step += 1
            return x

        current = None
        with self.progress_bar(iterable=itertools.count() if total is None else range(total)) as chunks:
            for c in chunks:
                begin = time.perf_counter()
                start = c * C
                ids, texts = _prompt_at(schedule, start)
                switched = current is not None and not torch.equal(ids, current)
                nfe = 0
                if switched:
                    nfe += context.recache(torch.cat([ids, null]) if guided else ids, keep_sink=not s.recache_sink)
                current = ids
                if s.latents is None:
                    noise = randn_tensor(shape, generator=s.generator, device=device, dtype=dtype)
                else:
                    noise = s.latents[:, start:start + C].to(device, dtype)
                init = None
                if s.video_latents is not None:  # the last chunk may run past the given frames: pad
                    init = s.video_latents[:, start:start + C].to(device, dtype)
                    init = torch.cat([init, init[:, -1:].expand(B, C - init.shape[1], *init.shape[2:])], 1)
                x = context.sample(noise, ids, null, sampler, s.guidance_scale, on_step, s.generator, init,
                                   s.strength)
                nfe += sampler.steps_run(s.strength) + (s.cache_mode != "window-recompute")
                n = C if s.num_frames is None else min(C, s.num_frames - start)
                latents = x[:, :n]
                frames = latents if s.output_type == "latent" else self._postprocess(latents, s.output_type, decoder)
                stats = dict(latency_s=time.perf_counter() - begin, cache_frames=context.frames(),
                             cache_bytes=context.nbytes(), switched=switched, nfe=int(nfe))
                # indices of these frames in the output: video frames once decoded, else latent frames
                first, stop = (start, start + n) if s.output_type == "latent" else (
                    self.video_frames(start), self.video_frames(start + n))
                yield VideoChunk(frames=frames, frame_indices=range(first, stop), latents=latents,
                                 prompts=list(texts), stats=stats)
                if self.interrupt:
                    return

    def _encode(self, texts: list[str | None]) -> torch.Tensor:
        """Conditioning rows of prompts (``None``: the null prompt): the bundled model's (B, 3) ids,
        or Wan's (B, L, D) UMT5 embeddings (WanPipeline's)."""
        if not self.is_wan:
            return self.transformer.encode_prompts(texts)
        return encode_prompts(texts, self.text_encoder, self.tokenizer, self.stream_defaults()["max_text_length"])

    def _postprocess(self, latents: torch.Tensor, output_type: str, decoder: WanStreamingDecoder | None = None):
        """(B, n, C, h, w) latents -> decoded frames as ``output_type`` (diffusers' ``VideoProcessor``):
        the bundled autoencoder one frame per latent frame, Wan's ``decoder`` chunk by chunk with its
        causal feature cache (1 frame for the stream's first latent frame, 4 for each later one)."""
        B, n = latents.shape[:2]
        if decoder is not None:
            # the streaming decoder calls the VAE's parts, not its hooked forward or decode: under model
            # offload the VAE moves to the execution device here (else the decode ran on the CPU)
            onload(self.vae)
            pixels = decoder.decode(latents).clamp(-1, 1)  # (B, n', 3, H, W)
        else:
            pixels = self.vae.decode(latents.flatten(0, 1)).clamp(-1, 1).unflatten(0, (B, n))  # (B, n, 3, H, W)
        return self.video_processor.postprocess_video(pixels.permute(0, 2, 1, 3, 4).float(), output_type=output_type)

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, num_frames: int | None = None,
                 generator: torch.Generator | list[torch.Generator] | None = None, guidance_scale: float | None = None,
                 num_inference_steps: int | None = None, sink_frames: int | None = None,
                 window_frames: int | None = None, cache_mode: str = "rolling", recache_sink: bool | None = None,
                 output_type: str = "pil", return_dict: bool = True, callback_on_step_end: Callable | None = None,
                 callback_on_step_end_tensor_inputs: list[str] = ("latents",), prompts: list | None = None,
                 height: int | None = None, width: int | None = None, video_latents: torch.Tensor | None = None,
                 strength: float = 1.0, latents: torch.Tensor | None = None, num_latent_frames: int | None = None):
        """Generate a video per prompt: ``stream`` collected (the same arguments; see it), with a
        length required and ``output_type`` ``"pil"`` by default. Without ``num_frames``,
        ``num_latent_frames``, ``latents`` or ``video_latents``: 81 video frames for Wan (diffusers'
        ``WanPipeline`` default, 21 latent frames), 96 for the bundled model.

        Returns:
            ``StreamingVideoPipelineOutput(frames, stats)``, or ``(frames,)`` when
            ``return_dict=False``. ``frames[r]`` is video r: a list of PIL images, an (F, H, W, 3)
            array or an (F, 3, H, W) tensor in [0, 1].
        """
        checks.check_flag(return_dict, "return_dict")
        if num_frames is None and num_latent_frames is None and latents is None and video_latents is None:
            num_frames = 81 if self.is_wan else 96  # WanPipeline's default; the bundled model's 96
        s = self.check_inputs(prompt, prompts, num_frames, generator, guidance_scale, num_inference_steps, sink_frames,
                              window_frames, cache_mode, recache_sink, output_type, callback_on_step_end,
                              callback_on_step_end_tensor_inputs, height, width, video_latents, strength, latents,
                              num_latent_frames)
        chunks = list(self._stream(s))  # what stream() yields; it ends with maybe_free_model_hooks
        parts = [c.frames for c in chunks]
        if output_type == "pil":
            frames = [sum((p[r] for p in parts), []) for r in range(len(parts[0]))]
        elif output_type == "np":
            frames = np.concatenate(parts, axis=1)
        else:
            frames = torch.cat(parts, 1)
        if not return_dict:
            return (frames,)
        latency = [c.stats["latency_s"] for c in chunks]
        stats = dict(frames=chunks[-1].frame_indices.stop, chunks=len(chunks), wall_seconds=sum(latency),
                     latency_s=latency, nfe=sum(c.stats["nfe"] for c in chunks),
                     cache_frames=chunks[-1].stats["cache_frames"],
                     cache_bytes=max(c.stats["cache_bytes"] for c in chunks),
                     switch_frames=[c.frame_indices.start for c in chunks if c.stats["switched"]],
                     cache_mode=s.cache_mode, sink_frames=s.sink, window_frames=s.window, num_inference_steps=s.steps,
                     guidance_scale=s.guidance_scale, recache_sink=s.recache_sink)
        return StreamingVideoPipelineOutput(frames=frames, stats=stats)


def _check_wan_parts(vae, text_encoder, tokenizer, stream_config, transformer) -> dict:
    """The Wan family's components and stream settings, checked when the pipeline is built (before
    any model runs), the sink and window by the rules the stream's cache applies
    (``WanVideoModel.new_cache``); returns the settings complete."""
    check(isinstance(vae, AutoencoderKLWan), "vae", "a diffusers AutoencoderKLWan with a WanTransformer3DModel",
          type(vae).__name__)
    check(text_encoder is not None, "text_encoder", "a UMT5 text encoder (transformers' UMT5EncoderModel) for Wan "
          "prompts", None)
    check(tokenizer is not None, "tokenizer", "the text encoder's tokenizer", None)
    check(isinstance(stream_config, dict) and "chunk_frames" in stream_config, "stream_config",
          "a dict with chunk_frames, the latent frames per chunk the causal checkpoint was trained with "
          "(StreamingVideoPipeline.from_wan builds it)", stream_config)
    config = dict(WAN_STREAM_DEFAULTS, **stream_config)
    unknown = sorted(set(config) - set(WAN_STREAM_DEFAULTS) - {"chunk_frames"})
    check(not unknown, "stream_config", f"keys among chunk_frames, {', '.join(WAN_STREAM_DEFAULTS)}", unknown)
    check(checks.is_int(config["chunk_frames"]) and config["chunk_frames"] >= 1, "chunk_frames",
          "an int >= 1 (latent frames per chunk)", config["chunk_frames"])
    check_choice("position_policy", config["position_policy"], POSITION_POLICIES)
    check_choice("sampler", config["sampler"], SAMPLERS)
    check_choice("recache_rule", config["recache_rule"], RECACHE_RULES)
    for name in ("num_inference_steps", "height", "width", "max_text_length"):
        checks.check_int(config[name], name, 1)
    checks.check_number(config["guidance_scale"], "guidance_scale", 0)
    sigmas = config["sigmas"]
    check(sigmas is None or (isinstance(sigmas, (list, tuple)) and len(sigmas) == config["num_inference_steps"]),
          "sigmas", f"None or {config['num_inference_steps']} values (one per step)", sigmas)
    FlowSampler(FlowMatchEulerDiscreteScheduler(), config["num_inference_steps"], config["sampler"], sigmas,
                config["model_times"])  # refuses bad sigmas and model_times now, not at the first stream
    config["window_frames"] = check_window(config["chunk_frames"], config["sink_frames"], config["window_frames"],
                                           int(transformer.config.rope_max_seq_len))  # -1 -> None: every frame
    return config


def _prompt_at(schedule, frame: int) -> tuple[torch.Tensor, list[str]]:
    """The (B, 3) ids and texts in force at ``frame`` (the schedule sorted by start frame)."""
    active = schedule[0]
    for entry in schedule:
        if entry[0] <= frame:
            active = entry
    return active[1], active[2]


def _video_frames(latent_frames: int, scale: int) -> int:
    """Video frames ``latent_frames`` latent frames decode to: the first gives 1, each later one
    ``scale`` (Wan's VAE: 4; the bundled model: 1, one video frame per latent frame)."""
    return 0 if latent_frames <= 0 else 1 + scale * (latent_frames - 1)


def _check_schedule(prompts, num_frames: int | None, chunk: int, scale: int = 1) -> list[tuple[int, list[str]]]:
    """``[(start frame, text or list of texts), ...]`` -> ``[(start, [texts])]``; see ``stream``.
    Starts and ``num_frames`` count video frames (``scale`` per latent frame past the first); the
    returned starts count latent frames."""
    check(isinstance(prompts, (list, tuple)) and len(prompts) >= 1
          and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in prompts), "prompts",
          "a non-empty list of (start frame, text) pairs", prompts)
    starts = [p[0] for p in prompts]
    below = "" if num_frames is None else f" and below num_frames ({num_frames})"
    check(all(checks.is_int(s) for s in starts) and starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:]))
          and (num_frames is None or starts[-1] < num_frames), "prompts",
          f"sorted by start frame: strictly increasing from 0{below}", starts)
    out = []
    for i, (start, text) in enumerate(prompts):
        if scale == 1:
            low = start // chunk * chunk
            check(start % chunk == 0, f"prompts[{i}] start frame", f"a multiple of chunk_frames ({chunk}): prompts "
                  f"switch at chunk boundaries, e.g. {low} or {low + chunk}", start)
            latent = start
        else:  # video frames: chunk k starts at the video frame latent frame k * chunk decodes to first
            k = 0 if start <= 0 else ((start - 1) // scale + 1) // chunk
            low, high = _video_frames(k * chunk, scale), _video_frames((k + 1) * chunk, scale)
            first = ", ".join(str(_video_frames(j * chunk, scale)) for j in range(4))
            check(start == low, f"prompts[{i}] start frame",
                  f"a chunk boundary in video frames ({first}, ...: chunks of {chunk} latent frames, the first "
                  f"decoding to {_video_frames(chunk, scale)} video frames and each later one to {scale * chunk}), "
                  f"e.g. {low} or {high}", start)
            latent = k * chunk
        texts = checks.check_prompts(text, f"prompts[{i}] text")
        check(len(texts) == len(out[0][1]) if out else True, f"prompts[{i}] text",
              f"{len(out[0][1]) if out else 0} prompts (one per video, as prompts[0])", text)
        out.append((int(latent), texts))
    return out


# -- files ------------------------------------------------------------------------------------------
VIDEO_SUFFIXES = (".mp4", ".gif")


def _as_images(frames, scale: int) -> list:
    """PIL images (or an (F, H, W, 3) float array in [0, 1]) -> RGB images ``scale`` times larger
    (nearest neighbour: the tiny frames stay sharp)."""
    import PIL.Image

    if isinstance(frames, np.ndarray):
        check(frames.ndim == 4 and frames.shape[-1] == 3 and np.issubdtype(frames.dtype, np.floating), "frames",
              "PIL images or an (F, H, W, 3) float array in [0, 1]", getattr(frames, "shape", frames))
        frames = [PIL.Image.fromarray((f.clip(0, 1) * 255).round().astype(np.uint8)) for f in frames]
    check(len(frames) >= 1 and all(isinstance(f, PIL.Image.Image) for f in frames), "frames",
          "a non-empty list of PIL images or an (F, H, W, 3) float array in [0, 1]", type(frames).__name__)
    checks.check_int(scale, "scale", 1)
    return [f.convert("RGB").resize((f.width * scale, f.height * scale), PIL.Image.NEAREST) for f in frames]


def save_video(frames, path, fps: int = 16, scale: int = 8) -> Path:
    """Write one video (``frames``: PIL images, e.g. ``out.frames[0]``, or an (F, H, W, 3) float
    array in [0, 1]) to ``path``, ``scale`` times larger (nearest neighbour), by its suffix:
    ``.mp4`` through diffusers' ``export_to_video`` (imageio + imageio-ffmpeg: H.264, yuv420p;
    a side that is not a multiple of 16 is scaled up to one by the encoder, so the default 8x of
    32 px frames, 256 px, is kept as is) or ``.gif`` through Pillow (looping). Written to a
    temporary file beside ``path`` and renamed: an interrupted write leaves no partial file."""
    from diffusers.utils import export_to_video

    from ..utils.atomic import atomic_path

    path = Path(path)
    check_choice("path suffix", path.suffix.lower(), VIDEO_SUFFIXES)
    checks.check_int(fps, "fps", 1)
    images = _as_images(frames, scale)
    with atomic_path(path) as tmp:
        if path.suffix.lower() == ".mp4":
            export_to_video(images, str(tmp), fps=fps)
        else:
            images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                           duration=max(1, round(1000 / fps)), loop=0)
    return path


def save_frame_strip(videos, path, every: int = 1, per_row: int = 16, scale: int = 2) -> Path:
    """A PNG of videos (each a list of PIL images or an (F, H, W, 3) float array in [0, 1]):
    every ``every``-th frame, ``per_row`` frames per row, the rows of one video after another,
    ``scale`` times larger; written atomically."""
    import PIL.Image

    from ..utils.atomic import atomic_path

    checks.check_int(every, "every", 1)
    checks.check_int(per_row, "per_row", 1)
    rows = []
    for video in videos:
        images = _as_images(video, scale)[::every]
        rows += [images[i:i + per_row] for i in range(0, len(images), per_row)]
    w, h = rows[0][0].size
    strip = PIL.Image.new("RGB", (w * max(len(r) for r in rows), h * len(rows)), "white")
    for y, row in enumerate(rows):
        for x, image in enumerate(row):
            strip.paste(image, (x * w, y * h))
    with atomic_path(path) as tmp:
        strip.save(tmp, format="PNG")
    return Path(path)
