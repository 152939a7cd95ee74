"""Parallel draft heads on the AR image target (``mmspec.models.medusa.GridMedusaHeads`` driven by
``mmspec.core.ParallelHeadsDrafter``), on ``test_eagle``'s tiny LlamaGen targets.

- Zero init: untrained heads are the target's LM head on the feature before the root.
- The spatial inputs: the token one grid row above each drafted token (-1 in the top row) and its
  column, the same in decoding (``step_inputs``, every pass, checked against the finished grid)
  as in training (``spatial_inputs``).
- Lossless: greedy decoding with random and trained heads equals the target alone, with and
  without CFG, B = 1 and 3; sampled decoding with CFG follows the target's exact joint law of the
  first 3 tokens (chi-square, stated below) and a rule without the residual fails the same test.
- One heads call per verification; trained heads are accepted (tau) where random ones are not.
- The ``ar-draft --kind medusa`` recipe and its bad arguments.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmspec import commands
from mmspec.core import LogitsProcessor, ParallelHeadsDrafter, SpeculativeDecoder
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index
from mmspec.models import load_checkpoint
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.medusa import GridMedusaHeads
from mmspec.training.recipes import train_ar_draft
from test_eagle import GRID, LABELS, SCALE, NoResidual, QUIET, TINY_RUN, target, trained_dirs  # noqa: F401

TREE = dict(top_k=2, total_tokens=6)


def randomised(heads: GridMedusaHeads, std: float = 0.3, seed: int = 1) -> GridMedusaHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(std * torch.randn(p.shape, generator=g))
    return heads.eval()


def greedy_grids(model, labels, guided: bool):
    pipeline = LogitsProcessor(temperature=0, guidance_scale=SCALE if guided else None)
    kwargs = {"uncond_input_ids": model.uncond_prompts(len(labels))} if guided else {}
    return SpeculativeDecoder(model, processor=pipeline).generate(model.class_prompts(labels), GRID * GRID, **kwargs)


def decode(model, heads, labels, guided: bool, **tree):
    pipeline = LogitsProcessor(temperature=0, guidance_scale=SCALE if guided else None)
    kwargs = {"uncond_input_ids": model.uncond_prompts(len(labels))} if guided else {}
    drafter = ParallelHeadsDrafter(heads, **{**TREE, **tree})
    return SpeculativeDecoder(model, drafter, processor=pipeline).generate(model.class_prompts(labels), GRID * GRID,
                                                                        **kwargs)


@pytest.fixture(scope="module")
def trained_heads(target):
    """Heads fitted (300 Adam steps) by ``GridMedusaHeads.loss`` to the target's greedy grids for
    every class, with and without guidance, on both CFG halves (as ``test_eagle``'s head)."""
    classes = list(range(target.config.num_classes))
    plain = greedy_grids(target, classes, False).sequences
    guided = greedy_grids(target, classes, True).sequences
    ids = torch.cat([plain, guided, guided])  # generated tokens only: the image grids
    labels = torch.tensor(classes + classes + [target.null_class] * len(classes))
    heads = GridMedusaHeads.from_target(target, num_heads=3).eval()
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(300):
        logs = heads.loss(labels, ids)
        opt.zero_grad()
        logs["loss"].backward()
        opt.step()
    return heads.requires_grad_(False), logs


# 1. zero init and the spatial inputs ------------------------------------------------------------
def test_untrained_heads_are_the_lm_head(target):
    heads = GridMedusaHeads.from_target(target, num_heads=3).eval()
    grid = greedy_grids(target, LABELS, False).sequences  # (3, N) image tokens
    out = target(torch.cat([torch.tensor(LABELS)[:, None], grid[:, :-1]], 1))  # logits at p give raster p
    with torch.no_grad():
        logits = heads(out.hidden[:, :-1], grid[:, :-1],
                       heads.spatial_inputs(torch.arange(GRID * GRID - 1).expand(3, -1), grid))
    for k in range(3):
        torch.testing.assert_close(logits[:, :, k], out.logits[:, :-1], rtol=1e-5, atol=1e-5)


def test_spatial_inputs_are_the_token_above_and_the_column():
    heads = GridMedusaHeads(dim=8, vocab_size=50, grid_size=4, num_heads=3)
    ids = torch.arange(16)[None] + 10  # raster index i holds id 10 + i
    out = heads.spatial_inputs(torch.tensor([[0, 2, 5, 12]]), ids)
    # roots at raster 0, 2, 5, 12: heads predict 1-3, 3-5, 6-8, 13-15
    assert out["above"].tolist() == [[[-1, -1, -1], [-1, 10, 11], [12, 13, 14], [19, 20, 21]]]
    assert out["column"].tolist() == [[[1, 2, 3], [3, 0, 1], [2, 3, 0], [1, 2, 3]]]
    with pytest.raises(ValueError, match=r"num_heads must be an int in \[1, 3\]"):
        GridMedusaHeads(dim=8, vocab_size=50, grid_size=4, num_heads=4)


def test_decoding_feeds_the_heads_what_training_shows_them(target):
    """Every pass's ``step_inputs`` (with CFG: both halves) equals ``spatial_inputs`` of the
    finished grid at that pass's root: the tokens above are committed ones, read at the right place."""
    seen = []

    class Spy(GridMedusaHeads):
        def step_inputs(self, state, started):
            out = super().step_inputs(state, started)
            seen.append((state.lengths - 1 - state.prompt_lengths, out))
            return out

    heads = randomised(Spy.from_target(target, num_heads=3))
    res = decode(target, heads, LABELS, guided=True)
    grid = res.sequences  # the image tokens
    assert len(seen) == res.stats.target_forwards - 1 > 10
    B = len(LABELS)
    for root, out in seen:
        assert out["above"].shape == (2 * B, 3)
        want = heads.spatial_inputs(root[:B, None], grid)
        assert torch.equal(out["above"][:B], want["above"][:, 0]) and torch.equal(out["above"][B:], out["above"][:B])
        assert torch.equal(out["column"][:B], want["column"][:, 0])
    assert any((out["above"] >= 0).any() for _, out in seen) and any((out["above"] < 0).any() for _, out in seen)


# 2. lossless --------------------------------------------------------------------------------------
@pytest.mark.parametrize("guided", [False, True], ids=["plain", "cfg"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B=1", "B=3"])
def test_greedy_bit_identical(target, trained_heads, guided, batch):
    labels = LABELS[:batch]
    reference = greedy_grids(target, labels, guided).sequences
    for heads in (randomised(GridMedusaHeads.from_target(target, num_heads=3)), trained_heads[0]):
        out = decode(target, heads, labels, guided)
        assert out.sequences.tolist() == reference.tolist()
        assert out.stats.draft_forwards == out.stats.target_forwards - 1  # one heads call per pass


def test_trained_heads_are_accepted(target, trained_heads):
    """Train/serve consistency: heads fitted on the target's own grids agree with its argmax far
    more often than untrained ones (the random target's distributions are wide: about 0.40
    against 0.13 per head), and decoding with them accepts more (tau about 1.5 against 1.2), so
    decoding feeds the heads what training showed them."""
    heads, logs = trained_heads
    untrained = GridMedusaHeads.from_target(target, num_heads=3).eval()
    classes = list(range(target.config.num_classes))
    with torch.no_grad():
        before = untrained.loss(torch.tensor(classes), greedy_grids(target, classes, False).sequences)["top1"]
    assert float(logs["top1"].min()) > float(before.max()) + 0.2, (logs["top1"], before)
    taus = [decode(target, h, LABELS, guided=True, top_k=3, total_tokens=10).stats.tau for h in (heads, untrained)]
    assert taus[0] > 1.3 and taus[0] > taus[1] + 0.15, taus


N_SAMPLES, N_TOKENS, LABEL = 20_000, 3, 3
GUIDED = LogitsProcessor(temperature=1.0, guidance_scale=2.0)


@pytest.fixture(scope="module")
def vocab8():
    """``test_eagle``'s vocab-8, grid-4 target (init std 0.1) and random heads (std 0.3, K = 2)."""
    torch.manual_seed(0)
    model = LlamaGenModel(vocab_size=8, grid_size=4, num_classes=10, dim=16, n_layers=2, n_heads=2, mlp_hidden=32,
                          initializer_range=0.1).eval()
    heads = randomised(GridMedusaHeads.from_target(model, num_heads=2), std=0.5)
    return model, heads, exact_joint(model, [LABEL], N_TOKENS, GUIDED, [model.null_class])


@pytest.mark.statistical
@pytest.mark.parametrize("broken", [False, True], ids=["exact", "no-residual"])
def test_sampled_cfg_exact(vocab8, broken):
    """Seed 0, 20,000 guided rows (temperature 1, guidance 2), the first 3 image tokens against
    the exact joint over all 8**3 prefixes, Pearson chi-square at p >= 1e-3 (``P_THRESHOLD``);
    a rule that resamples from p after a rejection fails the same test."""
    model, heads, probs = vocab8
    dec = SpeculativeDecoder(model, ParallelHeadsDrafter(heads, top_k=2, total_tokens=5),
                             rule=NoResidual() if broken else None, processor=GUIDED)
    out = dec.generate(model.class_prompts([LABEL] * N_SAMPLES), N_TOKENS, generator=torch.Generator().manual_seed(0),
                       uncond_input_ids=model.uncond_prompts(N_SAMPLES))
    pval = chisquare_pvalue(sequence_index(out.sequences[:, :N_TOKENS], model.vocab_size), probs)
    assert out.stats.tau > 1.1, "drafts must be accepted for this test to mean anything"
    assert (pval < P_THRESHOLD) if broken else (pval >= P_THRESHOLD), pval


# 3. the recipe ------------------------------------------------------------------------------------
def test_medusa_recipe_saves_heads_for_the_target(tmp_path, trained_dirs):
    vq_dir, ar_dir = trained_dirs
    out = tmp_path / "medusa"
    record = train_ar_draft(out, kind="medusa", vq_dir=vq_dir, target_dir=ar_dir, medusa_heads=3, **TINY_RUN, **QUIET)
    assert json.loads((out / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert (record["recipe"], record["kind"], record["config"]["num_heads"]) == ("ar-draft", "medusa", 3)
    assert len(record["heldout_top1"]) == len(record["heldout_top1_uncond"]) == 3
    assert all(0 <= x <= 1 for x in record["heldout_top1"]) and record["heldout_loss"] > 0
    target = load_checkpoint(LlamaGenModel, ar_dir)
    heads = load_checkpoint(GridMedusaHeads, out).bind(target)
    assert set(heads.state_dict()) == {"block_weight", "block_bias", "root_in", "above_in", "column"}
    with pytest.raises(ValueError, match="medusa_heads must be an int >= 1"):
        train_ar_draft(tmp_path / "x", kind="medusa", vq_dir=vq_dir, target_dir=ar_dir, medusa_heads=0, **TINY_RUN)
    with pytest.raises(ValueError, match="target_dir must be the folder of the AR target .kind='medusa'"):
        train_ar_draft(tmp_path / "x", kind="medusa", vq_dir=vq_dir, **TINY_RUN)
    assert not (tmp_path / "x").exists()


def test_cli_heads_only_for_medusa(tmp_path, trained_dirs, capsys):
    vq_dir, ar_dir = trained_dirs
    with pytest.raises(SystemExit) as exit_:
        commands.main(["train", "ar-draft", "--kind", "eagle", "--heads", "3", "--target", str(ar_dir), "--vq",
                       str(vq_dir), "--out", str(tmp_path / "e")])
    assert exit_.value.code == 2 and "--heads is for --kind medusa only, got --kind eagle" in capsys.readouterr().err
    args = commands.build_parser().parse_args(["train", "ar-draft", "--kind", "medusa", "--heads", "3", "--target",
                                               str(ar_dir), "--vq", str(vq_dir), "--out", "x"])
    assert (args.kind, args.heads) == ("medusa", 3)
