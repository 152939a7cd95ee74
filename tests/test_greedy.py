"""Greedy speculative output is bit-identical to greedy target-only decoding (must-show 4).

The reference is a from-scratch loop: no cache, the whole sequence recomputed for every token.
"""

import pytest
import torch

from mmspec.core import (JacobiDrafter, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         SpeculativeDecoder)
from mmspec.bench.synthetic import perturbed_copy
from tiny import reference_greedy, tiny_lm

V = 48
PROMPTS = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [17], [30, 31, 32, 33, 34, 35]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(0, vocab_size=V, dim=32, n_layers=3, init_std=0.5)
    close = perturbed_copy(target, noise=0.05, seed=1)  # accepts often: long paths, gathers
    unrelated = tiny_lm(2, vocab_size=V, dim=16, n_layers=1, init_std=0.3)
    return target, close, unrelated


@pytest.fixture(scope="module")
def reference(models):
    target = models[0]
    ref = [reference_greedy(target, p, MAX_NEW) for p in PROMPTS]
    assert len({tuple(r) for r in ref}) == len(ref), "rows should differ for the test to bite"
    assert all(len(set(r)) > 3 for r in ref), "greedy text should not be a constant"
    return ref


DRAFTERS = {
    "chain": lambda d: ModelChainDrafter(d, gamma=4),
    "tree-topk": lambda d: ModelTreeDrafter(d, top_k=3, depth=3, total_tokens=12),
    "tree-sampled": lambda d: ModelTreeDrafter(d, top_k=2, depth=2, mode="sample"),
    "jacobi": lambda d: JacobiDrafter(V, window=5),
    "jacobi-repeat": lambda d: JacobiDrafter(V, window=5, init="repeat"),
}


@pytest.mark.parametrize("draft_kind", ["close", "unrelated"])
@pytest.mark.parametrize("method", list(DRAFTERS))
@pytest.mark.parametrize("batch", ["B=1", "B=4"])
def test_greedy_bit_identical(models, reference, method, draft_kind, batch):
    target, close, unrelated = models
    draft = close if draft_kind == "close" else unrelated
    dec = SpeculativeDecoder(target, DRAFTERS[method](draft), processor=LogitsProcessor(temperature=0))
    if batch == "B=4":
        out = dec.generate(PROMPTS, MAX_NEW)
        assert out.sequences.tolist() == reference
        stats = out.stats
    else:
        for prompt, ref in zip(PROMPTS, reference):
            out = dec.generate([prompt], MAX_NEW)
            assert out.sequences[0].tolist() == ref
            stats = out.stats
    if draft_kind == "close" and not method.startswith("jacobi"):
        assert stats.tau > 1.5, "a close draft must be accepted: the test must exercise long paths"


def test_target_only_loop_matches_reference(models, reference):
    out = SpeculativeDecoder(models[0], processor=LogitsProcessor(temperature=0)).generate(PROMPTS, MAX_NEW)
    assert out.sequences.tolist() == reference
    assert out.stats.target_forwards == MAX_NEW  # prefill + one pass per further token
    assert out.stats.tau == 1.0


def test_eos_stops_rows(models, reference):
    eos = reference[0][5]
    dec = SpeculativeDecoder(models[0], ModelChainDrafter(models[1], 4), processor=LogitsProcessor(temperature=0))
    out = dec.generate(PROMPTS, MAX_NEW, eos_token_id=eos, pad_token_id=-1)
    for row, ref, n in zip(out.sequences.tolist(), reference, out.lengths.tolist()):
        expect = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert n == len(expect)
        assert row == expect + [-1] * (MAX_NEW - len(expect))


def test_nfe_per_sample_counts_each_rows_passes(models, reference):
    """Target-only: a row of n tokens needs n passes (the prefill emits the first); the batch runs
    until its longest row is done."""
    eos = reference[0][5]
    out = SpeculativeDecoder(models[0], processor=LogitsProcessor(temperature=0)).generate(
        PROMPTS, MAX_NEW, eos_token_id=eos)
    assert out.stats.nfe_per_sample == pytest.approx(out.lengths.float().mean().item())
    assert out.stats.target_forwards == int(out.lengths.max())
