"""``SpeculativeGlmImagePipeline``: diffusers' ``GlmImagePipeline`` with the AR prior's image tokens
drawn by mmspec's decoder; the glyph text encoder, the DiT, the VAE and the scheduler are diffusers'.

::

    pipe = SpeculativeGlmImagePipeline.from_pretrained(local_glm_image_folder)
    out = pipe("a red fox in snow", height=1024, width=1024, method="sjd",
               generator=torch.Generator().manual_seed(0))
    out.images[0].save("fox.png"); print(out.stats["nfe"])

Methods (``mmspec.methods`` names of the ``"ar-image"`` modality): ``none`` (the AR baseline),
``sjd`` and ``mcsjd`` (lossless), ``gsd`` and ``mcsjd+gsd`` (lossy, GSD's grouped test over the
prior's image-token embeddings). ZipAR is refused: text-to-image decodes two grids in sequence (the
small preview, then the target), and its next-set schedule covers one grid. Drafters that need a
trained model or head (``sd``, ``eagle``, ``medusa``, ``lantern``) are refused: none exists for
GLM-Image. Text-to-image only (no ``image``).

Sampling is the prior's ``generation_config`` (temperature, top-k, top-p), as diffusers'
``generate(do_sample=True)`` applies it; ``prior_temperature`` overrides the temperature (0 is
greedy). Randomness: diffusers seeds the prior from ``generator.initial_seed()``; so does this
pipeline, with a generator of its own (the global RNG and ``generator`` are left untouched, so the
latents draw what diffusers' draw). A list of generators gives prompt ``i`` the seed of image
``i * num_images_per_prompt``; one prior is drawn per prompt and shared by its images, as in
diffusers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from diffusers import GlmImagePipeline
from diffusers.pipelines.glm_image.pipeline_output import GlmImagePipelineOutput

from ..adapters.glm_image import GlmImagePriorTarget, prior_logits, prior_prompts
from .. import methods
from ..core import SpeculativeDecoder
from ..core.errors import check
from . import checks

MODALITY = "ar-image"


@dataclass
class GlmImageSpeculativeOutput(GlmImagePipelineOutput):
    """diffusers' output plus ``stats``: the prior decode's counters (``Stats.as_dict``)."""

    stats: dict = field(default_factory=dict)


class SpeculativeGlmImagePipeline(GlmImagePipeline):
    """``GlmImagePipeline`` whose ``generate_prior_tokens`` runs ``SpeculativeDecoder`` over
    ``GlmImagePriorTarget``; ``__call__`` takes diffusers' arguments plus ``method``,
    ``method_knobs`` and ``prior_temperature``."""

    _prior_call: dict | None = None

    @torch.no_grad()
    def __call__(self, prompt=None, *args, method: str = "none", method_knobs: dict | None = None,
                 prior_temperature: float | None = None, **kwargs):
        """diffusers' ``GlmImagePipeline.__call__``; the prior's tokens come from ``method``.

        Args:
            method: ``"none"``, ``"sjd"``, ``"mcsjd"``, ``"gsd"`` or ``"mcsjd+gsd"``.
            method_knobs: the method's prefixed knobs, e.g. ``{"sjd_window": 16}``.
            prior_temperature: the prior's temperature instead of its generation config's (0: greedy).
        Returns:
            ``GlmImageSpeculativeOutput`` (``images``, ``stats``), or diffusers' tuple when
            ``return_dict=False``.
        """
        recipe = check_method(method, method_knobs)
        check(prior_temperature is None or (isinstance(prior_temperature, (int, float))
                                            and not isinstance(prior_temperature, bool) and prior_temperature >= 0),
              "prior_temperature", "None or a number >= 0", prior_temperature)
        n = kwargs.get("num_images_per_prompt", 1)
        checks.check_int(n, "num_images_per_prompt", 1)
        generator = kwargs.get("generator")
        if prompt is not None and kwargs.get("prior_token_ids") is None:
            checks.check_generator(generator, (1 if isinstance(prompt, str) else len(prompt)) * n)
        check(kwargs.get("image") is None, "image", "None: the speculative prior decodes text-to-image only",
              "source images")
        gens = generator[::n] if isinstance(generator, (list, tuple)) else generator
        self._prior_call = {"recipe": recipe, "temperature": prior_temperature, "generator": gens, "stats": {}}
        try:
            out = super().__call__(prompt, *args, **kwargs)
            stats = self._prior_call["stats"]
        finally:
            self._prior_call = None
        if not kwargs.get("return_dict", True):
            return out
        return GlmImageSpeculativeOutput(images=out.images, stats=stats)

    def generate_prior_tokens(self, prompt, height, width, image=None, device=None, generator=None):
        """diffusers' text-to-image prior step with mmspec's decoder: the same prompt inputs,
        ``max_new_tokens``, token extraction and 2x upsampling. Outside ``__call__`` it decodes
        with ``method="none"``."""
        check(image is None, "image", "None: the speculative prior decodes text-to-image only", "source images")
        call = self._prior_call or {"recipe": check_method("none", None), "temperature": None,
                                    "generator": generator, "stats": {}}
        device = device or self._execution_device
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        messages = [[{"role": "user", "content": [{"type": "text", "text": p}]}] for p in prompts]
        inputs = self.processor.apply_chat_template(messages, tokenize=True, padding=len(prompts) > 1,
                                                    target_h=height, target_w=width, return_dict=True,
                                                    return_tensors="pt").to(device)
        grids = inputs["image_grid_thw"]
        per_sample = int(inputs["images_per_sample"][0]) if inputs.get("images_per_sample") is not None \
            else grids.shape[0]
        max_new_tokens, offset, token_h, token_w = self._compute_generation_params(grids[:per_sample], True)

        model = self.vision_language_encoder
        target = GlmImagePriorTarget(model)
        logits = prior_logits(model)
        if call["temperature"] is not None:
            logits = dataclasses.replace(logits, temperature=float(call["temperature"]))
        parts = methods.build(call["recipe"], {"target": target})  # no schedule: check_method refuses zipar
        decoder = SpeculativeDecoder(target, parts.drafter, rule=parts.rule, processor=logits, device=device)
        rows, conditioning = prior_prompts(inputs)
        out = decoder.generate(rows, max_new_tokens, conditioning=conditioning,
                               generator=_prior_generators(call["generator"], device),
                               eos_token_id=model.generation_config.eos_token_id,
                               pad_token_id=model.generation_config.pad_token_id or 0)
        call["stats"] = out.stats.as_dict()
        large = out.sequences[:, offset: offset + token_h * token_w]  # (B, h * w)
        check(large.shape[1] == token_h * token_w and bool((out.lengths >= offset + token_h * token_w).all()),
              "the prior", f"{offset + token_h * token_w} image tokens before its end token",
              out.lengths.tolist())
        prior = torch.cat([self._upsample_token_ids(row, token_h, token_w) for row in large])
        return prior, None, None


def check_method(method, method_knobs):
    """``method`` through the registry, limited to the training-free methods the prior supports."""
    recipe = checks.check_method(MODALITY, method, method_knobs)
    check(recipe.part("schedule") is None, "method",
          "a method without zipar: GLM-Image decodes a preview grid then the target grid, ZipAR schedules one grid",
          method)
    check(not recipe.requires and recipe.part("drafter") in (None, "sjd", "mcsjd")
          and recipe.part("rule") in (None, "gsd"), "method",
          "one of none, sjd, mcsjd, gsd, mcsjd+gsd (no trained drafter exists for GLM-Image)", method)
    drafter = recipe.part("drafter")
    if drafter is not None:
        cfg = recipe.configs[drafter]
        check(cfg.init != "spatial", "sjd_init", "'random' or 'repeat' (the prior decodes two grids in sequence)",
              cfg.init)
        check(cfg.interval == "full", "sjd_interval", "'full' (the reference interval counts one grid)", cfg.interval)
    return recipe


def _prior_generators(generator, device):
    """Fresh generators seeded from the caller's (diffusers seeds its prior from ``initial_seed``)."""
    def fresh(g):
        return torch.Generator(device=g.device).manual_seed(g.initial_seed())
    if generator is None:
        return None
    return [fresh(g) for g in generator] if isinstance(generator, (list, tuple)) else fresh(generator)
