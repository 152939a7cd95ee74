"""Continuous-token AR image generation (``"continuous"``): MAR-style heads on a causal backbone,
every method on the core's one loop.

Parts: drafters ``sd`` (a small continuous draft model drafting a chain, with an optional warm-up of
target-only tokens) and ``sjd`` (a Jacobi window on densities: the target drafts its own next
tokens from its previous pass, no draft model; mixture head only); rules ``path`` (exact
speculative sampling on a diffusion head's whole denoising path, emitting the target's last step) and ``cspd`` (CSpD's reference rule, lossy).
Without a rule the decoder verifies the mixture head's exact densities. ``head_for(recipe)`` names
the head a recipe decodes with (``DensityProcessor(head=...)``): ``"diffusion"`` with a ``path`` or
``cspd`` rule, ``"mixture"`` otherwise. Continuous tokens take chains only (no trees) and raster
order. Components: ``target`` (``ContinuousARModel``), ``draft_model`` (a smaller one; not needed by
``sjd``; trained by ``DRAFT_TRAINING``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import CSpDAcceptance, JacobiDensityDrafter, ModelChainDrafter, SpeculativeSampling
from ..core.errors import check
from .knobs import check_config, knob
from .registry import (REQUIRED, Component, MethodRecipe, TrainingRecipe, register_method, register_modality,
                       register_part)

MODALITY = "continuous"
register_modality(MODALITY, components=("target",),
                  doc="class-conditional image generation over continuous tokens (mixture or diffusion heads)")

HEADS = {"path": "diffusion", "cspd": "diffusion"}
"""The head each rule part needs; recipes without one of these rules use the mixture head."""


def head_for(recipe: MethodRecipe) -> str:
    """``"diffusion"`` or ``"mixture"``: the ``DensityProcessor(head=...)`` a continuous recipe uses."""
    return HEADS.get(recipe.part("rule"), "mixture")


@dataclass(frozen=True)
class ContinuousSDConfig:
    """Chain speculative decoding with a small continuous draft model (Leviathan et al., 2023, on
    densities).

    Args:
        gamma: draft tokens per round.
        warmup: fraction of an image's tokens decoded by the target alone before drafting starts
            (CSpD's token pre-filling; exact).
    """

    gamma: int = knob(4, min=1)
    warmup: float = knob(0.0, min=0.0, max=0.95)

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class ContinuousSJDConfig:
    """Speculative Jacobi Decoding on densities (Teng et al., 2025, SJD), by default with each
    position's noise fixed across passes (fixed-noise Jacobi, Song et al., 2021), or MC-SJD's
    maximal coupling (So et al., 2025) carried to densities; lossless, no draft model
    (``mmspec.core.JacobiDensityDrafter``).

    Args:
        window: L, tokens verified per target pass (root included): ``window - 1`` drafts.
        coupling: ``"maximal"`` (MC-SJD: a redraft keeps the old draft with probability
            ``min(1, q_new / q_old)``, else draws from the exact residual), ``"independent"``
            (SJD: a fresh draw from q_new) or ``"noise"`` (each position keeps its noise and is
            redrawn from q_new with it: fixed-noise Jacobi, Song et al., 2021).
    """

    window: int = knob(8, min=2)
    coupling: str = knob("noise", choices=JacobiDensityDrafter.COUPLINGS)

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class PathConfig:
    """Exact speculative sampling on the diffusion head's denoising path (no knobs)."""

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class CSpDConfig:
    """CSpD's reference rule (Wang et al., 2025), lossy; defaults from its code.

    Args:
        inner_temperature: tau, the tolerance of the distance test in units of the last step's
            std (42 in the reference; larger accepts more and departs further from the target).
        max_tries: residual tries before the target's aligned output is emitted (100 in the reference).
    """

    inner_temperature: float = knob(42.0, min=1e-6)
    max_tries: int = knob(100, min=1)

    def __post_init__(self):
        check_config(self)


def _sd(cfg: ContinuousSDConfig, components) -> ModelChainDrafter:
    target, draft = components["target"], components["draft_model"]
    for name in ("token_shape", "state_kernel"):
        check(getattr(draft, name) == getattr(target, name), f"draft_model.{name}",
              f"the target's ({getattr(target, name)}): draft and target tokens must live in one space",
              getattr(draft, name))
    steps = [m.heads["diffusion"].schedule.timesteps.tolist() for m in (target, draft)]
    check(steps[0] == steps[1], "draft_model's diffusion timesteps",
          f"the target's ({steps[0]}): path densities compare chains on the same steps", steps[1])
    return ModelChainDrafter(draft, gamma=cfg.gamma, warmup=cfg.warmup)


DRAFT_MODEL = Component("draft_model", "mmspec.models.continuous:ContinuousARModel",
                        doc="a smaller continuous AR model")
"""The ``sd`` part's pipeline component."""


def _check_draft(options) -> None:
    if options["distill"] > 0 and options["target"] is None:
        raise ValueError("--distill needs --target DIR (the continuous AR model it distills from)")


def report(log: dict) -> str:
    """What ``mmspec train`` prints of a continuous model's training log."""
    return (f"held-out loss {log['heldout_loss']:.4f} (mixture {log['heldout_losses']['mixture']:.4f}), "
            f"{log['s_per_step']:.2f} s/step, {log['wall_time_s']:.0f} s")


INPUT_NOISE = 0.5
"""Default std of the extra noise on the teacher-forced input latents, for the target's recipe
(``mmspec train continuous-ar``) and the drafts' (``continuous-sd`` / ``continuous-draft``) alike:
the bundled target and drafts were trained with it (docs/continuous.md)."""

_TRAIN = "mmspec.training.recipes.registered:"  # the recipe's train function, imported when run
# sized from measured step times, plain and distilled, at one thread each (docs/costs.md)
DRAFT_TRAINING = TrainingRecipe(
    "continuous-sd", _TRAIN + "continuous_sd", "heldout_loss", alias="continuous-draft",
    check_options=_check_draft,
    report=report, defaults=dict(steps=4000, batch_size=32, lr=2e-3, dataset_size=16384),
    options=(("--tokenizer", str, REQUIRED, "folder written by 'mmspec train continuous-tokenizer'"),
             ("--input-noise", float, INPUT_NOISE, "std of extra noise on the teacher-forced input latents (training only)"),
             ("--target", str, None, "folder written by 'mmspec train continuous-ar' (its diffusion schedule is "
                                     "copied; required with --distill)"),
             ("--distill", float, 0.0, "weight of distillation to the target's heads, in [0, 1] (0: data only)")),
    doc="a small continuous draft, optionally distilled to the target (--distill)")
"""The ``sd`` part's training recipe: ``mmspec train continuous-sd`` (also ``continuous-draft``)."""

register_part(
    name="sd", component=DRAFT_MODEL, recipe=DRAFT_TRAINING, kind="drafter", config=ContinuousSDConfig,
    requires=("draft_model",), build=_sd,
    doc="a small continuous draft model drafting a chain (Leviathan et al., 2023), optional target-only warm-up",
    modalities=(MODALITY,))
register_part(
    name="sjd", kind="drafter", config=ContinuousSJDConfig,
    build=lambda cfg, c: JacobiDensityDrafter(tuple(c["target"].token_shape), window=cfg.window,
                                              coupling=cfg.coupling),
    doc="a Jacobi window on densities: the target's previous pass drafts its next tokens, each position redrawn "
        "with its own fixed noise or maximally coupled (Teng et al., 2025, SJD; Song et al., 2021; So et al., 2025, "
        "MC-SJD); no draft model, mixture head",
    modalities=(MODALITY,))
# the diffusion head's rules verify a draft model's denoising paths; Jacobi redraws keep no path
register_part(
    name="path", kind="rule", config=PathConfig, build=lambda cfg, c: SpeculativeSampling(),
    partners={"drafter": ("sd",)},
    doc="exact speculative sampling on the diffusion head's whole denoising path, emitting the target's last step",
    modalities=(MODALITY,))
register_part(
    name="cspd", kind="rule", config=CSpDConfig, lossless=False, partners={"drafter": ("sd",)},
    build=lambda cfg, c: CSpDAcceptance(cfg.inner_temperature, cfg.max_tries),
    doc="CSpD's reference rule: a distance test on coupled draft/target outputs relaxed by an inner "
        "temperature (Wang et al., 2025); lossy",
    modalities=(MODALITY,))

for _name, _parts, _knobs, _doc in (
    ("none", "", None, "target-only decoding with the mixture head (the baseline)"),
    ("none-diffusion", "path", None, "target-only decoding with the diffusion head (the path rule's baseline)"),
    ("sd", "sd", None, "a small draft model drafts a chain; exact speculative sampling on the mixture head"),
    ("sd-warmup", "sd", {"sd_warmup": 0.15}, "sd after 15% target-only tokens (CSpD's pre-filling); exact"),
    ("path", "sd+path", None, "sd with the diffusion head, exact on the whole denoising path"),
    ("cspd", "sd+cspd", None, "sd with the diffusion head and CSpD's reference rule (lossy, inner temperature 42)"),
    ("sjd", "sjd", None, "SJD on densities: the target drafts a Jacobi window from its previous pass, each position "
     "redrawn with its own fixed noise; no draft model, exact speculative sampling on the mixture head (lossless)"),
    ("sjd-mc", "sjd", {"sjd_coupling": "maximal"},
     "MC-SJD on densities: redrafts maximally coupled with the previous draft (exact residual); lossless, mixture head"),
    ("sjd-independent", "sjd", {"sjd_coupling": "independent"},
     "SJD on densities: the Jacobi window redrawn independently each pass; lossless, mixture head"),
):
    register_method(_name, _parts, knobs=_knobs, doc=_doc, modalities=(MODALITY,))
