"""Fused guided acceptance of a drafted chain: classifier-free guidance, temperature, top-k and
softmax over the vocabulary, then the accept tests, the residual and the correction / bonus draw,
from given uniforms, without materialising the (B, G+1, V) probabilities.

The rules are the core's (``mmspec.core.acceptance``, ``mmspec.core.relaxed``), on a chain of G
drafts ``tokens`` (B, G) scored by the target at G + 1 positions:

- the logits processor (``mmspec.core.logits.LogitsProcessor`` without top-p): ``l = l_u + s (l_c -
  l_u)`` (Ho & Salimans, 2022; ``logits`` is then ``[cond; uncond]``, 2B rows), ``l / temperature``,
  top-k (ties with the k-th value kept), softmax; ``temperature = 0`` is greedy;
- the accept test of draft g: lossless speculative sampling (Leviathan et al., 2023; Chen et al.,
  2023), ``min(1, p(x) / q(x))``, or ``p(x)`` for deterministic drafts (``q=None``); with
  ``group``, GSD's grouped test (So et al., 2025) ``min(1, p(G) / q(G))`` over the group G of
  tokens of nearby target rank whose probability and embedding are close to x's; greedy: x is
  the argmax;
- draft g is accepted when ``u_accept[b, g] < a``; the first rejection ends the chain; the next
  token is drawn by inverse CDF with ``u_sample[b]`` from the residual ``norm(max(p - q, 0))``
  at the rejected position (``p`` when it is numerically zero, SJD issue #7; the residual kernel
  of ``mmspec.kernels.residual`` is this step) or from ``p`` after the last draft (the bonus).

With the uniforms the core's rule objects draw (``rand((B, G))`` then ``rand((B, 1))`` from the
same generator) the decisions are the core's, except where a uniform falls within float rounding
of a threshold: probabilities are computed in a different summation order (a few ulps), so
``u < a`` or an inverse-CDF boundary can flip with probability of order 1e-7 per decision. The
kernel accumulates the CDF in float64, as torch's CPU ``cumsum`` does (CUDA's accumulates in
float32). Top-p needs a sort and is not fused: ``guided_accept`` takes the reference for it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mmspec.utils.errors import check, check_int

from .dispatch import TRITON_AVAILABLE, dtype_problem, preferred, use_triton
from .residual import residual_distribution_reference
from .torch_ops import inverse_cdf as torch_inverse_cdf
from .torch_ops import logits_to_probs

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl


class ChainAcceptance(NamedTuple):
    num_accepted: torch.Tensor  # (B,) accepted drafts
    next_token: torch.Tensor  # (B,) the correction or bonus token
    accept_prob: torch.Tensor  # (B, G) every draft's accept probability (greedy: 0 or 1)


@dataclass(frozen=True)
class Grouping:
    """GSD's group (``mmspec.core.relaxed.GroupedAcceptance``): the target's input embeddings
    (V, E) and its ``p_threshold``, ``d_threshold``, ``half_width``."""

    embeddings: torch.Tensor
    p_threshold: float = 0.15
    d_threshold: float = 0.5
    half_width: int = 7

    @classmethod
    def of(cls, rule) -> "Grouping":
        """The grouping of a core ``GroupedAcceptance`` rule."""
        cfg = rule.config
        return cls(rule.embeddings, cfg.p_threshold, cfg.d_threshold, cfg.half_width)


def _check_inputs(logits, tokens, q, u_accept, u_sample, guidance_scale, temperature, top_k, group):
    check(logits.dim() == 3, "logits", "a (B, G+1, V) tensor ((2B, G+1, V) [cond; uncond] with guidance)",
          tuple(logits.shape))
    check(tokens.dim() == 2 and not tokens.is_floating_point(), "tokens", "a (B, G) integer tensor",
          (tuple(tokens.shape), tokens.dtype))
    B, G = tokens.shape
    rows = 2 * B if guidance_scale is not None else B
    check(logits.shape[:2] == (rows, G + 1), "logits", f"({rows}, {G + 1}, V) for {B} chains of {G} drafts"
          + (" with guidance ([cond; uncond])" if guidance_scale is not None else ""), tuple(logits.shape))
    V = logits.shape[-1]
    check(isinstance(temperature, (int, float)) and temperature >= 0, "temperature", ">= 0 (0 means greedy)",
          temperature)
    check_int(top_k, "top_k", 1, optional=True)
    if q is not None:
        check(q.shape == (B, G, V), "q", f"None or the drafts' ({B}, {G}, {V}) probabilities", tuple(q.shape))
    greedy = temperature == 0
    check(not (greedy and group is not None), "group", "None with temperature 0 (greedy accepts the argmax)",
          group)
    if not greedy:
        check(u_accept is not None and u_accept.shape == (B, G), "u_accept", f"a ({B}, {G}) tensor of uniforms",
              None if u_accept is None else tuple(u_accept.shape))
        check(u_sample is not None and u_sample.shape == (B,), "u_sample", f"a ({B},) tensor of uniforms",
              None if u_sample is None else tuple(u_sample.shape))
    if group is not None:
        check(isinstance(group, Grouping) and group.embeddings.dim() == 2 and group.embeddings.shape[0] == V,
              "group", f"None or a Grouping with ({V}, E) embeddings", group)
        check(isinstance(group.half_width, int) and group.half_width >= 1, "group.half_width", "an int >= 1",
              group.half_width)


# -- the torch reference ------------------------------------------------------------------------
def process_logits(logits: torch.Tensor, guidance_scale: float | None = None, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """(B or 2B, ..., V) -> (B, ..., V) float32 probabilities: the core's ``LogitsProcessor``
    (``torch_ops.logits_to_probs``)."""
    return logits_to_probs(logits, guidance_scale, temperature, top_k, top_p)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) rows of positive mass, (B,) uniforms -> (B,) tokens: the core's ``inverse_cdf``
    (``mmspec.core.sampling.sample``'s draw with its uniforms given)."""
    return torch_inverse_cdf(probs, u[:, None].to(probs.dtype))


def group_members(p: torch.Tensor, x: torch.Tensor, group: Grouping) -> torch.Tensor:
    """(N, V) target probabilities, (N,) drafts -> (N, 2w) group members, -1 outside
    (``GroupedAcceptance.group``)."""
    N, V = p.shape
    order = p.argsort(dim=-1, stable=True)  # ascending, ties by token id
    rank = order.argsort(dim=-1).gather(1, x[:, None])
    slots = rank + torch.arange(-group.half_width, group.half_width, device=p.device)  # (N, 2w)
    inside = (slots >= 0) & (slots < V)
    cand = order.gather(1, slots.clamp(0, V - 1))
    close_p = (p.gather(1, cand) - p.gather(1, x[:, None])).abs() < group.p_threshold
    e = group.embeddings.float().to(p.device)
    close_e = (e[cand] - e[x][:, None]).pow(2).sum(-1) < group.d_threshold
    member = inside & ((close_p & close_e) | (cand == x[:, None]))
    return torch.where(member, cand, -1)


def accept_probability(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor,
                       group: Grouping | None = None) -> torch.Tensor:
    """(N, V), (N, V) or None, (N,) -> (N,): ``SpeculativeSampling`` / ``GroupedAcceptance``'s
    ``accept_prob``."""
    if group is None:
        px = p.gather(-1, x[:, None]).squeeze(-1)
        if q is None:
            return px
        qx = q.gather(-1, x[:, None]).squeeze(-1)
        return torch.where(qx > 0, (px / qx.clamp_min(1e-30)).clamp(max=1.0), 0.0)
    g = group_members(p, x, group)
    present = g >= 0
    g = g.clamp(min=0)
    p_mass = (p.gather(1, g) * present).sum(-1)
    if q is None:
        return p_mass.clamp(max=1.0)
    q_mass = (q.gather(1, g) * present).sum(-1)
    qx = q.gather(1, x[:, None]).squeeze(-1)
    return torch.where(qx > 0, (p_mass / q_mass.clamp_min(1e-30)).clamp(max=1.0), 0.0)


def guided_accept_reference(logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None = None, *,
                            u_accept: torch.Tensor | None = None, u_sample: torch.Tensor | None = None,
                            guidance_scale: float | None = None, temperature: float = 1.0,
                            top_k: int | None = None, top_p: float | None = None,
                            group: Grouping | None = None) -> ChainAcceptance:
    """The core's chain acceptance (module docstring) in plain torch, the uniforms given."""
    _check_inputs(logits, tokens, q, u_accept, u_sample, guidance_scale, temperature, top_k, group)
    check(top_p is None or (isinstance(top_p, (int, float)) and 0 < top_p <= 1), "top_p",
          "a float in (0, 1] or None", top_p)
    B, G = tokens.shape
    rows = torch.arange(B, device=tokens.device)
    if temperature == 0:  # GreedyMatch: accept the argmax, emit the argmax after the last accepted
        best = process_logits(logits, guidance_scale, 0).argmax(-1)  # (B, G+1)
        a = (best[:, :G] == tokens).float()
        n = a.long().cumprod(1).sum(1)
        return ChainAcceptance(n, best[rows, n], a)
    p = process_logits(logits, guidance_scale, temperature, top_k, top_p)  # (B, G+1, V)
    V = p.shape[-1]
    a = accept_probability(p[:, :G].reshape(B * G, V), None if q is None else q.reshape(B * G, V),
                           tokens.reshape(-1), group).view(B, G)
    n = (u_accept.to(a.device) < a).long().cumprod(1).sum(1)  # (B,)
    if G == 0:
        return ChainAcceptance(n, inverse_cdf(p[:, 0], u_sample), a)
    at = n.clamp(max=G - 1)
    qn = torch.nn.functional.one_hot(tokens[rows, at], V).float() if q is None else q[rows, at]
    last = torch.where((n == G)[:, None], p[:, G], residual_distribution_reference(p[rows, at], qn))
    return ChainAcceptance(n, inverse_cdf(last, u_sample), a)


# -- the Triton kernels --------------------------------------------------------------------------
if TRITON_AVAILABLE:

    @triton.jit
    def _logits(COND, UNCOND, cols, mask, scale, temperature, GUIDED: tl.constexpr, GREEDY: tl.constexpr):
        """The guided, tempered fp32 logits at ``cols`` (-inf outside ``mask``), op for op as torch."""
        c = tl.load(COND + cols, mask=mask, other=0.0).to(tl.float32)
        if GUIDED:
            u = tl.load(UNCOND + cols, mask=mask, other=0.0).to(tl.float32)
            c = u + scale * (c - u)
        if not GREEDY:
            c = c / temperature
        return tl.where(mask, c, float("-inf"))

    @triton.jit
    def _probs(COND, UNCOND, cols, mask, scale, temperature, kth, m, z, GUIDED: tl.constexpr):
        """p at ``cols``: softmax of the kept logits given the row's max m and sum z (0 elsewhere)."""
        lg = _logits(COND, UNCOND, cols, mask, scale, temperature, GUIDED, False)
        return tl.where(mask & (lg >= kth), tl.exp(lg - m) / z, 0.0)

    @triton.jit
    def _sortable(x):
        """fp32 -> int32 keys in the floats' order."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    # Memory traffic per position: the logits (cond and uncond) are streamed twice (max, sum), plus
    # 32 counting passes with top-k and 2 half_width - 1 passes for GSD's rank neighbours, and two
    # loads of q. Nothing V-sized is written. The reference writes the merged logits,
    # the tempered logits, the probabilities and, on the rule's side, argsort/cumsum temporaries.
    @triton.jit
    def _position_kernel(
        LOGITS, TOKENS, Q, EMB, M_OUT, Z_OUT, KTH_OUT, A_OUT, BEST_OUT,
        B, G, V, E, slb, sln, stb, sqb, sqn, seb,
        scale, temperature, top_k, p_thr, d_thr, half_width,
        GUIDED: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr, HAS_Q: tl.constexpr,
        GROUPED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        """One program per (row b, position g): the softmax statistics, the argmax (greedy), and
        draft g's accept probability (g < G)."""
        pid = tl.program_id(0).to(tl.int64)
        N1 = G + 1
        b = pid // N1
        g = pid % N1
        COND = LOGITS + b * slb + g * sln
        UNCOND = LOGITS + (b + B) * slb + g * sln
        has_draft = g < G
        x = tl.load(TOKENS + b * stb + g, mask=has_draft, other=0).to(tl.int64)

        if GREEDY:
            best_v = float("-inf")
            best_i = V
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                lg = _logits(COND, UNCOND, cols, cols < V, scale, temperature, GUIDED, True)
                bv = tl.max(lg, 0)
                bi = tl.min(tl.where(lg == bv, cols, V), 0)
                take = bv > best_v  # strictly: ties keep the earlier (lower) index, as argmax does
                best_i = tl.where(take, bi, best_i)
                best_v = tl.where(take, bv, best_v)
            best_i = tl.minimum(best_i, V - 1)
            tl.store(BEST_OUT + pid, best_i)
            if has_draft:
                tl.store(A_OUT + b * G + g, tl.where(best_i == x, 1.0, 0.0))
        else:
            # top-k: the k-th largest logit by bisection on the floats' order (32 counting passes)
            kth = float("-inf")
            if TOP_K:
                lo = tl.full([], -2147483648, tl.int64)
                hi = tl.full([], 2147483648, tl.int64)
                for _ in range(32):
                    mid = lo + (hi - lo) // 2
                    cnt = 0
                    for start in range(0, V, BLOCK):
                        cols = start + tl.arange(0, BLOCK)
                        ok = cols < V
                        lg = _logits(COND, UNCOND, cols, ok, scale, temperature, GUIDED, False)
                        cnt += tl.sum((ok & (_sortable(lg).to(tl.int64) >= mid)).to(tl.int32), 0)
                    enough = cnt >= top_k
                    lo = tl.where(enough, mid, lo)
                    hi = tl.where(enough, hi, mid)
                key = lo.to(tl.int32)
                kth = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
            m = float("-inf")
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                m = tl.maximum(m, tl.max(_logits(COND, UNCOND, cols, cols < V, scale, temperature, GUIDED, False), 0))
            z = 0.0
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                lg = _logits(COND, UNCOND, cols, cols < V, scale, temperature, GUIDED, False)
                z += tl.sum(tl.where((cols < V) & (lg >= kth), tl.exp(lg - m), 0.0), 0)
            tl.store(M_OUT + pid, m)
            tl.store(Z_OUT + pid, z)
            tl.store(KTH_OUT + pid, kth)
            if has_draft:
                px = _probs(COND, UNCOND, x, True, scale, temperature, kth, m, z, GUIDED)
                qx = 1.0
                if HAS_Q:
                    qx = tl.load(Q + b * sqb + g * sqn + x).to(tl.float32)
                if GROUPED:
                    # GSD's group: the half_width tokens ranked just below x and the half_width - 1
                    # just above, in (p, token id) order (a stable ascending argsort), found by
                    # repeated arg-min / arg-max passes instead of a sort
                    offs_e = tl.arange(0, BLOCK_E)
                    e_x = tl.load(EMB + x * seb + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)
                    p_mass = px
                    q_mass = qx
                    for side in range(2):
                        cur_p = px
                        cur_i = x
                        for _ in range(half_width - side):
                            best_p = tl.where(side == 0, -1.0, 2.0)
                            best_i = tl.where(side == 0, -1, V).to(tl.int64)
                            for start in range(0, V, BLOCK):
                                cols = start + tl.arange(0, BLOCK).to(tl.int64)
                                ok = cols < V
                                p = _probs(COND, UNCOND, cols, ok, scale, temperature, kth, m, z, GUIDED)
                                if side == 0:  # the largest (p, id) below the current one
                                    hit = ok & ((p < cur_p) | ((p == cur_p) & (cols < cur_i)))
                                    cp = tl.where(hit, p, -1.0)
                                    bp = tl.max(cp, 0)
                                    bi = tl.max(tl.where(hit & (cp == bp), cols, -1), 0)
                                    take = (bp > best_p) | ((bp == best_p) & (bi > best_i))
                                else:  # the smallest (p, id) above it
                                    hit = ok & ((p > cur_p) | ((p == cur_p) & (cols > cur_i)))
                                    cp = tl.where(hit, p, 2.0)
                                    bp = tl.min(cp, 0)
                                    bi = tl.min(tl.where(hit & (cp == bp), cols, V), 0)
                                    take = (bp < best_p) | ((bp == best_p) & (bi < best_i))
                                best_p = tl.where(take, bp, best_p)
                                best_i = tl.where(take, bi, best_i)
                            found = (best_i >= 0) & (best_i < V)
                            y = tl.where(found, best_i, 0)
                            e_y = tl.load(EMB + y * seb + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)
                            diff = e_y - e_x
                            dist = tl.sum(diff * diff, 0)
                            member = found & (tl.abs(best_p - px) < p_thr) & (dist < d_thr)
                            p_mass += tl.where(member, best_p, 0.0)
                            if HAS_Q:
                                q_y = tl.load(Q + b * sqb + g * sqn + y).to(tl.float32)
                                q_mass += tl.where(member, q_y, 0.0)
                            cur_p = tl.where(found, best_p, cur_p)
                            cur_i = tl.where(found, best_i, cur_i)
                    if HAS_Q:
                        a = tl.where(qx > 0, tl.minimum(p_mass / tl.maximum(q_mass, 1e-30), 1.0), 0.0)
                    else:
                        a = tl.minimum(p_mass, 1.0)
                else:
                    if HAS_Q:
                        a = tl.where(qx > 0, tl.minimum(px / tl.maximum(qx, 1e-30), 1.0), 0.0)
                    else:
                        a = px
                tl.store(A_OUT + b * G + g, a)

    @triton.jit
    def _chain_kernel(
        LOGITS, TOKENS, Q, A, UA, US, M, Z, KTH, BEST, N_OUT, NEXT_OUT,
        B, G, V, slb, sln, stb, sqb, sqn, sub, scale, temperature, eps,
        GUIDED: tl.constexpr, GREEDY: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):
        """One program per row: the accepted length from the accept probabilities and uniforms,
        then the correction (residual) or bonus token by inverse CDF."""
        b = tl.program_id(0).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        a = tl.load(A + b * G + offs_g, mask=g_ok, other=0.0)
        # not named ``ok``: the loops below use that name for their (BLOCK,) column masks, and the
        # compiler (not the interpreter) refuses a name whose shape changes inside a loop
        if GREEDY:
            accepted = a > 0.0
        else:
            u = tl.load(UA + b * sub + offs_g, mask=g_ok, other=1.0)
            accepted = u < a
        n = tl.min(tl.where(g_ok & ~accepted, offs_g, G), 0).to(tl.int64)  # the first rejection, or G
        tl.store(N_OUT + b, n)
        if GREEDY:
            tl.store(NEXT_OUT + b, tl.load(BEST + b * (G + 1) + n).to(tl.int64))
        else:
            row = b * (G + 1) + n
            m = tl.load(M + row)
            z = tl.load(Z + row)
            kth = tl.load(KTH + row)
            COND = LOGITS + b * slb + n * sln
            UNCOND = LOGITS + (b + B) * slb + n * sln
            residual = n < G
            x = tl.load(TOKENS + b * stb + n, mask=residual, other=-1).to(tl.int64)
            QROW = Q + b * sqb + n * sqn
            # pass 1: the residual's mass (the bonus position takes p itself)
            mass = 0.0
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = cols < V
                p = _probs(COND, UNCOND, cols, ok, scale, temperature, kth, m, z, GUIDED)
                if HAS_Q:
                    qv = tl.load(QROW + cols, mask=ok & residual, other=0.0).to(tl.float32)
                else:
                    qv = tl.where(cols == x, 1.0, 0.0)
                mass += tl.sum(tl.maximum(p - qv, 0.0), 0)
            use_res = residual & (mass > eps)
            denom = tl.maximum(mass, eps)
            # pass 2: the CDF's total, accumulated in fp64 and rounded per element as torch's CPU cumsum
            carry = tl.zeros([], tl.float64)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = cols < V
                p = _probs(COND, UNCOND, cols, ok, scale, temperature, kth, m, z, GUIDED)
                if HAS_Q:
                    qv = tl.load(QROW + cols, mask=ok & residual, other=0.0).to(tl.float32)
                else:
                    qv = tl.where(cols == x, 1.0, 0.0)
                w = tl.where(use_res, tl.maximum(p - qv, 0.0) / denom, p)
                carry += tl.sum(w.to(tl.float64), 0)
            total = carry.to(tl.float32)
            us = tl.load(US + b)
            # min(u * total, nextafter(total, 0)): one ulp below a positive total
            below = (total.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
            target = tl.minimum(us * total, below)
            # pass 3: searchsorted(cdf, target, right=True) = how many CDF entries are <= target
            carry = tl.zeros([], tl.float64)
            count = 0
            last = 0
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = cols < V
                p = _probs(COND, UNCOND, cols, ok, scale, temperature, kth, m, z, GUIDED)
                if HAS_Q:
                    qv = tl.load(QROW + cols, mask=ok & residual, other=0.0).to(tl.float32)
                else:
                    qv = tl.where(cols == x, 1.0, 0.0)
                w = tl.where(use_res, tl.maximum(p - qv, 0.0) / denom, p)
                w = tl.where(ok, w, 0.0)
                cdf = (carry + tl.cumsum(w.to(tl.float64), 0)).to(tl.float32)
                count += tl.sum((ok & (cdf <= target)).to(tl.int32), 0)
                last = tl.maximum(last, tl.max(tl.where(w > 0, cols, 0), 0))
                carry += tl.sum(w.to(tl.float64), 0)
            tl.store(NEXT_OUT + b, tl.minimum(count, last).to(tl.int64))


def _launch_positions(logits, tokens, q, guidance_scale, temperature, top_k, group):
    B, G = tokens.shape
    V = logits.shape[-1]
    N1 = G + 1
    dev = logits.device
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    tokens = tokens.contiguous()
    q = None if q is None else (q if q.stride(-1) == 1 else q.contiguous())
    f32 = dict(dtype=torch.float32, device=dev)
    m, z, kth = (torch.empty(B * N1, **f32) for _ in range(3))
    a = torch.empty(B, G, **f32)
    best = torch.empty(B * N1, dtype=torch.int64, device=dev)
    emb = None if group is None else group.embeddings.to(device=dev, dtype=torch.float32).contiguous()
    E = 1 if emb is None else emb.shape[1]
    greedy = temperature == 0
    BLOCK = min(triton.next_power_of_2(V), 4096)
    _position_kernel[(B * N1,)](
        logits, tokens, logits if q is None else q, m if emb is None else emb, m, z, kth, a, best,
        B, G, V, E, logits.stride(0), logits.stride(1), tokens.stride(0),
        0 if q is None else q.stride(0), 0 if q is None else q.stride(1), 0 if emb is None else emb.stride(0),
        float(guidance_scale or 0.0), float(temperature or 1.0), int(top_k or 0),
        float(group.p_threshold) if group else 0.0, float(group.d_threshold) if group else 0.0,
        int(group.half_width) if group else 0,
        GUIDED=guidance_scale is not None, GREEDY=greedy, TOP_K=not greedy and top_k is not None and top_k < V,
        HAS_Q=q is not None, GROUPED=group is not None, BLOCK=BLOCK,
        BLOCK_E=triton.next_power_of_2(E), num_warps=8 if BLOCK >= 2048 else 4)
    return logits, tokens, q, m, z, kth, a, best


def guided_accept_triton(logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None = None, *,
                         u_accept: torch.Tensor | None = None, u_sample: torch.Tensor | None = None,
                         guidance_scale: float | None = None, temperature: float = 1.0,
                         top_k: int | None = None, group: Grouping | None = None) -> ChainAcceptance:
    """The Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``); the reference's contract."""
    _check_inputs(logits, tokens, q, u_accept, u_sample, guidance_scale, temperature, top_k, group)
    B, G = tokens.shape
    dev = logits.device
    n = torch.empty(B, dtype=torch.int64, device=dev)
    nxt = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return ChainAcceptance(n, nxt, torch.empty(0, G, device=dev))
    greedy = temperature == 0
    device = torch.cuda.device(dev) if logits.is_cuda else contextlib.nullcontext()
    with device:
        logits, tokens, q, m, z, kth, a, best = _launch_positions(
            logits, tokens, q, guidance_scale, temperature, top_k, group)
        ua = a if greedy else u_accept.to(device=dev, dtype=torch.float32).contiguous()
        us = a if greedy else u_sample.to(device=dev, dtype=torch.float32).contiguous()
        V = logits.shape[-1]
        BLOCK = min(triton.next_power_of_2(V), 4096)
        _chain_kernel[(B,)](
            logits, tokens, logits if q is None else q, a, ua, us, m, z, kth, best, n, nxt,
            B, G, V, logits.stride(0), logits.stride(1), tokens.stride(0),
            0 if q is None else q.stride(0), 0 if q is None else q.stride(1), 0 if greedy else ua.stride(0),
            float(guidance_scale or 0.0), float(temperature or 1.0), 1e-12,
            GUIDED=guidance_scale is not None, GREEDY=greedy, HAS_Q=q is not None, BLOCK=BLOCK,
            BLOCK_G=max(2, triton.next_power_of_2(max(G, 1))), num_warps=8 if BLOCK >= 2048 else 4)
    return ChainAcceptance(n, nxt, a)


def accept_problem(logits: torch.Tensor, q: torch.Tensor | None, top_p: float | None) -> str | None:
    """Why the fused kernel cannot take these inputs (None when it can)."""
    if top_p is not None and top_p < 1:
        return "top-p needs a sort the fused kernel does not do"
    return dtype_problem(logits, q)


def guided_accept(logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None = None, *,
                  u_accept: torch.Tensor | None = None, u_sample: torch.Tensor | None = None,
                  guidance_scale: float | None = None, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, group: Grouping | None = None) -> ChainAcceptance:
    """Fused chain acceptance (module docstring): the Triton kernels on CUDA, the reference
    elsewhere or with top-p (``MMSPEC_KERNELS`` forces either)."""
    kwargs = dict(u_accept=u_accept, u_sample=u_sample, guidance_scale=guidance_scale, temperature=temperature,
                  top_k=top_k, group=group)
    if use_triton("guided acceptance", logits.device, accept_problem(logits, q, top_p),
                  preferred=preferred("guided acceptance")):
        return guided_accept_triton(logits, tokens, q, **kwargs)
    return guided_accept_reference(logits, tokens, q, top_p=top_p, **kwargs)
