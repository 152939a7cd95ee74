"""The video adapter: the chunk cache, one chunk sampler and the stream contexts, for every video
model that denoises chunk by chunk over a ``VideoChunkCache`` (the core's ``SinkWindowCache`` with
Self-Forcing's chunk writes and LongLive's re-cache on top).

A *video model* here is anything with the bundled ``VideoDiTModel``'s cache-driven call,
``model(latents (B, F, C, h, w), t, prompt, cache=cache) -> velocity`` (flow time ``t`` in
[0, 1], a number or per frame (B, F); ``prompt``: the model's conditioning rows), plus
``new_cache(rows, sink_frames, window_frames, ...)``, ``chunk_frames`` and ``rope_frames``: the
bundled DiT, and diffusers' ``WanTransformer3DModel`` through ``mmspec.adapters.video_wan``.

- ``VideoChunkCache`` and ``chunk_causal_mask``: the cache's chunk / re-cache / latent protocol
  (see the class) and CausVid's block-causal in-block mask.
- ``FlowSampler``: the denoising steps of one chunk through a diffusers
  ``FlowMatchEulerDiscreteScheduler`` (shifted sigmas, or an explicit sigma list as the few-step
  distilled checkpoints use): ``"euler"`` integrates the flow ODE with the scheduler's step
  (``x + (sigma_next - sigma) v``); ``"renoise"`` is Self-Forcing's (Huang et al., 2025) few-step
  rule: ``x0 = x - sigma v``, then the scheduler's ``scale_noise(x0, sigma_next, fresh noise)``.
  Classifier-free guidance ``v_u + s (v_c - v_u)`` (Ho & Salimans, 2022) when the scale is not 1.
- ``sample_chunk``: Self-Forcing's cache semantics: ``begin_chunk``, every step writes the chunk's
  K/V into the same slots, a clean pass at t = 0 writes the K/V that stay, ``commit`` keeps them
  with the clean latents and rolls.
- ``recache``: LongLive's prompt-switch re-cache (Yang et al., 2025).
- ``CachedStream`` (rolling, no-sink, full-cache: a cache that ``grow``s instead of evicting) and
  ``RecomputeStream`` (StreamingLLM's sliding window with recompute: the baseline), behind one
  ``sample`` / ``recache`` / ``frames`` / ``nbytes``. A window of None keeps every frame so far
  (Self-Forcing's and CausVid's ``local_attn_size=-1``) up to ``frame_limit(model)`` frames and
  refuses the chunk past it (``CacheLimitError``), as ``full-cache`` does.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..core.cache import CacheStep, SinkWindowCache
from ..core.errors import check, check_choice, check_int, is_int
from ..core.logits import cfg_merge
from ..kernels.torch_ops import visibility_mask

SAMPLERS = ("euler", "renoise")
RECACHE_RULES = ("prefill", "longlive")  # CachedStream's prompt-switch re-cache

OnStep = Callable[[int, float, torch.Tensor], torch.Tensor]
"""``on_step(i, t, x) -> x`` after denoising step i (from flow time t) of a chunk; may replace x."""


class CacheLimitError(RuntimeError):
    """A growing (``"full-cache"``) stream reached the frames its model's positions tell apart;
    ``frames`` is how many frames it had."""

    def __init__(self, message: str, frames: int):
        super().__init__(message)
        self.frames = frames


def frame_limit(model) -> int:
    """Frames a stream that never evicts can hold: whole chunks, one chunk short of the model's
    ``rope_frames`` (the frame positions its RoPE tells apart), so every chunk's keys stay inside
    them (``cache_mode="full-cache"``, a window of every frame so far)."""
    config = getattr(model, "config", None)  # the bundled DiT's config, or Wan's adapter's own attribute
    C = config.chunk_frames if hasattr(config, "chunk_frames") else model.chunk_frames
    return (model.rope_frames // C - 1) * C


def _limit_error(model, limit: int, frames: int) -> CacheLimitError:
    return CacheLimitError(
        f"a stream that keeps every frame (cache_mode='full-cache', or window_frames None or -1) stops at {limit} "
        f"frames: one more chunk would put keys past the {model.rope_frames} frame positions the model's RoPE "
        "tells apart (use cache_mode='rolling' with a window for unbounded streams)", frames)


class FlowSampler:
    """The denoising steps of a chunk, from a diffusers ``FlowMatchEulerDiscreteScheduler``.

    Args:
        scheduler: the pipeline's scheduler (its ``shift`` shifts the sigmas); the sampler steps a
            copy of it made from its config.
        num_inference_steps: steps per chunk.
        sampler: ``"euler"`` or ``"renoise"`` (module docstring).
        sigmas: an explicit list of ``num_inference_steps`` sigmas (before the scheduler's shift),
            e.g. Self-Forcing's warped ``[1.0, 0.9375, 0.8333, 0.625]`` with ``shift`` 1; default
            ``linspace(1, 0, steps + 1)[:-1]``, shifted by the scheduler.
        model_times: the flow times the model is told at each step, where they differ from the
            sigmas the step uses (x0 = x - sigma v, the re-noising): CausVid feeds its model the
            timesteps 757 and 522 but steps with its scheduler's nearest table sigmas 0.756757 and
            0.521739. None: the sigmas themselves (shifted); given, used as they are, with explicit
            ``sigmas`` only.
    """

    def __init__(self, scheduler, num_inference_steps: int, sampler: str = "euler", sigmas=None, model_times=None):
        check_int(num_inference_steps, "num_inference_steps", 1)
        check_choice("sampler", sampler, SAMPLERS)
        check(model_times is None or sigmas is not None, "model_times", "None without explicit sigmas", model_times)
        if sigmas is None:
            sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()
        check(len(sigmas) == num_inference_steps and all(0 < s <= 1 for s in sigmas), "sigmas",
              f"{num_inference_steps} values in (0, 1] (one per step)", sigmas)
        check(model_times is None or (isinstance(model_times, (list, tuple)) and len(model_times) == num_inference_steps
                                      and all(isinstance(t, (int, float)) and 0 < t <= 1 for t in model_times)),
              "model_times", f"None or {num_inference_steps} flow times in (0, 1] (one per step)", model_times)
        self.model_times = None if model_times is None else [float(t) for t in model_times]
        # a stream's own copy: the scheduler keeps a step index, and two streams of one pipeline
        # (a demo's, a generator left open) must not advance each other's
        self.scheduler = type(scheduler).from_config(scheduler.config)
        self.steps, self.sampler, self.base = num_inference_steps, sampler, list(sigmas)

    def sigmas(self, device=None) -> torch.Tensor:
        """(steps + 1,) float32 flow times of the chunk's steps, shifted, ending at 0."""
        self.scheduler.set_timesteps(sigmas=self.base, device=device)
        return self.scheduler.sigmas

    def first_step(self, strength: float = 1.0) -> int:
        """The step a chunk starts from at ``strength`` (diffusers' image-to-image rule:
        ``steps - min(steps * strength, steps)``, rounded down); 0 at strength 1."""
        return int(max(self.steps - min(self.steps * strength, self.steps), 0))

    def steps_run(self, strength: float = 1.0) -> int:
        """Denoising steps (transformer passes, without guidance's doubling) a chunk takes."""
        return self.steps - self.first_step(strength)

    @torch.no_grad()
    def denoise(self, velocity: Callable[[torch.Tensor, float], torch.Tensor], noise: torch.Tensor,
                guidance_scale: float = 1.0, on_step: OnStep | None = None, generator=None,
                init: torch.Tensor | None = None, strength: float = 1.0) -> torch.Tensor:
        """The clean latents (B, F, C, h, w) of a chunk from ``noise`` at t = 1. ``velocity(x, t)``
        gets ``[x; x]`` (2B rows, conditional half first) when guided. ``generator``: the fresh
        noise of ``"renoise"``.

        With ``init`` (clean latents of the chunk's shape) and ``strength`` in (0, 1): diffusers'
        image-to-image start (its SD3 img2img pipeline's ``get_timesteps``): the steps before
        ``first_step(strength)`` are skipped and the chunk starts from ``init`` noised to that
        step's sigma by the scheduler's ``scale_noise`` with ``noise``. Strength 1 ignores
        ``init`` (the plain chunk: bit-identical)."""
        from diffusers.utils.torch_utils import randn_tensor

        guided = guidance_scale != 1.0
        s = self.scheduler
        sigmas = self.sigmas(noise.device)  # also resets the scheduler's step index for this chunk
        first = self.first_step(strength)
        x = noise
        if first:
            check(init is not None and init.shape == noise.shape, "init",
                  f"clean latents of shape {tuple(noise.shape)} when strength < 1", None if init is None else
                  tuple(init.shape))
            # no set_begin_index: the steps find their sigma by timestep value, which "renoise"'s
            # scale_noise needs (it never steps the scheduler)
            x = s.scale_noise(init.to(noise.dtype), s.timesteps[first:first + 1], noise)
        for i in range(first, len(s.timesteps)):
            t, sigma = s.timesteps[i], float(sigmas[i])
            told = sigma if self.model_times is None else self.model_times[i]  # what the model hears
            v = velocity(torch.cat([x, x]) if guided else x, told)
            if guided:
                v = cfg_merge(*v.chunk(2), guidance_scale)
            if self.sampler == "euler":
                x = s.step(v, t, x, return_dict=False)[0]
            elif i + 1 < len(s.timesteps):  # renoise: the prediction of x0, noised to the next sigma
                fresh = randn_tensor(x.shape, generator=generator, device=x.device, dtype=x.dtype)
                x = s.scale_noise(x - sigma * v, s.timesteps[i + 1:i + 2], fresh)
            else:
                x = x - sigma * v
            if on_step is not None:
                x = on_step(i, sigma, x)
        return x


# -- the chunk cache ---------------------------------------------------------------------------
def chunk_causal_mask(num_frames: int, chunk_frames: int, frame_size: int, batch_size: int,
                      device=None) -> torch.Tensor:
    """(B, T, T) in-block visibility of a block of whole chunks of ``frame_size``-token frames:
    bidirectional inside a chunk, causal across chunks (CausVid's block-causal attention)."""
    chunk = torch.arange(num_frames, device=device).div(chunk_frames, rounding_mode="floor")
    chunk = chunk.repeat_interleave(frame_size)  # (T,)
    return (chunk[None, :] <= chunk[:, None]).expand(batch_size, -1, -1)


class VideoChunkCache(SinkWindowCache):
    """The core's sink + window cache at frame granularity with Self-Forcing's chunk writes and
    LongLive's re-cache on top, plus the clean latents of the kept frames.

    Whole chunks of frames are appended: ``begin_chunk()`` opens the next ``chunk`` frames; every
    ``step`` until ``commit`` writes the chunk's K/V into the *same* slots (denoising steps
    overwrite, nothing advances), visible to the chunk itself (bidirectional inside it) after the
    committed context; the last pass before ``commit(latents)`` is the clean one (t = 0), whose
    K/V stay. ``commit`` advances, stores the clean latents, and rolls (the latents roll with
    their frames). ``begin_recache(keep_sink)`` + one forward at t = 0 under a new prompt +
    ``commit()`` is LongLive's prompt-switch re-cache: the cached frames' K/V recomputed from their
    clean latents, chunk-causally, at the same cache positions (or as LongLive's code does it:
    with evicted frames in front and no mask, ``begin_recache(lead=..., bidirectional=True)``).
    Without an open chunk the cache is the core's ``SinkWindowCache``: decoder blocks step past the
    committed entries. ``sink``, ``window``, ``max_block`` (default ``chunk``), ``rope``, ``dtype``,
    ``device``, ``frame_size`` and ``capacity`` are ``SinkWindowCache``'s.

    Args:
        chunk: frames per Self-Forcing chunk. Sink and window need not be multiples of it:
            eviction is frame by frame, as the reference repositories roll their caches (a chunk
            sees ``sink + window`` committed frames and itself; a window shorter than a chunk keeps
            only the chunk's last frames).
        latent_shape: shape of one frame's clean latent (e.g. (C, h, w)) kept for ``begin_recache``;
            None keeps no latents.
        latent_dtype: dtype of the kept latents.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int, sink: int,
                 window: int, max_block: int | None = None, rope=None, dtype=torch.float32, device=None, *,
                 chunk: int, frame_size: int = 1, capacity: int | None = None,
                 latent_shape: tuple[int, ...] | None = None, latent_dtype=torch.float32):
        # every check before any buffer is allocated (the core's own run first in its __init__)
        check(is_int(chunk) and chunk >= 1, "chunk", "an int >= 1 (frames per chunk)", chunk)
        max_block = chunk if max_block is None else max_block
        check(is_int(max_block) and max_block >= chunk, "max_block", f"an int >= chunk ({chunk})", max_block)
        if latent_shape is not None:
            latent_shape = tuple(latent_shape)
            check(all(is_int(n) and n >= 1 for n in latent_shape), "latent_shape", "None or a tuple of ints >= 1",
                  latent_shape)
        super().__init__(num_layers, batch_size, num_heads, head_dim, sink, window, max_block, rope, dtype, device,
                         frame_size=frame_size, capacity=capacity)
        self.chunk = chunk
        self.latents = None if latent_shape is None else torch.zeros(
            (batch_size, self.capacity) + latent_shape, dtype=latent_dtype, device=device)  # (B, capacity, *latent)
        # (start (B,), tokens, "chunk" | "recache") of the open block, if any
        self._open: tuple[torch.Tensor, int, str] | None = None
        self._bidirectional = False  # the open re-cache attends to all of itself (LongLive's)
        self._written = False  # a step wrote the open block

    @property
    def open_frames(self) -> int | None:
        """Frames of the open chunk or re-cache (what the next ``step`` must write), None when none
        is open."""
        return None if self._open is None else self._open[1] // self.frame_size

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self.latents is None else self.latents.nbytes)

    def next_positions(self) -> torch.Tensor:
        """(B,) where the next block goes: the open chunk's (re-cache's) start while one is open."""
        return (self.lengths if self._open is None else self._open[0]).clone()

    # -- Self-Forcing chunks and LongLive re-cache ----------------------------------------------
    def begin_chunk(self) -> None:
        """Open the next chunk: until ``commit``, every ``step`` (one per denoising step, then the
        clean pass) writes the chunk's ``chunk * frame_size`` tokens into the same slots."""
        self._check_closed("begin_chunk")
        self._open, self._written = (self.lengths.clone(), self.chunk * self.frame_size, "chunk"), False
        self._bidirectional = False

    def begin_recache(self, keep_sink: bool = True, lead: torch.Tensor | None = None,
                      bidirectional: bool = False) -> torch.Tensor:
        """Open a re-cache of the committed frames (the window; the sink too unless ``keep_sink``)
        and return their clean latents (B, n, *latent_shape), n frames (possibly 0). Run the model
        on them once at t = 0 under the new conditioning (one block, chunk-causal: the cache's
        default mask), then ``commit()``: their K/V are then those of a fresh prefill of the same
        frames at the same positions (the sink's kept or recomputed).

        LongLive's own re-cache (Yang et al., 2025; NVlabs/LongLive v1.0,
        ``pipeline/interactive_causal_inference.py::_recache_after_switch``) differs in two ways,
        both options here: it runs its last ``local_attn_size`` frames, more than the cache keeps
        after a commit, and it runs them in one pass without a mask.

        - ``lead`` (B, E, *latent_shape): clean latents of the E frames just before the window (frames
          the cache has evicted; E <= ``max_block``), re-encoded first in the same block, after the
          sink: the block sees them and their K/V, and ``commit`` evicts them again.
        - ``bidirectional``: the block attends to all of itself (no mask) instead of chunk-causally."""
        check(self.latents is not None, "latent_shape", "set at construction: a re-cache re-encodes the "
              "cached frames' clean latents", None)
        check(isinstance(keep_sink, bool), "keep_sink", "True or False", keep_sink)
        check(isinstance(bidirectional, bool), "bidirectional", "True or False", bidirectional)
        self._check_closed("begin_recache")
        n = int(self.lengths[0])
        check(bool((self.lengths == n).all()), "lengths", "equal in every row for a re-cache",
              self.lengths.tolist())
        fs, latent = self.frame_size, tuple(self.latents.shape[2:])
        E = 0 if lead is None else lead.shape[1]
        if lead is not None:
            room = self.capacity - n // fs
            check(isinstance(lead, torch.Tensor) and lead.dim() == 2 + len(latent) and lead.shape[0] == self.batch_size
                  and tuple(lead.shape[2:]) == latent and E <= room and n >= self.sink, "lead",
                  f"None or ({self.batch_size}, frames <= {room}, {', '.join(map(str, latent))}) clean latents of "
                  f"evicted frames, after a full sink ({self.sink_frames} frames)", getattr(lead, "shape", lead))
        if E:  # the lead goes after the sink, the window's latents move E frames on (their K/V are rewritten)
            s_f, n_f = self.sink // fs, n // fs
            self.latents[:, s_f + E:n_f + E] = self.latents[:, s_f:n_f].clone()
            self.latents[:, s_f:s_f + E] = lead.to(self.latents)
        start = min(n, self.sink) if keep_sink else 0
        end = n + E * fs
        self._open, self._written = (torch.full_like(self.lengths, start), end - start, "recache"), False
        self._bidirectional = bidirectional
        return self.latents[:, start // fs: end // fs].clone()

    def commit(self, latents: torch.Tensor | None = None) -> None:
        """Close the open chunk or re-cache. A chunk advances the cache by its frames (its K/V are
        what the last ``step`` wrote: run the clean t = 0 pass last), stores ``latents`` (B,
        chunk, *latent_shape), its clean latents (required when the cache keeps latents), and rolls
        (evicts whole frames down to sink + window). A re-cache takes no latents."""
        if self._open is None:
            raise RuntimeError("commit() without an open chunk: call begin_chunk() or begin_recache() first")
        start, T, kind = self._open
        if T and not self._written:
            raise RuntimeError(f"commit() of a {kind} no step wrote: run its t = 0 pass first")
        if kind == "chunk":
            if self.latents is None:
                check(latents is None, "latents", "None: this cache keeps no latents (latent_shape=None)",
                      type(latents).__name__)
            else:
                want = (self.batch_size, T // self.frame_size) + tuple(self.latents.shape[2:])
                check(latents is not None and tuple(latents.shape) == want, "latents",
                      f"the chunk's clean latents of shape {want}", None if latents is None else tuple(latents.shape))
                f = (start // self.frame_size)[:, None] + torch.arange(want[1], device=start.device)  # (B, n)
                index = f.view(*f.shape, *[1] * (latents.dim() - 2)).expand(want)
                self.latents.scatter_(1, index, latents.to(self.latents))
            self.lengths = start + T
        else:
            check(latents is None, "latents", "None for a re-cache (the cache has them)", type(latents).__name__)
            self.lengths = start + T  # past the window by the lead's frames, if any: evicted below
        self._open = None
        self._roll()

    def grow(self, window_frames: int) -> None:
        """``SinkWindowCache.grow``, with room for the new frames' latents. Between chunks only."""
        self._check_closed("grow")
        super().grow(window_frames)
        if self.latents is not None and self.latents.shape[1] < self.capacity:
            self.latents = torch.cat([self.latents, self.latents.new_zeros(
                (self.batch_size, self.capacity - self.latents.shape[1]) + tuple(self.latents.shape[2:]))], 1)

    def _check_closed(self, what: str) -> None:
        if self._open is not None:
            raise RuntimeError(f"{what}() while a chunk or re-cache is open: commit() it first")

    # -- the core's step, with an open chunk ----------------------------------------------------
    def step(self, positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> CacheStep:
        """Without an open chunk: ``SinkWindowCache.step`` (write past the committed entries, advance).
        With one: write the block into the open slots without advancing; ``tree_mask`` (B, T, T)
        defaults to chunk-causal (bidirectional inside each chunk, causal across). A default-masked
        block of one chunk whose rows all end at the same slot sees every key: its step hands SDPA
        no mask (``CacheStep.attn_mask`` None; ``mask`` an all-true view)."""
        if self._open is None:
            return super().step(positions, tree_mask)
        B, T = positions.shape
        start, size, _ = self._open
        check(T == size, "positions", f"the open block's {size} tokens", T)
        # bidirectional inside itself: one chunk, or a re-cache opened bidirectional
        one_chunk = tree_mask is None and (self._bidirectional or T <= self.chunk * self.frame_size)
        if tree_mask is None and self._bidirectional:
            tree_mask = torch.ones((1, 1, 1), dtype=torch.bool, device=positions.device).expand(B, T, T)
        elif tree_mask is None:
            tree_mask = chunk_causal_mask(T // self.frame_size, self.chunk, self.frame_size, B, positions.device)
        slots = start[:, None] + torch.arange(T, device=positions.device)
        ends = start + T
        low, S = torch.stack(torch.aminmax(ends)).tolist()  # one host read, as the key range's end alone took
        dense = one_chunk and low == S  # no row's keys end early: nothing is masked
        mask = (torch.ones((1, 1, 1, 1), dtype=torch.bool, device=positions.device).expand(B, 1, T, S) if dense
                else visibility_mask(ends, T, S, tree_mask))
        step = CacheStep(self, positions, slots, mask, self._key_positions(slots, positions, S), tree_mask, dense)
        self._written = True
        return step

    def _evict(self) -> torch.Tensor | None:
        """The core's eviction; the kept frames' latents move with their K/V."""
        src_f = super()._evict()
        if src_f is not None and self.latents is not None:
            B, cap_f = src_f.shape
            index = src_f.view(B, cap_f, *[1] * (self.latents.dim() - 2)).expand(B, cap_f, *self.latents.shape[2:])
            self.latents[:, :cap_f] = self.latents.gather(1, index)
        return src_f

    def truncate(self, lengths: torch.Tensor) -> None:
        self._check_closed("truncate")
        super().truncate(lengths)

    def gather(self, start, idx, n) -> None:
        self._check_closed("gather")
        super().gather(start, idx, n)


@torch.no_grad()
def sample_chunk(model, cache: VideoChunkCache, noise: torch.Tensor, prompt: torch.Tensor, sampler: FlowSampler,
                 guidance_scale: float = 1.0, null_prompt: torch.Tensor | None = None, on_step: OnStep | None = None,
                 generator=None, init: torch.Tensor | None = None, strength: float = 1.0) -> torch.Tensor:
    """Denoise one chunk with Self-Forcing's cache semantics and return its clean latents.

    ``noise`` (B, C_f, C, h, w) at t = 1; ``cache`` (``model.new_cache``) holds ``2B`` rows
    ``[cond; uncond]`` when ``guidance_scale != 1`` (``null_prompt``: the second half's rows),
    else ``B``. ``init`` and ``strength``: ``FlowSampler.denoise``'s image-to-image start.
    ``begin_chunk`` opens the chunk: every denoising step writes its K/V into the same slots; a
    final pass at t = 0 on the clean latents writes the K/V that stay, and ``commit``
    keeps them with the clean latents and rolls."""
    guided = guidance_scale != 1.0
    prompts = torch.cat([prompt, null_prompt]) if guided else prompt
    cache.begin_chunk()
    x = sampler.denoise(lambda x, t: model(x, t, prompts, cache=cache), noise, guidance_scale, on_step, generator,
                        init, strength)
    clean = torch.cat([x, x]) if guided else x
    model(clean, 0.0, prompts, cache=cache)
    cache.commit(clean)
    return x


@torch.no_grad()
def recache(model, cache: VideoChunkCache, prompt: torch.Tensor, keep_sink: bool = False,
            lead: torch.Tensor | None = None, bidirectional: bool = False) -> int:
    """LongLive's prompt-switch re-cache: recompute the K/V of the cached frames (the window; the
    sink too unless ``keep_sink``) from their clean latents, in one pass at t = 0 under ``prompt``
    (the cache's rows: ``[cond; uncond]`` with guidance), at the same cache positions. The cache
    then equals a fresh prefill of those frames under the new prompt. ``lead`` and
    ``bidirectional``: ``VideoChunkCache.begin_recache``'s (LongLive's code as released). Returns
    the frames re-encoded."""
    latents = cache.begin_recache(keep_sink, lead, bidirectional)
    if latents.shape[1]:
        model(latents, 0.0, prompt, cache=cache)
    cache.commit()
    return latents.shape[1]


class CachedStream:
    """``rolling``, ``no-sink`` and ``full-cache``: a ``VideoChunkCache`` through
    ``sample_chunk``. With ``grow_to`` (frames) the cache never evicts: before a chunk that would
    roll it ``grow``s (doubling the window) until it holds ``grow_to`` frames, sink included, and
    past that raises ``CacheLimitError``. ``window`` None: every frame so far, a window of four
    chunks that grows to ``grow_to`` (default ``frame_limit(model)``). ``cache_kwargs`` go to
    ``model.new_cache``.

    ``recache_rule``: how a prompt switch re-caches (``RECACHE_RULES``):

    - ``"prefill"``: the kept frames (the sink too unless ``keep_sink``) re-encoded chunk-causally,
      as a fresh prefill of them would be;
    - ``"longlive"``: as LongLive v1's ``_recache_after_switch`` with ``global_sink: true`` (NVlabs/
      LongLive v1.0, pipeline/interactive_causal_inference.py l.34-96, wan/modules/causal_model.py
      l.230-333): its last ``local_attn_size = sink + window + chunk`` frames in one pass without a
      mask. Of those, a cache that has rolled keeps the sink's K/V (the write starts past the sink
      when the re-cache does not start at frame 0), so the frames re-encoded are the last ``window +
      chunk`` (the chunk evicted at the last commit comes back in front as ``lead``: the stream keeps
      the clean latents of its last ``window + chunk`` frames for it); before that, every frame so far,
      the sink included. A cache that never evicts re-caches every frame (``local_attn_size=-1``).
      ``keep_sink`` is LongLive's to decide then, not the caller's."""

    def __init__(self, model, rows: int, sink: int, window: int | None, grow_to: int | None = None,
                 recache_rule: str = "prefill", **cache_kwargs):
        check_choice("recache_rule", recache_rule, RECACHE_RULES)
        if window is None:
            grow_to = frame_limit(model) if grow_to is None else grow_to
            window = max(0, min(4 * model.chunk_frames, grow_to - sink))
        self.model, self.grow_to, self.recache_rule = model, grow_to, recache_rule
        self.cache = model.new_cache(rows, sink, window, **cache_kwargs)
        self.streamed = 0  # frames committed by chunks
        self.recent: torch.Tensor | None = None  # "longlive": the clean rows of the last window + chunk frames

    def frames(self) -> int:
        return int(self.cache.num_frames()[0])

    def nbytes(self) -> int:
        return self.cache.nbytes() + (0 if self.recent is None else self.recent.nbytes)

    def sample(self, noise, prompt, null, sampler: FlowSampler, guidance_scale, on_step=None, generator=None,
               init=None, strength: float = 1.0):
        if self.grow_to is not None:
            n, chunk = self.frames(), noise.shape[1]
            sink, window = self.cache.sink_frames, self.cache.window_frames
            if n + chunk > sink + window:
                if n + chunk > self.grow_to:
                    raise _limit_error(self.model, self.grow_to, n)
                self.cache.grow(min(max(2 * window, n + chunk - sink), self.grow_to - sink))
        x = sample_chunk(self.model, self.cache, noise, prompt, sampler, guidance_scale, null, on_step, generator,
                         init, strength)
        self.streamed += x.shape[1]
        if self.recache_rule == "longlive" and self.grow_to is None:
            clean = torch.cat([x, x]) if guidance_scale != 1.0 else x  # the cache's rows
            keep = self.cache.window_frames + self.model.chunk_frames
            self.recent = (clean if self.recent is None else torch.cat([self.recent, clean], 1))[:, -keep:]
        return x

    def recache(self, prompt_rows, keep_sink: bool) -> int:
        """A prompt switch's re-cache by ``recache_rule``; returns the transformer passes it ran (0
        when nothing was cached)."""
        if self.recache_rule == "prefill":
            return int(recache(self.model, self.cache, prompt_rows, keep_sink) > 0)
        S, W, C, cur = self.cache.sink_frames, self.cache.window_frames, self.model.chunk_frames, self.streamed
        lead = None
        keep_sink = self.grow_to is None and cur > S + W + C  # LongLive's re-cache starts past frame 0
        E = 0 if self.grow_to is not None else max(0, min(C, cur - W - S))  # evicted frames it re-encodes
        if E:
            a = self.recent.shape[1]
            lead = self.recent[:, a - W - E:a - W]
        return int(recache(self.model, self.cache, prompt_rows, keep_sink, lead, bidirectional=True) > 0)


class RecomputeStream:
    """``window-recompute``: no K/V kept between denoising steps; the clean latents of the visible
    frames (the first ``sink`` frames and the last ``window``) and the prompt rows each is encoded
    under. Every denoising step runs the model from scratch on [visible frames at t = 0; the chunk
    at t] as one chunk-causal block through a fresh cache of exactly that many frames, at positions
    0, 1, ... (cache order, as the rolling cache has them): StreamingLLM's sliding window with
    recompute, for any video model. Prompts go to the model as rows when every visible frame has
    the same ones, else per frame (B, F, ...) (a model that takes only rows refuses that: a switch
    with ``recache_sink=False``). ``window`` None: every frame so far, up to ``grow_to`` frames
    (default ``frame_limit(model)``; past it ``CacheLimitError``), as ``CachedStream``.
    ``cache_kwargs`` go to ``model.new_cache``."""

    def __init__(self, model, rows: int, sink: int, window: int | None, grow_to: int | None = None,
                 **cache_kwargs):
        del rows  # CachedStream's signature: here each step's fresh cache is sized by its prompt rows
        if window is None:
            grow_to = frame_limit(model) if grow_to is None else grow_to
            window = max(0, grow_to - sink)
        self.model, self.sink, self.window, self.cache_kwargs = model, sink, window, cache_kwargs
        self.grow_to = grow_to
        self.latents: torch.Tensor | None = None  # (rows, n, C, h, w)
        self.prompts: torch.Tensor | None = None  # (rows, n, *prompt row shape)

    def frames(self) -> int:
        return 0 if self.latents is None else self.latents.shape[1]

    def nbytes(self) -> int:
        return sum(0 if t is None else t.nbytes for t in (self.latents, self.prompts))

    def sample(self, noise, prompt, null, sampler: FlowSampler, guidance_scale, on_step=None, generator=None,
               init=None, strength: float = 1.0):
        guided = guidance_scale != 1.0
        rows = torch.cat([prompt, null]) if guided else prompt  # (R, ...)
        R, n, C = rows.shape[0], self.frames(), noise.shape[1]
        if self.grow_to is not None and n + C > self.grow_to:
            raise _limit_error(self.model, self.grow_to, n)
        frame_rows = rows[:, None].expand(R, C, *rows.shape[1:])
        prompts = frame_rows if self.prompts is None else torch.cat([self.prompts, frame_rows], 1)
        uniform = bool((prompts == rows[:, None]).all())
        context = prompts[:, 0] if uniform else prompts

        def velocity(x, t):
            fresh = self.model.new_cache(R, 0, max(n, C), **self.cache_kwargs)
            if n == 0:
                return self.model(x, t, rows, cache=fresh)
            times = torch.cat([torch.zeros(R, n), torch.full((R, C), t)], 1).to(x.device)
            return self.model(torch.cat([self.latents, x], 1), times, context, cache=fresh)[:, n:]

        x = sampler.denoise(velocity, noise, guidance_scale, on_step, generator, init, strength)
        clean = torch.cat([x, x]) if guided else x
        latents = clean if self.latents is None else torch.cat([self.latents, clean], 1)
        self.latents, self.prompts = self._keep(latents), self._keep(prompts)
        return x

    def _keep(self, z: torch.Tensor) -> torch.Tensor:
        return z if z.shape[1] <= self.sink + self.window else torch.cat(
            [z[:, :self.sink], z[:, z.shape[1] - self.window:]], 1)

    def recache(self, prompt_rows, keep_sink: bool) -> int:
        """The visible frames (the sink too unless ``keep_sink``) are encoded under the new prompt
        from now on; no transformer pass (returns 0)."""
        if self.prompts is not None:
            start = min(self.sink, self.frames()) if keep_sink else 0
            self.prompts = self.prompts.clone()
            self.prompts[:, start:] = prompt_rows[:, None]
        return 0


__all__ = ["RECACHE_RULES", "SAMPLERS", "CacheLimitError", "CachedStream", "FlowSampler", "OnStep", "RecomputeStream",
           "VideoChunkCache", "chunk_causal_mask", "frame_limit", "recache", "sample_chunk"]
