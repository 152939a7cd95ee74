"""``mmspec gpu-check``: the prepared GPU check (``make gpu-check``); the check itself and its
options live in ``mmspec.bench.gpu_check``."""

from __future__ import annotations

NAME = "gpu-check"


def register_subcommand(subparsers) -> None:
    from ..bench import gpu_check

    gpu = subparsers.add_parser(NAME, help="the prepared GPU check: CUDA tests, kernel timings, pipelines on "
                                           "the GPU (make gpu-check; --dry-run without one)")
    gpu_check.add_arguments(gpu)


def run(args) -> int:
    from ..bench import gpu_check

    return gpu_check.cmd(args)
