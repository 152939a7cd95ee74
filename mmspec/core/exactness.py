"""The core's distribution test: do sampled tokens follow the target's exact distribution?

Lossless rules are checked by sampling the first ``n`` generated tokens many times and running a
Pearson chi-square test against the exact joint distribution, computed from scratch by
enumerating all ``V**n`` continuations (so keep V and n small: 8**3 cells is typical).

Continuous tokens have no enumerable support: a rule with an exact density is checked by the
probability integral transform of its samples under the target (``pit_pvalue``, the Rosenblatt
transform), one without (a diffusion head) by two-sample tests against target-only samples
(``two_sample_pvalue``). Both use SciPy's Kolmogorov-Smirnov and chi-square distributions.
"""

from __future__ import annotations

import itertools

import torch

P_THRESHOLD = 1e-3  # a correct rule passes with p >= 1e-3; a broken one must fall below it


@torch.no_grad()
def exact_joint(model, prompt: list[int], n_tokens: int, pipeline, uncond_prompt: list[int] | None = None
                ) -> torch.Tensor:
    """(V**n,) probability of every n-token continuation, in lexicographic order.

    ``model(ids (N, S)).logits`` must score full sequences without a cache (the reference path of
    ``TinyCausalLM``, or any transformers causal LM). With ``uncond_prompt`` the pipeline's
    guidance merges the conditional and unconditional logits, as during decoding.
    """
    V = model.vocab_size
    conts = torch.tensor(list(itertools.product(range(V), repeat=n_tokens)))  # (V**n, n)

    def conditionals(pr):
        ids = torch.cat([torch.tensor(pr).expand(len(conts), -1), conts], 1)
        return model(ids).logits[:, len(pr) - 1 : len(pr) - 1 + n_tokens]  # (V**n, n, V)

    logits = conditionals(prompt)
    if uncond_prompt is not None:
        logits = torch.cat([logits, conditionals(uncond_prompt)])
    probs = pipeline(logits).double()
    return probs.gather(-1, conts.unsqueeze(-1)).squeeze(-1).prod(-1)


def sequence_index(tokens: torch.Tensor, V: int) -> torch.Tensor:
    """(N, n) token sequences -> (N,) index in the lexicographic order of ``exact_joint``."""
    idx = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    for j in range(tokens.shape[1]):
        idx = idx * V + tokens[:, j]
    return idx.cpu()


def chisquare_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of sample indices (N,) to ``probs``.

    Cells expecting fewer than 5 samples are pooled into one; any sample in a zero-probability
    cell gives p = 0. The p-value is the chi-square survival function, ``Q(k/2, x/2)``.
    """
    n = samples.numel()
    probs = probs.double().cpu()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * float((counts / samples.numel() - probs.double().cpu()).abs().sum())


# -- continuous tokens: no enumerable support, so uniform transforms and two-sample tests ------------

def ks_uniform_pvalue(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov tests of each column of ``u`` (N, k) against U(0, 1); the smallest
    p-value times k (Bonferroni), capped at 1."""
    from scipy import stats

    u = u.detach().double().cpu().reshape(u.shape[0], -1).numpy()
    return min(1.0, u.shape[1] * min(stats.kstest(u[:, j], "uniform").pvalue for j in range(u.shape[1])))


def grid_chisquare_pvalue(u: torch.Tensor, bins: int = 3) -> float:
    """Pearson chi-square of the joint cells ``floor(bins * u)`` of ``u`` (N, k) against the uniform
    grid of ``bins**k`` cells: catches dependence between coordinates that are each uniform."""
    u = u.detach().double().cpu().reshape(u.shape[0], -1)
    cell = (u * bins).floor().clamp(0, bins - 1).long()
    idx = torch.zeros(u.shape[0], dtype=torch.long)
    for j in range(cell.shape[1]):
        idx = idx * bins + cell[:, j]
    cells = bins ** cell.shape[1]
    return chisquare_pvalue(idx, torch.full((cells,), 1.0 / cells, dtype=torch.float64))


def pit_pvalue(u: torch.Tensor, bins: int = 3) -> float:
    """Probability-integral-transform test of ``u`` (N, k), the Rosenblatt transform of samples
    under the exact target (``u_j = F(x_j | x_<j)``): exact sampling makes the coordinates iid
    U(0, 1). The smaller of ``ks_uniform_pvalue`` and ``grid_chisquare_pvalue``; under exactness
    it falls below a with probability at most 2a."""
    return min(ks_uniform_pvalue(u), grid_chisquare_pvalue(u, bins))


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor, bins: int = 3) -> float:
    """Do samples ``a`` (N, k) and ``b`` (M, k) come from one distribution? The smaller of
    (1) two-sample Kolmogorov-Smirnov tests per column, Bonferroni-adjusted, and (2) a chi-square
    homogeneity test on the joint cells of per-column pooled-quantile bins (``bins**k`` cells,
    empty ones dropped). Under equal distributions it falls below a with probability at most 2a."""
    from scipy import stats

    a = a.detach().double().cpu().reshape(a.shape[0], -1)
    b = b.detach().double().cpu().reshape(b.shape[0], -1)
    k = a.shape[1]
    ks = min(1.0, k * min(stats.ks_2samp(a[:, j].numpy(), b[:, j].numpy()).pvalue for j in range(k)))
    pooled = torch.cat([a, b])
    edges = torch.quantile(pooled, torch.linspace(0, 1, bins + 1, dtype=torch.float64)[1:-1], dim=0)  # (bins-1, k)

    def cells(x):
        idx = torch.zeros(x.shape[0], dtype=torch.long)
        for j in range(k):
            idx = idx * bins + torch.searchsorted(edges[:, j].contiguous(), x[:, j].contiguous())
        return torch.bincount(idx, minlength=bins ** k)

    table = torch.stack([cells(a), cells(b)]).numpy()
    table = table[:, table.sum(0) > 0]
    return min(ks, float(stats.chi2_contingency(table, correction=False).pvalue))
