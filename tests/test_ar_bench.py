"""``mmspec bench ar-image`` and ``mmspec generate ar-image`` end to end on tiny random components
saved as local folders (the bundled checkpoints are not needed: the code path is what is tested)."""

import json

import pytest
import torch

from mmspec import commands
from mmspec.bench import ar_image
from mmspec.bench.report import format_table
from mmspec.models.classifier import ShapesClassifier
from mmspec.models.eagle import EagleDraftHead
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline
from mmspec.training.data import CLASS_NAMES, CLASS_PROMPTS


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    cfg = dict(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32, n_layers=1,
               n_heads=2, mlp_hidden=64, initializer_range=0.3)
    # the recipe's class names, so that prompts map to class ids as with the bundled model
    id2label = {str(i): f"{p}, {n}" for i, (p, n) in enumerate(zip(CLASS_PROMPTS, CLASS_NAMES))}
    target, draft = LlamaGenModel(**cfg, id2label=id2label).eval(), LlamaGenModel(**cfg).eval()
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq, draft_model=draft,
                                      eagle_head=EagleDraftHead.from_target(target))
    pipe.save_pretrained(root / "ar-image")
    ShapesClassifier().eval().save_pretrained(root / "classifier")
    return root


def test_bench_rows_carry_speed_quality_and_exactness(folders):
    methods = (("none", "none", {}), ("sjd", "sjd", {"sjd_window": 8}), ("zipar", "zipar", {"zipar_window": 4}))
    cfg = ar_image.ARImageBenchConfig(pipeline_dir=str(folders / "ar-image"), classifier_dir=str(folders / "classifier"),
                                      methods=methods, images=3, reference_images=32, exact_samples=400,
                                      bootstrap_resamples=50, permutations=200)
    result = ar_image.run(cfg)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["none"]["nfe"] == 256 and rows["none"]["nfe_speedup"] == 1.0 and rows["none"]["fd_ratio"] == 1.0
    assert rows["zipar"]["nfe"] == rows["zipar"]["nfe_closed_form"] == 15 * 4 + 16
    assert rows["sjd"]["exact"] in (True, False) and 0.0 <= rows["sjd"]["exact_p"] <= 1.0
    assert "exact" not in rows["zipar"] and "exact" not in rows["none"]  # lossy / baseline: no test
    for row in rows.values():
        assert {"nfe", "draft_nfe", "tau", "wall_s", "wall_speedup", "fd", "fd_ratio", "class_acc"} <= row.keys()
        # bootstrap intervals hold their estimates; accuracy stays a fraction
        assert row["fd_ci_low"] <= row["fd"] <= row["fd_ci_high"]
        assert 0 <= row["class_acc_ci_low"] <= row["class_acc"] <= row["class_acc_ci_high"] <= 1
        assert row["fd_ratio_ci_low"] <= row["fd_ratio"] <= row["fd_ratio_ci_high"]
    # the baseline against itself: a paired ratio of 1 in every resample, and no test
    assert rows["none"]["fd_ratio_ci_low"] == pytest.approx(1.0) == rows["none"]["fd_ratio_ci_high"]
    assert rows["none"]["mmd_vs_none"] is None and rows["none"]["p_vs_none"] is None
    for row in (rows["sjd"], rows["zipar"]):  # the primary figures: KID, its interval, the test against none
        assert row["kid_ci_low"] <= row["kid"] <= row["kid_ci_high"]
        assert 1 / (cfg.permutations + 1) <= row["p_vs_none"] <= 1.0 and isinstance(row["mmd_vs_none"], float)
    table = format_table(result["rows"], ar_image.AR_IMAGE_COLUMNS)
    assert table.index("p vs none") < table.index("| FD ")  # KID first, FD kept as a secondary column
    setup = result["setup"]
    assert setup["fd_real_floor"] >= 0 and 0 < setup["mean_top1_prob"] <= 1
    assert setup["fd_baseline"] == rows["none"]["fd"] and len(setup["fd_real_floor_ci"]) == 2
    assert setup["bootstrap_resamples"] == cfg.bootstrap_resamples and "bootstrap_seed" in setup
    assert setup["kid_baseline"] == rows["none"]["kid"] and len(setup["kid_real_floor_ci"]) == 2
    assert setup["permutations"] == cfg.permutations == 200 and setup["permutation_seed"] == 0
    ar_image.save_grid(result, folders / "grid.png")
    assert (folders / "grid.png").stat().st_size > 0


def test_generate_writes_pngs(folders, tmp_path, capsys):
    out = tmp_path / "png"
    assert commands.main(["generate", "ar-image", "--method", "zipar+gsd", "--prompt", "a red circle", "a blue star",
                          "--knob", "zipar_window=4", "--num-images", "2", "--out", str(out), "--quiet",
                          "--model", str(folders / "ar-image")]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["a_blue_star-zipar_gsd-0.png", "a_blue_star-zipar_gsd-1.png",
                     "a_red_circle-zipar_gsd-0.png", "a_red_circle-zipar_gsd-1.png"]
    assert "4 images" in capsys.readouterr().out


def test_generate_rejects_bad_knobs(folders, tmp_path):
    with pytest.raises(ValueError, match="method knobs"):
        commands.main(["--debug", "generate", "ar-image", "--method", "sjd", "--prompt", "a red circle", "--knob", "zipar_window=4",
                       "--out", str(tmp_path), "--quiet", "--model", str(folders / "ar-image")])
    assert list(tmp_path.iterdir()) == []


def test_bench_json_is_written(folders, tmp_path, monkeypatch):
    small = ar_image.ARImageBenchConfig(pipeline_dir=str(folders / "ar-image"), classifier_dir=str(folders / "classifier"),
                                        methods=(("none", "none", {}), ("gsd", "gsd", {})), images=3,
                                        reference_images=16, exact_samples=0, bootstrap_resamples=20)
    monkeypatch.setattr(ar_image.ARImageBenchConfig, "quick", classmethod(lambda cls, **kw: small))
    path = tmp_path / "bench.json"
    assert commands.main(["bench", "ar-image", "--quick", "--quiet", "--images", "2", "--json", str(path)]) == 0
    payload = json.loads(path.read_text())
    assert payload["bench"] == "ar-image" and [r["method"] for r in payload["rows"]] == ["none", "gsd"]
    assert payload["setup"]["images"] == 2  # --images overrides the config's count
    assert {"fd_ci_low", "fd_ci_high", "class_acc_ci_low", "class_acc_ci_high", "kid", "kid_ci_low", "kid_ci_high",
            "mmd_vs_none", "p_vs_none"} <= payload["rows"][1].keys()
    with pytest.raises(SystemExit):  # --images is the AR image bench's alone
        commands.main(["bench", "vlm", "--images", "2", "--quiet"])
