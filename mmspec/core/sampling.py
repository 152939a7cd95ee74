"""Randomness of the core: categorical sampling and uniforms, drawn per row.

Every random number the core draws goes through ``rand`` / ``randn`` / ``randint`` here, so that a *list of
generators* (diffusers' convention: one ``torch.Generator`` per output row) means what users
expect: row r draws its numbers from generator r, in the same order and amounts as when it is
decoded alone, so row r of a batch equals that row decoded alone with the same generator.
Consecutive rows that share one generator draw in one call (the lanes of one ZipAR image, or a
single generator for the whole batch), which keeps a single generator's stream exactly as one
``torch.rand`` over the batch.

Devices follow diffusers' ``randn_tensor`` rule: numbers are drawn on the generator's device and then
moved to the requested one, so a CPU ``torch.Generator()`` (the README's snippets, ``mmspec.serve``,
the demo, ``mmspec batch``) drives a pipeline on CUDA and gives the tokens it gives on the CPU for
the same draws (torch refuses a CPU generator in a CUDA ``torch.rand``). With ``generator=None``
torch's global generator of the requested device draws there.

``sample`` is inverse-CDF sampling: one uniform per row, no per-row setup.
``torch.multinomial`` builds per-row alias state on the CPU and is the slowest op in a decode
step at large batch; a cumulative sum and a binary search do the same job exactly.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from ..kernels.torch_ops import inverse_cdf
from .errors import check

Generators = Union[torch.Generator, Sequence[torch.Generator], None]
"""None (torch's global generator), one generator, or one per row (a tuple after ``as_generators``)."""


def as_generators(generator, batch_size: int, name: str = "generator"):
    """Check a ``generate(generator=...)`` argument: None, a ``torch.Generator``, or a list/tuple
    of ``batch_size`` of them. Returns None, the generator, or a tuple."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    ok = isinstance(generator, (list, tuple)) and all(isinstance(g, torch.Generator) for g in generator)
    got = generator if not isinstance(generator, (list, tuple)) else \
        f"a {type(generator).__name__} of {len(generator)} items"
    check(ok and len(generator) == batch_size, name,
          f"None, a torch.Generator, or a list of {batch_size} torch.Generator (one per prompt)", got)
    return tuple(generator)


def select_rows(generator: Generators, index: torch.Tensor) -> Generators:
    """The generators of rows ``index`` (1-D): a per-row tuple is indexed, anything else shared."""
    if not isinstance(generator, tuple):
        return generator
    return tuple(generator[i] for i in index.tolist())


def repeat_rows(generator: Generators, times: int) -> Generators:
    """Each row's generator repeated ``times`` times in place (row r -> rows r*times .. r*times+times-1)."""
    if not isinstance(generator, tuple) or times == 1:
        return generator
    return tuple(g for g in generator for _ in range(times))


def _runs(generators: tuple):
    """(generator, start, stop) for each run of consecutive rows sharing one generator object."""
    start = 0
    for i in range(1, len(generators) + 1):
        if i == len(generators) or generators[i] is not generators[start]:
            yield generators[start], start, i
            start = i


def _per_row(draw, shape: tuple, generator: Generators, device) -> torch.Tensor:
    """``draw(shape, generator, device)`` row-wise over a per-row tuple, each run of rows sharing a
    generator in one call on that generator's device; the result on ``device``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if not isinstance(generator, tuple):
        return _on(draw, shape, generator, device)
    check(len(generator) == shape[0], "generator", f"{shape[0]} generators (one per row)", len(generator))
    if shape[0] == 0:
        return draw(shape, None, device)
    parts = [draw((stop - start,) + tuple(shape[1:]), g, g.device) for g, start, stop in _runs(generator)]
    # one concatenation where the generators live, then one copy to the device
    return (parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts])).to(device)


def _on(draw, shape: tuple, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One draw on the generator's device (torch's global generator of ``device`` for None), moved."""
    if generator is None or _same_device(generator.device, device):
        return draw(shape, generator, device)
    return draw(shape, generator, generator.device).to(device)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def rand(shape, generator: Generators = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """``torch.rand(shape)`` whose row r (``shape[0]``) comes from generator r of a per-row tuple."""
    return _per_row(lambda s, g, d: torch.rand(s, device=d, dtype=dtype, generator=g), tuple(shape), generator, device)


def randn(shape, generator: Generators = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """``torch.randn(shape)`` drawn per row like ``rand`` (continuous tokens' noise)."""
    return _per_row(lambda s, g, d: torch.randn(s, device=d, dtype=dtype, generator=g), tuple(shape), generator,
                    device)


def randint(low: int, high: int, shape, generator: Generators = None, device=None) -> torch.Tensor:
    """``torch.randint(low, high, shape)`` drawn per row like ``rand``."""
    return _per_row(lambda s, g, d: torch.randint(low, high, s, device=d, generator=g), tuple(shape), generator,
                    device)


def sample(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """probs (B, ..., V), rows summing to > 0 -> (B, ...) indices drawn from each row.

    With a per-row tuple of generators, ``probs[r]`` draws from generator r."""
    return inverse_cdf(probs, rand(probs.shape[:-1] + (1,), generator, probs.device, probs.dtype))
