"""``mmspec bench kernels``: the kernels behind the core, measured where possible and projected
where not.

Measured rows (``projected: false``), per kernel, small shape and dtype: the Triton kernel's
output against the torch reference in fp32 (``max_abs_err`` beside the ``tolerance`` the tests
use; ``correct`` also requires the acceptance kernel's decisions to equal the reference's), and the
reference's time on this machine (``reference_ms``, the median of ``repeats`` calls after one
warm-up, ``torch.get_num_threads()`` threads). Without a GPU the kernels run in Triton's CPU
interpreter in a child process (``mmspec.kernels.interpret``), which says whether they compute the
right thing and nothing about their speed; with CUDA they run compiled, ``kernel_ms`` is timed
with CUDA events, and the attention rows add ``sdpa_ms``: ``scaled_dot_product_attention`` with
the dense mask, the models' path today.

Projected rows (``projected: true``): bytes moved and FLOPs per call at realistic GPU shapes, for
the kernel and for the torch path it replaces, and the time an H100 SXM would need at its HBM and
tensor-core roofs (``H100``). Nothing there is measured. Bytes are compulsory traffic: every input
read once and every output written once, at the shape's dtype (a tiled kernel re-reads key/value
tiles per query tile; on a GPU the L2 cache absorbs much of that, and it is left out for both
sides). The torch path's bytes add what it writes and reads back: materialised masks, the rotated
key copy, the logits pipeline's intermediates; its launches are counted because at these sizes the
acceptance step is launch-bound, not bandwidth-bound.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

H100 = {"name": "H100 SXM5", "hbm_bytes_per_s": 3.35e12, "tensor_flops_16bit": 989.4e12, "fp32_flops": 66.9e12,
        "sfu_ops_per_s": 132 * 16 * 1.98e9}
"""NVIDIA's datasheet figures (HBM3 bandwidth, dense FP16/BF16 tensor-core and FP32 peaks) and the
special-function units' rate: 16 exp/sin/cos per SM per clock (CUDA's throughput table for compute
capability 9.0) x 132 SMs x 1.98 GHz boost."""


@dataclass
class KernelBenchConfig:
    repeats: int = 5
    seed: int = 0

    @classmethod
    def quick(cls) -> "KernelBenchConfig":
        return cls(repeats=2)


# -- measured rows --------------------------------------------------------------------------------
def _tree_inputs(g, B, Hq, Hkv, T, S, D):
    parents = torch.stack([torch.randint(0, i, (B,), generator=g) for i in range(1, T)], 1)
    mask = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    rows = torch.arange(B)
    for i in range(1, T):  # ancestor mask: a node sees itself and its parent's ancestors
        mask[:, i] |= mask[rows, parents[:, i - 1]]
    prefix = torch.randint(S // 2, S - T + 1, (B,), generator=g)
    return dict(q=torch.randn(B, Hq, T, D, generator=g), k=torch.randn(B, Hkv, S, D, generator=g),
                v=torch.randn(B, Hkv, S, D, generator=g), prefix_lens=prefix, tree_mask=mask)


def _rolling_inputs(g, B, Hq, Hkv, T, D, sink, window, rope, ring):
    C = sink + window + T
    lengths = torch.full((B,), sink + window)
    return dict(q=torch.randn(B, Hq, T, D, generator=g), k=torch.randn(B, Hkv, C, D, generator=g),
                v=torch.randn(B, Hkv, C, D, generator=g), lengths=lengths, block_start=lengths.clone(),
                positions=lengths[:, None] + torch.arange(T), ring_start=torch.full((B,), ring),
                rope=rope, sink=sink, window=window, tree_mask=torch.ones(B, T, T, dtype=torch.bool))


def _accept_inputs(g, B, G, V, guidance=3.0, top_k=None, group=None, temperature=1.0):
    from ..kernels.guided_accept import process_logits

    logits = 2 * torch.randn(2 * B if guidance else B, G + 1, V, generator=g)
    target = process_logits(logits, guidance, 1.0)[:, :G].clamp_min(1e-30).log()
    q = process_logits(target + 0.7 * torch.randn(B, G, V, generator=g), None, 1.0, top_k)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    return dict(logits=logits, tokens=tokens, q=None if temperature == 0 else q,
                u_accept=torch.rand(B, G, generator=g), u_sample=torch.rand(B, generator=g),
                guidance_scale=guidance, temperature=temperature, top_k=top_k, group=group)


def measured_cases(seed: int) -> list[dict]:
    """The small shapes run on this machine: kernel, shape, the public function names, inputs."""
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


def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if k in ("q", "k", "v", "logits") and isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


def _time(fn, repeats: int, cuda: bool = False) -> float:
    """Milliseconds: the median of ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _attention_tolerance(reference, inputs, exact, dtype) -> float:
    """fp32: 2e-6; lower precisions: twice torch's own error at that precision plus a quarter ulp
    at the outputs' scale (the tests' criterion, flash-attn's)."""
    if dtype == torch.float32:
        return 2e-6
    torch_err = (reference(**_cast(inputs, dtype)).float() - exact).abs().max().item()
    floor = {torch.float16: 2.5e-4, torch.bfloat16: 2e-3}[dtype]
    return 2 * torch_err + floor * exact.abs().max().item()


def _measured(cfg: KernelBenchConfig, say) -> list[dict]:
    from .. import kernels
    from ..kernels.interpret import run_interpreted

    cuda = torch.cuda.is_available()
    cases = measured_cases(cfg.seed)
    dtypes = {"tree_attention": (torch.float32, torch.float16), "rolling_attention": (torch.float32, torch.float16),
              "guided_accept": (torch.float32,)}
    runs = [(case, dtype) for case in cases for dtype in dtypes[case["kernel"]]]
    calls = {str(i): (case["fn"] + "_triton", (), _cast(case["inputs"], dtype)) for i, (case, dtype) in enumerate(runs)}
    outputs = None
    if not cuda and kernels.dispatch.TRITON_AVAILABLE:
        say(f"kernels: {len(calls)} kernel calls in Triton's interpreter (a child process)")
        outputs = run_interpreted(calls)
    rows = []
    for i, (case, dtype) in enumerate(runs):
        reference = getattr(kernels, case["fn"] + "_reference")
        inputs = case["inputs"]
        say(f"kernels: {case['kernel']} {case['shape']} {str(dtype).removeprefix('torch.')}")
        row = {"kernel": case["kernel"], "shape": case["shape"], "dtype": str(dtype).removeprefix("torch."),
               "projected": False, "device": "cuda" if cuda else "cpu"}
        cast = _cast(inputs, dtype)
        row["reference_ms"] = _time(lambda: reference(**cast), cfg.repeats)
        if cuda:
            moved = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in cast.items()}
            launcher = getattr(kernels, case["fn"] + "_triton")
            out = launcher(**moved)
            row["kernel_ms"] = _time(lambda: launcher(**moved), cfg.repeats, cuda=True)
            row["reference_cuda_ms"] = _time(lambda: reference(**moved), cfg.repeats, cuda=True)
            out = type(out)(*(t.cpu() for t in out)) if isinstance(out, tuple) else out.cpu()
        elif outputs is not None:
            out = outputs[str(i)]
        else:
            out = None
        if isinstance(out, Exception) or out is None:
            row.update(max_abs_err=None, tolerance=None, correct=False if out is not None else None,
                       note=str(out)[-300:] if out is not None else "triton is not installed")
        elif case["kernel"] == "guided_accept":
            ref = reference(**inputs)
            row["max_abs_err"] = (out.accept_prob - ref.accept_prob).abs().max().item()
            row["tolerance"] = 1e-6
            row["decisions_equal"] = bool(torch.equal(out.num_accepted, ref.num_accepted)
                                          and torch.equal(out.next_token, ref.next_token))
            row["correct"] = row["decisions_equal"] and row["max_abs_err"] <= row["tolerance"]
        else:
            exact = reference(**inputs)
            row["max_abs_err"] = (out.float() - exact).abs().max().item()
            row["tolerance"] = _attention_tolerance(reference, inputs, exact, dtype)
            row["correct"] = row["max_abs_err"] <= row["tolerance"]
        rows.append(row)
    return rows


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
        "reference_ms": None, "projected": True, "inputs": inputs, "gpu": H100,
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


def project_tree_attention(B=1, H=32, Hkv=32, D=128, T=60, prefix=4096, elem=2) -> dict:
    """EAGLE-2's 60-node tree over a 4k-token cache with Llama-7B's attention (32 heads of 128), one
    layer, fp16. Torch path (the models' today): ``visibility_mask`` builds a (B, 1, T, S) bool
    mask, SDPA's masked (memory-efficient) backend reads it as an additive fp16 mask."""
    S = prefix + T
    qo, kv, flops, exps = _attention_terms(B, H, Hkv, T, S, D, elem)
    tree = B * T * T
    fused = _stage(qo + kv + tree, flops, sfu_ops=exps)
    stages = {"visibility_mask": _stage(B * T * S * (1 + 1 + 2 * elem)),  # bool written, read, additive written
              "sdpa": _stage(qo + kv + B * T * S * elem, flops, sfu_ops=exps)}
    inputs = dict(B=B, heads=H, kv_heads=Hkv, head_dim=D, tree_nodes=T, cache_tokens=prefix, bytes_per_element=elem)
    return _projection("tree_attention", f"eagle2 tree T={T} over S={prefix}, llama-7b heads {H}x{D}", "float16",
                       inputs, fused, stages)


def _rolling_projection(label, B, H, D, T, held, elem, dtype):
    """Fused: one launch, keys rotated on load by every query tile (sin and cos per element).
    Torch (``SinkWindowCache``'s read): RoPE writes rotated copies of the keys and the queries (read
    once, written once, read again by SDPA; the fp32 temporaries of ``RotaryEmbedding.apply`` not
    counted) and cos/sin tables, the dense mask as for tree attention, then SDPA."""
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
    inputs = dict(B=B, heads=H, head_dim=D, queries=T, held_keys=held, keys=C, query_tiles=q_tiles,
                  bytes_per_element=elem)
    return _projection("rolling_attention", label, dtype, inputs, fused, stages)


def project_rolling_tokens(B=1, H=32, D=128, T=60, sink=4, window=4092) -> dict:
    """StreamingLLM with an EAGLE-2 tree: a 60-node block over a full 4 + 4,092-token sink-window
    cache, Llama-7B heads, fp16 (one query tile: the case the fused kernel is for)."""
    return _rolling_projection(f"tree T={T} over sink {sink} + window {window}, llama-7b heads {H}x{D}", B, H, D, T,
                               sink + window, 2, "float16")


def project_rolling_video(B=1, H=12, D=128, frame_tokens=1560, chunk=3, window_frames=21) -> dict:
    """A Self-Forcing chunk of 3 frames over a 21-frame sink + window cache of 1,560 tokens per
    frame, Wan-1.3B heads, bf16: 74 query tiles each re-rotating every key, so the fused kernel is
    sin/cos-bound and projected slower than the torch path; the dispatcher sends blocks of more
    than ``FUSED_MAX_QUERIES`` queries to the reference."""
    return _rolling_projection(f"{chunk}-frame chunk over {window_frames} frames x {frame_tokens} tokens, "
                               f"wan-1.3b heads {H}x{D}", B, H, D, chunk * frame_tokens,
                               window_frames * frame_tokens, 2, "bfloat16")


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


def projected_rows() -> list[dict]:
    return [project_tree_attention(), project_rolling_tokens(), project_rolling_video(), project_guided_accept()]


def run(config: KernelBenchConfig | None = None, progress=None) -> dict:
    """``{"bench": "kernels", "rows": [...], "setup": {...}}``: measured rows, then projected ones."""
    cfg = config or KernelBenchConfig()
    say = progress or (lambda msg: None)
    rows = _measured(cfg, say) + projected_rows()
    setup = {"repeats": cfg.repeats, "seed": cfg.seed, "torch_threads": torch.get_num_threads(),
             "device": "cuda" if torch.cuda.is_available() else "cpu",
             "kernels_ran": "compiled (CUDA)" if torch.cuda.is_available() else "Triton's CPU interpreter",
             "gpu_model": H100}
    return {"bench": "kernels", "rows": rows, "setup": setup}


KERNELS_COLUMNS = [
    ("kernel", "kernel"), ("shape", "shape"), ("dtype", "dtype"), ("projected", "projected"),
    ("max_abs_err", "max abs err"), ("tolerance", "tolerance"), ("correct", "correct"),
    ("reference_ms", "reference ms"), ("kernel_ms", "kernel ms"), ("mb", "MB"),
    ("torch_mb", "torch MB"), ("h100_us", "H100 us"), ("torch_h100_us", "torch H100 us"),
    ("bound", "bound"), ("projected_speedup", "x torch"),
]

__all__ = ["H100", "KERNELS_COLUMNS", "KernelBenchConfig", "measured_cases", "projected_rows", "run"]
