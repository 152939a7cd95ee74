"""``mmspec bench continuous``: every continuous-token method on the bundled pipeline, in one run.

As the AR image bench: image i asks for class ``i % 16`` with generator seed ``seed + i``, one
image per call (batch 1), constant CFG 3.0, temperature 1; images outer and rows
inner after one untimed warm-up call per row; diffusion-head rows run the first
``diffusion_images`` images only (each of their tokens costs K sequential head calls). Rows
(``DEFAULT_ROWS``): ``none`` (mixture head, target only), ``sd`` (mixture), ``sd+distill`` (``sd`` with the draft distilled to the target,
the acceptance booster; needs ``booster_dir``), ``none-diffusion`` (the diffusion head's target-only
baseline), ``path`` (diffusion, lossless), ``cspd`` at inner temperature 1, 10 and 42 (lossy),
``sd`` after 5% and 15% target-only warm-up tokens, ``sjd`` (a Jacobi window of 8 on densities, each
position redrawn with its own fixed noise; no draft model), ``sjd-w4``, ``sjd-w6``, ``sjd-w12`` and
``sjd-w16`` (windows 4, 6, 12 and 16: a narrower verify costs less per pass here), ``sjd-mc``
(MC-SJD's maximal coupling) and ``sjd-independent`` (SJD's independent redrafts).

Columns per row: backbone passes per image (``nfe``, prefill included) and ``nfe_speedup`` over
``none``, draft backbone passes (``draft_nfe``), head calls and rows of target and draft
(``head_calls`` is their sum), residual tries and cap fallbacks, acceptance ``alpha``, ``tau``
(tokens per target pass, bonus counted), wall seconds per image and ``wall_speedup`` over ``none``,
quality on the classifier's features: first KID to real images (``kid``; ``kid_real_floor``, the
KID of as many real images) and, against the baseline of the same head (``none`` or
``none-diffusion``, over the same images), ``mmd_vs_none``, a Gaussian-kernel MMD^2, with its
paired permutation p-value ``p_vs_none`` (``quality.mmd_permutation_test``: exact at any image
count, so p < 0.05 in 5% of runs of an exact row), then, secondary, FD (``fd``, ``fd_ratio`` to that baseline,
``fd_real_floor``; biased at these image counts, no test), class accuracy, and ``exact`` /
``exact_p`` for every row but
the baselines: the first ``exact_tokens`` tokens of ``exact_samples`` rows of one class, tested
against the exact guided target by the Rosenblatt (PIT) transform for the mixture head, and by a
two-sample test against ``none-diffusion``'s samples for the diffusion head (``exact`` = p >= 1e-3;
the lossy ``cspd`` rows are tested too, to show what they lose). The joint (dependence) part of
both tests bins the first latent coordinate of every token (``pit_exact_p``,
``two_sample_exact_p``); every coordinate gets a KS test.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import methods
from ..core import DensityProcessor, ModelOutput, SpeculativeDecoder
from ..core.exactness import P_THRESHOLD, grid_chisquare_pvalue, ks_uniform_pvalue, two_sample_pvalue
from ..eval.quality import (PERMUTATION_SEED, PERMUTATIONS, FrechetToReference, ReferenceStats, extract_features,
                           kernel_inception_distance, mmd_permutation_test, reference_features)
from ..methods.continuous import head_for
from ..training.data import ShapesDataset
from ..training.recipes.ar_image import AR_DATA_STYLE
from .ar_image import save_grid

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MODALITY = "continuous"

# (row label, method, knobs, draft): draft "booster" swaps in the distilled draft
DEFAULT_ROWS = (
    ("none", "none", {}, None),
    ("sd", "sd", {}, None),
    ("sd+distill", "sd", {}, "booster"),
    ("none-diffusion", "none-diffusion", {}, None),
    ("path", "path", {}, None),
    ("cspd-t1", "cspd", {"cspd_inner_temperature": 1.0}, None),
    ("cspd-t10", "cspd", {"cspd_inner_temperature": 10.0}, None),
    ("cspd-t42", "cspd", {"cspd_inner_temperature": 42.0}, None),
    ("sd-warmup5", "sd", {"sd_warmup": 0.05}, None),
    ("sd-warmup15", "sd", {"sd_warmup": 0.15}, None),
    ("sjd", "sjd", {}, None),
    ("sjd-w4", "sjd", {"sjd_window": 4}, None),
    ("sjd-w6", "sjd", {"sjd_window": 6}, None),
    ("sjd-w12", "sjd", {"sjd_window": 12}, None),
    ("sjd-w16", "sjd", {"sjd_window": 16}, None),
    ("sjd-mc", "sjd-mc", {}, None),
    ("sjd-independent", "sjd-independent", {}, None),
)
BASELINES = ("none", "none-diffusion")
# the showcase's rows: mixture-head rows only (a diffusion-head image costs seconds: docs/costs.md)
SHOWCASE_ROWS = ("none", "sd", "sd+distill", "sjd")


@dataclass
class ContinuousBenchConfig:
    pipeline_dir: str = str(ASSETS / "continuous")
    booster_dir: str | None = str(ASSETS / "continuous" / "draft_distilled")  # None: skip the booster row
    classifier_dir: str = str(ASSETS / "classifier")
    rows: tuple = DEFAULT_ROWS
    images: int = 128  # image i: class i % 16, seed + i
    # diffusion-head rows run the first this many images only (None: all): a diffusion token costs K
    # sequential head calls, so 128 images of every row would take hours (per-image times measured:
    # docs/costs.md)
    diffusion_images: int | None = 32
    # constant CFG as the VQ bench; on the bundled (conv-tokenizer) target, scale 3 and 4 drew the
    # asked class equally often on held-out seeds (128 images each, seeds 5000..: 0.648 at 3 and 4,
    # 0.531 at 5, 0.44 at 6 over 64), and the lower scale departs less from the model
    guidance_scale: float = 3.0
    guidance_schedule: str = "constant"
    temperature: float = 1.0
    seed: int = 0
    reference_images: int = 1024
    reference_seed: int = 777
    reference_style: str = AR_DATA_STYLE
    exact_samples: int = 4000
    exact_tokens: int = 3
    exact_class: int = 5
    permutations: int = PERMUTATIONS  # of the paired permutation test against the same head's baseline
    permutation_seed: int = PERMUTATION_SEED

    @classmethod
    def quick(cls, **kw) -> "ContinuousBenchConfig":
        return cls(**{"images": 16, "diffusion_images": 8, "reference_images": 256, "exact_samples": 1000, **kw})


def _short(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"


def load(cfg: ContinuousBenchConfig):
    from ..models import load_checkpoint
    from ..models.classifier import ShapesClassifier
    from ..models.continuous import ContinuousARModel
    from ..pipelines import SpeculativeContinuousARPipeline

    pipe = SpeculativeContinuousARPipeline.from_pretrained(cfg.pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    booster = None if cfg.booster_dir is None else load_checkpoint(ContinuousARModel, cfg.booster_dir)
    return pipe, booster, load_checkpoint(ShapesClassifier, cfg.classifier_dir)


@contextlib.contextmanager
def _draft(pipe, draft):
    """The pipeline with ``draft`` as its draft model for the block (the booster row)."""
    if draft is None:
        yield pipe
        return
    original = pipe.draft_model
    pipe.register_modules(draft_model=draft)
    try:
        yield pipe
    finally:
        pipe.register_modules(draft_model=original)


def _density(cfg: ContinuousBenchConfig, recipe) -> DensityProcessor:
    return DensityProcessor(cfg.temperature, cfg.guidance_scale, cfg.guidance_schedule, head=head_for(recipe))


@torch.no_grad()
def first_tokens(pipe, draft, method: str, knobs: dict, cfg: ContinuousBenchConfig, seed: int) -> torch.Tensor:
    """(exact_samples, exact_tokens, 2, d) tokens of class ``exact_class`` (the first
    ``exact_tokens`` of an image generated with that many tokens; the CFG schedule over them)."""
    model = pipe.transformer
    recipe = methods.resolve(MODALITY, method, knobs)
    parts = methods.build(recipe, {"target": model, "draft_model": draft if draft is not None else pipe.draft_model})
    dec = SpeculativeDecoder(model, parts.drafter, rule=parts.rule, processor=_density(cfg, recipe))
    n = cfg.exact_samples
    out = dec.generate(model.class_prompts([cfg.exact_class] * n), cfg.exact_tokens,
                       uncond_input_ids=model.uncond_prompts(n), generator=torch.Generator().manual_seed(seed))
    return out.sequences


@torch.no_grad()
def mixture_pit(model, tokens: torch.Tensor, cfg: ContinuousBenchConfig) -> torch.Tensor:
    """(n, k d) Rosenblatt uniforms of the tokens' latents under the exact processed (guided,
    tempered) mixture of the target, from a cache-free forward on each prefix."""
    n, k, _, d = tokens.shape
    pipe = DensityProcessor(cfg.temperature, cfg.guidance_scale, cfg.guidance_schedule, head="mixture")

    def feats(cls: int):
        ids = torch.cat([torch.full((n, 1, 2, d), float(cls), dtype=tokens.dtype), tokens[:, :-1]], 1)
        return model(ids)

    out = feats(cfg.exact_class)
    out = ModelOutput(logits=None, cond=torch.cat([out.cond, feats(model.null_class).cond]), heads=out.heads)
    dist = pipe(out, torch.arange(k).expand(n, k), k)
    return dist.rosenblatt(tokens[..., 1, :].double()).reshape(n, -1)


def pit_exact_p(u: torch.Tensor) -> float:
    """Exactness p-value of Rosenblatt uniforms u (n, k tokens, d): the smaller of KS per coordinate
    (Bonferroni over k d) and a grid chi-square on the first coordinate of every token (3^k cells:
    dependence between tokens, e.g. a missing truncation; a grid over all k d coordinates would need
    more samples than its 3^(k d) cells)."""
    return min(ks_uniform_pvalue(u.flatten(1)), grid_chisquare_pvalue(u[..., 0]))


def two_sample_exact_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample p-value of latents a (n, k, d) and b (m, k, d): the smaller of ``two_sample_pvalue``
    on the first coordinate of every token (its joint grid over 3^k cells) and two-sample KS per
    coordinate, Bonferroni over k d."""
    from scipy import stats

    a2, b2 = a.double().flatten(1).numpy(), b.double().flatten(1).numpy()
    ks = min(1.0, a2.shape[1] * min(stats.ks_2samp(a2[:, j], b2[:, j]).pvalue for j in range(a2.shape[1])))
    return min(ks, two_sample_pvalue(a[..., 0], b[..., 0]))


def _call(pipe, cfg: ContinuousBenchConfig, method: str, knobs: dict, label: int, seed: int):
    return pipe(class_labels=[label], method=method, method_knobs=knobs, guidance_scale=cfg.guidance_scale,
                guidance_schedule=cfg.guidance_schedule, temperature=cfg.temperature,
                generator=torch.Generator().manual_seed(seed), output_type="latent")


STAT_KEYS = ("nfe", "draft_nfe", "tau", "alpha", "target_head_calls", "target_head_rows", "draft_head_calls",
             "draft_head_rows", "residual_rows", "residual_tries", "residual_fallbacks")


@torch.no_grad()
def run(cfg: ContinuousBenchConfig, progress=None) -> dict:
    """One run over every row (images outer, rows inner, one untimed warm-up call per row)."""
    say = progress or (lambda msg: None)
    rows_cfg = tuple(r for r in cfg.rows if r[3] != "booster" or cfg.booster_dir is not None)
    recipes = [methods.resolve(MODALITY, method, knobs) for _, method, knobs, _ in rows_cfg]  # fail before loading
    pipe, booster, classifier = load(cfg)
    drafts = {None: None, "booster": booster}
    labels = [i % pipe.num_classes for i in range(cfg.images)]
    n_diff = cfg.images if cfg.diffusion_images is None else min(cfg.images, cfg.diffusion_images)
    counts = [n_diff if head_for(r) == "diffusion" else cfg.images for r in recipes]
    say(f"reference features of {cfg.reference_images} real images")
    real = reference_features(classifier, ShapesDataset(cfg.reference_images, cfg.reference_seed,
                                                     classifier.config.sample_size, style=cfg.reference_style))
    fd_ref = FrechetToReference(ReferenceStats.from_features(real))
    floors = {n: _real_floor(classifier, cfg, fd_ref, real, n) for n in sorted(set(counts))}
    for label, method, knobs, draft in rows_cfg:
        say(f"{label}: warm-up call")
        with _draft(pipe, drafts[draft]):
            _call(pipe, cfg, method, knobs, labels[0], cfg.seed)
    M = len(rows_cfg)
    latents, stats, walls = ([[] for _ in range(M)] for _ in range(3))
    for i, c in enumerate(labels):
        if i % 8 == 0:
            say(f"images {i}..{min(i + 8, cfg.images) - 1} of {cfg.images}, {M} rows each")
        for m, (label, method, knobs, draft) in enumerate(rows_cfg):
            if i >= counts[m]:
                continue
            with _draft(pipe, drafts[draft]):
                start = time.perf_counter()
                out = _call(pipe, cfg, method, knobs, c, cfg.seed + i)
                walls[m].append(time.perf_counter() - start)
            latents[m].append(out.latents)
            stats[m].append(out.stats)

    reference_diffusion = None
    if cfg.exact_samples and any(head_for(r) == "diffusion" and row[0] not in BASELINES
                                 for r, row in zip(recipes, rows_cfg)):
        say(f"none-diffusion: {cfg.exact_samples} reference samples for the two-sample tests")
        reference_diffusion = first_tokens(pipe, None, "none-diffusion", {}, cfg, cfg.seed + 1)[..., 1, :]
    target = torch.tensor(labels)
    rows, grids, all_feats = [], {}, []
    for m, ((label, method, knobs, draft), recipe) in enumerate(zip(rows_cfg, recipes)):
        images = pipe.tokenizer.decode(torch.cat(latents[m])).clamp(-1, 1)
        feats = extract_features(classifier, images)
        all_feats.append(feats)
        row = {"method": label, "composition": method, "knobs": _short(knobs), "draft": draft or "draft_model",
               "head": head_for(recipe), "lossless": recipe.lossless, "images": counts[m],
               "fd_real_floor": floors[counts[m]][0], "kid_real_floor": floors[counts[m]][1],
               **{k: statistics.fmean(float(s.get(k) or 0.0) for s in stats[m]) for k in STAT_KEYS},
               "wall_s": statistics.fmean(walls[m]), "kid": kernel_inception_distance(feats, real),
               "fd": fd_ref(feats),
               "class_acc": float((classifier.head(feats).argmax(-1) == target[: counts[m]]).double().mean())}
        row["head_calls"] = row["target_head_calls"] + row["draft_head_calls"]
        row["head_rows"] = row["target_head_rows"] + row["draft_head_rows"]
        if cfg.exact_samples and label not in BASELINES:
            say(f"{label}: distribution test, {cfg.exact_samples} samples of {cfg.exact_tokens} tokens")
            toks = first_tokens(pipe, drafts[draft], method, knobs, cfg, cfg.seed + 2)
            if row["head"] == "mixture":
                p = pit_exact_p(mixture_pit(pipe.transformer, toks, cfg).view(toks.shape[0], cfg.exact_tokens, -1))
            else:
                p = two_sample_exact_p(reference_diffusion, toks[..., 1, :])
            row["exact_p"], row["exact"] = float(p), bool(p >= P_THRESHOLD)
        else:
            row["exact_p"], row["exact"] = None, None
        rows.append(row)
        grids[label] = images
    base = rows[0]
    head_base = {r["head"]: m for m, r in reversed(list(enumerate(rows))) if r["method"] in BASELINES}
    for row, feats in zip(rows, all_feats):
        row["nfe_speedup"] = base["nfe"] / row["nfe"]
        row["wall_speedup"] = base["wall_s"] / row["wall_s"]
        # FD depends on the image count and the test pairs image i: compare with the same head's baseline
        b = head_base.get(row["head"], 0)
        same = rows[b]
        paired = same["images"] == row["images"]
        row["fd_ratio"] = row["fd"] / same["fd"] if paired else float("nan")
        row["mmd_vs_none"], row["p_vs_none"] = mmd_permutation_test(
            feats, all_feats[b], cfg.permutations, cfg.permutation_seed) if paired and row is not same else (None, None)
    setup = {"pipeline": cfg.pipeline_dir, "booster": cfg.booster_dir, "classifier": cfg.classifier_dir,
             "images": cfg.images, "guidance_scale": cfg.guidance_scale, "guidance_schedule": cfg.guidance_schedule,
             "temperature": cfg.temperature, "seed": cfg.seed, "reference_images": cfg.reference_images,
             "reference_style": cfg.reference_style, "diffusion_images": n_diff,
             "fd_real_floor": floors[cfg.images][0], "kid_real_floor": floors[cfg.images][1],
             "permutations": cfg.permutations, "permutation_seed": cfg.permutation_seed,
             "exact_samples": cfg.exact_samples,
             "exact_tokens": cfg.exact_tokens, "exact_class": cfg.exact_class, "exact_threshold": P_THRESHOLD,
             "wall_order": "images outer, rows inner; one untimed warm-up call per row",
             "torch_threads": torch.get_num_threads()}
    return {"bench": "continuous", "setup": setup, "rows": rows, "_grids": grids, "_labels": labels}


def _real_floor(classifier, cfg: ContinuousBenchConfig, fd_ref: FrechetToReference, real,
                n: int) -> tuple[float, float]:
    """FD and KID of ``n`` real images (as many as a row generates): the metrics' floors at that size."""
    data = ShapesDataset(n, cfg.reference_seed + 1, classifier.config.sample_size, style=cfg.reference_style)
    feats = extract_features(classifier, torch.stack([data[i][0] for i in range(n)]))
    return fd_ref(feats), kernel_inception_distance(feats, real)


CONTINUOUS_COLUMNS = [
    ("method", "method"), ("knobs", "knobs"), ("head", "head"), ("nfe", "NFE/img"), ("nfe_speedup", "NFE x"),
    ("draft_nfe", "draft NFE/img"), ("target_head_calls", "t head calls"), ("target_head_rows", "t head rows"),
    ("draft_head_calls", "d head calls"), ("draft_head_rows", "d head rows"), ("residual_tries", "res tries"),
    ("residual_fallbacks", "res fallbacks"), ("alpha", "alpha"), ("tau", "tau"), ("wall_s", "wall s/img"),
    ("wall_speedup", "wall x"), ("kid", "KID"), ("mmd_vs_none", "MMD to none"), ("p_vs_none", "p vs none"),
    ("fd", "FD"), ("fd_ratio", "FD x"), ("class_acc", "class acc"), ("exact", "exact"),
    ("exact_p", "exact p"),
]


SHOWCASE_COLUMNS = [c for c in CONTINUOUS_COLUMNS if c[0] in (
    "method", "nfe", "nfe_speedup", "draft_nfe", "alpha", "tau", "wall_s", "wall_speedup", "kid", "p_vs_none",
    "fd", "fd_ratio",
    "class_acc", "exact")]


def public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


__all__ = ["CONTINUOUS_COLUMNS", "ContinuousBenchConfig", "DEFAULT_ROWS", "SHOWCASE_COLUMNS", "SHOWCASE_ROWS", "first_tokens", "mixture_pit", "pit_exact_p", "public",
           "run", "save_grid", "two_sample_exact_p"]
