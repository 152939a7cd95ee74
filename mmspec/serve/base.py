"""What every modality's runner shares: the ``ModalitySpec`` record (a modality declared once),
the served modalities by kind (``SPECS``), ``Models`` (the bundled pipelines, each loaded once and
shared), the plain ``Result`` a run returns, and the input checks and helpers more than one runner
uses."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .. import methods
from ..core.errors import check, is_int
from ..utils.refs import is_ref, load_ref

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
class JobField:
    """One input or option of a job kind: its type, default, and whether it must be given
    (``required``) or may be None (``optional``)."""

    type: type
    default: Any = None
    required: bool = False
    optional: bool = False  # None allowed


@dataclass(frozen=True)
class ModalitySpec:
    """A modality, declared once: everything the serve layer, ``mmspec batch``, ``mmspec
    generate``, the demo, the GPU check and the cost bench need to know of it. Each modality's
    module in this package registers one (``register``); every caller reads ``SPECS``.

    Args:
        kind: the registry modality (``mmspec.methods.modality(kind)``), also the job kind, the
            ``mmspec generate`` subcommand and the ``assets/<kind>`` folder.
        title: what people see it called (the demo's tab).
        pipeline: the pipeline class whose ``from_pretrained`` loads ``assets/<kind>``: a class
            name in ``mmspec.pipelines``, or ``"module:Class"``.
        batchable: ``batchable(method, temperature)``: whether several jobs may share one
            pipeline call without changing any job's output.
        run_jobs: ``run_jobs(models, jobs, seeds, method, knobs)``: one pipeline call for
            same-method jobs (each a dict of the kind's inputs and options, as ``mmspec batch``
            parses them; the options of the first job apply to all), one ``Result`` per job.
        job_fields: a job's inputs and options (``mmspec batch``), by name.
        per_job: the fields that may differ between the jobs of one pipeline call.
        output_ext: a job's output file extension (a job's ``format`` field, where it has one,
            overrides it).
        default_method: a job's method when it names none.
        check_job: ``check_job(params, method, knobs, base)``: the kind's checks of a parsed job
            beyond each field's type (ranges, paths relative to the jobs file's folder ``base``,
            schedules), raising ``ValueError`` that names the field; it may normalise ``params``
            in place. None: the types are all.
        slot_jobs: ``"module:function"`` of continuous batching for ``mmspec batch --continuous``:
            ``run(models, jobs, seeds, method, knobs, slots)`` yielding ``(index, Result)`` as each
            job ends; None: the kind has none.
        generate: ``"module:attribute"`` of its ``mmspec generate`` command (a
            ``mmspec.commands.generate.GenerateCommand``); None: no such subcommand.
        demo_tab: its demo tab's builder: a function name in ``demos/app.py`` or a
            ``"module:function"`` elsewhere (called inside ``gr.Tab``); None: no tab.
        device_check: ``"module:Class"`` of the GPU check's driver (a
            ``mmspec.bench.gpu_check.PipelineCheck`` subclass); None: not checked there.
        cost_target: ``"module:Class"`` of the cost bench's target (``mmspec bench cost``); None:
            not benched there.

    The references are strings, imported only by the caller that uses them, so declaring a
    modality imports no CLI, Gradio or bench code."""

    kind: str
    title: str
    pipeline: str
    batchable: Callable[[str, float], bool]
    run_jobs: Callable[..., list[Result]]
    job_fields: Mapping[str, JobField]
    per_job: tuple[str, ...]
    output_ext: str
    default_method: str = "none"
    check_job: Callable[[dict, str, dict, Path], None] | None = None
    slot_jobs: str | None = None
    generate: str | None = None
    demo_tab: str | None = None
    device_check: str | None = None
    cost_target: str | None = None

    def __post_init__(self):
        check(isinstance(self.title, str) and self.title.strip() != "", "title", "a non-empty str", self.title)
        check(isinstance(self.pipeline, str) and (self.pipeline.isidentifier() or is_ref(self.pipeline)), "pipeline",
              "the name of a mmspec.pipelines class or a 'module:Class' string", self.pipeline)
        check(callable(self.batchable), "batchable", "a callable batchable(method, temperature)", self.batchable)
        check(callable(self.run_jobs), "run_jobs", "a callable run_jobs(models, jobs, seeds, method, knobs)",
              self.run_jobs)
        check(isinstance(self.job_fields, Mapping) and all(isinstance(f, JobField) for f in self.job_fields.values()),
              "job_fields", "a mapping of field names to JobField", self.job_fields)
        check(set(self.per_job) <= set(self.job_fields), "per_job",
              f"fields of job_fields ({', '.join(self.job_fields)})", self.per_job)
        check(isinstance(self.output_ext, str) and self.output_ext.startswith("."), "output_ext",
              "a file extension such as '.png'", self.output_ext)
        check(self.check_job is None or callable(self.check_job), "check_job",
              "None or a callable check_job(params, method, knobs, base)", self.check_job)
        for name in ("slot_jobs", "generate", "device_check", "cost_target"):
            value = getattr(self, name)
            check(value is None or is_ref(value), name, "None or a 'module:attribute' string", value)
        check(self.demo_tab is None or is_ref(self.demo_tab) or (isinstance(self.demo_tab, str)
                                                                 and self.demo_tab.isidentifier()),
              "demo_tab", "None, a function name in demos/app.py or a 'module:function' string", self.demo_tab)

    def pipeline_class(self) -> type:
        from .. import pipelines

        return load_ref(self.pipeline) if is_ref(self.pipeline) else getattr(pipelines, self.pipeline)

    def load(self, folder: str | Path):
        """The pipeline saved in ``folder``, progress bar off."""
        pipe = self.pipeline_class().from_pretrained(str(folder))
        pipe.set_progress_bar_config(disable=True)
        return pipe


SPECS: dict[str, ModalitySpec] = {}
"""The served modalities by kind, in registration order (the demo's tab order, ``mmspec generate``'s
and ``mmspec batch``'s kinds); each modality's module registers its own."""


def register(spec: ModalitySpec) -> ModalitySpec:
    """Add ``spec`` to ``SPECS``: its kind must be a registry modality (``mmspec.methods``) not
    served yet."""
    check(isinstance(spec, ModalitySpec), "spec", "a mmspec.serve.ModalitySpec", spec)
    methods.modality(spec.kind)  # a registry modality, or ValueError naming the registered ones
    check(spec.kind not in SPECS, "kind", "a modality not served yet", spec.kind)
    SPECS[spec.kind] = spec
    return spec


def unregister(kind: str) -> ModalitySpec:
    """Remove a served modality (tests that add one take it away again)."""
    return SPECS.pop(spec(kind).kind)


def spec(kind: str) -> ModalitySpec:
    """The spec of job kind ``kind``, or ``ValueError`` listing the kinds."""
    check(kind in SPECS, "kind", "one of " + ", ".join(repr(k) for k in SPECS), kind)
    return SPECS[kind]


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
        serving = spec(kind)

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
    check(is_int(seed) and 0 <= seed < 2**63, "seed", "an int in [0, 2**63)", seed)
    return seed


def resolve(kind: str, method: str, knobs: dict | None):
    """The registry's validation of a method and its knobs (``ValueError`` naming the knob): the
    method's ``MethodRecipe``, or None for ``"auto"`` (chosen by the pipeline at the call's batch size)."""
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
