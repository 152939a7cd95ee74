"""``mmspec bench glm-image --quick`` on the tiny random GLM-Image: the JSON's structure, the
documented ratios, the baseline's passes equal the prior's token count and the speculative rows
take fewer; bad settings and other benches' flags are refused before anything loads."""

import json

import pytest

from mmspec import commands
from mmspec.bench import glm_image


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm_bench") / "glm.json"
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert commands.main(["bench", "glm-image", "--quick", "--quiet", "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_quick_bench_rows_and_json(quick_run):
    data, printed = quick_run
    assert data["bench"] == "glm-image"
    setup = data["setup"]
    assert "machine" in setup and setup["weights"] == "random" and setup["acceptance_representative"] is False
    assert setup["images"] == 2 and setup["threads"] == 1
    assert [r["method"] for r in data["rows"]] == list(glm_image.DEFAULT_METHODS)
    rows = {r["method"]: r for r in data["rows"]}
    tokens = setup["prior_tokens_per_image"]
    assert tokens == 1 + 256 + 1  # the 16x16 preview, the 1x1 target grid at 32 px, one more token
    assert rows["none"]["nfe"] == tokens
    assert rows["sjd"]["nfe"] < rows["none"]["nfe"]
    for r in data["rows"]:
        assert r["images"] == 2 and r["prior_s"] > 0 and r["pipeline_s"] >= r["prior_s"]
        assert r["nfe_speedup"] == pytest.approx(rows["none"]["nfe"] / r["nfe"])
        assert r["wall_speedup"] == pytest.approx(rows["none"]["prior_s"] / r["prior_s"])
        assert r["tau"] >= 1.0
    assert rows["none"]["nfe_speedup"] == rows["none"]["wall_speedup"] == 1.0
    assert "| method | prior passes/image | x fewer passes" in printed
    assert "RANDOM" in printed and "NOT representative" in printed and "machine:" in printed


@pytest.mark.parametrize("argv, message", [
    (["bench", "glm-image", "--images", "4"], "--images is for 'bench ar-image' only"),
    (["bench", "glm-image", "--frames", "10"], "--frames is for 'bench video' only"),
    (["bench", "glm-image", "--threads", "0"], "threads"),
])
def test_bad_cli_args_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        commands.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bad_settings_are_refused_before_loading(monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("built the pipeline before checking the settings")

    monkeypatch.setattr(glm_image, "tiny_glm_image_pipeline", no_build)
    with pytest.raises(ValueError, match="images must be an int >= 1"):
        glm_image.run(glm_image.GlmImageBenchConfig(images=0))
    with pytest.raises(ValueError, match="method"):
        glm_image.run(glm_image.GlmImageBenchConfig(methods=("none", "zipar")))
