"""The continuous heads and the model: the mixture head's guided densities, the diffusion schedule
and network, the diffusion head's ``path`` rule against target-only sampling (two-sample tests)
with its broken controls and CSpD's rule, the backbone's cache, training losses, and the
``continuous`` methods of the registry.

Two-sample tests (``two_sample_pvalue``): seed 1 for the target-only arm, seed 2 for the method,
N = 20,000 rows each (classes i % 3), the latents of the first 2 tokens (4 coordinates): KS per
coordinate (Bonferroni) and a chi-square homogeneity test on 3**4 pooled-quantile cells; a
lossless rule passes at p >= 1e-3, a broken one falls below it. Toy pair: ``test_continuous_core``.
"""

import copy
import math

import pytest
import torch

from mmspec import methods
from mmspec.core import (CSpDAcceptance, DensityProcessor, HeadMeter, ModelChainDrafter, SpeculativeDecoder,
                         SpeculativeSampling)
from mmspec.core.exactness import P_THRESHOLD, pit_pvalue, two_sample_pvalue
from mmspec.models.continuous import ContinuousARModel
from mmspec.models.continuous_heads import (DiffusionHead, DiffusionSchedule, GaussianMixture, GaussianMixtureHead,
                                            SimpleMLPAdaLN)
from test_continuous_core import NULL, TIMESTEPS, generate, toy_draft, toy_target


@pytest.fixture(scope="module")
def pair():
    target = toy_target()
    return target, toy_draft(target)


# -- the mixture head -----------------------------------------------------------------------------
def test_guided_mixture_is_the_normalised_product():
    """Per component and dimension, ``GaussianMixture.guided`` is ``p_c^s p_u^(1-s)`` renormalised
    (checked on a grid), and keeps the conditional component where the product does not normalise."""
    x = torch.linspace(-12, 12, 200_001, dtype=torch.float64)
    mu_c, sig_c, mu_u, sig_u = 0.7, 0.8, -0.4, 1.3
    for s in (0.0, 1.0, 2.5, 4.0):
        _, mu, sig = GaussianMixture.guided(
            (torch.zeros(1), torch.tensor([[mu_c]], dtype=torch.float64), torch.tensor([[sig_c]], dtype=torch.float64)),
            (None, torch.tensor([[mu_u]], dtype=torch.float64), torch.tensor([[sig_u]], dtype=torch.float64)),
            torch.tensor(s, dtype=torch.float64))
        logd = s * (-0.5 * ((x - mu_c) / sig_c) ** 2) + (1 - s) * (-0.5 * ((x - mu_u) / sig_u) ** 2)
        w = (logd - logd.max()).exp()
        w = w / w.sum()
        mean = (w * x).sum()
        std = (w * (x - mean) ** 2).sum().sqrt()
        assert abs(float(mu) - float(mean)) < 1e-6 and abs(float(sig) - float(std)) < 1e-6, s
    # s / sig_c^2 < (s - 1) / sig_u^2: the product is not normalisable; the conditional is kept
    _, mu, sig = GaussianMixture.guided(
        (torch.zeros(1), torch.tensor([[mu_c]], dtype=torch.float64), torch.tensor([[2.0]], dtype=torch.float64)),
        (None, torch.tensor([[mu_u]], dtype=torch.float64), torch.tensor([[0.5]], dtype=torch.float64)),
        torch.tensor(3.0, dtype=torch.float64))
    assert float(mu) == mu_c and float(sig) == 2.0


@pytest.mark.statistical
def test_mixture_samples_pass_their_own_rosenblatt_transform_and_temperature_scales_sigma():
    """Seed 0, N = 20,000 draws of a d = 3, M = 4 mixture head's guided, tempered distribution:
    ``rosenblatt`` of its own samples passes ``pit_pvalue`` (>= 1e-3); T multiplies every std."""
    torch.manual_seed(0)
    head = GaussianMixtureHead(8, 3, components=4, hidden=16).double().requires_grad_(False)
    with torch.no_grad():
        head.net[2].weight.mul_(4.0)
    z = torch.randn(2, 8, dtype=torch.float64)
    cond, uncond = z[:1].expand(20_000, 8), z[1:].expand(20_000, 8)
    scale = torch.full((20_000,), 2.0, dtype=torch.float64)
    meter = HeadMeter()
    dist = head.distribution(cond, uncond, scale, DensityProcessor(temperature=0.8), meter)
    draw = dist.sample(torch.Generator().manual_seed(0))
    assert draw.token.shape == (20_000, 2, 3) and torch.equal(draw.token[:, 0], draw.token[:, 1])  # b = 0
    assert pit_pvalue(dist.rosenblatt(draw.token[:, 1])) >= P_THRESHOLD
    assert (meter.calls, meter.rows) == (1, 40_000)
    cold = head.distribution(cond[:2], uncond[:2], scale[:2], DensityProcessor(temperature=1.0), None)
    assert torch.allclose(dist.sigma[:2], 0.8 * cold.sigma)
    assert torch.allclose(dist.log_prob(draw)[:5], dist[:5].latent_log_prob(draw.token[:5, 1]))
    assert torch.equal(dist.log_prob(draw), draw.log_prob)


def test_mixture_state_kernel_and_nll():
    """With a kernel (a, b), the state is a x_0 + b eps and the joint density adds its Gaussian;
    ``nll`` is minus the unguided, untempered mixture log-density (what training minimises)."""
    torch.manual_seed(1)
    head = GaussianMixtureHead(4, 2, components=2, hidden=8).double().requires_grad_(False)
    head.state_kernel = (0.9, 0.3)
    z = torch.randn(50_000, 4, dtype=torch.float64)
    dist = head.distribution(z, None, None, DensityProcessor(), None)
    draw = dist.sample(torch.Generator().manual_seed(0))
    state, latent = draw.token.unbind(-2)
    resid = (state - 0.9 * latent) / 0.3
    assert abs(float(resid.mean())) < 0.02 and abs(float(resid.std()) - 1) < 0.02
    kernel = (-0.5 * resid ** 2 - math.log(0.3) - 0.5 * math.log(2 * math.pi)).sum(-1)
    assert torch.allclose(dist.log_prob(draw), dist.latent_log_prob(latent) + kernel)
    assert torch.allclose(head.nll(z[:7], latent[:7]), -dist[:7].latent_log_prob(latent[:7]))


# -- the diffusion schedule and network -----------------------------------------------------------
def test_schedule_respaces_like_iddpm_and_ends_in_the_clean_estimate():
    S = DiffusionSchedule(1000, 20)
    assert S.timesteps.tolist() == [0, 53, 105, 158, 210, 263, 315, 368, 421, 473, 526, 578, 631, 684, 736, 789,
                                    841, 894, 946, 999]  # IDDPM's space_timesteps(1000, [20])
    assert float(S.coef_x0[0]) == pytest.approx(1.0) and float(S.coef_xt[0]) == 0.0  # index 0 emits x0_hat
    a, b = S.state_kernel
    assert a ** 2 + b ** 2 == pytest.approx(1.0) and 0.006 < b < 0.0065  # sigma_0 of the cosine schedule
    # the posterior mean interpolates x_0 and x_k: exact for x_k = sqrt(ab) x_0 (no noise)
    x0 = torch.randn(5, dtype=torch.float64)
    for k in (1, 7, 19):
        xk = S.alphas_cumprod[k].sqrt() * x0
        mean = S.coef_x0[k] * x0 + S.coef_xt[k] * xk
        assert torch.allclose(mean, S.alphas_cumprod[k - 1].sqrt() * x0)
    with pytest.raises(ValueError, match="timesteps must be strictly increasing ints"):
        DiffusionSchedule(1000, timesteps=[5, 5, 9])


def test_simple_mlp_adaln_starts_at_zero_and_a_zero_head_denoises_by_rescaling():
    """MAR's initialisation zeroes the output; epsilon 0 gives ``x0_hat = x / sqrt(ab)``."""
    net = SimpleMLPAdaLN(3, 16, 6, 8, 2)
    x, t, z = torch.randn(4, 3), torch.tensor([0, 10, 500, 999]), torch.randn(4, 8)
    assert torch.equal(net(x, t, z), torch.zeros(4, 6))
    head = DiffusionHead(3, 8, width=16, blocks=1, sampling_steps=5)
    k = torch.tensor([0, 1, 2, 4])
    x0, mean, log_var = head.guided_step(x, k, z)
    S = head.schedule
    assert torch.allclose(x0, x.double() / S.alphas_cumprod[k].sqrt()[:, None])
    assert torch.allclose(log_var, (S.log_var_max[k] + S.log_var_min[k])[:, None].expand(4, 3) / 2)  # v = 0


# -- the diffusion head through the loop: the path rule -------------------------------------------
class DraftLastStep(SpeculativeSampling):
    """Broken: emit the draft's own last step on an accepted path."""

    def score(self, p, x):
        return p.score(x)[0], x.token


class NoResidual(SpeculativeSampling):
    """Broken: after a rejection, draw from p."""

    def reject(self, p, q, x):
        return p


N_TWO = 20_000
DIFFUSION = DensityProcessor(head="diffusion")
DIFFUSION_CFG = DensityProcessor(head="diffusion", guidance_scale=2.0, guidance_schedule="linear")


def latents(out):
    return out.sequences[:, :2, 1, :].reshape(out.sequences.shape[0], -1)  # (N, 2 tokens * d)


@pytest.fixture(scope="module")
def reference(pair):
    """Target-only samples (seed 1), plain and guided."""
    target, _ = pair
    labels = torch.arange(N_TWO) % 3
    return {p: latents(generate(target, None, p, labels, 2, 1)) for p in (DIFFUSION, DIFFUSION_CFG)}


def two_sample(pair, reference, pipeline, rule=None):
    target, draft = pair
    out = generate(target, ModelChainDrafter(draft, gamma=2), pipeline, torch.arange(N_TWO) % 3, 2, 2, rule)
    return two_sample_pvalue(reference[pipeline], latents(out)), out.stats


@pytest.mark.statistical
@pytest.mark.parametrize("pipeline", [DIFFUSION, DIFFUSION_CFG], ids=["plain", "cfg-linear"])
def test_path_rule_matches_target_only_sampling(pair, reference, pipeline):
    """The path rule passes the two-sample test; drafts were accepted (alpha > 0.2) and rejected,
    and no residual fell back (cap 1000)."""
    p, stats = two_sample(pair, reference, pipeline)
    assert p >= P_THRESHOLD, p
    assert 0.2 < stats.alpha < 0.9 and stats.heads["target"].residual_rows > 0
    assert stats.heads["target"].residual_fallbacks == 0


@pytest.mark.parametrize("rule", [DraftLastStep(), NoResidual(), CSpDAcceptance(42.0)],
                         ids=["draft-last-step", "no-residual", "cspd-42"])
@pytest.mark.statistical
def test_broken_and_lossy_rules_fail_the_two_sample_test(pair, reference, rule):
    p, _ = two_sample(pair, reference, DIFFUSION, rule)
    assert p < P_THRESHOLD, p


def test_path_density_is_the_samplers_and_a_head_scores_its_own_last_step(pair):
    """A distribution scoring its own draw reproduces the sampler's log-density (float64) and
    emits the drawn token itself; the draft's head scores a different path density and emits
    its own (different) last step."""
    target, draft = pair
    z = torch.randn(5, 16, dtype=torch.float64)
    p = target.heads["diffusion"].distribution(z, None, None, DIFFUSION, None)
    q = draft.heads["diffusion"].distribution(z, None, None, DIFFUSION, None)
    x = q.sample(torch.Generator().manual_seed(0))
    assert x.aux["path"].shape == (5, len(TIMESTEPS), 2) and x.aux["noise"].shape == (5, len(TIMESTEPS), 2)
    logq, same = q.score(x)
    assert torch.allclose(logq, x.log_prob, rtol=0, atol=1e-9) and torch.allclose(same, x.token, atol=1e-12)
    logp, emitted = p.score(x)
    assert not torch.allclose(logp, logq) and torch.equal(emitted[:, 0], x.token[:, 0])
    assert (emitted[:, 1] - x.token[:, 1]).abs().min() > 1e-3  # F_p(x_0) != F_q(x_0)


def test_cspd_inner_temperature_and_counted_fallbacks(pair):
    """CSpD's test at tau = 1 accepts less than at tau = 42 (its relaxation knob); with one
    residual try most corrections fall back, the meter says how many, and the fallback emits the
    target's aligned output, never zeros. Seed 3, 2,000 rows, 3 tokens."""
    target, draft = pair
    labels = torch.arange(2000) % 3
    run = lambda rule: generate(target, ModelChainDrafter(draft, gamma=2), DIFFUSION, labels, 3, 3, rule)  # noqa: E731
    strict, loose = run(CSpDAcceptance(1.0)), run(CSpDAcceptance(42.0))
    assert strict.stats.alpha < loose.stats.alpha - 0.2
    capped = run(CSpDAcceptance(1.0, max_tries=1)).stats.heads["target"]
    assert capped.residual_rows > 0 and 0 < capped.residual_fallbacks <= capped.residual_rows
    assert capped.residual_tries == capped.residual_rows
    with pytest.raises(ValueError, match="inner_temperature must be a float > 0"):
        CSpDAcceptance(0.0)
    with pytest.raises(ValueError, match=r"p_all must be a TokenDist with aligned\(draw\)"):
        generate(target, ModelChainDrafter(draft, gamma=2), DensityProcessor(), [0], 3, 0, CSpDAcceptance())


# -- the backbone ---------------------------------------------------------------------------------
def test_cached_decoding_equals_the_reference_forward(pair):
    """A token block fed through the KV cache gives the cache-free forward's features."""
    target, _ = pair
    toks = torch.randn(2, 4, 2, 2, dtype=torch.float64)
    toks[:, 0] = torch.tensor([1.0, 2.0])[:, None, None]  # class ids at position 0
    ref = target(toks).cond
    cache = target.new_cache(2, 8)
    first = target(toks[:, :2], torch.arange(2).expand(2, 2), cache).cond
    rest = target(toks[:, 2:], torch.arange(2, 4).expand(2, 2), cache).cond
    assert torch.allclose(torch.cat([first, rest], 1), ref, atol=1e-6)
    assert target.token_shape == (2, 2) and target.token_dtype == torch.float64 and target.vocab_size is None
    with pytest.raises(ValueError, match=r"tokens must be a \(batch, length, 2, 2\) tensor"):
        target(torch.zeros(1, 3, 2))


def test_every_position_reads_its_rows_class_and_the_cache_remembers_it(pair):
    """``class_in`` (zero at init) made non-zero: the class now moves every position's features,
    and a cached decode, whose later passes hold no position 0, still equals the cache-free forward
    (each row's class kept from its prompt pass). A cached pass before the prompt pass is refused."""
    target = copy.deepcopy(pair[0])
    toks = torch.randn(2, 4, 2, 2, dtype=torch.float64)
    toks[:, 0] = torch.tensor([1.0, 2.0])[:, None, None]
    before = target(toks).cond
    with torch.no_grad():
        target.class_in.weight.normal_(generator=torch.Generator().manual_seed(0))
    ref = target(toks).cond
    assert (ref - before)[:, 1:].abs().amin() > 0  # every token position moved, not only position 0
    cache = target.new_cache(2, 8)
    parts = [target(toks[:, :1], torch.zeros(2, 1, dtype=torch.long), cache).cond]
    parts += [target(toks[:, j:j + 1], torch.full((2, 1), j), cache).cond for j in range(1, 4)]
    assert torch.allclose(torch.cat(parts, 1), ref, atol=1e-6)
    other = toks.clone()
    other[:, 0] = torch.tensor([2.0, 1.0])[:, None, None]  # the classes swapped: other features
    assert not torch.allclose(target(other).cond[:, 1:], ref[:, 1:], atol=1e-3)
    with pytest.raises(ValueError, match="a cached pass came before the prompt pass"):
        target(toks[:, 1:], torch.arange(1, 4).expand(2, 3), target.new_cache(2, 8))
    with pytest.raises(ValueError, match="needs position 0 .the class. in every row"):
        target(toks[:, 1:], torch.arange(1, 4).expand(2, 3))


def test_save_and_load_roundtrip(tmp_path):
    """diffusers' folder layout, safetensors: the reloaded model has the same config, features and
    schedule (rebuilt from the config)."""
    torch.manual_seed(0)
    model = ContinuousARModel(token_dim=2, grid_size=2, num_classes=2, dim=16, n_layers=1, n_heads=2, mlp_hidden=32,
                              diffusion_width=16, diffusion_blocks=1, diffusion_timesteps=TIMESTEPS,
                              id2label={"0": "a red circle", "1": "a blue square"}).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").exists()
    again = ContinuousARModel.from_pretrained(tmp_path, use_safetensors=True).eval()
    toks = torch.randn(1, 3, 2, 2)
    toks[:, 0] = 1.0
    assert torch.equal(again(toks).cond, model(toks).cond) and again.config.id2label == model.config.id2label
    assert torch.equal(again.heads["diffusion"].schedule.timesteps, torch.tensor(TIMESTEPS))
    assert again.heads["mixture"].state_kernel == model.state_kernel


def test_losses_train():
    """Twenty Adam steps on a fixed batch of random latents lower both heads' losses (seed 0)."""
    torch.manual_seed(0)
    model = ContinuousARModel(token_dim=3, grid_size=2, num_classes=2, dim=16, n_layers=1, n_heads=2, mlp_hidden=32,
                              mixture_components=2, mixture_hidden=16, diffusion_width=16, diffusion_blocks=1)
    labels = torch.tensor([0, 1, 0, 1])
    lat = torch.randn(4, 4, 3) * 0.5 + labels[:, None, None]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for step in range(20):
        losses = model.loss(labels, lat, torch.Generator().manual_seed(step % 2), diffusion_positions=4)
        first = first or {k: float(v.detach()) for k, v in losses.items()}
        opt.zero_grad()
        losses["loss"].backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        last = {k: float(v) for k, v in model.loss(labels, lat, torch.Generator().manual_seed(0), 4).items()}
    assert all(math.isfinite(v) for v in last.values())
    assert last["mixture"] < first["mixture"] and last["loss"] < first["loss"]
    with pytest.raises(ValueError, match=r"latents must be a \(batch, 4, 3\) tensor"):
        model.loss(labels, lat[:, :3])


# -- the registry -----------------------------------------------------------------------------------
def test_continuous_methods_resolve_build_and_run(pair):
    """Every named method builds from (target, draft_model), runs 3 tokens for 2 classes with CFG,
    and declares its head and losslessness; trees and schedules do not compose."""
    target, draft = pair
    assert methods.names("continuous") == ("none", "none-diffusion", "sd", "sd-warmup", "path", "cspd", "sjd",
                                           "sjd-mc", "sjd-independent")
    heads = {}
    for name in methods.names("continuous"):
        recipe = methods.resolve("continuous", name)
        parts = methods.build(recipe, {"target": target, "draft_model": draft})
        head = methods.continuous.head_for(recipe)
        heads[name] = (head, recipe.lossless)
        pipe = DensityProcessor(guidance_scale=2.0, guidance_schedule="linear", head=head)
        dec = SpeculativeDecoder(target, parts.drafter, rule=parts.rule, schedule=parts.schedule, processor=pipe)
        out = dec.generate([[0], [2]], 3, uncond_input_ids=[[NULL]] * 2, generator=torch.Generator().manual_seed(0))
        assert out.sequences.shape == (2, 3, 2, 2) and torch.isfinite(out.sequences).all(), name
    assert heads == {"none": ("mixture", True), "none-diffusion": ("diffusion", True), "sd": ("mixture", True),
                     "sd-warmup": ("mixture", True), "path": ("diffusion", True), "cspd": ("diffusion", False),
                     "sjd": ("mixture", True), "sjd-mc": ("mixture", True),
                     "sjd-independent": ("mixture", True)}
    assert methods.resolve("continuous", "sd-warmup").configs["sd"].warmup == 0.15
    assert methods.resolve("continuous", "cspd", {"cspd_inner_temperature": 10}).configs["cspd"].inner_temperature == 10
    with pytest.raises(ValueError, match="sd_warmup must be a float in \\[0, 0.95\\], got 1.0"):
        methods.resolve("continuous", "sd", {"sd_warmup": 1.0})
    with pytest.raises(ValueError, match="at most one rule"):
        methods.resolve("continuous", "path+cspd")
    other = ContinuousARModel(**{**target.config, "diffusion_timesteps": [60, 400, 800]}).double()
    with pytest.raises(ValueError, match="draft_model's diffusion timesteps must be the target's"):
        methods.build(methods.resolve("continuous", "path"), {"target": target, "draft_model": other})
    shifted = ContinuousARModel(**{**target.config, "diffusion_timesteps": [100, 400, 800]}).double()
    with pytest.raises(ValueError, match="draft_model.state_kernel must be the target's"):
        methods.build(methods.resolve("continuous", "sd"), {"target": target, "draft_model": shifted})
    with pytest.raises(ValueError, match="draw must be a denoising path of this head's 6 steps, got 3"):
        z = torch.zeros(2, 16, dtype=torch.float64)
        x = other.heads["diffusion"].distribution(z, None, None, DIFFUSION, None).sample()
        target.heads["diffusion"].distribution(z, None, None, DIFFUSION, None).score(x)
