"""The LlamaGen-style class-to-image model as a core Target: cache vs reference, 2-D RoPE, greedy
and sampled exactness of speculative decoding with CFG, save/load, label dropout, training."""

import math

import pytest
import torch

from mmspec.core import (JacobiDrafter, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         SpeculativeDecoder, SpeculativeSampling)
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index, total_variation
from mmspec.core.rope import GridRope2D
from mmspec.models.llamagen import LlamaGenModel

V, GRID, CLASSES = 32, 6, 16
TINY = dict(vocab_size=V, grid_size=GRID, num_classes=CLASSES, dim=32, n_layers=2, n_heads=2, mlp_hidden=64)


def tiny(seed: int, **overrides) -> LlamaGenModel:
    torch.manual_seed(seed)
    return LlamaGenModel(**{**TINY, "initializer_range": 0.3, **overrides}).eval()


@pytest.fixture(scope="module")
def model():
    return tiny(0)


# 1. cached path == reference path -------------------------------------------------------------
def test_cached_matches_reference():
    model = tiny(0, initializer_range=0.2)  # logits of O(1): 1e-5 is then well above fp32 noise
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([[3], [CLASSES]])  # a class and the null class
    tokens = torch.cat([labels, torch.randint(0, V, (2, GRID * GRID), generator=g)], 1)  # (2, 37)
    cache = model.new_cache(2, tokens.shape[1])
    P = 5
    with torch.no_grad():
        ref = model(tokens)
        outs = [model(tokens[:, :P], torch.arange(P).expand(2, P), cache)]
        for t in range(P, tokens.shape[1]):
            outs.append(model(tokens[:, t : t + 1], torch.full((2, 1), t), cache))
    torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), ref.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([o.hidden for o in outs], 1), ref.hidden, atol=1e-5, rtol=0)


# 2. 2-D RoPE ----------------------------------------------------------------------------------
def layer0_qk(model, tokens, positions):
    """Layer-0 queries and keys before RoPE (B, H, T, D): they depend on the token alone."""
    layer = model.layers[0]
    is_cls = positions == 0
    x = torch.where(is_cls[..., None], model.embed_classes(torch.where(is_cls, tokens, 0)),
                    model.tok_embeddings(torch.where(is_cls, 0, tokens)))
    B, T, C = x.shape
    q, k, _ = layer.wqkv(layer.attention_norm(x)).view(B, T, 3, layer.n_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k


@torch.no_grad()
def test_rope_class_unrotated_and_same_column_differs_in_row_half(model):
    c, r1, r2 = 2, 0, 3
    p1, p2 = 1 + r1 * GRID + c, 1 + r2 * GRID + c
    tokens = torch.tensor([[7] + [5] * p2])  # class 7, then image token 5 everywhere
    positions = torch.arange(tokens.shape[1])[None]
    cache = model.new_cache(1, tokens.shape[1])
    model(tokens, positions, cache)
    q, k = layer0_qk(model, tokens, positions)
    cached_k = cache.k[0, :, :, : tokens.shape[1]]  # (B, H, T, D) keys as the model stored them
    torch.testing.assert_close(cached_k, model.rope(k, positions), atol=0, rtol=0)
    assert torch.equal(cached_k[:, :, 0], k[:, :, 0]), "the class key must be unrotated"
    assert torch.equal(model.rope(q, positions)[:, :, 0], q[:, :, 0]), "the class query must be unrotated"
    half = k.shape[-1] // 2
    for x in (model.rope(q, positions), cached_k):
        a, b = x[:, :, p1], x[:, :, p2]  # the same token, same column, rows r1 and r2
        assert torch.equal(a[..., half:], b[..., half:]), "column half must not depend on the row"
        assert not torch.allclose(a[..., :half], b[..., :half]), "row half must depend on the row"


def test_rope_hand_computed():
    """Head dim 8, base 100: pairs 0, 1 rotate by row * (1, 0.1), pairs 2, 3 by col * (1, 0.1)."""
    grid, row, col = 5, 2, 3
    x = torch.arange(1.0, 9.0).view(1, 1, 1, 8)
    out = GridRope2D(8, grid, base=100.0)(x, torch.tensor([[1 + row * grid + col]])).flatten().tolist()
    expect = []
    for (a, b), angle in zip([(1, 2), (3, 4), (5, 6), (7, 8)], [row * 1.0, row * 0.1, col * 1.0, col * 0.1]):
        expect += [a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle)]
    assert out == pytest.approx(expect, abs=1e-5)
    assert torch.equal(GridRope2D(8, grid, base=100.0)(x, torch.tensor([[0]])), x)


# 3. greedy speculative decoding with CFG is bit-identical --------------------------------------
LABELS = [1, 5, 11]
SCALE = 3.0


def perturbed_copy(model: LlamaGenModel, noise: float, seed: int) -> LlamaGenModel:
    """A draft that agrees with ``model`` often: its weights plus ``noise`` times their std."""
    draft = LlamaGenModel.from_config(model.config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p, src in zip(draft.parameters(), model.parameters()):
            p.copy_(src + noise * src.std() * torch.randn(src.shape, generator=g))
    return draft


@pytest.fixture(scope="module")
def drafts(model):
    """``smaller``: a 1-layer config with the same vocabulary, the target's first layer (layer-skip
    self-speculation; accepted now and then). ``close``: a noisy copy, accepted often, so long
    chains and tree-path gathers are exercised."""
    smaller = LlamaGenModel(**{**TINY, "n_layers": 1}).eval()
    smaller.load_state_dict(model.state_dict(), strict=False)
    return {"smaller": smaller, "close": perturbed_copy(model, noise=0.05, seed=1)}


@torch.no_grad()
def reference_cfg_greedy(model, labels, n, scale):
    """From scratch: no cache, CFG by hand, the whole [cond; uncond] batch recomputed per token."""
    B = len(labels)
    seq = torch.tensor([[c] for c in labels] + [[model.null_class]] * B)  # (2B, 1)
    for _ in range(n):
        logits = model(seq).logits[:, -1]  # (2B, V)
        l_c, l_u = logits[:B], logits[B:]
        x = (l_u + scale * (l_c - l_u)).argmax(-1)
        seq = torch.cat([seq, torch.cat([x, x])[:, None]], 1)
    return seq[:B, 1:].tolist()


@pytest.fixture(scope="module")
def reference(model):
    ref = reference_cfg_greedy(model, LABELS, GRID * GRID, SCALE)
    assert len({tuple(r) for r in ref}) == len(ref), "rows should differ for the test to bite"
    assert all(len(set(r)) > 3 for r in ref), "the token grid should not be a constant"
    return ref


GREEDY_DRAFTERS = {
    "target-only": lambda d: None,
    "chain": lambda d: ModelChainDrafter(d, gamma=3),
    "tree": lambda d: ModelTreeDrafter(d, top_k=3, depth=2, total_tokens=8),
    "jacobi": lambda d: JacobiDrafter(V, window=4),
}


@pytest.mark.parametrize("method,draft_kind", [
    ("target-only", None), ("chain", "smaller"), ("chain", "close"), ("tree", "smaller"), ("tree", "close"),
    ("jacobi", None),
])
def test_greedy_cfg_bit_identical(model, drafts, reference, method, draft_kind):
    """B=3 rows with different classes, a full 6x6 grid, CFG scale 3."""
    dec = SpeculativeDecoder(model, GREEDY_DRAFTERS[method](drafts.get(draft_kind)),
                             processor=LogitsProcessor(temperature=0, guidance_scale=SCALE))
    out = dec.generate(model.class_prompts(LABELS), GRID * GRID,
                       uncond_input_ids=model.uncond_prompts(len(LABELS)))
    assert out.sequences.tolist() == reference
    if draft_kind == "close":
        assert out.stats.tau > 1.5, "a close draft must be accepted: the test must exercise long paths"


# 4. sampled exactness with CFG ----------------------------------------------------------------
N_SAMPLES, N_TOKENS, LABEL = 20_000, 3, 3
GUIDED = LogitsProcessor(temperature=1.0, top_k=6, guidance_scale=2.0)


class NoResidual(SpeculativeSampling):
    """Broken: after a rejection, resample from p instead of norm(max(p - q, 0))."""

    def reject(self, p, q, x):
        return p


@pytest.fixture(scope="module")
def vocab8_pair():
    """Vocab 8 (10 classes, so the null class id 10 lies outside the image vocabulary), grid 4.
    Init std 0.1 keeps the guided distributions spread (top-1 0.3-0.7, top-k=6 cuts 2-9% of the
    mass); the draft is the target's weights plus noise, so acceptances and rejections are common."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=8, grid_size=4, num_classes=10, dim=16, n_layers=2, n_heads=2, mlp_hidden=32,
               initializer_range=0.1)
    target = LlamaGenModel(**cfg).eval()
    return target, perturbed_copy(target, noise=0.5, seed=1)


DRAFTERS = {"chain": lambda d: ModelChainDrafter(d, gamma=2), "jacobi": lambda d: JacobiDrafter(8, window=3)}


def sample_pvalue(target, drafter, rule=None, seed=0):
    dec = SpeculativeDecoder(target, drafter, rule=rule, processor=GUIDED)
    g = torch.Generator().manual_seed(seed)
    out = dec.generate(target.class_prompts([LABEL] * N_SAMPLES), N_TOKENS, generator=g,
                       uncond_input_ids=target.uncond_prompts(N_SAMPLES))
    probs = exact_joint(target, [LABEL], N_TOKENS, GUIDED, [target.null_class])
    samples = sequence_index(out.sequences[:, :N_TOKENS], target.vocab_size)
    return chisquare_pvalue(samples, probs), total_variation(samples, probs), out.stats


@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["chain", "jacobi"])
def test_sampled_cfg_exact(vocab8_pair, kind):
    """Seed 0, N = 20,000 samples of the first 3 image tokens (one batch of 20,000 guided rows),
    Pearson chi-square against the exact joint over all 8**3 grid prefixes from the reference
    path (``exact_joint``); passes at p >= 1e-3 (``P_THRESHOLD``)."""
    target, draft = vocab8_pair
    pval, tv, stats = sample_pvalue(target, DRAFTERS[kind](draft))
    assert stats.tau > 1.1, "drafts must be accepted for this test to mean anything"
    assert pval >= P_THRESHOLD, f"{kind}: chi-square p={pval:.2e}, TV={tv:.4f}"


@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["chain", "jacobi"])
def test_broken_rule_caught(vocab8_pair, kind):
    """The same test (seed 0, 20,000 samples, threshold 1e-3) rejects a rule without the residual."""
    target, draft = vocab8_pair
    pval, tv, _ = sample_pvalue(target, DRAFTERS[kind](draft), rule=NoResidual())
    assert pval < P_THRESHOLD, f"{kind} with NoResidual passed: p={pval:.2e}, TV={tv:.4f}"


# 5. save/load, label dropout, bad config ------------------------------------------------------
def public_config(model):
    return {k: v for k, v in model.config.items() if not k.startswith("_")}  # not diffusers' bookkeeping


def test_save_load_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").exists()
    loaded = LlamaGenModel.from_pretrained(tmp_path).eval()
    assert public_config(loaded) == public_config(model)
    tokens = torch.tensor([[4, 1, 2, 3], [CLASSES, 9, 8, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_label_dropout():
    model = tiny(1, grid_size=4, class_dropout_prob=1.0)
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 3, 7, 15])
    ids = torch.randint(0, V, (4, 16), generator=g)
    null = torch.full_like(labels, CLASSES)
    with torch.no_grad():
        cond, uncond = model.loss(labels, ids), model.loss(null, ids)  # eval mode: labels kept
        model.train()
        assert torch.equal(model.drop_labels(labels), null)
        dropped = model.loss(labels, ids)
    assert not torch.allclose(cond, uncond)
    assert torch.equal(dropped, uncond), "with class_dropout_prob=1 every label becomes the null class"
    half = LlamaGenModel(**{**TINY, "class_dropout_prob": 0.5})
    frac = (half.drop_labels(torch.zeros(10_000, dtype=torch.long), g) == CLASSES).float().mean()
    assert abs(float(frac) - 0.5) < 0.03


@pytest.mark.parametrize("kwargs,match", [
    ({"grid_size": 0}, r"grid_size must be an int >= 1, got 0"),
    ({"n_heads": 3}, r"n_heads must be a divisor of dim \(32\), got 3"),
    ({"n_heads": 4, "dim": 24}, r"n_heads must be such that dim / n_heads is a multiple of 4"),
    ({"class_dropout_prob": 1.5}, r"class_dropout_prob must be a float in \[0, 1\], got 1.5"),
    ({"class_dropout_prob": -0.1}, r"class_dropout_prob must be a float in \[0, 1\], got -0.1"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaGenModel(**{**TINY, **kwargs})


# 6. training smoke ----------------------------------------------------------------------------
def test_training_reduces_loss():
    torch.manual_seed(0)
    model = LlamaGenModel(**{**TINY, "grid_size": 4})
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, CLASSES, (8,), generator=g)
    ids = torch.randint(0, V, (8, 16), generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(50):
        loss = model.loss(labels, ids, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
