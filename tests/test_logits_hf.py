"""``LogitsProcessor`` against transformers' logits processors on random logits.

Reference: ``transformers.generation.logits_process`` ``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper`` applied in that order (the order of
``GenerationMixin._get_logits_processor``), then a softmax; with guidance,
``ClassifierFreeGuidanceLogitsProcessor`` first, which merges raw logits of a ``[cond; uncond]``
batch as ``uncond + (cond - uncond) * s``, our formula. (Its sibling
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` merges *log-softmaxed* scores and is not what we do.)

Tolerance: exact. The same float32 ops on the same masked logits give the same bits, so we require
``torch.equal`` of the probabilities on 512 random rows per setting (seed 0, V = 1000, logits
N(0, 3^2)). Deliberate differences, each shown by a test below:
- ties exactly on the top-p boundary: we keep the lower token ids, transformers the higher ones
  (it sorts ascending); ties at the top-k boundary are all kept by both;
- ``temperature=0`` is greedy here (one-hot at the argmax); transformers' warper refuses 0 and
  greedy is ``do_sample=False`` (the argmax), the same token;
- ``guidance_scale`` in [0, 1] is allowed here (1 is the conditional model alone, 0 the
  unconditional one); transformers' processor refuses scales <= 1.
"""

import pytest
import torch
from transformers.generation.logits_process import (ClassifierFreeGuidanceLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from mmspec.core import LogitsProcessor

V, ROWS = 1000, 512


def random_logits(rows=ROWS, seed=0):
    return 3.0 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def hf_probs(logits, temperature=1.0, top_k=None, top_p=None, guidance_scale=None):
    ids = torch.zeros(logits.shape[0] // (2 if guidance_scale else 1), 1, dtype=torch.long)
    procs = []
    if guidance_scale is not None:
        procs.append(ClassifierFreeGuidanceLogitsProcessor(guidance_scale))
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        procs.append(TopPLogitsWarper(top_p))
    scores = logits.clone()
    for proc in procs:
        scores = proc(ids, scores)
    return scores.softmax(-1)


SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.3),
    dict(top_k=1),
    dict(top_k=50),
    dict(top_p=0.9),
    dict(top_p=0.3),
    dict(temperature=0.8, top_k=40, top_p=0.95),
    dict(temperature=1.5, top_k=200, top_p=0.5),
]


@pytest.mark.parametrize("knobs", SETTINGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_warpers_match_transformers(knobs):
    logits = random_logits()
    ours = LogitsProcessor(**knobs)(logits)
    ref = hf_probs(logits, **knobs)
    assert torch.equal(ours, ref)
    kept = (ours > 0).sum(-1)
    if knobs.get("top_p") is not None or knobs.get("top_k") not in (None, V):
        assert bool((kept < V).all())  # the filters did remove tokens: the comparison is not vacuous


@pytest.mark.parametrize("knobs", [dict(guidance_scale=1.5), dict(guidance_scale=4.0, temperature=0.9, top_k=100,
                                                                 top_p=0.9)],
                         ids=["cfg", "cfg+warpers"])
def test_guidance_matches_transformers(knobs):
    logits = random_logits(2 * ROWS, seed=1)  # [cond; uncond]
    ours = LogitsProcessor(**knobs)(logits)
    assert ours.shape == (ROWS, V)
    assert torch.equal(ours, hf_probs(logits, **knobs))


def test_a_broken_pipeline_fails_the_comparison():
    """The comparison can fail: top-p applied before top-k (the wrong order) does not match."""
    logits = random_logits()
    wrong = LogitsProcessor(top_k=200)(LogitsProcessor(top_p=0.5)(logits).clamp_min(1e-30).log())
    assert not torch.equal(wrong, hf_probs(logits, top_k=200, top_p=0.5))


def test_top_p_ties_on_the_boundary_keep_the_lower_ids():
    """p = (.25, .5, .25, 0), top_p = 0.6: the nucleus needs one of the two tied .25 tokens. We keep
    token 0 (stable descending sort), transformers keeps token 2; both keep the same mass."""
    logits = torch.tensor([[0.25, 0.5, 0.25, 1e-9]]).log()
    ours = LogitsProcessor(top_p=0.6)(logits)
    ref = hf_probs(logits, top_p=0.6)
    assert ours[0].tolist() == pytest.approx([1 / 3, 2 / 3, 0.0, 0.0])
    assert ref[0].tolist() == pytest.approx([0.0, 2 / 3, 1 / 3, 0.0])


def test_top_k_ties_on_the_boundary_are_all_kept_by_both():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    ours = LogitsProcessor(top_k=2)(logits)
    assert torch.equal(ours, hf_probs(logits, top_k=2))
    assert (ours > 0).sum().item() == 3  # 3.0 and both 2.0s


def test_greedy_is_the_argmax():
    logits = random_logits(64)
    ours = LogitsProcessor(temperature=0)(logits)
    assert torch.equal(ours.argmax(-1), logits.argmax(-1)) and torch.equal(ours.sum(-1), torch.ones(64))
    with pytest.raises(ValueError):
        TemperatureLogitsWarper(0.0)  # transformers: greedy is do_sample=False instead


def test_guidance_scales_at_most_one_are_ours_only():
    logits = random_logits(2 * 8, seed=2)
    cond, uncond = logits.chunk(2)
    assert torch.equal(LogitsProcessor(guidance_scale=1.0).merge_guidance(logits), uncond + 1.0 * (cond - uncond))
    assert torch.equal(LogitsProcessor(guidance_scale=0.0)(logits), uncond.softmax(-1))
    with pytest.raises(ValueError):
        ClassifierFreeGuidanceLogitsProcessor(1.0)
