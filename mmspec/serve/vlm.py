"""The VLM runner: questions about images to answers through ``SpeculativeVLMPipeline``, run whole
or streamed pass by pass (``stream_vlm``: the answer's tokens so far after every pass), with the
pass that committed each token."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ..core.errors import check, check_int, is_int
from .passes import commit_passes, passes_from_tokens
from .base import ASSETS, JobField, ModalitySpec, Models, Result, generators, plain_stats, register, resolve


def scene(index: int) -> np.ndarray:
    """Bundled procedural scene ``index`` (held out from training) as a (64, 64, 3) uint8 array: the
    PNG ``assets/vlm/scenes/<index>.png`` (two digits), one of the 16 held-out scenes the VLM bench
    asks about first, saved by ``mmspec.training.recipes.vlm.save_heldout_scenes``."""
    check(is_int(index) and 0 <= index < 16, "scene", "an int in [0, 16)", index)
    return open_image(ASSETS / "vlm" / "scenes" / f"{index:02d}.png")


def as_rgb(image) -> np.ndarray:
    """An uploaded image as (H, W, 3) uint8, or ``ValueError`` saying what is wrong with it."""
    check(image is not None, "image", "an uploaded image or a bundled scene", None)
    if not isinstance(image, np.ndarray):
        import PIL.Image

        check(isinstance(image, PIL.Image.Image), "image", "a PIL image or an (H, W, 3) uint8 array",
              type(image).__name__)
        image = np.asarray(image.convert("RGB"))
    if image.ndim == 3 and image.shape[-1] == 4:
        image = image[..., :3]
    check(image.ndim == 3 and image.shape[-1] == 3, "image", "an RGB image (H, W, 3)", image.shape)
    check(image.dtype == np.uint8, "image", "uint8 pixels", image.dtype)
    check(min(image.shape[:2]) >= 16, "image", "at least 16 x 16 pixels", image.shape[:2])
    return image


def open_image(path: str | Path) -> np.ndarray:
    """The image file at ``path`` as (H, W, 3) uint8 (``as_rgb``'s checks), or ``ValueError``."""
    import PIL.Image

    try:
        with PIL.Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError) as err:
        raise ValueError(f"image must be a readable image file, got {str(path)!r} ({err})") from None
    return as_rgb(arr)


def vlm_batchable(method: str, temperature: float) -> bool:
    """Greedy answers do not depend on the batch they are decoded in (the pipeline pads rows and
    masks them), so greedy jobs batch. Sampled ones stay alone: per-row generators make a row
    independent of its batch's randomness, but that is not yet measured on the bundled VLM here."""
    return temperature == 0


def check_requests(images: list, questions: list[str], seeds: list[int], method: str, knobs: dict | None,
                   max_new_tokens: int) -> list[np.ndarray]:
    """VLM requests checked before any model runs (``ValueError`` naming the argument); returns the
    images as (H, W, 3) uint8 arrays."""
    images = [as_rgb(im) for im in images]
    check(len(questions) == len(images) and all(isinstance(q, str) and q.strip() for q in questions), "question",
          "a non-empty question per image", questions)
    check(len(seeds) == len(images), "seeds", f"one seed per image ({len(images)})", seeds)
    resolve("vlm", method, knobs)
    check_int(max_new_tokens, "max_new_tokens", 1, 512)
    return images


def run_vlm(models: Models, images: list, questions: list[str], seeds: list[int], method: str = "none",
            knobs: dict | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
            on_pass: Callable[[int, list[int]], None] | None = None) -> list[Result]:
    """Answer each question about its image. ``on_pass(step, tokens)`` is called after every
    target pass with the first answer's tokens so far (its text as it is decoded)."""
    images = check_requests(images, questions, seeds, method, knobs, max_new_tokens)
    pipe = models.pipeline("vlm")
    snapshots: list[torch.Tensor] = []

    def on_step(p, step, done, kwargs):
        tokens = kwargs["tokens"]  # (B, n) each answer so far, right-padded with 0 (a copy)
        snapshots.append(tokens)
        if on_pass is not None:
            n = tokens.shape[1] if len(images) == 1 else int(done)
            on_pass(step + 1, tokens[0, :n].tolist())
        return {}

    t0 = time.perf_counter()
    out = pipe(images=images, prompts=questions, method=method, method_knobs=dict(knobs or {}),
               max_new_tokens=max_new_tokens, temperature=temperature, generator=generators(seeds),
               callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["tokens"])
    wall = time.perf_counter() - t0
    stats = plain_stats(out.stats, wall, len(images))
    finals = [list(t) for t in out.tokens]
    passes = passes_from_tokens(snapshots, finals)
    return [Result(stats=stats, text=text, tokens=toks, commit_pass=cp)
            for text, toks, cp in zip(out.texts, finals, passes)]


@dataclass
class Partial:
    """The answer so far, after one pass: its ``tokens`` and the pass that committed each
    (``commit_pass``, exact for one row)."""

    tokens: list[int]
    commit_pass: np.ndarray


def stream_vlm(models: Models, image, question: str, seed: int, method: str, knobs: dict | None,
               max_new_tokens: int = 64, temperature: float = 0.0) -> Iterator[tuple[Partial, Result | None]]:
    """Run one VLM request on a worker thread and yield ``(partial, None)`` after every pass as it
    is decoded (the answer's tokens so far), then ``(partial, result)`` once with the whole
    answer. Errors are raised in the caller's thread."""
    updates: queue.Queue = queue.Queue()
    box: dict = {}

    def work():
        try:
            box["result"] = run_vlm(models, [image], [question], [seed], method, knobs, max_new_tokens, temperature,
                                    on_pass=lambda step, tokens: updates.put(tokens))[0]
        except BaseException as err:  # handed to the caller's thread below
            box["error"] = err
        finally:
            updates.put(None)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    counts = [1]  # the prefill emits the first token; one row: each pass's tokens are exact
    tokens: list[int] = []
    while (item := updates.get()) is not None:
        tokens = item
        counts.append(len(tokens))
        yield Partial(tokens, commit_passes(counts, len(tokens))), None
    worker.join()
    if "error" in box:
        raise box["error"]
    result = box["result"]
    yield Partial(result.tokens, result.commit_pass), result


def _check_job(params: dict, method: str, knobs: dict, base) -> None:
    """A batch VLM job's image (a readable file relative to the jobs file's folder ``base``; made
    absolute in place), question and answer length."""
    path = (Path(base) / params["image"]).resolve()
    check(path.is_file(), "image", "an existing image file (relative to the jobs file)", params["image"])
    open_image(path)
    params["image"] = str(path)
    check(params["question"].strip() != "", "question", "a non-empty question", params["question"])
    check(1 <= params["max_new_tokens"] <= 512, "max_new_tokens", "an int in [1, 512]", params["max_new_tokens"])


def _run_jobs(models: Models, jobs: list[dict], seeds: list[int], method: str, knobs: dict | None) -> list[Result]:
    p = jobs[0]
    images = [open_image(j["image"]) for j in jobs]  # batch jobs name image files
    return run_vlm(models, images, [j["question"] for j in jobs], seeds, method, knobs,
                   max_new_tokens=p["max_new_tokens"], temperature=p["temperature"])


register(ModalitySpec(
    "vlm", title="VLM", pipeline="SpeculativeVLMPipeline", batchable=vlm_batchable, run_jobs=_run_jobs,
    job_fields={"image": JobField(str, required=True), "question": JobField(str, required=True),
                "max_new_tokens": JobField(int, 64), "temperature": JobField(float, 0.0)},
    per_job=("image", "question"), output_ext=".txt", check_job=_check_job,
    slot_jobs="mmspec.serve.slots:vlm_slot_jobs",
    generate="mmspec.commands.generate:VLM", demo_tab="vlm_tab",
    device_check="mmspec.bench.gpu_check:VLMCheck", cost_target="mmspec.bench.cost.targets:VLMCost"))
