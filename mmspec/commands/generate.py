"""``mmspec generate MODALITY``: run a bundled pipeline: images (ar-image, continuous), answers (vlm)
or videos (video). Method names and knobs come from the method registry (``mmspec.methods``).

The subcommands are the served modalities (``mmspec.serve.SPECS``) whose spec names a
``GenerateCommand`` (``ModalitySpec.generate``), in their registration order."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .common import (ROOT, existing_dir, image_file, non_empty, non_negative_float, non_negative_int, output_dir,
                     output_file, positive_float, positive_int, probability, set_threads)

NAME = "generate"


def register_subcommand(subparsers) -> None:
    gen = subparsers.add_parser(NAME, help="run a bundled pipeline: images (ar-image, continuous), answers (vlm) "
                                           "or videos (video)")
    kinds = gen.add_subparsers(dest="kind", required=True)
    for command in commands().values():
        command.add(kinds)


@dataclass(frozen=True)
class GenerateCommand:
    """One modality's ``mmspec generate KIND``, named by its ``ModalitySpec.generate``.

    ``add(subparsers)`` adds the subcommand's parser (named after the kind); ``run(args) -> int``
    runs it. ``registry_knobs``: whether ``--method`` and ``--knob`` resolve through the method
    registry before any model loads (``args.method_knobs``); False where the command checks its own
    options (video: cache modes)."""

    add: Callable[[argparse._SubParsersAction], None]
    run: Callable[[argparse.Namespace], int]
    registry_knobs: bool = True


def commands() -> dict[str, GenerateCommand]:
    """``{kind: command}`` of the served modalities that have one, in registration order."""
    from .. import serve
    from ..utils.refs import load_ref

    return {kind: load_ref(spec.generate) for kind, spec in serve.SPECS.items() if spec.generate is not None}


def _add_common(p) -> None:
    p.add_argument("--seed", type=non_negative_int, default=0, help="(default 0)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_vlm(kinds) -> None:
    from .. import methods

    v = kinds.add_parser("vlm", help="answer a question about an image with the bundled VLM (lossless methods)")
    v.add_argument("--image", required=True, type=image_file, metavar="PATH", action="append",
                   help="an image file (PNG, JPEG, ...; converted to RGB); repeat it for several images in the "
                        "prompt, in order")
    v.add_argument("--prompt", required=True, type=non_empty, help='a question, e.g. "describe the image in detail ."')
    v.add_argument("--method", default="none", choices=methods.auto.method_names("vlm", methods.names("vlm")),
                   help="(default none; auto: the fastest lossless method on this machine, from "
                        "`mmspec bench cost --calibrate`)")
    v.add_argument("--knob", action="append", metavar="KEY=VALUE", help="a method knob, e.g. tree_depth=5")
    v.add_argument("--max-new-tokens", type=positive_int, default=128, help="(default 128)")
    v.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy (default 0)")
    v.add_argument("--top-p", type=probability, default=None, help="nucleus sampling with --temperature > 0")
    v.add_argument("--model", default=str(ROOT / "assets" / "vlm"),
                   type=existing_dir, metavar="DIR", help="pipeline folder (default assets/vlm)")
    _add_common(v)


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
    return output_file(text)


def _add_video(kinds) -> None:
    v = kinds.add_parser("video", help="stream a video from the bundled chunk-causal video model (rolling KV cache)")
    v.add_argument("--prompt", required=True, type=non_empty, help='e.g. "a red circle moving right" (a colour, a '
                   "shape and a direction: red green blue yellow, circle square triangle star, right left up down)")
    v.add_argument("--switch", action="append", type=_switch, metavar="FRAME:TEXT",
                   help="switch to TEXT at FRAME, a multiple of the model's chunk (3 frames for the bundled one); "
                        "repeatable, any order; the cached frames are re-encoded under the new prompt")
    v.add_argument("--frames", type=positive_int, default=96, help="frames to generate (default 96)")
    v.add_argument("--out", required=True, type=_video_file, metavar="PATH",
                   help="clip.mp4 (H.264 through imageio-ffmpeg) or clip.gif; written to a temporary file and renamed")
    v.add_argument("--fps", type=positive_int, default=16, help="(default 16)")
    v.add_argument("--scale", type=positive_int, default=8,
                   help="upscale factor of the 32x32 frames in the file, nearest neighbour (default 8: 256x256)")
    v.add_argument("--steps", type=positive_int, default=None,
                   help="denoising steps per chunk (default: the model's, 4)")
    v.add_argument("--guidance-scale", type=non_negative_float, default=None,
                   help="classifier-free guidance (default: the model's, 3.0)")
    v.add_argument("--model", default=str(ROOT / "assets" / "video"),
                   type=existing_dir, metavar="DIR", help="pipeline folder (default assets/video)")
    _add_common(v)


def _add_ar_image(kinds) -> None:
    from .. import methods

    p = kinds.add_parser("ar-image", help="AR image generation over VQ tokens")
    p.add_argument("--prompt", required=True, nargs="+", type=non_empty, help='class prompts, e.g. "a red circle"')
    p.add_argument("--method", default="none",
                   help=f"none or a composition: {', '.join(methods.names('ar-image'))}; or auto, the fastest on "
                        "this machine from `mmspec bench cost --calibrate` (default none)")
    p.add_argument("--knob", action="append", metavar="KEY=VALUE", help="a method knob, e.g. sjd_window=16")
    p.add_argument("--out", required=True, type=output_dir, metavar="DIR", help="folder for the PNGs")
    p.add_argument("--model", default=str(ROOT / "assets" / "ar-image"),
                   type=existing_dir, metavar="DIR", help="pipeline folder (default assets/ar-image)")
    p.add_argument("--num-images", type=positive_int, default=1, help="images per prompt (default 1)")
    p.add_argument("--guidance-scale", type=non_negative_float, default=2.0, help="CFG scale (default 2.0)")
    p.add_argument("--temperature", type=non_negative_float, default=1.0, help="0 is greedy (default 1.0)")
    _add_common(p)


def _add_continuous(kinds) -> None:
    from .. import methods

    c = kinds.add_parser("continuous", help="AR image generation over continuous tokens (mixture / diffusion heads)")
    c.add_argument("--prompt", required=True, nargs="+", type=non_empty, help='class prompts, e.g. "a red circle"')
    c.add_argument("--method", default="none",
                   help=f"one of {', '.join(methods.names('continuous'))}; or auto, the fastest lossless one on this "
                        "machine from `mmspec bench cost --calibrate --target continuous` (default none)")
    c.add_argument("--knob", action="append", metavar="KEY=VALUE", help="a method knob, e.g. cspd_inner_temperature=10")
    c.add_argument("--out", required=True, type=output_dir, metavar="DIR", help="folder for the PNGs")
    c.add_argument("--model", default=str(ROOT / "assets" / "continuous"),
                   type=existing_dir, metavar="DIR", help="pipeline folder (default assets/continuous)")
    c.add_argument("--num-images", type=positive_int, default=1, help="images per prompt (default 1)")
    c.add_argument("--guidance-scale", type=non_negative_float, default=2.0,
                   help="CFG scale, MAR's linear schedule (default 2.0)")
    c.add_argument("--temperature", type=positive_float, default=1.0, help="MAR's temperature, > 0 (default 1.0)")
    _add_common(c)


def check(args) -> None:
    """Method names and ``--knob`` items through the method registry (``ValueError`` naming them),
    before any model loads; the typed knobs go to ``args.method_knobs``."""
    if commands()[args.kind].registry_knobs:
        args.method_knobs = _knobs(args.knob, args.kind, args.method)


def _knobs(items, modality: str, method: str) -> dict:
    """``--knob KEY=VALUE`` items as the method's typed knobs, validated by the method registry
    (unknown methods and knobs, bad values: ``ValueError`` naming them) before any model loads."""
    from .. import methods

    methods.validate(modality, method)
    specs = methods.knobs(modality, method)
    knobs = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--knob must be KEY=VALUE, got {item!r}")
        if key in knobs:
            raise ValueError(f"--knob must name each knob once, got {key!r} twice")
        knobs[key] = _knob_value(text, specs.get(key))
    methods.validate(modality, method, knobs)
    return knobs


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


def run(args) -> int:
    set_threads(args.threads)
    return commands()[args.kind].run(args)


def _generate_images(args) -> int:
    """Class prompts to PNGs through the kind's pipeline (ar-image, continuous)."""
    import torch

    from .. import serve

    pipe = serve.spec(args.kind).load(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)  # load() turned it off
    out = pipe(prompt=args.prompt, method=args.method, method_knobs=args.method_knobs,
               guidance_scale=args.guidance_scale, temperature=args.temperature,
               num_images_per_prompt=args.num_images, generator=torch.Generator().manual_seed(args.seed))
    paths = _save_images(out.images, Path(args.out), args.method, args.prompt)
    s = out.stats
    print(f"{len(paths)} images in {args.out}: method {args.method}, {s['nfe']} target passes "
          f"({s['tau']:.2f} tokens per pass), {s['wall_seconds']:.2f} s")
    if "auto" in s:
        print(s["auto"])
    return 0


def _generate_vlm(args) -> int:
    import PIL.Image
    import torch

    from ..pipelines import SpeculativeVLMPipeline

    images = []
    for path in args.image:
        with PIL.Image.open(path) as image:
            images.append(image.convert("RGB"))  # as diffusers' load_image: a file's mode is not the caller's choice
    pipe = SpeculativeVLMPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(images=[images if len(images) > 1 else images[0]], prompts=[args.prompt], method=args.method,
               method_knobs=args.method_knobs, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               generator=torch.Generator().manual_seed(args.seed))
    s = out.stats
    print(out.texts[0])
    print(f"-- method {args.method}: {len(out.tokens[0])} tokens, {s['nfe']} target passes "
          f"({s['tau']:.2f} tokens per pass), {s['wall_seconds']:.2f} s", file=sys.stderr)
    if "auto" in s:
        print(f"-- {s['auto']}", file=sys.stderr)
    return 0


def _generate_video(args) -> int:
    import torch

    from ..pipelines import StreamingVideoPipeline, save_video

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


def _save_images(images, out: Path, method: str, prompts) -> list[Path]:
    """PNG files ``{prompt}-{method}-{i}.png``, each written to a temp name and renamed."""
    from ..utils.atomic import atomic_path

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


AR_IMAGE = GenerateCommand(_add_ar_image, _generate_images)
CONTINUOUS = GenerateCommand(_add_continuous, _generate_images)
VLM = GenerateCommand(_add_vlm, _generate_vlm)
VIDEO = GenerateCommand(_add_video, _generate_video, registry_knobs=False)
