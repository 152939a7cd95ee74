"""``mmspec``: the command line.

    mmspec showcase                  the main job: every modality's default, baseline vs methods
    mmspec bench core [--json PATH]  the speculation core on synthetic pairs, as a table or JSON
    mmspec bench ar-image [--json PATH]
                                     every AR image method on the bundled checkpoints: NFE, wall, FD, accuracy
    mmspec bench vlm [--json PATH]   every VLM method and transformers' assisted generation: tau, tokens/s
    mmspec bench kernels [--json PATH]
                                     the kernels against their torch references; H100 roofline projections
    mmspec bench video [--json PATH] [--frames N ...] [--groups GROUP ...]
                                     the streaming video cache modes: fps, chunk latency and memory slopes,
                                     speed-up over window recompute, judge accuracy, prompt switches; a tiny
                                     random diffusers Wan, rolling against recompute (--groups wan-tiny)
    mmspec bench continuous [--json PATH]
                                     continuous-token methods (sd, path, cspd, warm-up): NFE, alpha, wall, FD, exactness
    mmspec bench cost [--json PATH] [--gpu-curve FILE]
                                     forward cost curves of every bundled target; each method's ceiling,
                                     predicted and measured speed-up (and a labelled projection for FILE)
    mmspec bench compile [--json PATH]
                                     torch.compile on the bundled AR target per method: eager vs compiled wall,
                                     first-call (compile) time
    mmspec bench glm-image [--json PATH]
                                     SpeculativeGlmImagePipeline on a tiny RANDOM-weight GLM-Image (acceptance
                                     not representative): prior passes per image and prior wall vs none
    mmspec generate ar-image --method gsd --prompt "a red circle" --out DIR
                                     write PNGs from the bundled AR image pipeline
    mmspec generate continuous --method sd --prompt "a red circle" --out DIR
                                     write PNGs from the continuous-token pipeline (MAR-style heads)
    mmspec generate vlm --image PATH --prompt "describe the image in detail ." --method vispec
                                     answer a question about an image with the bundled VLM
    mmspec generate video --prompt "a red circle moving right" [--switch FRAME:TEXT ...] --frames 96 --out clip.mp4
                                     stream a video (MP4 or GIF) from the bundled streaming video pipeline
    mmspec gpu-check [--out DIR] [--dry-run]
                                     the prepared GPU check (make gpu-check): CUDA tests, compiled kernel
                                     timings, every pipeline on the GPU with offload; report.json + summary.txt
    mmspec demo [--host H] [--port P] the Gradio demo on 127.0.0.1 (AR image and VLM tabs)
    mmspec batch JOBS.jsonl --out DIR  resumable batch generation (PNG / text per job + manifest.jsonl)
    mmspec train vq --out DIR        rebuild the tiny VQ tokenizer from a seed (about 6 min on 2 cores)
    mmspec train ar-image --vq DIR --out DIR
                                     rebuild the AR image model on that tokenizer (about 20 min)
    mmspec train ar-draft --kind eagle|medusa|chain --target DIR --vq DIR --out DIR
                                     train a draft for it (at most 8 min each)
    mmspec train classifier --out DIR [--vq DIR]
                                     rebuild the AR image bench's classifier (about 3 min)
    mmspec train vlm [--size target|draft] --out DIR
                                     rebuild the tiny LLaVA-style VLM (about 26 min) or its draft VLM
    mmspec train vlm-draft --method eagle|specvlm|vispec|medusa --target DIR --out DIR
                                     train a VLM draft head by online-logit distillation; also runs as
                                     accelerate launch --num_processes 2 -m mmspec train vlm-draft ...
    mmspec train video-ae --out DIR  rebuild the streaming video model's frame autoencoder (about 6 min)
    mmspec train video --ae DIR --out DIR
                                     rebuild its chunk-causal video transformer (about 57 min)
    mmspec train video-judge --out DIR [--ae DIR]
                                     rebuild the video bench's frame judge (colour, shape; about 2.5 min)
    mmspec train continuous-tokenizer --out DIR [--kind conv|pca] [--classifier DIR]
                                     the continuous tokenizer: a small conv autoencoder (default, about
                                     5 min) or the closed-form PCA of patches (seconds)
    mmspec train continuous-ar --tokenizer DIR --out DIR
    mmspec train continuous-draft --tokenizer DIR --target DIR [--distill W] --out DIR
                                     the continuous AR target and its drafts (target 9,000 steps in 19 min
                                     at two threads, drafts 4,000 and 2,500 steps in 6 and 9 min at one)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from .utils import one_line

BENCHES = ("core", "ar-image", "vlm", "video", "kernels", "continuous", "cost", "compile", "glm-image")
VIDEO_GROUPS = ("window-sweep", "prompt-switch", "multi-switch", "frames", "wan-tiny")


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2 (argparse's)."""

    def __init__(self, message: str, prog: str = "mmspec"):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """Every (sub)parser: errors raise ``UsageError`` instead of printing usage, and ``--debug``
    is accepted anywhere on the line (before or after the subcommand)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show the full traceback instead of one line")
        self.set_defaults(_prog=self.prog)  # the deepest subcommand's name wins: errors are prefixed with it

    def error(self, message):
        raise UsageError(message, self.prog)


def _progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def _set_threads(n: int) -> None:
    import torch

    # the bundled models are tiny: on a 2-core machine, intra-op threads cost more than they save
    # and turn wall times noisy under any other load, so benchmarks default to one
    torch.set_num_threads(n)


def cmd_bench(args) -> int:
    from .bench import report
    from .bench.machine import LoadMonitor

    _set_threads(args.threads)
    with LoadMonitor() as monitor:
        result, columns = _run_bench(args)
    result.setdefault("setup", {})["machine"] = monitor.record()
    if args.json:
        report.write_json(args.json, result)
    if args.name == "cost":  # a curve table per target, then the method table
        from .bench import cost

        print(cost.format_report(result))
    elif args.name == "glm-image":  # a header and footnote: the weights are random
        from .bench import glm_image

        print(glm_image.format_report(result, columns))
    else:
        print(report.format_table(result["rows"], columns))
    footer = monitor.footer()
    print("\n" + "\n".join(footer))
    if monitor.quiet is False:
        print(footer[-1], file=sys.stderr)
    return 0


def _run_bench(args) -> tuple[dict, list]:
    from .bench import core, report

    if args.name == "core":
        cfg = core.CoreBenchConfig.quick() if args.quick else core.CoreBenchConfig()
        result = core.run(cfg, progress=None if args.quiet else _progress)
        columns = report.CORE_COLUMNS
    elif args.name == "vlm":
        from .bench import vlm

        cfg = vlm.VLMBenchConfig.quick() if args.quick else vlm.VLMBenchConfig()
        if args.pipeline is not None:
            cfg.pipeline_dir = args.pipeline
        result = vlm.run(cfg, progress=None if args.quiet else _progress)
        columns = vlm.VLM_COLUMNS
    elif args.name == "video":
        from .bench import video

        cfg = video.VideoBenchConfig.quick() if args.quick else video.VideoBenchConfig()
        if args.frames is not None:
            cfg.frames = tuple(args.frames)
        groups = set(args.groups or VIDEO_GROUPS)
        for group, field, off in (("window-sweep", "windows", ()), ("prompt-switch", "switches", ()),
                                  ("multi-switch", "multi_switches", 0), ("frames", "frames", ()),
                                  ("wan-tiny", "wan_frames", 0)):
            if group not in groups:
                setattr(cfg, field, off)
        # rewritten after every group: an interrupted run leaves the groups it finished
        result = video.public(video.run(cfg, progress=None if args.quiet else _progress, json_path=args.json))
        columns = video.VIDEO_COLUMNS
    elif args.name == "continuous":
        from .bench import continuous

        cfg = continuous.ContinuousBenchConfig.quick() if args.quick else continuous.ContinuousBenchConfig()
        result = continuous.public(continuous.run(cfg, progress=None if args.quiet else _progress))
        columns = continuous.CONTINUOUS_COLUMNS
    elif args.name == "cost":
        from .bench import cost

        cfg = cost.CostBenchConfig.quick() if args.quick else cost.CostBenchConfig()
        cfg.gpu_curve = args.gpu_curve  # checked and loaded by check_args
        result = cost.public(cost.run(cfg, progress=None if args.quiet else _progress))
        columns = cost.columns(result)
    elif args.name == "compile":
        from .bench import compile as compiled

        cfg = compiled.CompileBenchConfig.quick() if args.quick else compiled.CompileBenchConfig()
        result = compiled.run(cfg, progress=None if args.quiet else _progress)
        columns = compiled.COMPILE_COLUMNS
    elif args.name == "kernels":
        from .bench import kernels

        cfg = kernels.KernelBenchConfig.quick() if args.quick else kernels.KernelBenchConfig()
        result = kernels.run(cfg, progress=None if args.quiet else _progress)
        columns = kernels.KERNELS_COLUMNS
    elif args.name == "glm-image":
        from .bench import glm_image

        cfg = glm_image.GlmImageBenchConfig.quick() if args.quick else glm_image.GlmImageBenchConfig()
        result = glm_image.run(cfg, progress=None if args.quiet else _progress)
        columns = glm_image.GLM_IMAGE_COLUMNS
    else:
        from .bench import ar_image

        cfg = ar_image.ARImageBenchConfig.quick() if args.quick else ar_image.ARImageBenchConfig()
        if args.images is not None:
            cfg.images = args.images
        result = ar_image.public(ar_image.run(cfg, progress=None if args.quiet else _progress))
        columns = ar_image.AR_IMAGE_COLUMNS
    return result, columns


def _knobs(items, modality: str, method: str) -> dict:
    """``--knob KEY=VALUE`` items as the method's typed knobs, validated by the method registry
    (unknown methods and knobs, bad values: ``ValueError`` naming them) before any model loads."""
    from . import methods

    methods.resolve(modality, method)
    specs = methods.knobs(modality, method)
    knobs = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--knob must be KEY=VALUE, got {item!r}")
        if key in knobs:
            raise ValueError(f"--knob must name each knob once, got {key!r} twice")
        knobs[key] = _knob_value(text, specs.get(key))
    methods.resolve(modality, method, knobs)
    return knobs


def cmd_generate(args) -> int:
    import torch

    _set_threads(args.threads)
    if args.kind == "video":
        return _generate_video(args)
    knobs = args.method_knobs
    if args.kind == "vlm":
        return _generate_vlm(args, knobs)
    from .pipelines import SpeculativeARImagePipeline, SpeculativeContinuousARPipeline

    cls = SpeculativeContinuousARPipeline if args.kind == "continuous" else SpeculativeARImagePipeline
    pipe = cls.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(prompt=args.prompt, method=args.method, method_knobs=knobs, guidance_scale=args.guidance_scale,
               temperature=args.temperature, num_images_per_prompt=args.num_images,
               generator=torch.Generator().manual_seed(args.seed))
    paths = _save_images(out.images, Path(args.out), args.method, args.prompt)
    s = out.stats
    print(f"{len(paths)} images in {args.out}: method {args.method}, {s['nfe']} target passes "
          f"({s['tau']:.2f} tokens per pass), {s['wall_seconds']:.2f} s")
    return 0


def _generate_vlm(args, knobs: dict) -> int:
    import PIL.Image
    import torch

    from .pipelines import SpeculativeVLMPipeline

    with PIL.Image.open(args.image) as image:
        image = image.convert("RGB")  # as diffusers' load_image: a file's mode is not the caller's choice
    pipe = SpeculativeVLMPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(images=[image], prompts=[args.prompt], method=args.method, method_knobs=knobs,
               max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               generator=torch.Generator().manual_seed(args.seed))
    s = out.stats
    print(out.texts[0])
    print(f"-- method {args.method}: {len(out.tokens[0])} tokens, {s['nfe']} target passes "
          f"({s['tau']:.2f} tokens per pass), {s['wall_seconds']:.2f} s", file=sys.stderr)
    return 0


def _generate_video(args) -> int:
    import torch

    from .pipelines import StreamingVideoPipeline, save_video

    pipe = StreamingVideoPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    schedule = [(0, args.prompt)] + sorted(args.switch or [])
    out = pipe(prompts=schedule, num_frames=args.frames, generator=torch.Generator().manual_seed(args.seed),
               num_inference_steps=args.steps, guidance_scale=args.guidance_scale)
    path = save_video(out.frames[0], args.out, fps=args.fps, scale=args.scale)
    s = out.stats
    latency = sorted(s["latency_s"])[len(s["latency_s"]) // 2]
    switches = f"; prompt switches (re-cache) at frames {s['switch_frames']}" if s["switch_frames"] else ""
    print(f"{path}: {s['frames']} frames ({s['chunks']} chunks of {pipe.chunk_frames}) at {args.fps} fps; median "
          f"chunk latency {1000 * latency:.0f} ms; cache {s['cache_frames']} frames, {s['cache_bytes'] / 1024:.0f} "
          f"KiB{switches}")
    return 0


def _knob_value(text: str, spec):
    """``text`` cast to the knob's type; left as text when it does not parse, so the registry's
    error names the knob and what it accepts."""
    if spec is None:
        return text  # not a knob of this method: the registry lists the ones it has
    if spec.optional and text.lower() == "none":
        return None
    if spec.type is bool:
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower(), text)
    if spec.type in (int, float):
        try:
            return spec.type(text)
        except ValueError:
            return text
    return text


def _save_images(images, out: Path, method: str, prompts) -> list[Path]:
    """PNG files ``{prompt}-{method}-{i}.png``, each written to a temp name and renamed."""
    from .utils.atomic import atomic_path

    out.mkdir(parents=True, exist_ok=True)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    per = len(images) // len(prompts)
    paths = []
    for i, image in enumerate(images):
        stem = "_".join(prompts[i // per].lower().split()).replace("/", "_")
        path = out / f"{stem}-{method.replace('+', '_')}-{i % per}.png"
        with atomic_path(path) as tmp:
            image.save(tmp)
        paths.append(path)
    return paths


def cmd_showcase(args) -> int:
    from .bench import core, report

    _set_threads(args.threads)
    print("mmspec showcase: the speculation core on synthetic draft/target pairs (CPU)\n")
    result = core.run(core.CoreBenchConfig.quick(), progress=_progress)
    print(report.format_table(result["rows"], report.CORE_COLUMNS))
    setup = result["setup"]
    print(f"\nlayer-skip pair: {setup['target']}; draft: {setup['draft']}; "
          f"{setup['prompts']} prompts x {setup['new_tokens']} tokens.")
    print("NFE/sample = target passes each row needed (prefill included); x = speedup vs 'none' in this run;")
    print("tau = tokens per target pass, bonus token counted; exact: greedy rows bit-identical to 'none',")
    print(f"sampled rows pass the chi-square distribution test (N={setup['exact_samples']}, p >= "
          f"{setup['exact_threshold']}); iid rows: tau beside (1 - a^(g+1)) / (1 - a).")
    _showcase_ar_image(args)
    _showcase_vlm()
    _showcase_video(Path(args.out))
    if (Path(__file__).resolve().parents[1] / "assets" / "continuous" / "model_index.json").is_file():
        _showcase_continuous(Path(args.out))
    else:
        print("\nThe continuous-token part needs assets/continuous, which is missing here: `make assets` "
              "rebuilds it (README, 'Continuous-token image generation').")
    print("Try the methods by hand in the Gradio demo: `make demo` (or `.venv/bin/mmspec demo`), then open "
          "http://127.0.0.1:7860 in a browser.")
    return 0


def _showcase_ar_image(args) -> None:
    from .bench import ar_image, report

    print("\nmmspec showcase: AR image generation on the bundled checkpoints (CPU, 1 image per call)\n")
    cfg = ar_image.ARImageBenchConfig.quick(methods=ar_image.SHOWCASE_METHODS)
    result = ar_image.run(cfg, progress=_progress)
    grid = Path(args.out) / "ar_image_grid.png"
    ar_image.save_grid(result, grid)
    print(report.format_table(result["rows"], ar_image.AR_IMAGE_COLUMNS))
    setup = result["setup"]
    print(f"\n{setup['images']} images per method (one per class, seeds {setup['seed']}..), CFG "
          f"{setup['guidance_scale']}, T={setup['temperature']}; FD on the recipe classifier's features vs "
          f"{setup['reference_images']} real images (real-vs-real floor at this size: {setup['fd_real_floor']:.2f}); "
          f"target's mean top-1 probability on its samples: {setup['mean_top1_prob']:.3f}.")
    print(f"samples, one row per method ({', '.join(result['_grids'])}): {grid}")


def _showcase_continuous(out_dir: Path, model_dir: str | Path | None = None, images: int = 16, **bench) -> None:
    """Continuous tokens on the bundled pipeline: the target alone (mixture head), lossless ``sd``
    and ``sd`` with the distilled draft, ``images`` images each (one per class), a grid of samples
    in ``out_dir`` and the bench's table with the PIT exactness test of the ``sd`` rows. ``bench``
    overrides other ``ContinuousBenchConfig.quick`` fields."""
    from .bench import continuous, report

    print("\nmmspec showcase: continuous-token AR image generation (MAR-style mixture head, CPU, 1 image per call)\n")
    model_dir = Path(model_dir or Path(__file__).resolve().parents[1] / "assets" / "continuous")
    booster = model_dir / "draft_distilled"
    cfg = continuous.ContinuousBenchConfig.quick(
        pipeline_dir=str(model_dir), booster_dir=str(booster) if booster.is_dir() else None, images=images,
        rows=tuple(r for r in continuous.DEFAULT_ROWS if r[0] in continuous.SHOWCASE_ROWS), **bench)
    result = continuous.run(cfg, progress=_progress)
    grid = out_dir / "continuous_grid.png"
    continuous.save_grid(result, grid)
    print(report.format_table(result["rows"], continuous.SHOWCASE_COLUMNS))
    setup = result["setup"]
    print(f"\n{setup['images']} images per row (class i % 16, seed i), CFG {setup['guidance_scale']:g} "
          f"({setup['guidance_schedule']}), T={setup['temperature']:g}; NFE = backbone passes per image; FD vs "
          f"{setup['reference_images']} real images (real-vs-real floor at this size: {setup['fd_real_floor']:.2f}); "
          f"exact: PIT test of the first {setup['exact_tokens']} tokens, {setup['exact_samples']} samples, "
          f"p >= {setup['exact_threshold']:g}.")
    print(f"samples, one row per method ({', '.join(result['_grids'])}): {grid}")


def _showcase_video(out_dir: Path, model_dir: str | Path | None = None) -> None:
    """A prompt-switch stream from the bundled video pipeline: a GIF and a frame strip in ``out_dir``,
    the stream's cache and latency figures, and the colour read back from its pixels."""
    import torch

    from .pipelines import StreamingVideoPipeline, save_frame_strip, save_video
    from .training.data.video import PROMPT_VOCAB, frame_colour

    print("\nmmspec showcase: streaming video on the bundled chunk-causal video model (CPU, rolling sink + window "
          "KV cache)\n")
    model_dir = model_dir or Path(__file__).resolve().parents[1] / "assets" / "video"
    pipe = StreamingVideoPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    C = pipe.chunk_frames
    switch = 16 * C
    prompts = [(0, "a red circle moving right"), (switch, "a blue circle moving right")]
    result = pipe(prompts=prompts, num_frames=2 * switch, generator=torch.Generator().manual_seed(0),
                  output_type="np")
    video = result.frames  # (1, F, H, W, 3) in [0, 1]
    gif = save_video(video[0], out_dir / "video.gif", fps=16, scale=4)
    strip = save_frame_strip(video, out_dir / "video_strip.png", every=C, per_row=16)
    colours = list(PROMPT_VOCAB["colour"])  # frame_colour's palette order
    seen = frame_colour(torch.from_numpy(video[0]).permute(0, 3, 1, 2) * 2 - 1)  # (F,) palette ids, -1: none
    red, blue = seen[:switch] == colours.index("red"), seen[switch:] == colours.index("blue")
    first = int(blue.float().argmax()) if bool(blue.any()) else None
    s = result.stats
    latency = sorted(s["latency_s"])[len(s["latency_s"]) // 2]
    print(f"{s['frames']} frames in {s['chunks']} chunks of {C} ({s['num_inference_steps']} Euler steps each, CFG "
          f"{s['guidance_scale']:g}); cache: sink {s['sink_frames']} + window {s['window_frames']} frames, "
          f"{s['cache_bytes'] / 1024:.0f} KiB, the same after every chunk; median chunk latency "
          f"{1000 * latency:.0f} ms (decode included, this machine)")
    print(f"prompts: {prompts[0][1]!r}, then {prompts[1][1]!r} from frame {switch} (re-cache of the kept frames "
          f"under the new prompt); colour read from the pixels: red on {int(red.sum())}/{switch} frames before the "
          f"switch, blue on {int(blue.sum())}/{switch} after"
          + ("" if first is None else f", first at frame {switch + first}"))
    print(f"video: {gif}; one frame per chunk: {strip}")


def _showcase_vlm() -> None:
    from .bench import report, vlm
    from .pipelines import SpeculativeVLMPipeline

    print("\nmmspec showcase: lossless VLM decoding on the bundled tiny LLaVA-style model (CPU, batch 1)\n")
    cfg = vlm.VLMBenchConfig.quick(rows=vlm.SHOWCASE_ROWS)
    result = vlm.run(cfg, progress=_progress)
    print(report.format_table(result["rows"], vlm.VLM_COLUMNS[:7]))
    setup = result["setup"]
    print(f"\n{setup['prompts']} held-out scenes, 'describe the image' questions, greedy, up to "
          f"{setup['max_new_tokens']} tokens; wall x = tokens/s over the faster target-only row; x vs peer = over "
          f"transformers' assisted generation with the small draft VLM; greedy = : bit-identical to the target alone.")
    for note in result["notes"]:
        print(f"note: {note}")
    pipe = SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    images, prompts = vlm.bench_prompts(1)
    out = pipe(images=images, prompts=prompts, method="vispec", max_new_tokens=cfg.max_new_tokens)
    print(f"\nexample (vispec, {out.stats['tau']:.2f} tokens per target pass): {prompts[0]!r}\n  -> {out.texts[0]}")


def cmd_gpu_check(args) -> int:
    from .bench import gpu_check

    return gpu_check.cmd(args)


def cmd_train(args) -> int:
    from .training import recipes

    _set_threads(args.threads)
    if args.recipe == "continuous-tokenizer":
        record = recipes.train_continuous_tokenizer(args.out, kind=args.kind, dataset_size=args.dataset_size,
                                                    seed=args.seed, steps=args.steps, batch_size=args.batch_size,
                                                    lr=args.lr, classifier_dir=args.classifier,
                                                    log_every=args.log_every, log=print)
        acc = "" if record["recon_accuracy"] is None else f", classifier accuracy {record['recon_accuracy']:.3f}"
        print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.5f}{acc}, "
              f"{record['wall_time_s']:.0f} s")
        return 0
    common = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                  dataset_size=args.dataset_size, log_every=args.log_every, log=print)
    if args.recipe == "vq":
        record = recipes.train_vq(args.out, **common)
        print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.4f}, "
              f"{record['wall_time_s']:.0f} s")
    elif args.recipe == "ar-draft":
        record = recipes.train_ar_draft(args.out, kind=args.kind, vq_dir=args.vq, target_dir=args.target,
                                        **({} if args.heads is None else {"medusa_heads": args.heads}), **common)
        metric = (f"held-out top-1 agreement {_agreement(record['heldout_top1'])}" if args.kind != "chain"
                  else f"held-out loss {record['heldout_loss']:.4f}")
        print(f"saved {args.out}: {metric}, {record['wall_time_s']:.0f} s")
    elif args.recipe == "classifier":
        record = recipes.train_classifier(args.out, vq_dir=args.vq, **common)
        on_vq = "" if args.vq is None else f", {record['vq_recon_accuracy']:.4f} on VQ reconstructions"
        print(f"saved {args.out}: held-out accuracy {record['heldout_accuracy']:.4f}{on_vq}, "
              f"{record['wall_time_s']:.0f} s")
    elif args.recipe == "vlm-draft":
        record = recipes.train_vlm_draft(args.out, method=args.method, target_dir=args.target,
                                         rollout_steps=args.rollout_steps,
                                         **({} if args.heads is None else {"medusa_heads": args.heads}), **common)
        if record is not None:  # None on the other processes of an accelerate launch
            print(f"saved {args.out}: held-out top-1 agreement {_agreement(record['heldout_top1'])}, "
                  f"{record['wall_time_s']:.0f} s on {record['processes']} process(es)")
    elif args.recipe == "video-ae":
        record = recipes.train_video_ae(args.out, **common)
        print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.5f} "
              f"(PSNR {record['heldout_psnr_db']:.1f} dB), {record['wall_time_s']:.0f} s")
    elif args.recipe == "video":
        record = recipes.train_video(args.out, ae_dir=args.ae, rollout_prob=args.rollout_prob,
                                     rollout_strength=tuple(args.rollout_strength), **common)
        print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f}, rollout colour accuracy "
              f"{record['rollout']['colour_acc']:.3f}, direction accuracy {record['rollout']['direction_acc']:.3f}, "
              f"{record['wall_time_s']:.0f} s")
    elif args.recipe == "video-judge":
        record = recipes.train_video_judge(args.out, ae_dir=args.ae, **common)
        on_ae = "" if record["ae_recon"] is None else f", {record['ae_recon']['both']:.4f} on reconstructions"
        print(f"saved {args.out}: held-out accuracy (colour and shape) {record['heldout_accuracy']:.4f}{on_ae}, "
              f"{record['wall_time_s']:.0f} s")
    elif args.recipe in ("continuous-ar", "continuous-draft"):
        if args.recipe == "continuous-ar":
            record = recipes.train_continuous_ar(args.out, tokenizer_dir=args.tokenizer, input_noise=args.input_noise,
                                                 **common)
        else:
            record = recipes.train_continuous_draft(args.out, tokenizer_dir=args.tokenizer, target_dir=args.target,
                                                    distill=args.distill, input_noise=args.input_noise, **common)
        print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f} (mixture "
              f"{record['heldout_losses']['mixture']:.4f}), {record['s_per_step']:.2f} s/step, "
              f"{record['wall_time_s']:.0f} s")
    elif args.recipe == "vlm":
        record = recipes.train_vlm(args.out, size=args.size, **common)
        print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f} nats/answer token, "
              f"{record['wall_time_s']:.0f} s")
    else:
        record = recipes.train_ar_image(args.out, vq_dir=args.vq, **common)
        print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f}, {record['wall_time_s']:.0f} s")
    return 0


def _agreement(top1) -> str:
    """A recipe's held-out top-1 agreement: one figure, or one per parallel head."""
    return ", ".join(f"{x:.4f}" for x in top1) if isinstance(top1, list) else f"{top1:.4f}"


def _number(cast, low, strict: bool, high=None):
    """An argparse type: ``cast(text)``, finite, above ``low`` (or at least, if not strict) and at
    most ``high``."""
    kind = "an int" if cast is int else "a number"
    if high is not None:
        allowed = f"{kind} in {'(' if strict else '['}{low}, {high}]"
    else:
        allowed = f"{kind} {'>' if strict else '>='} {low}"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


_positive_int = _number(int, 1, strict=False)
_non_negative_int = _number(int, 0, strict=False)
_positive_float = _number(float, 0, strict=True)
_non_negative_float = _number(float, 0, strict=False)
_probability = _number(float, 0, strict=True, high=1)


def _existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text!r}")
    return text


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _unwritable(path: Path) -> str | None:
    """Why nothing could be written at ``path`` (its nearest existing parent), or None."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{str(parent)!r} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{str(parent)!r} is not writable"
    return None


def _output_dir(text: str) -> str:
    """A folder to write into: refused now if it names an existing file or cannot be created,
    rather than after the work."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a folder, got the existing file {text!r}")
    problem = None if path.is_dir() else _unwritable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot create the folder {text!r}: {problem}")
    return text


def _output_file(text: str) -> str:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a file path, got the existing folder {text!r}")
    problem = _unwritable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def _image_file(text: str) -> str:
    """A file PIL can decode (checked now, before any model loads)."""
    import PIL.Image

    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    try:
        with PIL.Image.open(text) as image:
            image.load()
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a readable image ({one_line(err)})") from None
    return text


def _text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a non-empty text")
    return text


# defaults sized from measured step times on a 2-core CPU at 2 threads (0.24 s per VQ step at
# batch 16; 0.62-0.70 s per AR step at batch 32): about 6 and 35 minutes (3,000 AR steps: at 2,000
# the target still drew blobs; the bundled one ran at one thread beside other jobs, 3,640 s)
TRAIN_DEFAULTS = {
    "vq": dict(steps=1500, batch_size=16, lr=1e-3, dataset_size=4096),
    "ar-image": dict(steps=3000, batch_size=32, lr=1e-3, dataset_size=32768),
    # one thread, batch 16: ~0.33 s per eagle step (the frozen target's forward dominates), ~0.2 s
    # per chain step; about 5 and 3.5 minutes with tokenizing
    "ar-draft": dict(steps=800, batch_size=16, lr=1e-3, dataset_size=4096),
    # one thread, batch 32: ~0.11 s per step; about 3 minutes, held-out accuracy ~0.965
    "classifier": dict(steps=1600, batch_size=32, lr=3e-3, dataset_size=4096),
    # two threads, batch 32: ~0.95 s per target step (~26 min), ~0.1 s per draft-VLM step
    "vlm": dict(steps=1600, batch_size=32, lr=1e-3, dataset_size=16000),
    "vlm-draft": dict(steps=1000, batch_size=16, lr=1e-3, dataset_size=8000),
    # two threads, alone: the autoencoder (dataset_size in frames) 57 s with rendering; the video
    # transformer (dataset_size in clips of 18 frames) ~0.53 s per step with self-rollouts on 30%
    # of them, 3,386 s for the bundled weights: 57.4 minutes from a seed
    "video-ae": dict(steps=1500, batch_size=16, lr=2e-3, dataset_size=4096),
    "video": dict(steps=6000, batch_size=8, lr=1e-3, dataset_size=4096),
    # one thread, batch 64: ~0.12 s per step, about 2.5 minutes with rendering (dataset_size in frames)
    "video-judge": dict(steps=1000, batch_size=64, lr=3e-3, dataset_size=16384),
    # --kind conv (default): 1,500 Adam steps of a small conv autoencoder; --kind pca: an SVD, seconds
    "continuous-tokenizer": dict(steps=1500, batch_size=32, lr=2e-3, dataset_size=4096),
    # batch 32, 64 tokens of 8 channels: 0.12 s per target step at two threads (9,000: 19 min), 0.08 s per plain
    # draft step, 0.18 s per distilled draft step at one thread each (the two drafts side by side)
    "continuous-ar": dict(steps=9000, batch_size=32, lr=1e-3, dataset_size=16384),
    "continuous-draft": dict(steps=4000, batch_size=32, lr=2e-3, dataset_size=16384),
}


# the video recipe's self-rollouts (mmspec.training.recipes.video.TwoStreamLoss)
VIDEO_ROLLOUT = dict(rollout_prob=0.3, rollout_strength=[0.3, 0.8])


def _add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="rebuild a tiny checkpoint from a seed")
    recipes = train.add_subparsers(dest="recipe", required=True)
    helps = {"vq": "the VQ tokenizer on procedural shapes",
             "ar-image": "the class-conditional AR image model on a trained VQ's ids",
             "ar-draft": "a draft for the AR image model: EAGLE's feature head, Medusa heads or a small chain model",
             "classifier": "the shapes classifier whose features the AR image bench's FD uses",
             "vlm": "a tiny LLaVA-architecture VLM on procedural image/question/answer data",
             "vlm-draft": "a draft head for the VLM (eagle, specvlm, vispec, medusa) by online-logit distillation",
             "video-ae": "the streaming video model's per-frame autoencoder on procedural moving shapes",
             "video": "the chunk-causal video transformer on a trained frame autoencoder's latents",
             "video-judge": "the video bench's frame judge (colour and shape) on rendered frames",
             "continuous-tokenizer": "the continuous tokenizer (a conv autoencoder, or --kind pca: closed form)",
             "continuous-ar": "the continuous-token AR target (backbone, mixture head, diffusion head)",
             "continuous-draft": "a small continuous draft, optionally distilled to the target (--distill)"}
    for name, defaults in TRAIN_DEFAULTS.items():
        p = recipes.add_parser(name, help=helps[name])
        if name == "ar-draft":
            p.add_argument("--kind", required=True, choices=("eagle", "medusa", "chain"),
                           help="eagle: feature head on the target; medusa: parallel heads on the target's "
                                "features (root token, token above, column); chain: a small AR model")
            p.add_argument("--target", type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train ar-image' (required for --kind eagle and medusa)")
            p.add_argument("--heads", type=_positive_int, default=None,
                           help="medusa only: parallel heads, the tree's depth below the root (default 4, "
                                "less than the grid's width)")
        if name in ("ar-image", "ar-draft"):
            p.add_argument("--vq", required=True, type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train vq'")
        if name == "vlm":
            p.add_argument("--size", default="target", choices=("target", "draft"),
                           help="target: the model the VLM methods accelerate; draft: the small VLM of "
                                "'sd' and the transformers peer (default target)")
        if name == "vlm-draft":
            p.add_argument("--method", required=True, choices=("eagle", "specvlm", "vispec", "medusa"),
                           help="eagle: all image tokens; specvlm: elastic visual compressor; "
                                "vispec: vision adaptor + global image feature; medusa: parallel heads "
                                "(root token + global image feature)")
            p.add_argument("--target", required=True, type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train vlm' (the VLM it drafts for)")
            p.add_argument("--rollout-steps", type=_positive_int, default=None,
                           help="anti-shortcut rollout steps (default: 2 for vispec, 1 otherwise)")
            p.add_argument("--heads", type=_positive_int, default=None,
                           help="medusa only: parallel heads, the tree's depth below the root (default 6)")
        if name == "video":
            p.add_argument("--ae", required=True, type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train video-ae'")
            p.add_argument("--rollout-prob", type=_number(float, 0, strict=False, high=1),
                           default=VIDEO_ROLLOUT["rollout_prob"],
                           help="share of steps whose context is the model's own stream through the rolling cache "
                                f"(self-rollout; default {VIDEO_ROLLOUT['rollout_prob']})")
            p.add_argument("--rollout-strength", type=_number(float, 0, strict=True, high=1), nargs=2,
                           metavar=("LOW", "HIGH"), default=VIDEO_ROLLOUT["rollout_strength"],
                           help="each rollout starts its chunks from the clip's at a strength drawn from "
                                "[LOW, HIGH] (default %(default)s)")
        if name == "video-judge":
            p.add_argument("--ae", type=_existing_dir, metavar="DIR",
                           help="also report the accuracy on this autoencoder's reconstructions of held-out frames")
        if name == "classifier":
            p.add_argument("--vq", type=_existing_dir, metavar="DIR",
                           help="also report the accuracy on this VQ's reconstructions of held-out images")
        if name == "continuous-tokenizer":
            p.add_argument("--kind", default="conv", choices=("conv", "pca"),
                           help="conv: a small noise-regularised conv autoencoder, 8 channels per 8x8 patch "
                                "(default); pca: PCA of 8x8 patches, 16 coefficients (closed form; steps unused)")
            p.add_argument("--classifier", type=_existing_dir, metavar="DIR",
                           help="also report this classifier's accuracy on reconstructions (e.g. assets/classifier)")
        if name in ("continuous-ar", "continuous-draft"):
            p.add_argument("--tokenizer", required=True, type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train continuous-tokenizer'")
        if name in ("continuous-ar", "continuous-draft"):
            p.add_argument("--input-noise", type=_number(float, 0, strict=False), default=0.25,
                           help="std of extra noise on the teacher-forced input latents (default 0.25; training only)")
        if name == "continuous-draft":
            p.add_argument("--target", type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train continuous-ar' (its diffusion schedule is copied; "
                                "required with --distill)")
            p.add_argument("--distill", type=_number(float, 0, strict=False, high=1), default=0.0,
                           help="weight of distillation to the target's heads, in [0, 1] (default 0: data only)")
        p.add_argument("--out", required=True, type=_output_dir, metavar="DIR",
                       help="checkpoint folder (replaced atomically)")
        if "steps" in defaults:  # not for closed-form fits
            p.add_argument("--steps", type=_positive_int, default=defaults["steps"],
                           help=f"optimizer steps (default {defaults['steps']})")
            p.add_argument("--batch-size", type=_positive_int, default=defaults["batch_size"],
                           help=f"(default {defaults['batch_size']})")
            p.add_argument("--lr", type=_positive_float, default=defaults["lr"], help=f"(default {defaults['lr']})")
        p.add_argument("--seed", type=_non_negative_int, default=0, help="init, data and batch order (default 0)")
        p.add_argument("--dataset-size", type=_positive_int, default=defaults["dataset_size"],
                       help=f"training images (default {defaults['dataset_size']})")
        p.add_argument("--log-every", type=_positive_int, default=50, help="steps between loss lines (default 50)")
        p.add_argument("--threads", type=_positive_int, default=2, help="torch intra-op threads (default 2)")


def _switch(text: str) -> tuple[int, str]:
    """``FRAME:TEXT``: the prompt from frame FRAME (>= 1; frame 0 is --prompt) on."""
    frame, sep, prompt = text.partition(":")
    if not sep or not frame.strip().isdigit() or int(frame) < 1 or not prompt.strip():
        raise argparse.ArgumentTypeError(f"must be FRAME:TEXT with FRAME an int >= 1 (e.g. '48:a blue circle moving "
                                         f"right'), got {text!r}")
    return int(frame), prompt


def _video_file(text: str) -> str:
    if Path(text).suffix.lower() not in (".mp4", ".gif"):
        raise argparse.ArgumentTypeError(f"must end in .mp4 or .gif, got {text!r}")
    return _output_file(text)


def _add_generate_video_parser(kinds) -> None:
    v = kinds.add_parser("video", help="stream a video from the bundled chunk-causal video model (rolling KV cache)")
    v.add_argument("--prompt", required=True, type=_text, help='e.g. "a red circle moving right" (a colour, a shape '
                   "and a direction: red green blue yellow, circle square triangle star, right left up down)")
    v.add_argument("--switch", action="append", type=_switch, metavar="FRAME:TEXT",
                   help="switch to TEXT at FRAME, a multiple of the model's chunk (3 frames for the bundled one); "
                        "repeatable, any order; the cached frames are re-encoded under the new prompt")
    v.add_argument("--frames", type=_positive_int, default=96, help="frames to generate (default 96)")
    v.add_argument("--out", required=True, type=_video_file, metavar="PATH",
                   help="clip.mp4 (H.264 through imageio-ffmpeg) or clip.gif; written to a temporary file and renamed")
    v.add_argument("--fps", type=_positive_int, default=16, help="(default 16)")
    v.add_argument("--scale", type=_positive_int, default=8,
                   help="upscale factor of the 32x32 frames in the file, nearest neighbour (default 8: 256x256)")
    v.add_argument("--steps", type=_positive_int, default=None,
                   help="denoising steps per chunk (default: the model's, 4)")
    v.add_argument("--guidance-scale", type=_non_negative_float, default=None,
                   help="classifier-free guidance (default: the model's, 3.0)")
    v.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "assets" / "video"),
                   type=_existing_dir, metavar="DIR", help="pipeline folder (default assets/video)")
    v.add_argument("--seed", type=_non_negative_int, default=0, help="(default 0)")
    v.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    v.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_generate_parser(sub) -> None:
    from . import methods

    METHODS, VLM_METHODS = methods.names("ar-image"), methods.names("vlm")

    gen = sub.add_parser("generate", help="run a bundled pipeline: images (ar-image), answers (vlm) or videos (video)")
    kinds = gen.add_subparsers(dest="kind", required=True)
    v = kinds.add_parser("vlm", help="answer a question about an image with the bundled VLM (lossless methods)")
    v.add_argument("--image", required=True, type=_image_file, metavar="PATH",
                   help="an image file (PNG, JPEG, ...; converted to RGB)")
    v.add_argument("--prompt", required=True, type=_text, help='a question, e.g. "describe the image in detail ."')
    v.add_argument("--method", default="none", choices=VLM_METHODS, help="(default none)")
    v.add_argument("--knob", action="append", metavar="KEY=VALUE", help="a method knob, e.g. tree_depth=5")
    v.add_argument("--max-new-tokens", type=_positive_int, default=128, help="(default 128)")
    v.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 is greedy (default 0)")
    v.add_argument("--top-p", type=_probability, default=None, help="nucleus sampling with --temperature > 0")
    v.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "assets" / "vlm"),
                   type=_existing_dir, metavar="DIR", help="pipeline folder (default assets/vlm)")
    v.add_argument("--seed", type=_non_negative_int, default=0, help="(default 0)")
    v.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_generate_video_parser(kinds)
    p = kinds.add_parser("ar-image", help="AR image generation over VQ tokens")
    p.add_argument("--prompt", required=True, nargs="+", type=_text, help='class prompts, e.g. "a red circle"')
    p.add_argument("--method", default="none",
                   help=f"none or a composition: {', '.join(METHODS)} (default none)")
    p.add_argument("--knob", action="append", metavar="KEY=VALUE", help="a method knob, e.g. sjd_window=16")
    p.add_argument("--out", required=True, type=_output_dir, metavar="DIR", help="folder for the PNGs")
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "assets" / "ar-image"),
                   type=_existing_dir, metavar="DIR", help="pipeline folder (default assets/ar-image)")
    p.add_argument("--num-images", type=_positive_int, default=1, help="images per prompt (default 1)")
    p.add_argument("--guidance-scale", type=_non_negative_float, default=2.0, help="CFG scale (default 2.0)")
    p.add_argument("--temperature", type=_non_negative_float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="(default 0)")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    c = kinds.add_parser("continuous", help="AR image generation over continuous tokens (mixture / diffusion heads)")
    c.add_argument("--prompt", required=True, nargs="+", type=_text, help='class prompts, e.g. "a red circle"')
    c.add_argument("--method", default="none", help=f"one of {', '.join(methods.names('continuous'))} (default none)")
    c.add_argument("--knob", action="append", metavar="KEY=VALUE", help="a method knob, e.g. cspd_inner_temperature=10")
    c.add_argument("--out", required=True, type=_output_dir, metavar="DIR", help="folder for the PNGs")
    c.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "assets" / "continuous"),
                   type=_existing_dir, metavar="DIR", help="pipeline folder (default assets/continuous)")
    c.add_argument("--num-images", type=_positive_int, default=1, help="images per prompt (default 1)")
    c.add_argument("--guidance-scale", type=_non_negative_float, default=2.0,
                   help="CFG scale, MAR's linear schedule (default 2.0)")
    c.add_argument("--temperature", type=_positive_float, default=1.0, help="MAR's temperature, > 0 (default 1.0)")
    c.add_argument("--seed", type=_non_negative_int, default=0, help="(default 0)")
    c.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")


def cmd_demo(args) -> int:
    # the demo lives in the repository's demos/ folder, next to this package (editable installs)
    root = Path(__file__).resolve().parents[1]
    if not (root / "demos" / "app.py").is_file():
        raise FileNotFoundError(f"{root / 'demos' / 'app.py'} not found (run from a clone of the repository)")
    sys.path.insert(0, str(root))
    from demos import app

    app.launch(args.host, args.port)
    return 0


def cmd_batch(args) -> int:
    from .batch import run

    _set_threads(args.threads)
    summary = run(args.jobs, args.out, batch_size=args.batch_size, progress=not args.quiet)
    if summary.failed:
        print(f"mmspec batch: {summary.failed} of {summary.total} jobs failed; their errors are in "
              f"{Path(args.out) / 'manifest.jsonl'}", file=sys.stderr)
        return 1
    return 0


def _add_demo_batch_parsers(sub) -> None:
    demo = sub.add_parser("demo", help="launch the Gradio demo (localhost only unless --host says otherwise)")
    demo.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    demo.add_argument("--port", type=_positive_int, default=None, help="port (default: 7860 or the next free one)")
    batch = sub.add_parser("batch", help="run a JSONL/CSV file of jobs into a folder of files + manifest.jsonl "
                                         "(resumable; scales with accelerate launch --multi_gpu --num_processes N)")
    batch.add_argument("jobs", type=_existing_file, help="a .jsonl (or .csv) file of jobs (see mmspec/batch.py)")
    batch.add_argument("--out", required=True, type=_output_dir, metavar="DIR",
                       help="output folder (created; reruns resume it)")
    batch.add_argument("--batch-size", type=_positive_int, default=4,
                       help="same-kind jobs per pipeline call where outputs cannot change (default 4)")
    batch.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gpu = sub.add_parser("gpu-check", help="the prepared GPU check: CUDA tests, kernel timings, pipelines on "
                                           "the GPU (make gpu-check; --dry-run without one)")
    from .bench import gpu_check

    gpu_check.add_arguments(gpu)
    showcase = sub.add_parser("showcase", help="run every modality's bundled default, baseline vs methods")
    bench = sub.add_parser("bench", help="benchmark one part; prints a table, --json writes the rows")
    for p in (showcase, bench):
        p.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("--json", type=_output_file, metavar="PATH", help='write {"bench": name, "rows": [...]} here')
    bench.add_argument("--quick", action="store_true", help="smaller sample counts (the showcase's)")
    bench.add_argument("--pipeline", type=_existing_dir, metavar="DIR",
                       help="vlm only: the pipeline folder (default assets/vlm)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--images", type=_positive_int, metavar="N",
                       help="ar-image only: images per method (default 128, 16 with --quick); KID intervals "
                            "narrow as 1/sqrt(N); p vs none is exact at any N")
    bench.add_argument("--frames", type=_positive_int, nargs="+", metavar="N",
                       help="video only: stream lengths of the per-method rows (default 100 1000 10000, "
                            "100 300 with --quick)")
    bench.add_argument("--groups", nargs="+", choices=VIDEO_GROUPS, metavar="GROUP",
                       help=f"video only: the row groups to run, among {', '.join(VIDEO_GROUPS)} (default all)")
    bench.add_argument("--gpu-curve", type=_existing_file, metavar="FILE",
                       help="cost only: a JSON cost curve of another machine (verify cost ratio by T, draft/target "
                            "cost ratios; see assets/cost_curves/); adds a projected column, labelled as not measured")
    showcase.add_argument("--out", default="outputs/showcase", type=_output_dir, metavar="DIR",
                          help="where the sample grids go (default outputs/showcase)")
    _add_generate_parser(sub)
    _add_train_parser(sub)
    _add_demo_batch_parsers(sub)
    return parser


def check_args(args) -> None:
    """What argparse cannot see alone, checked before anything loads: method names and knobs
    through the method registry, arguments that need each other. ``UsageError`` otherwise."""
    try:
        if args.command == "generate" and args.kind != "video":
            args.method_knobs = _knobs(args.knob, args.kind, args.method)
        elif args.command == "train" and args.recipe == "ar-draft" and args.kind != "chain" and args.target is None:
            raise ValueError(f"--kind {args.kind} needs --target DIR (the AR model it drafts for)")
        elif args.command == "train" and args.recipe == "ar-draft" and args.heads is not None and args.kind != "medusa":
            raise ValueError(f"--heads is for --kind medusa only, got --kind {args.kind}")
        elif args.command == "train" and args.recipe == "vlm-draft" and args.heads is not None and args.method != "medusa":
            raise ValueError(f"--heads is for --method medusa only, got --method {args.method}")
        elif args.command == "train" and args.recipe == "continuous-draft" and args.distill > 0 and args.target is None:
            raise ValueError("--distill needs --target DIR (the continuous AR model it distills from)")
        elif args.command == "bench" and args.pipeline is not None and args.name != "vlm":
            raise ValueError(f"--pipeline is for 'bench vlm' only, got 'bench {args.name}'")
        elif args.command == "bench" and args.frames is not None and args.name != "video":
            raise ValueError(f"--frames is for 'bench video' only, got 'bench {args.name}'")
        elif args.command == "bench" and args.groups is not None and args.name != "video":
            raise ValueError(f"--groups is for 'bench video' only, got 'bench {args.name}'")
        elif args.command == "bench" and args.images is not None and args.name != "ar-image":
            raise ValueError(f"--images is for 'bench ar-image' only, got 'bench {args.name}'")
        elif args.command == "bench" and args.gpu_curve is not None and args.name != "cost":
            raise ValueError(f"--gpu-curve is for 'bench cost' only, got 'bench {args.name}'")
        elif args.command == "bench" and args.gpu_curve is not None:  # last: the checks above still apply
            from .bench import cost

            args.gpu_curve = cost.load_gpu_curve(args.gpu_curve, "--gpu-curve", cost.CostBenchConfig().drafters())
    except UsageError:
        raise
    except ValueError as err:
        raise UsageError(str(err), args._prog) from err


def main(argv: list[str] | None = None) -> int:
    """Run one command. An error prints one line ``<command>: error: <message>`` on stderr and
    exits with status 2 (a bad command line, found before anything loads) or 1 (a ValueError or
    OSError while running, e.g. a corrupt checkpoint); ``--debug`` re-raises it instead."""
    parser = build_parser()
    args, debug = None, False
    try:
        args = parser.parse_args(argv)
        debug = getattr(args, "debug", False)
        check_args(args)
        handler = {"bench": cmd_bench, "showcase": cmd_showcase, "train": cmd_train,
                   "generate": cmd_generate, "demo": cmd_demo, "batch": cmd_batch,
                   "gpu-check": cmd_gpu_check}[args.command]
        return handler(args)
    except (ValueError, OSError) as err:
        if debug or (args is None and "--debug" in (sys.argv[1:] if argv is None else argv)):
            raise
        usage = isinstance(err, UsageError)
        prog = err.prog if usage else getattr(args, "_prog", parser.prog)
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(2 if usage else 1) from None


if __name__ == "__main__":
    raise SystemExit(main())
