"""``mmspec bench compile``: what ``torch.compile`` does to the bundled AR target's methods here.

Issue 14 asks for compiled targets where they pay on this CPU. This bench measures it, per method
and per way of compiling the target (``LlamaGenModel``), against the same target uncompiled:

- ``forward``: ``torch.compile(target.forward, dynamic=True)``, the whole forward (the cache's
  host-side length check and slicing break the graph where they sit);
- ``layers``: every decoder layer compiled on its own (``layer.compile(dynamic=True)``), the
  cache calls inside each.

``dynamic=True`` because block widths and cache lengths change every pass, and dynamo specialises
on static shapes. Rows are interleaved: images outer, then every
(way, method) pair, switching the target's forward between its eager and compiled versions per
call, after one call per pair that compiles (its time is ``first call s``: compilation plus one
image; a later pair's first call reuses what earlier ones compiled: dynamo compiles each layer's
frame after a graph break once, for both ways). ``gain x`` = eager
seconds per image / compiled seconds per image, both from this run; ``same tokens`` says whether
the compiled call drew the same tokens as the eager call with the same seed (compiled kernels may
sum in another order, and a sampled token can then differ; nothing here is claimed exact).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import check, check_int
from .cost import SMALL_EAGLE

ASSETS = Path(__file__).resolve().parents[2] / "assets"
WAYS = ("forward", "layers")
DEFAULT_ROWS = (("none", "none", {}), ("sd", "sd", {}), ("eagle-small", "eagle", SMALL_EAGLE),
                ("medusa", "medusa", {}))


@dataclass
class CompileBenchConfig:
    """One run; ``quick()`` is the smaller version (two methods, two images)."""

    pipeline_dir: str = str(ASSETS / "ar-image")
    rows: tuple = DEFAULT_ROWS  # (label, method, knobs)
    ways: tuple = WAYS
    images: int = 4  # image i: class i % 16, seed + i
    guidance_scale: float = 2.0  # as `mmspec bench ar-image`
    seed: int = 0

    @classmethod
    def quick(cls, **kw) -> "CompileBenchConfig":
        return cls(**{"rows": DEFAULT_ROWS[:1] + DEFAULT_ROWS[3:], "images": 2, **kw})


class _Switch:
    """The target's eager and compiled forwards, one of them active per call."""

    def __init__(self, model, way: str):
        self.model, self.way = model, way
        if way == "forward":
            self.compiled = torch.compile(model.forward, dynamic=True)
        else:
            self.compiled = [torch.compile(layer._call_impl, dynamic=True) for layer in model.layers]

    def use(self, compiled: bool) -> None:
        if self.way == "forward":
            if compiled:
                self.model.forward = self.compiled  # an instance attribute shadows the class's forward
            else:
                self.model.__dict__.pop("forward", None)
        else:
            for layer, fn in zip(self.model.layers, self.compiled):
                layer._compiled_call_impl = fn if compiled else None


def run(cfg: CompileBenchConfig, progress=None) -> dict:
    from .. import methods
    from ..pipelines import SpeculativeARImagePipeline

    check_int(cfg.images, "images", 1)
    check(all(w in WAYS for w in cfg.ways) and len(cfg.ways) > 0, "ways", f"a non-empty tuple among {WAYS}", cfg.ways)
    for _, method, knobs in cfg.rows:
        methods.resolve("ar-image", method, knobs)  # refused before anything loads
    say = progress or (lambda msg: None)
    pipe = SpeculativeARImagePipeline.from_pretrained(cfg.pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer

    def call(method: str, knobs: dict, i: int) -> tuple[float, torch.Tensor]:
        g = torch.Generator().manual_seed(cfg.seed + i)
        t = time.perf_counter()
        out = pipe(class_labels=[i % pipe.num_classes], method=method, method_knobs=knobs or None,
                   guidance_scale=cfg.guidance_scale, generator=g, output_type="latent")
        return time.perf_counter() - t, out.tokens

    switches = {way: _Switch(model, way) for way in cfg.ways}
    first = {}
    try:
        for label, method, knobs in cfg.rows:  # eager warm-up, then each way's compiling call
            call(method, knobs, 0)
            for way, switch in switches.items():
                switch.use(True)
                say(f"{way}: first compiled call of {label}")
                first[way, label] = call(method, knobs, 0)[0]
                switch.use(False)
        times = {key: 0.0 for key in [("eager", label) for label, _, _ in cfg.rows] +
                 [(way, label) for way in cfg.ways for label, _, _ in cfg.rows]}
        same = {(way, label): True for way in cfg.ways for label, _, _ in cfg.rows}
        for i in range(cfg.images):
            say(f"image {i + 1} of {cfg.images}")
            for label, method, knobs in cfg.rows:
                seconds, eager_tokens = call(method, knobs, i)
                times["eager", label] += seconds
                for way, switch in switches.items():
                    switch.use(True)
                    seconds, tokens = call(method, knobs, i)
                    switch.use(False)
                    times[way, label] += seconds
                    same[way, label] &= torch.equal(tokens, eager_tokens)
    finally:
        for switch in switches.values():
            switch.use(False)
        torch._dynamo.reset()
    rows = []
    for way in cfg.ways:
        for label, method, knobs in cfg.rows:
            eager, compiled = times["eager", label] / cfg.images, times[way, label] / cfg.images
            rows.append({"way": way, "method": label, "knobs": knobs, "eager_s": eager, "compiled_s": compiled,
                         "gain": eager / compiled, "first_call_s": first[way, label],
                         "same_tokens": same[way, label]})
    setup = {"pipeline": cfg.pipeline_dir, "images": cfg.images, "guidance_scale": cfg.guidance_scale,
             "seed": cfg.seed, "threads": torch.get_num_threads(), "torch": torch.__version__,
             "definitions": {"gain": "eager s/img / compiled s/img, interleaved in this run",
                             "first_call_s": "the first compiled call of the method on image 0: compilation "
                                             "(for the shapes not compiled by an earlier row) plus one image",
                             "same_tokens": "the compiled calls drew the eager calls' tokens on every image"}}
    return {"bench": "compile", "setup": setup, "rows": rows}


COMPILE_COLUMNS = [
    ("way", "compiled"), ("method", "method"), ("eager_s", "eager s/img"), ("compiled_s", "compiled s/img"),
    ("gain", "gain x"), ("first_call_s", "first call s"), ("same_tokens", "same tokens"),
]
