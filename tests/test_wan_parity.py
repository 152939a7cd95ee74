"""Parity with the reference code: Wan streams replayed from fixtures recorded by Self-Forcing's and
LongLive's own inference loops (``scripts/wan_parity_fixtures.py``; the repositories' code is not
here, only what it computed): a tiny ``CausalWanModel``'s weights in Wan's original key layout, the
prompt embeddings, the initial noise, the re-noising draws, and every transformer call's input,
timesteps, start frame, flow prediction and x0, in float32.

Each case loads the weights through ``load_original_wan`` and streams through the public
``StreamingVideoPipeline`` (``from_wan(preset=...)``, ``latents=`` the same noise, the re-noising
drawn from a generator of the recorded seed); a forward hook on the pipeline's video model sees
every transformer call. Every flow prediction and every x0 (inputs, intermediate re-noised
latents, the committed outputs) must agree within 1e-5 relative to the predictions' scale (max
|v| 4.9 here, so 4.9e-5 absolute; measured at most 1.4e-5, 2.9e-6 of the scale); a window
one frame wider must not (the fixtures tell the settings apart). The prompt embeddings stand for
UMT5's output (the text encoder is not part of the parity).

The floor is diffusers' port, not the stream: the very first call (same input, empty cache) is
already 1.1e-5 apart, because diffusers' ``WanTransformer3DModel`` computes the sinusoidal time
embedding in float32 where Wan's ``sinusoidal_embedding_1d`` uses float64 (1.7e-5 apart at t =
1000: ``test_the_floor_is_the_float32_time_embedding``), and every later call stays at that
level."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from mmspec.adapters.video_wan import load_original_wan
from mmspec.bench.wan_tiny import VAE, text_parts
from mmspec.pipelines import StreamingVideoPipeline
from mmspec.pipelines.video import WAN_STREAM_PRESETS

FIXTURES = Path(__file__).parent / "fixtures" / "wan_parity"
RTOL = 1e-5  # of the largest |flow| of the case
# case -> (preset, overrides of the preset: the reference's sink_size / local_attn_size in our terms)
CASES = {
    "self_forcing": ("self-forcing", {}),
    "self_forcing_evict": ("self-forcing", dict(sink_frames=1, window_frames=2)),  # local_attn_size 6, sink 1
    "longlive": ("longlive", {}),
    "longlive_switch": ("longlive", {}),  # a switch at frame 15: the sink keeps its K/V
    "longlive_switch_early": ("longlive", {}),  # at frame 12: the re-cache covers the sink too
    "causvid": ("causvid", {}),  # 3 steps: the model told 757 and 522, stepping at 28/37 and 12/23
}


def load_case(name):
    path = FIXTURES / f"{name}.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    return load_file(str(path)), meta


def wan_pipe(meta, preset, **overrides):
    from diffusers import AutoencoderKLWan

    config = json.loads(meta["config"])
    transformer = load_original_wan(str(FIXTURES / "weights.safetensors"), config)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**VAE).eval()  # not used: the latents are compared
    encoder, tokenizer = text_parts(0, d_model=config["text_dim"])
    C, h, w = json.loads(meta["latent"])
    pipe = StreamingVideoPipeline.from_wan(transformer, vae, encoder, tokenizer, preset=preset, height=8 * h,
                                           width=8 * w, max_text_length=int(meta["text_len"]), **overrides)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def replay(name, **extra):
    """Stream the case through the pipeline: (fixture tensors, meta, our calls [(x, t, v)], output)."""
    fx, meta = load_case(name)
    preset, overrides = CASES[name]
    pipe = wan_pipe(meta, preset, **dict(overrides, **extra))
    embeds = {"p0": fx["prompt.0"], "p1": fx["prompt.1"]}
    pipe._encode = lambda texts: torch.cat([embeds[t] for t in texts])  # UMT5's rows, as recorded
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((args[0].clone(), torch.as_tensor(args[1], dtype=torch.float64), out.clone()))

    handle = pipe.video_model.register_forward_hook(hook, with_kwargs=True)
    try:
        switch = int(meta["switch_frame"])
        prompt = dict(prompt="p0") if switch < 0 else dict(prompts=[(0, "p0"), (pipe.video_frames(switch), "p1")])
        out = pipe(**prompt, latents=fx["noise"], generator=torch.Generator().manual_seed(int(meta["eps_seed"])),
                   output_type="latent", num_latent_frames=fx["noise"].shape[1]).frames
    finally:
        handle.remove()
    return fx, meta, calls, out


@pytest.mark.parametrize("name", list(CASES))
def test_every_flow_prediction_and_x0_match_the_reference_loop(name):
    fx, meta, calls, out = replay(name)
    n = int(meta["calls"])
    assert len(calls) == n  # 4 denoising steps and the clean pass per chunk, as the reference runs
    eps_gen = torch.Generator().manual_seed(int(meta["eps_seed"]))
    draws = sorted(int(k.split(".")[1]) for k in fx if k.startswith("eps."))
    for i in draws:  # the re-noising noise is the recorded one
        assert torch.equal(torch.randn(fx[f"eps.{i}"].shape, generator=eps_gen), fx[f"eps.{i}"])
    worst = dict(x=0.0, flow=0.0, x0=0.0, t=0.0)
    preset = WAN_STREAM_PRESETS[CASES[name][0]]  # the sigma each step's x0 uses, where not the time told
    stepped = {round(t, 6): s for t, s in zip(preset.get("model_times") or [], preset["sigmas"])}
    for i, (x, t, v) in enumerate(calls):
        ref_t = fx[f"t.{i}"]  # Wan timesteps, (B, F)
        # a LongLive re-cache runs its last local_attn_size frames, of which the first sink_size
        # (behind the kept sink) are written nowhere and seen by no one: ours runs the rest
        f = x.shape[1]
        assert f == ref_t.shape[1] or (float(ref_t.max()) == 0 and f < ref_t.shape[1]), (i, f, ref_t.shape)
        worst["t"] = max(worst["t"], float((1000 * t - ref_t[:, -f:]).abs().max()))
        worst["x"] = max(worst["x"], float((x - fx[f"x.{i}"][:, -f:]).abs().max()))
        worst["flow"] = max(worst["flow"], float((v - fx[f"flow.{i}"][:, -f:]).abs().max()))
        if float(t.max()) > 0:  # the clean pass's x0 is discarded (the reference's uses its table's last sigma)
            sigma = stepped.get(round(float(t.max()), 6), float(t.max()))
            worst["x0"] = max(worst["x0"], float((x - sigma * v - fx[f"x0.{i}"]).abs().max()))
    assert worst["t"] < 1e-3, worst  # Wan timesteps (0 .. 1000) fed to the same sinusoidal embedding
    tol = RTOL * scale(fx, n)
    assert max(worst["x"], worst["flow"], worst["x0"]) <= tol, (worst, tol)
    assert (out - fx["output"]).abs().max() <= tol
    assert float(fx["flow.0"].abs().mean()) > 0.1  # the fixture's predictions are not trivially zero


def scale(fx, n):
    return max(float(fx[f"flow.{i}"].abs().max()) for i in range(n))


def test_the_floor_is_the_float32_time_embedding():
    """diffusers' Wan time embedding (``get_timestep_embedding``, float32) against Wan's own
    ``sinusoidal_embedding_1d`` (float64, cos then sin), at Self-Forcing's timesteps."""
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([1000.0, 937.5, 833.3333, 625.0])
    ours = get_timestep_embedding(t, 32, flip_sin_to_cos=True, downscale_freq_shift=0).double()
    arg = torch.outer(t.double(), torch.pow(10000, -torch.arange(16).double().div(16)))
    wan = torch.cat([torch.cos(arg), torch.sin(arg)], dim=1)
    gap = float((ours - wan).abs().max())
    assert 5e-6 < gap < 5e-5  # measured 1.7e-5: the order of the first call's 1.1e-5


@pytest.mark.parametrize("name", ["self_forcing_evict", "longlive"])
def test_a_window_one_frame_wider_fails_the_fixtures(name):
    """The fixtures separate the settings: one more window frame changes what the chunks after the
    first eviction see, and their predictions leave the tolerance."""
    preset, overrides = CASES[name]
    window = overrides.get("window_frames", {"longlive": 6}.get(name))
    fx, meta, calls, out = replay(name, window_frames=window + 1)
    n = min(len(calls), int(meta["calls"]))
    worst = max(float((calls[i][2] - fx[f"flow.{i}"]).abs().max()) for i in range(n))
    assert worst > 100 * RTOL * scale(fx, n)


def test_merge_lora_is_peft_merge_and_unload():
    """LongLive's released weights are a base checkpoint plus a LoRA (``lora.pt``, peft's
    ``get_peft_model_state_dict`` names: ``base_model.model.blocks.0.q.lora_A.weight``, checked
    against peft itself when this was written); ``merge_lora`` folds it in as peft's merge does:
    the merged linear computes ``W x + b + scale * B (A x)``."""
    from mmspec.adapters.video_wan import merge_lora

    g = torch.Generator().manual_seed(0)
    W, b = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    A, B = torch.randn(2, 6, generator=g), torch.randn(8, 2, generator=g)
    base = {"model.blocks.0.self_attn.q.weight": W, "model.blocks.0.self_attn.q.bias": b,
            "model.head.head.weight": torch.ones(3, 3)}
    lora = {"base_model.model.blocks.0.self_attn.q.lora_A.weight": A,
            "base_model.model.blocks.0.self_attn.q.lora_B.weight": B}
    merged = merge_lora(base, lora, scale=0.5)
    x = torch.randn(5, 6, generator=g)
    want = x @ W.T + b + 0.5 * (x @ A.T) @ B.T
    got = x @ merged["model.blocks.0.self_attn.q.weight"].T + merged["model.blocks.0.self_attn.q.bias"]
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(base["model.blocks.0.self_attn.q.weight"], W)  # the inputs are left alone
    assert merged["model.head.head.weight"] is base["model.head.head.weight"]
    with pytest.raises(ValueError, match="lora_state_dict"):  # a LoRA for a module the base lacks
        merge_lora(base, {k.replace("self_attn.q", "self_attn.k"): v for k, v in lora.items()})
    with pytest.raises(ValueError, match="lora_state_dict"):  # half a pair
        merge_lora(base, {k: v for k, v in lora.items() if "lora_A" in k})


@pytest.mark.parametrize("name", ["longlive_switch", "longlive_switch_early"])
def test_the_prefill_recache_fails_longlives_switch(name):
    """LongLive's re-cache is its own rule (``recache_rule="longlive"``: its last 12 frames in one
    unmasked pass, the sink kept once the cache has rolled): this project's chunk-causal prefill of
    the kept frames leaves the fixture after the switch, and matches it before."""
    fx, meta, calls, out = replay(name, recache_rule="prefill")
    n, switch = int(meta["calls"]), int(meta["switch_frame"])
    tol = RTOL * scale(fx, n)
    before = [i for i in range(n) if int(fx[f"start.{i}"]) < switch and float(fx[f"t.{i}"].max()) > 0]
    assert max(float((calls[i][2] - fx[f"flow.{i}"]).abs().max()) for i in before) <= tol
    assert (out[:, switch:] - fx["output"][:, switch:]).abs().max() > 100 * tol


def test_causvids_table_sigmas_are_needed():
    """CausVid tells its model the timesteps 757 and 522 but converts to x0 and re-noises at its
    scheduler's table sigmas 28/37 and 12/23 (the causvid preset's ``model_times`` and
    ``sigmas``); stepping at 0.757 and 0.522 instead, as the preset did before, leaves the fixture's
    re-noised inputs by more than 10 times the tolerance (measured 2.5e-3, the tolerance 4.6e-5)."""
    fx, meta, calls, out = replay("causvid", sigmas=[1.0, 0.757, 0.522], model_times=None)
    n = int(meta["calls"])
    worst = max(float((calls[i][0] - fx[f"x.{i}"]).abs().max()) for i in range(n))
    assert worst > 10 * RTOL * scale(fx, n)
