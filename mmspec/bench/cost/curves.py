"""Cost curves: one pass of a model on a warm cache (a probe), sampled at every width a row uses."""

from __future__ import annotations

import statistics
from typing import Callable, Mapping

import torch

from ...core.tree import Tree
from .config import DRAFT_GRID_MAX, TARGET
from .timing import Pass, PassTimer


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
