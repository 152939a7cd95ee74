"""Count the tensor operations one decode pass of the continuous pipeline dispatches.

Runs ``none`` and ``sjd`` on the bundled continuous-token target (classes 0-3, generator seeds
0-3, the bench's constant CFG 3) under the torch profiler and prints, per target pass, the
top-level ``aten`` operations (those not called from another ``aten`` operation) and their self
CPU time (inflated by the profiler), with the 20 most frequent. On this CPU a small tensor
operation costs a few microseconds whatever its size, so the count tracks the Python-level cost
of a pass (docs/continuous.md). Run from the repository root:
``.venv/bin/python scripts/continuous_ops_per_pass.py [PIPELINE_DIR]``.
"""

import collections
import sys

import torch
from torch.profiler import profile

from mmspec.pipelines import SpeculativeContinuousARPipeline


def main(pipeline_dir: str = "assets/continuous") -> None:
    torch.set_num_threads(1)
    pipe = SpeculativeContinuousARPipeline.from_pretrained(pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    for method in ("none", "sjd"):
        nfe = 0
        with profile() as prof:
            for i in range(4):
                out = pipe(class_labels=i, method=method, guidance_scale=3.0, guidance_schedule="constant",
                           generator=torch.Generator().manual_seed(i), output_type="latent")
                nfe += out.stats["nfe"]
        ops = [e for e in prof.events() if e.name.startswith("aten::")]
        top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
        print(f"{method}: {len(top) / nfe:.1f} top-level aten ops per pass, "
              f"{sum(e.self_cpu_time_total for e in ops) / nfe / 1e3:.3f} ms self CPU per pass (profiled)")
        common = collections.Counter(e.name for e in top).most_common(20)
        print("  " + ", ".join(f"{name[6:]} {count / nfe:.1f}" for name, count in common))


if __name__ == "__main__":
    main(*sys.argv[1:2])
