"""The prepared GPU check (``make gpu-check``, ``mmspec.bench.gpu_check``) on this CPU: the dry run
through make fills the report's schema, the schema check bites, each step's reading of its child's
output (pytest's JUnit XML, the kernel bench's JSON, a pipeline step's JSON, a timeout) is right,
and the pipeline checks themselves run on the CPU in float32 and bfloat16 at a small size."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmspec.bench import gpu_check as gc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run(["make", "-s", "gpu-check", "DRY_RUN=1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "report.json").read_text()), (out / "summary.txt").read_text(), done.stdout


def test_dry_run_fills_the_schema(dry_report):
    report, summary, stdout = dry_report
    assert gc.validate_report(report) == []
    assert report["dry_run"] is True and report["machine"]["gpu_name"] is None
    assert [s["name"] for s in report["steps"]] == list(gc.step_names())
    assert all(s["status"] == "skipped" and "dry run" in s["reason"] for s in report["steps"])
    tests = report["steps"][0]["summary"]
    # the marker selects the CUDA tests of every kernel's test file, and collecting them needs no GPU
    assert tests["selected"] >= 10
    assert {"tests/test_kernels.py", "tests/test_kernels_accept.py", "tests/test_kernels_attention.py"} <= set(
        tests["files"])
    for name in gc.step_names():
        assert f"- {name}: skipped" in summary
    assert summary in stdout
    # the real-size Wan row is planned: Wan-1.3B's shapes built on the meta device through from_wan's presets
    wan = report["steps"][gc.step_names().index("real-size:wan")]["summary"]
    sf = wan["presets"]["self-forcing"]
    assert (wan["latent_hw"], wan["tokens_per_frame"], wan["chunks"]) == ([60, 104], 1560, 60)
    assert (sf["sink_frames"], sf["window_frames"], sf["key_tokens"], sf["frames"]) == (0, 18, 21 * 1560, 186)
    kv, latents = 2 * 30 * 12 * 128 * 21 * 1560 * 2, 21 * 16 * 60 * 104 * 2  # bf16 K/V of 21 frames, latents
    assert sf["cache_bytes"] == pytest.approx(kv + latents, rel=1e-3)
    assert "self-forcing (sink 0, window 18, absolute): 5 passes a chunk over 32760 keys" in summary


def _complete_report() -> dict:
    report = gc.new_report(dry_run=False, budget_s=480)
    ran = {"cuda-tests": {"selected": 3, "passed": 3, "failed": 0, "errors": 0, "skipped": 0},
           "kernels": {"rows": [], "measured": 0, "correct": 0},
           "real-size": {"verify_ms": {"1": 1.0}, "draft_ms": 0.1, "loop": {}},
           "real-size:wan": {"presets": {}, "targets": {}, "errors": []},
           "vlm-heavy": {"rows": [], "errors": []}}
    for name in gc.step_names():
        summary = ran.get(name, {"identity": [], "speed": {}, "offload": [], "problems": []})
        report["steps"].append({"name": name, "status": "passed", "seconds": 1.0, "summary": summary})
    return report


def test_schema_check_bites():
    assert gc.validate_report(_complete_report()) == []
    broken = {
        "a step missing": lambda r: r["steps"].pop(),
        "an unknown status": lambda r: r["steps"][1].update(status="fine"),
        "a failure without a reason": lambda r: r["steps"][2].update(status="failed"),
        "a pipeline summary without offload": lambda r: r["steps"][3]["summary"].pop("offload"),
        "test counts missing": lambda r: r["steps"][0]["summary"].pop("passed"),
        "no machine": lambda r: r.pop("machine"),
        "no commit": lambda r: r.pop("commit"),
        "a vlm-heavy summary without rows": lambda r: r["steps"][gc.step_names().index("vlm-heavy")]["summary"].pop("rows"),
    }
    for what, breakage in broken.items():
        report = _complete_report()
        breakage(report)
        assert gc.validate_report(report), what


def test_budget_spent_skips_the_rest(tmp_path):
    report = gc.run(tmp_path, dry_run=True, budget_s=5, say=lambda m: None)
    assert gc.validate_report(report) == []
    assert all(s["status"] == "skipped" and "budget" in s["reason"] for s in report["steps"])
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == json.loads(json.dumps(report["steps"]))


def test_junit_counts_from_a_real_pytest_run(tmp_path):
    (tmp_path / "test_mix.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no')\ndef test_skip():\n    pass\n")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                    f"--junitxml={xml}", str(tmp_path / "test_mix.py")], cwd=tmp_path, capture_output=True,
                   timeout=120)
    counts = gc.junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 0, 1)
    assert counts["failures"][0]["test"].endswith("test_bad") and "one is not two" in counts["failures"][0]["message"]


def _fake_child(monkeypatch, rc, write=None, text="child output"):
    def child(args, timeout, env=None):
        if write is not None:
            write(args)
        return rc, text
    monkeypatch.setattr(gc, "_child", child)


def test_kernel_step_reads_the_bench(monkeypatch, tmp_path):
    rows = [{"kernel": "tree_attention", "shape": "s", "dtype": "float16", "measured": True, "projected": False,
             "correct": True, "kernel_ms": 0.01, "reference_ms": 0.03},
            {"kernel": "rolling_attention", "shape": "s", "dtype": "bfloat16", "measured": True,
             "projected": False, "correct": False, "note": "CompilationError: tl.dot needs K >= 16"},
            {"kernel": "guided_accept", "shape": "big", "dtype": "float32", "projected": True, "measured": False,
             "correct": None, "note": "not run: the bench's budget was spent"}]

    def write(args):
        Path(args[args.index("--json") + 1]).write_text(json.dumps({"rows": rows, "setup": {"gpu_name": "X"}}))

    _fake_child(monkeypatch, 0, write)
    step = gc.step_kernels(tmp_path, 60, dry_run=False)
    assert step["status"] == "failed" and "tl.dot needs K >= 16" in step["reason"]
    assert (step["summary"]["measured"], step["summary"]["correct"]) == (2, 1)
    rows[1]["correct"] = True
    assert gc.step_kernels(tmp_path, 60, dry_run=False)["status"] == "passed"
    _fake_child(monkeypatch, None)
    assert gc.step_kernels(tmp_path, 60, dry_run=False)["status"] == "timeout"


def test_kernel_summary_shows_every_timing():
    """Small-shape and GPU-shape rows in ms (the first GPU report printed "not timed" beside four
    timed large rows), SDPA where timed, and why a row was not."""
    rows = [{"kernel": "tree_attention", "shape": "s", "dtype": "float16", "correct": True, "kernel_ms": 0.124,
             "reference_ms": 0.318, "sdpa_ms": 0.048},
            {"kernel": "rolling_attention", "shape": "big", "dtype": "bfloat16", "gpu_shape": True, "correct": True,
             "kernel_ms": 166.8913, "reference_ms": 7.4282, "sdpa_ms": 5.3179},
            {"kernel": "guided_accept", "shape": "b", "dtype": "float32", "correct": None,
             "note": "not run: the bench's 70 s budget (budget_s) was spent"}]
    lines = gc._step_lines({"name": "kernels", "summary": {"rows": rows}})
    assert lines[0].endswith("kernel 0.1240 ms, reference 0.3180 ms, sdpa 0.0480 ms")
    assert lines[1].endswith("kernel 166.8913 ms, reference 7.4282 ms, sdpa 5.3179 ms")
    assert lines[2].endswith("not timed (not run: the bench's 70 s budget (budget_s) was spent)")


@pytest.mark.parametrize("xdist, cpus, expected", [(True, 16, 8), (True, 2, 2), (False, 16, 1), (True, 1, 1)])
def test_cuda_tests_run_on_xdist_workers(monkeypatch, tmp_path, xdist, cpus, expected):
    """The first GPU run took the CUDA tests one at a time and ran past the step's limit with
    Triton's cache cold; they now run on up to CUDA_TEST_WORKERS xdist workers, one per CPU."""
    calls = []

    def child(args, timeout, env=None):
        calls.append(args)
        return (0, "tests/test_kernels_attention.py::test_a\n") if "--collect-only" in args else (0, "")
    monkeypatch.setattr(gc, "_child", child)
    monkeypatch.setattr(gc.os, "cpu_count", lambda: cpus)
    real = gc.importlib.util.find_spec
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: (real(name) if xdist else None)
                        if name == "xdist" else real(name))
    step = gc.step_cuda_tests(tmp_path, 100, dry_run=False)
    run = calls[-1]
    assert step["summary"]["workers"] == expected
    assert (run[run.index("-n") + 1] == str(expected)) if expected > 1 else "-n" not in run


def test_pipeline_step_reads_its_child(monkeypatch, tmp_path):
    found = {"pipeline": "vlm", "identity": [], "speed": {}, "offload": [], "problems": ["offload changes sd"]}

    def write(args):
        Path(args[args.index("--json") + 1]).write_text(json.dumps(found))

    _fake_child(monkeypatch, 0, write)
    step = gc.step_pipeline("vlm", tmp_path, 60, dry_run=False, device="cuda")
    assert step["status"] == "failed" and step["reason"] == "offload changes sd"
    found["problems"] = []
    assert gc.step_pipeline("vlm", tmp_path, 60, dry_run=False, device="cuda")["status"] == "passed"
    _fake_child(monkeypatch, None, write)  # a timeout keeps what the child recorded
    step = gc.step_pipeline("vlm", tmp_path, 60, dry_run=False, device="cuda")
    assert step["status"] == "timeout" and step["summary"]["pipeline"] == "vlm"
    (tmp_path / "pipeline-vlm.json").unlink()
    _fake_child(monkeypatch, 1, text="Traceback\nRuntimeError: CUDA error: no kernel image")
    step = gc.step_pipeline("vlm", tmp_path, 60, dry_run=False, device="cuda")
    assert step["status"] == "error" and "no kernel image" in step["reason"]


@pytest.mark.parametrize("name", gc.pipeline_names())
def test_pipeline_check_on_cpu(name):
    """The GPU step's own code on the CPU: float32 greedy identity holds (the project's CPU
    guarantee), bfloat16 runs, offload gives the same outputs, the speed rows are filled."""
    result = gc.check_pipeline(name, "cpu", dtypes=("float32", "bfloat16"), speed_dtype="bfloat16", rounds=1,
                               quick=True, compile_steps=False)
    assert result["problems"] == [], result["problems"]
    spec = gc.pipeline_checks()[name]
    assert {(r["dtype"], r["method"]) for r in result["identity"]} == {
        (d, m) for d in ("float32", "bfloat16") for m in spec.methods}
    assert all(r["identical"] for r in result["identity"] if r["dtype"] == "float32")
    rows = result["speed"]["rows"]
    assert [r["method"] for r in rows] == list(spec.speed_methods) and rows[0]["wall_ratio"] == 1.0
    assert all(r["wall_s"] > 0 for r in rows)
    if spec.decodes:
        assert all(r["nfe"] > 0 for r in rows) and rows[0]["nfe_ratio"] == 1.0
        assert all(r["share_kept"] == pytest.approx(r["wall_ratio"] / r["nfe_ratio"]) for r in rows)
    assert {(r["dtype"], r["method"]) for r in result["offload"]} == {
        (d, m) for d in ("float32", "bfloat16") for m in spec.offload_methods}
    assert all(r["identical"] for r in result["offload"])


def test_pipeline_check_reports_a_wrong_method(monkeypatch):
    """A method that changes one token, and an output that changes under offload, are problems."""
    spec = gc.pipeline_checks()["ar-image"]
    call = spec.call

    def wrong(self, pipe, method, device, seed=0):
        out = call(self, pipe, method, device, seed)
        if method == "sd" or getattr(pipe, "_all_hooks", None):
            out.tokens = out.tokens.clone()  # an inference tensor: changed on a copy
            out.tokens[0, 3, 2] = (out.tokens[0, 3, 2] + 1) % pipe.transformer.vocab_size
        return out

    monkeypatch.setattr(spec, "call", wrong)
    monkeypatch.setattr(spec, "methods", ("sd", "sjd"))
    monkeypatch.setattr(spec, "offload_methods", ("none",))
    monkeypatch.setattr(spec, "speed_methods", ("none",))
    result = gc.check_pipeline("ar-image", "cpu", dtypes=("float32",), speed_dtype="float32", rounds=1, quick=True,
                               compile_steps=False)
    sd, sjd = result["identity"]
    assert not sd["identical"] and sd["first_mismatch"] == 3 * 16 + 2 and sjd["identical"]
    assert any(p.startswith("greedy sd differs") for p in result["problems"])
    assert not result["offload"][0]["identical"] and any(p.startswith("offload changes none") for p in result["problems"])


def test_bad_arguments():
    from mmspec import commands

    with pytest.raises(SystemExit) as e:
        commands.main(["gpu-check", "--budget", "0", "--dry-run"])
    assert e.value.code == 1
    with pytest.raises(SystemExit) as e:
        commands.main(["gpu-check", "--steps", "everything"])
    assert e.value.code == 2


def test_cpu_pipeline_tensors_compare():
    same, frac, first = gc._compare(torch.tensor([[1, 2, 3]]), torch.tensor([[1, 5, 3]]))
    assert (same, round(frac, 3), first) == (False, 0.667, 1)
    assert gc._compare([[1, 2], [3]], [[1, 2], [3]]) == (True, 1.0, None)
    same, frac, first = gc._compare([[1, 2], [3]], [[1, 2], [3, 4]])
    assert not same and first == 3 and frac == 0.75


def test_the_compiled_speed_rows_on_cpu(monkeypatch):
    """The compiled part of a pipeline step (``enable_compiled_steps``; here dynamo's ``eager``
    backend, so the CPU does not spend minutes in Inductor): rows for every speed method, the same
    ratios as the eager run, and the eager forwards restored after."""
    from mmspec.pipelines import SpeculativeARImagePipeline

    enable = SpeculativeARImagePipeline.enable_compiled_steps
    monkeypatch.setattr(SpeculativeARImagePipeline, "enable_compiled_steps",
                        lambda self, **kw: enable(self, backend="eager"))
    monkeypatch.setattr(gc.pipeline_checks()["ar-image"], "speed_methods", ("none", "sd"))
    result = gc.check_pipeline("ar-image", "cpu", dtypes=(), speed_dtype="float32", rounds=1, quick=True,
                               offload=False)
    assert result["problems"] == [], result["problems"]
    rows = result["compiled"]["rows"]
    assert [r["method"] for r in rows] == ["none", "sd"] and rows[0]["wall_ratio"] == 1.0
    assert all(r["share_kept"] == pytest.approx(r["wall_ratio"] / r["nfe_ratio"]) and r["wall_x_eager_none"] > 0
               for r in rows)
    eager = {r["method"]: r["nfe"] for r in result["speed"]["rows"]}
    assert {r["method"]: r["nfe"] for r in rows} == eager  # the same decodes, greedy
    assert "syncs_per_pass" not in rows[0]  # counted by CUDA only
    lines = gc._step_lines({"name": "pipeline:ar-image", "summary": result})
    assert any(line.startswith("compiled float32 sd: wall x") and "share_kept" in line for line in lines)


def test_the_real_size_row_on_cpu():
    """The real-size step's row at a tiny size: every timing filled, the loop's own cost is the
    pass minus the forward."""
    from mmspec.bench import real_size

    row = real_size.row("cpu", torch.float32, real_size.TINY, prefix=16, tokens=6, repeats=1, compiled=False)
    assert set(row["verify_ms"]) == {"1", "16", "64"} and all(v > 0 for v in row["verify_ms"].values())
    loop = row["loop"]["eager"]
    assert row["draft_ms"] > 0 and loop["passes"] == 5 and row["errors"] == []
    assert loop["loop_ms"] == pytest.approx(loop["pass_ms"] - loop["forward_ms"])
    lines = gc._step_lines({"name": "real-size", "summary": row})
    assert lines[0].startswith("float32, Llama-2-7B shapes") and lines[1].startswith("loop eager:")


def test_real_size_step_reads_its_child(monkeypatch, tmp_path):
    found = {"verify_ms": {"1": 2.0}, "draft_ms": 0.5, "loop": {"eager": {}}, "errors": []}

    def write(args):
        Path(args[args.index("--json") + 1]).write_text(json.dumps(found))

    _fake_child(monkeypatch, 0, write)
    assert gc.step_real_size(tmp_path, 60, dry_run=False, device="cuda")["status"] == "passed"
    found["errors"] = ["loop compiled: RuntimeError: boom"]
    step = gc.step_real_size(tmp_path, 60, dry_run=False, device="cuda")
    assert step["status"] == "failed" and "boom" in step["reason"]
    assert gc.step_real_size(tmp_path, 60, dry_run=True, device="cuda")["status"] == "skipped"


def test_the_real_size_wan_row_on_cpu():
    """The real-size Wan step's row at a tiny size in float32: both presets streamed through
    ``from_wan``'s machinery, every field filled, rolling against window-recompute, a record after
    every part."""
    from mmspec.bench import real_size_wan as rsw

    saved = []
    row = rsw.row("cpu", torch.float32, rsw.TINY, chunks=6, recompute_chunks=4, warmup=1,
                  record=lambda r: saved.append(json.loads(json.dumps(r, default=str))))
    assert row["errors"] == [] and list(row["presets"]) == ["longlive", "self-forcing"]
    ll = row["presets"]["longlive"]
    st = ll["stream"]
    assert st["chunks_done"] == 6 and st["truncated"] is None and st["fit_chunks"] == 3  # frames 12, 15, 18
    assert st["ms_per_chunk"] > 0 and isinstance(st["flat"], bool) and row["targets"]["flat"]["longlive"] == st["flat"]
    assert st["slope_pct_per_1k_frames"] == pytest.approx(100 * st["latency_slope"] / st["ms_per_chunk"])
    assert st["cache_bytes"] >= ll["cache_bytes"]  # the plan's cache, and what else the stream keeps
    rc = ll["recompute"]
    assert rc["chunks_done"] == 4 and rc["steady"] and rc["rolling_ms_per_chunk"] > 0
    assert rc["speedup"] == pytest.approx(rc["recompute_ms_per_chunk"] / rc["rolling_ms_per_chunk"])
    assert rc["cache_bytes"]["window-recompute"] < rc["cache_bytes"]["rolling"]
    assert row["targets"]["rolling_faster"]["longlive"] == rc["rolling_faster"] == (rc["speedup"] > 1)
    sf = row["presets"]["self-forcing"]
    assert (sf["sink_frames"], sf["window_frames"], sf["key_tokens"]) == (0, 18, 21 * 6)
    assert sf["stream"]["chunks_done"] == 6 and not sf["stream"]["steady"]  # 18 frames: the window not yet full
    assert sf["stream"]["flat"] is None and sf["recompute"]["chunks_done"] == 4
    assert len(saved) == 5 and saved[-1] == json.loads(json.dumps(row, default=str))
    lines = gc._step_lines({"name": "real-size:wan", "summary": row})
    assert lines[0].startswith("float32, Wan2.1-T2V-1.3B shapes") and lines[2].startswith("longlive (sink 3, window 6")
    assert lines[3].startswith("  stream: ") and "rolling faster: " in lines[4]


def test_the_real_size_wan_row_keeps_to_its_budget():
    """No part starts once the row's budget is spent, and no chunk that would end past it."""
    from mmspec.bench import real_size_wan as rsw

    row = rsw.row("cpu", torch.float32, rsw.TINY, chunks=4, recompute_chunks=2, warmup=1, budget_s=0)
    assert row["errors"] == []
    for p in row["presets"].values():
        assert p["stream"]["note"] == p["recompute"]["note"] == "not run: the row's 0 s budget was spent"
    assert "  stream: not run: the row's 0 s budget was spent" in gc._step_lines(
        {"name": "real-size:wan", "summary": row})

    class Slow:  # chunks of 50 ms
        i = 0

        def __next__(self):
            time.sleep(0.05)
            self.i += 1
            return SimpleNamespace(frame_indices=range(3 * self.i, 3 * self.i + 3), stats={"cache_bytes": 1})

    cpu = torch.device("cpu")
    got, cut = rsw._pull({"a": Slow(), "b": Slow()}, 5, cpu, time.perf_counter() + 0.15)
    assert [len(v) for v in got.values()] == [1, 1] and cut == "the row's budget: 1 of 5 chunks ran"
    got, cut = rsw._pull({"a": Slow()}, 3, cpu, None)
    assert [t[0] for t in got["a"]] == [3, 6, 9] and cut is None


def test_real_size_wan_step_reads_its_child(monkeypatch, tmp_path):
    found = {"presets": {"longlive": {}}, "targets": {}, "errors": []}
    seen = {}

    def write(args):
        seen["budget"] = float(args[args.index("--budget") + 1])
        Path(args[args.index("--json") + 1]).write_text(json.dumps(found))

    _fake_child(monkeypatch, 0, write)
    step = gc.step_real_size_wan(tmp_path, 100, dry_run=False, device="cuda")
    assert step["status"] == "passed" and seen["budget"] == 100 - gc.REAL_SIZE_WAN_MARGIN
    found["errors"] = ["self-forcing stream: OutOfMemoryError: CUDA out of memory"]
    step = gc.step_real_size_wan(tmp_path, 100, dry_run=False, device="cuda")
    assert step["status"] == "failed" and "out of memory" in step["reason"]
    _fake_child(monkeypatch, None, write)  # killed: what the child recorded stays
    step = gc.step_real_size_wan(tmp_path, 100, dry_run=False, device="cuda")
    assert step["status"] == "timeout" and "longlive" in step["summary"]["presets"]
    (tmp_path / "real-size-wan.json").unlink()
    _fake_child(monkeypatch, 1, text="Traceback\nRuntimeError: CUDA error: no kernel image")
    step = gc.step_real_size_wan(tmp_path, 100, dry_run=False, device="cuda")
    assert step["status"] == "error" and "no kernel image" in step["reason"]
