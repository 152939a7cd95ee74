"""The AR image runner: class prompts to uint8 images through ``SpeculativeARImagePipeline``, with
the pass that committed each token, and the quality classifier the demo shows beside lossy
methods."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..core.errors import check, is_int
from .passes import passes_from_tokens
from .base import ASSETS, JobField, ModalitySpec, Models, Result, generators, plain_stats, register, resolve


def ar_prompts() -> tuple[str, ...]:
    """The class prompts the bundled AR model draws (``"a red circle"``, ...), in class-id order:
    the first name of each id in the ``id2label`` its transformer config saves
    (``assets/ar-image/transformer/config.json``; the labels live with the weights, so this reads one
    small JSON file and loads no model), lower case with single spaces."""
    return _saved_prompts(str(ASSETS / "ar-image" / "transformer" / "config.json"))


@functools.lru_cache(maxsize=None)
def _saved_prompts(path: str) -> tuple[str, ...]:
    config = json.loads(Path(path).read_text())
    id2label = config.get("id2label") or {}
    n = config.get("num_classes")
    check(is_int(n) and all(str(i) in id2label for i in range(n)), path,
          "a class-conditioned transformer config naming every class in id2label", sorted(id2label))
    return tuple(" ".join(id2label[str(i)].split(",")[0].lower().split()) for i in range(n))


def check_ar_prompt(prompt) -> str:
    """``prompt`` normalised (case and spaces), or ``ValueError`` listing the class prompts."""
    norm = " ".join(str(prompt).lower().split()) if isinstance(prompt, str) else None
    check(norm in ar_prompts(), "prompt", "one of the class prompts: " + ", ".join(ar_prompts()), prompt)
    return norm


AR_BATCHABLE = ()
"""AR methods whose batched rows were measured equal to the rows alone (per-row generators)."""


def ar_batchable(method: str, temperature: float) -> bool:
    """Whether several AR jobs may share one pipeline call without changing any job's image: each
    row draws from its own generator (the job's seed), and the image is decoded from its tokens
    alone (``run_ar``), so a row's image is the job's own wherever the pipeline's rows are
    independent of their batch, measured for the methods in ``AR_BATCHABLE``."""
    return method in AR_BATCHABLE


def run_ar(models: Models, prompts: list[str], seeds: list[int], method: str = "none", knobs: dict | None = None,
           guidance_scale: float = 2.0, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None) -> list[Result]:
    """Generate one image per prompt with its seed; every input is checked before any model runs."""
    prompts = [check_ar_prompt(p) for p in prompts]
    check(len(seeds) == len(prompts), "seeds", f"one seed per prompt ({len(prompts)})", seeds)
    recipe = resolve("ar-image", method, knobs)
    check(isinstance(guidance_scale, (int, float)) and not isinstance(guidance_scale, bool) and guidance_scale >= 0,
          "guidance_scale", "a number >= 0", guidance_scale)
    pipe = models.pipeline("ar-image")
    # ZipAR's lanes: the pipelines refuse tensor inputs; "auto" (recipe None) then chooses raster methods
    raster = recipe is None or recipe.part("schedule") is None
    snapshots: list[torch.Tensor] = []

    def on_step(p, step, timestep, kwargs):
        if raster:
            snapshots.append(kwargs["tokens"])  # (B, n) each image's tokens so far (a copy)
        return {}

    t0 = time.perf_counter()
    out = pipe(prompt=prompts, method=method, method_knobs=dict(knobs or {}), guidance_scale=guidance_scale,
               temperature=temperature, top_k=top_k, top_p=top_p, generator=generators(seeds),
               output_type="latent", callback_on_step_end=on_step,
               callback_on_step_end_tensor_inputs=["tokens"] if raster else [])
    with torch.no_grad():  # each image from its own tokens: a row's pixels do not depend on its batch
        pixels = [pipe.postprocess_images(pipe.vqvae.decode(grid[None]), "np")[0] for grid in out.tokens]
    wall = time.perf_counter() - t0
    images = [(np.asarray(px) * 255).round().astype(np.uint8) for px in pixels]  # (H, W, 3) each
    stats = plain_stats(out.stats, wall, len(prompts))
    finals = [t.flatten().tolist() for t in out.tokens]
    passes = passes_from_tokens(snapshots, finals) if raster else [None] * len(prompts)
    lossless = recipe.lossless if recipe is not None else bool(out.stats["auto_lossless"])  # "auto": its choice's
    return [Result(stats=stats, image=img, tokens=finals[i], commit_pass=passes[i],
                   extra={"lossless": lossless}) for i, img in enumerate(images)]


@torch.no_grad()
def class_confidence(models: Models, images: list[np.ndarray], prompts: list[str]) -> list[float]:
    """The quality figure shown beside lossy methods: the bundled classifier's probability of the
    class each image was asked for (the bench's class accuracy, per image)."""
    labels = [ar_prompts().index(check_ar_prompt(p)) for p in prompts]
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1  # (B, 3, H, W) in [-1, 1]
    probs = models.classifier()(x).softmax(-1)  # (B, classes)
    return [round(float(probs[i, c]), 4) for i, c in enumerate(labels)]


def check_ar_job(params: dict, method: str, knobs: dict, base) -> None:
    """A batch job's class prompt (normalised in place) and CFG scale."""
    params["prompt"] = check_ar_prompt(params["prompt"])
    check(params["guidance_scale"] >= 0, "guidance_scale", "a number >= 0", params["guidance_scale"])


def _run_jobs(models: Models, jobs: list[dict], seeds: list[int], method: str, knobs: dict | None) -> list[Result]:
    p = jobs[0]
    return run_ar(models, [j["prompt"] for j in jobs], seeds, method, knobs, guidance_scale=p["guidance_scale"],
                  temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"])


register(ModalitySpec(
    "ar-image", title="AR image", pipeline="SpeculativeARImagePipeline", batchable=ar_batchable, run_jobs=_run_jobs,
    job_fields={"prompt": JobField(str, required=True), "guidance_scale": JobField(float, 2.0),
                "temperature": JobField(float, 1.0), "top_k": JobField(int, None, optional=True),
                "top_p": JobField(float, None, optional=True)},
    per_job=("prompt",), output_ext=".png", check_job=check_ar_job, slot_jobs="mmspec.serve.slots:ar_slot_jobs",
    generate="mmspec.commands.generate:AR_IMAGE", demo_tab="ar_tab",
    device_check="mmspec.bench.gpu_check:ARImageCheck", cost_target="mmspec.bench.cost.targets:ARImageCost"))
