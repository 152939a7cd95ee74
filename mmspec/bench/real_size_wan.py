"""A real-size Wan streaming row for the GPU check (issue 44, item 7): what a chunk costs at
Wan2.1-T2V-1.3B's shapes, and whether that cost stays flat as the stream grows.

A ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's shapes (30 blocks, 12 heads of 128 = 1,536
wide, FFN 8,960, 16 latent channels, text rows 4,096 wide, patch (1, 2, 2); random weights built
on the device in the row's dtype, never on the CPU) streamed by
``StreamingVideoPipeline.from_wan(..., preset=name)`` at 480 x 832 pixels: latent frames of 60 x
104, 1,560 tokens, so a chunk of 3 frames is 4,680 query tokens. One video (B = 1), latents out
(the VAE decode, the same for every mode, is left out). The prompt's 512 x 4,096 text rows come
from a one-layer random UMT5 of that width (``wan_tiny.text_parts``; rows past the prompt's tokens
zeroed, as ``WanPipeline`` pads), and a tiny random ``AutoencoderKLWan`` completes the pipeline
(never run). For each preset of ``PRESETS`` (``WAN_STREAM_PRESETS``: sink, window, steps and
sigmas as released), one entry with two parts:

- ``stream``: the preset as released (absolute positions), ``warmup`` untimed chunks, then
  ``chunks`` chunks each timed with the device synchronised: ``ms_per_chunk`` (median over the
  chunks from ``fit_from_frame`` = sink + window + chunk on, where the cache has filled, as the
  video bench fits), ``latency_slope`` (least squares of chunk latency in ms over the chunk's
  first frame, per 1,000 frames, with its standard error and a moving-block bootstrap interval,
  ``mmspec.eval.stats.fit_slope``), ``slope_pct_per_1k_frames`` (that over ``ms_per_chunk``),
  ``cache_bytes``; ``flat``: |slope| < ``FLAT_PCT`` % per 1,000 frames.
- ``recompute``: ``cache_mode="rolling"`` against ``"window-recompute"`` at the preset's chunk,
  sink, window and sampler (``_cost_settings``), with cache-order positions (the pipeline's window
  recompute re-encodes the visible frames at cache-order positions, so it refuses absolute ones),
  ``recompute_chunks`` chunks each after one warm-up chunk, in lockstep (one chunk of each in
  turn, the order swapped every round, so a drift of the machine lands on both): their
  ``ms_per_chunk`` (median over the chunks from ``fit_from_frame`` on when any ran), ``speedup``
  (recompute's over rolling's) beside ``compute_ratio`` (their FLOPs per chunk);
  ``rolling_faster``.

The targets are reported (``targets``), not judged: the step fails on an exception only.

Cost, from ``plan`` (FLOPs of the projections, FFN, self- and cross-attention, the mask not
exploited): a rolling chunk is steps + 1 = 5 passes of 4,680 queries over 18,720 keys (longlive:
sink 3 + window 6 + the chunk) or 32,760 (self-forcing: window 18 + the chunk), 141 and 202 TFLOP.
The first GPU report timed the masked SDPA of one self-forcing layer's chunk at 5.3 ms on an H200
(about 180 TFLOP/s); attention at that rate and the projections and FFN (11.7 TFLOP a pass) at
about 600 give about 0.55 and 0.9 s a chunk, 35 and 55 s for 62 chunks (an upper estimate:
attention without a mask can take flash kernels). A window-recompute chunk is 4 passes over all
18,720 or 32,760 tokens, 3.2 and 5.6 times the rolling chunk's FLOPs (about 1.8 and 5 s a chunk
once the window has filled; 11 chunks with the ramp, 16 and 36 s). With the imports and the
build, at most about 170 s for the whole row, which is ``STEP_SECONDS["real-size:wan"]`` in the
check. Parts run in this order: the streams (longlive, then self-forcing), then the comparisons
(the same order); with ``budget_s`` no chunk starts that would end past it, judged by the last
one, and what was cut says so (``truncated``; a part not reached: ``note``). ``record(partial)``
is called after every part.

``row(...)`` runs anywhere (the tests run it on the CPU at ``TINY``); ``plan(...)`` builds the
shapes on the meta device (the settings checked, the cache's exact bytes) and runs nothing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..utils import one_line
from ..eval.stats import fit_slope


@dataclass(frozen=True)
class Shapes:
    num_layers: int = 30
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    ffn_dim: int = 8960
    in_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    text_tokens: int = 512
    height: int = 480  # pixels
    width: int = 832

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def transformer_config(self) -> dict:
        """``WanTransformer3DModel``'s arguments (Wan2.1-T2V-1.3B's config at the default shapes)."""
        return dict(patch_size=(1, 2, 2), num_attention_heads=self.num_attention_heads,
                    attention_head_dim=self.attention_head_dim, in_channels=self.in_channels,
                    out_channels=self.in_channels, text_dim=self.text_dim, freq_dim=self.freq_dim,
                    ffn_dim=self.ffn_dim, num_layers=self.num_layers, cross_attn_norm=True, eps=1e-6)


WAN_1_3B = Shapes()
TINY = Shapes(num_layers=2, num_attention_heads=2, attention_head_dim=16, ffn_dim=64, in_channels=4, text_dim=16,
              freq_dim=8, text_tokens=8, height=32, width=48)
"""What the tests run on the CPU: latent frames of 4 x 6, 6 tokens."""
PRESETS = ("longlive", "self-forcing")
FLAT_PCT = 2.0
"""The flatness target: |latency slope| under this many % of a chunk's latency per 1,000 frames."""
PROMPT = "a red cat walks on grass"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Parameters created inside are created in ``dtype`` (no float32 copy first)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(shapes: Shapes, device, dtype, seed: int = 0):
    """(transformer, vae, text_encoder, tokenizer): the transformer's random weights initialised on
    ``device`` in ``dtype``; a tiny VAE with its latent channels and a one-layer UMT5 as wide as its
    text rows (``wan_tiny``), on ``device``; all in eval mode."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from .wan_tiny import VAE, text_parts

    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype):
        transformer = WanTransformer3DModel(**shapes.transformer_config()).eval()
    C = shapes.in_channels
    target = device if torch.device(device).type != "meta" else "cpu"  # the tiny parts stay real
    vae = AutoencoderKLWan(**dict(VAE, z_dim=C, latents_mean=[0.0] * C, latents_std=[1.0] * C)).to(target).eval()
    encoder, tokenizer = text_parts(seed + 1, d_model=shapes.text_dim)
    return transformer, vae, encoder.to(target), tokenizer


def _pipeline(parts, shapes: Shapes, preset: str | None = None, **stream_config):
    from ..pipelines import StreamingVideoPipeline

    pipe = StreamingVideoPipeline.from_wan(*parts, preset=preset, height=shapes.height, width=shapes.width,
                                           max_text_length=shapes.text_tokens, **stream_config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _cost_settings(preset: str) -> dict:
    """The settings of ``preset`` a chunk's cost depends on; ``from_wan``'s defaults give the rest
    (a preset's prompt-switch rule may refuse the recompute, and these streams never switch)."""
    from ..pipelines.video import WAN_STREAM_PRESETS

    keep = ("chunk_frames", "sink_frames", "window_frames", "num_inference_steps", "sigmas", "sampler",
            "guidance_scale")
    return {k: v for k, v in WAN_STREAM_PRESETS[preset].items() if k in keep}


def _tflop(shapes: Shapes, queries: int, keys: int) -> float:
    """One pass of ``queries`` tokens attending to ``keys`` (the mask not exploited): the blocks'
    projections and FFN, self- and cross-attention (the prompt's K/V are memoised)."""
    d, L = shapes.dim, shapes.num_layers
    macs = L * queries * (6 * d * d + 2 * d * shapes.ffn_dim + 2 * keys * d + 2 * shapes.text_tokens * d)
    return 2 * macs / 1e12


@torch.no_grad()
def plan(shapes: Shapes = WAN_1_3B, dtype=torch.bfloat16, presets=PRESETS, chunks: int = 60,
         recompute_chunks: int = 10, warmup: int = 2, parts=None) -> dict:
    """What the row runs, without running it: per preset the resolved stream settings, tokens,
    keys, passes and TFLOP per chunk (rolling and window-recompute), and the bytes of its rolling
    cache (K/V and kept latents; a stream's ``cache_bytes`` adds what else its context keeps), from
    the pipeline built over ``parts`` (default: ``build`` on the meta device)."""
    parts = parts or build(shapes, "meta", dtype)
    transformer = parts[0]
    out = {"shapes": asdict(shapes), "dtype": str(dtype).replace("torch.", ""),
           "params": sum(p.numel() for p in transformer.parameters()), "chunks": chunks, "warmup": warmup,
           "recompute_chunks": recompute_chunks, "flat_limit_pct": FLAT_PCT, "presets": {}}
    for name in presets:
        pipe = _pipeline(parts, shapes, name)
        model, s = pipe.video_model, pipe.stream_defaults()
        try:
            C, K, W = pipe.chunk_frames, s["sink_frames"], s["window_frames"]
            scale = pipe.vae.config.scale_factor_spatial
            latent = (s["height"] // scale, s["width"] // scale)
            P = model.tokens_per_frame(*latent)
            cache_bytes = model.new_cache(1, K, W, latent).nbytes()  # exact; no memory on the meta device
            steps, seen = s["num_inference_steps"], (K + W + C) * P  # a chunk sees the kept frames and itself
            rolling = (steps + 1) * _tflop(shapes, C * P, seen)  # the denoising steps and the clean pass
            recompute = steps * _tflop(shapes, seen, seen)  # once the window has filled
            out["latent_hw"], out["tokens_per_frame"], out["chunk_frames"] = list(latent), P, C
            out["presets"][name] = dict(
                sink_frames=K, window_frames=W, position_policy=s["position_policy"], steps=steps,
                passes_per_chunk=steps + 1, query_tokens=C * P, key_tokens=seen, fit_from_frame=K + W + C,
                tflop_per_chunk=rolling, recompute_tflop_per_chunk=recompute, compute_ratio=recompute / rolling,
                cache_bytes=cache_bytes, frames=(warmup + chunks) * C)
        finally:
            model.restore_processors()
    return out


def _pull(streams: dict[str, Iterator], n: int, device: torch.device,
          deadline: float | None) -> tuple[dict, str | None]:
    """Up to ``n`` chunks of every stream, one of each in turn (the order swapped every round), each
    timed with ``device`` synchronised: per stream a list of (first frame, ms, cache bytes), and
    why it stopped early (None: it did not). No round starts that would end past ``deadline``,
    judged by the last round."""
    got: dict[str, list] = {k: [] for k in streams}
    names = list(streams)
    last = 0.0
    for i in range(n):
        if deadline is not None and time.perf_counter() + last > deadline:
            return got, f"the row's budget: {i} of {n} chunks ran"
        started = time.perf_counter()
        for name in names[i % 2:] + names[:i % 2]:
            _sync(device)
            t0 = time.perf_counter()
            chunk = next(streams[name])
            _sync(device)
            got[name].append((chunk.frame_indices.start, 1000 * (time.perf_counter() - t0),
                              int(chunk.stats["cache_bytes"])))
        last = time.perf_counter() - started
    return got, None


def _latency(timed: list, warmup: int, fit_from: int) -> dict:
    """The figures of one stream's chunks after the ``warmup`` first (see the module)."""
    timed = timed[warmup:]
    starts = np.asarray([t[0] for t in timed], np.float64)
    ms = np.asarray([t[1] for t in timed], np.float64)
    steady = starts >= fit_from
    use = ms[steady] if steady.any() else ms
    med = float(np.median(use)) if len(use) else None
    fit = fit_slope(starts[steady], ms[steady])
    pct = (lambda v: None if v is None or not med else 100 * v / med)  # noqa: E731
    return dict(chunks_done=len(timed), fit_from_frame=fit_from, fit_chunks=fit["n"], steady=bool(steady.any()),
                ms_per_chunk=med, ms_per_chunk_p95=float(np.percentile(use, 95)) if len(use) else None,
                latency_slope=fit["slope"], latency_slope_se=fit["se"], latency_slope_ci_low=fit["ci_low"],
                latency_slope_ci_high=fit["ci_high"], slope_pct_per_1k_frames=pct(fit["slope"]),
                slope_pct_se=pct(fit["se"]), cache_bytes=max((t[2] for t in timed), default=None))


@torch.no_grad()
def row(device="cuda", dtype=torch.bfloat16, shapes: Shapes = WAN_1_3B, presets=PRESETS, chunks: int = 60,
        recompute_chunks: int = 10, warmup: int = 2, budget_s: float | None = None, seed: int = 0,
        record: Callable[[dict], None] | None = None) -> dict:
    """One row (see the module); every part recorded even when another fails (``errors``)."""
    started = time.perf_counter()
    deadline = None if budget_s is None else started + budget_s
    device = torch.device(device)
    parts = build(shapes, device, dtype, seed)
    out = plan(shapes, dtype, presets, chunks, recompute_chunks, warmup, parts=parts)
    out.update(device=str(device), budget_s=budget_s, build_s=time.perf_counter() - started, errors=[],
               targets={"flat": dict.fromkeys(presets), "rolling_faster": dict.fromkeys(presets)})
    save = record or (lambda partial: None)

    def attempt(name: str, part: str, fn: Callable[[], dict]) -> None:
        entry = out["presets"][name]
        if deadline is not None and time.perf_counter() >= deadline:
            entry[part] = {"note": f"not run: the row's {budget_s:.0f} s budget was spent"}
        else:
            try:
                entry[part] = fn()
            except Exception as e:  # noqa: BLE001 - one failing part must not hide the others
                entry[part] = {"note": "failed"}
                out["errors"].append(f"{name} {part}: {type(e).__name__}: {one_line(e)}"[:400])
        save(out)

    def stream(name: str) -> dict:
        pipe = _pipeline(parts, shapes, name)
        try:
            gen = torch.Generator(device).manual_seed(seed)
            it = pipe.stream(prompt=PROMPT, num_latent_frames=(warmup + chunks) * pipe.chunk_frames,
                             output_type="latent", generator=gen)
            try:
                got, cut = _pull({"rolling": it}, warmup + chunks, device, deadline)
            finally:
                it.close()
        finally:
            pipe.video_model.restore_processors()
        res = dict(_latency(got["rolling"], warmup, out["presets"][name]["fit_from_frame"]), chunks=chunks,
                   warmup=warmup, truncated=cut)
        s = res["slope_pct_per_1k_frames"]
        res["flat"] = None if s is None else abs(s) < FLAT_PCT
        out["targets"]["flat"][name] = res["flat"]
        return res

    def compare(name: str) -> dict:
        pipe = _pipeline(parts, shapes, position_policy="cache-order", **_cost_settings(name))
        modes = ("rolling", "window-recompute")
        its = {}
        try:
            for mode in modes:
                its[mode] = pipe.stream(prompt=PROMPT, num_latent_frames=(1 + recompute_chunks) * pipe.chunk_frames,
                                        cache_mode=mode, output_type="latent",
                                        generator=torch.Generator(device).manual_seed(seed))
            got, cut = _pull(its, 1 + recompute_chunks, device, deadline)
        finally:
            for it in its.values():
                it.close()
            pipe.video_model.restore_processors()
        fit_from = out["presets"][name]["fit_from_frame"]
        per = {mode: _latency(got[mode], 1, fit_from) for mode in modes}
        rolling, recompute = per["rolling"]["ms_per_chunk"], per["window-recompute"]["ms_per_chunk"]
        speedup = recompute / rolling if rolling and recompute else None
        res = dict(position_policy="cache-order", chunks=recompute_chunks, warmup=1, truncated=cut,
                   chunks_done=per["rolling"]["chunks_done"], steady=per["rolling"]["steady"],
                   rolling_ms_per_chunk=rolling, recompute_ms_per_chunk=recompute, speedup=speedup,
                   compute_ratio=out["presets"][name]["compute_ratio"],
                   cache_bytes={mode: per[mode]["cache_bytes"] for mode in modes},
                   rolling_faster=None if speedup is None else speedup > 1)
        out["targets"]["rolling_faster"][name] = res["rolling_faster"]
        return res

    for name in presets:  # the flatness of every preset before any comparison: a short budget cuts those
        attempt(name, "stream", lambda n=name: stream(n))
    for name in presets:
        attempt(name, "recompute", lambda n=name: compare(n))
    out["wall_s"] = time.perf_counter() - started
    save(out)
    return out
