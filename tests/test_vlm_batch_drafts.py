"""VLM targets with VLM drafts at batch 3 (issue 28): every family (LLaVA, Qwen2-VL, Qwen2.5-VL) with
every drafter that runs a VLM draft (a second VLM in a chain or a tree, the target drafting for
itself in a chain or a tree), ragged prompts, two images in row 0, and a target that generates its
own image-placeholder id. Greedy output is bit-identical to the target alone, which equals
transformers' ``generate``.

The generated placeholder id is the regression: the draft's prompt pass used to be the prompt plus
the first generated token, so that token was read as an image placeholder (transformers'
``get_rope_index`` then ran out of image grids, or took the next row's; LLaVA counted one feature
too few). The draft's prompt pass is now the prompts alone, as the target's prefill.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mmspec.adapters.hf import HFCausalLMTarget
from mmspec.adapters.vlm import VLMTarget
from mmspec.core import LogitsProcessor, ModelChainDrafter, ModelTreeDrafter, SpeculativeDecoder
from test_vlm_adapter import (IMAGE, LLAVA_TOKENS, TEXT_LAYERS, VEND, VSTART, tiny_llava, tiny_qwen2_5_vl,
                              tiny_qwen2_vl)
from tiny import noisy_copy

NEW_TOKENS = 10
# (text before, between the images, after) per row; row 0 holds two images, rows 1 and 2 one
TEXTS = [([5, 9], [17], [2, 33, 7]), ([7, 21, 3, 11, 30, 8], None, []), ([4], None, [12, 13])]
QWEN_GRIDS = [(1, 4, 4), (1, 4, 6), (1, 4, 6), (1, 4, 4)]  # per image, prompt order: 4, 6, 6, 4 tokens


def llava_images(n: int) -> tuple[list[list[int]], list[dict]]:
    return [[IMAGE] * LLAVA_TOKENS] * n, [
        dict(pixel_values=torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(10 + i)))
        for i in range(n)]


def qwen_images(n: int) -> tuple[list[list[int]], list[dict]]:
    grids = torch.tensor(QWEN_GRIDS[:n])
    spans = [[VSTART] + [IMAGE] * (int(g.prod()) // 4) + [VEND] for g in grids]
    return spans, [dict(pixel_values=torch.randn(int(g.prod()), 3 * 2 * 2 * 2,
                                                 generator=torch.Generator().manual_seed(10 + i)),
                        image_grid_thw=g[None]) for i, g in enumerate(grids)]


FAMILIES = {"llava": (tiny_llava, llava_images), "qwen2-vl": (tiny_qwen2_vl, qwen_images),
            "qwen2.5-vl": (tiny_qwen2_5_vl, qwen_images)}


def batch_inputs(family: str) -> tuple[list[list[int]], list[dict]]:
    """Three ragged prompts and, per row, its images' inputs (one dict per image, prompt order)."""
    spans, images = FAMILIES[family][1](4)
    prompts, per_row, k = [], [], 0
    for before, between, after in TEXTS:
        n = 1 if between is None else 2
        body = spans[k] if n == 1 else spans[k] + between + spans[k + 1]
        prompts.append(before + body + after)
        per_row.append(images[k:k + n])
        k += n
    return prompts, per_row


def cat_images(images: list[dict]) -> dict:
    return {key: torch.cat([im[key] for im in images]) for key in images[0]}


def likes_its_placeholder(model, prompts, vision: dict, token: int = IMAGE):
    """Make the model's greedy first token of row 0 its placeholder id ``token`` (the image's by
    default; ``vision``: the prompts' ``vision_inputs``): the LM head's row of that id becomes a
    slightly larger copy of the row of the token it generated there."""
    target = VLMTarget(model)
    out = SpeculativeDecoder(target, None, processor=LogitsProcessor(temperature=0)).generate(
        prompts, 1, conditioning=target.vision_inputs(**vision))
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[token] = 1.05 * head[int(out.sequences[0, 0])]
    return model


@torch.no_grad()
def hf_greedy(family: str, model, prompt: list[int], images: list[dict], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    extra = {} if family == "llava" else dict(mm_token_type_ids=(ids == IMAGE).int())
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         **cat_images(images), **extra)
    return out[0, len(prompt):].tolist()


DRAFTERS = {
    "chain": lambda target, draft: ModelChainDrafter(draft, gamma=3),
    "tree": lambda target, draft: ModelTreeDrafter(draft, top_k=3, depth=3, total_tokens=10),
    "chain-self": lambda target, draft: ModelChainDrafter(target, gamma=3),
    "tree-self": lambda target, draft: ModelTreeDrafter(target, top_k=3, depth=3, total_tokens=10),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_case(request):
    """(family, target model, draft VLM, prompts, per-row images, the target alone's greedy tokens)."""
    family = request.param
    prompts, images = batch_inputs(family)
    model = likes_its_placeholder(FAMILIES[family][0](), prompts, cat_images(sum(images, [])))
    draft = noisy_copy(model, scale=0.05, seed=2)
    target = VLMTarget(model)
    alone = SpeculativeDecoder(target, None, processor=LogitsProcessor(temperature=0)).generate(
        prompts, NEW_TOKENS, conditioning=target.vision_inputs(**cat_images(sum(images, []))))
    return family, model, draft, prompts, images, alone.sequences.tolist()


def test_target_alone_equals_transformers_generate(family_case):
    """The batch has what the drafts must survive: the image-placeholder id among the generated
    tokens (row 0's first), and varied text."""
    family, model, _, prompts, images, alone = family_case
    assert alone[0][0] == IMAGE and all(len(set(row)) > 2 for row in alone)
    assert [hf_greedy(family, model, p, im, NEW_TOKENS) for p, im in zip(prompts, images)] == alone


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_vlm_drafts_at_batch_3_equal_the_target_alone(family_case, drafter):
    family, model, draft_model, prompts, images, alone = family_case
    target = VLMTarget(model)
    decoder = SpeculativeDecoder(target, DRAFTERS[drafter](target, VLMTarget(draft_model)),
                                 processor=LogitsProcessor(temperature=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = decoder.generate(prompts, NEW_TOKENS, conditioning=target.vision_inputs(**cat_images(sum(images, []))))
    assert out.sequences.tolist() == alone
    if drafter.endswith("-self"):  # the target drafting for itself: its greedy drafts are all accepted
        assert out.stats.tau > 3
    else:  # a noisy copy: some drafts accepted, some rejected
        assert 1 < out.stats.tau < 3
    assert not [w for w in caught if "past_key_values" in str(w.message)]  # transformers' FutureWarning


@pytest.mark.parametrize("drafter", ["chain", "tree-self"])
def test_vlm_drafts_at_batch_1(family_case, drafter):
    """Row 0 alone (two images, its first generated token the placeholder id)."""
    family, model, draft_model, prompts, images, alone = family_case
    target = VLMTarget(model)
    decoder = SpeculativeDecoder(target, DRAFTERS[drafter](target, VLMTarget(draft_model)),
                                 processor=LogitsProcessor(temperature=0))
    out = decoder.generate(prompts[:1], NEW_TOKENS, conditioning=target.vision_inputs(**cat_images(images[0])))
    assert out.sequences.tolist() == alone[:1]


def test_text_target_passes_no_deprecated_cache_argument():
    """``HFCausalLMTarget`` hands transformers its cache under the current name: no FutureWarning."""
    torch.manual_seed(0)
    target = HFCausalLMTarget(LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **TEXT_LAYERS)).eval())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpeculativeDecoder(target, ModelChainDrafter(target, gamma=2), processor=LogitsProcessor(temperature=0)).generate(
            [[3, 4, 5], [6]], 4)
    assert not [w for w in caught if "past_key_values" in str(w.message)]
