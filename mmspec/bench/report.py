"""Bench output: an aligned text table for people and an atomically written JSON file."""

from __future__ import annotations

import json
import os

from ..utils.atomic import atomic_path


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 and value != 0 else f"{value:.2f}"
    return str(value)


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """``columns`` is a list of (row key, header); missing keys print as ``-``."""
    cells = [[header for _, header in columns]]
    cells += [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: str | os.PathLike, payload: dict) -> None:
    """Write to a temp file beside ``path`` and rename it into place: never half-written."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


CORE_COLUMNS = [
    ("method", "method"), ("pair", "pair"), ("temperature", "T"), ("alpha", "alpha"), ("gamma", "gamma"),
    ("nfe", "NFE/sample"), ("nfe_speedup", "NFE x"), ("wall_speedup", "wall x"), ("tau", "tau"),
    ("tau_formula", "tau formula"), ("draft_nfe", "draft NFE"), ("exact", "exact"),
]
