"""``demos/render.py``: what the demo draws beside the outputs, without a model or a server."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demos import render  # noqa: E402


def _frames(n: int, h: int = 2, w: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def test_frame_strip_rows_scale_and_white_tail():
    frames = _frames(5)
    strip = render.frame_strip(frames, per_row=2, scale=2)
    assert strip.shape == (3 * 4, 2 * 6, 3) and strip.dtype == np.uint8
    for i, f in enumerate(frames):  # frame i at row i // 2, column i % 2, each pixel 2 x 2
        r, c = divmod(i, 2)
        assert np.array_equal(strip[r * 4:(r + 1) * 4, c * 6:(c + 1) * 6], f.repeat(2, 0).repeat(2, 1))
    assert (strip[8:, 6:] == 255).all()  # the last row ends early: white
    picked = render.frame_strip(frames, every=2, per_row=16, scale=1)  # frames 0, 2, 4 in one row
    assert np.array_equal(picked, np.concatenate([frames[0], frames[2], frames[4]], 1))
    assert np.array_equal(render.frame_strip(frames[:1], scale=3), frames[0].repeat(3, 0).repeat(3, 1))
    with pytest.raises(ValueError, match="frames must be at least one frame"):
        render.frame_strip([])


def test_commit_grid_image_colours_passes_and_borders_between_them():
    img = render.commit_grid_image(np.array([0, 1, 2, 2]), grid=2, cell=4)
    assert img.shape == (8, 8, 3) and img.dtype == np.uint8
    dark = [40, 40, 40]
    assert (img[0, 0] == 255).all()  # the prefill's token is white
    assert not np.array_equal(img[0, 4], img[4, 0])  # passes 1 and 2 differ
    assert np.array_equal(img[4, 0], img[4, 4])  # tokens of one pass share a colour ...
    assert not (img[4:7, 3] == dark).all(axis=-1).any()  # ... and no border between them
    assert (img[0:3, 3] == dark).all()  # a border between passes 0 and 1 ...
    assert (img[3, 0:3] == dark).all() and (img[3, 4:7] == dark).all()  # ... and between the rows' passes
    with pytest.raises(ValueError, match="commit_pass must be 256 pass indices"):
        render.commit_grid_image(np.zeros(10, dtype=int))


def test_stats_lines():
    line = render.stats_line({"nfe": 90, "tau": 2.891, "wall_seconds": 1.0}, {"nfe": 256, "wall_seconds": 2.1})
    assert line == "NFE 90 | tau 2.89 | wall 1.00 s | speed-up 2.10x | NFE x 2.84"
    stats = {"frames": 96, "chunks": 32, "fps": 31.2, "latency_ms_median": 96.4, "latency_ms_p95": 120.2,
             "cache_frames": 12, "cache_kib": 97.0, "nfe": 288, "switch_frames": [48], "cache_mode": "rolling",
             "sink_frames": 3, "window_frames": 9, "num_inference_steps": 8, "guidance_scale": 3.5}
    assert render.video_stats_line(stats) == (
        "96 frames, 32 chunks | 31.2 fps | chunk latency median 96 ms (p95 120 ms) | cache 12 frames, 97 KiB | "
        "NFE 288 | re-cache at frames [48] | rolling: sink 3, window 9, 8 steps, CFG 3.5")
