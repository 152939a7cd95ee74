"""``mmspec bench serve``: a queue of mixed-length VLM requests replayed at several arrival rates,
served with static batches or continuous batching, by a fixed method or ``method="auto"``.

**The queue.** ``jobs`` held-out scenes (``SceneQADataset`` on the held-out seed, half of them
description questions answered in 40-70 tokens, half short questions answered in a few), greedy,
``max_new_tokens`` 64, job i with seed i. Every run serves the same queue.

**Arrivals.** A Poisson process (numpy ``default_rng(arrival_seed)``) at each rate in ``loads``,
given as fractions of the machine's capacity (the jobs per second of the first run: static
batches of ``none`` with every job waiting at time 0), plus ``burst`` (every job at time 0: the
throughput a backlog gets). Time is a virtual clock driven by real work: the server never sleeps;
when it is idle and nothing has arrived the clock jumps to the next arrival, and otherwise it
advances by the measured wall time of the work it does. A job's latency is its finish time minus
its arrival.

**Policies.** ``static``: when the server is free it takes up to ``batch_size`` waiting jobs into
one pipeline call (what ``mmspec batch`` does), and a finished row waits for its batch's slowest.
``continuous``: ``batch_size`` rows decode together and a finished row's slot takes the next
waiting job's prefill while the others keep decoding (``mmspec.serve.slots``).

**Runs.** After a warm-up (every policy and method serving the first ``2 * batch_size`` jobs at
once), each (load, policy, method) is run ``rounds`` times, rounds outer and runs interleaved.

**Figures per row:** jobs per minute over the makespan (first arrival to last finish; the mean over
rounds), p50 / p95 latency (every round's jobs pooled), the mean batch occupancy (static: rows per
call; continuous: rows decoding when each job ends), the process's CPU use (CPU seconds / wall
seconds, so at most the torch threads; a GPU's utilisation where ``torch.cuda.utilization``
answers), and whether every answer equals the first run's (greedy: they must).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..core.errors import check, check_choice, check_int


@dataclass
class ServeBenchConfig:
    jobs: int = 32
    loads: tuple = ("burst", 0.5, 0.9)  # fractions of capacity, and "burst"
    policies: tuple = ("static", "continuous")
    methods: tuple = ("none", "medusa", "auto")
    batch_size: int = 4  # static batches; continuous slots
    rounds: int = 2  # runs of each (load, policy, method), interleaved
    max_new_tokens: int = 64
    describe_prob: float = 0.5
    arrival_seed: int = 0

    @classmethod
    def quick(cls, **kw) -> "ServeBenchConfig":
        return cls(**{"jobs": 12, "loads": ("burst",), "rounds": 1, **kw})

    def check(self) -> None:
        check_int(self.jobs, "jobs", 2)
        for load in self.loads:
            check(load == "burst" or (isinstance(load, (int, float)) and 0 < load <= 4), "loads",
                  "'burst' or fractions of capacity in (0, 4]", self.loads)
        for p in self.policies:
            check_choice("policies", p, ("static", "continuous"))
        check_int(self.batch_size, "batch_size", 1)
        check_int(self.rounds, "rounds", 1)


@dataclass
class Job:
    index: int
    image: np.ndarray
    question: str
    arrival: float = 0.0


@dataclass
class Served:
    """A run's outcome: per job its answer tokens and finish time (virtual seconds), the rows each
    pass or call held, and the process's CPU seconds and wall seconds."""

    tokens: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)
    occupancy: list = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    stats: list = field(default_factory=list)


def queue(cfg: ServeBenchConfig) -> list[Job]:
    from ..training.data.scene_qa import SceneQADataset
    from ..training.recipes.common import heldout_seed

    data = SceneQADataset(cfg.jobs, heldout_seed(0), describe_prob=cfg.describe_prob)
    jobs = []
    for i in range(cfg.jobs):
        image, question, _ = data[i]
        pixels = ((image.permute(1, 2, 0) + 1) / 2).clamp(0, 1).mul(255).round().byte().numpy()
        jobs.append(Job(i, pixels, question))
    return jobs


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """``n`` arrival times: all 0 for ``rate`` None (burst), else a Poisson process at ``rate`` per second."""
    if rate is None:
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]


def serve_static(models, jobs: list[Job], method: str, cfg: ServeBenchConfig) -> Served:
    """Static batches on a virtual clock (see the module docstring)."""
    from .. import serve

    out, clock = Served(), 0.0
    pending = sorted(jobs, key=lambda j: (j.arrival, j.index))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while pending:
        waiting = [j for j in pending if j.arrival <= clock]
        if not waiting:
            clock = pending[0].arrival
            continue
        batch = waiting[: cfg.batch_size]
        t0 = time.perf_counter()
        results = serve.run_vlm(models, [j.image for j in batch], [j.question for j in batch],
                                [j.index for j in batch], method, {}, max_new_tokens=cfg.max_new_tokens)
        clock += time.perf_counter() - t0
        out.occupancy.append(len(batch))
        out.stats.append(results[0].stats)
        for j, r in zip(batch, results):
            out.tokens[j.index], out.finish[j.index] = r.tokens, clock
        done = {j.index for j in batch}
        pending = [j for j in pending if j.index not in done]
    out.cpu_s, out.wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return out


def serve_continuous(models, jobs: list[Job], method: str, cfg: ServeBenchConfig) -> Served:
    """Continuous batching (``mmspec.serve.slots``) on the same virtual clock: jobs enter in
    arrival order when a row is free and they have arrived (``admit``); an idle server jumps the
    clock to the next arrival. Occupancy: the rows decoding at each admission check."""
    from .. import serve

    out = Served()
    order = sorted(jobs, key=lambda j: (j.arrival, j.index))
    real0 = time.perf_counter()
    offset = 0.0  # virtual = real elapsed + offset (the jumps of an idle server)
    active = [0]

    def now() -> float:
        return time.perf_counter() - real0 + offset

    def admit(j: int, idle: bool) -> bool:
        nonlocal offset
        t = now()
        if order[j].arrival > t:
            if not idle:
                return False
            offset += order[j].arrival - t  # nothing to decode: wait for it
        active[0] += 1
        return True

    cpu0 = time.process_time()
    results = serve.run_vlm_continuous(models, [j.image for j in order], [j.question for j in order],
                                       [j.index for j in order], method, {}, max_new_tokens=cfg.max_new_tokens,
                                       slots=cfg.batch_size, admit=admit)
    for i, result in results:
        job = order[i]
        out.tokens[job.index], out.finish[job.index] = result.tokens, now()
        out.occupancy.append(active[0])
        active[0] -= 1
        out.stats.append(result.stats)
    out.cpu_s, out.wall_s = time.process_time() - cpu0, time.perf_counter() - real0
    return out


POLICIES: dict[str, Callable] = {"static": serve_static, "continuous": serve_continuous}
"""How a policy serves a queue: ``fn(models, jobs, method, cfg) -> Served``."""


def _figures(jobs: list[Job], runs: list[Served], reference: dict | None) -> dict:
    """A row's figures over its ``runs`` (rounds of the same queue): jobs per minute and makespan
    averaged, latencies pooled for the percentiles."""
    lat = [r.finish[j.index] - j.arrival for r in runs for j in jobs]
    spans = [max(r.finish.values()) - min(j.arrival for j in jobs) for r in runs]
    gpu = None
    if torch.cuda.is_available():
        try:
            gpu = torch.cuda.utilization()
        except Exception:  # pynvml missing: not available
            gpu = None
    cpu, wall = sum(r.cpu_s for r in runs), sum(r.wall_s for r in runs)
    return {"jobs_per_min": round(statistics.fmean(60 * len(jobs) / m for m in spans), 2),
            "p50_s": round(float(np.percentile(lat, 50)), 3), "p95_s": round(float(np.percentile(lat, 95)), 3),
            "makespan_s": round(statistics.fmean(spans), 3),
            "occupancy": round(statistics.fmean(o for r in runs for o in r.occupancy), 2),
            "cpu_cores": round(cpu / wall, 2) if wall else None, "gpu_util": gpu,
            "identical": None if reference is None else all(r.tokens[i] == reference[i] for r in runs
                                                            for i in reference)}


@torch.no_grad()
def run(cfg: ServeBenchConfig, progress=None, models=None) -> dict:
    from .. import serve

    cfg.check()
    say = progress or (lambda msg: None)
    models = models or serve.Models()
    jobs = queue(cfg)
    policies = [p for p in cfg.policies if p in POLICIES]
    warm = jobs[: 2 * cfg.batch_size]
    for policy in policies:  # warm every policy and method on a short burst
        for method in cfg.methods:
            POLICIES[policy](models, warm, method, cfg)
    say("capacity: static none, every job waiting at 0")
    base = serve_static(models, jobs, "none", cfg)
    capacity = len(jobs) / max(base.finish.values())
    reference = base.tokens
    rows = []
    for load in cfg.loads:
        rate = None if load == "burst" else load * capacity
        times = arrivals(len(jobs), rate, cfg.arrival_seed)
        queued = [Job(j.index, j.image, j.question, t) for j, t in zip(jobs, times)]
        runs = {(p, m): [] for p in policies for m in cfg.methods}
        for r in range(cfg.rounds):  # rounds outer, runs interleaved inside
            for policy in policies:
                for method in cfg.methods:
                    served = POLICIES[policy](models, queued, method, cfg)
                    runs[policy, method].append(served)
                    say(f"load {load} round {r + 1}/{cfg.rounds} {policy} {method}: "
                        f"{60 * len(jobs) / (max(served.finish.values()) - times[0]):.1f} jobs/min")
        for (policy, method), done in runs.items():
            row = {"load": load if load == "burst" else f"{load:g}x", "rate_per_s": None if rate is None
                   else round(rate, 3), "policy": policy, "method": method, **_figures(queued, done, reference)}
            chosen = sorted({s["auto_method"] for d in done for s in d.stats if "auto_method" in s})
            if chosen:
                row["auto_chose"] = "/".join(chosen)
            rows.append(row)
    for row in rows:  # continuous over static, same load and method
        twin = next((r for r in rows if r["load"] == row["load"] and r["method"] == row["method"]
                     and r["policy"] == "static"), None)
        row["x_static"] = round(row["jobs_per_min"] / twin["jobs_per_min"], 3) if twin else None
    setup = {"jobs": cfg.jobs, "loads": list(cfg.loads), "rounds": cfg.rounds, "policies": policies,
             "methods": list(cfg.methods), "batch_size": cfg.batch_size, "max_new_tokens": cfg.max_new_tokens,
             "describe_prob": cfg.describe_prob, "arrival_seed": cfg.arrival_seed,
             "capacity_jobs_per_s": round(capacity, 3), "threads": torch.get_num_threads(),
             "answer_tokens": {"mean": statistics.fmean(len(t) for t in reference.values()),
                               "min": min(len(t) for t in reference.values()),
                               "max": max(len(t) for t in reference.values())}}
    return {"bench": "serve", "setup": setup, "rows": rows}


SERVE_COLUMNS = [("load", "load"), ("policy", "policy"), ("method", "method"), ("auto_chose", "auto chose"),
                 ("jobs_per_min", "jobs/min"), ("x_static", "x static"), ("p50_s", "p50 s"), ("p95_s", "p95 s"),
                 ("occupancy", "rows"), ("cpu_cores", "CPU cores"), ("identical", "identical")]
