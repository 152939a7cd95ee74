"""Per-position token distributions: what continuous targets hand the loop instead of probabilities.

A discrete target's verify pass gives probabilities (B, T, V); a continuous target's gives a
``TokenDist``: a batch of distributions over tokens of a trailing shape, batch dims first ((B, T)
for a verify pass, (B,) for one position per row), with

- ``sample(generator) -> Draw``: one token per entry of a 1-D batch (row r draws only from
  generator r of a per-row tuple, as everywhere in the core), with its ``aux`` (a diffusion head's
  denoising path) and its log-density;
- ``log_prob(draw)``: float64 log-density of each draw (path space for diffusion heads);
- ``score(draw) -> (log_prob, emitted)``: what the target emits for an accepted draw (the draw
  itself by default; a diffusion head's own last denoising step on the draft's path);
- ``residual(q)``: ``(p - q)^+ / (1 - beta)`` as a ``Residual``, sampled exactly from
  log-densities alone;
- indexing by batch dims and ``stack``.

``DensityProcessor`` is the ``LogitsProcessor`` of continuous tokens: it turns a model output's
features (``ModelOutput.cond``) into a ``TokenDist`` through one of the model's heads
(``ModelOutput.heads``), with classifier-free guidance and temperature applied identically to
draft and target.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from .errors import check, check_choice, is_int
from .sampling import Generators, rand, select_rows

LOG_2PI = math.log(2 * math.pi)


def normal_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Elementwise float64 ``log N(x; mean, std**2)``."""
    x, mean, std = x.double(), mean.double(), std.double()
    return -0.5 * ((x - mean) / std) ** 2 - std.log() - 0.5 * LOG_2PI


def state_latent_token(state: torch.Tensor, latent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., d) state and latent -> (..., 2, d) tokens in ``dtype``: the two-row layout of
    continuous tokens whose backbone reads back a state (row 0) other than the emitted latent
    (row 1); a diffusion head's chain ends at a state and emits its last step."""
    return torch.stack([state, latent], -2).to(dtype)


@dataclass
class HeadMeter:
    """Work of one model's per-token head during one ``generate`` call (continuous tokens).

    Attributes:
        calls: sequential head calls (one batched call counts once).
        rows: rows through the head (both CFG halves counted).
        residual_rows: tokens drawn from a residual (rejections).
        residual_tries: proposals those draws took (``residual_tries / residual_rows`` estimates
            ``1 / (1 - beta)``).
        residual_fallbacks: residual draws that hit the try cap and took the last proposal from p
            instead (biased; reported, never silent).
    """

    calls: int = 0
    rows: int = 0
    residual_rows: int = 0
    residual_tries: int = 0
    residual_fallbacks: int = 0

    def record_call(self, rows: int) -> None:
        self.calls += 1
        self.rows += int(rows)


@dataclass
class Draw:
    """Sampled tokens (batch, *token_shape) with what their distribution needs to score them again.

    ``aux`` holds per-token extras with the same batch dims (a diffusion head's denoising path and
    noise); ``log_prob`` is the float64 log-density under the distribution that drew them (None
    when not known).
    """

    token: torch.Tensor
    aux: Mapping[str, torch.Tensor] = field(default_factory=dict)
    log_prob: torch.Tensor | None = None

    def __getitem__(self, index) -> "Draw":
        return Draw(self.token[index], {k: v[index] for k, v in self.aux.items()},
                    None if self.log_prob is None else self.log_prob[index])

    @staticmethod
    def stack(draws: list["Draw"], dim: int) -> "Draw":
        """Stack draws of equal batch shape along a new batch dim ``dim``."""
        logp = [d.log_prob for d in draws]
        return Draw(torch.stack([d.token for d in draws], dim),
                    {k: torch.stack([d.aux[k] for d in draws], dim) for k in draws[0].aux},
                    None if any(lp is None for lp in logp) else torch.stack(logp, dim))


class TokenDist:
    """A batch of token distributions. Subclasses are dataclasses whose tensor fields all lead with
    the batch dims (indexing and stacking act on those), with ``token_shape`` and ``token_dtype``
    and ``sample`` / ``log_prob``; ``score`` and ``residual`` have exact defaults."""

    token_shape: tuple[int, ...]
    token_dtype: torch.dtype
    meter: HeadMeter | None = None
    max_tries: int | None = 1000

    # -- batch plumbing -------------------------------------------------------------------------
    def _tensor_fields(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def _with(self, fields: dict[str, torch.Tensor]) -> "TokenDist":
        """A shallow copy with ``fields`` replaced, without re-running ``__init__`` (the decode loop
        indexes distributions several times per pass: ``dataclasses.replace`` cost more than the
        indexing itself)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.__dict__.update(fields)
        return new

    @property
    def batch_shape(self) -> torch.Size:
        """The batch dims (shared by every tensor field)."""
        return self._batch_ref().shape[: self._batch_ndim()]

    def _batch_ref(self) -> torch.Tensor:
        return next(iter(self._tensor_fields().values()))

    def _batch_ndim(self) -> int:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self._batch_ref().device

    def __getitem__(self, index) -> "TokenDist":
        index = index if isinstance(index, tuple) else (index,)
        return self._with({k: v[index] for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)})

    @classmethod
    def stack(cls, dists: list["TokenDist"], dim: int) -> "TokenDist":
        """Stack distributions of equal batch shape along a new batch dim ``dim``."""
        first = dists[0]
        return dataclasses.replace(first, **{k: torch.stack([getattr(d, k) for d in dists], dim)
                                             for k in first._tensor_fields()})

    # -- the distribution -----------------------------------------------------------------------
    def sample(self, generator: Generators = None) -> Draw:
        """One token per entry of a 1-D batch; entry r draws from generator r of a per-row tuple."""
        raise NotImplementedError

    def log_prob(self, draw: Draw) -> torch.Tensor:
        """Float64 log-density of each draw, shape ``batch_shape``."""
        raise NotImplementedError

    def noise(self, generator: Generators = None) -> torch.Tensor:
        """The randomness ``sample`` consumes, as a float64 (n, k) tensor for a 1-D batch of n
        (entry r from generator r of a per-row tuple), for ``from_noise``. Optional: only
        distributions whose draws are a function of fixed noise implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no noise/from_noise (a draw as a function of "
                                  "fixed noise); use a coupling that does not need it")

    def from_noise(self, noise: torch.Tensor) -> Draw:
        """The draw ``sample`` would make from ``noise`` (``sample(g) == from_noise(noise(g))`` bit
        for bit): a deterministic map of noise of a fixed law to a draw of this distribution."""
        raise NotImplementedError(f"{type(self).__name__} has no noise/from_noise")

    def score(self, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log_prob(draw), tokens the target emits when it accepts draw)``; the draw itself here."""
        return self.log_prob(draw), draw.token

    def residual(self, q: "TokenDist") -> "Residual":
        """The speculative-sampling residual ``(p - q)^+ / (1 - beta)`` (1-D batches)."""
        return Residual(self, q, self.max_tries, self.meter)


class Residual:
    """The residual ``r = (p - q)^+ / (1 - beta)`` of target p and draft q, ``beta = int min(p, q)``:
    the correction after a rejection in speculative sampling (Leviathan et al., 2023; Chen et al.,
    2023), for densities.

    Exact sampler from log-densities alone: repeat y ~ p, u ~ U(0, 1) until ``u < 1 - q(y) / p(y)``;
    the accepted y has density ``p (1 - q/p)^+ / (1 - beta) = r``. Each try succeeds with
    probability ``1 - beta``, so a rejection costs ``1 / (1 - beta)`` tries on average (they are
    drawn ``tries_per_round`` at a time; tries after a row's first success are drawn, not counted,
    not used). After ``max_tries`` tries (``None``: no cap) the last proposal from p is taken
    instead and counted in ``meter.residual_fallbacks`` (a fraction ``(1 - beta) beta^max_tries`` of residual draws is
    then biased towards p). Rows draw independently (row r only from generator r of a per-row
    tuple, and only while it has not succeeded). Its normaliser ``1 - beta`` has no closed form,
    so ``log_prob`` is refused; that is why continuous tokens need chains (a tree's sibling
    recursion would score the next sibling under r).
    """

    tries_per_round = 4
    """Tries drawn per pending row in one batched call (fewer Python rounds; the law is the same)."""

    def __init__(self, p: TokenDist, q: TokenDist, max_tries: int | None = 1000, meter: HeadMeter | None = None):
        check(max_tries is None or (is_int(max_tries) and max_tries >= 1), "max_tries",
              "None (no cap) or an int >= 1", max_tries)
        self.p, self.q, self.max_tries, self.meter = p, q, max_tries, meter
        self.token_shape, self.token_dtype = p.token_shape, p.token_dtype

    def __getitem__(self, index) -> "Residual":
        return Residual(self.p[index], self.q[index], self.max_tries, self.meter)

    def log_prob(self, draw: Draw) -> torch.Tensor:
        raise ValueError("a speculative-sampling residual has no closed-form density (its normaliser "
                         "1 - beta is an integral); continuous tokens are verified in chains")

    def sample(self, generator: Generators = None) -> Draw:
        return self.sample_with_log_p(generator)[0]

    def sample_with_log_p(self, generator: Generators = None) -> tuple[Draw, torch.Tensor]:
        """``sample``, plus the float64 log-density of each drawn token under p (the residual's
        own density has no closed form; a Jacobi redraft needs p's, which the tries computed)."""
        p, q = self.p, self.q
        n = p.batch_shape[0]
        device = p.device
        tokens = log_p = None
        pending = torch.arange(n, device=device)
        tries = 0
        while pending.numel() > 0:
            # ``tries_per_round`` tries of every pending row in one batched call: the tries are
            # iid, so taking each row's first success is the sequential loop's law; only tries up
            # to it are counted
            k = self.tries_per_round if self.max_tries is None else min(self.tries_per_round,
                                                                        self.max_tries - tries)
            m = pending.numel()
            first_round = tries == 0
            idx = pending.repeat_interleave(k)  # row r's k tries side by side (one generator run)
            gen = select_rows(generator, idx)
            pp, qq = p[idx], q[idx]
            y = pp.sample(gen)
            logp = y.log_prob if y.log_prob is not None else pp.log_prob(y)
            logq = qq.log_prob(y)
            u = rand((m * k,), gen, device, torch.float64)
            ok = (u < -torch.expm1(logq - logp)).view(m, k)  # u < 1 - q(y)/p(y)
            tries += k
            hit = ok.any(1)
            capped = self.max_tries is not None and tries >= self.max_tries
            first = torch.where(hit, ok.to(torch.int8).argmax(1), k - 1)  # a capped row takes its last try
            if self.meter is not None:  # a settled row counts its tries up to its first success, the others k
                self.meter.residual_tries += int(first.sum()) + m
                if capped:
                    self.meter.residual_fallbacks += int((~hit).sum())
            rows = torch.arange(m, device=device)
            chosen = y.token.view((m, k) + tuple(y.token.shape[1:]))[rows, first].to(p.token_dtype)
            chosen_log_p = logp.view(m, k)[rows, first]
            if first_round and (capped or bool(hit.all())):  # one round settled every row (the common case)
                if self.meter is not None:
                    self.meter.residual_rows += n
                return Draw(chosen), chosen_log_p
            if tokens is None:
                tokens = torch.zeros((n,) + tuple(p.token_shape), dtype=p.token_dtype, device=device)
                log_p = torch.zeros(n, dtype=torch.float64, device=device)
            take = torch.ones_like(hit) if capped else hit
            done = pending[take]
            tokens[done] = chosen[take]
            log_p[done] = chosen_log_p[take]
            pending = pending[~take]
        if self.meter is not None:
            self.meter.residual_rows += n
        return Draw(tokens), log_p


@dataclass(frozen=True)
class DensityProcessor:
    """Continuous tokens' ``LogitsProcessor``: model features -> per-position ``TokenDist``.

    ``pipeline(out, index, num_tokens, meter)`` reads ``out.cond`` (R, T, H) through
    ``out.heads[head]``; with guidance the rows are ``[cond; uncond]`` and the result has half the
    rows. Draft and target go through the same pipeline, so they share every setting below.

    Args:
        temperature: MAR's temperature (> 0): a diffusion head scales its per-step noise by it
            (``x = mu + T sigma eps``, not the starting noise), a mixture head its components'
            standard deviations.
        guidance_scale: CFG scale s in MAR's convention (``eps_u + s (eps_c - eps_u)``; 1 is the
            conditional model); ``None`` turns guidance off.
        guidance_schedule: ``"constant"`` (s everywhere) or ``"linear"`` (MAR's ``cfg_schedule``:
            the token with generated index j, of N, uses ``1 + (s - 1) (j + 1) / N``).
        head: which of the model's heads (``ModelOutput.heads``) turns features into tokens.
        residual_max_tries: the residual sampler's try cap (``None``: uncapped); see ``Residual``.
    """

    temperature: float = 1.0
    guidance_scale: float | None = None
    guidance_schedule: str = "constant"
    head: str = "mixture"
    residual_max_tries: int | None = 1000

    SCHEDULES = ("constant", "linear")

    def __post_init__(self):
        check(_real(self.temperature) and self.temperature > 0, "temperature", "a float > 0", self.temperature)
        if self.guidance_scale is not None:
            check(_real(self.guidance_scale) and self.guidance_scale >= 0, "guidance_scale", ">= 0 or None",
                  self.guidance_scale)
        check_choice("guidance_schedule", self.guidance_schedule, self.SCHEDULES)
        check(isinstance(self.head, str) and self.head != "", "head", "a head name such as 'mixture'", self.head)
        check(self.residual_max_tries is None or (is_int(self.residual_max_tries) and self.residual_max_tries >= 1),
              "residual_max_tries", "None (no cap) or an int >= 1", self.residual_max_tries)

    greedy = False  # continuous tokens are always sampled

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale is not None

    def scales(self, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """(B, T) float64 guidance scale of the tokens with generated indices ``index`` (0-based)."""
        s = float(self.guidance_scale)
        if self.guidance_schedule == "constant":
            return torch.full(index.shape, s, dtype=torch.float64, device=index.device)
        done = (index + 1).clamp(1, num_tokens).double()  # drafts past the end reuse the last scale
        return 1.0 + (s - 1.0) * done / num_tokens

    def __call__(self, out: Any, index: torch.Tensor, num_tokens: int, meter: HeadMeter | None = None) -> TokenDist:
        """``out.cond`` (R, T, H) -> (B, T) distributions of the tokens with generated ``index`` (B, T)."""
        heads = getattr(out, "heads", None)
        if getattr(out, "cond", None) is None or heads is None:
            raise ValueError("a continuous-token model must return ModelOutput.cond (its features) and "
                             "ModelOutput.heads (its per-token heads)")
        check(self.head in heads, "head", f"one of the model's heads ({', '.join(heads)})", self.head)
        cond, uncond, scale = out.cond, None, None
        if self.uses_guidance:
            cond, uncond = cond.chunk(2, dim=0)
            scale = self.scales(index, num_tokens)
        return heads[self.head].distribution(cond, uncond, scale, self, meter)

    # -- the token space the decoder asks (``LogitsProcessor``'s same methods for token ids) ---------
    def check_eos(self, eos: tuple[int, ...] | None, given) -> None:
        """Continuous tokens have no end-of-sequence id."""
        check(eos is None, "eos_token_id", "None for continuous tokens", given)

    def prompt_tokens(self, ids: torch.Tensor, target) -> torch.Tensor:
        """(R, S) prompt ids -> (R, S, *token_shape): broadcast over the target's token shape in
        its ``token_dtype`` (float32 when it names none)."""
        shape = tuple(target.token_shape)
        ids = ids.to(getattr(target, "token_dtype", torch.float32))
        return ids.view(*ids.shape, *(1,) * len(shape)).expand(*ids.shape, *shape)

    def new_meters(self) -> dict[str, HeadMeter]:
        """Per-call head counters of the target's and the draft's heads."""
        return {"target": HeadMeter(), "draft": HeadMeter()}

    def last_distribution(self, state, out: Any, rows: torch.Tensor, at: torch.Tensor) -> TokenDist:
        """(B,) distributions of each row's first token, from the prompt pass's features at
        ``(rows, at)`` (each prompt's last position), counted in the target meter."""
        last = SimpleNamespace(cond=out.cond[rows, at][:, None], heads=out.heads)
        return state.distribution(last, at[:, None], state.meters["target"])[:, 0]

    def pass_distribution(self, state, out: Any, positions: torch.Tensor) -> TokenDist:
        """A verify pass's (B, T) distributions (``DecodeState.distribution``), counted in the
        target meter."""
        return state.distribution(out, positions, state.meters["target"])

    def record_tests(self, stats, drafted: int, accepted: torch.Tensor, emitting: torch.Tensor) -> None:
        """Continuous tokens are verified in chains: count the accept tests of the ``emitting``
        rows (``accepted`` (B,) prefix lengths; ``Stats.record_tests``, the per-token acceptance
        ``alpha``)."""
        stats.record_tests(drafted, accepted[emitting])


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
