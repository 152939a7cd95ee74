"""``mmspec bench video``: the streaming video pipeline's cache modes, one run, same prompts and seeds.

Every stream is one batched call of ``StreamingVideoPipeline.stream`` over the same ``prompts``
(one video per prompt, video i from ``torch.Generator().manual_seed(seed + i)``), at the model's
guidance and steps unless set. Four groups of rows:

- ``frames`` (one group per count in ``frames``): ``rolling`` (ours: sinks + window, cached),
  ``window-recompute`` (StreamingLLM's sliding window with recompute, Xiao et al., 2024: every
  denoising step re-encodes sink + window from scratch), ``no-sink`` (the window alone: the attention-sink
  ablation) and ``full-cache`` (no eviction; it stops where the transformer's RoPE range ends,
  288 frames for the bundled model, and the row says where and why instead of failing), all at
  the trained sink and window.
- ``window-sweep``: ``rolling`` and ``window-recompute`` at windows of ``windows`` chunks, for the
  measured speed-up against the compute ratio ``S (C + K + W) / ((S + 1) C)`` (S steps, C frames
  per chunk, K sink and W window frames: the recompute re-encodes the K + W visible frames with
  the chunk in each of S steps, the cached stream encodes the chunk S times plus one commit). The
  bundled model was trained with a window of 9 frames (3 chunks): larger windows are outside its
  training distribution, so their quality says little; their cost comparison holds.
- ``prompt-switch``: ``rolling`` streams whose prompts change one field (``colour`` or
  ``direction``) at frame ``switch_at`` (LongLive's re-cache, Yang et al., 2025): frames until
  the judge reports the new value, and the frame-to-frame pixel change at the switch against the
  stream's median (and the same ratio on real rendered clips with that switch).
- ``multi-switch``: ``rolling`` streams of ``multi_switches + 1`` prompts, the colour moving on
  to the next palette colour every ``multi_switch_every`` frames: the colour accuracy of every
  prompt segment (``colour_min_segment``: the worst segment of any stream; judge and pixels
  agreeing, as the colour switch measures) and, per switch, frames until the new colour holds
  (``multi_switch_within_2_chunks``: the share of switches that took hold within two chunks).

- ``wan-tiny``: diffusers' Wan classes through ``StreamingVideoPipeline.from_wan``, tiny and
  random (``mmspec.bench.wan_tiny``, ``wan_size`` pixels; ``WAN_NOTE`` says the shape):
  ``rolling`` against ``window-recompute`` at the windows ``wan_windows``, ``wan_frames`` latent
  frames, the transformer's stream (the VAE decode left out): the ratio to recompute and the
  flatness of latency and memory, no quality (random weights draw noise).

A stream that stops early (full-cache's ``CacheLimitError``, a ``MemoryError``, or the process's
RSS past ``rss_limit_mb``) keeps its row: ``stopped`` says what and at which frame,
``stop_reason`` the full message. With a JSON path the result is rewritten after every group
(``setup.complete`` False until the end), so an interrupted run keeps the groups it finished.

Timing: inside a group the streams advance in lockstep, one chunk each in turn (the order rotated
every chunk), after an untimed warm-up stream per setting, so a slow stretch of the machine lands
on every row alike; wall ratios are measured in that one run. A chunk's latency is the wall time of
one ``next()`` on its stream (re-cache, denoising, commit, decode). ``fps`` counts the frames of all
``len(prompts)`` videos. Slopes are least-squares fits of per-chunk latency (ms) over the chunk's
first frame index, in ms per 1,000 frames, over the chunks after the cache has filled
(``fit_from_frame``), with the slope's standard error and a moving-block bootstrap 95% interval
(blocks of about ``n ** (1/3)`` chunks, so the chunks' autocorrelation is kept).
``latency_slope_adj`` is the same fit after dividing each chunk's latency by its lockstep round's
``speed_index`` (the median of the relative latencies, in that round, of the group's streams
whose cost per chunk is constant by design, i.e. all but full-cache; three or more of them): a
drift of the machine's speed during the run, which the raw slope takes for growth, cancels; a
row's own growth does not (a row that grows within the other rows' spread moves the median a
little: the others then show a small negative slope).

Memory: the process's resident set from ``/proc/self/statm``, read before and after every chunk
call, the C heap's free memory returned to the OS before each group (``trim_heap``: otherwise
memory an earlier group freed is reused unseen). The change across a call is attributed to the
stream that made it (in lockstep several rows share one process): ``peak_rss_mb`` is the largest
cumulative growth attributed to the row since its group started (peaks inside one call are not
seen; memory another stream of the group freed can still be reused unseen), ``rss_slope`` its
fitted slope in MB per 1,000 frames. ``cache_mb`` is what the stream's cache object holds (the
pipeline's ``cache_bytes``), exactly.

Quality, over the first and the last ``quality_frames`` frames of each stream: ``class_acc``
(the judge, a ``FrameJudge`` trained on rendered frames, reports the prompt's shape and colour,
and the pixels show that colour), ``shape_acc``, ``colour_acc`` (``frame_colour`` from pixels), ``direction_acc`` (the
motion of the prompt colour's pixel centroid between consecutive frames, ``motion_direction``);
``*_drift`` is last minus first in points. The setup gives the same figures on real rendered
clips of the bench's prompts and on their autoencoder reconstructions: the ceiling a perfect
generator would reach through this decoder.

Layout: ``config`` (``VideoBenchConfig``), ``timing`` (streams in lockstep, latency, RSS, the speed
index), ``model`` (the compute ratio, slopes and speed-ups of a row; the statistics are
``mmspec.eval.stats``), ``measures`` (the rows' quality, switch and segment measures; the judges
they apply are ``mmspec.eval.video``'s), ``report`` (columns,
JSON), ``runner`` (``run`` and its groups).
"""

from ...eval.stats import fit_slope
from ...eval.video import accuracy, frames_until, judge_frames, pixel_changes, switch_jump
from .config import ASSETS, DEFAULT_PROMPTS, METHODS, PROMPT_SET, SWITCH_FIELDS, VideoBenchConfig
from .model import compute_ratio
from .report import VIDEO_COLUMNS, public
from .runner import WAN_NOTE, run
from .timing import FrameBuffer, rss_mb, speed_index, trim_heap

__all__ = ["DEFAULT_PROMPTS", "METHODS", "PROMPT_SET", "SWITCH_FIELDS", "VideoBenchConfig", "VIDEO_COLUMNS", "WAN_NOTE", "accuracy",
           "compute_ratio", "fit_slope", "frames_until", "judge_frames", "pixel_changes", "public", "rss_mb", "run",
           "speed_index", "switch_jump", "trim_heap", "FrameBuffer"]
