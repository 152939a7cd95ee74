"""The Triton kernels compiled for sm_90 (H100, H200) on the CPU.

Triton's interpreter runs the kernels' Python, not its compiler, so it passes code that no GPU can
compile: a name whose shape changes inside a loop, a branch that yields different types, ``tl.dot``
shapes below 16. The compiler itself (to PTX and, with the ptxas Triton bundles, to a cubin) needs
no GPU: here every launch is bound as the JIT binds it (the same specialisation) and compiled for
sm_90 instead of run. Launches cover every constexpr branch: the bench's cases in the dtypes it
times, the causal tree block, both attention kernels with one key split (direct store) and with
several (workspace and the combine kernel), acceptance without guidance or drafted q, with
top-k and greedy on bf16 logits, and the residual."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit  # noqa: E402

from mmspec import kernels  # noqa: E402
from mmspec.bench import kernels as bench  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="under TRITON_INTERPRET=1 the kernels were decorated for the interpreter"),
    pytest.mark.skipif(not (hasattr(jit, "create_function_from_signature") and hasattr(jit.JITFunction, "_pack_args")),
                       reason="this Triton binds launch arguments differently"),
]


@pytest.fixture
def compiled(monkeypatch) -> dict:
    """Every Triton launch compiled for sm_90 instead of run: {(kernel, specialisation): error or None}."""
    backend = make_backend(SM90)
    results = {}

    def compile_instead(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug)
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        key = (self.fn.__name__, str(specialization), str(options))
        if key in results:
            return None
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        try:
            triton.compile(ASTSource(self, signature, constexprs, attrs), target=SM90, options=options.__dict__)
            results[key] = None
        except Exception as exc:  # collected, so that one failure does not hide the others
            results[key] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        return None

    monkeypatch.setattr(jit.JITFunction, "run", compile_instead)
    return results


def _launches():
    """(launcher, kwargs) for every kernel branch the project runs on a GPU."""
    g = torch.Generator().manual_seed(0)
    calls = []
    cases = bench.measured_cases(0)
    for case in cases:
        for dtype in bench.COMPILED_DTYPES[case["kernel"]]:
            calls.append((getattr(kernels, case["fn"] + "_triton"), bench._cast(case["inputs"], dtype)))
    tree = cases[0]["inputs"]
    calls.append((kernels.tree_attention_triton, dict(bench._cast(tree, torch.float16), tree_mask=None)))
    rolling = next(case["inputs"] for case in cases if case["kernel"] == "rolling_attention")
    for splits in (1, 3):  # whatever the automatic count picks for the bench's shapes
        calls.append((kernels.tree_attention_triton, dict(bench._cast(tree, torch.bfloat16), num_splits=splits)))
        calls.append((kernels.rolling_attention_triton, dict(bench._cast(rolling, torch.float16), num_splits=splits)))
    plain = bench._accept_inputs(g, 2, 3, 300, guidance=None)
    calls.append((kernels.guided_accept_triton, plain))
    calls.append((kernels.guided_accept_triton, dict(plain, q=None)))
    logits = plain["logits"].to(torch.bfloat16)
    for knobs in (dict(guidance_scale=None, temperature=0.7, top_k=5), dict(guidance_scale=None, temperature=0)):
        calls.append((kernels.guided_accept_triton, dict(plain, logits=logits, **knobs)))
    for dtype, V in ((torch.float32, 1), (torch.float16, 1000), (torch.bfloat16, 4099)):
        p, q = torch.rand(2, 2, V, generator=g).to(dtype), torch.rand(2, 2, V, generator=g).to(dtype)
        calls.append((kernels.residual_distribution_triton, dict(p=p, q=q)))
    return calls


def test_every_kernel_branch_compiles_for_sm90(compiled):
    for launcher, kwargs in _launches():
        launcher(**kwargs)
    names = {name for name, *_ in compiled}
    assert names == {"_tree_attention_kernel", "_rolling_attention_kernel", "_merge_splits_kernel",
                     "_position_kernel", "_chain_kernel", "_residual_kernel"}, names
    failures = {key[0] + " " + key[1]: error for key, error in compiled.items() if error is not None}
    assert not failures, "\n\n".join(f"{k}\n{v}" for k, v in failures.items())


@triton.jit
def _reuses_a_name_with_another_shape(X, BLOCK: tl.constexpr):
    """The interpreter runs this; the compiler refuses it (the acceptance kernel's former bug)."""
    ok = tl.arange(0, 2) < 1
    for start in range(0, 8, BLOCK):
        ok = start + tl.arange(0, BLOCK) < 4
    tl.store(X, tl.sum(ok.to(tl.int32), 0))


def test_the_compile_check_bites(compiled):
    _reuses_a_name_with_another_shape[(1,)](torch.zeros(1, dtype=torch.int32), BLOCK=4)
    (error,) = compiled.values()
    assert error is not None and "Loop-carried variable ok" in error
