"""Video input for Qwen2-VL and Qwen2.5-VL through ``VLMTarget`` and ``SpeculativeVLMPipeline``
(issue 47), on tiny random models built in code.

Greedy decoding through the core with a video, a video and an image, and a ragged batch of both
equals transformers' own ``generate``, and each decode step's logits equal a cache-free forward
over the whole sequence (also after a prompt that ends inside a video whose temporal ids outrun the
text after it); chain, tree and self drafts at B = 3 (a video row, an image and video row, a
text-only row, the first generated token the video-placeholder id) equal the target alone bit for
bit; the pipeline's ``videos=`` equals the processor plus ``generate``; bad video input is refused
naming the argument.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import AutoProcessor, Qwen2_5_VLProcessor, Qwen2VLProcessor

from mmspec.adapters.vlm import VLMTarget
from mmspec.core import LogitsProcessor, SpeculativeDecoder
from mmspec.pipelines import SpeculativeVLMPipeline
from mmspec.pipelines.vlm_inputs import prepare_vlm_inputs, user_message
from test_vlm_adapter import (IMAGE, VEND, VIDEO, VSTART, hf_greedy_batched, tiny_llava, tiny_qwen2_5_vl, tiny_qwen2_vl,
                              token_types)
from test_vlm_batch_drafts import DRAFTERS, likes_its_placeholder
from test_vlm_inputs import QWEN_TEMPLATE, qwen_processor
from tiny import noisy_copy

NEW_TOKENS = 10
FAMILIES = {"qwen2-vl": (tiny_qwen2_vl, Qwen2VLProcessor), "qwen2.5-vl": (tiny_qwen2_5_vl, Qwen2_5_VLProcessor)}
# (t, h, w) patch grids in prompt order, per kind; a 2x2 merge: t * h * w / 4 placeholders. The
# second video's temporal ids outrun the text after it (M-RoPE: the text continues from its start
# plus max(h, w) / 2).
GRIDS = {"image": [(1, 4, 4), (1, 4, 6)], "video": [(2, 4, 6), (6, 2, 4)]}
SECONDS = [0.5, 0.75]  # Qwen2.5-VL's second_per_grid_ts per video: temporal ids step by 4 * s (2, 3)
TEXT = [5, 9, 14, 2, 33, 7, 21, 3, 11, 30]  # the text runs around the vision spans


def media(family: str, kind: str, k: int) -> dict:
    """The k-th image or video of a batch, as the model's processor returns it."""
    grid = GRIDS[kind][k]
    seed = {"image": 20, "video": 40}[kind] + k
    pixels = torch.randn(math.prod(grid), 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(seed))
    if kind == "image":
        return dict(pixel_values=pixels, image_grid_thw=torch.tensor([grid]))
    clip = dict(pixel_values_videos=pixels, video_grid_thw=torch.tensor([grid]))
    if family == "qwen2.5-vl":
        clip["second_per_grid_ts"] = torch.tensor([SECONDS[k]])
    return clip


def batch(family: str, rows: list[tuple[str, ...]]) -> tuple[list[list[int]], dict]:
    """Prompts whose row r holds its media kinds in order, each a ``<vision_start> placeholders
    <vision_end>`` span between text runs (row r's first run 3 + r ids long), and the batch's vision
    inputs: its images and its videos, each in prompt order."""
    prompts, items, seen = [], [], {"image": 0, "video": 0}
    for r, kinds in enumerate(rows):
        prompt = TEXT[: 3 + r]
        for kind in kinds:
            items.append(media(family, kind, seen[kind]))
            n = math.prod(GRIDS[kind][seen[kind]]) // 4
            prompt = prompt + [VSTART] + [IMAGE if kind == "image" else VIDEO] * n + [VEND] + TEXT[r: r + 2]
            seen[kind] += 1
        prompts.append(prompt)
    keys = {k for item in items for k in item}
    return prompts, {k: torch.cat([item[k] for item in items if k in item]) for k in keys}


def target_alone(target: VLMTarget, prompts, vision: dict, drafter=None):
    return SpeculativeDecoder(target, drafter, processor=LogitsProcessor(temperature=0)).generate(
        prompts, NEW_TOKENS, conditioning=target.vision_inputs(**vision))


CASES = {"video": [("video",)], "video+image": [("video", "image")],
         "ragged": [("video",), ("image", "video")]}  # B = 1, 1, 2


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_videos_matches_transformers_generate(family, case):
    model = FAMILIES[family][0]()
    prompts, vision = batch(family, CASES[case])
    expected = hf_greedy_batched(family, model, prompts, vision, NEW_TOKENS)
    assert all(len(set(row)) > 2 for row in expected), "the target's greedy text is trivially constant"
    out = target_alone(VLMTarget(model), prompts, vision)
    assert out.sequences.tolist() == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_steps_equal_a_forward_over_the_whole_sequence(family):
    """After a prompt that ends with text and one that ends inside its second video (the end token
    cut), each decoded token's logits equal a cache-free forward of the model over the whole
    sequence, which computes every id itself."""
    model = FAMILIES[family][0]()
    (prompt,), vision = batch(family, [("video", "video")])
    target = VLMTarget(model)
    for context in (prompt, prompt[:-3]):
        cache = target.new_cache(1, 64)
        target(torch.tensor([context]), torch.arange(len(context))[None], cache, **target.vision_inputs(**vision))
        for token in (20, 40, 50):
            out = target(torch.tensor([[token]]), cache.next_positions()[:, None], cache)
            context = context + [token]
            ids = torch.tensor([context])
            with torch.no_grad():
                expected = model(input_ids=ids, mm_token_type_ids=token_types(ids), **vision).logits[0, -1]
            torch.testing.assert_close(out.logits[0, 0], expected, atol=1e-5, rtol=0)


def test_the_videos_reach_the_prompt_pass():
    """Another video, or (Qwen2.5-VL) another time step, changes the answer."""
    model = tiny_qwen2_5_vl()
    prompts, vision = batch("qwen2.5-vl", CASES["video"])
    target = VLMTarget(model)
    answer = target_alone(target, prompts, vision).sequences.tolist()
    other = dict(vision, pixel_values_videos=vision["pixel_values_videos"].flip(0))
    slower = dict(vision, second_per_grid_ts=4 * vision["second_per_grid_ts"])
    assert target_alone(target, prompts, other).sequences.tolist() != answer
    assert target_alone(target, prompts, slower).sequences.tolist() != answer


# --- drafts at batch 3 ---------------------------------------------------------------------------

ROWS = [("video",), ("image", "video"), ()]  # a video, an image and a video, text only


@pytest.fixture(scope="module", params=list(FAMILIES))
def video_case(request):
    """(family, target model, draft VLM, prompts, vision inputs, the target alone's greedy tokens),
    the target's first generated token of row 0 its video-placeholder id."""
    family = request.param
    prompts, vision = batch(family, ROWS)
    model = likes_its_placeholder(FAMILIES[family][0](), prompts, vision, token=VIDEO)
    alone = target_alone(VLMTarget(model), prompts, vision).sequences.tolist()
    return family, model, noisy_copy(model, scale=0.05, seed=2), prompts, vision, alone


def test_target_alone_with_videos_equals_transformers_generate(video_case):
    family, model, _, prompts, vision, alone = video_case
    assert alone[0][0] == VIDEO and all(len(set(row)) > 2 for row in alone)
    assert hf_greedy_batched(family, model, prompts, vision, NEW_TOKENS) == alone


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_vlm_drafts_with_videos_at_batch_3_equal_the_target_alone(video_case, drafter):
    _, model, draft_model, prompts, vision, alone = video_case
    target = VLMTarget(model)
    out = target_alone(target, prompts, vision, DRAFTERS[drafter](target, VLMTarget(draft_model)))
    assert out.sequences.tolist() == alone
    assert out.stats.tau > (3 if drafter.endswith("-self") else 1)  # a draft that sees the video is accepted


# --- the pipeline: videos= -----------------------------------------------------------------------

# the tests' ChatML template with Qwen2-VL's video part added
VIDEO_TEMPLATE = QWEN_TEMPLATE.replace(
    "{%- elif part['type'] == 'text' %}",
    "{%- elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}")
QUESTIONS = ["what colour is the shape ?", "describe the image in detail ."]


def frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """(t, h, w, 3) uint8: a clip the video processor cuts into (t / 2, h / 2, w / 2) patches."""
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def pipeline_media():
    """The questions' images and videos: a video as PIL frames; an image and a video as a
    (T, H, W, 3) array."""
    image = PIL.Image.fromarray(frames(1, 8, 8, 5)[0])
    return [None, image], [[PIL.Image.fromarray(f) for f in frames(4, 8, 12, 6)], frames(2, 12, 8, 7)]


def video_processor(family: str):
    processor = qwen_processor(FAMILIES[family][1])
    assert VIDEO_TEMPLATE != QWEN_TEMPLATE
    processor.chat_template = VIDEO_TEMPLATE
    return processor


@torch.no_grad()
def hf_answers(model, processor, images, videos) -> list[list[int]]:
    """transformers' own path: the processor on the templated text and the raw media, then
    ``model.generate`` on what it returns."""
    answers = []
    for image, video, q in zip(images, videos, QUESTIONS):
        text = processor.apply_chat_template(user_message(q, image=image is not None, video=True),
                                             add_generation_prompt=True, tokenize=False)
        enc = processor(text=[text], videos=[video], images=None if image is None else [image], return_tensors="pt")
        out = model.generate(**enc, do_sample=False, max_new_tokens=NEW_TOKENS)
        answers.append(out[0, enc["input_ids"].shape[1]:].tolist())
    return answers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_videos_equal_transformers_generate(family):
    model = FAMILIES[family][0]()
    processor = video_processor(family)
    pipe = SpeculativeVLMPipeline(target=model, processor=processor, draft_model=noisy_copy(model, 0.05, seed=2))
    pipe.set_progress_bar_config(disable=True)
    images, videos = pipeline_media()
    expected = hf_answers(model, processor, images, videos)
    assert all(len(set(row)) > 2 for row in expected), "the target's greedy text is trivially constant"
    out = pipe(images=images, videos=videos, prompts=QUESTIONS, max_new_tokens=NEW_TOKENS, method="sd")  # B = 2
    assert out.tokens == expected
    alone = pipe(videos=videos[:1], prompts=QUESTIONS[:1], max_new_tokens=NEW_TOKENS, method="none")  # B = 1
    assert alone.tokens == expected[:1]


def test_video_forms_give_the_same_inputs():
    """PIL frames, a (T, H, W, 3) array and (T, 3, H, W) / (T, H, W, 3) tensors: the same ids and pixels."""
    processor = video_processor("qwen2.5-vl")
    clip = frames(4, 8, 12, 6)
    forms = [[PIL.Image.fromarray(f) for f in clip], torch.from_numpy(clip).permute(0, 3, 1, 2),
             torch.from_numpy(clip)]
    ref = prepare_vlm_inputs(processor, None, QUESTIONS[0], videos=[clip])
    assert ref.vision["video_grid_thw"].tolist() == [[2, 4, 6]] and ref.input_ids[0].count(VIDEO) == 12
    assert set(ref.vision) == {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"}
    for video in forms:
        got = prepare_vlm_inputs(processor, None, QUESTIONS[0], videos=[video])
        assert got.input_ids == ref.input_ids
        assert all(torch.equal(got.vision[k], ref.vision[k]) for k in ref.vision)


# --- bad input -----------------------------------------------------------------------------------

def clip_inputs(grid=(2, 4, 6), rows=None) -> dict:
    rows = math.prod(grid) if rows is None else rows
    return dict(pixel_values_videos=torch.zeros(rows, 24), video_grid_thw=torch.tensor([grid]))


@pytest.mark.parametrize("build, kwargs, message", [
    (tiny_llava, clip_inputs(), "pixel_values_videos must be None for LlavaForConditionalGeneration"),
    (tiny_llava, dict(video_grid_thw=torch.tensor([[2, 4, 6]])),
     "video_grid_thw and second_per_grid_ts must be None when pixel_values_videos is None"),
    (tiny_qwen2_vl, clip_inputs(rows=40), r"pixel_values_videos must be 48 patch rows \(video_grid_thw"),
    (tiny_qwen2_vl, dict(pixel_values_videos=torch.zeros(48, 24)), r"video_grid_thw must be an \(videos, 3\) tensor"),
    (tiny_qwen2_vl, dict(clip_inputs(), second_per_grid_ts=torch.tensor([1.0])),
     "second_per_grid_ts must be None for Qwen2VLForConditionalGeneration"),
    (tiny_qwen2_5_vl, dict(clip_inputs(), second_per_grid_ts=torch.tensor([1.0, 2.0])),
     r"second_per_grid_ts must be one number per video \(1\)"),
])
def test_vision_inputs_refuse_bad_videos(build, kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLMTarget(build()).vision_inputs(**kwargs)


@pytest.mark.parametrize("build", [tiny_qwen2_vl, tiny_qwen2_5_vl])
def test_prompt_pass_refuses_a_placeholder_count_unlike_the_videos_features(build):
    target = VLMTarget(build())
    prompt = [5, VSTART] + [VIDEO] * 11 + [VEND]  # the (2, 4, 6) grid has 12 features
    ids = torch.tensor([prompt])
    with pytest.raises(ValueError, match="pixel_values_videos must be as many video features as the prompts' "
                                         "11 video placeholders, got 12"):
        target(ids, torch.arange(len(prompt))[None], target.new_cache(1, 32), **target.vision_inputs(**clip_inputs()))


def test_pipeline_refuses_bad_videos_before_any_model_runs():
    pipe = SpeculativeVLMPipeline(target=tiny_qwen2_vl(), processor=video_processor("qwen2-vl"))
    clip = frames(2, 8, 8, 0)
    calls = []
    hook = pipe.target.register_forward_hook(lambda *a: calls.append(1))
    bad = [
        (dict(videos=clip), r"videos must be a list of one video \(or None\) per prompt \(2\), got 'ndarray'"),
        (dict(videos=[clip]), r"videos must be a list of one video \(or None\) per prompt \(2\), got '1 videos'"),
        (dict(videos=[clip, None]), r"videos\[1\] must be a video where images\[1\] is None"),
        (dict(videos=[clip, clip.astype(np.float32)]), r"videos\[1\]\.dtype must be uint8"),
        (dict(videos=[clip, clip[0]]), r"videos\[1\]\.shape must be \(T, H, W, 3\) or \(T, 3, H, W\)"),
        (dict(videos=[clip, [clip[0]]]), r"videos\[1\] must be a list of PIL frames"),
        (dict(videos=[clip, clip], images=[None]), r"images must be None or a list of one image \(or None\)"),
    ]
    try:
        for kwargs, message in bad:
            with pytest.raises(ValueError, match=message):
                pipe(prompts=QUESTIONS, **kwargs)
        pipe.processor.chat_template = QWEN_TEMPLATE  # no video part
        with pytest.raises(ValueError, match="processor.chat_template must be a template that writes the video"):
            pipe(prompts=QUESTIONS, videos=[clip, clip])
    finally:
        hook.remove()
    assert not calls


def test_llava_refuses_videos():
    clip = frames(2, 8, 8, 0)
    llava = AutoProcessor.from_pretrained(Path(__file__).resolve().parents[1] / "assets" / "vlm" / "processor")
    pipe = SpeculativeVLMPipeline(target=tiny_llava(), processor=llava)
    with pytest.raises(ValueError, match="videos must be None for a LlavaForConditionalGeneration target"):
        pipe(prompts=QUESTIONS[0], videos=[clip])
    with pytest.raises(ValueError, match="processor must be a processor with a video processor"):
        prepare_vlm_inputs(llava, None, QUESTIONS[0], videos=[clip])
