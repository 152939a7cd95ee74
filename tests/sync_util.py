"""Host-device synchronisations counted on the CPU (issue 42: a sync budget per decode pass).

On a GPU, every read of a device value by the host waits for the queued work: ``.item()``,
``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``torch.equal``, and the ops whose
output shape depends on values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``). On the CPU none of them waits, but they still run,
so ``SyncCounter`` counts them: the aten ops through a ``TorchDispatchMode``, and the Python-side
reads that reach no aten op on a CPU tensor (``tolist``, ``cpu``, ``numpy``) through patched
``torch.Tensor`` methods. What it counts is what ``torch.cuda.set_sync_debug_mode("warn")`` would
flag on a device, except host-to-device copies of host data (``torch.tensor(list, device=...)``),
which do not wait for queued work.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

VALUE_READS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"}
"""Ops that hand a tensor's value to the host (``item``, ``int``, ``bool``, ``torch.equal``). Under
``torch.inference_mode`` the mode sees ``aten.item`` / ``aten.is_nonzero``, elsewhere their
decomposition ``aten._local_scalar_dense``: never both for one read."""

VALUE_SHAPED = {"aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
                "aten.masked_scatter"}
"""Ops whose output shape depends on tensor values (the host must read a count)."""

HOST_READS = ("tolist", "cpu", "numpy")
"""``torch.Tensor`` methods that copy values to the host without a counted aten op on a CPU tensor."""


class SyncCounter(TorchDispatchMode):
    """Counts host syncs by name (``counts``) while active; ``total`` sums them.

    ``paused`` (a context) leaves a region out, e.g. a model's forward when only the loop is judged.
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._paused = 0
        self._patches = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _count(self, name: str) -> None:
        if not self._paused:
            self.counts[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in VALUE_READS or name in VALUE_SHAPED:
            self._count(name)
        elif name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_leaves(indices)):
                self._count(name + "[bool mask]")
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None and \
                isinstance(args[0], torch.Tensor) and len(args) < 3:
            self._count(name)
        return func(*args, **kwargs)

    def __enter__(self):
        for method in HOST_READS:
            original = getattr(torch.Tensor, method)

            def read(t, *a, _original=original, _name=method, **k):
                self._count(f"Tensor.{_name}")
                return _original(t, *a, **k)

            self._patches.enter_context(_patched(torch.Tensor, method, read))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()


@contextlib.contextmanager
def _patched(owner, name, value):
    original = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
