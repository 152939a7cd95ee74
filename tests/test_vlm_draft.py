"""VLM draft heads (eagle, specvlm, vispec) on tiny random LLaVA targets, and their recipes.

- Lossless: greedy decoding with every head (and every forced SpecVLM branch) equals the target
  alone, at B = 1 and B = 2 with unequal prompt lengths.
- Train/serve consistency: the head's drafting path (planned first feed into its compressed cache,
  then cached feeds, truncation included) gives the same features as the causal reference path
  its training loss uses.
- The recipes: the VLM recipe writes a loadable LLaVA + processor; the distillation recipe writes
  loadable heads for all three methods, and runs under ``accelerate launch`` with 2 processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmspec.adapters.vlm import VLMTarget
from mmspec.core import EagleTreeDrafter, LogitsPipeline, SpeculativeDecoder
from mmspec.models import load_checkpoint
from mmspec.models.vlm_draft import BRANCHES, METHODS, VLMDraftHead
from test_vlm_adapter import llava_inputs, tiny_llava
from tiny import spread

SMALL = dict(num_heads=4, intermediate_size=64, prune_ratio=2, pool_ratio=4, conv_ratio=4)


@pytest.fixture(scope="module")
def target():
    return VLMTarget(tiny_llava())


def head_for(target, method, seed=0, std=0.3):
    torch.manual_seed(seed)
    return spread(VLMDraftHead.from_target(target, method=method, **SMALL), std=std, seed=seed).eval()


def greedy(target, prompts, pixels, drafter=None):
    target.bind_images(pixels)
    out = SpeculativeDecoder(target, drafter, logits=LogitsPipeline(temperature=0)).generate(prompts, 16)
    return out.sequences


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_lossless(target, method, rows):
    prompts, inputs = llava_inputs(rows)
    ref = greedy(target, prompts, inputs["pixel_values"])
    head = head_for(target, method)
    got = greedy(target, prompts, inputs["pixel_values"], EagleTreeDrafter(head, top_k=3, depth=3, total_tokens=8))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("branch", BRANCHES)
def test_every_specvlm_branch_is_lossless(target, branch):
    prompts, inputs = llava_inputs(2)
    ref = greedy(target, prompts, inputs["pixel_values"])
    head = head_for(target, "specvlm")
    with torch.no_grad():
        head.compressor.gate.weight.zero_()
        head.compressor.gate.bias.copy_(torch.arange(len(BRANCHES)) == BRANCHES.index(branch))
    drafter = EagleTreeDrafter(head, top_k=2, depth=3, total_tokens=6)
    target.bind_images(inputs["pixel_values"])
    dec = SpeculativeDecoder(target, drafter, logits=LogitsPipeline(temperature=0))
    got = dec.generate(prompts, 16).sequences
    assert torch.equal(got, ref)
    plan = head.plan(torch.randn(1, 5, 32), torch.tensor([[1, 60, 60, 60, 60]]), torch.randn(1, 5, 32),
                     torch.tensor([5]))
    assert plan["branches"] == [[BRANCHES.index(branch)]]
    sizes = {"prune": 2, "pool": 1, "conv": 1, "resampler": 2, "text": 0}  # 4 image tokens, a 2x2 grid
    assert len(plan["visual"][0][0]) == sizes[branch]


def _teacher(target, ids, pixels):
    """The target's features and merged embeddings over whole sequences (the training inputs)."""
    target._capture = True
    try:
        out = target.model(input_ids=ids, pixel_values=pixels, output_hidden_states=True)
    finally:
        target._capture = False
    return out.hidden_states[-1], target.prompt_embeds


@pytest.mark.parametrize("method", METHODS)
def test_drafting_path_equals_the_training_path(target, method):
    """Feed a prompt + continuation through a planned cache (first feed, then one entry at a time,
    with a truncate-and-refeed in the middle) and compare with the causal reference pass."""
    torch.manual_seed(1)
    prompt = [5, 9, 14] + [60] * 4 + [2, 33]  # text, 4 image tokens, text
    cont = [7, 40, 21, 3, 11]
    ids = torch.tensor([prompt + cont])
    pixels = torch.randn(1, 3, 16, 16)
    head = head_for(target, method, std=0.3)
    feats, embeds = _teacher(target, ids, pixels)
    S = ids.shape[1]
    with torch.no_grad():
        plan = head.plan(feats, ids, embeds, torch.tensor([S]))
        positions = torch.arange(1, S)[None]
        x = head._text_inputs(feats[:, :-1], ids[:, 1:], plan["g"], plan, positions)
        ref, _ = head._layer(x, positions, plan, lambda pos: None)  # (1, S-1, H)

        cache = head.new_cache(1, 64)
        cache.plan = head.plan(feats[:, : len(prompt)], ids[:, : len(prompt)], embeds[:, : len(prompt)],
                               torch.tensor([len(prompt)]))
        cache.g = cache.plan["g"]
        P = len(prompt)
        first = head(feats[:, : P - 1], ids[:, 1:P], torch.arange(1, P)[None], cache)
        outs = [first.hidden]
        for p in range(P, S):
            if p == P + 2:  # draft junk past the committed point, cut it, and go on
                head(feats[:, p - 1 : p + 1], torch.tensor([[0, 0]]), torch.tensor([[p, p + 1]]), cache)
                cache.truncate(torch.tensor([p - 1]))
            outs.append(head(feats[:, p - 1 : p], ids[:, p : p + 1], torch.tensor([[p]]), cache).hidden)
        got = torch.cat(outs, 1)
    text = ids[0, 1:] != 60  # image columns: compressed heads output zeros there
    assert torch.allclose(got[0, text], ref[0, text], atol=1e-5)
    assert got[0, text].abs().sum() > 0
    if method != "eagle":
        assert int(cache.offset[0]) == 4 - len(plan["visual"][0][0])  # the image span was compressed


def test_vispec_starts_as_eagle(target):
    vispec, eagle = head_for(target, "vispec"), head_for(target, "eagle")
    eagle.fc.load_state_dict(vispec.fc.state_dict())
    feats, toks, g = torch.randn(1, 3, 32), torch.tensor([[3, 4, 5]]), torch.randn(1, 32)
    with torch.no_grad():
        vispec.img_fc.weight.copy_(torch.cat([torch.eye(32), torch.zeros(32, 32)], 1))
        assert torch.allclose(vispec._text_inputs(feats, toks, g), eagle._text_inputs(feats, toks, None), atol=1e-6)
    fresh = VLMDraftHead.from_target(target, method="vispec", **SMALL)
    assert torch.equal(fresh.img_fc.weight, torch.cat([torch.eye(32), torch.zeros(32, 32)], 1))


@pytest.mark.parametrize("method", METHODS)
def test_distill_loss_trains_the_head(target, method):
    torch.manual_seed(0)
    prompts, inputs = llava_inputs(2)
    L = max(map(len, prompts))
    ids = torch.tensor([p + [7] * (L - len(p)) + [3, 4, 5, 6] for p in prompts])
    feats, embeds = _teacher(target, ids, inputs["pixel_values"])
    logits = target.model.lm_head(feats)
    lengths = torch.tensor([ids.shape[1]] * 2)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, L - 1 : -1] = True
    head = head_for(target, method).train()
    logs = head.distill_loss(feats, ids, embeds, logits, lengths, mask)
    logs["loss"].backward()
    assert torch.isfinite(logs["loss"])
    assert head.fc.weight.grad.abs().sum() > 0
    if method == "specvlm":
        assert head.compressor.gate.weight.grad is not None  # straight-through Gumbel reaches the gate
    two = head_for(target, method).train().distill_loss(feats, ids, embeds, logits, lengths, mask, rollout_steps=2)
    assert {"step0_top1", "step1_top1"} <= set(two) and not torch.equal(two["loss"], logs["loss"])


@pytest.mark.parametrize("kwargs, name", [(dict(method="medusa"), "method"), (dict(pool_ratio=8), "pool_ratio"),
                                          (dict(vispec_queries=1), "vispec_queries"), (dict(num_heads=5), "num_heads")])
def test_bad_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        VLMDraftHead(hidden_size=32, **{**dict(num_heads=4), **kwargs})


def test_binding(target):
    head = VLMDraftHead(hidden_size=32, vocab_size=64, image_token_id=60, num_heads=4)
    with pytest.raises(RuntimeError, match="bind"):
        head.embed(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="hidden_size"):
        VLMDraftHead(hidden_size=64, vocab_size=64, image_token_id=60, num_heads=4).bind(target)


@pytest.fixture(scope="module")
def tiny_vlm_dir(tmp_path_factory):
    from mmspec.training.recipes import train_vlm

    out = tmp_path_factory.mktemp("vlm") / "model"
    record = train_vlm(out, size="draft", steps=3, batch_size=4, lr=1e-3, dataset_size=8, heldout_size=4,
                       warmup=1, log=lambda m: None)
    assert record["heldout_loss"] > 0
    return out


def test_vlm_recipe_writes_a_model_and_processor(tiny_vlm_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    files = {p.name for p in tiny_vlm_dir.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "processor_config.json", "train_log.json"} <= files
    model = LlavaForConditionalGeneration.from_pretrained(tiny_vlm_dir)
    assert model.dtype == torch.float16  # shipped as fp16
    assert AutoProcessor.from_pretrained(tiny_vlm_dir).tokenizer.image_token == "<image>"


@pytest.mark.parametrize("method", METHODS)
def test_vlm_draft_recipe_writes_a_loadable_head(tiny_vlm_dir, tmp_path, method):
    from mmspec.training.recipes import train_vlm_draft
    from mmspec.training.recipes.vlm_draft import load_target

    record = train_vlm_draft(tmp_path / method, method=method, target_dir=tiny_vlm_dir, steps=2, batch_size=4,
                             lr=1e-3, dataset_size=8, heldout_size=4, warmup=1, log=lambda m: None)
    assert 0 <= record["heldout_top1"] <= 1 and record["processes"] == 1
    assert record["train"]["rollout_steps"] == (2 if method == "vispec" else 1)
    head = load_checkpoint(VLMDraftHead, tmp_path / method).bind(load_target(tiny_vlm_dir))
    assert head.config.method == method
    saved = {k for k in head.state_dict()}
    assert not any("embed" in k or "lm_head" in k for k in saved)  # shared with the target, not saved


def test_vlm_draft_recipe_runs_under_accelerate_with_two_processes(tiny_vlm_dir, tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    out = tmp_path / "ddp"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "mmspec", "train", "vlm-draft",
           "--method", "specvlm", "--target", str(tiny_vlm_dir), "--out", str(out), "--steps", "2",
           "--batch-size", "4", "--dataset-size", "8", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((out / "train_log.json").read_text())["processes"] == 2
