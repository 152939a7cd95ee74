"""The AR image methods' former entry points, kept while callers move to ``mmspec.methods``.

The methods, their parts, knobs and grammar are registered in ``mmspec.methods.ar_image``; these
wrappers resolve and build through the registry (``methods.resolve("ar-image", ...)``,
``methods.build``), so both paths give the same objects and the same errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import methods
from ..methods.ar_image import MODALITY, SJDConfig, ZipARConfig
from ..methods.registry import Composition
from ..methods.shared import SDConfig, TreeConfig as EagleConfig

METHODS = methods.names(MODALITY)
"""The named methods (what the bench runs); any composition the parts allow is accepted too."""


@dataclass(frozen=True)
class Method:
    """A resolved method seen by kind: its schedule, drafter and rule parts and their configs."""

    name: str
    schedule: str | None
    drafter: str | None
    rule: str | None
    configs: dict
    recipe: methods.Recipe

    @property
    def lossless(self) -> bool:
        return self.recipe.lossless

    @property
    def components(self) -> tuple[str, ...]:
        return self.recipe.parts


def method_knobs(method: str) -> dict:
    """``{knob: default}`` of every knob ``method`` accepts."""
    return {name: spec.default for name, spec in methods.knobs(MODALITY, method).items()}


def parse_method(method: str, **knobs) -> Method:
    """Validate a method name and its prefixed knobs (``methods.resolve``)."""
    r = methods.resolve(MODALITY, method, knobs)
    return Method(r.name, r.part("schedule"), r.part("drafter"), r.part("rule"), dict(r.configs), r)


def compose(method: Method, target, *, draft_model=None, eagle_head=None, medusa_head=None,
            codebook: torch.Tensor | None = None) -> Composition:
    """The core objects of ``method`` for a LlamaGen-style ``target`` (``methods.build``)."""
    return methods.build(method.recipe, {"target": target, "draft_model": draft_model, "eagle_head": eagle_head,
                                         "medusa_head": medusa_head,
                                         "codebook": codebook})


__all__ = ["METHODS", "Composition", "EagleConfig", "Method", "SDConfig", "SJDConfig", "ZipARConfig", "compose",
           "method_knobs", "parse_method"]
