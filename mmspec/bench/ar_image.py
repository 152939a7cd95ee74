"""``mmspec bench ar-image``: every AR image method on the bundled checkpoints, in one run.

The same classes and seeds for every method: image i asks for class ``i % 16`` with generator
seed ``seed + i``, one image per call (batch 1: the latency setting speculative decoding is
for). Images are the outer loop and methods the inner one, after one untimed warm-up call per
method, so no method's wall clock is favoured by running first or in a quiet stretch. Per method:
target passes (NFE) per image, draft passes per image, tokens per target pass (tau), CPU wall time
per image, both as ratios to ``none`` measured in this run, and quality on the recipe-trained
classifier's features.

Primary quality figures: ``kid``, KID to the real procedural images
with a bootstrap 95% interval (``kid_ci_low``/``kid_ci_high``) that resamples the generated and
the real images; ``mmd_vs_none``, a Gaussian-kernel MMD^2 between the method's images and
``none``'s, and ``p_vs_none``, its paired permutation p-value (``quality.mmd_permutation_test``:
``permutations`` swaps of image i between the two, numpy ``default_rng(permutation_seed)``;
KID's cubic kernel had too little power here): exact at any image count, so an exact method
scores p < 0.05 in 5% of runs and a small p flags a change of distribution (one p per row: with
six exact rows, one of them below 0.05 is expected in about a quarter of runs; divide 0.05 by
the rows read together). Secondary: FD
(``fd_ci_low``/``fd_ci_high``, re-centred on the estimate, see ``stats.centred_interval``), the
FD ratio to ``none`` with a paired bootstrap interval (measured on synthetic features at 32
images it held 1.0 for 79% of exact pairs, not 95%: it is biased at small N, read it as a rough
size, not a test), and class accuracy (percentile interval). Bootstraps use
``bootstrap_resamples`` resamples, numpy ``default_rng(bootstrap_seed)``, one index matrix for all
methods (image i of every method shares class and seed), ``bootstrap_seed + 1`` for the real
set. The setup carries the baseline's FD and KID beside their real-vs-real floors (as many real
images as generated ones).

How many images: the permutation test is calibrated at any N; its power grows with N (on
synthetic 128-wide features at N = 32 it flagged a pre-ReLU shift of 0.2 within-class sd in 92%
of runs, a within-class spread narrowed to 0.6 in all; on the bundled checkpoints at N = 128 it
gave ``lantern-per-test`` p 0.0005, ``lantern++`` 0.001, ``zipar+gsd-s2`` 0.006, ``sjd`` 0.97,
``eagle`` 0.10, with 2,000 permutations). For FD, at the default 128 (bundled target before its
retraining) ``none`` scored FD 88.5 [65.4, 116.6] and the exact ``sjd`` an FD ratio of 0.84
[0.56, 1.26], so exact methods cannot be told from a 1.15x loss by FD below about
``--images 1024``.

Lossless methods also get ``exact``: the first two image tokens of N sampled rows (same class,
CFG on) against the exact guided distribution of the second token, a 512-cell chi-square at
p >= 1e-3 (the second token is the first one a draft can decide).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import methods
from ..core import LogitsProcessor, SpeculativeDecoder
from ..core.exactness import P_THRESHOLD, chisquare_pvalue
from ..core.schedule import NextSetSchedule
from ..eval.quality import (PERMUTATION_SEED, PERMUTATIONS, FrechetToReference, KIDToReference, ReferenceStats,
                           extract_features, fd_replicates, kid_interval, mmd_permutation_test, reference_features)
from ..eval.stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CI_LEVEL, bootstrap_indices, centred_interval, mean_ci
from ..training.data import ShapesDataset
from ..training.recipes.ar_image import AR_DATA_STYLE

EXACT_CHUNK = 1000
ASSETS = Path(__file__).resolve().parents[2] / "assets"

MODALITY = "ar-image"
# knobs the bench runs a named method with (the papers' defaults otherwise) ...
BENCH_KNOBS = {"zipar+sjd": {"zipar_window": 4}, "zipar+gsd": {"zipar_window": 4},
               "zipar+sjd+lantern": {"zipar_window": 4}}
# ... and extra rows, (label, method, knobs), each listed after its method's row
VARIANTS = {
    "lantern": (("lantern-per-test", "lantern", {"lantern_budget": "per-test"}),
                ("lantern++", "lantern", {"lantern_lam": 5.0, "lantern_k": 10})),
    "sjd+lantern": (("sjd+lantern-per-test", "sjd+lantern", {"lantern_budget": "per-test"}),),
    "sjd": (("sjd-spatial", "sjd", {"sjd_init": "spatial"}),),
    "zipar": (("zipar-s4", "zipar", {"zipar_window": 4}),),
    "zipar+gsd": (("zipar+gsd-s2", "zipar+gsd", {"zipar_window": 2}),),
}
# (row label, method, knobs): every named AR image method of the registry, then its variants
DEFAULT_METHODS = tuple(row for m in methods.names(MODALITY)
                        for row in ((m, m, BENCH_KNOBS.get(m, {})),) + VARIANTS.get(m, ()))

SHOWCASE_METHODS = tuple(m for m in DEFAULT_METHODS if m[0] in ("none", "medusa", "sjd", "gsd", "lantern", "zipar+gsd"))


@dataclass
class ARImageBenchConfig:
    pipeline_dir: str = str(ASSETS / "ar-image")
    classifier_dir: str = str(ASSETS / "classifier")
    methods: tuple = DEFAULT_METHODS
    images: int = 128  # image i: class i % 16, seed + i
    guidance_scale: float = 2.0
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0
    reference_images: int = 1024  # real images for FD and KID
    reference_seed: int = 777
    reference_style: str = AR_DATA_STYLE  # the scenes the bundled target was trained on
    exact_samples: int = 8_000
    exact_class: int = 5
    bootstrap_resamples: int = BOOTSTRAP_RESAMPLES  # paired over image indices, numpy default_rng
    bootstrap_seed: int = BOOTSTRAP_SEED
    permutations: int = PERMUTATIONS  # of the paired permutation test against none
    permutation_seed: int = PERMUTATION_SEED

    @classmethod
    def quick(cls, **kw) -> "ARImageBenchConfig":
        kw = {"images": 16, "bootstrap_resamples": 200, **kw}
        return cls(exact_samples=0, reference_images=512, **kw)


def _short(knobs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"


def load(cfg: ARImageBenchConfig):
    from ..models import load_checkpoint
    from ..models.classifier import ShapesClassifier
    from ..pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(cfg.pipeline_dir)
    pipe.set_progress_bar_config(disable=True)
    classifier = load_checkpoint(ShapesClassifier, cfg.classifier_dir)
    return pipe, classifier


@torch.no_grad()
def second_token_pvalue(pipe, method: str, knobs: dict, cfg: ARImageBenchConfig) -> float:
    """Chi-square p-value of the second generated token of ``cfg.exact_samples`` rows against its
    exact guided marginal ``sum_x1 p(x1) p(x2 | x1)`` (computed with V + 1 target passes)."""
    model = pipe.transformer
    V = model.vocab_size
    logits = LogitsProcessor(temperature=cfg.temperature, top_k=cfg.top_k, guidance_scale=cfg.guidance_scale)
    c, u = cfg.exact_class, model.null_class
    first = logits(torch.cat([model(torch.tensor([[c]])).logits[:, -1], model(torch.tensor([[u]])).logits[:, -1]]))
    x1 = torch.arange(V)[:, None]
    cond = model(torch.cat([torch.full((V, 1), c), x1], 1)).logits[:, -1]
    uncond = model(torch.cat([torch.full((V, 1), u), x1], 1)).logits[:, -1]
    second = logits(torch.cat([cond, uncond]))  # (V, V): p(x2 | x1)
    marginal = (first[0].double()[:, None] * second.double()).sum(0)
    recipe = methods.resolve(MODALITY, method, knobs)
    parts = methods.build(recipe, pipe.method_components(recipe.requires))
    dec = SpeculativeDecoder(model, parts.drafter, rule=parts.rule, processor=logits)
    g = torch.Generator().manual_seed(cfg.seed + 12345)
    samples = []
    for start in range(0, cfg.exact_samples, EXACT_CHUNK):  # chunks bound the memory of big trees
        n = min(EXACT_CHUNK, cfg.exact_samples - start)
        out = dec.generate(model.class_prompts([c] * n), 2, uncond_input_ids=model.uncond_prompts(n), generator=g)
        samples.append(out.sequences[:, 1].cpu())
    return chisquare_pvalue(torch.cat(samples), marginal)


def _call(pipe, cfg: ARImageBenchConfig, method: str, knobs: dict, label: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return pipe(class_labels=[label], method=method, method_knobs=knobs, guidance_scale=cfg.guidance_scale,
                temperature=cfg.temperature, top_k=cfg.top_k, generator=g, output_type="latent")


@torch.no_grad()
def run(cfg: ARImageBenchConfig, progress=None) -> dict:
    """Images outer, methods inner: image i is generated by every method in turn, so a slow or
    fast stretch of the machine (another process, thermal state) lands on all methods alike; one
    untimed warm-up call per method first (image 0's call: allocator, caches, lazy tables such as
    LANTERN's neighbours are built there, not in a timed call)."""
    say = progress or (lambda msg: None)
    # bad methods or knobs fail before any model loads
    recipes = [methods.resolve(MODALITY, method, knobs) for _, method, knobs in cfg.methods]
    pipe, classifier = load(cfg)
    model = pipe.transformer
    num_classes = model.config.num_classes
    labels = [i % num_classes for i in range(cfg.images)]
    say(f"reference features of {cfg.reference_images} real images")
    real = reference_features(classifier, ShapesDataset(cfg.reference_images, cfg.reference_seed,
                                                     classifier.config.sample_size, style=cfg.reference_style))
    fd_ref = FrechetToReference(ReferenceStats.from_features(real))
    idx = bootstrap_indices(cfg.images, cfg.bootstrap_resamples, cfg.bootstrap_seed)
    kid_ref = KIDToReference(real, idx, bootstrap_indices(cfg.reference_images, cfg.bootstrap_resamples,
                                                          cfg.bootstrap_seed + 1))
    floor, floor_reps, kid_floor = _real_floor(classifier, cfg, fd_ref, kid_ref, idx)

    for label, method, knobs in cfg.methods:
        say(f"{label}: warm-up call")
        _call(pipe, cfg, method, knobs, labels[0], cfg.seed)
    M = len(cfg.methods)
    tokens, nfe, draft, taus, walls = ([[] for _ in range(M)] for _ in range(5))
    for i, c in enumerate(labels):
        if i % 8 == 0:
            say(f"images {i}..{min(i + 8, cfg.images) - 1} of {cfg.images}, {M} methods each")
        for m, (label, method, knobs) in enumerate(cfg.methods):
            start = time.perf_counter()
            out = _call(pipe, cfg, method, knobs, c, cfg.seed + i)
            walls[m].append(time.perf_counter() - start)
            tokens[m].append(out.tokens)
            nfe[m].append(out.stats["nfe"])
            draft[m].append(out.stats["draft_nfe"])
            taus[m].append(out.stats["tau"])

    rows, grids, fd_reps, all_feats = [], {}, [], []
    target = torch.tensor(labels)
    for m, ((label, method, knobs), recipe) in enumerate(zip(cfg.methods, recipes)):
        images = pipe.vqvae.decode(torch.cat(tokens[m])).clamp(-1, 1)
        feats = extract_features(classifier, images)
        correct = (classifier.head(feats).argmax(-1) == target).double().numpy()
        fd = fd_ref(feats)
        reps = fd_replicates(feats, fd_ref, idx)
        fd_reps.append(reps)
        all_feats.append(feats)
        fd_low, fd_high = centred_interval(reps, fd, lower=0.0)
        acc_low, acc_high = mean_ci(correct, idx)
        kid, kid_low, kid_high = kid_interval(kid_ref.replicates(feats))
        row = {"method": label, "composition": method, "knobs": _short(knobs),
               "nfe": statistics.fmean(nfe[m]), "draft_nfe": statistics.fmean(draft[m]),
               "tau": statistics.fmean(taus[m]), "wall_s": statistics.fmean(walls[m]),
               "kid": kid, "kid_ci_low": kid_low, "kid_ci_high": kid_high, "fd": fd,
               "fd_ci_low": fd_low, "fd_ci_high": fd_high, "class_acc": float(correct.mean()),
               "class_acc_ci_low": acc_low, "class_acc_ci_high": acc_high, "lossless": recipe.lossless}
        if recipe.parts == ("zipar",):
            g = model.config.grid_size
            row["nfe_closed_form"] = NextSetSchedule.closed_form_nfe(g, g, recipe.knobs["zipar_window"])
        if row["lossless"] and recipe.parts and cfg.exact_samples:  # the baseline needs no test
            say(f"{label}: distribution test, {cfg.exact_samples} samples")
            p = second_token_pvalue(pipe, method, knobs, cfg)
            row["exact_p"] = p
            row["exact"] = p >= P_THRESHOLD
        rows.append(row)
        grids[label] = images
    base = rows[0]
    for row, reps, feats in zip(rows, fd_reps, all_feats):
        row["nfe_speedup"] = base["nfe"] / row["nfe"]
        row["wall_speedup"] = base["wall_s"] / row["wall_s"]
        # the baseline against itself needs no test
        row["mmd_vs_none"], row["p_vs_none"] = (None, None) if row is base else mmd_permutation_test(
            feats, all_feats[0], cfg.permutations, cfg.permutation_seed)
        row["fd_ratio"] = row["fd"] / base["fd"]
        # paired: replicate r resamples the same image indices (same classes, same seeds) in both
        row["fd_ratio_ci_low"], row["fd_ratio_ci_high"] = centred_interval(reps / fd_reps[0], row["fd_ratio"],
                                                                           log=True)
        row["class_acc_delta"] = 100 * (row["class_acc"] - base["class_acc"])
    floor_low, floor_high = centred_interval(floor_reps, floor, lower=0.0)
    setup = {"pipeline": cfg.pipeline_dir, "classifier": cfg.classifier_dir, "images": cfg.images,
             "guidance_scale": cfg.guidance_scale, "temperature": cfg.temperature, "top_k": cfg.top_k,
             "seed": cfg.seed, "reference_images": cfg.reference_images, "reference_style": cfg.reference_style,
             "fd_baseline": base["fd"], "fd_baseline_ci": [base["fd_ci_low"], base["fd_ci_high"]],
             "fd_real_floor": floor, "fd_real_floor_ci": [floor_low, floor_high],
             "kid_baseline": base["kid"], "kid_baseline_ci": [base["kid_ci_low"], base["kid_ci_high"]],
             "kid_real_floor": kid_floor[0], "kid_real_floor_ci": list(kid_floor[1:]),
             "bootstrap_resamples": cfg.bootstrap_resamples, "bootstrap_seed": cfg.bootstrap_seed,
             "permutations": cfg.permutations, "permutation_seed": cfg.permutation_seed,
             "ci_level": CI_LEVEL, "wall_order": "images outer, methods inner; one untimed warm-up call per method",
             "exact_samples": cfg.exact_samples, "exact_threshold": P_THRESHOLD,
             "torch_threads": torch.get_num_threads(), "mean_top1_prob": _mean_top1(pipe, cfg)}
    return {"bench": "ar-image", "setup": setup, "rows": rows, "_grids": grids, "_labels": labels}


def _real_floor(classifier, cfg, fd_ref: FrechetToReference, kid_ref: KIDToReference, idx):
    """FD of as many *real* images as the run generates, its bootstrap replicates, and their KID
    with its interval: the metrics' floors at that size, what a perfect generator would score."""
    data = ShapesDataset(cfg.images, cfg.reference_seed + 1, classifier.config.sample_size, style=cfg.reference_style)
    images = torch.stack([data[i][0] for i in range(cfg.images)])
    feats = extract_features(classifier, images)
    return fd_ref(feats), fd_replicates(feats, fd_ref, idx), kid_interval(kid_ref.replicates(feats))


@torch.no_grad()
def _mean_top1(pipe, cfg: ARImageBenchConfig, n: int = 8) -> float:
    """The target's mean top-1 probability (guided, processed) along its own samples."""
    model = pipe.transformer
    logits = LogitsProcessor(temperature=cfg.temperature, top_k=cfg.top_k, guidance_scale=cfg.guidance_scale)
    labels = list(range(n))
    out = SpeculativeDecoder(model, processor=logits).generate(
        model.class_prompts(labels), model.num_image_tokens, uncond_input_ids=model.uncond_prompts(n),
        generator=torch.Generator().manual_seed(cfg.seed))
    seq = torch.cat([torch.tensor(model.class_prompts(labels)), out.sequences[:, :-1]], 1)
    useq = torch.cat([torch.tensor(model.uncond_prompts(n)), out.sequences[:, :-1]], 1)
    probs = logits(torch.cat([model(seq).logits, model(useq).logits]))
    return float(probs.max(-1).values.mean())


AR_IMAGE_COLUMNS = [
    ("method", "method"), ("knobs", "knobs"), ("nfe", "NFE/img"), ("nfe_speedup", "NFE x"),
    ("wall_s", "wall s/img"), ("wall_speedup", "wall x"), ("tau", "tau"), ("draft_nfe", "draft NFE/img"),
    ("kid", "KID"), ("kid_ci_low", "KID lo"), ("kid_ci_high", "KID hi"), ("mmd_vs_none", "MMD to none"),
    ("p_vs_none", "p vs none"), ("fd", "FD"), ("fd_ci_low", "FD lo"), ("fd_ci_high", "FD hi"), ("fd_ratio", "FD x"),
    ("fd_ratio_ci_low", "FD x lo"), ("fd_ratio_ci_high", "FD x hi"), ("class_acc", "class acc"),
    ("class_acc_ci_low", "acc lo"), ("class_acc_ci_high", "acc hi"), ("exact", "exact"),
]


def save_grid(result: dict, path: str | Path, per_row: int = 16) -> None:
    """A PNG: one row of samples per method (the first ``per_row`` images, fewer if a method has
    fewer), labelled on stdout by the caller; written atomically (``save_image_grid``)."""
    from ..utils.images import save_image_grid

    grids = result["_grids"]
    per_row = min(per_row, *(len(images) for images in grids.values()))
    images = torch.cat([images[:per_row] for images in grids.values()])  # (methods * per_row, 3, H, W)
    save_image_grid(((images + 1) / 2).clamp(0, 1), path, nrow=per_row)


def public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


__all__ = ["ARImageBenchConfig", "AR_IMAGE_COLUMNS", "DEFAULT_METHODS", "SHOWCASE_METHODS", "run", "save_grid", "public"]
