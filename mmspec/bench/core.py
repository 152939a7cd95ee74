"""``mmspec bench core``: the speculation core on synthetic draft/target pairs, in one run.

Three parts, every figure measured here:

1. *layer-skip pair* (a 12-layer random target, a 2-layer early-exit draft): every core method
   against target-only decoding on the same prompts and seed, greedy and sampled. Greedy rows are
   ``exact`` when their tokens equal the baseline's bit for bit.
2. *exactness*: for sampled rows, ``exact`` is a chi-square test of the first three tokens
   against the exact target distribution on an 8-token pair (N samples, p >= 1e-3), run here.
3. *i.i.d. pairs*: measured tau beside Leviathan et al.'s formula for several alpha and gamma.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch
from .. import methods
from ..core import LogitsProcessor, SpeculativeDecoder
from ..core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index
from .synthetic import (IIDDrafter, IIDTarget, expected_tau, iid_pair_distributions, layer_skip_pair,
                        small_vocab_pair)


@dataclass
class CoreBenchConfig:
    """Sizes of one run; ``quick()`` is the showcase's smaller version."""

    prompts: int = 4
    new_tokens: int = 128
    exact_samples: int = 20_000
    iid_rows: int = 2_000
    iid_tokens: int = 120
    alphas: tuple = (0.6, 0.8, 0.9)
    gammas: tuple = (2, 4, 8)
    seed: int = 0
    repeats: int = 3  # wall time is the median of this many runs

    @classmethod
    def quick(cls) -> "CoreBenchConfig":
        return cls(new_tokens=64, iid_rows=1_000, iid_tokens=80, alphas=(0.8,), gammas=(4,), repeats=1)


MODALITY = "text"
METHODS = methods.names(MODALITY)
"""The layer-skip rows: the text modality's named methods (``mmspec.methods.text``)."""


def _what(method: str) -> str:
    """The row's description: the method's doc and its resolved knobs."""
    recipe = methods.resolve(MODALITY, method)
    knobs = " ".join(f"{k}={v}" for k, v in recipe.knobs.items())
    return f"{recipe.doc}, {knobs}" if knobs else recipe.doc


def _drafter(method: str, target, draft):
    return methods.build(methods.resolve(MODALITY, method), {"target": target, "draft_model": draft}).drafter


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _timed_generate(dec, prompts, n, seed, repeats):
    """Warm up once (first calls pay one-off allocation costs), then the median of ``repeats``
    timed runs with the same seed (so every repeat produces the same tokens)."""
    dec.generate(prompts, min(n, 4), generator=torch.Generator().manual_seed(seed))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = dec.generate(prompts, n, generator=torch.Generator().manual_seed(seed))
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def exactness_pvalue(method: str, samples: int, seed: int) -> float:
    """The core's distribution test for one method on the 8-token pair."""
    target, draft = small_vocab_pair(seed)
    prompt, n, pipeline = [3, 1, 4], 3, LogitsProcessor(temperature=1.0)
    dec = SpeculativeDecoder(target, _drafter(method, target, draft), processor=pipeline)
    out = dec.generate(torch.tensor([prompt]).expand(samples, -1), n, generator=torch.Generator().manual_seed(seed))
    joint = exact_joint(target, prompt, n, pipeline)
    return chisquare_pvalue(sequence_index(out.sequences[:, :n], target.vocab_size), joint)


def run(config: CoreBenchConfig | None = None, progress=None) -> dict:
    """Run the benchmark; returns ``{"bench": "core", "rows": [...], "setup": {...}}``."""
    cfg = config or CoreBenchConfig()
    say = progress or (lambda msg: None)
    target, draft = layer_skip_pair()
    V = target.vocab_size
    prompts = _prompts(cfg.prompts, V, cfg.seed)
    rows = []
    for temperature in (0.0, 1.0):
        pipeline = LogitsProcessor(temperature=temperature)
        base_out = base_time = None
        for name in METHODS:
            say(f"core: {name} at temperature {temperature}")
            dec = SpeculativeDecoder(target, _drafter(name, target, draft), processor=pipeline)
            out, seconds = _timed_generate(dec, prompts, cfg.new_tokens, cfg.seed, cfg.repeats)
            if name == "none":
                base_out, base_time = out, seconds
                exact, pval = None, None
            elif temperature == 0:
                exact, pval = bool(torch.equal(out.sequences, base_out.sequences)), None
            else:
                pval = exactness_pvalue(name, cfg.exact_samples, cfg.seed)
                exact = pval >= P_THRESHOLD
            rows.append({
                "method": name, "pair": "layer-skip", "temperature": temperature, "what": _what(name),
                "nfe": out.stats.nfe_per_sample, "batch_nfe": out.stats.target_forwards,
                "draft_nfe": out.stats.draft_forwards,
                "nfe_speedup": base_out.stats.nfe_per_sample / out.stats.nfe_per_sample,
                "wall_seconds": seconds, "wall_speedup": base_time / seconds,
                "tau": out.stats.tau, "exact": exact, "exact_pvalue": pval,
                "tokens_per_sample": cfg.new_tokens,
            })
    for alpha, gamma in itertools.product(cfg.alphas, cfg.gammas):
        say(f"core: iid alpha={alpha} gamma={gamma}")
        p, q = iid_pair_distributions(alpha)
        ids = torch.zeros(cfg.iid_rows, 1, dtype=torch.long)
        base, base_time = _timed_generate(SpeculativeDecoder(IIDTarget(p)), ids, cfg.iid_tokens, cfg.seed, 1)
        out, seconds = _timed_generate(SpeculativeDecoder(IIDTarget(p), IIDDrafter(q, gamma)), ids,
                                       cfg.iid_tokens, cfg.seed, 1)
        formula = expected_tau(alpha, gamma)
        rows.append({
            "method": "sd-iid", "pair": "iid", "temperature": 1.0, "alpha": alpha, "gamma": gamma,
            "what": "i.i.d. drafts with acceptance rate alpha",
            "nfe": out.stats.nfe_per_sample, "batch_nfe": out.stats.target_forwards, "draft_nfe": 0,
            "nfe_speedup": base.stats.nfe_per_sample / out.stats.nfe_per_sample,
            "wall_seconds": seconds, "wall_speedup": base_time / seconds,
            "tau": out.stats.tau, "tau_formula": formula, "tau_rel_error": out.stats.tau / formula - 1,
            "exact": None, "tokens_per_sample": cfg.iid_tokens,
        })
    setup = {
        "target": "layer_skip_pair(): 12 layers, dim 192, vocab 256 (random, seed 0)",
        "draft": "its first 2 layers + shared embedding/head",
        "prompts": cfg.prompts, "new_tokens": cfg.new_tokens, "seed": cfg.seed,
        "exact_samples": cfg.exact_samples, "exact_threshold": P_THRESHOLD,
        "repeats": cfg.repeats, "torch_threads": torch.get_num_threads(), "device": "cpu",
    }
    return {"bench": "core", "rows": rows, "setup": setup}
