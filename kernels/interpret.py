"""Run kernels in Triton's CPU interpreter from a process that has already imported Triton.

Triton decides between interpreter and compiler when a function is decorated, and reads
``TRITON_INTERPRET`` when it is imported: once ``mmspec.kernels`` (or triton) is imported, setting
it is too late (without a GPU the launch then fails with "0 active drivers"). So the calls are
pickled, run in a child process started with ``TRITON_INTERPRET=1`` and ``MMSPEC_KERNELS=triton``,
and their results pickled back. Used by the kernel tests and ``mmspec bench kernels``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


class InterpretedError(RuntimeError):
    """A call failed in the child process; the message carries its traceback."""


def run_interpreted(calls: dict, timeout: float = 600) -> dict:
    """``{name: (function, args, kwargs)}`` -> ``{name: result}``, each ``function`` a public name of
    ``mmspec.kernels`` run in the interpreter. A call that raises gives an ``InterpretedError``
    as its result; a child that dies raises one."""
    with tempfile.TemporaryDirectory(prefix="mmspec-interpret-") as tmp:
        src, dst = Path(tmp) / "calls.pkl", Path(tmp) / "results.pkl"
        # calls and results are our own Python objects (tensors, ropes, errors) passed to and from
        # a child process we start: pickled IPC, not weights (weights load through safetensors)
        src.write_bytes(pickle.dumps(calls))
        env = {**os.environ, "TRITON_INTERPRET": "1", "MMSPEC_KERNELS": "triton"}
        env.pop("MMSPEC_DISABLE_KERNELS", None)
        proc = subprocess.run([sys.executable, "-m", "mmspec.kernels.interpret", str(src), str(dst)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise InterpretedError(f"the interpreter process failed:\n{proc.stderr[-4000:]}")
        return pickle.loads(dst.read_bytes())


def _main(src: str, dst: str) -> None:
    import traceback

    from mmspec import kernels

    torch.set_num_threads(1)  # the interpreter runs numpy per program: threads only add contention
    results = {}
    for name, (function, args, kwargs) in pickle.loads(Path(src).read_bytes()).items():
        if function not in kernels.__all__:
            results[name] = InterpretedError(f"{function!r} is not a public name of mmspec.kernels")
            continue
        try:
            results[name] = getattr(kernels, function)(*args, **kwargs)
        except Exception:  # reported per call, so that one failure does not hide the others
            results[name] = InterpretedError(traceback.format_exc()[-4000:])
    Path(dst).write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
