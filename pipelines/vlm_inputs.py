"""What a VLM pipeline hands the core, built from the artifacts alone: the processor's chat template
frames each question, the processor turns images into ``pixel_values`` (and, for Qwen2-VL /
Qwen2.5-VL, ``image_grid_thw``) and videos into ``pixel_values_videos`` and ``video_grid_thw`` (and
Qwen2.5-VL's ``second_per_grid_ts``), the target's ``GenerationConfig`` gives the sampling defaults
and the EOS ids, and a transformers streamer is fed as tokens are accepted.

Nothing here knows a model family or a vocabulary: a LLaVA, Qwen2-VL or Qwen2.5-VL processor that
carries a chat template is served the same way, the bundled tiny one included.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import PIL.Image
import torch

from ..core.errors import check, check_int, is_int

# PIL modes that hold colour and nothing else: converting them to RGB loses nothing. Alpha (RGBA,
# LA, PA, a palette with transparency), 1-bit, 16/32-bit integer and float modes are refused.
RGB_MODES = ("RGB", "L", "P", "YCbCr")
IMAGE_FORMS = (f"a PIL image (mode {', '.join(RGB_MODES)}), an (H, W, 3) array (uint8, or floats in [0, 1]) "
               "or a (3, H, W) float tensor in [0, 1]")
VIDEO_FORMS = "a list of PIL frames of one size, or a (T, H, W, 3) or (T, 3, H, W) uint8 array or tensor"
# what the processors of the served families return: token ids and their mask (dropped: the core
# pads itself), a modality type per token (recomputed by VLMTarget) and the vision inputs
_TEXT_KEYS = {"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"}
_VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


class VLMInputs(NamedTuple):
    """``input_ids``: per prompt its token ids (unpadded, image and video placeholders expanded);
    ``vision``: the images and videos of all prompts in prompt order, as
    ``VLMTarget.vision_inputs(**vision)`` takes them (``pixel_values``, and ``image_grid_thw`` for
    the M-RoPE families; ``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL,
    ``second_per_grid_ts`` when there are videos)."""

    input_ids: list[list[int]]
    vision: dict


def user_message(question: str, image: bool | int = True, video: bool = False) -> list[dict]:
    """The standard one-turn conversation: an image (or ``image`` images, in order) and / or a
    video, then the question."""
    parts = [{"type": "image"}] * int(image) + [{"type": "video"}] * video
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


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


def as_video(video, name: str = "video") -> torch.Tensor:
    """One video in one of ``VIDEO_FORMS`` -> a (T, 3, H, W) uint8 tensor, what the Qwen2-VL video
    processor takes (channels first, so a frame 3 pixels tall is never read as channels last).
    Frames go through ``as_image`` (RGB modes only). A shape that fits both layouts is read as
    (T, H, W, 3)."""
    if isinstance(video, (list, tuple)):
        check(len(video) > 0 and all(isinstance(f, PIL.Image.Image) for f in video), name,
              VIDEO_FORMS, f"a list of {len(video)} " + ", ".join(sorted({type(f).__name__ for f in video})))
        frames = [as_image(f, f"{name}[{i}]") for i, f in enumerate(video)]
        check(len({f.size for f in frames}) == 1, f"{name} frames", "of one size", sorted({f.size for f in frames}))
        return torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).contiguous()
    check(isinstance(video, (np.ndarray, torch.Tensor)), name, VIDEO_FORMS, type(video).__name__)
    video = torch.from_numpy(np.ascontiguousarray(video)) if isinstance(video, np.ndarray) else video
    check(video.dtype == torch.uint8, f"{name}.dtype", "uint8 (0-255)", video.dtype)
    shape = tuple(video.shape)
    check(video.dim() == 4 and 3 in (shape[1], shape[3]) and min(shape) > 0, f"{name}.shape",
          "(T, H, W, 3) or (T, 3, H, W)", shape)
    return (video.permute(0, 3, 1, 2) if shape[3] == 3 else video).detach().cpu().contiguous()


def media_per_prompt(images, videos, count: int) -> tuple[list[list], list]:
    """Per prompt its images (a list of ``as_image``, empty for none) and its video (``as_video``)
    or ``None``. ``images``: one image per prompt (a single image for a single prompt), where a
    prompt's image may also be a non-empty list of images (several images, in order, as
    transformers' processors take ``images=[[a, b], [c]]``). ``videos``: ``None``, or a list of one
    video or ``None`` per prompt; with videos, ``images`` is ``None`` or a list of one image (or a
    list of them) or ``None`` per prompt, and every prompt has an image or a video."""
    if videos is None:
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        check(len(images) == count, "images", f"one image (or a list of images) per prompt ({count})",
              f"{len(images)} images")
        return [_prompt_images(image, f"images[{i}]") for i, image in enumerate(images)], [None] * count
    check(isinstance(videos, (list, tuple)) and len(videos) == count, "videos",
          f"a list of one video (or None) per prompt ({count})",
          f"{len(videos)} videos" if isinstance(videos, (list, tuple)) else type(videos).__name__)
    images = [None] * count if images is None else images
    check(isinstance(images, (list, tuple)) and len(images) == count, "images",
          f"None or a list of one image (or None) per prompt ({count}) when videos are given",
          f"{len(images)} images" if isinstance(images, (list, tuple)) else type(images).__name__)
    for i, (image, video) in enumerate(zip(images, videos)):
        check(image is not None or video is not None, f"videos[{i}]", f"a video where images[{i}] is None", None)
    return ([[] if x is None else _prompt_images(x, f"images[{i}]") for i, x in enumerate(images)],
            [None if x is None else as_video(x, f"videos[{i}]") for i, x in enumerate(videos)])


def _prompt_images(image, name: str) -> list:
    """A prompt's image, or its non-empty list of images, as a list of ``as_image``."""
    if isinstance(image, (list, tuple)):
        check(len(image) > 0, name, "an image or a non-empty list of images", image)
        return [as_image(x, f"{name}[{j}]") for j, x in enumerate(image)]
    return [as_image(image, name)]


def prepare_vlm_inputs(processor, images, prompts, videos=None) -> VLMInputs:
    """Frame each prompt with ``processor``'s chat template (``user_message``, generation prompt
    added) and run the processor on it and its image and / or video, prompts in order.

    Args:
        processor: a LLaVA, Qwen2-VL or Qwen2.5-VL processor with a ``chat_template``; with
            ``videos``, one with a video processor whose template writes a ``{"type": "video"}``
            part as the video placeholder (Qwen2-VL, Qwen2.5-VL).
        images: one image per prompt (``IMAGE_FORMS``), or a list of images for a prompt with
            several (one image part each, in order); a single image for a single prompt. With
            ``videos``: ``None`` or one image (or list) or ``None`` per prompt (``media_per_prompt``).
        prompts: a question or a list of them.
        videos: ``None``, or one video (``VIDEO_FORMS``) or ``None`` per prompt, in a list.
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
    check(videos is None or getattr(processor, "video_processor", None) is not None, "processor",
          "a processor with a video processor (Qwen2-VL, Qwen2.5-VL) when videos are given",
          f"{type(processor).__name__} without one")
    images, videos = media_per_prompt(images, videos, len(prompts))  # all checked before any work

    bos = processor.tokenizer.bos_token
    ids, vision = [], {k: [] for k in _VISION_KEYS}
    for image, video, prompt in zip(images, videos, prompts):
        message = user_message(prompt, image=len(image), video=video is not None)
        text = processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
        token = getattr(processor, "video_token", None)
        check(video is None or token is None or token in text, "processor.chat_template",
              'a template that writes the video placeholder for a {"type": "video"} part', text)
        media = {k: x for k, x in (("images", image), ("videos", None if video is None else [video])) if x}
        # as processor.apply_chat_template(tokenize=True) does: a template that writes BOS gets no second one
        enc = processor(text=[text], **media, return_tensors="pt",
                        add_special_tokens=not (bos is not None and text.startswith(bos)))
        unknown = set(enc) - _TEXT_KEYS - set(_VISION_KEYS)
        check(not unknown, "processor", "a LLaVA, Qwen2-VL or Qwen2.5-VL processor (outputs: input ids, "
              + ", ".join(_VISION_KEYS) + ")", f"{type(processor).__name__} returning {sorted(unknown)}")
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
    check_int(top_k, "top_k", 1, optional=True)
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
        check(len(eos) > 0 and all(is_int(i) and i >= 0 for i in eos),
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
