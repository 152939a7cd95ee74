"""Configs and parts more than one modality registers: a draft model's chain, a dynamic tree and
the parallel heads' tree; how their training recipes report agreement."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import ModelChainDrafter
from .knobs import check_config, knob
from .registry import Part


@dataclass(frozen=True)
class SDConfig:
    """Chain speculative decoding with a small draft model (Leviathan et al., 2023).

    Args:
        gamma: draft tokens per round.
    """

    gamma: int = knob(4, min=1)

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2's dynamic tree; defaults from LANTERN's ``EaModel.from_pretrained`` (top_k=10,
    depth=4, total_token=59). Modalities override them (``register_modality(defaults=...)``).

    Args:
        top_k: children expanded per node.
        depth: levels below the root's children (a depth-d tree has d + 1 levels).
        total_tokens: nodes kept for verification (the most likely by path score).
        mode: ``"topk"`` (EAGLE-2's deterministic tree, q = 1) or ``"sample"`` (children drawn
            without replacement, verified with their draft probabilities).
    """

    top_k: int = knob(10, min=1)
    depth: int = knob(4, min=0)
    total_tokens: int = knob(59, min=2)
    mode: str = knob("topk", choices=("topk", "sample"))

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class MedusaConfig:
    """The tree of the parallel heads: EAGLE-2's dynamic tree over the K heads' distributions.
    Modalities override the defaults (``register_modality(defaults=...)``).

    Args:
        top_k: children per frontier node (and frontier width).
        total_tokens: nodes kept for verification.
        depth: levels below the root, at most the heads' count (None: all of them).
    """

    top_k: int = knob(4, min=1)
    total_tokens: int = knob(16, min=2)
    depth: int | None = knob(None, min=1)

    def __post_init__(self):
        check_config(self)


SD = Part(name="sd", kind="drafter", config=SDConfig, requires=("draft_model",),
          build=lambda cfg, c: ModelChainDrafter(c["draft_model"], gamma=cfg.gamma),
          doc="a small draft model drafting a chain (Leviathan et al., 2023)")
"""A small draft model (component ``draft_model``) drafting a chain of ``sd_gamma`` tokens."""


def agreement(top1) -> str:
    """A drafter's held-out top-1 agreement as ``mmspec train`` prints it: one figure, or one per
    parallel head."""
    return ", ".join(f"{x:.4f}" for x in top1) if isinstance(top1, list) else f"{top1:.4f}"
