"""``mmspec bench video`` and its judge: the measurements on synthetic series and rendered clips
where the answer is known (slope fit, compute ratio, RSS sampling, switch latency and jump, frame
buffer), the bench end to end on a tiny random pipeline (every column, full-cache's stop recorded,
an interrupted run leaves the finished groups), the ``FrameJudge`` model and its recipe, and the
CLI guard. No assets needed (the shipped judge is checked when present)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmspec.bench import video as vb
from mmspec.bench.video import measures as vq
from mmspec.bench.video import runner
from mmspec.bench.video import timing as vt
from mmspec.models import load_checkpoint
from mmspec.models.video_ae import FrameAutoencoder
from mmspec.models.video_dit import VideoDiTModel
from mmspec.models.video_judge import FrameJudge
from mmspec.pipelines import StreamingVideoPipeline
from mmspec.training.data.video import VideoPrompt, render_clip

pytestmark = pytest.mark.slow

RED, BLUE, RED_UP = (VideoPrompt.parse(t) for t in ("a red circle moving right", "a blue circle moving right",
                                                    "a red circle moving up"))
ISSUE_KEYS = {"method", "frames", "window", "chunk", "steps", "fps", "latency_ms_median", "latency_ms_p95",
              "peak_rss_mb", "latency_slope", "rss_slope", "class_acc_first", "class_acc_last"}
SHIPPED_JUDGE = Path(__file__).resolve().parents[1] / "assets" / "video_judge"


# -- the slope fit -------------------------------------------------------------------------------
def series(slope_per_1000, n=1500, noise=1.0, phi=0.0, seed=0):
    """Chunk start frames (every 3) and latencies 20 ms + slope * x / 1000 + AR(1) noise."""
    rng = np.random.default_rng(seed)
    x = 3.0 * np.arange(n)
    e = np.zeros(n)
    for i in range(n):
        e[i] = (phi * e[i - 1] if i else 0.0) + noise * rng.standard_normal()
    return x, 20.0 + slope_per_1000 * x / 1000 + e


def test_fit_slope_recovers_a_known_slope():
    x, y = series(4.0)
    fit = vb.fit_slope(x, y, resamples=500)
    assert fit["n"] == 1500
    assert abs(fit["slope"] - 4.0) < 3 * fit["se"]
    assert fit["ci_low"] < 4.0 < fit["ci_high"]
    # the OLS slope itself, against numpy's fit
    assert fit["slope"] == pytest.approx(1000 * np.polyfit(x, y, 1)[0], rel=1e-9)


def test_a_flat_series_is_flat_and_a_growing_one_is_caught():
    """The bench's flatness claim: the interval of a flat stream contains 0; a stream whose
    latency grows by 0.5 ms per 1,000 frames (a deliberately broken input, e.g. a cache that
    never evicts) has an interval above 0."""
    flat = vb.fit_slope(*series(0.0, noise=2.0, seed=1), resamples=500)
    assert flat["ci_low"] < 0 < flat["ci_high"]
    grows = vb.fit_slope(*series(0.5, noise=2.0, seed=1), resamples=500)
    assert grows["ci_low"] > 0


def test_a_100k_frame_stream_is_fitted_in_bounded_batches():
    """33,334 chunks (100,000 frames): the bootstrap runs in batches and still covers the slope."""
    fit = vb.fit_slope(*series(0.05, n=33_334, noise=2.0, seed=4), resamples=200)
    assert fit["ci_low"] < 0.05 < fit["ci_high"] and fit["ci_low"] > 0


def test_block_bootstrap_widens_the_interval_for_correlated_noise():
    """Serially correlated latencies (a slow stretch of the machine lasts many chunks): the
    classical standard error is too small for them; the block bootstrap's interval is wider."""
    fit = vb.fit_slope(*series(0.0, noise=1.0, phi=0.95, seed=2), resamples=500)
    assert (fit["ci_high"] - fit["ci_low"]) / 2 > 2 * 1.96 * fit["se"]


def test_speed_index_removes_the_machines_drift_not_a_rows_growth():
    """Four streams in lockstep while the machine slows down by half over the run (another
    process starting): three flat rows look like they grow, the raw slope says so; divided by the
    round's speed index they are nearly flat again (a tenth of the raw slope at most: a row that
    grows within the others' spread moves the median a little), and the fourth, whose own
    latency grows 10 ms per 1,000 frames, still grows."""
    n = 600
    rng = np.random.default_rng(5)
    x = 3.0 * np.arange(n)
    drift = 1 + x / x[-1]  # the machine: 1x to 2x slower
    own = [np.full(n, base) for base in (20.0, 60.0, 25.0)] + [20.0 + 0.01 * x]  # the last grows 10 ms / 1k
    lat = [list(o * drift * np.exp(0.05 * rng.standard_normal(n))) for o in own]
    index = vb.speed_index(lat, [list(range(n))] * 4)
    assert len(index) == n
    flat_raw = vb.fit_slope(x, np.asarray(lat[0]), resamples=300)
    assert flat_raw["ci_low"] > 5  # the drift alone: ~ +20 ms per 600 chunks
    for i in range(3):
        raw = vb.fit_slope(x, np.asarray(lat[i]), resamples=0)["slope"]
        adj = vb.fit_slope(x, np.asarray(lat[i]) / [index[k] for k in range(n)], resamples=0)["slope"]
        assert abs(adj) < 0.1 * raw
    grow = vb.fit_slope(x, np.asarray(lat[3]) / [index[k] for k in range(n)], resamples=300)
    assert grow["ci_low"] > 5
    # rounds where fewer than three streams ran have no index
    assert vb.speed_index(lat[:2], [list(range(n))] * 2) == {}


def test_the_speed_index_ignores_full_cache():
    """Three constant-cost rows and a full-cache row whose latency explodes: the index is the
    constant rows' alone, so their adjusted latencies are unmoved by it."""
    runs = [vt._Run(label={"method": m}, kwargs={}, frames=9, keep=(1, 1), latency=list(lat), rounds=[0, 1, 2])
            for m, lat in (("rolling", (1.0, 2.0, 1.0)), ("no-sink", (1.0, 2.0, 1.0)),
                           ("window-recompute", (3.0, 6.0, 3.0)), ("full-cache", (1.0, 50.0, 900.0)))]
    vt._adjust(runs)
    assert runs[0].adjusted == pytest.approx([1.0, 1.0, 1.0])  # the machine slowed down in round 1
    assert runs[2].adjusted == pytest.approx([3.0, 3.0, 3.0])
    assert runs[3].adjusted == pytest.approx([1.0, 25.0, 900.0])
    vt._adjust(runs[2:])  # one constant-cost stream: no index
    assert all(np.isnan(runs[2].adjusted))


def test_fit_slope_degenerate_inputs():
    assert vb.fit_slope([0, 3], [1.0, 2.0])["slope"] is None
    assert vb.fit_slope([3, 3, 3], [1.0, 2.0, 3.0])["slope"] is None
    with pytest.raises(ValueError, match="y must be a series as long as x"):
        vb.fit_slope([0, 1, 2], [1.0, 2.0])


# -- compute ratio, RSS ----------------------------------------------------------------------------
def test_compute_ratio_formula():
    # S = 4 steps, C = 3, sink 3 + window 9: 4 * (3 + 12) / (5 * 3) = 4
    assert vb.compute_ratio(4, 3, 12) == pytest.approx(4.0)
    # window 16 chunks (48 frames) + sink 3: 4 * 54 / 15
    assert vb.compute_ratio(4, 3, 51) == pytest.approx(14.4)
    assert vb.compute_ratio(1, 1, 0) == pytest.approx(0.5)
    for bad in ((0, 3, 12), (4, 0, 12), (4, 3, -1)):
        with pytest.raises(ValueError):
            vb.compute_ratio(*bad)


def test_rss_sampling_sees_an_allocation_and_its_release():
    before = vb.rss_mb()
    block = torch.ones(64 * 2**20 // 4 * 4)  # 256 MB, every page touched
    grown = vb.rss_mb()
    del block
    after = vb.rss_mb()
    assert grown - before > 200
    assert grown - after > 200


def test_trim_heap_returns_freed_small_blocks_to_the_os():
    """160 MB in 4 KB tensors come from the C heap; freed, they stay resident (an allocator keeps
    them for reuse, which would hide a later group's growth) until ``trim_heap``."""
    blocks = [torch.ones(1024) for _ in range(40000)]
    held = vb.rss_mb()
    del blocks
    freed = vb.rss_mb()
    assert vb.trim_heap() is True
    trimmed = vb.rss_mb()
    assert held - trimmed > 100 and freed - trimmed > 100


def test_rss_falls_back_to_the_peak_without_proc(monkeypatch):
    import builtins

    real_open = builtins.open

    def no_proc(path, *args, **kw):
        if str(path).startswith("/proc/"):
            raise OSError("no /proc here")
        return real_open(path, *args, **kw)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert vb.rss_mb() >= vt.peak_rss_mb() * 0.99 > 0


# -- prompt switches on rendered clips -------------------------------------------------------------
def rendered(schedule, frames=30, seed=3):
    clip, truth = render_clip(schedule, frames, torch.Generator().manual_seed(seed))
    return (clip + 1) / 2, truth.prompt_ids  # [0, 1], (F, 3)


def test_frames_until_counts_from_the_switch():
    r = torch.zeros(30, dtype=torch.bool)
    r[15:] = True
    assert vb.frames_until(r, 12, hold=3) == 3
    assert vb.frames_until(r, 15, hold=1) == 0
    r[16] = False  # a flicker back: the run of 3 starts at 17
    assert vb.frames_until(r, 12, hold=3) == 5
    assert vb.frames_until(torch.zeros(30, dtype=torch.bool), 12, hold=1) is None
    with pytest.raises(ValueError):
        vb.frames_until(r, 31)


def test_colour_switch_measured_where_it_happens():
    """A rendered clip whose colour switches at frame 15: asked from frame 12, the new colour is
    reported 3 frames later; the repaint is a pixel jump well above the stream's median change,
    which a clip without a switch does not show."""
    frames, want = rendered([(0, RED), (15, BLUE)])
    seen = vb.judge_frames(frames, want)
    assert vb.frames_until(seen["colour"] == BLUE.colour, 12, hold=3) == 3
    assert vb.frames_until(seen["colour"] == BLUE.colour, 15, hold=3) == 0
    assert vb.switch_jump(vb.pixel_changes(frames), 15, span=6)["jump_ratio"] > 3
    plain, _ = rendered([(0, RED)])
    assert vb.switch_jump(vb.pixel_changes(plain), 15, span=6)["jump_ratio"] < 1.5


def test_direction_switch_measured_from_the_centroid():
    frames, want = rendered([(0, RED), (15, RED_UP)])
    seen = vb.judge_frames(frames, want)
    d = seen["direction"]  # step f -> f + 1
    assert (d[:14] == RED.direction).all() and (d[14:] == RED_UP.direction).all()
    reports = torch.cat([torch.zeros(1, dtype=torch.bool), d == RED_UP.direction])
    assert vb.frames_until(reports, 15, hold=3) == 0
    acc = vb.accuracy(seen, want, slice(None))
    assert acc["colour_acc"] == 1.0 and acc["direction_acc"] == 1.0
    assert acc["class_acc"] is None  # no judge given


def test_switch_row_on_a_synthetic_stream_with_a_known_answer():
    """Two rendered videos asked to switch red -> blue at frame 12: the first actually turns blue
    at 15 (3 frames late), the second at 12. The row's measures say exactly that."""
    old, new = [RED.text, RED.text], [BLUE.text, BLUE.text]
    clips = [rendered([(0, RED), (at, BLUE)], seed=5 + i)[0] for i, at in enumerate((15, 12))]
    cfg = vb.VideoBenchConfig(switch_at=12, switch_frames=30, hold_frames=3, quality_frames=30, reference_frames=8)
    run = vt._Run(label={}, kwargs={}, frames=30, keep=(30, 30), buffer=vb.FrameBuffer(30, 30), done=30,
                  latency=[0.01] * 10, switched=[c == 4 for c in range(10)])
    for c in range(10):
        run.buffer.add(torch.stack(clips)[:, 3 * c:3 * c + 3])
    quality = vq._quality(run, old, [(12, new)], None, cfg)
    got = vq._switch_measures(run, quality, old, new, "colour", cfg, 3, judged=False)
    assert got["switch_frames_to_new_each"] == [3, 0] and got["switch_frames_to_new"] == 1.5
    assert got["switch_within_2_chunks"] == 1.0 and got["switch_old_before"] == 1.0
    assert got["switch_jump_max_ratio"] > 2 and got["switch_real_jump_ratio"] > 2
    assert got["switch_latency_ms"] == pytest.approx(10.0)
    # the first 12 frames are red, the rest follow each clip's own switch
    assert quality["colour_acc_first"] == pytest.approx((27 / 30 + 1) / 2)


def test_multi_switch_measures_each_segment_on_a_stream_with_a_known_answer():
    """Two rendered videos cycling red -> green -> blue every 10 frames; the second turns blue 4
    frames late. Per segment colour accuracy and per switch frames-to-new say exactly that, and
    the worst segment is the second video's blue one (its first 4 frames still green: 6 of 10)."""
    schedule = vq._colour_cycle([RED.text, RED.text], 3, 10, {"colour": ["red", "green", "blue", "yellow"]})
    assert [s for s, _ in schedule] == [0, 10, 20]
    green = VideoPrompt(1, RED.shape, RED.direction)
    clips = [rendered([(0, RED), (10, green), (at, BLUE)], seed=5 + i)[0] for i, at in enumerate((20, 24))]
    cfg = vb.VideoBenchConfig(hold_frames=3, quality_frames=30, reference_frames=8)
    run = vt._Run(label={}, kwargs={}, frames=30, keep=(30, 30), buffer=vb.FrameBuffer(30, 30), done=30)
    for c in range(10):
        run.buffer.add(torch.stack(clips)[:, 3 * c:3 * c + 3])
    quality = vq._quality(run, schedule[0][1], schedule[1:], None, cfg)
    got = vq._segment_measures(quality, schedule, 30, cfg, 3, judged=False)
    assert got["switch_frames_to_new_each"] == [0, 0, 0, 4]
    assert np.allclose(got["colour_segments"], [[1.0, 1.0, 1.0], [1.0, 1.0, 0.6]])
    assert got["colour_min_segment"] == pytest.approx(0.6) and got["multi_switch_within_2_chunks"] == 1.0


def test_class_accuracy_needs_the_object_in_the_pixels():
    """A frame without the object (pixel colour -1) does not count as the prompt's colour even
    when the judge's colour head, forced to choose, names it."""
    want = torch.tensor([[0, 1, 0]] * 4)
    seen = {"colour": torch.tensor([0, -1, 0, 0]), "judge_colour": torch.tensor([0, 0, 1, 0]),
            "judge_shape": torch.tensor([1, 1, 1, 2]), "direction": torch.tensor([0, 0, 0])}
    acc = vb.accuracy(seen, want, slice(None))
    assert acc["class_acc"] == 0.25 and acc["shape_acc"] == 0.75 and acc["colour_acc"] == 0.75


def test_switch_jump_checks_and_degenerate_median():
    with pytest.raises(ValueError):
        vb.switch_jump(torch.ones(10), 0)
    assert vb.switch_jump(torch.zeros(10), 5)["jump_ratio"] is None


def test_frame_buffer_keeps_first_and_last_in_constant_memory():
    buf = vb.FrameBuffer(first=5, last=7)
    for c in range(1000):
        idx = torch.arange(3 * c, 3 * c + 3).float() / 3000  # frame index encoded in the pixels
        buf.add(idx.view(1, 3, 1, 1, 1).expand(2, 3, 3, 4, 4))
    assert sum(t.shape[1] for t in buf.tail) <= 7 + 2  # bounded whatever the stream's length
    head, tail, start = buf.frames()
    assert head.shape == (2, 5, 3, 4, 4) and tail.shape == (2, 7, 3, 4, 4) and start == 2993
    decode = lambda t: (t[0, :, 0, 0, 0] * 255).round().long()  # noqa: E731  (stored as uint8)
    assert decode(head).tolist() == [round(f / 3000 * 255) for f in range(5)]
    assert decode(tail).tolist() == [round(f / 3000 * 255) for f in range(2993, 3000)]


# -- the bench end to end ------------------------------------------------------------------------
TINY = dict(dim=32, n_heads=2, n_layers=2, mlp_hidden=64, chunk_frames=2, sink_frames=2, window_frames=4,
            rope_theta=10.0)  # RoPE tells 35 frame positions apart: full-cache stops at 32 frames


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_bench")
    torch.manual_seed(0)
    vae = FrameAutoencoder(channels=(8, 16), stem_channels=8).eval()
    model = VideoDiTModel(**TINY).eval()
    with torch.no_grad():  # leave adaLN-Zero's zeros: otherwise every block is the identity
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    StreamingVideoPipeline(vae=vae, transformer=model).save_pretrained(root / "pipe")
    FrameJudge(block_out_channels=(8, 8, 8), feature_dim=8).eval().save_pretrained(root / "judge")
    return root


def tiny_config(folders, **kw):
    return vb.VideoBenchConfig.quick(**{
        "pipeline_dir": str(folders / "pipe"), "judge_dir": str(folders / "judge"), "frames": (40,),
        "windows": (1, 2), "sweep_frames": 12, "switch_at": 8, "switch_frames": 16, "quality_frames": 6,
        "reference_frames": 8, "bootstrap_resamples": 50, "wan_frames": 0, "multi_switch_every": 6, **kw})


def test_bench_writes_every_column(folders, tmp_path):
    path = tmp_path / "video.json"
    result = vb.run(tiny_config(folders), json_path=path)
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(vb.public(result)))
    assert saved["bench"] == "video" and saved["setup"]["complete"] is True
    rows = saved["rows"]
    groups = [(r["group"], r["method"], r.get("window"), r.get("switch")) for r in rows]
    assert groups == [("window-sweep", "rolling", 2, None), ("window-sweep", "window-recompute", 2, None),
                      ("window-sweep", "rolling", 4, None), ("window-sweep", "window-recompute", 4, None),
                      ("prompt-switch", "prompt-switch", 4, "colour"),
                      ("prompt-switch", "prompt-switch", 4, "direction"),
                      ("multi-switch", "prompt-switch", 4, "colour x2"),
                      ("frames", "rolling", 4, None), ("frames", "window-recompute", 4, None),
                      ("frames", "full-cache", None, None), ("frames", "no-sink", 4, None)]
    columns = {key for key, _ in vb.VIDEO_COLUMNS} | ISSUE_KEYS
    for row in rows:
        assert columns <= row.keys()  # None where a column does not apply (a switch figure on a frames row)
        assert row["latency_ms_median"] > 0 and row["fps"] > 0 and row["peak_rss_mb"] >= 0
        assert 0 <= row["class_acc_first"] <= 1 and 0 <= row["direction_acc_last"] <= 1
    multi = [r for r in rows if r["group"] == "multi-switch"][0]
    assert multi["frames_done"] == 18 and len(multi["colour_segments"]) == 2  # 2 videos x 3 segments
    assert all(len(seg) == 3 for seg in multi["colour_segments"]) and len(multi["switch_frames_to_new_each"]) == 4
    assert multi["colour_min_segment"] == min(min(seg) for seg in multi["colour_segments"])
    assert [c for c in multi["switched_at"]] == [6, 12]
    by = {(r["group"], r["method"], r["window"]): r for r in rows if "switch" not in r["group"]}
    # speed-ups beside the compute ratio of the same window: S (C + K + W) / ((S + 1) C)
    assert by[("window-sweep", "rolling", 4)]["compute_ratio"] == pytest.approx(vb.compute_ratio(4, 2, 2 + 4))
    assert by[("window-sweep", "window-recompute", 2)]["speedup_vs_recompute"] == pytest.approx(1.0)
    assert by[("frames", "rolling", 4)]["speedup_vs_recompute"] > 0
    # full-cache stops where the RoPE range ends and says why instead of failing the bench
    full = by[("frames", "full-cache", None)]
    assert full["frames_done"] == 32 and full["stopped"] == "CacheLimitError at 32 frames"
    assert "RoPE" in full["stop_reason"]
    assert by[("frames", "rolling", 4)]["frames_done"] == 40 and by[("frames", "rolling", 4)]["stopped"] is None
    # the cache object: constant for rolling, growing for full-cache
    assert full["cache_mb"] > by[("frames", "rolling", 4)]["cache_mb"]
    switch = [r for r in rows if r["group"] == "prompt-switch"]
    for r in switch:
        assert r["switch_at"] == 8 and len(r["switch_frames_to_new_each"]) == 2
        assert r["switch_median_change"] > 0 and r["switch_real_jump_ratio"] > 0
        assert r["switch_latency_ms"] > 0
    assert all(r["latency_slope_adj"] is None for r in switch)  # two streams: no speed index
    assert all(r["latency_slope_adj"] is not None for r in rows if r["group"] == "frames")
    setup = saved["setup"]
    assert setup["batch"] == 2 and setup["full_cache_limit_frames"] == 32 and setup["trained_window"] == 4
    assert set(setup["ceiling"]) >= {"real_class_acc", "recon_class_acc", "real_direction_acc"}
    for r in rows:
        if r["group"] != "window-sweep":
            assert r["streams"] == 2
            for when in ("first", "last"):
                low, high = r[f"shape_acc_{when}_ci_low"], r[f"shape_acc_{when}_ci_high"]
                assert 0 <= low <= r[f"shape_acc_{when}"] <= high <= 1


def test_a_repeated_prompt_streams_from_its_own_seeds(folders, monkeypatch):
    """What ``--videos-per-prompt`` relies on: a prompt listed twice is streamed twice in the
    batch, video i from ``torch.Generator().manual_seed(seed + i)`` (read at the pipeline's
    ``stream`` call), and the row averages over both streams."""
    from mmspec.pipelines.video import StreamingVideoPipeline

    calls = []
    stream = StreamingVideoPipeline.stream

    def spy(self, *args, **kw):
        calls.append((kw.get("prompt"), [g.initial_seed() for g in kw["generator"]]))
        return stream(self, *args, **kw)

    monkeypatch.setattr(StreamingVideoPipeline, "stream", spy)
    text = vb.DEFAULT_PROMPTS[0]
    result = vb.run(tiny_config(folders, prompts=(text, text), seed=5, methods=("rolling",), windows=(),
                                switches=(), multi_switches=0, warmup=False))
    assert calls and all(call == ([text, text], [5, 6]) for call in calls)
    assert [r["streams"] for r in result["rows"]] == [2]


def test_shape_interval_is_a_bootstrap_over_the_streams():
    """``_quality``'s shape interval: the percentile interval of the mean over
    ``bootstrap_indices(streams, resamples, seed)`` resamples of the per-stream accuracies. Four
    synthetic streams whose judged shape is right on 0, 1/3, 2/3 and all of their frames (mean
    0.5): with 2,000 resamples of seed 0 the interval is what ``mean_ci`` gives on those four
    values, strictly inside [0, 1] and around 0.5; one stream gives a zero-width interval."""
    from mmspec.bench.video import measures as quality
    from mmspec.eval.stats import bootstrap_indices, mean_ci

    cfg = vb.VideoBenchConfig(bootstrap_resamples=2000, quality_frames=3)
    want_shape = 1  # square

    class Buffer:
        def __init__(self, n):
            self.n = n

        def frames(self):
            x = torch.zeros(self.n, 3, 3, 8, 8)
            return x, x, 0

    class Run:
        done = 3

        def __init__(self, n):
            self.buffer = Buffer(n)

    right = iter([0, 0, 1, 1, 2, 2, 3, 3, 3, 3])  # head then tail of each stream

    def fake_judge(frames, want, judge):
        k = next(right)
        shape = torch.tensor([want_shape] * k + [0] * (3 - k))
        return dict(colour=want[:, 0], judge_colour=want[:, 0], judge_shape=shape,
                    direction=torch.full((2,), -1))

    texts = ["a red square moving right"] * 4
    orig = quality.judge_frames
    quality.judge_frames = fake_judge
    try:
        out = quality._quality(Run(4), texts, None, object(), cfg)
        assert out["streams"] == 4 and out["shape_acc_first"] == pytest.approx(0.5)
        want = mean_ci([0, 1 / 3, 2 / 3, 1], bootstrap_indices(4, 2000, 0))
        assert (out["shape_acc_first_ci_low"], out["shape_acc_first_ci_high"]) == pytest.approx(want)
        assert 0 < want[0] < 0.5 < want[1] < 1
        one = quality._quality(Run(1), texts[:1], None, object(), cfg)
        assert one["shape_acc_first_ci_low"] == one["shape_acc_first_ci_high"] == one["shape_acc_first"] == 1.0
    finally:
        quality.judge_frames = orig


def test_wan_rows_measure_rolling_against_recompute(folders):
    """The tiny Wan group: rolling and window-recompute at two windows, 30 latent frames; the
    cache object constant for rolling after the window filled, recompute's ratio beside the
    compute ratio, no quality columns (random weights)."""
    result = vb.run(tiny_config(folders, frames=(), windows=(), switches=(), multi_switches=0, wan_frames=30, wan_windows=(1, 2),
                                wan_size=32))
    rows = result["rows"]
    assert [(r["group"], r["method"], r["window"]) for r in rows] == [
        ("wan-tiny", "rolling", 3), ("wan-tiny", "window-recompute", 3),
        ("wan-tiny", "rolling", 6), ("wan-tiny", "window-recompute", 6)]
    for r in rows:
        assert r["frames_done"] == 30 and r["fps"] > 0 and r["latency_ms_median"] > 0 and r["sink"] == 3
        assert r["compute_ratio"] == pytest.approx(vb.compute_ratio(4, 3, 3 + r["window"]))
        assert r.get("class_acc_first") is None
    assert rows[1]["speedup_vs_recompute"] == pytest.approx(1.0) and rows[0]["speedup_vs_recompute"] > 0
    assert rows[2]["cache_mb"] > rows[0]["cache_mb"] > rows[1]["cache_mb"]
    assert "random weights" in result["setup"]["wan"]["note"] and result["setup"]["wan"]["tokens_per_frame"] == 4


def test_an_interrupted_bench_leaves_the_finished_groups(folders, tmp_path, monkeypatch):
    calls = []
    original = vt._lockstep

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args, **kw)

    monkeypatch.setattr(runner, "_lockstep", interrupted)  # where run finds it
    path = tmp_path / "video.json"
    with pytest.raises(KeyboardInterrupt):
        vb.run(tiny_config(folders, windows=(1,)), json_path=path)
    saved = json.loads(path.read_text())
    assert saved["setup"]["complete"] is False
    assert [r["group"] for r in saved["rows"]] == ["window-sweep", "window-sweep"]


def test_a_stream_past_the_memory_limit_is_stopped_and_says_so(folders):
    result = vb.run(tiny_config(folders, windows=(), switches=(), multi_switches=0, frames=(12,), rss_limit_mb=1.0, warmup=False))
    assert [r["method"] for r in result["rows"]] == list(vb.METHODS)
    for row in result["rows"]:
        assert row["stopped"] == "memory at 2 frames" and "rss_limit_mb (1)" in row["stop_reason"]
        assert row["frames_done"] == 2


def test_public_drops_the_private_keys():
    assert vb.public({"bench": "video", "rows": [], "_pipe": object()}) == {"bench": "video", "rows": []}


def test_bad_settings_fail_before_loading(tmp_path):
    for kw, name in ((dict(frames=(0,)), "frames"), (dict(methods=("rolling", "cached")), "methods"),
                     (dict(switch_at=200, switch_frames=144), "switch_at"), (dict(switches=("shape",)), "switches")):
        with pytest.raises(ValueError, match=name):
            vb.run(vb.VideoBenchConfig(pipeline_dir=str(tmp_path / "missing"), **kw))
    with pytest.raises(ValueError, match="pipeline_dir"):
        vb.run(vb.VideoBenchConfig(pipeline_dir=str(tmp_path / "missing")))


def test_cli_groups_pick_the_video_rows(capsys):
    from mmspec import commands

    with pytest.raises(SystemExit) as e:
        commands.main(["bench", "core", "--groups", "wan-tiny"])
    assert e.value.code == 2 and "--groups is for 'bench video' only, got 'bench core'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        commands.main(["bench", "video", "--groups", "everything"])
    args = commands.build_parser().parse_args(["bench", "video", "--groups", "wan-tiny", "frames"])
    assert args.groups == ["wan-tiny", "frames"]


def test_cli_frames_is_for_the_video_bench(capsys):
    from mmspec import commands

    with pytest.raises(SystemExit) as exit_:
        commands.main(["bench", "core", "--frames", "100"])
    assert exit_.value.code == 2
    assert "--frames is for 'bench video' only, got 'bench core'" in capsys.readouterr().err
    args = commands.build_parser().parse_args(["bench", "video", "--frames", "100", "1000", "--quick"])
    assert args.name == "video" and args.frames == [100, 1000] and args.quick


def test_cli_prompts_picks_the_first_n_of_the_prompt_set(capsys, monkeypatch):
    """``--prompts N``: the first N of the 16 colour x shape prompts (the default four first);
    for the video bench only, 1-16."""
    from mmspec import commands

    assert len(set(vb.PROMPT_SET)) == 16 and vb.PROMPT_SET[:4] == vb.DEFAULT_PROMPTS
    pairs = {tuple(p.split()[1:3]) for p in vb.PROMPT_SET}
    assert len(pairs) == 16  # every colour x shape once
    seen = []
    monkeypatch.setattr(vb, "run", lambda cfg, **kw: seen.append(cfg) or {"rows": [], "setup": {}})
    monkeypatch.setattr(vb, "public", lambda result: result)
    commands.main(["bench", "video", "--prompts", "9", "--groups", "frames", "--quiet"])
    assert seen[0].prompts == vb.PROMPT_SET[:9]
    for bad in ("0", "17"):
        with pytest.raises(SystemExit):
            commands.main(["bench", "video", "--prompts", bad])
        assert "--prompts: must be an int in [1, 16]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        commands.main(["bench", "core", "--prompts", "4"])
    assert "--prompts is for 'bench video' only, got 'bench core'" in capsys.readouterr().err


def test_cli_videos_per_prompt_and_methods(capsys, monkeypatch):
    """``--videos-per-prompt K``: the prompts K times over (video i shows prompt i % N; the runner
    seeds video i with ``seed + i``, so every stream has its own seed); ``--methods``: the
    per-method rows' cache modes. Both for the video bench only; bad values refused by name."""
    from mmspec import commands
    from mmspec.commands import bench

    assert bench.METHODS == vb.METHODS  # the parser's copy (no bench import to build it)
    seen = []
    monkeypatch.setattr(vb, "run", lambda cfg, **kw: seen.append(cfg) or {"rows": [], "setup": {}})
    monkeypatch.setattr(vb, "public", lambda result: result)
    commands.main(["bench", "video", "--prompts", "3", "--videos-per-prompt", "2", "--methods", "rolling",
                   "--groups", "frames", "--quiet"])
    commands.main(["bench", "video", "--videos-per-prompt", "3", "--groups", "frames", "--quiet"])
    commands.main(["bench", "video", "--groups", "frames", "--quiet"])
    assert seen[0].prompts == vb.PROMPT_SET[:3] * 2 and seen[0].methods == ("rolling",)
    assert seen[1].prompts == vb.DEFAULT_PROMPTS * 3 and seen[1].methods == vb.METHODS
    assert seen[2].prompts == vb.DEFAULT_PROMPTS
    for bad in ("0", "65", "two"):
        with pytest.raises(SystemExit):
            commands.main(["bench", "video", "--videos-per-prompt", bad])
        assert "--videos-per-prompt: must be an int in [1, 64]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        commands.main(["bench", "video", "--methods", "rolling", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
    for option in (["--videos-per-prompt", "2"], ["--methods", "rolling"]):
        with pytest.raises(SystemExit):
            commands.main(["bench", "core", *option])
        assert f"{option[0]} is for 'bench video' only, got 'bench core'" in capsys.readouterr().err
    assert len(seen) == 3


def test_cli_pipeline_benches_another_video_folder(capsys, monkeypatch, tmp_path):
    """``--pipeline DIR``: the video bench streams the pipeline saved there (a user's own training)
    instead of assets/video; a missing folder is refused before anything runs."""
    from mmspec import commands

    seen = []
    monkeypatch.setattr(vb, "run", lambda cfg, **kw: seen.append(cfg) or {"rows": [], "setup": {}})
    monkeypatch.setattr(vb, "public", lambda result: result)
    commands.main(["bench", "video", "--groups", "frames", "--quiet"])
    commands.main(["bench", "video", "--pipeline", str(tmp_path), "--groups", "frames", "--quiet"])
    assert seen[0].pipeline_dir == vb.VideoBenchConfig().pipeline_dir and seen[0].pipeline_dir.endswith("video")
    assert seen[1].pipeline_dir == str(tmp_path)
    with pytest.raises(SystemExit):
        commands.main(["bench", "video", "--pipeline", str(tmp_path / "missing")])
    assert "argument --pipeline: no such folder" in capsys.readouterr().err
    assert len(seen) == 2
    from mmspec.bench import vlm  # the one seam (the bench's config) serves the VLM bench too

    monkeypatch.setattr(vlm, "run", lambda cfg, **kw: seen.append(cfg) or {"rows": [], "setup": {}})
    commands.main(["bench", "vlm", "--pipeline", str(tmp_path), "--quiet"])
    assert isinstance(seen[2], vlm.VLMBenchConfig) and seen[2].pipeline_dir == str(tmp_path)


# -- the judge -----------------------------------------------------------------------------------
def test_judge_model_shapes_labels_and_bad_input(tmp_path):
    judge = FrameJudge(block_out_channels=(8, 8, 8), feature_dim=8).eval()
    out = judge(torch.zeros(5, 3, 32, 32))
    assert out["colour"].shape == (5, 4) and out["shape"].shape == (5, 4)
    pred = judge.predict(torch.zeros(0, 3, 32, 32))
    assert pred["shape"].shape == (0,)
    judge.save_pretrained(tmp_path)
    loaded = load_checkpoint(FrameJudge, tmp_path)
    assert loaded.labels == judge.labels == {"colour": ["red", "green", "blue", "yellow"],
                                             "shape": ["circle", "square", "triangle", "star"]}
    x = torch.rand(3, 3, 32, 32) * 2 - 1
    assert torch.allclose(loaded(x)["shape"], judge(x)["shape"], atol=1e-5)
    # the palette maps' colours are saved in the config and are the data's palette
    from mmspec.training.data.shapes import PALETTE

    assert torch.allclose(torch.tensor(loaded.config.palette), PALETTE)
    with pytest.raises(ValueError, match="frames must be"):
        judge(torch.zeros(2, 3, 16, 16))
    with pytest.raises(ValueError, match="labels must be"):
        FrameJudge(labels={"colour": ["red", "blue"]})


def test_judge_recipe_saves_a_loadable_folder(tmp_path):
    from mmspec.training.recipes import train_video_judge

    out = tmp_path / "judge"
    record = train_video_judge(out, steps=3, batch_size=8, lr=1e-3, dataset_size=16, heldout_size=8, log=lambda m: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                     "train_log.json"]
    assert json.loads((out / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert record["recipe"] == "video-judge" and 0 <= record["heldout_accuracy"] <= 1
    assert record["ae_recon"] is None and record["heldout"]["seed"] != record["seed"]
    assert record["config"]["palette"] == [[0.9, 0.12, 0.12], [0.12, 0.75, 0.2], [0.15, 0.3, 0.95], [0.95, 0.85, 0.1]]
    from safetensors import safe_open

    with safe_open(str(out / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if "num_batches" not in k} == {torch.float16}
    assert load_checkpoint(FrameJudge, out).predict(torch.zeros(2, 3, 32, 32))["colour"].shape == (2,)


def test_shipped_judge_reads_real_frames():
    """The shipped judge on 512 frames of 64 fresh rendered clips (every prompt once): colour and
    shape right on at least 85% (its train_log.json states the held-out figure on 2,048 frames)."""
    from mmspec.training.recipes.video_judge import judge_accuracy, judge_frames

    frames, ids = judge_frames(512, 4242, 8, 32)
    judge = load_checkpoint(FrameJudge, SHIPPED_JUDGE)
    assert torch.allclose(judge.palette_rgb, torch.tensor(judge.config.palette))
    acc = judge_accuracy(judge, frames, ids)
    assert acc["both"] >= 0.85 and acc["colour"] >= 0.98
