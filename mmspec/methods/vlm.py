"""VLM answers (``"vlm"``): every method is a drafter in the core's one loop, verified by its exact
rule, so every method is lossless.

======== =====================================================================================
none     the target alone
sd       a small draft VLM (same tokenizer) drafting a chain (Leviathan et al., 2023)
lookup   prompt lookup: n-gram matches in the context (Saxena, 2023; transformers' prompt lookup)
eagle    EAGLE-2 dynamic tree from a draft head that sees every image token (SpecVLM's EagleVLM)
specvlm  the same tree, the head's image through SpecVLM's elastic visual compressor
vispec   the same tree, the head's image through ViSpec's vision adaptor + global feature
medusa   parallel heads (Medusa) score the whole tree in one pass, reading the root token and
         the image's mean embedding
======== =====================================================================================

Components: ``target`` (a ``VLMTarget``); the parts declare ``draft_model`` (a small VLM, which
``build`` reads as ``draft``, its ``VLMTarget``), ``eagle_head`` / ``specvlm_head`` /
``vispec_head`` (``VLMDraftHead``s, bound to the target here) and ``medusa_head`` (``MedusaHeads``),
each trained by its recipe (``TRAINING``). The three EAGLE head methods share the ``tree_*`` knobs;
``medusa`` has its own ``medusa_*`` (its depth is bounded by its head count).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import core
from ..core.errors import check
from .shared import MedusaConfig, SDConfig, agreement
from .knobs import check_config, knob
from .registry import REQUIRED, Component, TrainingRecipe, register_method, register_modality, register_part

MODALITY = "vlm"
HEADS = ("eagle", "specvlm", "vispec")
register_modality(MODALITY, components=("target",),
                  doc="answers about an image from a LLaVA-style VLM")


@dataclass(frozen=True)
class TreeConfig:
    """EAGLE-2's dynamic tree. EAGLE's own defaults are top_k 10, depth 7, 60 tokens (SpecVLM's
    too) and ViSpec's 8 / 3 / 30. Ours sit between them, smaller in tokens because on this CPU a
    verify pass's cost grows with its width: with the bundled heads, depth 6 is accepted almost
    whole (tau 7.2; a depth-6 tree has 7 levels, so at most 8), and ``mmspec bench vlm``'s deeper
    4 / 10 / 16 variant raises tau to 8.5 without raising tokens/s (each extra depth costs a head
    pass).

    Args:
        top_k: children expanded per node.
        depth: levels below the root's children (a depth-d tree has d + 1 levels).
        total_tokens: nodes kept for verification.
    """

    top_k: int = knob(8, min=1)
    depth: int = knob(6, min=1)
    total_tokens: int = knob(24, min=1)

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup (transformers' ``prompt_lookup_num_tokens``, 10 in its examples, and
    ``max_matching_ngram_size``, 2 by default).

    Args:
        num_tokens: tokens copied after a match.
        max_ngram: the longest n-gram matched (down to 1).
    """

    num_tokens: int = knob(10, min=1)
    max_ngram: int = knob(2, min=1)

    def __post_init__(self):
        check_config(self)


@dataclass(frozen=True)
class SpecVLMTreeConfig(TreeConfig):
    """EAGLE-2's dynamic tree from a SpecVLM head, with its compressor's gate optionally overridden.

    Args:
        top_k: children expanded per node.
        depth: levels below the root's children (a depth-d tree has d + 1 levels).
        total_tokens: nodes kept for verification.
        branch: 'gate' lets the question-aware gate pick the compression per request (SpecVLM's
            dynamic selection, top-1); a branch name forces it for every request.
        ratio: 0 keeps the trained ratio; for the parameter-free 'prune' (any ratio) and 'pool' (a
            square) branches, the compression applied instead.
    """

    branch: str = knob("gate", choices=("gate", "prune", "pool", "conv", "resampler", "text"), name="specvlm_branch")
    ratio: int = knob(0, min=0, name="specvlm_ratio")

    def __post_init__(self):
        check_config(self)
        if (self.branch, self.ratio) != ("gate", 0):  # the default is built at registration: no model code
            from ..models.vlm_draft import ElasticVisualCompressor

            ElasticVisualCompressor.check_override(self.branch, self.ratio)


def _head_part(method: str):
    def build(cfg: TreeConfig, components):
        head = components[f"{method}_head"]
        check(head.config.method == method, f"{method}_head", f"a head trained with method={method!r}",
              head.config.method)
        head = head.bind(components["target"])
        if isinstance(cfg, SpecVLMTreeConfig):
            head = head.compressed(cfg.branch, cfg.ratio)
        return core.EagleTreeDrafter(head, top_k=cfg.top_k, depth=cfg.depth, total_tokens=cfg.total_tokens)

    return build


def _draft_view(model, components):
    from ..adapters.vlm import VLMTarget  # the adapter imports the core only; no import at registration

    return VLMTarget(model)


COMPONENTS = {
    "sd": Component("draft_model", "transformers:LlavaForConditionalGeneration", _draft_view, provides="draft",
                    doc="a small VLM with the target's tokenizer", timing="span"),
    **{h: Component(f"{h}_head", "mmspec.models.vlm_draft:VLMDraftHead", doc=f"the {h} draft head",
                    timing="features") for h in HEADS},
    "medusa": Component("medusa_head", "mmspec.models.medusa:MedusaHeads", doc="parallel Medusa heads",
                        timing="heads"),
}
"""The pipeline component of each trained drafter part (the draft VLM may be any class the
adapter takes: LLaVA, Qwen2-VL, Qwen2.5-VL)."""


def _report_head(log: dict) -> str:
    tau = "" if log.get("heldout_tau") is None else (
        f", held-out tau {log['heldout_tau']:.2f} ({'at --init' if log['train'].get('init') else 'untrained'} "
        f"{log['untrained_tau']:.2f})")
    return (f"held-out top-1 agreement {agreement(log['heldout_top1'])}{tau}, {log['wall_time_s']:.0f} s on "
            f"{log['processes']} process(es)")


# the defaults of the target's recipe ('mmspec train vlm'); a draft-VLM step's time: docs/costs.md
_DRAFT_VLM_DEFAULTS = dict(steps=1600, batch_size=32, lr=1e-3, dataset_size=16000)
_HEAD_DEFAULTS = dict(steps=1000, batch_size=16, lr=1e-3, dataset_size=8000)
_HEAD_OPTIONS = (
    ("--target", str, REQUIRED, "the VLM it drafts for: a transformers LLaVA, Qwen2-VL or Qwen2.5-VL folder with "
                                "its processor (e.g. written by 'mmspec train vlm'), or a hub id"),
    ("--data", str, None, "conversations in the LLaVA / ShareGPT layout: a .json or .jsonl file or a folder of them "
                          "(default: generated scene questions, for a target written by 'mmspec train vlm')"),
    ("--image-folder", str, None, "where the data's image paths start (default: the data file's folder)"),
    ("--regenerate", int, None, "self-distillation: the target answers each first question itself, up to N tokens"),
    ("--tau-tokens", int, None, "new tokens per held-out prompt for the held-out tau, 0 to skip (default 32)"),
    ("--rollout-steps", int, None, "anti-shortcut rollout steps (default: 2 for vispec, 1 otherwise)"),
    ("--init", str, None, "fine-tune this saved head of the same method (e.g. one trained for another "
                          "resolution of the target) instead of starting fresh"))
_TRAIN = "mmspec.training.recipes.registered:"  # the recipes' train functions, imported when run
TRAINING = {
    "sd": TrainingRecipe(
        "vlm-sd", _TRAIN + "vlm_sd", "heldout_loss", defaults=_DRAFT_VLM_DEFAULTS,
        report=lambda log: f"held-out loss {log['heldout_loss']:.4f} nats/answer token, {log['wall_time_s']:.0f} s",
        doc="the small draft VLM of 'sd' (as 'mmspec train vlm --size draft')"),
    **{h: TrainingRecipe(f"vlm-{h}", _TRAIN + f"vlm_{h}", "heldout_top1", options=_HEAD_OPTIONS,
                         defaults=_HEAD_DEFAULTS,
                         report=_report_head, alias=f"vlm-draft --method {h}",
                         doc=f"the VLM's {h} draft head by online-logit distillation")
       for h in HEADS},
    "medusa": TrainingRecipe(
        "vlm-medusa", _TRAIN + "vlm_medusa", "heldout_top1", defaults=_HEAD_DEFAULTS, report=_report_head,
        options=_HEAD_OPTIONS + (("--heads", int, None, "parallel heads, the tree's depth below the root "
                                                        "(default 6)"),),
        alias="vlm-draft --method medusa", doc="the VLM's Medusa heads (root token + global image feature) by "
                                               "online-logit distillation"),
}
"""The training recipe of each trained drafter part: ``mmspec train vlm-sd``, ``vlm-eagle``,
``vlm-specvlm``, ``vlm-vispec``, ``vlm-medusa`` (the heads also ``mmspec train vlm-draft --method
...``; the heads' recipes run under ``accelerate launch``)."""

register_part(
    name="sd", component=COMPONENTS["sd"], recipe=TRAINING["sd"], kind="drafter", config=SDConfig, requires=("draft",),
    build=lambda cfg, c: core.ModelChainDrafter(c["draft"], gamma=cfg.gamma),
    doc="a small draft VLM (same tokenizer, sees the image) drafting a chain (Leviathan et al., 2023)",
    modalities=(MODALITY,))
register_part(
    name="lookup", kind="drafter", config=LookupConfig, traits=("lane_safe", "deterministic"),
    build=lambda cfg, c: core.PromptLookupDrafter(num_tokens=cfg.num_tokens, max_ngram=cfg.max_ngram),
    doc="prompt lookup: n-gram matches in the row's context (Saxena, 2023)", modalities=(MODALITY,))
_HEAD_DOCS = {
    "eagle": "EAGLE-2 dynamic tree from a head that sees every image token (SpecVLM's EagleVLM)",
    "specvlm": "EAGLE-2 tree from a head seeing the image through SpecVLM's elastic visual compressor",
    "vispec": "EAGLE-2 tree from a head seeing the image through ViSpec's vision adaptor + global feature",
}
for _h in HEADS:
    register_part(name=_h, component=COMPONENTS[_h], recipe=TRAINING[_h], kind="drafter",
                  config=SpecVLMTreeConfig if _h == "specvlm" else TreeConfig,
                  prefix="tree", requires=(f"{_h}_head",),
                  build=_head_part(_h), doc=_HEAD_DOCS[_h], modalities=(MODALITY,))

register_part(
    name="medusa", component=COMPONENTS["medusa"], recipe=TRAINING["medusa"], kind="drafter", config=MedusaConfig,
    prefix="medusa", requires=("medusa_head",),
    build=lambda cfg, c: core.ParallelHeadsDrafter(c["medusa_head"].bind(c["target"]), top_k=cfg.top_k,
                                                   total_tokens=cfg.total_tokens, depth=cfg.depth),
    doc="parallel heads (Medusa) on the target's features score a whole EAGLE-2 tree in one pass; they also "
        "read the root token and the image's mean embedding", modalities=(MODALITY,))

register_method("none", "", doc="the target alone (the baseline)", modalities=(MODALITY,))
for _name in ("sd", "lookup") + HEADS + ("medusa",):
    register_method(_name, modalities=(MODALITY,))
