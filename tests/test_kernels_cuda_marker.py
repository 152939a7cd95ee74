"""The ``cuda`` marker (``pytest -m cuda``, what ``make gpu-check`` runs on a lent GPU) selects the
GPU tests: some in every kernel test file, every test that skips without CUDA and nothing else;
without a GPU they are collected and skipped, never errors."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
KERNEL_TEST_FILES = ["tests/test_kernels.py", "tests/test_kernels_accept.py", "tests/test_kernels_attention.py",
                     "tests/test_kernels_bench.py"]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *args],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=600)


def test_the_marker_selects_gpu_tests_in_every_kernel_test_file():
    proc = _pytest("--collect-only", *KERNEL_TEST_FILES)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    selected = [line for line in proc.stdout.splitlines() if "::" in line]
    for path in KERNEL_TEST_FILES:
        assert any(line.startswith(path + "::") for line in selected), (path, selected)
    # the GPU tests are named for it; a marker on a CPU test would show here
    assert all("cuda" in line.split("::")[1] for line in selected), selected


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CUDA tests run instead of skipping")
def test_without_a_gpu_every_selected_test_skips(tmp_path):
    xml = tmp_path / "cuda.xml"
    proc = _pytest(f"--junitxml={xml}", *KERNEL_TEST_FILES)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    assert cases and all(case.find("skipped") is not None for case in cases), [
        (case.get("name"), [child.tag for child in case]) for case in cases if case.find("skipped") is None]


def _cuda_skips(source: str) -> bool:
    """Whether decorator source skips when CUDA is missing (``skipif(not torch.cuda.is_available())``)."""
    return re.search(r"\bnot\s+(torch\.)?cuda\.is_available\(\)", source) is not None


def test_every_test_that_skips_without_cuda_carries_the_marker():
    """Over every test file: a test whose decorators (or its module's ``pytestmark``) skip without
    CUDA also carries ``pytest.mark.cuda``, and the reverse, so ``-m cuda`` is exactly the GPU tests."""
    problems = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        # module-level names bound to a CUDA skip (``needs_cuda = pytest.mark.skipif(...)``)
        skip_names = {target.id for node in tree.body if isinstance(node, ast.Assign)
                      and _cuda_skips(ast.unparse(node.value)) for target in node.targets
                      if isinstance(target, ast.Name)}
        module_marks = "".join(ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
                               and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            skips = _cuda_skips(module_marks) or any(_cuda_skips(d) or d in skip_names for d in decorators)
            marked = "pytest.mark.cuda" in module_marks or "pytest.mark.cuda" in decorators
            if skips != marked:
                problems.append(f"{path.name}::{node.name}: " + ("skips without CUDA but is not marked cuda" if skips
                                                                 else "is marked cuda but does not skip without it"))
    assert not problems, problems


def test_the_marker_check_bites(tmp_path, monkeypatch):
    """The AST check above on a file with one unmarked and one unskipped GPU test."""
    bad = tmp_path / "test_bad.py"
    bad.write_text("import pytest, torch\n"
                   "needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='gpu')\n"
                   "@needs_cuda\ndef test_unmarked():\n    pass\n"
                   "@pytest.mark.cuda\ndef test_unskipped():\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tmp_path)
    with pytest.raises(AssertionError) as info:
        test_every_test_that_skips_without_cuda_carries_the_marker()
    assert "test_unmarked: skips without CUDA" in str(info.value)
    assert "test_unskipped: is marked cuda" in str(info.value)
