"""EAGLE's feature head on the LlamaGen target: the head's weights and binding, the drafter's
feature bookkeeping against a from-scratch pass, greedy bit-identity with and without CFG, the
distribution test with CFG for both tree forms (and a broken rule it must catch), and the
``ar-draft`` recipes."""

import json

import pytest
import torch

from mmspec import commands
from mmspec.core import EagleTreeDrafter, LogitsProcessor, ModelTreeDrafter, SpeculativeDecoder, SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index, total_variation
from mmspec.models import load_checkpoint
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.llamagen import LlamaGenModel
from mmspec.training.recipes import train_ar_draft, train_ar_image, train_vq

V, GRID, CLASSES = 32, 6, 16
TINY = dict(vocab_size=V, grid_size=GRID, num_classes=CLASSES, dim=32, n_layers=2, n_heads=2, mlp_hidden=64)
LABELS = [1, 5, 11]
SCALE = 3.0


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaGenModel(**TINY, initializer_range=0.3).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def random_head(target):
    torch.manual_seed(1)
    return EagleDraftHead.from_target(target, initializer_range=0.2).eval()


@pytest.fixture(scope="module")
def trained_head(target):
    """A head fitted (300 Adam steps, about 6 s) to the target's greedy grids for every class,
    with and without guidance, on both CFG halves: accepted often, so the drafter's bookkeeping
    decides whether it is (a wrong feature/token pairing would leave it near the random head)."""
    classes = list(range(CLASSES))
    plain = SpeculativeDecoder(target, processor=LogitsProcessor(temperature=0)).generate(
        target.class_prompts(classes), GRID * GRID).sequences
    guided = SpeculativeDecoder(target, processor=LogitsProcessor(temperature=0, guidance_scale=SCALE)).generate(
        target.class_prompts(classes), GRID * GRID, uncond_input_ids=target.uncond_prompts(CLASSES)).sequences
    ids = torch.cat([plain, guided, guided])
    labels = torch.tensor(classes + classes + [target.null_class] * CLASSES)
    torch.manual_seed(1)
    head = EagleDraftHead.from_target(target).eval()  # eval: labels kept, both halves given explicitly
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(300):
        loss = head.loss(labels, ids, cls_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.requires_grad_(False)


# 1. the head: its own weights only, bound to a target ------------------------------------------
def test_head_saves_only_fc_and_block(target, random_head, tmp_path):
    keys = set(random_head.state_dict())
    assert keys == {"fc.weight", "block.wqkv.weight", "block.wo.weight", "block.ffn_norm.weight",
                    "block.w1.weight", "block.w2.weight", "block.w3.weight"}
    random_head.save_pretrained(tmp_path)
    loaded = load_checkpoint(EagleDraftHead, tmp_path)
    with pytest.raises(RuntimeError, match="not bound to a target"):
        loaded(torch.zeros(1, 1, 32), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    loaded.bind(target)
    feats, tokens = torch.randn(2, 5, 32), torch.randint(0, V, (2, 5))
    positions = torch.arange(1, 6).expand(2, 5)
    with torch.no_grad():
        a, b = random_head(feats, tokens, positions), loaded(feats, tokens, positions)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
    assert a.logits.shape == (2, 5, V) and a.hidden.shape == (2, 5, 32)
    # the logits are the target's own LM head applied to the predicted features
    torch.testing.assert_close(a.logits, target.output(a.hidden))


def test_bind_checks_the_target(random_head):
    other = LlamaGenModel(**{**TINY, "vocab_size": 16})
    with pytest.raises(ValueError, match="target must be a LlamaGenModel with vocab_size=32"):
        EagleDraftHead(**{k: random_head.config[k] for k in ("vocab_size", "grid_size", "dim")},
                       n_heads=2, mlp_hidden=64).bind(other)


# 2. the drafter feeds the head exactly EAGLE's pairs ---------------------------------------------
@torch.no_grad()
def test_root_output_matches_a_from_scratch_head_pass(target, random_head):
    """After every pass (B=3, CFG, top-k tree, 36 tokens) the drafter's head output at each row's
    root equals the head run without a cache over the target's reference features: entries
    (f_{p-1}, x_p) for p = 1 .. L-1, features from the target's cache-free pass."""
    drafter = EagleTreeDrafter(random_head, top_k=3, depth=3, total_tokens=12)
    checked = []

    def compare(step, state):
        got = drafter.root_output(state)
        for r in range(state.rows):
            L = int(state.lengths[r])
            seq = state.tokens[r : r + 1, :L]
            feats = target(seq).hidden  # (1, L, H)
            ref = random_head(feats[:, : L - 1], seq[:, 1:], torch.arange(1, L)[None])
            torch.testing.assert_close(got.hidden[r], ref.hidden[0, -1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.logits[r], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
        checked.append(step)

    out = SpeculativeDecoder(target, drafter, processor=LogitsProcessor(temperature=0, guidance_scale=SCALE)).generate(
        target.class_prompts(LABELS), GRID * GRID, uncond_input_ids=target.uncond_prompts(len(LABELS)),
        callback=compare)
    assert len(checked) == out.stats.target_forwards - 1 > 0


@torch.no_grad()
@pytest.mark.parametrize("kind", ["eagle", "draft-model"])
def test_a_tree_wider_than_its_block_fits_the_draft_cache(target, random_head, kind):
    """A tree is fed to the draft level by level (``top_k`` nodes per level, ``depth`` levels)
    before it is cut to ``total_tokens``, so a proposal made when a row's history is near the
    decoder's capacity needs ``top_k * depth`` draft-cache slots past it, more than the two
    verify blocks the capacity leaves when ``total_tokens`` is small (EAGLE-2's top-k tree; a
    sampled tree verifies every node it feeds). Greedy decoding to the last token with such trees
    runs (it overflowed the draft's cache before) and equals ``none``."""
    knobs = dict(top_k=4, depth=4, total_tokens=3)  # 16 fed nodes, blocks of 3
    drafter = EagleTreeDrafter(random_head, **knobs) if kind == "eagle" else ModelTreeDrafter(target, **knobs)
    prompts = target.class_prompts(LABELS)
    greedy = LogitsProcessor(temperature=0)
    want = SpeculativeDecoder(target, processor=greedy).generate(prompts, GRID * GRID).sequences
    got = SpeculativeDecoder(target, drafter, processor=greedy).generate(prompts, GRID * GRID).sequences
    assert torch.equal(got, want)


def test_needs_the_targets_features(random_head):
    from mmspec.core.decoder import DecodeState

    state = DecodeState(tokens=torch.zeros(1, 4, dtype=torch.long), lengths=torch.tensor([2]), batch_size=1,
                        processor=LogitsProcessor(), generator=None, max_len=4)  # no prefill output
    with pytest.raises(ValueError, match="needs the target's features"):
        EagleTreeDrafter(random_head).start(state)


# 3. greedy: bit-identical to target-only decoding ------------------------------------------------
@pytest.mark.parametrize("mode", ["topk", "sample"])
@pytest.mark.parametrize("guided", [False, True], ids=["plain", "cfg"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B=1", "B=3"])
def test_greedy_bit_identical(target, trained_head, mode, guided, batch):
    pipeline = LogitsProcessor(temperature=0, guidance_scale=SCALE if guided else None)
    labels = LABELS[:batch]
    kwargs = {"uncond_input_ids": target.uncond_prompts(batch)} if guided else {}
    reference = SpeculativeDecoder(target, processor=pipeline).generate(
        target.class_prompts(labels), GRID * GRID, **kwargs).sequences
    drafter = EagleTreeDrafter(trained_head, top_k=3, depth=3, total_tokens=12, mode=mode)
    out = SpeculativeDecoder(target, drafter, processor=pipeline).generate(
        target.class_prompts(labels), GRID * GRID, **kwargs)
    assert out.sequences.tolist() == reference.tolist()
    if batch == 3:  # the trained head must be accepted: long paths and tree gathers are exercised
        assert out.stats.tau > (1.1 if mode == "sample" or guided else 1.4), out.stats.tau


# 4. the distribution test with CFG ---------------------------------------------------------------
N_SAMPLES, N_TOKENS, LABEL = 20_000, 3, 3
GUIDED = LogitsProcessor(temperature=1.0, guidance_scale=2.0)
TREES = {"topk": dict(top_k=3, depth=2, total_tokens=8, mode="topk"),  # EAGLE-2's form, q = 1
         "sample": dict(top_k=2, depth=2, mode="sample")}  # nodes sampled without replacement


class NoResidual(SpeculativeSampling):
    """Broken: after a rejection, resample from p instead of norm(max(p - q, 0))."""

    def reject(self, p, q, x):
        return p


@pytest.fixture(scope="module")
def vocab8():
    """Vocab 8, grid 4, 10 classes (null id 10): a spread guided distribution (init std 0.1) and a
    random head (init std 0.3), accepted about a third of the time."""
    torch.manual_seed(0)
    target = LlamaGenModel(vocab_size=8, grid_size=4, num_classes=10, dim=16, n_layers=2, n_heads=2,
                           mlp_hidden=32, initializer_range=0.1).eval()
    torch.manual_seed(1)
    head = EagleDraftHead.from_target(target, initializer_range=0.3).eval()
    probs = exact_joint(target, [LABEL], N_TOKENS, GUIDED, [target.null_class])
    return target, head, probs


def sample_pvalue(vocab8, tree, rule=None, seed=0):
    target, head, probs = vocab8
    dec = SpeculativeDecoder(target, EagleTreeDrafter(head, **TREES[tree]), rule=rule, processor=GUIDED)
    g = torch.Generator().manual_seed(seed)
    out = dec.generate(target.class_prompts([LABEL] * N_SAMPLES), N_TOKENS, generator=g,
                       uncond_input_ids=target.uncond_prompts(N_SAMPLES))
    samples = sequence_index(out.sequences[:, :N_TOKENS], target.vocab_size)
    return chisquare_pvalue(samples, probs), total_variation(samples, probs), out.stats


@pytest.mark.statistical
@pytest.mark.parametrize("tree", list(TREES))
def test_sampled_cfg_exact(vocab8, tree):
    """Seed 0, N = 20,000 samples of the first 3 image tokens (one batch of 20,000 guided rows,
    temperature 1, guidance 2), Pearson chi-square against the exact joint over all 8**3 prefixes
    from the target's reference path; passes at p >= 1e-3 (``P_THRESHOLD``)."""
    pval, tv, stats = sample_pvalue(vocab8, tree)
    assert stats.tau > 1.1, "drafts must be accepted for this test to mean anything"
    assert pval >= P_THRESHOLD, f"eagle {tree}: chi-square p={pval:.2e}, TV={tv:.4f}"


@pytest.mark.statistical
@pytest.mark.parametrize("tree", list(TREES))
def test_broken_rule_caught(vocab8, tree):
    """The same test (seed 0, 20,000 samples, threshold 1e-3) rejects a rule without the residual."""
    pval, tv, _ = sample_pvalue(vocab8, tree, rule=NoResidual())
    assert pval < P_THRESHOLD, f"eagle {tree} with NoResidual passed: p={pval:.2e}, TV={tv:.4f}"


# 5. the ar-draft recipes -------------------------------------------------------------------------
TINY_RUN = dict(steps=3, batch_size=2, lr=1e-3, dataset_size=8, heldout_size=4, log_every=2)
QUIET = dict(log=lambda msg: None)


@pytest.fixture(scope="module")
def trained_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ar-draft")
    train_vq(root / "vq", **TINY_RUN, **QUIET)
    train_ar_image(root / "ar", vq_dir=root / "vq", model_config=dict(dim=32, n_layers=1, n_heads=2, mlp_hidden=64),
                   **TINY_RUN, **QUIET)
    return root / "vq", root / "ar"


def test_eagle_recipe_saves_a_head_for_the_target(tmp_path, trained_dirs):
    vq_dir, ar_dir = trained_dirs
    out = tmp_path / "eagle"
    record = train_ar_draft(out, kind="eagle", vq_dir=vq_dir, target_dir=ar_dir, **TINY_RUN, **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle"]
    assert json.loads((out / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert (record["recipe"], record["kind"], record["steps"]) == ("ar-draft", "eagle", 3)
    assert 0 <= record["heldout_top1"] <= 1 and 0 <= record["heldout_top1_uncond"] <= 1
    assert record["heldout_loss"] > 0 and record["target_dir"] == str(ar_dir.resolve())
    target = load_checkpoint(LlamaGenModel, ar_dir)
    head = load_checkpoint(EagleDraftHead, out).bind(target)
    assert not any(k.startswith(("tok_embeddings", "output")) for k in head.state_dict())
    out2 = tmp_path / "eagle2"
    train_ar_draft(out2, kind="eagle", vq_dir=vq_dir, target_dir=ar_dir, **TINY_RUN, **QUIET)
    weights = "diffusion_pytorch_model.safetensors"
    assert (out / weights).read_bytes() == (out2 / weights).read_bytes(), "one seed, one set of weights"


def test_chain_recipe_reuses_the_ar_recipe(tmp_path, trained_dirs):
    vq_dir, ar_dir = trained_dirs
    out = tmp_path / "chain"
    record = train_ar_draft(out, kind="chain", vq_dir=vq_dir, steps=3, batch_size=2, lr=1e-3, dataset_size=8,
                            heldout_size=4, model_config=dict(dim=16, n_layers=1, n_heads=2, mlp_hidden=32),
                            **QUIET)
    assert json.loads((out / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert (record["recipe"], record["kind"], record["target_dir"]) == ("ar-draft", "chain", None)
    assert record["heldout_loss"] > 0
    draft = load_checkpoint(LlamaGenModel, out)
    assert (draft.config.dim, draft.config.n_layers) == (16, 1)
    assert draft.vocab_size == load_checkpoint(LlamaGenModel, ar_dir).vocab_size


def test_ar_draft_bad_arguments(tmp_path, trained_dirs):
    vq_dir, ar_dir = trained_dirs
    with pytest.raises(ValueError, match="kind must be one of .eagle., .medusa., .chain."):
        train_ar_draft(tmp_path / "x", kind="hydra", vq_dir=vq_dir, target_dir=ar_dir, **TINY_RUN)
    with pytest.raises(ValueError, match="target_dir must be the folder of the AR target"):
        train_ar_draft(tmp_path / "x", kind="eagle", vq_dir=vq_dir, **TINY_RUN)
    with pytest.raises(ValueError, match="target_dir must be a folder saved by LlamaGenModel"):
        train_ar_draft(tmp_path / "x", kind="eagle", vq_dir=vq_dir, target_dir=vq_dir / "missing", **TINY_RUN)
    assert not (tmp_path / "x").exists()


def test_cli_ar_draft(tmp_path, trained_dirs, capsys):
    vq_dir, ar_dir = trained_dirs
    args = commands.build_parser().parse_args(["train", "ar-draft", "--kind", "eagle", "--target", str(ar_dir),
                                               "--vq", str(vq_dir), "--out", "x"])
    assert (args.recipe, args.kind, args.target, args.steps) == \
        ("ar-draft", "eagle", str(ar_dir), commands.train.TRAIN_DEFAULTS["ar-draft"]["steps"])
    with pytest.raises(SystemExit) as exit_:
        commands.main(["train", "ar-draft", "--kind", "eagle", "--vq", str(vq_dir), "--out", str(tmp_path / "e"),
                       "--threads", str(torch.get_num_threads())])
    assert exit_.value.code == 2 and "--kind eagle needs --target" in capsys.readouterr().err
    threads = torch.get_num_threads()
    try:
        assert commands.main(["train", "ar-draft", "--kind", "eagle", "--target", str(ar_dir), "--vq", str(vq_dir),
                              "--out", str(tmp_path / "e"), "--steps", "1", "--batch-size", "2", "--dataset-size", "2",
                              "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "held-out top-1 agreement" in capsys.readouterr().out
