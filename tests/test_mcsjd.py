"""MC-SJD (``JacobiDrafter(coupling="maximal")``, the ``mcsjd`` part): lossless, and a coupling.

Distribution tests follow tests/test_exactness.py: fixed seed, N = 20,000 samples of the first 3
generated tokens (one batch), Pearson chi-square against the exact joint over all 8**3 sequences,
pass at p >= 1e-3; each lossless setting is paired with deliberately broken redrafts that the
same test must reject (p < 1e-3). The coupling's own test draws N = 20,000 (x ~ p_old, coupled y)
pairs: y must follow p_new (chi-square, p >= 1e-3) and the keep rate must be sum min(p_new, p_old)
within 4 binomial standard deviations.
"""

import math

import pytest
import torch

from mmspec import methods
from mmspec.core import JacobiDrafter, LogitsProcessor, NextSetSchedule, SpeculativeDecoder
from mmspec.core.drafters import maximal_coupling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index, total_variation
from mmspec.core.relaxed import GroupedAcceptance, GroupedAcceptanceConfig
from mmspec.core.sampling import sample
from mmspec.models.llamagen import LlamaGenModel

N_SAMPLES, N_TOKENS, SEED = 20_000, 3, 0
PROMPT, UNCOND = [3, 1, 4], [0]


class AlwaysKeep(JacobiDrafter):
    """Broken: keeps the previous draft whenever there is one, still claiming q = p_new."""

    def redraft(self, prev, p_old, p_new, generator):
        return torch.where(p_old.sum(-1) > 0, prev, sample(p_new, generator))


class ResidualOmitted(JacobiDrafter):
    """Broken: a draft not kept is redrawn from p_new instead of norm(max(p_new - p_old, 0))."""

    def redraft(self, prev, p_old, p_new, generator):
        _, kept = maximal_coupling(prev, p_old, p_new, generator)
        return torch.where(kept, prev, sample(p_new, generator))


# -- the coupling alone ----------------------------------------------------------------------------
def distributions(seed, V=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * 1.5).softmax(-1), (torch.randn(V, generator=g) * 1.5).softmax(-1)


def couple(p_old, p_new, rule=maximal_coupling, N=N_SAMPLES, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    P_old, P_new = p_old.expand(N, -1), p_new.expand(N, -1)
    x = sample(P_old, g) if p_old.sum() > 0 else torch.zeros(N, dtype=torch.long)
    y, kept = rule(x, P_old, P_new, g)
    return x, y, kept


def residual_omitted(x, p_old, p_new, g):
    _, kept = maximal_coupling(x, p_old, p_new, g)
    return torch.where(kept, x, sample(p_new, g)), kept


def always_keep(x, p_old, p_new, g):
    return x, torch.ones_like(x, dtype=torch.bool)


@pytest.mark.statistical
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_coupled_draw_follows_p_new_and_keeps_at_the_maximal_rate(seed):
    p_old, p_new = distributions(seed)
    x, y, kept = couple(p_old, p_new)
    assert chisquare_pvalue(y, p_new) >= P_THRESHOLD
    agree = float(torch.minimum(p_old, p_new).sum())  # the maximal coupling's agreement probability
    rate = kept.float().mean().item()
    assert abs(rate - agree) < 4 * math.sqrt(agree * (1 - agree) / N_SAMPLES), (rate, agree)
    assert torch.equal(y[kept], x[kept]) and bool((y[~kept] != x[~kept]).all())  # redraws never repeat x
    # the residual is where p_new exceeds p_old: a redraw never lands where p_old >= p_new
    assert bool((p_new > p_old)[y[~kept]].all())


def test_fresh_and_missing_previous_drafts():
    """One-hot p_old (a freshly initialised token): keep with p_new(x); all-zero p_old (no previous
    draft): a plain draw from p_new, never a 'keep'."""
    _, p_new = distributions(4)
    x, y, kept = couple(torch.nn.functional.one_hot(torch.tensor(5), 8).float(), p_new)
    assert chisquare_pvalue(y, p_new) >= P_THRESHOLD
    assert abs(kept.float().mean().item() - float(p_new[5])) < 4 * math.sqrt(float(p_new[5] * (1 - p_new[5])) / N_SAMPLES)
    _, y, kept = couple(torch.zeros(8), p_new)
    assert not bool(kept.any()) and chisquare_pvalue(y, p_new) >= P_THRESHOLD


@pytest.mark.statistical
@pytest.mark.parametrize("broken", [residual_omitted, always_keep])
def test_broken_couplings_are_caught(broken):
    p_old, p_new = distributions(1)
    _, y, _ = couple(p_old, p_new, rule=broken)
    assert chisquare_pvalue(y, p_new) < P_THRESHOLD


def test_coupling_draws_row_r_from_generator_r():
    p_old, p_new = distributions(2)
    P_old, P_new = p_old.expand(3, 4, -1), p_new.expand(3, 4, -1)
    x = torch.tensor([[0, 1, 2, 3]] * 3)
    batch = maximal_coupling(x, P_old, P_new, tuple(torch.Generator().manual_seed(s) for s in (7, 8, 9)))[0]
    alone = [maximal_coupling(x[:1], P_old[:1], P_new[:1], torch.Generator().manual_seed(s))[0] for s in (7, 8, 9)]
    assert torch.equal(batch, torch.cat(alone))


# -- through the decoder ---------------------------------------------------------------------------
PLAIN = LogitsProcessor(temperature=1.0)
GUIDED = LogitsProcessor(temperature=0.8, top_k=5, guidance_scale=2.0)


def toy_pvalue(target, drafter, pipeline, guided=False):
    dec = SpeculativeDecoder(target, drafter, processor=pipeline)
    out = dec.generate(torch.tensor([PROMPT]).expand(N_SAMPLES, -1), N_TOKENS,
                       generator=torch.Generator().manual_seed(SEED),
                       uncond_input_ids=torch.tensor([UNCOND]).expand(N_SAMPLES, -1) if guided else None)
    probs = exact_joint(target, PROMPT, N_TOKENS, pipeline, UNCOND if guided else None)
    samples = sequence_index(out.sequences[:, :N_TOKENS], target.vocab_size)
    return chisquare_pvalue(samples, probs), total_variation(samples, probs), out.stats


@pytest.mark.statistical
@pytest.mark.parametrize("init", ["random", "repeat"])
@pytest.mark.parametrize("pipeline,guided", [(PLAIN, False), (GUIDED, True)], ids=["plain", "cfg-topk-temp"])
def test_mcsjd_samples_the_toy_target_exactly(small_vocab_pair, pipeline, guided, init):
    target, _ = small_vocab_pair
    pval, tv, stats = toy_pvalue(target, JacobiDrafter(8, window=3, init=init, coupling="maximal"), pipeline, guided)
    assert stats.tau > 1.1, "drafts must actually be accepted for this test to mean anything"
    assert pval >= P_THRESHOLD, f"chi-square p={pval:.2e}, TV={tv:.4f}"


@pytest.mark.statistical
@pytest.mark.parametrize("broken", [AlwaysKeep, ResidualOmitted])
def test_broken_redrafts_are_caught_on_the_toy_target(small_vocab_pair, broken):
    """With ``repeat`` initialisation the previous draft is fixed by the context. (With uniform
    random initialisation an omitted residual averages out over x in the first 3 tokens: there
    the coupling-level test above catches it.)"""
    target, _ = small_vocab_pair
    pval, tv, _ = toy_pvalue(target, broken(8, window=3, init="repeat", coupling="maximal"), PLAIN)
    assert pval < P_THRESHOLD, f"{broken.__name__} passed: p={pval:.2e}, TV={tv:.4f}"


def tiny_image(seed=5, vocab=8, grid=4, init=0.3):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=vocab, grid_size=grid, num_classes=4, dim=32, n_layers=2, n_heads=2,
                         mlp_hidden=64, initializer_range=init).eval()


IMAGE = LogitsProcessor(temperature=1.0, guidance_scale=2.0)


def image_pvalue(drafter, label=1):
    model = tiny_image()
    out = SpeculativeDecoder(model, drafter, processor=IMAGE).generate(
        model.class_prompts([label] * N_SAMPLES), N_TOKENS, uncond_input_ids=model.uncond_prompts(N_SAMPLES),
        generator=torch.Generator().manual_seed(SEED))
    probs = exact_joint(model, [label], N_TOKENS, IMAGE, [model.null_class])
    return chisquare_pvalue(sequence_index(out.sequences, model.vocab_size), probs), out.stats


@pytest.mark.statistical
def test_mcsjd_samples_the_guided_image_model_exactly():
    pval, stats = image_pvalue(JacobiDrafter(8, window=3, coupling="maximal"))
    assert stats.tau > 1.1
    assert pval >= P_THRESHOLD, f"chi-square p={pval:.2e}"
    broken, _ = image_pvalue(AlwaysKeep(8, window=3, coupling="maximal"))
    assert broken < P_THRESHOLD, f"a broken coupling passed (p={broken:.2e})"


def test_mcsjd_with_coupled_non_one_hot_drafts():
    """In the first 3 tokens a coupled draft's previous draft is always a fresh one-hot token; by
    token 4 it can be a Jacobi sample with a full p_old. Joint of the first 4 tokens of a V = 5
    guided image model (625 cells), N = 20,000, seed 0, p >= 1e-3; always-keep must fail."""
    def pvalue(drafter, n=4, label=1):
        model = tiny_image(vocab=5)
        out = SpeculativeDecoder(model, drafter, processor=IMAGE).generate(
            model.class_prompts([label] * N_SAMPLES), n, uncond_input_ids=model.uncond_prompts(N_SAMPLES),
            generator=torch.Generator().manual_seed(SEED))
        probs = exact_joint(model, [label], n, IMAGE, [model.null_class])
        return chisquare_pvalue(sequence_index(out.sequences[:, :n], 5), probs), out.stats

    pval, stats = pvalue(JacobiDrafter(5, window=3, coupling="maximal"))
    assert stats.tau > 1.1 and pval >= P_THRESHOLD, f"chi-square p={pval:.2e}"
    broken, _ = pvalue(AlwaysKeep(5, window=3, coupling="maximal"))
    assert broken < P_THRESHOLD, f"a broken coupling passed (p={broken:.2e})"


def test_greedy_mcsjd_equals_the_baseline():
    model = tiny_image(seed=0, vocab=32)
    greedy = LogitsProcessor(temperature=0.0, guidance_scale=3.0)

    def run(drafter):
        return SpeculativeDecoder(model, drafter, processor=greedy).generate(
            model.class_prompts([0, 1, 3]), model.num_image_tokens, uncond_input_ids=model.uncond_prompts(3))

    ref = run(None)
    assert torch.equal(run(JacobiDrafter(32, 5, init="repeat", coupling="maximal")).sequences, ref.sequences)


def test_maximal_coupling_accepts_more_than_independent_redrafts():
    """The point of MC-SJD: on the tiny guided image model (V = 32, 4x4 grid, 256 images, window 6),
    coupled redrafts agree with the previous ones more often, so more drafts pass per target pass."""
    model = tiny_image(seed=0, vocab=32, init=0.2)
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=2.0)

    def tau(coupling):
        dec = SpeculativeDecoder(model, JacobiDrafter(32, 6, coupling=coupling), processor=sampled)
        out = dec.generate(model.class_prompts([i % 4 for i in range(256)]), model.num_image_tokens,
                           uncond_input_ids=model.uncond_prompts(256), generator=torch.Generator().manual_seed(3))
        return out.stats.accept_lengths.float().sum() / (out.stats.accept_lengths > 0).sum()

    assert tau("maximal") > tau("independent")


def test_mcsjd_generator_lists():
    """Row r draws from generator r: a batch equals its rows decoded alone, bit for bit."""
    model = tiny_image(seed=0, vocab=32, init=0.2)
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=2.0)

    def run(labels, seeds):
        dec = SpeculativeDecoder(model, JacobiDrafter(32, 4, coupling="maximal"), processor=sampled)
        return dec.generate(model.class_prompts(labels), model.num_image_tokens,
                            uncond_input_ids=model.uncond_prompts(len(labels)),
                            generator=[torch.Generator().manual_seed(s) for s in seeds]).sequences

    batch = run([0, 1, 3], [11, 12, 13])
    assert torch.equal(batch, torch.cat([run([label], [seed]) for label, seed in zip([0, 1, 3], [11, 12, 13])]))


# -- compositions through the registry ------------------------------------------------------------
def test_mcsjd_composes_where_sjd_does():
    for name, parts in (("mcsjd", ("mcsjd",)), ("zipar+mcsjd", ("zipar", "mcsjd")), ("mcsjd+gsd", ("mcsjd", "gsd")),
                        ("zipar+mcsjd+gsd", ("zipar", "mcsjd", "gsd")), ("mcsjd+lantern", ("mcsjd", "lantern"))):
        recipe = methods.resolve("ar-image", name)
        assert recipe.parts == parts and recipe.lossless == (name == "mcsjd")
    assert methods.resolve("ar-image", "mcsjd").knobs == {"mcsjd_window": 16, "mcsjd_init": "random",
                                                          "mcsjd_interval": "full"}
    model = tiny_image(seed=0, vocab=32)
    model.config["grid_size"] = 4
    built = methods.build(methods.resolve("ar-image", "zipar+mcsjd", {"zipar_window": 2, "mcsjd_window": 3}),
                          {"target": model})
    assert built.drafter.coupling == "maximal" and isinstance(built.schedule, NextSetSchedule)
    out = SpeculativeDecoder(model, built.drafter, processor=IMAGE, schedule=built.schedule).generate(
        model.class_prompts([0, 2]), 16, uncond_input_ids=model.uncond_prompts(2),
        generator=torch.Generator().manual_seed(0))
    assert out.sequences.shape == (2, 16) and out.stats.target_forwards <= NextSetSchedule.closed_form_nfe(4, 4, 2)
    with pytest.raises(ValueError, match=r"'zipar' with a drafter among sjd, mcsjd or none \('mcsjd' is not lane_safe"):
        methods.resolve("ar-image", "zipar+mcsjd", {"mcsjd_init": "spatial"})


def test_gsd_at_zero_thresholds_on_mcsjd_is_mcsjd():
    model = tiny_image(seed=0, vocab=32)
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=3.0)

    def run(rule):
        dec = SpeculativeDecoder(model, JacobiDrafter(32, 6, coupling="maximal"), rule=rule, processor=sampled)
        return dec.generate(model.class_prompts([0, 1]), 16, uncond_input_ids=model.uncond_prompts(2),
                            generator=torch.Generator().manual_seed(2)).sequences

    zero = GroupedAcceptance(model.tok_embeddings.weight, GroupedAcceptanceConfig(p_threshold=0.0, d_threshold=0.0))
    assert torch.equal(run(zero), run(None))


def test_coupling_is_checked():
    with pytest.raises(ValueError, match="coupling must be one of 'independent', 'maximal', got 'gumbel'"):
        JacobiDrafter(8, coupling="gumbel")


@pytest.mark.statistical
def test_late_tokens_follow_the_baseline_sampler():
    """Long runs of coupled redrafts (16-token images, window 6, V = 4): the joint of tokens 10-11
    and of 15-16 under MC-SJD matches plain AR sampling, by a two-sample chi-square (2 x 16 table,
    N = 20,000 each, seeds 1 and 2, p >= 1e-3); always-keep must fail it."""
    model = tiny_image(seed=5, vocab=4)
    N = N_SAMPLES

    def tokens(drafter, seed):
        return SpeculativeDecoder(model, drafter, processor=IMAGE).generate(
            model.class_prompts([1] * N), 16, uncond_input_ids=model.uncond_prompts(N),
            generator=torch.Generator().manual_seed(seed)).sequences

    def two_sample_p(a, b):
        ca, cb = torch.bincount(a, minlength=16).double(), torch.bincount(b, minlength=16).double()
        e = (ca + cb) / 2
        keep = e > 0
        stat = (((ca - e) ** 2 + (cb - e) ** 2) / e.clamp_min(1e-30))[keep].sum()
        return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.double), stat / 2))

    base = tokens(None, 1)
    pairs = ((9, 10), (14, 15))

    def pvalues(drafter):
        s = tokens(drafter, 2)
        return [two_sample_p(base[:, i] * 4 + base[:, j], s[:, i] * 4 + s[:, j]) for i, j in pairs]

    assert min(pvalues(JacobiDrafter(4, 6, coupling="maximal"))) >= P_THRESHOLD
    assert min(pvalues(AlwaysKeep(4, 6, coupling="maximal"))) < P_THRESHOLD
