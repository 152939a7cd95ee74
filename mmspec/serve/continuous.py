"""The continuous-token runner: class prompts to uint8 images through
``SpeculativeContinuousARPipeline`` (MAR-style heads), the AR image modality's prompts."""

from __future__ import annotations

import time

import numpy as np
import torch

from .. import methods
from ..core.errors import check
from .ar_image import check_ar_job, check_ar_prompt
from .passes import commit_passes
from .base import JobField, ModalitySpec, Models, Result, check_seed, generators, plain_stats, register, resolve


def continuous_batchable(method: str, temperature: float) -> bool:
    """Continuous jobs run one per call: a batched row equals the image alone only to float
    rounding (``tests/test_continuous_pipeline.py``; the latents differ in the last bits), which
    can move a later accept test or a uint8 pixel, and a job's file must not depend on its batch."""
    return False


def run_continuous(models: Models, prompts: list[str], seeds: list[int], method: str = "none",
                   knobs: dict | None = None, guidance_scale: float = 2.0, temperature: float = 1.0) -> list[Result]:
    """Generate one image per class prompt with its seed through the continuous-token pipeline
    (``methods.names("continuous")``); every input is checked before any model runs. The prompts
    are the AR image modality's class prompts, which the bundled continuous model is trained on;
    the pipeline checks them again against its own labels. ``commit_pass`` is exact for one
    prompt and ``None`` in a batch (``mmspec.serve.passes``)."""
    prompts = [check_ar_prompt(p) for p in prompts]
    check(len(seeds) == len(prompts), "seeds", f"one seed per prompt ({len(prompts)})", seeds)
    seeds = [check_seed(s) for s in seeds]
    recipe = resolve("continuous", method, knobs)
    check(isinstance(guidance_scale, (int, float)) and not isinstance(guidance_scale, bool) and guidance_scale >= 0,
          "guidance_scale", "a number >= 0", guidance_scale)
    check(isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0,
          "temperature", "a number > 0", temperature)
    pipe = models.pipeline("continuous")
    counts = [1]  # the prefill emits each image's first token

    def on_step(p, step, done, kwargs):
        counts.append(int(done))  # tokens per image so far (a mean over the rows of a batch)
        return {}

    t0 = time.perf_counter()
    out = pipe(prompt=prompts, method=method, method_knobs=dict(knobs or {}), guidance_scale=guidance_scale,
               temperature=temperature, generator=generators(seeds), output_type="latent",
               callback_on_step_end=on_step)
    with torch.no_grad():  # each image from its own latents: a row's pixels do not depend on its batch
        pixels = [pipe.postprocess_images(pipe.tokenizer.decode(lat[None]).clamp(-1, 1), "np")[0]
                  for lat in out.latents]  # lat: (T, d)
    wall = time.perf_counter() - t0
    images = [(np.asarray(px) * 255).round().astype(np.uint8) for px in pixels]  # (H, W, 3) each
    stats = plain_stats(out.stats, wall, len(prompts))
    passes = [commit_passes(counts, out.latents.shape[1])] if len(prompts) == 1 else [None] * len(prompts)
    if recipe is None:  # method="auto": the method it chose (a lossless one, on the mixture head)
        recipe = methods.auto.candidate_recipe("continuous", out.stats["auto_method"])
    head = methods.continuous.head_for(recipe)
    return [Result(stats=stats, image=img, commit_pass=passes[i], extra={"lossless": recipe.lossless, "head": head})
            for i, img in enumerate(images)]


def _check_job(params: dict, method: str, knobs: dict, base) -> None:
    """A batch job's class prompt (normalised in place), CFG scale and temperature: MAR's
    temperature scales the heads' noise, so 0 is not greedy here."""
    check_ar_job(params, method, knobs, base)
    check(params["temperature"] > 0, "temperature", "a number > 0", params["temperature"])


def _run_jobs(models: Models, jobs: list[dict], seeds: list[int], method: str, knobs: dict | None) -> list[Result]:
    p = jobs[0]
    return run_continuous(models, [j["prompt"] for j in jobs], seeds, method, knobs,
                          guidance_scale=p["guidance_scale"], temperature=p["temperature"])


register(ModalitySpec(
    "continuous", title="Continuous tokens", pipeline="SpeculativeContinuousARPipeline",
    batchable=continuous_batchable, run_jobs=_run_jobs,
    job_fields={"prompt": JobField(str, required=True), "guidance_scale": JobField(float, 2.0),
                "temperature": JobField(float, 1.0)},
    per_job=("prompt",), output_ext=".png", check_job=_check_job, generate="mmspec.commands.generate:CONTINUOUS",
    demo_tab="continuous_tab", device_check="mmspec.bench.gpu_check:ContinuousCheck",
    cost_target="mmspec.bench.cost.targets:ContinuousCost"))
