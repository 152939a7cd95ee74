"""Host syncs per decode pass, held to a budget for every registered token method (issue 42, item 2).

On a GPU each host read of a device value stalls the launch queue; the loop is built to read one
small tensor per pass (the stop flag and the rows' generated counts, ``decoder._host_read``).
Counted here on the CPU with ``sync_util.SyncCounter`` under ``MMSPEC_STATIC_SHAPES=1``, the
shapes an accelerator gets (``mmspec.core.shapes``): syncs between consecutive decode passes
(snapshots at ``Stats.record_step``, called once per pass), over a whole sampled call with the
progress bar on (it must read no device value), CFG on for the image modalities.

Budgets (``BUDGET``; a method not listed gets its modality's default, so a newly registered
method is held to it without a line of test code):

- ar-image: 1 per pass for every raster method (target alone, chain, Jacobi, parallel heads and
  EAGLE trees alike); ZipAR's next-set lanes 2 (which lanes emit is a ``nonzero``, so that only
  they draw randomness and a row decodes alike alone or in a batch);
- vlm: 1 per pass for every method whose drafts run on the device (the transformers models decode
  on the core's static cache, ``mmspec.adapters.hf``; before it, their ``DynamicCache`` crops
  read the kept widths: 2 per pass, ``sd`` 6), ``lookup`` 8 (the n-gram search runs on host lists
  by design);
- continuous: the measured maxima at this seed (the density rule's residual rounds and the
  diffusion head's scheduler read the device); stated, not yet small.

The counts are deterministic at a fixed seed. ``test_an_extra_sync_breaks_the_budget`` shows the
count bites: one ``int()`` added per pass fails every raster AR method's budget.
"""

from __future__ import annotations

import pytest
import torch

from contract_util import VLM_QUESTION, tiny_ar_pipeline, tiny_vlm_pipeline
from mmspec import methods
from mmspec.core import stats as stats_module
from mmspec.core.cache import StaticKVCache
from sync_util import SyncCounter

DEFAULT = {"ar-image": 1, "vlm": 1, "continuous": 0}
BUDGET = {
    ("ar-image", "zipar"): 2, ("ar-image", "zipar+sjd"): 2, ("ar-image", "zipar+mcsjd"): 2,
    ("ar-image", "zipar+gsd"): 2, ("ar-image", "zipar+sjd+lantern"): 2,
    ("vlm", "lookup"): 8,
    # continuous: measured at this seed (CFG 2, temperature 1, 3 images of 2x2 tokens)
    ("continuous", "none"): 3, ("continuous", "none-diffusion"): 15, ("continuous", "sd"): 18,
    ("continuous", "sd-warmup"): 19, ("continuous", "path"): 72, ("continuous", "cspd"): 81,
    ("continuous", "sjd"): 8, ("continuous", "sjd-mc"): 13, ("continuous", "sjd-independent"): 8,
}
MODALITIES = ("ar-image", "vlm", "continuous")
CASES = [(m, name) for m in MODALITIES for name in methods.names(m)]
_PIPES: dict = {}


def _continuous_pipe():
    from test_method_contract import _continuous_pipe as build

    return build()


def _call(modality: str):
    """(pipeline call for a method) on the modality's tiny pipeline, sampled, progress bar on."""
    if modality not in _PIPES:
        pipe = {"ar-image": lambda: tiny_ar_pipeline(grid_size=5), "vlm": tiny_vlm_pipeline,
                "continuous": _continuous_pipe}[modality]()
        pipe.set_progress_bar_config(disable=False, leave=False)
        _PIPES[modality] = pipe
    pipe = _PIPES[modality]
    g = lambda: torch.Generator().manual_seed(0)
    if modality == "ar-image":
        return lambda m, **kw: pipe(class_labels=[1, 2], method=m, temperature=1.0, guidance_scale=2.0, generator=g(),
                                    output_type="latent", method_knobs={"zipar_window": 2} if "zipar" in m else None,
                                    **kw)
    if modality == "vlm":
        image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(0))
        return lambda m, **kw: pipe(images=[image] * 2, prompts=[VLM_QUESTION] * 2, method=m, temperature=1.0,
                                    max_new_tokens=20, generator=g(), **kw)
    return lambda m, **kw: pipe(class_labels=[0, 1, 2], method=m, generator=g(), output_type="latent",
                                guidance_scale=2.0, temperature=1.0, **kw)


def syncs_per_pass(modality: str, method: str, monkeypatch) -> list[int]:
    """Host syncs between consecutive decode passes of one sampled call (static shapes)."""
    monkeypatch.setenv("MMSPEC_STATIC_SHAPES", "1")
    counter, totals = SyncCounter(), []
    record = stats_module.Stats.record_step

    def snapshot(self, emitted):
        totals.append(counter.total)
        return record(self, emitted)

    monkeypatch.setattr(stats_module.Stats, "record_step", snapshot)
    call = _call(modality)
    with counter:
        call(method)
    return [b - a for a, b in zip(totals, totals[1:])]


@pytest.mark.parametrize("modality, method", CASES)
def test_syncs_per_pass_within_the_budget(modality, method, monkeypatch):
    per_pass = syncs_per_pass(modality, method, monkeypatch)
    budget = BUDGET.get((modality, method), DEFAULT[modality])
    assert per_pass, f"{modality} {method}: fewer than two decode passes, nothing measured"
    assert max(per_pass) <= budget, (modality, method, per_pass)


def test_an_extra_sync_breaks_the_budget(monkeypatch):
    """The control: one host read more per pass (an ``int()`` of the emitted counts, as a progress
    bar reading the device would add) and a raster AR method is over its budget."""
    record = stats_module.Stats.record_step

    def reads(self, emitted):
        int(emitted.sum())
        return record(self, emitted)

    monkeypatch.setattr(stats_module.Stats, "record_step", reads)
    for method in ("none", "sd", "eagle", "medusa", "sjd"):
        assert max(syncs_per_pass("ar-image", method, monkeypatch)) > DEFAULT["ar-image"], method


@pytest.mark.parametrize("method", ["none", "sd", "eagle", "medusa", "sjd", "mcsjd", "zipar+sjd"])
def test_static_shapes_give_the_same_tokens(method, monkeypatch):
    """Static widths (whole-buffer keys, masked) and exact widths decode the same greedy tokens
    (seeded: ZipAR's lanes start when the rows above have enough tokens, so its greedy output
    depends on how many Jacobi drafts, randomly initialised, were accepted)."""
    pipe = tiny_ar_pipeline(grid_size=5)
    knobs = {"zipar_window": 2} if "zipar" in method else None
    outs = {}
    for static in ("0", "1"):
        monkeypatch.setenv("MMSPEC_STATIC_SHAPES", static)
        outs[static] = pipe(class_labels=[1, 2, 3], method=method, temperature=0.0, guidance_scale=2.0,
                            output_type="latent", method_knobs=knobs, generator=torch.Generator().manual_seed(0)).tokens
    assert torch.equal(outs["0"], outs["1"]), method


@pytest.mark.parametrize("method", ["none", "sd", "eagle", "specvlm"])
def test_static_shapes_give_the_same_vlm_answers(method, monkeypatch):
    """The transformers target (and draft VLM) on the static cache: whole-buffer keys, masked, and
    exact widths decode the same greedy answers."""
    pipe = _PIPES.get("vlm") or tiny_vlm_pipeline()
    image = torch.rand(3, 16, 16, generator=torch.Generator().manual_seed(1))
    outs = {}
    for static in ("0", "1"):
        monkeypatch.setenv("MMSPEC_STATIC_SHAPES", static)
        outs[static] = pipe(images=[image] * 2, prompts=[VLM_QUESTION, "what is a ?"], method=method,
                            temperature=0.0, max_new_tokens=16).tokens
    assert outs["0"] == outs["1"], method


def test_a_static_overflow_is_reported_after_the_fact(monkeypatch):
    cache = StaticKVCache(1, 2, 1, 4, max_len=4)
    monkeypatch.setenv("MMSPEC_STATIC_SHAPES", "0")
    with pytest.raises(ValueError, match="cache overflow"):
        cache.step(torch.zeros(2, 5, dtype=torch.long))
    monkeypatch.setenv("MMSPEC_STATIC_SHAPES", "1")
    cache = StaticKVCache(1, 2, 1, 4, max_len=4)
    step = cache.step(torch.zeros(2, 3, dtype=torch.long))
    assert step.mask.shape[-1] == 4  # every slot, masked
    cache.check_overflow()  # 3 of 4 slots: fine
    cache.step(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="cache overflow"):
        cache.check_overflow()


def test_static_shapes_setting(monkeypatch):
    from mmspec.core.shapes import static_shapes

    monkeypatch.delenv("MMSPEC_STATIC_SHAPES", raising=False)
    assert not static_shapes("cpu") and static_shapes("meta")
    monkeypatch.setenv("MMSPEC_STATIC_SHAPES", "1")
    assert static_shapes("cpu")
    monkeypatch.setenv("MMSPEC_STATIC_SHAPES", "maybe")
    with pytest.raises(ValueError, match="MMSPEC_STATIC_SHAPES must be one of"):
        static_shapes("cpu")
