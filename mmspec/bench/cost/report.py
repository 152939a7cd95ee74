"""What the cost bench reports: the definitions in its setup, its tables and their columns."""

from __future__ import annotations

import statistics
from typing import Mapping

from ..report import format_table
from .config import TARGET


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
