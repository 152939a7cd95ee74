"""diffusers' Wan streamed chunk-causally through the core's rolling cache (``mmspec.adapters.video_wan``).

Every model is a tiny random ``WanTransformer3DModel`` / ``AutoencoderKLWan`` / ``UMT5EncoderModel``
built here under a fixed seed (spec §9's config: 2 heads of 12, 4 latent channels, text width 16).

The references share no code with the adapter: they run the *stock* transformer (a copy made
before the adapter installs its processors) with its own ``WanAttnProcessor``, either under a
dense chunk-causal mask over [kept frames at t = 0; the chunk at t] at positions 0, 1, ... (cache
order), or, for two layers after the cache has rolled and for absolute positions, with a grouped
attention written here that rotates by diffusers' own RoPE tables (``transformer.rope``'s float64-
built buffers). Tolerance 1e-5 (float32; measured errors are around 1e-7); the tests that need it
show a wrong context or position moves the output by more than 1e-3.

What holds, by depth (as ``tests/test_video_cache.py`` states for the core):
- one layer: a kept frame's K/V depend on the frame alone, so after any number of rolls a chunk
  equals a from-scratch forward over the kept frames and itself at positions 0, 1, ...;
- two layers: after the first eviction the layer-1 K/V of a window frame were computed while
  frames since evicted were visible, so a from-scratch recompute differs; what holds is the rolling
  definition (every chunk's K/V computed when it was committed, over the kept frames of that
  moment, at cache-order positions).
"""

import copy

import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from safetensors.torch import save_file
from torch.nn import functional as F

from mmspec.adapters.video import FlowSampler, chunk_causal_mask, recache, sample_chunk
from mmspec.adapters.video_wan import (WanStreamingDecoder, WanVideoModel, check_window, encode_prompts,
                                     load_original_wan)
from mmspec.core import SinkWindowCache

ATOL = 1e-5
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=8, ffn_dim=32, num_layers=2, cross_attn_norm=True)
HW = (4, 4)  # latent frames of 2 x 2 tokens
P = 4
SINK, WINDOW, CHUNK = 3, 6, 3


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def tiny_wan(num_layers=2, seed=0, **overrides) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(**{**TINY, "num_layers": num_layers, **overrides}).eval()


def wrapped(num_layers=2, **kwargs):
    """(WanVideoModel, a stock copy of its transformer made before the processors went in)."""
    transformer = tiny_wan(num_layers)
    stock = copy.deepcopy(transformer)
    return WanVideoModel(transformer, **kwargs), stock


def prompts(B=2, seed=5, L=8):
    return torch.randn(B, L, 16, generator=torch.Generator().manual_seed(seed))


# -- references: the stock transformer ----------------------------------------------------------
def stock_forward(stock, latents, times, prompt, attn1=None):
    """The stock transformer on (B, F, C, h, w) at per-frame flow times (B, F), its ``attn1``
    processors replaced by ``attn1`` for the call when given."""
    B, Fr, _, h, w = latents.shape
    n_tok = (h // 2) * (w // 2)
    saved = stock.attn_processors
    if attn1 is not None:
        stock.set_attn_processor({k: attn1 if ".attn1." in k else v for k, v in saved.items()})
    try:
        timestep = 1000.0 * times.repeat_interleave(n_tok, 1)  # per token, as Wan 2.2 TI2V takes them
        out = stock(latents.permute(0, 2, 1, 3, 4), timestep, prompt, return_dict=False)[0]
    finally:
        stock.set_attn_processor(saved)
    return out.permute(0, 2, 1, 3, 4)


class Masked:
    """The stock processor under a dense mask (the mask diffusers' Wan block never passes)."""

    def __init__(self, stock_processor, mask):
        self.stock_processor, self.mask = stock_processor, mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.stock_processor(attn, hidden_states, encoder_hidden_states, self.mask, rotary_emb)


def dense_block_causal(stock, latents, times, prompt, chunk=CHUNK):
    """The stock transformer under a dense chunk-causal mask, frames at positions 0 .. F - 1."""
    Fr = latents.shape[1]
    frame_chunk = torch.arange(Fr).repeat_interleave(P) // chunk
    mask = (frame_chunk[None, :] <= frame_chunk[:, None])[None, None]  # (1, 1, T, T)
    return stock_forward(stock, latents, times, prompt, Masked(stock.blocks[0].attn1.processor, mask))


class Grouped:
    """``attn1`` in which the query frames of each group attend exactly to the group's key frames,
    rotated at the frame positions the group gives them (diffusers' RoPE tables, stock formula)."""

    def __init__(self, stock, groups, grid=(2, 2)):
        self.groups, self.grid = groups, grid
        rope = stock.rope
        self.cos = rope.freqs_cos.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)
        self.sin = rope.freqs_sin.split([rope.t_dim, rope.h_dim, rope.w_dim], dim=1)

    def rotate(self, x, frames):
        """x (B, len(frames) * P, H, D), frames: the frame position of each P-token frame."""
        gh, gw = self.grid
        f = torch.tensor(frames).repeat_interleave(gh * gw)
        j = torch.arange(gh * gw).repeat(len(frames))
        cos = torch.cat([self.cos[0][f], self.cos[1][j // gw], self.cos[2][j % gw]], -1)[None, :, None]
        sin = torch.cat([self.sin[0][f], self.sin[1][j // gw], self.sin[2][j % gw]], -1)[None, :, None]
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
        out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
        return out

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        H = attn.heads
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (H, -1))  # (B, T, H, D)
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (H, -1))
        v = attn.to_v(hidden_states).unflatten(2, (H, -1))
        out = torch.empty_like(q)
        n = self.grid[0] * self.grid[1]
        tok = lambda frames: (torch.tensor(frames)[:, None] * n + torch.arange(n)).flatten()  # noqa: E731
        for query, keys, key_pos in self.groups:
            q_pos = [key_pos[keys.index(f)] for f in query]
            qr = self.rotate(q[:, tok(query)], q_pos).transpose(1, 2)
            kr = self.rotate(k[:, tok(keys)], key_pos).transpose(1, 2)
            y = F.scaled_dot_product_attention(qr, kr, v[:, tok(keys)].transpose(1, 2))
            out[:, tok(query)] = y.transpose(1, 2)
        return attn.to_out[0](out.flatten(2))


def visible(n, sink=SINK, window=WINDOW):
    """Frames a chunk starting at frame n sees: the first ``sink`` and the last ``window``."""
    return list(range(n)) if n <= sink + window else list(range(sink)) + list(range(n - window, n))


# -- the stream ----------------------------------------------------------------------------------
class Stream:
    """Self-Forcing's loop over a cache with random inputs, recording the committed clean latents:
    per chunk, ``steps`` denoising passes (the first at t = 1 given as a number, the next at
    random per-frame times (B, C)), each handed to ``check(x, times, out)``, then the clean pass
    at t = 0 and ``commit``."""

    def __init__(self, model, cache, prompt, seed=0):
        self.model, self.cache, self.prompt = model, cache, prompt
        self.B = prompt.shape[0]
        self.g = torch.Generator().manual_seed(seed)
        self.latents = []  # (B, C, h, w) per committed frame

    def randn(self, frames):
        return torch.randn(self.B, frames, 4, *HW, generator=self.g)

    def chunk(self, steps=2, check=None):
        self.cache.begin_chunk()
        for s in range(steps):
            x = self.randn(CHUNK)
            times = torch.ones(self.B, CHUNK) if s == 0 else torch.rand(self.B, CHUNK, generator=self.g)
            out = self.model(x, 1.0 if s == 0 else times, self.prompt, cache=self.cache)
            if check is not None:
                check(x, times, out)
        x0 = self.randn(CHUNK)
        self.model(x0, 0.0, self.prompt, cache=self.cache)
        self.cache.commit(x0)
        self.latents += list(x0.unbind(1))

    def inputs(self, frames, x, times):
        """[committed ``frames`` at t = 0; the query chunk at ``times``]."""
        lat = torch.stack([self.latents[f] for f in frames] + list(x.unbind(1)), 1)
        return lat, torch.cat([torch.zeros(self.B, len(frames)), times], 1)

    def rolling_groups(self, absolute=False):
        """The rolling definition over every committed frame and a query chunk after them: chunk at
        frame s attended to ``visible(s)`` and itself, at cache-order positions (or absolute)."""
        groups = []
        for s in range(0, len(self.latents) + CHUNK, CHUNK):
            keys = visible(s) + list(range(s, s + CHUNK))
            groups.append((list(range(s, s + CHUNK)), keys, keys if absolute else list(range(len(keys)))))
        return groups


# -- 1. the rolling stream equals a block-causal forward --------------------------------------
def test_wan_rope_is_rope3d_with_wan_split():
    """The cache's ``Rope3D`` rotates as diffusers' ``WanRotaryPosEmbed`` + the stock processor's
    rotation: the tiny head (12 = 4/4/4) over 3 frames of 2x3 tokens, and Wan2.1-1.3B's head of
    128 (44/42/42) at a 480x832 frame's 30x52 tokens, frames 0..2 and the table's last, 1021..1023.
    The differences are float32 angles (``Rope3D``) against float64-built tables (diffusers), largest
    where the angle is: measured 2.4e-7 / 1.5e-6 (tiny), 6.1e-6 / 8.2e-5 (1.3B) on unit-scale
    inputs, far below bfloat16's resolution (3.9e-3)."""
    for head_dim, grid, near, far in ((12, (2, 3), 1e-6, 4e-6), (128, (30, 52), 2e-5, 2e-4)):
        transformer = tiny_wan(1, num_attention_heads=1, attention_head_dim=head_dim)
        model = WanVideoModel(transformer)
        rope = model.rope(2 * grid[0], 2 * grid[1])
        assert rope.sections == [transformer.rope.t_dim // 2, transformer.rope.h_dim // 2, transformer.rope.w_dim // 2]
        n = grid[0] * grid[1]
        x = torch.randn(1, 3 * n, 1, head_dim, generator=torch.Generator().manual_seed(0))  # (B, T, H, D)
        stock = Grouped(transformer, [], grid)
        for frames, bound in (([0, 1, 2], near), ([1021, 1022, 1023], far)):
            want = stock.rotate(x, frames)
            pos = (torch.tensor(frames)[:, None] * n + torch.arange(n)).flatten()[None]
            got = rope(x.transpose(1, 2), pos).transpose(1, 2)
            assert (got - want).abs().max() < bound


def test_without_a_cache_forward_is_the_stock_transformer():
    """Bit-identical to the stock transformer (number, (B,) and per-frame times); ``chunk_causal``
    equals the stock transformer under a dense chunk-causal mask."""
    model, stock = wrapped(2)
    x = torch.randn(2, 6, 4, *HW, generator=torch.Generator().manual_seed(1))
    e = prompts()
    times = torch.rand(2, 6, generator=torch.Generator().manual_seed(2))
    for t in (0.5, torch.tensor([0.2, 0.9])):
        want = stock(x.permute(0, 2, 1, 3, 4), 1000.0 * torch.as_tensor(t).expand(2), e, return_dict=False)[0]
        assert torch.equal(model(x, t, e), want.permute(0, 2, 1, 3, 4))
    assert torch.equal(model(x, times, e), stock_forward(stock, x, times, e))
    got = model(x, times, e, chunk_causal=True)
    assert (got - dense_block_causal(stock, x, times, e)).abs().max() < ATOL
    assert (got - model(x, times, e)).abs()[:, :3].max() > 1e-3  # the first chunk no longer sees the second


@pytest.mark.parametrize("batch", [1, 2])
def test_one_layer_rolling_stream_equals_the_dense_block_causal_forward(batch):
    """8 chunks through sink 3 + window 6 (the cache rolls from the fifth chunk on), 2 denoising
    passes each (t given as a number, then per frame): every pass equals the stock transformer
    under a dense chunk-causal mask over [kept frames at t = 0; the chunk] at positions 0, 1, ...
    (1e-5; the measured worst is printed on failure)."""
    model, stock = wrapped(1)
    cache = model.new_cache(batch, SINK, WINDOW, HW)
    s = Stream(model, cache, prompts(batch))
    worst = 0.0
    for c in range(8):
        frames = visible(len(s.latents))
        assert cache.num_frames().tolist() == [len(frames)] * batch

        def check(x, times, out):
            nonlocal worst
            want = dense_block_causal(stock, *s.inputs(frames, x, times), s.prompt)[:, len(frames):]
            worst = max(worst, (out - want).abs().max().item())
        s.chunk(check=check)
    assert worst < ATOL, worst
    assert len(s.latents) > 2 * (SINK + WINDOW) and int(cache.num_frames().max()) == SINK + WINDOW


@pytest.mark.parametrize("sink,window", [(1, 2), (0, 4), (2, 0)])
def test_frame_granular_windows_roll_frame_by_frame(sink, window):
    """Sink and window in frames, as Self-Forcing's ``sink_size`` / ``local_attn_size`` count them
    (sink 1 + window 2 + a chunk of 3 is ``local_attn_size=6``): one layer, 6 chunks, every pass
    equals the stock transformer where the chunk attends to the ``sink`` first and ``window``
    last committed frames and itself at positions 0, 1, ... (1e-5); the same reference with a
    window one frame wider misses by more than 1e-3 once the cache rolls."""
    model, stock = wrapped(1)
    cache = model.new_cache(1, sink, window, HW)
    s = Stream(model, cache, prompts(1))

    def reference(frames, x, times):
        latents, t = s.inputs(frames, x, times)
        group = torch.tensor([0] * len(frames) + [1] * CHUNK).repeat_interleave(P)  # the chunk sees all
        mask = (group[None, :] <= group[:, None])[None, None]
        out = stock_forward(stock, latents, t, s.prompt, Masked(stock.blocks[0].attn1.processor, mask))
        return out[:, len(frames):]

    worst, shifted = 0.0, 0.0
    for c in range(6):
        frames = visible(len(s.latents), sink, window)
        wider = visible(len(s.latents), sink, window + 1)
        assert cache.num_frames().tolist() == [len(frames)]

        def check(x, times, out):
            nonlocal worst, shifted
            worst = max(worst, (out - reference(frames, x, times)).abs().max().item())
            if wider != frames:
                shifted = max(shifted, (out - reference(wider, x, times)).abs().max().item())
        s.chunk(check=check)
    assert worst < ATOL, worst
    assert shifted > 1e-3, shifted
    assert int(cache.num_frames().max()) == sink + window


def test_two_layers_equal_the_dense_forward_until_the_first_eviction_then_the_rolling_definition():
    """Two layers, 8 chunks: chunks that never saw a roll equal the dense chunk-causal forward over
    every frame so far; every chunk equals the rolling definition (grouped reference); after the
    first eviction a from-scratch recompute over the kept frames differs by more than 1e-3."""
    model, stock = wrapped(2)
    cache = model.new_cache(2, SINK, WINDOW, HW)
    s = Stream(model, cache, prompts())
    before, rolling, recompute = 0.0, 0.0, 0.0
    for c in range(8):
        n = len(s.latents)
        frames = visible(n)

        def check(x, times, out):
            nonlocal before, rolling, recompute
            lat, tim = s.inputs(list(range(n)), x, times)
            want = stock_forward(stock, lat, tim, s.prompt, Grouped(stock, s.rolling_groups()))[:, n:]
            rolling = max(rolling, (out - want).abs().max().item())
            scratch = dense_block_causal(stock, *s.inputs(frames, x, times), s.prompt)[:, len(frames):]
            if n <= SINK + WINDOW:
                before = max(before, (out - scratch).abs().max().item())
            else:
                recompute = max(recompute, (out - scratch).abs().max().item())
        s.chunk(check=check)
    assert before < ATOL and rolling < ATOL, (before, rolling)
    assert recompute > 1e-3


def test_absolute_positions_are_self_forcings_and_break_the_cache_order_reference():
    """The deliberately broken variant of test 1: keys rotated at their absolute frame index and
    never re-rotated (``position_policy="absolute"``) equals the cache-order reference until the
    first eviction, then differs by more than 1e-3. It is Self-Forcing's released rule: it equals
    the reference at absolute positions (grouped) throughout, within 1e-5."""
    model, stock = wrapped(1, position_policy="absolute")
    cache = model.new_cache(2, SINK, WINDOW, HW)
    assert cache.rope is None
    s = Stream(model, cache, prompts())
    before, after, own = 0.0, 0.0, 0.0
    for c in range(7):
        n = len(s.latents)
        frames = visible(n)

        def check(x, times, out):
            nonlocal before, after, own
            want = dense_block_causal(stock, *s.inputs(frames, x, times), s.prompt)[:, len(frames):]
            diff = (out - want).abs().max().item()
            if n <= SINK + WINDOW:
                before = max(before, diff)
            else:
                after = max(after, diff)
            lat, tim = s.inputs(list(range(n)), x, times)
            ref = stock_forward(stock, lat, tim, s.prompt, Grouped(stock, s.rolling_groups(absolute=True)))[:, n:]
            own = max(own, (out - ref).abs().max().item())
        s.chunk(check=check)
    assert before < ATOL and own < ATOL, (before, own)
    assert after > 1e-3
    assert cache.frames_streamed == 21
    # one layer: a re-cache under the same prompt rewrites the kept frames' rotated K/V unchanged,
    # so it rotates each at the absolute index it had (sink 0..2, window 15..20)
    kept = (SINK + WINDOW) * P
    k, v = cache.k[..., :kept, :].clone(), cache.v[..., :kept, :].clone()
    assert recache(model, cache, s.prompt, keep_sink=False) == SINK + WINDOW
    assert (cache.k[..., :kept, :] - k).abs().max() < ATOL and (cache.v[..., :kept, :] - v).abs().max() < ATOL


# -- 2. cross-attention K/V once per prompt; re-cache ------------------------------------------
def count_kv(transformer):
    counts = {"k": 0, "v": 0}

    def hook(name):
        def bump(module, args, out):
            counts[name] += 1
        return bump
    for block in transformer.blocks:
        block.attn2.to_k.register_forward_hook(hook("k"))
        block.attn2.to_v.register_forward_hook(hook("v"))
    return counts


def test_prompt_kv_once_per_prompt_and_recache_equals_a_fresh_prefill():
    """5 chunks x (2 steps + clean pass) under one prompt (also handed over as equal copies, as a
    guided sampler rebuilds ``[cond; uncond]`` each chunk): each layer's ``attn2.to_k``/``to_v``
    run once. A switch: ``recache`` under the new prompt runs them once more, the chunks after it
    none; an in-place edit of the prompt recomputes. After the re-cache the cache's K/V and the
    next chunk equal a fresh prefill of the kept frames under the new prompt (1e-5)."""
    model, _ = wrapped(2)
    counts = count_kv(model.transformer)
    L = model.num_layers
    cache = model.new_cache(2, SINK, WINDOW, HW)
    old, new = prompts(seed=5), prompts(seed=6)
    s = Stream(model, cache, old)
    for c in range(5):
        s.prompt = old if c % 2 else old.clone()
        s.chunk()
    assert counts == {"k": L, "v": L}

    assert recache(model, cache, new, keep_sink=False) == SINK + WINDOW
    assert counts == {"k": 2 * L, "v": 2 * L}
    x = s.randn(CHUNK)
    cache.begin_chunk()
    got = model(x, 0.7, new, cache=cache)
    assert counts == {"k": 2 * L, "v": 2 * L}

    fresh = model.new_cache(2, SINK, WINDOW, HW)
    kept = visible(len(s.latents))
    for i in range(0, len(kept), CHUNK):
        x0 = torch.stack([s.latents[f] for f in kept[i:i + CHUNK]], 1)
        fresh.begin_chunk()
        model(x0, 0.0, new, cache=fresh)
        fresh.commit(x0)
    n = len(kept) * P
    assert (cache.k[..., :n, :] - fresh.k[..., :n, :]).abs().max() < ATOL
    assert (cache.v[..., :n, :] - fresh.v[..., :n, :]).abs().max() < ATOL
    fresh.begin_chunk()
    assert (got - model(x, 0.7, new, cache=fresh)).abs().max() < ATOL
    assert counts == {"k": 2 * L, "v": 2 * L}

    new.mul_(2.0)  # same tensor, new content: recomputed
    model(x, 0.7, new, cache=fresh)
    assert counts == {"k": 3 * L, "v": 3 * L}
    with torch.enable_grad():  # no memo where autograd records: a kept graph would outlive its call
        model(x, 0.7, new, cache=fresh)
    assert counts == {"k": 4 * L, "v": 4 * L}


def test_drop_in_for_the_video_adapters_sample_chunk_with_guidance():
    """``sample_chunk`` (diffusers' flow-match scheduler, guidance 3 on [cond; uncond] rows) runs
    the Wan model unchanged: one prompt's K/V computed once over 4 chunks, outputs finite."""
    model, _ = wrapped(2)
    counts = count_kv(model.transformer)
    cache = model.new_cache(2, SINK, WINDOW, HW)
    sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(shift=3.0), 2)
    cond, null = prompts(1, seed=7), torch.zeros(1, 8, 16)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = sample_chunk(model, cache, torch.randn(1, CHUNK, 4, *HW, generator=g), cond, sampler, 3.0, null)
        assert x.shape == (1, CHUNK, 4, *HW) and torch.isfinite(x).all()
    assert counts == {"k": model.num_layers, "v": model.num_layers}


def test_video_adapters_streams_run_wan_and_one_layer_rolling_equals_recompute():
    """The video adapter's ``CachedStream`` (rolling) and ``RecomputeStream`` (window recompute
    through a fresh cache per step) both drive the Wan model; with one layer they agree over 7
    chunks, the last four after the cache rolled (1e-5)."""
    from mmspec.adapters.video import CachedStream, RecomputeStream

    model, _ = wrapped(1)
    sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(), 2)
    streams = [kind(model, 1, SINK, WINDOW, latent_hw=HW) for kind in (CachedStream, RecomputeStream)]
    e, g = prompts(1), torch.Generator().manual_seed(0)
    for _ in range(7):
        noise = torch.randn(1, CHUNK, 4, *HW, generator=g)
        a, b = (st.sample(noise, e, None, sampler, 1.0) for st in streams)
        assert (a - b).abs().max() < ATOL
    assert streams[0].frames() == streams[1].frames() == SINK + WINDOW


# -- no mask where none is needed ------------------------------------------------------------------
def test_a_one_chunk_step_hands_sdpa_no_mask_and_others_keep_theirs(monkeypatch):
    """Every cached one-chunk step (the chunk over the kept frames and itself, bidirectional: an
    all-true mask) hands ``scaled_dot_product_attention`` ``attn_mask=None`` in every
    self-attention layer, so a GPU can take its flash kernels; the outputs equal those of the same
    steps with an all-true mask given (measured: bit for bit). Steps whose mask is not all true
    keep it: a re-cache of three chunks, and the cache-less ``chunk_causal`` forward over two
    chunks (over one it is the stock call: no mask)."""
    model, _ = wrapped(2)
    e = prompts(2, L=5)  # 5 prompt keys: never a whole number of 4-token frames
    real, force, calls = F.scaled_dot_product_attention, [False], []

    def sdpa(query, key, value, attn_mask=None, **kwargs):
        if key.shape[-2] != 5:  # self-attention
            calls.append(attn_mask)
            if force[0] and attn_mask is None:
                attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool)
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)

    def run():
        cache, g, outs = model.new_cache(2, SINK, WINDOW, HW), torch.Generator().manual_seed(0), []
        for _ in range(5):  # the cache rolls from the fourth chunk on
            cache.begin_chunk()
            x = torch.randn(2, CHUNK, 4, *HW, generator=g)
            outs += [model(x, torch.rand(2, CHUNK, generator=g), e, cache=cache), model(x, 0.0, e, cache=cache)]
            cache.commit(x)
        return outs, cache

    plain, cache = run()
    assert len(calls) == 10 * model.num_layers and all(m is None for m in calls)
    force[0] = True
    masked, _ = run()
    assert all(torch.equal(a, b) for a, b in zip(plain, masked))
    force[0] = False
    calls.clear()
    recache(model, cache, e, keep_sink=False)  # 9 frames: three chunks, chunk-causal
    assert len(calls) == model.num_layers and all(m is not None and not bool(m.all()) for m in calls)
    calls.clear()
    x = torch.randn(2, 2 * CHUNK, 4, *HW, generator=torch.Generator().manual_seed(1))
    model(x, 0.5, e, chunk_causal=True)
    assert len(calls) == model.num_layers and all(m is not None and not bool(m.all()) for m in calls)
    calls.clear()
    assert torch.equal(model(x[:, :CHUNK], 0.5, e, chunk_causal=True), model(x[:, :CHUNK], 0.5, e))
    assert len(calls) == 2 * model.num_layers and all(m is None for m in calls)


# -- a window of every frame so far -------------------------------------------------------------
def test_check_window_takes_none_or_minus_one_for_every_frame():
    """None and -1 (the reference repositories' ``local_attn_size=-1``) both mean every frame so
    far (returned as None); other values are refused in one line naming ``window_frames``."""
    assert check_window(3, 0, None, 1024) is None and check_window(3, 2, -1, 1024) is None
    assert check_window(3, 1, 2, 1024) == 2
    for bad in (-2, 1.5, "x", True):
        with pytest.raises(ValueError, match=r"window_frames must be an int >= 0 \(latent frames\), or None or -1 "
                                             r"\(every frame so far\), got") as err:
            check_window(3, 0, bad, 1024)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"sink_frames \+ window_frames must be at most 1021 frames"):
        check_window(3, 1022, -1, 1024)


def test_a_window_of_every_frame_grows_then_stops_at_the_rope_positions():
    """A Wan of 40 temporal RoPE positions (``frame_limit``: 36 frames, one chunk short of them).
    ``CachedStream`` with window None at sink 3 (a window of four chunks that doubles, as
    ``full-cache``'s; it grows twice) gives, chunk for chunk and bit for bit, the stream with a
    fixed window of 33 (sink + window = 36: nothing ever evicted); ``RecomputeStream`` with window
    None follows it at two layers (nothing evicted, 1e-5); a window of 27 (it rolls) differs in
    the last chunk. The chunk past 36 frames is refused by both with ``CacheLimitError``."""
    from mmspec.adapters.video import CacheLimitError, CachedStream, RecomputeStream, frame_limit

    model = WanVideoModel(tiny_wan(2, rope_max_seq_len=40))
    assert frame_limit(model) == 36
    sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(), 2)
    every = CachedStream(model, 1, SINK, None, latent_hw=HW)
    fixed, narrow = (CachedStream(model, 1, SINK, w, latent_hw=HW) for w in (33, 27))
    recompute = RecomputeStream(model, 1, SINK, None, latent_hw=HW)
    e, g = prompts(1), torch.Generator().manual_seed(0)
    windows = set()
    for c in range(12):
        noise = torch.randn(1, CHUNK, 4, *HW, generator=g)
        a, b, r, n = (st.sample(noise, e, None, sampler, 1.0) for st in (every, fixed, recompute, narrow))
        assert torch.equal(a, b) and (a - r).abs().max() < ATOL
        windows.add(every.cache.window_frames)
    assert (a - n).abs().max() > 1e-3
    assert windows == {12, 24, 33} and every.frames() == fixed.frames() == recompute.frames() == 36
    for st in (every, recompute):
        with pytest.raises(CacheLimitError, match="stops at 36 frames: one more chunk would put keys past the 40 "
                                                  "frame positions") as err:
            st.sample(noise, e, None, sampler, 1.0)
        assert err.value.frames == 36 and "\n" not in str(err.value)


# -- 3. the original key layout ----------------------------------------------------------------
ORIGINAL_NAMES = [  # diffusers -> Wan / CausalWanModel, the inverse of convert_wan_transformer_to_diffusers
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"), ("attn2", "cross_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("norm2", "norm__swap"), ("norm3", "norm2"), ("norm__swap", "norm3"),
    ("proj_out", "head.head"),
]


def to_original_names(state_dict):
    out = {}
    for key, value in state_dict.items():
        for a, b in ORIGINAL_NAMES:
            key = key.replace(a, b)
        key = "head.modulation" if key == "scale_shift_table" else key.replace(".scale_shift_table", ".modulation")
        out[key] = value.clone()
    return out


def test_original_key_layout_loads_through_diffusers_converter(tmp_path):
    """The tiny model's weights in Wan's own names (``blocks.0.self_attn.q.weight``, ...), loaded by
    ``load_original_wan`` from a dict and from a safetensors file with Self-Forcing's ``model.``
    prefix, stream bit-identically to the diffusers-layout model."""
    model, _ = wrapped(2)
    original = to_original_names(model.transformer.state_dict())
    for key in ("patch_embedding.weight", "text_embedding.0.weight", "time_embedding.2.bias",
                "time_projection.1.weight", "blocks.0.self_attn.q.weight", "blocks.1.self_attn.norm_k.weight",
                "blocks.0.cross_attn.o.bias", "blocks.0.norm3.weight", "blocks.1.ffn.0.weight",
                "blocks.1.ffn.2.bias", "blocks.0.modulation", "head.head.weight", "head.modulation"):
        assert key in original
    assert not any(w in k for k in original for w in ("attn1", "attn2", "to_", "condition_embedder",
                                                      "scale_shift_table", "proj_out", "ffn.net", "norm2"))
    path = tmp_path / "causal_wan.safetensors"
    save_file({"model." + k: v for k, v in original.items()}, str(path))
    config = dict(model.transformer.config)
    x = torch.randn(1, CHUNK, 4, *HW, generator=torch.Generator().manual_seed(3))
    e = prompts(1)

    def stream(m):
        cache, outs = m.new_cache(1, SINK, WINDOW, HW), []
        for _ in range(4):
            cache.begin_chunk()
            outs.append(m(x, 0.6, e, cache=cache))
            m(x, 0.0, e, cache=cache)
            cache.commit(x)
        return torch.cat(outs, 1)

    want = stream(model)
    for source in (original, path):
        loaded = load_original_wan(source, config)
        assert isinstance(loaded, WanTransformer3DModel)
        assert torch.equal(stream(WanVideoModel(loaded)), want)
    with pytest.raises(ValueError, match="state_dict_or_path must be the original Wan keys of this config"):
        load_original_wan({k: v for k, v in original.items() if k != "head.modulation"}, config)
    with pytest.raises(ValueError, match="state_dict_or_path must be a dict or an existing .safetensors file"):
        load_original_wan(tmp_path / "model.pt", config)


# -- 4. streaming VAE decode -------------------------------------------------------------------
def tiny_vae():
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
                            latents_std=[1.5, 0.5, 2.0, 1.0]).eval()


def test_streaming_decode_equals_decoding_the_clip_at_once():
    """7 latent frames decoded as chunks of 1, 3 and 3 (then 3, 3 and 1 after ``reset``) equal
    ``AutoencoderKLWan.decode`` of the whole clip de-normalised as ``WanPipeline`` does (25 pixel
    frames: 1 + 4 per later latent): bit-identical, float32."""
    vae = tiny_vae()
    z = torch.randn(2, 7, 4, 4, 4, generator=torch.Generator().manual_seed(0))  # (B, n, C, h, w)
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    want = vae.decode(z.permute(0, 2, 1, 3, 4) / inv_std + mean, return_dict=False)[0].permute(0, 2, 1, 3, 4)
    assert want.shape == (2, 25, 3, 32, 32)
    decoder = WanStreamingDecoder(vae)
    for cuts in ((1, 3, 3), (3, 3, 1)):
        decoder.reset()
        parts, start = [], 0
        for n in cuts:
            parts.append(decoder.decode(z[:, start:start + n]))
            assert parts[-1].shape[1] == 4 * n - (3 if start == 0 else 0)
            start += n
        assert torch.equal(torch.cat(parts, 1), want)


# -- 5. memory and positions over a long stream ------------------------------------------------
def test_two_thousand_frames_keep_memory_and_positions_bounded():
    """2001 frames (667 chunks, 1 step each, through ``sample_chunk``) of the 2-layer model at the
    smallest latent size (2 x 2: one token per frame): after the first eviction ``nbytes`` never
    changes, the cache holds sink + window frames, and the frames' cache positions stay below
    sink + window + chunk frames (< rope_frames = 1024), far past Wan's table length."""
    model, _ = wrapped(2)
    cache = model.new_cache(1, SINK, WINDOW, (2, 2))
    sampler = FlowSampler(FlowMatchEulerDiscreteScheduler(), 1)
    e = prompts(1)
    g = torch.Generator().manual_seed(0)
    nbytes, top = None, 0
    while cache.frames_streamed < 2000:
        top = max(top, int(cache.next_positions().max()) + CHUNK)  # cache frame positions of this chunk, + 1
        x = sample_chunk(model, cache, torch.randn(1, CHUNK, 4, 2, 2, generator=g), e, sampler)
        if cache.frames_streamed > SINK + WINDOW:
            nbytes = nbytes or cache.nbytes()
            assert cache.nbytes() == nbytes and int(cache.num_frames()[0]) == SINK + WINDOW
    assert torch.isfinite(x).all() and cache.frames_streamed == 2001
    assert top == SINK + WINDOW + CHUNK < model.rope_frames


def test_absolute_positions_refuse_past_the_rope_table():
    """``position_policy="absolute"`` streams frames 0 .. 1022 (341 chunks), then refuses the chunk
    at frames 1023 .. 1025 before running anything, naming the bound and the way out."""
    model, _ = wrapped(1, position_policy="absolute")
    cache = model.new_cache(1, SINK, WINDOW, (2, 2))
    e = prompts(1)
    x = torch.randn(1, CHUNK, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    for _ in range(341):
        cache.begin_chunk()
        model(x, 0.0, e, cache=cache)
        cache.commit(x)
    assert cache.frames_streamed == 1023
    cache.begin_chunk()
    with pytest.raises(ValueError, match=r"latents must be frames within the 1024 temporal RoPE positions .*"
                                         r"use 'cache-order' .*got 'frames 1023..1025'") as err:
        model(x, 0.0, e, cache=cache)
    assert "\n" not in str(err.value)


# -- 6. bad input --------------------------------------------------------------------------------
def test_bad_input_is_refused_before_any_forward():
    """Each refusal is one line naming the argument, raised before the transformer runs."""
    model, _ = wrapped(1)
    runs = []
    model.transformer.register_forward_pre_hook(lambda *a: runs.append(1))
    cache = model.new_cache(1, SINK, WINDOW, HW)
    cache.begin_chunk()
    x, e = torch.zeros(1, CHUNK, 4, *HW), torch.zeros(1, 8, 16)
    cases = [
        ("latents must be the 3 frames of the cache's open chunk or re-cache",
         lambda: model(x[:, :2], 0.5, e, cache=cache)),
        ("sink_frames \\+ window_frames must be at most 1021", lambda: model.new_cache(1, 3, 1020, HW)),
        ("latents must be a latent height and width divisible by the patch size 2",
         lambda: model(torch.zeros(1, CHUNK, 4, 5, 4), 0.5, e, cache=cache)),
        ("latent_hw must be a latent height and width divisible by the patch size 2",
         lambda: model.new_cache(1, SINK, WINDOW, (4, 5))),
        ("position_policy must be one of 'cache-order', 'absolute'",
         lambda: WanVideoModel(tiny_wan(1), position_policy="relative")),
        ("prompt_embeds must be a \\(1, length, 16\\) tensor",
         lambda: model(x, 0.5, torch.zeros(1, 8, 15), cache=cache)),
        ("chunk_frames must be an int >= 1", lambda: WanVideoModel(tiny_wan(1), chunk_frames=0)),
        ("patch_size must be \\(1, p, p\\)", lambda: WanVideoModel(tiny_wan(1, patch_size=(2, 2, 2)))),
        ("window_frames must be an int >= 0 \\(latent frames\\), or None or -1", lambda: model.new_cache(1, 3, -2, HW)),
        ("window_frames must be an int >= 0 for new_cache \\(every frame so far, None or -1, is a cache that grows",
         lambda: model.new_cache(1, 3, -1, HW)),
        ("t must be a number, \\(1,\\) or \\(1, 3\\)", lambda: model(x, torch.zeros(1, 2), e, cache=cache)),
        ("latents must be frames of the cache's 4 tokens", lambda: model(torch.zeros(1, 3, 4, 2, 2), 0.5, e,
                                                                         cache=cache)),
        ("transformer must be a transformer no WanVideoModel wraps already", lambda: WanVideoModel(model.transformer)),
        ("cache must be a cache from new_cache of a position_policy='absolute' model",
         lambda: WanVideoModel(copy.deepcopy(tiny_wan(1)), position_policy="absolute")(x, 0.5, e, cache=cache)),
    ]
    for message, call in cases:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert "\n" not in str(err.value)
    assert runs == []
    model(x, 0.0, e, cache=cache)  # the open chunk was not disturbed
    cache.commit(x)
    assert isinstance(cache, SinkWindowCache) and int(cache.num_frames()[0]) == CHUNK


def test_restore_processors_gives_back_the_stock_transformer():
    model, stock = wrapped(1)
    x, e = torch.randn(1, CHUNK, 4, *HW, generator=torch.Generator().manual_seed(4)), prompts(1)
    model.restore_processors()
    assert all(type(p).__name__ == "WanAttnProcessor" for p in model.transformer.attn_processors.values())
    times = torch.full((1, CHUNK), 0.3)
    assert torch.equal(model(x, times, e), stock_forward(stock, x, times, e))
    with pytest.raises(ValueError, match="cache must be None after restore_processors"):
        model(x, 0.3, e, chunk_causal=True)


def test_chunk_causal_mask():
    mask = chunk_causal_mask(4, 2, 1, 1)[0]
    assert mask.tolist() == [[True, True, False, False], [True, True, False, False],
                             [True, True, True, True], [True, True, True, True]]


# -- text ----------------------------------------------------------------------------------------
def test_encode_prompts_matches_wan_pipeline():
    """UMT5 embeddings equal ``WanPipeline._get_t5_prompt_embeds`` (padding, zeroed rows past the
    mask, the cleaned text), with ``None`` and ``""`` both the null prompt."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "red", "ball", "rolls", "left", "fast"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                          num_heads=2, relative_attention_num_buckets=8)).eval()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=tiny_vae(),
                       scheduler=FlowMatchEulerDiscreteScheduler(), transformer=tiny_wan(1))
    texts = ["a  red ball rolls left", "a ball rolls fast fast fast fast fast fast", ""]
    want = pipe._get_t5_prompt_embeds(texts, max_sequence_length=7, device=torch.device("cpu"))
    got = encode_prompts(texts[:2] + [None], encoder, tokenizer, max_length=7)
    assert got.shape == (3, 7, 16) and torch.equal(got, want)
    assert (got[0, 6:] == 0).all() and (got[2, 1:] == 0).all() and got[2, 0].abs().sum() > 0
    with pytest.raises(ValueError, match="max_length must be an int >= 1"):
        encode_prompts("a", encoder, tokenizer, max_length=0)
