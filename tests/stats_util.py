"""Shared helpers for the statistical tests: exact joint distributions and a chi-square test."""

from __future__ import annotations

import itertools

import torch
from scipy.stats import chi2

P_THRESHOLD = 1e-3  # a correct rule passes with p >= 1e-3; every broken rule must fall below it


def exact_joint(model, prompt, n_tokens, pipeline, uncond_prompt=None) -> torch.Tensor:
    """The exact distribution of the first ``n_tokens`` sampled tokens, over all V**n sequences.

    Computed from scratch (no cache) by enumerating every continuation and chaining the
    processed conditionals, with guidance when ``uncond_prompt`` is given.
    """
    V = model.vocab_size
    conts = torch.tensor(list(itertools.product(range(V), repeat=n_tokens)))  # (V**n, n)

    def conditionals(pr):
        ids = torch.cat([torch.tensor(pr).expand(len(conts), -1), conts], 1)
        with torch.no_grad():
            logits = model(ids).logits  # (V**n, S+n, V)
        return logits[:, len(pr) - 1 : len(pr) - 1 + n_tokens]

    logits = conditionals(prompt)
    if uncond_prompt is not None:
        logits = torch.cat([logits, conditionals(uncond_prompt)])
    probs = pipeline(logits).double()  # (V**n, n, V)
    picked = probs.gather(-1, conts.unsqueeze(-1)).squeeze(-1)  # (V**n, n)
    return picked.prod(-1)


def sequence_index(tokens: torch.Tensor, V: int) -> torch.Tensor:
    """(N, n) token sequences -> (N,) index in lexicographic order (as ``exact_joint``)."""
    idx = torch.zeros(tokens.shape[0], dtype=torch.long)
    for j in range(tokens.shape[1]):
        idx = idx * V + tokens[:, j]
    return idx


def chisquare_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of sample indices to ``probs``.

    Cells expecting fewer than 5 samples are pooled into one; a sample in a zero-probability cell
    gives p = 0.
    """
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * float((counts / samples.numel() - probs).abs().sum())
