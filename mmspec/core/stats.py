"""Decoding statistics, returned in every output object (never printed by library code)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

PHASES = ("prefill", "draft", "verify", "accept", "commit")


@dataclass
class Stats:
    """Counters of one ``generate`` call.

    ``target_forwards`` is the NFE: target passes including the prefill (the whole batch shares
    each pass). ``tau`` is the mean number of tokens a decode pass emits per row, *counting the
    target's bonus/correction token* (EAGLE's convention; target-only decoding has tau = 1).

    ``wall_seconds`` is the whole call's wall time, always measured (two clock reads and one
    device sync at the end). ``seconds`` holds wall time per phase (``PHASES``) only when the
    call was profiled (``generate(..., profile=True)``), which synchronises the device after every
    phase of every pass; otherwise it is ``None`` and ``as_dict()`` has no ``"seconds"`` key.

    Continuous tokens add ``heads`` (``{"target": HeadMeter, "draft": HeadMeter}``: head calls and
    rows, residual draws, tries and cap fallbacks) and the per-token acceptance ``alpha``
    (accepted drafts / accept tests; a chain stops testing at its first rejection); ``as_dict()``
    then has those keys too.
    """

    target_forwards: int = 0
    draft_forwards: int = 0
    profile: bool = False
    seconds: dict | None = None
    wall_seconds: float = 0.0
    heads: dict | None = None
    accept_tests: int = 0
    accepted: int = 0
    _emitted: list = field(default_factory=list)  # per decode pass: (B,) tokens emitted, 0 if done
    extra: dict = field(default_factory=dict)  # the caller's annotations (a pipeline's method="auto" choice)

    def __post_init__(self):
        if self.profile and self.seconds is None:
            self.seconds = dict.fromkeys(PHASES, 0.0)

    def timed(self, phase: str, device: torch.device | None = None):
        """A context timing ``phase`` when profiling (device synced at its end); a no-op otherwise."""
        return self._timed(phase, device) if self.profile else nullcontext()

    @contextmanager
    def _timed(self, phase: str, device: torch.device | None):
        start = time.perf_counter()
        yield
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds[phase] += time.perf_counter() - start

    def record_step(self, emitted: torch.Tensor) -> None:
        self._emitted.append(emitted)

    def record_tests(self, drafted: int, accepted: torch.Tensor) -> None:
        """A chain of ``drafted`` tokens verified in each row; ``accepted`` (n,) prefix lengths."""
        if drafted > 0:
            self.accept_tests += int((accepted + 1).clamp(max=drafted).sum())
            self.accepted += int(accepted.sum())

    @property
    def alpha(self) -> float:
        """Per-token acceptance: accepted drafts / accept tests (NaN before any test)."""
        return self.accepted / self.accept_tests if self.accept_tests else float("nan")

    @property
    def decode_steps(self) -> int:
        return len(self._emitted)

    @property
    def accept_lengths(self) -> torch.Tensor:
        """(steps, B) tokens emitted per row per pass (0 once a row is done)."""
        if not self._emitted:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.stack(self._emitted).cpu()

    @property
    def nfe_per_sample(self) -> float:
        """Target passes each row needed until it finished (prefill included), averaged over rows.

        ``target_forwards`` counts the batch's passes, which run until the slowest row is done."""
        a = self.accept_lengths
        if a.numel() == 0:
            return float(self.target_forwards)
        return float(((a > 0).sum(0) + 1).float().mean())

    @property
    def tau(self) -> float:
        a = self.accept_lengths
        live = a > 0
        return float(a[live].float().mean()) if live.any() else 0.0

    def as_dict(self) -> dict:
        return {
            "nfe": self.target_forwards,
            "nfe_per_sample": self.nfe_per_sample,
            "draft_nfe": self.draft_forwards,
            "decode_steps": self.decode_steps,
            "tau": self.tau,
            "wall_seconds": self.wall_seconds,
            **({} if self.seconds is None else {"seconds": dict(self.seconds)}),
            **({} if self.heads is None else self._head_dict()),
            **self.extra,
        }

    def _head_dict(self) -> dict:
        t, d = self.heads["target"], self.heads["draft"]
        return {"alpha": self.alpha, "accept_tests": self.accept_tests,
                "target_head_calls": t.calls, "target_head_rows": t.rows,
                "draft_head_calls": d.calls, "draft_head_rows": d.rows,
                "residual_rows": t.residual_rows, "residual_tries": t.residual_tries,
                "residual_fallbacks": t.residual_fallbacks}
