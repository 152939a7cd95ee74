"""What a VLM pipeline hands the core, built from the artifacts alone: the processor's chat template
frames each question, the processor turns images into ``pixel_values`` (and, for Qwen2-VL /
Qwen2.5-VL, ``image_grid_thw``), the target's ``GenerationConfig`` gives the sampling defaults and
the EOS ids, and a transformers streamer is fed as tokens are accepted.

Nothing here knows a model family or a vocabulary: a LLaVA, Qwen2-VL or Qwen2.5-VL processor that
carries a chat template is served the same way, the bundled tiny one included.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import PIL.Image
import torch

from ..core.errors import check

# PIL modes that hold colour and nothing else: converting them to RGB loses nothing. Alpha (RGBA,
# LA, PA, a palette with transparency), 1-bit, 16/32-bit integer and float modes are refused.
RGB_MODES = ("RGB", "L", "P", "YCbCr")
IMAGE_FORMS = (f"a PIL image (mode {', '.join(RGB_MODES)}), an (H, W, 3) array (uint8, or floats in [0, 1]) "
               "or a (3, H, W) float tensor in [0, 1]")
# what the processors of the served families return: token ids and their mask (dropped: the core
# pads itself), a modality type per token (recomputed by VLMTarget) and the vision inputs
_TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}
_VISION_KEYS = ("pixel_values", "image_grid_thw")


class VLMInputs(NamedTuple):
    """``input_ids``: per prompt its token ids (unpadded, image placeholders expanded);
    ``vision``: the images of all prompts in prompt order, as ``VLMTarget.vision_inputs(**vision)``
    takes them (``pixel_values``, and ``image_grid_thw`` for the M-RoPE families)."""

    input_ids: list[list[int]]
    vision: dict


def user_message(question: str) -> list[dict]:
    """The standard one-turn conversation: an image, then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def as_image(image, name: str = "image") -> PIL.Image.Image:
    """One image in one of ``IMAGE_FORMS`` -> an RGB PIL image, what every processor takes. PIL
    images of a mode in ``RGB_MODES`` are converted to RGB; uint8 arrays are wrapped; float arrays
    and tensors must lie in [0, 1] (values outside are refused, not clipped) and are rounded to
    8 bits, as an image file would hold them."""
    if isinstance(image, PIL.Image.Image):
        mode_ok = image.mode in RGB_MODES and not (image.mode == "P" and "transparency" in image.info)
        check(mode_ok, f"{name}.mode", f"one of {list(RGB_MODES)} (a palette without transparency)", image.mode)
        check(min(image.size) > 0, f"{name}.size", "a non-empty (width, height)", image.size)
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, np.ndarray):
        check(image.ndim == 3 and image.shape[-1] == 3 and min(image.shape) > 0, f"{name}.shape", "(H, W, 3)",
              image.shape)
        if image.dtype == np.uint8:
            return PIL.Image.fromarray(image)
        check(np.issubdtype(image.dtype, np.floating), f"{name}.dtype", "uint8 or a float dtype", str(image.dtype))
        image = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)  # (3, H, W)
    elif isinstance(image, torch.Tensor):
        check(image.dim() == 3 and image.shape[0] == 3 and min(image.shape) > 0, f"{name}.shape", "(3, H, W)",
              tuple(image.shape))
        check(image.is_floating_point(), f"{name}.dtype", "a float dtype (values in [0, 1])", image.dtype)
    else:
        check(False, name, IMAGE_FORMS, type(image).__name__)
    image = image.detach().to("cpu", torch.float32)
    lo, hi = image.min().item(), image.max().item()
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo and hi <= 1):
        raise ValueError(f"{name} values must be floats in [0, 1] (divide 0-255 values by 255), "
                         f"got values in [{lo:g}, {hi:g}]")
    return PIL.Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())


def prepare_vlm_inputs(processor, images, prompts) -> VLMInputs:
    """Frame each prompt with ``processor``'s chat template (``user_message``, generation prompt
    added) and run the processor on it and its image: one image per prompt, prompts in order.

    Args:
        processor: a LLaVA, Qwen2-VL or Qwen2.5-VL processor with a ``chat_template``.
        images: one image per prompt (``IMAGE_FORMS``); a single image for a single prompt.
        prompts: a question or a list of them.
    """
    check(callable(getattr(processor, "apply_chat_template", None)) and getattr(processor, "tokenizer", None)
          is not None, "processor", "a transformers multimodal processor (with a tokenizer)", type(processor).__name__)
    check(isinstance(getattr(processor, "chat_template", None), (str, dict)) and processor.chat_template,
          "processor", "a processor with a chat_template (set processor.chat_template and save it with the processor)",
          f"{type(processor).__name__} without one")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    check(isinstance(prompts, (list, tuple)) and len(prompts) > 0, "prompts",
          "a non-empty question string or a non-empty list of them", prompts)
    for i, p in enumerate(prompts):
        check(isinstance(p, str) and p.strip() != "", f"prompts[{i}]", "a non-empty string", p)
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    check(len(images) == len(prompts), "images", f"one image per prompt ({len(prompts)})", f"{len(images)} images")
    images = [as_image(image, f"images[{i}]") for i, image in enumerate(images)]  # all checked before any work

    bos = processor.tokenizer.bos_token
    ids, vision = [], {k: [] for k in _VISION_KEYS}
    for image, prompt in zip(images, prompts):
        text = processor.apply_chat_template(user_message(prompt), add_generation_prompt=True, tokenize=False)
        # as processor.apply_chat_template(tokenize=True) does: a template that writes BOS gets no second one
        enc = processor(images=[image], text=[text], return_tensors="pt",
                        add_special_tokens=not (bos is not None and text.startswith(bos)))
        unknown = set(enc) - _TEXT_KEYS - set(_VISION_KEYS)
        check(not unknown, "processor", "a LLaVA, Qwen2-VL or Qwen2.5-VL processor (outputs: input ids, "
              "pixel_values, image_grid_thw)", f"{type(processor).__name__} returning {sorted(unknown)}")
        ids.append(enc["input_ids"][0].tolist())
        for k in _VISION_KEYS:
            if k in enc:
                vision[k].append(enc[k])
    return VLMInputs(ids, {k: torch.cat(v) for k, v in vision.items() if v})


def sampling_from_generation_config(config, temperature=None, top_k=None, top_p=None) -> dict:
    """The core's sampling arguments and EOS ids, defaulting to ``config`` (a transformers
    ``GenerationConfig``, e.g. ``target.generation_config``; ``None`` = an empty one).

    An argument given (not ``None``) wins. Otherwise: ``do_sample`` false or unset is greedy
    (temperature 0, no top-k / top-p); ``do_sample`` true samples at ``config.temperature`` (1.0
    when unset) with ``config.top_k`` and ``config.top_p`` when set (``top_k`` 0 and ``top_p`` 1.0
    mean off, as in transformers). Unlike transformers' ``generate``, an unset ``top_k`` does not
    become 50: only what the artifact states is applied.

    Returns:
        ``dict(temperature, top_k, top_p, eos_token_id)``; ``eos_token_id`` is ``None`` or a tuple
        of ints (a config may list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``).
    """
    from transformers import GenerationConfig

    check(config is None or isinstance(config, GenerationConfig), "generation_config",
          "None or a transformers GenerationConfig", type(config).__name__)
    config = config or GenerationConfig()

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    check(temperature is None or (number(temperature) and temperature >= 0), "temperature",
          "None or a number >= 0 (0 is greedy)", temperature)
    check(top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1), "top_k",
          "None or an int >= 1", top_k)
    check(top_p is None or (number(top_p) and 0 < top_p <= 1), "top_p", "None or a number in (0, 1]", top_p)

    sample = bool(config.do_sample)
    if temperature is None:
        temperature = (1.0 if config.temperature is None else float(config.temperature)) if sample else 0.0
    if top_k is None and sample and config.top_k:  # 0 / None: off
        top_k = int(config.top_k)
    if top_p is None and sample and config.top_p is not None and config.top_p < 1:
        top_p = float(config.top_p)

    eos = config.eos_token_id
    if eos is not None:
        eos = (eos,) if isinstance(eos, int) else tuple(eos)
        check(len(eos) > 0 and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos),
              "generation_config.eos_token_id", "None, an int >= 0 or a non-empty list of them", config.eos_token_id)
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos)


def check_streamer(streamer, num_prompts: int = 1) -> None:
    """``None``, or a transformers streamer (``put`` and ``end``) with a single prompt."""
    ok = streamer is None or (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None)))
    check(ok, "streamer", "None or a transformers streamer (with put(token_ids) and end(), e.g. TextStreamer)",
          type(streamer).__name__)
    check(streamer is None or num_prompts == 1, "streamer",
          "None with more than one prompt (streaming is batch 1, as in transformers)",
          f"a streamer with {num_prompts} prompts")


class StreamerFeed:
    """Feeds a transformers streamer (``put(token_ids)``, ``end()``: ``TextStreamer``,
    ``TextIteratorStreamer``) from the decode loop, batch 1 only, as transformers' ``generate``
    does: ``put`` the (1, T) prompt first (a ``skip_prompt`` streamer drops it), then the answer's
    tokens as they are emitted (accepted drafts arrive several at a time, as a (n,) tensor), cut at
    ``max_new_tokens`` and after the first EOS exactly as the final answer is, then ``end()``.

    ``step(state)`` is the decode callback's part; ``end(tokens)`` puts what the last passes emitted
    after the last callback (or a prefill-only decode) and ends the stream.
    """

    def __init__(self, streamer, prompt_ids: list[int], max_new_tokens: int, eos_token_id=None):
        check(streamer is not None, "streamer", "a transformers streamer", None)
        check_streamer(streamer)
        self.streamer, self.max_new_tokens = streamer, max_new_tokens
        self.eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) \
            else set(eos_token_id)
        self.sent, self.closed = 0, False  # answer tokens put so far; EOS or the limit reached
        streamer.put(torch.tensor([prompt_ids]))

    def step(self, state) -> None:
        """Put row 0's tokens emitted since the last call (``state``: the core's ``DecodeState``)."""
        start = int(state.prompt_lengths[0])
        self._put(state.tokens[0, start + self.sent: int(state.lengths[0])])

    def end(self, tokens: list[int]) -> None:
        """Put the rest of the final answer ``tokens`` (row 0's, EOS included) and end the stream."""
        self._put(torch.tensor(tokens[self.sent:], dtype=torch.long))
        self.streamer.end()

    def _put(self, new: torch.Tensor) -> None:
        if self.closed:
            return
        new = new[: self.max_new_tokens - self.sent].cpu()
        for i, t in enumerate(new.tolist()):
            if t in self.eos:
                new, self.closed = new[: i + 1], True
                break
        self.sent += len(new)
        self.closed |= self.sent >= self.max_new_tokens
        if len(new):
            self.streamer.put(new)
