"""Continuous batching for the runners: jobs decoded in a batch of ``slots`` rows, a finished job's
row refilled with the next job's prefill while the other rows keep decoding
(``SpeculativeDecoder.serve`` through the pipelines' ``serve``).

``run_vlm_continuous`` and ``run_ar_continuous`` yield ``(job index, Result)`` as each job ends,
in finishing order; each ``Result`` is the job's own (the same tokens as ``run_vlm`` / ``run_ar``
on the job alone where the runner's ``batchable`` holds), its ``stats`` the job's: ``nfe`` (its
prefill and the batch passes it was in), ``new_tokens``, ``wall_seconds`` (from the call's start
to the job's end) and ``batch`` (the slots). ``vlm_slot_jobs`` / ``ar_slot_jobs`` run
``mmspec batch --continuous``'s jobs through them (their kinds' ``ModalitySpec.slot_jobs``).
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from ..core.errors import check, check_int
from .ar_image import check_ar_prompt
from .base import Models, Result, generators, plain_stats, resolve
from .passes import commit_passes
from .vlm import check_requests, open_image


def _check_slots(slots) -> int:
    check_int(slots, "slots", 1)
    return slots


def _result(served, t0: float, slots: int, **fields) -> Result:
    n = len(served.tokens)
    chosen = {k: v for k, v in served.stats.extra.items() if k in ("auto", "auto_method")}  # method="auto"
    stats = plain_stats({"nfe": served.target_forwards, "new_tokens": n, **chosen}, time.perf_counter() - t0, slots)
    return Result(stats=stats, tokens=served.tokens.tolist(), commit_pass=commit_passes(served.counts, n), **fields)


def run_vlm_continuous(models: Models, images: list, questions: list[str], seeds: list[int], method: str = "none",
                       knobs: dict | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                       slots: int = 4, admit=None) -> Iterator[tuple[int, Result]]:
    """Answer each question about its image (``run_vlm``'s inputs and checks), ``slots`` answers
    in flight at once; yields ``(index, Result)`` as each answer ends. ``admit(j, idle)``: whether
    job j (the next, in order) may enter a free row now (``SpeculativeDecoder.serve``)."""
    images = check_requests(images, questions, seeds, method, knobs, max_new_tokens)
    _check_slots(slots)
    pipe = models.pipeline("vlm")
    t0 = time.perf_counter()
    for served, text in pipe.serve(images, questions, slots=slots, method=method, method_knobs=dict(knobs or {}),
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   generator=generators(seeds), admit=admit):
        yield served.index, _result(served, t0, slots, text=text)


def run_ar_continuous(models: Models, prompts: list[str], seeds: list[int], method: str = "none",
                      knobs: dict | None = None, guidance_scale: float = 2.0, temperature: float = 1.0,
                      top_k: int | None = None, top_p: float | None = None,
                      slots: int = 4) -> Iterator[tuple[int, Result]]:
    """Generate one image per class prompt (``run_ar``'s inputs and checks), ``slots`` images in
    flight at once; yields ``(index, Result)`` as each image's grid ends (decoded from its own
    tokens)."""
    prompts = [check_ar_prompt(p) for p in prompts]
    check(len(seeds) == len(prompts), "seeds", f"one seed per prompt ({len(prompts)})", seeds)
    recipe = resolve("ar-image", method, knobs)
    check(isinstance(guidance_scale, (int, float)) and not isinstance(guidance_scale, bool) and guidance_scale >= 0,
          "guidance_scale", "a number >= 0", guidance_scale)
    _check_slots(slots)
    pipe = models.pipeline("ar-image")
    t0 = time.perf_counter()
    for served, grid in pipe.serve(prompt=prompts, slots=slots, method=method, method_knobs=dict(knobs or {}),
                                   guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p,
                                   generator=generators(seeds)):
        with torch.no_grad():
            pixels = pipe.postprocess_images(pipe.vqvae.decode(grid[None]), "np")[0]
        image = (np.asarray(pixels) * 255).round().astype(np.uint8)
        lossless = recipe.lossless if recipe is not None else bool(served.stats.extra["auto_lossless"])  # "auto"
        yield served.index, _result(served, t0, slots, image=image, extra={"lossless": lossless})


def vlm_slot_jobs(models: Models, jobs: list[dict], seeds: list[int], method: str, knobs: dict | None,
                  slots: int) -> Iterator[tuple[int, Result]]:
    """``mmspec batch --continuous``'s same-group VLM jobs (parsed dicts; the first job's options
    apply to all) through continuous batching, yielding ``(index, Result)`` as each ends: the VLM
    kind's ``ModalitySpec.slot_jobs``."""
    p = jobs[0]
    images = [open_image(j["image"]) for j in jobs]  # batch jobs name image files
    return run_vlm_continuous(models, images, [j["question"] for j in jobs], seeds, method, knobs,
                              max_new_tokens=p["max_new_tokens"], temperature=p["temperature"], slots=slots)


def ar_slot_jobs(models: Models, jobs: list[dict], seeds: list[int], method: str, knobs: dict | None,
                 slots: int) -> Iterator[tuple[int, Result]]:
    """``mmspec batch --continuous``'s same-group AR image jobs (parsed dicts; the first job's
    options apply to all) through continuous batching, yielding ``(index, Result)`` as each ends:
    the AR image kind's ``ModalitySpec.slot_jobs``."""
    p = jobs[0]
    return run_ar_continuous(models, [j["prompt"] for j in jobs], seeds, method, knobs,
                             guidance_scale=p["guidance_scale"], temperature=p["temperature"], top_k=p["top_k"],
                             top_p=p["top_p"], slots=slots)

