"""Serving the bundled pipelines to people: the one package the demo (``demos/app.py``) and
``mmspec batch`` call pipelines through, one runner per modality behind one small record.

A ``Runner`` says how its kind (a registry modality) is served: the pipeline class that loads
``assets/<kind>``, whether jobs may share a pipeline call (``batchable``), and ``run_jobs``, one
pipeline call for a batch's same-method jobs. ``RUNNERS`` holds them by kind (``runner(kind)``);
``Models`` loads each kind's pipeline lazily, once, shared and thread-safe
(``Models.pipeline(kind)``). Each runner module also has the calls the demo makes directly:
``run_ar`` (``ar_image.py``), ``run_continuous`` (``continuous.py``), ``run_vlm`` / ``stream_vlm``
(``vlm.py``, the answer's tokens after every pass), ``stream_video`` / ``run_video`` (``video.py``,
frames chunk by chunk from a prompt schedule). They return plain results (``Result``): uint8
images, texts or frames, the decode's stats and, per generated token, the decode pass that
committed it (``commit_pass``, ``passes.py``). Every pipeline call lives in this package, so a
change of the pipelines' calling contract is a change here only; a new modality is one module
that registers its runner (and a demo tab, and a ``KIND_SPECS`` entry in ``mmspec.batch``).

Batches: every row gets its own ``torch.Generator`` from its job's seed (a generator list), so a
row of a batched call equals that job run alone wherever the pipelines keep their promise (row r
of a batch equals that prompt alone with g_r); each runner's ``batchable`` says where it is
measured to hold, and ``tests/test_batch.py`` checks batched files against batch-size-1 files.

Continuous batching (``slots.py``: ``run_vlm_continuous``, ``run_ar_continuous``, ``SLOT_RUNNERS``
for ``mmspec batch --continuous``): jobs stream through a batch of slots, a finished job's row
refilled by the next job's prefill, each job yielded as it ends. ``SharedQueue`` (``shared.py``):
requests from many threads (the demo's users) decoded together that way, a future per request.
"""

from . import ar_image, continuous, shared, slots, video, vlm
from .ar_image import AR_BATCHABLE, ar_batchable, ar_prompts, check_ar_prompt, class_confidence, run_ar
from .continuous import continuous_batchable, run_continuous
from .base import (ASSETS, GAUGE, RUNNERS, ActivityGauge, Models, Result, Runner, check_seed, knob_specs,
                     method_defaults, resolve, runner)
from .video import (VIDEO_MAX_FRAMES, VideoPiece, check_video_knobs, run_video, stream_video, video_batchable,
                    video_config, video_schedule, video_stats, write_video)
from .shared import SharedQueue
from .slots import SLOT_RUNNERS, run_ar_continuous, run_vlm_continuous
from .vlm import Partial, as_rgb, open_image, run_vlm, scene, stream_vlm, vlm_batchable

__all__ = [
    "ASSETS", "AR_BATCHABLE", "GAUGE", "RUNNERS", "SLOT_RUNNERS", "VIDEO_MAX_FRAMES", "ActivityGauge", "Models",
    "Partial", "Result", "Runner", "SharedQueue", "VideoPiece", "ar_batchable", "ar_image", "ar_prompts", "as_rgb",
    "check_ar_prompt", "check_seed", "check_video_knobs", "class_confidence", "continuous", "continuous_batchable",
    "knob_specs", "method_defaults", "open_image", "resolve", "run_ar", "run_ar_continuous", "run_continuous",
    "run_video", "run_vlm", "run_vlm_continuous", "runner", "scene", "shared", "slots", "stream_video", "stream_vlm",
    "video", "video_batchable", "video_config", "video_schedule", "video_stats", "vlm", "vlm_batchable", "write_video",
]
