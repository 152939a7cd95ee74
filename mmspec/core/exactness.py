"""The core's distribution test: do sampled tokens follow the target's exact distribution?

Lossless rules are checked by sampling the first ``n`` generated tokens many times and running a
Pearson chi-square test against the exact joint distribution, computed from scratch by
enumerating all ``V**n`` continuations (so keep V and n small: 8**3 cells is typical).
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
