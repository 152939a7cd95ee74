from pathlib import Path

import pytest
import torch

from mmspec.bench.synthetic import small_vocab_pair as _small_vocab_pair

# Tiny models gain nothing from intra-op threads, and OpenMP workers spinning against any other
# load on a 2-core machine slow the suite down several-fold.
torch.set_num_threads(1)


SLOW_TIER = Path(__file__).with_name("slow_tier.txt")


def slow_tier() -> set[str]:
    """The lines of tests/slow_tier.txt: files and node ids ``make test`` leaves to ``make test-slow``."""
    return {line.strip() for line in SLOW_TIER.read_text().splitlines() if line.strip() and not line.startswith("#")}


def in_slow_tier(nodeid: str, tier: set[str]) -> bool:
    """Whether ``nodeid`` is listed: its file, itself, or itself without parameters."""
    return bool({nodeid.split("::")[0], nodeid, nodeid.split("[")[0]} & tier)


def pytest_collection_modifyitems(config, items):
    """``gpu`` is the issue's name for the ``cuda`` marker: every ``cuda`` test carries both. A test
    that tests/slow_tier.txt names (its file, its node id, or its node id without parameters)
    carries ``slow``."""
    tier = slow_tier()
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.gpu)
        if in_slow_tier(item.nodeid, tier):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def small_vocab_pair():
    return _small_vocab_pair(0)


@pytest.fixture
def restore_torch_threads():
    """Put torch's thread count back after a test that runs the CLI (its --threads sets it for the
    process, and a reduction's float rounding depends on it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bundled_vlm_pipe():
    """The bundled 64 px VLM pipeline (``assets/vlm``), progress bars off, one per test module."""
    from pathlib import Path

    from mmspec.pipelines import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline.from_pretrained(Path(__file__).resolve().parents[1] / "assets" / "vlm")
    pipe.set_progress_bar_config(disable=True)
    return pipe
