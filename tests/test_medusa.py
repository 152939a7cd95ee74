"""Parallel draft heads (``mmspec.models.medusa.MedusaHeads`` driven by
``mmspec.core.ParallelHeadsDrafter``) on the tiny random LLaVA of ``test_vlm_adapter``.

- Lossless: greedy decoding with untrained, randomised and overfit heads equals the target alone
  at B = 1 and B = 2 (unequal prompt lengths); sampled decoding follows the target's joint law
  (chi-square, stated below) and a broken rule fails the same test.
- One head call per verification, whatever the tree's depth.
- Train/serve consistency: heads overfit by ``distill_loss`` on the target's own answers draft
  them back (most drafts accepted), so the drafter feeds the heads what training showed them
  (the feature before the root, the root token, the image feature).
- Zero init: untrained heads are the target's LM head (their logits equal the target's next-token
  logits); ``image_feature`` is the mean image embedding; bad knobs are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from mmspec.adapters.vlm import VLMTarget
from mmspec.core import LogitsProcessor, ParallelHeadsDrafter, SpeculativeDecoder, SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue
from mmspec.models.medusa import MedusaHeads
from mmspec.models.vlm_distill import answer_mask
from test_vlm_adapter import llava_inputs, tiny_llava
from test_vlm_draft import NEW_TOKENS, teacher_batch
from tiny import spread

TREE = dict(top_k=3, total_tokens=8)


@pytest.fixture(scope="module")
def target():
    return VLMTarget(tiny_llava())


def heads(target, **kw):
    return MedusaHeads.from_target(target, **{"num_heads": 3, **kw}).eval()


def decode(target, rows, medusa=None, logits=None, n=NEW_TOKENS, generator=None, **tree):
    prompts, images = llava_inputs(rows)
    drafter = None if medusa is None else ParallelHeadsDrafter(medusa, **{**TREE, **tree})
    dec = SpeculativeDecoder(target, drafter, processor=logits or LogitsProcessor(temperature=0))
    return dec.generate(prompts, n, conditioning=target.vision_inputs(**images), generator=generator)


@pytest.fixture(scope="module")
def reference(target):
    return {rows: decode(target, rows).sequences for rows in (1, 2)}


def overfit(medusa, target, reference, steps=200):
    ids, P, L, feats, embeds, logits = teacher_batch(target, reference[2].tolist())
    opt = torch.optim.Adam(medusa.parameters(), lr=1e-2)
    for _ in range(steps):
        logs = medusa.distill_loss(feats, ids, embeds, logits, L, answer_mask(ids, P.tolist(), L))
        opt.zero_grad()
        logs["loss"].backward()
        opt.step()
    return medusa.eval(), logs


@pytest.mark.parametrize("rows", [1, 2])
def test_untrained_and_random_heads_are_lossless(target, reference, rows):
    for medusa in (heads(target), spread(heads(target), std=0.3, seed=1)):
        out = decode(target, rows, medusa)
        assert torch.equal(out.sequences, reference[rows])


def test_one_head_call_per_verification(target):
    for depth in (1, 3):
        out = decode(target, 2, spread(heads(target), std=0.3, seed=1), depth=depth)
        assert out.stats.draft_forwards == out.stats.target_forwards - 1  # every pass but the prefill


def test_overfit_heads_draft_what_they_learned(target, reference):
    medusa, logs = overfit(heads(target), target, reference, steps=400)
    assert float(logs["top1"].min()) >= 0.8, logs["top1"]
    for rows in (2, 1):
        out = decode(target, rows, medusa)
        assert torch.equal(out.sequences, reference[rows])
        assert out.stats.tau > 2.5, (rows, out.stats.tau)


@pytest.mark.statistical
def test_sampled_decoding_follows_the_target():
    """The first 3 tokens of 4,000 sampled rows (seed 0, temperature 1, one prompt) against the
    target's exact joint law over the 8^3 cells of an 8-token target with features, chi-square
    at p >= 1e-3; a rule without the residual fails the same test."""
    from mmspec.bench.synthetic import small_vocab_pair
    from mmspec.core.exactness import exact_joint, sequence_index

    target, _ = small_vocab_pair(0)

    class ToyHeads(torch.nn.Module):  # any ParallelHeads: random linear maps of the feature
        vocab_size, num_heads = target.vocab_size, 2

        def __init__(self, H):
            super().__init__()
            g = torch.Generator().manual_seed(3)
            self.w = torch.randn(2, H, self.vocab_size, generator=g) * 2.0

        def start(self, state):
            return None

        def step_inputs(self, state, started):
            return started

        def forward(self, features, root, image=None):
            return torch.einsum("rh,khv->rkv", features.float(), self.w)

    out = target(torch.tensor([[3, 1, 4]]), torch.arange(3)[None], None)
    assert out.hidden is not None
    drafter = lambda: ParallelHeadsDrafter(ToyHeads(out.hidden.shape[-1]), top_k=2, total_tokens=5)  # noqa: E731
    probs = exact_joint(target, [3, 1, 4], 3, LogitsProcessor(temperature=1.0))

    class NoResidual(SpeculativeSampling):
        def reject(self, p, q, x):
            return p

    results = {}
    for name, rule in (("exact", None), ("broken", NoResidual())):
        dec = SpeculativeDecoder(target, drafter(), rule=rule, processor=LogitsProcessor(temperature=1.0))
        res = dec.generate(torch.tensor([[3, 1, 4]]).expand(4000, -1), 3, generator=torch.Generator().manual_seed(0))
        results[name] = (chisquare_pvalue(sequence_index(res.sequences[:, :3], target.vocab_size), probs),
                         res.stats.tau)
    assert results["exact"][1] > 1.1, "drafts must be accepted for the test to mean anything"
    assert results["exact"][0] >= P_THRESHOLD, results
    assert results["broken"][0] < P_THRESHOLD, results


def test_untrained_heads_are_the_lm_head(target):
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    medusa = heads(target)
    out = medusa(feats[:, :-1], ids[:, 1:], medusa.image_feature(ids, embeds, P)[:, None].expand(-1, ids.shape[1] - 1, -1))
    for k in range(medusa.num_heads):
        torch.testing.assert_close(out[:, :, k], logits[:, :-1].float(), rtol=1e-5, atol=1e-5)


def test_image_feature_is_the_mean_image_embedding(target):
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    medusa = heads(target)
    g = medusa.image_feature(ids, embeds, P)
    for r in range(2):
        at = (ids[r, : P[r]] == target.image_token_id).nonzero().flatten()
        assert len(at) > 0
        torch.testing.assert_close(g[r], embeds[r, at].mean(0))


def test_bad_knobs(target):
    with pytest.raises(ValueError, match="depth"):
        ParallelHeadsDrafter(heads(target), depth=4)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(num_heads=0)
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    with pytest.raises(ValueError, match="rollout_steps"):
        heads(target).distill_loss(feats, ids, embeds, logits, L, answer_mask(ids, P.tolist(), L), rollout_steps=2)
    with pytest.raises(RuntimeError, match="bind"):
        MedusaHeads(hidden_size=32, vocab_size=64)(torch.zeros(1, 32), torch.zeros(1, dtype=torch.long))


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory):
    from mmspec.training.recipes import train_vlm

    out = tmp_path_factory.mktemp("vlm") / "model"
    train_vlm(out, size="draft", steps=3, batch_size=4, lr=1e-3, dataset_size=8, heldout_size=4, warmup=1,
              log=lambda m: None)
    return out


def test_recipe_writes_loadable_heads(tiny_vlm_dir, tmp_path):
    """``train_vlm_draft(method="medusa")``: fp16 heads with the per-head held-out agreement in
    the log, the target's embedding and LM head not saved, and the loaded heads lossless."""
    import json

    from transformers import AutoProcessor

    from mmspec.models import load_checkpoint
    from mmspec.training.data.scene_qa import SceneQADataset
    from mmspec.training.recipes import train_vlm_draft
    from mmspec.training.recipes.vlm import encode
    from mmspec.training.recipes.vlm_draft import load_target
    from test_vlm_draft import safetensors_dtypes

    out = tmp_path / "medusa"
    record = train_vlm_draft(out, method="medusa", target_dir=tiny_vlm_dir, steps=2, batch_size=4, lr=1e-3,
                             dataset_size=8, heldout_size=4, warmup=1, medusa_heads=3, log=lambda m: None)
    assert record["method"] == "medusa" and record["config"]["num_heads"] == 3
    assert len(record["heldout_top1"]) == 3 and all(0 <= x <= 1 for x in record["heldout_top1"])
    assert json.loads((out / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert safetensors_dtypes(out) == {"F16"}
    vlm = load_target(tiny_vlm_dir)
    medusa = load_checkpoint(MedusaHeads, out).bind(vlm)
    assert not any("embed" in k or "lm_head" in k for k in medusa.state_dict())
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    pixels, seqs, prompt_lens = encode(processor, SceneQADataset(2, 7))
    prompts = [s[:n] for s, n in zip(seqs, prompt_lens)]
    images = vlm.vision_inputs(torch.cat(pixels))
    greedy = LogitsProcessor(temperature=0)
    plain = SpeculativeDecoder(vlm, None, processor=greedy).generate(prompts, 8, conditioning=images)
    drafted = SpeculativeDecoder(vlm, ParallelHeadsDrafter(medusa, **TREE), processor=greedy).generate(
        prompts, 8, conditioning=images)
    assert torch.equal(drafted.sequences, plain.sequences)


def test_distill_loss_weights_heads_by_decay(target, reference):
    """``decay ** k``: at decay 0 only head 0 is trained (the others get no gradient), at 0.8 all."""
    ids, P, L, feats, embeds, logits = teacher_batch(target, reference[2].tolist())
    for decay, later_trained in ((0.0, False), (0.8, True)):
        medusa = spread(heads(target), std=0.3, seed=2).train()
        medusa.zero_grad()
        mask = answer_mask(ids, P.tolist(), L)
        medusa.distill_loss(feats, ids, embeds, logits, L, mask, decay=decay)["loss"].backward()
        grads = [float(medusa.blocks[k][0].weight.grad.abs().sum()) for k in range(medusa.num_heads)]
        assert grads[0] > 0 and all((g > 0) == later_trained for g in grads[1:]), (decay, grads)


def test_stacked_heads_equal_head_by_head(target):
    """Decoding (no gradients) runs the heads as batched products over stacked weights; training
    runs them head by head. Same logits (to float rounding), and the stack follows weight changes."""
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    medusa = spread(heads(target), std=0.3, seed=2)
    image = medusa.image_feature(ids, embeds, P)[:, None].expand(-1, ids.shape[1] - 1, -1)
    args = (feats[:, :-1], ids[:, 1:], image)
    for _ in range(2):
        with torch.no_grad():
            stacked = medusa(*args)
        looped = medusa(*args).detach()  # gradients on: head by head
        torch.testing.assert_close(stacked, looped, rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # a weight change must reach the stacked path
            medusa.blocks[1][0].weight.add_(0.5)
            medusa.root_in[0].weight.mul_(-1)
