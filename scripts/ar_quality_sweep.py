"""The AR image bench's `p vs none` over seeds (issue 28, part 4): how often exact rows fall below
0.05 on the bundled checkpoints, and how often a lossy rule is flagged.

Runs ``mmspec.bench.ar_image`` with ``none``, ``sjd``, ``eagle``, ``medusa`` (exact) and
``lantern-per-test`` (lossy) at 32 images per seed (image i: class i % 16, generator seed
``seed + i``; seeds 1,000 apart, so no image is shared), one thread, and prints the counts. Run from the
repository root: ``.venv/bin/python scripts/ar_quality_sweep.py [SEEDS] [OUT_JSON]`` with SEEDS
comma-separated (default 0,1000,...,19000).
"""

import json
import sys

import torch

from mmspec.bench import ar_image as ab

EXACT, LOSSY = ("sjd", "eagle", "medusa"), "lantern-per-test"


def main(seeds: str = ",".join(str(1000 * k) for k in range(20)), out: str | None = None) -> None:
    torch.set_num_threads(1)
    rows = tuple(m for m in ab.DEFAULT_METHODS if m[0] in ("none", *EXACT, LOSSY))
    pvalues = {}
    for seed in (int(s) for s in seeds.split(",")):
        cfg = ab.ARImageBenchConfig(methods=rows, images=32, seed=seed, exact_samples=0, bootstrap_resamples=200)
        pvalues[seed] = {r["method"]: r["p_vs_none"] for r in ab.run(cfg)["rows"] if r["method"] != "none"}
        print(seed, pvalues[seed], flush=True)
    for name in (*EXACT, LOSSY):
        ps = [p[name] for p in pvalues.values()]
        print(f"{name}: p < 0.05 in {sum(p < 0.05 for p in ps)} of {len(ps)} seeds")
    if out:
        with open(out, "w") as f:
            json.dump(pvalues, f, indent=2)


if __name__ == "__main__":
    main(*sys.argv[1:])
