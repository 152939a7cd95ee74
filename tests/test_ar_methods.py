"""The AR image methods as compositions on the core, on a tiny LlamaGen-style model.

Equivalences are exact (bit for bit under a seed); distribution tests follow
tests/test_exactness.py: fixed seed, N = 20,000 samples of the first 3 image tokens, chi-square
against the exact joint at p >= 1e-3, and a deliberately broken rule must fall below it.
"""

import math

import pytest
import torch

from mmspec.core import (GroupedAcceptance, GroupedAcceptanceConfig, JacobiDrafter, LogitsProcessor,
                         ModelChainDrafter, ModelTreeDrafter, SpeculativeDecoder, SpeculativeSampling)
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index
from mmspec.core.relaxed import LatentProximityAcceptance, LatentProximityConfig, latent_neighbours
from mmspec.core.schedule import NextSetSchedule
from mmspec.core.types import ModelOutput
from mmspec.models.llamagen import LlamaGenModel


def tiny(seed=0, vocab=32, grid=4, dim=32, init=0.2):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=vocab, grid_size=grid, num_classes=4, dim=dim, n_layers=2, n_heads=2,
                         mlp_hidden=2 * dim, initializer_range=init).eval()


def perturbed(model, seed, scale):
    """A draft close to ``model``: its weights plus seeded noise."""
    draft = LlamaGenModel(**{k: v for k, v in model.config.items() if not k.startswith("_")}).eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return draft


def run(model, labels, drafter=None, rule=None, logits=None, schedule=None, guided=False, seed=0):
    logits = logits or LogitsProcessor(temperature=0.0, guidance_scale=3.0 if guided else None)
    dec = SpeculativeDecoder(model, drafter, rule=rule, processor=logits, schedule=schedule)
    kw = dict(uncond_input_ids=model.uncond_prompts(len(labels))) if guided else {}
    return dec.generate(model.class_prompts(labels), model.num_image_tokens,
                        generator=torch.Generator().manual_seed(seed), **kw)


# -- ZipAR: the next-set schedule -----------------------------------------------------------------
@pytest.mark.parametrize("guided", [False, True])
def test_zipar_with_full_window_is_raster_order(guided):
    model = tiny()
    labels = [0, 3, 1]
    ref = run(model, labels, guided=guided)
    out = run(model, labels, schedule=NextSetSchedule(4, 4, 4), guided=guided)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.target_forwards == ref.stats.target_forwards == 16  # H * W


@pytest.mark.statistical
def test_zipar_with_full_window_samples_like_raster():
    """Sampled, B=1: only emitting rows draw randomness, so the streams coincide."""
    model = tiny()
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=2.0)
    ref = run(model, [2], logits=sampled, guided=True, seed=7)
    out = run(model, [2], logits=sampled, schedule=NextSetSchedule(4, 4, 4), guided=True, seed=7)
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_zipar_nfe_matches_closed_form(window):
    model = tiny(grid=4)
    out = run(model, [0, 1], schedule=NextSetSchedule(4, 4, window), guided=True,
              logits=LogitsProcessor(temperature=1.0, guidance_scale=3.0))
    assert out.stats.target_forwards == NextSetSchedule.closed_form_nfe(4, 4, window) == 3 * window + 4
    assert out.sequences.shape == (2, 16) and int(out.sequences.max()) < model.vocab_size
    # a pass emits one token per row in flight: 15 tokens after the prefill's first, <= 4 at once
    per_pass = out.stats.accept_lengths
    assert per_pass.sum(0).tolist() == [15, 15] and 1 < int(per_pass.max()) <= 4


def test_zipar_rows_see_only_what_the_window_allows():
    """A row's first token must not depend on the upper row's tokens past the window: changing a
    late token of row 0 keeps row 1's first token (same seed) when s is small."""
    model = tiny(seed=3)
    sched = NextSetSchedule(4, 4, 1)
    out = run(model, [1], schedule=sched)
    # the same decode by hand: row 1's first token comes from [class, row0 col0] + seed at (0, 3)
    row0 = out.sequences[0, :4]
    tokens = torch.tensor([[1, int(row0[0]), int(row0[0])]])
    positions = torch.tensor([[0, 1, 4]])  # class, (0, 0), seed at (0, 3)
    logits = model(tokens, positions, model.new_cache(1, 8), torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]],
                                                                                dtype=torch.bool)).logits
    assert int(logits[0, -1].argmax()) == int(out.sequences[0, 4])


def test_zipar_plus_sjd_and_bad_knobs():
    model = tiny()
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=3.0)
    out = run(model, [0, 2], JacobiDrafter(model.vocab_size, 4), logits=sampled,
              schedule=NextSetSchedule(4, 4, 2), guided=True)
    assert out.sequences.shape == (2, 16) and out.stats.target_forwards <= NextSetSchedule.closed_form_nfe(4, 4, 2)
    with pytest.raises(ValueError, match="window"):
        NextSetSchedule(4, 4, 5)
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeDecoder(model, ModelChainDrafter(perturbed(model, 1, 0.1)), schedule=NextSetSchedule(4, 4, 2))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpeculativeDecoder(model, schedule=NextSetSchedule(4, 4, 2)).generate(model.class_prompts([0]), 10)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="eos_token_id"):
            SpeculativeDecoder(model, schedule=NextSetSchedule(4, 4, 2)).generate(model.class_prompts([0]), 16,
                                                                                 eos_token_id=3)
    finally:
        hook.remove()
    assert calls == []  # rejected before the prefill


# -- SJD ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("init", ["random", "repeat", "spatial"])
def test_every_sjd_iteration_commits_a_token(init):
    model = tiny()
    drafter = JacobiDrafter(model.vocab_size, 6, init=init, grid_width=4)
    out = run(model, [0, 1, 2], drafter, logits=LogitsProcessor(temperature=1.0, guidance_scale=3.0), guided=True)
    steps = out.stats.accept_lengths  # (passes, B), 0 only once a row is done
    for b in range(3):
        live = steps[:, b][: int((steps[:, b] > 0).sum())]
        assert bool((live >= 1).all()) and int(steps[:, b].sum()) + 1 >= 16


@pytest.mark.parametrize("init", ["repeat", "spatial"])
def test_greedy_sjd_is_lossless(init):
    model = tiny()
    ref = run(model, [0, 1, 3], guided=True)
    out = run(model, [0, 1, 3], JacobiDrafter(model.vocab_size, 5, init=init, grid_width=4), guided=True)
    assert torch.equal(out.sequences, ref.sequences)


def test_spatial_init_copies_the_token_above():
    from mmspec.core.decoder import DecodeState

    W = 4
    history = torch.arange(100, 120)[None]  # prompt of 1, then 19 tokens
    state = DecodeState(history.clone(), torch.tensor([12]), 1, LogitsProcessor(), None, 20,
                        prompt_lengths=torch.tensor([1]))
    d = JacobiDrafter(200, 4, init="spatial", grid_width=W)
    d.start(state)
    draft = d.propose(state)
    # drafts sit at history 12, 13, 14: the tokens above are at 8, 9, 10
    assert draft.tokens.tolist() == [[108, 109, 110]]


# -- LANTERN --------------------------------------------------------------------------------------
def test_latent_neighbours_are_sorted_nearest_first():
    codebook = torch.tensor([[0.0, 1.0], [0.1, 1.0], [1.0, 0.0], [1.0, 0.2]])
    nn = latent_neighbours(codebook, normalize=False)
    assert nn[0].tolist() == [1, 3, 2] and nn[2].tolist() == [3, 1, 0]


def test_lantern_relaxed_probability_and_rejections():
    p = torch.tensor([[0.30, 0.05, 0.04, 0.01, 0.60]])
    nn = torch.tensor([[1, 2, 3, 4], [0, 2, 3, 4], [3, 1, 0, 4], [2, 1, 0, 4], [3, 2, 1, 0]])
    x = torch.tensor([0])
    paper = LatentProximityAcceptance(nn, LatentProximityConfig(k=3, delta=0.095))
    # S = 0.05, 0.09, 0.10: j* = 2, A = {1, 2}
    assert paper.accept_prob(p, None, x).item() == pytest.approx(0.39)
    lam = LatentProximityAcceptance(nn, LatentProximityConfig(k=3, lam=1.2))  # bound 0.2 * 0.30 = 0.06
    assert lam.accept_prob(p, None, x).item() == pytest.approx(0.35)
    after = paper.reject(p, None, x)
    assert after[0, :3].tolist() == [0.0, 0.0, 0.0] and after[0, 3].item() == pytest.approx(0.01 / 0.61)
    ref = LatentProximityAcceptance(nn, LatentProximityConfig(k=2, delta=0.095, rejection="reference"))
    assert ref.accept_prob(p, None, x).item() == pytest.approx(0.39)  # the same A = {1, 2}
    after_ref = ref.reject(p, None, x)
    assert after_ref[0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]  # x and its k+1 = 3 nearest: code 3 too
    # an empty proximity set changes nothing in either variant
    tight = LatentProximityAcceptance(nn, LatentProximityConfig(k=3, delta=0.01, rejection="reference"))
    assert tight.accept_prob(p, None, x).item() == pytest.approx(0.30)
    assert torch.allclose(tight.reject(p, None, x), SpeculativeSampling().reject(p, None, x))


@pytest.mark.parametrize("config", [LatentProximityConfig(delta=0.0), LatentProximityConfig(lam=1.0)])
def test_lantern_at_zero_relaxation_is_the_eagle_tree_bit_for_bit(config):
    model = tiny(vocab=32)
    draft = perturbed(model, 1, 0.3)
    sampled = LogitsProcessor(temperature=1.0, top_k=8, guidance_scale=3.0)
    tree = lambda: ModelTreeDrafter(draft, top_k=3, depth=3, total_tokens=10)  # noqa: E731
    ref = run(model, [0, 1, 2], tree(), logits=sampled, guided=True, seed=4)
    rule = LatentProximityAcceptance(latent_neighbours(model.tok_embeddings.weight), config)
    out = run(model, [0, 1, 2], tree(), rule=rule, logits=sampled, guided=True, seed=4)
    assert torch.equal(out.sequences, ref.sequences)
    loose = LatentProximityAcceptance(latent_neighbours(model.tok_embeddings.weight), LatentProximityConfig(delta=0.3))
    relaxed = run(model, [0, 1, 2], tree(), rule=loose, logits=sampled, guided=True, seed=4)
    assert relaxed.stats.tau > ref.stats.tau  # the relaxation accepts more


def test_lantern_reference_rejection_at_zero_delta():
    """The reference's over-zeroing: at delta=0 it equals exact verification draw for draw only
    while every neighbour has mass; once top-k leaves zero-mass neighbours, A is non-empty and it
    zeroes k+1 real codes. (Exact verification here walks the siblings as any rule with its own
    test does; the default one-draw-per-node road draws differently.)"""

    class SiblingRounds(SpeculativeSampling):
        def accept_prob(self, p, q, x):
            return super().accept_prob(p, q, x)

    model = tiny(vocab=32)
    draft = perturbed(model, 1, 0.3)
    nn = latent_neighbours(model.tok_embeddings.weight)
    tree = lambda: ModelTreeDrafter(draft, top_k=3, depth=3, total_tokens=10)  # noqa: E731
    rule = LatentProximityAcceptance(nn, LatentProximityConfig(k=4, delta=0.0, rejection="reference"))
    for top_k, same in ((None, True), (8, False)):
        sampled = LogitsProcessor(temperature=1.0, top_k=top_k, guidance_scale=3.0)
        ref = run(model, [0, 1, 2], tree(), rule=SiblingRounds(), logits=sampled, guided=True, seed=4)
        out = run(model, [0, 1, 2], tree(), rule=rule, logits=sampled, guided=True, seed=4)
        assert torch.equal(out.sequences, ref.sequences) == same


def test_lantern_bad_knobs():
    with pytest.raises(ValueError, match="delta"):
        LatentProximityConfig(delta=1.5)
    with pytest.raises(ValueError, match="lam"):
        LatentProximityConfig(lam=0.5)
    with pytest.raises(ValueError, match="rejection"):
        LatentProximityConfig(rejection="code")
    with pytest.raises(ValueError, match="k"):
        LatentProximityAcceptance(torch.zeros(8, 7, dtype=torch.long), LatentProximityConfig(k=9))


# -- distribution tests on the image model ---------------------------------------------------------
N_SAMPLES, N_TOKENS, LABEL = 20_000, 3, 1
GUIDED = LogitsProcessor(temperature=1.0, guidance_scale=2.0)


class NoResidual(SpeculativeSampling):
    """Broken: after a rejection, resample from p instead of the residual."""

    def reject(self, p, q, x):
        return p


def image_pvalue(kind, rule=None, seed=0):
    model = tiny(seed=5, vocab=8, grid=4, dim=32, init=0.3)
    draft = perturbed(model, 2, 0.5)
    drafter = {"sd": lambda: ModelChainDrafter(draft, gamma=2),
               "eagle": lambda: ModelTreeDrafter(draft, top_k=3, depth=1, total_tokens=8),
               "sjd": lambda: JacobiDrafter(model.vocab_size, 3)}[kind]()
    dec = SpeculativeDecoder(model, drafter, rule=rule, processor=GUIDED)
    out = dec.generate(model.class_prompts([LABEL] * N_SAMPLES), N_TOKENS,
                       uncond_input_ids=model.uncond_prompts(N_SAMPLES),
                       generator=torch.Generator().manual_seed(seed))
    probs = exact_joint(model, [LABEL], N_TOKENS, GUIDED, [model.null_class])
    return chisquare_pvalue(sequence_index(out.sequences, model.vocab_size), probs), out.stats


@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["sd", "eagle", "sjd"])
def test_lossless_methods_sample_the_guided_image_model(kind):
    pval, stats = image_pvalue(kind)
    assert stats.tau > 1.1
    assert pval >= P_THRESHOLD, f"{kind}: chi-square p={pval:.2e}"
    broken, _ = image_pvalue(kind, rule=NoResidual())
    assert broken < P_THRESHOLD, f"{kind}: a broken rule passed (p={broken:.2e})"


def test_gsd_with_zero_thresholds_is_sjd_on_the_image_model():
    model = tiny()
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=3.0)
    ref = run(model, [0, 1], JacobiDrafter(model.vocab_size, 6), logits=sampled, guided=True, seed=2)
    zero = GroupedAcceptance(model.tok_embeddings.weight, GroupedAcceptanceConfig(p_threshold=0.0, d_threshold=0.0))
    out = run(model, [0, 1], JacobiDrafter(model.vocab_size, 6), rule=zero, logits=sampled, guided=True, seed=2)
    assert torch.equal(out.sequences, ref.sequences)


# -- SJD's reference interval: its pass count, like for like ----------------------------------------
class PointMassRows:
    """Stub target (a tiny LlamaGen writes the cache; the answer is replaced): row 0 always says
    token 5, so a ``repeat`` window of 5s is accepted whole; other rows say "the input token plus
    one", which a Jacobi window never guesses: its drafts repeat the root or follow stale inputs,
    always one behind (one token per pass)."""

    def __init__(self, grid):
        self.model = tiny(vocab=32, grid=grid)
        self.vocab_size = 32

    def new_cache(self, batch_size, max_len):
        return self.model.new_cache(batch_size, max_len)

    def __call__(self, tokens, positions, cache, tree_mask=None, **conditioning):
        out = self.model(tokens, positions, cache, tree_mask, **conditioning)
        answer = torch.where(torch.arange(len(tokens))[:, None] == 0, 5, (tokens + 1) % 32)
        return ModelOutput(logits=torch.full_like(out.logits, -1e4).scatter(-1, answer[..., None], 0.0))


def interval_run(grid, L, interval, labels=(0,)):
    stub = PointMassRows(grid)
    N = grid * grid
    drafter = JacobiDrafter(32, L, init="repeat", interval=None if interval is None else (1, N - L - 2))
    dec = SpeculativeDecoder(stub, drafter, processor=LogitsProcessor(temperature=1.0))
    return dec.generate(stub.model.class_prompts(list(labels)), N, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("grid,L", [(4, 2), (4, 3), (4, 4), (4, 6), (8, 10), (8, 16)])
def test_reference_interval_nfe_matches_its_closed_form(grid, L):
    """Every draft accepted, N = grid^2 tokens, window L, the reference LlamaGen interval
    (l, r) = (1, N - L - 2) with windows decided one pass late (the reference computes a pass's
    window from the length before the previous pass): the prefill and two passes give 3 tokens,
    one full window follows, then ceil(D / L) windows cover D = N - L - 4 tokens (the last one
    shortened), and one single-token pass ends: NFE = 5 + ceil((N - L - 4) / L) (needs
    N >= 2L + 4). Drafting on every pass instead: NFE = 1 + ceil((N - 1) / L)."""
    N = grid * grid
    out = interval_run(grid, L, "reference")
    assert out.stats.target_forwards == 5 + math.ceil((N - L - 4) / L)
    D = N - L - 4
    windows = [1, 1, L] + [L] * (math.ceil(D / L) - 1) + [D - (math.ceil(D / L) - 1) * L] + [1]
    assert out.stats.accept_lengths[:, 0].tolist() == windows and sum(windows) == N - 1
    assert interval_run(grid, L, None).stats.target_forwards == 1 + math.ceil((N - 1) / L)
    assert bool((out.sequences == 5).all())


def test_reference_interval_rows_keep_their_own_windows_in_a_batch():
    """At B > 1 the chain is as long as the longest row's; a row's extra slots are empty (q = 0)
    and never accepted, so row 0 emits exactly what it emits alone while row 1 drafts in vain."""
    alone = interval_run(4, 4, "reference").stats.accept_lengths[:, 0]
    batch = interval_run(4, 4, "reference", labels=(0, 1)).stats.accept_lengths
    assert batch[: len(alone), 0].tolist() == alone.tolist() and int(batch[len(alone):, 0].sum()) == 0
    assert bool((batch[:, 1] == 1).all()) and batch.shape[0] == 15


def test_reference_interval_is_lossless_under_greedy_and_refused_under_zipar():
    model = tiny()
    ref = run(model, [0, 1, 3], guided=True)
    out = run(model, [0, 1, 3], JacobiDrafter(model.vocab_size, 5, init="repeat", interval=(1, 16 - 5 - 2)), guided=True)
    assert torch.equal(out.sequences, ref.sequences)
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeDecoder(model, JacobiDrafter(32, 4, interval=(1, 8)), schedule=NextSetSchedule(4, 4, 2))
    with pytest.raises(ValueError, match="interval must be None or a tuple"):
        JacobiDrafter(32, 4, interval=(-1, 8))
