"""``mmspec batch``: bad job files are refused by line number before any work; a run killed with
SIGKILL and restarted ends with exactly the files of an uninterrupted run; two accelerate
processes write the same files as one; a failing job is recorded while the others go on. Every
kind is in the runs: AR images, VLM answers and streaming videos (an MP4 with a prompt switch, a
GIF in another cache mode).

The end-to-end runs are subprocesses on the bundled tiny models (a few seconds of decoding each,
plus model loading); the job list is kept small so the file stays within about two minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from mmspec import batch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ACCELERATE = str(Path(PY).with_name("accelerate"))

JOBS = [
    {"id": "img-0", "kind": "ar-image", "prompt": "a red circle", "method": "gsd", "seed": 0},
    {"id": "img-1", "kind": "ar-image", "prompt": "a blue star", "method": "sjd", "seed": 1, "sjd_window": 8},
    {"id": "img-2", "kind": "ar-image", "prompt": "a green square", "method": "gsd", "seed": 2},
    # passes every check before work; ZipAR's window is checked against the grid (16 wide) when the model is known
    {"id": "fails", "kind": "ar-image", "prompt": "a red star", "method": "zipar", "seed": 3, "zipar_window": 20},
    {"id": "ans-0", "kind": "vlm", "image": "scene.png", "question": "describe the image in detail .",
     "method": "vispec", "max_new_tokens": 24},
    {"id": "ans-1", "kind": "vlm", "image": "scene.png", "question": "what colour is the main shape ?",
     "method": "vispec", "max_new_tokens": 24},
    {"id": "clip-0", "kind": "video", "prompt": "a red circle moving right", "frames": 24, "seed": 0,
     "switches": [[12, "a blue circle moving right"]]},
    {"id": "clip-1", "kind": "video", "prompt": "a green square moving up", "frames": 18, "seed": 1,
     "method": "no-sink", "window_frames": 6, "format": "gif", "scale": 2, "switches": "9: a yellow square moving up"},
]
OUTPUTS = {"img-0.png", "img-1.png", "img-2.png", "ans-0.txt", "ans-1.txt", "clip-0.mp4", "clip-1.gif"}


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}


def _write_jobs(folder: Path, jobs=JOBS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    from mmspec import serve

    PIL.Image.fromarray(serve.scene(1)).save(folder / "scene.png")
    path = folder / "jobs.jsonl"
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def _cmd(jobs: Path, out: Path, *extra, processes: int = 1) -> list[str]:
    tail = ["batch", str(jobs), "--out", str(out), "--quiet", *extra]
    if processes == 1:
        return [PY, "-m", "mmspec", *tail]
    return [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0", "-m", "mmspec", *tail]


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.name != batch.MANIFEST}


def _manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / batch.MANIFEST).read_text().splitlines()]


def _outcome(records: list[dict]) -> list[tuple]:
    """What a manifest says about each job, without timings or which process ran it."""
    return [(r["id"], r["status"], r["output"], r["error"]) for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted single-process run (batch size 4: the two VLM jobs share a call)."""
    folder = tmp_path_factory.mktemp("batch-ref")
    jobs = _write_jobs(folder)
    out = folder / "out"
    proc = subprocess.run(_cmd(jobs, out, "--batch-size", "4"), env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]  # one job fails on purpose
    assert "1 of 8 jobs failed" in proc.stderr
    return jobs, out


def test_reference_run_writes_every_file_and_records_the_failure(reference):
    jobs, out = reference
    files = _files(out)
    assert set(files) == OUTPUTS  # no temporary files, nothing for the failed job
    for name in OUTPUTS:
        if name.endswith(".png"):
            assert PIL.Image.open(out / name).size == (64, 64)
        elif name.endswith(".txt"):
            assert files[name].decode().strip()
    records = _manifest(out)
    assert [r["id"] for r in records] == [j["id"] for j in JOBS]  # one record per job, in the file's order
    failed = [r for r in records if r["status"] == "error"]
    assert [r["id"] for r in failed] == ["fails"] and "zipar_window" in failed[0]["error"]
    ok = [r for r in records if r["status"] == "ok"]
    assert all(r["stats"]["nfe"] >= 1 for r in ok)
    assert {r["stats"]["batch"] for r in ok if r["kind"] == "vlm"} == {2}  # same-kind greedy jobs batched
    # the VLM answers are the pipeline's own greedy answers for those questions
    assert (out / "ans-1.txt").read_text().startswith("the main shape is")
    # the videos: the stream's stats, and the frames serve gives for the same job (MP4: within H.264's loss)
    import imageio.v3 as iio

    from mmspec import serve

    clip = {r["id"]: r["stats"] for r in ok if r["kind"] == "video"}
    assert clip["clip-0"]["frames"] == 24 and clip["clip-0"]["switch_frames"] == [12]
    assert clip["clip-0"]["cache_mode"] == "rolling" and clip["clip-0"]["cache_frames"] == 12  # sink 3 + window 9
    assert clip["clip-1"]["cache_mode"] == "no-sink" and clip["clip-1"]["cache_frames"] == 6
    assert clip["clip-1"]["switch_frames"] == [9]
    assert all(s["fps"] > 0 and s["latency_ms_p95"] >= s["latency_ms_median"] > 0 for s in clip.values())
    video = iio.imread(out / "clip-0.mp4")  # (F, H, W, 3) uint8
    assert video.shape == (24, 256, 256, 3)
    direct = serve.run_video(serve.Models(), "a red circle moving right", 0, 24, "rolling", {},
                             [(12, "a blue circle moving right")])
    assert np.abs(video.astype(float) - direct.frames.repeat(8, 1).repeat(8, 2)).mean() < 4
    with PIL.Image.open(out / "clip-1.gif") as gif:
        assert gif.n_frames == 18 and gif.size == (64, 64)


def test_two_processes_write_the_same_files(reference, tmp_path):
    jobs, ref_out = reference
    out = tmp_path / "out2"
    # batch size 1 here: answers decoded alone must equal those decoded in a batch of two
    proc = subprocess.run(_cmd(jobs, out, "--batch-size", "1", processes=2), env=_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert _files(out) == _files(ref_out)
    records = _manifest(out)
    assert _outcome(records) == _outcome(_manifest(ref_out))
    assert {r["process"] for r in records} == {0, 1}  # both processes did work


def test_sigkill_then_rerun_gives_the_uninterrupted_files(reference, tmp_path):
    jobs, ref_out = reference
    ref = _files(ref_out)
    out = tmp_path / "out"
    proc = subprocess.Popen(_cmd(jobs, out, "--batch-size", "4"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    manifest = out / batch.MANIFEST
    deadline = time.monotonic() + 600
    while not (manifest.is_file() and manifest.read_bytes().count(b"\n") >= 1):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # part-way: some jobs done, some not; every file already in place is whole and final
    done_before = {n for n in os.listdir(out) if n in OUTPUTS}
    assert 1 <= len(done_before) < len(OUTPUTS)
    for name in done_before:
        assert (out / name).read_bytes() == ref[name]
    mtimes = {n: (out / n).stat().st_mtime_ns for n in done_before}
    recorded = {r["id"] for r in map(json.loads, manifest.read_text().splitlines()) if r["status"] == "ok"}

    rerun = subprocess.run(_cmd(jobs, out, "--batch-size", "4"), env=_env(), capture_output=True, text=True,
                           timeout=600)
    assert rerun.returncode == 1, rerun.stderr[-2000:]
    assert _files(out) == ref  # byte-identical, no partial or temporary files left
    records = _manifest(out)
    assert [r["id"] for r in records] == [j["id"] for j in JOBS]  # no duplicates
    assert _outcome(records) == _outcome(_manifest(ref_out))
    for job in JOBS:  # jobs the killed run finished and recorded were skipped, not redone
        name = batch.Job(0, job["id"], job["kind"], "", 0, {k: job[k] for k in ("format",) if k in job}).output
        if job["id"] in recorded:
            assert (out / name).stat().st_mtime_ns == mtimes[name]


def test_a_rerun_of_a_finished_folder_does_no_work(reference, tmp_path):
    jobs, ref_out = reference
    records = {r["id"]: r for r in _manifest(ref_out)}
    ok = [j for j in JOBS if records[j["id"]]["status"] == "ok"]
    # a jobs file without the failing job, run in a copy of the finished folder: nothing to do
    folder = tmp_path / "copy"
    out = folder / "out"
    out.mkdir(parents=True)
    for name, data in _files(ref_out).items():
        (out / name).write_bytes(data)
    (out / batch.MANIFEST).write_text("".join(json.dumps(records[j["id"]]) + "\n" for j in ok))
    stray = out / ".clip-0.mp4.0a1b2c3d.tmp.mp4"  # what a video writer killed mid-write leaves
    stray.write_bytes(b"partial")
    path = _write_jobs(folder, ok)
    from accelerate.state import PartialState

    try:
        summary = batch.run(path, out, progress=False, models=_NoModels())
    finally:
        PartialState._reset_state()  # leave no process state behind for other tests
    assert (summary.skipped, summary.ok, summary.failed) == (len(ok), 0, 0)
    assert not stray.exists() and set(_files(out)) == OUTPUTS


class _NoModels:
    """Models that fail if anything asks for them."""

    def __getattr__(self, name):
        raise AssertionError(f"a finished folder loaded a model ({name})")


# ---------------------------------------------------------------- bad input, before any work

def _bad(tmp_path, lines: list[str], suffix: str = ".jsonl") -> str:
    (tmp_path / "scene.png").write_bytes(b"")  # exists but is not an image
    PIL.Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "ok.png")
    path = tmp_path / f"jobs{suffix}"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        batch.run(path, out, progress=False, models=_NoModels())
    assert not out.exists()  # nothing written
    return str(err.value)


GOOD = '{"id": "a", "kind": "ar-image", "prompt": "a red circle", "seed": 0}'


@pytest.mark.parametrize("line, expected", [
    ('{"id": "b", "kind": "ar-image", "prompt": "a red circle"', "line 2: not valid JSON"),
    ('{"id": "b", "kind": "audio", "prompt": "x"}', "line 2: kind must be one of 'ar-image', 'vlm', 'video'"),
    ('{"id": "b", "kind": "ar-image", "prompt": "a red circle", "method": "fast"}', "line 2: method"),
    ('{"id": "b", "kind": "ar-image", "prompt": "a red circle", "method": "sjd", "sjd_window": 1}',
     "line 2: sjd_window must be an int >= 2"),
    ('{"id": "b", "kind": "ar-image", "prompt": "a red circle", "method": "sjd", "tree_depth": 3}',
     "sjd_window), got 'tree_depth'"),
    ('{"id": "b", "kind": "ar-image", "prompt": "a purple moon"}', "line 2: prompt must be one of the class prompts"),
    ('{"id": "b", "kind": "ar-image", "prompt": "a red circle", "seed": -1}', "line 2: seed"),
    ('{"id": "b", "kind": "ar-image", "prompt": "a red circle", "seed": "7"}', "line 2: seed"),
    ('{"id": "a", "kind": "ar-image", "prompt": "a red circle"}', "line 2: id must be unique (line 1 has it too)"),
    ('{"id": "../escape", "kind": "ar-image", "prompt": "a red circle"}', "line 2: id must be a file-name stem"),
    ('{"id": "b", "kind": "vlm", "image": "missing.png", "question": "what ?"}', "line 2: image must be an existing"),
    ('{"id": "b", "kind": "vlm", "image": "scene.png", "question": "what ?"}', "line 2: image must be a readable"),
    ('{"id": "b", "kind": "vlm", "image": "ok.png", "question": "  "}', "line 2: question"),
    ('{"id": "b", "kind": "vlm", "image": "ok.png"}', "line 2: question must be given for a 'vlm' job"),
    ('[1, 2]', "line 2: job must be a JSON object"),
    ('{"id": "b", "kind": "video", "prompt": "a red moon"}', "line 2: prompt must be text naming exactly one"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "switches": [[13, "a blue circle moving up"]]}',
     "line 2: switch frame must be a multiple of the model's chunk (3 frames): prompts switch at chunk boundaries, "
     "e.g. 12 or 15, got 13"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "frames": 24, "switches": "30:a blue star up"}',
     "line 2: switch frame must be below the number of frames (24)"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "switches": "soon: a blue circle moving up"}',
     "line 2: switches must be a list of [frame, prompt] pairs"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "sink_frames": 4}',
     "line 2: sink_frames must be None or a multiple of the model's chunk (3 frames), got 4"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "method": "full-cache", "window_frames": 6}',
     "line 2: method_knobs must be knobs of 'full-cache'"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "method": "none"}',
     "line 2: method must be one of the cache modes 'rolling', 'window-recompute', 'full-cache', 'no-sink'"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "method": "rolling+no-sink"}',
     "line 2: method must be a composition with at most one schedule (rolling or no-sink)"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "switches": "12:a red star up; 12:a star"}',
     "line 2: switch frame must be distinct frames (one prompt per switch), got 12"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "format": "avi"}',
     "line 2: format must be one of 'mp4', 'gif', got 'avi'"),
    ('{"id": "b", "kind": "video", "prompt": "a red circle moving up", "frames": 0}',
     "line 2: frames must be an int in [1, 10000]"),
])
def test_bad_line_is_reported_by_number(tmp_path, line, expected):
    assert expected in _bad(tmp_path, [GOOD, line])


def test_every_bad_line_is_reported_at_once(tmp_path):
    msg = _bad(tmp_path, ['{"id": 1}', GOOD, "", "not json", '{"id": "c", "kind": "vlm"}'])
    assert "3 bad line(s), nothing was run" in msg
    assert "line 1: id" in msg and "line 4: not valid JSON" in msg and "line 5: image" in msg


def test_csv_jobs_and_their_errors(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("id,kind,prompt,method,seed,sjd_window\n"
                    "a,ar-image,a red circle,sjd,3,8\n"
                    "b,ar-image,a blue star,none,,\n")
    jobs = batch.load_jobs(path)
    assert [(j.id, j.method, j.seed, j.knobs) for j in jobs] == [("a", "sjd", 3, {"sjd_window": 8}),
                                                                 ("b", "none", 0, {})]
    msg = _bad(tmp_path, ["id,kind,prompt,method,seed,sjd_window", "a,ar-image,a red circle,sjd,x,8",
                          "b,ar-image,a red circle,sjd,1,eight"], suffix=".csv")
    assert "line 2: seed must be an int, got 'x'" in msg and "line 3: sjd_window" in msg
    # video rows: switches as FRAME:TEXT text (any order), knobs parsed from their cells, the cache mode by default
    path.write_text("id,kind,prompt,frames,switches,recache_sink,format\n"
                    "v,video,a red circle moving right,30,24:a blue star moving up; 12:a blue circle moving right,"
                    "false,gif\n")
    (job,) = batch.load_jobs(path)
    assert (job.method, job.output, job.knobs) == ("rolling", "v.gif", {"recache_sink": False})
    assert job.params["switches"] == [(12, "a blue circle moving right"), (24, "a blue star moving up")]


def test_batches_only_where_outputs_cannot_change():
    from batch_jobs import job

    video = [batch.Job(7 + i, f"v{i}", "video", "rolling", 0, {"prompt": "a red circle moving right", "frames": 24,
                                                                "switches": [], "format": "mp4", "fps": 16, "scale": 8})
             for i in range(2)]
    jobs = [job(0), job(1, kind="ar-image", method="gsd"), job(2), job(3, temperature=1.0), job(4), job(5),
            job(6, method="eagle"), *video]
    groups = [[j.id for j in b] for b in batch.make_batches(jobs, 3)]
    # greedy VLM jobs with the same method and options share calls; sampled, AR and video jobs run alone
    assert groups == [["j0", "j2", "j4"], ["j1"], ["j3"], ["j5"], ["j6"], ["v0"], ["v1"]]
    assert [[j.id for j in b] for b in batch.make_batches(jobs, 1)] == [[j.id] for j in jobs]


# ---------------------------------------------------------------- per-row pass maps in a batched call

def test_commit_passes_of_batched_rows_from_the_tokens_input():
    """``serve.passes.passes_from_tokens``: each row's pass per token, read from the right-padded
    ``"tokens"`` snapshots; a row that ran past its final tokens (drafts accepted beyond its EOS)
    counts all of them; a row whose length the 0 padding leaves open gets None, not a guess."""
    import torch

    from mmspec.serve.passes import passes_from_tokens

    finals = [[5, 6, 7, 8, 9], [3, 2], [4, 0, 6]]
    snaps = [torch.tensor([[5, 6, 7], [3, 2, 1], [4, 0, 0]]),  # row 1 ran past its EOS (2)
             torch.tensor([[5, 6, 7, 8, 9], [3, 2, 1, 0, 0], [4, 0, 0, 0, 0]])]
    passes = passes_from_tokens(snaps, finals)
    assert passes[0].tolist() == [0, 1, 1, 2, 2] and passes[1].tolist() == [0, 1]
    assert passes[2] is None  # after pass 1 row 2 holds [4] or [4, 0]: the padding cannot tell
    # one row alone: its width is its length, zeros included
    alone = passes_from_tokens([torch.tensor([[4, 0]]), torch.tensor([[4, 0, 6]])], [finals[2]])
    assert alone[0].tolist() == [0, 1, 2]
