"""``mmspec batch JOBS --out DIR``: resumable batch generation (``mmspec.batch``): a file per job
and ``manifest.jsonl``; exit status 1 when a job failed."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import existing_file, output_dir, positive_float, positive_int, set_threads

NAME = "batch"


def register_subcommand(subparsers) -> None:
    batch = subparsers.add_parser(NAME, help="run a JSONL/CSV file of jobs into a folder of files + manifest.jsonl "
                                             "(resumable; scales with accelerate launch --multi_gpu --num_processes N)")
    batch.add_argument("jobs", type=existing_file, help="a .jsonl (or .csv) file of jobs (see mmspec/batch.py)")
    batch.add_argument("--out", required=True, type=output_dir, metavar="DIR",
                       help="output folder (created; reruns resume it)")
    batch.add_argument("--batch-size", type=positive_int, default=4,
                       help="same-kind jobs per pipeline call where outputs cannot change (default 4)")
    batch.add_argument("--continuous", action="store_true",
                       help="continuous batching: same-kind jobs that may share a call stream through --batch-size "
                            "slots, a finished job's slot refilled at once (its file written as it ends)")
    batch.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")
    batch.add_argument("--adapt-drafts", action="store_true",
                       help="vlm jobs: the draft heads keep learning from the answers they serve (online "
                            "distillation; answers unchanged; each process adapts its own copy, from the saved "
                            "head again at every run or resume)")
    batch.add_argument("--adapt-lr", type=positive_float, default=3e-4, help="with --adapt-drafts (default 3e-4)")
    batch.add_argument("--adapt-every", type=positive_int, default=8,
                       help="with --adapt-drafts: answers per update step (default 8)")


def run(args) -> int:
    from ..batch import run as run_jobs

    set_threads(args.threads)
    models = None
    if args.adapt_drafts:
        from .. import serve

        models = serve.Models(adapt_drafts=dict(lr=args.adapt_lr, every=args.adapt_every))
    summary = run_jobs(args.jobs, args.out, batch_size=args.batch_size, progress=not args.quiet, models=models,
                       continuous=args.continuous)
    if summary.failed:
        print(f"mmspec batch: {summary.failed} of {summary.total} jobs failed; their errors are in "
              f"{Path(args.out) / 'manifest.jsonl'}", file=sys.stderr)
        return 1
    return 0
