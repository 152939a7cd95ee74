"""Static shapes or exact widths: how the loop sizes its tensors on a device.

On an accelerator, a width read from a tensor (``int(lengths.max())``) waits for every queued
kernel before the host can launch the next, and a width that changes every pass gives
``torch.compile`` and CUDA graphs a new shape each time. gpt-fast's discipline applies there:
caches attend over their whole preallocated buffer with a mask, and draft models catch up a
fixed number of history entries, so a pass reads nothing from the device but its one stop flag.

On the CPU the same reads cost nothing (there is no queue) and the static widths cost compute
(a wider key range, and this CPU's one-token matrix path lost for a wider feed), so the loop
reads the exact widths there. Both give the same tokens: the extra keys are masked, the extra
fed entries lie past each row's history and are cut from the cache
(``tests/test_sync_budget.py`` holds the two to greedy identity).

``MMSPEC_STATIC_SHAPES`` (read on every call, so tests can flip it): ``auto`` (default: static
off the CPU), ``1`` (static everywhere: how the tests count an accelerator's host syncs on the
CPU) or ``0`` (exact widths everywhere). Inside ``forced_static_shapes()`` (compiled steps,
``SpeculativePipeline.enable_compiled_steps``) shapes are static whatever the setting: a compiled
step must see one shape per bucket.

Caches decide once, when they are built (``StaticKVCache.static``), so nothing is read inside a
compiled forward.
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar

import torch

from .errors import check

ENV = "MMSPEC_STATIC_SHAPES"
MODES = ("auto", "1", "0")
_FORCED: ContextVar[bool] = ContextVar("mmspec_static_shapes", default=False)


@contextlib.contextmanager
def forced_static_shapes():
    """Static shapes on every device inside the block."""
    token = _FORCED.set(True)
    try:
        yield
    finally:
        _FORCED.reset(token)


def static_shapes(device: torch.device | str | None) -> bool:
    """Whether tensors on ``device`` get static widths (no host reads for shapes); see the module."""
    if _FORCED.get():
        return True
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    check(value in MODES, ENV, "one of " + ", ".join(repr(m) for m in MODES), os.environ.get(ENV))
    if value != "auto":
        return value == "1"
    return device is not None and torch.device(device).type != "cpu"
