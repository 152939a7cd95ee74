"""How quiet the machine was while a bench ran: load averages and competing processes.

Wall-clock ratios taken beside other CPU work are not honest here: contention slows the one-token
target-only loop more than wide verifies, so a busy machine flatters speculation. ``LoadMonitor``
samples ``/proc`` at the start, every ``interval`` seconds while the bench runs, and at the end;
"competing" CPU is what processes outside the bench's own process tree used between two samples, in
cores. A run is ``quiet`` when no sample saw competing processes use ``BUSY_CORES`` or more.
Linux only (``/proc``); elsewhere the record says ``available: False``.

And what a bench's process holds: ``rss_mb`` (its resident set now) and ``trim_heap`` (glibc's
``malloc_trim(0)``: the heap's free pages back to the OS, so the resident set reads live memory).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

BUSY_CORES = 0.25  # a competing job that holds a quarter of a core for a sample makes the run busy
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_ticks() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, utime + stime ticks, command name) for every process we can read."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # the process ended between listdir and open
            continue
        # the command is in parentheses and may hold spaces: split after the last ')'
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2:].split()
        out[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]), comm)
    return out


def _own_tree(ticks: dict[int, tuple[int, int, str]]) -> set[int]:
    """This process and its descendants (a bench's worker processes are not competition)."""
    own, grew = {os.getpid()}, True
    while grew:
        grew = False
        for pid, (ppid, _, _) in ticks.items():
            if ppid in own and pid not in own:
                own.add(pid)
                grew = True
    return own


def _cmdline(pid: int, comm: str, limit: int = 80) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        text = ""
    text = " ".join(text.split()) or comm
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


@dataclass
class _Sample:
    loadavg: list[float]
    competing_cores: float
    top: list[dict] = field(default_factory=list)


class LoadMonitor:
    """``with LoadMonitor() as mon: run()``; then ``mon.record()`` (a JSON-ready dict) and
    ``mon.footer()`` (lines for the table's footer, a loud warning when the run was busy)."""

    def __init__(self, interval: float = 15.0, first_window: float = 1.0):
        self.interval, self.first_window = interval, first_window
        self.available = os.path.exists("/proc/loadavg") and os.path.isdir("/proc/self")
        self.samples: list[_Sample] = []
        self._prev: tuple[float, dict] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now, ticks = time.monotonic(), _cpu_ticks()
        prev_t, prev = self._prev
        own, dt = _own_tree(ticks), max(now - prev_t, 1e-6)
        used = []
        for pid, (_, cpu, comm) in ticks.items():
            if pid in own or pid not in prev:
                continue
            cores = (cpu - prev[pid][1]) / _TICK / dt
            if cores > 0.01:
                used.append((cores, pid, comm))
        used.sort(reverse=True)
        self.samples.append(_Sample(_loadavg(), sum(c for c, _, _ in used),
                                    [{"pid": pid, "cores": round(c, 2), "command": _cmdline(pid, comm)}
                                     for c, pid, comm in used[:5]]))
        self._prev = (now, ticks)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> LoadMonitor:
        if self.available:
            self._prev = (time.monotonic(), _cpu_ticks())
            time.sleep(self.first_window)  # a CPU share needs two readings
            self._sample()
            self._thread = threading.Thread(target=self._run, daemon=True, name="mmspec-load-monitor")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    @property
    def quiet(self) -> bool | None:
        if not self.samples:
            return None
        return max(s.competing_cores for s in self.samples) < BUSY_CORES

    def record(self) -> dict:
        if not self.samples:
            return {"available": False}
        first, last = self.samples[0], self.samples[-1]
        worst = max(self.samples, key=lambda s: s.competing_cores)
        return {"available": True, "quiet": self.quiet, "busy_threshold_cores": BUSY_CORES,
                "cpus": os.cpu_count(), "samples": len(self.samples), "interval_s": self.interval,
                "loadavg_start": first.loadavg, "loadavg_end": last.loadavg,
                "competing_cores_start": round(first.competing_cores, 2),
                "competing_cores_end": round(last.competing_cores, 2),
                "competing_cores_max": round(worst.competing_cores, 2),
                "competing_cores_mean": round(sum(s.competing_cores for s in self.samples) / len(self.samples), 2),
                "competing_start": first.top, "competing_end": last.top, "competing_at_max": worst.top}

    def footer(self) -> list[str]:
        r = self.record()
        if not r["available"]:
            return ["machine: load not recorded (no /proc here)"]
        lines = [f"machine: load average {r['loadavg_start'][0]:.2f} at start, {r['loadavg_end'][0]:.2f} at end "
                 f"({r['cpus']} CPUs); competing processes used {r['competing_cores_start']:.2f} cores at start, "
                 f"{r['competing_cores_end']:.2f} at end, at most {r['competing_cores_max']:.2f} over "
                 f"{r['samples']} samples"]
        if r["quiet"]:
            lines.append("machine: quiet (no competing process held a quarter of a core)")
        else:
            names = "; ".join(f"{p['command']} ({p['cores']:.2f} cores)" for p in r["competing_at_max"][:3])
            lines.append("WARNING: the machine was BUSY during this bench: wall-clock figures are not trustworthy "
                         "(contention slows the one-token baseline more than wide verifies and flatters "
                         f"speculation); NFE, tau and quality figures are unaffected. Busiest: {names}")
        return lines


__all__ = ["BUSY_CORES", "LoadMonitor"]


# -- resident memory -----------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def trim_heap() -> bool:
    """Hand the C heap's free memory back to the OS (glibc's ``malloc_trim(0)``), so the RSS
    reads live memory rather than what earlier work freed; False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def rss_mb() -> float:
    """This process's resident set size in MB (``/proc/self/statm``; the peak from
    ``resource.getrusage`` where there is no /proc, which only grows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return peak_rss_mb() or 0.0


def peak_rss_mb() -> float | None:
    """This process's peak resident set size in MB (``resource.getrusage``), None where the
    platform has no ``resource`` module."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024
    except (ImportError, OSError):
        return None
