"""The tiny LLaVA-architecture VLMs (stock transformers ``LlavaForConditionalGeneration``: a CLIP
vision tower, a 2-layer GELU projector, a Llama language model) and their locally built
word-level tokenizer and processor. Nothing is downloaded. The vocabulary is an argument (the
training recipe passes the closed word set of its data), so this module knows network shapes and
the chat frame, not the data; once saved, the processor folder carries the vocabulary and the chat
template, and runtime code reads them from there.

``"target"`` is the model the VLM methods accelerate; ``"draft"`` is a much smaller VLM with the
same tokenizer, the ``sd`` baseline's draft and transformers' assistant in the peer benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
from transformers import PreTrainedTokenizerFast

from ..core.errors import check, check_choice, is_int

IMAGE_TOKEN = "<image>"
# ids 0-4 of every vocabulary; the words follow
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", IMAGE_TOKEN)

# The chat frame, as a template saved with the processor: "<s> user : <image> QUESTION assistant :"
# and, in a conversation, "ANSWER </s>" after "assistant :". The word-level vocabulary is lower case
# with words split on whitespace, so the template lower-cases each text and joins its words with
# single spaces (what the tokenizer sees anyway). Roles other than user / assistant have no words.
CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('roles are user or assistant, got ' + message['role']) }}
    {%- endif %}
    {{- ' ' + message['role'] + ' :' }}
    {%- if message['content'] is string %}
        {{- ' ' + (message['content'].lower().split() | join(' ')) }}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] == 'image' %}
                {{- ' IMAGE_TOKEN' }}
            {%- elif part['type'] == 'text' %}
                {{- ' ' + (part['text'].lower().split() | join(' ')) }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}
        {{- ' ' + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- ' assistant :' }}
{%- endif %}
""".replace("IMAGE_TOKEN", IMAGE_TOKEN)

IMAGE_SIZE, PATCH_SIZE = 64, 8


def image_tokens(resolution: int = IMAGE_SIZE) -> int:
    """Image features per ``resolution`` x ``resolution`` image: one per ``PATCH_SIZE`` patch (the
    CLS feature is dropped, the "default" strategy)."""
    check_resolution(resolution)
    return (resolution // PATCH_SIZE) ** 2


def check_resolution(resolution) -> int:
    check(is_int(resolution) and resolution >= PATCH_SIZE and resolution % PATCH_SIZE == 0, "resolution",
          f"an int multiple of the patch size {PATCH_SIZE}", resolution)
    return resolution


IMAGE_TOKENS = image_tokens()

# (vision tower, language model) sizes; the target's language model is deep and narrow so a pass
# costs several draft-head layers, the draft VLM's is one narrow layer
SIZES = {
    "target": (dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4),
               dict(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=6,
                    num_key_value_heads=6)),
    "draft": (dict(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2),
              dict(hidden_size=96, intermediate_size=256, num_hidden_layers=1, num_attention_heads=3,
                   num_key_value_heads=3)),
}


def _check_words(words: Sequence[str]) -> list[str]:
    words = list(words) if isinstance(words, (list, tuple)) else words
    check(isinstance(words, list) and tuple(words[:len(SPECIAL_TOKENS)]) == SPECIAL_TOKENS
          and all(isinstance(w, str) and w and not w.split()[1:] for w in words) and len(set(words)) == len(words),
          "words", f"a list of distinct single words starting with {list(SPECIAL_TOKENS)}",
          words if not isinstance(words, list) else words[:len(SPECIAL_TOKENS)])
    return words


def build_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """The word-level tokenizer over ``words`` (word i has id i): ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2,
    ``<unk>`` 3, ``<image>`` 4, then the vocabulary. Text is split on whitespace only."""
    words = _check_words(words)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN},
                                   padding_side="left")


def build_processor(words: Sequence[str], resolution: int = IMAGE_SIZE) -> LlavaProcessor:
    """A ``LlavaProcessor`` over ``build_tokenizer(words)``: ``resolution``-pixel square RGB images
    normalised to [-1, 1] (mean = std = 0.5, as the scenes are rendered), ``<image>`` expanded to
    ``image_tokens(resolution)`` placeholders, ``CHAT_TEMPLATE`` as its chat template."""
    R = check_resolution(resolution)
    images = CLIPImageProcessor(size={"shortest_edge": R}, crop_size={"height": R, "width": R},
                                image_mean=[0.5] * 3, image_std=[0.5] * 3, do_convert_rgb=True)
    return LlavaProcessor(image_processor=images, tokenizer=build_tokenizer(words), patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def llava_config(words: Sequence[str], size: str = "target", resolution: int = IMAGE_SIZE) -> LlavaConfig:
    """The ``LlavaConfig`` of the tiny ``"target"`` or ``"draft"`` VLM over ``words`` for
    ``resolution``-pixel images (sdpa attention)."""
    check_choice("size", size, tuple(SIZES))
    words = _check_words(words)
    vision, text = SIZES[size]
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", image_size=check_resolution(resolution), patch_size=PATCH_SIZE,
                           projection_dim=vision["hidden_size"], **vision),
        text_config=dict(model_type="llama", vocab_size=len(words), max_position_embeddings=512,
                         bos_token_id=words.index("<s>"), eos_token_id=words.index("</s>"),
                         pad_token_id=words.index("<pad>"), tie_word_embeddings=False, **text),
        image_token_index=words.index(IMAGE_TOKEN), vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", attn_implementation="sdpa")
    return config


def new_llava(words: Sequence[str], size: str = "target", resolution: int = IMAGE_SIZE) -> LlavaForConditionalGeneration:
    """A freshly initialised tiny VLM over ``words`` for ``resolution``-pixel images (seed with
    ``torch.manual_seed`` first)."""
    model = LlavaForConditionalGeneration(llava_config(words, size, resolution))
    model.generation_config.eos_token_id = model.config.text_config.eos_token_id
    model.generation_config.pad_token_id = model.config.text_config.pad_token_id
    return model


def resize_vision(model: LlavaForConditionalGeneration, resolution: int) -> LlavaForConditionalGeneration:
    """A copy of a trained tiny VLM that reads ``resolution``-pixel images: every weight kept, the
    vision tower's patch position embeddings resampled (bicubic, as ViT fine-tuning at a higher
    resolution does; the CLS position kept) from the old patch grid to the new one. The warm start
    of a higher-resolution target (``mmspec train vlm --resolution R --init DIR``)."""
    R = check_resolution(resolution)
    config = model.config.to_dict()
    config["vision_config"]["image_size"] = R
    new = LlavaForConditionalGeneration(LlavaConfig.from_dict(config)).to(model.dtype)
    state = dict(model.state_dict())
    key = next(k for k in state if k.endswith("embeddings.position_embedding.weight"))
    old = state[key]  # (1 + s * s, D)
    s, n = math.isqrt(old.shape[0] - 1), R // PATCH_SIZE
    grid = old[1:].float().T.reshape(1, -1, s, s)
    grid = torch.nn.functional.interpolate(grid, size=(n, n), mode="bicubic", align_corners=False)
    state[key] = torch.cat([old[:1].float(), grid.reshape(-1, n * n).T]).to(old.dtype)
    state = {k: v for k, v in state.items() if not k.endswith("position_ids")}  # buffers sized by the config
    missing, unexpected = new.load_state_dict(state, strict=False)
    check(not unexpected and all(k.endswith("position_ids") for k in missing), "model",
          "a tiny LLaVA of mmspec.models.vlm", f"missing {missing}, unexpected {unexpected}")
    new.generation_config = model.generation_config
    return new
