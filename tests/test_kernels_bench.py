"""``mmspec bench kernels``: the JSON rows' schema, correctness from the interpreter, the GPU-shape
rows' shapes, and the compiled (GPU) path's rows, assembled on the CPU with a stand-in timer and
the torch references standing in for the launchers."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import torch

from mmspec import commands
from mmspec.bench import gpu_check
from mmspec.bench import kernels as bench
from mmspec.bench.report import format_table
from mmspec.kernels import dispatch, splitk

ROW_KEYS = {"kernel", "shape", "dtype", "max_abs_err", "tolerance", "correct", "reference_ms", "gpu_shape", "measured"}


def test_gpu_shapes_are_the_shapes_the_kernels_are_for():
    """EAGLE-2's 60 nodes over 4,096 cached tokens with Llama-7B's 32 heads of 128 (tree and
    rolling token attention, fp16), a Wan-1.3B video chunk (3 frames of 1,560 tokens over a 1 + 20
    frame cache, bf16) and a 15-draft chain over 16,384 image tokens; no H100 projection is left."""
    rows = bench.gpu_shape_rows()
    assert [(r["kernel"], r["dtype"]) for r in rows[:4]] == [
        ("tree_attention", "float16"), ("rolling_attention", "float16"), ("rolling_attention", "bfloat16"),
        ("guided_accept", "float32")]
    tree, tokens, video, accept = rows[:4]
    assert (tree["inputs"]["tree_nodes"], tree["inputs"]["cache_tokens"], tree["inputs"]["heads"]) == (60, 4096, 32)
    assert tokens["inputs"]["held_keys"] == 4096 and tokens["inputs"]["rope"] == "1d"
    assert video["inputs"]["queries"] == 3 * 1560 and video["inputs"]["keys"] == 24 * 1560
    assert (accept["inputs"]["vocab"], accept["inputs"]["drafts"]) == (16384, 15)
    for row in rows:
        assert ROW_KEYS <= set(row) and row["gpu_shape"] is True and row["measured"] is False
        assert not any("h100" in k or "projected" in k for k in row), row
    assert not hasattr(bench, "H100")


def test_key_sweep_covers_both_kernels_at_four_key_counts():
    """Tree attention over 256 to 16,384 cached tokens and rolling attention over a sink of 4 + a
    window of the same key counts, EAGLE-2's tree and Llama-7B heads, fp16 and bf16; the two fp16
    rows at 4,096 keys are the sweep's own, unchanged and first."""
    rows = bench.gpu_shape_rows()
    sweep = [r for r in rows if "sweep_keys" in r]
    assert len(sweep) == 16 and all(ROW_KEYS <= set(r) and r["gpu_shape"] and not r["measured"] for r in sweep)
    for kernel in ("tree_attention", "rolling_attention"):
        for dtype in ("float16", "bfloat16"):
            got = [r for r in sweep if (r["kernel"], r["dtype"]) == (kernel, dtype)]
            assert sorted(r["sweep_keys"] for r in got) == [256, 1024, 4096, 16384]
    for row in sweep:
        s, n = row["inputs"], row["sweep_keys"]
        assert (s["B"], s["heads"], s["head_dim"]) == (1, 32, 128)
        if row["kernel"] == "tree_attention":
            assert (s["tree_nodes"], s["cache_tokens"], s["kv_heads"]) == (60, n, 32) and f"S={n}," in row["shape"]
        else:
            assert (s["queries"], s["sink"], s["window"], s["held_keys"], s["rope"]) == (60, 4, n - 4, n, "1d")
    assert [{k: v for k, v in r.items() if k != "sweep_keys"} for r in rows[:2]] == [
        bench.tree_attention_shape(), bench.rolling_tokens_shape()]
    assert [(r["kernel"], r.get("sweep_keys"), r["dtype"]) for r in rows[:2]] == [
        ("tree_attention", 4096, "float16"), ("rolling_attention", 4096, "float16")]


def test_the_kernel_bench_stops_starting_rows_inside_the_gpu_checks_limit():
    """The GPU check kills the bench at its step's limit, and the bench writes its JSON only at the
    end: its budget leaves time for starting Python and for the row in flight."""
    assert bench.KernelBenchConfig().budget_s + 20 <= gpu_check.STEP_SECONDS["kernels"]


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
def test_cli_writes_the_interpreters_rows(tmp_path, monkeypatch, capsys):
    """Two small cases (to keep the interpreter run short) through ``mmspec bench kernels --json``:
    without a GPU only the small shapes, checked and unmeasured (the GPU shapes need CUDA)."""
    full = bench.measured_cases
    monkeypatch.setattr(bench, "measured_cases", lambda seed: [full(seed)[0], full(seed)[4]])
    out = tmp_path / "kernels.json"
    assert commands.main(["bench", "kernels", "--json", str(out), "--quick", "--quiet"]) == 0
    result = json.loads(out.read_text())
    assert result["bench"] == "kernels"
    rows = result["rows"]
    assert all(ROW_KEYS <= set(row) and row["gpu_shape"] is False for row in rows)
    assert [(r["kernel"], r["dtype"]) for r in rows] == [("tree_attention", "float32"),
                                                          ("tree_attention", "float16"),
                                                          ("guided_accept", "float32")]
    for row in rows:
        assert row["correct"] is True and row["max_abs_err"] <= row["tolerance"] and row["reference_ms"] > 0
    assert rows[2]["decisions_equal"] is True
    assert not any(r["measured"] for r in rows) and not any("kernel_ms" in r or "sweep_keys" in r for r in rows)
    setup = result["setup"]
    assert "gpu_model" not in setup
    assert setup["kernels_ran"] == "Triton's CPU interpreter" and setup["timer"].startswith("time.perf_counter")
    assert setup["gpu_name"] is None and setup["torch"] == torch.__version__ and setup["triton"]
    out = capsys.readouterr().out
    assert "tree_attention" in out and "x sdpa" in out


def test_attention_tolerance_follows_the_tests():
    """fp32 a fixed 2e-6; fp16 twice torch's own fp16 error plus a quarter ulp at the outputs' scale."""
    case = bench.measured_cases(0)[0]
    ref = __import__("mmspec.kernels", fromlist=["tree_attention_reference"]).tree_attention_reference
    exact = ref(**case["inputs"])
    assert bench._attention_tolerance(ref, case["inputs"], exact, torch.float32) == 2e-6
    tol = bench._attention_tolerance(ref, case["inputs"], exact, torch.float16)
    torch_err = (ref(**bench._cast(case["inputs"], torch.float16)).float() - exact).abs().max().item()
    assert tol == pytest.approx(2 * torch_err + 2.5e-4 * exact.abs().max().item())


# -- the compiled path, on the CPU -----------------------------------------------------------------
def _small_shapes():
    """The four GPU-shape rows at toy sizes (the measured path builds inputs at a row's shape)."""
    return [bench.tree_attention_shape(H=2, Hkv=1, D=16, T=5, prefix=20),
            bench.rolling_tokens_shape(H=2, D=16, T=3, sink=2, window=9),
            bench.rolling_video_shape(H=2, D=24, frame_shape=(2, 3), chunk=1, window_frames=4),
            bench.guided_accept_shape(G=3, V=64)]


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """The compiled path made to run here: the references stand in for the launchers (through a log
    of which side each call ran), a timer that calls once and says 2 ms for kernels and 3 ms for
    anything else, two small cases and the toy GPU shapes. Yields the log of timed sides."""
    kernels = importlib.import_module("mmspec.kernels")
    called = []
    for fn in ("tree_attention", "rolling_attention", "guided_accept"):
        reference = getattr(kernels, fn + "_reference")
        monkeypatch.setattr(kernels, fn + "_triton",
                            lambda *a, _r=reference, **k: called.append("kernel") or _r(*a, **k))
        monkeypatch.setattr(kernels, fn + "_reference",
                            lambda *a, _r=reference, **k: called.append("reference") or _r(*a, **k))
    timed = []

    def timer(fn, warmup_ms, rep_ms):
        before = len(called)
        fn()
        timed.append(called[before] if len(called) > before else "sdpa")
        ms = 2.0 if timed[-1] == "kernel" else 3.0
        return ms, 0.9 * ms, 1.1 * ms

    full = bench.measured_cases
    monkeypatch.setattr(bench, "measured_cases", lambda seed: [full(seed)[0], full(seed)[4]])
    monkeypatch.setattr(bench, "gpu_shape_rows", _small_shapes)
    monkeypatch.setattr(bench, "gpu_time", timer)
    return timed


def test_compiled_rows_carry_times_speedups_and_checks(compiled_on_cpu):
    result = bench.run(bench.KernelBenchConfig(), device="cpu")
    rows = [r for r in result["rows"] if not r["gpu_shape"]]
    assert [(r["kernel"], r["dtype"]) for r in rows] == [
        ("tree_attention", "float32"), ("tree_attention", "float16"), ("tree_attention", "bfloat16"),
        ("guided_accept", "float32"), ("guided_accept", "bfloat16")]
    for row in rows:
        assert ROW_KEYS <= set(row) and row["measured"] is True and row["correct"] is True, row
        assert row["kernel_ms"] == 2.0 and row["reference_ms"] == 3.0 and row["speedup"] == 1.5
        assert row["kernel_ms_p20_p80"] == pytest.approx([1.8, 2.2]) and "note" not in row
    assert all(r["sdpa_ms"] == 3.0 and r["sdpa_speedup"] == 1.5 for r in rows[:3])
    assert all("sdpa_ms" not in r and r["decisions_equal"] is True for r in rows[3:])
    # the fp32 tolerance of a compiled kernel is the CUDA tests' (plus their 1e-5 slack)
    assert rows[0]["tolerance"] == pytest.approx(2e-6 + 1e-5)
    setup = result["setup"]
    assert setup["timer"] == "triton.testing.do_bench" and setup["warmup_ms"] == 10.0 and setup["rep_ms"] == 40.0
    assert setup["torch"] == torch.__version__ and "triton" in setup and setup["gpu_name"] is None


def test_sides_are_timed_one_after_another_per_row(compiled_on_cpu):
    """GPU shapes first (the GPU run's point), then the small shapes; within a row the
    kernel, its reference and (attention) the per-layer SDPA path, one after the other."""
    bench.run(bench.KernelBenchConfig(), device="cpu")
    attention, accept = ["kernel", "reference", "sdpa"], ["kernel", "reference"]
    assert compiled_on_cpu == 3 * attention + accept + 3 * attention + 2 * accept


def test_gpu_shape_rows_are_measured_like_the_small_ones(compiled_on_cpu):
    rows = [r for r in bench.run(bench.KernelBenchConfig(), device="cpu")["rows"] if r["gpu_shape"]]
    assert [(r["kernel"], r["dtype"]) for r in rows] == [
        ("tree_attention", "float16"), ("rolling_attention", "float16"), ("rolling_attention", "bfloat16"),
        ("guided_accept", "float32")]
    for row in rows:
        assert ROW_KEYS <= set(row) and row["measured"] is True and row["correct"] is True, row
        assert row["kernel_ms"] == 2.0 and row["reference_ms"] == 3.0 and row["speedup"] == 1.5
        assert row["max_abs_err"] <= row["tolerance"] and row["device"] == "cpu" and row["inputs"]
        assert not any("h100" in k or "projected" in k or k.startswith("measured_") for k in row), row
    assert all(r["sdpa_ms"] == 3.0 and r["sdpa_speedup"] == 1.5 for r in rows[:3]) and "sdpa_ms" not in rows[3]


def test_a_failing_kernel_gives_an_incorrect_row_and_the_bench_goes_on(compiled_on_cpu, monkeypatch):
    """A kernel that does not compile: its rows say so (the error's last line in ``note``), its
    reference is still timed, and the other kernel's rows are measured as usual."""
    kernels = importlib.import_module("mmspec.kernels")

    def broken(*args, **kwargs):
        raise RuntimeError("at 12:8:\n        s = tl.dot(q, tl.trans(k))\nAssertionError: K must be >= 16")

    monkeypatch.setattr(kernels, "tree_attention_triton", broken)
    rows = bench.run(bench.KernelBenchConfig(), device="cpu")["rows"]
    tree = [r for r in rows if r["kernel"] == "tree_attention"]
    assert len(tree) == 4  # three dtypes and the GPU shape
    for row in tree:
        assert row["correct"] is False and row["measured"] is False and "K must be >= 16" in row["note"]
        assert "kernel_ms" not in row and row["reference_ms"] == 3.0
    others = [r for r in rows if r["kernel"] != "tree_attention"]
    assert len(others) == 5 and all(r["measured"] and r["correct"] for r in others)


def test_a_failing_timer_is_a_note_not_a_lost_row(compiled_on_cpu, monkeypatch):
    def timer(fn, warmup_ms, rep_ms):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(bench, "gpu_time", timer)
    rows = bench.run(bench.KernelBenchConfig(), device="cpu")["rows"]
    assert len(rows) == 9
    for row in rows:
        assert row["correct"] is True and row["measured"] is False and "timing the kernel failed" in row["note"]
        assert "out of memory" in row["note"]


def test_rows_past_the_budget_are_reported_unmeasured(compiled_on_cpu):
    rows = bench.run(bench.KernelBenchConfig(budget_s=0.0), device="cpu")["rows"]
    assert len(rows) == 9 and compiled_on_cpu == []
    assert all(r["measured"] is False and r["correct"] is None and "budget" in r["note"] for r in rows)


def test_sweep_rows_carry_the_ratio_to_sdpa_and_the_launchers_splits(compiled_on_cpu, monkeypatch):
    """A toy sweep through the compiled path: every row measured, with sdpa / kernel and the key
    splits the launcher picks (one key tile at 16 keys, five at 300), printed."""
    monkeypatch.setattr(bench, "gpu_shape_rows",
                        lambda: bench.key_sweep_rows(keys=(16, 300), H=2, D=16, T=5, sink=2))
    rows = [r for r in bench.run(bench.KernelBenchConfig(), device="cpu")["rows"] if r["gpu_shape"]]
    assert [(r["kernel"], r["dtype"], r["sweep_keys"]) for r in rows] == [
        (kernel, dtype, n) for dtype in ("float16", "bfloat16") for kernel in ("tree_attention", "rolling_attention")
        for n in (16, 300)]
    for row in rows:
        assert row["measured"] is True and row["correct"] is True, row
        assert row["sdpa_ms"] == 3.0 and row["sdpa_speedup"] == 1.5
        assert row["num_splits"] == (1 if row["sweep_keys"] == 16 else 5)
    table = format_table(rows, bench.KERNELS_COLUMNS).splitlines()
    header, _, first = (line.strip("|").split("|") for line in table[:3])
    cells = dict(zip((c.strip() for c in header), (c.strip() for c in first)))
    assert (cells["sdpa ms"], cells["x sdpa"], cells["splits"]) == ("3.00", "1.50", "1")


def test_the_gpu_checks_summary_gives_the_ratio_to_sdpa_and_the_splits():
    row = {"kernel": "tree_attention", "shape": "s", "dtype": "float16", "gpu_shape": True, "correct": True,
           "sweep_keys": 16384, "kernel_ms": 0.2, "reference_ms": 0.9, "sdpa_ms": 0.3, "sdpa_speedup": 1.5,
           "num_splits": 9}
    lines = gpu_check._step_lines({"name": "kernels", "summary": {"rows": [row]}})
    assert lines == ["tree_attention s float16: correct=True, kernel 0.2000 ms, reference 0.9000 ms, "
                     "sdpa 0.3000 ms, sdpa/kernel 1.50, 9 key splits"]


@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
@pytest.mark.parametrize("fn, T, D, keys", [("tree_attention", 60, 128, 2000), ("rolling_attention", 5, 64, 700),
                                            ("tree_attention", 17, 24, 60)])
def test_recorded_splits_are_the_launchers(monkeypatch, fn, T, D, keys):
    """``num_splits`` against what the launcher itself plans (stopped before its launch)."""
    from mmspec.core.rope import Rope1D

    class Planned(Exception):
        pass

    real = splitk.plan
    monkeypatch.setattr(splitk, "plan", lambda *a: (_ for _ in ()).throw(Planned(real(*a).count)))
    g = torch.Generator().manual_seed(0)
    if fn == "tree_attention":
        inputs = bench._tree_inputs(g, 1, 4, 4, T, keys + T, D, prefix=keys)
    else:
        inputs = bench._rolling_inputs(g, 1, 4, 4, T, D, 4, keys - 4, Rope1D(D), 3)
    launcher = getattr(importlib.import_module("mmspec.kernels"), fn + "_triton")
    with pytest.raises(Planned) as planned:
        launcher(**inputs)
    assert planned.value.args[0] == bench.num_splits(inputs, torch.device("cpu")) > 1


def test_gpu_shape_cases_are_built_at_the_rows_shapes():
    g = torch.Generator().manual_seed(0)
    tree, tokens, video, accept = _small_shapes()
    _, kw = bench.gpu_shape_case(tree, g)
    assert kw["q"].shape == (1, 2, 5, 16) and kw["k"].shape == (1, 1, 25, 16) and kw["prefix_lens"].tolist() == [20]
    _, kw = bench.gpu_shape_case(tokens, g)
    assert kw["k"].shape == (1, 2, 2 + 9 + 3, 16) and (kw["sink"], kw["window"]) == (2, 9)
    assert kw["ring_start"].tolist() == [3] and type(kw["rope"]).__name__ == "Rope1D"
    assert not kw["tree_mask"].all()  # a tree's ancestor mask
    _, kw = bench.gpu_shape_case(video, g)
    assert kw["q"].shape == (1, 2, 6, 24) and (kw["sink"], kw["window"]) == (6, 18)
    assert kw["rope"].frame_shape == (2, 3) and kw["ring_start"].tolist() == [6] and kw["tree_mask"].all()
    _, kw = bench.gpu_shape_case(accept, g)
    assert kw["logits"].shape == (2, 4, 64) and kw["tokens"].shape == (1, 3) and kw["guidance_scale"] == 3.0
    # the default video row: one 1,560-token sink frame and a 20-frame window
    inputs = bench.rolling_video_shape()["inputs"]
    assert (inputs["sink"], inputs["window"], inputs["frame_tokens"]) == (1560, 20 * 1560, 1560)


def test_gpu_time_is_do_bench_by_time_with_quantiles(monkeypatch):
    """The call the GPU run makes, bound against the installed ``triton.testing.do_bench``."""
    testing = pytest.importorskip("triton.testing")
    real, calls = testing.do_bench, []
    monkeypatch.setattr(testing, "do_bench", lambda fn, **kw: calls.append(kw) or [1.0, 0.8, 1.3])
    assert bench.gpu_time(lambda: None, 10.0, 40.0) == (1.0, 0.8, 1.3)
    assert calls == [dict(warmup=10.0, rep=40.0, quantiles=[0.5, 0.2, 0.8])]
    inspect.signature(real).bind(lambda: None, **calls[0])


@pytest.mark.cuda
@pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
def test_compiled_bench_on_cuda(monkeypatch):
    """Two small cases, the toy GPU shapes and a toy key sweep (split and unsplit) compiled and
    timed by do_bench (short windows)."""
    full = bench.measured_cases
    monkeypatch.setattr(bench, "measured_cases", lambda seed: [full(seed)[0], full(seed)[4]])
    monkeypatch.setattr(bench, "gpu_shape_rows", lambda: _small_shapes() + bench.key_sweep_rows(
        keys=(16, 300), H=2, D=16, T=5, sink=2))
    result = bench.run(bench.KernelBenchConfig(warmup_ms=2.0, rep_ms=5.0))
    assert result["setup"]["gpu_name"] == torch.cuda.get_device_name()
    for row in result["rows"]:
        assert row["measured"] is True and row["correct"] is True, row
        assert row["kernel_ms"] > 0 and row["reference_ms"] > 0
    sweep = [r for r in result["rows"] if "sweep_keys" in r]
    assert len(sweep) == 8 and {r["num_splits"] for r in sweep} == {1, 5}
    assert all(r["sdpa_speedup"] > 0 and r["sdpa_ms"] > 0 for r in sweep)
