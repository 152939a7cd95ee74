"""``mmspec bench cost --calibrate`` and ``mmspec bench auto`` (issue 46) on the bundled pipelines,
at small sizes: the profile holds what the pipeline's ``method="auto"`` reads (found by its key),
and the auto bench reports every fixed row beside ``auto`` with the targets' verdicts."""

from __future__ import annotations

import json

import pytest

from mmspec import serve
from mmspec.bench import auto as auto_bench
from mmspec.bench.cost import calibrate as cal
from mmspec.methods import auto

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ar_pipe():
    from mmspec.pipelines import SpeculativeARImagePipeline

    pipe = SpeculativeARImagePipeline.from_pretrained(str(serve.ASSETS / "ar-image"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_calibration_writes_the_profile_auto_reads(ar_pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    quality = tmp_path / "ar.json"  # a bench ar-image result: gsd kept (p 0.4), zipar not (p 0.001)
    quality.write_text(json.dumps({"bench": "ar-image", "rows": [{"method": "none", "p_vs_none": None},
                                                                 {"method": "gsd", "p_vs_none": 0.4},
                                                                 {"method": "zipar", "p_vs_none": 0.001}]}))
    cfg = cal.CalibrateConfig(modality="ar-image", batch_sizes=(1, 2), prompts=2, min_gaps=8, max_calls=1,
                              labels=("none", "sjd-w8", "gsd"), quality=str(quality))
    said = []
    profile = cal.calibrate(cfg, progress=said.append, pipe=ar_pipe)
    assert list(profile.rows) == ["none", "sjd-w8", "gsd"]
    for row in profile.rows.values():
        assert sorted(row.pass_s) == [1, 2] and all(s > 0 for s in row.pass_s.values())
        assert len(row.passes) == len(row.tau) == 2 and row.n == 256
    assert profile.rows["none"].passes == [255.0, 255.0] and profile.rows["none"].tau == [1.0, 1.0]
    assert min(profile.rows["sjd-w8"].tau) > 1.2  # the Jacobi drafts are accepted
    assert profile.quality["gsd"]["kept"] and not profile.quality["zipar"]["kept"]
    assert profile.setup["guidance_scale"] == 2.0 and profile.setup["prompts"] == 2
    # saved under the key the pipeline looks for, and read back by method="auto"
    assert profile.path == str(tmp_path / "profiles" / profile.key)
    ar_pipe.set_cost_profile(None)
    found = ar_pipe.cost_profile()
    assert found is not None and found.to_json() == profile.to_json()
    out = ar_pipe(prompt="a red circle", method="auto", output_type="latent", method_knobs={"auto_online": False})
    assert out.stats["auto_method"] == auto.choose(profile, 1).label
    table = cal.profile_table(profile)
    assert len(table) == 6 and {r["method"] for r in table} == {"none", "sjd-w8", "gsd"}
    assert any("ms per pass" in m for m in said)


def test_calibration_refuses_bad_settings():
    for kw, name in (({"modality": "video"}, "modality must be"), ({"batch_sizes": (2, 4)}, "batch_sizes must be"),
                     ({"labels": ("sjd",)}, "labels must be"), ({"labels": ("none", "hydra")}, "labels must be"),
                     ({"quality": "missing.json"}, "quality must be"), ({"prompts": 0}, "prompts must be")):
        with pytest.raises(ValueError, match=name):
            cal.calibrate(cal.CalibrateConfig(**kw), pipe=object())


def test_auto_bench_reports_fixed_rows_and_auto(tmp_path, monkeypatch):
    """The VLM at B = 1, 2, one round, with a profile of none and eagle in the cache: the rows,
    auto's choice and verdicts, and auto's answers equal none's (greedy)."""
    from mmspec.pipelines import SpeculativeVLMPipeline

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    pipe = SpeculativeVLMPipeline.from_pretrained(str(serve.ASSETS / "vlm"))
    pipe.set_progress_bar_config(disable=True)
    rows = {"none": auto.Row("none", "none", {}, True, {1: 0.01, 2: 0.011}, {1: 0.02, 2: 0.03}, [63.0], [1.0], 64),
            "eagle": auto.Row("eagle", "eagle", {}, True, {1: 0.03, 2: 0.04}, {1: 0.02, 2: 0.03}, [9.0], [7.0], 64)}
    auto.CostProfile("vlm", pipe.model_fingerprint(), auto.machine_id("cpu"), "float32", rows).save()
    result = auto_bench.run(auto_bench.AutoBenchConfig(modalities=("vlm",), batch_sizes=(1, 2), rounds=1),
                            pipes={"vlm": pipe})
    assert [(r["B"], r["method"]) for r in result["rows"]] == [(1, "none"), (1, "eagle"), (1, "auto"),
                                                                (2, "none"), (2, "eagle"), (2, "auto")]
    autos = [r for r in result["rows"] if r["method"] == "auto"]
    assert all(r["chosen"] == "eagle" and r["identical_to_none"] and r["reason"].startswith("auto chose eagle")
               for r in autos)
    assert not result["setup"]["profiles"]["vlm"]["calibrated_in_this_run"]
    for s, r in zip(result["summary"], autos):
        assert s["auto_vs_best"] == r["auto_vs_best"]
        assert s["within_5pct_of_best"] == (s["auto_vs_best"] >= 1 - auto_bench.WITHIN_BEST)  # the shown figure
        assert s["not_3pct_below_none"] == (s["auto_x_vs_none"] >= 1 - auto_bench.BELOW_NONE)


def test_serve_bench_clock_and_batches(monkeypatch):
    """The virtual clock: an idle server jumps to the next arrival, waiting jobs share a call up to
    batch_size, and a job's finish time is its batch's (a stand-in runner that takes no time)."""
    from mmspec.bench import serve as sb

    calls = []

    def fake_run_vlm(models, images, questions, seeds, method, knobs, max_new_tokens=64):
        calls.append(list(seeds))
        return [serve.Result(stats={"auto_method": "x"} if method == "auto" else {}, tokens=[s]) for s in seeds]

    monkeypatch.setattr(serve, "run_vlm", fake_run_vlm)
    cfg = sb.ServeBenchConfig(batch_size=2)
    jobs = [sb.Job(i, None, "q", t) for i, t in enumerate([0.0, 0.0, 0.0, 10.0, 10.5])]
    out = sb.serve_static(None, jobs, "none", cfg)
    assert calls == [[0, 1], [2], [3], [4]] and out.occupancy == [2, 1, 1, 1]
    assert out.finish[3] == pytest.approx(10.0, abs=0.05) and out.finish[4] == pytest.approx(10.5, abs=0.05)
    assert out.tokens == {i: [i] for i in range(5)}
    assert sb.arrivals(3, None, 0) == [0.0, 0.0, 0.0]
    times = sb.arrivals(2000, 4.0, 0)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.1)  # the rate asked for


def test_serve_bench_runs_the_bundled_vlm():
    from mmspec.bench import serve as sb

    result = sb.run(sb.ServeBenchConfig(jobs=6, loads=("burst", 0.5), methods=("none",), rounds=1))
    assert [(r["load"], r["policy"]) for r in result["rows"]] == [("burst", "static"), ("burst", "continuous"),
                                                                  ("0.5x", "static"), ("0.5x", "continuous")]
    for row in result["rows"]:  # greedy: every policy and load gives each job its own answer
        assert row["identical"] and row["jobs_per_min"] > 0 and row["p95_s"] >= row["p50_s"]
    assert result["rows"][0]["occupancy"] == 3 and result["rows"][0]["x_static"] == 1.0  # batches of 4, then 2
    assert result["rows"][1]["x_static"] == round(result["rows"][1]["jobs_per_min"] / result["rows"][0]["jobs_per_min"],
                                                  3)
    assert result["setup"]["answer_tokens"]["max"] <= 64
