"""``mmspec bench vlm`` on the bundled VLM, 2 prompts and 24 tokens: every row is measured, every
row of ours and the peer's is greedy-identical to the target alone, and failures are reported."""

import json

import pytest

from mmspec.bench import vlm
from mmspec.commands import main


@pytest.fixture(scope="module")
def result():
    cfg = vlm.VLMBenchConfig(prompts=2, max_new_tokens=24, rows=vlm.DEFAULT_ROWS[:10] + (("eagle-d3", "eagle", {"tree_depth": 3}),))
    return vlm.run(cfg)


def test_every_row_is_measured_and_lossless(result):
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"none", "hf-generate", "hf-assisted", "hf-lookup", "sd", "lookup", "eagle", "specvlm",
                         "vispec", "medusa", "eagle-d3"}
    for name, r in rows.items():
        if name == "hf-lookup":  # transformers' prompt lookup copies <image> placeholders: reported, not hidden
            assert r["greedy_identical"] == "failed" and "Image features" in r["error"]
            continue
        assert r["greedy_identical"] is True, name
        assert r["tokens_per_s"] > 0 and r["wall_speedup"] > 0
    assert rows["none"]["nfe"] == rows["none"]["tokens"] / 2  # one pass per token (the prefill makes the first)
    assert rows["hf-generate"]["nfe"] == rows["none"]["nfe"]  # the hook counts the same passes
    assert rows["none"]["tau"] == 1.0
    assert rows["eagle"]["tau"] > 2 and rows["eagle"]["draft_params"] > 0 and rows["eagle"]["draft_train_s"] > 0
    assert rows["eagle-d3"]["tau"] <= 5  # depth 3: 4 levels, so at most 4 drafts + 1 per pass
    assert rows["medusa"]["tau"] > 2 and rows["medusa"]["draft_params"] > 0
    assert rows["medusa"]["draft_nfe"] == rows["medusa"]["nfe"] - 1  # one heads call per verification
    assert rows["hf-assisted"]["assistant_sees_image"] is False  # transformers 5.x drops pixel_values
    assert max(rows["none"]["wall_speedup"], rows["hf-generate"]["wall_speedup"]) == 1.0
    assert rows["hf-assisted"]["wall_speedup_vs_peer"] == 1.0
    assert any("hf-lookup" in n for n in result["notes"])


def test_cli_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(vlm, "DEFAULT_ROWS", ("none", "eagle"))
    monkeypatch.setattr(vlm.VLMBenchConfig, "quick", classmethod(lambda cls, **kw: cls(prompts=1, max_new_tokens=8,
                                                                                          rows=("none", "eagle"))))
    assert main(["bench", "vlm", "--quick", "--quiet", "--json", str(tmp_path / "b.json")]) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert [r["method"] for r in data["rows"]] == ["none", "eagle"]
    assert "| eagle" in capsys.readouterr().out


def test_missing_component_is_skipped_with_a_note(tmp_path):
    import shutil

    shutil.copytree(vlm.ASSETS / "vlm", tmp_path / "vlm")
    index = json.loads((tmp_path / "vlm" / "model_index.json").read_text())
    del index["vispec_head"]
    (tmp_path / "vlm" / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(tmp_path / "vlm" / "vispec_head")
    out = vlm.run(vlm.VLMBenchConfig(pipeline_dir=str(tmp_path / "vlm"), prompts=1, max_new_tokens=8,
                                     rows=("none", "vispec")))
    assert [r["method"] for r in out["rows"]] == ["none"]
    assert out["notes"] == ["vispec: skipped (no vispec_head)"]
