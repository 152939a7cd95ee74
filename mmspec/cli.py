"""``mmspec``: the command line.

    mmspec showcase                  the main job: every modality's default, baseline vs methods
    mmspec bench core [--json PATH]  the speculation core on synthetic pairs, as a table or JSON
"""

from __future__ import annotations

import argparse
import sys

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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"bench": cmd_bench, "showcase": cmd_showcase}[args.command]
    return handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
