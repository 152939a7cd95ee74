"""PromptLookupDrafter: the lookup itself, greedy bit-identity, and the distribution test.

Distribution test: the small-vocabulary pair's target (V = 8), prompt [3, 1, 4, 1, 3, 1], 20,000
rows of 3 sampled tokens (seed 0) against the exact joint, chi-square at p >= 1e-3; a rule that
accepts every draft fails the same test.
"""

import pytest
import torch

from mmspec.core import LogitsProcessor, PromptLookupDrafter, SpeculativeDecoder, SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index
from tiny import reference_greedy, tiny_lm


def test_lookup_takes_the_first_match_of_the_longest_ngram():
    from mmspec.core.lookup import lookup_draft

    seq = torch.tensor([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # bigram (6, 7) first occurs at 1: the draft is what followed it
    assert lookup_draft(seq, 3, max_ngram=2).tolist() == [8, 9, 1]
    assert lookup_draft(seq, 10, max_ngram=2).tolist() == [8, 9, 1, 6, 7, 2, 3, 6, 7]
    # no bigram match: fall back to the unigram (4 occurs once before)
    assert lookup_draft(torch.tensor([4, 2, 9, 3, 4]), 2, max_ngram=2).tolist() == [2, 9]
    # nothing matches
    assert lookup_draft(torch.tensor([1, 2, 3]), 4, max_ngram=2).tolist() == []
    assert lookup_draft(torch.tensor([1, 2, 3, 1]), 4, max_ngram=2, min_ngram=2).tolist() == []


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0, vocab_size=12, dim=32, n_layers=2, init_std=0.6)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 7, 2], [1, 2, 3, 1, 2, 3, 1, 2]]


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_bit_identical_and_drafts_accepted(target, rows):
    prompts = PROMPTS[:rows]
    dec = SpeculativeDecoder(target, PromptLookupDrafter(num_tokens=4), processor=LogitsProcessor(temperature=0))
    out = dec.generate(prompts, 30)
    for r, p in enumerate(prompts):
        assert out.sequences[r].tolist() == reference_greedy(target, p, 30)
    # a tiny greedy LM falls into loops, which lookup then copies: passes < tokens
    assert out.stats.target_forwards < 30


@pytest.mark.statistical
def test_sampled_lookup_is_exact_and_a_broken_rule_is_not():
    target = tiny_lm(0, vocab_size=8, dim=16, n_layers=2, init_std=0.5)
    prompt, n = [3, 1, 4, 1, 3, 1], 20_000
    pipeline = LogitsProcessor(temperature=1.0)
    probs = exact_joint(target, prompt, 3, pipeline)

    class AlwaysAccept(SpeculativeSampling):
        def accept_prob(self, p, q, x):
            return torch.ones_like(p[:, 0])

    pvalues, taus = [], []
    for rule in (None, AlwaysAccept()):
        kw = {} if rule is None else {"rule": rule}
        dec = SpeculativeDecoder(target, PromptLookupDrafter(num_tokens=3), processor=pipeline, **kw)
        out = dec.generate(torch.tensor([prompt]).expand(n, -1), 3, generator=torch.Generator().manual_seed(0))
        pvalues.append(chisquare_pvalue(sequence_index(out.sequences[:, :3], 8), probs))
        taus.append(out.stats.tau)
    assert taus[0] > 1.1, "drafts must be accepted for the test to mean anything"
    assert pvalues[0] >= P_THRESHOLD
    assert pvalues[1] < P_THRESHOLD


@pytest.mark.parametrize("kwargs, name", [(dict(num_tokens=0), "num_tokens"), (dict(max_ngram=0), "max_ngram"),
                                          (dict(max_ngram=2, min_ngram=3), "min_ngram"),
                                          (dict(num_tokens=2.5), "num_tokens")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PromptLookupDrafter(**kwargs)
