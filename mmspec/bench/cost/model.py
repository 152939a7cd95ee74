"""The cost model: a row's passes priced by the measured curves (ceiling, prediction), the speed-ups,
and a GPU cost curve's projection (an input: assumptions, not measurements)."""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ...core.errors import check, check_choice, is_int
from .config import TARGET, WITHIN, draft_roles
from .timing import CallRecord, Pass


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


def target_prompt_seconds(records: Mapping[str, list[CallRecord]]) -> list[float]:
    """Per prompt, the median over rows of the target's prompt pass (one computation for every row)."""
    calls = len(next(iter(records.values())))
    return [statistics.median(p.seconds for recs in records.values() for p in recs[i].passes
                              if p.role == TARGET and p.prompt) for i in range(calls)]


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
        ok = is_int(T) or (isinstance(T, str) and T.strip().isdigit())
        check(ok and int(T) >= 1, f"{name} verify_cost_ratio", what, T)
        check(_is_number(value) and value > 0, f"{name} verify_cost_ratio[{T!r}]", "a number > 0", value)
        verify[int(T)] = float(value)
    check(verify.get(1) == 1.0, f"{name} verify_cost_ratio", 'ratios to the one-token pass: "1": 1.0 included',
          verify.get(1))
    costs = [verify[T] for T in sorted(verify)]
    check(all(a <= b for a, b in zip(costs, costs[1:])), f"{name} verify_cost_ratio",
          "non-decreasing in T (a wider verify never costs less than a narrower one)",
          {str(T): verify[T] for T in sorted(verify)})
    draft, roles = source["draft_target_ratio"], draft_roles()
    check(isinstance(draft, Mapping), f"{name} draft_target_ratio",
          f"an object {{drafter: draft pass / target pass}}, drafters among {', '.join(roles)}", draft)
    for key, value in draft.items():
        check_choice(f"{name} draft_target_ratio key", key, roles)
        check(_is_number(value) and value > 0, f"{name} draft_target_ratio[{key!r}]", "a number > 0", value)
    missing = [d for d in drafters if d not in draft]
    check(not missing, f"{name} draft_target_ratio",
          f"a ratio for every drafter the bench runs ({', '.join(drafters)}); missing {', '.join(missing)}",
          sorted(draft))
    overhead = source.get("overhead_ratio", 0.0)
    check(_is_number(overhead) and overhead >= 0, f"{name} overhead_ratio", "a number >= 0", overhead)
    return GPUCurve(source["name"], source["source"], verify, {k: float(v) for k, v in draft.items()},
                    float(overhead), path)
