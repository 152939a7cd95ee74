"""``SpeculativeVLMPipeline``: lossless speculative decoding for a LLaVA, Qwen2-VL or Qwen2.5-VL
VLM, with the acceleration method as an argument (diffusers conventions). The processor's chat
template frames the questions and the target's generation config gives the sampling defaults
(``pipelines/vlm_inputs.py``).

::

    pipe = SpeculativeVLMPipeline.from_pretrained("assets/vlm")
    out = pipe(images=[PIL.Image.open("scene.png")], prompts=["describe the image in detail ."],
               method="vispec", max_new_tokens=128)
    print(out.texts[0], out.stats["tau"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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
from .vlm_inputs import StreamerFeed, VLMInputs, check_streamer, prepare_vlm_inputs, sampling_from_generation_config


@dataclass
class VLMPipelineOutput(BaseOutput):
    """``texts``: the answers (special tokens dropped); ``tokens``: the generated ids per prompt
    (EOS included when emitted); ``stats``: the decode's counters (``Stats.as_dict``: nfe, tau,
    draft_nfe, wall_seconds, ...)."""

    texts: list[str]
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)


class SpeculativeVLMPipeline(DiffusionPipeline):
    """A VLM (``target``: ``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration`` or
    ``Qwen2_5_VLForConditionalGeneration``; ``processor``: its processor, with a chat template)
    plus optional drafts: ``draft_model`` (a small VLM with the same
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

    def prepare_inputs(self, images, prompts) -> VLMInputs:
        """``(input_ids, vision)``: per prompt its token ids (the processor's chat template around
        the question, image placeholders expanded) and the images as ``VLMTarget.vision_inputs``
        takes them (``pixel_values``, and ``image_grid_thw`` for Qwen2-VL / Qwen2.5-VL)."""
        return prepare_vlm_inputs(self.processor, images, prompts)

    def check_inputs(self, images, prompts, *, method, method_knobs, max_new_tokens, temperature, top_p, generator,
                     callback, return_dict, show_progress, top_k=None, streamer=None) -> None:
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
        checks.check_number(temperature, "temperature", 0, optional=True)  # None: the generation config's
        checks.check_int(top_k, "top_k", 1, optional=True)
        checks.check_number(top_p, "top_p", 0, 1, low_open=True, optional=True)
        check_streamer(streamer, len(prompts))
        checks.check_generator(generator)
        checks.check_callback(callback, "callback")
        checks.check_flag(return_dict, "return_dict")
        checks.check_flag(show_progress, "show_progress")

    @torch.no_grad()
    def __call__(self, images=None, prompts: str | list[str] | None = None, *, max_new_tokens: int = 128,
                 method: str = "none", temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, generator: torch.Generator | None = None, method_knobs: dict | None = None,
                 callback: Callable | None = None, streamer=None, return_dict: bool = True,
                 show_progress: bool = True):
        """Answer each prompt about its image.

        Args:
            images: one image per prompt (PIL, (H, W, 3) array or (3, H, W) tensor in [0, 1]).
            prompts: questions, e.g. ``"describe the image in detail ."``; the processor's chat
                template frames each (``[{"role": "user", "content": [image, question]}]``).
            max_new_tokens: the answer's length limit; a row stops at an EOS id of the target's
                ``generation_config`` (an int or a list).
            method: ``"none"``, ``"sd"``, ``"lookup"``, ``"eagle"``, ``"specvlm"`` or ``"vispec"``.
                Every method is lossless: greedy answers equal ``method="none"``'s, sampled
                answers follow the same distribution.
            temperature: 0 is greedy, > 0 samples; ``None``: from the target's
                ``generation_config`` (greedy unless it sets ``do_sample``), as are ``top_k`` and
                ``top_p`` (``vlm_inputs.sampling_from_generation_config``). Given values win.
            top_p: nucleus sampling (with ``temperature`` > 0).
            top_k: keep the k most likely tokens (with ``temperature`` > 0).
            generator: the randomness of sampling (and of nothing else).
            method_knobs: e.g. ``{"tree_depth": 5}`` (``mmspec.adapters.vlm_methods.method_knobs``).
            callback: ``callback(pipe, step, tokens_done: int)`` after every target pass.
            streamer: a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``) fed the
                prompt, then the answer's tokens as they are accepted; one prompt only.
        Returns:
            ``VLMPipelineOutput`` (or ``(texts, stats)`` when ``return_dict=False``).
        """
        self.check_inputs(images, prompts, method=method, method_knobs=method_knobs, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, generator=generator, callback=callback,
                          return_dict=return_dict, show_progress=show_progress, top_k=top_k, streamer=streamer)
        ids, vision = self.prepare_inputs(images, prompts)
        sampling = sampling_from_generation_config(self.target.generation_config, temperature, top_k, top_p)
        eos = sampling.pop("eos_token_id")

        target, draft = self.views()
        heads = {m: getattr(self, f"{m}_head") for m in HEAD_METHODS}
        drafter = build_drafter(method, target, draft=draft, heads=heads, knobs=method_knobs)
        decoder = SpeculativeDecoder(target, drafter, logits=LogitsPipeline(**sampling))
        feed = None if streamer is None else StreamerFeed(streamer, ids[0], max_new_tokens, eos)
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
            if feed is not None:
                feed.step(state)

        out = decoder.generate(ids, max_new_tokens, generator=generator, eos_token_id=eos,
                               conditioning=target.vision_inputs(**vision),
                               callback=None if progress is None and callback is None and feed is None else on_step)
        if progress is not None:
            progress.close()
        tokens = [row[:n].tolist() for row, n in zip(out.sequences, out.lengths)]
        if feed is not None:
            feed.end(tokens[0])
        texts = self.processor.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        stats = out.stats.as_dict()
        if not return_dict:
            return texts, stats
        return VLMPipelineOutput(texts=texts, tokens=tokens, stats=stats)
