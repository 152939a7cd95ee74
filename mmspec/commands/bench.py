"""``mmspec bench NAME``: one benchmark as a table (``--json PATH`` writes the rows too).

Each bench is one entry of ``BENCHES``: a function that runs it from the parsed arguments and
returns ``(result, columns)``; the subcommand's choices are that table's names."""

from __future__ import annotations

import sys
from typing import Callable

from .common import existing_dir, existing_file, number, output_file, positive_int, progress, set_threads

NAME = "bench"

BENCHES: dict[str, Callable] = {}
"""``{name: run(args) -> (result, columns)}``, in the order ``mmspec bench --help`` lists them."""

VIDEO_GROUPS = {"window-sweep": ("windows", ()), "prompt-switch": ("switches", ()),
                "multi-switch": ("multi_switches", 0), "frames": ("frames", ()), "wan-tiny": ("wan_frames", 0)}
"""``bench video --groups``: each row group, the ``VideoBenchConfig`` field that sizes it and the
value that turns it off."""
METHODS = ("rolling", "window-recompute", "full-cache", "no-sink")
"""``bench video --methods``: ``mmspec.bench.video``'s cache modes (named here so the parser is
built without importing the bench)."""


def _bench(name: str):
    def register(fn):
        BENCHES[name] = fn
        return fn

    return register


def _progress(args):
    return None if args.quiet else progress


def _config(config_cls, args):
    """The bench's config: its ``quick()`` sizes with ``--quick``, its defaults otherwise, and
    ``pipeline_dir`` from ``--pipeline`` (given only to the benches ``_ONLY`` allows it for)."""
    cfg = config_cls.quick() if args.quick else config_cls()
    if args.pipeline is not None:
        cfg.pipeline_dir = args.pipeline
    return cfg


@_bench("core")
def _core(args):
    from ..bench import core, report

    cfg = _config(core.CoreBenchConfig, args)
    return core.run(cfg, progress=_progress(args)), report.CORE_COLUMNS


@_bench("ar-image")
def _ar_image(args):
    from ..bench import ar_image

    cfg = _config(ar_image.ARImageBenchConfig, args)
    if args.images is not None:
        cfg.images = args.images
    return ar_image.public(ar_image.run(cfg, progress=_progress(args))), ar_image.AR_IMAGE_COLUMNS


@_bench("vlm")
def _vlm(args):
    from ..bench import vlm

    cfg = (vlm.VLMBenchConfig.quick if args.quick else vlm.VLMBenchConfig)(
        scenario=args.scenario or "scenes", images_per_prompt=args.images_per_prompt or 1)
    if args.pipeline is not None:
        cfg.pipeline_dir = args.pipeline
    return vlm.run(cfg, progress=_progress(args)), vlm.VLM_COLUMNS


@_bench("adapt")
def _adapt(args):
    from ..bench import adapt

    cfg = _config(adapt.AdaptBenchConfig, args)
    return adapt.run(cfg, progress=_progress(args)), adapt.ADAPT_COLUMNS


@_bench("video")
def _video(args):
    from ..bench import video

    cfg = _config(video.VideoBenchConfig, args)
    if args.frames is not None:
        cfg.frames = tuple(args.frames)
    if args.prompts is not None:
        cfg.prompts = video.PROMPT_SET[:args.prompts]
    if args.videos_per_prompt is not None:  # video i: prompt i % N, generator seed + i
        cfg.prompts = tuple(cfg.prompts) * args.videos_per_prompt
    if args.methods is not None:
        cfg.methods = tuple(args.methods)
    groups = set(args.groups or VIDEO_GROUPS)
    for group, (field, off) in VIDEO_GROUPS.items():
        if group not in groups:
            setattr(cfg, field, off)
    # rewritten after every group: an interrupted run leaves the groups it finished
    result = video.public(video.run(cfg, progress=_progress(args), json_path=args.json))
    return result, video.VIDEO_COLUMNS


@_bench("kernels")
def _kernels(args):
    from ..bench import kernels

    cfg = _config(kernels.KernelBenchConfig, args)
    return kernels.run(cfg, progress=_progress(args)), kernels.KERNELS_COLUMNS


@_bench("continuous")
def _continuous(args):
    from ..bench import continuous

    cfg = _config(continuous.ContinuousBenchConfig, args)
    return continuous.public(continuous.run(cfg, progress=_progress(args))), continuous.CONTINUOUS_COLUMNS


@_bench("cost")
def _cost(args):
    from ..bench import cost

    if args.calibrate:
        return _calibrate(args)
    cfg = _config(cost.CostBenchConfig, args)
    cfg.gpu_curve = args.gpu_curve  # checked and loaded by check
    result = cost.public(cost.run(cfg, progress=_progress(args)))
    return result, cost.columns(result)


def _calibrate(args):
    """``bench cost --calibrate``: this machine's cost profile for ``method="auto"``, per target."""
    from ..bench.cost import calibrate as cal

    rows, profiles = [], []
    for modality in args.target or ("ar-image", "vlm"):
        cfg = cal.CalibrateConfig(modality=modality, folder=args.pipeline, quality=args.quality,
                                  out=args.profile_out, **({"prompts": 2} if args.quick else {}))
        say = _progress(args)
        profile = cal.calibrate(cfg, progress=None if say is None else (lambda m, t=modality: say(f"{t}: {m}")))
        profiles.append({"modality": modality, "path": profile.path, "key": profile.key, "machine": profile.machine,
                         "setup": profile.setup, "quality": profile.quality})
        rows += [{"modality": modality, **r} for r in cal.profile_table(profile)]
    return {"bench": "cost-calibrate", "setup": {"profiles": profiles}, "rows": rows}, cal.PROFILE_COLUMNS


@_bench("auto")
def _auto(args):
    from ..bench import auto

    cfg = _config(auto.AutoBenchConfig, args)
    if args.target:
        cfg.modalities = tuple(args.target)
    cfg.calibrate = bool(args.calibrate)
    return auto.run(cfg, progress=_progress(args)), auto.AUTO_COLUMNS


@_bench("serve")
def _serve(args):
    from ..bench import serve

    cfg = _config(serve.ServeBenchConfig, args)
    return serve.run(cfg, progress=_progress(args)), serve.SERVE_COLUMNS


@_bench("compile")
def _compile(args):
    from ..bench import compile as compiled

    cfg = _config(compiled.CompileBenchConfig, args)
    return compiled.run(cfg, progress=_progress(args)), compiled.COMPILE_COLUMNS


@_bench("glm-image")
def _glm_image(args):
    from ..bench import glm_image

    cfg = _config(glm_image.GlmImageBenchConfig, args)
    return glm_image.run(cfg, progress=_progress(args)), glm_image.GLM_IMAGE_COLUMNS


def register_subcommand(subparsers) -> None:
    bench = subparsers.add_parser(NAME, help="benchmark one part; prints a table, --json writes the rows")
    bench.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)")
    bench.add_argument("name", choices=tuple(BENCHES))
    bench.add_argument("--json", type=output_file, metavar="PATH", help='write {"bench": name, "rows": [...]} here')
    bench.add_argument("--quick", action="store_true", help="smaller sample counts (the showcase's)")
    bench.add_argument("--pipeline", type=existing_dir, metavar="DIR",
                       help="vlm, adapt, video and cost --calibrate only: the pipeline folder to bench (default "
                            "assets/vlm, assets/video; for cost --calibrate the --target's bundled folder)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--scenario", choices=("scenes", "visual-heavy", "stream"),
                       help="vlm only: scenes (default: the 64 px VLM, 64 visual tokens per image), visual-heavy "
                            "(the 192 px VLM, 576 per image: eagle, specvlm's gate and forced branches, vispec, "
                            "medusa) or stream (2,000 frames in chunks of 4, a question each chunk, on the bounded "
                            "stream cache: latency slope, cache size, exactness)")
    bench.add_argument("--images-per-prompt", type=positive_int, metavar="K",
                       help="vlm only, scenes and visual-heavy: held-out scenes per prompt (default 1), one image "
                            "part each before the question: K times the visual tokens")
    bench.add_argument("--images", type=positive_int, metavar="N",
                       help="ar-image only: images per method (default 128, 16 with --quick); KID intervals "
                            "narrow as 1/sqrt(N); p vs none is exact at any N")
    bench.add_argument("--frames", type=positive_int, nargs="+", metavar="N",
                       help="video only: stream lengths of the per-method rows (default 100 1000 10000, "
                            "100 300 with --quick)")
    bench.add_argument("--prompts", type=number(int, 1, strict=False, high=16), metavar="N",
                       help="video only: streams per row, the first N of the 16 colour x shape prompts (default 4, "
                            "2 with --quick); the shape columns' 95%% intervals are over these streams")
    bench.add_argument("--videos-per-prompt", type=number(int, 1, strict=False, high=64), metavar="K",
                       help="video only: streams per prompt, each from its own seed (default 1): the rows average "
                            "over prompts x K streams, video i showing prompt i %% N from seed i")
    bench.add_argument("--methods", nargs="+", choices=METHODS, metavar="METHOD",
                       help=f"video only: the cache modes of the per-method rows, among {', '.join(METHODS)} "
                            "(default all)")
    bench.add_argument("--groups", nargs="+", choices=tuple(VIDEO_GROUPS), metavar="GROUP",
                       help=f"video only: the row groups to run, among {', '.join(VIDEO_GROUPS)} (default all)")
    bench.add_argument("--calibrate", action="store_true",
                       help="cost: measure this machine's cost profile for method='auto' (pass costs by batch size, "
                            "acceptance; here about 5.5 minutes for both bundled targets) and save it under ~/.cache/mmspec/profiles; "
                            "auto: calibrate first even when a profile exists")
    bench.add_argument("--target", nargs="+", choices=("ar-image", "vlm", "continuous"), metavar="TARGET",
                       help="cost --calibrate and auto only: the targets, among ar-image, vlm, continuous "
                            "(default ar-image and vlm)")
    bench.add_argument("--quality", type=existing_file, metavar="FILE",
                       help="cost --calibrate only: a `mmspec bench ar-image --json` result; its permutation test "
                            "marks the lossy methods auto_quality='kept' admits")
    bench.add_argument("--profile-out", type=output_file, metavar="PATH",
                       help="cost --calibrate only: save the profile here instead of the cache (one target)")
    bench.add_argument("--gpu-curve", type=existing_file, metavar="FILE",
                       help="cost only: a JSON cost curve of another machine (verify cost ratio by T, draft/target "
                            "cost ratios; see assets/cost_curves/); adds a projected column, labelled as not measured")


# options that belong to some benches: (argument, attribute, the benches it is for)
_ONLY = (("--pipeline", "pipeline", ("vlm", "video", "adapt", "cost")), ("--frames", "frames", ("video",)),
         ("--prompts", "prompts", ("video",)), ("--groups", "groups", ("video",)),
         ("--videos-per-prompt", "videos_per_prompt", ("video",)), ("--methods", "methods", ("video",)),
         ("--images", "images", ("ar-image",)), ("--gpu-curve", "gpu_curve", ("cost",)),
         ("--target", "target", ("cost", "auto")), ("--quality", "quality", ("cost",)),
         ("--profile-out", "profile_out", ("cost",)), ("--scenario", "scenario", ("vlm",)),
         ("--images-per-prompt", "images_per_prompt", ("vlm",)))


def check(args) -> None:
    """Options given to a bench they are not for; ``--gpu-curve`` loaded (``ValueError`` if bad)."""
    for option, attr, names in _ONLY:
        if getattr(args, attr) is not None and args.name not in names:
            allowed = " and ".join(f"'bench {n}'" for n in names)
            raise ValueError(f"{option} is for {allowed} only, got 'bench {args.name}'")
    if args.calibrate and args.name not in ("cost", "auto"):
        raise ValueError(f"--calibrate is for 'bench cost' and 'bench auto' only, got 'bench {args.name}'")
    if args.name == "cost":
        for option, attr in (("--target", "target"), ("--quality", "quality"), ("--profile-out", "profile_out"),
                             ("--pipeline", "pipeline")):
            if getattr(args, attr) is not None and not args.calibrate:
                raise ValueError(f"{option} is for 'bench cost --calibrate' only (a profile), got 'bench cost'")
        if args.calibrate and args.gpu_curve is not None:
            raise ValueError("--gpu-curve is for 'bench cost' without --calibrate (a projection, not a profile)")
        if args.calibrate and (args.profile_out or args.pipeline) and len(args.target or ("ar-image", "vlm")) != 1:
            raise ValueError("--profile-out and --pipeline name one pipeline: give one --target with them")
    if args.gpu_curve is not None:
        from ..bench import cost

        args.gpu_curve = cost.load_gpu_curve(args.gpu_curve, "--gpu-curve", cost.CostBenchConfig().drafters())


def run(args) -> int:
    from ..bench import report
    from ..bench.machine import LoadMonitor

    set_threads(args.threads)
    with LoadMonitor() as monitor:
        result, columns = run_bench(args)
    result.setdefault("setup", {})["machine"] = monitor.record()
    if args.json:
        report.write_json(args.json, result)
    if args.name == "cost" and args.calibrate:
        print(report.format_table(result["rows"], columns))
        for p in result["setup"]["profiles"]:
            print(f"\n{p['modality']}: profile saved to {p['path']} ({p['machine']})")
    elif args.name == "auto":
        from ..bench import auto

        print(report.format_table(result["rows"], columns))
        print("\n" + report.format_table(result["summary"], auto.SUMMARY_COLUMNS))
    elif args.name == "cost":  # a curve table per target, then the method table
        from ..bench import cost

        print(cost.format_report(result))
    elif args.name == "glm-image":  # a header and footnote: the weights are random
        from ..bench import glm_image

        print(glm_image.format_report(result, columns))
    else:
        print(report.format_table(result["rows"], columns))
    footer = monitor.footer()
    print("\n" + "\n".join(footer))
    if monitor.quiet is False:
        print(footer[-1], file=sys.stderr)
    return 0


def run_bench(args) -> tuple[dict, list]:
    """The bench ``args.name`` run: ``(result, columns)``."""
    return BENCHES[args.name](args)
