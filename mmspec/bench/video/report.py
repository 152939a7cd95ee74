"""What the video bench reports: its table's columns and the JSON it writes."""

from __future__ import annotations


def public(result: dict) -> dict:
    """The result as the JSON holds it: every key but the private ones (``_``-prefixed)."""
    return {k: v for k, v in result.items() if not k.startswith("_")}


VIDEO_COLUMNS = [
    ("method", "method"), ("group", "group"), ("switch", "switch"), ("frames_done", "frames"), ("sink", "sink"),
    ("window", "window"), ("chunk", "chunk"), ("steps", "steps"), ("streams", "streams"), ("fps", "fps"),
    ("latency_ms_median", "ms/chunk"), ("latency_ms_p95", "p95 ms"), ("latency_slope", "ms/1k fr"),
    ("latency_slope_se", "+-se"), ("latency_slope_adj", "adj ms/1k"), ("peak_rss_mb", "RSS MB"),
    ("rss_slope", "MB/1k fr"), ("cache_mb", "cache MB"),
    ("speedup_vs_recompute", "x recompute"), ("compute_ratio", "compute x"), ("class_acc_first", "class first"),
    ("class_acc_last", "class last"), ("shape_acc_first", "shape first"), ("shape_acc_first_ci_low", "95% low"),
    ("shape_acc_first_ci_high", "95% high"), ("shape_acc_last", "shape last"), ("shape_acc_last_ci_low", "95% low"),
    ("shape_acc_last_ci_high", "95% high"), ("direction_acc_first", "dir first"), ("direction_acc_last", "dir last"),
    ("switch_frames_to_new", "switch frames"), ("switch_jump_ratio", "jump/median"),
    ("colour_min_segment", "colour worst seg"), ("stopped", "stopped"),
]
