"""``mmspec gpu-check`` (``make gpu-check``): the prepared GPU check, one command that fits eight
minutes of a briefly lent CUDA machine.

Steps, in order, each in its own child process with its own time limit (a kernel that crashes
the interpreter or hangs in compilation costs its step, not the report):

1. ``cuda-tests``: ``pytest -m cuda`` over the test files that hold CUDA-marked tests (the
   compiled kernels against their torch references at every tested shape and dtype).
2. ``kernels``: ``mmspec bench kernels`` (compiled timings against the torch/SDPA reference, at
   the report's shapes and over 256 to 16,384 keys).
3. ``pipeline:ar-image``, ``pipeline:vlm``, ``pipeline:continuous``, ``pipeline:video``: the
   bundled checkpoint on the device in float32 and the low precisions (``check_pipeline``);
   ``pipeline:wan-tiny``: diffusers' Wan classes through ``from_wan``, tiny and random:
   greedy identity of every lossless method with the target alone, NFE and wall ratios (and the
   share of the saving kept) over a short interleaved run after a warm-up, the host syncs per pass
   on CUDA, the same run with compiled steps where the pipeline compiles them, and
   ``enable_model_cpu_offload()`` giving the outputs the pipeline gives without it.
4. ``vlm-heavy``: ``mmspec bench vlm --scenario visual-heavy`` on the device (the 192 px VLM,
   576 visual tokens per image; ``VLM_HEAVY_PROMPTS`` prompts): tau, wall speed-ups, the heads' draft
   and the target's verify milliseconds per pass (issue 47: does visual compression pay here?).
5. ``real-size``: ``mmspec.bench.real_size`` at Llama-2-7B's shapes (verify passes, an EAGLE head
   step, the loop's own cost per pass, eager and compiled).
6. ``real-size:wan``: ``mmspec.bench.real_size_wan`` at Wan2.1-T2V-1.3B's shapes, 480 x 832
   pixels, the "longlive" and "self-forcing" presets: ms per chunk over 60 chunks, the latency
   slope in % per 1,000 frames, cache bytes, rolling against window-recompute. It fits its parts
   into the time it is given (``--budget``) and the dry run plans it (``real_size_wan.plan``: the
   shapes on the meta device, the settings checked, the cache's bytes, the FLOPs per chunk).

The report: ``report.json`` (``validate_report`` says what it holds) and ``summary.txt`` in the
report folder (``--out``, else ``$OUT`` when set, else ``gpu-check-out``); both are rewritten after
every step, through a temporary file, so a run cut short leaves the steps it finished.

``--dry-run`` (``make gpu-check DRY_RUN=1``, which CI's tests run) goes through the same driver
with every CUDA step reported as skipped; it still collects the CUDA-marked tests (so the marker
selects something and collection needs no GPU). ``check_pipeline`` itself runs on any device,
and the tests run it on the CPU at a small size.

A step's status: ``passed``; ``failed`` (it ran and something is wrong: the ``problems`` list says
what); ``error`` (it could not run: an exception, a child that died); ``timeout``; ``skipped``
(``reason`` says why). In a pipeline step a float32 greedy mismatch, an offload mismatch or an
exception is a problem; a low-precision greedy mismatch is reported, not judged: a verify block
of several tokens rounds differently from one-token passes in fp16/bf16, so a near-tie between
two tokens can flip.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..utils import one_line

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"
SCHEMA = 1
STATUSES = ("passed", "failed", "error", "timeout", "skipped")
STEP_SECONDS = {"cuda-tests": 80, "kernels": 90, "vlm-heavy": 180, "real-size": 75, "real-size:wan": 170}
"""The time limit in seconds of each step that is not a pipeline's (a pipeline step's is its
``PipelineCheck.seconds``: ar-image 100, vlm 75, video 30, continuous 40, wan-tiny 45). The steps
before ``real-size:wan`` together 715 s, past the
540 s budget since ``vlm-heavy`` (issue 47) was added: a full run gives the last steps what is left
(``--steps`` picks the ones a session needs). ``real-size:wan`` (issue 44, about 170 s by its module's estimate) comes last and
takes what they leave, up to 170 s: the driver gives no step more than the budget has left, and
this one fits its parts into that (``REAL_SIZE_WAN_MARGIN``), streams first; run alone
(``--steps real-size:wan``) it gets all of it. A pipeline step that
runs out keeps the parts it finished (float32 identity, offload, speed eager, syncs, speed with
compiled steps, then low precision). Sized from the first run on a GPU (H200, 2026-11-28, budget
480 s): the CUDA tests one process at a time ran past 115 s with Triton's cache cold (123 passed
in 33 s on 8 workers, cache warm); the kernel bench spent its 70 s before its guided-acceptance
rows (it starts no row after ``KernelBenchConfig.budget_s`` = 70 s, so that it writes its JSON
inside this limit); ar-image and vlm ran past 70 s, continuous took 31 s, video 29 s, wan-tiny past
30 s. The compiled speed rows (ar-image, vlm, continuous), the real-size step (issue 42) and the
kernel bench's key sweep (issue 43) were added since and have not run on a GPU: their limits are
guesses, and each records what finished."""
BUDGET_SECONDS = 540.0
REAL_SIZE_WAN_MARGIN = 15.0
"""Seconds of ``real-size:wan``'s limit kept from its row's own budget: the child's imports and its
last JSON write."""
CUDA_TEST_WORKERS = 8
"""pytest-xdist workers for the CUDA tests, where xdist is installed (at most one per CPU)."""
LOW_PRECISIONS = ("bfloat16", "float16")
VLM_HEAVY_PROMPTS = 4
DEFAULT_OUT = "gpu-check-out"


# -- the report -----------------------------------------------------------------------------------
def machine_info() -> dict:
    """What the check ran on: the GPU's name (None without CUDA), CUDA, torch, triton, Python."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"gpu_name": torch.cuda.get_device_name(0) if cuda else None, "cuda_available": cuda,
            "cuda_version": torch.version.cuda, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "host": platform.node(), "cpu_count": os.cpu_count()}


def commit_info() -> dict:
    """The commit checked: ``git rev-parse HEAD`` (with ``dirty`` when the tree has changes), or,
    where the repository travelled without ``.git``, the one ``make gpu-wheels`` wrote to
    ``.whl/COMMIT``; ``None`` when neither is there."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=10)
            return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()), "source": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    recorded = ROOT / ".whl" / "COMMIT"
    if recorded.is_file():
        sha, _, flag = recorded.read_text().strip().partition(" ")
        return {"commit": sha, "dirty": flag == "dirty", "source": ".whl/COMMIT (written by make gpu-wheels)"}
    return {"commit": None, "dirty": None, "source": None}


def new_report(dry_run: bool, budget_s: float) -> dict:
    return {"check": "gpu-check", "schema": SCHEMA, "dry_run": dry_run,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "budget_seconds": budget_s, "wall_seconds": 0.0, "machine": machine_info(), **commit_info(),
            "steps": []}


def pipeline_checks() -> dict[str, type]:
    """The pipeline steps' drivers by name: every served modality's ``device_check``
    (``mmspec.serve.SPECS``, in their order), then ``wan-tiny`` (diffusers' Wan classes behind the
    video modality, not a modality of their own)."""
    from .. import serve
    from ..utils.refs import load_ref

    found = {kind: load_ref(spec.device_check) for kind, spec in serve.SPECS.items() if spec.device_check}
    return {**found, "wan-tiny": WanTinyCheck}


def pipeline_names() -> tuple[str, ...]:
    return tuple(pipeline_checks())


def step_names() -> tuple[str, ...]:
    """Every step, in the order a run takes them."""
    return ("cuda-tests", "kernels") + tuple(f"pipeline:{p}" for p in pipeline_names()) + (
        "vlm-heavy", "real-size", "real-size:wan")


def step_seconds(name: str) -> float:
    """A step's time limit: ``STEP_SECONDS``, or a pipeline step's ``PipelineCheck.seconds``."""
    if name.startswith("pipeline:"):
        return pipeline_checks()[name.split(":", 1)[1]].seconds
    return STEP_SECONDS[name]


def validate_report(report: dict) -> list[str]:
    """What is missing or wrong in a report (empty when it is complete): the top-level keys, one
    entry per step in ``step_names()`` order, each with a known status, its seconds, a ``reason`` when
    skipped, failed, timed out or in error, and the summary its kind of step fills when it ran."""
    problems = []
    for key, kind in (("check", str), ("schema", int), ("dry_run", bool), ("started", str),
                      ("budget_seconds", (int, float)), ("wall_seconds", (int, float)), ("machine", dict),
                      ("steps", list)):
        if not isinstance(report.get(key), kind):
            problems.append(f"{key}: missing or not {kind}")
    if "commit" not in report:
        problems.append("commit: missing")
    for key in ("gpu_name", "torch", "triton", "python", "cuda_available"):
        if key not in report.get("machine", {}):
            problems.append(f"machine.{key}: missing")
    steps = report.get("steps") or []
    names = [s.get("name") for s in steps]
    if names != list(step_names()):
        problems.append(f"steps: {names} instead of {list(step_names())}")
    for s in steps:
        name, status = s.get("name"), s.get("status")
        if status not in STATUSES:
            problems.append(f"{name}: status {status!r} not in {STATUSES}")
            continue
        if not isinstance(s.get("seconds"), (int, float)):
            problems.append(f"{name}: seconds missing")
        if status != "passed" and not s.get("reason"):
            problems.append(f"{name}: {status} without a reason")
        summary = s.get("summary")
        if not isinstance(summary, dict):
            problems.append(f"{name}: summary missing")
            continue
        if name == "cuda-tests" and status != "skipped" and not isinstance(summary.get("selected"), int):
            problems.append("cuda-tests: summary.selected missing")
        if status in ("passed", "failed"):
            need = {"cuda-tests": ("passed", "failed", "errors", "skipped"),
                    "kernels": ("rows", "measured", "correct"),
                    "real-size": ("verify_ms", "draft_ms", "loop"),
                    "real-size:wan": ("presets", "targets", "errors"),
                    "vlm-heavy": ("rows", "errors")}.get(name, ("identity", "speed", "offload",
                                                                                  "problems"))
            problems += [f"{name}: summary.{k} missing" for k in need if k not in summary]
    return problems


def write_report(report: dict, out: Path) -> None:
    """``report.json`` and ``summary.txt`` in ``out``, each through a temporary file."""
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    _write(out / "summary.txt", format_summary(report) + "\n")


def _write(path: Path, text: str) -> None:
    from ..utils.atomic import atomic_path

    with atomic_path(path) as tmp:
        tmp.write_text(text)


def format_summary(report: dict) -> str:
    m = report["machine"]
    head = (f"mmspec gpu-check {'(dry run) ' if report['dry_run'] else ''}{report['started']}: "
            f"{m.get('gpu_name') or 'no GPU'}, torch {m.get('torch')}, triton {m.get('triton')}, "
            f"commit {(report.get('commit') or 'unknown')[:12]}{' (dirty)' if report.get('dirty') else ''}, "
            f"{report['wall_seconds']:.0f} s of {report['budget_seconds']:.0f}")
    lines = [head]
    for s in report["steps"]:
        lines.append(f"- {s['name']}: {s['status']} ({s['seconds']:.0f} s)"
                     + (f": {s['reason']}" if s.get("reason") else ""))
        lines += [f"    {line}" for line in _step_lines(s)]
    return "\n".join(lines)


def _timing(row: dict) -> str:
    """A kernel row's times in ms (``*_ms``, small and GPU shapes alike); ``sdpa`` where timed, and
    the ratio sdpa / kernel and the key splits where the row has them."""
    number = lambda v: isinstance(v, (int, float))  # noqa: E731
    if number(row.get("kernel_ms")) and number(row.get("reference_ms")):
        times = {"kernel": row["kernel_ms"], "reference": row["reference_ms"], "sdpa": row.get("sdpa_ms")}
        ratio = row.get("sdpa_speedup")
    else:
        return "not timed" + (f" ({row['note']})" if row.get("note") else "")
    out = [f"{k} {v:.4f} ms" for k, v in times.items() if number(v)]
    if number(ratio):
        out.append(f"sdpa/kernel {ratio:.2f}")
    if number(row.get("num_splits")):
        out.append(f"{row['num_splits']} key splits")
    return ", ".join(out)


def _step_lines(step: dict) -> list[str]:
    sm = step.get("summary") or {}
    if step["name"] == "cuda-tests":
        if "passed" not in sm:
            return [f"{sm.get('selected')} tests selected"] if "selected" in sm else []
        out = [f"{sm['passed']} passed, {sm['failed']} failed, {sm['errors']} errors, {sm['skipped']} skipped"]
        return out + [f"FAIL {f['test']}: {f['message']}" for f in sm.get("failures", [])[:10]]
    if step["name"] == "kernels":
        out = []
        for r in sm.get("rows", []):
            out.append(f"{r['kernel']} {r['shape']} {r['dtype']}: correct={r.get('correct')}, {_timing(r)}")
        return out
    if step["name"] == "real-size":
        if "verify_ms" not in sm:
            return []
        verify = ", ".join(f"{w} tokens {ms:.2f} ms" for w, ms in sm["verify_ms"].items())
        out = [f"{sm['dtype']}, Llama-2-7B shapes, {sm['prefix']} cached tokens: verify {verify}; "
               f"EAGLE head step {sm['draft_ms']:.2f} ms"]
        for mode, loop in sm.get("loop", {}).items():
            out.append(f"loop {mode}: {loop['pass_ms']:.2f} ms a pass, forward {loop['forward_ms']:.2f} ms, "
                       f"outside it {loop['loop_ms']:.2f} ms ({100 * loop['loop_share']:.1f}% of the forward)")
        return out + [f"PROBLEM {p}" for p in sm.get("errors", [])]
    if step["name"] == "real-size:wan":
        return _wan_lines(sm)
    if step["name"] == "vlm-heavy":
        n = lambda v, f=".2f": "n/a" if v is None else format(v, f)  # noqa: E731
        out = [f"{r['method']}: tau {n(r.get('tau'))}, wall x {n(r.get('wall_speedup'))}, draft "
               f"{n(r.get('draft_ms_per_pass'))} ms / verify {n(r.get('verify_ms_per_pass'))} ms a pass, "
               f"visual tokens in draft {n(r.get('visual_tokens_kept'), '')}, greedy = {r.get('greedy_identical')}"
               for r in sm.get("rows", [])]
        return out + [f"PROBLEM {p}" for p in sm.get("errors", [])]
    out = [f"{k}: {v}" for k, v in sm.items() if k in ("note",)]
    for row in sm.get("identity", []):
        out.append(f"greedy {row['dtype']} {row['method']}: "
                   + ("identical" if row["identical"] else f"{row['match_fraction']:.3f} of tokens equal"))
    for part in ("speed", "compiled"):
        for row in (sm.get(part) or {}).get("rows", []):
            extra = "".join(f", {k} {row[k]:.2f}" for k in ("nfe_ratio", "share_kept", "tau", "syncs_per_pass")
                            if isinstance(row.get(k), (int, float)))
            out.append(f"{part} {sm[part]['dtype']} {row['method']}: wall x {row['wall_ratio']:.2f}{extra}")
    for row in sm.get("offload", []):
        out.append(f"offload {row['dtype']} {row['method']}: {'identical' if row['identical'] else 'DIFFERS'}"
                   + (f" (max abs diff {row['max_abs_diff']:.3g})" if row.get("max_abs_diff") else ""))
    return out + [f"PROBLEM {p}" for p in sm.get("problems", [])]


def _wan_lines(sm: dict) -> list[str]:
    """The real-size Wan row: its shapes, then per preset its plan, its stream and its comparison
    (whichever the summary holds: the dry run has the plan only)."""
    if "presets" not in sm:
        return []
    n = lambda v, f=".1f": "n/a" if v is None else format(v, f)  # noqa: E731
    yes = lambda v: "n/a" if v is None else ("yes" if v else "NO")  # noqa: E731
    (h, w), C = sm["latent_hw"], sm["chunk_frames"]
    out = [f"{sm['dtype']}, Wan2.1-T2V-1.3B shapes ({sm['params'] / 1e9:.2f} B parameters, random): "
           f"{sm['shapes']['height']} x {sm['shapes']['width']} px, latent frames {h} x {w} "
           f"({sm['tokens_per_frame']} tokens), chunks of {C} frames ({C * sm['tokens_per_frame']} queries)",
           f"{sm['warmup']} + {sm['chunks']} chunks a stream, {sm['recompute_chunks']} rolling against "
           f"window-recompute; flat: |slope| < {sm['flat_limit_pct']:g}% per 1,000 frames"]
    for name, p in sm["presets"].items():
        out.append(f"{name} (sink {p['sink_frames']}, window {p['window_frames']}, {p['position_policy']}): "
                   f"{p['passes_per_chunk']} passes a chunk over {p['key_tokens']} keys, "
                   f"{p['tflop_per_chunk']:.0f} TFLOP (window-recompute x {p['compute_ratio']:.1f}), "
                   f"cache {p['cache_bytes'] / 2**30:.2f} GiB")
        st, rc = p.get("stream") or {}, p.get("recompute") or {}
        if "note" in st:
            out.append(f"  stream: {st['note']}")
        elif st:
            over = (f"{st['fit_chunks']} chunks from frame {st['fit_from_frame']}" if st["steady"] else
                    f"{st['chunks_done']} chunks, the cache not yet full")
            out.append(f"  stream: {n(st['ms_per_chunk'])} ms a chunk over {over}, slope "
                       f"{n(st['slope_pct_per_1k_frames'], '+.2f')}% per 1,000 frames "
                       f"(se {n(st['slope_pct_se'], '.2f')}), flat: {yes(st['flat'])}"
                       + (f" (cut: {st['truncated']})" if st.get("truncated") else ""))
        if "note" in rc:
            out.append(f"  rolling against window-recompute: {rc['note']}")
        elif rc:
            out.append(f"  rolling {n(rc['rolling_ms_per_chunk'])} against window-recompute "
                       f"{n(rc['recompute_ms_per_chunk'])} ms a chunk ({rc['position_policy']}, {rc['chunks_done']} "
                       f"chunks{'' if rc['steady'] else ', window not yet full'}): x {n(rc['speedup'], '.2f')}, "
                       f"rolling faster: {yes(rc['rolling_faster'])}"
                       + (f" (cut: {rc['truncated']})" if rc.get("truncated") else ""))
    return out + [f"PROBLEM {p}" for p in sm.get("errors", [])]


# -- the steps ------------------------------------------------------------------------------------
def cuda_test_files() -> list[str]:
    """The test files that hold CUDA-marked tests (only they are handed to pytest: the others may
    import what the GPU machine lacks, gradio or playwright)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.cuda" in p.read_text())


def _child(args: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """Run ``python args`` in the repository root; (return code or None on timeout, its output)."""
    try:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        return done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return None, out.decode(errors="replace") if isinstance(out, bytes) else out


def _tail(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def step_cuda_tests(out: Path, timeout: float, dry_run: bool) -> dict:
    files = cuda_test_files()
    if not files:
        return {"status": "error", "reason": "no test file under tests/ holds a test marked cuda",
                "summary": {"selected": 0, "files": []}}
    rc, text = _child(["-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files],
                      min(timeout, 60))
    selected = sum(1 for line in text.splitlines() if "::" in line)
    summary: dict[str, Any] = {"selected": selected, "files": files}
    if rc not in (0, 5) or selected == 0:
        return {"status": "error", "reason": f"collecting the CUDA tests failed (exit {rc}): {_tail(text, 6)}",
                "summary": summary}
    if dry_run:
        return {"status": "skipped", "reason": "dry run: the CUDA tests were collected, not run", "summary": summary}
    xml = out / "cuda-tests.xml"
    workers = min(CUDA_TEST_WORKERS, os.cpu_count() or 1)
    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") is not None else []
    summary["workers"] = int(parallel[1]) if parallel else 1
    rc, text = _child(["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *parallel,
                       f"--junitxml={xml}", *files], timeout)
    (out / "cuda-tests.log").write_text(text)
    if rc is None:
        return {"status": "timeout", "reason": f"pytest -m cuda ran past {timeout:.0f} s", "summary": summary}
    summary.update(junit_counts(xml))
    ok = rc == 0 and summary["failed"] == summary["errors"] == 0 and summary["passed"] > 0
    reason = None if ok else (f"pytest exit {rc}: {summary['failed']} failed, {summary['errors']} errors, "
                              f"{summary['passed']} passed")
    return {"status": "passed" if ok else "failed", "reason": reason, "summary": summary}


def junit_counts(xml: Path) -> dict:
    """Counts and the failures (test id, first line of the message) of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    if not xml.is_file():
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            counts["failures"].append({"test": test, "message": (message[0] if message else "")[:300]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def step_kernels(out: Path, timeout: float, dry_run: bool) -> dict:
    if dry_run:
        return {"status": "skipped", "reason": "dry run: no compiled kernels to time", "summary": {}}
    path = out / "kernels.json"
    rc, text = _child(["-m", "mmspec", "bench", "kernels", "--json", str(path), "--quiet"], timeout)
    if rc is None:
        return {"status": "timeout", "reason": f"mmspec bench kernels ran past {timeout:.0f} s: {_tail(text, 4)}",
                "summary": {}}
    if rc != 0 or not path.is_file():
        return {"status": "error", "reason": f"mmspec bench kernels exit {rc}: {_tail(text, 8)}", "summary": {}}
    result = json.loads(path.read_text())
    keep = ("kernel", "shape", "dtype", "gpu_shape", "device", "sweep_keys", "measured", "correct",
            "decisions_equal", "max_abs_err", "tolerance", "kernel_ms", "reference_ms", "speedup", "sdpa_ms",
            "sdpa_speedup", "num_splits", "note")
    rows = [{k: r[k] for k in keep if k in r} for r in result["rows"]]
    ran = [r for r in rows if r.get("measured")]
    wrong = [r for r in ran if r.get("correct") is False]
    summary = {"rows": rows, "measured": len(ran), "correct": sum(r.get("correct") is True for r in ran),
               "setup": result.get("setup", {})}
    reason = None if not wrong else "; ".join(f"{r['kernel']} {r['shape']} {r['dtype']}: "
                                              f"{(r.get('note') or 'wrong result')[-160:]}" for r in wrong[:6])
    return {"status": "failed" if wrong else "passed", "reason": reason, "summary": summary}


def step_pipeline(name: str, out: Path, timeout: float, dry_run: bool, device: str) -> dict:
    if dry_run:
        return {"status": "skipped", "reason": "dry run: no CUDA device", "summary": {}}
    path = out / f"pipeline-{name}.json"
    rc, text = _child(["-m", "mmspec.bench.gpu_check", "--pipeline", name, "--device", device, "--json", str(path)],
                      timeout)
    (out / f"pipeline-{name}.log").write_text(text)
    if rc is None:
        partial = json.loads(path.read_text()) if path.is_file() else {}
        return {"status": "timeout", "reason": f"ran past {timeout:.0f} s: {_tail(text, 4)}", "summary": partial}
    if rc != 0 or not path.is_file():
        return {"status": "error", "reason": f"exit {rc}: {_tail(text, 8)}", "summary": {}}
    summary = json.loads(path.read_text())
    problems = summary.get("problems", [])
    return {"status": "failed" if problems else "passed", "reason": "; ".join(problems)[:600] or None,
            "summary": summary}


def step_real_size(out: Path, timeout: float, dry_run: bool, device: str) -> dict:
    """``mmspec.bench.real_size.row`` in bf16 in a child process (its JSON written as it goes)."""
    if dry_run:
        return {"status": "skipped", "reason": "dry run: no CUDA device", "summary": {}}
    return _child_row(out, "real-size", ["--real-size", "--device", device], timeout, "loop")


def _child_row(out: Path, name: str, args: list[str], timeout: float, key: str) -> dict:
    """Run ``python -m mmspec.bench.gpu_check *args --json out/name.json`` (its log beside it) and
    read the step's result from that JSON: timed out, an error (no ``key`` in it), or failed on its
    ``errors``."""
    path = out / f"{name}.json"
    rc, text = _child(["-m", "mmspec.bench.gpu_check", *args, "--json", str(path)], timeout)
    (out / f"{name}.log").write_text(text)
    summary = json.loads(path.read_text()) if path.is_file() else {}
    if rc is None:
        return {"status": "timeout", "reason": f"ran past {timeout:.0f} s: {_tail(text, 4)}", "summary": summary}
    if rc != 0 or key not in summary:
        return {"status": "error", "reason": f"exit {rc}: {_tail(text, 8)}", "summary": summary}
    errors = summary.get("errors", [])
    return {"status": "failed" if errors else "passed", "reason": "; ".join(errors)[:600] or None,
            "summary": summary}


def step_vlm_heavy(out: Path, timeout: float, dry_run: bool, device: str) -> dict:
    """``mmspec bench vlm --scenario visual-heavy`` on ``device`` in a child process; a row whose
    greedy tokens differ from the target alone's is an error of the step."""
    if dry_run:
        return {"status": "skipped", "reason": "dry run: no CUDA device", "summary": {}}
    return _child_row(out, "vlm-heavy", ["--vlm-heavy", "--device", device], timeout, "rows")


def step_real_size_wan(out: Path, timeout: float, dry_run: bool, device: str) -> dict:
    """``mmspec.bench.real_size_wan.row`` in bf16 in a child process given ``timeout`` less
    ``REAL_SIZE_WAN_MARGIN`` seconds (its JSON written after every part); the dry run's summary is
    the row's ``plan``."""
    if dry_run:
        from .real_size_wan import plan

        return {"status": "skipped", "reason": "dry run: no CUDA device (planned on the meta device)",
                "summary": plan()}
    budget = max(1.0, timeout - REAL_SIZE_WAN_MARGIN)
    return _child_row(out, "real-size-wan", ["--real-size-wan", "--device", device, "--budget", f"{budget:.0f}"],
                      timeout, "presets")


def run(out: Path, *, dry_run: bool = False, budget_s: float = BUDGET_SECONDS, device: str = "cuda",
        steps: tuple[str, ...] | None = None, say: Callable[[str], None] = print) -> dict:
    """Every step in order inside ``budget_s`` (``steps``: the ones to run, the others reported as
    not asked for; None: all); returns the report (also written to ``out``).
    Without CUDA and without ``dry_run`` the CUDA steps are skipped with that reason."""
    import torch

    t0 = time.perf_counter()
    report = new_report(dry_run, budget_s)
    no_cuda = device == "cuda" and not torch.cuda.is_available()
    steps = step_names() if steps is None else steps
    for name in step_names():
        left = budget_s - (time.perf_counter() - t0)
        start = time.perf_counter()
        if name not in steps:
            result = {"status": "skipped", "reason": "not asked for (--steps)", "summary": {}}
        elif left < 10:
            result = {"status": "skipped", "reason": f"the budget of {budget_s:.0f} s was spent", "summary": {}}
        elif no_cuda and not dry_run and name != "cuda-tests":
            result = {"status": "skipped", "reason": "torch sees no CUDA device", "summary": {}}
        else:
            timeout = min(step_seconds(name), left)
            say(f"gpu-check: {name} (at most {timeout:.0f} s)")
            try:
                if name == "cuda-tests":
                    result = step_cuda_tests(out, timeout, dry_run or no_cuda)
                    if no_cuda and not dry_run and result["status"] == "skipped":
                        result["reason"] = "torch sees no CUDA device: the CUDA tests were collected, not run"
                elif name == "kernels":
                    result = step_kernels(out, timeout, dry_run)
                elif name == "real-size":
                    result = step_real_size(out, timeout, dry_run, device)
                elif name == "real-size:wan":
                    result = step_real_size_wan(out, timeout, dry_run, device)
                elif name == "vlm-heavy":
                    result = step_vlm_heavy(out, timeout, dry_run, device)
                else:
                    result = step_pipeline(name.split(":", 1)[1], out, timeout, dry_run, device)
            except Exception as e:  # the report must survive any one step
                result = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:600], "summary": {}}
        report["steps"].append({"name": name, "seconds": time.perf_counter() - start, **result})
        report["wall_seconds"] = time.perf_counter() - t0
        write_report(report, out)
        say(f"gpu-check: {name}: {result['status']}" + (f" ({result['reason']})" if result.get("reason") else ""))
    problems = validate_report(report)
    if problems:  # a driver bug: say it in the report rather than hide it
        report["schema_problems"] = problems
        write_report(report, out)
    return report


# -- one pipeline on one device -------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _compare(a, b) -> tuple[bool, float, int | None]:
    """(identical, fraction of equal entries, first differing flat index) of two token tensors or
    lists of token lists."""
    import torch

    if not isinstance(a, torch.Tensor):  # lists of token lists (a VLM's answers)
        if a == b:
            return True, 1.0, None
        flat_a, flat_b = [t for row in a for t in row], [t for row in b for t in row]
        same = [x == y for x, y in zip(flat_a, flat_b)]
        first = next((i for i, s in enumerate(same) if not s), len(same))
        return False, sum(same) / max(len(flat_a), len(flat_b), 1), first
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape:
        return False, 0.0, 0
    eq = (a == b).flatten()
    first = None if bool(eq.all()) else int((~eq).nonzero()[0])
    return bool(eq.all()), float(eq.float().mean()), first


def _max_abs_diff(a, b) -> float:
    import torch

    a, b = torch.as_tensor(a).detach().cpu().float(), torch.as_tensor(b).detach().cpu().float()
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


class PipelineCheck:
    """How the check drives one pipeline: load it, call it, read its comparable output (a served
    modality names its subclass in ``ModalitySpec.device_check``)."""

    name: str
    seconds: float = 60.0          # the step's time limit
    methods: tuple[str, ...]       # the lossless methods checked for greedy identity (after "none")
    speed_methods: tuple[str, ...]  # the interleaved speed run ("none" first)
    offload_methods: tuple[str, ...]
    greedy = True                  # False: sampled only (identity not defined; offload compares samples)
    decodes = True                 # a speculative decode (stats carry NFE and tau); False: a video stream
    compiles = False               # a second speed run with pipe.enable_compiled_steps()

    def __init__(self, model_dir: Path, quick: bool):
        self.model_dir, self.quick = model_dir, quick

    @property
    def source(self) -> str:
        """Where the weights come from (the report says it)."""
        return str(self.model_dir)

    def load(self, dtype, device):
        raise NotImplementedError

    def call(self, pipe, method: str, device, seed: int = 0):
        raise NotImplementedError

    def output(self, out):
        raise NotImplementedError


class ARImageCheck(PipelineCheck):
    seconds = 100
    name = "ar-image"
    compiles = True
    methods = ("sd", "eagle", "medusa", "sjd", "mcsjd")
    speed_methods = ("none", "sd", "eagle", "medusa", "sjd")
    offload_methods = ("none", "sd", "eagle", "medusa")

    def load(self, dtype, device):
        from ..pipelines import SpeculativeARImagePipeline

        return SpeculativeARImagePipeline.from_pretrained(self.model_dir, dtype=dtype).to(device)

    def call(self, pipe, method, device, seed=0):
        import torch

        labels = [0, 5] if self.quick else [0, 5, 10, 15]
        return pipe(class_labels=labels, method=method, temperature=0, guidance_scale=2.0, output_type="latent",
                    generator=torch.Generator(device).manual_seed(seed))

    def output(self, out):
        return out.tokens


class VLMCheck(PipelineCheck):
    seconds = 75
    name = "vlm"
    compiles = True
    methods = ("sd", "lookup", "eagle", "specvlm", "vispec", "medusa")
    speed_methods = ("none", "sd", "eagle", "vispec", "medusa")
    offload_methods = ("none", "eagle", "medusa")

    def load(self, dtype, device):
        from ..pipelines import SpeculativeVLMPipeline

        return SpeculativeVLMPipeline.from_pretrained(self.model_dir, dtype=dtype).to(device)

    def call(self, pipe, method, device, seed=0):
        from .vlm import bench_prompts

        images, prompts = bench_prompts(2 if self.quick else 4)
        return pipe(images=images, prompts=prompts, method=method, temperature=0,
                    max_new_tokens=16 if self.quick else 64)

    def output(self, out):
        return out.tokens


class ContinuousCheck(PipelineCheck):
    seconds = 40
    name = "continuous"
    greedy = False
    compiles = True
    methods = ()
    speed_methods = ("none", "sd")
    offload_methods = ("none", "sd")

    def load(self, dtype, device):
        from ..pipelines import SpeculativeContinuousARPipeline

        return SpeculativeContinuousARPipeline.from_pretrained(self.model_dir, dtype=dtype).to(device)

    def call(self, pipe, method, device, seed=0):
        import torch

        labels = [0, 5] if self.quick else [0, 5, 10, 15]
        return pipe(class_labels=labels, method=method, output_type="latent",
                    generator=torch.Generator(device).manual_seed(seed))

    def output(self, out):
        return out.latents


class VideoCheck(PipelineCheck):
    seconds = 30
    name = "video"
    greedy = False
    decodes = False
    methods = ()
    speed_methods = ("rolling", "window-recompute")  # cache modes: the first is the one timed against
    offload_methods = ("rolling",)

    def load(self, dtype, device):
        from ..pipelines import StreamingVideoPipeline

        return StreamingVideoPipeline.from_pretrained(self.model_dir, dtype=dtype).to(device)

    def call(self, pipe, method, device, seed=0):
        import torch

        frames = pipe.chunk_frames * (3 if self.quick else 12)
        return pipe(prompt="a red circle moving right", num_frames=frames, cache_mode=method, output_type="pt",
                    generator=torch.Generator(device).manual_seed(seed))

    def output(self, out):
        return out.frames


class WanTinyCheck(VideoCheck):
    """diffusers' Wan classes through ``from_wan`` (``mmspec.bench.wan_tiny``, random weights, 128 x
    128 pixels): the attention processors and the core's cache on the GPU, rolling against
    recompute, offload."""

    name = "wan-tiny"
    seconds = 45
    source = "mmspec.bench.wan_tiny (random weights, built in code)"

    def load(self, dtype, device):
        from .wan_tiny import tiny_wan_pipeline

        return tiny_wan_pipeline(height=128, width=128, window_frames=12).to(device, dtype)

    def call(self, pipe, method, device, seed=0):
        import torch

        frames = pipe.chunk_frames * (3 if self.quick else 20)
        return pipe(prompt="a red cat walks on grass", num_latent_frames=frames, cache_mode=method, output_type="pt",
                    generator=torch.Generator(device).manual_seed(seed), **({"height": 32, "width": 32} if self.quick
                                                                            else {}))




def count_syncs(call: Callable[[], Any]) -> tuple[int, int]:
    """(host-device synchronisations CUDA reports during ``call()``, the call's target passes less
    the prefill): ``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronising call."""
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    count = sum("synchroniz" in str(w.message).lower() for w in caught)
    return count, max(0, dict(out.stats).get("nfe", 1) - 1)


def _interleaved(call: Callable[[str], Any], methods: tuple[str, ...], rounds: int, device) -> dict:
    """Every method once as a warm-up, then ``rounds`` rounds of every method in turn: the median
    wall seconds per method and the last run's stats."""
    walls: dict[str, list[float]] = {m: [] for m in methods}
    stats: dict[str, dict] = {}
    for m in methods:
        call(m)
    for _ in range(rounds):
        for m in methods:
            _sync(device)
            t0 = time.perf_counter()
            out = call(m)
            _sync(device)
            walls[m].append(time.perf_counter() - t0)
            stats[m] = dict(getattr(out, "stats", None) or {})
    return {m: (statistics.median(walls[m]), stats[m]) for m in methods}


def check_pipeline(name: str, device: str = "cuda", *, dtypes: tuple[str, ...] = ("float32",) + LOW_PRECISIONS,
                   speed_dtype: str = "bfloat16", rounds: int = 2, quick: bool = False,
                   model_dir: str | Path | None = None, offload: bool = True, compile_steps: bool = True,
                   progress: Callable[[str], None] | None = None, record: Callable[[dict], None] | None = None) -> dict:
    """One bundled pipeline on ``device``: greedy identity of its lossless methods with
    ``method="none"`` in every dtype of ``dtypes``, NFE and wall ratios over ``rounds`` interleaved
    rounds in ``speed_dtype`` after a warm-up (with each method's share of the saving kept, wall x
    over NFE x), on CUDA the host syncs per pass (``count_syncs``), for pipelines whose steps
    compile (``compile_steps``) the same run with ``enable_compiled_steps()``, and (``offload``)
    ``enable_model_cpu_offload`` on ``device`` giving the outputs it gives without (float32 and
    ``speed_dtype``). Every part is
    tried even when another failed; ``problems`` lists what is wrong. ``record(partial)`` is called
    after each part (the step's child writes it, so a timeout keeps what finished)."""
    import torch

    say = progress or (lambda msg: None)
    spec = pipeline_checks()[name](Path(model_dir or ASSETS / name), quick)
    result: dict[str, Any] = {"pipeline": name, "device": device, "model_dir": spec.source,
                              "identity": [], "speed": {}, "offload": [], "problems": [], "errors": []}
    if not spec.greedy:
        result["note"] = ("sampled pipeline: no greedy identity; offload compares samples drawn with the same "
                          "seed on the same device")

    def attempt(what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failing part must not hide the others
            msg = f"{what}: {type(e).__name__}: {one_line(e)}"[:400]
            result["errors"].append(msg)
            result["problems"].append(msg)
            say(msg)
        if record is not None:
            record(result)

    pipes: dict[str, Any] = {}
    baseline: dict[str, Any] = {}

    def load(dtype: str):
        if dtype not in pipes:
            pipes[dtype] = spec.load(getattr(torch, dtype), device)
            pipes[dtype].set_progress_bar_config(disable=True)
        return pipes[dtype]

    def identity(dtype: str) -> None:
        pipe = load(dtype)
        base = spec.output(spec.call(pipe, "none", device))
        baseline[dtype] = base
        for m in spec.methods:
            same, frac, first = _compare(spec.output(spec.call(pipe, m, device)), base)
            result["identity"].append({"dtype": dtype, "method": m, "identical": same, "match_fraction": frac,
                                       "first_mismatch": first})
            if not same and dtype == "float32":
                result["problems"].append(f"greedy {m} differs from the target alone in float32 "
                                          f"({frac:.3f} of tokens equal, first at {first})")

    def speed_rows(timed: dict, base_wall: float | None = None) -> list[dict]:
        first_wall, base_stats = timed[spec.speed_methods[0]]
        rows = []
        for m, (wall, st) in timed.items():
            row = {"method": m, "wall_s": wall, "wall_ratio": (base_wall or first_wall) / wall}
            if spec.decodes:  # share kept: how much of the saving in passes survives as wall time
                nfe_ratio = base_stats["nfe"] / st["nfe"]
                row.update(nfe=st["nfe"], nfe_ratio=nfe_ratio, share_kept=row["wall_ratio"] / nfe_ratio,
                           tau=st.get("tau"), draft_nfe=st.get("draft_nfe"))
            else:
                row.update(ms_per_chunk=1000 * statistics.median(st["latency_s"]), frames=st.get("frames"),
                           cache_bytes=st.get("cache_bytes"))
            rows.append(row)
        return rows

    def speed() -> None:
        pipe = load(speed_dtype)
        timed = _interleaved(lambda m: spec.call(pipe, m, device), spec.speed_methods, rounds, device)
        result["speed"] = {"dtype": speed_dtype, "rounds": rounds, "rows": speed_rows(timed)}

    def syncs() -> None:  # CUDA's own count: every synchronising call warns once
        pipe = load(speed_dtype)
        for row in result["speed"].get("rows", []):
            count, nfe = count_syncs(lambda: spec.call(pipe, row["method"], device))
            row["syncs_per_pass"] = count / nfe if nfe else None

    def compiled() -> None:
        pipe = load(speed_dtype)
        pipe.enable_compiled_steps()  # reduce-overhead: CUDA graphs; each method's first call compiles
        try:
            timed = _interleaved(lambda m: spec.call(pipe, m, device), spec.speed_methods, rounds, device)
        finally:
            pipe.disable_compiled_steps()
        eager = {r["method"]: r for r in result["speed"].get("rows", [])}
        rows = speed_rows(timed)
        for row in rows:  # the same ratios, and each method against the eager target alone
            base = eager.get(spec.speed_methods[0])
            row["wall_x_eager_none"] = base["wall_s"] / row["wall_s"] if base else None
        result["compiled"] = {"dtype": speed_dtype, "rounds": rounds, "mode": "reduce-overhead", "rows": rows}

    def offloaded(dtype: str) -> None:
        pipe = load(dtype)
        plain = {m: spec.output(spec.call(pipe, m, device)) for m in spec.offload_methods}
        pipe.enable_model_cpu_offload(device=device)
        try:
            for m in spec.offload_methods:
                got = spec.output(spec.call(pipe, m, device))
                diff = _max_abs_diff(got, plain[m]) if isinstance(got, torch.Tensor) else None
                same = _compare(got, plain[m])[0]
                result["offload"].append({"dtype": dtype, "method": m, "identical": same, "max_abs_diff": diff})
                if not same:
                    result["problems"].append(f"offload changes {m} in {dtype}"
                                              + (f" (max abs diff {diff:.3g})" if diff is not None else ""))
        finally:
            pipe.remove_all_hooks()
            pipes.pop(dtype)  # hooks moved its modules: reload rather than trust their placement

    # what is judged first, so that a step cut short by its time limit loses the reported-only part
    exact = [d for d in dtypes if d == "float32"] if spec.greedy else []
    for dtype in exact:
        say(f"{name}: greedy identity in {dtype}")
        attempt(f"identity {dtype}", lambda d=dtype: identity(d))
    if offload:
        for dtype in dict.fromkeys(("float32", speed_dtype)):
            say(f"{name}: enable_model_cpu_offload in {dtype}")
            attempt(f"offload {dtype}", lambda d=dtype: offloaded(d))
    say(f"{name}: interleaved speed in {speed_dtype}")
    attempt("speed", speed)
    if spec.decodes and str(device).startswith("cuda"):
        say(f"{name}: host syncs per pass")
        attempt("syncs", syncs)
    if spec.compiles and compile_steps:
        say(f"{name}: interleaved speed with compiled steps in {speed_dtype}")
        attempt("compiled", compiled)
    for dtype in (d for d in dtypes if d not in exact and spec.greedy):
        say(f"{name}: greedy identity in {dtype}")
        attempt(f"identity {dtype}", lambda d=dtype: identity(d))
    return result


# -- command line ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """``[--out DIR] [--dry-run] [--budget S] [--steps ...] [--device D]``, and the hidden
    ``--pipeline NAME --json PATH``, ``--real-size`` and ``--real-size-wan`` of one step (the
    driver's child; ``--budget`` is then the real-size Wan row's own)."""
    p.add_argument("--out", default=None, help=f"report folder (default: $OUT when set, else {DEFAULT_OUT})")
    p.add_argument("--dry-run", action="store_true", help="every CUDA step reported as skipped")
    p.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                   help=f"seconds for all steps (default {BUDGET_SECONDS:.0f})")
    p.add_argument("--steps", nargs="+", choices=step_names(), default=None, help="run only these steps")
    p.add_argument("--device", default="cuda", help="the pipelines' device (default cuda)")
    p.add_argument("--pipeline", choices=pipeline_names(), default=None, help=argparse.SUPPRESS)
    p.add_argument("--real-size", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--real-size-wan", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vlm-heavy", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)


def cmd(args: argparse.Namespace) -> int:
    """Run the check (or, with ``--pipeline``, one pipeline step); exit status 1 when the report
    is incomplete, 0 otherwise (failed steps are in the report, not the status)."""
    from ..core.errors import check

    check(args.budget > 0, "--budget", "> 0 seconds", args.budget)
    if args.real_size:
        import torch

        from .real_size import row

        check(args.json is not None, "--json", "a path with --real-size", None)
        _write(Path(args.json), json.dumps(row(args.device, torch.bfloat16), indent=2, default=str) + "\n")
        return 0
    if args.real_size_wan:
        import torch

        from .real_size_wan import row

        check(args.json is not None, "--json", "a path with --real-size-wan", None)
        path = Path(args.json)

        def save(partial: dict) -> None:
            _write(path, json.dumps(partial, indent=2, default=str) + "\n")

        save(row(args.device, torch.bfloat16, budget_s=args.budget, record=save))
        return 0
    if args.vlm_heavy:
        from .vlm import VLMBenchConfig, run as run_vlm

        check(args.json is not None, "--json", "a path with --vlm-heavy", None)
        result = run_vlm(VLMBenchConfig(scenario="visual-heavy", prompts=VLM_HEAVY_PROMPTS, device=args.device),
                         progress=lambda m: print(m, flush=True))
        result["errors"] = [f"{r['method']}: greedy tokens differ from none's" for r in result["rows"]
                            if r.get("greedy_identical") is not True]
        _write(Path(args.json), json.dumps(result, indent=2, default=str) + "\n")
        return 0
    if args.pipeline is not None:
        check(args.json is not None, "--json", "a path with --pipeline", None)
        path = Path(args.json)

        def record(partial: dict) -> None:
            _write(path, json.dumps(partial, indent=2, default=str) + "\n")

        record(check_pipeline(args.pipeline, args.device, quick=args.quick, record=record,
                              progress=lambda m: print(m, flush=True)))
        return 0
    out = Path(args.out or os.environ.get("OUT") or DEFAULT_OUT)
    report = run(out, dry_run=args.dry_run, budget_s=args.budget, device=args.device,
                 steps=None if args.steps is None else tuple(args.steps))
    print(format_summary(report))
    print(f"report: {out / 'report.json'}, {out / 'summary.txt'}")
    if report.get("schema_problems"):
        print("the report is incomplete: " + "; ".join(report["schema_problems"]), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmspec.bench.gpu_check", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
