"""Serving the bundled pipelines to people: the one package the demo (``demos/app.py``) and
``mmspec batch`` call pipelines through, and where a modality is declared once.

A ``ModalitySpec`` says all the rest of mmspec needs to know of a modality (a registry modality
of ``mmspec.methods``): the pipeline class that loads ``assets/<kind>``, a batch job's fields and
output file, whether jobs may share a pipeline call (``batchable``), ``run_jobs`` (one pipeline
call for a batch's same-method jobs), continuous batching (``slot_jobs``), and, as
``"module:attribute"`` references imported only where used, its ``mmspec generate`` command, its
demo tab, its GPU check driver and its cost bench target. ``SPECS`` holds them by kind
(``spec(kind)``); ``mmspec batch``, ``mmspec generate``, the demo, ``mmspec gpu-check`` and
``mmspec bench cost`` read it, so a new modality is one module that calls ``register`` (see
docs/guides/add-a-modality.md and ``tests/toy_modality.py``). ``Models`` loads each kind's pipeline
lazily, once, shared and thread-safe (``Models.pipeline(kind)``).

Each runner module also has the calls the demo makes directly: ``run_ar`` (``ar_image.py``),
``run_continuous`` (``continuous.py``), ``run_vlm`` / ``stream_vlm`` (``vlm.py``, the answer's
tokens after every pass), ``stream_video`` / ``run_video`` (``video.py``, frames chunk by chunk
from a prompt schedule). They return plain results (``Result``): uint8 images, texts or frames,
the decode's stats and, per generated token, the decode pass that committed it (``commit_pass``,
``passes.py``). Every pipeline call lives in this package, so a change of the pipelines' calling
contract is a change here only.

Batches: every row gets its own ``torch.Generator`` from its job's seed (a generator list), so a
row of a batched call equals that job run alone wherever the pipelines keep their promise (row r
of a batch equals that prompt alone with g_r); each spec's ``batchable`` says where it is
measured to hold, and ``tests/test_batch.py`` checks batched files against batch-size-1 files.

Continuous batching (``slots.py``: ``run_vlm_continuous``, ``run_ar_continuous``, and
``vlm_slot_jobs`` / ``ar_slot_jobs`` for ``mmspec batch --continuous``): jobs stream through a
batch of slots, a finished job's row refilled by the next job's prefill, each job yielded as it
ends. ``SharedQueue`` (``shared.py``): requests from many threads (the demo's users) decoded
together that way, a future per request.
"""

# registration order is the demo's tab order
from . import ar_image, vlm, video, continuous, shared, slots  # noqa: I001
from .ar_image import AR_BATCHABLE, ar_batchable, ar_prompts, check_ar_prompt, class_confidence, run_ar
from .continuous import continuous_batchable, run_continuous
from .base import (ASSETS, GAUGE, SPECS, ActivityGauge, JobField, ModalitySpec, Models, Result, check_seed,
                   knob_specs, method_defaults, register, resolve, spec, unregister)
from .video import (VIDEO_MAX_FRAMES, VideoPiece, check_video_knobs, run_video, stream_video, video_batchable,
                    video_config, video_schedule, video_stats, write_video)
from .shared import SharedQueue
from .slots import ar_slot_jobs, run_ar_continuous, run_vlm_continuous, vlm_slot_jobs
from .vlm import Partial, as_rgb, open_image, run_vlm, scene, stream_vlm, vlm_batchable

__all__ = [
    "ASSETS", "AR_BATCHABLE", "GAUGE", "SPECS", "VIDEO_MAX_FRAMES", "ActivityGauge", "JobField", "ModalitySpec",
    "Models", "Partial", "Result", "SharedQueue", "VideoPiece", "ar_batchable", "ar_image", "ar_prompts",
    "ar_slot_jobs", "as_rgb", "check_ar_prompt", "check_seed", "check_video_knobs", "class_confidence", "continuous",
    "continuous_batchable", "knob_specs", "method_defaults", "open_image", "register", "resolve", "run_ar",
    "run_ar_continuous", "run_continuous", "run_video", "run_vlm", "run_vlm_continuous", "scene", "shared", "slots",
    "spec", "stream_video", "stream_vlm", "unregister", "video", "video_batchable", "video_config", "video_schedule",
    "video_stats", "vlm", "vlm_batchable", "vlm_slot_jobs", "write_video",
]
