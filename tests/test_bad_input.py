"""Bad input raises a ValueError naming the argument and the allowed values (must-show 7)."""

import pytest
import torch

from mmspec.core import (JacobiDrafter, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         SpeculativeDecoder)
from tiny import tiny_lm


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0, vocab_size=16)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, r"temperature must be >= 0 \(0 means greedy\), got -0.5"),
    ({"top_p": 0.0}, r"top_p must be a float in \(0, 1\] or None, got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a float in \(0, 1\] or None, got 1.5"),
    ({"top_k": 0}, r"top_k must be an int >= 1 or None, got 0"),
    ({"guidance_scale": -1.0}, r"guidance_scale must be >= 0 or None"),
])
def test_logits_pipeline_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LogitsProcessor(**kwargs)


@pytest.mark.parametrize("gamma", [0, -3, 2.5])
def test_gamma_below_one(target, gamma):
    with pytest.raises(ValueError, match=r"gamma must be an int >= 1, got"):
        ModelChainDrafter(target, gamma=gamma)


def test_vocabulary_mismatch(target):
    other = tiny_lm(1, vocab_size=12)
    with pytest.raises(ValueError, match=r"drafter.vocab_size must be equal to the target's vocabulary size \(16\), got 12"):
        SpeculativeDecoder(target, ModelChainDrafter(other, 2))


def test_guidance_without_uncond(target):
    dec = SpeculativeDecoder(target, processor=LogitsProcessor(guidance_scale=3.0))
    with pytest.raises(ValueError, match=r"uncond_input_ids must be given when guidance_scale is set"):
        dec.generate([[1, 2]], 4)


def test_uncond_without_guidance(target):
    with pytest.raises(ValueError, match=r"uncond_input_ids is only used with guidance"):
        SpeculativeDecoder(target).generate([[1, 2]], 4, uncond_input_ids=[[0]])


@pytest.mark.parametrize("make,match", [
    (lambda t: ModelTreeDrafter(t, mode="beam"), r"mode must be one of 'topk', 'sample', got 'beam'"),
    (lambda t: ModelTreeDrafter(t, top_k=17), r"top_k must be an int in \[1, 16\], got 17"),
    (lambda t: ModelTreeDrafter(t, total_tokens=1), r"total_tokens must be an int >= 2, got 1"),
    (lambda t: JacobiDrafter(16, window=1), r"window must be an int >= 2, got 1"),
    (lambda t: JacobiDrafter(16, init="zeros"), r"init must be one of 'random', 'repeat', 'spatial', got 'zeros'"),
    (lambda t: JacobiDrafter(16, init_range=(4, 20)), r"init_range must be \(lo, hi\) with 0 <= lo < hi <= 16"),
])
def test_drafter_knobs(target, make, match):
    with pytest.raises(ValueError, match=match):
        make(target)


@pytest.mark.parametrize("call,match", [
    (lambda d: d.generate([[1]], 0), r"max_new_tokens must be an int >= 1, got 0"),
    (lambda d: d.generate([[]], 4), r"input_ids must be non-empty token sequences"),
    (lambda d: d.generate(torch.zeros(3, dtype=torch.long), 4), r"input_ids must be a \(batch, length>=1\) tensor"),
])
def test_generate_arguments(target, call, match):
    with pytest.raises(ValueError, match=match):
        call(SpeculativeDecoder(target))


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": "1"}, r"^temperature must be >= 0 \(0 means greedy\), got '1'"),
    ({"temperature": float("nan")}, r"^temperature must be >= 0"),
    ({"top_p": "0.9"}, r"^top_p must be a float in \(0, 1\] or None, got '0.9'"),
    ({"top_k": True}, r"^top_k must be an int >= 1 or None, got True"),
    ({"guidance_scale": "3"}, r"^guidance_scale must be >= 0 or None, got '3'"),
])
def test_logits_knobs_of_the_wrong_type(kwargs, match):
    """A wrong type is a ValueError naming the knob, not a bare TypeError from a comparison."""
    with pytest.raises(ValueError, match=match):
        LogitsProcessor(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"generator": 0}, r"^generator must be None, a torch.Generator, or a list of 1 torch.Generator"),
    ({"generator": [torch.Generator(), torch.Generator()]}, r"^generator must be .* a list of 1 torch.Generator"),
    ({"eos_token_id": "2"}, r"^eos_token_id must be None, an int >= 0, or a non-empty list of ints >= 0"),
    ({"eos_token_id": []}, r"^eos_token_id must be None, an int >= 0, or a non-empty list"),
    ({"pad_token_id": None}, r"^pad_token_id must be an int, got None"),
    ({"conditioning": [1]}, r"^conditioning must be None or a mapping"),
    ({"callback": 3}, r"^callback must be None or a callable"),
    ({"profile": 1}, r"^profile must be True or False, got 1"),
])
def test_generate_keywords(target, kwargs, match):
    """Each keyword is checked before the prefill: the target never runs."""
    calls = []
    hook = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            SpeculativeDecoder(target).generate([[1, 2]], 4, **kwargs)
    finally:
        hook.remove()
    assert calls == []
