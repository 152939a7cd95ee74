import pytest

from tiny import perturbed_copy, tiny_lm


@pytest.fixture(scope="session")
def small_vocab_pair():
    """A target over 8 tokens (top-1 probability ~0.4) and a noisy copy as draft: acceptance
    near 0.7, so both acceptances and rejections are common."""
    target = tiny_lm(0, init_std=0.2)
    return target, perturbed_copy(target, noise=0.5, seed=1)
