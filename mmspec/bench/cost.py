"""``mmspec bench cost``: what each method can reach, from its forward costs and its acceptance (issue 14).

For every bundled target that speculation applies to (``assets/ar-image``, ``assets/vlm``,
``assets/continuous``), one run:

1. **Runs the methods** (``DEFAULT_ROWS``; one untimed warm-up call per row, then prompts outer and
   rows inner) with forward hooks (``PassTimer``) on the target and on every draft model. Each pass
   is recorded with its role, its block width T, whether it carried a tree mask, and its time; a
   model's first pass in a call is its *prompt pass* (the target's prefill, a draft's first feed).
   Per row: the wall time, the time inside target forwards, inside draft forwards, and the *rest*
   (wall minus both: sampling, acceptance, tree building, cache commits, the pipeline's call).
2. **Measures cost curves** on a warm cache at a realistic prefix (the prompt plus half the
   generated tokens), through the same ``Target`` adapter and cache the decoder uses and timed by
   the same hooks: the target's pass of a T-token block for T in ``widths`` (``VERIFY_WIDTHS``) and
   every width the warm-up calls verified, as a chain and with a tree mask (``heap_tree``); each draft
   model's pass at the grid's widths up to 16 and every width its warm-up calls used, in the
   variants they used. After ``warmup`` untimed passes per point, ``ceil(repeats / prompts)``
   rounds over all points run after each prompt's calls (so the curves see the same machine as the
   calls); a point is the median of its passes. The cache is cut back to the prefix after every pass.

From those, per row (``row_figures``, ``add_speedups``):

- ``ceiling_s`` = the target's prompt passes (the median over rows of each prompt's, the same for
  every row) + the draft models' prompt passes (as measured) + every other pass priced by the
  curves at its width (``interpolate``); ``ceiling_x`` = ``none``'s / the row's: what the method
  reaches if the loop cost nothing outside the forwards;
- ``predicted_s`` = ``ceiling_s`` + the row's measured rest; ``predicted_x`` likewise;
- ``measured_x``: ``none``'s wall / the row's, same target, same run;
- ``measured_over_ceiling``, ``measured_over_predicted``, and ``within_15pct`` (issue 14's target:
  measured within 15% of the ceiling).

With a GPU cost curve (``load_gpu_curve``: verify cost ratio by T, draft/target cost ratio per
drafter, loop overhead per target pass) every row also gets ``projected_x``: the same passes
priced by that file, a projection from assumptions, never a measurement.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Mapping

import torch

from .. import methods
from ..core.errors import check, check_choice
from ..core.tree import Tree
from ..core.types import ModelOutput
from .report import format_table

ASSETS = Path(__file__).resolve().parents[2] / "assets"
TARGET = "target"
VERIFY_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_GRID_MAX = 16  # draft curves: the grid's widths up to here, plus every width a row used
WITHIN = 0.15  # issue 14: measured wall speed-up within 15% of the ceiling
# the drafter part of a method -> the pipeline component whose passes are its draft passes
DRAFT_ROLES = {"sd": "draft_model", "eagle": "eagle_head", "specvlm": "specvlm_head", "vispec": "vispec_head",
               "medusa": "medusa_head"}
TARGETS = ("ar-image", "vlm", "continuous")
SMALL_EAGLE = {"eagle_top_k": 2, "eagle_depth": 1, "eagle_total_tokens": 3}
DEFAULT_ROWS = {  # (label, method, knobs) per target; "none" first, the baseline of the ratios
    "ar-image": (("none", "none", {}), ("sd", "sd", {}), ("eagle", "eagle", {}),
                 ("eagle-small", "eagle", SMALL_EAGLE), ("medusa", "medusa", {})),
    "vlm": (("none", "none", {}), ("sd", "sd", {}), ("eagle", "eagle", {}), ("specvlm", "specvlm", {}),
            ("medusa", "medusa", {})),
    "continuous": (("none", "none", {}), ("sd", "sd", {})),
}


@dataclass
class CostBenchConfig:
    """One run; ``quick()`` is the smaller version (2 prompts per target, at least 7 passes per
    curve point). The bundled targets are named after their modality (``rows`` keys)."""

    targets: tuple = TARGETS
    ar_image_dir: str = str(ASSETS / "ar-image")
    vlm_dir: str = str(ASSETS / "vlm")
    continuous_dir: str = str(ASSETS / "continuous")
    rows: dict = field(default_factory=lambda: dict(DEFAULT_ROWS))
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
        for target in self.targets:
            for _, method, knobs in self.rows[target]:
                drafter = methods.resolve(target, method, knobs).part("drafter")
                if drafter in DRAFT_ROLES:
                    found.add(drafter)
        return tuple(sorted(found))


# -- timing every pass --------------------------------------------------------------------------

@dataclass(frozen=True)
class Pass:
    """One forward pass of a watched model."""

    role: str  # "target", or the draft's component ("draft_model", "eagle_head", ...)
    width: int  # T: tokens per row in the block
    tree: bool  # it carried a tree mask (an HF model: an explicit attention mask)
    seconds: float
    prompt: bool  # the role's first pass in its call (the target's prefill, a draft's first feed)


class PassTimer:
    """Forward hooks that time every pass of the watched models into ``passes``.

    A pass begins at a watched module's forward pre-hook and ends at its forward hook; while one is
    in flight, other watched modules' hooks are ignored (an EAGLE head reads the target's
    embedding inside its own pass). CPU timings: no device is synchronised. ``new_call()`` before
    each generation call makes every role's next pass a prompt pass again. Use as a context
    manager, or ``remove()`` the hooks.
    """

    def __init__(self):
        self.passes: list[Pass] = []
        self._open: list | None = None  # [role, width, tree, start] of the pass in flight
        self._seen: set[str] = set()
        self._handles: list = []

    def new_call(self) -> None:
        self._seen, self._open = set(), None

    def watch(self, role: str, module: torch.nn.Module, tokens_arg: int, mask_arg: int) -> None:
        """A model whose forward takes the block's tokens at position ``tokens_arg`` (or keyword
        ``tokens``) and the tree mask at ``mask_arg`` (or ``tree_mask``): native targets (0, 3),
        EAGLE heads (1, 4)."""

        def start(mod, args, kwargs):
            tokens = args[tokens_arg] if len(args) > tokens_arg else kwargs["tokens"]
            mask = args[mask_arg] if len(args) > mask_arg else kwargs.get("tree_mask")
            self._begin(role, tokens.shape[1], mask is not None)

        self._handles += [module.register_forward_pre_hook(start, with_kwargs=True),
                          module.register_forward_hook(partial(self._end, role))]

    def watch_heads(self, role: str, module: torch.nn.Module) -> None:
        """Parallel heads (``MedusaHeads``: ``heads(features, root, image)``): one call scores the
        whole tree from one feature per row, so its width is 1 (T for a (R, T, H) probe)."""

        def start(mod, args, kwargs):
            features = args[0] if args else kwargs["features"]
            self._begin(role, features.shape[1] if features.dim() == 3 else 1, False)

        self._handles += [module.register_forward_pre_hook(start, with_kwargs=True),
                          module.register_forward_hook(partial(self._end, role))]

    def watch_span(self, role: str, first: torch.nn.Module, last: torch.nn.Module, body: torch.nn.Module) -> None:
        """An HF model as ``VLMTarget`` runs it: from its input embedding ``first`` (the block's ids,
        and on a prompt pass the vision tower after it) through its LM head ``last``; ``body`` (the
        base model) says whether an explicit attention mask was passed (a tree, or a cache with holes)."""

        def start(mod, args, kwargs):
            if self._open is None:  # parallel heads embed their root tokens inside their own pass
                self._begin(role, args[0].shape[1], False)

        def masked(mod, args, kwargs):
            if self._open is not None and self._open[0] == role:
                self._open[2] = kwargs.get("attention_mask") is not None

        self._handles += [first.register_forward_pre_hook(start, with_kwargs=True),
                          body.register_forward_pre_hook(masked, with_kwargs=True),
                          last.register_forward_hook(partial(self._end, role))]

    def _begin(self, role: str, width: int, tree: bool) -> None:
        if self._open is None:
            self._open = [role, width, tree, time.perf_counter()]

    def _end(self, role: str, *hook_args) -> None:
        if self._open is None or self._open[0] != role:
            return
        seconds = time.perf_counter() - self._open[3]
        _, width, tree, _ = self._open
        self.passes.append(Pass(role, width, tree, seconds, prompt=role not in self._seen))
        self._seen.add(role)
        self._open = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "PassTimer":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


# -- the cost model -----------------------------------------------------------------------------

def interpolate(points: Mapping[int, float], T: float) -> float:
    """The cost at width T of a curve given at ``points`` ({T: cost}): linear between the two
    nearest points, the smallest point's cost below it, and past the largest point T_max in
    proportion to T (``cost(T_max) * T / T_max``)."""
    xs = sorted(points)
    if T <= xs[0]:
        return points[xs[0]]
    if T >= xs[-1]:
        return points[xs[-1]] * T / xs[-1]
    j = bisect.bisect_left(xs, T)
    a, b = xs[j - 1], xs[j]
    return points[a] + (T - a) / (b - a) * (points[b] - points[a])


def curve_seconds(passes: list[Pass], curves: Mapping) -> float:
    """Every pass but the prompt passes, priced by ``curves[role]["tree" or "chain"]`` at its width."""
    return sum(interpolate(curves[p.role]["tree" if p.tree else "chain"], p.width) for p in passes if not p.prompt)


def ceiling_seconds(passes: list[Pass], curves: Mapping, target_prompt_s: float) -> float:
    """``target_prompt_s`` + the draft models' prompt passes as measured + ``curve_seconds``."""
    draft_prompts = sum(p.seconds for p in passes if p.prompt and p.role != TARGET)
    return target_prompt_s + draft_prompts + curve_seconds(passes, curves)


@dataclass
class CallRecord:
    """One timed generation call: its wall time, the tokens it emitted and its passes."""

    wall: float
    tokens: int
    passes: list[Pass]


def _counts(passes: list[Pass], tree: bool) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in passes:
        if p.tree == tree:
            out[p.width] = out.get(p.width, 0) + 1
    return dict(sorted(out.items()))


def row_figures(records: list[CallRecord], curves: Mapping, target_prompt_s: float) -> dict:
    """A row's figures over its calls: NFE (target passes per call, prompt pass included), tau
    (tokens after each call's first / decode passes), the decode passes' width counts, times,
    ``ceiling_s`` (= ``target_prompt_s`` + ``draft_prompt_s`` + each counted width at its curve
    cost) and ``predicted_s`` (``ceiling_s`` + ``rest_s``, where ``rest_s`` = wall - target time -
    draft time). Per-pass figures divide by the target passes."""
    calls = len(records)
    passes = [p for r in records for p in r.passes]
    target = [p for p in passes if p.role == TARGET]
    decode = [p for p in target if not p.prompt]
    drafts = [p for p in passes if p.role != TARGET]
    draft_decode = [p for p in drafts if not p.prompt]
    wall = sum(r.wall for r in records)
    tokens = sum(r.tokens for r in records)
    target_s, draft_s = sum(p.seconds for p in target), sum(p.seconds for p in drafts)
    rest_s = wall - target_s - draft_s
    ceiling = ceiling_seconds(passes, curves, target_prompt_s)
    roles = sorted({p.role for p in drafts})
    return {
        "prompts": calls, "tokens": tokens, "nfe": len(target) / calls,
        "tau": (tokens - calls) / max(1, len(decode)),
        "verify_t_mean": statistics.fmean(p.width for p in decode) if decode else None,
        "verify_widths": {"chain": _counts(decode, False), "tree": _counts(decode, True)},
        "draft_passes_per_pass": len(drafts) / max(1, len(decode)),
        "draft_widths": {role: {variant: _counts([p for p in draft_decode if p.role == role], variant == "tree")
                                for variant in ("chain", "tree")} for role in roles},
        "wall_s": wall, "target_s": target_s, "draft_s": draft_s, "rest_s": rest_s,
        "target_ms_per_pass": 1000 * target_s / len(target), "draft_ms_per_pass": 1000 * draft_s / len(target),
        "overhead_ms_per_pass": 1000 * rest_s / len(target),
        "target_prompt_s": target_prompt_s,
        "draft_prompt_s": sum(p.seconds for p in drafts if p.prompt),
        "ceiling_s": ceiling, "predicted_s": ceiling + rest_s,
    }


def add_speedups(rows: list[dict], base: dict) -> None:
    """Ratios to ``base`` (the target's ``none`` row): measured, ceiling, predicted, and their quotients."""
    for row in rows:
        row["measured_x"] = base["wall_s"] / row["wall_s"]
        row["ceiling_x"] = base["ceiling_s"] / row["ceiling_s"]
        row["predicted_x"] = base["predicted_s"] / row["predicted_s"]
        row["measured_over_ceiling"] = row["measured_x"] / row["ceiling_x"]
        row["measured_over_predicted"] = row["measured_x"] / row["predicted_x"]
        row["within_15pct"] = abs(row["measured_over_ceiling"] - 1) <= WITHIN


# -- a GPU cost curve (an input: assumptions, not measurements) -----------------------------------

GPU_KEYS = ("name", "source", "verify_cost_ratio", "draft_target_ratio", "overhead_ratio")


@dataclass(frozen=True)
class GPUCurve:
    """Costs of another machine in units of its one-token target pass: ``verify_cost_ratio``
    {T: c(T)/c(1)} (``interpolate`` between and past the given T), ``draft_target_ratio`` {drafter:
    a draft pass / a target pass of the same width}, ``overhead_ratio`` (the loop's work per target
    pass). ``source`` says where the numbers come from."""

    name: str
    source: str
    verify_cost_ratio: dict[int, float]
    draft_target_ratio: dict[str, float]
    overhead_ratio: float = 0.0
    path: str | None = None

    def cost(self, passes: list[Pass], drafter: str | None) -> float:
        """The passes' cost in units of this machine's one-token target pass: each target pass
        ``verify_cost_ratio`` at its width, each draft pass ``draft_target_ratio[drafter]`` times
        that, plus ``overhead_ratio`` per target pass."""
        total = 0.0
        for p in passes:
            ratio = interpolate(self.verify_cost_ratio, p.width)
            total += ratio if p.role == TARGET else self.draft_target_ratio[drafter] * ratio
        return total + self.overhead_ratio * sum(p.role == TARGET for p in passes)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def load_gpu_curve(source: str | os.PathLike | Mapping, name: str = "gpu_curve",
                   drafters: tuple[str, ...] = ()) -> GPUCurve:
    """A ``GPUCurve`` from a JSON file (or its parsed object), checked: every error names ``name``,
    the key and what it accepts. ``drafters`` must all have a ``draft_target_ratio``."""
    path = None
    if not isinstance(source, Mapping):
        path = str(source)
        try:
            source = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{name} must be a readable JSON file, got {path!r} ({err})") from None
    keys = ", ".join(GPU_KEYS)
    check(isinstance(source, Mapping), name, f"a JSON object with the keys {keys}", type(source).__name__)
    unknown = sorted(set(source) - set(GPU_KEYS))
    check(not unknown, f"{name} keys", f"among {keys}", unknown)
    for key in GPU_KEYS[:4]:
        check(key in source, name, f"a JSON object with the keys {keys} (overhead_ratio optional); {key} is missing",
              sorted(source))
    for key in ("name", "source"):
        check(isinstance(source[key], str) and source[key].strip() != "", f"{name} {key}", "a non-empty string",
              source[key])
    ratio = source["verify_cost_ratio"]
    what = "an object {T: cost of a T-token verify / cost of a 1-token pass}, T an int >= 1, costs > 0"
    check(isinstance(ratio, Mapping) and len(ratio) > 0, f"{name} verify_cost_ratio", what, ratio)
    verify = {}
    for T, value in ratio.items():
        ok = (isinstance(T, int) and not isinstance(T, bool)) or (isinstance(T, str) and T.strip().isdigit())
        check(ok and int(T) >= 1, f"{name} verify_cost_ratio", what, T)
        check(_is_number(value) and value > 0, f"{name} verify_cost_ratio[{T!r}]", "a number > 0", value)
        verify[int(T)] = float(value)
    check(verify.get(1) == 1.0, f"{name} verify_cost_ratio", 'ratios to the one-token pass: "1": 1.0 included',
          verify.get(1))
    costs = [verify[T] for T in sorted(verify)]
    check(all(a <= b for a, b in zip(costs, costs[1:])), f"{name} verify_cost_ratio",
          "non-decreasing in T (a wider verify never costs less than a narrower one)",
          {str(T): verify[T] for T in sorted(verify)})
    draft = source["draft_target_ratio"]
    check(isinstance(draft, Mapping), f"{name} draft_target_ratio",
          f"an object {{drafter: draft pass / target pass}}, drafters among {', '.join(DRAFT_ROLES)}", draft)
    for key, value in draft.items():
        check_choice(f"{name} draft_target_ratio key", key, DRAFT_ROLES)
        check(_is_number(value) and value > 0, f"{name} draft_target_ratio[{key!r}]", "a number > 0", value)
    missing = [d for d in drafters if d not in draft]
    check(not missing, f"{name} draft_target_ratio",
          f"a ratio for every drafter the bench runs ({', '.join(drafters)}); missing {', '.join(missing)}",
          sorted(draft))
    overhead = source.get("overhead_ratio", 0.0)
    check(_is_number(overhead) and overhead >= 0, f"{name} overhead_ratio", "a number >= 0", overhead)
    return GPUCurve(source["name"], source["source"], verify, {k: float(v) for k, v in draft.items()},
                    float(overhead), path)


# -- probes: one pass of a model on a warm cache ---------------------------------------------------

def heap_tree(rows: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, T, T) ancestor mask and (rows, T) depths of a T-node binary-heap tree (node i's parent
    is (i - 1) // 2): the tree mask of a curve's tree variant."""
    parents = torch.tensor([(i - 1) // 2 for i in range(1, T)], dtype=torch.long).expand(rows, T - 1)
    tree = Tree(parents, max_depth=T.bit_length() - 1, max_children=min(2, T - 1))
    return tree.ancestor_mask, tree.depths


Probe = Callable[[int, bool], None]
"""``probe(T, tree)``: one pass of a T-token block (a chain, or ``heap_tree``) on a warm cache."""


def cached_probe(model, cache, prefix: int, cut: int, block: Callable[[int], tuple]) -> Probe:
    """``model(*block(T), positions, cache, mask)`` at positions ``prefix + depth``, then
    ``cache.truncate`` back to ``cut`` (an EAGLE head's cache holds positions 1..prefix-1: ``cut`` =
    prefix - 1), so every pass sees the same prefix."""
    rows = len(block(1)[0])
    lengths = torch.full((rows,), cut, dtype=torch.long)

    def probe(T: int, tree: bool) -> None:
        mask, depths = heap_tree(rows, T) if tree else (None, torch.arange(T).expand(rows, T))
        model(*block(T), prefix + depths, cache, mask)
        cache.truncate(lengths)

    return probe


class CurveSampler:
    """Samples cost curves: ``points`` {role: (variants, widths)} through ``probes``, each pass timed
    by ``timer`` (the hooks of the runs). ``warm(n)``: n untimed passes per point; ``round()``: one
    timed pass per point, each round starting one point further along the list; ``medians()``:
    {role: {variant: {T: median seconds}}}. Probes run under ``torch.inference_mode`` (as the decoder)."""

    def __init__(self, probes: Mapping[str, Probe], points: Mapping[str, tuple[tuple[str, ...], tuple[int, ...]]],
                 timer: PassTimer):
        self.probes, self.timer = probes, timer
        self.keys = [(role, variant, T) for role, (variants, widths) in points.items() for variant in variants
                     for T in widths]
        self.times: dict = {key: [] for key in self.keys}
        self.rounds = 0

    def _one(self, key) -> float:
        role, variant, T = key
        n = len(self.timer.passes)
        self.probes[role](T, variant == "tree")
        new = self.timer.passes[n:]
        if len(new) != 1 or new[0].role != role or new[0].width != T:
            raise RuntimeError(f"the {role} probe at T={T} recorded {[(p.role, p.width) for p in new]}")
        return new[0].seconds

    def warm(self, n: int) -> None:
        with torch.inference_mode():
            for key in self.keys:
                for _ in range(n):
                    self._one(key)

    def round(self) -> None:
        shift = self.rounds % len(self.keys)
        with torch.inference_mode():
            for key in self.keys[shift:] + self.keys[:shift]:
                self.times[key].append(self._one(key))
        self.rounds += 1

    def medians(self) -> dict:
        curves: dict = {}
        for (role, variant, T), values in self.times.items():
            curves.setdefault(role, {}).setdefault(variant, {})[T] = statistics.median(values)
        return curves


def warm_up(rows: list[tuple[str, Callable[[int], int]]], timer: PassTimer) -> list[Pass]:
    """One untimed call per row on prompt 0; returns their passes (the widths the rows use)."""
    n = len(timer.passes)
    for _, call in rows:
        timer.new_call()
        call(0)
    return timer.passes[n:]


def measure_calls(rows: list[tuple[str, Callable[[int], int]]], prompts: int, timer: PassTimer,
                  say=lambda msg: None, between: Callable[[], None] | None = None) -> dict[str, list[CallRecord]]:
    """Every row's ``call(i) -> tokens emitted`` on prompts 0..prompts-1, prompts outer and rows
    inner (drifts in machine speed hit every row alike); ``between()`` runs after each prompt's rows
    (the curve rounds, so the curves see the same machine as the calls)."""
    records = {label: [] for label, _ in rows}
    for i in range(prompts):
        say(f"prompt {i + 1}/{prompts}, {len(rows)} rows")
        for label, call in rows:
            timer.new_call()
            n = len(timer.passes)
            start = time.perf_counter()
            tokens = call(i)
            wall = time.perf_counter() - start
            records[label].append(CallRecord(wall, tokens, timer.passes[n:]))
        if between is not None:
            between()
    return records


# -- the bundled targets -------------------------------------------------------------------------

class _ARImage:
    """``assets/ar-image``: image i of class i % 16 with seed + i, CFG (two rows per pass)."""

    def __init__(self, cfg: CostBenchConfig):
        from ..pipelines import SpeculativeARImagePipeline

        self.cfg = cfg
        self.pipe = SpeculativeARImagePipeline.from_pretrained(cfg.ar_image_dir)
        self.pipe.set_progress_bar_config(disable=True)

    def component(self, role: str):
        return getattr(self.pipe, role, None)

    def call(self, method: str, knobs: dict, i: int) -> int:
        cfg = self.cfg
        out = self.pipe(class_labels=[i % self.pipe.num_classes], method=method, method_knobs=knobs,
                        guidance_scale=cfg.ar_guidance_scale, temperature=cfg.temperature,
                        generator=torch.Generator().manual_seed(cfg.seed + i), output_type="latent")
        return out.tokens.numel()

    def watch(self, timer: PassTimer, roles: set[str]) -> None:
        timer.watch(TARGET, self.pipe.transformer, 0, 3)
        if "draft_model" in roles:
            timer.watch("draft_model", self.pipe.draft_model, 0, 3)
        if "eagle_head" in roles:
            timer.watch("eagle_head", self.pipe.eagle_head, 1, 4)
        if "medusa_head" in roles:
            timer.watch_heads("medusa_head", self.pipe.medusa_head)

    def probes(self, roles: set[str], width: int) -> tuple[int, dict[str, Probe]]:
        model = self.pipe.transformer
        prefix, probes = _native_probes(model, {TARGET: model, "draft_model": self.pipe.draft_model},
                                        self.pipe.eagle_head, roles, width, prefix=1 + model.num_image_tokens // 2,
                                        seed=self.cfg.seed)
        if "medusa_head" in roles:  # no cache: one call on T features, two rows (a CFG pair) when drafting
            heads = self.pipe.medusa_head
            g = torch.Generator().manual_seed(self.cfg.seed)
            H, K = heads.config.dim, heads.num_heads

            def call(T, tree):
                inputs = {"above": torch.randint(model.vocab_size, (2, T, K), generator=g),
                          "column": torch.randint(model.config.grid_size, (2, T, K), generator=g)}
                return heads(torch.randn(2, T, H, generator=g), torch.randint(model.vocab_size, (2, T), generator=g),
                             inputs)

            probes["medusa_head"] = call
        return prefix, probes


def _native_probes(model, models: dict, head, roles: set[str], width: int, prefix: int, seed: int):
    """Probes of LlamaGen-style models (token ids, or continuous tokens of ``model.token_shape``)
    and an EAGLE head, two rows (a CFG pair: the class and the null class) on a ``prefix``-long cache."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(getattr(model, "token_shape", ()))

    def tokens(T: int) -> torch.Tensor:
        if shape:
            return torch.randn((2, T) + shape, generator=g)
        return torch.randint(model.vocab_size, (2, T), generator=g)

    prompt = tokens(prefix)
    prompt[:, 0] = torch.tensor([0, model.null_class]).view(2, *(1,) * len(shape)).to(prompt.dtype)
    positions = torch.arange(prefix).expand(2, prefix)
    probes = {}
    for role, m in models.items():
        if role in roles:
            cache = m.new_cache(2, prefix + width + 1)
            m(prompt, positions, cache)
            probes[role] = cached_probe(m, cache, prefix, prefix, lambda T: (tokens(T),))
    if "eagle_head" in roles:
        H = head.fc.weight.shape[0]
        cache = head.new_cache(2, prefix + width + 1)
        head(torch.randn(2, prefix - 1, H, generator=g), prompt[:, 1:], positions[:, 1:], cache)  # entries 1..prefix-1
        probes["eagle_head"] = cached_probe(head, cache, prefix, prefix - 1,
                                            lambda T: (torch.randn(2, T, H, generator=g), tokens(T)))
    return prefix, probes


class _Continuous(_ARImage):
    """``assets/continuous``: as the AR image target, CFG as ``mmspec bench continuous``."""

    def __init__(self, cfg: CostBenchConfig):
        from ..pipelines import SpeculativeContinuousARPipeline

        self.cfg = cfg
        self.pipe = SpeculativeContinuousARPipeline.from_pretrained(cfg.continuous_dir)
        self.pipe.set_progress_bar_config(disable=True)

    def call(self, method: str, knobs: dict, i: int) -> int:
        cfg = self.cfg
        out = self.pipe(class_labels=[i % self.pipe.num_classes], method=method, method_knobs=knobs,
                        guidance_scale=cfg.continuous_guidance_scale,
                        guidance_schedule=cfg.continuous_guidance_schedule, temperature=cfg.temperature,
                        generator=torch.Generator().manual_seed(cfg.seed + i), output_type="latent")
        return out.latents.shape[0] * out.latents.shape[1]

    def probes(self, roles: set[str], width: int) -> tuple[int, dict[str, Probe]]:
        model = self.pipe.transformer
        return _native_probes(model, {TARGET: model, "draft_model": self.pipe.draft_model}, None, roles, width,
                              prefix=1 + model.num_image_tokens // 2, seed=self.cfg.seed)


class _VLM:
    """``assets/vlm``: held-out scene i with a description question, greedy, batch 1."""

    def __init__(self, cfg: CostBenchConfig):
        from ..pipelines import SpeculativeVLMPipeline
        from .vlm import bench_prompts

        self.cfg = cfg
        self.pipe = SpeculativeVLMPipeline.from_pretrained(cfg.vlm_dir)
        self.pipe.set_progress_bar_config(disable=True)
        self.images, self.prompts = bench_prompts(cfg.prompts)

    def component(self, role: str):
        return getattr(self.pipe, role, None)

    def call(self, method: str, knobs: dict, i: int) -> int:
        out = self.pipe(images=[self.images[i]], prompts=[self.prompts[i]], method=method,
                        max_new_tokens=self.cfg.vlm_max_new_tokens, method_knobs=knobs or None)
        return len(out.tokens[0])

    def watch(self, timer: PassTimer, roles: set[str]) -> None:
        for role in (TARGET, "draft_model"):
            model = self.pipe.target if role == TARGET else self.pipe.draft_model
            if role in roles or role == TARGET:
                timer.watch_span(role, model.get_input_embeddings(), model.get_output_embeddings(), model.base_model)
        for role in roles - {"draft_model"}:
            if role == "medusa_head":
                timer.watch_heads(role, self.pipe.medusa_head)
            else:
                timer.watch(role, getattr(self.pipe, role), 1, 4)

    def probes(self, roles: set[str], width: int) -> tuple[int, dict[str, Probe]]:
        """Prompt 0 (with its image) plus half the new tokens on every cache; the heads are started
        on the target's prompt pass as ``EagleTreeDrafter`` starts them (images planned/compressed)."""
        target, draft = self.pipe.views()
        ids, vision = self.pipe.prepare_inputs(self.images[:1], self.prompts[:1])
        conditioning = target.vision_inputs(**vision)
        prompt = torch.tensor(ids)
        S, E = prompt.shape[1], self.cfg.vlm_max_new_tokens // 2
        prefix = S + E
        g = torch.Generator().manual_seed(self.cfg.seed)

        def tokens(T: int) -> torch.Tensor:
            x = torch.randint(target.vocab_size, (1, T), generator=g)
            return x.masked_fill(x == target.image_token_id, 0)  # text only after the prompt

        ext = tokens(E)
        seq = torch.cat([prompt, ext], 1)
        probes, first = {}, None
        for role, view in ((TARGET, target), ("draft_model", draft)):
            if role in roles:
                cache = view.new_cache(1, prefix + width + 1)
                out = view(prompt, torch.arange(S)[None], cache, **conditioning)
                more = view(ext, S + torch.arange(E)[None], cache)
                if role == TARGET:
                    first, hidden = out, torch.cat([out.hidden, more.hidden], 1)
                probes[role] = cached_probe(view, cache, prefix, prefix, lambda T: (tokens(T),))
        if "medusa_head" in roles:  # no cache: one call on T features (one per row when drafting)
            heads = self.pipe.medusa_head.bind(target)
            image = heads.image_feature(prompt, first.prompt_embeds, torch.tensor([S]))
            H = heads.config.hidden_size
            probes["medusa_head"] = lambda T, tree: heads(torch.randn(1, T, H, generator=g), tokens(T), image)
        for role in sorted(roles - {TARGET, "draft_model", "medusa_head"}):
            head = getattr(self.pipe, role).bind(target)
            H = head.fc.weight.shape[0]
            cache = head.new_cache(1, prefix + width + 1)
            prefill = ModelOutput(logits=None, hidden=first.hidden, prompt_embeds=first.prompt_embeds)
            head.start(cache, SimpleNamespace(prefill=prefill, tokens=seq, prompt_lengths=torch.tensor([S])))
            head(hidden[:, : prefix - 1], seq[:, 1:], torch.arange(1, prefix)[None], cache)  # entries 1..prefix-1
            probes[role] = cached_probe(head, cache, prefix, prefix - 1,
                                        lambda T: (torch.randn(1, T, H, generator=g), tokens(T)))
        return prefix, probes


_LOADERS = {"ar-image": _ARImage, "vlm": _VLM, "continuous": _Continuous}


# -- the run -------------------------------------------------------------------------------------

def _check(cfg: CostBenchConfig) -> dict[str, list]:
    """Every argument, before any model loads; returns each target's rows with their recipes."""
    check(isinstance(cfg.targets, tuple) and len(cfg.targets) > 0 and len(set(cfg.targets)) == len(cfg.targets),
          "targets", f"a non-empty tuple of distinct names among {', '.join(TARGETS)}", cfg.targets)
    for target in cfg.targets:
        check_choice("targets", target, TARGETS)
    for name in ("prompts", "repeats"):
        value = getattr(cfg, name)
        check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, "an int >= 1", value)
    check(isinstance(cfg.warmup, int) and cfg.warmup >= 0, "warmup", "an int >= 0", cfg.warmup)
    w = cfg.widths
    check(isinstance(w, tuple) and len(w) > 0 and w[0] == 1 and all(isinstance(t, int) and t >= 1 for t in w)
          and list(w) == sorted(set(w)), "widths", "increasing ints >= 1 starting at 1 (c(1) is the unit)", w)
    plans = {}
    for target in cfg.targets:
        rows = cfg.rows.get(target, ())
        check(len(rows) > 0 and rows[0][:2] == ("none", "none"), f"rows[{target!r}]",
              "(label, method, knobs) rows starting with ('none', 'none', {}): the baseline of the ratios", rows)
        plans[target] = [(label, method, knobs, methods.resolve(target, method, knobs))
                         for label, method, knobs in rows]
    if cfg.gpu_curve is not None:
        check(isinstance(cfg.gpu_curve, GPUCurve), "gpu_curve", "a GPUCurve (load_gpu_curve)", cfg.gpu_curve)
        load_gpu_curve({"name": cfg.gpu_curve.name, "source": cfg.gpu_curve.source,
                        "verify_cost_ratio": cfg.gpu_curve.verify_cost_ratio,
                        "draft_target_ratio": cfg.gpu_curve.draft_target_ratio,
                        "overhead_ratio": cfg.gpu_curve.overhead_ratio}, "gpu_curve", cfg.drafters())
    return plans


@torch.no_grad()
def run(cfg: CostBenchConfig, progress=None, loaders: Mapping | None = None) -> dict:
    """One run over ``cfg.targets`` (see the module docstring). ``loaders`` maps a target name to
    an object like ``_ARImage`` (tests pass tiny pipelines' folders through ``cfg`` instead)."""
    say = progress or (lambda msg: None)
    plans = _check(cfg)
    loaders = {**_LOADERS, **(loaders or {})}
    rows, curves, notes, prefixes = [], {}, [], {}
    for target in cfg.targets:
        say(f"{target}: loading")
        bench = loaders[target](cfg)
        live = []
        for label, method, knobs, recipe in plans[target]:
            role = DRAFT_ROLES.get(recipe.part("drafter"))
            if role is not None and bench.component(role) is None:
                notes.append(f"{target} {label}: skipped (no {role})")
            else:
                live.append((label, method, knobs, recipe, role))
        roles = {r[4] for r in live if r[4] is not None}
        rounds = math.ceil(cfg.repeats / cfg.prompts)  # curve rounds after each prompt
        with PassTimer() as timer:
            bench.watch(timer, roles)
            calls = [(label, partial(bench.call, method, knobs)) for label, method, knobs, _, _ in live]
            say(f"{target}: warm-up calls")
            points = curve_points(cfg.widths, warm_up(calls, timer), roles)
            width = max(max(w) for _, w in points.values())
            with torch.inference_mode():
                prefixes[target], probes = bench.probes(roles | {TARGET}, width)
            sampler = CurveSampler(probes, points, timer)
            say(f"{target}: {len(sampler.keys)} cost-curve points, {rounds * cfg.prompts} passes each, "
                f"{rounds} rounds after each prompt")
            sampler.warm(cfg.warmup)
            records = measure_calls(calls, cfg.prompts, timer, lambda msg: say(f"{target}: {msg}"),
                                    between=lambda: [sampler.round() for _ in range(rounds)])
            measured = sampler.medians()
        prompt_s = target_prompt_seconds(records)
        curves[target] = {"prefix": prefixes[target], "samples": sampler.rounds, "target_prompt_s": prompt_s,
                          "seconds": measured}
        target_rows = []
        for label, method, knobs, recipe, role in live:
            row = {"target": target, "method": label, "composition": method,
                   "knobs": " ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults",
                   "drafter": recipe.part("drafter"), "draft_role": role,
                   **row_figures(records[label], measured, sum(prompt_s))}
            if cfg.gpu_curve is not None:
                row["projected_cost"] = cfg.gpu_curve.cost([p for r in records[label] for p in r.passes],
                                                           row["drafter"])
            target_rows.append(row)
        add_speedups(target_rows, target_rows[0])
        if cfg.gpu_curve is not None:
            for row in target_rows:
                row["projected_x"] = target_rows[0]["projected_cost"] / row["projected_cost"]
                row["projection"] = f"gpu curve {cfg.gpu_curve.name}: assumed costs, not measured"
        rows += target_rows
        del bench
    setup = {
        "targets": list(cfg.targets), "prompts": cfg.prompts, "widths": list(cfg.widths), "repeats": cfg.repeats,
        "warmup": cfg.warmup, "threads": torch.get_num_threads(), "prefix": prefixes,
        "ar_guidance_scale": cfg.ar_guidance_scale, "continuous_guidance_scale": cfg.continuous_guidance_scale,
        "continuous_guidance_schedule": cfg.continuous_guidance_schedule, "temperature": cfg.temperature,
        "vlm_max_new_tokens": cfg.vlm_max_new_tokens, "seed": cfg.seed, "definitions": DEFINITIONS,
    }
    result = {"bench": "cost", "setup": setup, "curves": curves, "rows": rows, "notes": notes}
    if cfg.gpu_curve is not None:
        g = cfg.gpu_curve
        result["projection"] = {"name": g.name, "file": g.path, "source": g.source,
                                "verify_cost_ratio": g.verify_cost_ratio, "draft_target_ratio": g.draft_target_ratio,
                                "overhead_ratio": g.overhead_ratio,
                                "note": "projected_x prices the measured passes by this file's assumed costs: a "
                                        "projection, not a measurement"}
    return result


def curve_points(widths: tuple[int, ...], passes: list[Pass], roles: set[str]) -> dict:
    """{role: (variants, widths)} from the warm-up calls' passes: the target at ``widths`` and every
    width verified, chain and tree; each draft at ``widths`` up to ``DRAFT_GRID_MAX`` and every width
    it ran, in the variants it ran (other widths: ``interpolate``)."""
    passes = [p for p in passes if not p.prompt]
    verified = {p.width for p in passes if p.role == TARGET}
    points = {TARGET: (("chain", "tree"), tuple(sorted(set(widths) | verified)))}
    for role in sorted(roles):
        mine = [p for p in passes if p.role == role]
        grid = {T for T in widths if T <= DRAFT_GRID_MAX}
        variants = ("chain", "tree") if any(p.tree for p in mine) else ("chain",)
        points[role] = (variants, tuple(sorted(grid | {p.width for p in mine})))
    return points


def target_prompt_seconds(records: Mapping[str, list[CallRecord]]) -> list[float]:
    """Per prompt, the median over rows of the target's prompt pass (one computation for every row)."""
    calls = len(next(iter(records.values())))
    return [statistics.median(p.seconds for recs in records.values() for p in recs[i].passes
                              if p.role == TARGET and p.prompt) for i in range(calls)]


DEFINITIONS = {
    "passes": "forward hooks on the target and every draft model; a model's first pass in a call is its prompt pass",
    "target forward": "native models: the model's forward; HF VLMs: input embedding (and vision tower) to LM head, "
                      "so mask building before it and the continuous heads' per-token densities count in the rest",
    "rest_s": "wall - time inside target forwards - time inside draft forwards",
    "tau": "(tokens - prompts) / decode target passes: tokens per target pass after each call's prompt pass",
    "curves": "median pass time of a T-token block on a warm cache at the prefix, through the decoder's Target "
              "adapter and cache, cut back after each pass; 'tree' passes a binary-heap tree mask",
    "ceiling_s": "target prompt passes (per prompt, the median over rows) + draft prompt passes as measured + "
                 "every other pass at its curve cost (linear between measured widths)",
    "predicted_s": "ceiling_s + rest_s",
    "ceiling_x": "none's ceiling_s / the row's: the speed-up if the loop cost nothing outside forwards",
    "predicted_x": "none's predicted_s / the row's",
    "measured_x": "none's wall / the row's, same target, same run",
    "within_15pct": "|measured_x / ceiling_x - 1| <= 0.15 (issue 14's target)",
    "projected_x": "only with a GPU cost curve: the row's passes priced by that file's assumed ratios (plus its "
                   "overhead per target pass), none's cost / the row's; not measured",
}

COST_COLUMNS = [
    ("target", "target"), ("method", "method"), ("nfe", "NFE"), ("tau", "tau"), ("verify_t_mean", "verify T (mean)"),
    ("draft_passes_per_pass", "draft passes/pass"), ("target_ms_per_pass", "target ms/pass"),
    ("draft_ms_per_pass", "draft ms/pass"), ("overhead_ms_per_pass", "overhead ms/pass"), ("ceiling_x", "ceiling x"),
    ("predicted_x", "predicted x"), ("measured_x", "measured x"), ("measured_over_ceiling", "measured/ceiling"),
    ("within_15pct", "within 15% of ceiling"), ("measured_over_predicted", "measured/predicted"),
]


def columns(result: dict) -> list[tuple[str, str]]:
    """The method table's columns; with a GPU curve, the projected column, labelled as such."""
    projection = result.get("projection")
    if projection is None:
        return COST_COLUMNS
    return COST_COLUMNS + [("projected_x", f"projected x (gpu curve {projection['name']}, not measured)")]


def curve_rows(curve: Mapping) -> tuple[list[dict], list[tuple[str, str]]]:
    """One target's curves (``result["curves"][target]``) as table rows, one per width, and their
    columns: ms and c(T)/c(1) of every role and variant (c(1): the target's one-token chain pass)."""
    seconds = curve["seconds"]
    c1 = seconds[TARGET]["chain"][1]
    series = [(role if variant == "chain" else f"{role} tree", points)
              for role in [TARGET] + sorted(set(seconds) - {TARGET}) for variant, points in seconds[role].items()]
    cols = [("T", "T")] + [c for name, _ in series for c in ((f"{name} ms", f"{name} ms"), (name, f"{name} /c(1)"))]
    rows = []
    for T in sorted({T for _, points in series for T in points}):
        row = {"T": T}
        for name, points in series:
            if T in points:
                row[f"{name} ms"], row[name] = 1000 * points[T], points[T] / c1
        rows.append(row)
    return rows, cols


def format_report(result: dict) -> str:
    """The curve table of every target, then the method table, its notes and the projection's source."""
    parts = []
    for target, curve in result["curves"].items():
        rows, cols = curve_rows(curve)
        prompt_ms = 1000 * statistics.fmean(curve["target_prompt_s"])
        parts.append(f"{target}: cost curves on a warm cache at prefix {curve['prefix']} (median of "
                     f"{curve['samples']} passes per point, interleaved with the calls); target prompt pass "
                     f"{prompt_ms:.2f} ms (mean over prompts of the median over rows, from the runs)")
        parts.append(format_table(rows, cols) + "\n")
    parts.append(format_table(result["rows"], columns(result)))
    lines = ["", "NFE = target passes per prompt (prompt pass included); tau = tokens per target pass after it; "
                 "ms/pass per target pass; ceiling x = from the curves alone (no loop overhead); predicted x = "
                 "curves + each row's measured overhead; measured x = wall ratio to none in this run."]
    lines += [f"note: {n}" for n in result.get("notes", [])]
    projection = result.get("projection")
    if projection is not None:
        lines.append(f"projected x: the measured passes priced by gpu curve {projection['name']} "
                     f"({projection['file'] or 'given in Python'}), NOT measured; its source says: "
                     f"{projection['source']}")
    return "\n".join(parts + lines)


def public(result: dict) -> dict:
    return result


__all__ = ["COST_COLUMNS", "CallRecord", "CostBenchConfig", "DEFAULT_ROWS", "GPUCurve", "Pass", "PassTimer",
           "VERIFY_WIDTHS", "add_speedups", "cached_probe", "ceiling_seconds", "columns", "curve_seconds",
           "format_report", "curve_points", "heap_tree", "interpolate", "load_gpu_curve", "measure_calls",
           "CurveSampler", "public", "row_figures", "run", "target_prompt_seconds", "warm_up"]
