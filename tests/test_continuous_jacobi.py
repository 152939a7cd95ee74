"""Speculative Jacobi decoding on densities (``JacobiDensityDrafter``; methods ``sjd`` (fixed
noise per position), ``sjd-mc`` (maximal coupling) and ``sjd-independent``): exactness by the Rosenblatt (PIT) test on the toy AR density model of
``test_continuous_core.py``, broken controls that fail the same test, target passes on a target
whose distribution ignores its context, refused knobs and heads, and the pipeline's
reproducibility and batch rows.

Statistics: seed 0, N = 20,000 rows (classes i % 3), the first 6 tokens (12 coordinates) of
Rosenblatt uniforms under the exact processed target: KS per coordinate (Bonferroni over 12) and a
chi-square on the 3**6-cell grid of every token's first coordinate (dependence between tokens, as
the bench's ``pit_exact_p``), >= 1e-3 (``P_THRESHOLD``) for a correct drafter, < 1e-3 for a
broken one at the same seed and N. Window 4 over 6 tokens exercises every kind of draft: fresh
ones from the root's prefill distribution, redrafts coupled with an untested old draft, and fresh
ones at and past the last pass's bonus position.
"""

import dataclasses

import pytest
import torch

from mmspec import methods
from mmspec.core import DensityProcessor, Draw, JacobiDensityDrafter, SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, grid_chisquare_pvalue, ks_uniform_pvalue
from mmspec.core.gate import GatedDrafter, SpeedGate
from mmspec.core.types import Acceptance

from test_continuous_core import GUIDED, N_PIT, PLAIN, generate, rosenblatt, toy_target

# uncapped residuals (the spec's tests): a redraft's q can sit close to p, where 1 / (1 - beta)
# tries has a heavy tail; fallbacks are then impossible, and the tests check tries were made
PLAIN, GUIDED = (dataclasses.replace(p, residual_max_tries=None) for p in (PLAIN, GUIDED))
from test_continuous_pipeline import gen, tiny_pipeline


@pytest.fixture(scope="module")
def target():
    return toy_target()


N_TOKENS, WINDOW = 6, 4


def pit(target, drafter, pipeline=PLAIN, rule=None, seed=0):
    labels = torch.arange(N_PIT) % 3
    out = generate(target, drafter, pipeline, labels, N_TOKENS, seed, rule)
    u = rosenblatt(target, out.sequences, labels, pipeline, N_TOKENS).view(N_PIT, N_TOKENS, -1)
    return min(ks_uniform_pvalue(u.flatten(1)), grid_chisquare_pvalue(u[..., 0])), out.stats


def jacobi(target, coupling="noise", window=WINDOW):
    return JacobiDensityDrafter(target.token_shape, window=window, coupling=coupling)


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("coupling, pipeline", [("maximal", PLAIN), ("maximal", GUIDED), ("independent", PLAIN),
                                                ("noise", PLAIN), ("noise", GUIDED)],
                         ids=["mcsjd", "mcsjd-cfg-linear-T0.9", "sjd", "noise", "noise-cfg-linear-T0.9"])
@pytest.mark.statistical
def test_jacobi_on_densities_passes_the_rosenblatt_test(target, coupling, pipeline):
    """Every coupling keeps the target's law (guided and tempered too); drafts are accepted and
    rejected, fewer target passes than tokens, no residual falls back; only the maximal coupling
    draws from the coupling's residual (on the draft meter)."""
    p, stats = pit(target, jacobi(target, coupling), pipeline)
    assert p >= P_THRESHOLD, p
    assert 0.1 < stats.alpha < 0.95 and stats.tau > 1.1, (stats.alpha, stats.tau)
    assert stats.nfe_per_sample < N_TOKENS  # target passes per row, prefill included
    heads = stats.heads
    assert heads["target"].residual_rows > 0 and heads["target"].residual_fallbacks == 0
    assert heads["draft"].residual_fallbacks == 0
    assert (heads["draft"].residual_rows > 0) == (coupling == "maximal")
    assert stats.draft_forwards == 0  # no draft model


class StaleDraft(JacobiDensityDrafter):
    """Broken: keep every old draft as it is but hand the rule the new q (no coupling test)."""

    def update(self, state, draft, acceptance, target_probs, target_out):
        old = self.draws
        super().update(state, draft, acceptance, target_probs, target_out)
        n = self.window - 1
        pos = acceptance.num_accepted[:, None] + 1 + torch.arange(n)
        held = pos < draft.tokens.shape[1]
        at = pos.clamp(max=draft.tokens.shape[1] - 1)
        rows = torch.arange(pos.shape[0])[:, None]
        stale = torch.where(held[..., None, None], old.token[rows, at], self.draws.token)
        self.draws = Draw(stale, log_prob=self.q.log_prob(Draw(stale)))


class AcceptAll(SpeculativeSampling):
    """Broken: every draft is accepted, then the bonus."""

    def _chain_density(self, draft, p_all, generator):
        B, G = p_all.batch_shape[0], draft.tokens.shape[1]
        return Acceptance(path=torch.arange(G + 1).expand(B, G + 1), num_accepted=torch.full((B,), G),
                          next_token=p_all[:, G].sample(generator).token)


class SlotTiedNoise(JacobiDensityDrafter):
    """Broken: the noise stays with the window's slot instead of the position, so a position is
    drawn with noise that already made (and may have committed) an earlier position's token."""

    def update(self, state, draft, acceptance, target_probs, target_out):
        kept = self.noise
        super().update(state, draft, acceptance, target_probs, target_out)
        B, n = kept.shape[:2]
        self.noise = kept
        flat = self.q[torch.arange(B)[:, None].expand(B, n).reshape(-1), torch.arange(n).repeat(B)]
        x = flat.from_noise(kept.flatten(0, 1))
        self.draws = Draw(x.token.unflatten(0, (B, n)), log_prob=x.log_prob.unflatten(0, (B, n)))


@pytest.mark.statistical
@pytest.mark.parametrize("broken", ["stale-draft", "accept-all", "slot-tied-noise"])
def test_broken_jacobi_fails_the_rosenblatt_test(target, broken):
    """The same seed and N: a stale draft scored under the new q, accepting every draft, and noise
    tied to the window's slot rather than the position, fail."""
    drafter = {"stale-draft": lambda: StaleDraft(target.token_shape, window=WINDOW, coupling="maximal"),
               "slot-tied-noise": lambda: SlotTiedNoise(target.token_shape, window=WINDOW, coupling="noise"),
               "accept-all": lambda: jacobi(target)}[broken]()
    p, _ = pit(target, drafter, rule=AcceptAll() if broken == "accept-all" else None)
    assert p < P_THRESHOLD, p


# -- target passes ----------------------------------------------------------------------------------
def context_free_target():
    """The toy whose mixture head ignores its features (output layer zeroed: every position's
    distribution is the bias's, bit for bit)."""
    model = toy_target()
    with torch.no_grad():
        model.heads["mixture"].net[2].weight.zero_()
    return model


@pytest.mark.parametrize("coupling", ["maximal", "independent", "noise"])
@pytest.mark.parametrize("window", [4, 8])
def test_context_free_target_accepts_every_draft(coupling, window):
    """q is the target's own distribution everywhere, so every draft is accepted: n tokens take the
    prefill plus ceil((n - 1) / window) passes (target-only: n), alpha = 1, tau = window; the
    maximal coupling keeps every old draft (no residual draw)."""
    model, n = context_free_target(), 16
    pipe = DensityProcessor(guidance_scale=2.0)  # constant scale: the same distribution at every index
    out = generate(model, jacobi(model, coupling, window), pipe, [0, 1, 2], n, 0)
    stats = out.stats
    assert stats.target_forwards == 1 + -(-(n - 1) // window)
    assert stats.alpha == 1.0 and stats.tau == window
    assert stats.heads["draft"].residual_rows == 0 and stats.heads["target"].residual_rows == 0
    assert out.sequences.shape == (3, n, 2, 2) and torch.isfinite(out.sequences).all()
    assert generate(model, None, pipe, [0, 1, 2], n, 0).stats.target_forwards == n


# -- refused knobs and heads -----------------------------------------------------------------------
def test_bad_knobs_and_heads_are_refused_naming_the_argument(target):
    with pytest.raises(ValueError, match="sjd_window must be an int >= 2, got 1"):
        methods.resolve("continuous", "sjd", {"sjd_window": 1})
    with pytest.raises(ValueError, match="sjd_coupling must be one of 'independent', 'maximal', 'noise', got 'greedy'"):
        methods.resolve("continuous", "sjd", {"sjd_coupling": "greedy"})
    with pytest.raises(ValueError, match="method must be 'path' with a drafter among sd or none"):
        methods.resolve("continuous", "sjd+path")
    with pytest.raises(ValueError, match="window must be an int >= 2"):
        JacobiDensityDrafter(target.token_shape, window=1)
    with pytest.raises(ValueError, match="coupling must be one of 'independent', 'maximal', 'noise'"):
        JacobiDensityDrafter(target.token_shape, coupling="coupled")
    with pytest.raises(ValueError, match="token_shape must be a non-empty tuple"):
        JacobiDensityDrafter(())
    with pytest.raises(ValueError, match="the head must be one whose tokens are their own draws"):
        generate(target, jacobi(target), DensityProcessor(head="diffusion"), [0], 3, 0)
    recipe = methods.resolve("continuous", "sjd")
    assert recipe.requires == () and recipe.lossless and recipe.knobs == {"sjd_window": 8, "sjd_coupling": "noise"}
    built = methods.build(recipe, {"target": target}).drafter
    assert isinstance(built, JacobiDensityDrafter) and built.window == 8 and built.coupling == "noise"
    assert methods.resolve("continuous", "sjd-independent").configs["sjd"].coupling == "independent"
    assert methods.resolve("continuous", "sjd-mc").configs["sjd"].coupling == "maximal"


# -- the pipeline ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.register_modules(draft_model=None)  # sjd needs the target alone
    return pipe


@pytest.mark.parametrize("method", ["sjd", "sjd-mc", "sjd-independent"])
def test_pipeline_is_reproducible_and_batch_rows_equal_single_rows(pipe, method):
    """CFG on (the pipeline's default 2.0, linear): a fixed generator reproduces a call bit for bit
    and another seed changes it; with a generator list image r of a batch equals that class
    generated alone with generator r to float rounding (as ``test_continuous_pipeline``)."""
    a = pipe(class_labels=[0, 2], method=method, generator=gen(3), output_type="latent")
    b = pipe(class_labels=[0, 2], method=method, generator=gen(3), output_type="latent")
    assert torch.equal(a.latents, b.latents) and a.stats["nfe"] == b.stats["nfe"]
    assert not torch.equal(a.latents, pipe(class_labels=[0, 2], method=method, generator=gen(4),
                                           output_type="latent").latents)
    assert a.stats["draft_nfe"] == 0 and a.stats["residual_fallbacks"] == 0 and a.stats["nfe"] < 16
    classes = [0, 1, 2, 0]
    batch = pipe(class_labels=classes, method=method, generator=[gen(10 + i) for i in range(4)],
                 output_type="latent")
    for i, c in enumerate(classes):
        one = pipe(class_labels=c, method=method, generator=gen(10 + i), output_type="latent")
        torch.testing.assert_close(batch.latents[i], one.latents[0], atol=1e-4, rtol=0)


# -- the scores the coupling reuses -----------------------------------------------------------------
class ScoresDropped(SpeculativeSampling):
    """The exact rule, returning no ``log_p``: the Jacobi drafter then scores the old drafts itself."""

    def _chain_density(self, draft, p_all, generator):
        return dataclasses.replace(super()._chain_density(draft, p_all, generator), log_p=None)


def test_coupling_reuses_the_rules_scores_bit_for_bit(target):
    """The rule's float64 log p of every draft (``Acceptance.log_p``) is what the maximal coupling
    would compute itself: 200 rows of 6 tokens come out identical either way."""
    labels = torch.arange(200) % 3
    reused = generate(target, jacobi(target, "maximal"), PLAIN, labels, N_TOKENS, 3)
    recomputed = generate(target, jacobi(target, "maximal"), PLAIN, labels, N_TOKENS, 3, ScoresDropped())
    assert torch.equal(reused.sequences, recomputed.sequences)
    assert reused.stats.alpha == recomputed.stats.alpha


def test_residual_reports_the_targets_log_density_of_its_draws(target):
    """``Residual.sample_with_log_p`` returns log p of each token it emits (what a Jacobi redraft
    records as its q), and the same tokens as ``sample`` from the same generator."""
    from mmspec.core import DensityProcessor as DP
    from mmspec.core.types import ModelOutput

    z = torch.randn(2, 4, target.config.dim, generator=gen(0), dtype=torch.float64)
    dists = DP()(ModelOutput(logits=None, cond=z, heads=target.heads), torch.ones(2, 4, dtype=torch.long), 8)
    p, q = dists[:, 0], dists[:, 1]
    draw, log_p = p.residual(q).sample_with_log_p(torch.Generator().manual_seed(1))
    torch.testing.assert_close(log_p, p.log_prob(draw), rtol=0, atol=1e-9)
    assert torch.equal(draw.token, p.residual(q).sample(torch.Generator().manual_seed(1)).token)


def test_a_mixture_draw_is_a_function_of_its_noise(target):
    """``GaussianMixture.sample(g) == from_noise(noise(g))`` bit for bit (what the noise coupling
    relies on, with the old random stream kept), the same noise gives the same draw, and a
    distribution without noise refuses by name."""
    from mmspec.core import DensityProcessor as DP, TokenDist
    from mmspec.core.types import ModelOutput

    z = torch.randn(3, 5, target.config.dim, generator=gen(0), dtype=torch.float64)
    q = DP(guidance_scale=None)(ModelOutput(logits=None, cond=z, heads=target.heads),
                                torch.ones(3, 5, dtype=torch.long), 8)[:, 2]
    a = q.sample(torch.Generator().manual_seed(5))
    noise = q.noise(torch.Generator().manual_seed(5))
    b = q.from_noise(noise)
    assert torch.equal(a.token, b.token) and torch.equal(a.log_prob, b.log_prob)
    assert torch.equal(q.from_noise(noise).token, b.token)
    torch.testing.assert_close(b.log_prob, q.log_prob(b), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="has no noise/from_noise"):
        TokenDist.noise(q)


# -- method="auto"'s gate on densities -----------------------------------------------------------
class PeekingDensityGate(GatedDrafter):
    """Broken: decides from its own drafts, as ``tests/test_auto.py``'s token gate does: a draft
    with a positive first coordinate is handed to the rule mirrored (its q left as it was)."""

    def propose(self, state):
        draft = super().propose(state)
        if draft.tokens.shape[1]:
            first = draft.tokens[:, :, :, 0]  # both rows (state, latent) of each drafted token
            first.copy_(-first.abs())
        return draft


@pytest.mark.statistical
@pytest.mark.parametrize("gate_cls, coupling, lossless", [(GatedDrafter, "maximal", True), (GatedDrafter, "noise", True),
                                                      (PeekingDensityGate, "maximal", False)],
                         ids=["mcsjd", "noise", "peeking"])
def test_gated_jacobi_on_densities_keeps_the_law(target, gate_cls, coupling, lossless):
    """``method="auto"``'s gate (``GatedDrafter``) around MC-SJD and SJD's noise coupling on
    densities flips drafting every pass (c_on >> c_off, margin 0, probe 1), so tokens come from
    passes with and without drafts: the Rosenblatt test above (seed 0, N = 20,000, p >= 1e-3)
    passes with no residual falling back at the 1,000-try cap; the peeking gate fails it."""
    gate = gate_cls(jacobi(target, coupling), SpeedGate(c_on=1e3, c_off=1.0, every=1, probe=1))
    capped = dataclasses.replace(PLAIN, residual_max_tries=1000)  # the peeking gate's residuals can take forever
    p, stats = pit(target, gate, capped)
    if lossless:
        assert gate.log.passes_on > 0 and gate.log.passes_off > 0
        assert stats.heads["target"].residual_fallbacks == 0 and stats.heads["draft"].residual_fallbacks == 0
    assert (p >= P_THRESHOLD) == lossless, f"p={p:.2e}"
