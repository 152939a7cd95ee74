"""Atomic writes: a file or a folder appears whole or not at all.

``atomic_path(path)`` hands out a temporary name beside ``path`` (same folder, so the same file
system); when the ``with`` block ends normally the temporary file is flushed to disk and renamed
over ``path`` (``os.replace``: atomic on POSIX), and when it raises the temporary file is removed
and ``path`` is left as it was. ``atomic_dir(path)`` does the same for a folder: a folder cannot
be renamed over a non-empty one, so an existing ``path`` is moved aside first and removed only
once the new folder is in place (restored if the swap fails).

A process killed mid-write (SIGKILL, power loss) cannot clean up: it leaves a hidden temporary
(``.<name>.<random>.tmp<suffix>``), never a partial ``path``.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _reserve(path: Path, make) -> Path:
    """A fresh hidden sibling of ``path`` created by ``make(name)`` (which must fail if it exists).
    The temporary keeps ``path``'s suffix, so writers that infer a format from it (PIL) work."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp{path.suffix}")
        try:
            make(tmp)
            return tmp
        except FileExistsError:
            continue


def _create_file(tmp: Path) -> None:
    # mode 0o666 minus the umask, as ``open`` would give a new file (mkstemp's 0o600 would stick)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_path(path) as tmp:`` write ``tmp`` (an empty file that exists); on success it
    replaces ``path``, on any exception it is removed and ``path`` is untouched. A replaced file
    keeps its permission bits. The parent folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _reserve(path, _create_file)
    try:
        yield tmp
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_dir(path) as tmp:`` fill the empty folder ``tmp``; on success it becomes
    ``path`` (an existing ``path`` is replaced as a whole), on any exception it is removed and
    ``path`` is left as it was. The parent folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _reserve(path, lambda p: os.mkdir(p, 0o777))
    old = None
    try:
        yield tmp
        if path.exists():  # a folder cannot be renamed over a non-empty one: move the old aside
            old = tmp.with_name(f"{tmp.name}.old")  # unique: tmp's name is ours alone
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        if old is not None and not path.exists():
            os.rename(old, path)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
