"""diffusers' Wan (``WanTransformer3DModel``, ``AutoencoderKLWan``) streamed chunk-causally through
the video adapter's ``VideoChunkCache``: the Wan2.1-T2V-1.3B causal fine-tunes (Self-Forcing, CausVid,
LongLive) as a drop-in for the bundled DiT in ``sample_chunk`` / ``recache``.

Nothing of diffusers' Wan code is forked. ``WanVideoModel`` installs two attention processors in
every block (``set_attn_processor``) and calls the stock ``WanTransformer3DModel.forward``:

- ``attn1`` (self-attention): q, k, v after Wan's q/k RMS norms go to the cache step's
  ``attend(layer, q, k, v)``, which stores the chunk's K/V and attends over the kept frames plus
  the chunk (bidirectional inside a chunk, causal across: CausVid's block-causal attention);
- ``attn2`` (cross-attention): the prompt's K/V are computed once per prompt and reused by every
  denoising step and chunk (Self-Forcing's ``crossattn_cache``).

A call without a cache leaves both processors on the stock path, so the wrapped transformer
computes exactly what it computed before (``chunk_causal=True``: the stock attention under a dense
chunk-causal mask, the cache-less forward of CausVid's training and the window-recompute
baseline). The processors learn about the current call from a context object the wrapper sets for
the duration of one forward (diffusers' Wan forward passes no keyword arguments down to its
processors); nothing stays on the model between calls except the memo of the last prompt's
cross-attention K/V, keyed on the prompt tensor (identity and version, else content), which never
changes a result.

Positions (spec §2.8), ``position_policy``:

- ``"cache-order"`` (default; StreamingLLM's rule, LongLive's "infinite" variant): keys are stored
  before RoPE and rotated on read by their frame's place in the cache, sink first, so positions
  stay below ``sink + window + chunk`` frames for unbounded streams. The cache's rope is a
  ``Rope3D`` with Wan's (time, height, width) split, equal to diffusers' ``WanRotaryPosEmbed``.
- ``"absolute"`` (Self-Forcing, CausVid, LongLive v1 as released): q and k are rotated here at the
  frame's absolute index in the stream and stored rotated (the cache gets ``rope=None``), never
  re-rotated; the stream ends at the ``rope_max_seq_len`` (1024) temporal positions of Wan's table.

Layout: our latents are (B, F, C, h, w), diffusers' (B, C, F, h, w). Flow time t in [0, 1] is
Wan's timestep ``1000 t``; per-frame times (B, F) become per-token timesteps (B, F * P), the
``timestep.ndim == 2`` path diffusers' Wan forward takes for Wan 2.2 TI2V.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from ..core.cache import CacheStep
from ..core.errors import check, check_choice, check_int, is_int
from ..core.rope import Rope3D, RopeTables
from .video import VideoChunkCache, chunk_causal_mask

__all__ = ["POSITION_POLICIES", "WanCachedCrossAttnProcessor", "WanCachedSelfAttnProcessor", "WanStreamCache",
           "WanStreamingDecoder", "WanVideoModel", "check_window", "encode_prompts", "load_original_wan",
           "merge_lora"]

POSITION_POLICIES = ("cache-order", "absolute")
WAN_ROPE_THETA = 10000.0  # WanTransformer3DModel builds its WanRotaryPosEmbed with the default theta


def check_window(chunk_frames: int, sink_frames, window_frames, rope_frames: int) -> int | None:
    """The stream's sink and window in latent frames, as ``new_cache`` takes them (and
    ``StreamingVideoPipeline`` checks them when it is built): any counts >= 0, frame-granular as
    Self-Forcing's ``sink_size`` and ``local_attn_size`` are (a chunk sees ``sink + window``
    committed frames and itself: ``local_attn_size = sink + window + chunk``), within the model's
    ``rope_frames``. ``window_frames`` None or -1 (Self-Forcing's and CausVid's
    ``local_attn_size=-1``): every committed frame so far, a cache that grows instead of rolling
    up to the frames the model's positions tell apart (``mmspec.adapters.video.frame_limit``).
    Returns the window, None for every frame."""
    C, R = chunk_frames, rope_frames
    check(is_int(sink_frames) and sink_frames >= 0, "sink_frames", "an int >= 0 (latent frames)", sink_frames)
    check(window_frames is None or (is_int(window_frames) and window_frames >= -1), "window_frames",
          "an int >= 0 (latent frames), or None or -1 (every frame so far)", window_frames)
    window = None if window_frames in (None, -1) else window_frames
    check(sink_frames + (window or 0) + C <= R, "sink_frames + window_frames",
          f"at most {R - C} frames: with a chunk of {C} the frames a chunk sees must stay within the {R} "
          "temporal RoPE positions of this model", sink_frames + (window or 0))
    return window


class WanStreamCache(VideoChunkCache):
    """A ``VideoChunkCache`` that also counts the frames committed by chunks: the absolute frame
    index of the next chunk, which Self-Forcing's absolute positions need once the cache has
    rolled (the cache itself only knows cache-order slots). Counting follows the chunk protocol:
    ``begin_chunk`` ... ``commit(latents)`` adds ``chunk`` frames, a re-cache adds none."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.frames_streamed = 0  # frames committed by chunks since the stream began
        self.open_block: str | None = None  # "chunk" | "recache" while one is open
        self.open_lead = 0  # evicted frames an open re-cache re-encodes in front of the window

    def begin_chunk(self) -> None:
        super().begin_chunk()
        self.open_block = "chunk"

    def begin_recache(self, keep_sink: bool = True, lead: torch.Tensor | None = None,
                      bidirectional: bool = False) -> torch.Tensor:
        latents = super().begin_recache(keep_sink, lead, bidirectional)
        self.open_block = "recache"
        self.open_lead = 0 if lead is None else lead.shape[1]  # frames in front of the window
        return latents

    def commit(self, latents: torch.Tensor | None = None) -> None:
        super().commit(latents)
        if self.open_block == "chunk":
            self.frames_streamed += self.chunk
        self.open_block = None


# -- the processors ----------------------------------------------------------------------------
@dataclass
class _StreamCall:
    """What one forward that is not the stock one tells the processors."""

    step: CacheStep | None  # the cache's step; None: no cache, the stock attention under ``mask``
    mask: torch.Tensor | None = None  # (1, 1, T, T) chunk-causal mask of a cache-less call (None: one chunk)
    rope: Rope3D | None = None  # set for position_policy="absolute": rotate q and k here
    tables: RopeTables | None = None  # absolute positions' tables, shared by every layer
    prompt_kv: list | None = None  # per layer (k, v) of the prompt, filled by the first call; None: no memo


class _ActiveCall:
    """The call the processors of one wrapper serve (None: stock path)."""

    def __init__(self):
        self.current: _StreamCall | None = None


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, T, H * D) -> (B, H, T, D)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _self_qkv(attn, hidden_states):
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(hidden_states).chunk(3, dim=-1)
    return attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)


def _cross_kv(attn, context):
    if getattr(attn, "fused_projections", False):
        return attn.to_kv(context).chunk(2, dim=-1)
    return attn.to_k(context), attn.to_v(context)


def _out(attn, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) attention output -> the block's residual branch (B, T, dim)."""
    y = y.transpose(1, 2).flatten(2).type_as(like)
    return attn.to_out[1](attn.to_out[0](y))


class WanCachedSelfAttnProcessor:
    """``attn1`` of block ``layer``: through the core cache during a cached forward, else the
    processor it replaced."""

    def __init__(self, layer: int, fallback, active: _ActiveCall):
        self.layer, self.fallback, self.active = layer, fallback, active

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        call = self.active.current
        if call is None or call.step is None:
            mask = attention_mask if call is None else call.mask
            return self.fallback(attn, hidden_states, encoder_hidden_states, mask, rotary_emb, **kwargs)
        q, k, v = _self_qkv(attn, hidden_states)
        q, k, v = _heads(attn.norm_q(q), attn.heads), _heads(attn.norm_k(k), attn.heads), _heads(v, attn.heads)
        if call.rope is not None:  # absolute positions: stored rotated, the cache never rotates
            q, k = call.rope.apply(q, call.tables), call.rope.apply(k, call.tables)
        return _out(attn, call.step.attend(self.layer, q, k, v), q)  # the stock forward's rotary_emb is unused


class WanCachedCrossAttnProcessor:
    """``attn2`` of block ``layer``: during a cached forward the prompt's K/V come from the call's
    memo (computed by the first call that sees the prompt), else the processor it replaced."""

    def __init__(self, layer: int, fallback, active: _ActiveCall):
        self.layer, self.fallback, self.active = layer, fallback, active

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        call = self.active.current
        if call is None or call.prompt_kv is None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        kv = call.prompt_kv[self.layer]
        if kv is None:
            k, v = _cross_kv(attn, encoder_hidden_states)
            kv = call.prompt_kv[self.layer] = (_heads(attn.norm_k(k), attn.heads), _heads(v, attn.heads))
        q = _heads(attn.norm_q(attn.to_q(hidden_states)), attn.heads)
        return _out(attn, F.scaled_dot_product_attention(q, *kv), q)


class _PromptMemo:
    """Cross-attention K/V of the last prompt seen, per layer. The same tensor (same version) is a
    hit without reading it; another tensor, or an in-place change, is compared by content, so a
    prompt rebuilt every chunk (``torch.cat([cond, uncond])``) still counts as one prompt."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.forget()

    def forget(self) -> None:
        self.prompt = self.version = self.copy = None
        self.kv: list = [None] * self.num_layers

    def lookup(self, prompt: torch.Tensor) -> list:
        if not self._holds(prompt):
            self.prompt, self.version, self.copy = prompt, _version(prompt), prompt.detach().clone()
            self.kv = [None] * self.num_layers
        return self.kv

    def _holds(self, prompt: torch.Tensor) -> bool:
        if self.copy is None:
            return False
        if prompt is self.prompt and self.version is not None and _version(prompt) == self.version:
            return True
        same = (prompt.shape == self.copy.shape and prompt.dtype == self.copy.dtype
                and prompt.device == self.copy.device and torch.equal(prompt, self.copy))
        if same:  # the identity fast path again next time
            self.prompt, self.version = prompt, _version(prompt)
        return same


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version  # inference tensors have no version counter


# -- the model ---------------------------------------------------------------------------------
class WanVideoModel(nn.Module):
    """A diffusers ``WanTransformer3DModel`` with the bundled video DiT's cached call:
    ``model(latents, t, prompt_embeds, cache=cache) -> velocity``, so ``sample_chunk`` and
    ``recache`` drive it unchanged.

    An ``nn.Module`` wrapper rather than a plain class: the drivers call ``model(...)``, and a
    module gives that plus ``.to()``, ``.eval()``, ``parameters()`` and forward hooks (offload)
    for free. It holds no weights of its own (its state dict is the transformer's, under
    ``transformer.``). Building it installs its processors in ``transformer``; calls without a
    cache, through it or straight to the transformer, stay the stock computation.

    Args:
        transformer: a text-to-video ``WanTransformer3DModel`` (no image conditioning) with a
            patch of (1, p, p).
        chunk_frames: latent frames per chunk (Self-Forcing, CausVid, LongLive: 3).
        position_policy: ``"cache-order"`` or ``"absolute"`` (see the module docstring).
    """

    def __init__(self, transformer: WanTransformer3DModel, *, chunk_frames: int = 3,
                 position_policy: str = "cache-order"):
        super().__init__()
        check(isinstance(transformer, WanTransformer3DModel), "transformer", "a diffusers WanTransformer3DModel",
              type(transformer).__name__)
        check(is_int(chunk_frames) and chunk_frames >= 1, "chunk_frames", "an int >= 1 (latent frames per chunk)",
              chunk_frames)
        check_choice("position_policy", position_policy, POSITION_POLICIES)
        cfg = transformer.config
        patch = tuple(cfg.patch_size)
        check(len(patch) == 3 and patch[0] == 1 and patch[1] == patch[2], "patch_size",
              "(1, p, p): no temporal patching (a token lies in one latent frame), square spatial patches", patch)
        check(cfg.image_dim is None and cfg.added_kv_proj_dim is None, "transformer",
              "a text-to-video Wan (image_dim=None, added_kv_proj_dim=None)",
              dict(image_dim=cfg.image_dim, added_kv_proj_dim=cfg.added_kv_proj_dim))
        processors = transformer.attn_processors
        check(not any(isinstance(p, (WanCachedSelfAttnProcessor, WanCachedCrossAttnProcessor))
                      for p in processors.values()), "transformer", "a transformer no WanVideoModel wraps already",
              "one already wrapped")
        self.transformer = transformer
        self.chunk_frames, self.position_policy = chunk_frames, position_policy
        self.patch = patch[1]
        self.num_layers, self.num_heads, self.head_dim = cfg.num_layers, cfg.num_attention_heads, cfg.attention_head_dim
        self._ropes: dict[tuple[int, int], Rope3D] = {}
        self._prompt_kv = _PromptMemo(self.num_layers)
        self._active = _ActiveCall()
        self._stock = dict(processors)
        ours = {}
        for name, proc in processors.items():
            layer = int(name.split(".")[1])  # "blocks.{i}.attn{1,2}.processor"
            kind = WanCachedSelfAttnProcessor if ".attn1." in name else WanCachedCrossAttnProcessor
            ours[name] = kind(layer, proc, self._active)
        transformer.set_attn_processor(ours)
        self._installed = True

    def restore_processors(self) -> None:
        """Put the transformer's original processors back; this wrapper then only runs the stock
        forward (a call with a cache or ``chunk_causal`` is refused)."""
        self.transformer.set_attn_processor(dict(self._stock))
        self._installed = False

    # -- sizes --------------------------------------------------------------------------------
    @property
    def rope_frames(self) -> int:
        """Temporal positions of Wan's RoPE table (``rope_max_seq_len``, 1024): the frame positions
        the model was built for. Cache-order positions stay below ``sink + window + chunk``; the
        absolute policy's stream ends here."""
        return int(self.transformer.config.rope_max_seq_len)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    def _grid(self, h: int, w: int, name: str = "latents") -> tuple[int, int]:
        p = self.patch
        check(is_int(h) and h >= 1 and is_int(w) and w >= 1 and h % p == 0 and w % p == 0, name,
              f"a latent height and width divisible by the patch size {p}", (h, w))
        check(max(h, w) // p <= self.rope_frames, name,
              f"at most {self.rope_frames * p} latent rows and columns (Wan's RoPE table)", (h, w))
        return h // p, w // p

    def tokens_per_frame(self, h: int, w: int) -> int:
        """Tokens of one latent frame of height ``h``, width ``w``."""
        gh, gw = self._grid(h, w, "latent_hw")
        return gh * gw

    def rope(self, h: int, w: int) -> Rope3D:
        """The ``Rope3D`` of latent frames (h, w): Wan's rotary embedding (same t/h/w pair split,
        theta and interleaved layout as ``transformer.rope``) on token positions
        ``frame * P + row * (w / p) + column``."""
        grid = self._grid(h, w, "latent_hw")
        rope = self._ropes.get(grid)
        if rope is None:
            wan = self.transformer.rope
            rope = self._ropes[grid] = Rope3D(self.head_dim, WAN_ROPE_THETA, frame_shape=grid,
                                              sections=(wan.t_dim // 2, wan.h_dim // 2, wan.w_dim // 2))
        return rope

    # -- the cache ----------------------------------------------------------------------------
    def new_cache(self, batch_size: int, sink_frames: int, window_frames: int, latent_hw: tuple[int, int],
                  dtype=None) -> WanStreamCache:
        """A rolling cache for this model: ``frame_size`` = tokens per frame, chunks of
        ``chunk_frames``, one layer per transformer block, the clean latents (C, h, w) of the kept
        frames stored for LongLive's re-cache. ``sink_frames`` pinned frames (StreamingLLM's
        attention sink) and ``window_frames`` recent frames (``check_window``); a chunk
        sees ``sink + window`` frames plus itself (LongLive v1's ``sink_size 3, local_attn_size
        12`` is sink 3, window 6). A window of every frame so far (None or -1) is a cache that
        grows: ``mmspec.adapters.video.CachedStream`` builds and grows it. ``dtype`` of the K/V
        and latents defaults to the model's."""
        C = self.chunk_frames
        check_int(batch_size, "batch_size", 1)
        window = check_window(C, sink_frames, window_frames, self.rope_frames)
        check(window is not None, "window_frames", "an int >= 0 for new_cache (every frame so far, None or -1, is a "
              "cache that grows: CachedStream(model, rows, sink, None) or StreamingVideoPipeline)", window_frames)
        check(isinstance(latent_hw, (tuple, list)) and len(latent_hw) == 2, "latent_hw", "(height, width)", latent_hw)
        h, w = latent_hw
        P = self.tokens_per_frame(h, w)
        dtype = dtype or self.dtype
        rope = self.rope(h, w) if self.position_policy == "cache-order" else None
        return WanStreamCache(self.num_layers, batch_size, self.num_heads, self.head_dim, sink_frames, window_frames,
                              rope=rope, dtype=dtype, device=self.device, frame_size=P, chunk=C,
                              latent_shape=(self.latent_channels, h, w), latent_dtype=dtype)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, latents: torch.Tensor, t, prompt_embeds: torch.Tensor,
                cache: VideoChunkCache | None = None, chunk_causal: bool = False) -> torch.Tensor:
        """Flow velocity (B, F, C, h, w) of latents (B, F, C, h, w) at flow times ``t`` in [0, 1]
        (a number, (B,) or per frame (B, F)) under ``prompt_embeds`` (B, L, text_dim), in the
        latents' dtype.

        With ``cache``: the frames are appended to it as one block of whole chunks where it ends
        (the open chunk's or re-cache's slots), bidirectional inside a chunk, causal across,
        seeing the cache's kept frames. Without: the stock transformer over the frames at
        positions 0 .. F - 1, bidirectional, or with ``chunk_causal`` under a dense chunk-causal
        mask (what CausVid's training forward computes; the window-recompute baseline)."""
        cfg = self.transformer.config
        check(isinstance(latents, torch.Tensor) and latents.dim() == 5 and latents.shape[2] == self.latent_channels,
              "latents", f"a (batch, frames, {self.latent_channels}, height, width) tensor",
              tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__)
        B, Fr, _, h, w = latents.shape
        gh, gw = self._grid(h, w)
        P = gh * gw
        check(isinstance(prompt_embeds, torch.Tensor) and prompt_embeds.dim() == 3
              and prompt_embeds.shape[0] == B and prompt_embeds.shape[2] == cfg.text_dim, "prompt_embeds",
              f"a ({B}, length, {cfg.text_dim}) tensor (the text encoder's rows)",
              tuple(prompt_embeds.shape) if isinstance(prompt_embeds, torch.Tensor) else type(prompt_embeds).__name__)
        device = latents.device
        t = torch.as_tensor(t, dtype=torch.float32, device=device)
        check(t.dim() == 0 or t.shape in ((B,), (B, Fr)), "t", f"a number, ({B},) or ({B}, {Fr}) flow times",
              tuple(t.shape))
        # Wan's timestep is 1000 t; per-frame times go per token (diffusers' ``timestep.ndim == 2``)
        timestep = 1000.0 * (t.expand(B) if t.dim() == 0 else t)
        if timestep.dim() == 2:
            timestep = timestep.repeat_interleave(P, dim=1)  # (B, F * P)
        hidden = latents.to(self.dtype).permute(0, 2, 1, 3, 4)  # (B, C, F, h, w)

        check(isinstance(chunk_causal, bool), "chunk_causal", "True or False", chunk_causal)
        check(self._installed or (cache is None and not chunk_causal), "cache",
              "None after restore_processors() (the stock forward only)", type(cache).__name__)
        if cache is not None:
            call = self._stream_call(cache, B, Fr, (gh, gw), prompt_embeds, device)
        elif chunk_causal:
            check(Fr % self.chunk_frames == 0, "latents", f"whole chunks of {self.chunk_frames} frames with "
                  "chunk_causal=True", Fr)
            # one chunk is bidirectional: no mask, the stock call (a mask would keep SDPA off flash)
            mask = chunk_causal_mask(Fr, self.chunk_frames, P, 1, device)[None] if Fr > self.chunk_frames else None
            call = _StreamCall(None, mask)
        else:
            call = None
        previous, self._active.current = self._active.current, call
        try:
            out = self.transformer(hidden, timestep, prompt_embeds.to(self.dtype), return_dict=False)[0]
        finally:
            self._active.current = previous
        return out.permute(0, 2, 1, 3, 4).to(latents.dtype)  # (B, F, C, h, w)

    def _stream_call(self, cache, B, Fr, grid, prompt_embeds, device) -> _StreamCall:
        """Check the cache against the block (before it is touched), open its step, and say how
        the processors rotate."""
        check(isinstance(cache, VideoChunkCache), "cache", "a VideoChunkCache (WanVideoModel.new_cache)",
              type(cache).__name__)
        C, P = self.chunk_frames, grid[0] * grid[1]
        n = cache.open_frames
        check(Fr % C == 0 if n is None else Fr == n, "latents",
              f"whole chunks of {C} frames with a cache" if n is None else
              f"the {n} frames of the cache's open chunk or re-cache", Fr)
        check(cache.frame_size == P, "latents", f"frames of the cache's {cache.frame_size} tokens "
              f"(patch {self.patch})", f"{P} tokens per frame")
        check(cache.batch_size == B, "latents", f"a batch of the cache's {cache.batch_size} rows", B)
        check(cache.k.shape[0] == self.num_layers, "cache", f"a cache of {self.num_layers} layers",
              cache.k.shape[0])
        absolute = self.position_policy == "absolute"
        if absolute:
            check(isinstance(cache, WanStreamCache) and cache.rope is None, "cache",
                  "a cache from new_cache of a position_policy='absolute' model (it counts the frames streamed "
                  "and stores rotated keys)", type(cache).__name__)
            check(cache.open_block is not None, "cache", "an open chunk or re-cache (begin_chunk() / begin_recache()) "
                  "under position_policy='absolute'", "none open")
            end = cache.frames_streamed + (Fr if cache.open_block == "chunk" else 0)
            check(end <= self.rope_frames, "latents",
                  f"frames within the {self.rope_frames} temporal RoPE positions of this model under "
                  "position_policy='absolute' (Self-Forcing's absolute frame index: use 'cache-order' for longer "
                  "streams)", f"frames {end - Fr}..{end - 1}")
        else:
            shape = getattr(cache.rope, "frame_shape", None)
            check(cache.rope is not None and tuple(shape or ()) == grid, "cache",
                  f"a cache whose rope is a Rope3D over frames of {grid[0]}x{grid[1]} tokens "
                  "(new_cache with this latent size)", shape)
            check(cache.capacity <= self.rope_frames, "cache",
                  f"at most {self.rope_frames} frame slots (the model's temporal RoPE positions)", cache.capacity)

        frames = cache.next_positions().to(device)[:, None] // P + torch.arange(Fr, device=device)  # (B, F)
        j = torch.arange(P, device=device)
        tokens = (frames[..., None] * P + j).flatten(1)  # (B, T) cache-order positions
        rope = tables = None
        if absolute:
            # slots past the sink hold the stream's latest frames: shifted by what has been evicted
            lead = cache.open_lead if cache.open_block == "recache" else 0  # evicted frames re-encoded in front
            offset = max(0, cache.frames_streamed - cache.sink_frames - cache.window_frames - lead)
            abs_frames = frames + (frames >= cache.sink_frames).long() * offset
            rope = self.rope(grid[0] * self.patch, grid[1] * self.patch)
            tables = rope.tables((abs_frames[..., None] * P + j).flatten(1))
        # the cache's default in-block mask is this chunk-causal one when its chunk is ours: the cache
        # then knows a one-chunk block sees every key and hands SDPA no mask (flash kernels on a GPU)
        default = n is not None and cache.chunk == C
        step = cache.step(tokens, None if default else chunk_causal_mask(Fr, C, P, B, device))
        # keyed on the caller's tensor, not a dtype-cast copy, so the identity fast path can hit
        memo = None if torch.is_grad_enabled() else self._prompt_kv.lookup(prompt_embeds)
        return _StreamCall(step, rope=rope, tables=tables, prompt_kv=memo)


# -- checkpoints in Wan's own key layout -------------------------------------------------------
def load_original_wan(state_dict_or_path: dict | str | os.PathLike, config: dict, *,
                      prefix: str | None = None) -> WanTransformer3DModel:
    """A ``WanTransformer3DModel`` of ``config`` (a diffusers config dict, e.g. a saved
    ``transformer.config``) holding a state dict in the original Wan / ``CausalWanModel`` key
    layout (``blocks.0.self_attn.q.weight``, ``head.head.weight``, ...; Self-Forcing, CausVid and
    LongLive checkpoints), renamed by diffusers' ``convert_wan_transformer_to_diffusers``.

    ``state_dict_or_path``: a dict of tensors or a ``.safetensors`` file (pickled ``.pt``
    checkpoints are not read: convert them once with the tool you trust). ``prefix``: stripped
    from every key (default: ``"model."`` when every key has it, as in Self-Forcing's
    ``generator`` dicts; diffusers' converter strips ``model.diffusion_model.`` itself).
    Parameters take the state dict's tensors (and dtype) without a random init; every key must
    match."""
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        path = os.fspath(state_dict_or_path)
        check(path.endswith(".safetensors") and os.path.isfile(path), "state_dict_or_path",
              "a dict or an existing .safetensors file", path)
        state_dict = load_file(path)
    else:
        check(isinstance(state_dict_or_path, dict), "state_dict_or_path", "a dict or a .safetensors path",
              type(state_dict_or_path).__name__)
        state_dict = dict(state_dict_or_path)  # the converter pops from what it is given
    check(isinstance(config, dict), "config", "a WanTransformer3DModel config dict", type(config).__name__)
    if prefix is None:
        prefix = "model." if state_dict and all(k.startswith("model.") and not k.startswith(
            "model.diffusion_model.") for k in state_dict) else ""
    state_dict = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}
    converted = convert_wan_transformer_to_diffusers(state_dict)
    with init_empty_weights():  # parameters on meta, buffers (the RoPE tables) real
        model = WanTransformer3DModel.from_config(config)
    want = set(model.state_dict())
    missing, unexpected = sorted(want - set(converted)), sorted(set(converted) - want)
    check(not missing and not unexpected, "state_dict_or_path",
          "the original Wan keys of this config", f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.load_state_dict(converted, strict=True, assign=True)
    return model.eval()


def merge_lora(state_dict: dict, lora_state_dict: dict, scale: float = 1.0, *, prefix: str = "model.") -> dict:
    """A state dict with a LoRA merged in: ``W + scale * B @ A`` for every ``lora_A`` / ``lora_B``
    pair, as peft's ``merge_and_unload`` computes it (``scale = lora_alpha / r``: 1 for LongLive's
    ``rank: 256, alpha: 256``, configs/longlive_inference.yaml). ``lora_state_dict`` is in peft's
    layout (``base_model.model.<module>.lora_A.weight``; LongLive's ``lora.pt`` holds it under
    ``"generator_lora"``), ``state_dict`` in Wan's original names, each key behind ``prefix``
    (``"model."`` in LongLive's ``generator`` dicts, the ``WanDiffusionWrapper``'s). Every LoRA
    pair must find its base weight; the result is a new dict (the inputs are left as they are),
    in the base weights' dtype, the product taken in float32."""
    check(isinstance(state_dict, dict) and isinstance(lora_state_dict, dict), "state_dict",
          "two dicts of tensors (the base state dict, the LoRA's)", type(state_dict).__name__)
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool), "scale", "a number (lora_alpha / r)",
          scale)
    merged = dict(state_dict)
    pairs = {}
    for key, value in lora_state_dict.items():
        for part in ("lora_A", "lora_B"):
            if f".{part}." in key:
                module = key.split(f".{part}.")[0].removeprefix("base_model.model.")
                pairs.setdefault(module, {})[part] = value
    check(bool(pairs) and all(len(p) == 2 for p in pairs.values()), "lora_state_dict",
          "peft LoRA weights: a lora_A and a lora_B weight for each module",
          sorted(m for m, p in pairs.items() if len(p) != 2)[:4] or "no lora_A / lora_B keys")
    for module, p in pairs.items():
        key = f"{prefix}{module}.weight"
        check(key in merged, "lora_state_dict", f"modules of the base state dict (no {key!r} there)", module)
        base = merged[key]
        delta = p["lora_B"].float() @ p["lora_A"].float()
        check(delta.shape == base.shape, "lora_state_dict", f"a LoRA of {key}'s shape {tuple(base.shape)}",
              tuple(delta.shape))
        merged[key] = (base.float() + scale * delta).to(base.dtype)
    return merged


# -- text ----------------------------------------------------------------------------------------
def encode_prompts(texts, text_encoder, tokenizer, max_length: int = 512) -> torch.Tensor:
    """UMT5 prompt embeddings (B, max_length, d_model) as ``diffusers.WanPipeline``'s
    ``_get_t5_prompt_embeds`` makes them: cleaned text, padded to ``max_length`` (truncated past
    it), the rows past each prompt's tokens zeroed; in the text encoder's dtype, on its device.
    ``texts``: a string or a list; ``None`` or ``""`` is the null prompt (WanPipeline's default
    negative prompt, ``""``)."""
    texts = [texts] if texts is None or isinstance(texts, str) else list(texts)
    check(len(texts) >= 1 and all(x is None or isinstance(x, str) for x in texts), "texts",
          "a string, None, or a non-empty list of them", texts)
    check(is_int(max_length) and max_length >= 1, "max_length", "an int >= 1 (tokens per prompt)", max_length)
    texts = [prompt_clean(x or "") for x in texts]
    tokens = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)
    embeds = text_encoder(ids, mask).last_hidden_state  # (B, L, d_model)
    # WanPipeline keeps each prompt's first ``mask.sum()`` rows and pads with zeros
    keep = torch.arange(embeds.shape[1], device=device) < mask.gt(0).sum(1, keepdim=True)  # (B, L)
    return embeds.masked_fill(~keep[..., None], 0.0).to(text_encoder.dtype)


# -- pixels ------------------------------------------------------------------------------------
class WanStreamingDecoder:
    """Chunk-by-chunk decoding with ``AutoencoderKLWan``'s causal decoder: its per-conv
    ``feat_cache`` (the last frames each causal conv needs) is carried from one call to the next,
    so decoding a stream chunk by chunk gives the pixels of decoding it at once (Self-Forcing's
    streaming decode). The first latent frame of a stream decodes to 1 pixel frame, each later one
    to the VAE's temporal factor (4).

    ``decode`` takes normalised latents (what the transformer produces) and de-normalises them
    with the config's ``latents_mean`` / ``latents_std`` as ``WanPipeline`` does. Call ``reset()``
    before a new stream."""

    def __init__(self, vae: AutoencoderKLWan):
        check(isinstance(vae, AutoencoderKLWan), "vae", "a diffusers AutoencoderKLWan", type(vae).__name__)
        self.vae = vae
        self.num_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.reset()

    def reset(self) -> None:
        self._feat_cache: list = [None] * self.num_convs
        self._first = True

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Pixels (B, n', 3, H, W) in [-1, 1] of the next latent frames (B, n, C, h, w)."""
        vae = self.vae
        z_dim = vae.config.z_dim
        check(isinstance(latents, torch.Tensor) and latents.dim() == 5 and latents.shape[2] == z_dim
              and latents.shape[1] >= 1, "latents", f"a (batch, frames >= 1, {z_dim}, height, width) tensor",
              tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__)
        param = next(vae.parameters())
        z = latents.to(param).permute(0, 2, 1, 3, 4)  # (B, C, n, h, w)
        shape = (1, z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z)
        inv_std = (1.0 / torch.tensor(vae.config.latents_std)).view(shape).to(z)
        x = vae.post_quant_conv(z / inv_std + mean)  # WanPipeline's rounding; a 1x1x1 conv: no temporal state
        out = []
        for i in range(x.shape[2]):  # one latent frame at a time, as AutoencoderKLWan._decode
            out.append(vae.decoder(x[:, :, i:i + 1], feat_cache=self._feat_cache, feat_idx=[0],
                                   first_chunk=self._first))
            self._first = False
        pixels = torch.cat(out, 2)
        if vae.config.patch_size is not None:
            pixels = unpatchify(pixels, patch_size=vae.config.patch_size)
        return pixels.clamp(-1.0, 1.0).permute(0, 2, 1, 3, 4)  # (B, n', 3, H, W)
