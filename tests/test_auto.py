"""``method="auto"`` (issue 46): the cost profile, the prediction and the choice on synthetic
profiles; the online gate keeps lossless methods lossless (greedy bit-identical to the target
alone on the bundled pipelines; the sampled law by the core's chi-square test, with a broken gate
that must fail it); the profile's key, storage and refusals; and the CLI/serve entry points."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from mmspec import methods, serve
from mmspec.core import JacobiDrafter, LogitsProcessor, ModelChainDrafter, SpeculativeDecoder
from mmspec.core.drafters import _empty_draft
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index
from mmspec.core.gate import GatedDrafter, SpeedGate
from mmspec.methods import auto


def row(label, method, pass_s, passes, prefill=0.01, lossless=True, knobs=None, n=64):
    """A profile row: ``pass_s`` {B: seconds}, ``passes`` per calibration prompt."""
    return auto.Row(label, method, dict(knobs or {}), lossless, dict(pass_s), {b: prefill for b in pass_s},
                    [float(p) for p in passes], [max(1.0, (n - 1) / p) for p in passes], n)


def profile(rows, quality=None, modality="ar-image"):
    return auto.CostProfile(modality, "hash", "machine", "float32", {r.label: r for r in rows}, quality or {})


# The shape measured on this CPU (issue 46): drafting wins at B=1, loses from B=4.
MEASURED_SHAPE = [
    row("none", "none", {1: 0.0066, 4: 0.0074, 8: 0.0082}, [255] * 4, n=256),
    row("sjd-w8", "sjd", {1: 0.0074, 4: 0.0095, 8: 0.0175}, [120, 126, 131, 140], knobs={"sjd_window": 8}, n=256),
    row("medusa", "medusa", {1: 0.0111, 4: 0.0190, 8: 0.0260}, [70, 75, 80, 85], n=256),
    row("gsd", "gsd", {1: 0.0070, 4: 0.0080, 8: 0.0090}, [60, 62, 64, 66], lossless=False, n=256),
]


# ---------------------------------------------------------------- prediction

def test_expected_max_is_exact():
    """The closed form equals brute-force enumeration of every draw (n = 4 values, k = 1..4)."""
    values = [3.0, 1.0, 7.0, 2.0]
    for k in range(1, 5):
        brute = sum(max(c) for c in itertools.product(values, repeat=k)) / len(values) ** k
        assert auto.expected_max(values, k) == pytest.approx(brute, rel=1e-12)


def test_at_batch_interpolates_and_extrapolates():
    pts = {1: 1.0, 4: 2.5, 8: 4.0}
    assert auto.at_batch(pts, 1) == 1.0 and auto.at_batch(pts, 2) == pytest.approx(1.5)
    assert auto.at_batch(pts, 6) == pytest.approx(3.25) and auto.at_batch(pts, 16) == pytest.approx(8.0)


def test_predicted_seconds_follow_the_formula():
    r = row("x", "sjd", {1: 0.01, 4: 0.02}, [10, 20], prefill=0.5)
    assert auto.predict_seconds(r, 1) == pytest.approx(0.5 + 0.01 * 15)
    assert auto.predict_seconds(r, 4) == pytest.approx(0.5 + 0.02 * (20 - 10 / 16))  # E[max of 4] = 20 - 10/16
    assert auto.predict_seconds(r, 1, n=127) == pytest.approx(0.5 + 0.01 * 15 * 2)  # twice the tokens


# ---------------------------------------------------------------- the choice

def test_choice_turns_speculation_down_as_the_batch_grows():
    p = profile(MEASURED_SHAPE)
    picks = {b: auto.choose(p, b) for b in (1, 4, 8)}
    assert picks[1].label == "medusa" and picks[1].predicted_x > 1.3
    assert picks[4].label == "sjd-w8"
    assert picks[8].label == "none" and picks[8].predicted_x == 1.0
    for b, c in picks.items():  # the pick is the table's best, and the reason says so
        assert c.predicted_x == max(c.table.values())
        assert c.reason.startswith(f"auto chose {c.label}") and f"B={b}" in c.reason
    assert "gsd" not in picks[1].table  # lossy: not admitted by the lossless budget


def test_kept_quality_admits_only_recorded_lossy_methods():
    kept = profile(MEASURED_SHAPE, {"gsd": {"kept": True, "p_vs_none": 0.4}})
    assert auto.choose(kept, 1, "kept").label == "gsd"
    assert auto.choose(kept, 1, "lossless").label == "medusa"
    rejected = profile(MEASURED_SHAPE, {"gsd": {"kept": False, "p_vs_none": 0.001}})
    assert auto.choose(rejected, 1, "kept").label == "medusa"
    assert auto.choose(profile(MEASURED_SHAPE), 1, "kept").label == "medusa"  # no record: not admitted


def test_choice_respects_available_and_prefers_none_on_ties():
    p = profile(MEASURED_SHAPE)
    assert auto.choose(p, 1, available=["none", "sjd-w8"]).label == "sjd-w8"
    tie = profile([row("none", "none", {1: 0.01}, [63]), row("sd", "sd", {1: 0.02}, [31.5])])
    assert auto.choose(tie, 1).label == "none"


def test_no_profile_chooses_none_and_says_how_to_make_one():
    c = auto.choose(None, 4, hint=" (run mmspec bench cost --calibrate)")
    assert c.label == "none" and c.gate_settings() is None and "mmspec bench cost --calibrate" in c.reason


# ---------------------------------------------------------------- the profile file

def test_profile_round_trip_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    p = profile(MEASURED_SHAPE, {"gsd": {"kept": True, "p_vs_none": 0.4}})
    path = p.save()
    assert path.parent == tmp_path / "profiles" and path.name == p.key
    assert not list(tmp_path.glob("profiles/.*tmp*"))  # written whole, renamed into place
    back = auto.find_profile("ar-image", "hash", "machine", "float32")
    assert back.to_json() == p.to_json()
    assert auto.find_profile("ar-image", "other-model", "machine", "float32") is None
    assert auto.find_profile("ar-image", "hash", "other machine", "float32") is None
    assert auto.find_profile("ar-image", "hash", "machine", "bfloat16") is None


@pytest.mark.parametrize("edit, name", [
    (lambda d: d.update(version=0), "profile must be"),
    (lambda d: d["rows"].pop(0), "profile rows must be"),
    (lambda d: d["rows"][1].update(pass_s={"1": -1}), "pass_s must be"),
    (lambda d: d["rows"][1].update(tau=[0.5]), "tau must be"),
    (lambda d: d["rows"][1].update(passes=[1.0, 2.0, 3.0]), "passes must be"),
    (lambda d: d["rows"][1].update(n=0), "n must be"),
])
def test_bad_profiles_are_refused_naming_the_field(tmp_path, edit, name):
    data = profile(MEASURED_SHAPE).to_json()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=name):
        auto.CostProfile.load(path)


@pytest.mark.parametrize("knobs, name", [
    ({"auto_quality": "best"}, "auto_quality must be"), ({"auto_every": 0}, "auto_every must be"),
    ({"auto_online": 1}, "auto_online must be"), ({"auto_batch_size": 0}, "auto_batch_size must be"),
    ({"sjd_window": 8}, "method_knobs must be"),
])
def test_bad_auto_knobs_are_refused(knobs, name):
    with pytest.raises(ValueError, match=name):
        methods.validate("ar-image", "auto", knobs)
    with pytest.raises(ValueError, match="method must be"):
        methods.validate("video", "auto", {})


# ---------------------------------------------------------------- the online gate

def test_gate_formula_and_hysteresis():
    g = SpeedGate(c_on=2.0, c_off=1.0, margin=0.05)
    assert g.ratio([100], [2.5]) == pytest.approx(1.25)
    assert g.ratio([100, 40], [4.0, 1.0]) == pytest.approx(1.25)  # the slowest row: max(25, 40) * 2 vs 100
    assert g.keep_on(0.96, True) and not g.keep_on(0.94, True)
    assert not g.keep_on(1.04, False) and g.keep_on(1.06, False)
    assert SpeedGate(1.0, 1.0, prior_tau=3.0, prior_passes=10).tau(10, 10) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="c_on must be"):
        SpeedGate(c_on=0, c_off=1)


def test_gate_switches_off_when_drafting_does_not_pay_and_probes_back(small_vocab_pair):
    """Drafts that cost 50x a target pass are switched off after the first window, probed again
    after ``probe`` passes off, and the greedy output is the target's alone."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    base = SpeculativeDecoder(target, None, processor=LogitsProcessor(temperature=0.0)).generate(prompt, 40)
    gated = GatedDrafter(ModelChainDrafter(draft, gamma=3), SpeedGate(c_on=50.0, c_off=1.0, every=4, probe=8))
    out = SpeculativeDecoder(target, gated, processor=LogitsProcessor(temperature=0.0)).generate(prompt, 40)
    assert torch.equal(out.sequences, base.sequences)
    log = gated.log
    assert log.passes_off > 0 and log.passes_on > 4 and log.switches >= 2  # off, then a probe back on
    assert [d[1] for d in log.decisions[:2]] == [False, True]


def test_gate_keeps_a_paying_drafter_on(small_vocab_pair):
    """The target drafting for itself (tau = 4 under greedy) at twice the pass cost pays 2x: kept on."""
    target, _ = small_vocab_pair
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    gated = GatedDrafter(ModelChainDrafter(target, gamma=3), SpeedGate(c_on=2.0, c_off=1.0, every=2))
    out = SpeculativeDecoder(target, gated, processor=LogitsProcessor(temperature=0.0)).generate(prompt, 40)
    assert gated.log.passes_off == 0 and len(gated.log.decisions) >= 3 and out.stats.tau > 3.5
    assert all(on and ratio > 1.5 for _, on, ratio in gated.log.decisions)


class PeekingGate(GatedDrafter):
    """Broken: decides from the draft itself (keeps it only when its first token is even), not
    from passes already decoded; the proposals then no longer follow the q they carry."""

    def propose(self, state):
        draft = self.inner.propose(state)
        if draft.tokens.shape[1] and bool((draft.tokens[:, 0] % 2 == 1).any()):
            keep = draft.tokens[:, 0] % 2 == 0
            if not bool(keep.any()):
                return _empty_draft(state)
            draft.tokens[~keep] = draft.tokens[keep][0]  # odd first drafts replaced by an even one, q unchanged
        return draft


@pytest.mark.statistical
@pytest.mark.parametrize("gate_cls, lossless", [(GatedDrafter, True), (PeekingGate, False)])
def test_gated_sampling_keeps_the_target_law(small_vocab_pair, gate_cls, lossless):
    """Seed 0, N = 20,000 rows, the first 3 tokens, chi-square against the exact joint (8**3
    cells), pass at p >= 1e-3; the gate flips every pass (c_on = c_off, margin 0 then a probe) so
    the 3 tokens come from passes with and without drafts. The peeking gate must fail."""
    target, _ = small_vocab_pair
    V, n, N = target.vocab_size, 3, 20_000
    pipeline = LogitsProcessor(temperature=1.0)
    gate = SpeedGate(c_on=1e3, c_off=1.0, every=1, probe=1)
    drafter = gate_cls(JacobiDrafter(V, window=3), gate)
    prompt = [3, 1, 4]
    out = SpeculativeDecoder(target, drafter, processor=pipeline).generate(
        torch.tensor([prompt]).expand(N, -1), n, generator=torch.Generator().manual_seed(0))
    probs = exact_joint(target, prompt, n, pipeline)
    p = chisquare_pvalue(sequence_index(out.sequences[:, :n], V), probs)
    if lossless:  # drafts and single-token passes both happened
        assert drafter.log.passes_on > 0 and drafter.log.passes_off > 0
    assert (p >= P_THRESHOLD) == lossless, f"p={p:.2e}"


# ---------------------------------------------------------------- the pipelines

@pytest.fixture(scope="module")
def ar_pipe():
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(str(serve.ASSETS / "ar-image"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_ar_auto_is_greedy_identical_and_reports_its_choice(ar_pipe):
    ar_pipe.set_cost_profile(profile(MEASURED_SHAPE))
    try:
        kw = dict(prompt=["a red circle", "a blue star"], temperature=0.0, output_type="latent",
                  generator=[torch.Generator().manual_seed(i) for i in range(2)])
        base = ar_pipe(method="none", **kw)
        out = ar_pipe(method="auto", method_knobs={"auto_every": 4}, **kw)
        assert torch.equal(out.tokens, base.tokens)
        s = out.stats
        assert s["auto_method"] == auto.choose(profile(MEASURED_SHAPE), 2).label != "none"
        assert s["auto_batch_size"] == 2 and s["auto"].startswith("auto chose")
        assert s["auto_passes_on"] + s["auto_passes_off"] == s["nfe"] - 1
        big = ar_pipe(method="auto", method_knobs={"auto_batch_size": 8}, **kw)  # choose as for 8 rows
        assert big.stats["auto_method"] == "none" and torch.equal(big.tokens, base.tokens)
    finally:
        ar_pipe.set_cost_profile(None)


def test_auto_with_tensor_callbacks_chooses_raster_methods(ar_pipe):
    zipar_best = MEASURED_SHAPE + [row("zipar", "zipar", {1: 0.001}, [20], lossless=False, n=256)]
    ar_pipe.set_cost_profile(profile(zipar_best, {"zipar": {"kept": True, "p_vs_none": 0.5}}))
    try:
        kw = dict(prompt="a red circle", output_type="latent", method="auto",
                  method_knobs={"auto_quality": "kept", "auto_online": False})
        assert ar_pipe(**kw).stats["auto_method"] == "zipar"
        out = ar_pipe(**kw, callback_on_step_end=lambda p, s, t, k: {},
                      callback_on_step_end_tensor_inputs=["tokens"])
        assert out.stats["auto_method"] != "zipar" and "auto_passes_on" not in out.stats  # auto_online=False
    finally:
        ar_pipe.set_cost_profile(None)


def test_pipeline_finds_its_profile_by_key(ar_pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    assert ar_pipe.cost_profile() is None
    p = profile(MEASURED_SHAPE)
    p.model_hash, p.machine = ar_pipe.model_fingerprint(), auto.machine_id("cpu")
    p.save()
    assert ar_pipe.cost_profile().key == p.key
    out = ar_pipe(prompt="a red circle", method="auto", output_type="latent", method_knobs={"auto_online": False})
    assert out.stats["auto_method"] == "medusa"
    with pytest.raises(ValueError, match="profile must be"):
        ar_pipe.set_cost_profile(profile(MEASURED_SHAPE, modality="vlm"))


def test_vlm_auto_is_greedy_identical(tmp_path):
    from mmspec.bench.vlm import bench_prompts
    from mmspec.pipelines import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline.from_pretrained(str(serve.ASSETS / "vlm"))
    pipe.set_progress_bar_config(disable=True)
    pipe.set_cost_profile(profile([row("none", "none", {1: 0.01, 4: 0.012}, [63]),
                                   row("eagle", "eagle", {1: 0.02, 4: 0.05}, [9, 12])], modality="vlm"))
    images, questions = bench_prompts(3)
    kw = dict(images=images, prompts=questions, max_new_tokens=32)
    base = pipe(method="none", **kw)
    out = pipe(method="auto", method_knobs={"auto_every": 2}, **kw)
    assert out.texts == base.texts and out.stats["auto_method"] == "eagle"
    with pytest.raises(ValueError, match="auto_quality must be"):
        pipe(method="auto", method_knobs={"auto_quality": "any"}, **kw)


def test_serve_and_cli_accept_auto():
    assert serve.resolve("vlm", "auto", {"auto_every": 4}) is None
    assert "auto_quality" in serve.knob_specs("ar-image") and "auto" not in methods.names("ar-image")
    assert methods.auto.method_names("vlm", methods.names("vlm"))[0] == "auto"
    from mmspec.commands import generate

    class Args:
        kind, method, knob = "ar-image", "auto", ["auto_every=8", "auto_online=false"]
    generate.check(Args)
    assert Args.method_knobs == {"auto_every": 8, "auto_online": False}


def test_auto_under_continuous_batching_chooses_for_the_slots():
    """``pipe.serve(method="auto")`` chooses for the slots (2), not the 4 jobs; the gated drafter
    restarts refilled rows, and every answer equals the call without continuous batching."""
    from mmspec.bench.vlm import bench_prompts
    from mmspec.pipelines import SpeculativeVLMPipeline

    pipe = SpeculativeVLMPipeline.from_pretrained(str(serve.ASSETS / "vlm"))
    pipe.set_progress_bar_config(disable=True)
    pipe.set_cost_profile(profile([row("none", "none", {1: 0.01, 2: 0.011, 4: 0.012}, [63]),
                                   row("eagle", "eagle", {1: 0.02, 2: 0.03, 4: 0.2}, [9, 12])], modality="vlm"))
    images, questions = bench_prompts(4)
    base = pipe(images=images, prompts=questions, method="none", max_new_tokens=24)
    served = list(pipe.serve(images, questions, slots=2, method="auto", max_new_tokens=24,
                             method_knobs={"auto_every": 2}))
    assert sorted(s.index for s, _ in served) == [0, 1, 2, 3]
    for s, text in served:
        assert text == base.texts[s.index]
    extra = served[-1][0].stats.extra
    assert extra["auto_method"] == "eagle" and extra["auto_batch_size"] == 2 and extra["auto_passes_on"] > 0


def test_profile_key_changes_with_threads_and_weights(ar_pipe):
    """A profile is not used at another thread count, nor for a retrained head (the key's model
    fingerprint digests the weights)."""
    from mmspec.pipelines import SpeculativeARImagePipeline

    assert auto.machine_id("cpu", 1) != auto.machine_id("cpu", 4)
    other = SpeculativeARImagePipeline.from_pretrained(str(serve.ASSETS / "ar-image"))
    assert other.model_fingerprint() == ar_pipe.model_fingerprint()
    retrained = SpeculativeARImagePipeline.from_pretrained(str(serve.ASSETS / "ar-image"))
    with torch.no_grad():
        list(retrained.medusa_head.parameters())[-1].add_(0.01)
    assert retrained.model_fingerprint() != ar_pipe.model_fingerprint()


def test_gate_evidence_decays_at_each_decision(small_vocab_pair):
    """Older passes count less: after k decisions the evidence holds fewer passes than were run."""
    target, _ = small_vocab_pair
    gated = GatedDrafter(ModelChainDrafter(target, gamma=3), SpeedGate(c_on=1.0, c_off=1.0, every=2, decay=0.5))
    SpeculativeDecoder(target, gated, processor=LogitsProcessor(temperature=0.0)).generate(torch.tensor([[3, 1, 4]]), 40)
    decisions = len(gated.log.decisions)
    assert decisions >= 3 and gated.passes[0] < 2 / (1 - 0.5) + 2  # a geometric sum, not the passes run
    assert gated.log.passes_on > gated.passes[0] + 2


# ---------------------------------------------------------------- the continuous-token pipeline

CONTINUOUS_SHAPE = [
    row("none", "none", {1: 0.010, 4: 0.012}, [63] * 4, n=64),  # the bundled model's 8 x 8 latents
    row("sjd-mc", "sjd-mc", {1: 0.012, 4: 0.030}, [36, 40, 42, 45], n=64),
    row("sd", "sd", {1: 0.020, 4: 0.060}, [36, 40, 42, 45], n=64),
]


def test_continuous_auto_chooses_and_equals_the_chosen_method(tmp_path, monkeypatch):
    """On the bundled continuous-token pipeline: without ``auto_online`` the output is the chosen
    method's, latent for latent (same generators); online, the gate reports its passes; B = 4
    chooses ``none`` from this profile; the serve layer reports the chosen method's head."""
    from mmspec.pipelines import SpeculativeContinuousARPipeline

    pipe = SpeculativeContinuousARPipeline.from_pretrained(str(serve.ASSETS / "continuous"))
    pipe.set_progress_bar_config(disable=True)
    pipe.set_cost_profile(profile(CONTINUOUS_SHAPE, modality="continuous"))
    gens = lambda b: [torch.Generator().manual_seed(i) for i in range(b)]  # noqa: E731
    kw = dict(prompt=["a red circle"], output_type="latent")
    out = pipe(method="auto", method_knobs={"auto_online": False}, generator=gens(1), **kw)
    assert out.stats["auto_method"] == "sjd-mc" and out.stats["auto_lossless"]
    fixed = pipe(method="sjd-mc", generator=gens(1), **kw)
    assert torch.equal(out.latents, fixed.latents)
    online = pipe(method="auto", method_knobs={"auto_every": 4}, generator=gens(1), **kw)
    assert online.stats["auto_passes_on"] + online.stats["auto_passes_off"] == online.stats["nfe"] - 1
    four = pipe(method="auto", prompt=["a red circle"] * 4, output_type="latent", generator=gens(4))
    assert four.stats["auto_method"] == "none"
    assert "auto" in methods.auto.method_names("continuous", methods.names("continuous"))
    models = serve.Models()
    models._loaded["continuous"] = pipe
    result = serve.run_continuous(models, ["a red circle"], [0], "auto", {"auto_online": False})[0]
    assert result.stats["auto_method"] == "sjd-mc" and result.extra == {"lossless": True, "head": "mixture"}


def test_continuous_calibration_measures_every_candidate(tmp_path):
    from mmspec.bench.cost import calibrate as cal

    cfg = cal.CalibrateConfig(modality="continuous", batch_sizes=(1, 2), prompts=2, min_gaps=4, max_calls=2,
                              rounds=1, labels=("none", "sjd-mc"), out=str(tmp_path / "p.json"))
    prof = cal.calibrate(cfg)
    assert set(prof.rows) == {"none", "sjd-mc"} and prof.modality == "continuous"
    for r in prof.rows.values():
        assert set(r.pass_s) == {1, 2} and len(r.passes) == 2 and r.n == 64  # 8 x 8 latents
    assert prof.rows["sjd-mc"].passes[0] < prof.rows["none"].passes[0]  # Jacobi drafts were accepted
    assert auto.CostProfile.load(tmp_path / "p.json").rows.keys() == prof.rows.keys()


def test_a_near_tie_with_none_chooses_none():
    """A drafting method predicted under ``MIN_GAIN`` (1.05x) over none is not chosen; at or above
    it, it is (the reason says which rule decided)."""
    def with_gain(x):  # a drafter whose predicted speed-up over none at B=1 is x
        return profile([row("none", "none", {1: 0.01}, [63], prefill=0.0),
                        row("sjd", "sjd", {1: 0.01 / x}, [63], prefill=0.0)])

    near = auto.choose(with_gain(1.04), 1)
    assert near.label == "none" and "drafting must be predicted >= 1.05x" in near.reason
    assert near.table["sjd"] == pytest.approx(1.04)
    assert auto.choose(with_gain(1.06), 1).label == "sjd"
    assert "must be predicted" not in auto.choose(with_gain(0.9), 1).reason  # none wins without the rule
