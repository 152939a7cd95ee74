"""``mmspec.eval.stats``, the benches' shared statistics, held against scipy on fixed data:
``ols_slope`` is ``linregress``; ``bootstrap_indices`` draws ``scipy.stats.bootstrap``'s resamples and
``mean_ci`` lands on its percentile interval up to rounding; the moving-block bootstrap keeps runs of
consecutive points; ``fit_slope``'s replicates are per-resample least-squares slopes."""

import numpy as np
import pytest
from scipy import stats as sps

from mmspec.eval import stats

X = 3.0 * np.arange(40)
Y = 20.0 + 0.004 * X + np.random.default_rng(7).standard_normal(40)


def test_ols_slope_is_linregress_and_the_closed_form():
    slope, se = stats.ols_slope(X, Y)
    ref = sps.linregress(X, Y)
    assert (slope, se) == (ref.slope, ref.stderr)
    xc = X - X.mean()  # the classical formulas the video bench used before
    closed = (xc * (Y - Y.mean())).sum() / (xc * xc).sum()
    resid = Y - Y.mean() - closed * xc
    assert slope == pytest.approx(closed, rel=1e-12)
    assert se == pytest.approx(np.sqrt((resid * resid).sum() / (len(X) - 2) / (xc * xc).sum()), rel=1e-12)
    assert slope == pytest.approx(np.polyfit(X, Y, 1)[0], rel=1e-12)


def test_ols_slope_refuses_what_has_no_slope():
    with pytest.raises(ValueError, match="x must be a series of at least 3 points, not all equal"):
        stats.ols_slope([1.0, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="x must be"):
        stats.ols_slope([2.0, 2.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="y must be a series as long as x"):
        stats.ols_slope([0.0, 1.0, 2.0], [1.0, 2.0])


def test_bootstrap_indices_are_scipys_resamples_and_mean_ci_its_percentile_interval():
    values = (np.random.default_rng(3).random(50) < 0.7).astype(float)
    res = sps.bootstrap((values,), np.mean, n_resamples=400, method="percentile", vectorized=True,
                        rng=np.random.default_rng(11))
    idx = stats.bootstrap_indices(50, 400, 11)
    assert np.array_equal(values[idx].mean(1), res.bootstrap_distribution)  # the same draws, bit for bit
    low, high = stats.mean_ci(values, idx)
    assert (low, high) == pytest.approx(tuple(res.confidence_interval), rel=1e-12)  # rounding may differ
    assert stats.mean_ci(values, stats.bootstrap_indices(50)) == stats.mean_ci(values)  # the default matrix


def test_percentile_interval_is_the_central_quantiles():
    reps = np.random.default_rng(2).standard_normal(999)
    # exactly the quantiles at (1 - level) / 2 and (1 + level) / 2 (fit_slope's former arithmetic); the
    # video speed-up's former literal 0.025 and 0.975 agree up to rounding
    assert stats.percentile_interval(reps) == tuple(np.quantile(reps, [(1 - 0.95) / 2, (1 + 0.95) / 2]).tolist())
    assert stats.percentile_interval(reps) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])), rel=1e-12)
    assert stats.percentile_interval(reps, 0.5) == pytest.approx(tuple(sps.quantile(reps, [0.25, 0.75])))
    with_nan = np.concatenate([reps, [np.nan, np.inf]])
    assert stats.nan_percentile_interval(with_nan) == stats.percentile_interval(reps)
    with pytest.raises(ValueError, match="level must be a float in"):
        stats.percentile_interval(reps, 1.5)


def test_centred_interval_moves_the_replicates_median_onto_the_estimate():
    reps = np.arange(1.0, 102.0)  # median 51
    low, high = stats.percentile_interval(reps)
    assert stats.centred_interval(reps, 51.0) == pytest.approx((low, high))
    assert stats.centred_interval(reps, 61.0) == pytest.approx((low + 10, high + 10))
    assert stats.centred_interval(reps, 1.0, lower=0.0)[0] == 0.0
    ratios = np.exp(np.linspace(-1, 1, 101))  # median 1: in log space the interval scales
    lo2, hi2 = stats.centred_interval(ratios, 2.0, log=True)
    lo1, hi1 = stats.centred_interval(ratios, 1.0, log=True)
    assert (lo2, hi2) == pytest.approx((2 * lo1, 2 * hi1))


def test_block_length_is_the_cube_root():
    assert [stats.block_length(n) for n in (1, 3, 7, 8, 100, 1000)] == [1, 1, 2, 2, 5, 10]


def test_moving_block_resamples_are_runs_of_consecutive_points():
    n, seen = 100, []
    b = stats.block_length(n)

    def keep(xs):
        seen.append(xs)
        return xs.mean(1)

    reps = stats.moving_block_bootstrap(keep, (np.arange(n),), 30, np.random.default_rng(0))
    rows = np.concatenate(seen)
    assert reps.shape == (30,) and rows.shape == (30, n)
    runs = rows.reshape(30, n // b, b)
    assert (np.diff(runs, axis=-1) == 1).all()  # each block: b consecutive points
    assert (runs[..., 0] <= n - b).all()
    # batches change the memory, not the draws
    again = stats.moving_block_bootstrap(lambda xs: xs.mean(1), (np.arange(n),), 30, np.random.default_rng(0), batch=7)
    assert np.array_equal(again, reps)


def test_moving_block_with_blocks_of_one_is_scipys_bootstrap():
    """At n <= 3 the block is one point: the resamples are iid, and the draws are scipy's."""
    x = np.array([1.0, 4.0, 9.0])
    reps = stats.moving_block_bootstrap(lambda xs: xs.mean(1), (x,), 200, np.random.default_rng(5))
    res = sps.bootstrap((x,), np.mean, n_resamples=200, method="percentile", vectorized=True,
                        rng=np.random.default_rng(5))
    assert np.array_equal(reps, res.bootstrap_distribution)


def test_moving_block_refuses_bad_input():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="resamples must be an int >= 1"):
        stats.moving_block_bootstrap(lambda a: a.mean(1), (np.ones(5),), 0, rng)
    with pytest.raises(ValueError, match="samples must be non-empty 1-D series of one length"):
        stats.moving_block_bootstrap(lambda a, b: a.mean(1), (np.ones(5), np.ones(4)), 10, rng)


def test_fit_slope_replicates_are_linregress_slopes_of_the_block_resamples():
    fit = stats.fit_slope(X, Y, per=1000.0, resamples=60, seed=4)
    ref = sps.linregress(X, Y)
    assert fit["slope"] == 1000 * ref.slope and fit["se"] == 1000 * ref.stderr and fit["n"] == 40
    b = stats.block_length(40)
    starts = np.random.default_rng(4).integers(0, 40 - b + 1, size=(60, -(-40 // b)))
    idx = (starts[:, :, None] + np.arange(b)).reshape(60, -1)[:, :40]
    slopes = [1000 * sps.linregress(X[i], Y[i]).slope for i in idx]
    low, high = np.quantile(slopes, [0.025, 0.975])
    assert (fit["ci_low"], fit["ci_high"]) == pytest.approx((low, high), rel=1e-9)
    assert stats.fit_slope(X, Y, resamples=0)["ci_low"] is None  # no interval asked for


def test_fit_slope_leaves_out_resamples_without_a_slope():
    """Three points, blocks of one: some resamples draw one x three times (no slope); the interval
    comes from the others, and it is finite."""
    x, y = np.array([0.0, 1.0, 2.0]), np.array([0.0, 1.0, 3.0])
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 3, size=(200, 3))
    ok = np.ptp(x[idx], axis=1) > 0
    assert not ok.all()
    slopes = [sps.linregress(x[i], y[i]).slope * 1000 for i in idx[ok]]
    fit = stats.fit_slope(x, y, resamples=200, seed=1)
    assert (fit["ci_low"], fit["ci_high"]) == pytest.approx(tuple(np.quantile(slopes, [0.025, 0.975])), rel=1e-9)
