"""``mmspec showcase``: every modality's bundled default, baseline against its methods (the core on
synthetic pairs, AR image, VLM, streaming video, continuous tokens), with sample grids in ``--out``."""

from __future__ import annotations

from pathlib import Path

from .common import ROOT, output_dir, positive_int, progress, set_threads

NAME = "showcase"


def register_subcommand(subparsers) -> None:
    showcase = subparsers.add_parser(NAME, help="run every modality's bundled default, baseline vs methods")
    showcase.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)")
    showcase.add_argument("--out", default="outputs/showcase", type=output_dir, metavar="DIR",
                          help="where the sample grids go (default outputs/showcase)")


def run(args) -> int:
    from ..bench import core, report

    set_threads(args.threads)
    print("mmspec showcase: the speculation core on synthetic draft/target pairs (CPU)\n")
    result = core.run(core.CoreBenchConfig.quick(), progress=progress)
    print(report.format_table(result["rows"], report.CORE_COLUMNS))
    setup = result["setup"]
    print(f"\nlayer-skip pair: {setup['target']}; draft: {setup['draft']}; "
          f"{setup['prompts']} prompts x {setup['new_tokens']} tokens.")
    print("NFE/sample = target passes each row needed (prefill included); x = speedup vs 'none' in this run;")
    print("tau = tokens per target pass, bonus token counted; exact: greedy rows bit-identical to 'none',")
    print(f"sampled rows pass the chi-square distribution test (N={setup['exact_samples']}, p >= "
          f"{setup['exact_threshold']}); iid rows: tau beside (1 - a^(g+1)) / (1 - a).")
    ar_image_part(Path(args.out))
    vlm_part()
    video_part(Path(args.out))
    if (ROOT / "assets" / "continuous" / "model_index.json").is_file():
        continuous_part(Path(args.out))
    else:
        print("\nThe continuous-token part needs assets/continuous, which is missing here: `make assets` "
              "rebuilds it (README, 'Continuous-token image generation').")
    print("Try the methods by hand in the Gradio demo: `make demo` (or `.venv/bin/mmspec demo`), then open "
          "http://127.0.0.1:7860 in a browser.")
    return 0


def ar_image_part(out_dir: Path) -> None:
    from ..bench import ar_image, report

    print("\nmmspec showcase: AR image generation on the bundled checkpoints (CPU, 1 image per call)\n")
    cfg = ar_image.ARImageBenchConfig.quick(methods=ar_image.SHOWCASE_METHODS)
    result = ar_image.run(cfg, progress=progress)
    grid = out_dir / "ar_image_grid.png"
    ar_image.save_grid(result, grid)
    print(report.format_table(result["rows"], ar_image.AR_IMAGE_COLUMNS))
    setup = result["setup"]
    print(f"\n{setup['images']} images per method (one per class, seeds {setup['seed']}..), CFG "
          f"{setup['guidance_scale']}, T={setup['temperature']}; FD on the recipe classifier's features vs "
          f"{setup['reference_images']} real images (real-vs-real floor at this size: {setup['fd_real_floor']:.2f}); "
          f"target's mean top-1 probability on its samples: {setup['mean_top1_prob']:.3f}.")
    print(f"samples, one row per method ({', '.join(result['_grids'])}): {grid}")


def continuous_part(out_dir: Path, model_dir: str | Path | None = None, images: int = 16, **bench) -> None:
    """Continuous tokens on the bundled pipeline: the target alone (mixture head), lossless ``sd``
    and ``sd`` with the distilled draft, ``images`` images each (one per class), a grid of samples
    in ``out_dir`` and the bench's table with the PIT exactness test of the ``sd`` rows. ``bench``
    overrides other ``ContinuousBenchConfig.quick`` fields."""
    from ..bench import continuous, report

    print("\nmmspec showcase: continuous-token AR image generation (MAR-style mixture head, CPU, 1 image per call)\n")
    model_dir = Path(model_dir or ROOT / "assets" / "continuous")
    booster = model_dir / "draft_distilled"
    cfg = continuous.ContinuousBenchConfig.quick(
        pipeline_dir=str(model_dir), booster_dir=str(booster) if booster.is_dir() else None, images=images,
        rows=tuple(r for r in continuous.DEFAULT_ROWS if r[0] in continuous.SHOWCASE_ROWS), **bench)
    result = continuous.run(cfg, progress=progress)
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


def video_part(out_dir: Path, model_dir: str | Path | None = None) -> None:
    """A prompt-switch stream from the bundled video pipeline: a GIF and a frame strip in ``out_dir``,
    the stream's cache and latency figures, and the colour read back from its pixels."""
    import torch

    from ..pipelines import StreamingVideoPipeline, save_frame_strip, save_video
    from ..training.data.video import PROMPT_VOCAB, frame_colour

    print("\nmmspec showcase: streaming video on the bundled chunk-causal video model (CPU, rolling sink + window "
          "KV cache)\n")
    model_dir = model_dir or ROOT / "assets" / "video"
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


def vlm_part() -> None:
    from ..bench import report, vlm
    from ..pipelines import SpeculativeVLMPipeline

    print("\nmmspec showcase: lossless VLM decoding on the bundled tiny LLaVA-style model (CPU, batch 1)\n")
    cfg = vlm.VLMBenchConfig.quick(rows=vlm.SHOWCASE_ROWS)
    result = vlm.run(cfg, progress=progress)
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
