"""``StreamingVideoPipeline`` over diffusers' Wan classes (``from_wan``), with tiny random parts built
in code (``mmspec.bench.wan_tiny``; nothing downloaded): the pipeline's stream is the adapter's
loop, its frames are the whole clip decoded at once, it round-trips through a folder, offload keeps
its outputs, a prompt switch re-caches, the cache stays flat, and bad input is refused before any
forward."""

import json

import pytest
import torch
from diffusers import WanTransformer3DModel

from mmspec.adapters.video import CachedStream, FlowSampler
from mmspec.adapters.video_wan import WanStreamingDecoder, WanVideoModel, encode_prompts
from mmspec.bench.wan_tiny import TRANSFORMER, text_parts, tiny_wan_pipeline
from mmspec.pipelines import StreamingVideoPipeline
from mmspec.pipelines.base import PipelineBase
from mmspec.pipelines.video import WAN_STREAM_PRESETS

PROMPT, OTHER = "a red cat walks on grass", "the blue dog jumps"


@pytest.fixture(scope="module")
def pipe():
    return tiny_wan_pipeline()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_from_wan_is_one_pipeline_with_the_wan_adapter(pipe):
    assert isinstance(pipe, PipelineBase) and pipe.is_wan and isinstance(pipe.video_model, WanVideoModel)
    assert pipe.chunk_frames == 3 and pipe.max_frames("full-cache") == (1024 // 3 - 1) * 3
    d = pipe.stream_defaults()
    assert (d["sampler"], d["sigmas"], d["guidance_scale"], d["sink_frames"], d["window_frames"]) == (
        "renoise", [1.0, 0.9375, 0.8333, 0.625], 1.0, 3, 6)


def test_the_sigma_list_holds_for_its_own_step_count(pipe):
    args = (PROMPT, None, 21, None, None)  # 21 video frames: 6 latent
    rest = (None, None, "rolling", None, "latent", None, ())
    assert pipe.check_inputs(*args, None, *rest).sigmas == [1.0, 0.9375, 0.8333, 0.625]
    other = pipe.check_inputs(*args, 2, *rest)
    assert other.steps == 2 and other.sigmas is None and other.sampler == "renoise"


def test_the_stream_is_the_adapters_loop(pipe):
    """12 latent frames, rolling (sink 3 + window 6: the cache rolls at the 4th chunk): latents bit
    for bit those of the adapter driven by hand (UMT5 rows, one noise draw per chunk, then
    Self-Forcing's renoise draws, from one generator)."""
    got = pipe(prompt=PROMPT, num_latent_frames=12, generator=gen(3), output_type="latent").frames
    model, d = pipe.video_model, pipe.stream_defaults()
    stream = CachedStream(model, 1, 3, 6, latent_hw=(4, 4))
    sampler = FlowSampler(pipe.scheduler, 4, "renoise", d["sigmas"])
    g, chunks = gen(3), []
    with torch.no_grad():  # as the pipeline runs (UMT5 under autograd rounds differently, 2.4e-7)
        rows = encode_prompts([PROMPT], pipe.text_encoder, pipe.tokenizer, d["max_text_length"])
        for _ in range(4):
            noise = torch.randn((1, 3, 4, 4, 4), generator=g)
            chunks.append(stream.sample(noise, rows, None, sampler, 1.0, generator=g))
    assert torch.equal(got, torch.cat(chunks, 1))
    assert stream.frames() == 9


def test_num_frames_counts_video_frames_as_wan_pipeline_does(pipe):
    """``num_frames`` counts video frames (``4k + 1``, diffusers' ``WanPipeline``): 21 video frames
    are 6 latent frames, the same stream as ``num_latent_frames=6`` bit for bit, decoded to 21
    frames; chunk indices count video frames once decoded (0 .. 8, then 12 a chunk), latent frames
    for ``output_type="latent"``; the schedule's start 9 is the second chunk; without a length the
    call makes WanPipeline's 81 frames (21 latent)."""
    assert [pipe.video_frames(n) for n in (0, 1, 3, 6, 21)] == [0, 1, 9, 21, 81]
    video = pipe(prompt=PROMPT, num_frames=21, generator=gen(6), output_type="latent")
    latent = pipe(prompt=PROMPT, num_latent_frames=6, generator=gen(6), output_type="latent")
    assert torch.equal(video.frames, latent.frames) and video.frames.shape[1] == 6 and video.stats["frames"] == 6
    chunks = list(pipe.stream(prompts=[(0, PROMPT), (9, OTHER)], num_frames=21, generator=gen(6), output_type="pt"))
    assert [c.frame_indices for c in chunks] == [range(0, 9), range(9, 21)]
    assert [c.frames.shape[1] for c in chunks] == [9, 12] and [c.stats["switched"] for c in chunks] == [False, True]
    assert [c.frame_indices for c in pipe.stream(prompt=PROMPT, num_frames=21, output_type="latent")] == [
        range(0, 3), range(3, 6)]
    out = pipe(prompt=PROMPT, generator=gen(6), output_type="pt")
    assert out.frames.shape[1] == 81 and out.stats["frames"] == 81 and out.stats["chunks"] == 7


def test_frames_are_the_clip_decoded_at_once(pipe):
    """Decoded chunk by chunk with the VAE's causal cache: 1 + 4 x 11 = 45 video frames, equal to
    decoding the 12 latent frames in one call."""
    out = pipe(prompt=PROMPT, num_latent_frames=12, generator=gen(4), output_type="pt")
    latents = pipe(prompt=PROMPT, num_latent_frames=12, generator=gen(4), output_type="latent").frames
    assert out.frames.shape == (1, 45, 3, 32, 32)
    whole = pipe._postprocess(latents, "pt", WanStreamingDecoder(pipe.vae))
    assert torch.equal(out.frames, whole)


def test_round_trip_through_a_local_folder(pipe, tmp_path):
    """Saved and loaded: the same classes, settings and weights (bit for bit); the frames agree
    within 1e-5 (measured 1.8e-6: the loaded transformer's time embedding rounds differently at
    float32, 2.4e-7 on one raw forward with identical weights and buffers, a difference inside
    diffusers' loading, not this pipeline's code)."""
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["stream_config"]["chunk_frames"] == 3 and index["stream_config"]["sampler"] == "renoise"
    loaded = StreamingVideoPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.is_wan and loaded.stream_defaults() == pipe.stream_defaults()
    for name in ("transformer", "vae", "text_encoder"):
        mine, theirs = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a = pipe(prompts=[(0, PROMPT), (21, OTHER)], num_latent_frames=9, generator=gen(1), output_type="pt").frames
    b = loaded(prompts=[(0, PROMPT), (21, OTHER)], num_latent_frames=9, generator=gen(1), output_type="pt").frames
    assert a.shape == b.shape == (1, 33, 3, 32, 32) and (a - b).abs().max() < 1e-5


def test_a_prompt_switch_recaches_once_and_the_cache_stays_flat(pipe):
    """A switch at frame 9 re-caches the kept frames (one extra transformer pass in that chunk);
    over 30 chunks the cache holds sink + window frames at constant bytes once it has rolled."""
    chunks = list(pipe.stream(prompts=[(0, PROMPT), (33, OTHER)], num_latent_frames=90, generator=gen(2),
                              output_type="latent"))
    assert [c.stats["switched"] for c in chunks[:5]] == [False, False, False, True, False]
    assert [c.stats["nfe"] for c in chunks[2:5]] == [5, 6, 5] and chunks[3].prompts == [OTHER]
    after = [(c.stats["cache_frames"], c.stats["cache_bytes"]) for c in chunks[3:]]
    assert set(after) == {after[0]} and after[0][0] == 9


def test_offload_keeps_the_outputs(pipe):
    want = pipe(prompt=PROMPT, num_latent_frames=6, generator=gen(5), output_type="pt").frames
    pipe.enable_model_cpu_offload(device="cpu")
    try:
        got = pipe(prompt=PROMPT, num_latent_frames=6, generator=gen(5), output_type="pt").frames
    finally:
        pipe.remove_all_hooks()
    assert torch.equal(got, want)


def _counted(pipe):
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda *a: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("kwargs,message", [
    (dict(window_frames=1020), "sink_frames \\+ window_frames must be at most 1021 frames"),
    (dict(window_frames=-2), "window_frames must be an int >= 0 \\(latent frames\\), or None or -1"),
    (dict(window_frames=1.5), "window_frames must be an int >= 0 \\(latent frames\\), or None or -1"),
    (dict(window_frames="x"), "window_frames must be an int >= 0 \\(latent frames\\), or None or -1"),
    (dict(prompts=[(0, PROMPT), (4, OTHER)], prompt=None), "prompts\\[1\\] start frame must be a chunk boundary in "
                                                            "video frames \\(0, 9, 21, 33, ...: .*e.g. 0 or 9"),
    (dict(prompts=[(0, PROMPT), (12, OTHER)], prompt=None), "prompts\\[1\\] start frame .* e.g. 9 or 21, got 12"),
    (dict(num_frames=80), "num_frames must be 4k \\+ 1 video frames, as diffusers' WanPipeline takes them .*e.g. 77 "
                          "or 81; or num_latent_frames, got 80"),
    (dict(num_latent_frames=6), "num_latent_frames must be None when num_frames is given"),
    (dict(height=40), "height must be None or a positive multiple of 16"),
    (dict(prompt=7), "prompt must be"),
])
def test_bad_stream_input_is_refused_before_any_forward(pipe, kwargs, message):
    calls, handle = _counted(pipe)
    try:
        with pytest.raises(ValueError, match=message):
            pipe(**{"prompt": PROMPT, "num_frames": 21, **kwargs})
    finally:
        handle.remove()
    assert calls == []


def test_bad_parts_are_refused_when_the_pipeline_is_built(pipe):
    parts = dict(transformer=pipe.transformer, vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
    fresh = tiny_wan_pipeline(seed=1)  # a transformer no adapter wraps yet
    parts["transformer"] = fresh.transformer
    fresh.video_model.restore_processors()
    with pytest.raises(ValueError, match="chunk_frames must be the latent frames per chunk the causal checkpoint"):
        StreamingVideoPipeline.from_wan(**parts)
    with pytest.raises(ValueError, match="text_encoder must be a UMT5 text encoder"):
        StreamingVideoPipeline.from_wan(**dict(parts, text_encoder=None), chunk_frames=3)
    with pytest.raises(ValueError, match="stream_config must be keys among"):
        StreamingVideoPipeline.from_wan(**parts, chunk_frames=3, window=12)
    with pytest.raises(ValueError, match="position_policy must be one of"):
        StreamingVideoPipeline.from_wan(**parts, chunk_frames=3, position_policy="rolling")
    with pytest.raises(ValueError, match="vae must be a diffusers AutoencoderKLWan"):
        StreamingVideoPipeline(vae=torch.nn.Identity(), transformer=fresh.transformer, text_encoder=pipe.text_encoder,
                               tokenizer=pipe.tokenizer, stream_config={"chunk_frames": 3})


def _stream_config(parts, **kwargs) -> dict:
    """``from_wan(**parts, **kwargs)``'s saved stream settings, the transformer released after."""
    built = StreamingVideoPipeline.from_wan(**parts, **kwargs)
    built.video_model.restore_processors()  # one adapter per transformer at a time
    return dict(built.config.stream_config)


@pytest.fixture(scope="module")
def free_parts(pipe):
    """The pipe's text parts and VAE with a transformer no adapter wraps."""
    fresh = tiny_wan_pipeline(seed=1)
    fresh.video_model.restore_processors()
    return dict(transformer=fresh.transformer, vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)


@pytest.mark.parametrize("name", list(WAN_STREAM_PRESETS))
def test_presets_hold_the_released_settings(free_parts, name):
    """``from_wan(preset=...)``: the released chunk, sink/window (frames a chunk sees besides
    itself), absolute positions and sigmas (values and their sources: ``WAN_STREAM_PRESETS``);
    explicit settings override a preset."""
    small = dict(height=32, width=32, max_text_length=8)
    config = _stream_config(free_parts, preset=name, **small)
    expected = {"self-forcing": (3, 0, 18, [1.0, 0.9375, 5 / 6, 0.625]),
                "longlive": (3, 3, 6, [1.0, 0.9375, 5 / 6, 0.625]),
                "causvid": (3, 0, 18, [1.0, 28 / 37, 12 / 23])}[name]
    assert (config["chunk_frames"], config["sink_frames"], config["window_frames"], list(config["sigmas"])) == expected
    assert config["position_policy"] == "absolute" and config["guidance_scale"] == 1.0
    assert config["num_inference_steps"] == len(expected[3]) and config["sampler"] == "renoise"
    if name != "causvid":  # Self-Forcing's warp: timesteps[1000 - t] of the shift-5 table, t = 1000, 750, 500, 250
        table = [5.0 * s / (1 + 4.0 * s) for s in (1 - i / 1000 for i in range(1000))]
        assert config["sigmas"] == pytest.approx([table[1000 - t] for t in (1000, 750, 500, 250)], abs=1e-12)
        assert config["model_times"] is None
    else:  # CausVid: the model told 1000, 757, 522; x0 and re-noising at the shift-8 table's nearest sigmas
        table = [8.0 * s / (1 + 7.0 * s) for s in (1 - i / 1000 for i in range(1000))]
        nearest = [min(table, key=lambda s: abs(1000 * s - t)) for t in (1000, 757, 522)]
        assert config["sigmas"] == pytest.approx(nearest, abs=1e-12) and config["model_times"] == [1.0, 0.757, 0.522]
    assert _stream_config(free_parts, preset=name, sink_frames=6, **small)["sink_frames"] == 6


def test_stream_settings_are_checked_when_the_pipeline_is_built(free_parts):
    """A setting the stream's cache would refuse is refused by ``from_wan`` itself, before anything
    is built or saved; frame-granular settings (the issue's sink 1 + window 2) are accepted."""
    parts = free_parts
    with pytest.raises(ValueError, match="preset must be None or one of 'self-forcing', 'longlive', 'causvid'"):
        StreamingVideoPipeline.from_wan(**parts, preset="self_forcing")
    with pytest.raises(ValueError, match="sink_frames must be an int >= 0"):
        StreamingVideoPipeline.from_wan(**parts, chunk_frames=3, sink_frames=-1, window_frames=3)
    with pytest.raises(ValueError, match="window_frames must be an int >= 0"):
        StreamingVideoPipeline.from_wan(**parts, preset="longlive", window_frames=2.0)
    config = _stream_config(parts, chunk_frames=3, sink_frames=1, window_frames=2)
    assert (config["sink_frames"], config["window_frames"]) == (1, 2)
    R = parts["transformer"].config.rope_max_seq_len
    with pytest.raises(ValueError, match=f"sink_frames \\+ window_frames must be at most {R - 3} frames"):
        StreamingVideoPipeline.from_wan(**parts, chunk_frames=3, sink_frames=3, window_frames=3 * (R // 3))


def test_a_frame_granular_window_streams_through_the_pipeline(pipe):
    """sink 1 + window 2 with chunks of 3 (Self-Forcing's ``sink_size=1, local_attn_size=6``)
    streams through the public call; a different window gives a different stream once it rolls."""
    narrow = pipe(prompt=PROMPT, num_latent_frames=12, sink_frames=1, window_frames=2, generator=gen(0),
                  output_type="latent").frames
    wide = pipe(prompt=PROMPT, num_latent_frames=12, sink_frames=1, window_frames=5, generator=gen(0),
                output_type="latent").frames
    assert narrow.shape == wide.shape == (1, 12, 4, 4, 4)
    assert torch.equal(narrow[:, :6], wide[:, :6])  # frames 0..5: nothing evicted in either
    assert (narrow[:, 6:] - wide[:, 6:]).abs().max() > 1e-4


def test_a_window_of_every_frame_so_far_grows_to_the_rope_positions(pipe):
    """``window_frames=-1`` at the call, or -1 / None in the stream settings (saved as None): every
    frame so far, Self-Forcing's and CausVid's ``local_attn_size=-1``. On a Wan of 40 temporal RoPE
    positions (``max_frames("full-cache")`` 36): 36 frames at sink 3 equal, bit for bit, those of a
    fixed window of 33 (nothing evicted; the growing cache holds all 36), while a window of 27
    rolls and differs; 37 frames are refused before any forward, naming ``num_frames``; an
    unbounded stream yields 36 frames, then raises ``CacheLimitError``."""
    from mmspec.pipelines import CacheLimitError

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**dict(TRANSFORMER, rope_max_seq_len=40)).eval()
    short = StreamingVideoPipeline.from_wan(transformer, pipe.vae, pipe.text_encoder, pipe.tokenizer, chunk_frames=3,
                                            height=32, width=32, max_text_length=8, sink_frames=3, window_frames=-1)
    short.set_progress_bar_config(disable=True)
    assert short.config.stream_config["window_frames"] is None and short.max_frames("full-cache") == 36

    def run(**kwargs):
        return short(prompt=PROMPT, num_latent_frames=36, generator=gen(0), output_type="latent", **kwargs)

    every = run()
    assert every.stats["window_frames"] is None and every.stats["cache_frames"] == 36
    assert torch.equal(every.frames, run(window_frames=-1).frames)
    assert torch.equal(every.frames, run(window_frames=33).frames)
    assert (every.frames - run(window_frames=27).frames).abs().max() > 1e-4
    calls, handle = _counted(short)
    try:
        with pytest.raises(ValueError, match="num_frames must be None or at most 141 video frames \\(36 latent\\) with window_frames=-1") as err:
            short(prompt=PROMPT, num_latent_frames=37)
    finally:
        handle.remove()
    assert calls == [] and "\n" not in str(err.value)
    chunks = []
    with pytest.raises(CacheLimitError, match="stops at 36 frames"):
        for chunk in short.stream(prompt=PROMPT, generator=gen(0), output_type="latent"):
            chunks.append(chunk.latents)
    assert torch.equal(torch.cat(chunks, 1), every.frames)


def test_absolute_positions_refuse_the_recompute_baseline_and_long_streams():
    pipe = tiny_wan_pipeline(position_policy="absolute")
    calls, handle = _counted(pipe)
    try:
        with pytest.raises(ValueError, match="cache_mode must be 'rolling', 'no-sink' or 'full-cache' under "
                                             "position_policy='absolute'"):
            pipe(prompt=PROMPT, num_latent_frames=6, cache_mode="window-recompute")
        with pytest.raises(ValueError, match="num_frames must be None or at most 4093 video frames \\(1024 latent\\) under"):
            pipe(prompt=PROMPT, num_latent_frames=1026)
    finally:
        handle.remove()
    assert calls == []
    assert pipe(prompt=PROMPT, num_latent_frames=6, generator=gen(0), output_type="latent").frames.shape == (1, 6, 4, 4, 4)


def test_text_parts_tokenize_words_and_end_with_eos():
    _, tokenizer = text_parts()
    assert tokenizer("a red cat purrs")["input_ids"] == [3, 5, 7, 2, 1]


def test_the_recache_rule_and_model_times_are_checked_early(free_parts):
    """``recache_rule`` and ``model_times`` are refused when the pipeline is built; under
    LongLive's re-cache, ``recache_sink`` (LongLive decides) and the recompute baseline are refused
    at the call, before any forward."""
    small = dict(height=32, width=32, max_text_length=8)
    with pytest.raises(ValueError, match="recache_rule must be one of 'prefill', 'longlive'"):
        StreamingVideoPipeline.from_wan(**free_parts, chunk_frames=3, recache_rule="bidirectional", **small)
    with pytest.raises(ValueError, match="model_times must be None or 4 flow times in \\(0, 1\\]"):
        StreamingVideoPipeline.from_wan(**free_parts, preset="self-forcing", model_times=[1.0, 0.5], **small)
    with pytest.raises(ValueError, match="model_times must be None without explicit sigmas"):
        StreamingVideoPipeline.from_wan(**free_parts, chunk_frames=3, sigmas=None, model_times=[1.0] * 4, **small)
    pipe = StreamingVideoPipeline.from_wan(**free_parts, preset="longlive", position_policy="cache-order", **small)
    pipe.set_progress_bar_config(disable=True)
    calls, handle = _counted(pipe)
    try:
        with pytest.raises(ValueError, match="recache_sink must be None under recache_rule='longlive'"):
            pipe(prompt=PROMPT, num_latent_frames=6, recache_sink=True)
        with pytest.raises(ValueError, match="cache_mode must be 'rolling', 'no-sink' or 'full-cache' under "
                                             "recache_rule='longlive'"):
            pipe(prompt=PROMPT, num_latent_frames=6, cache_mode="window-recompute")
    finally:
        handle.remove()
        pipe.video_model.restore_processors()
    assert calls == []
