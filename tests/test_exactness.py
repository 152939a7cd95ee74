"""Lossless rules reproduce the target's distribution (must-show 1-3 of the foundation issue).

Every test: fixed seed, N = 20,000 samples of the first 3 generated tokens (one batch of 20,000
rows through the batched decoder), Pearson chi-square against the exact joint distribution over
all 8**3 sequences computed from scratch, pass at p >= 1e-3. Each lossless setting is paired with
deliberately broken rules, which the same test must reject (p < 1e-3).
"""

import pytest
import torch

from mmspec.core import (JacobiDrafter, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         SpeculativeDecoder, SpeculativeSampling)
from mmspec.core.exactness import (P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index,
                                   total_variation)

pytestmark = pytest.mark.statistical

N_SAMPLES = 20_000
N_TOKENS = 3
PROMPT = [3, 1, 4]
UNCOND = [0]


class NoResidual(SpeculativeSampling):
    """Broken: after a rejection, resample from p instead of norm(max(p - q, 0))."""

    def reject(self, p, q, x):
        return p


class AlwaysAccept(SpeculativeSampling):
    """Broken: accept every draft."""

    def accept_prob(self, p, q, x):
        return torch.ones_like(p[:, 0])


class SiblingRounds(SpeculativeSampling):
    """Lossless: the same test and residual, but as a subclass's own test, so deterministic trees
    take the sibling rounds over all nodes instead of one draw per node (``draws_decide``)."""

    def accept_prob(self, p, q, x):
        return super().accept_prob(p, q, x)


class FreshCorrection(SpeculativeSampling):
    """Broken (one draw per node): the token after the accepted path is drawn afresh from p at the
    path's last node instead of being the draw that rejected its children (p, not the residual)."""

    def _walk(self, draft, p_all, generator):
        acc = super()._walk(draft, p_all, generator)
        last = acc.path.gather(1, acc.num_accepted[:, None]).squeeze(1)
        acc.next_token = self.sample(p_all[torch.arange(len(last)), last], generator)
        return acc


def drafter(kind, draft, V):
    if kind == "chain":
        return ModelChainDrafter(draft, gamma=2)
    if kind == "tree-topk":  # EAGLE form: deterministic top-k nodes, q = 1
        return ModelTreeDrafter(draft, top_k=3, depth=1, total_tokens=8, mode="topk")
    if kind == "tree-sampled":  # drafted form: nodes sampled without replacement
        return ModelTreeDrafter(draft, top_k=2, depth=1, mode="sample")
    if kind == "jacobi":  # SJD: previous iteration's samples with their distributions
        return JacobiDrafter(V, window=3)
    raise AssertionError(kind)


def sample_pvalue(target, draft, kind, pipeline, rule=None, guided=False, seed=0):
    V = target.vocab_size
    dec = SpeculativeDecoder(target, drafter(kind, draft, V), rule=rule, processor=pipeline)
    g = torch.Generator().manual_seed(seed)
    out = dec.generate(torch.tensor([PROMPT]).expand(N_SAMPLES, -1), N_TOKENS, generator=g,
                       uncond_input_ids=torch.tensor([UNCOND]).expand(N_SAMPLES, -1) if guided else None)
    probs = exact_joint(target, PROMPT, N_TOKENS, pipeline, UNCOND if guided else None)
    samples = sequence_index(out.sequences[:, :N_TOKENS], V)
    return chisquare_pvalue(samples, probs), total_variation(samples, probs), out.stats


PLAIN = LogitsProcessor(temperature=1.0)
GUIDED = LogitsProcessor(temperature=0.8, top_k=5, guidance_scale=2.0)


@pytest.mark.parametrize("kind", ["chain", "tree-topk", "tree-sampled", "jacobi"])
def test_lossless_matches_target(small_vocab_pair, kind):
    """1 and 2: chains and both tree forms (and SJD's Jacobi drafts) sample the target exactly."""
    target, draft = small_vocab_pair
    pval, tv, stats = sample_pvalue(target, draft, kind, PLAIN)
    assert stats.tau > 1.1, "drafts must actually be accepted for this test to mean anything"
    assert pval >= P_THRESHOLD, f"{kind}: chi-square p={pval:.2e}, TV={tv:.4f}"


def test_lossless_tree_by_sibling_rounds(small_vocab_pair):
    """The deterministic tree under the sibling rounds (the road every other rule takes) is exact
    too; the default road is one draw per node."""
    target, draft = small_vocab_pair
    assert SpeculativeSampling().draws_decide and not SiblingRounds().draws_decide
    pval, tv, stats = sample_pvalue(target, draft, "tree-topk", PLAIN, rule=SiblingRounds())
    assert stats.tau > 1.1
    assert pval >= P_THRESHOLD, f"chi-square p={pval:.2e}, TV={tv:.4f}"


@pytest.mark.parametrize("kind", ["chain", "tree-topk", "tree-sampled", "jacobi"])
def test_lossless_with_cfg_topk_temperature(small_vocab_pair, kind):
    """3: exact with classifier-free guidance (doubled batch), top-k and temperature on."""
    target, draft = small_vocab_pair
    pval, tv, stats = sample_pvalue(target, draft, kind, GUIDED, guided=True)
    assert stats.tau > 1.1
    assert pval >= P_THRESHOLD, f"{kind}+cfg: chi-square p={pval:.2e}, TV={tv:.4f}"


@pytest.mark.parametrize("kind,broken", [
    ("chain", NoResidual), ("chain", AlwaysAccept),
    ("tree-topk", NoResidual), ("tree-topk", AlwaysAccept), ("tree-topk", FreshCorrection),
    ("tree-sampled", NoResidual), ("tree-sampled", AlwaysAccept),
    ("jacobi", NoResidual), ("jacobi", AlwaysAccept),
])
def test_broken_rules_are_caught(small_vocab_pair, kind, broken):
    """The same test, same seed and sample count, rejects each deliberately broken rule."""
    target, draft = small_vocab_pair
    pval, tv, _ = sample_pvalue(target, draft, kind, PLAIN, rule=broken())
    assert pval < P_THRESHOLD, f"{kind} with {broken.__name__} passed: p={pval:.2e}, TV={tv:.4f}"


def test_broken_rule_caught_with_cfg(small_vocab_pair):
    target, draft = small_vocab_pair
    pval, tv, _ = sample_pvalue(target, draft, "chain", GUIDED, rule=NoResidual(), guided=True)
    assert pval < P_THRESHOLD, f"p={pval:.2e}, TV={tv:.4f}"
