"""Generator lists (diffusers' convention): ``generate(generator=[g_0, .., g_{B-1}])`` draws row b's
random numbers from g_b only, so row b of a batch equals that prompt decoded alone with the same
generator, bit for bit, for every drafter, rule and schedule of the core (with and without CFG).

Tiny LlamaGen-style target (V = 32, 4x4 grid) and a perturbed copy as draft model; sampling at
temperature 1 so every method draws randomness (uniforms, samples, sampled trees, Jacobi inits).
"""

import pytest
import torch

from mmspec.core import (GroupedAcceptance, GroupedAcceptanceConfig, JacobiDrafter, LatentProximityAcceptance,
                         LatentProximityConfig, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         NextSetSchedule, SpeculativeDecoder, latent_neighbours)
from mmspec.models.llamagen import LlamaGenModel
from tiny import tiny_lm

V, GRID = 32, 4
LABELS = [0, 1, 3]
SEEDS = [11, 12, 13]


def tiny(seed=0):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=V, grid_size=GRID, num_classes=4, dim=32, n_layers=2, n_heads=2,
                         mlp_hidden=64, initializer_range=0.2).eval()


@pytest.fixture(scope="module")
def models():
    target = tiny(0)
    draft = tiny(0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())
    return target, draft


def method(name, target, draft):
    """-> (drafter, rule, schedule) for the named composition."""
    emb = target.tok_embeddings.weight
    jacobi = JacobiDrafter(V, window=4, init="random")
    return {
        "none": (None, None, None),
        "sd": (ModelChainDrafter(draft, gamma=3), None, None),
        "tree-sample": (ModelTreeDrafter(draft, top_k=2, depth=2, mode="sample"), None, None),
        "tree-topk": (ModelTreeDrafter(draft, top_k=3, depth=2, total_tokens=8, mode="topk"), None, None),
        "jacobi": (jacobi, None, None),
        "gsd": (jacobi, GroupedAcceptance(emb, GroupedAcceptanceConfig(p_threshold=0.1, d_threshold=10.0)), None),
        "lantern": (jacobi, LatentProximityAcceptance(latent_neighbours(emb, 8), LatentProximityConfig(k=8, delta=0.2)),
                    None),
        "zipar": (None, None, NextSetSchedule(GRID, GRID, 2)),
        "zipar+sjd": (JacobiDrafter(V, window=3, init="random"), None, NextSetSchedule(GRID, GRID, 2)),
    }[name]


def decode(target, draft, name, labels, generator, guided):
    drafter, rule, schedule = method(name, target, draft)
    logits = LogitsProcessor(temperature=1.0, guidance_scale=2.0 if guided else None)
    dec = SpeculativeDecoder(target, drafter, rule=rule, processor=logits, schedule=schedule)
    kw = dict(uncond_input_ids=target.uncond_prompts(len(labels))) if guided else {}
    return dec.generate(target.class_prompts(labels), target.num_image_tokens, generator=generator, **kw)


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("guided", [False, True], ids=["plain", "cfg"])
@pytest.mark.parametrize("name", ["none", "sd", "tree-sample", "tree-topk", "jacobi", "gsd", "lantern", "zipar",
                                  "zipar+sjd"])
def test_row_of_a_batch_equals_that_row_alone(models, name, guided):
    target, draft = models
    batch = decode(target, draft, name, LABELS, gens(SEEDS), guided)
    alone = [decode(target, draft, name, [label], gens([seed]), guided) for label, seed in zip(LABELS, SEEDS)]
    assert torch.equal(batch.sequences, torch.cat([a.sequences for a in alone]))
    assert torch.equal(batch.lengths, torch.cat([a.lengths for a in alone]))
    # a one-item list is the same as that generator alone
    single = decode(target, draft, name, LABELS[:1], torch.Generator().manual_seed(SEEDS[0]), guided)
    assert torch.equal(single.sequences, alone[0].sequences)


@pytest.mark.parametrize("name", ["sd", "jacobi"])
def test_one_shared_generator_mixes_the_rows(models, name):
    """The control: one generator for the whole batch draws the rows' numbers interleaved, so the
    rows differ from the per-row runs (the property above is not automatic)."""
    target, draft = models
    shared = decode(target, draft, name, LABELS, torch.Generator().manual_seed(SEEDS[0]), False)
    alone = [decode(target, draft, name, [label], gens([SEEDS[0]]), False) for label in LABELS]
    assert not torch.equal(shared.sequences, torch.cat([a.sequences for a in alone]))


def test_same_generators_same_rows(models):
    """Two rows with the same prompt and equally seeded generators are identical; different seeds
    give different rows (randomness reaches every row)."""
    target, draft = models
    out = decode(target, draft, "sd", [2, 2, 2], gens([4, 4, 9]), False)
    assert torch.equal(out.sequences[0], out.sequences[1])
    assert not torch.equal(out.sequences[0], out.sequences[2])


def test_prompts_of_different_lengths():
    """Text-style prompts of lengths 3, 6, 1 (right padding in the batch) with a chain draft model."""
    target, draft = tiny_lm(0, vocab_size=16, dim=16), tiny_lm(1, vocab_size=16, dim=16)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    seeds = [3, 1, 4]

    def run(ps, gs):
        dec = SpeculativeDecoder(target, ModelChainDrafter(draft, gamma=3), processor=LogitsProcessor(temperature=1.0))
        return dec.generate(ps, 12, generator=gs, eos_token_id=[5, 7])

    batch = run(prompts, gens(seeds))
    alone = [run([p], gens([s])) for p, s in zip(prompts, seeds)]
    for b, a in enumerate(alone):
        n = int(a.lengths[0])
        assert int(batch.lengths[b]) == n
        assert torch.equal(batch.sequences[b, :n], a.sequences[0, :n])


class _Counting:
    """A target wrapper that counts forward passes."""

    def __init__(self, target):
        self.target, self.vocab_size, self.calls = target, target.vocab_size, 0

    def new_cache(self, batch_size, max_len):
        return self.target.new_cache(batch_size, max_len)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.target(*args, **kwargs)


@pytest.mark.parametrize("bad", [gens([1, 2]), gens([1, 2, 3, 4]), [], 7, [torch.Generator(), 3], "seed"],
                         ids=["2-of-3", "4-of-3", "empty", "int", "mixed", "str"])
@pytest.mark.parametrize("schedule", [None, "zipar"])
def test_bad_generator_is_refused_before_any_forward(models, bad, schedule):
    target, _ = models
    counting = _Counting(target)
    sched = None if schedule is None else NextSetSchedule(GRID, GRID, 2)
    dec = SpeculativeDecoder(counting, processor=LogitsProcessor(temperature=1.0), schedule=sched)
    with pytest.raises(ValueError, match=r"^generator must be None, a torch.Generator, or a list of 3"):
        dec.generate(target.class_prompts(LABELS), target.num_image_tokens, generator=bad)
    assert counting.calls == 0
