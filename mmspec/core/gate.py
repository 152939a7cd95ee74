"""Speculation switched on and off during a call, from the call's own acceptance and the machine's
measured pass costs (dynamic speculation: vLLM's dynamic speculative decoding, SmartSpec; here
under a static batch, whose slowest row sets the pass count).

``GatedDrafter`` wraps any drafter. While *on* it proposes what the drafter proposes; while *off*
it proposes nothing (the root alone: one target token per pass, the baseline's pass) but still
hands every pass to the drafter's ``update``, so the drafter's state (a feature head's committed
features, a draft model's catch-up point, a Jacobi window) stays in step and it can resume at any
pass. Every decision depends only on passes already decoded, and verification is unchanged, so a
lossless method stays lossless: greedy outputs equal the target alone, sampled ones keep its law.

The decision (``SpeedGate``), every ``every`` passes: with ``n_r`` each row's tokens still to
generate (``state.new_tokens`` minus its generated tokens: an upper bound where rows may stop at an
end token) and ``tau_r`` its tokens per speculating pass so far (the evidence halved at each
decision, and the calibration's tau counted as ``prior_passes`` passes: one early window of a Jacobi
drafter, still converging, does not switch a good method off), the rest of a static batch takes
about ``max_r(n_r / tau_r) * c_on`` speculating and ``max_r(n_r) * c_off`` not (``c_on``, ``c_off``:
the measured seconds of a pass at this batch size with and without the drafter, its draft passes
included). Speculation stays on while the first is smaller by the ``margin``; once off, it is probed
again (``every`` passes on) after ``probe`` passes off.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from .drafters import _empty_draft
from .errors import check, check_int
from .tree import DraftTree
from .types import DecodeState, Drafter, DrafterBase


@dataclass
class SpeedGate:
    """When to speculate: ``c_on`` / ``c_off`` seconds per pass with / without the drafter at this
    batch size (measured, ``mmspec.methods.auto``'s profile), a decision every ``every`` passes
    from the last ``every`` speculating passes, a relative ``margin`` of hysteresis, and a probe of
    ``every`` speculating passes after ``probe`` passes off."""

    c_on: float
    c_off: float
    every: int = 16
    probe: int = 64
    margin: float = 0.03
    prior_tau: float | None = None  # the calibration's tokens per pass, worth ``prior_passes`` passes
    prior_passes: int = 32
    decay: float = 0.5  # the evidence kept at each decision (older passes count less)

    def __post_init__(self):
        for name in ("c_on", "c_off"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0, name,
                  "seconds per pass > 0", value)
        for name in ("every", "probe"):
            value = getattr(self, name)
            check_int(value, name, 1)
        check(isinstance(self.margin, (int, float)) and 0 <= self.margin < 1, "margin", "a number in [0, 1)",
              self.margin)
        check(self.prior_tau is None or (isinstance(self.prior_tau, (int, float)) and self.prior_tau >= 1),
              "prior_tau", "None or tokens per pass >= 1", self.prior_tau)
        check_int(self.prior_passes, "prior_passes", 0)
        check(isinstance(self.decay, (int, float)) and 0 <= self.decay <= 1, "decay", "a number in [0, 1]",
              self.decay)

    def tau(self, emitted: float, live: float) -> float:
        """A row's tokens per speculating pass: its ``emitted`` tokens over ``live`` passes, with the
        prior counted as ``prior_passes`` passes at ``prior_tau`` (none: the evidence alone)."""
        if self.prior_tau is None or self.prior_passes == 0:
            return emitted / live if live > 0 else 1.0
        return (self.prior_tau * self.prior_passes + emitted) / (self.prior_passes + live)

    def ratio(self, remaining: list[int], tau: list[float]) -> float:
        """Predicted (time off) / (time on) for the rest of the batch: > 1 means speculating pays.
        ``remaining``: tokens each live row has left; ``tau``: its tokens per speculating pass."""
        if not remaining:
            return 1.0
        on = max(n / max(t, 1e-9) for n, t in zip(remaining, tau)) * self.c_on
        off = max(remaining) * self.c_off
        return off / on if on > 0 else float("inf")

    def keep_on(self, ratio: float, on: bool) -> bool:
        """Hysteresis: stay on down to ``1 - margin``, switch on from ``1 + margin``."""
        return ratio >= (1 - self.margin if on else 1 + self.margin)


@dataclass
class GateLog:
    """What the gate did in one call: passes with and without drafting, switches, and each
    decision as ``(pass, on, predicted off/on time ratio)``."""

    passes_on: int = 0
    passes_off: int = 0
    switches: int = 0
    decisions: list = field(default_factory=list)


class GatedDrafter(DrafterBase):
    """``drafter`` switched on and off by ``gate`` (see the module docstring); ``on`` is the state
    at the first pass."""

    def __init__(self, drafter: Drafter, gate: SpeedGate, on: bool = True):
        check(isinstance(drafter, Drafter), "drafter", "a Drafter", type(drafter).__name__)
        check(isinstance(gate, SpeedGate), "gate", "a SpeedGate", type(gate).__name__)
        self.inner, self.gate, self.initial = drafter, gate, bool(on)
        self.vocab_size = drafter.vocab_size
        self.max_block = drafter.max_block
        self.lane_safe = getattr(drafter, "lane_safe", False)
        self.reads_target_probs = getattr(drafter, "reads_target_probs", True)
        self.token_shape = tuple(getattr(drafter, "token_shape", ()))
        self.log = GateLog()
        self._reset(self.initial)

    def _reset(self, on: bool) -> None:
        self.on = on
        self.since = 0  # passes since the last decision (or the switch off)
        self.emitted = self.passes = None  # per row: tokens and live passes over speculating passes (decayed)
        self.prev = None  # each row's generated count at the last proposal (host ints)
        self.drafted = False  # whether the last proposal drafted anything

    @property
    def forwards(self) -> int:
        return self.inner.forwards

    @property
    def restarts_rows(self) -> bool:
        return getattr(self.inner, "restarts_rows", False)

    def restart_rows(self, state: DecodeState, rows: list[int], alone: list[DecodeState]) -> None:
        """Continuous batching: the drafter restarts the rows; their counts start from the new
        job's (a refilled row emitted nothing of the new job in the last pass)."""
        self.inner.restart_rows(state, rows, alone)
        if self.prev is not None:
            counts = _generated(state)
            for b in rows:
                self.prev[b] = counts[b]

    def start(self, state: DecodeState) -> None:
        self.log = GateLog()
        self._reset(self.initial)
        self.inner.start(state)

    def propose(self, state: DecodeState) -> DraftTree:
        counts = _generated(state)  # host ints the loop read with its stop flag: no device read
        if self.drafted:  # the last pass speculated: what each live row emitted in it
            if self.emitted is None:
                self.emitted, self.passes = [0.0] * len(counts), [0.0] * len(counts)
            for r, (now, then) in enumerate(zip(counts, self.prev)):
                if now > then:  # a finished row stops growing
                    self.emitted[r] += now - then
                    self.passes[r] += 1
        self._decide(state, counts)
        self.prev = list(counts)
        if self.on:
            self.log.passes_on += 1
            draft = self.inner.propose(state)
            self.drafted = draft.tokens.shape[1] > 0
            return draft
        self.log.passes_off += 1
        self.drafted = False
        return _empty_draft(state)

    def update(self, state, draft, acceptance, target_probs, target_out) -> None:
        self.inner.update(state, draft, acceptance, target_probs, target_out)
        self.since += 1

    def _decide(self, state: DecodeState, counts: list[int]) -> None:
        """Every ``every`` passes on, or after ``probe`` passes off: decide (host ints only)."""
        g = self.gate
        if not self.on:
            if self.since >= g.probe:  # probe: speculate again for a window
                self._switch(True, state, None)
            return
        if self.since < g.every or self.emitted is None:
            return
        remaining, tau = [], []
        for r, now in enumerate(counts):
            left = state.new_tokens - now
            grew = self.prev is not None and now > self.prev[r]  # still decoding at the last pass
            if grew and left > 0 and self.passes[r] > 0:
                remaining.append(left)
                tau.append(g.tau(self.emitted[r], self.passes[r]))
        ratio = g.ratio(remaining, tau)
        self.log.decisions.append((self.log.passes_on + self.log.passes_off, True, round(ratio, 4)))
        self.since = 0
        self.emitted = [e * g.decay for e in self.emitted]
        self.passes = [p * g.decay for p in self.passes]
        if not g.keep_on(ratio, True):
            self._switch(False, state, ratio)

    def _switch(self, on: bool, state: DecodeState, ratio: float | None) -> None:
        self.log.switches += 1
        if ratio is None:
            self.log.decisions.append((self.log.passes_on + self.log.passes_off, on, None))
        else:
            self.log.decisions[-1] = (self.log.decisions[-1][0], on, self.log.decisions[-1][2])
        self.on, self.since = on, 0


def _generated(state: DecodeState) -> list[int]:
    """Each row's generated-token count: the loop's host copy (``state.generated``), else read."""
    if state.generated is not None:
        return list(state.generated)
    B = state.batch_size
    return (state.lengths[:B] - state.prompt_lengths[:B]).tolist()
