"""The video bench's quality measures on its streams: first/last-frame accuracies with bootstrap
intervals, the switch rows' schedules and measures, the colour-cycling segments, and the ceiling on
real rendered clips. The per-frame judges and switch measures they apply are
``mmspec.eval.video``'s."""

from __future__ import annotations

import numpy as np
import torch

from ...eval.stats import bootstrap_indices, mean_ci
from ...eval.video import accuracy, frames_until, judge_frames, pixel_changes, switch_jump
from .config import VideoBenchConfig
from .timing import _Run

# a direction switch turns a quarter: the centroid measure tells perpendicular motions apart best
_TURN = {"right": "up", "up": "left", "left": "down", "down": "right"}


def _schedules(cfg: VideoBenchConfig, vocab: dict) -> dict[str, list]:
    """The switch rows' prompt texts: per field, ``(first prompts, switched prompts)``."""
    from ...training.data.video import VideoPrompt

    out = {}
    for fld in cfg.switches:
        new = []
        for text in cfg.prompts:
            p = VideoPrompt.parse(text)
            ids = list(p.ids)
            if fld == "colour":
                ids[0] = (ids[0] + 1) % len(vocab["colour"])
            else:
                ids[2] = vocab["direction"].index(_TURN[vocab["direction"][ids[2]]])
            new.append(VideoPrompt(*ids).text)
        out[fld] = new
    return out


def _want(texts: list[str], schedule: list | None, n_frames: int) -> torch.Tensor:
    """(B, F, 3) the prompt ids each video should show at each frame."""
    from ...training.data.video import VideoPrompt

    base = torch.tensor([VideoPrompt.parse(t).ids for t in texts])  # (B, 3)
    want = base[:, None].expand(-1, n_frames, 3).clone()
    for start, new in schedule or []:
        want[:, start:] = torch.tensor([VideoPrompt.parse(t).ids for t in new])[:, None]
    return want


def _quality(run: _Run, texts: list[str], schedule, judge, cfg: VideoBenchConfig) -> dict:
    """First/last ``quality_frames`` accuracies (mean over videos), pixel change medians, and the
    judged frames of the head (the switch rows need them); ``streams``, the number of videos, and
    for the shape accuracy a 95% percentile-bootstrap interval over the videos
    (``shape_acc_{first,last}_ci_{low,high}``: ``bootstrap_resamples`` resamples of the streams,
    ``bootstrap_indices(streams, resamples, bootstrap_seed)``; None without a judge or resamples)."""
    head, tail, tail_start = run.buffer.frames()
    q = cfg.quality_frames
    total = run.done
    want = _want(texts, schedule, total)
    rows = {"first": [], "last": []}
    seen_head = []
    for b in range(head.shape[0]):
        sh = judge_frames(head[b], want[b, :head.shape[1]], judge)
        st = judge_frames(tail[b], want[b, tail_start:], judge)
        seen_head.append(sh)
        rows["first"].append(accuracy(sh, want[b, :head.shape[1]], slice(0, min(q, head.shape[1]))))
        rows["last"].append(accuracy(st, want[b, tail_start:], slice(max(0, tail.shape[1] - q), tail.shape[1])))
    out = {"streams": head.shape[0]}
    for when, accs in rows.items():
        for key in ("class_acc", "shape_acc", "colour_acc", "direction_acc"):
            vals = [a[key] for a in accs if a[key] is not None]
            out[f"{key}_{when}"] = float(np.mean(vals)) if vals else None
            if key == "shape_acc":
                ci = (mean_ci(vals, bootstrap_indices(len(vals), cfg.bootstrap_resamples, cfg.bootstrap_seed))
                      if vals and cfg.bootstrap_resamples else (None, None))
                out[f"shape_acc_{when}_ci_low"], out[f"shape_acc_{when}_ci_high"] = ci
    for key in ("class_acc", "direction_acc"):  # drift: last minus first, in points
        a, z = out[f"{key}_first"], out[f"{key}_last"]
        out[f"{key}_drift"] = None if a is None or z is None else 100 * (z - a)
    out["change_first"] = float(pixel_changes(head[:, :q]).median()) if head.shape[1] > 1 else None
    out["change_last"] = float(pixel_changes(tail[:, -q:]).median()) if tail.shape[1] > 1 else None
    return out | {"_head": head, "_seen_head": seen_head}


def _switch_measures(r: _Run, quality: dict, old: list[str], new: list[str], fld: str, cfg: VideoBenchConfig,
                     C: int, judged: bool) -> dict:
    """Per video: frames from the switch until the stream shows the new value of the switched
    field ``hold_frames`` frames in a row (colour: the judge's colour head and ``frame_colour``
    from pixels agree on it, pixels alone without a judge: a head forced to pick a colour does
    not count on a frame without one; direction: the centroid's motion into the frame), the share
    of the frames before the switch showing the old value, and the pixel change at the switch."""
    from ...training.data.video import VideoPrompt

    head, seen = quality["_head"], quality["_seen_head"]
    s = cfg.switch_at
    until, before, jumps = [], [], []
    for b in range(head.shape[0]):
        o, nw = VideoPrompt.parse(old[b]), VideoPrompt.parse(new[b])
        if fld == "colour":
            shown = _shown_colour(seen[b], judged)
            reports_new, reports_old = shown == nw.colour, shown[:s] == o.colour
        else:
            d = seen[b]["direction"]  # step f-1 -> f reported at frame f
            reports_new = torch.cat([torch.zeros(1, dtype=torch.bool), d == nw.direction])
            reports_old = d[: s - 1] == o.direction
        until.append(frames_until(reports_new, s, cfg.hold_frames))
        before.append(float(reports_old.float().mean()) if reports_old.numel() else None)
        jumps.append(switch_jump(pixel_changes(head[b]), s, span=2 * C))
    got = [u for u in until if u is not None]
    ratios = [j["jump_ratio"] for j in jumps if j["jump_ratio"] is not None]
    peaks = [j["jump_max_ratio"] for j in jumps if j["jump_max_ratio"] is not None]
    return dict(switch_at=s, switch_frames_to_new=float(np.mean(got)) if got else None,
                switch_frames_to_new_max=max(got) if got else None, switch_frames_to_new_each=until,
                switch_within_2_chunks=float(np.mean([u is not None and u < 2 * C for u in until])),
                switch_old_before=float(np.mean([v for v in before if v is not None])) if any(
                    v is not None for v in before) else None,
                switch_jump=float(np.mean([j["jump"] for j in jumps])),
                switch_median_change=float(np.mean([j["median"] for j in jumps])),
                switch_jump_ratio=float(np.mean(ratios)) if ratios else None,
                switch_jump_max_ratio=float(np.mean(peaks)) if peaks else None,
                switch_latency_ms=1000 * float(np.mean([t for t, sw in zip(r.latency, r.switched) if sw]))
                if any(r.switched) else None,
                switch_real_jump_ratio=_real_jump(old, new, cfg, C))


def _shown_colour(seen: dict, judged: bool) -> torch.Tensor:
    """(F,) the colour each frame shows (``judge_frames`` output): the pixels' colour where the
    judge's colour head agrees (a head forced to pick a colour does not count on a frame without
    one), -1 elsewhere; the pixels alone without a judge."""
    shown = seen["colour"]
    return torch.where(seen["judge_colour"] == shown, shown, -1) if judged else shown


def _colour_cycle(texts: list[str], segments: int, every: int, vocab: dict) -> list:
    """A schedule ``[(0, texts), (every, texts'), ...]``: each segment's prompts take the next
    palette colour (shape and direction kept)."""
    from ...training.data.video import VideoPrompt

    schedule = []
    for k in range(segments):
        new = []
        for text in texts:
            p = VideoPrompt.parse(text)
            new.append(VideoPrompt((p.colour + k) % len(vocab["colour"]), p.shape, p.direction).text)
        schedule.append((k * every, new))
    return schedule


def _segment_measures(quality: dict, schedule: list, n_frames: int, cfg: VideoBenchConfig, C: int,
                      judged: bool) -> dict:
    """Per stream and prompt segment of a colour-cycling schedule: the share of the segment's
    frames showing its colour (judge and pixels agreeing, pixels alone without a judge), and per
    switch the frames until the new colour holds ``hold_frames`` frames in a row."""
    from ...training.data.video import VideoPrompt

    seen = quality["_seen_head"]
    bounds = [start for start, _ in schedule] + [n_frames]
    segment_acc, until = [], []
    for b, frames_seen in enumerate(seen):
        shown = _shown_colour(frames_seen, judged)
        accs = []
        for k, (start, texts) in enumerate(schedule):
            want = VideoPrompt.parse(texts[b]).colour
            accs.append(float((shown[start:bounds[k + 1]] == want).float().mean()))
            if k:
                until.append(frames_until(shown == want, start, cfg.hold_frames))
        segment_acc.append(accs)
    return dict(multi_switch_every=cfg.multi_switch_every, colour_segments=segment_acc,
                colour_min_segment=min(min(a) for a in segment_acc),
                colour_mean_segment=float(np.mean(segment_acc)),
                switch_frames_to_new=float(np.mean([u for u in until if u is not None])) if any(
                    u is not None for u in until) else None,
                switch_frames_to_new_each=until,
                multi_switch_within_2_chunks=float(np.mean([u is not None and u < 2 * C for u in until])))


def _real_jump(old: list[str], new: list[str], cfg: VideoBenchConfig, C: int) -> float | None:
    """``switch_jump_ratio`` of real rendered clips with the same switch (mean over prompts): the
    jump a switch makes in the data itself (a colour switch repaints the object in one frame)."""
    from ...training.data.video import VideoPrompt, render_clip
    from ...training.recipes.video import VIDEO_DATA_STYLE

    ratios = []
    for i, (o, n) in enumerate(zip(old, new)):
        frames, _ = render_clip([(0, VideoPrompt.parse(o)), (cfg.switch_at, VideoPrompt.parse(n))], cfg.switch_frames,
                                torch.Generator().manual_seed(cfg.seed + i), style=VIDEO_DATA_STYLE)
        j = switch_jump(pixel_changes((frames + 1) / 2), cfg.switch_at, span=2 * C)["jump_ratio"]
        if j is not None:
            ratios.append(j)
    return float(np.mean(ratios)) if ratios else None


@torch.no_grad()
def _ceiling(pipe, judge, cfg: VideoBenchConfig) -> dict:
    """Judge and direction accuracies on real rendered clips of the bench's prompts (one per
    prompt, ``reference_frames`` frames, generator ``seed + i``) and on the pipeline's
    autoencoder reconstructions of them: what a perfect generator reaches, before and after the
    decoder."""
    from ...training.data.video import VideoPrompt, render_clip
    from ...training.recipes.video import VIDEO_DATA_STYLE

    out = {}
    real, recon, wants = [], [], []
    for i, text in enumerate(cfg.prompts):
        p = VideoPrompt.parse(text)
        frames, _ = render_clip([(0, p)], cfg.reference_frames, torch.Generator().manual_seed(cfg.seed + i),
                                pipe.vae.config.sample_size, style=VIDEO_DATA_STYLE)
        real.append((frames + 1) / 2)
        recon.append((pipe.vae(frames).clamp(-1, 1) + 1) / 2)
        wants.append(torch.tensor(p.ids).expand(cfg.reference_frames, 3))
    for name, clips in (("real", real), ("recon", recon)):
        accs = [accuracy(judge_frames(c, w, judge), w, slice(None)) for c, w in zip(clips, wants)]
        for key in ("class_acc", "shape_acc", "colour_acc", "direction_acc"):
            vals = [a[key] for a in accs if a[key] is not None]
            out[f"{name}_{key}"] = float(np.mean(vals)) if vals else None
    return out
