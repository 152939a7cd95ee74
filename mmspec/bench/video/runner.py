"""One run of the video bench: the groups of streams in lockstep, and their rows."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...core.errors import check
from .config import VideoBenchConfig
from .model import _row, _speedups
from .measures import _ceiling, _colour_cycle, _quality, _schedules, _segment_measures, _switch_measures
from .report import public
from .timing import _lockstep, _Run, _warm, peak_rss_mb, trim_heap


def _load(cfg: VideoBenchConfig):
    from ...models import load_checkpoint
    from ...models.video_judge import FrameJudge
    from ...pipelines import StreamingVideoPipeline

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


def run(cfg: VideoBenchConfig, progress=None, json_path: str | os.PathLike | None = None) -> dict:
    """The three groups (module docstring). With ``json_path`` the result so far is written there
    (atomically, ``report.write_json``) after every group, ``setup.complete`` False until the end:
    an interrupted run leaves the finished groups."""
    from ..report import write_json

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
    setup["process_peak_rss_mb"] = peak_rss_mb()
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
    from ..wan_tiny import tiny_wan_pipeline

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
            kw = dict(kwargs, cache_mode=mode, window_frames=w * C, num_latent_frames=frames)
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
