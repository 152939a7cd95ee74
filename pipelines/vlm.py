"""``SpeculativeVLMPipeline``: lossless speculative decoding for a LLaVA-style VLM, with the
acceleration method as an argument (diffusers conventions).

::

    pipe = SpeculativeVLMPipeline.from_pretrained("assets/vlm")
    out = pipe(images=[PIL.Image.open("scene.png")], prompts=["describe the image in detail ."],
               method="vispec", max_new_tokens=128)
    print(out.texts[0], out.stats["tau"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from ..adapters.vlm import VLMTarget
from ..adapters.vlm_methods import HEAD_METHODS, METHODS, build_drafter
from ..core import LogitsPipeline, SpeculativeDecoder
from ..core.errors import check, check_choice
from . import checks
# diffusers loads components only from modules already imported: name them here
from ..models import vlm_draft as _vlm_draft  # noqa: F401
from ..training.data.scene_qa import prompt_text


@dataclass
class VLMPipelineOutput(BaseOutput):
    """``texts``: the answers (special tokens dropped); ``tokens``: the generated ids per prompt
    (EOS included when emitted); ``stats``: the decode's counters (``Stats.as_dict``: nfe, tau,
    draft_nfe, seconds, ...)."""

    texts: list[str]
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)


def _as_pil(image) -> PIL.Image.Image:
    if isinstance(image, PIL.Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[-1] == 3:
        arr = image if image.dtype == np.uint8 else (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
        return PIL.Image.fromarray(arr)
    if isinstance(image, torch.Tensor) and image.dim() == 3 and image.shape[0] == 3:
        return _as_pil(image.permute(1, 2, 0).float().clamp(0, 1).cpu().numpy())
    raise ValueError("images: expected PIL images, (H, W, 3) arrays (uint8, or floats in [0, 1]) or (3, H, W) "
                     f"tensors in [0, 1]; got {type(image).__name__}")


class SpeculativeVLMPipeline(DiffusionPipeline):
    """A LLaVA-style VLM (``target``: ``LlavaForConditionalGeneration``; ``processor``: its
    ``LlavaProcessor``) plus optional drafts: ``draft_model`` (a small VLM with the same
    tokenizer, for ``sd``) and ``eagle_head`` / ``specvlm_head`` / ``vispec_head``
    (``VLMDraftHead``s). Methods: ``mmspec.adapters.vlm_methods.METHODS``."""

    model_cpu_offload_seq = "target"
    _optional_components = ["draft_model", "eagle_head", "specvlm_head", "vispec_head"]

    def __init__(self, target, processor, draft_model=None, eagle_head=None, specvlm_head=None, vispec_head=None):
        super().__init__()
        self.register_modules(target=target, processor=processor, draft_model=draft_model, eagle_head=eagle_head,
                              specvlm_head=specvlm_head, vispec_head=vispec_head)
        self._views = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader, computing in float32 by default (checkpoints ship as fp16), after
        ``check_pipeline_folder`` has checked every component folder (nothing is built before)."""
        from .loading import check_pipeline_folder

        check_pipeline_folder(pretrained_model_name_or_path, cls, provided=kwargs)
        kwargs.setdefault("dtype", torch.float32)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def views(self) -> tuple[VLMTarget, VLMTarget | None]:
        """The core's views of the target and the draft VLM (built once)."""
        if self._views is None or self._views[0].model is not self.target:
            draft = None if self.draft_model is None else VLMTarget(self.draft_model)
            self._views = (VLMTarget(self.target), draft)
        return self._views

    def prepare_inputs(self, images, prompts) -> tuple[list[list[int]], torch.Tensor]:
        """Per prompt its token ids (the chat frame around the question, ``<image>`` expanded)
        and the stacked pixel values."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        check(len(prompts) > 0 and all(isinstance(p, str) and p.strip() for p in prompts), "prompts",
              "a non-empty question string or a non-empty list of them", prompts)
        check(images is not None, "images", f"one image per prompt ({len(prompts)})", None)
        images = [images] if not isinstance(images, (list, tuple)) else list(images)
        check(len(images) == len(prompts), "images", f"one image per prompt ({len(prompts)})", len(images))
        ids, pixels = [], []
        for image, prompt in zip(images, prompts):
            enc = self.processor(images=[_as_pil(image)], text=[prompt_text(" ".join(prompt.lower().split()))],
                                 return_tensors="pt")
            ids.append(enc["input_ids"][0].tolist())
            pixels.append(enc["pixel_values"])
        return ids, torch.cat(pixels)

    def check_inputs(self, images, prompts, *, method, method_knobs, max_new_tokens, temperature, top_p, generator,
                     callback, return_dict, show_progress) -> None:
        """Every argument of ``__call__``, checked before any model runs (``pipelines.checks``):
        ``ValueError`` naming the argument and the allowed values."""
        check_choice("method", method, METHODS)
        checks.check_method("vlm", method, method_knobs)
        if method == "sd":
            check(self.draft_model is not None, "method", "a method whose draft this pipeline holds (no draft_model)", method)
        if method in HEAD_METHODS:
            check(getattr(self, f"{method}_head") is not None, "method",
                  f"a method whose draft this pipeline holds (no {method}_head)", method)
        prompts = checks.check_prompts(prompts, "prompts")
        checks.check_images(images, len(prompts), "images")
        checks.check_int(max_new_tokens, "max_new_tokens", 1)
        checks.check_sampling(temperature, top_p=top_p)
        checks.check_generator(generator)
        checks.check_callback(callback, "callback")
        checks.check_flag(return_dict, "return_dict")
        checks.check_flag(show_progress, "show_progress")

    @torch.no_grad()
    def __call__(self, images=None, prompts: str | list[str] | None = None, *, max_new_tokens: int = 128,
                 method: str = "none", temperature: float = 0.0, top_p: float | None = None,
                 generator: torch.Generator | None = None, method_knobs: dict | None = None,
                 callback: Callable | None = None, return_dict: bool = True, show_progress: bool = True):
        """Answer each prompt about its image.

        Args:
            images: one image per prompt (PIL, (H, W, 3) array or (3, H, W) tensor in [0, 1]).
            prompts: questions, e.g. ``"describe the image in detail ."``; the pipeline adds the
                chat frame (``user : <image> QUESTION assistant :``).
            max_new_tokens: the answer's length limit; a row stops at ``</s>``.
            method: ``"none"``, ``"sd"``, ``"lookup"``, ``"eagle"``, ``"specvlm"`` or ``"vispec"``.
                Every method is lossless: greedy answers equal ``method="none"``'s, sampled
                answers follow the same distribution.
            temperature: 0 is greedy (the default, as transformers' ``generate``); > 0 samples.
            top_p: nucleus sampling (with ``temperature`` > 0).
            generator: the randomness of sampling (and of nothing else).
            method_knobs: e.g. ``{"tree_depth": 5}`` (``mmspec.adapters.vlm_methods.method_knobs``).
            callback: ``callback(pipe, step, tokens_done: int)`` after every target pass.
        Returns:
            ``VLMPipelineOutput`` (or ``(texts, stats)`` when ``return_dict=False``).
        """
        self.check_inputs(images, prompts, method=method, method_knobs=method_knobs, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, generator=generator, callback=callback,
                          return_dict=return_dict, show_progress=show_progress)
        ids, pixels = self.prepare_inputs(images, prompts)

        target, draft = self.views()
        heads = {m: getattr(self, f"{m}_head") for m in HEAD_METHODS}
        drafter = build_drafter(method, target, draft=draft, heads=heads, knobs=method_knobs)
        decoder = SpeculativeDecoder(target, drafter, logits=LogitsPipeline(temperature=temperature, top_p=top_p))
        progress = self.progress_bar(total=max_new_tokens) if show_progress else None
        seen = [0]

        def on_step(step, state):
            B = state.batch_size
            done = int((state.lengths[:B] - state.prompt_lengths[:B]).max())
            if progress is not None:
                progress.update(max(0, min(done, max_new_tokens) - seen[0]))
                seen[0] = max(seen[0], min(done, max_new_tokens))
            if callback is not None:
                callback(self, step, done)

        eos = self.processor.tokenizer.eos_token_id
        out = decoder.generate(ids, max_new_tokens, generator=generator, eos_token_id=eos,
                               conditioning=target.vision_inputs(pixels),
                               callback=on_step if progress is not None or callback is not None else None)
        if progress is not None:
            progress.close()
        tokens = [row[:n].tolist() for row, n in zip(out.sequences, out.lengths)]
        texts = self.processor.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        stats = out.stats.as_dict()
        if not return_dict:
            return texts, stats
        return VLMPipelineOutput(texts=texts, tokens=tokens, stats=stats)
