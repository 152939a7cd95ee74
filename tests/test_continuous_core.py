"""Continuous tokens through the one loop (``SpeculativeDecoder.generate``): the exact residual
sampler, what the seams refuse and why, the mixture head's probability-integral-transform test,
and reproducibility.

Toy (shared with ``test_continuous_heads.py``): a float64 ``ContinuousARModel`` (d = 2, one
layer, 3 classes) whose mixture head's output layer is scaled up so tokens depend strongly on
their prefix, and whose diffusion network is an analytic epsilon (``AnalyticEps``: a Gaussian
denoiser plus a fixed random nonlinearity) on K = 6 steps; the draft is a seeded perturbation of
every part (and, for the diffusion head, an offset at the last step only).

Statistics: seeds stated per test; a correct rule passes at p >= 1e-3 (``P_THRESHOLD``), a broken
control must fall below it at the same seed and sample count.
"""

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from mmspec.core import (DensityProcessor, Draw, GreedyMatch, HeadMeter, JacobiDrafter, LogitsProcessor,
                         ModelChainDrafter, ModelOutput, ModelTreeDrafter, NextSetSchedule, Residual,
                         SpeculativeDecoder, SpeculativeSampling, TokenDist)
from mmspec.core.acceptance import check_chain
from mmspec.core.distributions import normal_log_prob
from mmspec.core.exactness import P_THRESHOLD, ks_uniform_pvalue, pit_pvalue
from mmspec.core.sampling import rand, randn, sample, select_rows
from mmspec.core.tree import DraftTree, Tree
from mmspec.core.types import Acceptance
from mmspec.models.continuous import ContinuousARModel

TIMESTEPS = [60, 200, 350, 500, 650, 800]
NULL = 3  # the toy's null class


# -- the toy pair ---------------------------------------------------------------------------------
class AnalyticEps(nn.Module):
    """A diffusion head's network with a closed form: ``eps = sqrt(1 - ab_t) (x - sqrt(ab_t) M z)
    + a tanh(W x + U z)`` (the Gaussian denoiser of N(M z, I) plus a fixed random nonlinearity),
    ``+ last`` at train step ``last_t`` only; learned-range output ``tanh(V z) / 2``."""

    def __init__(self, d, H, alphas_cumprod, seed, a=0.5, last_t=TIMESTEPS[0]):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def r(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)

        self.M = nn.Parameter(r(H, d) * 2.0 / H ** 0.5)
        self.W = nn.Parameter(r(d, d))
        self.U = nn.Parameter(r(H, d) / H ** 0.5)
        self.V = nn.Parameter(r(H, d) / H ** 0.5)
        self.last = nn.Parameter(torch.zeros(d, dtype=torch.float64))
        self.ab, self.a, self.last_t = alphas_cumprod, a, last_t

    def forward(self, x, t, z):
        ab = self.ab[t][:, None]
        eps = (1 - ab).sqrt() * (x - ab.sqrt() * (z @ self.M)) + self.a * torch.tanh(x @ self.W + z @ self.U)
        eps = eps + (t == self.last_t)[:, None] * self.last
        return torch.cat([eps, torch.tanh(z @ self.V) / 2], -1)


def toy_target(seed=0):
    torch.manual_seed(seed)
    model = ContinuousARModel(token_dim=2, grid_size=2, num_classes=3, dim=16, n_layers=1, n_heads=2, mlp_hidden=32,
                              initializer_range=0.5, mixture_components=3, mixture_hidden=16, diffusion_width=16,
                              diffusion_blocks=1, diffusion_timesteps=TIMESTEPS).double().eval()
    with torch.no_grad():
        model.heads["mixture"].net[2].weight.mul_(3.0)  # means that move with the prefix
    diffusion = model.heads["diffusion"]
    diffusion.net = AnalyticEps(2, 16, diffusion.schedule.train_alphas_cumprod, seed + 5)
    return model


def toy_draft(target, seed=1, backbone=0.07, mixture=0.5, diffusion=0.2, last=2.0):
    """A perturbed copy: relative noise per part; the diffusion head also moves its last step."""
    draft = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("net.last"):
                p.fill_(last)
                continue
            scale = mixture if name.startswith("heads.mixture") else diffusion if name.startswith(
                "heads.diffusion") else backbone
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return draft


@pytest.fixture(scope="module")
def pair():
    target = toy_target()
    return target, toy_draft(target)


def generate(target, drafter, pipeline, labels, n, seed, rule=None, **kw):
    """n tokens for every label (one row each), CFG halves when the pipeline guides."""
    labels = torch.as_tensor(labels)
    dec = SpeculativeDecoder(target, drafter, rule=rule, processor=pipeline)
    uncond = torch.full((len(labels), 1), NULL) if pipeline.uses_guidance else None
    gen = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    return dec.generate(labels[:, None], n, generator=gen, uncond_input_ids=uncond, **kw)


# -- the exact residual sampler, alone ------------------------------------------------------------
@dataclass
class Mix1D(TokenDist):
    """The smallest TokenDist: a 1-D Gaussian mixture per row (weights w, means m, stds s (n, M))."""

    w: torch.Tensor
    m: torch.Tensor
    s: torch.Tensor
    meter: HeadMeter | None = None
    max_tries: int | None = None

    token_shape = (1,)
    token_dtype = torch.float64

    def _batch_ndim(self):
        return self.w.dim() - 1

    def sample(self, generator=None):
        n = self.w.shape[0]
        k = sample(self.w, generator)
        rows = torch.arange(n)
        x = self.m[rows, k] + self.s[rows, k] * randn((n,), generator, dtype=torch.float64)
        draw = Draw(x[:, None])
        draw.log_prob = self.log_prob(draw)
        return draw

    def log_prob(self, draw):
        return torch.logsumexp(self.w.log() + normal_log_prob(draw.token, self.m, self.s), -1)


def mix(n, w, m, s, **kw):
    def col(v):
        return torch.tensor(v, dtype=torch.float64).expand(n, len(v))
    return Mix1D(col(w), col(m), col(s), **kw)


def residual_cdf(p, q):
    """(beta, CDF of (p - q)^+ / (1 - beta)) by the trapezoid rule on [-15, 15], 300,001 points."""
    x = torch.linspace(-15, 15, 300_001, dtype=torch.float64)
    draw = Draw(x[:, None])
    row0 = torch.zeros(len(x), dtype=torch.long)
    dp, dq = p[row0].log_prob(draw).exp(), q[row0].log_prob(draw).exp()
    r = (dp - dq).clamp(min=0)
    h = float(x[1] - x[0])
    beta = float(torch.minimum(dp, dq).sum() * h)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((r[1:] + r[:-1]) * h / 2, 0)])
    cum = cum / cum[-1]

    def cdf(v):
        import numpy as np

        return np.interp(v, x.numpy(), cum.numpy())

    return beta, cdf


P_ARGS = ([0.6, 0.4], [-1.0, 1.5], [0.5, 0.8])  # p: two components
Q_ARGS = ([1.0], [0.0], [1.0])  # q: a standard normal


@pytest.mark.statistical
def test_residual_sampler_matches_the_residual_density():
    """Seed 0, N = 200,000 rejections: the draws' KS p-value against the numerically integrated
    residual CDF is >= 1e-3, tries per rejection lie in the 99% interval of 1 / (1 - beta)
    (geometric, variance beta / (1 - beta)^2), no fallback without a cap; drawing from p instead
    (the "no residual" control) fails the same KS test."""
    from scipy import stats

    N = 200_000
    meter = HeadMeter()
    p, q = mix(N, *P_ARGS, meter=meter), mix(N, *Q_ARGS)
    beta, cdf = residual_cdf(p, q)
    assert 0.6 < beta < 0.9  # a real residual: neither p nor q
    g = torch.Generator().manual_seed(0)
    y = Residual(p, q, max_tries=None, meter=meter).sample(g).token[:, 0].numpy()
    assert stats.kstest(y, cdf).pvalue >= P_THRESHOLD
    mean = 1 / (1 - beta)
    tries = meter.residual_tries / meter.residual_rows
    assert meter.residual_rows == N and meter.residual_fallbacks == 0
    assert abs(tries - mean) < 2.576 * math.sqrt(beta / (1 - beta) ** 2 / N), (tries, mean)
    plain = p.sample(g).token[:, 0].numpy()
    assert stats.kstest(plain, cdf).pvalue < P_THRESHOLD


def test_residual_cap_falls_back_to_p_and_counts_it():
    """Seed 1, N = 100,000, cap K = 3: a draw falls back with probability beta**K; the count the
    meter reports lies in the binomial 99% interval, and the capped draws are biased (KS fails)."""
    from scipy import stats

    N, K = 100_000, 3
    meter = HeadMeter()
    p, q = mix(N, *P_ARGS), mix(N, *Q_ARGS)
    beta, cdf = residual_cdf(p, q)
    y = Residual(p, q, max_tries=K, meter=meter).sample(torch.Generator().manual_seed(1)).token[:, 0]
    expect = N * beta ** K
    assert abs(meter.residual_fallbacks - expect) < 2.576 * math.sqrt(expect * (1 - beta ** K))
    assert meter.residual_tries <= K * N and torch.isfinite(y).all() and (y != 0).all()
    assert stats.kstest(y.numpy(), cdf).pvalue < P_THRESHOLD
    with pytest.raises(ValueError, match="no closed-form density"):
        Residual(p, q).log_prob(Draw(y[:, None]))
    with pytest.raises(ValueError, match="max_tries must be None"):
        Residual(p, q, max_tries=0)


def test_residual_rows_draw_from_their_own_generators():
    """Row r of a residual draw uses generator r only, and only while it is still trying: a batch
    equals its rows drawn alone, bit for bit."""
    n = 6
    p, q = mix(n, *P_ARGS), mix(n, *Q_ARGS)
    gens = [torch.Generator().manual_seed(s) for s in range(n)]
    batch = Residual(p, q, None).sample(tuple(gens)).token
    alone = torch.cat([Residual(p[i:i + 1], q[i:i + 1], None).sample((torch.Generator().manual_seed(i),)).token
                       for i in range(n)])
    assert torch.equal(batch, alone)


# -- the seams refuse what continuous tokens cannot do, and say why -------------------------------
def test_continuous_seams_refuse_with_the_reason(pair):
    target, draft = pair
    from mmspec.models.llamagen import LlamaGenModel

    with pytest.raises(ValueError, match=r"drafter must be a chain drafter .*1 - beta has no closed form"):
        SpeculativeDecoder(target, _FakeTree(draft))
    with pytest.raises(ValueError, match=r"model must be a token-id model: continuous tokens are drafted in chains"):
        ModelTreeDrafter(draft)
    with pytest.raises(ValueError, match=r"processor must be a DensityProcessor for continuous tokens"):
        SpeculativeDecoder(target, processor=LogitsProcessor())
    with pytest.raises(ValueError, match=r"schedule must be RasterSchedule for continuous tokens"):
        SpeculativeDecoder(target, schedule=NextSetSchedule(2, 2, 1))
    with pytest.raises(ValueError, match=r"rule must be a rule that verifies densities"):
        SpeculativeDecoder(target, ModelChainDrafter(draft), rule=GreedyMatch())
    with pytest.raises(ValueError, match=r"drafter must be a drafter of continuous tokens of shape \(2, 2\)"):
        SpeculativeDecoder(target, JacobiDrafter(8, window=3))
    with pytest.raises(ValueError, match=r"eos_token_id must be None for continuous tokens"):
        SpeculativeDecoder(target).generate([[0]], 2, eos_token_id=1)
    torch.manual_seed(0)
    ids = LlamaGenModel(vocab_size=16, grid_size=2, num_classes=2, dim=16, n_layers=1, n_heads=2, mlp_hidden=32)
    with pytest.raises(ValueError, match=r"processor must be a LogitsProcessor for a token-id target"):
        SpeculativeDecoder(ids, processor=DensityProcessor())
    with pytest.raises(ValueError, match=r"drafter must be a drafter of token ids"):
        SpeculativeDecoder(ids, ModelChainDrafter(draft))
    with pytest.raises(ValueError, match=r"head must be one of the model's heads \(mixture, diffusion\)"):
        generate(target, None, DensityProcessor(head="flow"), [0], 2, 0)
    for bad, match in (({"temperature": 0.0}, "temperature must be a float > 0"),
                       ({"guidance_schedule": "cosine"}, "guidance_schedule must be one of 'constant', 'linear'"),
                       ({"residual_max_tries": 0}, "residual_max_tries must be None")):
        with pytest.raises(ValueError, match=match):
            DensityProcessor(**bad)


class _FakeTree(ModelTreeDrafter):
    """A tree drafter over a continuous model, built past ModelTreeDrafter's own check."""

    def __init__(self, model):
        self.runner = type("Runner", (), {"forwards": 0})()
        self.vocab_size, self.token_shape, self.max_block = None, model.token_shape, 3


def test_a_tree_of_continuous_drafts_is_refused_by_the_rule(pair):
    """A custom drafter that sneaks a tree past the decoder's checks meets the rule's reason."""
    target, _ = pair

    class Forked(ModelChainDrafter):
        def propose(self, state):
            B = state.batch_size
            tokens = state.roots[:, None].repeat(1, 2, 1, 1)
            return DraftTree(tokens, Tree(torch.zeros(B, 2, dtype=torch.long), max_depth=1, max_children=2))

    with pytest.raises(ValueError, match="continuous tokens need chain drafts, got a tree: .*1 - beta"):
        generate(target, Forked(target), DensityProcessor(), [0], 3, 0)


def test_linear_guidance_schedule_is_mars():
    """MAR's ``cfg_schedule="linear"``: the token with generated index j of N uses 1 + (s-1)(j+1)/N."""
    pipe = DensityProcessor(guidance_scale=4.0, guidance_schedule="linear")
    s = pipe.scales(torch.tensor([[0, 1, 2, 3, 9]]), 4)
    assert torch.allclose(s, torch.tensor([[1.75, 2.5, 3.25, 4.0, 4.0]], dtype=torch.float64))
    assert torch.equal(DensityProcessor(guidance_scale=4.0).scales(torch.tensor([[0, 3]]), 4),
                       torch.full((1, 2), 4.0, dtype=torch.float64))


# -- the mixture head: Rosenblatt / probability-integral-transform test ---------------------------
class NoResidual(SpeculativeSampling):
    """Broken: after a rejection, draw from p instead of (p - q)^+ / (1 - beta)."""

    def reject(self, p, q, x):
        return p


class KeepTesting(SpeculativeSampling):
    """Broken (CSpD's loop): every drafted token is tested on its own, a rejected one is replaced
    by a residual draw in place, later drafts are kept when their own test passes, then the bonus."""

    def _chain_density(self, draft, p_all, generator):
        check_chain(draft)
        B, G = p_all.batch_shape[0], draft.tokens.shape[1]
        x = draft.draws
        logp, emitted = self.score(p_all[:, :G], x)
        ok = rand((B, G), generator, p_all.device, torch.float64).log() < (logp - x.log_prob).clamp(max=0)
        tokens = emitted.clone()
        rows = torch.arange(B)
        for j in range(G):
            r = rows[~ok[:, j]]
            at = torch.full_like(r, j)
            if r.numel():
                tokens[r, j] = p_all[r, at].residual(draft.q[r, at]).sample(select_rows(generator, r)).token
        return Acceptance(path=torch.arange(G + 1).expand(B, G + 1), num_accepted=torch.full((B,), G),
                          next_token=p_all[:, G].sample(generator).token, tokens=tokens)


N_PIT, N_TOKENS = 20_000, 3
PLAIN = DensityProcessor()
GUIDED = DensityProcessor(temperature=0.9, guidance_scale=2.0, guidance_schedule="linear")


def rosenblatt(target, sequences, labels, pipeline, n):
    """(N, n * d) uniforms: each generated latent's Rosenblatt transform under the processed target
    (guided, tempered), computed from scratch by the reference (cache-free) forward."""
    toks = sequences[:, :n]  # (N, n, 2, d)
    d = toks.shape[-1]
    prefix = toks[:, :-1]

    def feats(cls):
        ids = torch.cat([torch.as_tensor(cls, dtype=toks.dtype)[:, None, None, None].expand(-1, 1, 2, d), prefix], 1)
        return target(ids)

    out = feats(labels)
    if pipeline.uses_guidance:
        out = ModelOutput(logits=None, cond=torch.cat([out.cond, feats(torch.full_like(labels, NULL)).cond]),
                          heads=out.heads)
    dist = pipeline(out, torch.arange(n).expand(len(labels), n), n)
    return dist.rosenblatt(toks[..., 1, :]).reshape(len(labels), -1)


def pit(pair, pipeline, rule=None, warmup=0.0, seed=0):
    target, draft = pair
    labels = torch.arange(N_PIT) % 3
    out = generate(target, ModelChainDrafter(draft, gamma=2, warmup=warmup), pipeline, labels, N_TOKENS, seed, rule)
    return pit_pvalue(rosenblatt(target, out.sequences, labels, pipeline, N_TOKENS)), out.stats


@pytest.mark.parametrize("pipeline, warmup", [(PLAIN, 0.0), (GUIDED, 0.0), (PLAIN, 0.34)],
                         ids=["plain", "cfg-linear-T0.9", "warmup"])
@pytest.mark.statistical
def test_mixture_sd_passes_the_rosenblatt_test(pair, pipeline, warmup):
    """Seed 0, N = 20,000 rows (classes i % 3), first 3 tokens (6 coordinates): KS per coordinate
    (Bonferroni) and a chi-square on the 3**6-cell grid of the joint, both >= 1e-3 (``pit_pvalue``);
    drafts were accepted and rejected; no residual fell back."""
    p, stats = pit(pair, pipeline, warmup=warmup)
    assert p >= P_THRESHOLD, p
    assert 0.2 < stats.alpha < 0.9 and stats.tau > 1.2
    assert stats.heads["target"].residual_rows > 0 and stats.heads["target"].residual_fallbacks == 0


@pytest.mark.statistical
@pytest.mark.parametrize("rule", [NoResidual, KeepTesting])
def test_broken_rules_fail_the_rosenblatt_test(pair, rule):
    """The same seed and N: "no residual" and "keep testing after the first rejection" fail."""
    p, _ = pit(pair, PLAIN, rule=rule())
    assert p < P_THRESHOLD, p


def test_the_target_alone_passes_and_warmup_drafts_nothing_first(pair):
    """Target-only decoding passes the same test (the transform is right); with warm-up 0.34 of 3
    tokens the first two tokens come from single-token passes and drafting starts afterwards."""
    target, draft = pair
    labels = torch.arange(N_PIT) % 3
    out = generate(target, None, PLAIN, labels, N_TOKENS, 0)
    assert pit_pvalue(rosenblatt(target, out.sequences, labels, PLAIN, N_TOKENS)) >= P_THRESHOLD
    seen = []

    def spy(step, state):
        seen.append(int(state.lengths[0]) - 1)

    warm = generate(target, ModelChainDrafter(draft, gamma=2, warmup=0.34), PLAIN, [0, 1], 4, 1, callback=spy)
    assert seen[0] == 2 and warm.stats.accept_lengths[0].tolist() == [1, 1]  # token 2 from the target alone
    assert warm.stats.draft_forwards >= 1


# -- reproducibility ------------------------------------------------------------------------------
METHODS = {
    "sd": (DensityProcessor(guidance_scale=2.0, guidance_schedule="linear"), None),
    "path": (DensityProcessor(guidance_scale=2.0, guidance_schedule="linear", head="diffusion"), None),
}


@pytest.mark.parametrize("name", ["sd", "path", "cspd"])
def test_fixed_generator_reproduces_and_batch_rows_match_single_rows(pair, name):
    """With a fixed generator a call is reproducible bit for bit. A batch of 4 rows (classes
    0, 1, 2, 0) with generators [g_0 .. g_3] equals the four rows decoded alone with g_b *up to
    float rounding*: every random number is drawn per row (the draws match bit for bit), but batched
    matmuls round differently from single-row ones, so latents agree to < 1e-12 (float64) and every
    row takes the same accept decisions. In distribution they are equal."""
    from mmspec.core import CSpDAcceptance

    target, draft = pair
    pipeline, rule = METHODS.get(name, (METHODS["path"][0], CSpDAcceptance(42.0)))

    def run(labels, seeds):
        return generate(target, ModelChainDrafter(draft, gamma=3), pipeline, labels, 4,
                        [torch.Generator().manual_seed(s) for s in seeds], rule)

    a, b = run([0, 1, 2, 0], [11, 12, 13, 14]), run([0, 1, 2, 0], [11, 12, 13, 14])
    assert torch.equal(a.sequences, b.sequences)
    for i, (label, seed) in enumerate(zip([0, 1, 2, 0], [11, 12, 13, 14])):
        alone = run([label], [seed])
        assert (a.sequences[i] - alone.sequences[0]).abs().max() < 1e-12
        steps = alone.stats.accept_lengths[:, 0]
        assert torch.equal(a.stats.accept_lengths[: len(steps), i], steps)


def test_stats_count_head_work(pair):
    """Target-only with the diffusion head: n tokens cost n * K head calls of B rows (2B guided);
    ``as_dict`` reports head work, residual draws and alpha for continuous tokens."""
    target, _ = pair
    K, B, n = len(TIMESTEPS), 3, 4
    out = generate(target, None, METHODS["path"][0], [0, 1, 2], n, 0)
    d = out.stats.as_dict()
    assert (d["target_head_calls"], d["target_head_rows"]) == (n * K, n * K * 2 * B)
    assert d["draft_head_calls"] == 0 and d["residual_rows"] == 0 and math.isnan(d["alpha"])
    assert out.sequences.shape == (B, n, 2, 2) and out.sequences.dtype == torch.float64
    assert torch.isfinite(out.sequences).all()
