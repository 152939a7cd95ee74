import pytest
import torch

from mmspec.bench.synthetic import small_vocab_pair as _small_vocab_pair

# Tiny models gain nothing from intra-op threads, and OpenMP workers spinning against any other
# load on a 2-core machine slow the suite down several-fold.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``gpu`` is the issue's name for the ``cuda`` marker: every ``cuda`` test carries both."""
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.gpu)


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
