"""The cost bench's settings: the targets (the served modalities that name a cost target), their
rows and the curve grid."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ... import methods

ASSETS = Path(__file__).resolve().parents[3] / "assets"
TARGET = "target"
VERIFY_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_GRID_MAX = 16  # draft curves: the grid's widths up to here, plus every width a row used
WITHIN = 0.15  # issue 14: measured wall speed-up within 15% of the ceiling


def cost_targets() -> dict[str, type]:
    """The targets by name: every served modality's ``cost_target`` class (``mmspec.serve.SPECS``
    order), which loads its pipeline, runs a row's call, watches its models and builds probes."""
    from ... import serve
    from ...utils.refs import load_ref

    return {kind: load_ref(spec.cost_target) for kind, spec in serve.SPECS.items() if spec.cost_target}


def draft_roles() -> dict[str, str]:
    """The drafter part of a method -> the pipeline component whose passes are its draft passes
    (the registry's ``Component`` the part requires: ``{"sd": "draft_model", "eagle":
    "eagle_head", ...}``), over every registered modality."""
    roles = {}
    for modality in methods.modalities():
        declared = {c.provides: c.name for c in methods.components(modality)}
        for part in methods.parts(modality).values():
            for need in part.requires:
                if part.kind == "drafter" and need in declared:
                    roles.setdefault(part.name, declared[need])
    return roles

SMALL_EAGLE = {"eagle_top_k": 2, "eagle_depth": 1, "eagle_total_tokens": 3}
DEFAULT_ROWS = {  # (label, method, knobs) per bundled target; "none" first, the baseline of the ratios
    "ar-image": (("none", "none", {}), ("sd", "sd", {}), ("eagle", "eagle", {}),
                 ("eagle-small", "eagle", SMALL_EAGLE), ("medusa", "medusa", {})),
    "vlm": (("none", "none", {}), ("sd", "sd", {}), ("eagle", "eagle", {}), ("specvlm", "specvlm", {}),
            ("medusa", "medusa", {})),
    "continuous": (("none", "none", {}), ("sd", "sd", {})),
}


@dataclass
class CostBenchConfig:
    """One run; ``quick()`` is the smaller version (2 prompts per target, at least 7 passes per
    curve point). The targets are named after their modality (``rows`` keys; a target without
    rows here runs its class's ``rows``); ``folders``: pipeline folders of targets other than the
    three bundled ones (default ``assets/<name>``)."""

    targets: tuple = field(default_factory=lambda: tuple(cost_targets()))
    ar_image_dir: str = str(ASSETS / "ar-image")
    vlm_dir: str = str(ASSETS / "vlm")
    continuous_dir: str = str(ASSETS / "continuous")
    rows: dict = field(default_factory=lambda: dict(DEFAULT_ROWS))
    folders: dict = field(default_factory=dict)
    prompts: int = 8  # per target: image i asks for class i % 16 with seed + i; VLM: held-out scene i
    widths: tuple = VERIFY_WIDTHS
    repeats: int = 21  # at least this many passes per curve point (the median is kept)
    warmup: int = 2  # untimed passes per curve point first
    ar_guidance_scale: float = 2.0  # as `mmspec bench ar-image`
    continuous_guidance_scale: float = 6.0  # as `mmspec bench continuous`
    continuous_guidance_schedule: str = "constant"
    temperature: float = 1.0  # AR and continuous; the VLM decodes greedily (its generation config)
    vlm_max_new_tokens: int = 128
    seed: int = 0
    gpu_curve: "GPUCurve | None" = None

    @classmethod
    def quick(cls, **kw) -> "CostBenchConfig":
        return cls(**{"prompts": 2, "repeats": 7, **kw})

    def drafters(self) -> tuple[str, ...]:
        """The drafter parts of the rows of ``targets`` that run a draft model (sorted)."""
        found = set()
        roles = draft_roles()
        for target in self.targets:
            for _, method, knobs in self.target_rows(target):
                drafter = methods.resolve(target, method, knobs).part("drafter")
                if drafter in roles:
                    found.add(drafter)
        return tuple(sorted(found))

    def target_rows(self, target: str) -> tuple:
        """``rows[target]``, or the target class's own ``rows`` (empty when it has none)."""
        if target in self.rows:
            return tuple(self.rows[target])
        return tuple(getattr(cost_targets().get(target), "rows", ()))

    def folder(self, target: str) -> str:
        """A target's pipeline folder: ``folders[target]``, else ``assets/<target>``."""
        return str(self.folders.get(target, ASSETS / target))
