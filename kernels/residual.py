"""The speculative-sampling residual ``norm(max(p - q, 0))``, falling back to ``p`` where it is
numerically zero (SJD issue #7)."""

from __future__ import annotations

import contextlib

import torch

from .dispatch import TRITON_AVAILABLE, dtype_problem, preferred, use_triton

_TRITON_AVAILABLE = TRITON_AVAILABLE
if _TRITON_AVAILABLE:
    import triton
    import triton.language as tl


def residual_distribution_reference(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """p, q (..., V) probabilities -> (..., V) the normalised positive part of ``p - q``."""
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > eps, r / mass.clamp_min(eps), p)


if _TRITON_AVAILABLE:

    # Memory traffic per row of V elements: the kernel reads p and q twice (once for the mass, once
    # for the output) and writes the output once, 5V element moves with nothing materialised in
    # between. The torch reference's five ops (p - q, clamp, sum, r / mass, where) read 7V and write
    # 4V: 11V moves, three of the writes temporaries that are read straight back. The op is memory
    # bound, so the moves are the cost.
    @triton.jit
    def _residual_kernel(p_ptr, q_ptr, out_ptr, V, eps, BLOCK: tl.constexpr):
        """One program per row: pass 1 sums ``max(p - q, 0)`` in fp32, pass 2 writes the output."""
        # int64 so that row * V cannot overflow for large batches at V ~ 65536
        row = tl.program_id(0).to(tl.int64)
        p_row = p_ptr + row * V
        q_row = q_ptr + row * V
        out_row = out_ptr + row * V

        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_row + cols, mask=mask, other=0.0).to(tl.float32)
            acc += tl.maximum(p - q, 0.0)  # masked lanes add max(0 - 0, 0) = 0
        mass = tl.sum(acc, axis=0)
        use_residual = mass > eps
        denom = tl.maximum(mass, eps)

        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            p = tl.load(p_row + cols, mask=mask, other=0.0).to(tl.float32)
            q = tl.load(q_row + cols, mask=mask, other=0.0).to(tl.float32)
            # fp32 -> p's dtype round-trips p exactly, so the fallback returns p bit for bit
            out = tl.where(use_residual, tl.maximum(p - q, 0.0) / denom, p)
            tl.store(out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def residual_distribution_triton(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """p, q (..., V) on one device -> (..., V) in p's dtype, via the Triton kernel."""
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    if p.device != q.device:
        raise ValueError(f"p and q must be on the same device, got {p.device} and {q.device}")
    V = p.shape[-1]
    p2 = p.reshape(-1, V).contiguous()  # (B, V)
    q2 = q.reshape(-1, V).contiguous()  # (B, V)
    out = torch.empty_like(p2)  # (B, V)
    if out.numel() == 0:
        return out.view(p.shape)
    # a row streams through in chunks of BLOCK; 4096 keeps registers modest at V ~ 65536
    BLOCK = min(triton.next_power_of_2(V), 4096)
    num_warps = 8 if BLOCK >= 2048 else 4
    # Triton launches on the current CUDA device, which need not be the tensors' device
    device = torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext()
    with device:
        _residual_kernel[(p2.shape[0],)](p2, q2, out, V, eps, BLOCK=BLOCK, num_warps=num_warps)
    return out.view(p.shape)


def _kernel_enabled(device: torch.device, unsupported: str | None = None) -> bool:
    """Whether the dispatcher runs the Triton kernel for tensors on ``device`` (``mmspec.kernels.dispatch``:
    CUDA in auto mode, unless ``MMSPEC_KERNELS=torch`` or ``MMSPEC_DISABLE_KERNELS=1``)."""
    return use_triton("residual", device, unsupported, available=_TRITON_AVAILABLE, preferred=preferred("residual"))


def residual_distribution(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """p, q (..., V) -> (..., V): the Triton kernel where enabled, the reference otherwise (silently,
    unless ``MMSPEC_KERNELS=triton``); the kernel computes in fp32, so float64 stays on the reference."""
    # broadcasting p against q is left to the reference; the kernel takes same-shape rows only
    problem = dtype_problem(p, q) or (None if p.shape == q.shape else "the kernel takes same-shape p and q")
    if _kernel_enabled(p.device, problem):
        return residual_distribution_triton(p, q, eps)
    return residual_distribution_reference(p, q, eps)
