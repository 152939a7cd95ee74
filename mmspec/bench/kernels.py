"""``mmspec bench kernels``: the kernels behind the core, checked and timed where they can run, and
projected onto an H100 at realistic GPU shapes.

Small-shape rows (``projected: false``), per kernel, shape and dtype: the Triton kernel's output
against the torch reference in fp32 (``max_abs_err`` beside the ``tolerance`` the tests use;
``correct`` also requires the acceptance kernel's decisions to equal the reference's) and
``reference_ms``, the reference's time on this machine.

- Without a GPU the kernels run in Triton's CPU interpreter in a child process
  (``mmspec.kernels.interpret``), which says whether they compute the right thing and nothing
  about their speed: ``measured: false``; ``reference_ms`` is the median of ``repeats`` CPU calls
  after one warm-up (``torch.get_num_threads()`` threads). Attention in fp32 and fp16, acceptance
  with fp32 logits.
- With CUDA the kernels run compiled, in fp32, fp16 and bf16 (acceptance: fp32 and bf16 logits),
  and both sides are timed one after the other, in the same harness, by
  ``triton.testing.do_bench`` (L2 flushed before every call; ``warmup_ms`` and ``rep_ms`` of
  calls, median and 20th/80th percentiles): ``kernel_ms`` (the ``*_triton`` launcher as the caches
  call it, its index-tensor conversions included), ``reference_ms`` (the ``*_reference``
  function on the GPU: the models' torch path including the dense mask it builds, and for rolling
  attention the key positions and RoPE tables) and ``speedup`` = reference / kernel. Attention rows
  add ``sdpa_ms``, the per-layer part of that path: ``scaled_dot_product_attention`` with the mask
  built beforehand (rolling: after rotating q and every key with tables built beforehand), as the
  caches build them once per forward for all layers; ``sdpa_speedup`` = sdpa / kernel (the ratio
  to SDPA), and ``num_splits``, the key splits the launcher chose (``splitk.choose_num_splits`` at
  the device's multiprocessor count, ``splitk.sm_count``). ``measured: true`` when the kernel ran
  and was timed. A kernel that fails to compile or run gives ``correct: false`` and the error's
  last lines in ``note``, and the bench goes on.

Projected rows (``projected: true``): bytes moved and FLOPs per call at realistic GPU shapes, for
the kernel and for the torch path it replaces, and the time an H100 SXM would need at its HBM and
tensor-core roofs (``H100``). Bytes are compulsory traffic: every input read once and every output
written once, at the shape's dtype (a tiled kernel re-reads key/value tiles per query tile; on a
GPU the L2 cache absorbs much of that, and it is left out for both sides). The torch path's bytes
add what it writes and reads back: materialised masks, the rotated key copy, the logits pipeline's
intermediates; its launches are counted because at these sizes the acceptance step is
launch-bound, not bandwidth-bound. With CUDA every projected shape is also built on the GPU, checked
against the fp32 reference there (acceptance: on the CPU, whose fp64 CDF the kernel follows) and
timed as above, beside its projection: ``measured_kernel_us``,
``measured_torch_us`` (the reference), ``measured_sdpa_us``, ``measured_speedup``,
``measured_max_abs_err`` and ``measured_tolerance``; attention rows add ``measured_sdpa_speedup``
(sdpa / kernel) and ``num_splits``.

Key sweep (``key_sweep_rows``, rows with ``sweep_keys``): the report's tree-attention and
rolling-token shapes (EAGLE-2's 60-node tree, Llama-7B's 32 heads of 128, batch 1) at 256, 1,024,
4,096 and 16,384 keys (``KEY_SWEEP``: tokens cached under the tree, or the rolling cache's sink of
4 plus its window), in fp16 and bf16. They are projected rows like the others: projections only without
CUDA (the interpreter never runs them), projected and measured with it. The report's two fp16
rows at 4,096 keys are the sweep's own points there, not repeated.

On CUDA the projected rows run first (the report's shapes, then the rest of the sweep, fp16 before
bf16), then the small shapes; rows are started until ``budget_s`` has passed, later ones say so in
``note`` and stay ``measured: false``: a run that overstays a GPU check's time limit would be killed
before writing anything, so slow compilation costs the last rows, not the report.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass

import torch
from torch.nn import functional as F

H100 = {"name": "H100 SXM5", "hbm_bytes_per_s": 3.35e12, "tensor_flops_16bit": 989.4e12, "fp32_flops": 66.9e12,
        "sfu_ops_per_s": 132 * 16 * 1.98e9}
"""NVIDIA's datasheet figures (HBM3 bandwidth, dense FP16/BF16 tensor-core and FP32 peaks) and the
special-function units' rate: 16 exp/sin/cos per SM per clock (CUDA's throughput table for compute
capability 9.0) x 132 SMs x 1.98 GHz boost."""

INTERPRETED_DTYPES = {"tree_attention": (torch.float32, torch.float16),
                      "rolling_attention": (torch.float32, torch.float16), "guided_accept": (torch.float32,)}
COMPILED_DTYPES = {"tree_attention": (torch.float32, torch.float16, torch.bfloat16),
                   "rolling_attention": (torch.float32, torch.float16, torch.bfloat16),
                   "guided_accept": (torch.float32, torch.bfloat16)}
CUDA_FP32_SLACK = 1e-5
"""Added to the fp32 attention tolerance for compiled kernels, as tests/test_kernels_attention.py's
CUDA tests add it: the GPU sums in another order than the CPU reference."""


@dataclass
class KernelBenchConfig:
    """``repeats``: CPU calls per reference timing. ``warmup_ms``, ``rep_ms``: do_bench's warm-up and
    timed windows per side on a GPU: at 10-100 us per call, 40 ms is 400 to 4,000 timed calls, and
    the whole bench's roughly 100 timed calls take a few seconds, the rest being compilation.
    ``budget_s``: on a GPU, no row starts after this many seconds."""

    repeats: int = 5
    seed: int = 0
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    # the GPU check runs this bench in a child it kills after STEP_SECONDS["kernels"] = 90 s, and
    # the JSON is written only at the end: 20 s are left for importing torch and Triton and for the
    # row in flight (a compilation, a reference and three timings)
    budget_s: float = 70.0

    @classmethod
    def quick(cls) -> "KernelBenchConfig":
        return cls(repeats=2, warmup_ms=5.0, rep_ms=20.0)


def gpu_time(fn, warmup_ms: float, rep_ms: float) -> tuple[float, float, float]:
    """Milliseconds per call of ``fn`` on the GPU: median, 20th and 80th percentiles of
    ``triton.testing.do_bench``. The compiled path's only timer (tests replace it)."""
    from triton.testing import do_bench

    median, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return median, p20, p80


# -- inputs ---------------------------------------------------------------------------------------
def _ancestor_mask(g, B, T):
    """(B, T, T) bool: B random trees of T nodes, each node seeing itself and its ancestors."""
    dev = g.device
    parents = torch.stack([torch.randint(0, i, (B,), generator=g, device=dev) for i in range(1, T)], 1) \
        if T > 1 else torch.zeros(B, 0, dtype=torch.long, device=dev)
    mask = torch.eye(T, dtype=torch.bool, device=dev).repeat(B, 1, 1)
    rows = torch.arange(B, device=dev)
    for i in range(1, T):
        mask[:, i] |= mask[rows, parents[:, i - 1]]
    return mask


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, device=g.device)


def _tree_inputs(g, B, Hq, Hkv, T, S, D, prefix=None):
    """Tensors on ``g``'s device; ``prefix`` None: each row's drawn in [S/2, S - T]."""
    mask = _ancestor_mask(g, B, T)
    if prefix is None:
        prefix_lens = torch.randint(S // 2, S - T + 1, (B,), generator=g, device=g.device)
    else:
        prefix_lens = torch.full((B,), prefix, device=g.device)
    return dict(q=_randn(g, B, Hq, T, D), k=_randn(g, B, Hkv, S, D), v=_randn(g, B, Hkv, S, D),
                prefix_lens=prefix_lens, tree_mask=mask)


def _rolling_inputs(g, B, Hq, Hkv, T, D, sink, window, rope, ring, tree_mask=None):
    """A full sink + window cache (a ring starting ``ring`` slots in) and a block of T after it;
    ``tree_mask`` None: all ones (a bidirectional chunk)."""
    C = sink + window + T
    lengths = torch.full((B,), sink + window, device=g.device)
    mask = torch.ones(B, T, T, dtype=torch.bool, device=g.device) if tree_mask is None else tree_mask
    return dict(q=_randn(g, B, Hq, T, D), k=_randn(g, B, Hkv, C, D), v=_randn(g, B, Hkv, C, D), lengths=lengths,
                block_start=lengths.clone(), positions=lengths[:, None] + torch.arange(T, device=g.device),
                ring_start=torch.full((B,), ring, device=g.device), rope=rope, sink=sink, window=window,
                tree_mask=mask)


def _accept_inputs(g, B, G, V, guidance=3.0, top_k=None, group=None, temperature=1.0):
    from ..kernels.guided_accept import process_logits

    logits = 2 * _randn(g, 2 * B if guidance else B, G + 1, V)
    target = process_logits(logits, guidance, 1.0)[:, :G].clamp_min(1e-30).log()
    q = process_logits(target + 0.7 * _randn(g, B, G, V), None, 1.0, top_k)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    return dict(logits=logits, tokens=tokens, q=None if temperature == 0 else q,
                u_accept=torch.rand(B, G, generator=g, device=g.device),
                u_sample=torch.rand(B, generator=g, device=g.device),
                guidance_scale=guidance, temperature=temperature, top_k=top_k, group=group)


def measured_cases(seed: int) -> list[dict]:
    """The small shapes checked on every machine: kernel, shape, the public function names, inputs."""
    from ..core.rope import Rope1D, Rope3D
    from ..kernels.guided_accept import Grouping

    g = torch.Generator().manual_seed(seed)
    cases = [
        dict(kernel="tree_attention", shape="B=2 Hq=6 Hkv=3 T=17 S=60 D=24", fn="tree_attention",
             inputs=_tree_inputs(g, 2, 6, 3, 17, 60, 24)),
        dict(kernel="tree_attention", shape="B=1 Hq=8 Hkv=8 T=60 S=512 D=64", fn="tree_attention",
             inputs=_tree_inputs(g, 1, 8, 8, 60, 512, 64)),
        dict(kernel="rolling_attention", shape="tokens sink=4 window=251 T=4 H=8/2 D=64 rope=1d",
             fn="rolling_attention", inputs=_rolling_inputs(g, 2, 8, 2, 4, 64, 4, 251, Rope1D(64), 3)),
        dict(kernel="rolling_attention", shape="frames 4x4 sink=1 window=3 chunk=1 H=4 D=48 rope=3d",
             fn="rolling_attention",
             inputs=_rolling_inputs(g, 1, 4, 4, 16, 48, 16, 48, Rope3D(48, frame_shape=(4, 4)), 16)),
        dict(kernel="guided_accept", shape="B=8 G=4 V=1024 cfg exact", fn="guided_accept",
             inputs=_accept_inputs(g, 8, 4, 1024)),
        dict(kernel="guided_accept", shape="B=4 G=4 V=1024 cfg top_k=64", fn="guided_accept",
             inputs=_accept_inputs(g, 4, 4, 1024, top_k=64)),
        dict(kernel="guided_accept", shape="B=4 G=3 V=512 cfg gsd", fn="guided_accept",
             inputs=_accept_inputs(g, 4, 3, 512, group=Grouping(torch.randn(512, 8, generator=g), 0.05, 12.0, 7))),
        dict(kernel="guided_accept", shape="B=8 G=4 V=1024 cfg greedy", fn="guided_accept",
             inputs=_accept_inputs(g, 8, 4, 1024, temperature=0)),
    ]
    return cases


def projected_case(row: dict, g: torch.Generator) -> tuple[str, dict]:
    """A projected row's shape (its ``inputs``) as the public function name and fp32 inputs on
    ``g``'s device, so the projection can be measured at the shape it is about."""
    from ..core.rope import Rope1D, Rope3D

    s = row["inputs"]
    if row["kernel"] == "tree_attention":
        T, prefix = s["tree_nodes"], s["cache_tokens"]
        return "tree_attention", _tree_inputs(g, s["B"], s["heads"], s["kv_heads"], T, prefix + T, s["head_dim"],
                                              prefix=prefix)
    if row["kernel"] == "rolling_attention":
        D, T = s["head_dim"], s["queries"]
        if s["rope"] == "3d":
            rope, mask = Rope3D(D, frame_shape=tuple(s["frame_shape"])), None
        else:  # a draft tree's block: ancestor mask
            rope, mask = Rope1D(D), _ancestor_mask(g, s["B"], T)
        ring = s["window"] // 3 // s["frame_tokens"] * s["frame_tokens"]  # wrapped, on a frame boundary
        return "rolling_attention", _rolling_inputs(g, s["B"], s["heads"], s["heads"], T, D, s["sink"], s["window"],
                                                    rope, ring, mask)
    return "guided_accept", _accept_inputs(g, s["B"], s["drafts"], s["vocab"])


# -- checks ---------------------------------------------------------------------------------------
def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    """The inputs at ``dtype``: q, k, v for attention; for acceptance the logits only (its ``q``, the
    drafts' probabilities, stays fp32, as the core's logits pipeline hands it over)."""
    keys = ("logits",) if "logits" in inputs else ("q", "k", "v")
    return {k: v.to(dtype) if k in keys and isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple):  # ChainAcceptance
        return type(obj)(*(_to(t, device) for t in obj))
    return obj


def _tail(exc: BaseException, lines: int = 8, chars: int = 800) -> str:
    """The error's last lines: where Triton's compilation errors and the interpreter's tracebacks
    say what failed."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def _attention_tolerance(reference, inputs, exact, dtype, compiled: bool = False) -> float:
    """fp32: 2e-6 (compiled: plus ``CUDA_FP32_SLACK``); lower precisions: twice torch's own error at
    that precision plus a quarter ulp at the outputs' scale (the tests' criterion, flash-attn's).
    Torch's error is taken where ``inputs`` are."""
    if dtype == torch.float32:
        return 2e-6 + (CUDA_FP32_SLACK if compiled else 0.0)
    torch_err = (reference(**_cast(inputs, dtype)).float() - exact).abs().max().item()
    floor = {torch.float16: 2.5e-4, torch.bfloat16: 2e-3}[dtype]
    return 2 * torch_err + floor * exact.abs().max().item()


def _check(fn: str, out, inputs: dict, dtype: torch.dtype, truth: torch.device, compiled: bool) -> dict:
    """The kernel's output ``out`` against the reference on fp32 ``inputs`` moved to ``truth``."""
    from .. import kernels

    reference = getattr(kernels, fn + "_reference")
    if fn == "guided_accept":
        # on the CPU: torch's CUDA cumsum accumulates in fp32, the kernel (like the CPU) in fp64
        ref = reference(**_to(_cast(inputs, dtype), "cpu"))
        out = _to(out, "cpu")
        err = (out.accept_prob - ref.accept_prob).abs().max().item()
        equal = bool(torch.equal(out.num_accepted, ref.num_accepted) and torch.equal(out.next_token, ref.next_token))
        tol = 1e-5 if compiled else 1e-6  # the CUDA tests' and the interpreter tests' tolerances
        return dict(max_abs_err=err, tolerance=tol, decisions_equal=equal, correct=equal and err <= tol)
    inputs = _to(inputs, truth)
    exact = reference(**inputs)
    err = (out.to(truth).float() - exact).abs().max().item()
    tol = _attention_tolerance(reference, inputs, exact, dtype, compiled)
    return dict(max_abs_err=err, tolerance=tol, correct=err <= tol)


# -- small shapes in Triton's interpreter (no GPU) ------------------------------------------------
def _time(fn, repeats: int) -> float:
    """Milliseconds: the median of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _head(case: dict, dtype: torch.dtype, device: str) -> dict:
    return {"kernel": case["kernel"], "shape": case["shape"], "dtype": str(dtype).removeprefix("torch."),
            "projected": False, "measured": False, "device": device}


def _interpreted(cfg: KernelBenchConfig, say) -> list[dict]:
    from .. import kernels
    from ..kernels.interpret import run_interpreted

    runs = [(case, dtype) for case in measured_cases(cfg.seed) for dtype in INTERPRETED_DTYPES[case["kernel"]]]
    calls = {str(i): (case["fn"] + "_triton", (), _cast(case["inputs"], dtype)) for i, (case, dtype) in enumerate(runs)}
    outputs = None
    if kernels.dispatch.TRITON_AVAILABLE:
        say(f"kernels: {len(calls)} kernel calls in Triton's interpreter (a child process)")
        outputs = run_interpreted(calls)
    rows = []
    for i, (case, dtype) in enumerate(runs):
        reference = getattr(kernels, case["fn"] + "_reference")
        say(f"kernels: {case['kernel']} {case['shape']} {str(dtype).removeprefix('torch.')}")
        row = _head(case, dtype, "cpu")
        cast = _cast(case["inputs"], dtype)
        row["reference_ms"] = _time(lambda: reference(**cast), cfg.repeats)
        out = None if outputs is None else outputs[str(i)]
        if out is None:
            row.update(max_abs_err=None, tolerance=None, correct=None, note="triton is not installed")
        elif isinstance(out, Exception):
            row.update(max_abs_err=None, tolerance=None, correct=False, note=_tail(out))
        else:
            row.update(_check(case["fn"], out, case["inputs"], dtype, torch.device("cpu"), compiled=False))
        rows.append(row)
    return rows


# -- compiled kernels (a GPU) ---------------------------------------------------------------------
def _layer_path(fn: str, inputs: dict):
    """The models' per-layer torch path on these inputs, the mask (and RoPE tables) built now, as
    the caches build them once per forward: a zero-argument callable."""
    from ..kernels.rolling_attention import slot_table
    from ..kernels.tree_attention import visibility

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    gqa = q.shape[1] != k.shape[1]
    if fn == "tree_attention":
        mask = visibility(inputs["prefix_lens"], q.shape[2], k.shape[2], inputs["tree_mask"])
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    rope, positions = inputs["rope"], inputs["positions"]
    ring = inputs.get("ring_start")
    key_pos, visible = slot_table(inputs["lengths"], torch.zeros_like(inputs["lengths"]) if ring is None else ring,
                                  inputs["block_start"], positions, inputs["sink"], inputs["window"], k.shape[2],
                                  inputs.get("tree_mask"))
    q_tables, k_tables, mask = rope.tables(positions), rope.tables(key_pos), visible[:, None]
    return lambda: F.scaled_dot_product_attention(rope.apply(q, q_tables), rope.apply(k, k_tables), v, attn_mask=mask,
                                                  enable_gqa=gqa)


def num_splits(inputs: dict, device: torch.device) -> int:
    """The key splits ``tree_attention_triton`` and ``rolling_attention_triton`` choose on
    ``device`` for attention ``inputs`` (``splitk.auto_splits``)."""
    from ..kernels import splitk

    return splitk.auto_splits(tuple(inputs["q"].shape), inputs["k"].shape[2], device)


def _compiled(fn: str, inputs: dict, dtype: torch.dtype, cfg: KernelBenchConfig, device: torch.device,
              truth: torch.device) -> dict:
    """One row's checks and timings: the kernel run once on ``device`` (compiling it) and checked
    against the reference on ``truth``, then kernel, reference and (attention) the per-layer path
    timed one after the other; attention rows record the launcher's ``num_splits``. Every failure
    becomes a ``note``; nothing raises."""
    from .. import kernels

    launcher = getattr(kernels, fn + "_triton")
    reference = getattr(kernels, fn + "_reference")
    cast = _to(_cast(inputs, dtype), device)
    notes = []
    result = {"max_abs_err": None, "tolerance": None, "correct": False}
    if fn != "guided_accept":
        result["num_splits"] = num_splits(cast, device)
    try:
        out = launcher(**cast)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a faulting launch raises here, inside this row
        ran = True
    except Exception as exc:  # compilation and launch errors alike: the row records them
        ran = False
        notes.append(f"the kernel failed: {_tail(exc)}")
    if ran:
        try:
            result.update(_check(fn, out, inputs, dtype, truth, compiled=True))
        except Exception as exc:
            notes.append(f"the check failed: {_tail(exc)}")
    sides = {"kernel": (lambda: launcher(**cast)) if ran else None, "reference": lambda: reference(**cast)}
    if fn != "guided_accept":
        try:
            sides["sdpa"] = _layer_path(fn, cast)
        except Exception as exc:
            notes.append(f"building the per-layer path failed: {_tail(exc)}")
    for side, call in sides.items():
        if call is None:
            continue
        try:
            median, p20, p80 = gpu_time(call, cfg.warmup_ms, cfg.rep_ms)
        except Exception as exc:
            notes.append(f"timing the {side} failed: {_tail(exc)}")
            continue
        result[f"{side}_ms"], result[f"{side}_ms_p20_p80"] = median, [p20, p80]
    result["measured"] = "kernel_ms" in result
    for key, side in (("speedup", "reference"), ("sdpa_speedup", "sdpa")):
        if result["measured"] and f"{side}_ms" in result:
            result[key] = result[f"{side}_ms"] / result["kernel_ms"]
    if notes:
        result["note"] = "\n".join(notes)
    return result


def _as_measured_projection(result: dict) -> dict:
    """A compiled result as the keys a projected row gains (times in us, beside the projection's)."""
    out = {k: result[k] for k in ("measured", "correct", "decisions_equal", "num_splits", "note") if k in result}
    out["measured_max_abs_err"], out["measured_tolerance"] = result["max_abs_err"], result["tolerance"]
    for side, name in (("kernel", "kernel"), ("reference", "torch"), ("sdpa", "sdpa")):
        if f"{side}_ms" in result:
            out[f"measured_{name}_us"] = 1e3 * result[f"{side}_ms"]
            out[f"measured_{name}_us_p20_p80"] = [1e3 * t for t in result[f"{side}_ms_p20_p80"]]
    for key in ("speedup", "sdpa_speedup"):
        if key in result:
            out[f"measured_{key}"] = result[key]
    return out


def measure_compiled(cfg: KernelBenchConfig, say, device: torch.device) -> list[dict]:
    """Small-shape rows, then projected rows (the key sweep's among them), with the kernels
    compiled on ``device`` (module docstring). The projected shapes run first, in
    ``projected_rows``' order: their timings are what a GPU run is for, and the small shapes'
    correctness per dtype is also checked by ``pytest -m cuda``."""
    started = time.perf_counter()
    cpu = torch.device("cpu")

    def out_of_time(row: dict) -> bool:
        if time.perf_counter() - started <= cfg.budget_s:
            return False
        row["note"] = f"not run: the bench's {cfg.budget_s:.0f} s budget (budget_s) was spent"
        return True

    projected = projected_rows()
    for row in projected:
        if out_of_time(row):
            continue
        say(f"kernels: {row['kernel']} {row['shape']} {row['dtype']} (measured at the projected shape)")
        try:
            fn, inputs = projected_case(row, torch.Generator(device).manual_seed(cfg.seed))
        except Exception as exc:  # e.g. out of memory: the other rows still run
            row["note"] = f"building the inputs failed: {_tail(exc)}"
            continue
        # the projected shapes are too large for a CPU reference: the GPU's fp32 one is the truth
        # for attention (acceptance is checked on the CPU either way)
        row.update(_as_measured_projection(_compiled(fn, inputs, getattr(torch, row["dtype"]), cfg, device, device)))
        del inputs
    rows = []
    for case in measured_cases(cfg.seed):
        for dtype in COMPILED_DTYPES[case["kernel"]]:
            row = _head(case, dtype, device.type)
            rows.append(row)
            if out_of_time(row):
                row.update(max_abs_err=None, tolerance=None, correct=None)
                continue
            say(f"kernels: {case['kernel']} {case['shape']} {row['dtype']}")
            row.update(_compiled(case["fn"], case["inputs"], dtype, cfg, device, cpu))
    return rows + projected


# -- projected rows --------------------------------------------------------------------------------
def _stage(bytes_: float, tensor_flops: float = 0.0, fp32_flops: float = 0.0, sfu_ops: float = 0.0) -> dict:
    """One kernel launch at the H100's roofs: its time is the slowest of HBM traffic, tensor-core
    FLOPs, FP32 FLOPs and special-function (exp, sin, cos) operations."""
    roofs = {"memory": bytes_ / H100["hbm_bytes_per_s"], "tensor": tensor_flops / H100["tensor_flops_16bit"],
             "fp32": fp32_flops / H100["fp32_flops"], "sfu": sfu_ops / H100["sfu_ops_per_s"]}
    bound = max(roofs, key=roofs.get)
    return {"bytes": bytes_, "flops": tensor_flops + fp32_flops, "sfu_ops": sfu_ops, "us": 1e6 * roofs[bound],
            "bound": bound, **{f"{k}_us": 1e6 * v for k, v in roofs.items()}}


def _projection(kernel: str, shape: str, dtype: str, inputs: dict, fused: dict, torch_stages: dict) -> dict:
    """A projected row: the kernel as one launch, the torch path as the sum of its launches."""
    return {
        "kernel": kernel, "shape": shape, "dtype": dtype, "max_abs_err": None, "tolerance": None, "correct": None,
        "reference_ms": None, "projected": True, "measured": False, "inputs": inputs, "gpu": H100,
        "bytes": fused["bytes"], "mb": fused["bytes"] / 1e6, "flops": fused["flops"], "sfu_ops": fused["sfu_ops"],
        "h100_memory_us": fused["memory_us"], "h100_compute_us": max(fused["tensor_us"], fused["fp32_us"]),
        "h100_sfu_us": fused["sfu_us"], "h100_us": fused["us"], "bound": fused["bound"], "launches": 1,
        "torch_bytes": sum(st["bytes"] for st in torch_stages.values()),
        "torch_mb": sum(st["bytes"] for st in torch_stages.values()) / 1e6,
        "torch_flops": sum(st["flops"] for st in torch_stages.values()),
        "torch_h100_us": sum(st["us"] for st in torch_stages.values()),
        "torch_stages": torch_stages, "torch_launches": len(torch_stages),
        "projected_speedup": sum(st["us"] for st in torch_stages.values()) / fused["us"],
    }


def _attention_terms(B, H, Hkv, T, S, D, elem):
    """Compulsory bytes of q, o, k, v; the score FLOPs (q k^T and p v) and exps of a block of T
    queries over S keys."""
    qo = 2 * B * H * T * D * elem
    kv = 2 * B * Hkv * S * D * elem
    return qo, kv, 4 * B * H * T * S * D, B * H * T * S


def project_tree_attention(B=1, H=32, Hkv=32, D=128, T=60, prefix=4096, dtype="float16") -> dict:
    """EAGLE-2's 60-node tree over a 4k-token cache with Llama-7B's attention (32 heads of 128), one
    layer, fp16. Torch path (the models' today): ``visibility_mask`` builds a (B, 1, T, S) bool
    mask, SDPA's masked (memory-efficient) backend reads it as an additive mask in q's dtype."""
    elem = getattr(torch, dtype).itemsize
    S = prefix + T
    qo, kv, flops, exps = _attention_terms(B, H, Hkv, T, S, D, elem)
    tree = B * T * T
    fused = _stage(qo + kv + tree, flops, sfu_ops=exps)
    stages = {"visibility_mask": _stage(B * T * S * (1 + 1 + 2 * elem)),  # bool written, read, additive written
              "sdpa": _stage(qo + kv + B * T * S * elem, flops, sfu_ops=exps)}
    inputs = dict(B=B, heads=H, kv_heads=Hkv, head_dim=D, tree_nodes=T, cache_tokens=prefix, bytes_per_element=elem)
    return _projection("tree_attention", f"eagle2 tree T={T} over S={prefix}, llama-7b heads {H}x{D}", dtype,
                       inputs, fused, stages)


def _rolling_projection(label, B, H, D, T, sink, window, elem, dtype, rope, frame_shape=None):
    """Fused: one launch, keys rotated on load by every query tile (sin and cos per element).
    Torch (``SinkWindowCache``'s read): RoPE writes rotated copies of the keys and the queries (read
    once, written once, read again by SDPA; the fp32 temporaries of ``RotaryEmbedding.apply`` not
    counted) and cos/sin tables, the dense mask as for tree attention, then SDPA."""
    held = sink + window
    C = held + T
    q_tiles = -(-T // 64)  # the launcher's BLOCK_M
    qo, kv, flops, exps = _attention_terms(B, H, H, T, C, D, elem)
    rot_sfu = 2 * B * H * C * D * q_tiles + 2 * B * H * T * D  # cos and sin per element, per query tile
    fused = _stage(qo + kv, flops, fp32_flops=4 * B * H * C * D * q_tiles, sfu_ops=exps + rot_sfu)
    k_bytes, q_bytes = B * H * C * D * elem, B * H * T * D * elem
    stages = {"rope": _stage(2 * (k_bytes + q_bytes) + 2 * B * C * D * 4, fp32_flops=6 * B * H * C * D,
                             sfu_ops=B * C * D),
              "visibility_mask": _stage(B * T * C * (1 + 1 + 2 * elem)),
              "sdpa": _stage(qo + kv + B * T * C * elem, flops, sfu_ops=exps)}
    frame_tokens = 1 if frame_shape is None else frame_shape[0] * frame_shape[1]
    inputs = dict(B=B, heads=H, head_dim=D, queries=T, held_keys=held, keys=C, query_tiles=q_tiles,
                  bytes_per_element=elem, sink=sink, window=window, rope=rope,
                  frame_shape=None if frame_shape is None else list(frame_shape), frame_tokens=frame_tokens)
    return _projection("rolling_attention", label, dtype, inputs, fused, stages)


def project_rolling_tokens(B=1, H=32, D=128, T=60, sink=4, window=4092, dtype="float16") -> dict:
    """StreamingLLM with an EAGLE-2 tree: a 60-node block over a full 4 + 4,092-token sink-window
    cache, Llama-7B heads, fp16 (one query tile: the case the fused kernel is for)."""
    return _rolling_projection(f"tree T={T} over sink {sink} + window {window}, llama-7b heads {H}x{D}", B, H, D, T,
                               sink, window, getattr(torch, dtype).itemsize, dtype, "1d")


def project_rolling_video(B=1, H=12, D=128, frame_shape=(30, 52), chunk=3, window_frames=21, sink_frames=1) -> dict:
    """A Self-Forcing chunk of 3 frames over a 21-frame cache (1 sink frame + a 20-frame window) of
    30 x 52 = 1,560 tokens per frame (Wan-1.3B at 480 x 832), Wan-1.3B heads, bf16: 74 query tiles
    each re-rotating every key, so the fused kernel is sin/cos-bound and projected slower than the
    torch path; the dispatcher sends blocks of more than 128 queries (``dispatch.PREFERRED``) to the
    reference."""
    frame_tokens = frame_shape[0] * frame_shape[1]
    return _rolling_projection(f"{chunk}-frame chunk over {window_frames} frames x {frame_tokens} tokens, "
                               f"wan-1.3b heads {H}x{D}", B, H, D, chunk * frame_tokens, sink_frames * frame_tokens,
                               (window_frames - sink_frames) * frame_tokens, 2, "bfloat16", "3d", frame_shape)


def project_guided_accept(B=1, G=15, V=16384, elem=4) -> dict:
    """Guided acceptance of a 15-draft chain (16 scored positions) over a 16,384-entry image
    vocabulary, CFG on (two logit rows per position), fp32 logits. Fused: two launches that read
    every logit (and the rejected position's q) once from HBM, the repeated passes of a row coming
    from L2; only scalars are written. Torch (``LogitsPipeline`` + ``SpeculativeSampling``): per
    op, the elements it reads and writes: the CFG merge (sub, mul, add), temperature, softmax (two
    internal passes), gathers, then at the rejected position the residual (sub, clamp, sum, div,
    where), the bonus/correction select and the CDF (cumsum, searchsorted)."""
    N = G + 1
    rows = B * N * V * elem  # one (B, N, V) fp32 tensor
    row = B * V * elem
    fused = _stage(2 * rows + row, fp32_flops=8 * B * N * V, sfu_ops=2 * B * N * V)
    stages = {"sub": _stage(3 * rows), "mul": _stage(2 * rows), "add": _stage(3 * rows), "div": _stage(2 * rows),
              "softmax": _stage(4 * rows, fp32_flops=4 * B * N * V, sfu_ops=B * N * V),
              "accept": _stage(4 * B * N * elem), "residual": _stage(11 * row), "select": _stage(3 * row),
              "cumsum": _stage(2 * row), "searchsorted": _stage(B * 4 * 14)}
    inputs = dict(B=B, drafts=G, positions=N, vocab=V, guidance=True, bytes_per_element=elem,
                  note="at this size every launch costs a few microseconds of latency, more than its traffic")
    return _projection("guided_accept", f"chain G={G} over V={V}, cfg", "float32", inputs, fused, stages)


KEY_SWEEP = (256, 1024, 4096, 16384)
"""The key sweep's key counts: tokens cached under the tree (tree attention), sink + window
(rolling attention)."""
SWEEP_DTYPES = ("float16", "bfloat16")


def key_sweep_rows(keys=KEY_SWEEP, dtypes=SWEEP_DTYPES, H=32, D=128, T=60, sink=4) -> list[dict]:
    """``project_tree_attention`` over ``keys`` cached tokens and ``project_rolling_tokens`` over a
    sink of ``sink`` + a window of ``keys - sink``, per dtype (fp16 first), key count and kernel;
    each row's ``sweep_keys`` is its key count."""
    rows = []
    for dtype in dtypes:
        for n in keys:
            rows.append({**project_tree_attention(H=H, Hkv=H, D=D, T=T, prefix=n, dtype=dtype), "sweep_keys": n})
        for n in keys:
            rows.append({**project_rolling_tokens(H=H, D=D, T=T, sink=sink, window=n - sink, dtype=dtype),
                         "sweep_keys": n})
    return rows


def projected_rows() -> list[dict]:
    """The report's shapes, then the rest of the key sweep, in the order a GPU measures them. The
    report's tree and rolling-token rows are the sweep's fp16 rows at 4,096 keys (the defaults of
    their projections), so the shape the kernels were judged by is measured first; when the
    budget (``budget_s``) runs out, the bf16 sweep and the small shapes are what goes."""
    sweep = key_sweep_rows()
    report = [r for r in sweep if (r["sweep_keys"], r["dtype"]) == (4096, "float16")]
    rest = [r for r in sweep if (r["sweep_keys"], r["dtype"]) != (4096, "float16")]
    return report + [project_rolling_video(), project_guided_accept()] + rest


# -- the bench ------------------------------------------------------------------------------------
def _setup(cfg: KernelBenchConfig, device: torch.device | None, elapsed: float) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    setup = {"repeats": cfg.repeats, "seed": cfg.seed, "torch_threads": torch.get_num_threads(),
             "torch": torch.__version__, "triton": triton_version, "gpu_model": H100, "elapsed_s": elapsed}
    if device is None:
        return {**setup, "device": "cpu", "kernels_ran": "Triton's CPU interpreter", "gpu_name": None,
                "timer": f"time.perf_counter, the median of {cfg.repeats} calls after one warm-up (references only)"}
    from ..kernels import splitk

    return {**setup, "device": device.type, "sm_count": splitk.sm_count(device),
            "kernels_ran": "compiled (CUDA)" if device.type == "cuda" else f"compiled ({device.type})",
            "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "timer": "triton.testing.do_bench", "warmup_ms": cfg.warmup_ms, "rep_ms": cfg.rep_ms,
            "budget_s": cfg.budget_s}


def run(config: KernelBenchConfig | None = None, progress=None, device: str | torch.device | None = None) -> dict:
    """``{"bench": "kernels", "rows": [...], "setup": {...}}``: small-shape rows, then projected ones.

    ``device``: where the kernels run compiled; None takes CUDA when it is available and Triton's
    interpreter otherwise."""
    cfg = config or KernelBenchConfig()
    say = progress or (lambda msg: None)
    if device is None and torch.cuda.is_available():
        device = "cuda"
    device = None if device is None else torch.device(device)
    started = time.perf_counter()
    rows = _interpreted(cfg, say) + projected_rows() if device is None else measure_compiled(cfg, say, device)
    return {"bench": "kernels", "rows": rows, "setup": _setup(cfg, device, time.perf_counter() - started)}


KERNELS_COLUMNS = [
    ("kernel", "kernel"), ("shape", "shape"), ("dtype", "dtype"), ("projected", "projected"),
    ("measured", "measured"), ("max_abs_err", "max abs err"), ("tolerance", "tolerance"), ("correct", "correct"),
    ("kernel_ms", "kernel ms"), ("reference_ms", "reference ms"), ("sdpa_ms", "sdpa ms"),
    ("speedup", "x reference"), ("mb", "MB"), ("torch_mb", "torch MB"), ("h100_us", "H100 us"),
    ("torch_h100_us", "torch H100 us"), ("bound", "bound"), ("projected_speedup", "x torch H100"),
    ("measured_kernel_us", "kernel us"), ("measured_torch_us", "torch us"), ("measured_speedup", "x torch"),
    ("measured_sdpa_us", "sdpa us"), ("measured_sdpa_speedup", "x sdpa"), ("num_splits", "splits"),
]

__all__ = ["H100", "KERNELS_COLUMNS", "KEY_SWEEP", "KernelBenchConfig", "gpu_time", "key_sweep_rows",
           "measure_compiled", "measured_cases", "num_splits", "projected_case", "projected_rows", "run"]
