"""What every subcommand shares: the parser class (``--debug`` anywhere, errors as ``UsageError``),
progress lines, thread count, and the argparse types that check a value before anything loads."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from ..utils import one_line

ROOT = Path(__file__).resolve().parents[2]
"""The repository (editable installs): ``assets/`` and ``demos/`` sit here."""


class UsageError(ValueError):
    """A bad command line: printed as one line, exit status 2 (argparse's)."""

    def __init__(self, message: str, prog: str = "mmspec"):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """Every (sub)parser: errors raise ``UsageError`` instead of printing usage, and ``--debug``
    is accepted anywhere on the line (before or after the subcommand)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show the full traceback instead of one line")
        self.set_defaults(_prog=self.prog)  # the deepest subcommand's name wins: errors are prefixed with it

    def error(self, message):
        raise UsageError(message, self.prog)


class TableChoices(Sequence):
    """An option's choices read from a table in another module (``module.name``) the first time
    argparse looks at them: the training recipes import transformers and diffusers, which
    ``mmspec --help`` should not wait for, but their tables stay the one list of names. Assign it
    to the action that ``add_argument`` returns (``add_argument`` itself formats ``choices=``)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    @cached_property
    def _items(self) -> tuple:
        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __getitem__(self, i):
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def set_threads(n: int) -> None:
    import torch

    # the bundled models are tiny: on a 2-core machine, intra-op threads cost more than they save
    # and turn wall times noisy under any other load, so benchmarks default to one
    torch.set_num_threads(n)


def number(cast, low, strict: bool, high=None, strict_high: bool = False):
    """An argparse type: ``cast(text)``, finite, above ``low`` (or at least, if not strict) and at
    most ``high`` (below it, if ``strict_high``)."""
    kind = "an int" if cast is int else "a number"
    if high is not None:
        allowed = f"{kind} in {'(' if strict else '['}{low}, {high}{')' if strict_high else ']'}"
    else:
        allowed = f"{kind} {'>' if strict else '>='} {low}"

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low) or (high is not None and (
                value > high or (strict_high and value == high))):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


positive_int = number(int, 1, strict=False)
non_negative_int = number(int, 0, strict=False)
positive_float = number(float, 0, strict=True)
non_negative_float = number(float, 0, strict=False)
probability = number(float, 0, strict=True, high=1)


def existing_dir(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text!r}")
    return text


def existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _unwritable(path: Path) -> str | None:
    """Why nothing could be written at ``path`` (its nearest existing parent), or None."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{str(parent)!r} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{str(parent)!r} is not writable"
    return None


def output_dir(text: str) -> str:
    """A folder to write into: refused now if it names an existing file or cannot be created,
    rather than after the work."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a folder, got the existing file {text!r}")
    problem = None if path.is_dir() else _unwritable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot create the folder {text!r}: {problem}")
    return text


def output_file(text: str) -> str:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"must be a file path, got the existing folder {text!r}")
    problem = _unwritable(path)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {problem}")
    return text


def image_file(text: str) -> str:
    """A file PIL can decode (checked now, before any model loads)."""
    import PIL.Image

    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    try:
        with PIL.Image.open(text) as image:
            image.load()
    except (OSError, ValueError, PIL.Image.DecompressionBombError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a readable image ({one_line(err)})") from None
    return text


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a non-empty text")
    return text
