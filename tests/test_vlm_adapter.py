"""VLMTarget: transformers LLaVA, Qwen2-VL and Qwen2.5-VL in the speculation core, prompts with images."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LlavaConfig, LlavaForConditionalGeneration,
                          Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration)

from mmspec.adapters.hf import HFCausalLMTarget
from mmspec.adapters.vlm import VLMTarget
from tiny import spread
from mmspec.core import JacobiDrafter, LogitsProcessor, ModelTreeDrafter, SpeculativeDecoder
from mmspec.core.shapes import forced_static_shapes

VOCAB = 64
IMAGE, VSTART, VEND, VIDEO = 60, 61, 62, 63  # the image placeholder, Qwen2-VL's vision start/end and video ids
NEW_TOKENS = 16
LLAVA_TOKENS = 4  # a 16x16 image in 8x8 patches, CLS dropped
QWEN_GRIDS = [(1, 4, 4), (1, 4, 6)]  # (t, h, w) patches per image; 2x2 merge -> 4 and 6 tokens
TEXT_LAYERS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
# (text before the image, text after it) per row; unequal lengths, and row 1 ends after its image
TEXTS = [([5, 9, 14], [2, 33, 7, 40]), ([7, 21, 3, 11, 30, 8], [])]




def tiny_llava() -> LlavaForConditionalGeneration:
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8,
                           projection_dim=16),
        text_config=dict(model_type="llama", **TEXT_LAYERS), image_token_index=IMAGE,
        vision_feature_layer=-1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = spread(LlavaForConditionalGeneration(config), std=0.3)
    model.generation_config.eos_token_id = None
    return model


def tiny_qwen2_vl() -> Qwen2VLForConditionalGeneration:
    config = Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2),
        text_config=dict(rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1]), **TEXT_LAYERS),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = spread(Qwen2VLForConditionalGeneration(config), std=0.3)
    model.generation_config.eos_token_id = None
    return model


def tiny_qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    """Qwen2.5-VL's vision tower: RMSNorm + gated MLP blocks, window attention (a window of 4
    patches = one 2x2 merge group) with block 0 full attention, block 1 windowed."""
    config = Qwen2_5_VLConfig(
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=2, temporal_patch_size=2, spatial_merge_size=2, window_size=4,
                           fullatt_block_indexes=[0]),
        text_config=dict(rope_parameters=dict(rope_type="default", mrope_section=[2, 1, 1]), **TEXT_LAYERS),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = spread(Qwen2_5_VLForConditionalGeneration(config), std=0.3)
    model.generation_config.eos_token_id = None
    return model


def llava_inputs(rows: int):
    """Prompts ``before <image>*4 after`` and one 16x16 image per row."""
    prompts = [a + [IMAGE] * LLAVA_TOKENS + b for a, b in TEXTS[:rows]]
    pixels = torch.randn(rows, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return prompts, dict(pixel_values=pixels)


def qwen_inputs(rows: int):
    """Prompts ``before <vision_start> <image>*n <vision_end> after`` and one image per row."""
    grids = torch.tensor(QWEN_GRIDS[:rows])
    n_tokens = [int(g.prod()) // 4 for g in grids]
    prompts = [a + [VSTART] + [IMAGE] * n + [VEND] + b for (a, b), n in zip(TEXTS[:rows], n_tokens)]
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(3))
    return prompts, dict(pixel_values=pixels, image_grid_thw=grids)


FAMILIES = {"llava": (tiny_llava, llava_inputs), "qwen2-vl": (tiny_qwen2_vl, qwen_inputs),
            "qwen2.5-vl": (tiny_qwen2_5_vl, qwen_inputs)}


def row_images(family: str, images: dict, b: int) -> dict:
    """Row b's share of a batch's image inputs (one image per row)."""
    if family == "llava":
        return dict(pixel_values=images["pixel_values"][b:b + 1])
    grids = images["image_grid_thw"]
    start = int(grids[:b].prod(-1).sum())
    return dict(pixel_values=images["pixel_values"][start:start + int(grids[b].prod())],
                image_grid_thw=grids[b:b + 1])


def token_types(ids: torch.Tensor) -> torch.Tensor:
    """Qwen2-VL's ``mm_token_type_ids``, as its processor writes them: text 0, image 1, video 2."""
    return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()


@torch.no_grad()
def hf_greedy(family: str, model, prompt: list[int], images: dict, n: int) -> list[int]:
    """transformers' own greedy decoding of one unpadded prompt with its image (or videos)."""
    ids = torch.tensor([prompt])
    extra = {} if family == "llava" else dict(mm_token_type_ids=token_types(ids))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         **images, **extra)
    return out[0, len(prompt):].tolist()


def tiny_llama_draft() -> HFCausalLMTarget:
    torch.manual_seed(5)
    return HFCausalLMTarget(spread(LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **TEXT_LAYERS)),
                                   std=0.3, seed=5))


DRAFTERS = {
    "none": lambda target: None,
    "jacobi": lambda target: JacobiDrafter(VOCAB, window=4),
    "tree-llama": lambda target: ModelTreeDrafter(tiny_llama_draft(), top_k=3, depth=3, total_tokens=10,
                                                  conditioned=False),  # a text LM: no images
    "tree-self": lambda target: ModelTreeDrafter(target, top_k=3, depth=3, total_tokens=10),
}


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_generate(family, drafter, rows):
    build, inputs = FAMILIES[family]
    model = build()
    prompts, images = inputs(rows)
    expected = [hf_greedy(family, model, p, row_images(family, images, b), NEW_TOKENS)
                for b, p in enumerate(prompts)]
    assert all(len(set(row)) > 2 for row in expected), "the target's greedy text is trivially constant"

    target = VLMTarget(model)
    decoder = SpeculativeDecoder(target, DRAFTERS[drafter](target), processor=LogitsProcessor(temperature=0))
    out = decoder.generate(prompts, NEW_TOKENS, conditioning=target.vision_inputs(**images))

    assert out.sequences.tolist() == expected
    if drafter == "tree-self":  # the target drafting for itself: every tree's greedy path is accepted
        assert out.stats.tau > 3


def test_rejects_models_that_are_not_vlms():
    model = LlamaForCausalLM(LlamaConfig(attn_implementation="sdpa", **TEXT_LAYERS))
    with pytest.raises(ValueError, match="model"):
        VLMTarget(model)


@torch.no_grad()
def hf_greedy_batched(family: str, model, prompts: list[list[int]], images: dict, n: int) -> list[list[int]]:
    """transformers' own greedy decoding of a left-padded batch (its padding side for generation)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    extra = {} if family == "llava" else dict(mm_token_type_ids=token_types(ids))
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, **images, **extra)
    return out[:, width:].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_matches_transformers_batched_generate(family):
    """Unequal prompt lengths: the core's right-padded batch equals transformers' left-padded one."""
    build, inputs = FAMILIES[family]
    model = build()
    prompts, images = inputs(2)
    expected = hf_greedy_batched(family, model, prompts, images, NEW_TOKENS)
    target = VLMTarget(model)
    drafter = ModelTreeDrafter(tiny_llama_draft(), top_k=3, depth=3, total_tokens=10, conditioned=False)
    out = SpeculativeDecoder(target, drafter, processor=LogitsProcessor(temperature=0)).generate(
        prompts, NEW_TOKENS, conditioning=target.vision_inputs(**images))
    assert out.sequences.tolist() == expected


@torch.no_grad()
def reference_logits(family: str, model, context: list[int], images: dict) -> torch.Tensor:
    """(V,) next-token logits of a cache-free forward of the model over ``context`` and its image
    (Qwen2-VL computes its own M-RoPE ids)."""
    ids = torch.tensor([context])
    extra = {} if family == "llava" else dict(mm_token_type_ids=token_types(ids))
    return model(input_ids=ids, **images, **extra).logits[0, -1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_steps_see_the_image_at_the_model_positions(family):
    build, inputs = FAMILIES[family]
    model = build()
    prompts, images = inputs(2)
    target = VLMTarget(model)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])  # right-padded, as the core does
    lens = torch.tensor([len(p) for p in prompts])
    cache = target.new_cache(2, 64)
    out = target(ids, torch.arange(width).expand_as(ids), cache, **target.vision_inputs(**images))
    cache.truncate(lens)
    torch.testing.assert_close(model.lm_head(out.hidden), out.logits)  # hidden is the LM head's input
    if family != "llava":  # M-RoPE: an image's grid ids span fewer positions than its tokens
        assert (cache.rope_deltas < 0).all()

    contexts = [list(p) for p in prompts]
    for step in range(3):  # a two-token block, then cut back to its first token
        block = torch.tensor([[20 + step, 40 + step], [30 + step, 50 + step]])
        out = target(block, cache.next_positions()[:, None] + torch.arange(2), cache)
        cache.keep_block(2, None, torch.tensor([1, 1]))
        for b in range(2):
            context = contexts[b] + block[b].tolist()
            row = row_images(family, images, b)
            torch.testing.assert_close(out.logits[b, 1], reference_logits(family, model, context, row),
                                       atol=1e-5, rtol=0)
            contexts[b].append(context[-2])
    # another image changes the text: the features reach the prefill
    other = {k: v.flip(0) if k == "pixel_values" else v for k, v in images.items()}
    assert not torch.allclose(reference_logits(family, model, contexts[0], row_images(family, other, 0)),
                              reference_logits(family, model, contexts[0], row_images(family, images, 0)))


@pytest.mark.parametrize("build", [tiny_qwen2_vl, tiny_qwen2_5_vl])
def test_vision_inputs_rejects_missing_grids(build):
    target = VLMTarget(build())
    with pytest.raises(ValueError, match="image_grid_thw"):
        target.vision_inputs(pixel_values=torch.zeros(16, 24))


def test_conditioning_reaches_the_prompt_pass_only():
    """Images are inputs of a call, not state of the model: a decode pass refuses them, and the
    model object holds no hooks afterwards."""
    model = tiny_llava()
    prompts, images = llava_inputs(1)

    def ours():  # transformers installs hooks of its own (output capturing); we install none
        fns = [f for m in model.modules() for f in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
        return [f for f in fns if getattr(getattr(f, "__self__", f), "__module__", "").startswith("mmspec")]

    target = VLMTarget(model)
    cache = target.new_cache(1, 64)
    ids = torch.tensor(prompts)
    out = target(ids, torch.arange(ids.shape[1])[None], cache, **target.vision_inputs(**images))
    assert out.prompt_embeds is not None and out.prompt_embeds.shape[:2] == ids.shape
    with pytest.raises(ValueError, match="conditioning must be given with the prompt pass only"):
        target(ids[:, -1:], cache.next_positions()[:, None], cache, **target.vision_inputs(**images))
    assert ours() == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_causal_prompt_pass_equals_the_masked_one(family, monkeypatch):
    """A prompt pass into an empty cache goes to SDPA without a mask (``is_causal``: the flash
    kernel skips the blocks above the diagonal): its logits and cached keys equal, bit for bit,
    those of the same pass with the dense causal mask; a tree block, a static cache and a block
    after earlier entries keep their masks."""
    from mmspec.adapters.hf import HFCacheAdapter

    build, inputs = FAMILIES[family]
    target = VLMTarget(build())
    prompts, images = inputs(1)
    ids = torch.tensor(prompts)
    runs = {}
    for plain in (True, False):
        if not plain:  # the same pass with the mask forced
            opened = HFCacheAdapter.open_block
            monkeypatch.setattr(HFCacheAdapter, "open_block",
                                lambda self, *a, causal_prompt=False, **k: opened(self, *a, **k))
        cache = target.new_cache(1, 64)
        out = target(ids, torch.arange(ids.shape[1])[None], cache, **target.vision_inputs(**images))
        assert (cache.causal_length == ids.shape[1]) is plain
        runs[plain] = (out.logits, cache.k.clone(), cache.v.clone())
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False]))
    monkeypatch.undo()

    cache = target.new_cache(1, 64)
    tree = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    assert cache.open_block(torch.arange(3)[None], tree, causal_prompt=True) is not None  # a tree mask
    assert cache.open_block(torch.arange(3, 5)[None], causal_prompt=True) is not None  # after entries
    assert cache.causal_length is None
    with forced_static_shapes():
        static = target.new_cache(1, 64)
        assert static.open_block(torch.arange(4)[None], causal_prompt=True) is not None
