"""The torch math the core and the kernels' references share: imports nothing of mmspec.

Each kernel's reference (``*_reference``) must be plain torch and the core's torch path at once, so
the ops both need live here, below both: the core imports them (``mmspec.core.cache``,
``mmspec.core.logits``, ``mmspec.core.sampling``) and the references call them, with no import
of the core from the kernels (the core imports the kernels while it initialises).
"""

from __future__ import annotations

import torch


def visibility_mask(ends: torch.Tensor, T: int, S: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, T, S) bool attention mask for a block ending at slot ``ends[b]`` (exclusive).

    Slots below ``ends - width`` (width = T, or the tree mask's width) are fully visible; the
    last ``width`` slots follow the tree mask (causal when it is None); later slots are hidden.
    """
    B = ends.shape[0]
    device = ends.device
    if tree_mask is None:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
    width = tree_mask.shape[-1]
    rel = torch.arange(S, device=device) - (ends - width)[:, None]  # (B, S)
    in_tree = (rel >= 0) & (rel < width)
    picked = tree_mask.gather(-1, rel.clamp(0, width - 1)[:, None, :].expand(B, T, S))
    return ((rel < 0)[:, None, :] | (in_tree[:, None, :] & picked)).unsqueeze(1)


def cfg_merge(cond: torch.Tensor, uncond: torch.Tensor, scale) -> torch.Tensor:
    """Classifier-free guidance (Ho & Salimans, 2022): ``uncond + scale * (cond - uncond)``, the one
    merge of conditional and unconditional logits, velocities or noise predictions; ``scale`` is a
    number or a tensor that broadcasts against them."""
    return uncond + scale * (cond - uncond)


def greedy_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """The greedy distribution: float32 one-hot at each row's argmax (the first on ties), built by
    one argmax and a scatter into zeros. The argmax ids ride along as the tensor's ``argmax_ids``
    attribute, so a greedy rule reads them instead of scanning the vocabulary again
    (``mmspec.core.logits.argmax_ids``); views and copies of the tensor drop it and scan."""
    ids = logits.argmax(-1, keepdim=True)
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, ids, 1.0)
    probs.argmax_ids = ids[..., 0]
    return probs


def logits_to_probs(logits: torch.Tensor, guidance_scale: float | None = None, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """(B or 2B, ..., V) raw logits -> (B, ..., V) float32 probabilities: CFG merge of ``[cond;
    uncond]`` (with ``guidance_scale``), then greedy one-hot (``temperature`` 0), or temperature,
    top-k (ties with the k-th value kept) and top-p, then softmax (``mmspec.core.logits.
    LogitsProcessor``, which checks the knobs and calls this)."""
    logits = logits.float()
    if guidance_scale is not None:
        logits = cfg_merge(*logits.chunk(2, dim=0), guidance_scale)
    if temperature == 0:
        return greedy_one_hot(logits)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # stable: among tokens tied at the nucleus boundary the lower ids are kept (transformers'
        # ascending sort keeps the higher ones; tests/test_logits_hf.py shows both)
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs (B, ..., V), rows summing to > 0, and uniforms u (B, ..., 1) in [0, 1) -> (B, ...)
    indices: the first index whose cumulative mass exceeds ``u`` times the row's total (``sample``
    with its uniforms given)."""
    cdf = probs.cumsum(-1)  # (B, ..., V)
    total = cdf[..., -1:]
    # kept strictly below the total even when u * total rounds up to it
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # right=True picks the first token whose cdf exceeds the target: zero-mass tokens never win
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
