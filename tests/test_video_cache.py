"""The core's rolling cache at frame granularity, as a chunk-causal video model uses it through
the video adapter's ``VideoChunkCache``.

A tiny chunk-attention model (defined here: per-frame prompt and time conditioning, ``Rope3D``
over (frame, row, column), one or two attention layers) runs Self-Forcing's loop through
``VideoChunkCache``: ``begin_chunk``, denoising steps that overwrite the chunk's slots, a clean
t = 0 pass, ``commit(latents)``. Its reference path attends by explicit *groups* (query frames,
key frames at positions 0, 1, ... in the listed order), with no cache at all, so every claim
below is checked against a computation that shares no buffer, gather or eviction arithmetic with
the cache. Tolerance 1e-5 (float32); the tests that need it show a wrong context or position
moves the output by far more.

What holds, by depth:
- one layer: a cached frame's K/V depend on the frame alone (and its prompt and time), so after
  any number of rolls the next chunk equals a from-scratch forward over the visible frames (sink
  + window) at positions 0, 1, ...;
- deeper: layer >= 1 K/V of a window frame were computed while older, since evicted frames were
  visible, so a from-scratch recompute differs (measured below: > 1e-3). What holds exactly is
  the rolling definition: every chunk's K/V computed, when it was committed, over the sink and
  window of that moment, at cache-order positions. After a re-cache the cache is a fresh prefill
  of the visible frames, so the next chunk equals the from-scratch recompute again.
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mmspec.adapters.video import VideoChunkCache, chunk_causal_mask
from mmspec.core import SinkWindowCache
from mmspec.core.rope import Rope3D

ATOL = 1e-5
C_LAT, GRID = 3, (2, 2)  # a latent frame: 2 x 2 tokens of 3 channels
P = GRID[0] * GRID[1]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


class ChunkAttention(nn.Module):
    """latents (B, F, P, C) at flow times (B, F) under prompt ids (B, F) -> (B, F, P, C)."""

    def __init__(self, n_layers: int, dim: int = 32, heads: int = 2, grid=GRID, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.grid = heads, grid
        self.embed = nn.Linear(C_LAT, dim)
        self.prompt = nn.Embedding(4, dim)
        self.time = nn.Linear(1, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(n_layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
                                 for _ in range(n_layers))
        self.head = nn.Linear(dim, C_LAT)
        self.rope = Rope3D(dim // heads, theta=100.0, frame_shape=grid)
        self.eval()

    @property
    def frame_size(self):
        return self.grid[0] * self.grid[1]

    def new_cache(self, batch_size, sink, window, chunk, latents=True):
        return VideoChunkCache(len(self.qkv), batch_size, self.heads, self.embed.out_features // self.heads,
                               sink, window, rope=self.rope, frame_size=self.frame_size, chunk=chunk,
                               latent_shape=(P, C_LAT) if latents else None)

    def forward(self, latents, t, prompt, cache=None, groups=None, block_mask=None):
        """With ``cache``: one block at the cache's next positions (``block_mask`` its in-block
        visibility, the cache's default when None). With ``groups`` [(query frames,
        key frames)]: each query frame attends exactly to its group's key frames (which include
        it), keys at positions 0, 1, ... in the listed order."""
        B, Fr, Pn, _ = latents.shape
        t = torch.as_tensor(t, dtype=torch.float32).expand(B, Fr)
        prompt = torch.as_tensor(prompt).expand(B, Fr)
        cond = self.prompt(prompt) + self.time(t[..., None])  # (B, F, dim)
        x = (self.embed(latents) + cond[:, :, None]).flatten(1, 2)  # (B, T, dim)
        j = torch.arange(Pn)
        if cache is not None:
            step = cache.step(cache.next_positions()[:, None] + torch.arange(Fr * Pn), block_mask)
        for layer, (qkv, out, mlp) in enumerate(zip(self.qkv, self.out, self.mlp)):
            q, k, v = qkv(x).view(B, Fr * Pn, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
            if cache is not None:
                q, k, v = step.update(layer, q, k, v)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask)
            else:
                y = torch.empty_like(q)
                for query, keys in groups:
                    qi = (torch.tensor(query)[:, None] * Pn + j).flatten()
                    ki = (torch.tensor(keys)[:, None] * Pn + j).flatten()
                    q_pos = (torch.tensor([keys.index(f) for f in query])[:, None] * Pn + j).flatten()
                    k_pos = torch.arange(len(ki))
                    y[:, :, qi] = F.scaled_dot_product_attention(self.rope(q[:, :, qi], q_pos.expand(B, -1)),
                                                                 self.rope(k[:, :, ki], k_pos.expand(B, -1)),
                                                                 v[:, :, ki])
            x = x + out(y.transpose(1, 2).flatten(2))
            x = x + mlp(x)
        return self.head(x).view(B, Fr, Pn, C_LAT)


def visible(n, sink, window):
    """Frames a chunk starting at frame n sees: the first ``sink`` and the last ``window``."""
    return list(range(n)) if n <= sink + window else list(range(sink)) + list(range(n - window, n))


def chunk_causal(frames, chunk):
    """Groups of a from-scratch forward over ``frames`` (whole chunks): chunk i sees chunks <= i."""
    return [(frames[i:i + chunk], frames[:i + chunk]) for i in range(0, len(frames), chunk)]


class Stream:
    """Self-Forcing's loop over a cache, recording what was committed (clean latents, prompts)."""

    def __init__(self, model, cache, batch=2, seed=0):
        self.model, self.cache, self.B = model, cache, batch
        self.g = torch.Generator().manual_seed(seed)
        self.latents, self.prompts = [], []  # per committed frame: (B, P, C), (B,)

    def randn(self, frames):
        return torch.randn(self.B, frames, P, C_LAT, generator=self.g)

    def chunk(self, prompt, steps=2, check=None):
        """One chunk: ``steps`` denoising passes (random inputs at t = 1, 1 - 1/steps, ...), each
        handed to ``check(x, t, out)``, then the clean pass and the commit. Returns x0."""
        C = self.cache.chunk
        self.cache.begin_chunk()
        for s in range(steps):
            x, t = self.randn(C), 1.0 - s / steps
            out = self.model(x, t, prompt, cache=self.cache)
            if check is not None:
                check(x, t, out)
        x0 = self.randn(C)
        self.model(x0, 0.0, prompt, cache=self.cache)
        self.cache.commit(x0)
        self.latents += list(x0.unbind(1))
        self.prompts += [torch.as_tensor(prompt).expand(self.B)] * C
        return x0

    def inputs(self, frames, x=None, t=None, prompt=None):
        """Latents, times and prompts of committed ``frames`` (clean, t = 0), then a query chunk."""
        lat = [self.latents[f] for f in frames]
        times = [torch.zeros(self.B)] * len(frames)
        prompts = [self.prompts[f] for f in frames]
        if x is not None:
            lat += list(x.unbind(1))
            times += [torch.full((self.B,), t)] * x.shape[1]
            prompts += [torch.as_tensor(prompt).expand(self.B)] * x.shape[1]
        return torch.stack(lat, 1), torch.stack(times, 1), torch.stack(prompts, 1)

    def scratch(self, frames, x, t, prompt):
        """From scratch over ``frames`` + the query chunk, chunk-causal at positions 0, 1, ...:
        the query chunk's output."""
        C = x.shape[1]
        n = len(frames)
        out = self.model(*self.inputs(frames, x, t, prompt), groups=chunk_causal(list(range(n + C)), C))
        return out[:, n:]

    def rolling(self, x, t, prompt, sink, window):
        """The rolling definition over the whole history: committed chunk c attended (when it was
        committed) to ``visible(c)`` and itself, as does the query chunk: its output."""
        C, N = x.shape[1], len(self.latents)
        groups = [(list(range(s, s + C)), visible(s, sink, window) + list(range(s, s + C)))
                  for s in range(0, N + C, C)]
        return self.model(*self.inputs(range(N), x, t, prompt), groups=groups)[:, N:]


# -- one layer: every roll equals a from-scratch recompute -----------------------------------
@pytest.mark.parametrize("sink,window,chunk", [(2, 4, 2), (0, 4, 2), (3, 3, 3), (2, 2, 1)])
def test_one_layer_roll_equals_recompute(sink, window, chunk):
    """20+ chunks through sink + window (several full wrap-arounds of the window, and sink = 0):
    every denoising pass equals a from-scratch forward over the visible frames at positions
    0, 1, ... (the query chunk after them); the cache holds at most sink + window frames."""
    model = ChunkAttention(1)
    cache = model.new_cache(2, sink, window, chunk)
    s = Stream(model, cache)
    n_chunks = max(20, 4 * (sink + window) // chunk)
    worst = 0.0
    for c in range(n_chunks):
        frames = visible(len(s.latents), sink, window)
        assert cache.num_frames().tolist() == [len(frames)] * 2

        def check(x, t, out):
            nonlocal worst
            want = s.scratch(frames, x, t, c % 4)
            worst = max(worst, (out - want).abs().max().item())
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
        s.chunk(c % 4, check=check)
        assert int(cache.num_frames().max()) <= sink + window
    assert len(s.latents) > 2 * (sink + window)  # it rolled, many times
    if sink:  # the kept frames really are re-positioned: at their original frame indices it differs
        x, t, n = s.randn(chunk), 0.5, len(s.latents)
        cache.begin_chunk()
        got = model(x, t, 1, cache=cache)
        assert (got - at_original_indices(model, s, visible(n, sink, window), x, t, 1)).abs().max() > 100 * ATOL


def at_original_indices(model, s, frames, x, t, prompt):
    """One layer: the query chunk's output with the visible ``frames`` at their original frame
    indices (a cache that never re-positions), the query chunk right after the last frame."""
    n, C = len(s.latents), x.shape[1]
    lat, times, prompts = s.inputs(frames, x, t, prompt)
    idx = list(frames) + list(range(n, n + C))
    full = [torch.zeros(x.shape[0], n + C, P, C_LAT), torch.zeros(x.shape[0], n + C),
            torch.zeros(x.shape[0], n + C, dtype=torch.long)]  # filler frames are never keys
    for buf, val in zip(full, (lat, times, prompts)):
        buf[:, idx] = val
    return _grouped_at(model, *full, list(range(n, n + C)), idx)


def _grouped_at(model, lat, times, prompts, query, keys):
    """Like the model's group path, but key positions are the frames' own indices (no re-count)."""
    B, Fr = lat.shape[:2]
    cond = model.prompt(prompts) + model.time(times[..., None])
    x = (model.embed(lat) + cond[:, :, None]).flatten(1, 2)
    j = torch.arange(P)
    qi = (torch.tensor(query)[:, None] * P + j).flatten()
    ki = (torch.tensor(keys)[:, None] * P + j).flatten()
    for qkv, out, mlp in zip(model.qkv, model.out, model.mlp):
        q, k, v = qkv(x).view(B, Fr * P, 3, model.heads, -1).permute(2, 0, 3, 1, 4)
        y = torch.zeros_like(q)
        y[:, :, qi] = F.scaled_dot_product_attention(model.rope(q[:, :, qi], qi.expand(B, -1)),
                                                     model.rope(k[:, :, ki], ki.expand(B, -1)), v[:, :, ki])
        x = x + out(y.transpose(1, 2).flatten(2))
        x = x + mlp(x)
    return model.head(x).view(B, Fr, P, C_LAT)[:, query]


def test_key_positions_are_cache_order_frames():
    """The keys a chunk reads are rotated at token position ``frame * P + j``: frame = the
    frame's place in the cache (sink first), j = the token's place in the frame (Rope3D's time,
    row and column), however long the stream."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(1)
    cache = model.new_cache(1, sink, window, chunk)
    s = Stream(model, cache, batch=1)
    for c in range(12):
        s.chunk(0)
    cache.begin_chunk()
    step = cache.step(cache.next_positions()[:, None] + torch.arange(chunk * P))
    frames = sink + window + chunk
    assert step.key_positions.tolist() == [list(range(frames * P))]
    assert step.positions.tolist() == [list(range((sink + window) * P, frames * P))]
    coords = torch.stack(model.rope.coordinates(step.key_positions)[0].unbind(0), -1)[0]  # (S, 3) (t, h, w)
    assert coords[::P, 0].tolist() == list(range(frames))
    assert coords[:P, 1:].tolist() == [[h, w] for h in range(GRID[0]) for w in range(GRID[1])]


# -- Self-Forcing's write semantics ----------------------------------------------------------
def test_denoising_steps_overwrite_without_advancing():
    """Denoising passes leave no trace: a cache that ran 3 noisy passes per chunk before the clean
    pass holds bit for bit the K/V, latents and lengths of one that ran only the clean passes,
    through 15 chunks of rolling; during the passes nothing advances."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(2)
    noisy, clean = model.new_cache(2, sink, window, chunk), model.new_cache(2, sink, window, chunk)
    g = torch.Generator().manual_seed(0)
    for c in range(15):
        before = noisy.next_positions()
        noisy.begin_chunk()
        clean.begin_chunk()
        for _ in range(3):
            model(torch.randn(2, chunk, P, C_LAT, generator=g), 0.7, 1, cache=noisy)
            assert torch.equal(noisy.next_positions(), before) and torch.equal(noisy.lengths, before)
        x0 = torch.randn(2, chunk, P, C_LAT, generator=g)
        for cache in (noisy, clean):
            model(x0, 0.0, 2, cache=cache)
            cache.commit(x0)
        n = int(noisy.lengths.max())
        assert n == min(c + 1, (sink + window) // chunk) * chunk * P
        assert torch.equal(noisy.lengths, clean.lengths)
        assert torch.equal(noisy.k[..., :n, :], clean.k[..., :n, :])
        assert torch.equal(noisy.v[..., :n, :], clean.v[..., :n, :])
        assert torch.equal(noisy.latents[:, :n // P], clean.latents[:, :n // P])
    # the last noisy pass really was written (and seen by the chunk itself): it differs from clean
    noisy.begin_chunk()
    model(torch.randn(2, chunk, P, C_LAT, generator=g), 0.7, 1, cache=noisy)
    assert (noisy.k[..., n:n + chunk * P, :] - clean.k[..., n:n + chunk * P, :]).abs().max() > 1e-2


def test_token_path_equals_chunk_path():
    """``frame_size`` is a generalisation, not a fork: driving the same frame cache through the
    decoder-style calls (``step`` advances, ``truncate`` back after a noisy pass, ``truncate``
    to commit and roll; the chunk's bidirectional mask passed explicitly, the decoder's default
    being causal) leaves bit for bit the state of ``begin_chunk`` / ``commit``."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(2)
    a, b = model.new_cache(2, sink, window, chunk), model.new_cache(2, sink, window, chunk, latents=False)
    g = torch.Generator().manual_seed(1)
    T = chunk * P
    both_ways = torch.ones(2, T, T, dtype=torch.bool)
    for c in range(9):
        x, x0 = (torch.randn(2, chunk, P, C_LAT, generator=g) for _ in range(2))
        a.begin_chunk()
        model(x, 0.5, 0, cache=a)
        model(x0, 0.0, 0, cache=a)
        a.commit(x0)
        model(x, 0.5, 0, cache=b, block_mask=both_ways)
        b.truncate(b.lengths - T)
        model(x0, 0.0, 0, cache=b, block_mask=both_ways)
        b.truncate(b.lengths)  # roll
        n = int(a.lengths.max())
        assert torch.equal(a.lengths, b.lengths)
        assert torch.equal(a.k[..., :n, :], b.k[..., :n, :]) and torch.equal(a.v[..., :n, :], b.v[..., :n, :])


# -- deeper models: what holds ---------------------------------------------------------------
def test_two_layers_follow_the_rolling_definition():
    """Two layers, sink 2 + window 4, chunks of 2, 12 chunks. Before the first eviction the cache
    equals a from-scratch forward; after it, the cache equals the rolling definition (each
    chunk's K/V computed when it was committed, over the sink and window of that moment, at
    cache-order positions) at every pass, and differs from a from-scratch forward over the
    visible frames by more than 1e-3 (layer 2's cached K/V still carry evicted frames)."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(2)
    cache = model.new_cache(2, sink, window, chunk)
    s = Stream(model, cache)
    gaps = []
    for c in range(12):
        n = len(s.latents)
        frames = visible(n, sink, window)

        def check(x, t, out):
            torch.testing.assert_close(out, s.rolling(x, t, c % 4, sink, window), atol=ATOL, rtol=0)
            gap = (out - s.scratch(frames, x, t, c % 4)).abs().max().item()
            if n <= sink + window:
                assert gap < ATOL
            else:
                gaps.append(gap)
        s.chunk(c % 4, check=check)
    assert len(gaps) == 2 * (12 - (sink + window) // chunk - 1)
    assert min(gaps) > 1e-3, gaps


def test_rolling_reference_bites():
    """The rolling definition is not vacuous: a reference with a different window (5 frames
    instead of 4) disagrees with the cache by more than 100x the tolerance."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(2)
    s = Stream(model, model.new_cache(1, sink, window, chunk), batch=1)
    for c in range(8):
        s.chunk(c % 4)
    s.cache.begin_chunk()
    x = s.randn(chunk)
    got = model(x, 0.5, 1, cache=s.cache)
    assert (got - s.rolling(x, 0.5, 1, sink, window + 1)).abs().max() > 100 * ATOL


# -- prompt switch: LongLive's re-cache ------------------------------------------------------
def fresh_prefill(model, s, frames, prompts, sink, window, chunk):
    """A new cache that committed ``frames`` (whole chunks) one chunk at a time at t = 0 under
    ``prompts`` (one per chunk): what a re-cache must reproduce."""
    cache = model.new_cache(s.B, sink, window, chunk)
    for i, p in zip(range(0, len(frames), chunk), prompts):
        x0 = torch.stack([s.latents[f] for f in frames[i:i + chunk]], 1)
        cache.begin_chunk()
        model(x0, 0.0, p, cache=cache)
        cache.commit(x0)
    return cache


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("keep_sink", [True, False])
def test_recache_equals_fresh_prefill(layers, keep_sink):
    """After 9 chunks under prompt 0 (rolled), ``begin_recache`` hands out the cached frames'
    clean latents (the window; the sink too when it is re-cached), one t = 0 pass under prompt 3
    and ``commit()`` give the K/V of a fresh prefill of the same frames at the same positions
    (sink under the old prompt when kept), to 1e-5, and so the same next chunk. The switch is
    real: the cache before the re-cache differs from that prefill by more than 1e-2."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(layers)
    cache = model.new_cache(2, sink, window, chunk)
    s = Stream(model, cache)
    for c in range(9):
        s.chunk(0)
    frames = visible(len(s.latents), sink, window)
    sink_prompt = 0 if keep_sink else 3
    fresh = fresh_prefill(model, s, frames, [sink_prompt] * (sink // chunk) + [3] * (window // chunk),
                          sink, window, chunk)
    n = int(cache.lengths.max())
    assert (cache.k[..., :n, :] - fresh.k[..., :n, :]).abs().max() > 1e-2

    latents = cache.begin_recache(keep_sink)
    redone = frames[sink:] if keep_sink else frames
    assert torch.equal(latents, torch.stack([s.latents[f] for f in redone], 1))
    model(latents, 0.0, 3, cache=cache)
    cache.commit()
    assert torch.equal(cache.lengths, fresh.lengths)
    assert torch.equal(cache.latents[:, :n // P], fresh.latents[:, :n // P])
    torch.testing.assert_close(cache.k[..., :n, :], fresh.k[..., :n, :], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.v[..., :n, :], fresh.v[..., :n, :], atol=ATOL, rtol=0)
    x = s.randn(chunk)
    outs = []
    for c in (cache, fresh):
        c.begin_chunk()
        outs.append(model(x, 0.5, 3, cache=c))
    torch.testing.assert_close(outs[0], outs[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("keep_sink", [True, False])
def test_two_layers_after_recache_equal_recompute(keep_sink):
    """A re-cache (same prompt) rebuilds a deep model's window from the visible frames only, so
    the next chunk equals the from-scratch forward over them again (the sink, committed first,
    never saw an evicted frame, so keeping it is exact too)."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(2)
    cache = model.new_cache(2, sink, window, chunk)
    s = Stream(model, cache)
    for c in range(8):
        s.chunk(1)
    model(cache.begin_recache(keep_sink), 0.0, 1, cache=cache)
    cache.commit()
    frames = visible(len(s.latents), sink, window)
    s.chunk(1, check=lambda x, t, out: torch.testing.assert_close(out, s.scratch(frames, x, t, 1), atol=ATOL,
                                                                     rtol=0))


def test_recache_of_an_empty_window():
    """Before any frame left the sink, a sink-keeping re-cache has nothing to redo: it hands out
    no latents, and commit() without a pass leaves the cache as it was."""
    model = ChunkAttention(1)
    cache = model.new_cache(1, 2, 4, 2)
    s = Stream(model, cache, batch=1)
    s.chunk(0)
    k = cache.k.clone()
    assert cache.begin_recache(keep_sink=True).shape == (1, 0, P, C_LAT)
    cache.commit()
    assert torch.equal(cache.k, k) and cache.num_frames().tolist() == [2]


# -- constant memory -------------------------------------------------------------------------
def test_memory_is_constant_over_10000_frames():
    """10,000 frames (1,000 chunks of 10 one-token frames, one denoising pass each): every tensor
    the cache holds keeps its size (and the K/V, latent and position buffers their storage),
    positions never pass sink + window + chunk frames, and a from-scratch recompute agrees now and
    then and at the end."""
    sink, window, chunk, total = 10, 20, 10, 10_000
    model = ChunkAttention(1, dim=8, grid=(1, 1))
    cache = VideoChunkCache(1, 1, 2, 4, sink, window, rope=model.rope, frame_size=1, chunk=chunk,
                            latent_shape=(1, C_LAT))
    # every tensor's size; the buffers' storage too (the (B,) lengths are replaced, not grown)
    tensors = lambda: {k: (v.data_ptr() if v.dim() > 1 else None, v.nbytes)  # noqa: E731
                       for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
    held, nbytes = tensors(), cache.nbytes()
    assert set(held) >= {"k", "v", "latents", "lengths", "pos"}
    g = torch.Generator().manual_seed(0)
    checked, top = 0, 0
    recent = []  # the last sink + window committed latents, for the recompute
    for c in range(total // chunk):
        cache.begin_chunk()
        top = max(top, int(cache.next_positions().max()) + chunk)
        x = torch.randn(1, chunk, 1, C_LAT, generator=g)
        out = model(x, 0.5, c % 4, cache=cache)
        if c % 200 == 0 or c == total // chunk - 1:
            lat = torch.stack([l for l, _ in recent], 1) if recent else torch.zeros(1, 0, 1, C_LAT)
            times = torch.cat([torch.zeros(1, len(recent)), torch.full((1, chunk), 0.5)], 1)
            prompts = torch.tensor([[p for _, p in recent] + [c % 4] * chunk])
            n = len(recent)
            want = model(torch.cat([lat, x], 1), times, prompts,
                         groups=chunk_causal(list(range(n + chunk)), chunk))[:, n:]
            torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
            checked += 1
        x0 = torch.randn(1, chunk, 1, C_LAT, generator=g)
        model(x0, 0.0, c % 4, cache=cache)
        cache.commit(x0)
        recent += [(f, c % 4) for f in x0.unbind(1)]
        if len(recent) > sink + window:
            recent = recent[:sink] + recent[-window:]
        assert tensors() == held and cache.nbytes() == nbytes
    assert checked == 6 and top == sink + window + chunk
    assert cache.num_frames().tolist() == [sink + window]


# -- bad arguments and misuse ----------------------------------------------------------------
BAD = [
    (dict(sink=-1), "sink must be an int >= 0"),
    (dict(window=-1), "window must be an int >= 0"),
    (dict(frame_size=0), "frame_size must be an int >= 1"),
    (dict(chunk=0), "chunk must be an int >= 1"),
    (dict(chunk=None, max_block=0), "max_block must be an int >= 1"),
    (dict(chunk=None, max_block=None), "max_block must be an int >= 1"),
    (dict(capacity=5), "sink + window must be <= capacity"),
    (dict(capacity=7), "max_block must be <= capacity - sink - window"),
    (dict(max_block=1), "max_block must be an int >= chunk"),
    (dict(capacity=0), "capacity must be None or an int >= 1"),
    (dict(frame_size=3), "frame_size must be the rope's frame_shape"),
    (dict(latent_shape=(4, 0)), "latent_shape must be None or a tuple of ints >= 1"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[m.split(" must")[0] + f"-{i}" for i, (_, m) in enumerate(BAD)])
def test_bad_arguments_raise_before_allocating(kwargs, message, monkeypatch):
    args = dict(sink=2, window=4, chunk=2, frame_size=P, rope=Rope3D(8, frame_shape=GRID), latent_shape=(P, 3))
    args.update(kwargs)

    def no_buffers(*a, **k):
        raise AssertionError("a buffer was allocated before the arguments were checked")
    monkeypatch.setattr(torch, "zeros", no_buffers)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        if args["chunk"] is None:  # the core's cache alone: no chunks, no latents
            del args["chunk"], args["latent_shape"]
            SinkWindowCache(1, 1, 2, 8, **args)
        else:
            VideoChunkCache(1, 1, 2, 8, **args)


def test_misuse_is_refused_and_leaves_the_cache_as_it_was():
    model = ChunkAttention(1)
    cache = model.new_cache(1, 2, 4, 2)
    s = Stream(model, cache, batch=1)
    s.chunk(0)
    state = lambda: (cache.lengths.clone(), cache.k.clone(), cache.latents.clone())  # noqa: E731
    before = state()
    with pytest.raises(RuntimeError, match="without an open chunk"):
        cache.commit()
    cache.begin_chunk()
    with pytest.raises(RuntimeError, match="begin_chunk"):
        cache.begin_chunk()
    with pytest.raises(RuntimeError, match="no step wrote"):
        cache.commit(s.randn(2))
    with pytest.raises(ValueError, match="positions must be the open block's 8 tokens"):
        model(s.randn(1), 0.5, 0, cache=cache)  # one frame of a two-frame chunk
    with pytest.raises(RuntimeError, match="truncate"):
        cache.truncate(cache.lengths)
    model(s.randn(2), 0.0, 0, cache=cache)
    with pytest.raises(ValueError, match="latents must be the chunk's clean latents"):
        cache.commit(s.randn(1))
    with pytest.raises(ValueError, match="latents must be the chunk's clean latents"):
        cache.commit()
    after = state()
    assert all(torch.equal(a, b) for a, b in zip(before[::2], after[::2]))  # lengths, latents untouched
    cache.commit(s.randn(2))  # the block stayed open: a good commit still works
    assert cache.num_frames().tolist() == [4]

    plain = model.new_cache(1, 2, 4, 2, latents=False)
    with pytest.raises(ValueError, match="latent_shape"):
        plain.begin_recache()
    tokens = SinkWindowCache(1, 1, 2, 16, sink=1, window=4, max_block=2)
    assert not hasattr(tokens, "begin_chunk")  # the core's cache has no chunk protocol (the video adapter's)


def test_grow_keeps_every_entry_and_then_holds_more():
    """A cache grown from a 4-frame window to 8 between chunks gives, chunk for chunk, the outputs,
    K/V and latents of a cache built with the 8-frame window from the start (nothing was evicted
    in either); growing is refused while a chunk is open and for a smaller window."""
    model = ChunkAttention(2)
    grown, wide = model.new_cache(1, 0, 4, 2), model.new_cache(1, 0, 8, 2)
    g = torch.Generator().manual_seed(0)
    for c in range(4):
        if c == 2:
            with pytest.raises(ValueError, match="window_frames must be an int >= the current window"):
                grown.grow(2)
            grown.grow(8)
            assert grown.window_frames == 8 and grown.capacity == wide.capacity
        x0 = torch.randn(1, 2, P, C_LAT, generator=g)
        outs = []
        for cache in (grown, wide):
            cache.begin_chunk()
            outs.append(model(x0, 0.0, 1, cache=cache))
            if c == 3 and cache is grown:
                with pytest.raises(RuntimeError, match="grow\\(\\) while a chunk or re-cache is open"):
                    cache.grow(16)
            cache.commit(x0)
        assert torch.equal(outs[0], outs[1])
        n = int(wide.lengths.max())
        assert torch.equal(grown.lengths, wide.lengths) and n == 2 * (c + 1) * P
        assert torch.equal(grown.k[..., :n, :], wide.k[..., :n, :])
        assert torch.equal(grown.latents[:, :n // P], wide.latents[:, :n // P])
    assert grown.nbytes() == wide.nbytes()


def test_a_one_chunk_step_hands_sdpa_no_mask():
    """``CacheStep.attn_mask`` (what SDPA gets) is None exactly where the step's mask is all true
    and host-side counts show it: an open chunk under the default in-block mask, one chunk long,
    every row ending at the same slot; ``mask`` is then an all-true (B, 1, T, S) view, which the
    visibility mask built the usual way confirms. A two-chunk re-cache block, an explicit in-block
    mask, rows of different lengths and a decoder block (no open chunk) keep their mask."""
    from mmspec.kernels.torch_ops import visibility_mask

    cache = VideoChunkCache(1, 2, 2, 4, sink=1, window=4, frame_size=P, chunk=2, latent_shape=(P, C_LAT))
    T = 2 * P

    def block(frames, tree_mask=None):
        return cache.step(cache.next_positions()[:, None] + torch.arange(frames * P), tree_mask)

    for c in range(4):  # nothing before the first chunk; the fourth sees sink 1 + window 4
        cache.begin_chunk()
        step = block(2)
        S = int(cache.lengths.max()) + T
        ends = cache.lengths + T
        assert step.attn_mask is None and step.mask.shape == (2, 1, T, S) and bool(step.mask.all())
        assert bool(visibility_mask(ends, T, S, chunk_causal_mask(2, 2, P, 2)).all())
        explicit = block(2, torch.ones(2, T, T, dtype=torch.bool))
        assert explicit.attn_mask is explicit.mask
        cache.commit(torch.zeros(2, 2, P, C_LAT))
    cache.begin_recache(keep_sink=False)  # 5 frames: chunks of 2, 2, 1, chunk-causal
    step = block(5)
    assert step.attn_mask is step.mask and not bool(step.mask.all())
    cache.commit()
    cache.truncate(torch.tensor([5 * P, 3 * P]))  # rows of different lengths
    cache.begin_chunk()
    step = block(2)
    assert step.attn_mask is step.mask and not bool(step.mask.all()) and bool(step.mask[0].all())
    cache.commit(torch.zeros(2, 2, P, C_LAT))
    step = block(1)  # a decoder block past the committed frames: causal
    assert step.attn_mask is step.mask and not bool(step.mask.all())


def test_longlives_recache_with_lead_and_no_mask_equals_its_from_scratch_forward():
    """LongLive's re-cache (``begin_recache(keep_sink=True, lead=..., bidirectional=True)``): after 9
    chunks (sink 2, window 4, chunk 2; frames 0 .. 17) the evicted chunk before the window (frames
    10, 11) comes back in front of it, the block runs under the new prompt with no mask (its step
    hands SDPA none), and ``commit`` evicts the lead again. The next chunk then equals a
    from-scratch two-layer forward where frames 10 .. 17 attend to the sink and to each other at once
    and the chunk to the sink and frames 12 .. 17, to 1e-5; a chunk-causal re-cache of the same
    frames is more than 1e-3 away (the test tells them apart)."""
    sink, window, chunk = 2, 4, 2
    model = ChunkAttention(2)
    cache = model.new_cache(2, sink, window, chunk)
    s = Stream(model, cache)
    for _ in range(9):
        s.chunk(0)
    N = len(s.latents)
    sink_f, lead_f, win_f = list(range(sink)), list(range(N - window - chunk, N - window)), list(range(N - window, N))
    lead = torch.stack([s.latents[f] for f in lead_f], 1)
    latents = cache.begin_recache(True, lead=lead, bidirectional=True)
    assert torch.equal(latents, torch.stack([s.latents[f] for f in lead_f + win_f], 1))
    masks = []
    step = cache.step
    cache.step = lambda *a: masks.append(step(*a).attn_mask) or step(*a)
    model(latents, 0.0, 3, cache=cache)
    del cache.step
    assert masks == [None]
    cache.commit()
    assert cache.num_frames().tolist() == [sink + window] * 2
    assert torch.equal(cache.latents[:, :sink + window], torch.stack([s.latents[f] for f in sink_f + win_f], 1))
    x = s.randn(chunk)
    cache.begin_chunk()
    out = model(x, 0.5, 3, cache=cache)

    frames = sink_f + lead_f + win_f
    n = len(frames)
    lat = torch.stack([s.latents[f] for f in frames] + list(x.unbind(1)), 1)
    times = torch.tensor([0.0] * n + [0.5] * chunk).expand(2, -1)
    prompts = torch.tensor([0] * sink + [3] * (n - sink + chunk)).expand(2, -1)
    i_sink, i_redo, i_win = list(range(sink)), list(range(sink, n)), list(range(sink + chunk, n))
    i_query = list(range(n, n + chunk))

    def scratch(redo_groups):
        groups = [(i_sink, i_sink)] + redo_groups + [(i_query, i_sink + i_win + i_query)]
        return model(lat, times, prompts, groups=groups)[:, n:]

    torch.testing.assert_close(out, scratch([(i_redo, i_sink + i_redo)]), atol=ATOL, rtol=0)
    causal = [(i_redo[j:j + chunk], i_sink + i_redo[:j + chunk]) for j in range(0, len(i_redo), chunk)]
    assert (out - scratch(causal)).abs().max() > 1e-3
