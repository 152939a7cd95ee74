"""The VLM methods' former entry points, kept while callers move to ``mmspec.methods``.

The methods, their parts and knobs are registered in ``mmspec.methods.vlm``; these wrappers
resolve and build through the registry, so both paths give the same drafters and errors.
"""

from __future__ import annotations

from .. import methods
from ..methods.shared import SDConfig
from ..methods.vlm import HEADS, MODALITY, LookupConfig, TreeConfig
from .vlm import VLMTarget

METHODS = methods.names(MODALITY)
HEAD_METHODS = HEADS


def method_knobs(method: str) -> dict:
    """The knobs ``method`` accepts with their defaults, e.g. ``{"tree_top_k": 8, ...}``."""
    return {name: spec.default for name, spec in methods.knobs(MODALITY, method).items()}


def parse_knobs(method: str, knobs: dict | None) -> dict:
    """``method``'s configs with ``knobs`` applied, by knob prefix (``{"tree": TreeConfig(...)}``);
    unknown knobs and bad values raise ``ValueError`` naming them."""
    recipe = methods.resolve(MODALITY, method, knobs)
    parts = methods.parts(MODALITY)
    return {parts[p].prefix: recipe.configs[p] for p in recipe.parts}


def build_drafter(method: str, target: VLMTarget, *, draft: VLMTarget | None = None, heads: dict | None = None,
                  knobs: dict | None = None):
    """The drafter of ``method`` for ``target`` (``None`` for ``"none"``); ``heads`` maps
    ``eagle``/``specvlm``/``vispec`` to trained ``VLMDraftHead``s (bound here to ``target``)."""
    recipe = methods.resolve(MODALITY, method, knobs)
    components = {"target": target, "draft": draft, **{f"{h}_head": head for h, head in (heads or {}).items()}}
    return methods.build(recipe, components).drafter


__all__ = ["HEAD_METHODS", "METHODS", "LookupConfig", "SDConfig", "TreeConfig", "build_drafter", "method_knobs",
           "parse_knobs"]
