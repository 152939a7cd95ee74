"""Token sequences from a causal LM (``"text"``): the core's methods on the synthetic pairs of
``mmspec bench core`` (``mmspec.bench.synthetic``). Every method is lossless.

Components: ``target`` (a causal LM, e.g. ``TinyCausalLM``) and ``draft_model`` (a smaller one
with the same vocabulary). The tree's defaults are the bench's 4 / 4 / 16, not EAGLE-2's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import JacobiDrafter, ModelTreeDrafter
from .knobs import check_config, knob
from .registry import register_method, register_modality, register_part
from .shared import SD, TreeConfig

MODALITY = "text"
register_modality(MODALITY, components=("target", "draft_model"),
                  defaults={"tree_top_k": 4, "tree_depth": 4, "tree_total_tokens": 16},
                  doc="token sequences from a causal LM (the core's synthetic bench)")


@dataclass(frozen=True)
class JacobiConfig:
    """SJD's Jacobi window on a 1-D sequence (no grid, so no spatial initialisation).

    Args:
        window: Jacobi window L: tokens drafted (and re-drafted) per pass.
        init: new window tokens: ``"random"`` (uniform) or ``"repeat"`` (the last known token).
    """

    window: int = knob(8, min=2)
    init: str = knob("random", choices=("random", "repeat"))

    def __post_init__(self):
        check_config(self)


register_part(SD, modalities=(MODALITY,))
register_part(
    name="tree", kind="drafter", config=TreeConfig, requires=("draft_model",),
    build=lambda cfg, c: ModelTreeDrafter(c["draft_model"], top_k=cfg.top_k, depth=cfg.depth,
                                          total_tokens=cfg.total_tokens, mode=cfg.mode),
    doc="EAGLE-2's dynamic tree drafted by a small draft model (Li et al., 2024)", modalities=(MODALITY,))
register_part(
    name="jacobi", kind="drafter", config=JacobiConfig, traits=("lane_safe",),
    build=lambda cfg, c: JacobiDrafter(c["target"].vocab_size, window=cfg.window, init=cfg.init),
    doc="a Jacobi window: the previous pass's samples are the drafts (SJD's drafts, no draft model)",
    modalities=(MODALITY,))

register_method("none", "", doc="target only (baseline)", modalities=(MODALITY,))
register_method("sd", doc="chain from a draft model, exact speculative sampling", modalities=(MODALITY,))
register_method("tree", doc="EAGLE-2 dynamic tree (top-k nodes, q = 1) from a draft model", modalities=(MODALITY,))
register_method("tree-sampled", "tree", knobs={"tree_mode": "sample", "tree_top_k": 2, "tree_depth": 3},
                doc="sampled tree (children drawn without replacement) from a draft model", modalities=(MODALITY,))
register_method("jacobi", doc="Jacobi window (SJD's drafts, no draft model)", modalities=(MODALITY,))
