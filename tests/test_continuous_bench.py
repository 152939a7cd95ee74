"""``mmspec bench continuous`` on a tiny random-init pipeline saved in a temp folder: every row and
every column of the JSON, the booster row on a swapped draft, ratios to ``none``, exactness
fields for the non-baseline rows; the bundled classifier measures FD (64x64 images)."""

import json
import math
from pathlib import Path

import pytest
import torch

from mmspec.bench import continuous
from mmspec.bench.report import format_table
from mmspec.models.continuous_tokenizer import PatchPCATokenizer
from mmspec.pipelines import SpeculativeContinuousARPipeline

from test_continuous_pipeline import tiny_model

CLASSIFIER = Path(__file__).resolve().parents[1] / "assets" / "classifier"
JSON_KEYS = ("method", "nfe", "nfe_speedup", "wall_speedup", "tau", "exact", "fd", "fd_ratio", "class_acc", "alpha",
             "head_calls", "residual_tries", "draft_nfe", "target_head_calls", "target_head_rows", "draft_head_calls",
             "draft_head_rows", "residual_fallbacks", "wall_s", "exact_p", "head_rows", "images", "fd_real_floor",
             "kid", "mmd_vs_none", "p_vs_none", "kid_real_floor")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    tokenizer = PatchPCATokenizer(sample_size=64, patch_size=16, latent_dim=3).fit(torch.rand(4, 3, 64, 64) * 2 - 1)
    SpeculativeContinuousARPipeline(tokenizer=tokenizer, transformer=tiny_model(1, 24, 2),
                                    draft_model=tiny_model(2)).save_pretrained(root / "pipe")
    tiny_model(3).save_pretrained(root / "booster")
    return root


def test_bench_rows_and_columns(folders, tmp_path):
    cfg = continuous.ContinuousBenchConfig.quick(
        pipeline_dir=str(folders / "pipe"), booster_dir=str(folders / "booster"), classifier_dir=str(CLASSIFIER),
        images=3, diffusion_images=2, reference_images=32, exact_samples=300, exact_tokens=2, exact_class=1,
        permutations=100)
    result = continuous.run(cfg)
    rows = result["rows"]
    assert [r["method"] for r in rows] == [r[0] for r in continuous.DEFAULT_ROWS]
    for row in rows:
        for key in JSON_KEYS:
            assert key in row, (row["method"], key)
        assert math.isfinite(row["fd"]) and math.isfinite(row["kid"]) and 0 <= row["class_acc"] <= 1
        assert row["residual_fallbacks"] == 0
    by = {r["method"]: r for r in rows}
    assert by["none"]["nfe_speedup"] == 1.0 and by["none"]["fd_ratio"] == 1.0
    assert by["sd"]["images"] == 3 and by["path"]["images"] == by["none-diffusion"]["images"] == 2
    assert by["none-diffusion"]["fd_ratio"] == 1.0 and math.isfinite(by["path"]["fd_ratio"])  # same-head baseline
    # the permutation test against the same head's baseline, none for the baselines themselves
    assert by["none"]["p_vs_none"] is None and by["none-diffusion"]["p_vs_none"] is None
    for label in ("sd", "path", "cspd-t42"):
        assert 1 / 101 <= by[label]["p_vs_none"] <= 1 and math.isfinite(by[label]["mmd_vs_none"])
    assert by["path"]["kid_real_floor"] != by["sd"]["kid_real_floor"] and result["setup"]["permutations"] == 100
    assert result["setup"]["diffusion_images"] == 2 and by["path"]["fd_real_floor"] != by["sd"]["fd_real_floor"]
    assert by["none"]["nfe"] == 16 and by["none"]["draft_nfe"] == 0  # one pass per token (the prefill's first)
    assert by["sd"]["draft_nfe"] > 0 and by["sd+distill"]["draft"] == "booster"
    for label in ("sjd", "sjd-w4", "sjd-w6", "sjd-w12", "sjd-w16", "sjd-mc", "sjd-independent"):  # the target drafts for itself: no draft model, mixture head
        assert by[label]["draft_nfe"] == 0 and by[label]["head"] == "mixture" and by[label]["lossless"]
        assert isinstance(by[label]["exact"], bool) and by[label]["nfe"] < by["none"]["nfe"]
    assert by["none"]["exact"] is None and isinstance(by["sd"]["exact"], bool) and isinstance(by["path"]["exact"], bool)
    assert by["cspd-t42"]["lossless"] is False and by["path"]["head"] == "diffusion" and by["sd"]["head"] == "mixture"
    assert 0 < result["setup"]["fd_real_floor"]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(continuous.public(result)))
    assert json.loads(path.read_text())["rows"][1]["method"] == "sd"
    table = format_table(rows, continuous.CONTINUOUS_COLUMNS)
    assert "wall x" in table and table.index("p vs none") < table.index("| FD ")  # KID first, FD secondary
    continuous.save_grid(result, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0


def test_booster_row_skipped_without_booster_and_bad_knobs_fail_before_loading(tmp_path):
    cfg = continuous.ContinuousBenchConfig(pipeline_dir=str(tmp_path / "missing"), booster_dir=None,
                                           rows=(("bad", "sd", {"sd_gamma": 0}, None),))
    with pytest.raises(ValueError, match="sd_gamma must be"):
        continuous.run(cfg)


def test_showcase_part_writes_a_grid_and_a_table(folders, tmp_path, capsys):
    """The showcase's continuous part on the tiny pipeline: the three mixture-head rows (the distilled
    draft found in the pipeline folder's ``draft_distilled``), a grid PNG with one row of samples per
    method, and the table with the sd rows' exactness column."""
    import shutil

    import PIL.Image

    from mmspec import commands

    model_dir = tmp_path / "continuous"
    shutil.copytree(folders / "pipe", model_dir)
    shutil.copytree(folders / "booster", model_dir / "draft_distilled")
    commands.showcase.continuous_part(tmp_path, model_dir, images=2, classifier_dir=str(CLASSIFIER),
                                      reference_images=32, exact_samples=300, exact_tokens=2, exact_class=1)
    out = capsys.readouterr().out
    for label in continuous.SHOWCASE_ROWS:
        assert f"| {label} " in out
    assert "exact" in out and "real-vs-real floor" in out
    with PIL.Image.open(tmp_path / "continuous_grid.png") as grid:
        assert grid.size == (2 * 64, len(continuous.SHOWCASE_ROWS) * 64)
