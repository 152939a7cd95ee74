"""pipelines/vlm_inputs.py: chat templates from the processor (the bundled tiny one reproduces the
old hard-coded frame), LLaVA / Qwen2-VL / Qwen2.5-VL processors, image forms refused or accepted,
sampling defaults from a GenerationConfig, a streamer fed from the decode loop, and the VLM
pipeline around tiny random Qwen2-VL and Qwen2.5-VL models equal to transformers' generate."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoProcessor, GenerationConfig, PreTrainedTokenizerFast, Qwen2_5_VLProcessor,
                          Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor, TextStreamer)

from mmspec.adapters.vlm import VLMTarget
from mmspec.core import LogitsProcessor, ModelTreeDrafter, SpeculativeDecoder
from mmspec.models.vlm import CHAT_TEMPLATE, build_processor
from mmspec.pipelines import SpeculativeVLMPipeline
from mmspec.pipelines.vlm_inputs import (StreamerFeed, as_image, prepare_vlm_inputs, sampling_from_generation_config,
                                         user_message)
from mmspec.training.data.scene_qa import _DESCRIBE, SceneQADataset, prompt_text, vocabulary
from mmspec.training.recipes.common import heldout_seed
from test_vlm_adapter import IMAGE, VEND, VOCAB, VSTART, tiny_llava, tiny_qwen2_5_vl, tiny_qwen2_vl

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "assets" / "vlm"


# --- the bundled processor: its chat template writes the frame the tiny VLM was trained on -------

@pytest.fixture(scope="module")
def bundled():
    return AutoProcessor.from_pretrained(ASSETS / "processor")


def heldout_questions(n: int = 50) -> tuple[list[torch.Tensor], list[str]]:
    """The pipeline tests' 50 held-out prompts: images in [0, 1], description and short questions."""
    data = SceneQADataset(n, heldout_seed(0))
    images, questions = [], []
    for i in range(n):
        image, question, _ = data[i]
        images.append((image + 1) / 2)
        questions.append(question if i % 5 == 4 else _DESCRIBE[i % len(_DESCRIBE)])
    return images, questions


def test_bundled_template_gives_the_old_frames_token_ids(bundled):
    """On the 50 held-out prompts' questions (and the same questions in upper case with extra
    spaces), apply_chat_template + the processor give the ids of the old hard-coded frame
    ``prompt_text(" ".join(q.lower().split()))``, and the same pixel values."""
    images, questions = heldout_questions()
    assert len(set(questions)) >= 5
    for image, q in zip(images, questions):
        pil = PIL.Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())  # as before
        old = bundled(images=[pil], text=[prompt_text(" ".join(q.lower().split()))], return_tensors="pt")
        for asked in (q, "  " + q.upper().replace(" ", "   ") + " "):
            new = prepare_vlm_inputs(bundled, image, asked)
            assert new.input_ids == [old["input_ids"][0].tolist()]
            assert torch.equal(new.vision["pixel_values"], old["pixel_values"])
            assert set(new.vision) == {"pixel_values"}  # LLaVA: no grids


def test_the_template_is_saved_with_the_processor_and_the_recipe_writes_it(bundled, tmp_path):
    assert bundled.chat_template == CHAT_TEMPLATE
    assert (ASSETS / "processor" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert AutoProcessor.from_pretrained(ASSETS / "target").chat_template == CHAT_TEMPLATE
    build_processor(vocabulary()).save_pretrained(tmp_path)  # what train_vlm saves beside the weights
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        assert (tmp_path / name).read_bytes() == (ASSETS / "processor" / name).read_bytes(), name


def test_template_conversation_and_roles(bundled):
    conversation = user_message("What SHAPE ?") + [{"role": "assistant", "content": "a star ."},
                                                   {"role": "user", "content": "what colour is it ?"}]
    assert bundled.apply_chat_template(conversation, add_generation_prompt=True) == \
        "<s> user : <image> what shape ? assistant : a star . </s> user : what colour is it ? assistant :"
    with pytest.raises(Exception, match="roles are user or assistant, got system"):
        bundled.apply_chat_template([{"role": "system", "content": "be brief"}])


def test_runtime_modules_do_not_import_training_code():
    """models/vlm and adapters/vlm import nothing of mmspec.training (a fresh interpreter); the VLM
    pipeline's own files name no training module (statically: importing mmspec.pipelines also
    imports the other pipelines, whose imports are theirs)."""
    code = ("import sys, mmspec.models.vlm, mmspec.adapters.vlm\n"
            "print(sorted(m for m in sys.modules if m.startswith('mmspec.training')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
    for path in (ROOT / "pipelines" / "vlm.py", ROOT / "pipelines" / "vlm_inputs.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any("training" in n.split(".") for n in names), (path.name, names)


def test_a_processor_without_a_chat_template_is_refused(bundled):
    bare = build_processor(vocabulary())
    bare.chat_template = None
    with pytest.raises(ValueError, match="processor must be a processor with a chat_template"):
        prepare_vlm_inputs(bare, np.zeros((8, 8, 3), np.uint8), "what shape ?")


# --- image forms --------------------------------------------------------------------------------

def _rgb(seed=0, size=(64, 64)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def test_image_forms_give_the_same_pixels(bundled):
    arr = _rgb()
    pil = PIL.Image.fromarray(arr)
    ref = prepare_vlm_inputs(bundled, pil, "what shape ?").vision["pixel_values"]
    assert torch.equal(prepare_vlm_inputs(bundled, arr, "what shape ?").vision["pixel_values"], ref)
    floats = arr.astype(np.float32) / 255
    from_array = prepare_vlm_inputs(bundled, floats, "what shape ?").vision["pixel_values"]
    from_tensor = prepare_vlm_inputs(bundled, torch.from_numpy(floats).permute(2, 0, 1), "what shape ?")
    assert torch.equal(from_array, from_tensor.vision["pixel_values"])
    assert torch.equal(from_array, ref)  # floats are rounded to the same 8 bits
    grey = PIL.Image.fromarray(arr[..., 0])  # mode L: converted to RGB explicitly
    assert as_image(grey).mode == "RGB" and np.array_equal(np.asarray(as_image(grey))[..., 2], arr[..., 0])


@pytest.mark.parametrize("image, message", [
    (PIL.Image.new("RGBA", (8, 8)), r"image.mode must be one of \['RGB', 'L', 'P', 'YCbCr'\]"),
    (PIL.Image.new("LA", (8, 8)), "image.mode must be one of"),
    (PIL.Image.new("I", (8, 8)), "image.mode must be one of"),
    (PIL.Image.new("1", (8, 8)), "image.mode must be one of"),
    (PIL.Image.new("RGB", (8, 8)).convert("P"), None),  # a palette without transparency is fine
    (np.full((8, 8, 3), 200.0), r"image values must be floats in \[0, 1\] \(divide 0-255 values by 255\), "
                                r"got values in \[200, 200\]"),
    (torch.full((3, 8, 8), -0.5), r"got values in \[-0.5, -0.5\]"),
    (torch.full((3, 8, 8), float("nan")), r"image values must be floats in \[0, 1\]"),
    (np.zeros((3, 8, 8), np.float32), r"image.shape must be \(H, W, 3\)"),
    (torch.zeros(8, 8, 3), r"image.shape must be \(3, H, W\)"),
    (torch.zeros(3, 8, 8, dtype=torch.uint8), "image.dtype must be a float dtype"),
    (np.zeros((8, 8, 3), np.int64), "image.dtype must be uint8 or a float dtype"),
    ("scene.png", "image must be a PIL image"),
    (None, "image must be a PIL image"),
])
def test_image_forms_refused(image, message):
    if message is None:
        assert as_image(image).mode == "RGB"
        p = image.copy()
        p.info["transparency"] = 0
        with pytest.raises(ValueError, match="a palette without transparency"):
            as_image(p)
        return
    with pytest.raises(ValueError, match=message):
        as_image(image)


@pytest.mark.parametrize("kwargs, message", [
    (dict(images=[np.zeros((8, 8, 3), np.uint8)] * 2, prompts="what ?"), r"images must be one image \(or a list of images\) per prompt \(1\)"),
    (dict(images=np.zeros((8, 8, 3), np.uint8), prompts=[]), "prompts must be a non-empty"),
    (dict(images=np.zeros((8, 8, 3), np.uint8), prompts=["  "]), r"prompts\[0\] must be a non-empty string"),
    (dict(images=[np.zeros((8, 8, 3), np.uint8), np.full((8, 8, 3), 9.0)], prompts=["a", "b"]),
     r"images\[1\] values must be floats in \[0, 1\]"),
])
def test_prepare_refuses_bad_calls(bundled, kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_vlm_inputs(bundled, **kwargs)


# --- Qwen2-VL / Qwen2.5-VL processors built locally -------------------------------------------

# ids match the tiny random models of test_vlm_adapter (VOCAB 64, image 60, vision start 61, end 62)
QWEN_SPECIAL = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<unk>", IMAGE: "<|image_pad|>",
                VSTART: "<|vision_start|>", VEND: "<|vision_end|>", 63: "<|video_pad|>"}
QWEN_WORDS = ["user", "assistant", "system", "what", "colour", "is", "the", "shape", "?", "describe", "image",
              "in", "detail", ".", "where"]
# ChatML, as the Qwen2-VL family frames a turn (written for these tests)
QWEN_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def qwen_processor(cls):
    """A word-level tokenizer over ``VOCAB`` ids and Qwen2-VL's image processor at patch 2, merge
    2 (8 x 12 pixels -> a (1, 4, 6) grid -> 6 image tokens), no download."""
    vocab = {QWEN_SPECIAL.get(i) or (QWEN_WORDS[i - 4] if i - 4 < len(QWEN_WORDS) else f"w{i}"): i
             for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",
                              "im_start": "<|im_start|>"})
    sizes = dict(size={"shortest_edge": 16, "longest_edge": 32 * 32}, patch_size=2, temporal_patch_size=2,
                 merge_size=2)
    return cls(image_processor=Qwen2VLImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3, **sizes),
               tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(**sizes), chat_template=QWEN_TEMPLATE)


QWEN = {"qwen2-vl": (Qwen2VLProcessor, tiny_qwen2_vl), "qwen2.5-vl": (Qwen2_5_VLProcessor, tiny_qwen2_5_vl)}
QUESTIONS = ["what colour is the shape ?", "describe the image in detail . where is the shape ?"]
SIZES = [(8, 12), (12, 8)]  # (H, W): grids (1, 4, 6) and (1, 6, 4), 6 tokens each


def qwen_images():
    rng = np.random.default_rng(4)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]


@pytest.mark.parametrize("family", list(QWEN))
def test_qwen_processors_give_ids_and_grids(family):
    processor = qwen_processor(QWEN[family][0])
    inputs = prepare_vlm_inputs(processor, qwen_images(), QUESTIONS)
    assert inputs.vision["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 4]]
    assert inputs.vision["pixel_values"].shape == (24 + 24, 3 * 2 * 2 * 2)  # patches, C * T * P * P
    for ids, q in zip(inputs.input_ids, QUESTIONS):
        tok = processor.tokenizer
        words = tok.convert_ids_to_tokens(ids)
        assert words[:2] == ["<|im_start|>", "user"] and words[-3:] == ["<|im_end|>", "<|im_start|>", "assistant"]
        assert words[2:10] == ["<|vision_start|>"] + ["<|image_pad|>"] * 6 + ["<|vision_end|>"]
        assert tok.decode(ids[10:-3]) == q
    single = prepare_vlm_inputs(processor, qwen_images()[1], QUESTIONS[1])  # one prompt alone, same ids
    assert single.input_ids == inputs.input_ids[1:]
    assert torch.equal(single.vision["pixel_values"], inputs.vision["pixel_values"][24:])


def test_several_images_for_a_prompt(bundled):
    """``images=[[a, b], c]``: the template writes one image part per image, in order, and the
    pixels come in the same order; a prompt with one image is the same with or without the list.
    On a Qwen processor each image keeps its own grid and vision block."""
    a, b = (np.full((8, 8, 3), v, np.uint8) for v in (40, 200))
    two = prepare_vlm_inputs(bundled, [[a, b], a], ["what ?", "what ?"])
    alone = prepare_vlm_inputs(bundled, [a], ["what ?"])
    image_id = bundled.tokenizer.convert_tokens_to_ids(bundled.image_token)
    assert [row.count(image_id) for row in two.input_ids] == [128, 64] and two.input_ids[1] == alone.input_ids[0]
    assert torch.equal(two.vision["pixel_values"][2], alone.vision["pixel_values"][0])
    assert torch.equal(two.vision["pixel_values"][0], two.vision["pixel_values"][2])
    listed = prepare_vlm_inputs(bundled, [[a]], ["what ?"])
    assert listed.input_ids == alone.input_ids and torch.equal(listed.vision["pixel_values"], alone.vision["pixel_values"])
    processor = qwen_processor(Qwen2VLProcessor)
    x, y = qwen_images()
    inputs = prepare_vlm_inputs(processor, [[x, y]], QUESTIONS[:1])
    assert inputs.vision["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 4]]
    words = processor.tokenizer.convert_ids_to_tokens(inputs.input_ids[0])
    block = ["<|vision_start|>"] + ["<|image_pad|>"] * 6 + ["<|vision_end|>"]
    assert words[2:18] == block + block
    with pytest.raises(ValueError, match=r"images\[0\] must be an image or a non-empty list of images"):
        prepare_vlm_inputs(bundled, [[]], ["what ?"])
    with pytest.raises(ValueError, match=r"images\[1\]\[0\] values must be floats in \[0, 1\]"):
        prepare_vlm_inputs(bundled, [a, [np.full((8, 8, 3), 9.0)]], ["a", "b"])


# --- sampling defaults from a GenerationConfig ---------------------------------------------------

@pytest.mark.parametrize("config, args, expected", [
    (None, {}, dict(temperature=0.0, top_k=None, top_p=None, eos_token_id=None)),
    (GenerationConfig(eos_token_id=2), {}, dict(temperature=0.0, top_k=None, top_p=None, eos_token_id=(2,))),
    (GenerationConfig(eos_token_id=[2, 0]), {}, dict(temperature=0.0, top_k=None, top_p=None, eos_token_id=(2, 0))),
    # greedy config: the sampling fields are not applied ...
    (GenerationConfig(do_sample=False, temperature=0.7, top_k=20, top_p=0.8), {},
     dict(temperature=0.0, top_k=None, top_p=None, eos_token_id=None)),
    # ... a sampling config applies what it states (Qwen2-VL-Instruct ships like this)
    (GenerationConfig(do_sample=True, temperature=0.01, top_k=1, top_p=0.001, eos_token_id=[151645, 151643]), {},
     dict(temperature=0.01, top_k=1, top_p=0.001, eos_token_id=(151645, 151643))),
    (GenerationConfig(do_sample=True), {}, dict(temperature=1.0, top_k=None, top_p=None, eos_token_id=None)),
    (GenerationConfig(do_sample=True, top_k=0, top_p=1.0), {},  # transformers' "off" values
     dict(temperature=1.0, top_k=None, top_p=None, eos_token_id=None)),
    # explicit arguments win, field by field
    (GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
     dict(temperature=0), dict(temperature=0, top_k=20, top_p=0.8, eos_token_id=None)),
    (GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
     dict(top_k=5, top_p=0.5), dict(temperature=0.7, top_k=5, top_p=0.5, eos_token_id=None)),
    (GenerationConfig(do_sample=False, top_k=20), dict(temperature=1.5, top_p=0.9),
     dict(temperature=1.5, top_k=None, top_p=0.9, eos_token_id=None)),
])
def test_sampling_from_generation_config(config, args, expected):
    assert sampling_from_generation_config(config, **args) == expected


@pytest.mark.parametrize("config, args, message", [
    ({"do_sample": True}, {}, "generation_config must be None or a transformers GenerationConfig"),
    (None, dict(temperature=-1), "temperature must be None or a number >= 0"),
    (None, dict(temperature=True), "temperature must be"),
    (None, dict(top_k=0), "top_k must be None or an int >= 1"),
    (None, dict(top_k=2.0), "top_k must be"),
    (None, dict(top_p=0), r"top_p must be None or a number in \(0, 1\]"),
    (None, dict(top_p=1.5), "top_p must be"),
])
def test_sampling_arguments_refused(config, args, message):
    with pytest.raises(ValueError, match=message):
        sampling_from_generation_config(config, **args)


def test_the_bundled_targets_generation_config_is_greedy_with_its_eos():
    config = GenerationConfig.from_pretrained(ASSETS / "target")
    assert sampling_from_generation_config(config) == dict(temperature=0.0, top_k=None, top_p=None, eos_token_id=(2,))


# --- a streamer fed from the decode loop ---------------------------------------------------------

class Recording(TextStreamer):
    """transformers' TextStreamer, keeping what it would print and each put's size."""

    def __init__(self, tokenizer, **kw):
        super().__init__(tokenizer, **kw)
        self.text, self.puts, self.ended = "", [], False

    def put(self, value):
        self.puts.append(value.numel())
        super().put(value)

    def on_finalized_text(self, text, stream_end=False):
        self.text += text
        self.ended |= stream_end


@pytest.mark.parametrize("max_new_tokens, eos", [(24, None), (24, "first"), (5, None), (1, None)])
def test_streamed_text_equals_the_final_answer(max_new_tokens, eos):
    """A tiny LLaVA drafting for itself (every tree accepted: several tokens per put), streaming
    through TextStreamer(skip_prompt=True): the printed text is the decoded final answer."""
    model = tiny_llava()
    processor = qwen_processor(Qwen2VLProcessor)  # only its tokenizer: ids < 64 decode to words
    tok = processor.tokenizer
    target = VLMTarget(model)
    prompt = [5, 9, 14] + [IMAGE] * 4 + [2, 33]
    conditioning = target.vision_inputs(torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3)))
    decoder = SpeculativeDecoder(target, ModelTreeDrafter(target, top_k=3, depth=3, total_tokens=10),
                                 processor=LogitsProcessor(temperature=0))
    plain = decoder.generate([prompt], max_new_tokens, conditioning=conditioning)
    greedy = plain.sequences[0].tolist()
    eos_id = None if eos is None else greedy[3]  # a token it emits: the answer ends at its first
    length = max_new_tokens if eos is None else greedy.index(eos_id) + 1

    streamer = Recording(tok, skip_prompt=True, skip_special_tokens=True)
    feed = StreamerFeed(streamer, prompt, max_new_tokens, eos_id)
    out = decoder.generate([prompt], max_new_tokens, conditioning=conditioning, eos_token_id=eos_id,
                           callback=lambda step, state: feed.step(state))
    answer = out.sequences[0, : out.lengths[0]].tolist()
    feed.end(answer)
    assert streamer.ended and streamer.puts[0] == len(prompt)  # the prompt went first, and was skipped
    assert sum(streamer.puts[1:]) == len(answer) == length
    assert streamer.text == tok.decode(answer, skip_special_tokens=True)
    if max_new_tokens == 24 and eos is None:
        assert max(streamer.puts[1:]) > 1  # accepted drafts arrive together


def test_streamer_without_put_and_end_is_refused():
    with pytest.raises(ValueError, match="streamer must be None or a transformers streamer"):
        StreamerFeed(print, [1, 2], 4)


# --- the VLM pipeline around real families, built in memory --------------------------------------

NEW_TOKENS = 12


def qwen_pipe(family: str, **generation) -> SpeculativeVLMPipeline:
    """The pipeline around a tiny random model whose ``generation_config`` lists two EOS ids, each
    ending one of the two answers mid-way (picked from its EOS-free greedy answers: a random model
    emits <|im_end|> at arbitrary points)."""
    processor_cls, build = QWEN[family]
    model = build()
    pipe = SpeculativeVLMPipeline(target=model, processor=qwen_processor(processor_cls))
    pipe.set_progress_bar_config(disable=True)
    model.generation_config.eos_token_id = None
    free = hf_answers(pipe, qwen_images(), QUESTIONS)
    eos = []
    for row in free:
        seen = {t for r in free for t in r[:5]} | set(eos)
        eos.append(next(t for i, t in enumerate(row) if i >= 5 and t not in seen and t not in row[:i]))
    model.generation_config.eos_token_id = eos
    for k, v in generation.items():
        setattr(model.generation_config, k, v)
    return pipe


@torch.no_grad()
def hf_answers(pipe, images, questions) -> list[list[int]]:
    """transformers' own path: the processor on the templated text, then ``model.generate``."""
    answers = []
    for image, q in zip(images, questions):
        text = pipe.processor.apply_chat_template(user_message(q), add_generation_prompt=True)
        enc = pipe.processor(images=[PIL.Image.fromarray(image)], text=[text], return_tensors="pt")
        out = pipe.target.generate(**enc, do_sample=False, max_new_tokens=NEW_TOKENS)
        answers.append(out[0, enc["input_ids"].shape[1]:].tolist())
    return answers


@pytest.mark.parametrize("family", list(QWEN))
def test_pipeline_serves_qwen_families_like_transformers_generate(family):
    pipe = qwen_pipe(family)
    images = qwen_images()
    expected = hf_answers(pipe, images, QUESTIONS)
    assert all(len(set(row)) > 2 for row in expected), "the target's greedy text is trivially constant"
    assert all(len(row) < NEW_TOKENS for row in expected)  # each row ended at one of the listed EOS ids
    out = pipe(images=images, prompts=QUESTIONS, max_new_tokens=NEW_TOKENS, method="none")  # B = 2
    assert out.tokens == expected
    assert out.texts == pipe.processor.tokenizer.batch_decode(expected, skip_special_tokens=True)
    alone = pipe(images=images[1], prompts=QUESTIONS[1], max_new_tokens=NEW_TOKENS, method="lookup")  # B = 1
    assert alone.tokens == expected[1:]


@pytest.mark.parametrize("family", list(QWEN))
def test_pipeline_reads_sampling_defaults_from_the_generation_config(family):
    greedy = hf_answers(qwen_pipe(family), qwen_images(), QUESTIONS)
    call = dict(images=qwen_images(), prompts=QUESTIONS, max_new_tokens=NEW_TOKENS)
    # the config samples with top_k 1: the argmax, whatever the generator
    pipe = qwen_pipe(family, do_sample=True, top_k=1)
    assert pipe(**call, generator=torch.Generator().manual_seed(0)).tokens == greedy
    # without top_k it samples from the whole distribution (seed 0, 24 tokens): not the argmax path ...
    pipe = qwen_pipe(family, do_sample=True)
    assert pipe(**call, generator=torch.Generator().manual_seed(0)).tokens != greedy
    # ... unless the caller's argument wins
    assert pipe(**call, temperature=0).tokens == greedy


def test_pipeline_streams_one_prompt_and_refuses_a_streamed_batch():
    pipe = qwen_pipe("qwen2-vl")
    streamer = Recording(pipe.processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = pipe(images=qwen_images()[0], prompts=QUESTIONS[0], max_new_tokens=NEW_TOKENS, method="lookup",
               streamer=streamer)
    assert streamer.ended and streamer.text == out.texts[0] and sum(streamer.puts[1:]) == len(out.tokens[0])
    calls = []
    hook = pipe.target.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="streamer must be None with more than one prompt"):
            pipe(images=qwen_images(), prompts=QUESTIONS, streamer=Recording(pipe.processor.tokenizer))
        with pytest.raises(ValueError, match="streamer must be None or a transformers streamer"):
            pipe(images=qwen_images()[0], prompts=QUESTIONS[0], streamer=print)
    finally:
        hook.remove()
    assert not calls
