"""The two tiers: tests/slow_tier.txt names only tests that exist (a renamed or deleted test must
leave the list, or its line would silently stop meaning anything), and the conftest hook marks
exactly the listed ones ``slow``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import in_slow_tier, slow_tier

ROOT = Path(__file__).resolve().parents[1]


def test_every_line_names_an_existing_test():
    tier = slow_tier()
    assert tier, "tests/slow_tier.txt is empty"
    for line in sorted(tier):
        path, _, name = line.partition("::")
        assert (ROOT / path).is_file(), f"{line}: no such test file"
        if name:
            func = name.split("[")[0].split("::")[-1]
            text = (ROOT / path).read_text()
            assert re.search(rf"^\s*def {re.escape(func)}\(", text, re.M), f"{line}: no test {func} in {path}"


def test_the_hook_marks_the_listed_tests(request):
    # this file is not listed: its tests stay in the fast tier
    assert request.node.get_closest_marker("slow") is None
    assert not any(line.startswith("tests/test_tiers.py") for line in slow_tier())


@pytest.mark.parametrize("nodeid, listed", [
    ("tests/test_vlm_pipeline.py::test_anything", True),                      # a listed file
    ("tests/test_mcsjd.py::test_late_tokens_follow_the_baseline_sampler", True),  # a listed node id
    ("tests/test_mcsjd.py::test_late_tokens_follow_the_baseline_sampler[x]", True),  # a parametrization
    ("tests/test_tiers.py::test_every_line_names_an_existing_test", False),
])
def test_membership(nodeid, listed):
    assert in_slow_tier(nodeid, slow_tier()) == listed
