"""``mmspec bench cost --calibrate``: this machine's cost profile for ``method="auto"``
(``mmspec.methods.auto``) (here about 5.5 minutes for both bundled pipelines).

For one pipeline (the bundled ``assets/ar-image`` or ``assets/vlm``, or a folder of the same kind)
and every candidate method it holds the components for (``auto.CANDIDATES``), after one untimed
whole call of the first candidate at the largest batch size:

1. **Pass costs by batch size.** For B in ``batch_sizes``: one untimed warm-up call cut after two
   passes (``pipe._interrupt``), then ``rounds`` rounds over the candidates, each round whole calls
   of B prompts until ``min_gaps / rounds`` pass gaps (or ``max_calls / rounds`` calls). A callback
   stamps the clock after every pass: ``pass_s[B]`` is the median gap between passes (the pass's
   target verify, its draft passes and the loop's own work, at every prefix length the calls
   reached), ``prefill_s[B]`` the median time from a call to its first stamp less one pass (input
   checks, encoding, the prefill). Candidates (in the registry's order) run inside batch sizes, so
   that what one batch size compares is measured close together in time.
2. **Acceptance.** At B = 1, ``prompts`` whole calls per candidate (the first is step 1's B = 1
   call; then prompts outer, candidates inner): each prompt's decode passes and tokens per pass
   (``out.stats``).

Lossy candidates are measured only with a ``quality`` record (nothing else admits them).

Settings are the benches': AR classifier-free guidance 2 at temperature 1 (``mmspec bench
ar-image``), the VLM greedy with 64 new tokens; the profile records them. ``quality``: a
``mmspec bench ar-image --json`` result, whose rows' ``p_vs_none`` (its permutation test against
``none``) mark a lossy method kept when ``>= auto.KEPT_P``; ``auto_quality="kept"`` admits those.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ... import methods
from ...core.errors import check, check_choice, check_int, is_int
from ...methods import auto
from .config import ASSETS


@dataclass
class CalibrateConfig:
    """One calibration: ``modality`` (``"ar-image"``, ``"vlm"`` or ``"continuous"``) of the pipeline
    in ``folder`` (default the bundled one); ``labels`` the candidates to measure (default all it
    can run)."""

    modality: str = "ar-image"
    folder: str | None = None
    batch_sizes: tuple = auto.BATCH_SIZES
    prompts: int = 6
    min_gaps: int = 48  # pass gaps per (candidate, B): calls are repeated until there are this many ...
    max_calls: int = 4  # ... or this many calls, split over ``rounds``
    rounds: int = 2  # rounds over the candidates at each batch size
    labels: tuple | None = None
    quality: str | None = None  # a `mmspec bench ar-image --json` file
    guidance_scale: float = 2.0
    temperature: float = 1.0  # AR and continuous; the VLM decodes greedily
    max_new_tokens: int = 64  # VLM
    seed: int = 0
    out: str | None = None  # where to save (default auto.cache_dir()/profiles/<key>)
    save: bool = True
    settings: dict = field(default_factory=dict)

    def check(self) -> None:
        check_choice("modality", self.modality, auto.modalities())
        bs = self.batch_sizes
        check(isinstance(bs, tuple) and len(bs) > 0 and bs[0] == 1 and list(bs) == sorted(set(bs))
              and all(is_int(b) and b >= 1 for b in bs), "batch_sizes",
              "increasing ints >= 1 starting at 1", bs)
        for name, low in (("prompts", 1), ("rounds", 1), ("min_gaps", 1), ("max_calls", 1)):
            value = getattr(self, name)
            check_int(value, name, low)
        if self.labels is not None:
            known = [c[0] for c in auto.CANDIDATES[self.modality]]
            check(isinstance(self.labels, tuple) and len(self.labels) > 0, "labels", "a non-empty tuple", self.labels)
            for label in self.labels:
                check_choice("labels", label, known)
            check("none" in self.labels, "labels", "a tuple including 'none' (the baseline)", self.labels)
        if self.quality is not None:
            check(Path(self.quality).is_file(), "quality", "an existing `mmspec bench ar-image --json` file",
                  self.quality)


# ---------------------------------------------------------------- one call per modality

def _class_call(pipe, cfg: CalibrateConfig):
    """A class-prompt image pipeline (AR image, continuous tokens): row i gets class start + i."""
    classes = pipe.num_classes

    def call(method, knobs, b, start, callback):
        return pipe(class_labels=[(start + i) % classes for i in range(b)], method=method, method_knobs=knobs,
                    guidance_scale=cfg.guidance_scale, temperature=cfg.temperature,
                    generator=[torch.Generator().manual_seed(cfg.seed + start + i) for i in range(b)],
                    output_type="latent", callback_on_step_end=callback)

    return call, pipe.transformer.num_image_tokens


def _vlm_call(pipe, cfg: CalibrateConfig):
    from ..vlm import bench_prompts

    images, questions = bench_prompts(16)

    def call(method, knobs, b, start, callback):
        idx = [(start + i) % len(images) for i in range(b)]
        return pipe(images=[images[i] for i in idx], prompts=[questions[i] for i in idx], method=method,
                    method_knobs=knobs, max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                    generator=[torch.Generator().manual_seed(cfg.seed + i) for i in idx],
                    callback_on_step_end=callback)

    return call, cfg.max_new_tokens


def call_for(modality: str):
    """``(pipe, cfg) -> (call, n)``: how to run one calibration call of ``modality``'s pipeline,
    ``call(method, knobs, b, start, callback)``, and its new tokens per row."""
    return {"ar-image": _class_call, "vlm": _vlm_call, "continuous": _class_call}[modality]


def _load(cfg: CalibrateConfig):
    from ... import pipelines

    cls = {"ar-image": pipelines.SpeculativeARImagePipeline, "vlm": pipelines.SpeculativeVLMPipeline,
           "continuous": pipelines.SpeculativeContinuousARPipeline}[cfg.modality]
    pipe = cls.from_pretrained(cfg.folder or str(ASSETS / cfg.modality))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _stamps(pipe, limit: int | None):
    """A callback that stamps the clock after every pass and interrupts after ``limit`` passes."""
    stamps: list[float] = []

    def callback(p, step, timestep, kwargs):
        stamps.append(time.perf_counter())
        if limit is not None and len(stamps) >= limit:
            p._interrupt = True
        return {}

    return stamps, callback


def quality_record(path: str) -> dict:
    """``{label: {"kept", "p_vs_none", "source"}}`` from a ``mmspec bench ar-image --json`` file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"quality must be a readable JSON file, got {path!r} ({err})") from None
    rows = data.get("rows") if isinstance(data, dict) else None
    check(isinstance(rows, list) and data.get("bench") in (None, "ar-image"), "quality",
          "a `mmspec bench ar-image --json` result (an object with its rows)", path)
    out = {}
    for row in rows:
        p = row.get("p_vs_none")
        if isinstance(row, dict) and isinstance(p, (int, float)):
            out[str(row.get("method"))] = {"kept": p >= auto.KEPT_P, "p_vs_none": p, "source": str(path),
                                           "test": f"permutation test against none, kept when p >= {auto.KEPT_P}"}
    return out


@torch.no_grad()
def calibrate(cfg: CalibrateConfig, progress: Callable[[str], None] | None = None, pipe=None) -> auto.CostProfile:
    """Measure and (unless ``cfg.save`` is False) save this machine's profile; see the module
    docstring. ``pipe``: an already loaded pipeline of ``cfg.modality`` (tests pass tiny ones)."""
    cfg.check()
    say = progress or (lambda msg: None)
    quality = quality_record(cfg.quality) if cfg.quality else {}
    pipe = pipe if pipe is not None else _load(cfg)
    call, n = call_for(cfg.modality)(pipe, cfg)
    rows = []
    for label, method, knobs in auto.CANDIDATES[cfg.modality]:
        if cfg.labels is not None and label not in cfg.labels:
            continue
        recipe = methods.resolve(cfg.modality, method, knobs)
        if not recipe.lossless and label not in quality:
            continue
        if all(getattr(pipe, pipe.component_attribute(need), None) is not None for need in recipe.requires):
            rows.append((label, method, knobs, recipe.lossless))
        else:
            say(f"{label}: skipped (the pipeline lacks {', '.join(recipe.requires)})")
    pass_s: dict[str, dict] = {r[0]: {} for r in rows}
    prefill_s: dict[str, dict] = {r[0]: {} for r in rows}
    passes: dict[str, list] = {r[0]: [] for r in rows}
    taus: dict[str, list] = {r[0]: [] for r in rows}

    def record(label, out):
        passes[label].append(float(out.stats["decode_steps"]))
        taus[label].append(max(1.0, float(out.stats["tau"])))

    if rows:  # the allocator and kernels at the largest batch, before anything is timed
        call(rows[0][1], rows[0][2], max(cfg.batch_sizes), 0, None)
    per_round = -(-cfg.min_gaps // cfg.rounds), max(1, cfg.max_calls // cfg.rounds)
    for b in cfg.batch_sizes:  # batch sizes outer: a batch size's candidates are timed close together
        gaps = {r[0]: [] for r in rows}
        firsts = {r[0]: [] for r in rows}
        for label, method, knobs, _ in rows:
            call(method, knobs, b, 0, _stamps(pipe, 2)[1])  # warm-up, cut after two passes
        for _ in range(cfg.rounds):  # rounds outer, candidates inner: a slow spell hits them all
            for label, method, knobs, _ in rows:
                mine, calls = 0, 0
                while mine < per_round[0] and calls < per_round[1]:
                    stamps, stamp = _stamps(pipe, None)
                    t0 = time.perf_counter()
                    out = call(method, knobs, b, len(firsts[label]) * b, stamp)
                    if b == 1 and not firsts[label]:
                        record(label, out)  # prompt 0's acceptance
                    gaps[label] += [b2 - a for a, b2 in zip(stamps, stamps[1:])]
                    firsts[label].append(stamps[0] - t0)
                    mine, calls = mine + len(stamps) - 1, calls + 1
        for label, *_ in rows:
            per = statistics.median(gaps[label]) if gaps[label] else statistics.median(firsts[label])
            pass_s[label][b] = per
            prefill_s[label][b] = max(1e-6, statistics.median(firsts[label]) - per)
            say(f"{label} B={b}: {1000 * per:.2f} ms per pass (median of {len(gaps[label])} over "
                f"{len(firsts[label])} calls), {1000 * prefill_s[label][b]:.1f} ms before the first")
    for i in range(1, cfg.prompts):
        for label, method, knobs, _ in rows:
            record(label, call(method, knobs, 1, i, None))
        say(f"prompt {i + 1}/{cfg.prompts}: " + ", ".join(f"{r[0]} tau {taus[r[0]][-1]:.2f}" for r in rows))
    profile_rows = {label: auto.Row(label, method, dict(knobs), lossless, pass_s[label], prefill_s[label],
                                    passes[label], taus[label], n)
                    for label, method, knobs, lossless in rows}
    setup = {"batch_sizes": list(cfg.batch_sizes), "prompts": cfg.prompts,
             "threads": torch.get_num_threads(),
             "guidance_scale": None if cfg.modality == "vlm" else cfg.guidance_scale,
             "temperature": 0.0 if cfg.modality == "vlm" else cfg.temperature,
             "max_new_tokens": cfg.max_new_tokens if cfg.modality == "vlm" else None, "seed": cfg.seed,
             "folder": cfg.folder or str(ASSETS / cfg.modality), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                      time.gmtime())}
    profile = auto.CostProfile(cfg.modality, *pipe.profile_identity(), profile_rows, quality, setup)
    if cfg.save:
        path = profile.save(cfg.out)
        say(f"saved {path}")
    return profile


def profile_table(profile: auto.CostProfile) -> list[dict]:
    """One row per candidate and batch size: ms per pass, predicted speed-up over none, mean tau."""
    base = next(r for r in profile.rows.values() if r.method == "none")
    out = []
    for row in profile.rows.values():
        for b in sorted(row.pass_s):
            out.append({"method": row.label, "B": b, "ms_per_pass": round(1000 * row.pass_s[b], 3),
                        "tau": round(statistics.fmean(row.tau), 3),
                        "passes_max_B": round(auto.expected_max(row.passes, b), 1),
                        "predicted_x": round(auto.predict_seconds(base, b) / auto.predict_seconds(row, b), 3),
                        "lossless": row.lossless,
                        "kept": profile.quality.get(row.label, {}).get("kept") if not row.lossless else None})
    return out


PROFILE_COLUMNS = [("modality", "target"), ("method", "method"), ("B", "B"), ("ms_per_pass", "ms/pass"),
                   ("tau", "tau"), ("passes_max_B", "passes (max of B)"), ("predicted_x", "pred x none"),
                   ("lossless", "lossless"), ("kept", "kept")]
