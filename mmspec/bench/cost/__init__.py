"""``mmspec bench cost``: what each method can reach, from its forward costs and its acceptance (issue 14).

For every target that speculation applies to (each served modality whose ``ModalitySpec`` names a
``cost_target``: ``assets/ar-image``, ``assets/vlm``, ``assets/continuous``), one run:

1. **Runs the methods** (``DEFAULT_ROWS``; one untimed warm-up call per row, then prompts outer and
   rows inner) with forward hooks (``PassTimer``) on the target and on every draft model. Each pass
   is recorded with its role, its block width T, whether it carried a tree mask, and its time; a
   model's first pass in a call is its *prompt pass* (the target's prefill, a draft's first feed).
   Per row: the wall time, the time inside target forwards, inside draft forwards, and the *rest*
   (wall minus both: sampling, acceptance, tree building, cache commits, the pipeline's call).
2. **Measures cost curves** on a warm cache at a realistic prefix (the prompt plus half the
   generated tokens), through the same ``Target`` adapter and cache the decoder uses and timed by
   the same hooks: the target's pass of a T-token block for T in ``widths`` (``VERIFY_WIDTHS``) and
   every width the warm-up calls verified, as a chain and with a tree mask (``heap_tree``); each draft
   model's pass at the grid's widths up to 16 and every width its warm-up calls used, in the
   variants they used. After ``warmup`` untimed passes per point, ``ceil(repeats / prompts)``
   rounds over all points run after each prompt's calls (so the curves see the same machine as the
   calls); a point is the median of its passes. The cache is cut back to the prefix after every pass.

From those, per row (``row_figures``, ``add_speedups``):

- ``ceiling_s`` = the target's prompt passes (the median over rows of each prompt's, the same for
  every row) + the draft models' prompt passes (as measured) + every other pass priced by the
  curves at its width (``interpolate``); ``ceiling_x`` = ``none``'s / the row's: what the method
  reaches if the loop cost nothing outside the forwards;
- ``predicted_s`` = ``ceiling_s`` + the row's measured rest; ``predicted_x`` likewise;
- ``measured_x``: ``none``'s wall / the row's, same target, same run;
- ``measured_over_ceiling``, ``measured_over_predicted``, and ``within_15pct`` (issue 14's target:
  measured within 15% of the ceiling).

With a GPU cost curve (``load_gpu_curve``: verify cost ratio by T, draft/target cost ratio per
drafter, loop overhead per target pass) every row also gets ``projected_x``: the same passes
priced by that file, a projection from assumptions, never a measurement.

Layout: ``config`` (settings, the bundled targets' rows), ``timing`` (``PassTimer``: every pass of
the calls; a drafting component is timed as its registry ``Component.timing`` says), ``curves``
(probes on a warm cache, ``CurveSampler``), ``model`` (the passes priced by the curves or a GPU
curve), ``targets`` (the bundled pipelines), ``report`` (tables, definitions), ``runner``
(``run``).
"""

from .config import (ASSETS, DEFAULT_ROWS, DRAFT_GRID_MAX, SMALL_EAGLE, TARGET, VERIFY_WIDTHS, WITHIN, CostBenchConfig,
                     cost_targets, draft_roles)
from .curves import CurveSampler, Probe, cached_probe, curve_points, heap_tree
from .model import (GPU_KEYS, GPUCurve, add_speedups, ceiling_seconds, curve_seconds, interpolate, load_gpu_curve,
                    row_figures, target_prompt_seconds)
from .report import COST_COLUMNS, DEFINITIONS, columns, curve_rows, format_report, public
from .runner import run
from .timing import CallRecord, Pass, PassTimer, measure_calls, warm_up

__all__ = ["COST_COLUMNS", "CallRecord", "CostBenchConfig", "DEFAULT_ROWS", "cost_targets", "draft_roles",
           "GPUCurve", "Pass", "PassTimer",
           "VERIFY_WIDTHS", "add_speedups", "cached_probe", "ceiling_seconds", "columns", "curve_seconds",
           "format_report", "curve_points", "heap_tree", "interpolate", "load_gpu_curve", "measure_calls",
           "CurveSampler", "public", "row_figures", "run", "target_prompt_seconds", "warm_up"]
