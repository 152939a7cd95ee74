"""``mmspec bench kernels``: the kernels behind the core, checked and timed where they can run: at
small shapes everywhere, and on a GPU also at realistic GPU shapes.

Small-shape rows (``gpu_shape: false``), per kernel, shape and dtype: the Triton kernel's output
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

GPU-shape rows (``gpu_shape: true``, CUDA only: the interpreter cannot run them at these sizes):
the shapes the kernels are for (``gpu_shape_rows``; the row's ``inputs`` say the shape), built on
the GPU, checked against the fp32 reference there (acceptance: on the CPU, whose fp64 CDF the
kernel follows) and timed as above, with the small rows' fields. These shapes once also carried
roofline projections for an H100 (bytes, FLOPs and times at its roofs, never measured); the H200
measurements of the GPU checks (docs/gpu-reports/) replaced them.

Key sweep (``key_sweep_rows``, rows with ``sweep_keys``): the tree-attention and rolling-token
shapes (EAGLE-2's 60-node tree, Llama-7B's 32 heads of 128, batch 1) at 256, 1,024, 4,096 and
16,384 keys (``KEY_SWEEP``: tokens cached under the tree, or the rolling cache's sink of 4 plus
its window), in fp16 and bf16. The two fp16 rows at 4,096 keys are the sweep's own points there,
not repeated.

On CUDA the GPU-shape rows run first (the 4,096-key fp16 shapes, the video chunk and the
acceptance step, then the rest of the sweep, fp16 before bf16), then the small shapes; rows are
started until ``budget_s`` has passed, later ones say so in ``note`` and stay ``measured: false``:
a run that overstays a GPU check's time limit would be killed before writing anything, so slow
compilation costs the last rows, not the report.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass

import torch
from torch.nn import functional as F

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


def gpu_shape_case(row: dict, g: torch.Generator) -> tuple[str, dict]:
    """A GPU-shape row's shape (its ``inputs``) as the public function name and fp32 inputs on
    ``g``'s device."""
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
    drafts' probabilities, stays fp32, as the core's logits processor hands it over)."""
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
            "gpu_shape": False, "measured": False, "device": device}


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


def measure_compiled(cfg: KernelBenchConfig, say, device: torch.device) -> list[dict]:
    """Small-shape rows, then GPU-shape rows (the key sweep's among them), with the kernels
    compiled on ``device`` (module docstring). The GPU shapes run first, in ``gpu_shape_rows``'
    order: their timings are what a GPU run is for, and the small shapes' correctness per dtype is
    also checked by ``pytest -m cuda``."""
    started = time.perf_counter()
    cpu = torch.device("cpu")

    def out_of_time(row: dict) -> bool:
        if time.perf_counter() - started <= cfg.budget_s:
            return False
        row["note"] = f"not run: the bench's {cfg.budget_s:.0f} s budget (budget_s) was spent"
        return True

    shaped = gpu_shape_rows()
    for row in shaped:
        row["device"] = device.type
        if out_of_time(row):
            continue
        say(f"kernels: {row['kernel']} {row['shape']} {row['dtype']} (GPU shape)")
        try:
            fn, inputs = gpu_shape_case(row, torch.Generator(device).manual_seed(cfg.seed))
        except Exception as exc:  # e.g. out of memory: the other rows still run
            row["note"] = f"building the inputs failed: {_tail(exc)}"
            continue
        # the GPU shapes are too large for a CPU reference: the GPU's fp32 one is the truth for
        # attention (acceptance is checked on the CPU either way)
        row.update(_compiled(fn, inputs, getattr(torch, row["dtype"]), cfg, device, device))
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
    return rows + shaped


# -- GPU-shape rows --------------------------------------------------------------------------------
def _gpu_row(kernel: str, shape: str, dtype: str, inputs: dict) -> dict:
    """A GPU-shape row before it runs: what it is and its ``inputs`` (the shape ``gpu_shape_case``
    builds); the compiled path adds the checks and times."""
    return {"kernel": kernel, "shape": shape, "dtype": dtype, "gpu_shape": True, "measured": False,
            "max_abs_err": None, "tolerance": None, "correct": None, "reference_ms": None,
            "inputs": inputs}


def tree_attention_shape(B=1, H=32, Hkv=32, D=128, T=60, prefix=4096, dtype="float16") -> dict:
    """EAGLE-2's 60-node tree over a 4k-token cache with Llama-7B's attention (32 heads of 128), one
    layer, fp16."""
    inputs = dict(B=B, heads=H, kv_heads=Hkv, head_dim=D, tree_nodes=T, cache_tokens=prefix)
    return _gpu_row("tree_attention", f"eagle2 tree T={T} over S={prefix}, llama-7b heads {H}x{D}", dtype,
                    inputs)


def _rolling_shape(label, B, H, D, T, sink, window, dtype, rope, frame_shape) -> dict:
    frame_tokens = 1 if frame_shape is None else frame_shape[0] * frame_shape[1]
    inputs = dict(B=B, heads=H, head_dim=D, queries=T, held_keys=sink + window, keys=sink + window + T, sink=sink,
                  window=window, rope=rope, frame_shape=None if frame_shape is None else list(frame_shape),
                  frame_tokens=frame_tokens)
    return _gpu_row("rolling_attention", label, dtype, inputs)


def rolling_tokens_shape(B=1, H=32, D=128, T=60, sink=4, window=4092, dtype="float16") -> dict:
    """StreamingLLM with an EAGLE-2 tree: a 60-node block over a full 4 + 4,092-token sink-window
    cache, Llama-7B heads, fp16 (one query tile: the case the fused kernel is for)."""
    return _rolling_shape(f"tree T={T} over sink {sink} + window {window}, llama-7b heads {H}x{D}", B, H, D, T,
                          sink, window, dtype, "1d", None)


def rolling_video_shape(B=1, H=12, D=128, frame_shape=(30, 52), chunk=3, window_frames=21, sink_frames=1) -> dict:
    """A Self-Forcing chunk of 3 frames over a 21-frame cache (1 sink frame + a 20-frame window) of
    30 x 52 = 1,560 tokens per frame (Wan-1.3B at 480 x 832), Wan-1.3B heads, bf16: the block the
    dispatcher sends to the reference (more than 128 queries, ``dispatch.PREFERRED``), measured on
    an H200 at 22 times the torch path's time."""
    frame_tokens = frame_shape[0] * frame_shape[1]
    return _rolling_shape(f"{chunk}-frame chunk over {window_frames} frames x {frame_tokens} tokens, "
                          f"wan-1.3b heads {H}x{D}", B, H, D, chunk * frame_tokens, sink_frames * frame_tokens,
                          (window_frames - sink_frames) * frame_tokens, "bfloat16", "3d", frame_shape)


def guided_accept_shape(B=1, G=15, V=16384) -> dict:
    """Guided acceptance of a 15-draft chain (16 scored positions) over a 16,384-entry image
    vocabulary, CFG on (two logit rows per position), fp32 logits."""
    inputs = dict(B=B, drafts=G, positions=G + 1, vocab=V, guidance=True)
    return _gpu_row("guided_accept", f"chain G={G} over V={V}, cfg", "float32", inputs)


KEY_SWEEP = (256, 1024, 4096, 16384)
"""The key sweep's key counts: tokens cached under the tree (tree attention), sink + window
(rolling attention)."""
SWEEP_DTYPES = ("float16", "bfloat16")


def key_sweep_rows(keys=KEY_SWEEP, dtypes=SWEEP_DTYPES, H=32, D=128, T=60, sink=4) -> list[dict]:
    """``tree_attention_shape`` over ``keys`` cached tokens and ``rolling_tokens_shape`` over a
    sink of ``sink`` + a window of ``keys - sink``, per dtype (fp16 first), key count and kernel;
    each row's ``sweep_keys`` is its key count."""
    rows = []
    for dtype in dtypes:
        for n in keys:
            rows.append({**tree_attention_shape(H=H, Hkv=H, D=D, T=T, prefix=n, dtype=dtype), "sweep_keys": n})
        for n in keys:
            rows.append({**rolling_tokens_shape(H=H, D=D, T=T, sink=sink, window=n - sink, dtype=dtype),
                         "sweep_keys": n})
    return rows


def gpu_shape_rows() -> list[dict]:
    """The GPU-shape rows in the order a GPU measures them: the sweep's fp16 tree and rolling-token
    rows at 4,096 keys (the shapes the kernels were judged by), the video chunk and the acceptance
    step, then the rest of the key sweep; when the budget (``budget_s``) runs out, the bf16 sweep
    and the small shapes are what goes."""
    sweep = key_sweep_rows()
    first = [r for r in sweep if (r["sweep_keys"], r["dtype"]) == (4096, "float16")]
    rest = [r for r in sweep if (r["sweep_keys"], r["dtype"]) != (4096, "float16")]
    return first + [rolling_video_shape(), guided_accept_shape()] + rest


# -- the bench ------------------------------------------------------------------------------------
def _setup(cfg: KernelBenchConfig, device: torch.device | None, elapsed: float) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    setup = {"repeats": cfg.repeats, "seed": cfg.seed, "torch_threads": torch.get_num_threads(),
             "torch": torch.__version__, "triton": triton_version, "elapsed_s": elapsed}
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
    """``{"bench": "kernels", "rows": [...], "setup": {...}}``: small-shape rows, then (compiled
    only) the GPU-shape rows.

    ``device``: where the kernels run compiled; None takes CUDA when it is available and Triton's
    interpreter otherwise (small shapes only)."""
    cfg = config or KernelBenchConfig()
    say = progress or (lambda msg: None)
    if device is None and torch.cuda.is_available():
        device = "cuda"
    device = None if device is None else torch.device(device)
    started = time.perf_counter()
    rows = _interpreted(cfg, say) if device is None else measure_compiled(cfg, say, device)
    return {"bench": "kernels", "rows": rows, "setup": _setup(cfg, device, time.perf_counter() - started)}


KERNELS_COLUMNS = [
    ("kernel", "kernel"), ("shape", "shape"), ("dtype", "dtype"), ("gpu_shape", "GPU shape"),
    ("measured", "measured"), ("max_abs_err", "max abs err"), ("tolerance", "tolerance"), ("correct", "correct"),
    ("kernel_ms", "kernel ms"), ("reference_ms", "reference ms"), ("sdpa_ms", "sdpa ms"),
    ("speedup", "x reference"), ("sdpa_speedup", "x sdpa"), ("num_splits", "splits"),
]

__all__ = ["KERNELS_COLUMNS", "KEY_SWEEP", "KernelBenchConfig", "gpu_shape_case", "gpu_shape_rows", "gpu_time",
           "guided_accept_shape", "key_sweep_rows", "measure_compiled", "measured_cases", "num_splits",
           "rolling_tokens_shape", "rolling_video_shape", "run", "tree_attention_shape"]
