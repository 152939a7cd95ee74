"""``SpeculativeContinuousARPipeline``: class-conditional AR image generation over continuous tokens
(MAR-style heads on a causal backbone), the acceleration method as an argument (diffusers
conventions, as ``SpeculativeARImagePipeline``).

::

    pipe = SpeculativeContinuousARPipeline.from_pretrained("assets/continuous")
    out = pipe(prompt="a red circle", method="sd", guidance_scale=2.0,
               generator=torch.Generator().manual_seed(0))
    out.images[0].save("red_circle.png"); print(out.stats["nfe"], out.stats["alpha"])

Methods (``mmspec.methods.names("continuous")``): ``none`` and ``none-diffusion`` (target only,
mixture or diffusion head), ``sd`` and ``sd-warmup`` (lossless speculative sampling on the
mixture's exact densities), ``path`` (lossless, on the diffusion head's whole denoising path),
``cspd`` (CSpD's reference rule, lossy; knob ``cspd_inner_temperature``), and ``sjd`` /
``sjd-independent`` (lossless speculative Jacobi decoding on the mixture's densities: no draft model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from diffusers.utils import BaseOutput

from ..core import DensityProcessor
from ..core.errors import check
from ..methods.continuous import head_for
from . import checks
from .base import SpeculativePipeline
from .labels import ClassLabelsMixin
# diffusers loads components only from modules already imported: name them here
from ..models import continuous as _continuous, continuous_tokenizer as _continuous_tokenizer  # noqa: F401

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


@dataclass
class ContinuousARPipelineOutput(BaseOutput):
    """``images``: PIL images, an (N, H, W, 3) float array in [0, 1], an (N, 3, H, W) tensor in
    [0, 1], or (``output_type="latent"``) the (N, T, d) latents. ``latents``: the (N, T, d) latents
    in raster order (always). ``stats``: the decode's counters (``Stats.as_dict``: nfe, draft_nfe,
    tau, alpha, head calls and rows, residual tries and fallbacks, ...)."""

    images: list | np.ndarray | torch.Tensor
    latents: torch.Tensor
    stats: dict = field(default_factory=dict)


class SpeculativeContinuousARPipeline(ClassLabelsMixin, SpeculativePipeline):
    """A continuous-token AR transformer with a mixture and a diffusion head, a continuous tokenizer,
    and optionally a small draft model (for ``sd``, ``sd-warmup``, ``path``, ``cspd``).

    Components: ``tokenizer`` (``ConvTokenizer`` or ``PatchPCATokenizer``), ``transformer`` (``ContinuousARModel``),
    ``draft_model`` (a smaller ``ContinuousARModel``, optional; the method components of
    ``mmspec.methods.components("continuous")``). Class names come from the
    transformer's config (``id2label``): ``pipe.labels``, ``pipe.get_label_ids``.

    Callbacks: ``callback_on_step_end(pipe, step, timestep, callback_kwargs) -> dict`` after every
    decode pass: ``step`` counts target passes from 0 (a pass commits a variable number of tokens
    per image), ``timestep`` is the tokens decoded so far per image. The only tensor input is
    ``"latents"``, (B, n, d) each image's latents so far, zero-padded on the right (a copy). A
    returned ``"latents"`` (same shape) may change each image's last latent, the one the next
    pass feeds the target: decoding continues from the edited latent, whose state (the token
    row the backbone reads) moves by ``a`` times the edit (``state_kernel``: for the mixture
    head's ``a x_0 + b eps``, the same noise eps); the output holds the edit. Earlier latents are in the target's KV cache (and a draft's), so
    changing one is refused (``ValueError`` naming the image and latent): an exact edit would
    need a new prefill. Drafted tokens are never shown: every draft is verified by the next pass
    against the edited history. ``pipe._guidance_scale`` set by a callback changes the guidance
    scale from the next pass on (``SpeculativePipeline.decode``); ``pipe._interrupt = True``
    stops after the current pass (images then hold zeros where no token was decoded).
    """

    modality = "continuous"
    # the main flow only; the draft runs between the target's passes and gets an unchained hook
    # (pipelines.base, SpeculativeARImagePipeline say why)
    model_cpu_offload_seq = "transformer->tokenizer"
    _method_components = {"target": "transformer"}
    _callback_tensor_inputs = ["latents"]
    _callback_replaceable = ("latents",)

    def __init__(self, tokenizer, transformer, **components):
        super().__init__()
        self.register_modules(tokenizer=tokenizer, transformer=transformer, **self.method_modules(components))

    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    def base_components(self, requires: tuple[str, ...]) -> dict:
        return {"target": self.transformer}

    def check_inputs(self, prompt, class_labels, *, method, method_knobs, guidance_scale, guidance_schedule,
                     temperature, num_images_per_prompt, generator, output_type, return_dict, callback_on_step_end,
                     callback_on_step_end_tensor_inputs):
        """Every argument of ``__call__``, checked before any model runs: ``ValueError`` naming
        the argument and the allowed values. Returns the class ids and the resolved recipe."""
        check((prompt is None) != (class_labels is None), "prompt", "exactly one of prompt and class_labels",
              {"prompt": prompt, "class_labels": class_labels})
        if prompt is not None:
            labels = self.get_label_ids(checks.check_prompts(prompt, "prompt"), name="prompt")
        else:
            labels = checks.check_class_labels(class_labels, self.num_classes)
        checks.check_int(num_images_per_prompt, "num_images_per_prompt", 1)
        checks.check_number(temperature, "temperature", 0, low_open=True)
        checks.check_number(guidance_scale, "guidance_scale", 0, optional=True)
        check(guidance_schedule in DensityProcessor.SCHEDULES, "guidance_schedule",
              f"one of {', '.join(map(repr, DensityProcessor.SCHEDULES))}", guidance_schedule)
        checks.check_output_type(output_type, OUTPUT_TYPES)
        recipe = self.check_shared_inputs(method=method, method_knobs=method_knobs,
                                          batch_size=len(labels) * num_images_per_prompt, generator=generator,
                                          return_dict=return_dict, callback_on_step_end=callback_on_step_end,
                                          callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)
        return labels, recipe

    @torch.no_grad()
    def __call__(self, prompt: str | list[str] | None = None, class_labels: int | list[int] | None = None, *,
                 method: str = "none", guidance_scale: float | None = 2.0, guidance_schedule: str = "linear",
                 temperature: float = 1.0, num_images_per_prompt: int = 1,
                 generator: torch.Generator | list[torch.Generator] | None = None, output_type: str = "pil",
                 return_dict: bool = True, callback_on_step_end: Callable | None = None,
                 callback_on_step_end_tensor_inputs: list[str] = (), method_knobs: dict | None = None,
                 residual_max_tries: int | None = 1000):
        """Generate ``num_images_per_prompt`` images per prompt (or class label).

        Args:
            prompt: class names or prompts such as ``"a red circle"`` (``pipe.labels``; exclusive
                with ``class_labels``).
            class_labels: class ids in ``[0, num_classes)``.
            method: ``"none"``, ``"none-diffusion"``, ``"sd"``, ``"sd-warmup"``, ``"path"`` or
                ``"cspd"`` (``mmspec.methods.names("continuous")``); the head follows the method
                (``methods.continuous.head_for``).
            guidance_scale: MAR's CFG scale s (``eps_u + s (eps_c - eps_u)``, or the guided
                mixture); ``None`` or 1 disables it.
            guidance_schedule: ``"linear"`` (MAR's: token j of N uses ``1 + (s - 1)(j + 1) / N``)
                or ``"constant"``.
            temperature: MAR's temperature (> 0): the diffusion head's per-step noise, the
                mixture's standard deviations.
            num_images_per_prompt: images per prompt; image ``i * n + j`` is prompt i's j-th.
            generator: one ``torch.Generator``, or a list of one per image: image r then equals
                that prompt generated alone with generator r (to float rounding: batched matrix
                products may round differently).
            output_type: ``"pil"``, ``"np"``, ``"pt"`` or ``"latent"`` (the (N, T, d) latents).
            callback_on_step_end, callback_on_step_end_tensor_inputs: see the class docstring.
            method_knobs: the method's prefixed knobs, e.g. ``{"sd_gamma": 6}`` or
                ``{"cspd_inner_temperature": 10.0}`` (``mmspec.methods.knobs("continuous", method)``).
            residual_max_tries: the exact residual sampler's try cap (``None``: none); draws that
                hit it are counted in ``stats["residual_fallbacks"]``.
        Returns:
            ``ContinuousARPipelineOutput``, or ``(images,)`` when ``return_dict=False``.
        """
        # 1. check every input before any model runs
        labels, recipe = self.check_inputs(
            prompt, class_labels, method=method, method_knobs=method_knobs, guidance_scale=guidance_scale,
            guidance_schedule=guidance_schedule, temperature=temperature, num_images_per_prompt=num_images_per_prompt,
            generator=generator, output_type=output_type, return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)
        check(residual_max_tries is None or (checks.is_int(residual_max_tries) and residual_max_tries >= 1),
              "residual_max_tries", "None (no cap) or an int >= 1", residual_max_tries)

        # 2. the conditioning: one class-token prompt per image (and the null class for CFG)
        labels = [c for c in labels for _ in range(num_images_per_prompt)]
        B = len(labels)
        guided = guidance_scale is not None and guidance_scale != 1.0
        density = DensityProcessor(temperature=float(temperature),
                                  guidance_scale=float(guidance_scale) if guided else None,
                                  guidance_schedule=guidance_schedule, head=head_for(recipe),
                                  residual_max_tries=residual_max_tries)
        N = self.transformer.num_image_tokens

        def tokens_done(state) -> int:
            return sum(max(0, n) for n in state.generated) // B

        # 3. decode the latents: one SpeculativeDecoder.generate
        out = self.decode(recipe, density, self.transformer.class_prompts(labels), N, tokens_done=tokens_done,
                          callback_on_step_end=callback_on_step_end,
                          callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                          guidance_scale=guidance_scale, generator=generator,
                          uncond_input_ids=self.transformer.uncond_prompts(B) if guided else None)

        # 4. latents -> pixels -> output_type
        latents = out.sequences[..., 1, :].float()  # (B, N, d): row 1 of each token is the latent
        images = latents if output_type == "latent" else self.postprocess_images(
            self.tokenizer.decode(latents).clamp(-1, 1), output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ContinuousARPipelineOutput(images=images, latents=latents, stats=out.stats.as_dict())


    def callback_tensor_input(self, name: str, state) -> torch.Tensor:
        """``"latents"``: (B, n, d) each image's latents so far (``_latents_so_far``)."""
        return _latents_so_far(state)

    def apply_callback_outputs(self, returned, state, requested, vocab) -> None:
        """A returned ``"latents"``: each image's last latent may change (see the class docstring)."""
        check(isinstance(returned, dict) and set(returned) <= ({"latents"} & set(requested)), "callback_on_step_end",
              "a callable returning a dict, {} or (when requested) {'latents': edited latents}", returned)
        if "latents" not in returned:
            return
        before, new = _latents_so_far(state), returned["latents"]
        check(isinstance(new, torch.Tensor) and new.shape == before.shape and new.is_floating_point()
              and bool(torch.isfinite(new).all()), "latents",
              f"a finite float tensor of the shape it was given, {tuple(before.shape)}", new)
        new = new.to(before)
        B = state.batch_size
        n = (state.lengths[:B] - state.prompt_lengths[:B]).to(new.device)  # (B,)
        changed = (new != before).any(-1)  # (B, n)
        last = torch.arange(before.shape[1], device=new.device)[None] == (n - 1)[:, None]
        wrong = (changed & ~last).nonzero()
        if len(wrong):
            b, j = (int(v) for v in wrong[0])
            raise ValueError(f"latents: callback_on_step_end may change only each image's last latent (index n - 1, "
                             f"not yet read by the target); image {b}'s latent {j} is in the KV cache (an exact "
                             f"edit would need a new prefill), got {len(wrong)} such change(s)")
        rows = changed.any(1).nonzero()[:, 0]  # images whose last latent changed
        if len(rows) == 0:
            return
        a, _ = self.transformer.state_kernel
        cols = (state.prompt_lengths[:B] + n - 1)[rows]
        delta = new[rows, n[rows] - 1] - before[rows, n[rows] - 1]  # (k, d)
        for half in range(state.rows // B):  # both CFG halves hold the same generated tokens
            token = state.tokens[rows + half * B, cols].float()  # (k, 2, d)
            token[:, 0] += a * delta  # the state follows its latent (state_kernel's a x_0 + b eps, same eps)
            token[:, 1] = new[rows, n[rows] - 1]
            state.tokens[rows + half * B, cols] = token.to(state.tokens.dtype)


def _latents_so_far(state) -> torch.Tensor:
    """(B, n, d) each image's generated latents so far, zero-padded on the right (a copy)."""
    B = state.batch_size
    start, n = state.prompt_lengths[:B], state.lengths[:B] - state.prompt_lengths[:B]
    span = torch.arange(int(n.max()), device=n.device)
    cols = (start[:, None] + span).clamp(max=state.tokens.shape[1] - 1)  # (B, n)
    rows = torch.arange(B, device=n.device)[:, None]
    latents = state.tokens[rows, cols][..., 1, :].float().clone()  # (B, n, d)
    return latents.masked_fill((span >= n[:, None])[..., None], 0.0)
