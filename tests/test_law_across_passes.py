"""The sampled law across verify passes (issue 42, item 6).

The method contract (``tests/test_method_contract.py``) tests each lossless method's sampled law on
the first 3 generated tokens, which one or two verify passes emit; what a method carries from one
pass to the next (a chain's partial accept and ``drafter.update``, EAGLE's features along the
accepted path, Medusa's last accepted feature, SJD's carried window, MC-SJD's coupled redraft of
it) is held there only to greedy identity. Here it is held to the exact law.

Setup: ``contract_util.tiny_ar_pipeline(vocab_size=5, grid_size=3)`` (5 codes, 9 tokens an
image), class 1, temperature 1, CFG scale 2, through the pipeline as the contract samples it
(``pipe(..., num_images_per_prompt=N, method=..., method_knobs=..., generator=seed)``, one batched
call), N = 2,000 images, seed 0, for ``sd``, ``eagle`` (EAGLE-2's top-k tree and its sampled
tree), ``medusa``, ``sjd`` and ``mcsjd`` (every lossless ``ar-image`` method but ``none``).

Short drafts (``KNOBS``: ``sd_gamma`` 2; EAGLE depth 1, i.e. 2 draft levels; Medusa depth 2;
Jacobi windows of 3) make every verify pass emit at most 3 tokens, so tokens 1 (the prefill's)
to 7 is the most two passes can reach and token 8 always comes from the 3rd pass or a later one.
The tested window is tokens 6 to 8 (1-based; the prefill emits token 1): their joint law, 125
cells, against the target's exact marginal, computed by one full forward (no cache) of the
target on each of the 5**7 prefixes ``[class, x1..x7]`` (both CFG halves) whose causal logits give
every conditional; the joint of tokens 1..8 is summed over tokens 1..5. Pearson chi-square, cells
expecting < 5 samples pooled (``chisquare_pvalue``); a correct method passes at p >= 1e-3
(``mmspec.core.exactness.P_THRESHOLD``).

Passes spanned, measured from each sample's accept lengths (``Stats.accept_lengths`` of the
decode, read by a spy on ``pipe.decode``) and asserted per method: every sample's token 8 was
emitted by its 3rd verify pass or a later one, every tested token by its 2nd or later. Measured at
seed 0: the window's tokens came from verify passes 2 to 7 (2 to 6 for EAGLE's top-k tree, 2 to 5
for its sampled tree), and in 61% (EAGLE, sampled tree) to 99% (sd) of the samples all three
tested tokens came from pass 3 or later.

Measured p-values (seed 0, N = 2,000): sd 0.66, eagle 0.83, eagle (sampled tree) 0.57, medusa
0.79, sjd 0.16, mcsjd 0.075 (seeds 1 and 2: all >= 0.23).

Broken controls (``test_a_rule_broken_from_a_later_pass_fails``): ``sd`` with a rule
(``BrokenFrom``) that is exact on its first ``k - 1`` calls (one call per verify pass) and from
the k-th on draws corrections from p instead of the residual (``contract_util.NoResidual``'s bug),
registered for the test only as the contract's ``broken_method`` fixture does, sampled by the same
function at the same seed and N: p = 1e-38 when broken from pass 2, p = 7e-34 when broken from
pass 3 on only (seeds 1-2: <= 4e-29), both < 1e-3. The pass-3 control cannot show in the
contract's window, the first 3 tokens (emitted by the prefill and passes 1-2; asserted): there its
samples are sd's own (the same tokens, measured) and give p = 0.59, which the test asserts passes.

Not covered: the VLM methods. Their tiny VLM has 18 words and EOS, so the exact law of tokens
past the 5th is not enumerable here (18**7 prefixes), and ``exact_law``'s pruned joint of 8 tokens
at N = 2,000 pools 76% of the mass into one cell (measured), so the later passes would go
nearly untested, while sampling VLM ``sd`` alone took 17 s.

Runtime: 17 s and 23 s for the file in two runs on the 2-core CPU machine (pytest's total with
``--durations=0``; 8-10 s of it build the pipeline and enumerate the law).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from contract_util import NoKnobs, exact_law, tiny_ar_pipeline
from mmspec import methods
from mmspec.core import LogitsProcessor, SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, sequence_index

MODALITY = "ar-image"
VOCAB, GRID = 5, 3
N_SAMPLES, SEED = 2_000, 0
AR_CLASS, GUIDANCE = 1, 2.0
FIRST, LAST = 6, 8  # the tested window, 1-based generated tokens (the prefill emits token 1)
MAX_EMIT = 3  # tokens one verify pass emits at most under KNOBS: 2 drafts deep, plus the target's own
KNOBS = {  # (method, its knobs): drafts 2 deep, so a pass emits at most MAX_EMIT tokens
    "sd": ("sd", {"sd_gamma": 2}),
    "eagle": ("eagle", {"eagle_top_k": 4, "eagle_depth": 1, "eagle_total_tokens": 10}),
    "eagle-sampled": ("eagle", {"eagle_top_k": 4, "eagle_depth": 1, "eagle_total_tokens": 10,
                                "eagle_mode": "sample"}),
    "medusa": ("medusa", {"medusa_top_k": 3, "medusa_depth": 2, "medusa_total_tokens": 6}),
    "sjd": ("sjd", {"sjd_window": 3}),
    "mcsjd": ("mcsjd", {"mcsjd_window": 3}),
}
assert 1 + 2 * MAX_EMIT < LAST  # two passes cannot reach the last tested token


class _Sampler:
    """The tiny pipeline, the target's exact joint law of its first ``LAST`` tokens, and the
    batched samples of a method with each sample's verify pass of every token."""

    def __init__(self):
        self.pipe = tiny_ar_pipeline(vocab_size=VOCAB, grid_size=GRID)
        self.joint = self._joint()

    @torch.no_grad()
    def _joint(self) -> torch.Tensor:
        """(V,) * LAST: the target's exact probability of every first ``LAST`` tokens."""
        model = self.pipe.transformer
        logits = LogitsProcessor(temperature=1.0, guidance_scale=GUIDANCE)
        prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=LAST - 1)))  # (V**7, 7)
        rows = [torch.cat([torch.full((len(prefixes), 1), c), prefixes], 1) for c in (AR_CLASS, model.null_class)]
        probs = logits(torch.cat([model(r).logits for r in rows])).double()  # (V**7, LAST, V): every conditional
        prefix = probs[:, :-1].gather(-1, prefixes[..., None]).squeeze(-1).prod(-1)  # P(x1..x7)
        return (prefix[:, None] * probs[:, -1]).view((VOCAB,) * LAST)

    def window_law(self, first: int, last: int) -> torch.Tensor:
        """The exact joint of tokens ``first..last`` (1-based), flattened in lexicographic order."""
        others = [d for d in range(LAST) if not first - 1 <= d < last]
        return (self.joint.sum(others) if others else self.joint).flatten()

    def sample(self, method: str, knobs: dict):
        """N images of one batched pipeline call: (tokens (N, GRID**2), passes (N, GRID**2): the
        verify pass that emitted each token, 0 for the prefill's, and the output's stats)."""
        pipe, decode, seen = self.pipe, self.pipe.decode, {}

        def spy(*args, **kwargs):
            seen["out"] = decode(*args, **kwargs)
            return seen["out"]

        pipe.decode = spy
        try:
            out = pipe(class_labels=AR_CLASS, num_images_per_prompt=N_SAMPLES, method=method, method_knobs=knobs,
                       temperature=1.0, guidance_scale=GUIDANCE, generator=torch.Generator().manual_seed(SEED),
                       output_type="latent")
        finally:
            del pipe.decode
        emitted = seen["out"].stats.accept_lengths  # (passes, N) tokens each verify pass emitted per image
        total = 1 + emitted.cumsum(0)  # tokens generated after each pass (the prefill's first)
        j = torch.arange(1, GRID * GRID + 1)
        passes = (total[:, :, None] < j).sum(0) + (j > 1).long()  # pass p emits tokens total[p-1]+1 .. total[p]
        return out.tokens.flatten(1), passes, out.stats

    def pvalue(self, tokens: torch.Tensor, first: int = FIRST, last: int = LAST) -> float:
        return chisquare_pvalue(sequence_index(tokens[:, first - 1:last], VOCAB), self.window_law(first, last))


_SAMPLER: list = []


def _sampler() -> _Sampler:
    if not _SAMPLER:
        _SAMPLER.append(_Sampler())
    return _SAMPLER[0]


def test_every_state_carrying_lossless_method_is_covered():
    """Every lossless ar-image method but ``none`` has short-draft knobs here, each a knob it
    takes (a method registered later needs its own)."""
    lossless = {n for n in methods.names(MODALITY) if n != "none" and methods.resolve(MODALITY, n).lossless}
    assert lossless == {name for name, _ in KNOBS.values()}
    for name, knobs in KNOBS.values():
        assert set(knobs) <= set(methods.knobs(MODALITY, name)), (name, knobs)


def test_the_window_law_is_the_contract_law():
    """The marginalised enumeration agrees with ``contract_util.exact_law`` (unpruned) on the
    first 3 tokens, and sums to 1."""
    s = _sampler()
    model = s.pipe.transformer
    logits = LogitsProcessor(temperature=1.0, guidance_scale=GUIDANCE)

    def score(prefixes):
        ids = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)
        rows = [torch.cat([torch.full((len(ids), 1), c), ids], 1) for c in (AR_CLASS, model.null_class)]
        with torch.no_grad():
            return logits(torch.cat([model(r).logits[:, -1] for r in rows]))

    law = exact_law(score, 3, n_samples=10**12)  # nothing pruned at this count
    expected = torch.tensor([law.cells[c] for c in itertools.product(range(VOCAB), repeat=3)], dtype=torch.float64)
    torch.testing.assert_close(s.window_law(1, 3), expected, rtol=1e-5, atol=1e-9)
    assert abs(float(s.joint.sum()) - 1.0) < 1e-6


@pytest.mark.statistical
@pytest.mark.parametrize("case", list(KNOBS))
def test_the_law_across_passes_is_the_targets(case):
    """Tokens 6..8, which every sample's 2nd to later verify passes emitted (token 8 its 3rd or
    later), follow the target's exact joint law (p >= 1e-3); drafts were accepted (tau > 1)."""
    method, knobs = KNOBS[case]
    s = _sampler()
    tokens, passes, stats = s.sample(method, knobs)
    assert int(passes[:, LAST - 1].min()) >= 3, f"{case}: a sample's token {LAST} came from pass < 3"
    assert int(passes[:, FIRST - 1].min()) >= 2, f"{case}: a sample's token {FIRST} came from pass < 2"
    assert stats["tau"] > 1.0, stats["tau"]
    p = s.pvalue(tokens)
    assert p >= P_THRESHOLD, f"{case}: p={p:.2e}"


class BrokenFrom(SpeculativeSampling):
    """Exact on its first ``start - 1`` calls (verify passes); from call ``start`` on, broken as
    ``contract_util.NoResidual``: after a rejection the correction is drawn from p instead of the
    residual."""

    start = 2

    def __init__(self):
        self.calls = 0

    def __call__(self, draft, p_all, generator=None):
        self.calls += 1
        return super().__call__(draft, p_all, generator)

    def reject(self, p, q, x):
        return p if self.calls >= self.start else super().reject(p, q, x)


@pytest.fixture
def broken_from(monkeypatch):
    """Register, for this test only, ``sd-broken``: sd's parts plus a ``BrokenFrom`` rule broken
    from verify pass ``start`` on; the registry is restored after (as the contract's fixture)."""

    def register(start: int) -> str:
        mod = methods.modality(MODALITY)
        for attr in ("parts", "methods"):
            monkeypatch.setattr(mod, attr, dict(getattr(mod, attr)))
        rule = type(f"BrokenFrom{start}", (BrokenFrom,), {"start": start})
        methods.register_part(name="broken", kind="rule", config=NoKnobs, build=lambda cfg, c: rule(),
                              doc=f"broken on purpose from verify pass {start}", modalities=(MODALITY,))
        methods.register_method("sd-broken", f"{mod.methods['sd'].parts}+broken", modalities=(MODALITY,),
                                doc="broken on purpose (test only)")
        return "sd-broken"

    return register


@pytest.mark.statistical
@pytest.mark.parametrize("start", [2, 3])
def test_a_rule_broken_from_a_later_pass_fails(start, broken_from):
    name = broken_from(start)
    assert methods.resolve(MODALITY, name).lossless  # it claims to be: only the test can tell
    s = _sampler()
    tokens, passes, _ = s.sample(name, KNOBS["sd"][1])
    assert int(passes[:, LAST - 1].min()) >= 3
    p = s.pvalue(tokens)
    assert p < P_THRESHOLD, f"broken from pass {start}: p={p:.2e}"
    if start == 3:  # the contract's window, tokens 1..3, comes from passes <= 2: exact there
        assert int(passes[:, 2].max()) <= 2
        p_first = s.pvalue(tokens, 1, 3)
        assert p_first >= P_THRESHOLD, f"broken from pass 3, tokens 1..3: p={p_first:.2e}"


def test_the_broken_method_is_gone_after_its_test():
    assert "broken" not in methods.parts(MODALITY)
    assert not any(n.endswith("-broken") for n in methods.names(MODALITY))
