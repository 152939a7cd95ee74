"""``mmspec``: the command line.

    mmspec showcase                  the main job: every modality's default, baseline vs methods
    mmspec bench core [--json PATH]  the speculation core on synthetic pairs, as a table or JSON
    mmspec train vq --out DIR        rebuild the tiny VQ tokenizer from a seed (about 6 min on 2 cores)
    mmspec train ar-image --vq DIR --out DIR
                                     rebuild the AR image model on that tokenizer (about 20 min)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCHES = ("core",)


def _progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def _set_threads(n: int) -> None:
    import torch

    # the bundled models are tiny: on a 2-core machine, intra-op threads cost more than they save
    # and turn wall times noisy under any other load, so benchmarks default to one
    torch.set_num_threads(n)


def cmd_bench(args) -> int:
    from .bench import core, report

    _set_threads(args.threads)
    if args.name == "core":
        cfg = core.CoreBenchConfig.quick() if args.quick else core.CoreBenchConfig()
        result = core.run(cfg, progress=None if args.quiet else _progress)
        columns = report.CORE_COLUMNS
    if args.json:
        report.write_json(args.json, result)
    print(report.format_table(result["rows"], columns))
    return 0


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
    print("AR image, VLM, continuous and video parts arrive with their modality adapters.")
    return 0


def cmd_train(args) -> int:
    from .training import recipes

    _set_threads(args.threads)
    common = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                  dataset_size=args.dataset_size, log_every=args.log_every, log=print)
    if args.recipe == "vq":
        record = recipes.train_vq(args.out, **common)
        print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.4f}, "
              f"{record['wall_time_s']:.0f} s")
    else:
        record = recipes.train_ar_image(args.out, vq_dir=args.vq, **common)
        print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f}, {record['wall_time_s']:.0f} s")
    return 0


def _number(cast, low, strict: bool):
    """An argparse type: ``cast(text)`` that must be above ``low`` (or at least, if not strict)."""
    allowed = f"a number > {low}" if strict else f"an int >= {low}"

    def parse(text: str):
        value = cast(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


_positive_int = _number(int, 1, strict=False)
_non_negative_int = _number(int, 0, strict=False)
_positive_float = _number(float, 0, strict=True)


def _existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text!r}")
    return text


# defaults sized from measured step times on a 2-core CPU at 2 threads (0.24 s per VQ step at
# batch 16, 0.62 s per AR step at batch 32): about 6 and 19 minutes
TRAIN_DEFAULTS = {
    "vq": dict(steps=1500, batch_size=16, lr=1e-3, dataset_size=4096),
    "ar-image": dict(steps=1800, batch_size=32, lr=5e-4, dataset_size=4096),
}


def _add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="rebuild a tiny checkpoint from a seed")
    recipes = train.add_subparsers(dest="recipe", required=True)
    helps = {"vq": "the VQ tokenizer on procedural shapes",
             "ar-image": "the class-conditional AR image model on a trained VQ's ids"}
    for name, defaults in TRAIN_DEFAULTS.items():
        p = recipes.add_parser(name, help=helps[name])
        if name == "ar-image":
            p.add_argument("--vq", required=True, type=_existing_dir, metavar="DIR",
                           help="folder written by 'mmspec train vq'")
        p.add_argument("--out", required=True, metavar="DIR", help="checkpoint folder (replaced atomically)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmspec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    showcase = sub.add_parser("showcase", help="run every modality's bundled default, baseline vs methods")
    bench = sub.add_parser("bench", help="benchmark one part; prints a table, --json writes the rows")
    for p in (showcase, bench):
        p.add_argument("--threads", type=_positive_int, default=1, help="torch intra-op threads (default 1)")
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("--json", metavar="PATH", help='write {"bench": name, "rows": [...]} here')
    bench.add_argument("--quick", action="store_true", help="smaller sample counts (the showcase's)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"bench": cmd_bench, "showcase": cmd_showcase, "train": cmd_train}[args.command]
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
