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
from diffusers.utils import BaseOutput

from ..adapters.vlm import VLMTarget
from ..core import Job, LogitsProcessor
from ..core.errors import check
from ..methods import auto
from . import checks
from .base import SpeculativePipeline
# diffusers loads components only from modules already imported: name them here
from ..models import medusa as _medusa  # noqa: F401
from ..models import vlm_draft as _vlm_draft  # noqa: F401
from .vlm_inputs import (StreamerFeed, VLMInputs, check_streamer, media_per_prompt, prepare_vlm_inputs,
                         sampling_from_generation_config)


@dataclass
class VLMPipelineOutput(BaseOutput):
    """``texts``: the answers (special tokens dropped); ``tokens``: the generated ids per prompt
    (EOS included when emitted); ``stats``: the decode's counters (``Stats.as_dict``: nfe, tau,
    draft_nfe, wall_seconds, ...)."""

    texts: list[str]
    tokens: list[list[int]]
    stats: dict = field(default_factory=dict)


class SpeculativeVLMPipeline(SpeculativePipeline):
    """A VLM (``target``: ``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration`` or
    ``Qwen2_5_VLForConditionalGeneration``; ``processor``: its processor, with a chat template)
    plus optional drafts, the method components of ``mmspec.methods.components("vlm")``:
    ``draft_model`` (a small VLM with the same tokenizer, for ``sd``), ``eagle_head`` /
    ``specvlm_head`` / ``vispec_head`` (``VLMDraftHead``s) and ``medusa_head`` (``MedusaHeads``). Methods: ``mmspec.methods.names("vlm")``."""

    modality = "vlm"
    # the target alone: the draft VLM and the heads run between its passes and get unchained hooks
    # (SpeculativeARImagePipeline says why); the answers' decode is the processor's, no model
    model_cpu_offload_seq = "target"

    def __init__(self, target, processor, **components):
        super().__init__()
        self.register_modules(target=target, processor=processor, **self.method_modules(components))
        self._views = None
        self.draft_adaptation = None

    def enable_draft_adaptation(self, lr: float = 1e-4, every: int = 8, rollout_steps: int = 1):
        """Opt in to online adaptation (``mmspec.pipelines.draft_adaptation``, Online Speculative Decoding):
        after each call with a head method (``eagle``, ``specvlm``, ``vispec``, ``medusa``), its
        answers join a buffer and every ``every`` answers the head takes one AdamW step (``lr``)
        of its distillation loss on them. The answers stay exactly the target's; only how many
        tokens each pass accepts changes. The head must be float32. ``pipe.draft_adaptation``
        holds the counters (``updates``, ``losses``, ``served``). Returns it."""
        from .draft_adaptation import DraftAdaptation

        self.draft_adaptation = DraftAdaptation(lr=lr, every=every, rollout_steps=rollout_steps)
        return self.draft_adaptation

    def disable_draft_adaptation(self) -> None:
        """Stop adapting (the head keeps what it learned); an unfinished buffer is dropped."""
        self.draft_adaptation = None

    def _adapt(self, recipe, ids: list[list[int]], vision: dict, tokens: list[list[int]]) -> None:
        """Give the served answers to the adaptation, if on and the method drafts with a head."""
        images = vision.get("image_grid_thw", vision.get("pixel_values"))
        if self.draft_adaptation is None or "video_grid_thw" in vision or len(images) != len(ids):
            return  # calls with videos, or with several images for a prompt: not adapted on
        # the method's trained head, if it drafts with one (the sd draft VLM and lookup have none)
        heads = [getattr(self, c) for c in recipe.requires if hasattr(getattr(self, c, None), "distill_loss")]
        if not heads:
            return
        from ..models.vlm_distill import Rendered

        grids = vision.get("image_grid_thw")
        if grids is not None:  # Qwen2-VL / Qwen2.5-VL: patches of every image, concatenated
            ends = grids.prod(-1).cumsum(0).tolist()
            starts = [0] + ends[:-1]
            rows = [{"pixel_values": vision["pixel_values"][a:b], "image_grid_thw": grids[i : i + 1]}
                    for i, (a, b) in enumerate(zip(starts, ends))]
        else:
            rows = [{"pixel_values": vision["pixel_values"][i : i + 1]} for i in range(len(ids))]
        items = [Rendered(p + t, [False] * len(p) + [True] * len(t), v, len(p))
                 for p, t, v in zip(ids, tokens, rows) if t]
        pad = self.processor.tokenizer.pad_token_id
        self.draft_adaptation.observe(heads[0], items, 0 if pad is None else pad)

    def views(self) -> tuple[VLMTarget, VLMTarget | None]:
        """The core's views of the target and the draft VLM (built once)."""
        if self._views is None or self._views[0].model is not self.target or (
                self._views[1] is not None and self._views[1].model is not self.draft_model):
            draft = None if self.draft_model is None else VLMTarget(self.draft_model)
            self._views = (VLMTarget(self.target), draft)
        return self._views

    def _step_modules(self):
        """The language models of the target and the draft VLM (their prompt passes run eagerly,
        ``_eager_for``: a prompt's shape is the call's) and the heads."""
        for name, module in super()._step_modules():
            if name in ("target", "draft_model"):
                yield f"{name}.language_model", module.model.language_model
            else:
                yield name, module

    def _eager_for(self, name: str, module):
        if name.endswith(".language_model"):  # the prompt pass (the adapter's ``cache.prompt_pass``)
            return lambda *args, cache=None, **kwargs: bool(getattr(cache, "prompt_pass", False))
        return super()._eager_for(name, module)

    def _cache_owners(self):
        """The core's views of the transformers models (``views``) and the heads."""
        return [view for view in self.views() if view is not None] + super()._cache_owners()

    def base_components(self, requires: tuple[str, ...]) -> dict:
        """The target's view and, for a recipe that needs it, the draft VLM's: the pipeline's own
        (``views``, one per model, so compiled steps pool their caches)."""
        target, draft = self.views()
        return {"target": target, **({"draft": draft} if "draft" in requires and draft is not None else {})}

    def stream(self, *, vision_window: int = 4, text_window: int = 4, text_sink: int = 32,
               text_sliding_window: int = 32, chunk_frames: int = 1, capacity: int | None = None):
        """A session answering questions about a live frame stream on one bounded cache
        (StreamingVLM's policy, ``mmspec.adapters.vlm_stream``): ``session.add_frames(frames)``
        starts a round with a chunk of frames, ``session.ask(question, method=...)`` answers
        about what the cache holds, speculatively. The windows count rounds; ``text_sink`` and
        ``text_sliding_window`` bound the previous text in tokens; ``capacity`` (cache slots)
        defaults to what the windows hold at ``chunk_frames`` 64 px LLaVA frames a round and
        answers up to 256 tokens (pass it for other frame sizes). LLaVA, Qwen2-VL and Qwen2.5-VL
        targets; frames are images."""
        from ..adapters.vlm_stream import StreamPolicy
        from .vlm_stream import VLMStreamSession

        checks.check_int(chunk_frames, "chunk_frames", 1)
        policy = StreamPolicy(vision_window, text_window, text_sink, text_sliding_window)
        return VLMStreamSession(self, policy, capacity, chunk_frames)

    def prepare_inputs(self, images, prompts, videos=None) -> VLMInputs:
        """``(input_ids, vision)``: per prompt its token ids (the processor's chat template around
        the question, image and video placeholders expanded) and the images and videos as
        ``VLMTarget.vision_inputs`` takes them (``pixel_values``, and ``image_grid_thw`` for Qwen2-VL /
        Qwen2.5-VL; ``pixel_values_videos``, ``video_grid_thw``, ...: ``vlm_inputs.VLMInputs``)."""
        return prepare_vlm_inputs(self.processor, images, prompts, videos)

    def check_inputs(self, images, prompts, *, method, method_knobs, max_new_tokens, temperature, top_p, generator,
                     return_dict, callback_on_step_end, callback_on_step_end_tensor_inputs, top_k=None,
                     streamer=None, videos=None):
        """Every argument of ``__call__``, checked before any model runs (``pipelines.checks``):
        ``ValueError`` naming the argument and the allowed values. Returns the resolved recipe
        (``method="auto"``: the chosen method's)."""
        if method == "auto":
            auto.check_auto_knobs(self.modality, method_knobs)
        else:
            self.check_method(method, method_knobs)
        prompts = checks.check_prompts(prompts, "prompts")
        if videos is None:
            checks.check_images(images, len(prompts), "images")
        else:
            check(self.views()[0].mrope, "videos", f"None for a {type(self.target).__name__} target (videos: "
                  "Qwen2-VL, Qwen2.5-VL)", "videos")
            media_per_prompt(images, videos, len(prompts))
        checks.check_int(max_new_tokens, "max_new_tokens", 1)
        checks.check_number(temperature, "temperature", 0, optional=True)  # None: the generation config's
        checks.check_int(top_k, "top_k", 1, optional=True)
        checks.check_number(top_p, "top_p", 0, 1, low_open=True, optional=True)
        check_streamer(streamer, len(prompts))
        return self.check_shared_inputs(method=method, method_knobs=method_knobs, batch_size=len(prompts),
                                        generator=generator, return_dict=return_dict,
                                        callback_on_step_end=callback_on_step_end,
                                        callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)

    def serve(self, images, prompts: list[str], *, slots: int, max_new_tokens: int = 128, method: str = "none",
              temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
              generator: list[torch.Generator] | None = None, method_knobs: dict | None = None, admit=None):
        """Continuous batching (``SpeculativeDecoder.serve``): answer each prompt about its image in
        a batch of ``slots`` rows, a finished answer's row refilled with the next prompt (its
        image prefilled alone). Yields ``(served, text)`` per prompt as its answer ends: the
        ``mmspec.core.Served`` job (its ``index``, ``tokens``, ``counts``) and the answer's text.
        Arguments as in ``__call__`` (``generator``: None or one per prompt; ``admit``: when the
        next prompt may enter, ``SpeculativeDecoder.serve``'s); each answer equals
        ``__call__`` on its prompt alone (greedy: the same tokens). LLaVA-family targets only
        (Qwen2-VL's M-RoPE offsets are refused at the first refill); draft adaptation does not
        see these answers."""
        checks.check_int(slots, "slots", 1)
        if method == "auto":  # chosen for the slots decoded at once, not the number of jobs
            method_knobs = {"auto_batch_size": slots, **(method_knobs or {})}
        recipe = self.check_inputs(
            images, prompts, method=method, method_knobs=method_knobs, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, generator=generator, return_dict=True, callback_on_step_end=None,
            callback_on_step_end_tensor_inputs=(), top_k=top_k)
        check(generator is None or isinstance(generator, (list, tuple)), "generator",
              "None or a list of one torch.Generator per prompt for continuous batching", type(generator).__name__)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not isinstance(images, (list, tuple)):
            images = [images]
        self.onload_models(recipe)
        target, _ = self.views()
        jobs = []
        for i, (image, prompt) in enumerate(zip(images, prompts)):
            ids, vision = self.prepare_inputs([image], [prompt])  # each job's own prompt pass inputs
            jobs.append(Job(ids[0], conditioning=target.vision_inputs(**vision),
                            generator=None if generator is None else generator[i]))
        sampling = sampling_from_generation_config(self.target.generation_config, temperature, top_k, top_p)
        eos = sampling.pop("eos_token_id")
        for served in self.serve_tokens(recipe, LogitsProcessor(**sampling), jobs, max_new_tokens, slots=slots,
                                        eos_token_id=eos, admit=admit):
            yield served, self.processor.tokenizer.decode(served.tokens.tolist(), skip_special_tokens=True)

    @torch.no_grad()
    def __call__(self, images=None, prompts: str | list[str] | None = None, *, videos=None, max_new_tokens: int = 128,
                 method: str = "none", temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, generator: torch.Generator | list[torch.Generator] | None = None,
                 method_knobs: dict | None = None, callback_on_step_end: Callable | None = None,
                 callback_on_step_end_tensor_inputs: list[str] = (), streamer=None, return_dict: bool = True):
        """Answer each prompt about its image and / or video.

        Args:
            images: one image per prompt (PIL, (H, W, 3) array or (3, H, W) tensor in [0, 1]), or
                for a prompt with several images a list of them (``[[a, b], c]``: the template
                writes one image part each, in order, before the question); with ``videos``,
                ``None`` or a list of one image (or list) or ``None`` per prompt.
            prompts: questions, e.g. ``"describe the image in detail ."``; the processor's chat
                template frames each (``[{"role": "user", "content": [image, question]}]``).
            videos: Qwen2-VL / Qwen2.5-VL targets only: a list of one video or ``None`` per prompt
                (each prompt has an image or a video), a video being a list of PIL frames or a
                (T, H, W, 3) / (T, 3, H, W) uint8 array or tensor (``vlm_inputs.as_video``); the
                template frames it as ``{"type": "video"}``, after the image if there is one.
                Calls with videos or several images for a prompt are not adapted on
                (``enable_draft_adaptation``).
            max_new_tokens: the answer's length limit; a row stops at an EOS id of the target's
                ``generation_config`` (an int or a list).
            method: ``"none"``, ``"sd"``, ``"lookup"``, ``"eagle"``, ``"specvlm"``, ``"vispec"`` or
                ``"medusa"``.
                Every method is lossless: greedy answers equal ``method="none"``'s, sampled
                answers follow the same distribution.
            temperature: 0 is greedy, > 0 samples; ``None``: from the target's
                ``generation_config`` (greedy unless it sets ``do_sample``), as are ``top_k`` and
                ``top_p`` (``vlm_inputs.sampling_from_generation_config``). Given values win.
            top_p: nucleus sampling (with ``temperature`` > 0).
            top_k: keep the k most likely tokens (with ``temperature`` > 0).
            generator: the randomness of sampling (and of nothing else): one ``torch.Generator``,
                or a list of one per prompt (answer r then equals prompt r answered alone with
                generator r).
            method_knobs: e.g. ``{"tree_depth": 5}`` (``mmspec.methods.knobs("vlm", method)``).
            callback_on_step_end: ``callback(pipe, step, timestep, callback_kwargs) -> dict`` after
                every target pass; ``timestep`` is the longest answer's length so far
                (``pipelines.base`` says what the returned dict may replace; ``pipe._interrupt =
                True`` stops after this pass).
            callback_on_step_end_tensor_inputs: among ``"tokens"``, ``"next_tokens"``.
            streamer: a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``) fed the
                prompt, then the answer's tokens as they are accepted; one prompt only.
        Returns:
            ``VLMPipelineOutput``, or ``(texts,)`` when ``return_dict=False``.
        """
        # 1. check every input before any model runs
        recipe = self.check_inputs(
            images, prompts, method=method, method_knobs=method_knobs, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, generator=generator, return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs, top_k=top_k, streamer=streamer,
            videos=videos)

        # 2. the conditioning: chat-framed prompt ids, the images and videos as the prefill's vision inputs
        ids, vision = self.prepare_inputs(images, prompts, videos)
        self.onload_models(recipe)  # vision_inputs puts the pixels on the target's device, in its dtype
        sampling = sampling_from_generation_config(self.target.generation_config, temperature, top_k, top_p)
        eos = sampling.pop("eos_token_id")
        target, _ = self.views()
        feed = None if streamer is None else StreamerFeed(streamer, ids[0], max_new_tokens, eos)

        def tokens_done(state) -> int:
            return max(state.generated)

        # 3. decode the answers: one SpeculativeDecoder.generate
        out = self.decode(recipe, LogitsProcessor(**sampling), ids, max_new_tokens, tokens_done=tokens_done,
                          callback_on_step_end=callback_on_step_end,
                          callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                          on_step=None if feed is None else feed.step, generator=generator, eos_token_id=eos,
                          conditioning=target.vision_inputs(**vision))

        # 4. ids -> texts
        tokens = [row[:n].tolist() for row, n in zip(out.sequences, out.lengths)]
        if feed is not None:
            feed.end(tokens[0])
        texts = self.processor.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        self._adapt(recipe, ids, vision, tokens)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (texts,)
        return VLMPipelineOutput(texts=texts, tokens=tokens, stats=out.stats.as_dict())
