"""A real-size row for the GPU check (issue 42, item 7): what one pass costs at Llama-2-7B's shapes.

A target with Llama-2-7B's shapes (32 layers, 32 heads of 128, SwiGLU 11,008 wide, a vocabulary of
32,000; ``LlamaGenModel``'s layout with random weights built on the device) and a one-layer
EAGLE-style head of the same width (``EagleDraftHead``). Measured after a prefix of ``prefix``
cached tokens, one row:

- ``verify_ms``: one target pass of 1, 16 and 64 tokens (the 1-token pass is target-only
  decoding's; 16 and 64 are a chain or tree verify);
- ``draft_ms``: one head step (1 token), as an EAGLE draft calls it depth-many times a pass;
- ``loop_ms``: target-only decoding's wall time per pass minus the 1-token forward: what the loop
  costs outside the forward (``loop_share`` = that over the forward), eager and with the target's
  forward compiled (``torch.compile(mode="reduce-overhead", fullgraph=True)``), both with static
  shapes.

``row(...)`` runs anywhere; the tests run it on the CPU at a tiny size.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..core import LogitsProcessor, SpeculativeDecoder
from ..core.shapes import forced_static_shapes


@dataclass(frozen=True)
class Shapes:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    mlp_hidden: int = 11008
    vocab_size: int = 32000


LLAMA2_7B = Shapes()
TINY = Shapes(dim=64, n_layers=2, n_heads=4, mlp_hidden=128, vocab_size=256)
"""What the tests run on the CPU."""
WIDTHS = (1, 16, 64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def build(shapes: Shapes, device, dtype):
    """(target, EAGLE head) with random weights, on ``device`` in ``dtype``, in eval mode."""
    from ..models.eagle import EagleDraftHead
    from ..models.llamagen import LlamaGenModel

    grid = 1
    while grid * grid < 4096:  # room for the prefix and the decode in raster positions
        grid *= 2
    with torch.device(device):
        target = LlamaGenModel(vocab_size=shapes.vocab_size, grid_size=grid, num_classes=2, dim=shapes.dim,
                               n_layers=shapes.n_layers, n_heads=shapes.n_heads, mlp_hidden=shapes.mlp_hidden,
                               initializer_range=0.02)
    target = target.to(dtype).eval()
    head = EagleDraftHead.from_target(target).to(device, dtype).eval()
    return target, head


@torch.inference_mode()
def row(device="cuda", dtype=torch.bfloat16, shapes: Shapes = LLAMA2_7B, prefix: int = 512, tokens: int = 32,
        repeats: int = 5, compiled: bool = True) -> dict:
    """One row (see the module); every part recorded even when a later one fails (``errors``)."""
    device = torch.device(device)
    target, head = build(shapes, device, dtype)
    out: dict = {"shapes": asdict(shapes), "dtype": str(dtype).replace("torch.", ""), "device": str(device),
                 "prefix": prefix, "verify_ms": {}, "errors": []}
    ids = torch.randint(0, shapes.vocab_size, (1, prefix + max(WIDTHS)), device=device)
    ids[:, 0] = 0  # the class token at position 0

    with forced_static_shapes():
        cache = target.new_cache(1, prefix + max(WIDTHS) + 1)
        target(ids[:, :prefix], torch.arange(prefix, device=device)[None], cache)
        head_cache = head.new_cache(1, prefix + max(WIDTHS) + 1)
        hidden = torch.zeros(1, prefix, shapes.dim, device=device, dtype=dtype)
        head(hidden, ids[:, :prefix], torch.arange(prefix, device=device)[None], head_cache)
    base = cache.lengths.clone()

    def verify(width):
        def once():
            cache.lengths = base.clone()
            positions = prefix + torch.arange(width, device=device)[None]
            target(ids[:, prefix:prefix + width], positions, cache)
        return once

    def draft():
        head_cache.lengths = base.clone()
        head(hidden[:, :1], ids[:, prefix:prefix + 1], torch.full((1, 1), prefix, device=device), head_cache)

    for width in WIDTHS:
        out["verify_ms"][str(width)] = _median_ms(verify(width), repeats, device)
    out["draft_ms"] = _median_ms(draft, repeats, device)
    out["loop"] = {}
    for mode in ("eager", "compiled") if compiled else ("eager",):
        try:
            out["loop"][mode] = _loop(target, ids[:, :prefix], tokens, repeats, device, mode == "compiled")
        except Exception as e:  # noqa: BLE001 - the eager figures stand without the compiled ones
            out["errors"].append(f"loop {mode}: {type(e).__name__}: {e}"[:400])
    return out


def _loop(target, prompt, tokens: int, repeats: int, device: torch.device, compiled: bool) -> dict:
    """Target-only decoding of ``tokens`` tokens: ms per pass, the 1-token forward's ms inside the
    same static-shaped cache, and the difference (the loop's own cost)."""
    if compiled:
        target.forward = torch.compile(type(target).forward.__get__(target), mode="reduce-overhead",
                                       fullgraph=True, dynamic=False)
    try:
        decoder = SpeculativeDecoder(target, processor=LogitsProcessor(temperature=0), device=device)
        with forced_static_shapes():
            decode = lambda: decoder.generate(prompt, tokens)  # noqa: E731
            per_call = _median_ms(decode, repeats, device)
            passes = decode().stats.target_forwards - 1  # the prefill is not a decode pass
            cache = target.new_cache(1, prompt.shape[1] + tokens + 3)
            target(prompt, torch.arange(prompt.shape[1], device=device)[None], cache)
            base = cache.lengths.clone()
            last = prompt[:, -1:].clone(memory_format=torch.contiguous_format)  # the decoder's strides

            def one():
                cache.lengths = base.clone()
                target(last, base[:, None], cache)

            forward_ms = _median_ms(one, repeats, device)
            prefill_ms = _median_ms(lambda: target(prompt, torch.arange(prompt.shape[1], device=device)[None],
                                                   target.new_cache(1, prompt.shape[1] + tokens + 3)), repeats, device)
    finally:
        vars(target).pop("forward", None)  # back to the class's eager forward
    pass_ms = (per_call - prefill_ms) / passes
    return {"pass_ms": pass_ms, "forward_ms": forward_ms, "loop_ms": pass_ms - forward_ms,
            "loop_share": (pass_ms - forward_ms) / forward_ms, "passes": passes}
