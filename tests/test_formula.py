"""Mean tokens per pass matches Leviathan et al. (2023): tau = (1 - a^(g+1)) / (1 - a) (must-show 5).

I.i.d. drafts with acceptance rate a = sum(min(p, q)) (p, q uniform on overlapping token ranges),
2,000 rows x 120 tokens per setting (tens of thousands of passes), seed 0; bound: within 2%.
A rule that ignores the draft probability must miss the bound.
"""

import pytest
import torch

from mmspec.bench.synthetic import IIDDrafter, IIDTarget, expected_tau, iid_pair_distributions
from mmspec.core import LogitsProcessor, SpeculativeDecoder, SpeculativeSampling

ROWS, NEW_TOKENS = 2000, 120


def measured_tau(alpha, gamma, rule=None):
    p, q = iid_pair_distributions(alpha)
    dec = SpeculativeDecoder(IIDTarget(p), IIDDrafter(q, gamma), rule=rule, processor=LogitsProcessor())
    out = dec.generate(torch.zeros(ROWS, 1, dtype=torch.long), NEW_TOKENS, generator=torch.Generator().manual_seed(0))
    return out.stats.tau


@pytest.mark.parametrize("gamma", [2, 4, 8])
@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_tau_matches_formula(alpha, gamma):
    tau, formula = measured_tau(alpha, gamma), expected_tau(alpha, gamma)
    assert abs(tau / formula - 1) < 0.02, f"alpha={alpha} gamma={gamma}: tau={tau:.4f} formula={formula:.4f}"


class IgnoreDraftProb(SpeculativeSampling):
    """Broken: treats sampled drafts as deterministic ones (accepts with p(x), not p(x)/q(x))."""

    def accept_prob(self, p, q, x):
        return super().accept_prob(p, None, x)


def test_broken_rule_misses_formula():
    alpha, gamma = 0.7, 4
    tau = measured_tau(alpha, gamma, IgnoreDraftProb())
    assert abs(tau / expected_tau(alpha, gamma) - 1) > 0.02
