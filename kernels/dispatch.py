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


def check(ok: bool, name: str, allowed: str, got) -> None:
    """``mmspec.core.errors.check``'s message, without importing the core (the core imports us)."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {got!r}")


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
