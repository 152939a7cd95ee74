"""What the demo shows beside the outputs, and nothing else uses: the per-token picture (the AR
image tab), the strip of chunk frames (the streaming video tab), the stats lines, and the VLM
answer split into words marked by where they came from."""

from __future__ import annotations

import numpy as np
import torch
from torchvision.utils import make_grid

from mmspec.core.errors import check
from mmspec.serve import Models


def frame_strip(frames: list[np.ndarray], every: int = 1, per_row: int = 16, scale: int = 2) -> np.ndarray:
    """Every ``every``-th of (H, W, 3) uint8 ``frames`` in rows of ``per_row``, ``scale`` times
    larger (nearest neighbour), white where the last row ends early: (rows * H * scale,
    min(count, per_row) * W * scale, 3) uint8."""
    check(len(frames) >= 1, "frames", "at least one frame", len(frames))
    picked = torch.from_numpy(np.stack(frames[::every])).permute(0, 3, 1, 2)  # (N, 3, H, W) uint8
    picked = picked.repeat_interleave(scale, 2).repeat_interleave(scale, 3)
    return make_grid(picked, nrow=per_row, padding=0, pad_value=255).permute(1, 2, 0).contiguous().numpy()


def _pass_colour(k: np.ndarray) -> np.ndarray:
    """A colour per pass index: hues spaced by the golden angle, so consecutive passes differ
    clearly; the prefill (0) is white. (N,) ints -> (N, 3) uint8."""
    h = (k * 0.618033988749895) % 1.0
    s, v = 0.65, 0.95
    i = np.floor(h * 6).astype(int) % 6
    f = h * 6 - np.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    r = np.select([i == j for j in range(6)], [v, q, p, p, t, v])
    g = np.select([i == j for j in range(6)], [t, v, v, q, p, p])
    b = np.select([i == j for j in range(6)], [p, p, t, v, v, q])
    out = (np.stack([r, g, b], -1) * 255).round().astype(np.uint8)
    out[k == 0] = 255
    return out


def commit_grid_image(commit_pass: np.ndarray, grid: int = 16, cell: int = 16) -> np.ndarray:
    """The per-token picture: the (grid x grid) token grid, each cell coloured by the decode pass
    that committed its token; cells committed together share a colour and are joined (no border
    between them). Returns (grid * cell, grid * cell, 3) uint8."""
    check(commit_pass is not None and commit_pass.size == grid * grid, "commit_pass",
          f"{grid * grid} pass indices", None if commit_pass is None else commit_pass.shape)
    k = commit_pass.reshape(grid, grid)
    img = np.repeat(np.repeat(_pass_colour(k.flatten()).reshape(grid, grid, 3), cell, 0), cell, 1)
    dark = np.array([40, 40, 40], np.uint8)
    for r in range(grid):
        for c in range(grid):
            y, x = r * cell, c * cell
            if c + 1 < grid and k[r, c + 1] != k[r, c]:
                img[y:y + cell, x + cell - 1] = dark
            if r + 1 < grid and k[r + 1, c] != k[r, c]:
                img[y + cell - 1, x:x + cell] = dark
    return img


def stats_line(stats: dict, baseline: dict | None = None) -> str:
    """``NFE 90 | tau 2.89 | wall 1.01 s | speed-up 2.1x`` (speed-up over ``baseline``'s wall)."""
    parts = [f"NFE {stats.get('nfe', '?')}", f"tau {stats.get('tau', 0):.2f}", f"wall {stats['wall_seconds']:.2f} s"]
    if baseline is not None and stats["wall_seconds"] > 0:
        parts.append(f"speed-up {baseline['wall_seconds'] / stats['wall_seconds']:.2f}x")
        parts.append(f"NFE x {baseline.get('nfe', 0) / max(1, stats.get('nfe', 1)):.2f}")
    return " | ".join(parts)


def video_stats_line(stats: dict) -> str:
    """``96 frames, 32 chunks | 31.2 fps | chunk latency median 96 ms (p95 120 ms) | cache 12 frames,
    97 KiB | NFE 288 | re-cache at frames [48] | rolling: sink 3, window 9, 8 steps, CFG 3.5``."""
    s = stats
    mode = s["cache_mode"] + (f": sink {s['sink_frames']}, window {s['window_frames']}"
                              if s["cache_mode"] != "full-cache" else ": every frame kept")
    parts = [f"{s['frames']} frames, {s['chunks']} chunks", f"{s['fps']} fps",
             f"chunk latency median {s['latency_ms_median']:.0f} ms (p95 {s['latency_ms_p95']:.0f} ms)",
             f"cache {s['cache_frames']} frames, {s['cache_kib']:.0f} KiB", f"NFE {s['nfe']}"]
    if s["switch_frames"]:
        parts.append(f"re-cache at frames {s['switch_frames']}")
    parts.append(f"{mode}, {s['num_inference_steps']} steps, CFG {s['guidance_scale']:g}")
    return " | ".join(parts)


def vlm_pieces(models: Models, tokens: list[int], commit_pass: np.ndarray | None) -> list[tuple[str, str | None]]:
    """The answer as ``(word, label)`` pieces for display: ``"draft"`` for tokens that came from
    accepted drafts, ``None`` for the target's own tokens (one per pass: the correction or bonus
    token, and the prefill's first token). Special tokens are dropped."""
    tok = models.pipeline("vlm").processor.tokenizer
    special = set(tok.all_special_ids)
    pieces = []
    for i, t in enumerate(tokens):
        if t in special:
            continue
        last_of_pass = commit_pass is None or i + 1 == len(tokens) or commit_pass[i + 1] != commit_pass[i]
        word = tok.decode([t])
        pieces.append((word + " ", None if last_of_pass else "draft"))
    return pieces
