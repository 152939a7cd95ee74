"""A tiny chunk-causal video diffusion transformer over latent frames (CausVid / Self-Forcing's
causal DiT, at toy scale), with rolling sink + window attention built into training.

Frames are grouped in chunks of ``chunk_frames`` latent frames. A chunk attends bidirectionally
to itself and causally to earlier chunks, of which it sees only the *sink* (the first
``sink_frames``) and a *window* of the most recent frames: exactly what a rolling
``SinkWindowCache`` holds. Keys are rotated by their position in that visible set (cache order,
StreamingLLM's rule), so the positions a chunk sees never grow with the stream.

A latent frame (C, h, w) is cut into ``patch_size`` patches: ``P = (h / p) * (w / p)`` tokens in
raster order, with token position ``frame * P + raster index``; the 3-D RoPE
(``mmspec.core.rope.Rope3D`` with ``frame_shape``) reads (time, row, column) from it.

Conditioning (DiT's adaLN-Zero): per frame, the sum of a flow time embedding and the prompt's
embedding (three ids: colour, shape, direction; each field has its own table with a null row for
classifier-free guidance) modulates every block. The model predicts the flow-matching velocity
``v = noise - x0`` at time t of ``x_t = (1 - t) x0 + t noise`` (rectified flow); sampling takes
a few steps from t = 1 to 0 through diffusers' ``FlowMatchEulerDiscreteScheduler``
(``mmspec.adapters.video``: ``FlowSampler``, ``sample_chunk``).

Three attention paths, one block code:
- ``cache``: a core cache (``StaticKVCache`` family) through ``cache.step(positions, mask)`` and
  ``step.attend(layer, q, k, v)`` (as ``LlamaGenModel``: the rolling attention kernel where the
  kernels' dispatch picks it, the cache's update + SDPA otherwise); the cache stores keys before
  RoPE and rotates them by cache order (``SinkWindowCache``).
- ``plan`` (``ChunkPlan``): a set of query groups, each with its own visible frames and their
  cache-order positions, gathered from one sequence. Training runs the *two-stream* plan: a
  context stream (the frames as they would be committed at t = 0: clean, noised, or the model's
  own predictions) and a query stream (noisy chunks), where query chunk c sees the context
  stream's sink and window frames plus itself: one forward computes what the rolling cache
  computes at every chunk of the clip (tested equal).
- neither: full chunk-causal attention over the given frames at positions ``0 .. F - 1``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import get_timestep_embedding
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from torch.nn import functional as F

from ..adapters.video import VideoChunkCache, chunk_causal_mask
from ..core.errors import check, check_int, is_int
from ..core.rope import RopeTables, Rope3D

PROMPT_FIELDS = ("colour", "shape", "direction")


def parse_prompt(text: str, vocab: dict[str, list[str]]) -> tuple[int, ...]:
    """Ids of a text prompt, one per field of ``vocab`` (field -> words): exactly one word of
    each field must appear in ``text`` (any order, case, punctuation; other words ignored)."""
    check(isinstance(text, str) and text.strip() != "", "prompt", "a non-empty string", text)
    words = re.findall(r"[a-z]+", text.lower())
    ids = []
    for name, field in vocab.items():
        found = sorted({w for w in words if w in field})
        check(len(found) == 1, "prompt", f"text naming exactly one {name} of {', '.join(field)}", text)
        ids.append(list(field).index(found[0]))
    return tuple(ids)


# -- attention plans ---------------------------------------------------------------------------
def visible_chunks(c: int, sink_chunks: int, window_chunks: int | None) -> list[int]:
    """Earlier chunks chunk ``c`` sees: the sink chunks and the last ``window_chunks`` (None: all),
    in cache order."""
    if window_chunks is None:
        return list(range(c))
    return list(range(min(sink_chunks, c))) + list(range(max(sink_chunks, c - window_chunks), c))


@dataclass
class ChunkPlan:
    """Query groups over one token sequence: group g's queries are tokens ``q_idx[g]`` at
    positions ``q_pos[g]``; its keys are tokens ``k_idx[g]`` at positions ``k_pos[g]`` where
    ``k_valid[g]`` (padding elsewhere). Every token is a query of exactly one group.

    Build with ``rolling`` (one stream) or ``two_stream`` (training)."""

    q_idx: torch.Tensor  # (G, Tq) long
    q_pos: torch.Tensor  # (G, Tq) long
    k_idx: torch.Tensor  # (G, Lk) long
    k_pos: torch.Tensor  # (G, Lk) long
    k_valid: torch.Tensor  # (G, Lk) bool
    num_tokens: int

    @staticmethod
    def from_groups(groups: list[tuple[list[int], list[int]]], tokens_per_frame: int, num_frames: int) -> "ChunkPlan":
        """``groups``: (query frames, context frames) pairs; the keys of a group are its context
        frames then its query frames, at frame positions 0, 1, ... in that order."""
        P = tokens_per_frame
        Lk = max(len(q) + len(k) for q, k in groups) * P
        j = torch.arange(P)
        q_idx, q_pos, k_idx, k_pos, k_valid = [], [], [], [], []
        for query, context in groups:
            keys = list(context) + list(query)
            q_idx.append((torch.tensor(query)[:, None] * P + j).flatten())
            q_pos.append(((len(context) + torch.arange(len(query)))[:, None] * P + j).flatten())
            idx = (torch.tensor(keys)[:, None] * P + j).flatten()
            pad = Lk - len(idx)
            k_idx.append(F.pad(idx, (0, pad)))
            k_pos.append(F.pad(torch.arange(len(idx)), (0, pad)))
            k_valid.append(F.pad(torch.ones(len(idx), dtype=torch.bool), (0, pad)))
        check(len({len(q) for q in q_idx}) == 1, "groups", "query groups of equal size", [len(q) for q, _ in groups])
        plan = ChunkPlan(torch.stack(q_idx), torch.stack(q_pos), torch.stack(k_idx), torch.stack(k_pos),
                         torch.stack(k_valid), num_frames * P)
        covered = torch.zeros(plan.num_tokens, dtype=torch.long).index_add_(
            0, plan.q_idx.flatten(), torch.ones(plan.q_idx.numel(), dtype=torch.long))
        check(bool((covered == 1).all()), "groups", "query frames covering every frame exactly once", groups)
        return plan

    @staticmethod
    def rolling(num_frames: int, chunk_frames: int, tokens_per_frame: int, sink_frames: int = 0,
                window_frames: int | None = None) -> "ChunkPlan":
        """One stream of ``num_frames`` frames: chunk c sees the sink, the window before it, and
        itself, as a ``SinkWindowCache`` of ``sink_frames`` + ``window_frames`` would show it
        (``window_frames=None``: every earlier chunk, absolute positions)."""
        C = chunk_frames
        S, W = _chunks(num_frames, C, sink_frames, window_frames)
        frames = lambda chunks: [f for c in chunks for f in range(c * C, (c + 1) * C)]  # noqa: E731
        groups = [(frames([c]), frames(visible_chunks(c, S, W))) for c in range(num_frames // C)]
        return ChunkPlan.from_groups(groups, tokens_per_frame, num_frames)

    @staticmethod
    def two_stream(num_frames: int, chunk_frames: int, tokens_per_frame: int, sink_frames: int = 0,
                   window_frames: int | None = None) -> "ChunkPlan":
        """Training's plan over ``2 * num_frames`` frames: the context stream (frames ``0 ..
        F - 1``) attends as in ``rolling`` (the commit passes), and query chunk c (frames ``F +
        c * C ..``) sees the *context* stream's sink and window frames plus itself (a denoising
        step of chunk c)."""
        C, N = chunk_frames, num_frames
        S, W = _chunks(num_frames, C, sink_frames, window_frames)
        frames = lambda chunks, off=0: [off + f for c in chunks for f in range(c * C, (c + 1) * C)]  # noqa: E731
        groups = []
        for c in range(N // C):
            context = frames(visible_chunks(c, S, W))
            groups += [(frames([c]), context), (frames([c], N), context)]
        return ChunkPlan.from_groups(groups, tokens_per_frame, 2 * N)

    def rope_tables(self, rope: Rope3D) -> tuple[RopeTables, RopeTables]:
        """Query and key tables (1, 1, G, T, D/2): broadcast over batch and heads."""
        out = []
        for pos in (self.q_pos, self.k_pos):
            t = rope.tables(pos)  # (G, 1, T, D/2)
            out.append(RopeTables(t.cos[:, 0][None, None], t.sin[:, 0][None, None]))
        return out[0], out[1]


def _chunks(num_frames, chunk, sink_frames, window_frames):
    check_int(chunk, "chunk_frames", 1)
    check(is_int(num_frames) and num_frames >= chunk and num_frames % chunk == 0, "num_frames",
          f"a positive multiple of chunk_frames ({chunk})", num_frames)
    check(is_int(sink_frames) and sink_frames >= 0 and sink_frames % chunk == 0, "sink_frames",
          f"a multiple of chunk_frames ({chunk}), >= 0", sink_frames)
    check(window_frames is None or (is_int(window_frames) and window_frames >= chunk
                                    and window_frames % chunk == 0), "window_frames",
          f"None or a positive multiple of chunk_frames ({chunk})", window_frames)
    return sink_frames // chunk, None if window_frames is None else window_frames // chunk


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """(..., dim) sinusoidal embedding of flow times t in [0, 1] (scaled by 1000, as DiT's steps):
    diffusers' ``get_timestep_embedding``, cosines first."""
    emb = get_timestep_embedding((1000.0 * t.float()).flatten(), dim, flip_sin_to_cos=True, downscale_freq_shift=0,
                                 max_period=max_period)
    return emb.view(*t.shape, dim)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class VideoDiTBlock(nn.Module):
    """adaLN-Zero DiT block: modulated LayerNorm, attention with QK-RMSNorm and 3-D RoPE,
    modulated LayerNorm, GELU MLP; both branches gated."""

    def __init__(self, layer: int, dim: int, n_heads: int, mlp_hidden: int):
        super().__init__()
        self.layer, self.n_heads = layer, n_heads
        head_dim = dim // n_heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, dim))
        self.ada = nn.Linear(dim, 6 * dim)

    def forward(self, x, c, attend):
        """x (B, T, dim) with T = F * P, c (B, F, dim) per-frame conditioning,
        ``attend(layer, q, k, v) -> (B, H, T, D)``. The modulation is computed per frame and
        broadcast over its P tokens (a per-token adaLN linear would cost more than the attention)."""
        B, T, dim = x.shape
        Fr = c.shape[1]
        mods = [m[:, :, None] for m in self.ada(c).chunk(6, -1)]  # 6 x (B, F, 1, dim)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        per_frame = lambda t: t.view(B, Fr, T // Fr, dim)  # noqa: E731
        h = modulate(per_frame(self.norm1(x)), shift1, scale1).view(B, T, dim)
        q, k, v = self.qkv(h).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        y = attend(self.layer, self.q_norm(q), self.k_norm(k), v)  # (B, H, T, D)
        x = x + (gate1 * per_frame(self.proj(y.transpose(1, 2).reshape(B, T, dim)))).view(B, T, dim)
        h = modulate(per_frame(self.norm2(x)), shift2, scale2).view(B, T, dim)
        return x + (gate2 * per_frame(self.mlp(h))).view(B, T, dim)


class VideoDiTModel(ModelMixin, ConfigMixin):
    """Prompt-conditioned chunk-causal flow-matching transformer over latent frames.

    Args:
        latent_channels, latent_size: latent frames are (latent_channels, latent_size, latent_size).
        patch_size: side of a patch; ``P = (latent_size / patch_size) ** 2`` tokens per frame.
        chunk_frames: latent frames per chunk (bidirectional inside, causal across).
        sink_frames, window_frames: the rolling attention the model was trained with: the first
            ``sink_frames`` frames and the ``window_frames`` frames before a chunk stay visible
            (multiples of ``chunk_frames``); the defaults a pipeline should use.
        dim, n_layers, n_heads, mlp_hidden: transformer width, depth, heads, MLP width.
        rope_theta: the 3-D RoPE's base (all three axes).
        prompt_vocab: ``{"colour": [...], "shape": [...], "direction": [...]}``: the words of each
            prompt field; id ``len(words)`` of a field is its null (unconditional) id.
        prompt_dropout_prob: probability of training a clip with the null prompt (for CFG).
        sample_steps, time_shift, guidance_scale: sampling defaults (Euler steps per chunk, the
            scheduler's sigma shift, classifier-free guidance scale).
        conv_head: 0, or the width of a 3x3 convolutional head after the linear unpatchify, as
            U-ViT adds one (Bao et al., 2023): the last block's tokens are also projected to
            ``conv_head // 2`` channels per latent cell, put back on the latent grid, and refined
            by conv3x3 -> GELU -> conv3x3 over each whole latent frame (zero-initialised, so it
            starts as no head) into a correction added to the linear output.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(self, latent_channels: int = 4, latent_size: int = 8, patch_size: int = 2, chunk_frames: int = 3,
                 sink_frames: int = 3, window_frames: int = 9, dim: int = 128, n_layers: int = 4, n_heads: int = 4,
                 mlp_hidden: int = 384, rope_theta: float = 100.0, prompt_vocab: dict | None = None,
                 prompt_dropout_prob: float = 0.1, sample_steps: int = 4, time_shift: float = 1.0,
                 guidance_scale: float = 3.0, conv_head: int = 0):
        super().__init__()
        for name, value in dict(latent_channels=latent_channels, latent_size=latent_size, patch_size=patch_size,
                                chunk_frames=chunk_frames, dim=dim, n_layers=n_layers, n_heads=n_heads,
                                mlp_hidden=mlp_hidden, sample_steps=sample_steps).items():
            check_int(value, name, 1)
        check(latent_size % patch_size == 0, "patch_size", f"a divisor of latent_size ({latent_size})", patch_size)
        check(dim % n_heads == 0 and (dim // n_heads) % 2 == 0, "n_heads",
              f"a divisor of dim ({dim}) leaving an even head dimension", n_heads)
        _chunks(chunk_frames, chunk_frames, sink_frames, window_frames)
        check(0.0 <= prompt_dropout_prob <= 1.0, "prompt_dropout_prob", "a number in [0, 1]", prompt_dropout_prob)
        check(time_shift > 0, "time_shift", "> 0", time_shift)
        check(is_int(conv_head) and (conv_head == 0 or (conv_head >= 2 and conv_head % 2 == 0)), "conv_head",
              "0 (none) or an even int >= 2", conv_head)
        if prompt_vocab is None:
            prompt_vocab = {"colour": ["red", "green", "blue", "yellow"],
                            "shape": ["circle", "square", "triangle", "star"],
                            "direction": ["right", "left", "up", "down"]}
        check(isinstance(prompt_vocab, dict) and sorted(prompt_vocab) == sorted(PROMPT_FIELDS)
              and all(len(prompt_vocab[f]) >= 1 for f in PROMPT_FIELDS), "prompt_vocab",
              f"a dict of word lists for {', '.join(PROMPT_FIELDS)}", prompt_vocab)
        # in field order (a saved config.json has its keys sorted); saved with the config
        self.prompt_vocab = {f: list(prompt_vocab[f]) for f in PROMPT_FIELDS}
        self.register_to_config(prompt_vocab=self.prompt_vocab)
        grid = latent_size // patch_size
        self.tokens_per_frame = grid * grid
        patch_dim = latent_channels * patch_size * patch_size
        self.patch_embed = nn.Linear(patch_dim, dim)
        self.time_embed = nn.Sequential(nn.Linear(256, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.prompt_embed = nn.ModuleList(nn.Embedding(len(words) + 1, dim) for words in self.prompt_vocab.values())
        self.blocks = nn.ModuleList(VideoDiTBlock(i, dim, n_heads, mlp_hidden) for i in range(n_layers))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(dim, 2 * dim)
        self.proj_out = nn.Linear(dim, patch_dim)
        if conv_head:
            self.head_in = nn.Linear(dim, conv_head // 2 * patch_size * patch_size)
            self.head_conv = nn.Sequential(nn.Conv2d(conv_head // 2, conv_head, 3, padding=1),
                                           nn.GELU(approximate="tanh"), nn.Conv2d(conv_head, latent_channels, 3, padding=1))
        else:
            self.head_in = self.head_conv = None
        self._init_weights()
        # the (time, row, column) RoPE, also the caches' ``rope(x, token positions)``
        self.rope = Rope3D(dim // n_heads, rope_theta, frame_shape=(grid, grid))

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for emb in self.prompt_embed:
            nn.init.normal_(emb.weight, std=0.02)
        last = [self.head_conv[-1]] if self.head_conv is not None else []
        for m in [*(b.ada for b in self.blocks), self.ada_out, self.proj_out, *last]:  # adaLN-Zero
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    # -- prompts ------------------------------------------------------------------------------
    @property
    def null_prompt(self) -> tuple[int, ...]:
        return tuple(len(words) for words in self.prompt_vocab.values())

    def encode_prompts(self, prompts) -> torch.Tensor:
        """Text prompts (a str or a list) -> (B, 3) ids; ``None`` entries are the null prompt."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        check(len(prompts) >= 1, "prompt", "a string or a non-empty list of strings", prompts)
        ids = [self.null_prompt if p is None else parse_prompt(p, self.prompt_vocab) for p in prompts]
        return torch.tensor(ids, device=self.device)

    def drop_prompts(self, prompt: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Replace each row's prompt (B, 3) or (B, F, 3) by the null prompt with probability
        ``prompt_dropout_prob`` (one draw per row: a clip is either conditioned or not)."""
        u = torch.rand(prompt.shape[0], generator=generator, device=prompt.device)
        drop = (u < self.config.prompt_dropout_prob).view(-1, *[1] * (prompt.dim() - 1))
        return torch.where(drop, torch.tensor(self.null_prompt, device=prompt.device), prompt)

    # -- latents <-> tokens -------------------------------------------------------------------
    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, F, C, h, w) -> (B, F * P, C * p * p), tokens frame-major, raster order inside."""
        B, Fr, C, h, w = latents.shape
        p = self.config.patch_size
        x = latents.reshape(B, Fr, C, h // p, p, w // p, p).permute(0, 1, 3, 5, 2, 4, 6)
        return x.reshape(B, Fr * (h // p) * (w // p), C * p * p)

    def unpatchify(self, tokens: torch.Tensor, num_frames: int) -> torch.Tensor:
        """(B, F * P, C' * p * p) -> (B, F, C', h, w): ``patchify``'s inverse, for any channel
        count C' (the latent's, or the conv head's input)."""
        B = tokens.shape[0]
        p, s = self.config.patch_size, self.config.latent_size
        C = tokens.shape[-1] // (p * p)
        g = s // p
        x = tokens.reshape(B, num_frames, g, g, C, p, p).permute(0, 1, 4, 2, 5, 3, 6)
        return x.reshape(B, num_frames, C, s, s)

    # -- forward ------------------------------------------------------------------------------
    @property
    def rope_frames(self) -> int:
        """Frame positions the time axis of the 3-D RoPE tells apart: one turn of its slowest
        time frequency, ``floor(2 pi / min inv_freq_t)`` (291 for ``rope_theta=100`` and head
        dimension 32). Past it the time rotation wraps around and far positions alias near ones,
        so no cache of this model may show more frames than that (``new_cache`` refuses)."""
        pairs = self.rope.sections[0]
        return int(2 * math.pi / float(self.rope.inv_freq[:pairs].min()))

    def new_cache(self, batch_size: int, sink_frames: int | None = None, window_frames: int | None = None,
                  dtype=None) -> VideoChunkCache:
        """A rolling ``VideoChunkCache`` for this model at frame granularity: ``frame_size`` =
        tokens per frame, Self-Forcing chunks of ``chunk_frames`` (``begin_chunk`` / ``commit``),
        the clean latents of the kept frames stored for LongLive's re-cache (``recache``). Sink and
        window in frames (default: the ones the model was trained with); sink + window + one chunk
        must stay within ``rope_frames``."""
        cfg = self.config
        sink = cfg.sink_frames if sink_frames is None else sink_frames
        window = cfg.window_frames if window_frames is None else window_frames
        _chunks(cfg.chunk_frames, cfg.chunk_frames, sink, window)
        R = self.rope_frames
        check(sink + window + cfg.chunk_frames <= R, "sink_frames + window_frames",
              f"at most {R - cfg.chunk_frames} frames: with a chunk of {cfg.chunk_frames} the frames a chunk sees "
              f"must stay within the {R} frame positions this model's RoPE tells apart", sink + window)
        p = next(self.parameters())
        dtype = dtype or p.dtype
        return VideoChunkCache(cfg.n_layers, batch_size, cfg.n_heads, cfg.dim // cfg.n_heads, sink, window,
                               rope=self.rope, dtype=dtype, device=p.device, frame_size=self.tokens_per_frame,
                               chunk=cfg.chunk_frames,
                               latent_shape=(cfg.latent_channels, cfg.latent_size, cfg.latent_size),
                               latent_dtype=dtype)

    def forward(self, latents: torch.Tensor, t, prompt: torch.Tensor, positions: torch.Tensor | None = None,
                cache=None, plan: ChunkPlan | None = None) -> torch.Tensor:
        """Velocity (B, F, C, h, w) of noisy latents (B, F, C, h, w) at flow times ``t`` (a number,
        (B,) or per frame (B, F)) under prompts (B, 3) or per frame (B, F, 3).

        With ``cache``: the frames are appended to it as one block of whole chunks (``F`` a
        multiple of ``chunk_frames``, bidirectional inside a chunk, causal across) at frame
        ``positions`` (B, F) (default: where the cache ends). With ``plan``: attention as the plan
        says (positions come from it). Otherwise full chunk-causal attention at positions
        ``0 .. F - 1``."""
        B, Fr = latents.shape[:2]
        cfg = self.config
        shape = (cfg.latent_channels, cfg.latent_size, cfg.latent_size)
        check(latents.dim() == 5 and tuple(latents.shape[2:]) == shape, "latents",
              f"a (batch, frames, {', '.join(map(str, shape))}) tensor", tuple(latents.shape))
        check(cache is None or plan is None, "plan", "None when a cache is given", "a plan")
        P = self.tokens_per_frame
        t = torch.as_tensor(t, dtype=torch.float32, device=latents.device)
        t = t.expand(B, Fr) if t.dim() == 0 else (t[:, None].expand(B, Fr) if t.dim() == 1 else t)
        check(t.shape == (B, Fr), "t", f"a number, ({B},) or ({B}, {Fr})", tuple(t.shape))
        prompt = prompt[:, None].expand(B, Fr, 3) if prompt.dim() == 2 else prompt
        check(prompt.shape == (B, Fr, 3), "prompt", f"({B}, 3) or ({B}, {Fr}, 3) ids", tuple(prompt.shape))

        c = self.time_embed(timestep_embedding(t, 256).to(self.time_embed[0].weight.dtype))  # (B, F, dim)
        for field, emb in enumerate(self.prompt_embed):
            c = c + emb(prompt[..., field])
        c = F.silu(c)  # (B, F, dim): every token of a frame alike
        x = self.patch_embed(self.patchify(latents))  # (B, T, dim)

        if cache is not None:
            if positions is None:
                positions = cache.next_positions()[:, None].div(P, rounding_mode="floor") + torch.arange(
                    Fr, device=latents.device)
            check(positions.shape == (B, Fr), "positions", f"({B}, {Fr}) frame positions", tuple(positions.shape))
            check(Fr % cfg.chunk_frames == 0, "latents", f"whole chunks of {cfg.chunk_frames} frames with a cache",
                  Fr)
            tokens = (positions[..., None] * P + torch.arange(P, device=latents.device)).flatten(1)  # (B, T)
            attend = cache.step(tokens, chunk_causal_mask(Fr, cfg.chunk_frames, P, B, latents.device)).attend
        elif plan is None:
            # full chunk-causal attention at positions 0 .. F - 1: what ChunkPlan.rolling(F) gives,
            # computed densely (every token rotated once, one attention call under a (T, T) mask)
            # rather than by gathering each chunk's keys (which rotates a chunk's keys once per later
            # chunk); the window-recompute baseline runs this path on every denoising step
            tab = self.rope.tables(torch.arange(Fr * P, device=latents.device)[None])  # (1, 1, T, D/2)
            dense_mask = chunk_causal_mask(Fr, cfg.chunk_frames, P, 1, latents.device)[0]  # (T, T) bool

            def attend(layer, q, k, v):
                return F.scaled_dot_product_attention(self.rope.apply(q, tab), self.rope.apply(k, tab), v,
                                                      attn_mask=dense_mask)
        else:
            check(plan.num_tokens == Fr * P, "plan", f"a plan over {Fr} frames", plan.num_tokens // P)
            plan_on = ChunkPlan(*(getattr(plan, f).to(latents.device) for f in
                                  ("q_idx", "q_pos", "k_idx", "k_pos", "k_valid")), plan.num_tokens)
            q_tab, k_tab = plan_on.rope_tables(self.rope)
            # additive mask (G, 1, Lk): converted once, not by every layer's attention call
            mask = torch.zeros(plan_on.k_valid.shape, device=latents.device).masked_fill(
                ~plan_on.k_valid, float("-inf"))[:, None, :]
            q_flat = plan_on.q_idx.flatten()

            def attend(layer, q, k, v):
                qg = self.rope.apply(q[:, :, plan_on.q_idx], q_tab)  # (B, H, G, Tq, D)
                kg = self.rope.apply(k[:, :, plan_on.k_idx], k_tab)  # (B, H, G, Lk, D)
                y = F.scaled_dot_product_attention(qg, kg, v[:, :, plan_on.k_idx], attn_mask=mask)
                out = torch.empty_like(q)
                out[:, :, q_flat] = y.flatten(2, 3)
                return out

        for block in self.blocks:
            x = block(x, c, attend)
        shift, scale = (m[:, :, None] for m in self.ada_out(c).chunk(2, -1))  # (B, F, 1, dim) each
        h = modulate(self.norm_out(x).view(B, Fr, P, -1), shift, scale).flatten(1, 2)
        out = self.unpatchify(self.proj_out(h), Fr)
        if self.head_conv is not None:
            grid = self.unpatchify(self.head_in(h), Fr)  # (B, F, C', h, w)
            out = out + self.head_conv(grid.flatten(0, 1)).view(out.shape)
        return out


# -- decoder-style cache use ----------------------------------------------------------------
def commit(cache) -> None:
    """Keep everything appended and roll: evict down to sink + window (decoder-style)."""
    cache.truncate(cache.lengths)
