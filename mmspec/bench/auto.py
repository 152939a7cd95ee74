"""``mmspec bench auto``: ``method="auto"`` against every fixed method it chooses among, at several
batch sizes, on the bundled AR image and VLM pipelines (issue 46's targets: auto within 5% of the
best fixed method at each batch size, and never more than 3% below the target alone).

Per modality: the machine's cost profile (``pipe.cost_profile()``; calibrated first, in the same
run, when there is none or ``calibrate=True``, ``mmspec.bench.cost.calibrate``); the fixed rows are
the profile's candidates the lossless budget admits, plus ``auto`` (its default knobs: lossless,
re-decided every 16 passes). Per batch size B: one untimed warm-up call per row (cut after three
passes), then ``rounds`` rounds of one call per row (rows interleaved within a round, their order
rotated by one each round; round r asks for prompts r*B .. r*B + B - 1, seeds likewise). AR calls
use the benches' settings (classifier-free guidance 2, temperature 1, 256 tokens an image); VLM
calls answer held-out scenes greedily, 64 new tokens at most. Figures per row: mean wall seconds of
a call, generated tokens per second, NFE and tau (``out.stats``), ``x_vs_none`` (none's wall / the
row's, same B, same run); for ``auto`` also what it chose, its predicted speed-up, its passes with
and without drafting, ``auto_vs_best`` (the best fixed row's wall / auto's) and, for the VLM,
whether its answers equal ``none``'s (greedy: they must). The summary rows say whether each target
holds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..core.errors import check, check_choice, check_int, is_int
from ..methods import auto
from .cost.calibrate import CalibrateConfig, _load, _stamps, calibrate, call_for

WITHIN_BEST = 0.05  # auto at most this much slower than the best fixed method
BELOW_NONE = 0.03  # and never more than this much slower than the target alone


@dataclass
class AutoBenchConfig:
    modalities: tuple = ("ar-image", "vlm")
    batch_sizes: tuple = (1, 4, 8)
    rounds: int = 4
    calibrate: bool = False  # calibrate first even when a profile exists
    calibration_prompts: int = 6
    seed: int = 0

    @classmethod
    def quick(cls, **kw) -> "AutoBenchConfig":
        return cls(**{"batch_sizes": (1, 4), "rounds": 1, "calibration_prompts": 2, **kw})

    def check(self) -> None:
        check(isinstance(self.modalities, tuple) and len(self.modalities) > 0, "modalities",
              "a non-empty tuple among " + ", ".join(auto.modalities()), self.modalities)
        for m in self.modalities:
            check_choice("modalities", m, auto.modalities())
        bs = self.batch_sizes
        check(isinstance(bs, tuple) and len(bs) > 0 and all(is_int(b) and b >= 1 for b in bs), "batch_sizes",
              "a non-empty tuple of ints >= 1", bs)
        check_int(self.rounds, "rounds", 1)


def _tokens(modality: str, out) -> int:
    if modality == "continuous":
        return int(out.latents.shape[0] * out.latents.shape[1])
    return sum(len(t) for t in out.tokens) if modality == "vlm" else int(out.tokens.numel())


@torch.no_grad()
def run(cfg: AutoBenchConfig, progress=None, pipes: dict | None = None) -> dict:
    """The bench (see the module docstring); ``pipes``: loaded pipelines by modality (tests)."""
    cfg.check()
    say = progress or (lambda msg: None)
    rows, summary, profiles = [], [], {}
    for modality in cfg.modalities:
        ccfg = CalibrateConfig(modality=modality, prompts=cfg.calibration_prompts, seed=cfg.seed,
                               batch_sizes=tuple(sorted({1, *cfg.batch_sizes})))
        pipe = (pipes or {}).get(modality) or _load(ccfg)
        pipe.set_cost_profile(None)
        profile = None if cfg.calibrate else pipe.cost_profile()
        calibrated = profile is None
        if calibrated:
            say(f"{modality}: calibrating the cost profile (mmspec bench cost --calibrate)")
            profile = calibrate(ccfg, progress=lambda m: say(f"{modality}: {m}"), pipe=pipe)
        pipe.set_cost_profile(profile)
        profiles[modality] = {"path": profile.path, "key": profile.key, "calibrated_in_this_run": calibrated,
                              "machine": profile.machine, "setup": profile.setup}
        call, _ = call_for(modality)(pipe, ccfg)
        labels = [label for label, row in profile.rows.items() if row.lossless]
        entries = [(label, profile.rows[label].method, profile.rows[label].knobs) for label in labels]
        entries.append(("auto", "auto", {}))
        for b in cfg.batch_sizes:
            walls = {label: [] for label, _, _ in entries}
            outs = {label: [] for label, _, _ in entries}
            for label, method, knobs in entries:
                call(method, knobs, b, 0, _stamps(pipe, 3)[1])  # warm-up, cut after three passes
            for r in range(cfg.rounds):
                k = r % len(entries)  # the order rotates each round: no row always follows the same one
                for label, method, knobs in entries[k:] + entries[:k]:
                    t0 = time.perf_counter()
                    out = call(method, knobs, b, r * b, None)
                    walls[label].append(time.perf_counter() - t0)
                    outs[label].append(out)
                say(f"{modality} B={b} round {r + 1}/{cfg.rounds}: "
                    + ", ".join(f"{k} {statistics.fmean(v):.2f}s" for k, v in walls.items()))
            wall = {k: statistics.fmean(v) for k, v in walls.items()}
            base = wall["none"]
            best = min((k for k in wall if k != "auto"), key=wall.get)
            for label, method, knobs in entries:
                last = outs[label][-1]
                tokens = sum(_tokens(modality, o) for o in outs[label])
                row = {"modality": modality, "B": b, "method": label, "wall_s": round(wall[label], 4),
                       "tokens_per_s": round(tokens / sum(walls[label]), 1),
                       "nfe": statistics.fmean(o.stats["nfe"] for o in outs[label]),
                       "tau": round(statistics.fmean(o.stats["tau"] for o in outs[label]), 3),
                       "x_vs_none": round(base / wall[label], 3)}
                if label == "auto":
                    s = last.stats
                    chosen = sorted({o.stats["auto_method"] for o in outs[label]})
                    row.update(chosen="/".join(chosen), predicted_x=s["auto_predicted_x"],
                               passes_on=sum(o.stats.get("auto_passes_on", 0) for o in outs[label]),
                               passes_off=sum(o.stats.get("auto_passes_off", 0) for o in outs[label]),
                               auto_vs_best=round(wall[best] / wall[label], 3), reason=s["auto"])
                    if modality == "vlm":
                        row["identical_to_none"] = all(a.texts == n.texts for a, n in zip(outs["auto"],
                                                                                          outs["none"]))
                rows.append(row)
            a = wall["auto"]
            vs_best, vs_none = round(wall[best] / a, 3), round(base / a, 3)  # the verdicts read the shown figures
            summary.append({"modality": modality, "B": b, "best_fixed": best,
                            "best_x_vs_none": round(base / wall[best], 3),
                            "auto_chose": rows[-1]["chosen"], "auto_x_vs_none": vs_none, "auto_vs_best": vs_best,
                            "within_5pct_of_best": vs_best >= 1 - WITHIN_BEST,
                            "not_3pct_below_none": vs_none >= 1 - BELOW_NONE})
        del pipe
    setup = {"modalities": list(cfg.modalities), "batch_sizes": list(cfg.batch_sizes), "rounds": cfg.rounds,
             "threads": torch.get_num_threads(), "seed": cfg.seed, "profiles": profiles,
             "targets": f"auto_vs_best >= {1 - WITHIN_BEST}, auto_x_vs_none >= {1 - BELOW_NONE}"}
    return {"bench": "auto", "setup": setup, "rows": rows, "summary": summary}


AUTO_COLUMNS = [("modality", "modality"), ("B", "B"), ("method", "method"), ("wall_s", "wall s"),
                ("tokens_per_s", "tok/s"), ("nfe", "NFE"), ("tau", "tau"), ("x_vs_none", "x none"),
                ("chosen", "auto chose"), ("predicted_x", "pred x"), ("passes_on", "on"), ("passes_off", "off"),
                ("auto_vs_best", "auto/best")]
SUMMARY_COLUMNS = [("modality", "modality"), ("B", "B"), ("best_fixed", "best fixed"),
                   ("best_x_vs_none", "best x none"), ("auto_chose", "auto chose"), ("auto_x_vs_none", "auto x none"),
                   ("auto_vs_best", "auto/best"), ("within_5pct_of_best", "within 5%"),
                   ("not_3pct_below_none", ">= 0.97x none")]
