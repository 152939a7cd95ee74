"""The VLM methods by name: each is a drafter plugged into the one core loop; verification is the
core's exact rule, so every method is lossless.

======== =====================================================================================
none     the target alone
sd       a small draft VLM (same tokenizer) drafting a chain (Leviathan et al., 2023)
lookup   prompt lookup: n-gram matches in the context (Saxena, 2023; transformers' prompt lookup)
eagle    EAGLE-2 dynamic tree from a draft head that sees every image token (SpecVLM's EagleVLM)
specvlm  the same tree, the head's image through SpecVLM's elastic visual compressor
vispec   the same tree, the head's image through ViSpec's vision adaptor + global feature
======== =====================================================================================

Knobs are prefixed by what they tune and validated: ``tree_top_k``, ``tree_depth``,
``tree_total_tokens`` (the three head methods), ``sd_gamma``, ``lookup_num_tokens``,
``lookup_max_ngram``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .. import core
from ..core.errors import check, check_choice
from .vlm import VLMTarget

METHODS = ("none", "sd", "lookup", "eagle", "specvlm", "vispec")
HEAD_METHODS = ("eagle", "specvlm", "vispec")


@dataclass
class TreeConfig:
    """EAGLE-2's dynamic tree. EAGLE's own defaults are top_k 10, depth 7, 60 tokens (SpecVLM's
    too) and ViSpec's 8 / 3 / 30. Ours sit between them, smaller in tokens because on this CPU a
    verify pass's cost grows with its width: with the bundled heads, depth 6 is accepted almost
    whole (tau 7.2; a depth-6 tree has 7 levels, so at most 8), and ``mmspec bench vlm``'s deeper 4 / 10 / 16 variant raises
    tau to 8.5 without raising tokens/s (each extra depth costs a head pass)."""

    top_k: int = 8
    depth: int = 6
    total_tokens: int = 24


@dataclass
class SDConfig:
    """Draft-chain length per round (transformers' assistant starts at 20 with a heuristic schedule;
    a fixed 4 suits the small draft VLM's acceptance here)."""

    gamma: int = 4


@dataclass
class LookupConfig:
    """transformers' ``prompt_lookup_num_tokens`` (10 in its examples) and
    ``max_matching_ngram_size`` (2 by default)."""

    num_tokens: int = 10
    max_ngram: int = 2


_CONFIGS = {"tree": TreeConfig, "sd": SDConfig, "lookup": LookupConfig}
_USES = {"none": (), "sd": ("sd",), "lookup": ("lookup",), "eagle": ("tree",), "specvlm": ("tree",),
         "vispec": ("tree",)}


def method_knobs(method: str) -> dict:
    """The knobs ``method`` accepts with their defaults, e.g. ``{"tree_top_k": 8, ...}``."""
    check_choice("method", method, METHODS)
    return {f"{prefix}_{f.name}": f.default for prefix in _USES[method] for f in fields(_CONFIGS[prefix])}


def parse_knobs(method: str, knobs: dict | None) -> dict:
    """``method``'s configs with ``knobs`` applied: ``{prefix: config}``; unknown knobs and bad
    values raise ``ValueError`` naming them."""
    allowed = method_knobs(method)
    knobs = dict(knobs or {})
    for name, value in knobs.items():
        check(name in allowed, "method_knobs", f"knobs of {method!r}: {', '.join(allowed) or 'none'}", name)
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, "an int >= 1", value)
    configs = {}
    for prefix in _USES[method]:
        own = {k[len(prefix) + 1 :]: v for k, v in knobs.items() if k.startswith(prefix + "_")}
        configs[prefix] = _CONFIGS[prefix](**own)
    return configs


def build_drafter(method: str, target: VLMTarget, *, draft: VLMTarget | None = None, heads: dict | None = None,
                  knobs: dict | None = None):
    """The drafter of ``method`` for ``target`` (``None`` for ``"none"``).

    ``draft`` is the small draft VLM's view (``sd``; bind the same images to it); ``heads`` maps
    ``eagle``/``specvlm``/``vispec`` to trained ``VLMDraftHead``s (bound here to ``target``)."""
    configs = parse_knobs(method, knobs)
    if method == "none":
        return None
    if method == "sd":
        check(draft is not None, "draft_model", "a small draft VLM for method 'sd'", None)
        return core.ModelChainDrafter(draft, gamma=configs["sd"].gamma)
    if method == "lookup":
        c = configs["lookup"]
        return core.PromptLookupDrafter(num_tokens=c.num_tokens, max_ngram=c.max_ngram)
    head = (heads or {}).get(method)
    check(head is not None, f"{method}_head", f"a trained VLMDraftHead for method {method!r}", None)
    check(head.config.method == method, f"{method}_head", f"a head trained with method={method!r}", head.config.method)
    c = configs["tree"]
    return core.EagleTreeDrafter(head.bind(target), top_k=c.top_k, depth=c.depth, total_tokens=c.total_tokens)
