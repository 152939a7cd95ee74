"""What a video stream shows: the judge's and the pixels' reading of every frame
(``judge_frames``), accuracies over a span of frames (``accuracy``), and the measures of a prompt
switch (``frames_until`` the new prompt holds, ``pixel_changes`` and the ``switch_jump`` they make).
Frames are the rendered videos' (``mmspec.training.data.video``: its palette, shapes and motion
directions), read inside ``judge_frames``; the video bench (``mmspec.bench.video``) applies these
to its streams."""

from __future__ import annotations

import torch

from ..core.errors import check, check_int, is_int


def frames_until(reports, start: int, hold: int = 1) -> int | None:
    """Frames from ``start`` until ``reports`` (F,) bool is True ``hold`` frames in a row (0: at
    ``start`` itself); None if it never is."""
    r = torch.as_tensor(reports, dtype=torch.bool).flatten()
    check_int(hold, "hold", 1)
    check(is_int(start) and 0 <= start <= len(r), "start", f"an int in [0, {len(r)}]", start)
    run = 0
    for f in range(start, len(r)):
        run = run + 1 if bool(r[f]) else 0
        if run == hold:
            return f - hold + 1 - start
    return None


def pixel_changes(frames: torch.Tensor) -> torch.Tensor:
    """(..., F - 1) mean absolute change of each frame from the previous, for frames (..., F, 3, H,
    W) (any range; the bench passes [0, 1])."""
    return (frames[..., 1:, :, :, :].float() - frames[..., :-1, :, :, :].float()).abs().mean(dim=(-3, -2, -1))


def switch_jump(changes: torch.Tensor, switch_at: int, span: int = 1) -> dict:
    """The change entering frame ``switch_at`` (``changes[switch_at - 1]``) and the largest over
    the ``span`` frames from it, each over the median change of the stream outside that span."""
    c = torch.as_tensor(changes, dtype=torch.float64).flatten()
    check(is_int(switch_at) and 1 <= switch_at <= len(c), "switch_at", f"an int in [1, {len(c)}]",
          switch_at)
    inside = torch.zeros(len(c), dtype=torch.bool)
    inside[switch_at - 1: switch_at - 1 + span] = True
    median = float(c[~inside].median()) if bool((~inside).any()) else float("nan")
    at, peak = float(c[switch_at - 1]), float(c[inside].max())
    ratio = lambda v: v / median if median > 0 else None  # noqa: E731
    return dict(jump=at, jump_max=peak, median=median, jump_ratio=ratio(at), jump_max_ratio=ratio(peak))


@torch.no_grad()
def judge_frames(frames: torch.Tensor, want: torch.Tensor, judge=None) -> dict:
    """What a stream shows, per frame, for frames (F, 3, H, W) in [0, 1] asked to show prompt ids
    ``want`` (F, 3) (colour, shape, direction): ``colour`` (F,) ``frame_colour`` from pixels;
    ``judge_colour``, ``judge_shape`` (F,) the judge's ids (None without a judge); ``direction``
    (F - 1,) the motion of the wanted colour's centroid between consecutive frames (-1 where that
    colour is missing in either frame)."""
    from ..training.data.video import frame_colour, motion_direction, pixel_centroid

    x = frames.float() * 2 - 1
    out = {"colour": frame_colour(x)}
    if judge is not None:
        pred = judge.predict(x)
        out.update(judge_colour=pred["colour"], judge_shape=pred["shape"])
    else:
        out.update(judge_colour=None, judge_shape=None)
    centroids = pixel_centroid(x, want[:, 0])  # (F, 2), NaN where the colour is absent
    seen = ~centroids.isnan().any(-1)
    d = motion_direction(centroids) if len(x) > 1 else torch.zeros(0, dtype=torch.long)
    out["direction"] = torch.where(seen[1:] & seen[:-1], d, -1)
    return out


def accuracy(seen: dict, want: torch.Tensor, frames: slice) -> dict:
    """Accuracies over ``frames`` (a slice of frame indices) of ``judge_frames`` output against
    ``want`` (F, 3): ``class_acc`` (the prompt's colour, the judge's colour head and the pixels
    agreeing on it, and the prompt's shape from the judge; a head forced to pick a colour does not
    count on a frame without the object), ``shape_acc`` (the judge), ``colour_acc`` (pixels),
    ``direction_acc`` (steps whose later frame is in ``frames``)."""
    idx = torch.arange(len(want))[frames]
    mean = lambda t: float(t.float().mean()) if t.numel() else None  # noqa: E731
    colour_ok = seen["colour"][idx] == want[idx, 0]
    out = {"colour_acc": mean(colour_ok)}
    if seen["judge_shape"] is not None:
        shape_ok = seen["judge_shape"][idx] == want[idx, 1]
        both_colour = colour_ok & (seen["judge_colour"][idx] == want[idx, 0])
        out.update(shape_acc=mean(shape_ok), class_acc=mean(shape_ok & both_colour))
    else:
        out.update(shape_acc=None, class_acc=None)
    steps = idx[idx >= 1]
    out["direction_acc"] = mean(seen["direction"][steps - 1] == want[steps, 2])
    return out
