"""The Triton residual kernel against the torch reference, run in Triton's interpreter on CPU, and
the dispatcher's choice between them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mmspec.kernels import residual
from mmspec.kernels.residual import residual_distribution, residual_distribution_reference

needs_triton = pytest.mark.skipif(not residual._TRITON_AVAILABLE, reason="triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs CUDA")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# V = 4099 is one full BLOCK of 4096 plus a ragged tail; V = 1 always falls back to p
SHAPES = [(*lead, V) for lead in [(3,), (2, 5)] for V in (1, 7, 1000, 4099)]
# the kernel rounds once from fp32; this floor covers that when torch happens to be exact
ERR_FLOOR = {torch.float16: 1e-5, torch.bfloat16: 1e-4}


def _probs(shape, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.softmax(2 * torch.randn(shape, generator=g), -1).to(dtype)  # (..., V)


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Case id -> (p, q), the inputs in the dtype under test."""
    g = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        for shape in SHAPES:
            cases[f"{name}-{'x'.join(map(str, shape))}"] = (_probs(shape, g, dtype), _probs(shape, g, dtype))
        p, q = _probs((4, 33), g, dtype), _probs((4, 33), g, dtype)  # (4, 33)
        q[::2] = p[::2]  # rows 0 and 2: the residual is exactly zero
        cases[f"{name}-p_eq_q"] = (p, q)
        # (3, 100) a point-mass q, as in EAGLE's deterministic top-k drafts
        q = torch.nn.functional.one_hot(torch.tensor([0, 17, 99]), 100).to(dtype)
        p = _probs((3, 100), g, dtype)
        p[2] = q[2]  # a one-hot p on the drafted token: zero residual again
        cases[f"{name}-one_hot_q"] = (p, q)
        # rows 128 elements apart in memory: the launcher must make them contiguous
        cases[f"{name}-strided"] = (_probs((3, 2, 64), g, dtype)[:, 0], _probs((3, 2, 64), g, dtype)[:, 0])
    return cases


CASES = _cases()


def _assert_matches_reference(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, slack: float = 0.0):
    """Exact fallback to p on zero-residual rows; per-dtype tolerance against the fp32 reference."""
    assert out.dtype == p.dtype and out.shape == p.shape
    ref = residual_distribution_reference(p.float(), q.float())  # (..., V) fp32 ground truth
    zero = (p.float() - q.float()).clamp_min(0).sum(-1) == 0  # (...)
    assert torch.equal(out[zero], p[zero]), "a zero residual must fall back to p exactly"
    if p.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
        return
    # flash-attn's criterion: at most 2x as far from the fp32 result as torch at the same precision
    torch_err = (residual_distribution_reference(p, q).float() - ref).abs().max().item()
    kernel_err = (out.float() - ref).abs().max().item()
    assert kernel_err <= 2 * torch_err + ERR_FLOOR[p.dtype] + slack, (kernel_err, torch_err)


# Triton chooses interpreter or compiler when a function is decorated: our kernel when mmspec.kernels
# is imported, its own library (tl.sum among others) when triton is. Once any test has imported
# mmspec, setting TRITON_INTERPRET in this process is too late: without a GPU the launch fails with
# "0 active drivers", and a kernel re-decorated afterwards fails on tl.sum with "Cannot call
# @triton.jit'd outside of the scope of a kernel". So a child process started with it set runs every
# case once, and the checks stay here.
_RUNNER = """
import sys, torch
from mmspec.kernels.residual import residual_distribution_triton
cases = torch.load(sys.argv[1])
torch.save({k: residual_distribution_triton(p, q) for k, (p, q) in cases.items()}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Case id -> the launcher's output, computed under TRITON_INTERPRET=1 in a child process."""
    tmp = tmp_path_factory.mktemp("residual")
    torch.save(CASES, tmp / "cases.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp / "cases.pt"), str(tmp / "out.pt")],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"the kernel failed in Triton's interpreter:\n{proc.stderr[-4000:]}", pytrace=False)
    return torch.load(tmp / "out.pt")


@needs_triton
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernel_outputs, case):
    out, (p, q) = kernel_outputs[case], CASES[case]
    # Triton 3.8's interpreter truncates fp32 -> bf16 (its cast_impl passes no rounding mode) where
    # the GPU rounds to nearest even: up to one bf16 ulp more, which torch at bf16 need not show
    ulp = torch.finfo(torch.bfloat16).eps * out.float().abs().max().item()
    _assert_matches_reference(out, p, q, slack=ulp if p.dtype == torch.bfloat16 else 0.0)


def test_dispatcher_uses_reference_on_cpu(monkeypatch):
    """CPU tensors take the reference, even when TRITON_INTERPRET=1 would let the kernel run."""

    def no_kernel(*args):
        raise AssertionError("the dispatcher chose the Triton kernel for CPU tensors")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(residual, "residual_distribution_triton", no_kernel)
    for case in ("float32-3x1000", "bfloat16-p_eq_q"):
        p, q = CASES[case]
        assert torch.equal(residual_distribution(p, q), residual_distribution_reference(p, q))


def test_kernel_selection(monkeypatch):
    """The kernel needs triton, a CUDA device and MMSPEC_DISABLE_KERNELS unset or not ``1``."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # devices, not tensors: no GPU needed
    monkeypatch.setattr(residual, "_TRITON_AVAILABLE", True)
    monkeypatch.delenv("MMSPEC_DISABLE_KERNELS", raising=False)
    assert residual._kernel_enabled(cuda)
    assert not residual._kernel_enabled(cpu)
    monkeypatch.setenv("MMSPEC_DISABLE_KERNELS", "1")
    assert not residual._kernel_enabled(cuda)
    monkeypatch.setenv("MMSPEC_DISABLE_KERNELS", "0")
    assert residual._kernel_enabled(cuda)
    monkeypatch.setattr(residual, "_TRITON_AVAILABLE", False)
    assert not residual._kernel_enabled(cuda)


@pytest.mark.cuda
@needs_triton
@needs_cuda
def test_dispatcher_on_cuda(monkeypatch):
    """The compiled kernel, chosen for CUDA tensors but float64 and unless MMSPEC_DISABLE_KERNELS=1."""
    calls = []
    launcher = residual.residual_distribution_triton
    monkeypatch.setattr(residual, "residual_distribution_triton", lambda *a: calls.append(a) or launcher(*a))
    monkeypatch.delenv("MMSPEC_DISABLE_KERNELS", raising=False)
    g = torch.Generator().manual_seed(1)
    big = (_probs((4, 65536), g, torch.float32), _probs((4, 65536), g, torch.float32))  # 16 BLOCKs per row
    inputs = [CASES["float32-2x5x4099"], CASES["float16-p_eq_q"], CASES["bfloat16-one_hot_q"], big]
    for p, q in inputs:
        p, q = p.cuda(), q.cuda()
        _assert_matches_reference(residual_distribution(p, q), p, q)
    assert len(calls) == len(inputs)
    p64, q64 = p.double(), q.double()
    assert torch.equal(residual_distribution(p64, q64), residual_distribution_reference(p64, q64))
    monkeypatch.setenv("MMSPEC_DISABLE_KERNELS", "1")
    assert torch.equal(residual_distribution(p, q), residual_distribution_reference(p, q))
    assert len(calls) == len(inputs)


@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_on_cuda_matches_reference(case):
    """Every interpreter case compiled: each dtype, V from 1 to a ragged 4099, strided rows. The
    GPU rounds fp32 -> bf16 to nearest even, so no interpreter slack; torch's own error is taken on
    the GPU too."""
    # the same strides on the GPU (``.cuda()`` would make the strided case's rows contiguous)
    p, q = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda").copy_(x) for x in CASES[case])
    _assert_matches_reference(residual.residual_distribution_triton(p, q), p, q)
