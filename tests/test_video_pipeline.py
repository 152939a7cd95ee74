"""StreamingVideoPipeline: the diffusers contract, the stream() contract, the cache modes and the
prompt-switch re-cache, on tiny random components built here (no assets, no network).

The transformer: ``VideoDiTModel`` at width 32 with chunks of 2 latent frames, sink 2 + window 4
(a chunk sees at most 8 frames), 4x4 tokens per frame; its weights perturbed so adaLN-Zero's zero
gates do not make every block the identity. Its RoPE tells 198 frame positions apart
(``rope_frames``); a ``rope_theta=10`` copy only 35, for a fast full-cache limit. The autoencoder:
a narrow ``FrameAutoencoder`` (32x32 frames, 4x8x8 latents).

Tolerances: float32; the cached and the recompute paths attend through different kernels (a
boolean mask over the cache's slots vs gathered groups with an additive mask), so they agree to
rounding (observed <= 5e-7 on latents of magnitude ~5), not bit for bit; 1e-5 is the bound used.
"""

import itertools
import json

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec.models.video_ae import FrameAutoencoder
from mmspec.adapters.video import FlowSampler, sample_chunk
from mmspec.pipelines.base import PipelineBase
from mmspec.models.video_dit import VideoDiTModel
from mmspec.pipelines import CacheLimitError, StreamingVideoPipeline, StreamingVideoPipelineOutput, VideoChunk

RED, BLUE = "a red circle moving right", "a blue square moving up"
TINY = dict(dim=32, n_heads=2, mlp_hidden=64, chunk_frames=2, sink_frames=2, window_frames=4)
ATOL = 1e-5


def make_pipe(n_layers=2, seed=0, **overrides):
    torch.manual_seed(seed)
    vae = FrameAutoencoder(channels=(8, 16), stem_channels=8).eval()
    model = VideoDiTModel(**{**TINY, "n_layers": n_layers, **overrides}).eval()
    with torch.no_grad():  # leave adaLN-Zero's zeros: otherwise every block is the identity
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    pipe = StreamingVideoPipeline(vae=vae, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return make_pipe()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_round_trip_through_a_local_folder_is_bit_identical(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "StreamingVideoPipeline"
    assert index["vae"] == ["mmspec.models.video_ae", "FrameAutoencoder"]
    assert index["transformer"] == ["mmspec.models.video_dit", "VideoDiTModel"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    loaded = StreamingVideoPipeline.from_pretrained(tmp_path)
    assert isinstance(loaded, PipelineBase) and loaded.scheduler.config.shift == pipe.transformer.config.time_shift
    loaded.set_progress_bar_config(disable=True)
    assert next(loaded.transformer.parameters()).dtype == torch.float32
    a = pipe(prompts=[(0, RED), (4, BLUE)], num_frames=8, generator=gen(1), output_type="pt").frames
    b = loaded(prompts=[(0, RED), (4, BLUE)], num_frames=8, generator=gen(1), output_type="pt").frames
    assert torch.equal(a, b)


def test_stream_yields_what_call_returns(pipe):
    """7 frames in chunks of 2: indices 0-1, 2-3, 4-5, 6 (the last chunk cut); the chunks'
    frames concatenated are ``__call__``'s frames bit for bit; each chunk carries its latents,
    prompts and stats."""
    chunks = list(pipe.stream(prompt=RED, num_frames=7, generator=gen(2)))
    assert all(isinstance(c, VideoChunk) for c in chunks)
    assert [c.frame_indices for c in chunks] == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert [tuple(c.frames.shape) for c in chunks] == [(1, 2, 3, 32, 32)] * 3 + [(1, 1, 3, 32, 32)]
    assert [tuple(c.latents.shape) for c in chunks] == [(1, 2, 4, 8, 8)] * 3 + [(1, 1, 4, 8, 8)]
    assert all(c.prompts == [RED] for c in chunks)
    assert all(set(c.stats) == {"latency_s", "cache_frames", "cache_bytes", "switched", "nfe"} for c in chunks)
    assert [c.stats["cache_frames"] for c in chunks] == [2, 4, 6, 6]  # sink 2 + window 4 after the roll
    assert all(c.stats["latency_s"] > 0 and c.stats["nfe"] == 5 and not c.stats["switched"] for c in chunks)
    out = pipe(RED, num_frames=7, generator=gen(2), output_type="pt")
    assert isinstance(out, StreamingVideoPipelineOutput)
    assert torch.equal(out.frames, torch.cat([c.frames for c in chunks], 1))
    s = out.stats
    assert (s["frames"], s["chunks"], s["nfe"], s["switch_frames"]) == (7, 4, 20, [])
    assert (s["cache_mode"], s["sink_frames"], s["window_frames"], s["num_inference_steps"]) == ("rolling", 2, 4, 4)


def test_unbounded_stream_runs_until_you_stop(pipe):
    chunks = list(itertools.islice(pipe.stream(prompt=RED, num_frames=None, output_type="latent"), 5))
    assert [c.frame_indices.start for c in chunks] == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("n_layers", [1, 2])
def test_rolling_and_window_recompute_agree(n_layers):
    """20 chunks, a prompt switch at frame 20. One layer: the two modes agree on every frame
    within 1e-5 (a cached frame's K/V depend on that frame alone). Two layers: they agree until
    the first eviction (frames 0-7) and right after the re-cache (frames 20-21, within 1e-4: the
    cache is then a fresh prefill, only the latents carry earlier differences); between, the
    rolling cache's layer-2 K/V still carry evicted frames, so they differ (here by more than
    1e-4) yet stay close (less than 1e-2)."""
    pipe = make_pipe(n_layers)
    kw = dict(prompts=[(0, RED), (20, BLUE)], num_frames=40, output_type="latent")
    rolling = pipe(cache_mode="rolling", generator=gen(0), **kw)
    recompute = pipe(cache_mode="window-recompute", generator=gen(0), **kw)
    gap = (rolling.frames - recompute.frames).abs().amax(dim=(0, 2, 3, 4))  # per frame
    assert rolling.stats["switch_frames"] == recompute.stats["switch_frames"] == [20]
    if n_layers == 1:
        assert gap.max() < ATOL
    else:
        assert gap[:8].max() < ATOL
        assert gap[20:22].max() < 1e-4
        assert 1e-4 < gap[8:20].max() < 1e-2
    assert recompute.stats["nfe"] == 20 * 4 and rolling.stats["nfe"] == 20 * 5 + 1  # + the re-cache pass


def test_a_long_stream_keeps_positions_and_memory_bounded(pipe):
    """300 chunks (600 frames: 33 times the training clips, three times the 198 positions the
    RoPE tells apart): every rotation the transformer applies is at a frame position below sink +
    window + chunk = 8, the last ones reach it (it rolled), and cache_bytes never changes."""
    rope = pipe.transformer.rope
    seen = []
    original = rope.tables

    def record(positions):
        seen.append(int(positions.max()) // pipe.transformer.tokens_per_frame)
        return original(positions)

    rope.tables = record
    try:
        chunks = list(pipe.stream(prompt=RED, num_frames=600, num_inference_steps=1, output_type="latent"))
    finally:
        del rope.tables
    assert len(chunks) == 300 and chunks[-1].frame_indices == range(598, 600)
    assert max(seen) == 7 and seen[-1] == 7 and pipe.transformer.rope_frames == 198
    assert {c.stats["cache_bytes"] for c in chunks} == {chunks[0].stats["cache_bytes"]}
    assert {c.stats["cache_frames"] for c in chunks[3:]} == {6}
    assert all(torch.isfinite(c.latents).all() for c in chunks)


@pytest.mark.parametrize("recache_sink", [True, False])
def test_prompt_switch_recache_equals_a_fresh_prefill(recache_sink):
    """A switch to BLUE at frame 12 (the cache rolled): the chunk after it equals that chunk
    sampled, with the same noise, on a fresh cache prefilled with the same visible frames (sink
    0-1, window 8-11) under the new prompt (the sink under the old one when ``recache_sink`` is
    False), within 1e-5, through 2 layers. Without the re-cache (the window left under RED) the
    chunk differs by more than 1e-3."""
    pipe = make_pipe(2)
    model = pipe.transformer
    chunks = list(pipe.stream(prompts=[(0, RED), (12, BLUE)], num_frames=14, generator=gen(3),
                              recache_sink=recache_sink, output_type="latent"))
    assert [c.stats["switched"] for c in chunks] == [False] * 6 + [True]
    assert chunks[-1].prompts == [BLUE] and chunks[-1].stats["nfe"] == 6
    z = torch.cat([c.latents for c in chunks[:-1]], 1)  # (1, 12, C, h, w)
    visible = torch.cat([z[:, :2], z[:, 8:12]], 1)
    red, blue = model.encode_prompts(RED), model.encode_prompts(BLUE)
    null = torch.tensor([model.null_prompt])
    g = gen(3)
    for _ in range(6):
        torch.randn(1, 2, 4, 8, 8, generator=g)
    noise = torch.randn(1, 2, 4, 8, 8, generator=g)
    steps = FlowSampler(pipe.scheduler, model.config.sample_steps)

    def after_prefill(sink_prompt, window_prompt):
        cache = model.new_cache(2)  # [cond; uncond] rows
        ids = torch.stack([torch.cat([sink_prompt.expand(2, 3), window_prompt.expand(4, 3)]),
                           null.expand(6, 3)])  # (2, 6, 3)
        with torch.no_grad():
            model(torch.cat([visible, visible]), 0.0, ids, cache=cache)  # one chunk-causal block
        cache.truncate(cache.lengths)
        return sample_chunk(model, cache, noise, blue, steps, model.config.guidance_scale, null)

    fresh = after_prefill(blue if recache_sink else red, blue)
    assert (chunks[-1].latents - fresh).abs().max() < ATOL
    stale = after_prefill(red, red)
    assert (chunks[-1].latents - stale).abs().max() > 1e-3


def test_full_cache_grows_then_stops_with_a_clear_error():
    """rope_theta=10: the RoPE tells 35 frame positions apart, so full-cache stops at 32 frames
    (16 chunks); ``num_frames=34`` is refused up front, an unbounded stream yields the 16 chunks
    then raises ``CacheLimitError``. Its storage grows with the stream, and its frames equal
    those of a rolling cache whose window never fills (nothing evicted either way)."""
    pipe = make_pipe(2, rope_theta=10.0)
    assert pipe.transformer.rope_frames == 35 and pipe.max_frames("full-cache") == 32
    assert pipe.max_frames("rolling") is None
    with pytest.raises(ValueError, match="num_frames must be None or at most 32 with cache_mode='full-cache'"):
        pipe.stream(prompt=RED, num_frames=34, cache_mode="full-cache")
    chunks = []
    with pytest.raises(CacheLimitError, match="stops at 32 frames") as err:
        for chunk in pipe.stream(prompt=RED, generator=gen(4), cache_mode="full-cache", output_type="latent"):
            chunks.append(chunk)
    assert err.value.frames == 32 and len(chunks) == 16
    assert [c.stats["cache_frames"] for c in chunks] == list(range(2, 34, 2))
    sizes = [c.stats["cache_bytes"] for c in chunks]
    assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[0]
    full = torch.cat([c.latents for c in chunks], 1)
    wide = pipe(RED, num_frames=32, generator=gen(4), sink_frames=0, window_frames=30, output_type="latent").frames
    assert (full - wide).abs().max() < ATOL


def test_no_sink_is_the_window_alone(pipe):
    chunks = list(pipe.stream(prompt=RED, num_frames=12, cache_mode="no-sink", output_type="latent", generator=gen()))
    assert [c.stats["cache_frames"] for c in chunks] == [2, 4, 4, 4, 4, 4]
    rolling = pipe(RED, num_frames=12, output_type="latent", generator=gen()).frames
    no_sink = torch.cat([c.latents for c in chunks], 1)
    assert torch.equal(no_sink[:, :6], rolling[:, :6]) and (no_sink[:, 6:] - rolling[:, 6:]).abs().max() > 1e-4


@pytest.mark.parametrize("cache_mode", ["rolling", "window-recompute"])
def test_generator_lists_row_r_equals_row_r_alone(pipe, cache_mode):
    prompts = [RED, "a yellow star moving down", BLUE]
    batch = pipe(prompts, num_frames=10, generator=[gen(s) for s in (5, 6, 7)], cache_mode=cache_mode,
                 output_type="latent").frames
    for r, (p, s) in enumerate(zip(prompts, (5, 6, 7))):
        alone = pipe(p, num_frames=10, generator=gen(s), cache_mode=cache_mode, output_type="latent").frames
        # equal to float rounding: the CPU's matrix kernels may block a batch of 3 differently than
        # one row (this machine's AVX-512 / AMX kernels differ by up to 5e-7)
        assert (batch[r] - alone[0]).abs().max() < 1e-5
    assert (batch[0] - batch[2]).abs().max() > 1e-2


def test_output_types_and_tuple(pipe):
    kw = dict(prompt=[RED, BLUE], num_frames=5)
    pt = pipe(output_type="pt", generator=gen(), **kw).frames
    assert pt.shape == (2, 5, 3, 32, 32) and pt.dtype == torch.float32 and 0 <= pt.min() and pt.max() <= 1
    arr = pipe(output_type="np", generator=gen(), **kw).frames
    assert isinstance(arr, np.ndarray) and arr.shape == (2, 5, 32, 32, 3)
    assert np.allclose(arr, pt.permute(0, 1, 3, 4, 2).numpy())
    pil = pipe(generator=gen(), **kw).frames  # "pil" by default
    assert len(pil) == 2 and all(len(v) == 5 and all(isinstance(f, PIL.Image.Image) and f.size == (32, 32) for f in v)
                                 for v in pil)
    assert np.array_equal(np.asarray(pil[1][4]), (arr[1, 4] * 255).round().astype(np.uint8))
    latents = pipe(output_type="latent", generator=gen(), **kw).frames
    assert latents.shape == (2, 5, 4, 8, 8)
    assert torch.allclose(pipe.vae.decode(latents[0]).clamp(-1, 1) / 2 + 0.5, pt[0], atol=1e-6)
    tup = pipe(output_type="pt", return_dict=False, generator=gen(), **kw)
    assert isinstance(tup, tuple) and len(tup) == 1 and torch.equal(tup[0], pt)


def test_callback_sees_every_step_and_can_replace_latents(pipe):
    """Called after every denoising step, steps counted over the stream from 0, with the flow
    time the step started from and the chunk's latents; latents it returns replace them (zeros
    at each chunk's last step give zero latents); ``pipe._interrupt`` ends the stream after the
    chunk."""
    calls = []

    def zero_last(p, step, t, kw):
        calls.append((step, t, tuple(kw["latents"].shape)))
        return {"latents": torch.zeros_like(kw["latents"])} if step % 4 == 3 else {}

    out = pipe(RED, num_frames=6, output_type="latent", callback_on_step_end=zero_last)
    assert [c[0] for c in calls] == list(range(12))
    assert [c[1] for c in calls] == [1.0, 0.75, 0.5, 0.25] * 3
    assert all(c[2] == (1, 2, 4, 8, 8) for c in calls)
    assert torch.equal(out.frames, torch.zeros(1, 6, 4, 8, 8))

    def stop(p, step, t, kw):
        if step == 5:  # the second chunk's second step
            p._interrupt = True
        return {}

    chunks = list(pipe.stream(prompt=RED, num_frames=20, callback_on_step_end=stop, output_type="latent"))
    assert [c.frame_indices for c in chunks] == [range(0, 2), range(2, 4)]
    assert len(list(pipe.stream(prompt=RED, num_frames=4, output_type="latent"))) == 2  # reset per stream
    with pytest.raises(ValueError, match="callback_on_step_end must be a callable returning a dict"):
        pipe(RED, num_frames=2, callback_on_step_end=lambda *a: None)


def test_progress_bar_counts_chunks(capsys):
    pipe = make_pipe(1)
    pipe.set_progress_bar_config(disable=False)
    pipe(RED, num_frames=8, output_type="latent")
    assert "4/4" in capsys.readouterr().err
    pipe.set_progress_bar_config(disable=True)
    pipe(RED, num_frames=8, output_type="latent")
    assert capsys.readouterr().err == ""


BAD = [
    (dict(prompt=""), "prompt must be a non-empty string"),
    (dict(prompt=[]), "prompt must be a non-empty string"),
    (dict(prompt=[RED, "  "]), r"prompt\[1\] must be a non-empty string"),
    (dict(prompt="a purple hexagon moving right"), "prompt must be text naming exactly one colour of red, green"),
    (dict(prompt="a red circle"), "prompt must be text naming exactly one direction of right, left, up, down"),
    (dict(prompt=None), "prompt must be exactly one of prompt and prompts"),
    (dict(prompt=RED, prompts=[(0, BLUE)]), "prompt must be exactly one of prompt and prompts"),
    (dict(prompt=None, prompts=[(0, RED), (6, BLUE), (4, RED)]), "prompts must be sorted by start frame"),
    (dict(prompt=None, prompts=[(2, RED)]), "prompts must be sorted by start frame: strictly increasing from 0"),
    (dict(prompt=None, prompts=[(0, RED), (12, BLUE)]), "below num_frames"),
    (dict(prompt=None, prompts=[(0, RED), (3, BLUE)]), r"prompts\[1\] start frame must be a multiple of "
                                                       r"chunk_frames \(2\).*e.g. 2 or 4"),
    (dict(prompt=None, prompts=[(0, [RED, BLUE]), (4, RED)]), r"prompts\[1\] text must be 2 prompts"),
    (dict(prompt=None, prompts=[(0, RED), (4, "")]), r"prompts\[1\] text must be a non-empty string"),
    (dict(prompt=None, prompts=[]), "prompts must be a non-empty list"),
    (dict(num_frames=0), "num_frames must be (None or )?an int >= 1"),
    (dict(num_frames=-4), "num_frames must be (None or )?an int >= 1"),
    (dict(num_frames=2.5), "num_frames must be (None or )?an int >= 1"),
    (dict(window_frames=200), "sink_frames \\+ window_frames must be at most 196 frames"),
    (dict(window_frames=3), "window_frames must be None or a positive multiple of chunk_frames"),
    (dict(window_frames=-1), r"window_frames must be None or a positive multiple of chunk_frames \(2\) \(every "
                             r"frame so far, -1, is Wan's; here cache_mode='full-cache'\), got -1"),
    (dict(sink_frames=-2), "sink_frames must be None or a multiple of chunk_frames"),
    (dict(cache_mode="sliding"), "cache_mode must be one of 'rolling', 'window-recompute', 'full-cache', 'no-sink'"),
    (dict(cache_mode="no-sink", sink_frames=2), "sink_frames must be None or 0 with cache_mode='no-sink'"),
    (dict(cache_mode="full-cache", window_frames=4), "window_frames must be None with cache_mode='full-cache'"),
    (dict(cache_mode="full-cache", num_frames=500), "num_frames must be None or at most 196"),
    (dict(output_type="jpeg"), "output_type must be one of 'pil', 'np', 'pt', 'latent'"),
    (dict(generator=0), "generator must be a torch.Generator or None"),
    (dict(generator=[torch.Generator()] * 2), "generator must be a torch.Generator, None, or a list of 1"),
    (dict(num_inference_steps=0), "num_inference_steps must be None or an int >= 1"),
    (dict(guidance_scale=-1.0), "guidance_scale must be None or a number >= 0"),
    (dict(recache_sink="yes"), "recache_sink must be None, True or False"),
    (dict(callback_on_step_end="print"), "callback_on_step_end must be None or a callable"),
    (dict(callback_on_step_end_tensor_inputs=["noise"]), "callback_on_step_end_tensor_inputs must be"),
]


@pytest.mark.parametrize("kwargs, match", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_fails_before_any_work(pipe, kwargs, match):
    """``__call__`` and ``stream`` (at the call, before iterating) raise a ValueError naming the
    argument; no model ran."""
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in (pipe.transformer, pipe.vae)]
    kwargs = {"prompt": RED, "num_frames": 8, **kwargs}
    try:
        with pytest.raises(ValueError, match=match):
            pipe(**kwargs)
        with pytest.raises(ValueError, match=match):
            pipe.stream(**kwargs)
    finally:
        for h in hooks:
            h.remove()
    assert calls == []
    with pytest.raises(ValueError, match="return_dict must be True or False"):
        pipe(RED, num_frames=2, return_dict=1)


def test_bundled_assets_are_fp16_within_budget_and_stream():
    """assets/video: fp16 safetensors in the diffusers layout, at most 30 MB, trained by the
    recipes (train_log.json) with the recipes' defaults (steps, self-rollouts, first-chunk steps,
    the conv head), components that fit each other; it streams offline, and its RoPE range puts
    the full-cache limit at 288 frames (the module docstring's figure); it samples with 8 Euler
    steps at CFG 3.5 by default."""
    from pathlib import Path

    from safetensors import safe_open

    root = Path(__file__).resolve().parents[1] / "assets" / "video"
    files = sorted(root.glob("*/diffusion_pytorch_model.safetensors"))
    assert [f.parent.name for f in files] == ["transformer", "vae"]
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) <= 30 * 2**20
    for f in files:
        with safe_open(f, "pt") as st:
            assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.float16}
        log = json.loads((f.parent / "train_log.json").read_text())
        assert log["recipe"] in ("video", "video-ae") and log["seed"] == 0
    from mmspec.commands.train import TRAIN_DEFAULTS, VIDEO_ROLLOUT
    from mmspec.training.recipes.video import DEFAULT_VIDEO_CONFIG

    log = json.loads((root / "transformer" / "train_log.json").read_text())
    assert log["steps"] == TRAIN_DEFAULTS["video"]["steps"]
    assert {k: log["train"][k] for k in VIDEO_ROLLOUT} == VIDEO_ROLLOUT
    assert {k: log["config"][k] for k in DEFAULT_VIDEO_CONFIG} == DEFAULT_VIDEO_CONFIG
    bundled = StreamingVideoPipeline.from_pretrained(root)
    bundled.set_progress_bar_config(disable=True)
    model, vae = bundled.transformer, bundled.vae
    assert (model.config.latent_channels, model.config.latent_size) == (vae.config.latent_channels, vae.latent_size)
    assert model.rope_frames == 291 and bundled.max_frames("full-cache") == 288
    # the sampling defaults the README, the registry's knob docs and the recipe name
    assert (model.config.sample_steps, model.config.guidance_scale) == (8, 3.5)
    out = bundled(RED, num_frames=6, generator=gen(), output_type="pt")
    assert out.frames.shape == (1, 6, 3, 32, 32) and out.stats["cache_frames"] == 6


def test_concurrent_streams_of_one_pipeline_do_not_disturb_each_other(pipe):
    """Two streams of one pipeline in two threads at once (the demo serves requests so) give what
    each gives alone: each samples with its own copy of the scheduler, whose step index is state
    (a shared one was stepped past its end: IndexError)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(prompt, seed):
        return torch.cat([c.latents for c in pipe.stream(prompt=prompt, num_frames=40, generator=gen(seed),
                                                          output_type="latent")], 1)

    alone = [run(RED, 1), run(BLUE, 2)]
    with ThreadPoolExecutor(2) as pool:
        got = [f.result() for f in [pool.submit(run, RED, 1), pool.submit(run, BLUE, 2)]]
    assert all(torch.equal(g, w) for g, w in zip(got, alone))


def test_bundled_model_samples_as_the_former_euler_loop_bit_for_bit():
    """The README's claim: on the bundled weights the scheduler's Euler steps give the former
    hand-written loop's latents bit for bit (``x + (t_next - t) v`` in Python floats over the shifted
    uniform times, guided, then the clean pass and the commit), 4 chunks through a rolling cache."""
    from pathlib import Path

    pipe = StreamingVideoPipeline.from_pretrained(Path(__file__).resolve().parents[1] / "assets" / "video")
    model, cfg = pipe.transformer, pipe.transformer.config
    prompt = model.encode_prompts(["a red circle moving right"])
    null = model.encode_prompts([None])
    rows = torch.cat([prompt, null])
    u = torch.linspace(1.0, 0.0, cfg.sample_steps + 1)
    times = (cfg.time_shift * u / (1 + (cfg.time_shift - 1) * u)).tolist()
    sampler = FlowSampler(pipe.scheduler, cfg.sample_steps)
    old, new = model.new_cache(2), model.new_cache(2)
    g = gen(7)
    with torch.no_grad():
        for _ in range(4):
            noise = torch.randn(1, cfg.chunk_frames, cfg.latent_channels, cfg.latent_size, cfg.latent_size,
                                generator=g)
            old.begin_chunk()
            x = noise
            for t, t_next in zip(times[:-1], times[1:]):
                v_c, v_u = model(torch.cat([x, x]), t, rows, cache=old).chunk(2)
                x = x + (t_next - t) * (v_u + cfg.guidance_scale * (v_c - v_u))
            model(torch.cat([x, x]), 0.0, rows, cache=old)
            old.commit(torch.cat([x, x]))
            got = sample_chunk(model, new, noise, prompt, sampler, cfg.guidance_scale, null)
            assert torch.equal(got, x)
