"""What every modality's runner shares: the ``Runner`` record, the registry of runners by
modality, ``Models`` (the bundled pipelines, each loaded once and shared), the plain ``Result`` a
run returns, and the input checks and helpers more than one runner uses."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .. import methods
from ..core.errors import check

ASSETS = Path(__file__).resolve().parents[2] / "assets"


@dataclass
class Result:
    """One request's (or batch row's) output: ``image`` (H, W, 3) uint8, ``text`` or ``frames``
    (F, H, W, 3) uint8; ``stats`` of its decode; ``commit_pass`` per generated token (raster
    order), or None when unknown."""

    stats: dict
    image: np.ndarray | None = None
    text: str | None = None
    frames: np.ndarray | None = None
    tokens: list[int] | None = None
    commit_pass: np.ndarray | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Runner:
    """How one registry modality (``kind``) is served, all the demo and ``mmspec batch`` need to
    know of it.

    ``pipeline``: the ``mmspec.pipelines`` class whose ``from_pretrained`` loads ``assets/<kind>``.
    ``batchable(method, temperature)``: whether several jobs may share one pipeline call without
    changing any job's output. ``run_jobs(models, jobs, seeds, method, knobs)``: one pipeline call
    for same-method jobs (each a dict of the kind's inputs and options, as ``mmspec batch`` parses
    them; the options of the first job apply to all), one ``Result`` per job."""

    kind: str
    pipeline: str
    batchable: Callable[[str, float], bool]
    run_jobs: Callable[..., list[Result]]

    def load(self, folder: str | Path):
        from .. import pipelines

        pipe = getattr(pipelines, self.pipeline).from_pretrained(str(folder))
        pipe.set_progress_bar_config(disable=True)
        return pipe


RUNNERS: dict[str, Runner] = {}
"""Runners by job kind (= registry modality); each modality's module registers its own."""


def register(runner: Runner) -> Runner:
    methods.modality(runner.kind)  # a registry modality, or ValueError naming the registered ones
    RUNNERS[runner.kind] = runner
    return runner


def runner(kind: str) -> Runner:
    """The runner of job kind ``kind``, or ``ValueError`` listing the kinds."""
    check(kind in RUNNERS, "kind", "one of " + ", ".join(repr(k) for k in sorted(RUNNERS)), kind)
    return RUNNERS[kind]


# ---------------------------------------------------------------- models, loaded once and shared

class Models:
    """The bundled pipelines and the quality classifier, each loaded on first use and then shared
    by every caller (the demo's users, a batch's jobs). Loading is serialised by a lock, so two
    first requests arriving together load a model once."""

    def __init__(self, assets: str | Path = ASSETS, adapt_drafts: dict | None = None):
        """``adapt_drafts``: keyword arguments of ``SpeculativeVLMPipeline.enable_draft_adaptation``
        (``lr``, ``every``): the VLM pipeline's heads then keep learning from the answers they
        serve (``mmspec.pipelines.draft_adaptation``; the answers stay the target's). None: frozen heads."""
        self.assets = Path(assets)
        self.adapt_drafts = adapt_drafts
        self._lock = threading.Lock()
        self._loaded: dict[str, Any] = {}
        self.loads = 0  # how many loads ran (the load test checks it stays at one per model)

    def _get(self, name: str, load: Callable[[], Any]):
        with self._lock:
            if name not in self._loaded:
                self._loaded[name] = load()
                self.loads += 1
            return self._loaded[name]

    def pipeline(self, kind: str):
        """The pipeline of job kind ``kind``, from ``assets/<kind>``, progress bar off."""
        serving = runner(kind)

        def load():
            pipe = serving.load(self.assets / kind)
            if self.adapt_drafts is not None and hasattr(pipe, "enable_draft_adaptation"):
                pipe.enable_draft_adaptation(**self.adapt_drafts)
            return pipe

        return self._get(kind, load)

    def classifier(self):
        def load():
            from ..models import load_checkpoint
            from ..models.classifier import ShapesClassifier

            return load_checkpoint(ShapesClassifier, str(self.assets / "classifier")).eval()
        return self._get("classifier", load)


class ActivityGauge:
    """Counts requests running at once (and the most ever seen): what the load test reads to
    check that the demo's queue bounds concurrency."""

    def __init__(self):
        self._lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.total = 0

    def __enter__(self):
        with self._lock:
            self.active += 1
            self.total += 1
            self.peak = max(self.peak, self.active)
        return self

    def __exit__(self, *exc):
        with self._lock:
            self.active -= 1


GAUGE = ActivityGauge()


# ---------------------------------------------------------------- inputs and stats

def check_seed(seed) -> int:
    check(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63, "seed",
          "an int in [0, 2**63)", seed)
    return seed


def resolve(kind: str, method: str, knobs: dict | None):
    """The registry's validation of a method and its knobs (``ValueError`` naming the knob): the
    method's ``Recipe``, or None for ``"auto"`` (chosen by the pipeline at the call's batch size)."""
    return methods.validate(kind, method, knobs or {})


def knob_specs(kind: str) -> dict[str, methods.KnobSpec]:
    """Every knob any method of ``kind`` takes, ``"auto"``'s included (first method's spec wins;
    defaults are per method, see ``method_defaults``)."""
    out: dict[str, methods.KnobSpec] = {}
    for name in methods.auto.method_names(kind, methods.names(kind)):
        for spec in methods.knobs(kind, name).values():
            out.setdefault(spec.name, spec)
    return out


def method_defaults(kind: str, method: str) -> dict[str, Any]:
    return {name: spec.default for name, spec in methods.knobs(kind, method).items()}


def generators(seeds: list[int]) -> list[torch.Generator]:
    """One generator per row, from that row's seed (row r of a batch = that job alone)."""
    return [torch.Generator().manual_seed(check_seed(s)) for s in seeds]


def plain_stats(stats: dict, wall: float, batch: int) -> dict:
    """A decode's numeric stats (floats rounded to 4 places), ``method="auto"``'s choice and reason
    (``auto``, ``auto_method``), its ``wall_seconds`` and ``batch``."""
    out = {k: (round(float(v), 4) if isinstance(v, float) else v) for k, v in stats.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.update({k: stats[k] for k in ("auto", "auto_method") if k in stats})
    out["wall_seconds"] = round(wall, 4)
    out["batch"] = batch
    return out
