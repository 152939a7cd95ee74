"""Atomic writes (``mmspec.utils.atomic``): a failure mid-write leaves no partial file, the old
file or folder intact, and no temporary behind; a process killed mid-write leaves the old file
whole (only a hidden temporary); success replaces as a whole with the usual permissions."""

import os
import signal
import subprocess
import sys

import pytest

from mmspec.utils.atomic import atomic_dir, atomic_path


class Boom(Exception):
    pass


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_file_written_and_replaced_whole(tmp_path):
    path = tmp_path / "sub" / "result.json"  # the parent is created
    with atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp.exists() and tmp.suffix == ".json" and not path.exists()
        tmp.write_text("one")
    assert path.read_text() == "one" and names(path.parent) == ["result.json"]
    with atomic_path(path) as tmp:
        tmp.write_text("two")
        assert path.read_text() == "one"  # readers see the old file until the rename
    assert path.read_text() == "two" and names(path.parent) == ["result.json"]


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_failure_mid_write_keeps_the_old_file(tmp_path, error):
    path = tmp_path / "table.json"
    path.write_text("old")
    with pytest.raises(error):
        with atomic_path(path) as tmp:
            tmp.write_text("half of the ne")
            raise error()
    assert path.read_text() == "old" and names(tmp_path) == ["table.json"]


def test_failure_on_a_new_file_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic_path(tmp_path / "new.png") as tmp:
            tmp.write_bytes(b"\x89PNG partial")
            raise Boom()
    assert names(tmp_path) == []


def test_failed_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("old")

    def broken_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_path(path) as tmp:
            tmp.write_text("new")
    assert path.read_text() == "old" and names(tmp_path) == ["a.txt"]


def test_permissions_follow_umask_and_a_replaced_file_keeps_its_mode(tmp_path):
    old_umask = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "new.txt") as tmp:
            tmp.write_text("x")
    finally:
        os.umask(old_umask)
    assert (tmp_path / "new.txt").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0o600
    kept = tmp_path / "kept.txt"
    kept.write_text("x")
    kept.chmod(0o640)
    with atomic_path(kept) as tmp:
        tmp.write_text("y")
    assert kept.stat().st_mode & 0o777 == 0o640


def test_pil_infers_the_format_from_the_temporary_name(tmp_path):
    PIL = pytest.importorskip("PIL.Image")
    with atomic_path(tmp_path / "grid.png") as tmp:
        PIL.new("RGB", (4, 3), "red").save(tmp)
    with PIL.open(tmp_path / "grid.png") as image:
        assert image.format == "PNG" and image.size == (4, 3)


KILLED_WRITER = """
import sys, time
from mmspec.utils.atomic import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    with open(tmp, "w") as f:
        f.write("partial new content")
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
"""


def test_a_killed_writer_leaves_the_old_file_whole(tmp_path):
    """SIGKILL in the middle of a write: ``path`` still holds the old content; the only trace is a
    hidden temporary beside it."""
    path = tmp_path / "log.json"
    path.write_text("old")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert path.read_text() == "old"
    leftovers = [n for n in names(tmp_path) if n != "log.json"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".log.json.") and leftovers[0].endswith(".tmp.json")


def test_folder_written_and_replaced_whole(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_dir(out) as tmp:
        assert tmp.is_dir() and not out.exists()
        (tmp / "weights").write_text("1")
    assert names(out) == ["weights"]
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("2")
        assert names(out) == ["weights"]
    assert names(out) == ["config.json"] and names(tmp_path) == ["ckpt"]  # replaced as a whole


def test_folder_failure_keeps_the_old_folder(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(Boom):
        with atomic_dir(out) as tmp:
            (tmp / "partial.safetensors").write_text("")
            raise Boom()
    assert names(out) == ["old.txt"] and (out / "old.txt").read_text() == "old" and names(tmp_path) == ["ckpt"]


def test_folder_swap_failure_restores_the_old_folder(tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real_rename = os.rename
    calls = []

    def rename(src, dst):  # the old folder moves aside, then the new one fails to move in
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("rename failed")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_dir(out) as tmp:
            (tmp / "new.txt").write_text("new")
    assert names(out) == ["old.txt"] and names(tmp_path) == ["ckpt"]


def test_new_folder_failure_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic_dir(tmp_path / "x") as tmp:
            (tmp / "a").write_text("a")
            raise Boom()
    assert names(tmp_path) == []
