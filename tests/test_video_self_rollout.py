"""Self-rollout training of the video DiT (issue 26): the context a training step reads is the
model's own stream through the inference code (``pipe.stream``: rolling cache, eviction, re-cache
at switches, CFG), anchored to the clip by the streaming image-to-image start (``video_latents``
and ``strength``); the loss is flow matching on the true next chunks given that context. Also the
start itself (``FlowSampler.denoise(init=, strength=)``) and the bad arguments."""

import pytest
import torch

from mmspec.adapters.video import FlowSampler
from mmspec.models.video_ae import FrameAutoencoder
from mmspec.models.video_dit import VideoDiTModel
from mmspec.pipelines.video import StreamingVideoPipeline
from mmspec.training.data.video import VideoPrompt
from mmspec.training.recipes.video import TwoStreamLoss, schedule_texts, self_rollout

pytestmark = pytest.mark.slow

# chunk 2, sink 2, window 4: a clip of 12 frames evicts frames inside the rollout
TINY_DIT = dict(dim=32, n_layers=1, n_heads=2, mlp_hidden=64, chunk_frames=2, sink_frames=2, window_frames=4,
                sample_steps=4, guidance_scale=2.0)
N = 12


def tiny_pipe(seed=0):
    torch.manual_seed(seed)
    model = VideoDiTModel(**TINY_DIT)
    # adaLN-Zero starts with zero output projections: perturb them so the tiny model's outputs
    # depend on its inputs (context, prompt, time) and differences can show
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    pipe = StreamingVideoPipeline(vae=FrameAutoencoder(), transformer=model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def batch(seed=1):
    """Two clips of 12 frames: the first switches its colour at frame 6, the second does not."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, N, 4, 8, 8, generator=g)
    prompt = torch.tensor([[[0, 1, 2]] * 6 + [[3, 1, 2]] * 6, [[1, 0, 3]] * N])
    return x0, prompt, torch.tensor([6, -1])


def spy_forward(model):
    """Record the inputs and output of every call of ``model.forward`` made with a plan (the
    training forward; the stream's calls go through a cache)."""
    calls = []
    original = model.forward

    def spy(latents, t, prompt, **kwargs):
        v = original(latents, t, prompt, **kwargs)
        if kwargs.get("plan") is not None:
            calls.append(dict(latents=latents, t=t, prompt=prompt, v=v, grad=torch.is_grad_enabled()))
        return v

    model.forward = spy
    return calls


def test_schedule_texts_has_an_entry_at_every_prompt_change():
    x0, prompt, _ = batch()
    assert schedule_texts(prompt) == [(0, ["a red square moving up", "a green circle moving down"]),
                                      (6, ["a yellow square moving up", "a green circle moving down"])]


def test_training_rollout_equals_pipe_stream_with_the_same_seed_and_knobs():
    """The context stream of a training step with ``rollout_prob=1`` is exactly what a user's
    ``pipe.stream`` gives with the step's window, strength and seed (recorded in
    ``last_rollout``) over the clips' own schedule: one stream code for training and inference.
    The rollout evicts (12 frames through a sink of 2 and a window of 4) and re-caches at the
    switch. A stream with another window or strength differs, so the comparison bites."""
    pipe = tiny_pipe()
    model = pipe.transformer
    x0, prompt, switch = batch()
    fn = TwoStreamLoss(model, N, [2, 4], torch.Generator().manual_seed(3), rollout_prob=1.0, pipe=pipe)
    calls = spy_forward(model)
    fn(model, (x0, prompt, switch))
    knobs = fn.last_rollout
    assert len(calls) == 1 and calls[0]["grad"]  # one training forward, the rollout ran without grad
    context = calls[0]["latents"][:, :N]
    assert (calls[0]["t"][:, :N] == 0).all()  # the rollout is labelled as committed frames

    schedule = [(0, ["a red square moving up", "a green circle moving down"]),
                (6, ["a yellow square moving up", "a green circle moving down"])]

    def user_stream(window, strength, seed):
        chunks = list(pipe.stream(prompts=schedule, num_frames=N, video_latents=x0, strength=strength,
                                  window_frames=window, generator=torch.Generator().manual_seed(seed),
                                  output_type="latent"))
        return torch.cat([c.latents for c in chunks], 1), chunks

    want, chunks = user_stream(knobs["window"], knobs["strength"], knobs["seed"])
    assert torch.equal(context, want)
    assert max(c.stats["cache_frames"] for c in chunks) == 2 + knobs["window"]  # rolled: frames were evicted
    assert [c.frame_indices.start for c in chunks if c.stats["switched"]] == [6]  # re-cached at the switch
    other_window = 2 if knobs["window"] == 4 else 4
    assert not torch.equal(context, user_stream(other_window, knobs["strength"], knobs["seed"])[0])
    assert not torch.equal(context, user_stream(knobs["window"], knobs["strength"] / 2, knobs["seed"])[0])
    assert not torch.equal(context, user_stream(knobs["window"], knobs["strength"], knobs["seed"] + 1)[0])


def test_rollout_loss_is_flow_matching_on_the_true_chunks_from_the_switch_on():
    """With a self-generated context the loss is still the velocity error of the query stream
    against the *clips'* latents (recomputed here from the forward's own inputs and output),
    over the first clip's frames from its switch on and all frames of the second; a loss that
    also counted the frames before the switch, or that took the rollout as the target, differs."""
    pipe = tiny_pipe()
    model = pipe.transformer
    model.register_to_config(prompt_dropout_prob=0.0)
    x0, prompt, switch = batch()
    fn = TwoStreamLoss(model, N, [4], torch.Generator().manual_seed(5), rollout_prob=1.0, pipe=pipe)
    calls = spy_forward(model)
    loss = fn(model, (x0, prompt, switch))["loss"]
    c = calls[0]
    t = c["t"][:, N:, None, None, None]
    noise = (c["latents"][:, N:] - (1 - t) * x0) / t
    err = (c["v"][:, N:] - (noise - x0)).pow(2).mean(dim=(2, 3, 4))  # (2, N)
    weight = torch.ones(2, N)
    weight[0, :6] = 0
    assert torch.isclose(loss, (err * weight).sum() / weight.sum(), rtol=1e-5)
    assert not torch.isclose(loss, err.mean(), rtol=1e-3)
    rollout = c["latents"][:, :N]
    wrong = (c["v"][:, N:] - (noise - rollout)).pow(2).mean(dim=(2, 3, 4))
    assert not torch.isclose(loss, (wrong * weight).sum() / weight.sum(), rtol=1e-3)
    assert loss.requires_grad


def test_rollout_prob_zero_never_rolls_out_and_draws_as_before():
    """``rollout_prob=0`` (the default) runs no stream and draws the same random numbers as the
    loss always did: a seeded step gives the same loss with and without a pipeline attached."""
    pipe = tiny_pipe()
    model = pipe.transformer
    x0, prompt, switch = batch()
    plain = TwoStreamLoss(model, N, [2, 4], torch.Generator().manual_seed(7))
    attached = TwoStreamLoss(model, N, [2, 4], torch.Generator().manual_seed(7), pipe=pipe)
    for _ in range(3):
        assert torch.equal(plain(model, (x0, prompt, switch))["loss"], attached(model, (x0, prompt, switch))["loss"])
        assert attached.last_rollout is None


def test_self_rollout_runs_the_stream_once_per_chunk():
    pipe = tiny_pipe()
    x0, prompt, _ = batch()
    passes = []
    original = pipe.transformer.forward
    pipe.transformer.forward = lambda *a, **k: passes.append(1) or original(*a, **k)
    out = self_rollout(pipe, x0, prompt, window_frames=4, strength=0.5, seed=0)
    assert out.shape == x0.shape
    # 6 chunks x (2 of 4 steps + the commit pass) + one re-cache pass at the switch
    assert len(passes) == 6 * 3 + 1


def _recording_velocity(calls):
    def velocity(x, t):
        calls.append((x.clone(), t))
        return 0.5 * x + t
    return velocity


def test_sampler_strength_starts_from_the_noised_init_as_diffusers_img2img():
    """``denoise(init=, strength=)``: diffusers' image-to-image start: ``first_step`` skips
    ``steps - int(steps * strength)`` steps (8 steps at 0.5: 4), the first velocity call sees
    ``(1 - sigma) init + sigma noise`` at that step's sigma, and only the remaining steps run.
    Strength 1 ignores ``init`` bit for bit."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(shift=3.0), 8)
    g = torch.Generator().manual_seed(0)
    noise, init = torch.randn(1, 2, 4, 8, 8, generator=g), torch.randn(1, 2, 4, 8, 8, generator=g)
    assert [sampler.first_step(s) for s in (1.0, 0.5, 0.3, 0.01)] == [0, 4, 5, 7]
    assert [sampler.steps_run(s) for s in (1.0, 0.5, 0.3, 0.01)] == [8, 4, 3, 1]
    sigmas = sampler.sigmas()
    calls = []
    sampler.denoise(_recording_velocity(calls), noise, init=init, strength=0.5)
    assert len(calls) == 4 and calls[0][1] == pytest.approx(float(sigmas[4]))
    s = sigmas[4]
    assert torch.allclose(calls[0][0], (1 - s) * init + s * noise, atol=1e-6)
    plain, with_init = [], []
    a = sampler.denoise(_recording_velocity(plain), noise)
    b = sampler.denoise(_recording_velocity(with_init), noise, init=init, strength=1.0)
    assert torch.equal(a, b) and len(plain) == 8
    # the "renoise" rule finds each step's sigma by value, from the skipped start too
    renoise = FlowSampler(FlowMatchEulerDiscreteScheduler(shift=3.0), 8, sampler="renoise")
    calls = []
    renoise.denoise(_recording_velocity(calls), noise, init=init, strength=0.5, generator=g)
    assert [t for _, t in calls] == pytest.approx([float(x) for x in sigmas[4:8]])
    with pytest.raises(ValueError, match="init must be clean latents of shape"):
        sampler.denoise(_recording_velocity([]), noise, strength=0.5)


def test_pipeline_strength_counts_its_passes_and_matches_the_recompute_baseline():
    """At strength 0.5 of 4 steps a chunk takes 2 steps and the commit pass (``nfe``), the
    rolling stream equals the window-recompute baseline (the same frames visible) within 1e-4,
    and ``num_frames`` defaults to the given latents' frames."""
    pipe = tiny_pipe()
    x0, prompt, _ = batch()
    texts = schedule_texts(prompt)[0][1]
    kw = dict(prompt=texts, video_latents=x0, strength=0.5, output_type="latent")
    rolled = pipe(generator=torch.Generator().manual_seed(0), num_frames=N, **kw)
    assert rolled.stats["nfe"] == 6 * 3 and rolled.frames.shape == x0.shape
    recomputed = pipe(generator=torch.Generator().manual_seed(0), num_frames=N, cache_mode="window-recompute", **kw)
    assert torch.allclose(rolled.frames, recomputed.frames, atol=1e-4)
    streamed = torch.cat([c.latents for c in pipe.stream(generator=torch.Generator().manual_seed(0), **kw)], 1)
    assert torch.equal(streamed, rolled.frames)


def test_first_step_is_diffusers_sd3_img2img_get_timesteps():
    """``first_step`` / ``steps_run`` and the timestep a chunk starts from are what diffusers'
    ``StableDiffusion3Img2ImgPipeline.get_timesteps`` gives for the same scheduler, steps and
    strength."""
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Img2ImgPipeline

    for steps in (1, 4, 8, 10):
        sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(shift=3.0), steps)
        sampler.sigmas()
        scheduler = sampler.scheduler
        for strength in (0.01, 0.25, 0.3, 0.5, 0.77, 1.0):
            timesteps, run = StableDiffusion3Img2ImgPipeline.get_timesteps(
                SimpleNamespace(scheduler=scheduler), steps, strength, "cpu")
            first = sampler.first_step(strength)
            assert sampler.steps_run(strength) == run == len(timesteps)
            assert torch.equal(scheduler.timesteps[first:], timesteps)
        scheduler._begin_index = None  # get_timesteps set it; FlowSampler never does


def test_strength_one_is_the_plain_stream_and_a_short_last_chunk_repeats_the_last_frame():
    """At strength 1 the given latents change nothing, bit for bit. With 11 frames of latents
    and ``num_frames`` 11 (chunks of 2), the last chunk starts from frame 10 repeated: the same
    stream as with a twelfth frame equal to the eleventh (and not as with the clip's own twelfth)."""
    pipe = tiny_pipe()
    x0, prompt, _ = batch()
    texts = schedule_texts(prompt)[0][1]
    run = lambda **kw: pipe(prompt=texts, generator=torch.Generator().manual_seed(0), output_type="latent",  # noqa: E731
                            **kw).frames
    assert torch.equal(run(num_frames=N), run(num_frames=N, video_latents=x0, strength=1.0))
    short = x0[:, :11]
    padded = torch.cat([short, short[:, -1:]], 1)
    got = run(num_frames=11, video_latents=short, strength=0.5)
    assert got.shape[1] == 11
    assert torch.equal(got, run(num_frames=11, video_latents=padded, strength=0.5))
    assert not torch.equal(got, run(num_frames=11, video_latents=x0, strength=0.5))


@pytest.mark.parametrize("kwargs, match", [
    (dict(strength=0.5), "strength must be 1 without video_latents"),
    (dict(strength=0.0, video_latents=torch.zeros(2, N, 4, 8, 8)), r"strength must be a number in \(0, 1\]"),
    (dict(strength=1.5, video_latents=torch.zeros(2, N, 4, 8, 8)), r"strength must be a number in \(0, 1\]"),
    (dict(video_latents=torch.zeros(1, N, 4, 8, 8)), "video_latents must be None or a"),
    (dict(video_latents=torch.zeros(2, N, 4, 4, 4)), "video_latents must be None or a"),
    (dict(video_latents=torch.zeros(2, 4, 4, 8, 8)), "at least num_frames frames"),
    (dict(video_latents=[[0.0]]), "video_latents must be None or a"),
])
def test_pipeline_refuses_bad_video_latents_and_strength(kwargs, match):
    pipe = tiny_pipe()
    with pytest.raises(ValueError, match=match):
        pipe.stream(prompt=["a red circle moving up"] * 2, num_frames=N, **kwargs)


def test_loss_refuses_bad_rollout_arguments():
    model = VideoDiTModel(**TINY_DIT)
    g = torch.Generator()
    for kwargs, match in [(dict(rollout_prob=1.5, pipe=object()), "rollout_prob must be a number in"),
                          (dict(rollout_prob=0.5), "pipe must be a StreamingVideoPipeline"),
                          (dict(rollout_strength=(0.0, 0.5)), "rollout_strength must be"),
                          (dict(rollout_strength=(0.8, 0.5)), "rollout_strength must be"),
                          (dict(noisy_context_prob=-0.1), "noisy_context_prob must be"),
                          (dict(autocast="fp16"), "autocast must be one of fp32, bf16")]:
        with pytest.raises(ValueError, match=match):
            TwoStreamLoss(model, N, [4], g, **kwargs)


def test_cli_takes_and_refuses_the_rollout_options(tmp_path):
    from mmspec import commands

    base = ["train", "video", "--ae", str(tmp_path), "--out", str(tmp_path / "v")]
    args = commands.build_parser().parse_args(base)
    assert (args.rollout_prob, args.rollout_strength, args.autocast) == (0.3, [0.3, 0.8], "bf16")
    assert commands.build_parser().parse_args(base + ["--autocast", "fp32"]).autocast == "fp32"
    with pytest.raises(commands.UsageError, match="argument --autocast: invalid choice"):
        commands.build_parser().parse_args(base + ["--autocast", "fp16"])
    args = commands.build_parser().parse_args(base + ["--rollout-prob", "0", "--rollout-strength", "0.5", "1"])
    assert (args.rollout_prob, args.rollout_strength) == (0.0, [0.5, 1.0])
    for bad in (["--rollout-prob", "1.5"], ["--rollout-strength", "0", "0.5"]):
        with pytest.raises(commands.UsageError, match=f"argument {bad[0]}: must be a number in"):
            commands.build_parser().parse_args(base + bad)


def test_prompt_ids_round_trip_through_the_texts():
    """The rollout's texts parse back to the clips' ids (the stream re-reads them)."""
    model = VideoDiTModel(**TINY_DIT)
    ids = torch.tensor([[VideoPrompt.from_index(i).ids] for i in range(64)])  # (64, 1, 3)
    texts = schedule_texts(ids)[0][1]
    assert torch.equal(model.encode_prompts(texts), ids[:, 0])


def test_bf16_autocast_runs_the_loss_in_bfloat16_and_the_rollout_in_float32():
    """``autocast="bf16"``: the loss's training forward runs its matmuls in bfloat16 (the
    velocity the spy sees is bfloat16), its value is within 2% of the float32 loss of the same
    seeded step (same draws: the generator is not touched by the precision), the loss and the
    gradients are float32, and the self-rollout is the inference code in float32: the context it
    hands the two-stream pass equals the float32 step's bit for bit."""
    pipe = tiny_pipe()
    model = pipe.transformer
    x0, prompt, switch = batch()
    out = {}
    for precision in ("fp32", "bf16"):
        fn = TwoStreamLoss(model, N, [4], torch.Generator().manual_seed(5), rollout_prob=1.0, pipe=pipe,
                           autocast=precision)
        calls = spy_forward(model)
        loss = fn(model, (x0, prompt, switch))["loss"]
        model.zero_grad()
        loss.backward()
        model.forward = type(model).forward.__get__(model)
        out[precision] = dict(loss=loss, v=calls[0]["v"], context=calls[0]["latents"][:, :N],
                              grad=next(model.parameters()).grad)
    assert out["fp32"]["v"].dtype == torch.float32 and out["bf16"]["v"].dtype == torch.bfloat16
    assert out["bf16"]["loss"].dtype == torch.float32 and out["bf16"]["grad"].dtype == torch.float32
    assert torch.equal(out["fp32"]["context"], out["bf16"]["context"])
    assert torch.isclose(out["bf16"]["loss"], out["fp32"]["loss"], rtol=0.02)
    assert not torch.equal(out["bf16"]["loss"], out["fp32"]["loss"])


def test_first_chunk_steps_train_each_chunk_as_a_streams_first_chunk():
    """``first_chunk_prob=1``: one forward, without plan or cache, over the clips cut into their 6
    chunks (12 rows of 2 frames) under each chunk's own prompt (the switched clip's chunks after
    frame 6 carry the new colour, those before it the old one); its velocity for a chunk is what
    the pipeline's first chunk computes through the rolling cache (within 1e-5), and the loss is
    the mean flow-matching error recomputed from the forward's inputs and output."""
    pipe = tiny_pipe()
    model = pipe.transformer
    model.register_to_config(prompt_dropout_prob=0.0)
    x0, prompt, switch = batch()
    fn = TwoStreamLoss(model, N, [4], torch.Generator().manual_seed(5), first_chunk_prob=1.0)
    calls = []
    original = model.forward

    def spy(latents, t, prompt, **kwargs):
        v = original(latents, t, prompt, **kwargs)
        calls.append(dict(latents=latents, t=t, prompt=prompt, v=v, kwargs=kwargs))
        return v

    model.forward = spy
    loss = fn(model, (x0, prompt, switch))["loss"]
    assert fn.last_first_chunks and len(calls) == 1 and calls[0]["kwargs"] == {}
    c = calls[0]
    C = model.config.chunk_frames
    assert c["latents"].shape == (2 * N // C, C, 4, 8, 8)
    assert torch.equal(c["prompt"], prompt.reshape(2 * N // C, C, 3))
    assert c["prompt"][2, 0, 0] == 0 and c["prompt"][3, 0, 0] == 3  # chunks 2 and 3 of the switched clip
    t = c["t"][..., None, None, None]
    chunks = x0.reshape(2 * N // C, C, 4, 8, 8)
    noise = (c["latents"] - (1 - t) * chunks) / t
    assert torch.isclose(loss, (c["v"] - (noise - chunks)).pow(2).mean(), rtol=1e-5)
    assert loss.requires_grad
    # the velocity a stream's first chunk gets: an empty rolling cache, the chunk appended to it
    model.forward = original
    with torch.no_grad():
        for row in (0, 3, 11):
            cache = model.new_cache(1)
            v = model(c["latents"][row:row + 1], c["t"][row:row + 1], c["prompt"][row:row + 1], cache=cache)
            assert (v - c["v"][row:row + 1]).abs().max() < 1e-5
        # a chunk placed later in the stream (after one committed chunk) is not what was trained
        cache = model.new_cache(1)
        model(chunks[:1], 0.0, c["prompt"][:1], cache=cache)
        later = model(c["latents"][1:2], c["t"][1:2], c["prompt"][1:2], cache=cache)
        assert (later - c["v"][1:2]).abs().max() > 1e-3


def test_first_chunk_prob_mixes_the_two_kinds_of_step():
    """At ``first_chunk_prob`` 0 (the default) no step is a first-chunk step; at 0.5 over 40 steps
    (seed 9) both kinds occur (the chance that either kind never occurs is 2 x 0.5^40)."""
    pipe = tiny_pipe()
    model = pipe.transformer
    x0, prompt, switch = batch()
    for prob, want in ((0.0, {False}), (0.5, {True, False})):
        fn = TwoStreamLoss(model, N, [2, 4], torch.Generator().manual_seed(9), first_chunk_prob=prob)
        kinds = set()
        with torch.no_grad():
            for _ in range(40):
                fn(model, (x0, prompt, switch))
                kinds.add(fn.last_first_chunks)
        assert kinds == want


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.3", None])
def test_first_chunk_prob_must_be_a_probability(bad):
    model = tiny_pipe().transformer
    with pytest.raises(ValueError, match="first_chunk_prob must be a number in \\[0, 1\\]"):
        TwoStreamLoss(model, N, [4], torch.Generator(), first_chunk_prob=bad)
