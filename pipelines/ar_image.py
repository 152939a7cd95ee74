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
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

from ..adapters.ar_image import compose, parse_method
from ..core import LogitsPipeline, SpeculativeDecoder
from ..core.errors import check
from . import checks
# diffusers loads components only from modules already imported: name them here
from ..models import eagle as _eagle, llamagen as _llamagen, vq as _vq  # noqa: F401
from ..training.data.shapes import CLASS_NAMES, CLASS_PROMPTS

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclass
class ARImagePipelineOutput(BaseOutput):
    """``images``: PIL images, an (N, H, W, 3) float array in [0, 1], an (N, 3, H, W) tensor in
    [0, 1], or (``output_type="latent"``) the (N, h, w) token grids. ``tokens``: the token grids
    (always). ``stats``: the decode's counters (``Stats.as_dict``: nfe, draft_nfe, tau, ...)."""

    images: list | np.ndarray | torch.Tensor
    tokens: torch.Tensor
    stats: dict = field(default_factory=dict)


def labels_from_prompts(prompt) -> list[int]:
    """Map prompts to class ids: the dataset's class prompts ("a red circle") or names
    ("red circle"), case- and whitespace-insensitive."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    table = {p: i for i, p in enumerate(CLASS_PROMPTS)} | {n: i for i, n in enumerate(CLASS_NAMES)}
    out = []
    for p in prompts:
        key = " ".join(str(p).lower().split())
        check(key in table, "prompt", f"one of the class prompts: {', '.join(CLASS_PROMPTS)}", p)
        out.append(table[key])
    return out


class SpeculativeARImagePipeline(DiffusionPipeline):
    """A LlamaGen-style AR transformer over a VQ tokenizer's grid, plus optional drafters.

    Components: ``transformer`` (``LlamaGenModel``), ``vqvae`` (``TinyVQModel``), and optionally
    ``draft_model`` (a small ``LlamaGenModel``, for ``sd``) and ``eagle_head``
    (``EagleDraftHead``, for ``eagle`` and ``lantern``).
    """

    model_cpu_offload_seq = "transformer->vqvae"
    _optional_components = ["draft_model", "eagle_head"]

    def __init__(self, transformer, vqvae, draft_model=None, eagle_head=None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, draft_model=draft_model, eagle_head=eagle_head)
        if eagle_head is not None:
            eagle_head.bind(transformer)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader, computing in float32 by default (checkpoints ship as fp16), after
        ``check_pipeline_folder`` has checked every component folder (nothing is built before)."""
        from .loading import check_pipeline_folder

        check_pipeline_folder(pretrained_model_name_or_path, cls, provided=kwargs)
        kwargs.setdefault("dtype", torch.float32)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    def check_inputs(self, prompt, class_labels, *, method, method_knobs, guidance_scale, temperature, top_k, top_p,
                     num_images_per_prompt, generator, output_type, return_dict, callback_on_step_end,
                     show_progress) -> None:
        """Every argument of ``__call__``, checked before any model runs (``pipelines.checks``):
        ``ValueError`` naming the argument and the allowed values."""
        check((prompt is None) != (class_labels is None), "prompt", "exactly one of prompt and class_labels",
              {"prompt": prompt, "class_labels": class_labels})
        if prompt is not None:
            labels_from_prompts(checks.check_prompts(prompt, "prompt"))
        else:
            checks.check_class_labels(class_labels, self.num_classes)
        checks.check_int(num_images_per_prompt, "num_images_per_prompt", 1)
        checks.check_sampling(temperature, top_k, top_p, guidance_scale)
        checks.check_generator(generator)
        checks.check_output_type(output_type, OUTPUT_TYPES)
        checks.check_flag(return_dict, "return_dict")
        checks.check_flag(show_progress, "show_progress")
        checks.check_callback(callback_on_step_end, "callback_on_step_end")
        recipe = checks.check_method("ar-image", method, method_knobs)
        for need in recipe.requires:
            check(need not in ("draft_model", "eagle_head") or getattr(self, need) is not None, "method",
                  f"a method whose parts this pipeline holds (it has no {need})", method)

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, class_labels: int | list[int] | None = None, *,
                 method: str = "none", guidance_scale: float | None = 2.0, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, num_images_per_prompt: int = 1,
                 generator: torch.Generator | None = None, output_type: str = "pil", return_dict: bool = True,
                 callback_on_step_end: Callable | None = None, method_knobs: dict | None = None,
                 show_progress: bool = True):
        """Generate ``num_images_per_prompt`` images per prompt (or class label).

        Args:
            prompt: class prompts such as ``"a red circle"`` (exclusive with ``class_labels``).
            class_labels: class ids in ``[0, num_classes)``.
            method: ``"none"`` (AR baseline) or a composition such as ``"sjd"``, ``"gsd"``,
                ``"lantern"``, ``"zipar+gsd"`` (``mmspec.adapters.ar_image``).
            guidance_scale: classifier-free guidance ``l_u + s (l_c - l_u)``; ``None`` or 1 disables it.
            temperature, top_k, top_p: the sampling pipeline (temperature 0 is greedy).
            method_knobs: the method's prefixed knobs, e.g. ``{"sjd_window": 16}``
                (``mmspec.adapters.ar_image.method_knobs(method)`` lists them).
            callback_on_step_end: ``callback(pipe, step, None, {"tokens_done": int}) -> dict``,
                called after every decode pass.
        Returns:
            ``ARImagePipelineOutput`` (or a tuple ``(images, stats)`` when ``return_dict=False``).
        """
        self.check_inputs(prompt, class_labels, method=method, method_knobs=method_knobs,
                          guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p,
                          num_images_per_prompt=num_images_per_prompt, generator=generator, output_type=output_type,
                          return_dict=return_dict, callback_on_step_end=callback_on_step_end,
                          show_progress=show_progress)
        labels = labels_from_prompts(prompt) if prompt is not None else checks.check_class_labels(
            class_labels, self.num_classes)
        guided = guidance_scale is not None and guidance_scale != 1.0
        logits = LogitsPipeline(temperature=temperature, top_k=top_k, top_p=top_p,
                                guidance_scale=guidance_scale if guided else None)
        parsed = parse_method(method, **(method_knobs or {}))
        parts = compose(parsed, self.transformer, draft_model=self.draft_model, eagle_head=self.eagle_head,
                        codebook=self.vqvae.codebook())
        decoder = SpeculativeDecoder(self.transformer, parts.drafter, rule=parts.rule, logits=logits,
                                     schedule=parts.schedule)

        labels = [c for c in labels for _ in range(num_images_per_prompt)]
        N = self.transformer.num_image_tokens
        progress = self.progress_bar(total=N) if show_progress else None
        seen = [0]

        def on_step(step, state):
            B = state.batch_size  # rows or ZipAR's row lanes; a lane's seed counts as one token
            made = (state.lengths[:B] - state.prompt_lengths[:B]).clamp(min=0).sum()
            done = min(N, int(made) // len(labels))
            if progress is not None:
                progress.update(max(0, done - seen[0]))
                seen[0] = max(seen[0], done)
            if callback_on_step_end is not None:
                callback_on_step_end(self, step, None, {"tokens_done": done})

        out = decoder.generate(self.transformer.class_prompts(labels), N, generator=generator,
                               callback=on_step if progress is not None or callback_on_step_end is not None else None,
                               uncond_input_ids=self.transformer.uncond_prompts(len(labels)) if guided else None)
        if progress is not None:
            progress.update(N - seen[0])
            progress.close()
        g = self.transformer.config.grid_size
        tokens = out.sequences.view(-1, g, g)
        stats = out.stats.as_dict()
        if output_type == "latent":
            images = tokens
        else:
            pixels = ((self.vqvae.decode(tokens).float().clamp(-1, 1) + 1) / 2)  # (N, 3, H, W) in [0, 1]
            if output_type == "pt":
                images = pixels
            else:
                arr = pixels.permute(0, 2, 3, 1).cpu().numpy()
                images = arr if output_type == "np" else [PIL.Image.fromarray((a * 255).round().astype(np.uint8))
                                                          for a in arr]
        if not return_dict:
            return images, stats
        return ARImagePipelineOutput(images=images, tokens=tokens, stats=stats)
