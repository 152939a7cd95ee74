"""``LoadMonitor``: a bench records how busy the machine was, and says so loudly when it was busy.

A busy loop started outside the test's process tree (an orphan of a shell that exits at once) must
be seen as competition, name its command and make the run busy; a busy child of the test is the
bench's own work and must not be counted. Every ``mmspec bench`` run carries the record in its JSON
``setup`` and prints the footer under its table."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mmspec import commands
from mmspec.bench import machine

BUSY = "import time; t = time.time() + 60\nwhile time.time() < t: pass\n"

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="needs Linux /proc")


def _orphan_busy_loop(tag: str) -> int:
    """A 60 s busy loop whose parent shell exits at once: it is re-parented outside our tree."""
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "# {tag}\n{BUSY}" >/dev/null 2>&1 & echo $!'],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_an_outside_busy_process_makes_the_run_busy():
    pid = _orphan_busy_loop("mmspec-load-monitor-test")
    try:
        time.sleep(0.3)
        with machine.LoadMonitor(interval=0.5, first_window=0.5) as mon:
            time.sleep(1.2)
        record = mon.record()
    finally:
        os.kill(pid, signal.SIGKILL)
    assert record["available"] and record["quiet"] is False
    assert record["samples"] >= 3 and record["competing_cores_max"] >= 0.5  # a whole core, minus sharing
    seen = [p for s in mon.samples[1:] for p in s.top if p["pid"] == pid]
    assert seen and all("mmspec-load-monitor-test" in p["command"] for p in seen)
    footer = "\n".join(mon.footer())
    assert "WARNING: the machine was BUSY" in footer
    assert len(record["loadavg_start"]) == 3 and record["cpus"] == os.cpu_count()


def test_the_bench_own_children_are_not_competition():
    child = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.3)
        with machine.LoadMonitor(interval=0.5, first_window=0.5) as mon:
            time.sleep(1.0)
    finally:
        child.kill()
        child.wait()
    listed = [p["pid"] for s in mon.samples for p in s.top]
    assert child.pid not in listed


def test_quiet_is_decided_by_the_busiest_sample():
    mon = machine.LoadMonitor()
    assert mon.quiet is None and mon.record() == {"available": False}
    mon.samples = [machine._Sample([0.5, 0.5, 0.5], 0.0), machine._Sample([1.0, 1.0, 1.0], 0.1)]
    assert mon.quiet is True and "machine: quiet" in mon.footer()[-1]
    mon.samples.append(machine._Sample([2.0, 1.0, 1.0], machine.BUSY_CORES))
    assert mon.quiet is False and mon.footer()[-1].startswith("WARNING")


def test_bench_json_and_footer_carry_the_record(tmp_path, capsys, monkeypatch):
    """``mmspec bench`` wraps any bench in the monitor: a stand-in bench keeps this test fast."""
    monkeypatch.setattr(commands.bench, "run_bench",
                        lambda args: ({"bench": "x", "setup": {"a": 1}, "rows": [{"method": "none"}]},
                                      [("method", "method")]))
    path = tmp_path / "b.json"
    assert commands.main(["bench", "core", "--json", str(path)]) == 0
    setup = json.loads(path.read_text())["setup"]
    assert setup["a"] == 1 and setup["machine"]["available"] and isinstance(setup["machine"]["quiet"], bool)
    out = capsys.readouterr().out
    assert "| none" in out and "machine: load average" in out
