"""Serving the bundled pipelines to people: the one module the demo (``demos/app.py``) and
``mmspec batch`` call pipelines through.

``Models`` loads each pipeline lazily from ``assets/``, once, and shares it (thread-safe);
``run_ar`` / ``run_continuous`` / ``run_vlm`` run one request or one batch of same-kind jobs and
return plain results: uint8 images or texts, the decode's stats and, per generated token, the decode
pass that committed it (``commit_pass``; 0 is the prefill). ``stream_video`` / ``run_video``
stream one video from a prompt schedule through the streaming video pipeline (a cache mode of the
``"video"`` registry modality) and return uint8 frames and the stream's stats. Every pipeline call lives here, so a
change of the pipelines' calling contract is a change to this file only.

Where ``commit_pass`` comes from: in raster order (every AR method without ZipAR's next-set
schedule, and every VLM method) the step callback asks for the ``"tokens"`` tensor input, each row's
generated tokens so far after every pass (``pipelines.base``). The tokens a pass added are the ones
after the previous pass's, so the map is exact; a pass that adds ``k`` tokens committed ``k - 1``
accepted drafts and one token of the target's own (the correction or bonus token). The tensor is
right-padded with 0 (a valid token id), so in a batch a row's length after a pass is read from its
tokens against its final ones (``_row_lengths``); the rare row whose length that leaves open (its
next tokens are 0s) gets ``commit_pass = None`` rather than a guess. One row alone is always exact
(the tensor is as wide as the row). ZipAR's lanes fill several grid rows per pass and the pipelines
refuse tensor inputs there (nothing says which positions a pass filled), so ``commit_pass`` is
``None`` for ZipAR methods. The continuous-token pipeline decodes in raster order and its callback's
``timestep`` is the tokens per image so far: exact for one image, a mean over a batch, so
``run_continuous`` gives ``commit_pass`` for a single prompt and ``None`` for each row of a batch.

The VLM run streams the same tensor: ``on_pass`` receives the answer's tokens so far after every
pass, which ``stream_vlm`` hands to the demo as the growing text.

Batches: every row gets its own ``torch.Generator`` from its job's seed (a generator list), so a
row of a batched call equals that job run alone wherever the pipelines keep their promise (row r
of a batch equals that prompt alone with g_r); ``ar_batchable`` / ``vlm_batchable`` /
``continuous_batchable`` say where it is measured to hold, and ``tests/test_batch.py`` checks
batched files against batch-size-1 files.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from . import methods
from .core.errors import check

ASSETS = Path(__file__).resolve().parents[1] / "assets"
KINDS = ("ar-image", "vlm", "video", "continuous")
"""Job kinds (= registry modalities) this module can run; a new modality adds its runner here."""


# ---------------------------------------------------------------- models, loaded once and shared

class Models:
    """The bundled pipelines and the quality classifier, each loaded on first use and then shared
    by every caller (the demo's users, a batch's jobs). Loading is serialised by a lock, so two
    first requests arriving together load a model once."""

    def __init__(self, assets: str | Path = ASSETS):
        self.assets = Path(assets)
        self._lock = threading.Lock()
        self._loaded: dict[str, Any] = {}
        self.loads = 0  # how many loads ran (the load test checks it stays at one per model)

    def _get(self, name: str, load: Callable[[], Any]):
        with self._lock:
            if name not in self._loaded:
                self._loaded[name] = load()
                self.loads += 1
            return self._loaded[name]

    def ar_image(self):
        def load():
            from .pipelines import SpeculativeARImagePipeline

            pipe = SpeculativeARImagePipeline.from_pretrained(str(self.assets / "ar-image"))
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return self._get("ar-image", load)

    def continuous(self):
        def load():
            from .pipelines import SpeculativeContinuousARPipeline

            pipe = SpeculativeContinuousARPipeline.from_pretrained(str(self.assets / "continuous"))
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return self._get("continuous", load)

    def vlm(self):
        def load():
            from .pipelines import SpeculativeVLMPipeline

            pipe = SpeculativeVLMPipeline.from_pretrained(str(self.assets / "vlm"))
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return self._get("vlm", load)

    def video(self):
        def load():
            from .pipelines import StreamingVideoPipeline

            pipe = StreamingVideoPipeline.from_pretrained(str(self.assets / "video"))
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return self._get("video", load)

    def classifier(self):
        def load():
            from .models import load_checkpoint
            from .models.classifier import ShapesClassifier

            return load_checkpoint(ShapesClassifier, str(self.assets / "classifier")).eval()
        return self._get("classifier", load)


class ActivityGauge:
    """Counts requests running at once (and the most ever seen): what the load test reads to
    check that the demo's queue bounds concurrency."""

    def __init__(self):
        self._lock = threading.Lock()
        self.active = 0
        self.peak = 0
        self.total = 0

    def __enter__(self):
        with self._lock:
            self.active += 1
            self.total += 1
            self.peak = max(self.peak, self.active)
        return self

    def __exit__(self, *exc):
        with self._lock:
            self.active -= 1


GAUGE = ActivityGauge()


# ---------------------------------------------------------------- inputs

def ar_prompts() -> tuple[str, ...]:
    """The class prompts the bundled AR model draws (``"a red circle"``, ...)."""
    from .training.data.shapes import CLASS_PROMPTS

    return tuple(CLASS_PROMPTS)


def check_ar_prompt(prompt) -> str:
    """``prompt`` normalised (case and spaces), or ``ValueError`` listing the class prompts."""
    norm = " ".join(str(prompt).lower().split()) if isinstance(prompt, str) else None
    check(norm in ar_prompts(), "prompt", "one of the class prompts: " + ", ".join(ar_prompts()), prompt)
    return norm


def check_seed(seed) -> int:
    check(isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63, "seed",
          "an int in [0, 2**63)", seed)
    return seed


def resolve(kind: str, method: str, knobs: dict | None):
    """The registry's validation of a method and its knobs (``ValueError`` naming the knob)."""
    return methods.resolve(kind, method, knobs or {})


def scene(index: int) -> np.ndarray:
    """Bundled procedural scene ``index`` (held out from training) as a (64, 64, 3) uint8 array."""
    from .bench.vlm import bench_prompts

    check(isinstance(index, int) and 0 <= index < 16, "scene", "an int in [0, 16)", index)
    images, _ = bench_prompts(index + 1)
    return (images[index].permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8)


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


# ---------------------------------------------------------------- results

@dataclass
class Result:
    """One request's (or batch row's) output: ``image`` (H, W, 3) uint8, ``text`` or ``frames``
    (F, H, W, 3) uint8; ``stats`` of its decode; ``commit_pass`` per generated token (raster
    order), or None when unknown."""

    stats: dict
    image: np.ndarray | None = None
    text: str | None = None
    frames: np.ndarray | None = None
    tokens: list[int] | None = None
    commit_pass: np.ndarray | None = None
    extra: dict = field(default_factory=dict)


def _plain_stats(stats: dict, wall: float, batch: int) -> dict:
    out = {k: (round(float(v), 4) if isinstance(v, float) else v) for k, v in stats.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out["wall_seconds"] = round(wall, 4)
    out["batch"] = batch
    return out


def _commit_passes(counts: list[int], total: int) -> np.ndarray:
    """(total,) pass index per token from the token count after the prefill and each pass."""
    passes = np.zeros(total, dtype=np.int32)
    prev = 0
    for step, done in enumerate(counts):
        done = min(done, total)
        passes[prev:done] = step
        prev = max(prev, done)
    passes[prev:] = len(counts)  # anything the last callback did not report
    return passes


def _row_lengths(snapshot: torch.Tensor, finals: list[list[int]], previous: list[int | None]) -> list[int | None]:
    """Each row's length after one pass, counted in its final tokens, from the ``"tokens"`` input
    ``snapshot`` ((B, w): the rows so far, right-padded with 0) and each row's final tokens; ``None``
    where it is not determined. A row may run past its final tokens (drafts accepted beyond its
    EOS, or past ``max_new_tokens``, are cut from the output): its length is then all of them. Else
    a row of length n holds ``final[:n]`` then 0s, so n is at least one past its last non-zero
    token and at least the previous pass's length (``lo``), and can only extend over final tokens
    that are 0. One row alone: n is ``w`` exactly (capped at its final length)."""
    B, w = snapshot.shape
    if B == 1:
        return [min(w, len(finals[0]))]
    out: list[int | None] = []
    for row, final, prev in zip(snapshot.tolist(), finals, previous):
        L = len(final)
        nz = [k for k, t in enumerate(row) if t != 0]
        lo = max(prev or 0, nz[-1] + 1 if nz else 0)
        if prev is None or row[:min(lo, L)] != final[:min(lo, L)]:
            out.append(None)
        elif lo >= L:
            out.append(L)
        else:
            hi = lo
            while hi < min(w, L) and final[hi] == 0:
                hi += 1
            out.append(lo if hi == lo else None)
    return out


def _passes_from_tokens(snapshots: list[torch.Tensor], finals: list[list[int]]) -> list[np.ndarray | None]:
    """Per row, the pass that committed each of its final tokens (0: the prefill's one token),
    from the ``"tokens"`` input after every pass; ``None`` for a row whose lengths are not
    determined (see ``_row_lengths``)."""
    counts: list[list[int | None]] = [[1] * len(finals)]  # the prefill emits each row's first token
    for snap in snapshots:
        counts.append(_row_lengths(snap, finals, counts[-1]))
    out = []
    for r, final in enumerate(finals):
        row = [c[r] for c in counts]
        out.append(None if any(n is None for n in row) else _commit_passes(row, len(final)))
    return out


def _generators(seeds: list[int]) -> list[torch.Generator]:
    """One generator per row, from that row's seed (row r of a batch = that job alone)."""
    return [torch.Generator().manual_seed(check_seed(s)) for s in seeds]


# ---------------------------------------------------------------- AR image

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
    pipe = models.ar_image()
    raster = recipe.part("schedule") is None  # ZipAR's lanes: the pipelines refuse tensor inputs
    snapshots: list[torch.Tensor] = []

    def on_step(p, step, timestep, kwargs):
        if raster:
            snapshots.append(kwargs["tokens"])  # (B, n) each image's tokens so far (a copy)
        return {}

    t0 = time.perf_counter()
    out = pipe(prompt=prompts, method=method, method_knobs=dict(knobs or {}), guidance_scale=guidance_scale,
               temperature=temperature, top_k=top_k, top_p=top_p, generator=_generators(seeds),
               output_type="latent", callback_on_step_end=on_step,
               callback_on_step_end_tensor_inputs=["tokens"] if raster else [])
    with torch.no_grad():  # each image from its own tokens: a row's pixels do not depend on its batch
        pixels = [pipe.postprocess_images(pipe.vqvae.decode(grid[None]), "np")[0] for grid in out.tokens]
    wall = time.perf_counter() - t0
    images = [(np.asarray(px) * 255).round().astype(np.uint8) for px in pixels]  # (H, W, 3) each
    stats = _plain_stats(out.stats, wall, len(prompts))
    finals = [t.flatten().tolist() for t in out.tokens]
    passes = _passes_from_tokens(snapshots, finals) if raster else [None] * len(prompts)
    return [Result(stats=stats, image=img, tokens=finals[i], commit_pass=passes[i],
                   extra={"lossless": recipe.lossless}) for i, img in enumerate(images)]


@torch.no_grad()
def class_confidence(models: Models, images: list[np.ndarray], prompts: list[str]) -> list[float]:
    """The quality figure shown beside lossy methods: the bundled classifier's probability of the
    class each image was asked for (the bench's class accuracy, per image)."""
    labels = [ar_prompts().index(check_ar_prompt(p)) for p in prompts]
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1  # (B, 3, H, W) in [-1, 1]
    probs = models.classifier()(x).softmax(-1)  # (B, classes)
    return [round(float(probs[i, c]), 4) for i, c in enumerate(labels)]


# ---------------------------------------------------------------- continuous tokens

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
    prompt and ``None`` in a batch (see the module docstring)."""
    prompts = [check_ar_prompt(p) for p in prompts]
    check(len(seeds) == len(prompts), "seeds", f"one seed per prompt ({len(prompts)})", seeds)
    seeds = [check_seed(s) for s in seeds]
    recipe = resolve("continuous", method, knobs)
    check(isinstance(guidance_scale, (int, float)) and not isinstance(guidance_scale, bool) and guidance_scale >= 0,
          "guidance_scale", "a number >= 0", guidance_scale)
    check(isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0,
          "temperature", "a number > 0", temperature)
    pipe = models.continuous()
    counts = [1]  # the prefill emits each image's first token

    def on_step(p, step, done, kwargs):
        counts.append(int(done))  # tokens per image so far (a mean over the rows of a batch)
        return {}

    t0 = time.perf_counter()
    out = pipe(prompt=prompts, method=method, method_knobs=dict(knobs or {}), guidance_scale=guidance_scale,
               temperature=temperature, generator=_generators(seeds), output_type="latent",
               callback_on_step_end=on_step)
    with torch.no_grad():  # each image from its own latents: a row's pixels do not depend on its batch
        pixels = [pipe.postprocess_images(pipe.tokenizer.decode(lat[None]).clamp(-1, 1), "np")[0]
                  for lat in out.latents]  # lat: (T, d)
    wall = time.perf_counter() - t0
    images = [(np.asarray(px) * 255).round().astype(np.uint8) for px in pixels]  # (H, W, 3) each
    stats = _plain_stats(out.stats, wall, len(prompts))
    passes = [_commit_passes(counts, out.latents.shape[1])] if len(prompts) == 1 else [None] * len(prompts)
    head = methods.continuous.head_for(recipe)
    return [Result(stats=stats, image=img, commit_pass=passes[i], extra={"lossless": recipe.lossless, "head": head})
            for i, img in enumerate(images)]


# ---------------------------------------------------------------- VLM

def vlm_batchable(method: str, temperature: float) -> bool:
    """Greedy answers do not depend on the batch they are decoded in (the pipeline pads rows and
    masks them), so greedy jobs batch. Sampled ones stay alone: per-row generators make a row
    independent of its batch's randomness, but that is not yet measured on the bundled VLM here."""
    return temperature == 0


def run_vlm(models: Models, images: list, questions: list[str], seeds: list[int], method: str = "none",
            knobs: dict | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
            on_pass: Callable[[int, list[int]], None] | None = None) -> list[Result]:
    """Answer each question about its image. ``on_pass(step, tokens)`` is called after every
    target pass with the first answer's tokens so far (its text as it is decoded)."""
    images = [as_rgb(im) for im in images]
    check(len(questions) == len(images) and all(isinstance(q, str) and q.strip() for q in questions), "question",
          "a non-empty question per image", questions)
    check(len(seeds) == len(images), "seeds", f"one seed per image ({len(images)})", seeds)
    resolve("vlm", method, knobs)
    check(isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool) and 1 <= max_new_tokens <= 512,
          "max_new_tokens", "an int in [1, 512]", max_new_tokens)
    pipe = models.vlm()
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
               max_new_tokens=max_new_tokens, temperature=temperature, generator=_generators(seeds),
               callback_on_step_end=on_step, callback_on_step_end_tensor_inputs=["tokens"])
    wall = time.perf_counter() - t0
    stats = _plain_stats(out.stats, wall, len(images))
    finals = [list(t) for t in out.tokens]
    passes = _passes_from_tokens(snapshots, finals)
    return [Result(stats=stats, text=text, tokens=toks, commit_pass=cp)
            for text, toks, cp in zip(out.texts, finals, passes)]


def vlm_pieces(models: Models, tokens: list[int], commit_pass: np.ndarray | None) -> list[tuple[str, str | None]]:
    """The answer as ``(word, label)`` pieces for display: ``"draft"`` for tokens that came from
    accepted drafts, ``None`` for the target's own tokens (one per pass: the correction or bonus
    token, and the prefill's first token). Special tokens are dropped."""
    tok = models.vlm().processor.tokenizer
    special = set(tok.all_special_ids)
    pieces = []
    for i, t in enumerate(tokens):
        if t in special:
            continue
        last_of_pass = commit_pass is None or i + 1 == len(tokens) or commit_pass[i + 1] != commit_pass[i]
        word = tok.decode([t])
        pieces.append((word + " ", None if last_of_pass else "draft"))
    return pieces


@dataclass
class Partial:
    """The answer so far, after one pass: its ``tokens`` and the pass that committed each
    (``commit_pass``, exact for one row), for ``vlm_pieces``."""

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
        yield Partial(tokens, _commit_passes(counts, len(tokens))), None
    worker.join()
    if "error" in box:
        raise box["error"]
    result = box["result"]
    yield Partial(result.tokens, result.commit_pass), result


# ---------------------------------------------------------------- streaming video

VIDEO_MAX_FRAMES = 10_000
"""Frames one ``stream_video`` call (a batch job) may ask for; the pipeline itself streams without end."""


def video_config(assets: str | Path = ASSETS) -> dict:
    """The bundled video transformer's config (prompt vocabulary, chunk, trained sink and window),
    read from its folder without loading the model."""
    path = Path(assets) / "video" / "transformer" / "config.json"
    check(path.is_file(), "assets", "a folder holding video/transformer/config.json", str(path))
    return json.loads(path.read_text())


def video_schedule(prompt: str, switches=(), num_frames: int | None = None,
                   assets: str | Path = ASSETS) -> list[tuple[int, str]]:
    """The prompt schedule ``[(0, prompt), (frame, text), ...]`` of ``prompt`` and ``switches``
    (``(frame, text)`` pairs, any order), checked against the bundled model's config before any
    model loads: each text names one word of each prompt field (colour, shape, direction); switch
    frames are distinct ints > 0, below ``num_frames``, at chunk boundaries (the pipeline
    switches prompts between chunks, LongLive's re-cache)."""
    from .models.video_dit import parse_prompt

    cfg = video_config(assets)
    C, vocab = cfg["chunk_frames"], cfg["prompt_vocab"]
    check(isinstance(prompt, str) and prompt.strip() != "", "prompt", "a non-empty prompt such as "
          "'a red circle moving right'", prompt)
    parse_prompt(prompt, vocab)
    check(isinstance(switches, (list, tuple)) and all(isinstance(s, (list, tuple)) and len(s) == 2 for s in switches),
          "switches", "a list of (frame, prompt) pairs", switches)
    schedule = [(0, prompt)]
    for frame, text in sorted(switches, key=lambda s: s[0] if isinstance(s[0], int) else -1):
        check(isinstance(frame, int) and not isinstance(frame, bool) and frame > 0, "switch frame",
              "an int > 0 (frame 0 is the prompt's)", frame)
        low = frame // C * C
        check(frame % C == 0, "switch frame", f"a multiple of the model's chunk ({C} frames): prompts switch at "
              f"chunk boundaries, e.g. {low or C} or {low + C}", frame)
        check(num_frames is None or frame < num_frames, "switch frame", f"below the number of frames ({num_frames})",
              frame)
        check(frame != schedule[-1][0], "switch frame", "distinct frames (one prompt per switch)", frame)
        check(isinstance(text, str) and text.strip() != "", "switch prompt", "a non-empty prompt", text)
        parse_prompt(text, vocab)
        schedule.append((frame, text))
    return schedule


def video_batchable(method: str, temperature: float) -> bool:
    """Video jobs run one per call: a batched row equals the video alone only within float
    rounding (``tests/test_video_pipeline.py``), which can move a uint8 pixel, and a job's file
    must not depend on the batch it ran in."""
    return False


def check_video_knobs(method: str, knobs: dict | None, assets: str | Path = ASSETS) -> dict:
    """The pipeline's ``stream`` keyword arguments of a cache mode and its knobs (the registry's
    ``"video"`` modality), with sink and window checked against the model's chunk; the RoPE-range
    bound (sink + window + chunk) is the pipeline's check."""
    from .methods.video import stream_kwargs

    kwargs = stream_kwargs(resolve("video", method, knobs))
    C = video_config(assets)["chunk_frames"]
    for name in ("sink_frames", "window_frames"):
        value = kwargs.get(name)
        check(value is None or value % C == 0, name, f"None or a multiple of the model's chunk ({C} frames)", value)
    return kwargs


@dataclass
class VideoPiece:
    """One chunk of a stream as it arrives: ``frames`` (n, H, W, 3) uint8, ``start`` the index
    of its first frame, ``total`` the frames asked for, ``prompt`` in force, and the chunk's
    ``stats`` (``latency_s``, ``cache_frames``, ``cache_bytes``, ``switched``, ``nfe``)."""

    frames: np.ndarray
    start: int
    total: int
    prompt: str
    stats: dict


def stream_video(models: Models, prompt: str, seed: int, num_frames: int, method: str = "rolling",
                 knobs: dict | None = None, switches=()) -> Iterator[tuple[VideoPiece | None, Result | None]]:
    """Stream one video: yields ``(piece, None)`` for every chunk as it is decoded, then
    ``(None, result)`` once, ``result.frames`` (F, H, W, 3) uint8 and ``result.stats``
    (``video_stats``). ``method`` is a cache mode (``methods.names("video")``) with its
    ``knobs``; ``switches`` ``(frame, prompt)`` pairs. Every input is checked here, before any
    model loads; the pipeline's own checks (the RoPE range) run before its first chunk."""
    check(isinstance(num_frames, int) and not isinstance(num_frames, bool) and 1 <= num_frames <= VIDEO_MAX_FRAMES,
          "num_frames", f"an int in [1, {VIDEO_MAX_FRAMES}]", num_frames)
    schedule = video_schedule(prompt, switches, num_frames, models.assets)
    kwargs = check_video_knobs(method, knobs, models.assets)
    seed = check_seed(seed)
    return _stream_video(models, schedule, seed, num_frames, kwargs)


def _stream_video(models: Models, schedule, seed: int, num_frames: int, kwargs: dict):
    pipe = models.video()
    call = dict(prompts=schedule, num_frames=num_frames, **kwargs)
    setup = pipe.check_inputs(None, schedule, num_frames, None, kwargs["guidance_scale"],
                              kwargs["num_inference_steps"], kwargs.get("sink_frames"), kwargs.get("window_frames"),
                              kwargs["cache_mode"], kwargs["recache_sink"], "np", None, ["latents"])
    pieces = []
    for chunk in pipe.stream(**call, generator=torch.Generator().manual_seed(seed), output_type="np"):
        frames = (np.asarray(chunk.frames[0]) * 255).round().astype(np.uint8)  # (n, H, W, 3)
        piece = VideoPiece(frames, chunk.frame_indices.start, num_frames, chunk.prompts[0], dict(chunk.stats))
        pieces.append(piece)
        yield piece, None
    settings = dict(cache_mode=setup.cache_mode, sink_frames=setup.sink, window_frames=setup.window,
                    num_inference_steps=setup.steps, guidance_scale=setup.guidance_scale,
                    recache_sink=setup.recache_sink, chunk_frames=pipe.chunk_frames)
    frames = np.concatenate([p.frames for p in pieces])
    yield None, Result(stats=video_stats(pieces, settings), frames=frames)


def run_video(models: Models, prompt: str, seed: int, num_frames: int, method: str = "rolling",
              knobs: dict | None = None, switches=()) -> Result:
    """``stream_video`` to its end: the whole video's ``Result``."""
    for _, result in stream_video(models, prompt, seed, num_frames, method, knobs, switches):
        if result is not None:
            return result


def video_stats(pieces: list[VideoPiece], settings: dict) -> dict:
    """A stream's stats: ``frames``, ``chunks``, ``wall_seconds`` (the chunks' summed latency:
    the pipeline's time, not the caller's between chunks), ``fps`` (frames over it),
    ``latency_ms_median`` / ``latency_ms_p95`` per chunk, ``nfe``, ``cache_frames`` (after the
    last chunk), ``cache_kib`` (the largest), ``switch_frames`` (where a re-cache ran), and the
    resolved ``settings`` (cache mode, sink, window, steps, guidance, ...)."""
    latency = np.array([p.stats["latency_s"] for p in pieces])
    frames = sum(len(p.frames) for p in pieces)
    wall = float(latency.sum())
    return {"frames": frames, "chunks": len(pieces), "wall_seconds": round(wall, 4),
            "fps": round(frames / wall, 2) if wall > 0 else None,
            "latency_ms_median": round(1000 * float(np.median(latency)), 2),
            "latency_ms_p95": round(1000 * float(np.percentile(latency, 95)), 2),
            "nfe": int(sum(p.stats["nfe"] for p in pieces)), "cache_frames": int(pieces[-1].stats["cache_frames"]),
            "cache_kib": round(max(p.stats["cache_bytes"] for p in pieces) / 1024, 1),
            "switch_frames": [p.start for p in pieces if p.stats["switched"]], **settings}


def video_stats_line(stats: dict) -> str:
    """``96 frames, 32 chunks | 31.2 fps | chunk latency median 96 ms (p95 120 ms) | cache 12 frames,
    97 KiB | NFE 288 | re-cache at frames [48] | rolling: sink 3, window 9, 8 steps, CFG 3.5``."""
    s = stats
    mode = s["cache_mode"] + (f": sink {s['sink_frames']}, window {s['window_frames']}"
                              if s["cache_mode"] != "full-cache" else ": every frame kept")
    parts = [f"{s['frames']} frames, {s['chunks']} chunks", f"{s['fps']} fps",
             f"chunk latency median {s['latency_ms_median']:.0f} ms (p95 {s['latency_ms_p95']:.0f} ms)",
             f"cache {s['cache_frames']} frames, {s['cache_kib']:.0f} KiB", f"NFE {s['nfe']}"]
    if s["switch_frames"]:
        parts.append(f"re-cache at frames {s['switch_frames']}")
    parts.append(f"{mode}, {s['num_inference_steps']} steps, CFG {s['guidance_scale']:g}")
    return " | ".join(parts)


def write_video(frames: np.ndarray, path: str | Path, fps: int = 16, scale: int = 8) -> Path:
    """(F, H, W, 3) uint8 frames to ``path`` (``.mp4`` or ``.gif``) through the pipeline's writer
    (``save_video``: ``scale`` times larger, nearest neighbour; a temporary file renamed into place)."""
    import PIL.Image

    from .pipelines import save_video

    check(isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.shape[-1] == 3 and frames.dtype == np.uint8,
          "frames", "an (F, H, W, 3) uint8 array", getattr(frames, "shape", frames))
    return save_video([PIL.Image.fromarray(f) for f in frames], path, fps=fps, scale=scale)


def frame_strip(frames: list[np.ndarray], every: int = 1, per_row: int = 16, scale: int = 2) -> np.ndarray:
    """Every ``every``-th of (H, W, 3) uint8 ``frames`` in rows of ``per_row``, ``scale`` times
    larger (nearest neighbour), white where the last row ends early: (rows * H * scale,
    min(count, per_row) * W * scale, 3) uint8."""
    check(len(frames) >= 1, "frames", "at least one frame", len(frames))
    picked = [np.repeat(np.repeat(f, scale, 0), scale, 1) for f in frames[::every]]
    h, w = picked[0].shape[:2]
    cols = min(len(picked), per_row)
    rows = -(-len(picked) // per_row)
    strip = np.full((rows * h, cols * w, 3), 255, np.uint8)
    for i, f in enumerate(picked):
        r, c = divmod(i, per_row)
        strip[r * h:(r + 1) * h, c * w:(c + 1) * w] = f
    return strip


# ---------------------------------------------------------------- the per-token picture

def _pass_colour(k: np.ndarray) -> np.ndarray:
    """A colour per pass index: hues spaced by the golden angle, so consecutive passes differ
    clearly; the prefill (0) is white. (N,) ints -> (N, 3) uint8."""
    h = (k * 0.618033988749895) % 1.0
    s, v = 0.65, 0.95
    i = np.floor(h * 6).astype(int) % 6
    f = h * 6 - np.floor(h * 6)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    r = np.select([i == j for j in range(6)], [v, q, p, p, t, v])
    g = np.select([i == j for j in range(6)], [t, v, v, q, p, p])
    b = np.select([i == j for j in range(6)], [p, p, t, v, v, q])
    out = (np.stack([r, g, b], -1) * 255).round().astype(np.uint8)
    out[k == 0] = 255
    return out


def commit_grid_image(commit_pass: np.ndarray, grid: int = 16, cell: int = 16) -> np.ndarray:
    """The per-token picture: the (grid x grid) token grid, each cell coloured by the decode pass
    that committed its token; cells committed together share a colour and are joined (no border
    between them). Returns (grid * cell, grid * cell, 3) uint8."""
    check(commit_pass is not None and commit_pass.size == grid * grid, "commit_pass",
          f"{grid * grid} pass indices", None if commit_pass is None else commit_pass.shape)
    k = commit_pass.reshape(grid, grid)
    img = np.repeat(np.repeat(_pass_colour(k.flatten()).reshape(grid, grid, 3), cell, 0), cell, 1)
    dark = np.array([40, 40, 40], np.uint8)
    for r in range(grid):
        for c in range(grid):
            y, x = r * cell, c * cell
            if c + 1 < grid and k[r, c + 1] != k[r, c]:
                img[y:y + cell, x + cell - 1] = dark
            if r + 1 < grid and k[r + 1, c] != k[r, c]:
                img[y + cell - 1, x:x + cell] = dark
    return img


def stats_line(stats: dict, baseline: dict | None = None) -> str:
    """``NFE 90 | tau 2.89 | wall 1.01 s | speed-up 2.1x`` (speed-up over ``baseline``'s wall)."""
    parts = [f"NFE {stats.get('nfe', '?')}", f"tau {stats.get('tau', 0):.2f}", f"wall {stats['wall_seconds']:.2f} s"]
    if baseline is not None and stats["wall_seconds"] > 0:
        parts.append(f"speed-up {baseline['wall_seconds'] / stats['wall_seconds']:.2f}x")
        parts.append(f"NFE x {baseline.get('nfe', 0) / max(1, stats.get('nfe', 1)):.2f}")
    return " | ".join(parts)


def knob_specs(kind: str) -> dict[str, methods.KnobSpec]:
    """Every knob any method of ``kind`` takes (first method's spec wins; defaults are per method,
    see ``method_defaults``)."""
    out: dict[str, methods.KnobSpec] = {}
    for name in methods.names(kind):
        for spec in methods.knobs(kind, name).values():
            out.setdefault(spec.name, spec)
    return out


def method_defaults(kind: str, method: str) -> dict[str, Any]:
    return {name: spec.default for name, spec in methods.knobs(kind, method).items()}
