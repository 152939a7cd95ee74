"""Tokens with a trailing shape: discrete ids ``(R, C)`` or continuous vectors ``(R, C, *token_shape)``.

The loop moves tokens between the history, the drafts and the emitted block by index along dim 1;
these helpers do it for any trailing shape (for ids they are exactly ``gather`` / ``scatter_``).
"""

from __future__ import annotations

import torch


def _expanded(index: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(R, W) index -> (R, W, *token_shape), broadcast over the tokens' trailing shape."""
    trailing = tokens.shape[2:]
    return index.view(*index.shape, *(1,) * len(trailing)).expand(*index.shape, *trailing)


def gather_tokens(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tokens[r, index[r, w]]``: (R, C, *s) and (R, W) -> (R, W, *s)."""
    if tokens.dim() == 2:
        return tokens.gather(1, index)
    return tokens.gather(1, _expanded(index, tokens))


def scatter_tokens_(tokens: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """In place ``tokens[r, index[r, w]] = src[r, w]``: (R, C, *s), (R, W), (R, W, *s)."""
    if tokens.dim() == 2:
        return tokens.scatter_(1, index, src)
    return tokens.scatter_(1, _expanded(index, tokens), src)


def token_mask(mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A (R, W) mask viewed to broadcast over (R, W, *token_shape)."""
    return mask.view(*mask.shape, *(1,) * (tokens.dim() - mask.dim()))
