"""``method="auto"``: the method and knobs a machine decodes fastest at a batch size, from a measured
cost profile and acceptance statistics, under a quality budget.

**The profile** (``CostProfile``; ``mmspec bench cost --calibrate`` writes it, ``mmspec.bench.cost.
calibrate``) holds, for one pipeline (its models' fingerprint) on one machine (CPU or GPU model,
threads, dtype): per candidate method (``CANDIDATES``) and batch size B (1, 2, 4, 8 by default) the
seconds of one decode pass ``pass_s[B]`` (target verify plus the draft passes, the loop's own work
included: the median over a call's passes) and of everything before the first pass ``prefill_s[B]``;
and at B = 1 each calibration prompt's decode passes ``passes`` and tokens per decode pass ``tau``,
with the call's new-token budget ``n``. It is a small JSON under ``cache_dir()`` (``MMSPEC_CACHE``,
else ``$XDG_CACHE_HOME/mmspec``, else ``~/.cache/mmspec``), named by ``profile_key``.

**The prediction** (``predict_seconds``): a static batch of B rows takes its slowest row's passes,
so a call's seconds are ``prefill_s[B] + pass_s[B] * E[max of B draws of a prompt's passes]`` (exact
over the empirical distribution of the calibration prompts: ``expected_max``; answer lengths and
acceptance both vary by prompt); B between calibrated sizes is interpolated linearly, past the
largest in proportion. ``predicted_x`` = ``none``'s seconds / the
method's.

**The choice** (``choose``): the candidate with the smallest predicted seconds among those the
pipeline holds the components for and the quality budget admits: ``"lossless"`` (default) admits
lossless methods only; ``"kept"`` also admits a lossy method whose quality the profile records as
kept (``quality``: from a ``mmspec bench ar-image --json`` file given to the calibration, where the
bench's own test, the permutation test against ``none``, has ``p_vs_none >= KEPT_P``); a method
other than ``none`` must be predicted at least ``MIN_GAIN`` (1.05x) faster than ``none``. Without a
profile for this pipeline and machine the choice is ``none``, and the reason says how to make one.
During the call ``mmspec.core.gate`` re-decides every ``auto_every`` passes from the call's own
acceptance (switching speculation off, and back on after a probe).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..core.errors import check, check_choice, check_int, is_int

QUALITY = ("lossless", "kept")
KEPT_P = 0.05  # the AR bench's permutation test against none: kept when p_vs_none >= this
BATCH_SIZES = (1, 2, 4, 8)
PROFILE_VERSION = 1

CANDIDATES: dict[str, tuple[tuple[str, str, dict], ...]] = {
    # (label, method, knobs): the fixed methods auto chooses among, per modality
    "ar-image": (
        ("none", "none", {}), ("sjd", "sjd", {}), ("sjd-w8", "sjd", {"sjd_window": 8}), ("mcsjd", "mcsjd", {}),
        ("medusa", "medusa", {}), ("eagle", "eagle", {}),
        ("eagle-small", "eagle", {"eagle_top_k": 2, "eagle_depth": 1, "eagle_total_tokens": 3}),
        ("sd", "sd", {}),
        # lossy: admitted under auto_quality="kept" when the quality record keeps them
        ("gsd", "gsd", {}), ("lantern", "lantern", {}), ("zipar", "zipar", {}), ("zipar+sjd", "zipar+sjd", {}),
    ),
    "vlm": (
        ("none", "none", {}), ("lookup", "lookup", {}), ("sd", "sd", {}), ("eagle", "eagle", {}),
        ("specvlm", "specvlm", {}), ("vispec", "vispec", {}), ("medusa", "medusa", {}),
    ),
    "continuous": (  # the mixture head's law (none's); path and none-diffusion sample the diffusion head's
        ("none", "none", {}), ("sd", "sd", {}), ("sd-warmup", "sd-warmup", {}), ("sjd", "sjd", {}),
        ("sjd-mc", "sjd-mc", {}), ("sjd-independent", "sjd-independent", {}),
    ),
}
MIN_GAIN = 1.05
"""A drafting method is chosen only when predicted at least this much faster than ``none``: pass
costs on the project's CPU move between calibration and use (``docs/costs.md``: identical calls 8%
apart in an A/A check, 30-40% call to call at worst), and at a near-tie the target alone is the
safe side of the error (issue 46: never 3% below it)."""

AUTO_KNOBS = {
    "auto_quality": "'lossless' (default) or 'kept'",
    "auto_every": "an int >= 1: passes between re-decisions during the call (default 16)",
    "auto_online": "True (default) or False: re-decide during the call",
    "auto_batch_size": "None (default: the call's) or an int >= 1: the batch size to choose for",
}


def modalities() -> tuple[str, ...]:
    return tuple(CANDIDATES)


def check_auto_knobs(modality: str, knobs: Mapping[str, Any] | None) -> dict:
    """``method_knobs`` of ``method="auto"``: only ``AUTO_KNOBS``, checked; returns them with defaults."""
    check(modality in CANDIDATES, "method", "a named method or composition ('auto' chooses among the methods of "
          + ", ".join(CANDIDATES) + ")", f"'auto' for {modality}")
    knobs = dict(knobs or {})
    unknown = sorted(set(knobs) - set(AUTO_KNOBS))
    check(not unknown, "method_knobs", "for method='auto' among " + ", ".join(AUTO_KNOBS), unknown)
    out = {"auto_quality": "lossless", "auto_every": 16, "auto_online": True, "auto_batch_size": None, **knobs}
    check_choice("auto_quality", out["auto_quality"], QUALITY)
    every = out["auto_every"]
    check_int(every, "auto_every", 1)
    check(isinstance(out["auto_online"], bool), "auto_online", "True or False", out["auto_online"])
    b = out["auto_batch_size"]
    check_int(b, "auto_batch_size", 1, optional=True)
    return out


# ---------------------------------------------------------------- where profiles live

def cache_dir() -> Path:
    """``$MMSPEC_CACHE``, else ``$XDG_CACHE_HOME/mmspec``, else ``~/.cache/mmspec``."""
    if os.environ.get("MMSPEC_CACHE"):
        return Path(os.environ["MMSPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmspec"


def machine_id(device: str = "cpu", threads: int | None = None) -> str:
    """What sets a pass's cost besides the model: the processor (CPU model, or the CUDA device's
    name) and the torch threads, e.g. ``"x86_64 AMD EPYC 7B13 threads=1"``."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"cuda {torch.cuda.get_device_name(torch.device(device))}"
    threads = torch.get_num_threads() if threads is None else threads
    return f"{platform.machine()} {_cpu_name()} threads={threads}"


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (read once: a pipeline asks at every call), else the
    architecture (``platform.processor()`` would start a subprocess on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def fingerprint(configs: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the pipeline's component configs (``{name: config dict}``), keys sorted."""
    text = json.dumps(configs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def profile_key(modality: str, model_hash: str, machine: str, dtype: str) -> str:
    """The profile's file name: modality, model hash, a hash of the machine and the dtype."""
    m = hashlib.sha256(machine.encode()).hexdigest()[:12]
    return f"{modality}-{model_hash[:12]}-{m}-{dtype}.json"


# ---------------------------------------------------------------- the profile

@dataclass
class Row:
    """One candidate's measurements: ``pass_s`` / ``prefill_s`` by batch size; per calibration
    prompt at B = 1 its decode ``passes`` (after the prefill) and ``tau`` (tokens per decode pass);
    ``n`` the call's new-token budget; ``lossless``."""

    label: str
    method: str
    knobs: dict
    lossless: bool
    pass_s: dict[int, float]
    prefill_s: dict[int, float]
    passes: list[float]
    tau: list[float]
    n: int

    def to_json(self) -> dict:
        return {"label": self.label, "method": self.method, "knobs": self.knobs, "lossless": self.lossless,
                "pass_s": {str(b): s for b, s in self.pass_s.items()},
                "prefill_s": {str(b): s for b, s in self.prefill_s.items()}, "passes": self.passes,
                "tau": self.tau, "n": self.n}

    @classmethod
    def from_json(cls, d: Mapping) -> "Row":
        check(isinstance(d, Mapping) and all(k in d for k in ("label", "method", "lossless")), "profile row",
              "an object with label, method, lossless, pass_s, prefill_s, passes, tau, n", d)
        name = f"profile row {d.get('label')!r}"

        def by_batch(x, key):
            allowed = "an object {batch size: seconds > 0}"
            check(isinstance(x, Mapping) and len(x) > 0, f"{name} {key}", allowed, x)
            out = {}
            for b, s in x.items():
                ok = str(b).isdigit() and int(b) >= 1 and isinstance(s, (int, float)) and not isinstance(s, bool)
                check(ok and s > 0, f"{name} {key}", allowed, {b: s})
                out[int(b)] = float(s)
            return dict(sorted(out.items()))

        def numbers(x, key, low):
            check(isinstance(x, list) and len(x) > 0 and all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                                             and t >= low for t in x),
                  f"{name} {key}", f"a non-empty list of numbers >= {low}", x)
            return [float(t) for t in x]

        n = d.get("n")
        check(is_int(n) and n >= 1, f"{name} n", "an int >= 1", n)
        passes, tau = numbers(d.get("passes"), "passes", 0), numbers(d.get("tau"), "tau", 1)
        check(len(passes) == len(tau), f"{name} passes", f"one entry per prompt, as tau ({len(tau)})", passes)
        return cls(str(d["label"]), str(d["method"]), dict(d.get("knobs") or {}), bool(d["lossless"]),
                   by_batch(d.get("pass_s"), "pass_s"), by_batch(d.get("prefill_s"), "prefill_s"), passes, tau, n)


@dataclass
class CostProfile:
    """A machine's measured costs for one pipeline (see the module docstring)."""

    modality: str
    model_hash: str
    machine: str
    dtype: str
    rows: dict[str, Row]
    quality: dict[str, dict] = field(default_factory=dict)  # label -> {"kept": bool, "p_vs_none": ..., ...}
    setup: dict = field(default_factory=dict)
    path: str | None = None

    @property
    def key(self) -> str:
        return profile_key(self.modality, self.model_hash, self.machine, self.dtype)

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "modality": self.modality, "model_hash": self.model_hash,
                "machine": self.machine, "dtype": self.dtype, "setup": self.setup, "quality": self.quality,
                "rows": [r.to_json() for r in self.rows.values()]}

    @classmethod
    def from_json(cls, d: Mapping, path: str | None = None) -> "CostProfile":
        check(isinstance(d, Mapping) and d.get("version") == PROFILE_VERSION, "profile",
              f"a cost profile of version {PROFILE_VERSION} (mmspec bench cost --calibrate)",
              d.get("version") if isinstance(d, Mapping) else type(d).__name__)
        for key in ("modality", "model_hash", "machine", "dtype"):
            check(isinstance(d.get(key), str) and d[key] != "", f"profile {key}", "a non-empty string", d.get(key))
        rows = [Row.from_json(r) for r in d.get("rows") or []]
        check(any(r.method == "none" for r in rows), "profile rows", "a 'none' row (the baseline)",
              [r.label for r in rows])
        return cls(d["modality"], d["model_hash"], d["machine"], d["dtype"], {r.label: r for r in rows},
                   dict(d.get("quality") or {}), dict(d.get("setup") or {}), path)

    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the profile (to ``cache_dir() / "profiles" / key`` by default) whole: a temporary
        file renamed into place."""
        from ..utils.atomic import atomic_path

        path = Path(path) if path is not None else cache_dir() / "profiles" / self.key
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(self.to_json(), indent=1))
        self.path = str(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostProfile":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"profile must be a readable JSON file, got {str(path)!r} ({err})") from None
        return cls.from_json(data, str(path))


def find_profile(modality: str, model_hash: str, machine: str, dtype: str) -> CostProfile | None:
    """This pipeline's profile on this machine from ``cache_dir()``, or None. A file is read once
    and again only when it changes (its modification time and size)."""
    path = cache_dir() / "profiles" / profile_key(modality, model_hash, machine, dtype)
    try:
        st = path.stat()
    except OSError:
        return None
    return _load_cached(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> CostProfile:
    return CostProfile.load(path)


# ---------------------------------------------------------------- prediction

def expected_max(values: Iterable[float], k: int) -> float:
    """E[max of k independent draws] from the empirical distribution of ``values`` (exact:
    ``sum_i x_(i) ((i/n)^k - ((i-1)/n)^k)`` over the sorted values)."""
    xs = sorted(values)
    n = len(xs)
    check(n > 0 and k >= 1, "values", "a non-empty list and k >= 1", (n, k))
    return sum(x * ((i / n) ** k - ((i - 1) / n) ** k) for i, x in enumerate(xs, start=1))


def at_batch(points: Mapping[int, float], b: int) -> float:
    """A per-pass cost at batch size ``b``: linear between calibrated sizes, the smallest's below
    them, and past the largest in proportion to ``b``."""
    xs = sorted(points)
    if b <= xs[0]:
        return points[xs[0]]
    if b >= xs[-1]:
        return points[xs[-1]] * b / xs[-1]
    for lo, hi in zip(xs, xs[1:]):
        if lo <= b <= hi:
            return points[lo] + (b - lo) / (hi - lo) * (points[hi] - points[lo])
    raise AssertionError("unreachable")


def predict_seconds(row: Row, b: int, n: int | None = None) -> float:
    """Predicted seconds of a static batch of ``b`` rows: ``prefill_s[b] + pass_s[b] * E[max of b
    draws of a prompt's decode passes]``, the passes scaled by ``(n - 1) / (row.n - 1)`` when the
    call's new-token budget ``n`` differs from the calibration's."""
    scale = 1.0 if n is None or row.n <= 1 else max(0, n - 1) / (row.n - 1)
    return at_batch(row.prefill_s, b) + at_batch(row.pass_s, b) * expected_max(row.passes, b) * scale


@dataclass
class Choice:
    """What ``choose`` picked: the candidate ``label`` (its ``method`` and ``knobs``), its
    predicted speed-up over ``none`` at ``batch_size``, the table it chose from (label ->
    predicted_x) and the reason in words."""

    label: str
    method: str
    knobs: dict
    batch_size: int
    predicted_x: float
    table: dict[str, float]
    reason: str
    quality: str
    row: Row | None = None
    base: Row | None = None

    def gate_settings(self) -> dict | None:
        """``mmspec.core.gate.SpeedGate``'s ``c_on`` / ``c_off`` (seconds per pass with and without
        the drafter at the batch size) and ``prior_tau`` (the calibration's tokens per pass, the
        harmonic mean over its prompts); None when nothing is drafted."""
        if self.row is None or self.base is None or self.method == "none":
            return None
        prior = len(self.row.tau) / sum(1.0 / t for t in self.row.tau)
        b = self.batch_size
        return {"c_on": at_batch(self.row.pass_s, b), "c_off": at_batch(self.base.pass_s, b), "prior_tau": prior}


def admitted(profile: CostProfile, row: Row, quality: str) -> bool:
    if row.lossless:
        return True
    return quality == "kept" and bool(profile.quality.get(row.label, {}).get("kept", False))


def choose(profile: CostProfile | None, batch_size: int, quality: str = "lossless",
           available: Iterable[str] | None = None, n: int | None = None, hint: str = "") -> Choice:
    """The fastest admitted candidate at ``batch_size`` (see the module docstring). ``available``:
    the labels the pipeline can run (its components); None: every row. ``hint``: how to make a
    profile, quoted when there is none."""
    check_choice("auto_quality", quality, QUALITY)
    if profile is None:
        return Choice("none", "none", {}, batch_size, 1.0, {}, "auto chose none: no cost profile for this pipeline "
                      f"on this machine{hint}", quality)
    base = next(r for r in profile.rows.values() if r.method == "none")
    allowed = None if available is None else set(available)
    table, skipped = {}, []
    for label, row in profile.rows.items():
        if allowed is not None and label not in allowed:
            skipped.append(f"{label} (not in this pipeline)")
            continue
        if not admitted(profile, row, quality):
            skipped.append(f"{label} (lossy, quality not recorded as kept)" if quality == "kept"
                           else f"{label} (lossy)")
            continue
        table[label] = predict_seconds(base, batch_size, n) / predict_seconds(row, batch_size, n)
    # drafting must be predicted to gain MIN_GAIN over none: a near-tie is noise in the pass costs
    fast = {k: x for k, x in table.items() if k == "none" or x >= MIN_GAIN}
    best = max(fast, key=lambda k: (fast[k], k == "none"))  # ties go to none
    row = profile.rows[best]
    knobs = " ".join(f"{k}={v}" for k, v in row.knobs.items())
    runner_up = sorted(((x, k) for k, x in table.items() if k != best), reverse=True)[:2]
    others = ", ".join(f"{k} {x:.2f}x" for x, k in runner_up)
    unruled = max(table, key=lambda k: (table[k], k == "none"))
    margin = f" (drafting must be predicted >= {MIN_GAIN:.2f}x)" if unruled != best else ""
    reason = (f"auto chose {best}{' (' + knobs + ')' if knobs else ''}: predicted {table[best]:.2f}x at "
              f"B={batch_size}" + (f"; next {others}" if others else "") + margin + f" [{quality}]")
    return Choice(best, row.method, dict(row.knobs), batch_size, table[best], table, reason, quality, row, base)


# ---------------------------------------------------------------- for callers that take method names

def method_names(modality: str, names: Iterable[str]) -> tuple[str, ...]:
    """``names`` (a modality's methods) with ``"auto"`` first where the modality has candidates."""
    names = tuple(names)
    return (("auto",) + names) if modality in CANDIDATES else names


def knob_specs(modality: str) -> dict[str, Any]:
    """``{knob: KnobSpec}`` of ``method="auto"``'s own knobs (``AUTO_KNOBS``)."""
    from .knobs import KnobSpec

    check(modality in CANDIDATES, "method", "a method of " + modality, "auto")
    return {
        "auto_quality": KnobSpec("auto_quality", str, "lossless", AUTO_KNOBS["auto_quality"], choices=QUALITY),
        "auto_every": KnobSpec("auto_every", int, 16, AUTO_KNOBS["auto_every"], min=1),
        "auto_online": KnobSpec("auto_online", bool, True, AUTO_KNOBS["auto_online"]),
        "auto_batch_size": KnobSpec("auto_batch_size", int, None, AUTO_KNOBS["auto_batch_size"], min=1,
                                    optional=True),
    }


def candidate_recipe(modality: str, label: str):
    """The recipe of ``CANDIDATES[modality]``'s entry ``label`` (what ``stats["auto_method"]`` names)."""
    for name, method, knobs in CANDIDATES[modality]:
        if name == label:
            return recipe(modality, method, knobs)
    check(False, "label", f"a candidate of {modality}: " + ", ".join(c[0] for c in CANDIDATES[modality]), label)


def recipe(modality: str, method: str, knobs: Mapping[str, Any]):
    """``mmspec.methods.resolve`` of a profile row's method, kept (a pipeline asks at every call)."""
    return _recipe(modality, method, json.dumps(dict(knobs), sort_keys=True))


@functools.lru_cache(maxsize=256)
def _recipe(modality: str, method: str, knobs: str):
    from .registry import resolve

    return resolve(modality, method, json.loads(knobs))


def validate(modality: str, method: str, knobs: Mapping[str, Any] | None = None):
    """``method`` and its knobs checked as the registry checks them (``ValueError`` naming what is
    wrong): ``"auto"`` (where the modality has candidates) with its own knobs -> None; any other
    method -> its ``MethodRecipe`` (``mmspec.methods.resolve``)."""
    from .registry import resolve

    if method == "auto" and modality in CANDIDATES:
        check_auto_knobs(modality, knobs)
        return None
    return resolve(modality, method, knobs)
