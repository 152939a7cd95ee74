"""The accept step through the fused guided-acceptance kernel (``mmspec.kernels.guided_accept``),
where the kernels' dispatch picks Triton; ``None`` everywhere else, and the rule object decides.

The kernel is the logits processor followed by a rule on a chain, from raw logits. It implements
``GreedyMatch`` behind a greedy ``LogitsProcessor``, and ``SpeculativeSampling`` or
``GroupedAcceptance`` (GSD) behind a sampling one: exactly those classes, since a subclass may
change the test. Trees, the other rules (LANTERN, ...), densities and pipeline subclasses never
reach it. Top-p and dtypes the kernel does not load are the dispatch's to refuse: auto mode falls
back to the rule, ``MMSPEC_KERNELS=triton`` raises.

The uniforms are drawn as the rule draws them, from the same generators and in the same order:
``rule.uniform((B, G))`` for the accept tests (chains with drafts only), then ``sample``'s
``rand((B, 1))`` for the correction or bonus. The kernel then decides as the rule does, except
where a uniform lands within float rounding of a threshold (its probabilities are summed in
another order).
"""

from __future__ import annotations

import torch

from ..kernels import dispatch as kernel_dispatch
from ..kernels.guided_accept import Grouping, accept_problem, guided_accept_triton
from .acceptance import GreedyMatch, SpeculativeSampling
from .logits import LogitsProcessor
from .relaxed import GroupedAcceptance
from .sampling import Generators, rand
from .tree import DraftTree
from .types import Acceptance


def fused_knobs(rule, pipeline) -> dict | None:
    """The kernel's keyword arguments for ``rule`` behind ``pipeline`` (``top_p`` included), or
    None when the kernel does not implement the pair."""
    if type(pipeline) is not LogitsProcessor:
        return None
    guidance = None if pipeline.guidance_scale is None else float(pipeline.guidance_scale)
    if pipeline.greedy:
        # the pipeline's greedy one-hot is taken before temperature, top-k and top-p
        if type(rule) is not GreedyMatch:
            return None
        return dict(guidance_scale=guidance, temperature=0.0, top_k=None, top_p=None, group=None)
    if type(rule) is SpeculativeSampling:
        group = None
    elif type(rule) is GroupedAcceptance:
        group = Grouping.of(rule)
    else:
        return None
    return dict(guidance_scale=guidance, temperature=float(pipeline.temperature), top_k=pipeline.top_k,
                top_p=pipeline.top_p, group=group)


def fused_acceptance(rule, pipeline, draft: DraftTree, logits: torch.Tensor | None, generator: Generators,
                     rows: torch.Tensor | None = None) -> Acceptance | None:
    """``rule(draft, pipeline(logits), generator)`` by the fused kernel, or None where the
    dispatch keeps the torch path or the kernel does not implement the rule.

    Args:
        logits: (R, G+1, V) the target's raw logits for all rows (``[cond; uncond]`` with guidance).
        rows: (n,) the lanes decided (None: all); ``draft`` and ``generator`` are already theirs.
    """
    if logits is None or not draft.tree.is_chain or not kernel_dispatch.considered(logits.device):
        return None
    knobs = fused_knobs(rule, pipeline)
    if knobs is None:
        return None
    top_p = knobs.pop("top_p")
    if not kernel_dispatch.use_triton("guided acceptance", logits.device, accept_problem(logits, draft.q, top_p),
                                      preferred=kernel_dispatch.preferred("guided acceptance")):
        return None
    if rows is not None:  # both CFG halves of each lane
        logits = logits[rows if knobs["guidance_scale"] is None else torch.cat([rows, rows + logits.shape[0] // 2])]
    B, G = draft.tokens.shape
    device = logits.device
    u_accept = u_sample = None
    if knobs["temperature"] != 0:  # greedy draws nothing
        u_accept = rule.uniform((B, G), device, generator) if G else torch.zeros(B, 0, device=device)
        u_sample = rand((B, 1), generator, device)[:, 0]
    n, next_token, _ = guided_accept_triton(logits, draft.tokens, draft.q, u_accept=u_accept, u_sample=u_sample,
                                            **knobs)
    depth = torch.arange(G + 1, device=device)
    path = torch.where(depth <= n[:, None], depth, -1)
    return Acceptance(path=path, num_accepted=n, next_token=next_token)
