"""``SpeculativeARImagePipeline``: class- or prompt-conditioned AR image generation over VQ tokens,
with the acceleration method as an argument (diffusers conventions).

::

    pipe = SpeculativeARImagePipeline.from_pretrained("assets/ar-image")
    out = pipe(prompt="a red circle", method="zipar+gsd", guidance_scale=2.0,
               generator=torch.Generator().manual_seed(0))
    out.images[0].save("red_circle.png"); print(out.stats["nfe"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from diffusers.utils import BaseOutput

from ..core import Job, LogitsProcessor
from ..core.errors import check
from . import checks
from .base import SpeculativePipeline
from .labels import ClassLabelsMixin
# diffusers loads components only from modules already imported: name them here
from ..models import eagle as _eagle, llamagen as _llamagen, llamagen_vq as _llamagen_vq, vq as _vq  # noqa: F401

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclass
class ARImagePipelineOutput(BaseOutput):
    """``images``: PIL images, an (N, H, W, 3) float array in [0, 1], an (N, 3, H, W) tensor in
    [0, 1], or (``output_type="latent"``) the (N, h, w) token grids. ``tokens``: the token grids
    (always). ``stats``: the decode's counters (``Stats.as_dict``: nfe, draft_nfe, tau, ...)."""

    images: list | np.ndarray | torch.Tensor
    tokens: torch.Tensor
    stats: dict = field(default_factory=dict)


class SpeculativeARImagePipeline(ClassLabelsMixin, SpeculativePipeline):
    """A LlamaGen-style AR transformer over a VQ tokenizer's grid, plus optional drafters.

    Components: ``transformer`` (``LlamaGenModel``), ``vqvae`` (``TinyVQModel``, or LlamaGen's own
    tokenizer as ``LlamaGenVQModel``), and optionally the method components the registry declares
    (``mmspec.methods.components("ar-image")``): ``draft_model`` (a small ``LlamaGenModel``, for
    ``sd``), ``eagle_head`` (``EagleDraftHead``, for ``eagle`` and ``lantern``), ``medusa_head``
    (``GridMedusaHeads``, for ``medusa``) and any a part registers later. Class names come from the transformer's
    config (``id2label``, as diffusers' DiT keeps them): ``pipe.labels``, ``pipe.get_label_ids``.
    """

    modality = "ar-image"
    # model offload chains the main flow only: the drafts and heads run between the target's passes
    # (chained, each would offload the target every pass), so they get unchained hooks instead of
    # _exclude_from_cpu_offload, which would keep every head on the device even when unused
    model_cpu_offload_seq = "transformer->vqvae"
    _method_components = {"target": "transformer", "codebook": "vqvae"}

    def __init__(self, transformer, vqvae, **components):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, **self.method_modules(components))
        self.bind_modules({"target": transformer})  # heads share the target's embedding and LM head

    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    def base_components(self, requires: tuple[str, ...]) -> dict:
        # the codebook only when used: reading it onloads the VQ, which would then sit on the device
        codebook = self.vqvae.codebook() if "codebook" in requires else None
        return {"target": self.transformer, "codebook": codebook}

    def check_inputs(self, prompt, class_labels, *, method, method_knobs, guidance_scale, temperature, top_k, top_p,
                     num_images_per_prompt, generator, output_type, return_dict, callback_on_step_end,
                     callback_on_step_end_tensor_inputs) -> tuple[list[int], object]:
        """Every argument of ``__call__``, checked before any model runs (``pipelines.checks``):
        ``ValueError`` naming the argument and the allowed values. Returns the class ids and the
        method's resolved recipe."""
        check((prompt is None) != (class_labels is None), "prompt", "exactly one of prompt and class_labels",
              {"prompt": prompt, "class_labels": class_labels})
        if prompt is not None:
            labels = self.get_label_ids(checks.check_prompts(prompt, "prompt"), name="prompt")
        else:
            labels = checks.check_class_labels(class_labels, self.num_classes)
        checks.check_int(num_images_per_prompt, "num_images_per_prompt", 1)
        checks.check_sampling(temperature, top_k, top_p, guidance_scale)
        checks.check_output_type(output_type, OUTPUT_TYPES)
        recipe = self.check_shared_inputs(method=method, method_knobs=method_knobs,
                                 batch_size=len(labels) * num_images_per_prompt, generator=generator,
                                 return_dict=return_dict, callback_on_step_end=callback_on_step_end,
                                 callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)
        return labels, recipe

    def serve(self, prompt: list[str] | None = None, class_labels: list[int] | None = None, *, slots: int,
              method: str = "none", guidance_scale: float | None = 2.0, temperature: float = 1.0,
              top_k: int | None = None, top_p: float | None = None,
              generator: list[torch.Generator] | None = None, method_knobs: dict | None = None):
        """Continuous batching (``SpeculativeDecoder.serve``): one image per prompt (or class
        label) in a batch of ``slots`` rows (with guidance each row is a ``[cond; uncond]`` pair,
        rows b and b + slots), a finished image's row refilled with the next prompt. Yields
        ``(served, grid)`` per image as it ends: the ``mmspec.core.Served`` job (its ``index``,
        ``tokens``, ``counts``) and its (h, w) token grid (decode it with ``vqvae``). Arguments as
        in ``__call__`` (``generator``: None or one per image); each grid equals ``__call__`` on
        its prompt alone with its generator (ZipAR's next-set schedule is refused: its lanes share
        an image's cache)."""
        checks.check_int(slots, "slots", 1)
        if method == "auto":  # chosen for the slots decoded at once, not the number of jobs
            method_knobs = {"auto_batch_size": slots, **(method_knobs or {})}
        labels, recipe = self.check_inputs(
            prompt, class_labels, method=method, method_knobs=method_knobs, guidance_scale=guidance_scale,
            temperature=temperature, top_k=top_k, top_p=top_p, num_images_per_prompt=1, generator=generator,
            output_type="latent", return_dict=True, callback_on_step_end=None, callback_on_step_end_tensor_inputs=())
        check(generator is None or isinstance(generator, (list, tuple)), "generator",
              "None or a list of one torch.Generator per image for continuous batching", type(generator).__name__)
        guided = guidance_scale is not None and guidance_scale != 1.0
        logits = LogitsProcessor(temperature=temperature, top_k=top_k, top_p=top_p,
                                guidance_scale=guidance_scale if guided else None)
        model = self.transformer
        uncond = model.uncond_prompts(1)[0] if guided else None
        jobs = [Job(ids, uncond_input_ids=uncond, generator=None if generator is None else generator[i])
                for i, ids in enumerate(model.class_prompts(labels))]
        g = model.config.grid_size
        for served in self.serve_tokens(recipe, logits, jobs, model.num_image_tokens, slots=slots):
            yield served, served.tokens.view(g, g)

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, class_labels: int | list[int] | None = None, *,
                 method: str = "none", guidance_scale: float | None = 2.0, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable | None = None,
                 callback_on_step_end_tensor_inputs: list[str] = (), method_knobs: dict | None = None):
        """Generate ``num_images_per_prompt`` images per prompt (or class label).

        Args:
            prompt: class names or prompts such as ``"a red circle"`` (``pipe.labels``; exclusive
                with ``class_labels``).
            class_labels: class ids in ``[0, num_classes)``.
            method: ``"none"`` (AR baseline), a named method or a composition such as ``"sjd"``,
                ``"gsd"``, ``"lantern"``, ``"zipar+gsd"`` (``mmspec.methods.names("ar-image")``).
            guidance_scale: classifier-free guidance ``l_u + s (l_c - l_u)``; ``None`` or 1 disables it.
            temperature, top_k, top_p: the sampling pipeline (temperature 0 is greedy).
            num_images_per_prompt: images per prompt; image ``i * n + j`` is prompt i's j-th.
            generator: one ``torch.Generator``, or a list of one per image: image r then equals
                that prompt generated alone with generator r.
            output_type: ``"pil"``, ``"np"``, ``"pt"`` (``VaeImageProcessor``) or ``"latent"``
                (the token grids).
            callback_on_step_end: ``callback(pipe, step, timestep, callback_kwargs) -> dict`` after
                every decode pass: ``step`` counts target passes from 0 (a pass commits a variable
                number of tokens per image), ``timestep`` is the tokens decoded so far per image.
                Setting ``pipe._guidance_scale`` changes the scale from the next pass on
                (diffusers' CFG cut-off; ``SpeculativePipeline.decode`` says how, and why a call
                started without guidance cannot switch it on); ``pipe._interrupt = True`` stops
                after this pass.
            callback_on_step_end_tensor_inputs: among ``"tokens"`` (read-only: the target has read
                them, so returning them is refused) and ``"next_tokens"`` (each image's last token,
                not yet read by the target: a returned one replaces it, and decoding continues from
                it). Drafted tokens are never shown: each pass drafts anew from the (edited)
                history and verifies every draft.
            method_knobs: the method's prefixed knobs, e.g. ``{"sjd_window": 16}``
                (``mmspec.methods.knobs("ar-image", method)`` lists them).
        Returns:
            ``ARImagePipelineOutput``, or ``(images,)`` when ``return_dict=False``.
        """
        # 1. check every input before any model runs
        labels, recipe = self.check_inputs(
            prompt, class_labels, method=method, method_knobs=method_knobs, guidance_scale=guidance_scale,
            temperature=temperature, top_k=top_k, top_p=top_p, num_images_per_prompt=num_images_per_prompt,
            generator=generator, output_type=output_type, return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)

        # 2. the conditioning: one class-token prompt per image (and the null class for CFG)
        labels = [c for c in labels for _ in range(num_images_per_prompt)]
        guided = guidance_scale is not None and guidance_scale != 1.0
        logits = LogitsProcessor(temperature=temperature, top_k=top_k, top_p=top_p,
                                guidance_scale=guidance_scale if guided else None)
        N = self.transformer.num_image_tokens

        def tokens_done(state) -> int:
            # images, or ZipAR's row lanes: a lane's seed counts as one token
            return sum(max(0, n) for n in state.generated) // len(labels)

        # 3. decode the token grids: one SpeculativeDecoder.generate
        out = self.decode(recipe, logits, self.transformer.class_prompts(labels), N, tokens_done=tokens_done,
                          callback_on_step_end=callback_on_step_end,
                          callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                          guidance_scale=guidance_scale, generator=generator,
                          uncond_input_ids=self.transformer.uncond_prompts(len(labels)) if guided else None)

        # 4. tokens -> pixels -> output_type
        g = self.transformer.config.grid_size
        tokens = out.sequences.view(-1, g, g)
        images = tokens if output_type == "latent" else self.postprocess_images(self.vqvae.decode(tokens), output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ARImagePipelineOutput(images=images, tokens=tokens, stats=out.stats.as_dict())
