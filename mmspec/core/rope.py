"""Rotary position embeddings (Su et al., 2021, "RoFormer"), one family for every model we own.

A rotary embedding turns the head dimension D into D/2 rotation pairs; pair j of a token turns by
the angle ``coordinate[axis(j)] * inv_freq[j]``. The members differ only in how many position
axes there are, which pairs follow which axis, their frequencies, and how dimensions pair up:

| member        | axes                 | pairs per axis                          | layout      |
|---------------|----------------------|-----------------------------------------|-------------|
| ``Rope1D``    | sequence             | all, ``theta ** (-2j / D)``             | half        |
| ``GridRope2D``| raster row, column   | D/4 each, ``base ** (-4j / D)`` each    | interleaved |
| ``MRope``     | time, height, width  | ``sections``, one shared frequency set  | half        |
| ``Rope3D``    | time, height, width  | ``sections``, each its own frequencies  | interleaved |

``half`` pairs dimension j with j + D/2 (GPT-NeoX, HF Llama/Qwen's ``rotate_half``);
``interleaved`` pairs 2j with 2j + 1 (the complex-number form of LlamaGen and Wan).

Angles are computed once per forward and shared by every layer: ``tables(positions)`` gives the
cos/sin tables, ``apply(x, tables)`` rotates. A rotary embedding is also the core caches' ``Rope``
callable, ``rope(x, positions)``; caches call it once per layer with the same positions tensor,
so ``tables`` remembers the last two position tensors it saw (by identity and version counter:
an in-place change recomputes) and the layers after the first reuse their tables.

Pure math: no model, no library beyond torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import check, check_choice, check_int, is_int

LAYOUTS = ("half", "interleaved")
PREFIX_ROPES = ("identity", "zero")  # GridRope2D: what its prefix (condition) tokens get


def frequencies(dim: int, theta: float) -> torch.Tensor:
    """(dim/2,) float32 inverse frequencies ``theta ** (-2j / dim)`` of a ``dim``-wide rotation."""
    return theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)


@dataclass(frozen=True)
class RopeTables:
    """cos and sin of every pair's angle, float32 (B, 1, T, D/2): broadcast over heads."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding:
    """The family's engine: pair j turns by ``coords[axis(j)] * inv_freq[j]``.

    Args:
        inv_freq: (D/2,) the frequency of every pair.
        sections: pairs per axis, in order (contiguous runs of pairs); default one axis.
        layout: ``"half"`` or ``"interleaved"`` (see the module docstring).

    ``positions`` are either (B, T) (mapped to coordinates by ``coordinates``) or explicit
    coordinates (A, B, T), one row per axis.
    """

    def __init__(self, inv_freq: torch.Tensor, sections: Sequence[int] | None = None, layout: str = "half"):
        check_choice("layout", layout, LAYOUTS)
        inv_freq = torch.as_tensor(inv_freq, dtype=torch.float32).flatten()
        sections = [len(inv_freq)] if sections is None else [int(s) for s in sections]
        check(all(s >= 0 for s in sections) and sum(sections) == len(inv_freq), "sections",
              f"non-negative pair counts summing to {len(inv_freq)} (half the head dimension)", sections)
        self.inv_freq, self.sections, self.layout = inv_freq, sections, layout
        self._freq_on = {inv_freq.device: inv_freq}
        self._memo: tuple = ()  # ((positions, version, tables), ...) newest first, at most 2

    @property
    def head_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @property
    def num_axes(self) -> int:
        return len(self.sections)

    def coordinates(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(A, B, T) coordinates of (B, T) positions and a (B, T) mask of tokens left unrotated
        (or None). Default: the position on every axis (M-RoPE's rule for text tokens)."""
        return positions.expand(self.num_axes, *positions.shape), None

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T, D/2) float32 angle of every pair."""
        if positions.dim() == 2:
            coords, still = self.coordinates(positions)
        else:
            check(positions.dim() == 3 and positions.shape[0] == self.num_axes, "positions",
                  f"a (B, T) tensor or ({self.num_axes}, B, T) coordinates", tuple(positions.shape))
            coords, still = positions, None
        freq = self._freq_on.get(positions.device)
        if freq is None:
            freq = self._freq_on[positions.device] = self.inv_freq.to(positions.device)
        if self.num_axes == 1:
            angles = coords[0].to(torch.float32)[..., None] * freq
        else:
            bounds = [0]
            for s in self.sections:
                bounds.append(bounds[-1] + s)
            angles = torch.cat([coords[a].to(torch.float32)[..., None] * freq[bounds[a]:bounds[a + 1]]
                                for a in range(self.num_axes)], -1)
        if still is not None:
            angles = angles.masked_fill(still[..., None], 0.0)
        return angles

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """cos/sin tables for (B, T) positions or (A, B, T) coordinates; compute once per forward
        and pass them to every layer's ``apply``."""
        # inference tensors have no version counter; under torch.compile the graph computes them once
        tracked = not torch.compiler.is_compiling() and not positions.is_inference()
        if tracked:
            for seen, version, tables in self._memo:
                if seen is positions and version == positions._version:
                    return tables
        angles = self.angles(positions)[:, None]  # (B, 1, T, D/2)
        tables = RopeTables(angles.cos(), angles.sin())
        if tracked:
            self._memo = ((positions, positions._version, tables),) + self._memo[:1]
        return tables

    def apply(self, x: torch.Tensor, tables: RopeTables) -> torch.Tensor:
        """Rotate x (B, H, T, D) (any leading dims the tables broadcast to), in float32."""
        D = x.shape[-1]
        check(D == self.head_dim, "x", f"a tensor whose last dimension is the head dimension {self.head_dim}", D)
        cos, sin = tables.cos, tables.sin
        if self.layout == "half":
            a, b = x.float().chunk(2, dim=-1)
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)
        a, b = x.float().unflatten(-1, (D // 2, 2)).unbind(-1)  # (..., D/2) each
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2).to(x.dtype)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``rope(x, positions)``: the core caches' ``Rope`` protocol."""
        return self.apply(x, self.tables(positions))


def _check_dim(head_dim: int, multiple: int) -> None:
    check(is_int(head_dim) and head_dim >= multiple and head_dim % multiple == 0, "head_dim",
          f"a positive multiple of {multiple}", head_dim)


class Rope1D(RotaryEmbedding):
    """RoFormer's 1-D RoPE over sequence positions (B, T): pair j turns by ``p * theta ** (-2j / D)``."""

    def __init__(self, head_dim: int, theta: float = 10000.0, layout: str = "half"):
        _check_dim(head_dim, 2)
        check(theta > 0, "theta", "> 0", theta)
        super().__init__(frequencies(head_dim, theta), layout=layout)


class GridRope2D(RotaryEmbedding):
    """LlamaGen's 2-D RoPE over a ``grid_size``-wide raster of image tokens after ``prefix``
    condition tokens (LlamaGen's ``cls_token_num``).

    Sequence position p >= prefix is raster index ``p - prefix``: the first D/4 pairs turn by its
    row, the last D/4 by its column, each with frequencies ``base ** (-4j / D)``. Positions past
    the grid continue the raster rows.

    ``prefix_rope`` says what the prefix tokens get: ``"identity"`` (default) leaves them
    unrotated; ``"zero"`` multiplies them by cos = sin = 0, i.e. zeroes their queries and keys,
    which is what LlamaGen's released code does (``precompute_freqs_cis_2d`` prepends zero rows,
    not identity rows), so its checkpoints need it to be reproduced exactly. It applies to (B, T)
    positions; explicit (A, B, T) coordinates carry no prefix.
    """

    def __init__(self, head_dim: int, grid_size: int, base: float = 10000.0, prefix: int = 1,
                 prefix_rope: str = "identity"):
        _check_dim(head_dim, 4)
        check_int(grid_size, "grid_size", 1)
        check(base > 0, "base", "> 0", base)
        check_int(prefix, "prefix", 0)
        check_choice("prefix_rope", prefix_rope, PREFIX_ROPES)
        freq = frequencies(head_dim // 2, base)  # == base ** (-4j / D)
        super().__init__(torch.cat([freq, freq]), sections=(head_dim // 4, head_dim // 4), layout="interleaved")
        self.grid_size, self.prefix, self.prefix_rope = grid_size, prefix, prefix_rope

    def coordinates(self, positions):
        raster = (positions - self.prefix).clamp(min=0)
        return torch.stack([raster // self.grid_size, raster % self.grid_size]), positions < self.prefix

    def tables(self, positions: torch.Tensor) -> RopeTables:
        tables = super().tables(positions)
        if self.prefix_rope == "identity" or positions.dim() != 2:
            return tables
        keep = (positions >= self.prefix)[:, None, :, None].to(tables.cos.dtype)  # (B, 1, T, 1)
        return RopeTables(tables.cos * keep, tables.sin * keep)


class MRope(RotaryEmbedding):
    """Qwen2-VL's multimodal RoPE (Wang et al., 2024): the D/2 frequencies ``theta ** (-2j / D)``
    of a 1-D RoPE, split into ``sections`` (Qwen2-VL's ``mrope_section``) that follow the time,
    height and width ids (3, B, T). (B, T) positions give text tokens (the same id on all three
    axes), where it equals ``Rope1D``.

    ``inv_freq`` replaces the frequencies, e.g. by a checkpoint's own buffer: transformers
    computes ``1 / theta ** (2j / D)``, which differs from ``theta ** (-2j / D)`` in the last bit
    for some j.
    """

    def __init__(self, head_dim: int, sections: Sequence[int], theta: float = 10000.0,
                 inv_freq: torch.Tensor | None = None):
        _check_dim(head_dim, 2)
        check(theta > 0, "theta", "> 0", theta)
        check(len(sections) == 3, "sections", "three pair counts (time, height, width)", list(sections))
        super().__init__(frequencies(head_dim, theta) if inv_freq is None else inv_freq, sections, "half")


class Rope3D(RotaryEmbedding):
    """The (time, height, width) RoPE of video DiTs (Wan's layout): the head dimension is cut into
    three contiguous runs of pairs, ``sections``, and each run is a 1-D interleaved RoPE of its
    own axis with its own frequencies ``theta ** (-2j / d_a)`` (``d_a`` = 2 x its pairs). Relative
    on each axis; at height = width = 0 it is ``Rope1D(d_t, theta, "interleaved")`` on the time run.

    Args:
        head_dim: D, even.
        theta: the rotary base of every axis.
        sections: pairs of (time, height, width), summing to D/2; default Wan's split, time
            ``D/2 - 2 (D // 6)`` and ``D // 6`` for each spatial axis.
        frame_shape: (height, width) tokens of a frame; with it, (B, T) sequence positions are
            frame-major raster indices ``t * H * W + h * W + w``. Without it, pass (3, B, T)
            coordinates.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, sections: Sequence[int] | None = None,
                 frame_shape: tuple[int, int] | None = None):
        _check_dim(head_dim, 2)
        check(theta > 0, "theta", "> 0", theta)
        if sections is None:
            spatial = head_dim // 6
            sections = (head_dim // 2 - 2 * spatial, spatial, spatial)
        check(len(sections) == 3, "sections", "three pair counts (time, height, width)", list(sections))
        if frame_shape is not None:
            check(len(frame_shape) == 2 and all(is_int(n) and n >= 1 for n in frame_shape),
                  "frame_shape", "(height, width) ints >= 1", frame_shape)
        freq = torch.cat([frequencies(2 * int(s), theta) for s in sections])
        super().__init__(freq, sections, "interleaved")
        self.frame_shape = frame_shape

    def coordinates(self, positions):
        check(self.frame_shape is not None, "positions",
              "(3, B, T) (time, height, width) coordinates: this Rope3D has no frame_shape", tuple(positions.shape))
        H, W = self.frame_shape
        return torch.stack([positions // (H * W), positions // W % H, positions % W]), None
