"""The demo under load, through its API (gradio_client): 8 concurrent clients on the AR tab and 4
on the VLM tab against the in-process server. Every request completes with a correct result
(identical requests give identical images; a request equals the same call made directly; greedy
answers equal the baseline's), the queue runs at most ``CONCURRENCY`` model events at once, the
models load once, and the process's memory stays bounded. The streaming video tab, end to end on
``assets/video``: concurrent streams arrive chunk by chunk, end in an MP4 of the frames
``serve.run_video`` gives for the same request, with the stats line; bad input is a message."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
AR_CLIENTS, VLM_CLIENTS = 8, 4
RSS_GROWTH_LIMIT = 200 * 2**20  # bytes over a warmed-up server (59 MB measured); the models are ~20 MB


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def app():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    sys.path.insert(0, str(ROOT))
    from demos import app

    app.demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    yield app
    app.demo.close()


def _knobs(kind: str, method: str) -> list:
    from mmspec import serve

    defaults = serve.method_defaults(kind, method)
    return [defaults.get(name) for name in serve.knob_specs(kind)]


def _ar(url: str, seed: int):
    from gradio_client import Client

    out = Client(url, verbose=False).predict("a blue star", "gsd", seed, 2.0, *_knobs("ar-image", "gsd"),
                                             api_name="/ar_generate")
    base, ours, grid, base_md, ours_md, error = out
    assert error == "", error
    return np.asarray(PIL.Image.open(base)), np.asarray(PIL.Image.open(ours)), np.asarray(PIL.Image.open(grid)), ours_md


def _vlm(url: str, image_path: str, question: str):
    from gradio_client import Client, handle_file

    answer, base_md, ours_md, error = Client(url, verbose=False).predict(
        handle_file(image_path), question, "eagle", 48, *_knobs("vlm", "eagle"), api_name="/vlm_answer")
    assert error == "", error
    return "".join(piece["token"] for piece in answer).strip(), ours_md


def test_concurrent_clients(app, tmp_path):
    from mmspec import serve

    url = app.demo.local_url
    # warm up: load every model once, then measure memory from there
    _ar(url, 100)
    scenes = []
    for i in range(VLM_CLIENTS):
        path = tmp_path / f"scene{i}.png"
        PIL.Image.fromarray(serve.scene(i)).save(path)
        scenes.append(str(path))
    _vlm(url, scenes[0], "what colour is the main shape ?")
    loads, rss0 = app.MODELS.loads, _rss()
    serve.GAUGE.peak = 0

    seeds = [i % (AR_CLIENTS // 2) for i in range(AR_CLIENTS)]  # each seed asked twice
    questions = ["describe the image in detail .", "what shape is in the image ?"]
    peak_rss = [rss0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak_rss.append(_rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(AR_CLIENTS + VLM_CLIENTS) as pool:
        ar = [pool.submit(_ar, url, s) for s in seeds]
        vlm = [pool.submit(_vlm, url, scenes[i], questions[i % 2]) for i in range(VLM_CLIENTS)]
        ar, vlm = [f.result(timeout=900) for f in ar], [f.result(timeout=900) for f in vlm]
    stop.set()
    sampler.join()

    # every AR request completed correctly: same seed, same images; each a 64x64 image and a grid
    for i, (base, ours, grid, ours_md) in enumerate(ar):
        assert base.shape == ours.shape == (64, 64, 3) and grid.shape == (256, 256, 3)
        twin = ar[seeds.index(seeds[i])]
        assert np.array_equal(base, twin[0]) and np.array_equal(ours, twin[1])
        assert "lossy" in ours_md and "speed-up" in ours_md
    assert not np.array_equal(ar[0][1], ar[1][1])  # different seeds, different images
    # ... and equal to the same call made directly, outside the server
    direct = serve.run_ar(app.MODELS, ["a blue star"], [seeds[1]], "gsd", {})[0]
    assert np.array_equal(ar[1][1], direct.image)

    # every VLM answer is complete and equal to the baseline's greedy answer, and to a direct call
    for i, (text, ours_md) in enumerate(vlm):
        assert "yes, token for token" in ours_md
        direct = serve.run_vlm(app.MODELS, [serve.scene(i)], [questions[i % 2]], [0], "none", {}, max_new_tokens=48)
        assert text == direct[0].text.strip()

    # the queue bounded concurrency (and was saturated by this load); models loaded once
    assert serve.GAUGE.peak == app.CONCURRENCY
    # models loaded once each: nothing loaded again under load, one load per model held (the AR
    # pipeline, the classifier and the VLM pipeline here; the video pipeline too when another test
    # module of this process used the demo's video tab first)
    assert app.MODELS.loads == loads == len(app.MODELS._loaded)
    assert {"ar-image", "classifier", "vlm"} <= set(app.MODELS._loaded)
    growth = max(peak_rss) - rss0
    print(f"RSS {rss0 / 2**20:.0f} MB after warm-up, peak growth {growth / 2**20:.0f} MB under load")
    assert growth < RSS_GROWTH_LIMIT


VIDEO_CLIENTS, VIDEO_FRAMES, SWITCH = 3, 48, 24


def _video(url: str, seed: int, switch_frame: int = SWITCH, frames: int = VIDEO_FRAMES, method: str = "rolling"):
    """Every update the stream sent, in order (each: latest, strip, progress, clip, stats, error)."""
    from gradio_client import Client

    job = Client(url, verbose=False).submit("a red circle moving right", "a blue circle moving right", switch_frame,
                                            frames, method, seed, *_knobs("video", method), api_name="/video_generate")
    job.result(timeout=900)
    return job.outputs()


def _clip(value) -> str:
    return value["video"] if isinstance(value, dict) else value  # gradio_client gives a path (or a dict)


def test_video_tab_streams_chunks_then_the_clip(app):
    import imageio.v3 as iio

    from mmspec import serve

    url = app.demo.local_url
    with ThreadPoolExecutor(VIDEO_CLIENTS) as pool:
        runs = list(pool.map(lambda seed: _video(url, seed), [0, 1, 0]))
    for seed, updates in zip([0, 1, 0], runs):
        *streamed, (latest, strip, progress, clip, stats, error) = updates
        assert error == "", error
        # chunks arrived before the clip: growing progress, the latest frame, no clip yet
        assert streamed and all(u[3] is None and u[0] is not None for u in streamed)
        assert progress.startswith(f"frame {VIDEO_FRAMES} of {VIDEO_FRAMES} (16 chunks)")
        assert np.asarray(PIL.Image.open(latest)).shape == (256, 256, 3)  # 32 px frames, 8x
        assert np.asarray(PIL.Image.open(strip)).shape == (64, 16 * 64, 3)  # one frame per chunk, 2x
        assert f"re-cache at frames [{SWITCH}]" in stats and "fps" in stats and "chunk latency median" in stats
        assert "cache 12 frames" in stats  # sink 3 + window 9: flat after the window fills
        # the clip is the MP4 of the frames serve gives for the same request (within H.264's loss)
        video = iio.imread(_clip(clip))  # (F, 256, 256, 3) uint8
        direct = serve.run_video(app.MODELS, "a red circle moving right", seed, VIDEO_FRAMES, "rolling", {},
                                 [(SWITCH, "a blue circle moving right")])
        assert video.shape == (VIDEO_FRAMES, 256, 256, 3)
        want = direct.frames.repeat(8, axis=1).repeat(8, axis=2)
        assert np.abs(video.astype(float) - want).mean() < 4
    assert np.array_equal(iio.imread(_clip(runs[0][-1][3])), iio.imread(_clip(runs[2][-1][3])))  # same seed
    assert not list(app.CLIP_DIR.glob("*.mp4"))  # each clip removed once gradio had copied it

    # bad input: a readable message, nothing else
    for switch_frame, message in ((25, "switch frame must be a multiple of the model's chunk (3 frames)"),
                                  (60, "switch frame must be below the number of frames (48)")):
        *_, (latest, strip, progress, clip, stats, error) = _video(url, 0, switch_frame)
        assert message in error and latest is None and clip is None
    *_, last = _video(url, 0, method="full-cache", frames=291)
    assert "num_frames must be None or at most 288 with cache_mode='full-cache'" in last[-1]
