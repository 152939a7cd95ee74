"""VLM draft heads (``mmspec.models.vlm_draft``: eagle, specvlm, vispec) on tiny random LLaVA
targets, and the two VLM recipes.

- Lossless: greedy decoding with any head (untrained, every forced SpecVLM branch, overfit) equals
  the target alone, at B = 1 and B = 2 with unequal prompt lengths; an overfit head's drafts are
  accepted, so drafting really follows the path the head was trained on.
- Train/serve consistency: the drafting path (``start``'s plan, the planned first feed into the
  compressed cache, later feeds of 1-3 entries with rejected entries truncated away) gives the
  features the training path of ``distill_loss`` computes, and the SpecVLM gate reads the same
  question in both.
- ViSpec's ``img_fc`` starts as ``[I | 0]``, ``distill_loss`` trains what it should, bad input.
- Recipes: ``train_vlm`` writes a loadable LLaVA + processor, ``train_vlm_draft`` loadable heads
  for the three methods, also under ``accelerate launch`` with 2 processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mmspec.adapters.vlm import VLMTarget
from mmspec.core import EagleTreeDrafter, LogitsProcessor, SpeculativeDecoder
from mmspec.core.types import ModelOutput
from mmspec.models import load_checkpoint
from mmspec.models.vlm_draft import BRANCHES, METHODS, VLMDraftHead
from mmspec.models.vlm_distill import answer_mask, teacher
from test_vlm_adapter import IMAGE, LLAVA_TOKENS, llava_inputs, tiny_llava
from tiny import spread

pytestmark = pytest.mark.slow

SMALL = dict(num_heads=4, intermediate_size=64, prune_ratio=2, pool_ratio=4, conv_ratio=4)
HIDDEN = 32  # tiny_llava's text hidden size
NEW_TOKENS = 16
TREE = dict(top_k=3, depth=3, total_tokens=8)
# continuations making both rows of llava_inputs(2) (prompt lengths 11 and 10) 17 tokens long
CONTINUATIONS = [[7, 40, 21, 3, 11, 9], [12, 33, 14, 5, 16, 17, 8]]
# per SpecVLM branch, the visual tokens a 4-token (2 x 2) image becomes with SMALL's ratios
BRANCH_TOKENS = {"prune": 2, "pool": 1, "conv": 1, "resampler": 2, "text": 0}


@pytest.fixture(scope="module")
def target():
    return VLMTarget(tiny_llava())


def new_head(target, method, **overrides):
    """An untrained head, as ``from_target`` builds it (eval: pruning is evenly strided)."""
    torch.manual_seed(0)
    return VLMDraftHead.from_target(target, method=method, **{**SMALL, **overrides}).eval()


def random_head(target, method, seed=0):
    """A head whose matrices are all redrawn wide, so its outputs are far from zero."""
    return spread(new_head(target, method), std=0.3, seed=seed).eval()


def force_branch(head, branch):
    with torch.no_grad():
        head.compressor.gate.weight.zero_()
        head.compressor.gate.bias.copy_(10.0 * (torch.arange(len(BRANCHES)) == BRANCHES.index(branch)))
    return head


def decode(target, rows, head=None):
    prompts, images = llava_inputs(rows)
    drafter = None if head is None else EagleTreeDrafter(head, **TREE)
    return SpeculativeDecoder(target, drafter, processor=LogitsProcessor(temperature=0)).generate(
        prompts, NEW_TOKENS, conditioning=target.vision_inputs(**images))


@pytest.fixture(scope="module")
def reference(target):
    """The target's own greedy answers (no drafter) at B = 1 and B = 2."""
    return {rows: decode(target, rows).sequences for rows in (1, 2)}


def teacher_batch(target, continuations=CONTINUATIONS):
    """llava_inputs(2)'s prompts + continuations, right-padded, through the target teacher-forced
    (the recipe's ``teacher``): ids, prompt lengths, lengths, features, merged embeds, logits."""
    prompts, images = llava_inputs(2)
    seqs = [p + c for p, c in zip(prompts, continuations)]
    S = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (S - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (S - len(s)) for s in seqs])
    prompt_lens = torch.tensor([len(p) for p in prompts])
    feats, embeds, logits = teacher(target, ids, mask, images, prompt_lens)
    return ids, prompt_lens, mask.sum(1), feats, embeds, logits


# -- 1. lossless greedy decoding ---------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_untrained_heads_are_lossless(target, reference, method, rows):
    head = new_head(target, method)
    out = decode(target, rows, head)
    assert torch.equal(out.sequences, reference[rows])
    assert out.stats.tau >= 1


@pytest.mark.parametrize("branch", BRANCHES)
def test_every_forced_specvlm_branch_is_lossless(target, reference, branch):
    head = force_branch(new_head(target, "specvlm"), branch)
    assert torch.equal(decode(target, 2, head).sequences, reference[2])
    # the branch really was the one drafting: a 2 x 2 image became BRANCH_TOKENS[branch] tokens
    ids, P, L, feats, embeds, _ = teacher_batch(target)
    plan = head.plan(feats, ids, embeds, P)
    assert plan["branches"] == [[BRANCHES.index(branch)]] * 2
    assert [len(v[0]) for v in plan["visual"]] == [BRANCH_TOKENS[branch]] * 2


def overfit(head, target, reference, steps=150):
    """Distill ``head`` on the target's own greedy answers to llava_inputs(2) (eval mode: the plan
    is deterministic and a forced gate stays forced)."""
    ids, P, L, feats, embeds, logits = teacher_batch(target, reference[2].tolist())
    mask = answer_mask(ids, P.tolist(), L)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        logs = head.distill_loss(feats, ids, embeds, logits, L, mask, logit_weight=1.0)
        opt.zero_grad()
        logs["loss"].backward()
        opt.step()
    assert float(logs["step0_top1"]) == 1.0
    return head


@pytest.mark.parametrize("method, branch", [("eagle", None), ("vispec", None)]
                         + [("specvlm", b) for b in BRANCHES])
def test_overfit_heads_draft_what_they_learned(target, reference, method, branch):
    """A head overfit (by ``distill_loss``) on the target's answers drafts them back through the
    drafter: most drafts accepted, at B = 1 and 2. A drafting path that fed the head anything but
    what training showed it (positions, slots, compressed tokens, features) would lose this."""
    head = new_head(target, method)
    if branch is not None:
        force_branch(head, branch)
    overfit(head, target, reference)
    for rows in (2, 1):
        out = decode(target, rows, head)
        assert torch.equal(out.sequences, reference[rows])
        assert out.stats.tau > 2.5, (rows, out.stats.tau)


# -- 2. train/serve consistency ----------------------------------------------------------------

def spy(obj, name, calls):
    """Record every call of ``obj.name`` (args and result) into ``calls``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append((args, result))
        return result

    setattr(obj, name, wrapper)


def drafting_path(head, target, ids, P, feats, embeds, widths):
    """Entries (f_{p-1}, x_p) of the whole batch fed the way ``EagleTreeDrafter`` feeds them:
    ``start`` plans from the prompt, the first feed covers positions 1 .. max(P) (the shorter
    row's extra entry is cut), then rounds: a few rejected tree entries are fed and truncated away,
    the cache is cut back to re-feed the last committed entry on odd rounds, and ``width`` real
    entries follow. Returns the (R, S-1, H) hidden at column p - 1 for entry p, and the cache."""
    R, S = ids.shape
    Pm = int(P.max())
    # what the prefill returns: features and merged input embeddings over the padded prompts
    state = SimpleNamespace(prefill=ModelOutput(logits=None, hidden=feats[:, :Pm], prompt_embeds=embeds[:, :Pm]),
                            tokens=ids, prompt_lengths=P)
    cache = head.new_cache(R, 64)
    head.start(cache, state)
    got = torch.full((R, S - 1, HIDDEN), float("nan"))
    rows = torch.arange(R)[:, None]

    def feed(positions, features=None, tokens=None, tree_mask=None):
        clamped = positions.clamp(max=S - 1)
        features = feats.gather(1, (clamped - 1)[..., None].expand(-1, -1, HIDDEN)) if features is None else features
        tokens = ids.gather(1, clamped) if tokens is None else tokens
        return head(features, tokens, positions, cache, tree_mask).hidden

    positions = torch.arange(1, Pm + 1).expand(R, -1)
    hidden = feed(positions)
    valid = positions <= P[:, None]
    got[rows.expand_as(positions)[valid], (positions - 1)[valid]] = hidden[valid]
    fed = P.clone()  # entries 1 .. fed[r] are committed
    cache.truncate(fed)
    gen = torch.Generator().manual_seed(0)
    for i, width in enumerate(widths):
        # a rejected tree level: k siblings after the committed entries, each seeing only itself
        k = 1 + i % 3
        junk = fed[:, None] + 1 + torch.zeros(1, k, dtype=torch.long)
        feed(junk, torch.randn(R, k, HIDDEN, generator=gen), torch.randint(0, 60, (R, k), generator=gen),
             torch.eye(k, dtype=torch.bool).expand(R, k, k))
        start = fed - (i % 2)  # odd rounds re-feed the last committed entry (the drafter's root)
        cache.truncate(start)
        positions = start[:, None] + 1 + torch.arange(fed.sub(start).max() + width)
        hidden = feed(positions)
        valid = positions <= S - 1
        got[rows.expand_as(positions)[valid], (positions - 1)[valid]] = hidden[valid]
        fed = (fed + width).clamp(max=S - 1)
        cache.truncate(fed)
        if int(fed.min()) == S - 1:
            break
    assert int(fed.min()) == S - 1, "widths too short to reach the end"
    assert torch.equal(cache.lengths, fed - cache.offset)  # slots = positions - the dropped entries
    return got, cache


@pytest.mark.parametrize("method", METHODS)
def test_drafting_path_equals_the_training_path(target, method):
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    assert torch.equal(L, torch.tensor([ids.shape[1]] * 2))  # no right padding: every entry compares
    head = random_head(target, method)
    gates = []
    if method == "specvlm":
        spy(head.compressor, "gate_logits", gates)

    # the training path: distill_loss's own (cache-free) decoder-layer pass, as the recipe calls it
    layer = []
    spy(head, "_layer", layer)
    with torch.no_grad():
        head.distill_loss(feats, ids, embeds, logits, L, answer_mask(ids, P.tolist(), L))
    del head._layer
    assert len(layer) == 1
    ref = layer[0][1][0]  # (R, S-1, H): f^_p at column p - 1

    with torch.no_grad():
        got, cache = drafting_path(head, target, ids, P, feats, embeds, widths=[1, 3, 1, 2, 1, 1, 2, 1])

    text = ids[:, 1:] != IMAGE  # compressed heads have no output at their image entries
    assert not got[text].isnan().any()
    torch.testing.assert_close(got[text], ref[text], atol=1e-5, rtol=0)
    assert ref[text].abs().mean() > 1  # far from zero: the comparison means something
    if method == "eagle":
        assert cache.offset.tolist() == [0, 0]
    else:  # the image spans were compressed: the cache is shorter than the positions
        assert (cache.offset > 0).all()
    if method == "specvlm":
        # the gate read the same image and question in training (calls 0, 1) and at serving (2, 3)
        assert len(gates) == 4
        for (train_args, train_out), (serve_args, serve_out) in zip(gates[:2], gates[2:]):
            for a, b in zip(train_args, serve_args):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
            torch.testing.assert_close(train_out, serve_out, atol=1e-5, rtol=0)


def test_compressed_tokens_take_the_last_positions_of_their_span(target):
    """ViSpec's placement: the image span's entries (positions 3..6 here) are dropped, its c
    compressed tokens enter at positions 7-c..6, and every text entry keeps its position."""
    head = force_branch(new_head(target, "specvlm"), "prune")  # 2 tokens for 4
    ids = torch.tensor([[1, 5, 9] + [IMAGE] * LLAVA_TOKENS + [2, 33]])
    x = torch.randn(1, 8, HIDDEN)
    positions = torch.arange(1, 9)[None]
    plan = head.plan(torch.randn(1, 9, HIDDEN), ids, torch.randn(1, 9, HIDDEN), torch.tensor([9]))
    assert plan["spans"] == [[(3, 6)]]
    inputs, pos, cols, offsets = head._merge(x, positions, plan)
    assert pos.tolist() == [[1, 2, 5, 6, 7, 8]] and cols.tolist() == [[0, 1, -1, -1, 6, 7]]
    assert offsets.tolist() == [2]
    torch.testing.assert_close(inputs[0, 2:4], plan["visual"][0][0])
    torch.testing.assert_close(inputs[0, [0, 1, 4, 5]], x[0, [0, 1, 6, 7]])


def test_gate_never_reads_the_answer(target):
    """SpecVLM's question is the text between the image and the prompt's end, in training too:
    changing the answer's features does not change the gate's input or choice."""
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    head = random_head(target, "specvlm")
    mask = answer_mask(ids, P.tolist(), L)
    seen = []
    for shift in (0.0, 5.0):
        calls = []
        spy(head.compressor, "gate_logits", calls)
        moved = feats.clone()
        moved[torch.arange(ids.shape[1]) >= P[:, None]] += shift
        with torch.no_grad():
            head.distill_loss(moved, ids, embeds, logits, L, mask)
        del head.compressor.gate_logits
        seen.append(torch.stack([out for _, out in calls]))
    torch.testing.assert_close(seen[0], seen[1], atol=0, rtol=0)
    # the prompt's end defaults to one past the first scored position: the same as saying it
    with torch.no_grad():
        default = head.distill_loss(feats, ids, embeds, logits, L, mask)["loss"]
        explicit = head.distill_loss(feats, ids, embeds, logits, L, mask, prompt_lengths=P)["loss"]
    assert torch.equal(default, explicit)


def test_prefill_gives_the_training_inputs(target):
    """What ``start`` reads at serving time (the prefill's features and ``prompt_embeds`` over the
    right-padded prompts) equals what training reads (the teacher over whole sequences)."""
    ids, P, L, feats, embeds, _ = teacher_batch(target)
    prompts, images = llava_inputs(2)
    Pm = int(P.max())
    padded = torch.tensor([p + [0] * (Pm - len(p)) for p in prompts])
    out = target(padded, torch.arange(Pm).expand(2, -1), target.new_cache(2, 64), **target.vision_inputs(**images))
    for r in range(2):
        n = int(P[r])
        torch.testing.assert_close(out.hidden[r, :n], feats[r, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.prompt_embeds[r, :n], embeds[r, :n], atol=1e-6, rtol=0)


# -- 3. ViSpec starts as EAGLE -----------------------------------------------------------------

def test_vispec_img_fc_starts_as_identity(target):
    ids, P, L, feats, embeds, _ = teacher_batch(target)
    vispec, eagle = new_head(target, "vispec"), new_head(target, "eagle")
    H = HIDDEN
    assert torch.equal(vispec.img_fc.weight, torch.cat([torch.eye(H), torch.zeros(H, H)], 1))
    # same seed, same draws: the shared parts start identical
    for name in ("fc.weight", "block.wqkv.weight", "block.w2.weight"):
        assert torch.equal(vispec.state_dict()[name], eagle.state_dict()[name])
    with torch.no_grad():
        g = vispec.plan(feats, ids, embeds, L)["g"]
        assert g.abs().min() > 0  # a real global image feature, ignored through the zero half
        x_vispec = vispec._text_inputs(feats[:, :-1], ids[:, 1:], g)
        x_eagle = eagle._text_inputs(feats[:, :-1], ids[:, 1:], None)
        emb = target.model.get_input_embeddings()(ids[:, 1:])
        torch.testing.assert_close(x_vispec, x_eagle, atol=1e-6, rtol=0)
        torch.testing.assert_close(x_eagle, eagle.fc(torch.cat([emb, feats[:, :-1]], -1)), atol=1e-6, rtol=0)
    # g is not dead weight: training reaches img_fc's zero half
    head = new_head(target, "vispec").train()
    logs = head.distill_loss(feats, ids, embeds, feats @ target.model.lm_head.weight.T, L,
                             answer_mask(ids, P.tolist(), L), rollout_steps=1)
    logs["loss"].backward()
    assert head.img_fc.weight.grad[:, H:].abs().sum() > 0


# -- 4. distill_loss ---------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_distill_loss_trains_the_head(target, method):
    ids, P, L, feats, embeds, logits = teacher_batch(target)
    mask = answer_mask(ids, P.tolist(), L)
    head = new_head(target, method).train()
    torch.manual_seed(3)  # the Gumbel draws (specvlm)
    logs = head.distill_loss(feats, ids, embeds, logits, L, mask)
    assert torch.isfinite(logs["loss"]) and logs["loss"] > 0
    assert 0 <= float(logs["step0_top1"]) <= 1 and "step1_top1" not in logs
    logs["loss"].backward()
    for name in ("fc.weight", "block.wqkv.weight", "block.w1.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name
    if method == "specvlm":
        assert len(logs["branches"]) == 2 and BRANCHES.index("text") not in logs["branches"]
        # straight-through Gumbel-softmax: the chosen branch's output carries the gate's gradient
        assert head.compressor.gate.weight.grad.abs().sum() > 0
        assert head.compressor.gate.bias.grad.abs().sum() > 0
    else:
        assert logs["branches"] == [-1, -1]
    if method == "vispec":
        assert head.adaptor.k_proj.weight.grad.abs().sum() > 0

    # rollout: step 1 reads the step-0 predictions at scored entries, the target's features elsewhere
    head.eval()
    with torch.no_grad():
        one = head.distill_loss(feats, ids, embeds, logits, L, mask, rollout_steps=1)
        inputs, layers = [], []
        spy(head, "_text_inputs", inputs)
        spy(head, "_layer", layers)
        two = head.distill_loss(feats, ids, embeds, logits, L, mask, rollout_steps=2)
        del head._text_inputs, head._layer
    assert {"step0_top1", "step1_top1", "loss"} <= set(two)
    assert torch.equal(two["step0_top1"], one["step0_top1"])
    assert not torch.isclose(two["loss"], one["loss"])
    step1_feats = inputs[1][0][0]  # (R, S-1, H): the feature entry p reads, at column p - 1
    h0 = layers[0][1][0]
    scored = mask[:, 1:].clone()
    for r, spans in enumerate(head.plan(feats, ids, embeds, L)["spans"]):
        for a, b in spans:
            scored[r, max(a - 1, 0):b] = False
    prev = torch.cat([torch.zeros_like(scored[:, :1]), scored[:, :-1]], 1)  # entry p - 1 was scored
    expected = torch.where(prev[..., None], torch.cat([h0[:, :1], h0[:, :-1]], 1), feats[:, :-1])
    torch.testing.assert_close(step1_feats, expected, atol=0, rtol=0)
    assert prev.any()


# -- 5. bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(method="medusa"), "method must be one of 'eagle', 'specvlm', 'vispec'"),
    (dict(pool_ratio=8), "pool_ratio must be a square int"),
    (dict(conv_ratio=2), "conv_ratio must be a square int"),
    (dict(vispec_queries=1), "vispec_queries must be an int >= 2"),
    (dict(num_heads=5), "num_heads must be a divisor of hidden_size"),
    (dict(prune_ratio=0), "prune_ratio must be an int >= 1"),
])
def test_bad_config_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLMDraftHead(**{**dict(hidden_size=32, num_heads=4, method="specvlm"), **kwargs})


def test_binding(target):
    unbound = VLMDraftHead(method="vispec", hidden_size=32, vocab_size=64, image_token_id=IMAGE, num_heads=4)
    with pytest.raises(RuntimeError, match="not bound to a target: call head.bind"):
        unbound(torch.zeros(1, 2, 32), torch.ones(1, 2, dtype=torch.long), torch.tensor([[1, 2]]))
    with pytest.raises(RuntimeError, match="not bound"):
        unbound.start(unbound.new_cache(1, 8), SimpleNamespace(prefill=None))
    with pytest.raises(ValueError, match="target must be a VLM with hidden_size=64"):
        VLMDraftHead(hidden_size=64, vocab_size=64, image_token_id=IMAGE, num_heads=4).bind(target)
    with pytest.raises(ValueError, match="image_token_id"):
        VLMDraftHead(hidden_size=32, vocab_size=64, image_token_id=4, num_heads=4).bind(target)
    assert unbound.bind(target).target is target and unbound.vocab_size == 64


def test_misuse_of_a_planned_cache(target):
    head = new_head(target, "specvlm")
    ids, P, L, feats, embeds, _ = teacher_batch(target)
    with pytest.raises(ValueError, match="tree_mask needs a cache"):
        head(feats[:, :2], ids[:, 1:3], torch.tensor([[1, 2]] * 2), None, torch.ones(2, 2, 2, dtype=torch.bool))
    cache = head.new_cache(2, 64)
    state = SimpleNamespace(prefill=ModelOutput(logits=None, hidden=feats[:, :11], prompt_embeds=embeds[:, :5]),
                            tokens=ids, prompt_lengths=P)  # embeddings from another pass
    with pytest.raises(ValueError, match="state.prefill must be a VLMTarget's prompt pass output"):
        head.start(cache, state)
    state.prefill.prompt_embeds = embeds[:, :11]
    head.start(cache, state)
    with pytest.raises(ValueError, match="positions must be the first feed into a planned cache"):
        head(feats[:, 1:3], ids[:, 2:4], torch.tensor([[2, 3]] * 2), cache)


# -- 6. recipes --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory):
    from mmspec.training.recipes import train_vlm

    out = tmp_path_factory.mktemp("vlm") / "model"
    record = train_vlm(out, size="draft", steps=3, batch_size=4, lr=1e-3, dataset_size=8, heldout_size=4,
                       warmup=1, log=lambda m: None)
    assert record["recipe"] == "vlm" and record["steps"] == 3 and record["heldout_loss"] > 0
    return out


def safetensors_dtypes(folder: Path) -> set[str]:
    from safetensors import safe_open

    (weights,) = folder.glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_vlm_recipe_writes_a_model_and_processor(tiny_vlm_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    files = {p.name for p in tiny_vlm_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "processor_config.json", "train_log.json"} <= files
    assert safetensors_dtypes(tiny_vlm_dir) == {"F16"}
    model = LlavaForConditionalGeneration.from_pretrained(tiny_vlm_dir, use_safetensors=True)
    assert model.config.text_config.hidden_size == 96  # the "draft" size
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    assert processor.tokenizer.image_token == "<image>"
    assert json.loads((tiny_vlm_dir / "train_log.json").read_text())["size"] == "draft"


@pytest.mark.parametrize("method", METHODS)
def test_vlm_draft_recipe_writes_a_loadable_head(tiny_vlm_dir, tmp_path, method):
    from transformers import AutoProcessor

    from mmspec.training.data.scene_qa import SceneQADataset
    from mmspec.training.recipes import train_vlm_draft
    from mmspec.training.recipes.vlm import encode
    from mmspec.training.recipes.vlm_draft import load_target

    out = tmp_path / method
    record = train_vlm_draft(out, method=method, target_dir=tiny_vlm_dir, steps=2, batch_size=4, lr=1e-3,
                             dataset_size=8, heldout_size=4, warmup=1, log=lambda m: None)
    assert record["method"] == method and record["processes"] == 1 and 0 <= record["heldout_top1"] <= 1
    assert record["train"]["rollout_steps"] == (2 if method == "vispec" else 1)
    assert (record["branch_counts"] is not None) == (method == "specvlm")
    assert json.loads((out / "train_log.json").read_text()) == json.loads(json.dumps(record))
    assert safetensors_dtypes(out) == {"F16"}

    vlm = load_target(tiny_vlm_dir)
    head = load_checkpoint(VLMDraftHead, out).bind(vlm)
    assert head.config.method == method and head.fc.weight.dtype == torch.float32
    assert not any("embed" in k or "lm_head" in k for k in head.state_dict())  # borrowed, not saved
    # the loaded head drafts for the loaded target, losslessly
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    pixels, seqs, prompt_lens = encode(processor, SceneQADataset(2, 7))
    prompts = [s[:n] for s, n in zip(seqs, prompt_lens)]
    images = vlm.vision_inputs(torch.cat(pixels))
    plain = SpeculativeDecoder(vlm, None, processor=LogitsProcessor(temperature=0)).generate(prompts, 8,
                                                                                         conditioning=images)
    drafted = SpeculativeDecoder(vlm, EagleTreeDrafter(head, **TREE),
                                 processor=LogitsProcessor(temperature=0)).generate(prompts, 8, conditioning=images)
    assert torch.equal(drafted.sequences, plain.sequences)


def test_vlm_draft_recipe_starts_from_init(tiny_vlm_dir, tmp_path):
    """``init``: the saved head's weights are where training starts (unchanged at a negligible
    learning rate); a head of another method is refused naming ``init``."""
    from mmspec.training.recipes import train_vlm_draft

    run = dict(target_dir=tiny_vlm_dir, steps=1, batch_size=4, dataset_size=8, heldout_size=4, warmup=1,
               tau_tokens=0, log=lambda m: None)
    train_vlm_draft(tmp_path / "a", method="eagle", lr=1e-3, **run)
    record = train_vlm_draft(tmp_path / "b", method="eagle", lr=1e-12, init=tmp_path / "a", **run)
    assert record["train"]["init"] == str(tmp_path / "a")
    a, b = (load_checkpoint(VLMDraftHead, tmp_path / x).state_dict() for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # fp16 saves of the same weights
    with pytest.raises(ValueError, match="init"):
        train_vlm_draft(tmp_path / "c", method="specvlm", lr=1e-3, init=tmp_path / "a", **run)


def test_vlm_draft_recipe_runs_under_accelerate_with_two_processes(tiny_vlm_dir, tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    assert accelerate.is_file(), accelerate
    out = tmp_path / "ddp"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",  # a free port: no
           "-m", "mmspec", "train", "vlm-draft",  # clash with another launch running beside it
           "--method", "specvlm", "--target", str(tiny_vlm_dir), "--out", str(out), "--steps", "2",
           "--batch-size", "4", "--dataset-size", "8", "--threads", "1", "--tau-tokens", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((out / "train_log.json").read_text())
    assert record["processes"] == 2 and record["method"] == "specvlm" and record["steps"] == 2
    assert sum(record["branch_counts"].values()) == 4  # process 0's 2 images x 2 steps
    load_checkpoint(VLMDraftHead, out)
