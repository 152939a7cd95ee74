"""Generators as diffusers users pass them (issue 42, item 1): ``mmspec.core.sampling`` draws on the
generator's device and moves the numbers (diffusers' ``randn_tensor`` rule), so a CPU
``torch.Generator()`` drives a pipeline on CUDA, and its numbers are the ones it gives on the CPU.

Without a GPU the rule is checked on the ``meta`` device, which stands for "a device other than the
generator's": torch's own ``torch.rand(device="meta", generator=cpu_generator)`` runs there without
complaint (it would refuse on CUDA), so the tests read *where* each draw ran, not only that it ran.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmspec.core import sampling

DRAWS = {
    "rand": lambda g, device: sampling.rand((3, 5), g, device),
    "randn": lambda g, device: sampling.randn((3, 5), g, device),
    "randint": lambda g, device: sampling.randint(0, 7, (3, 5), g, device),
}


class DrawDevices(TorchDispatchMode):
    """The devices the random-number ops of ``torch`` produced their outputs on."""

    def __init__(self):
        super().__init__()
        self.devices = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) in ("aten.rand", "aten.randn", "aten.randint", "aten.uniform_", "aten.normal_",
                                        "aten.random_"):
            self.devices.append(out.device.type)
        return out


@pytest.mark.parametrize("kind", DRAWS)
@pytest.mark.parametrize("per_row", [False, True])
def test_a_cpu_generator_draws_on_the_cpu_for_another_device(kind, per_row):
    gens = lambda: tuple(torch.Generator().manual_seed(s) for s in (1, 1, 2)) if per_row else \
        torch.Generator().manual_seed(1)
    mode = DrawDevices()
    with mode:
        out = DRAWS[kind](gens(), "meta")
    assert out.device.type == "meta" and out.shape == (3, 5)
    assert mode.devices and set(mode.devices) == {"cpu"}, mode.devices


@pytest.mark.parametrize("kind", DRAWS)
def test_on_the_cpu_the_numbers_are_torchs_own(kind):
    """Seeds give what they gave before the rule: the same call as torch's for one generator, and
    row r from generator r for a list (consecutive rows sharing one generator draw together)."""
    g = torch.Generator().manual_seed(3)
    got = DRAWS[kind](g, None)
    ref = {"rand": lambda g: torch.rand((3, 5), generator=g), "randn": lambda g: torch.randn((3, 5), generator=g),
           "randint": lambda g: torch.randint(0, 7, (3, 5), generator=g)}[kind]
    assert torch.equal(got, ref(torch.Generator().manual_seed(3)))
    a, b = torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)
    rows = DRAWS[kind]((a, a, b), "cpu")
    first = {"rand": lambda g, n: torch.rand((n, 5), generator=g), "randn": lambda g, n: torch.randn((n, 5), generator=g),
             "randint": lambda g, n: torch.randint(0, 7, (n, 5), generator=g)}[kind]
    assert torch.equal(rows[:2], first(torch.Generator().manual_seed(4), 2))
    assert torch.equal(rows[2:], first(torch.Generator().manual_seed(5), 1))


def test_no_generator_draws_on_the_requested_device():
    mode = DrawDevices()
    with mode:
        out = sampling.rand((2, 2), None, "meta")
    assert out.device.type == "meta" and mode.devices == ["meta"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_cpu_generator_drives_a_pipeline_on_cuda():
    """The README's snippet shape: a CPU generator, the pipeline on CUDA, a sampled method; the
    uniforms equal the CPU's for the same seed."""
    from contract_util import tiny_ar_pipeline

    u = sampling.rand((4, 3), torch.Generator().manual_seed(0), "cuda")
    assert u.device.type == "cuda" and torch.equal(u.cpu(), torch.rand((4, 3), generator=torch.Generator().manual_seed(0)))
    pipe = tiny_ar_pipeline().to("cuda")
    for method in ("none", "sd", "sjd", "eagle", "medusa"):
        out = pipe(class_labels=[1, 2], method=method, temperature=1.0, guidance_scale=2.0, output_type="latent",
                   generator=torch.Generator().manual_seed(0))
        assert out.tokens.shape[0] == 2, method
        listed = pipe(class_labels=[1, 2], method=method, temperature=1.0, output_type="latent",
                      generator=[torch.Generator().manual_seed(s) for s in (0, 1)])
        assert listed.tokens.shape[0] == 2, method
