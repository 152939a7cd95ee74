"""Drafters for the user's VLM on the user's data: ``mmspec train vlm-eagle | vlm-medusa --target
FOLDER --data FILE`` for a tiny random LLaVA and a tiny random Qwen2-VL (configs built in code,
saved as transformers folders with their processors), on conversations in the LLaVA JSON layout.

The figures: after a short run (seed 0, 40 conversations, 8 held out, ``STEPS`` steps,
self-distillation ``--regenerate``), the head's held-out tau (tokens per target pass, greedy,
``TAU_TOKENS`` new tokens on each held-out prompt) is at least ``TAU_GAIN`` times the untrained
head's; the saved head, loaded into the pipeline, answers exactly as the target alone.
A head trained for one target is refused for the other, naming both. Malformed records are skipped
and counted; what cannot be read at all is refused before training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast, Qwen2_5_VLProcessor,
                          Qwen2VLProcessor)

from mmspec import commands
from mmspec.models import load_checkpoint
from mmspec.models.medusa import MedusaHeads
from mmspec.models.vlm_draft import VLMDraftHead
from mmspec.training.data.conversations import read_conversations
from test_vlm_adapter import IMAGE, VOCAB, tiny_llava, tiny_qwen2_5_vl, tiny_qwen2_vl
from test_vlm_inputs import qwen_processor
from tiny import spread

STEPS, TAU_TOKENS, SPREAD = 100, 16, 0.15
# held-out tau of the trained head over the untrained one's, at least. An untrained EAGLE head is
# random; untrained Medusa heads are Medusa-1's start, each a copy of the target's LM head (they
# already guess that the last token repeats, tau about 1.5 on these targets), which the trained
# ones beat by 1.2-1.3x here (measured in docs/guides/train.md), not the 1.5x.
TAU_GAIN = {"vlm-eagle": 1.5, "vlm-medusa": 1.15}
WORDS = ["what", "colour", "is", "the", "shape", "?", "describe", "image", "in", "detail", ".", "where"]
LLAVA_SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>", 4: "USER:", 5: "ASSISTANT:", IMAGE: "<image>"}
LLAVA_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages %}{{ ' USER:' if m['role'] == 'user' else ' ASSISTANT:' }}"
    "{%- for part in m['content'] %}{%- if part['type'] == 'image' %}{{ ' <image>' }}{%- else %}{{ ' ' + part['text'] }}"
    "{%- endif %}{%- endfor %}{%- if m['role'] == 'assistant' %}{{ ' </s>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ ' ASSISTANT:' }}{%- endif %}")

pytestmark = pytest.mark.usefixtures("restore_torch_threads")  # the CLI's --threads


def llava_processor() -> LlavaProcessor:
    """A word-level tokenizer over the tiny LLaVA's 64 ids, 16 x 16 images in 8 x 8 patches (4
    image tokens, CLS dropped), a USER: / ASSISTANT: chat template."""
    words = [w for w in WORDS]
    vocab = {LLAVA_SPECIAL.get(i) or (words.pop(0) if words else f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=LLAVA_TEMPLATE)


FAMILIES = {"llava": (tiny_llava, llava_processor, (16, 16)),
            "qwen2-vl": (tiny_qwen2_vl, lambda: qwen_processor(Qwen2VLProcessor), (8, 12)),
            "qwen2.5-vl": (tiny_qwen2_5_vl, lambda: qwen_processor(Qwen2_5_VLProcessor), (8, 12))}
"""Per family: the tiny random model (test_vlm_adapter's config, its matrices redrawn at std
``SPREAD``), its processor built here, the data's image size."""


def write_data(folder: Path, n: int, size, seed: int = 0) -> Path:
    """``n`` one-turn conversations in the LLaVA layout (JSON lines), random images of ``size``."""
    rng = np.random.default_rng(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    questions = ["what colour is the shape ?", "describe the image in detail .", "where is the shape ?"]
    lines = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / "images" / f"{i}.png")
        lines.append(json.dumps({"id": str(i), "image": f"images/{i}.png", "conversations": [
            {"from": "human", "value": f"<image>\n{questions[i % 3]}"},
            {"from": "gpt", "value": "the shape is in the image ."}]}))
    file = folder / "data.jsonl"
    file.write_text("\n".join(lines) + "\n")
    return file


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Per family: the saved tiny random target (model + processor) and its data file."""
    out = {}
    for name, (model_fn, processor_fn, size) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(name)
        spread(model_fn(), std=SPREAD).save_pretrained(folder / "target")
        processor_fn().save_pretrained(folder / "target")
        out[name] = (folder / "target", write_data(folder / "data", 40, size))
    return out


def train(out: Path, recipe: str, target: Path, data: Path, *extra) -> dict:
    args = ["train", recipe, "--out", str(out), "--target", str(target), "--data", str(data), "--regenerate",
            str(TAU_TOKENS), "--tau-tokens", str(TAU_TOKENS), "--steps", str(STEPS), "--batch-size", "8",
            "--lr", "3e-3", "--log-every", "1000", "--threads", "2", "--debug", *extra]
    assert commands.main(args) == 0
    return json.loads((out / "train_log.json").read_text())


@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
@pytest.mark.parametrize("recipe, cls, component", [("vlm-eagle", VLMDraftHead, "eagle_head"),
                                                     ("vlm-medusa", MedusaHeads, "medusa_head")])
def test_trained_head_beats_untrained_and_keeps_greedy_identity(targets, tmp_path, family, recipe, cls, component):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmspec.pipelines import SpeculativeVLMPipeline

    target_dir, data = targets[family]
    log = train(tmp_path / "head", recipe, target_dir, data)
    assert log["data"]["train"] + log["data"]["heldout"] == 40 and log["data"]["skipped"] == 0
    assert log["heldout_tau"] >= TAU_GAIN[recipe] * log["untrained_tau"], (log["heldout_tau"], log["untrained_tau"])

    # through the pipeline: the saved head, loaded and bound, answers exactly as the target alone
    model = AutoModelForImageTextToText.from_pretrained(target_dir).eval()
    processor = AutoProcessor.from_pretrained(target_dir)
    head = load_checkpoint(cls, tmp_path / "head")
    pipe = SpeculativeVLMPipeline(target=model, processor=processor, **{component: head})
    convs = read_conversations(data).records[:4]
    images = [Image.open(c.image).convert("RGB") for c in convs]
    questions = [c.turns[0][0] for c in convs]
    method = recipe.removeprefix("vlm-")
    plain = pipe(images, questions, max_new_tokens=TAU_TOKENS, method="none")
    drafted = pipe(images, questions, max_new_tokens=TAU_TOKENS, method=method)
    assert drafted.tokens == plain.tokens and len(plain.tokens[0]) == TAU_TOKENS
    assert drafted.stats["tau"] > 1.0


@pytest.mark.parametrize("recipe, cls, component", [("vlm-specvlm", VLMDraftHead, "specvlm_head"),
                                                     ("vlm-vispec", VLMDraftHead, "vispec_head")])
def test_qwen2_5_vl_heads_train_and_stay_lossless(targets, tmp_path, recipe, cls, component):
    """Qwen2.5-VL (its windowed vision tower), the other two head kinds: a short run writes a head
    stamped with this target that the pipeline drafts with, exactly."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmspec.models.binding import target_fingerprint
    from mmspec.pipelines import SpeculativeVLMPipeline

    target_dir, data = targets["qwen2.5-vl"]
    log = train(tmp_path / "head", recipe, target_dir, data, "--steps", "5", "--tau-tokens", "0")
    model = AutoModelForImageTextToText.from_pretrained(target_dir).eval()
    head = load_checkpoint(cls, tmp_path / "head")
    assert head.config["_trained_for"] == log["trained_for"] == target_fingerprint(model)
    assert log["trained_for"].startswith("Qwen2_5_VLForConditionalGeneration config ")
    pipe = SpeculativeVLMPipeline(target=model, processor=AutoProcessor.from_pretrained(target_dir),
                                  **{component: head})
    conv = read_conversations(data).records[0]
    image = Image.open(conv.image).convert("RGB")
    plain = pipe([image], [conv.turns[0][0]], max_new_tokens=12, method="none")
    drafted = pipe([image], [conv.turns[0][0]], max_new_tokens=12, method=recipe.removeprefix("vlm-"))
    assert drafted.tokens == plain.tokens


def test_a_head_is_refused_for_another_target(targets, tmp_path):
    from transformers import AutoProcessor

    from mmspec.pipelines import SpeculativeVLMPipeline

    target_dir, data = targets["qwen2-vl"]
    train(tmp_path / "head", "vlm-eagle", target_dir, data, "--steps", "1", "--tau-tokens", "0")
    head = load_checkpoint(VLMDraftHead, tmp_path / "head")
    llava_dir = targets["llava"][0]
    pipe = SpeculativeVLMPipeline(target=tiny_llava(), processor=AutoProcessor.from_pretrained(llava_dir),
                                  eagle_head=head)
    image = Image.new("RGB", (16, 16))
    with pytest.raises(ValueError) as err:
        pipe([image], ["what colour is the shape ?"], max_new_tokens=2, method="eagle")
    message = str(err.value)
    assert "Qwen2VLForConditionalGeneration config" in message and "LlavaForConditionalGeneration config" in message
    assert "\n" not in message


# --- the data: skipped and counted, or refused before training ------------------------------------

def test_malformed_records_are_skipped_and_counted(tmp_path):
    good = write_data(tmp_path, 3, (8, 8))
    lines = good.read_text().splitlines()
    (tmp_path / "images" / "bad.png").write_bytes(b"not a png")
    bad = [
        "{not json",
        json.dumps({"image": "images/0.png"}),  # no conversations
        json.dumps({"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "x"}]}),
        json.dumps({"image": "images/missing.png", "conversations": json.loads(lines[0])["conversations"]}),
        json.dumps({"conversations": [{"from": "human", "value": "<image>\nno image"}, {"from": "gpt", "value": "a"}]}),
        json.dumps({"image": "images/0.png", "conversations": [{"from": "human", "value": "q"},
                                                                {"from": "gpt", "value": "  "}]}),
        json.dumps({"image": ["images/0.png", "images/1.png"], "conversations": json.loads(lines[0])["conversations"]}),
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join([lines[0], *bad, lines[1], lines[2]]) + "\n")
    convs = read_conversations(tmp_path / "mixed.jsonl")
    assert len(convs.records) == 3 and len(convs.skipped) == len(bad)
    assert convs.skipped[0][0].endswith("mixed.jsonl:2") and "not JSON" in convs.skipped[0][1]
    assert "not found" in convs.skipped[3][1] and "no 'image'" in convs.skipped[4][1]
    assert "one image per record" in convs.skipped[6][1]
    assert convs.records[0].turns[0][0] == "what colour is the shape ?"  # the <image> tag removed


def test_an_unreadable_image_is_skipped_at_training(targets, tmp_path):
    target_dir, data = targets["llava"]
    lines = data.read_text().splitlines()
    (tmp_path / "images").mkdir()
    for i in range(10):
        (tmp_path / "images" / f"{i}.png").write_bytes((data.parent / "images" / f"{i}.png").read_bytes())
    (tmp_path / "images" / "3.png").write_bytes(b"\x89PNG broken")
    (tmp_path / "d.jsonl").write_text("\n".join(lines[:10]) + "\n")
    log = train(tmp_path / "head", "vlm-eagle", target_dir, tmp_path / "d.jsonl", "--steps", "1", "--tau-tokens", "0",
                "--batch-size", "4")
    assert log["data"]["skipped"] == 1 and "3.png cannot be read" in log["data"]["skipped_first"][0]
    assert log["data"]["train"] + log["data"]["heldout"] == 9


@pytest.mark.parametrize("content, expected", [
    (None, "no such file or folder"),
    ("[{\"image\": ", "is not valid JSON"),
    ("{\"bad\": 1}\n", "no usable conversation"),
])
def test_unreadable_data_is_refused_before_training(targets, tmp_path, content, expected):
    target_dir, _ = targets["llava"]
    data = tmp_path / ("d.json" if content and content.startswith("[") else "d.jsonl")
    if content is not None:
        data.write_text(content)
    with pytest.raises(ValueError, match=expected):
        train(tmp_path / "head", "vlm-eagle", target_dir, data)
    assert not (tmp_path / "head").exists()


def test_a_foreign_target_needs_data(targets, tmp_path):
    target_dir, _ = targets["qwen2-vl"]
    with pytest.raises(ValueError, match="data must be conversations in the LLaVA layout"):
        commands.main(["train", "vlm-eagle", "--out", str(tmp_path / "h"), "--target", str(target_dir),
                       "--steps", "1", "--debug"])


def test_a_multi_turn_conversation_marks_every_answer(tmp_path):
    """Two turns through the LLaVA chat template: the answer tokens are both answers with their
    end-of-turn token, the prompt ends at the first answer, and the ids are those of the whole
    conversation rendered at once."""
    from mmspec.training.data.conversations import load_image, render

    write_data(tmp_path, 1, (16, 16))
    record = {"image": "images/0.png", "conversations": [
        {"from": "human", "value": "<image>\nwhat colour is the shape ?"}, {"from": "gpt", "value": "the shape"},
        {"from": "human", "value": "where is the image ?"}, {"from": "gpt", "value": "in detail ."}]}
    (tmp_path / "two.jsonl").write_text(json.dumps(record) + "\n")
    conv = read_conversations(tmp_path / "two.jsonl").records[0]
    processor = llava_processor()
    r = render(processor, conv, load_image(conv.image))
    tok = processor.tokenizer
    answered = tok.convert_ids_to_tokens([i for i, a in zip(r.ids, r.answer) if a])
    assert answered == ["the", "shape", "</s>", "in", "detail", ".", "</s>"]
    assert tok.convert_ids_to_tokens(r.ids[r.prompt_len - 1 : r.prompt_len + 1]) == ["ASSISTANT:", "the"]
    assert r.ids.count(IMAGE) == 4 and r.vision["pixel_values"].shape == (1, 3, 16, 16)
    text = processor.apply_chat_template([
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape ?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "the shape"}]},
        {"role": "user", "content": [{"type": "text", "text": "where is the image ?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "in detail ."}]}], tokenize=False)
    whole = processor(text=[text], images=[load_image(conv.image)], add_special_tokens=False)["input_ids"][0]
    assert r.ids == list(whole)


def test_a_conversation_longer_than_max_length_is_skipped(tmp_path):
    """``user_items``: a rendered conversation over ``max_length`` tokens is skipped and counted."""
    from mmspec.training.recipes.vlm_draft import user_items

    data = write_data(tmp_path, 6, (16, 16))
    lines = data.read_text().splitlines()
    long = json.loads(lines[0])
    long["conversations"][1]["value"] = " ".join(["the shape"] * 20)
    data.write_text("\n".join([json.dumps(long), *lines[1:]]) + "\n")
    train, held, record = user_items(llava_processor(), data, None, limit=10, heldout_size=1, seed=0,
                                     max_length=30, log=lambda m: None)
    assert len(train) + len(held) == 5 and record["skipped"] == 1
    assert "more than max_length 30" in record["skipped_first"][0] and record["skipped_first"][0].startswith(str(data))
