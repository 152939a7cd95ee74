"""Kernels behind the core: a Triton (CUDA) kernel, a plain-torch reference and a dispatcher per op.

Each dispatcher (``residual_distribution``, ``tree_attention``, ``rolling_attention``,
``guided_accept``) picks the Triton kernel for CUDA tensors when Triton is
importable and the kernel takes the inputs, and the torch reference otherwise;
``MMSPEC_KERNELS=triton|torch|auto`` forces either (``mmspec.kernels.dispatch``;
``MMSPEC_DISABLE_KERNELS=1`` is ``torch``). ``*_reference`` and ``*_triton`` call one side directly.
The attention kernels share their online-softmax tile and flash-decoding's key splits
(``mmspec.kernels.splitk``).
"""

from .dispatch import KernelUnavailableError
from .guided_accept import (ChainAcceptance, Grouping, guided_accept, guided_accept_reference, guided_accept_triton,
                            process_logits)
from .residual import residual_distribution, residual_distribution_reference, residual_distribution_triton
from .rolling_attention import rolling_attention, rolling_attention_reference, rolling_attention_triton
from .tree_attention import tree_attention, tree_attention_reference, tree_attention_triton

__all__ = [
    "ChainAcceptance", "Grouping", "KernelUnavailableError", "guided_accept", "guided_accept_reference",
    "guided_accept_triton", "process_logits", "residual_distribution",
    "residual_distribution_reference", "residual_distribution_triton", "rolling_attention",
    "rolling_attention_reference", "rolling_attention_triton", "tree_attention", "tree_attention_reference",
    "tree_attention_triton",
]
