"""AR image generation over VQ tokens: every acceleration method as a composition on the core.

A method name joins components with ``+``:

- a schedule: ``zipar`` (ZipAR's next-set decoding) or raster order (default);
- a drafter: ``sd`` (small draft AR model, chain), ``eagle`` (EAGLE-2 tree from the target's
  features), ``sjd`` (Jacobi window), or none;
- an acceptance rule: ``gsd`` (grouped), ``lantern`` (latent proximity) or exact speculative
  sampling (default).

``gsd`` implies the ``sjd`` drafter (GSD is SJD with a grouped test) and ``lantern`` implies
``eagle`` (LANTERN sits on EAGLE-2) unless ``sjd`` is named. ``none`` is target-only AR decoding.
So ``zipar+gsd`` = next-set schedule + Jacobi windows per row + grouped acceptance, and
``sjd+lantern`` = Jacobi drafts verified with LANTERN's relaxed test. No method owns a loop.

Knobs are flat, prefixed by component (``sjd_window=16``, ``gsd_p_threshold=0.15``,
``lantern_delta=0.1``, ``zipar_window=8``, ...): ``method_knobs(method)`` lists the valid ones
with their defaults, and unknown or invalid knobs raise before any work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core import JacobiDrafter, ModelChainDrafter, NullDrafter
from ..core.drafters import EagleTreeDrafter
from ..core.errors import check, check_choice
from ..core.relaxed import (GroupedAcceptance, GroupedAcceptanceConfig, LatentProximityAcceptance,
                            LatentProximityConfig, latent_neighbours)
from ..core.schedule import NextSetSchedule

SCHEDULES = ("zipar",)
DRAFTERS = ("sd", "eagle", "sjd")
RULES = ("gsd", "lantern")
METHODS = ("none", "sd", "eagle", "lantern", "sjd", "gsd", "zipar", "zipar+sjd", "zipar+gsd", "sjd+lantern",
           "zipar+sjd+lantern")
"""The methods the bench runs; any valid combination of the components above is accepted."""


@dataclass(frozen=True)
class SDConfig:
    """Chain speculative decoding with a small draft AR model (Leviathan et al., 2023)."""

    gamma: int = 4

    def __post_init__(self):
        check(isinstance(self.gamma, int) and self.gamma >= 1, "sd_gamma", "an int >= 1", self.gamma)


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE-2's dynamic tree; defaults from LANTERN's ``EaModel.from_pretrained`` (top_k=10,
    depth=4, total_token=59)."""

    top_k: int = 10
    depth: int = 4
    total_tokens: int = 59
    mode: str = "topk"

    def __post_init__(self):
        check(isinstance(self.top_k, int) and self.top_k >= 1, "eagle_top_k", "an int >= 1", self.top_k)
        check(isinstance(self.depth, int) and self.depth >= 0, "eagle_depth", "an int >= 0", self.depth)
        check(isinstance(self.total_tokens, int) and self.total_tokens >= 2, "eagle_total_tokens", "an int >= 2",
              self.total_tokens)
        check_choice("eagle_mode", self.mode, ("topk", "sample"))


@dataclass(frozen=True)
class SJDConfig:
    """Speculative Jacobi Decoding; window L = 16 and random initialisation are the reference's
    Lumina-mGPT defaults (its LlamaGen script uses ``repeat``: the left neighbour)."""

    window: int = 16
    init: str = "random"

    def __post_init__(self):
        check(isinstance(self.window, int) and self.window >= 2, "sjd_window", "an int >= 2", self.window)
        check_choice("sjd_init", self.init, ("random", "repeat", "spatial"))


@dataclass(frozen=True)
class ZipARConfig:
    """ZipAR's window s (tokens of the upper row before a row starts); the reference's LlamaGen
    default is 8 (on 24-wide grids)."""

    window: int = 8

    def __post_init__(self):
        check(isinstance(self.window, int) and self.window >= 1, "zipar_window", "an int >= 1", self.window)


_CONFIGS = {"sd": SDConfig, "eagle": EagleConfig, "sjd": SJDConfig, "gsd": GroupedAcceptanceConfig,
            "lantern": LatentProximityConfig, "zipar": ZipARConfig}


@dataclass(frozen=True)
class Method:
    """A parsed method: its schedule, drafter and rule components and their configs."""

    name: str
    schedule: str | None
    drafter: str | None
    rule: str | None
    configs: dict

    @property
    def lossless(self) -> bool:
        return self.rule is None and self.schedule is None

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(c for c in (self.schedule, self.drafter, self.rule) if c is not None)


def method_knobs(method: str) -> dict:
    """``{knob: default}`` of every knob ``method`` accepts."""
    m = parse_method(method)
    return {f"{c}_{f.name}": f.default for c in m.components for f in dataclasses.fields(_CONFIGS[c])}


def parse_method(method: str, **knobs) -> Method:
    """Validate a method name and its prefixed knobs; returns the composition."""
    check(isinstance(method, str) and method.strip() != "", "method", f"one of {', '.join(METHODS)} "
          "(or a '+' combination of zipar | sd, eagle, sjd | gsd, lantern)", method)
    if method == "none":
        parts = []
    else:
        parts = method.split("+")
    allowed = SCHEDULES + DRAFTERS + RULES
    for p in parts:
        check(p in allowed, "method", f"'none' or '+'-joined components from {', '.join(allowed)}", method)
    check(len(set(parts)) == len(parts), "method", "each component at most once", method)
    pick = lambda group: [p for p in parts if p in group]  # noqa: E731
    schedules, drafters, rules = pick(SCHEDULES), pick(DRAFTERS), pick(RULES)
    check(len(drafters) <= 1 and len(rules) <= 1, "method", "at most one drafter (sd | eagle | sjd) and one "
          "rule (gsd | lantern)", method)
    drafter = drafters[0] if drafters else None
    rule = rules[0] if rules else None
    if rule == "gsd" and drafter is None:
        drafter = "sjd"
    if rule == "lantern" and drafter is None:
        drafter = "eagle"
    check(not (rule == "gsd" and drafter != "sjd"), "method", "gsd with the sjd drafter (GSD is SJD's test "
          "replaced)", method)
    check(not (rule == "lantern" and drafter == "sd"), "method", "lantern with eagle or sjd drafts", method)
    schedule = schedules[0] if schedules else None
    check(not (schedule == "zipar" and drafter in ("sd", "eagle")), "method",
          "zipar alone or with sjd (draft models keep raster caches)", method)
    used = [c for c in (schedule, drafter, rule) if c is not None]
    configs = {}
    for c in used:
        fields = {f.name for f in dataclasses.fields(_CONFIGS[c])}
        mine = {k[len(c) + 1:]: v for k, v in knobs.items() if k.startswith(c + "_") and k[len(c) + 1:] in fields}
        configs[c] = _CONFIGS[c](**mine)
    valid = {f"{c}_{f.name}" for c in used for f in dataclasses.fields(_CONFIGS[c])}
    unknown = sorted(set(knobs) - valid)
    check(not unknown, "method knobs", f"knobs of {method!r}: {', '.join(sorted(valid)) or 'none'}", unknown)
    return Method(method, schedule, drafter, rule, configs)


@dataclass
class Composition:
    drafter: object
    rule: object | None
    schedule: object | None


def compose(method: Method, target, *, draft_model=None, eagle_head=None, codebook: torch.Tensor | None = None
            ) -> Composition:
    """Build the core objects of ``method`` for a LlamaGen-style ``target``.

    ``draft_model`` is needed by ``sd``, ``eagle_head`` (bound to ``target``) by ``eagle`` and
    ``lantern``, ``codebook`` (the VQ's code vectors) by ``lantern``; GSD groups by the target's
    input token embeddings, as its reference does."""
    c = method.configs
    V = target.vocab_size
    grid = target.config.grid_size
    drafter = NullDrafter()
    if method.drafter == "sd":
        check(draft_model is not None, "draft_model", "a draft AR model for method 'sd'", None)
        drafter = ModelChainDrafter(draft_model, gamma=c["sd"].gamma)
    elif method.drafter == "eagle":
        check(eagle_head is not None, "eagle_head", f"an EAGLE draft head for method {method.name!r}", None)
        e = c["eagle"]
        drafter = EagleTreeDrafter(eagle_head, top_k=e.top_k, depth=e.depth, total_tokens=e.total_tokens, mode=e.mode)
    elif method.drafter == "sjd":
        s = c["sjd"]
        drafter = JacobiDrafter(V, window=s.window, init=s.init, grid_width=grid)
    rule = None
    if method.rule == "gsd":
        rule = GroupedAcceptance(target.tok_embeddings.weight, c["gsd"])
    elif method.rule == "lantern":
        check(codebook is not None, "codebook", "the VQ codebook for method 'lantern'", None)
        cfg = c["lantern"]
        k = cfg.k if cfg.k is not None else min(1000, V - 1)
        rule = LatentProximityAcceptance(latent_neighbours(codebook, min(k + 1, V - 1)), cfg)
    schedule = None
    if method.schedule == "zipar":
        w = c["zipar"].window
        check(w <= grid, "zipar_window", f"an int in [1, {grid}] (the grid's width)", w)
        schedule = NextSetSchedule(grid, grid, w)
    return Composition(drafter, rule, schedule)
