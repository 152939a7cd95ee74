"""Statistics every bench shares: bootstrap intervals and least-squares slopes.

- Resamples: ``bootstrap_indices`` (iid, for images: one matrix pairs every method of a run) and
  ``moving_block_bootstrap`` (runs of consecutive points, for time series whose noise is
  serially correlated: chunk latencies).
- Intervals from replicates: ``percentile_interval`` (and ``nan_percentile_interval``),
  ``centred_interval`` (re-centred on the estimate, optionally in log space), ``mean_ci``.
- Slopes: ``ols_slope`` is ``scipy.stats.linregress``'s slope and standard error;
  ``fit_slope`` adds a moving-block bootstrap interval.

Where scipy computes the same thing it is used (``linregress``). ``scipy.stats.bootstrap`` is
not: it draws the same iid resamples as ``bootstrap_indices`` from the same generator, but it
resamples each call anew (the benches share one index matrix between methods, so their intervals
are paired), has no moving-block or re-centred interval, and its percentile ends round differently
(``scipy.stats.quantile``); tests/test_bench_stats.py holds ``bootstrap_indices`` and ``mean_ci``
against it on fixed data. Gathered from the image and the video benches' quality code
unchanged, except: ``fit_slope``'s slope and ``se`` now come from ``linregress`` (equal to the
former closed form up to rounding: 4e-13 relative at most on the test series), and the video
bench's speed-up interval takes its quantiles at ``(1 - level) / 2`` and ``(1 + level) / 2`` like
every other interval here (it wrote 0.025 and 0.975: the lower one moves by 2e-17).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy import stats

from ..core.errors import check, check_int

BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
CI_LEVEL = 0.95


# -- resamples -----------------------------------------------------------------------------------
def bootstrap_indices(n: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """(resamples, n) image indices drawn with replacement (numpy ``default_rng(seed)``). One
    matrix serves every method of a run: image i of every method shares class and seed, so
    resampling the same indices pairs them (ratios between methods keep that pairing)."""
    check_int(n, "n", 1)
    check_int(resamples, "resamples", 1)
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def block_length(n: int) -> int:
    """The moving-block bootstrap's block: ``round(n ** (1/3))`` points, at least 1."""
    return max(1, round(n ** (1 / 3)))


def moving_block_bootstrap(statistic: Callable[..., np.ndarray], samples: tuple, resamples: int,
                           rng: np.random.Generator, batch: int | None = None) -> np.ndarray:
    """(resamples,) replicates of ``statistic(*resampled)`` for paired series ``samples`` of n
    points each: every resample is ceil(n / b) runs of b = ``block_length(n)`` consecutive points
    (start drawn uniformly by ``rng``, all starts in one draw) cut to n, so serially correlated
    noise stays in the resamples. ``statistic`` maps (r, n) arrays to (r,); it is called on at most
    ``batch`` resamples at a time (memory)."""
    check_int(resamples, "resamples", 1)
    samples = tuple(np.asarray(s) for s in samples)
    n = len(samples[0])
    check(n >= 1 and all(s.shape == (n,) for s in samples), "samples", "non-empty 1-D series of one length",
          [s.shape for s in samples])
    b = block_length(n)
    starts = rng.integers(0, n - b + 1, size=(resamples, -(-n // b)))
    step = resamples if batch is None else max(1, batch)
    out = []
    for r0 in range(0, resamples, step):
        part = starts[r0:r0 + step]
        idx = (part[:, :, None] + np.arange(b)).reshape(len(part), -1)[:, :n]  # (r, n)
        out.append(np.asarray(statistic(*(s[idx] for s in samples))))
    return np.concatenate(out)


# -- intervals -----------------------------------------------------------------------------------
def percentile_interval(values, level: float = CI_LEVEL) -> tuple[float, float]:
    """The central ``level`` interval of bootstrap replicates (resamples,): the percentile method."""
    check(0 < level < 1, "level", "a float in (0, 1)", level)
    values = np.asarray(values, np.float64)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def nan_percentile_interval(values, level: float = CI_LEVEL) -> tuple[float, float]:
    """``percentile_interval`` over the finite replicates (a resample that leaves a statistic
    undefined gives NaN)."""
    values = np.asarray(values, np.float64)
    return percentile_interval(values[np.isfinite(values)], level)


def mean_ci(values, idx: np.ndarray | None = None, level: float = CI_LEVEL) -> tuple[float, float]:
    """Bootstrap interval of the mean of ``values`` (n,) (class accuracy: 0/1 per image) over the
    resampled indices ``idx`` (``bootstrap_indices(n)`` by default)."""
    values = np.asarray(values, np.float64)
    check(values.ndim == 1 and len(values) >= 1, "values", "a (n,) array with n >= 1", values.shape)
    idx = bootstrap_indices(len(values)) if idx is None else idx
    return percentile_interval(values[idx].mean(1), level)


def centred_interval(replicates, estimate: float, level: float = CI_LEVEL, log: bool = False,
                     lower: float | None = None) -> tuple[float, float]:
    """The percentile interval of ``replicates`` moved so that their median sits on ``estimate``
    (in log space with ``log=True``, for ratios), its ends clipped at ``lower`` (FD: 0, which a
    shift can cross when the estimate is near 0, as the real-vs-real floor is).

    FD needs this: a resample repeats images, which shrinks the covariance's rank and inflates
    FD (measured at n = 128, F = 128 on Gaussian features: the replicates' median 36% above the
    estimate, the plain percentile interval entirely above it), while its spread still measures
    the image sample's noise. The centred interval is that spread around the estimate: an
    interval for the FD of a fresh set of n images, not for the infinite-sample FD."""
    values = np.asarray(replicates, np.float64)
    if log:
        check(estimate > 0 and (values > 0).all(), "replicates", "positive values with log=True", estimate)
        low, high = centred_interval(np.log(values), float(np.log(estimate)), level)
        return float(np.exp(low)), float(np.exp(high))
    low, high = percentile_interval(values, level)
    shift = estimate - float(np.median(values))
    low, high = low + shift, high + shift
    if lower is not None:
        low, high = max(low, lower), max(high, lower)
    return low, high


# -- slopes --------------------------------------------------------------------------------------
def ols_slope(x, y) -> tuple[float, float]:
    """Least-squares slope of ``y`` over ``x`` and its classical standard error
    (``scipy.stats.linregress``); at least 3 points and two distinct x values."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    check(x.ndim == 1 and len(x) >= 3 and np.ptp(x) > 0, "x", "a series of at least 3 points, not all equal",
          x.tolist() if x.size <= 8 else x.shape)
    check(y.shape == x.shape, "y", f"a series as long as x ({x.shape})", y.shape)
    fit = stats.linregress(x, y)
    return float(fit.slope), float(fit.stderr)


def _slopes(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """(r,) least-squares slopes of the rows of xs, ys (r, n); NaN where a row's x are all equal."""
    xc = xs - xs.mean(1, keepdims=True)
    sxx = (xc * xc).sum(1)
    num = (xc * (ys - ys.mean(1, keepdims=True))).sum(1)
    return np.divide(num, sxx, out=np.full(len(xs), np.nan), where=sxx > 0)


def fit_slope(x, y, per: float = 1000.0, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
              level: float = CI_LEVEL) -> dict:
    """Least-squares slope of ``y`` over ``x`` times ``per`` (e.g. ms per 1,000 frames), with its
    classical standard error (``se``, both from ``ols_slope``) and a moving-block bootstrap
    interval (``ci_low``, ``ci_high``: ``moving_block_bootstrap`` with ``resamples`` resamples,
    numpy ``default_rng(seed)``, resamples whose x are all equal left out; serially correlated
    noise widens it as it should; ``resamples=0``: no interval). ``n``: the points. Fewer than 3
    points, or one x value: every figure None."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    check(x.shape == y.shape and x.ndim == 1, "y", f"a series as long as x ({x.shape})", y.shape)
    n = len(x)
    out = dict(slope=None, se=None, ci_low=None, ci_high=None, n=n)
    if n < 3 or np.ptp(x) == 0:
        return out
    slope, se = ols_slope(x, y)
    out.update(slope=slope * per, se=se * per)
    if resamples:
        reps = moving_block_bootstrap(_slopes, (x, y), resamples, np.random.default_rng(seed),
                                      batch=2_000_000 // n)  # bounded memory for 100,000-frame streams
        out.update(zip(("ci_low", "ci_high"), nan_percentile_interval(reps * per, level)))
    return out


__all__ = ["BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "CI_LEVEL", "block_length", "bootstrap_indices",
           "centred_interval", "fit_slope", "mean_ci", "moving_block_bootstrap", "nan_percentile_interval",
           "ols_slope", "percentile_interval"]
