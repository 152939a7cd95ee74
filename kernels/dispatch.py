"""Which implementation of an op runs: the Triton kernel or the torch reference.

``MMSPEC_KERNELS`` (read on every call, so tests can flip it) chooses:

- ``auto`` (default): the Triton kernel for CUDA tensors when Triton is importable and the kernel
  takes the inputs (dtype, options); the torch reference otherwise, silently.
- ``torch``: the reference everywhere. ``MMSPEC_DISABLE_KERNELS=1``, the older switch, means the
  same.
- ``triton``: the kernel, or a ``KernelUnavailableError`` saying why it cannot run: Triton missing,
  tensors not on CUDA (CPU tensors are accepted under ``TRITON_INTERPRET=1``, Triton's
  interpreter, which is how the tests run the kernels), or inputs the kernel does not take.

This follows diffusers' ``attention_dispatch``: a silent fallback when the backend was picked
automatically, a loud error when the user asked for it.
"""

from __future__ import annotations

import os

import torch

from mmspec.utils.errors import check

try:
    import triton  # noqa: F401
except ImportError:
    triton = None

TRITON_AVAILABLE = triton is not None
ENV = "MMSPEC_KERNELS"
MODES = ("auto", "triton", "torch")
# every kernel loads these and computes in fp32; float64 stays on the reference
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelUnavailableError(RuntimeError):
    """``MMSPEC_KERNELS=triton`` asked for a kernel that cannot run here."""


def mode() -> str:
    """The requested backend: ``auto``, ``triton`` or ``torch`` (see the module docstring)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    check(value in MODES, ENV, "one of " + ", ".join(repr(m) for m in MODES), os.environ.get(ENV))
    disabled = os.environ.get("MMSPEC_DISABLE_KERNELS") == "1"
    check(not (disabled and value == "triton"), ENV, "not 'triton' while MMSPEC_DISABLE_KERNELS=1", value)
    return "torch" if disabled else value


def interpreted() -> bool:
    """Whether Triton's CPU interpreter is on (it must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable(device: torch.device, available: bool = TRITON_AVAILABLE) -> str | None:
    """Why a Triton kernel cannot run on ``device``, or None when it can."""
    if not available:
        return "triton is not installed"
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return None
    return (f"the tensors are on {device.type}: Triton kernels run on CUDA, or on the CPU under "
            "TRITON_INTERPRET=1 (Triton's interpreter)")


def use_triton(op: str, device: torch.device, unsupported: str | None = None,
               available: bool = TRITON_AVAILABLE, preferred: bool = True) -> bool:
    """Whether ``op`` runs its Triton kernel for tensors on ``device``.

    ``unsupported``: why the kernel cannot take these particular inputs (None when it can); auto
    mode then falls back, forced mode raises. ``preferred=False``: the kernel can run but is not
    expected to beat the reference on these inputs; auto mode takes the reference, forced mode the
    kernel. Auto mode never picks the interpreter: CPU tensors take the reference unless
    ``MMSPEC_KERNELS=triton``.
    """
    requested = mode()
    if requested == "torch":
        return False
    reason = unavailable(device, available)
    if requested == "auto":
        return device.type == "cuda" and reason is None and unsupported is None and preferred
    reason = reason or unsupported
    if reason is not None:
        raise KernelUnavailableError(f"{ENV}=triton forces the Triton {op} kernel, but {reason}; "
                                     f"unset {ENV} (or set it to 'auto' or 'torch') to use the torch reference")
    return True


# -- where auto mode expects a kernel to win: every measured threshold, in one table ---------------
# Measured on an H200 (the GPU check of 2026-11-28; the timings: docs/costs.md and
# docs/guides/kernels.md), before the key splits of issue 43 (``splitk``), which were made for
# exactly the shapes that lost; `make gpu-check` re-times kernel, reference and SDPA over 256 to
# 16,384 keys (``mmspec bench kernels``), and these rules change only with such a measurement.
#
# - tree attention: the models' SDPA path with the dense mask beat the kernel in fp16 and bf16 at
#   every shape timed, and in fp32 over 512 keys: never preferred.
# - rolling attention: the kernel beat the models' SDPA path with sink + window = 255 keys (4
#   queries, bf16 and fp32) and with 64 keys (16 queries, 3-D rope, bf16), and lost with 4,096 keys
#   (a 60-node tree, Llama-7B heads, fp16); between 256 and 4,096 nothing was measured. Each query
#   tile rotates every key it reads, so blocks of more than 128 queries (video chunks; the bench
#   projects the rotations above the attention's own tensor-core time for a Wan-sized chunk) take
#   the reference (rotate once, then attend).
# - guided acceptance: faster than its torch path at every shape timed.
# - residual: not timed on a GPU yet; preferred wherever it runs (it moves 5V elements per row
#   against the reference's 11V, ``residual.py``).
PREFERRED = {
    "tree attention": dict(max_queries=0, max_keys=0),
    "rolling attention": dict(max_queries=128, max_keys=256),
    "guided acceptance": dict(max_queries=None, max_keys=None),
    "residual": dict(max_queries=None, max_keys=None),
}
"""op -> the largest block (queries) and key range auto mode sends to the kernel (None: no limit;
0: never). Read by ``preferred``; the dispatchers alone consult it."""


def preferred(op: str, queries: int | None = None, keys: int | None = None) -> bool:
    """Whether auto mode expects ``op``'s kernel to beat its torch path for a block of ``queries``
    queries over ``keys`` keys (``PREFERRED``)."""
    check(op in PREFERRED, "op", "one of " + ", ".join(repr(k) for k in PREFERRED), op)
    limits = PREFERRED[op]
    for size, limit in ((queries, limits["max_queries"]), (keys, limits["max_keys"])):
        if limit is not None and (size is None or size > limit):
            return False
    return True


def considered(device: torch.device) -> bool:
    """A cheap first test for hot paths: False when ``use_triton`` would certainly say False for
    ``device`` (``torch`` mode, or auto mode off CUDA), so callers skip building its arguments."""
    requested = mode()
    return requested == "triton" or (requested == "auto" and device.type == "cuda")


def dtype_problem(*tensors: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors' dtypes (None when they can)."""
    for t in tensors:
        if t is not None and t.dtype not in KERNEL_DTYPES:
            return f"the kernel takes float32, float16 or bfloat16, not {t.dtype}"
    return None
