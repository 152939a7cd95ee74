"""The diffusers callback contract beyond reading: guidance changed between passes (diffusers' CFG
cut-off, ``pipe._guidance_scale``), edited continuous latents, and safetensors-only folders.

A step is one target pass; a speculative pass commits a variable number of tokens, so "the same
switch" means the same committed length: a method that switched after a pass at committed length L
must equal ``method="none"`` switched at L (greedy, so the tokens are comparable one for one)."""

import dataclasses

import pytest
import torch

from mmspec.core import LogitsProcessor, SpeculativeDecoder
from mmspec.pipelines import SpeculativeContinuousARPipeline
from test_ar_pipeline import pipe as ar  # noqa: F401  (the module fixture: tiny AR pipeline with every head)
from test_continuous_pipeline import tiny_pipeline
from tiny import tiny_lm


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def switch_at(length, scale, seen):
    """A callback setting ``pipe._guidance_scale = scale`` after the first pass whose committed
    length reaches ``length``; ``seen`` records that length and the scales the pipe reported."""
    def callback(pipe, step, timestep, kwargs):
        seen.setdefault("scales", []).append((pipe.guidance_scale, pipe.do_classifier_free_guidance))
        if timestep >= length and "at" not in seen:
            seen["at"] = timestep
            pipe._guidance_scale = scale
        return {}
    return callback


# -- guidance between passes -----------------------------------------------------------------------

@pytest.mark.parametrize("method", ["sd", "eagle", "sjd"])
@pytest.mark.parametrize("new_scale", [0.0, None])
def test_a_guidance_switch_matches_the_baseline_switched_at_the_same_length(ar, method, new_scale):
    kw = dict(class_labels=[5], temperature=0.0, guidance_scale=3.0, output_type="latent")
    knobs = {"sjd_init": "spatial"} if method == "sjd" else {}
    seen = {}
    out = ar(method=method, method_knobs=knobs, callback_on_step_end=switch_at(60, new_scale, seen), **kw)
    L = seen["at"]
    assert 60 <= L < 256
    base_seen = {}
    base = ar(method="none", callback_on_step_end=switch_at(L, new_scale, base_seen), **kw)
    assert base_seen["at"] == L  # 'none' commits one token per pass: it switches at exactly L
    assert torch.equal(out.tokens, base.tokens)
    unswitched = ar(method="none", **kw).tokens.flatten()
    assert torch.equal(out.tokens.flatten()[:L], unswitched[:L])  # before the switch: the old scale
    assert not torch.equal(out.tokens.flatten()[L:], unswitched[L:])  # after it: the new one
    # the pipe reports the call's scale until the callback changes it, then the new one
    assert seen["scales"][0] == (3.0, True) and seen["scales"][-1] == (new_scale, new_scale is not None)


def test_guidance_properties_follow_the_call(ar):
    seen = []
    ar(class_labels=[0], temperature=0.0, guidance_scale=1.0, output_type="latent",
       callback_on_step_end=lambda p, i, t, kw: seen.append((p.guidance_scale, p.do_classifier_free_guidance)) or {})
    assert set(seen) == {(1.0, False)}
    assert ar.guidance_scale == 1.0  # the last call's, as diffusers' pipelines keep it


@pytest.mark.parametrize("start", [None, 1.0])
def test_switching_guidance_on_in_an_unguided_call_is_refused(ar, start):
    with pytest.raises(ValueError, match="guidance_scale must be None or 1.0 when set by callback_on_step_end"):
        ar(class_labels=[0], guidance_scale=start, output_type="latent", generator=gen(),
           callback_on_step_end=switch_at(3, 2.0, {}))
    # staying off is no change at all
    ref = ar(class_labels=[0], guidance_scale=start, output_type="latent", generator=gen())
    out = ar(class_labels=[0], guidance_scale=start, output_type="latent", generator=gen(),
             callback_on_step_end=switch_at(3, 1.0, {}))
    assert torch.equal(out.tokens, ref.tokens)


@pytest.mark.parametrize("bad", [-1.0, "2", float("nan")])
def test_a_bad_scale_from_a_callback_is_refused(ar, bad):
    with pytest.raises(ValueError, match="guidance_scale must be"):
        ar(class_labels=[0], output_type="latent", generator=gen(), callback_on_step_end=switch_at(3, bad, {}))


def test_the_decoder_takes_a_new_guidance_scale_only():
    target = tiny_lm(0)
    dec = SpeculativeDecoder(target, processor=LogitsProcessor(temperature=0.0, guidance_scale=2.0))
    ids, uncond = torch.tensor([[1, 2, 3]]), torch.tensor([[0]])

    def hot(step, state):
        state.processor = dataclasses.replace(state.processor, temperature=1.0)

    with pytest.raises(ValueError, match="state.processor must be a LogitsProcessor differing from the call's only"):
        dec.generate(ids, 6, uncond_input_ids=uncond, callback=hot)

    def off(step, state):
        state.processor = dataclasses.replace(state.processor, guidance_scale=None)

    with pytest.raises(ValueError, match="guidance_scale must be a number >= 0"):
        dec.generate(ids, 6, uncond_input_ids=uncond, callback=off)


def test_continuous_guidance_switch_changes_the_tokens_after_it():
    pipe = tiny_pipeline()
    kw = dict(class_labels=0, method="sd", guidance_scale=3.0, guidance_schedule="constant", output_type="latent")
    seen = {}
    out = pipe(generator=gen(4), callback_on_step_end=switch_at(5, 1.0, seen), **kw).latents[0]
    ref = pipe(generator=gen(4), **kw).latents[0]
    L = seen["at"]
    assert torch.equal(out[:L], ref[:L]) and not torch.allclose(out[L:], ref[L:])
    with pytest.raises(ValueError, match="guidance_scale must be None or 1.0 when set by callback_on_step_end"):
        pipe(class_labels=0, guidance_scale=None, generator=gen(4), callback_on_step_end=switch_at(2, 2.0, {}))


# -- continuous latents ----------------------------------------------------------------------------

def _feeds(pipe):
    """Record the tokens the target is fed each pass (a forward pre-hook)."""
    fed = []
    handle = pipe.transformer.register_forward_pre_hook(lambda m, args: fed.append(args[0].clone()))
    return fed, handle


@pytest.mark.parametrize("method", ["none", "sd"])
def test_an_edited_last_latent_is_what_decoding_continues_from(method):
    pipe = tiny_pipeline()
    edit = torch.tensor([0.5, -1.0, 2.0])
    at = {}

    def callback(p, step, timestep, kwargs):
        lat = kwargs["latents"]
        if step == 2:
            at["n"], at["old"] = lat.shape[1], lat[0, -1].clone()
            lat = lat.clone()
            lat[0, -1] = edit
            return {"latents": lat}
        return {}

    kw = dict(class_labels=1, method=method, guidance_scale=None, output_type="latent",
              callback_on_step_end_tensor_inputs=["latents"])
    fed, handle = _feeds(pipe)
    out = pipe(generator=gen(2), callback_on_step_end=callback, **kw).latents[0]
    edited_feeds = list(fed)
    fed.clear()
    ref = pipe(generator=gen(2), **kw).latents[0]
    handle.remove()
    n = at["n"]
    assert torch.equal(out[n - 1], edit) and torch.equal(out[: n - 1], ref[: n - 1])
    assert not torch.allclose(out[n:], ref[n:])  # decoding went on from the edit
    # the next pass fed the edited token: its latent, and its state moved by a times the edit
    a, _ = pipe.transformer.state_kernel
    root_e, root_r = edited_feeds[4][0, 0], fed[4][0, 0]  # prefill, then passes 0, 1, 2; pass 3's root
    assert torch.equal(root_e[1], edit)
    torch.testing.assert_close(root_e[0] - root_r[0], a * (edit - at["old"]), atol=1e-5, rtol=1e-5)


def test_editing_a_latent_the_target_has_read_is_refused():
    pipe = tiny_pipeline()

    def callback(p, step, timestep, kwargs):
        lat = kwargs["latents"].clone()
        lat[0, 0] += 1.0
        return {"latents": lat}

    with pytest.raises(ValueError, match="image 0's latent 0 is in the KV cache"):
        pipe(class_labels=0, generator=gen(0), callback_on_step_end=callback,
             callback_on_step_end_tensor_inputs=["latents"])
    with pytest.raises(ValueError, match="latents must be a finite float tensor of the shape it was given"):
        pipe(class_labels=0, generator=gen(0), callback_on_step_end=lambda *a: {"latents": torch.zeros(1, 1)},
             callback_on_step_end_tensor_inputs=["latents"])
    with pytest.raises(ValueError, match="callback_on_step_end must be a callable returning a dict"):
        pipe(class_labels=0, generator=gen(0), callback_on_step_end=lambda *a: {"latents": None})


# -- safetensors only ------------------------------------------------------------------------------

def test_a_folder_saved_without_safe_serialization_is_refused(tmp_path):
    pipe = tiny_pipeline()
    pipe.save_pretrained(tmp_path, safe_serialization=False)
    assert list(tmp_path.glob("transformer/*.bin"))
    with pytest.raises(FileNotFoundError, match=r"found diffusion_pytorch_model\.bin: only safetensors"):
        SpeculativeContinuousARPipeline.from_pretrained(tmp_path)
