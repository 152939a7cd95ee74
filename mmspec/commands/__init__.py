"""``mmspec``: the command line.

    mmspec showcase                  the main job: every modality's default, baseline vs methods
    mmspec bench core [--json PATH]  the speculation core on synthetic pairs, as a table or JSON
    mmspec bench ar-image [--json PATH]
                                     every AR image method on the bundled checkpoints: NFE, wall, FD, accuracy
    mmspec bench vlm [--json PATH]   every VLM method and transformers' assisted generation: tau, tokens/s
    mmspec bench kernels [--json PATH]
                                     the kernels against their torch references; on a GPU also at GPU shapes
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
                                     the continuous AR target and its drafts (target 18,000 steps in 40 min
                                     at two threads, drafts 4,000 and 2,500 steps in 5 and 8 min at one
                                     thread each, side by side)
    mmspec train ar-eagle | vlm-medusa | continuous-sd | ... --out DIR
                                     each trained drafter's registered recipe (mmspec.methods); ar-draft,
                                     vlm-draft and continuous-draft run them

One module per subcommand (``bench``, ``generate``, ``train``, ...), each with
``register_subcommand(subparsers)``, ``run(args)`` and, where arguments depend on each other,
``check(args)``; ``common`` holds the parser class and the argument types they share. Method names
come from the method registry (``mmspec.methods``), and so do the trained drafters' recipes (with
the ``ar-draft --kind`` / ``vlm-draft --method`` choices); other recipe kinds come from the
recipes' tables, bench names from ``bench.BENCHES``.
"""

from __future__ import annotations

import sys

from ..utils import one_line
from . import batch, bench, demo, generate, gpu_check, showcase, train
from .common import Parser, UsageError

COMMANDS = {m.NAME: m for m in (gpu_check, showcase, bench, generate, train, demo, batch)}
"""``{name: module}``, in the order ``mmspec --help`` lists them."""

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]


def build_parser() -> Parser:
    parser = Parser(prog="mmspec", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.register_subcommand(subparsers)
    return parser


def check_args(args) -> None:
    """What argparse cannot see alone, checked before anything loads: method names and knobs
    through the method registry, arguments that need each other. ``UsageError`` otherwise."""
    check = getattr(COMMANDS[args.command], "check", None)
    if check is None:
        return
    try:
        check(args)
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
        return COMMANDS[args.command].run(args)
    except (ValueError, OSError) as err:
        if debug or (args is None and "--debug" in (sys.argv[1:] if argv is None else argv)):
            raise
        usage = isinstance(err, UsageError)
        prog = err.prog if usage else getattr(args, "_prog", parser.prog)
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(2 if usage else 1) from None
