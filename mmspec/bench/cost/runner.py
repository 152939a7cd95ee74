"""One run of the cost bench: checks, then per target the warm-up calls, the curves interleaved
with the timed calls, and the rows."""

from __future__ import annotations

import math
from functools import partial
from typing import Mapping

import torch

from ... import methods
from ...core.errors import check, check_choice, check_int, is_int
from .config import TARGET, CostBenchConfig, cost_targets, draft_roles
from .curves import CurveSampler, curve_points
from .model import GPUCurve, add_speedups, load_gpu_curve, row_figures, target_prompt_seconds
from .report import DEFINITIONS
from .timing import PassTimer, measure_calls, warm_up


def _check(cfg: CostBenchConfig) -> dict[str, list]:
    """Every argument, before any model loads; returns each target's rows with their recipes."""
    known = tuple(cost_targets())
    check(isinstance(cfg.targets, tuple) and len(cfg.targets) > 0 and len(set(cfg.targets)) == len(cfg.targets),
          "targets", f"a non-empty tuple of distinct names among {', '.join(known)}", cfg.targets)
    for target in cfg.targets:
        check_choice("targets", target, known)
    for name in ("prompts", "repeats"):
        value = getattr(cfg, name)
        check_int(value, name, 1)
    check_int(cfg.warmup, "warmup", 0)
    w = cfg.widths
    check(isinstance(w, tuple) and len(w) > 0 and w[0] == 1 and all(is_int(t) and t >= 1 for t in w)
          and list(w) == sorted(set(w)), "widths", "increasing ints >= 1 starting at 1 (c(1) is the unit)", w)
    plans = {}
    for target in cfg.targets:
        rows = cfg.target_rows(target)
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
    an object like ``ARImageCost`` (default: each served modality's ``cost_target``; tests pass tiny
    pipelines' folders through ``cfg`` instead)."""
    say = progress or (lambda msg: None)
    plans = _check(cfg)
    loaders = {**cost_targets(), **(loaders or {})}
    roles_of = draft_roles()
    rows, curves, notes, prefixes = [], {}, [], {}
    for target in cfg.targets:
        say(f"{target}: loading")
        bench = loaders[target](cfg)
        live = []
        for label, method, knobs, recipe in plans[target]:
            role = roles_of.get(recipe.part("drafter"))
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
