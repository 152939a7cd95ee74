"""The streaming video model's networks: the frame autoencoder and the chunk-causal video DiT.

The central promise: the training forward (the two-stream plan, one pass over a clip) computes
exactly what the rolling sink + window cache computes chunk by chunk at inference (Self-Forcing's
write semantics: every denoising step overwrites the chunk's slots, a t = 0 pass commits), for a
multi-layer model, so what the model learns is what it is asked at inference."""

import pytest
import torch

from mmspec.core.cache import SinkWindowCache
from mmspec.models import load_checkpoint
from mmspec.models.video_ae import FrameAutoencoder
from diffusers import FlowMatchEulerDiscreteScheduler

from mmspec.adapters.video import FlowSampler, sample_chunk
from mmspec.models.video_dit import ChunkPlan, VideoDiTModel, commit, parse_prompt, visible_chunks

TINY = dict(dim=32, n_layers=3, n_heads=2, mlp_hidden=64, chunk_frames=2, sink_frames=2, window_frames=4)
# the output heads: linear (unpatchify), and linear plus U-ViT's conv head
HEADS = pytest.mark.parametrize("heads", [{}, dict(conv_head=8)], ids=["linear", "conv"])


def tiny_dit(seed=0, **overrides):
    torch.manual_seed(seed)
    model = VideoDiTModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():  # leave adaLN-Zero's zeros: otherwise every block is the identity
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def clip(B=2, N=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, N, 4, 8, 8, generator=g)
    noise = torch.randn(B, N, 4, 8, 8, generator=g)
    t = torch.rand(B, N // 2, generator=g).repeat_interleave(2, 1)
    x_t = (1 - t[..., None, None, None]) * x0 + t[..., None, None, None] * noise
    return x0, x_t, t


def cached_chunks(model, x0, x_t, t, prompt, sink=2, window=4, steps=2):
    """The inference computation: per chunk, ``steps`` denoising passes at the chunk's t that
    overwrite its slots, then the commit pass of the clean chunk at t = 0; returns the last
    denoising pass's velocity of every chunk and the cache."""
    C, P = model.config.chunk_frames, model.tokens_per_frame
    cache = model.new_cache(x0.shape[0], sink, window)
    outs = []
    for c in range(x0.shape[1] // C):
        part = slice(c * C, (c + 1) * C)
        for _ in range(steps):
            v = model(x_t[:, part], t[:, part], prompt, cache=cache)
            cache.truncate(cache.lengths - C * P)  # forget the block: the next step overwrites its slots
        outs.append(v)
        model(x0[:, part], 0.0, prompt, cache=cache)
        commit(cache)
    return torch.cat(outs, 1), cache


def test_visible_chunks_are_what_a_sink_window_cache_holds():
    assert visible_chunks(0, 1, 2) == []
    assert visible_chunks(3, 1, 2) == [0, 1, 2]
    assert visible_chunks(6, 1, 2) == [0, 4, 5]
    assert visible_chunks(6, 0, 2) == [4, 5]
    assert visible_chunks(6, 1, None) == [0, 1, 2, 3, 4, 5]


@HEADS
def test_two_stream_training_forward_equals_the_rolling_cache(heads):
    """3 layers, 6 chunks of 2 frames, sink 1 chunk + window 2 chunks (so chunks 4 and 5 see a
    rolled cache): max |difference| below 1e-5; a plan without the window (attention over the
    whole past, absolute positions) differs by more than 1e-3, as does a cache that does not
    roll."""
    model = tiny_dit(**heads)
    x0, x_t, t = clip()
    prompt = torch.tensor([[0, 1, 2], [3, 0, 1]])
    want, cache = cached_chunks(model, x0, x_t, t, prompt)
    N = x0.shape[1]
    inputs = (torch.cat([x0, x_t], 1), torch.cat([torch.zeros_like(t), t], 1), prompt)
    plan = ChunkPlan.two_stream(N, 2, model.tokens_per_frame, sink_frames=2, window_frames=4)
    got = model(*inputs, plan=plan)[:, N:]
    assert (got - want).abs().max() < 1e-5
    assert int(cache.lengths.max()) == (2 + 4) * model.tokens_per_frame  # it rolled
    full = model(*inputs, plan=ChunkPlan.two_stream(N, 2, model.tokens_per_frame))[:, N:]
    assert (full - want).abs().max() > 1e-3
    unrolled, _ = cached_chunks(model, x0, x_t, t, prompt, sink=2, window=N)
    assert (got - unrolled).abs().max() > 1e-3
    # the earliest chunks never see a roll: the same either way
    assert (full[:, :6] - want[:, :6]).abs().max() < 1e-5


def test_per_frame_prompts_and_times_reach_their_frames():
    """Changing the prompt of the query stream's last chunk changes only that chunk's output
    (the chunks before it cannot see it)."""
    model = tiny_dit()
    x0, x_t, t = clip(B=1)
    N = x0.shape[1]
    plan = ChunkPlan.two_stream(N, 2, model.tokens_per_frame, 2, 4)
    prompt = torch.tensor([[[0, 1, 2]] * 2 * N])
    other = prompt.clone()
    other[0, -2:] = torch.tensor([3, 3, 3])
    inputs = (torch.cat([x0, x_t], 1), torch.cat([torch.zeros_like(t), t], 1))
    a, b = model(*inputs, prompt, plan=plan), model(*inputs, other, plan=plan)
    assert torch.equal(a[:, :-2], b[:, :-2]) and (a[:, -2:] - b[:, -2:]).abs().max() > 1e-3


@HEADS
def test_default_forward_is_chunk_causal(heads):
    """Without cache or plan: a frame's output depends on frames of its own chunk (both ways) and
    of earlier chunks, never on later ones."""
    model = tiny_dit(**heads)
    x0, _, _ = clip(B=1, N=6)
    base = model(x0, 0.5, torch.tensor([[0, 0, 0]]))
    later = x0.clone()
    later[:, 4:] += 1.0
    out = model(later, 0.5, torch.tensor([[0, 0, 0]]))
    assert torch.equal(out[:, :4], base[:, :4]) and (out[:, 4:] - base[:, 4:]).abs().max() > 1e-3
    inside = x0.clone()
    inside[:, 3] += 1.0  # second frame of chunk 1: changes frame 2 too (bidirectional chunk)
    out = model(inside, 0.5, torch.tensor([[0, 0, 0]]))
    assert torch.equal(out[:, :2], base[:, :2]) and (out[:, 2] - base[:, 2]).abs().max() > 1e-3


@HEADS
def test_default_forward_equals_the_rolling_plan_without_a_window(heads):
    """The plan-less forward (dense: one attention call under a (T, T) chunk-causal mask, every
    token rotated once; what the window-recompute baseline runs) equals the gathered
    ``ChunkPlan.rolling(F)`` forward within 1e-5, over 12 frames with per-frame times and prompts."""
    model = tiny_dit(**heads)
    x0, x_t, t = clip(B=2, N=12)
    prompt = torch.tensor([[0, 1, 2], [3, 0, 1]])
    dense = model(x_t, t, prompt)
    gathered = model(x_t, t, prompt, plan=ChunkPlan.rolling(12, 2, model.tokens_per_frame))
    assert (dense - gathered).abs().max() < 1e-5


def test_a_long_stream_keeps_positions_and_memory_bounded():
    """200 chunks (400 frames) through ``sample_chunk`` with guidance: the cache never grows
    past sink + window + one chunk, key positions stay below that many frames, outputs finite."""
    model = tiny_dit()
    P = model.tokens_per_frame
    cache = model.new_cache(2)  # [cond; uncond]
    nbytes = cache.nbytes()
    prompt, null = torch.tensor([[1, 2, 3]]), torch.tensor([model.null_prompt])
    g = torch.Generator().manual_seed(0)
    top = 0
    steps = FlowSampler(FlowMatchEulerDiscreteScheduler(), 2)
    for _ in range(200):
        x = sample_chunk(model, cache, torch.randn(1, 2, 4, 8, 8, generator=g), prompt, steps, 2.0, null)
        assert torch.isfinite(x).all()
        top = max(top, int(cache.next_positions().max()))
    assert top == (2 + 4) * P and cache.nbytes() == nbytes


def test_sample_chunk_is_euler_on_the_guided_velocity():
    """One chunk from an empty cache, 2 steps at guidance 2: the same as running the Euler steps by
    hand with the reference forward (no cache; a single chunk sees only itself)."""
    model = tiny_dit()
    noise = torch.randn(1, 2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    prompt, null = torch.tensor([[1, 2, 3]]), torch.tensor([model.null_prompt])
    got = sample_chunk(model, model.new_cache(2), noise, prompt, FlowSampler(FlowMatchEulerDiscreteScheduler(), 2), 2.0,
                       null)
    x = noise
    for t, t_next in ((1.0, 0.5), (0.5, 0.0)):
        v_c, v_u = model(x, t, prompt), model(x, t, null)
        x = x + (t_next - t) * (v_u + 2.0 * (v_c - v_u))
    assert (got - x).abs().max() < 1e-5


def test_prompts_encode_from_text_with_a_null_prompt():
    model = tiny_dit()
    ids = model.encode_prompts(["a red circle moving right", "a yellow star moving down", None])
    assert ids.tolist() == [[0, 0, 0], [3, 3, 3], [4, 4, 4]] and model.null_prompt == (4, 4, 4)
    assert parse_prompt("Moving UP: a green square!", model.prompt_vocab) == (1, 1, 2)
    with pytest.raises(ValueError, match="prompt must be text naming exactly one direction"):
        model.encode_prompts("a red circle")
    dropped = VideoDiTModel(**TINY, prompt_dropout_prob=1.0).drop_prompts(torch.zeros(3, 5, 3, dtype=torch.long))
    assert (dropped == 4).all()


def test_flow_sampler_sigmas_follow_the_scheduler():
    """Uniform sigmas from 1 to 0, shifted by the scheduler's ``shift`` (SD3's
    ``shift t / (1 + (shift - 1) t)``), ending at 0; an explicit list (Self-Forcing's warped one)
    is taken as given."""
    assert FlowSampler(FlowMatchEulerDiscreteScheduler(), 4).sigmas().tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    shifted = FlowSampler(FlowMatchEulerDiscreteScheduler(shift=3.0), 4).sigmas()
    u = torch.tensor([1.0, 0.75, 0.5, 0.25])
    assert torch.allclose(shifted[:-1], 3 * u / (1 + 2 * u)) and shifted[-1] == 0
    warped = FlowSampler(FlowMatchEulerDiscreteScheduler(), 4, sigmas=[1.0, 0.9375, 0.8333, 0.625]).sigmas()
    assert torch.allclose(warped, torch.tensor([1.0, 0.9375, 0.8333, 0.625, 0.0]))
    with pytest.raises(ValueError, match="sampler must be one of"):
        FlowSampler(FlowMatchEulerDiscreteScheduler(), 4, sampler="heun")
    with pytest.raises(ValueError, match="sigmas must be 4 values in"):
        FlowSampler(FlowMatchEulerDiscreteScheduler(), 4, sigmas=[1.0, 0.5])


def test_renoise_is_self_forcings_x0_then_noise():
    """``sampler="renoise"``: x0 = x - sigma v at every step, re-noised to the next sigma with
    fresh noise from the generator ((1 - s) x0 + s eps), the last step's x0 returned."""
    model = tiny_dit()
    noise = torch.randn(1, 2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    prompt = torch.tensor([[1, 2, 3]])
    sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(), 2, sampler="renoise", sigmas=[1.0, 0.5])
    got = sample_chunk(model, model.new_cache(1), noise, prompt, sampler, 1.0, generator=torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    x0 = noise - 1.0 * model(noise, 1.0, prompt)
    x = 0.5 * x0 + 0.5 * torch.randn(noise.shape, generator=g)
    want = x - 0.5 * model(x, 0.5, prompt)
    assert (got - want).abs().max() < 1e-5
    euler = sample_chunk(model, model.new_cache(1), noise, prompt, FlowSampler(FlowMatchEulerDiscreteScheduler(), 2,
                                                                                sigmas=[1.0, 0.5]), 1.0)
    assert (got - euler).abs().max() > 1e-3  # the fresh noise matters: not the ODE


def test_bad_inputs_name_the_argument():
    model = tiny_dit()
    x = torch.zeros(1, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="latents must be"):
        model(torch.zeros(1, 2, 3, 8, 8), 0.0, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="t must be"):
        model(x, torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="latents must be whole chunks"):
        model(x[:, :1], 0.0, torch.zeros(1, 3, dtype=torch.long), cache=model.new_cache(1))
    with pytest.raises(ValueError, match="window_frames must be"):
        model.new_cache(1, 2, 3)
    with pytest.raises(ValueError, match="sink_frames must be"):
        VideoDiTModel(chunk_frames=3, sink_frames=2)
    with pytest.raises(ValueError, match="num_frames must be a positive multiple"):
        ChunkPlan.rolling(5, 2, 16)
    for bad in (-2, 3, 1, 2.0, True):
        with pytest.raises(ValueError, match="conv_head must be 0 \\(none\\) or an even int >= 2"):
            VideoDiTModel(conv_head=bad)


@HEADS
def test_save_and_load_round_trip(tmp_path, heads):
    """fp16 safetensors in a diffusers folder: the loaded model (computed in fp32) matches the
    saved one within fp16 rounding, and keeps its prompt vocabulary."""
    model = tiny_dit(**heads)
    model.to(torch.float16).save_pretrained(tmp_path / "dit")
    model.to(torch.float32)
    loaded = load_checkpoint(VideoDiTModel, tmp_path / "dit")
    assert loaded.prompt_vocab == model.prompt_vocab and list(loaded.prompt_vocab) == ["colour", "shape", "direction"]
    x0, _, _ = clip(B=1, N=4)
    prompt = torch.tensor([[1, 1, 1]])
    assert (loaded(x0, 0.3, prompt) - model(x0, 0.3, prompt)).abs().max() < 0.05

    ae = FrameAutoencoder()
    ae.latent_std.fill_(2.0)
    ae.to(torch.float16).save_pretrained(tmp_path / "ae")
    back = load_checkpoint(FrameAutoencoder, tmp_path / "ae")
    assert torch.equal(back.latent_std, torch.full((4,), 2.0))


def test_conv_head_starts_as_no_head():
    """A fresh model with ``conv_head`` computes exactly what the same weights without it do (its
    last convolution is zero-initialised, adaLN-Zero style); once trained (perturbed here) the
    head changes the output. It convolves each whole latent frame (conv_head / 2 channels on the
    8x8 grid, one image per frame), not each patch."""
    torch.manual_seed(0)
    plain = VideoDiTModel(**TINY).eval()
    torch.manual_seed(0)
    headed = VideoDiTModel(**TINY, conv_head=8).eval()
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.05 * torch.randn_like(p))
        headed.load_state_dict({**headed.state_dict(), **plain.state_dict()})
    x0, x_t, t = clip(B=1, N=4)
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(headed(x_t, t, prompt), plain(x_t, t, prompt))
    with torch.no_grad():
        headed.head_conv[-1].weight.add_(0.05 * torch.randn_like(headed.head_conv[-1].weight))
    seen = []
    headed.head_conv.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
    assert (headed(x_t, t, prompt) - plain(x_t, t, prompt)).abs().max() > 1e-3
    assert seen == [(1 * 4, 4, 8, 8)]  # (batch x frames, conv_head // 2, latent grid)


def test_autoencoder_shapes_and_latent_statistics():
    """After ``set_latent_stats`` on a set of frames, their encodings have per-channel mean ~0 and
    std ~1 (within 1e-4), and decode returns frames of the input's shape."""
    torch.manual_seed(0)
    ae = FrameAutoencoder().eval()
    frames = torch.rand(20, 3, 32, 32) * 2 - 1
    ae.set_latent_stats(frames)
    z = ae.encode(frames)
    assert z.shape == (20, 4, 8, 8) and ae.latent_size == 8
    assert z.mean(dim=(0, 2, 3)).abs().max() < 1e-4 and (z.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-4
    assert ae.decode(z).shape == frames.shape
    losses = ae.train().loss(frames, torch.Generator().manual_seed(0))
    assert losses["loss"] >= losses["recon"] > 0
    with pytest.raises(ValueError, match="frames must be"):
        ae.encode(torch.zeros(1, 3, 30, 30))


def test_the_cache_is_the_cores():
    assert isinstance(tiny_dit().new_cache(1), SinkWindowCache)
