"""``mmspec bench vlm``: every VLM method and the transformers peer on the bundled tiny VLM, one run.

The same held-out scenes and description questions for every row, one prompt per call (batch 1,
the papers' protocol), greedy, ``max_new_tokens`` with a stop at ``</s>``. One untimed warm-up
call per row. Rows:

- ``none``: our loop, the target alone; ``hf-generate``: transformers' plain ``generate``;
- the peer, transformers' assisted generation: ``hf-assisted`` (``assistant_model=`` the small
  draft VLM, transformers' default schedule) and ``hf-lookup`` (``prompt_lookup_num_tokens=10``);
- ours: ``sd``, ``lookup``, ``eagle``, ``specvlm``, ``vispec``.

Per row: target passes per prompt (NFE, counted by a forward hook on the target, prefill
included), tau = generated tokens per target pass after the prefill, ``(tokens - 1) / (NFE - 1)``
(EAGLE's convention: the bonus token counts; target-only decoding gives 1), tokens per second
over all prompts (prefill included), speed-ups as ratios measured in this run against the faster
target-only row (``none`` or ``hf-generate``) and against ``hf-assisted``, ``greedy_identical`` (every prompt's tokens equal ``none``'s), the
draft's parameters (the shared embedding and LM head of the heads excluded) and its recipe's
training time. ``hf-assisted`` also reports whether the assistant's vision tower ran at all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import methods
from ..training.data.scene_qa import _DESCRIBE, SceneQADataset
from ..training.recipes.common import heldout_seed

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MODALITY = "vlm"
OURS = methods.names(MODALITY)
PEER = ("hf-generate", "hf-assisted", "hf-lookup")
DEEP = {"tree_top_k": 4, "tree_depth": 10, "tree_total_tokens": 16}  # a deeper, narrower tree
# every named VLM method of the registry after the peers, then a deeper tree for each method with tree knobs
DEFAULT_ROWS = (("none",) + PEER + tuple(m for m in OURS if m != "none")
                + tuple((f"{m}-deep", m, DEEP) for m in OURS if set(DEEP) <= set(methods.knobs(MODALITY, m))))
SHOWCASE_ROWS = ("none", "hf-generate", "hf-assisted", "lookup", "eagle", "specvlm", "vispec")


@dataclass
class VLMBenchConfig:
    pipeline_dir: str = str(ASSETS / "vlm")
    rows: tuple = DEFAULT_ROWS
    prompts: int = 24  # held-out scenes, each with a description question
    max_new_tokens: int = 128

    @classmethod
    def quick(cls, **kw) -> "VLMBenchConfig":
        return cls(**{"prompts": 4, **kw})


def bench_prompts(n: int) -> tuple[list, list[str]]:
    """``n`` held-out scenes (images in [0, 1]) with the description questions in turn."""
    data = SceneQADataset(n, heldout_seed(0))
    images = [(data[i][0] + 1) / 2 for i in range(n)]
    return images, [_DESCRIBE[i % len(_DESCRIBE)] for i in range(n)]


class _Counter:
    """Counts forward calls of a module (a hook, removed on exit)."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, *args):
        self.calls += 1

    def __exit__(self, *exc):
        self.handle.remove()


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _train_seconds(folder: Path) -> float | None:
    log = folder / "train_log.json"
    return json.loads(log.read_text()).get("wall_time_s") if log.is_file() else None


def _hf_call(pipe, row: str, image, prompt: str, max_new_tokens: int) -> list[int]:
    ids, vision = pipe.prepare_inputs([image], [prompt])
    input_ids = torch.tensor(ids)
    kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **vision,
              max_new_tokens=max_new_tokens, do_sample=False)
    if row == "hf-assisted":
        kw["assistant_model"] = pipe.draft_model
    elif row == "hf-lookup":
        kw["prompt_lookup_num_tokens"] = 10
    out = pipe.target.generate(**kw)
    return out[0, input_ids.shape[1] :].tolist()


def _drafts(method: str) -> tuple[str, ...]:
    """The pipeline components a row drafts with (the registry's ``requires``; the draft VLM's view
    ``draft`` is the pipeline's ``draft_model``)."""
    if method in PEER:
        return ("draft_model",) if method == "hf-assisted" else ()
    return tuple("draft_model" if c == "draft" else c for c in methods.resolve(MODALITY, method).requires)


def _available(pipe, row: str) -> str | None:
    """Why ``row`` cannot run on this pipeline (a missing component), or None."""
    missing = [c for c in _drafts(row) if getattr(pipe, c) is None]
    return f"no {missing[0]}" if missing else None


def run(cfg: VLMBenchConfig, progress=None) -> dict:
    from transformers import __version__ as transformers_version

    from ..pipelines import SpeculativeVLMPipeline

    say = progress or (lambda msg: None)
    for _, method, knobs in (_spec(r) for r in cfg.rows):  # bad rows fail before the pipeline loads
        if method not in PEER:
            methods.resolve(MODALITY, method, knobs)
    pipe = SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    images, prompts = bench_prompts(cfg.prompts)
    folder = Path(cfg.pipeline_dir)
    notes, specs = [], []
    for label, method, knobs in (_spec(r) for r in cfg.rows):
        missing = _available(pipe, method)
        if missing:
            notes.append(f"{label}: skipped ({missing})")
        else:
            specs.append((label, method, knobs))

    def call(method, knobs, i):
        if method in PEER:
            return _hf_call(pipe, method, images[i], prompts[i], cfg.max_new_tokens), None
        out = pipe(images=[images[i]], prompts=[prompts[i]], method=method, max_new_tokens=cfg.max_new_tokens,
                   method_knobs=knobs or None)
        return out.tokens[0], out.stats

    errors = {}
    for label, method, knobs in specs:  # warm-up, untimed; a peer that cannot run is reported
        try:
            call(method, knobs, 0)
        except Exception as err:
            errors[label] = f"{type(err).__name__}: {err}"
            notes.append(f"{label}: failed on the first prompt: {errors[label]}")
    live = [s for s in specs if s[0] not in errors]
    acc = {label: dict(tokens=[], seconds=0.0, nfe=0, draft_nfe=0, vision=0) for label, _, _ in live}
    for i in range(cfg.prompts):  # prompts outer, rows inner: drifts in machine speed hit every row alike
        say(f"vlm bench: prompt {i + 1}/{cfg.prompts}")
        for label, method, knobs in live:
            a = acc[label]
            vision = _Counter(pipe.draft_model.model.vision_tower) if method == "hf-assisted" else None
            with _Counter(pipe.target.model.language_model) as target_calls:  # our adapter and generate call it
                if vision is not None:
                    vision.__enter__()
                start = time.perf_counter()
                toks, stats = call(method, knobs, i)
                a["seconds"] += time.perf_counter() - start
                if vision is not None:
                    vision.__exit__()
                    a["vision"] += vision.calls
            a["tokens"].append(toks)
            a["nfe"] += target_calls.calls
            a["draft_nfe"] += 0 if stats is None else stats["draft_nfe"]
    rows = []
    for label, method, knobs in specs:
        if label in errors:
            rows.append(dict(method=label, prompts=cfg.prompts, greedy_identical="failed", error=errors[label]))
            continue
        a = acc[label]
        made = sum(map(len, a["tokens"]))
        drafts = _drafts(method)
        draft_params = sum(_params(getattr(pipe, c)) for c in drafts)
        train_s = _train_seconds(folder / drafts[0]) if drafts else None
        rows.append(dict(method=label, knobs=knobs, prompts=cfg.prompts, tokens=made, nfe=a["nfe"] / cfg.prompts,
                         tau=(made - cfg.prompts) / max(1, a["nfe"] - cfg.prompts), seconds=a["seconds"],
                         tokens_per_s=made / a["seconds"],
                         draft_nfe=a["draft_nfe"] / cfg.prompts if method in OURS else None,
                         draft_params=draft_params, draft_train_s=train_s,
                         assistant_sees_image=(a["vision"] > 0) if method == "hf-assisted" else None))
    ref = acc["none"]["tokens"] if "none" in acc else None
    by_name = {r["method"]: r for r in rows if "error" not in r}
    # "target only" is the faster of our loop without a drafter and transformers' plain generate
    alone = [by_name[n]["tokens_per_s"] for n in ("none", "hf-generate") if n in by_name]
    for r in rows:
        if "error" in r:
            continue
        r["greedy_identical"] = None if ref is None else acc[r["method"]]["tokens"] == ref
        r["wall_speedup"] = r["tokens_per_s"] / max(alone) if alone else None
        r["wall_speedup_vs_peer"] = (r["tokens_per_s"] / by_name["hf-assisted"]["tokens_per_s"]
                                     if "hf-assisted" in by_name else None)
    if "hf-assisted" in by_name:
        notes.append("hf-assisted: transformers " + transformers_version + " runs the assistant VLM "
                     + ("with" if by_name["hf-assisted"]["assistant_sees_image"] else "without")
                     + " its image (vision-tower calls counted); it refuses batches larger than 1")
    setup = dict(prompts=cfg.prompts, max_new_tokens=cfg.max_new_tokens, batch_size=1, temperature=0.0,
                 threads=torch.get_num_threads(), transformers=transformers_version,
                 tau="(generated tokens - 1) / (target passes - 1): tokens per pass after the prefill, bonus counted",
                 speedup="tokens/s over the faster target-only row (none or hf-generate) in this run",
                 order="prompts outer, rows inner; one untimed warm-up call per row")
    return dict(bench="vlm", setup=setup, rows=rows, notes=notes)


def _spec(row) -> tuple[str, str, dict]:
    """A row is a method name or ``(label, method, knobs)``."""
    return (row, row, {}) if isinstance(row, str) else tuple(row)


VLM_COLUMNS = [
    ("method", "method"), ("nfe", "NFE/prompt"), ("tau", "tau"), ("tokens_per_s", "tokens/s"),
    ("wall_speedup", "wall x"), ("wall_speedup_vs_peer", "x vs peer"), ("greedy_identical", "greedy ="),
    ("draft_nfe", "draft NFE/prompt"), ("draft_params", "draft params"), ("draft_train_s", "draft train s"),
    ("assistant_sees_image", "assistant sees image"),
]


def public(result: dict) -> dict:
    return result
