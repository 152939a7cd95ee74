"""The tiny LLaVA-architecture VLMs (stock transformers ``LlavaForConditionalGeneration``: a CLIP
vision tower, a 2-layer GELU projector, a Llama language model) and their locally built
word-level tokenizer and processor. Nothing is downloaded: the vocabulary is the closed word set
of ``mmspec.training.data.scene_qa``.

``"target"`` is the model the VLM methods accelerate; ``"draft"`` is a much smaller VLM with the
same tokenizer, the ``sd`` baseline's draft and transformers' assistant in the peer benchmark.
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
from transformers import PreTrainedTokenizerFast

from ..core.errors import check_choice
from ..training.data.scene_qa import IMAGE_TOKEN, vocabulary

IMAGE_SIZE, PATCH_SIZE = 64, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # the CLS feature is dropped ("default" strategy)

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


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The word-level tokenizer over ``vocabulary()``: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2,
    ``<unk>`` 3, ``<image>`` 4, then the words sorted. Text is split on whitespace only."""
    words = vocabulary()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN},
                                   padding_side="left")


def build_processor() -> LlavaProcessor:
    """A ``LlavaProcessor``: 64x64 RGB images normalised to [-1, 1] (mean = std = 0.5, as the
    scenes are rendered), ``<image>`` expanded to ``IMAGE_TOKENS`` placeholders."""
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                image_mean=[0.5] * 3, image_std=[0.5] * 3, do_convert_rgb=True)
    return LlavaProcessor(image_processor=images, tokenizer=build_tokenizer(), patch_size=PATCH_SIZE,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def llava_config(size: str = "target") -> LlavaConfig:
    """The ``LlavaConfig`` of the tiny ``"target"`` or ``"draft"`` VLM (sdpa attention)."""
    check_choice("size", size, tuple(SIZES))
    vision, text = SIZES[size]
    words = vocabulary()
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
                           projection_dim=vision["hidden_size"], **vision),
        text_config=dict(model_type="llama", vocab_size=len(words), max_position_embeddings=512,
                         bos_token_id=words.index("<s>"), eos_token_id=words.index("</s>"),
                         pad_token_id=words.index("<pad>"), tie_word_embeddings=False, **text),
        image_token_index=words.index(IMAGE_TOKEN), vision_feature_layer=-1,
        vision_feature_select_strategy="default", projector_hidden_act="gelu", attn_implementation="sdpa")
    return config


def new_llava(size: str = "target") -> LlavaForConditionalGeneration:
    """A freshly initialised tiny VLM (seed with ``torch.manual_seed`` first)."""
    model = LlavaForConditionalGeneration(llava_config(size))
    model.generation_config.eos_token_id = model.config.text_config.eos_token_id
    model.generation_config.pad_token_id = model.config.text_config.pad_token_id
    return model
