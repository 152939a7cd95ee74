"""Kernels behind the core: a Triton (CUDA) kernel, a plain-torch reference and a dispatcher per op.

The dispatcher picks the Triton kernel for CUDA tensors when Triton is importable and
``MMSPEC_DISABLE_KERNELS`` is not ``1``, and the torch reference otherwise.
"""

from .residual import residual_distribution, residual_distribution_reference

__all__ = ["residual_distribution", "residual_distribution_reference"]
