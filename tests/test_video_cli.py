"""``mmspec generate video`` and the video file writers (``save_video``, ``save_frame_strip``): MP4
through diffusers' ``export_to_video`` (imageio-ffmpeg) and GIF through Pillow, read back; files
appear whole or not at all (an interrupted write leaves no partial file and keeps an old one);
bad command lines fail before anything loads, bad schedules before any model runs.

A tiny random pipeline (tests/test_video_pipeline.py's) saved to a folder stands in for assets/video.
"""

import os

import imageio.v3 as iio
import numpy as np
import PIL.Image
import pytest
import torch

from mmspec import commands
from mmspec.pipelines import StreamingVideoPipeline, save_frame_strip, save_video
from test_video_pipeline import BLUE, RED, make_pipe


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("video") / "pipe"
    make_pipe(1).save_pretrained(folder)
    return folder


def generate(model_dir, out, *extra):
    return commands.main(["generate", "video", "--prompt", RED, "--frames", "10", "--out", str(out), "--model",
                          str(model_dir), "--steps", "2", "--scale", "4", "--quiet", *extra])


def test_generate_video_writes_the_pipelines_frames_as_mp4(model_dir, tmp_path, capsys):
    """10 frames with a switch at frame 4: the MP4 holds 10 frames of 128x128 (32 px x 4) that
    match the pipeline's own frames within H.264's loss (mean error < 4/255)."""
    out = tmp_path / "clip.mp4"
    assert generate(model_dir, out, "--switch", f"4:{BLUE}") == 0
    printed = capsys.readouterr().out
    assert "10 frames (5 chunks of 2)" in printed and "prompt switches (re-cache) at frames [4]" in printed
    video = iio.imread(out)  # (F, H, W, 3) uint8
    assert video.shape == (10, 128, 128, 3)
    pipe = StreamingVideoPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompts=[(0, RED), (4, BLUE)], num_frames=10, num_inference_steps=2, output_type="np",
                generator=torch.Generator().manual_seed(0)).frames[0]
    want = want.repeat(4, axis=1).repeat(4, axis=2)
    assert np.abs(video / 255.0 - want).mean() < 4 / 255
    assert os.listdir(tmp_path) == ["clip.mp4"]  # no temporary left behind


def test_generate_video_writes_a_gif(model_dir, tmp_path):
    out = tmp_path / "clip.gif"
    assert generate(model_dir, out, "--fps", "10") == 0
    with PIL.Image.open(out) as gif:
        assert gif.n_frames == 10 and gif.size == (128, 128) and gif.info["duration"] == 100


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_an_interrupted_write_leaves_no_partial_file(model_dir, tmp_path, monkeypatch, suffix):
    """The writer is stopped (KeyboardInterrupt) after writing part of its file: the target keeps
    its old content (or stays absent) and no temporary is left."""
    import diffusers.utils

    def partial_then_interrupt(path):
        with open(path, "wb") as f:
            f.write(b"\x00partial")
        raise KeyboardInterrupt

    if suffix == ".mp4":
        monkeypatch.setattr(diffusers.utils, "export_to_video", lambda frames, path, fps: partial_then_interrupt(path))
    else:
        monkeypatch.setattr(PIL.Image.Image, "save", lambda self, path, **kw: partial_then_interrupt(path))
    fresh, old = tmp_path / f"fresh{suffix}", tmp_path / f"old{suffix}"
    old.write_bytes(b"old clip")
    for out in (fresh, old):
        with pytest.raises(KeyboardInterrupt):
            generate(model_dir, out)
    assert not fresh.exists() and old.read_bytes() == b"old clip"
    assert sorted(os.listdir(tmp_path)) == [old.name]


@pytest.mark.parametrize("argv, message", [
    (["--switch", "abc"], "--switch: must be FRAME:TEXT"),
    (["--switch", f"0:{BLUE}"], "--switch: must be FRAME:TEXT with FRAME an int >= 1"),
    (["--frames", "0"], "--frames: must be an int >= 1"),
    (["--out", "clip.avi"], "--out: must end in .mp4 or .gif"),
])
def test_bad_command_lines_fail_before_loading(model_dir, tmp_path, capsys, argv, message):
    base = ["generate", "video", "--prompt", RED, "--out", str(tmp_path / "clip.mp4"), "--model", str(model_dir)]
    with pytest.raises(SystemExit) as err:
        commands.main(base + argv)
    assert err.value.code == 2 and message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, message", [
    (["--switch", f"5:{BLUE}"], "prompts[1] start frame must be a multiple of chunk_frames (2)"),
    (["--switch", f"12:{BLUE}"], "below num_frames (10)"),
    (["--prompt", "a purple hexagon moving up"], "prompt must be text naming exactly one colour"),
])
def test_bad_schedules_fail_before_any_model_runs(model_dir, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        generate(model_dir, tmp_path / "clip.mp4", *argv)
    assert err.value.code == 1 and message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_writers_refuse_what_they_cannot_write(tmp_path):
    frames = np.random.default_rng(0).random((3, 32, 32, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="path suffix must be one of '.mp4', '.gif'"):
        save_video(frames, tmp_path / "clip.webm")
    with pytest.raises(ValueError, match="frames must be PIL images or an"):
        save_video((frames * 255).astype(np.uint8), tmp_path / "clip.gif")
    assert os.listdir(tmp_path) == []
    save_frame_strip([frames, frames], tmp_path / "strip.png", every=2, per_row=1, scale=1)
    with PIL.Image.open(tmp_path / "strip.png") as strip:
        assert strip.size == (32, 4 * 32)  # frames 0 and 2 of each video, one per row


def test_showcase_part_writes_a_gif_and_a_strip(model_dir, tmp_path, capsys):
    """The showcase's video part on the tiny pipeline (chunks of 2: a switch at frame 32 of 64)."""
    commands.showcase.video_part(tmp_path, model_dir)
    printed = capsys.readouterr().out
    assert "64 frames in 32 chunks of 2" in printed and "sink 2 + window 4 frames" in printed
    assert "from frame 32" in printed and "/32 after" in printed
    with PIL.Image.open(tmp_path / "video.gif") as gif:
        assert gif.n_frames == 64 and gif.size == (128, 128)
    with PIL.Image.open(tmp_path / "video_strip.png") as strip:
        assert strip.size == (16 * 64, 2 * 64)  # 32 frames (one per chunk), 16 per row, 2x
    assert sorted(os.listdir(tmp_path)) == ["video.gif", "video_strip.png"]
