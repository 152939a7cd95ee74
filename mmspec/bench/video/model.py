"""The cost model and a row's figures: the compute ratio of recompute over the cached stream, the
latency and memory slopes, and the speed-ups over recompute."""

from __future__ import annotations

import numpy as np

from ...core.errors import check_int
from ...eval.stats import fit_slope, moving_block_bootstrap, percentile_interval
from .config import VideoBenchConfig
from .timing import _Run


def compute_ratio(steps: int, chunk: int, visible: int) -> float:
    """Frame-passes per chunk of the window recompute over the cached stream's:
    ``S (C + V) / ((S + 1) C)`` with V = sink + window frames (StreamingLLM's cost argument,
    Xiao et al., 2024, at chunk granularity: attention itself is not counted)."""
    for name, v in (("steps", steps), ("chunk", chunk)):
        check_int(v, name, 1)
    check_int(visible, "visible", 0)
    return steps * (chunk + visible) / ((steps + 1) * chunk)


def _row(run: _Run, cfg: VideoBenchConfig, fit_from: int, steps: int, chunk: int, batch: int) -> dict:
    lat_ms = np.asarray(run.latency) * 1000
    starts = np.asarray(run.starts)
    steady = starts >= fit_from
    seconds = float(np.sum(run.latency))
    lat = fit_slope(starts[steady], lat_ms[steady], resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed)
    mem = fit_slope(starts[steady], np.asarray(run.rss)[steady], resamples=cfg.bootstrap_resamples,
                    seed=cfg.bootstrap_seed)
    adj_ms = np.asarray(run.adjusted if run.adjusted is not None else [np.nan] * len(lat_ms)) * 1000
    ok = steady & np.isfinite(adj_ms)
    adj = fit_slope(starts[ok], adj_ms[ok], resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed)
    med = float(np.median(lat_ms)) if len(lat_ms) else None
    # every column in every row, None where it does not apply
    row = dict(switch=None, speedup_vs_recompute=None, compute_ratio=None, switch_frames_to_new=None,
               switch_jump_ratio=None, colour_min_segment=None)
    row.update(run.label)
    row.update(frames=run.frames, frames_done=run.done, chunk=chunk, steps=steps, batch=batch,
               fps=batch * run.done / seconds if seconds else None, latency_ms_median=med,
               latency_ms_p95=float(np.percentile(lat_ms, 95)) if len(lat_ms) else None,
               latency_slope=lat["slope"], latency_slope_se=lat["se"], latency_slope_ci_low=lat["ci_low"],
               latency_slope_ci_high=lat["ci_high"], latency_slope_adj=adj["slope"], latency_slope_adj_se=adj["se"],
               latency_slope_adj_ci_low=adj["ci_low"], latency_slope_adj_ci_high=adj["ci_high"],
               latency_drift_pct=(100 * lat["slope"] * run.done / 1000 / med) if lat["slope"] is not None and med
               else None,
               peak_rss_mb=max(0.0, max(run.rss)) if run.rss else None,
               rss_slope=mem["slope"], rss_slope_se=mem["se"], rss_slope_ci_low=mem["ci_low"],
               rss_slope_ci_high=mem["ci_high"], cache_mb=max(run.cache) / 2**20 if run.cache else None,
               fit_from_frame=fit_from, fit_chunks=lat["n"], stopped=run.stopped, stop_reason=run.stop_reason)
    return row


def _median_ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(r,) median of each row of a (r, n) over the median of the same row of b."""
    return np.median(a, 1) / np.median(b, 1)


def _speedups(rows_runs: list[tuple[dict, _Run]], recompute: _Run, fit_from: int, cfg: VideoBenchConfig,
              steps: int, chunk: int, visible: int) -> None:
    """``speedup_vs_recompute``: the recompute's median steady-state chunk latency over the row's,
    over the chunks both streams ran (lockstep pairs), with a paired moving-block bootstrap
    95% interval (one generator, ``default_rng(bootstrap_seed)``, drawn row after row);
    ``compute_ratio`` beside it and the share of it reached."""
    base = np.asarray(recompute.latency)
    base_starts = np.asarray(recompute.starts)
    ratio = compute_ratio(steps, chunk, visible)
    rng = np.random.default_rng(cfg.bootstrap_seed)
    for row, run in rows_runs:
        lat = np.asarray(run.latency)
        n = min(len(lat), len(base))
        keep = np.asarray(run.starts[:n]) >= fit_from
        keep &= base_starts[:n] >= fit_from
        a, b = base[:n][keep], lat[:n][keep]
        row["compute_ratio"] = ratio
        if len(a) == 0:
            row.update(speedup_vs_recompute=None, speedup_ci_low=None, speedup_ci_high=None, speedup_of_compute=None)
            continue
        speed = float(np.median(a) / np.median(b))
        lo = hi = None
        if cfg.bootstrap_resamples and len(a) >= 3:
            reps = moving_block_bootstrap(_median_ratio, (a, b), cfg.bootstrap_resamples, rng)
            lo, hi = percentile_interval(reps)
        row.update(speedup_vs_recompute=speed, speedup_ci_low=lo, speedup_ci_high=hi,
                   speedup_of_compute=speed / ratio)
