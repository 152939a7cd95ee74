"""``mmspec bench adapt``: online draft adaptation (``SpeculativeVLMPipeline.enable_draft_adaptation``)
measured where it should pay: the bundled VLM serving prompts of a kind its head was not trained on.

The served stream: ``prompts`` images of the shapes generator's ``style`` (the head's training
scenes are ``"scene"``; ``"bold"`` draws larger objects over at most one distractor) with one
question phrased as no training template is (``question``; its unknown words become ``<unk>``),
each answered greedily with ``max_new_tokens``. Three arms see the same stream, interleaved
prompt by prompt: the target alone (``none``), the head frozen, and the head adapting (a step
every ``every`` answers at ``lr``). Per arm: tau (tokens per target pass) over the first and the
last ``window`` prompts and its change, the wall seconds per answer, the seconds spent in
adaptation steps, and whether every answer equals the target's alone (greedy identity).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import check

ASSETS = Path(__file__).resolve().parents[2] / "assets"


@dataclass
class AdaptBenchConfig:
    pipeline_dir: str | Path = ASSETS / "vlm"
    method: str = "eagle"
    prompts: int = 500
    window: int = 100  # tau over prompts [0, window) and [prompts - window, prompts)
    style: str = "bold"
    question: str = "tell me about the shape ."
    lr: float = 3e-4
    every: int = 8
    max_new_tokens: int = 64
    seed: int = 1000  # image i is drawn from seed + i

    @classmethod
    def quick(cls) -> "AdaptBenchConfig":
        return cls(prompts=120, window=40)


def _image(cfg: AdaptBenchConfig, i: int) -> torch.Tensor:
    from ..training.data.shapes import NUM_CLASSES, render

    image = render(i % NUM_CLASSES, torch.Generator().manual_seed(cfg.seed + i), 64, style=cfg.style)
    return (image + 1) / 2  # [0, 1], as the pipeline takes tensors


def run(cfg: AdaptBenchConfig, progress=None) -> dict:
    """The three arms over the served stream (module docstring): ``{"setup": ..., "rows": [...]}``."""
    from ..pipelines import SpeculativeVLMPipeline

    check(cfg.prompts >= 2 * cfg.window >= 2, "prompts", f"at least twice the window ({cfg.window})", cfg.prompts)
    pipes = {"none": SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir),
             "frozen": SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir),
             "adapted": SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    adaptation = pipes["adapted"].enable_draft_adaptation(lr=cfg.lr, every=cfg.every)
    taus = {arm: [] for arm in pipes}
    walls = {arm: [] for arm in pipes}
    same = {arm: 0 for arm in pipes}
    for i in range(cfg.prompts):
        image = _image(cfg, i)
        answers = {}
        for arm, pipe in pipes.items():  # interleaved: every arm answers prompt i before prompt i + 1
            t0 = time.perf_counter()
            out = pipe([image], [cfg.question], max_new_tokens=cfg.max_new_tokens,
                       method="none" if arm == "none" else cfg.method)
            wall = time.perf_counter() - t0
            answers[arm] = out.tokens[0]
            taus[arm].append(out.stats["tau"])
            walls[arm].append(wall)
        for arm in pipes:
            same[arm] += answers[arm] == answers["none"]
        if progress is not None and (i + 1) % 20 == 0:
            progress(f"adapt: {i + 1}/{cfg.prompts} prompts, tau over the last 20: "
                     + ", ".join(f"{a} {statistics.fmean(t[-20:]):.2f}" for a, t in taus.items()))
    rows = []
    for arm in pipes:
        first = statistics.fmean(taus[arm][: cfg.window])
        last = statistics.fmean(taus[arm][-cfg.window:])
        rows.append({"arm": arm, "tau_first": first, "tau_last": last, "tau_change": last / first - 1,
                     "wall_s": statistics.fmean(walls[arm]), "identical": same[arm] == cfg.prompts,
                     "identical_answers": same[arm], "updates": adaptation.updates if arm == "adapted" else 0,
                     "adapt_s": sum(adaptation.seconds) if arm == "adapted" else 0.0})
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()}
    setup["windows"] = [[0, cfg.window], [cfg.prompts - cfg.window, cfg.prompts]]
    return {"setup": setup, "rows": rows}


ADAPT_COLUMNS = [("arm", "arm"), ("tau_first", "tau first"), ("tau_last", "tau last"), ("tau_change", "change"),
                 ("wall_s", "wall s/answer"), ("updates", "updates"), ("adapt_s", "adapt s"),
                 ("identical_answers", "= target alone")]
