"""AR image generation over VQ tokens (``"ar-image"``): every method is a composition on the core.

Parts, by kind (any ``+`` of one of each that the parts allow is a method):

- schedule: ``zipar`` (ZipAR's next-set decoding; raster order otherwise);
- drafter: ``sd`` (small draft AR model, chain), ``eagle`` (EAGLE-2 tree from the target's
  features), ``medusa`` (the same tree from parallel heads in one pass), ``sjd`` (Jacobi window),
  ``mcsjd`` (Jacobi window, redrafts maximally coupled);
- rule: ``gsd`` (grouped), ``lantern`` (latent proximity); exact speculative sampling otherwise.

``gsd`` implies the ``sjd`` drafter (GSD is SJD with a grouped test; ``mcsjd+gsd`` takes the
coupled window) and ``lantern`` implies ``eagle`` (LANTERN sits on EAGLE-2) unless a Jacobi
drafter is named; ``zipar`` runs a Jacobi window per row, never a draft model (draft models keep
raster caches). Components: ``target`` (a
LlamaGen-style model) and ``codebook`` (the VQ's code vectors); the parts declare ``draft_model``
(``LlamaGenModel``), ``eagle_head`` (``EagleDraftHead``) and ``medusa_head`` (``GridMedusaHeads``),
both heads bound to the target (``COMPONENTS``), each trained by its recipe (``TRAINING``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..core import JacobiDrafter
from ..core.drafters import EagleTreeDrafter, ParallelHeadsDrafter
from ..core.errors import check
from ..core.relaxed import (GroupedAcceptance, GroupedAcceptanceConfig, LatentProximityAcceptance,
                            LatentProximityConfig, latent_neighbours)
from ..core.schedule import NextSetSchedule
from .knobs import check_config, knob
from .registry import REQUIRED, Component, TrainingRecipe, register_method, register_modality, register_part
from .shared import SD, MedusaConfig, TreeConfig, agreement

MODALITY = "ar-image"
# the AR heads' tree: small, because this CPU verifies up to about 6 tokens at one token's cost on
# the bundled target and not much more (``mmspec bench cost``'s curve); (3, 6) was the fastest of
# a quiet sweep of (top_k, total_tokens) against target-only (docs/costs.md)
MEDUSA_DEFAULTS = {"medusa_top_k": 3, "medusa_total_tokens": 6}
register_modality(MODALITY, components=("target", "codebook"),
                  defaults=MEDUSA_DEFAULTS,
                  doc="class-conditional image generation over VQ tokens (LlamaGen-style targets)")


@dataclass(frozen=True)
class SJDConfig:
    """Speculative Jacobi Decoding; window L = 16 and random initialisation are the reference's
    Lumina-mGPT defaults (its LlamaGen script uses ``repeat``: the left neighbour).

    Args:
        window: Jacobi window L: tokens drafted (and re-drafted) per pass.
        init: new window tokens: ``"random"`` (uniform), ``"repeat"`` (the last known token) or
            ``"spatial"`` (the token one grid row above).
        interval: which passes draft: ``"full"`` (every pass, a full window) or ``"reference"``
            (the reference LlamaGen script's interval: single-token passes for the first two
            tokens after the prefill's and the last L + 2 or so; its NFE, like for like).
    """

    window: int = knob(16, min=2)
    init: str = knob("random", choices=("random", "repeat", "spatial"))
    interval: str = knob("full", choices=("full", "reference"))

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class ZipARConfig:
    """ZipAR's next-set schedule; the reference's LlamaGen default is 8 (on 24-wide grids).

    Args:
        window: s, the tokens of the upper row decoded before a row starts (at most the grid's
            width, checked when the target is known).
        mode: ``"paper"`` (row r starts when row r-1 has s tokens, seeded by its latest token) or
            ``"reference"`` (the public LlamaGen code: row 1 after row 0 is complete, rows r >= 2
            seeded by row r-2's latest token; NFE 2W + (H-2)s instead of (H-1)s + W).
    """

    window: int = knob(8, min=1)
    mode: str = knob("paper", choices=NextSetSchedule.MODES)

    def __post_init__(self):
        check_config(self)


def _grid(components) -> int:
    return components["target"].config.grid_size


def _zipar(cfg: ZipARConfig, components):
    grid = _grid(components)
    check(cfg.window <= grid, "zipar_window", f"an int in [1, {grid}] (the grid's width)", cfg.window)
    return NextSetSchedule(grid, grid, cfg.window, mode=cfg.mode)


def _jacobi(coupling: str):
    """The builder of a Jacobi drafter part: SJD's independent redrafts or MC-SJD's coupled ones."""

    def build(cfg: SJDConfig, components):
        # only the spatial init and the reference interval read the grid (a target that decodes
        # several grids, e.g. GLM-Image's prior, has no single one)
        grid = _grid(components) if cfg.init == "spatial" or cfg.interval == "reference" else None
        # the reference LlamaGen script's jacobi_loop_interval: (1, N - L - 2) for N image tokens
        interval = (1, grid * grid - cfg.window - 2) if cfg.interval == "reference" else None
        return JacobiDrafter(components["target"].vocab_size, window=cfg.window, init=cfg.init, grid_width=grid,
                             coupling=coupling, interval=interval)

    return build


def _jacobi_traits(cfg: SJDConfig):
    # 'spatial' reads the raster history and the reference interval counts raster tokens: no lanes
    return ("jacobi",) + (("lane_safe",) if cfg.init != "spatial" and cfg.interval == "full" else ())


# the last codebook's neighbour table: building it takes V x V distances (1 GiB at a 16k codebook),
# and a pipeline builds its method on every call with the same codebook
_NEIGHBOURS: dict = {}


def neighbour_table(codebook: torch.Tensor, count: int) -> torch.Tensor:
    """``latent_neighbours(codebook, count)``, computed once per codebook content and count."""
    data = codebook.detach().float().cpu().contiguous()
    key = (hashlib.sha1(data.numpy().tobytes()).hexdigest(), tuple(data.shape), str(codebook.device), count)
    if key not in _NEIGHBOURS:
        _NEIGHBOURS.clear()
        _NEIGHBOURS[key] = latent_neighbours(codebook, count)
    return _NEIGHBOURS[key]


def _lantern(cfg: LatentProximityConfig, components):
    V = components["target"].vocab_size
    k = cfg.k if cfg.k is not None else min(1000, V - 1)
    return LatentProximityAcceptance(neighbour_table(components["codebook"], min(k + 1, V - 1)), cfg)


def _bind_to_target(head, components):
    return head.bind(components["target"])  # shares the target's embedding and LM head; returns head


COMPONENTS = {
    "sd": Component("draft_model", "mmspec.models.llamagen:LlamaGenModel", doc="a small LlamaGen-style draft model"),
    "eagle": Component("eagle_head", "mmspec.models.eagle:EagleDraftHead", _bind_to_target,
                       doc="EAGLE's feature head on the target", timing="features"),
    "medusa": Component("medusa_head", "mmspec.models.medusa:GridMedusaHeads", _bind_to_target,
                        doc="parallel Medusa heads on the target's features", timing="heads"),
}
"""The pipeline component of each trained drafter part."""


def _report_draft(log: dict) -> str:
    metric = (f"held-out loss {log['heldout_loss']:.4f}" if log["kind"] == "chain"
              else f"held-out top-1 agreement {agreement(log['heldout_top1'])}")
    return f"{metric}, {log['wall_time_s']:.0f} s"


# sized from measured step times at one thread, batch 16 (the frozen target's forward dominates an
# eagle step): minutes per run (docs/costs.md)
_DRAFT_DEFAULTS = dict(steps=800, batch_size=16, lr=1e-3, dataset_size=4096)
_VQ = ("--vq", str, REQUIRED, "folder written by 'mmspec train vq'")
_TARGET = ("--target", str, REQUIRED, "the AR model it drafts for")
# the heads also train for a user's LlamaGen checkpoints (LlamaGen's own layout) on an image folder
# (--target's help is also the message of 'ar-draft --kind eagle' without it: the folders and files
# it takes are told by --n-head's help)
_HEAD_OPTIONS = (
    _TARGET,
    ("--vq", str, REQUIRED, "folder written by 'mmspec train vq', or a LlamaGen VQ checkpoint (.safetensors file)"),
    ("--data", str, None, "train on this image folder, DIR/<class>/<image> (class folders named by class id, or "
                          "sorted names get ids 0..n-1; default: the procedural shapes)"),
    ("--n-head", int, None, "when --target is a LlamaGen c2i GPT checkpoint (.safetensors file, LlamaGen's layout; "
                            "else a folder written by 'mmspec train ar-image'): its attention heads (default: "
                            "those of the LlamaGen config with its depth and width, GPT-B ... GPT-7B)"),
    ("--image-size", int, None, "when --vq is a LlamaGen VQ checkpoint: the image side it encodes (default 256)"),
)
_TRAIN = "mmspec.training.recipes.registered:"  # the recipes' train functions, imported when run
TRAINING = {
    "sd": TrainingRecipe(
        "ar-sd", _TRAIN + "ar_sd", "heldout_loss", alias="ar-draft --kind chain", report=_report_draft,
        options=(("--target", str, None, "folder written by 'mmspec train ar-image' (checked and recorded)"), _VQ),
        defaults=_DRAFT_DEFAULTS, doc="the AR image model's chain draft: a small AR model on the VQ's ids"),
    "eagle": TrainingRecipe(
        "ar-eagle", _TRAIN + "ar_eagle", "heldout_top1", alias="ar-draft --kind eagle", report=_report_draft,
        options=_HEAD_OPTIONS, defaults=_DRAFT_DEFAULTS, doc="EAGLE's feature head on the AR image model"),
    "medusa": TrainingRecipe(
        "ar-medusa", _TRAIN + "ar_medusa", "heldout_top1", alias="ar-draft --kind medusa", report=_report_draft,
        options=(*_HEAD_OPTIONS, ("--heads", int, None, "parallel heads, the tree's depth below the root (default 4, "
                                                       "less than the grid's width)")),
        defaults=_DRAFT_DEFAULTS, doc="Medusa heads on the AR image model's features (root token, token above, "
                                      "column)"),
}
"""The training recipe of each trained drafter part: ``mmspec train ar-sd``, ``ar-eagle``,
``ar-medusa`` (also ``mmspec train ar-draft --kind chain|eagle|medusa``)."""

register_part(SD, modalities=(MODALITY,), component=COMPONENTS["sd"], recipe=TRAINING["sd"])
register_part(
    name="eagle", component=COMPONENTS["eagle"], recipe=TRAINING["eagle"], kind="drafter", config=TreeConfig,
    requires=("eagle_head",),
    build=lambda cfg, c: EagleTreeDrafter(c["eagle_head"], top_k=cfg.top_k, depth=cfg.depth,
                                          total_tokens=cfg.total_tokens, mode=cfg.mode),
    doc="EAGLE-2 dynamic tree from the target's features (Li et al., 2024)", modalities=(MODALITY,))
register_part(
    name="medusa", component=COMPONENTS["medusa"], recipe=TRAINING["medusa"], kind="drafter", config=MedusaConfig,
    requires=("medusa_head",),
    build=lambda cfg, c: ParallelHeadsDrafter(c["medusa_head"].bind(c["target"]), top_k=cfg.top_k,
                                              total_tokens=cfg.total_tokens, depth=cfg.depth),
    doc="parallel heads (Medusa) on the target's features score a whole EAGLE-2 tree in one pass; they also read "
        "the root token, the token one grid row above each draft and its column", modalities=(MODALITY,))
register_part(
    name="sjd", kind="drafter", config=SJDConfig, build=_jacobi("independent"), traits=_jacobi_traits,
    doc="a Jacobi window: the previous pass's samples are the drafts (Teng et al., 2025, SJD)",
    modalities=(MODALITY,))
register_part(
    name="mcsjd", kind="drafter", config=SJDConfig, build=_jacobi("maximal"), traits=_jacobi_traits,
    doc="a Jacobi window whose redrafts are maximally coupled with the previous drafts, lossless "
        "(So et al., 2025, MC-SJD)",
    modalities=(MODALITY,))
register_part(
    name="zipar", kind="schedule", config=ZipARConfig, build=_zipar, lossless=False,
    partners={"drafter": ("lane_safe",)},
    doc="ZipAR's next-set schedule: a row starts once the row above has `window` tokens (He et al., 2025)",
    modalities=(MODALITY,))
register_part(
    name="gsd", kind="rule", config=GroupedAcceptanceConfig, lossless=False,
    build=lambda cfg, c: GroupedAcceptance(c["target"].tok_embeddings.weight, cfg),
    partners={"drafter": ("jacobi",)}, implies={"drafter": "sjd"},
    knob_info={"p_threshold": {"min": 0.0}, "d_threshold": {"min": 0.0}, "half_width": {"min": 1}},
    doc="GSD's grouped acceptance over the target's embeddings (So et al., 2025)", modalities=(MODALITY,))
register_part(
    name="lantern", kind="rule", config=LatentProximityConfig, requires=("codebook",), lossless=False,
    build=_lantern, partners={"drafter": ("eagle", "jacobi", "deterministic")}, implies={"drafter": "eagle"},
    knob_info={"k": {"min": 1}, "delta": {"min": 0.0, "max": 1.0}, "lam": {"min": 1.0},
               "rejection": {"choices": ("paper", "reference")}, "budget": {"choices": LatentProximityConfig.BUDGETS}},
    doc="LANTERN's relaxed test over latent proximity sets of the codebook (Jang et al., 2025); "
        "budget 'per-token' (default) keeps every emitted token within delta in TV, 'per-test' is the papers' rule",
    modalities=(MODALITY,))

for _name, _doc in (
    ("none", "target-only AR decoding (the baseline)"),
    ("sd", "a small draft AR model drafts a chain; exact speculative sampling"),
    ("eagle", "EAGLE-2 tree from the target's features; exact speculative sampling (q = 1)"),
    ("medusa", "EAGLE-2 tree from parallel heads in one pass; exact speculative sampling (q = 1)"),
    ("lantern", "EAGLE-2 tree verified with LANTERN's relaxed test (TVD <= delta per token)"),
    ("sjd", "Speculative Jacobi Decoding: Jacobi window, exact speculative sampling"),
    ("mcsjd", "MC-SJD: Jacobi window, redrafts maximally coupled with the last drafts; exact"),
    ("gsd", "Grouped Speculative Decoding: Jacobi window, grouped acceptance"),
    ("zipar", "ZipAR's next-set schedule alone (several rows in flight)"),
    ("zipar+sjd", "next-set schedule with a Jacobi window per row"),
    ("zipar+mcsjd", "next-set schedule with an MC-SJD window per row"),
    ("zipar+gsd", "next-set schedule, a Jacobi window per row, grouped acceptance"),
    ("sjd+lantern", "Jacobi drafts verified with LANTERN's test on drafted q"),
    ("zipar+sjd+lantern", "next-set schedule, Jacobi drafts per row, LANTERN's test"),
):
    register_method(_name, "" if _name == "none" else _name, doc=_doc, modalities=(MODALITY,))
