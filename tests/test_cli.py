"""``mmspec bench core --json`` writes the documented schema; bad arguments fail clearly."""

import json

import pytest

from mmspec import cli
from mmspec.bench import core, report

REQUIRED = {"method", "nfe", "nfe_speedup", "wall_speedup", "tau", "exact"}


@pytest.fixture(scope="module")
def small_run():
    cfg = core.CoreBenchConfig(prompts=2, new_tokens=12, exact_samples=4_000, iid_rows=200, iid_tokens=30,
                               alphas=(0.8,), gammas=(2,), repeats=1)
    return core.run(cfg)


def test_rows_follow_the_schema(small_run):
    assert small_run["bench"] == "core"
    rows = small_run["rows"]
    assert {r["method"] for r in rows} == set(core.METHODS) | {"sd-iid"}
    for row in rows:
        assert REQUIRED <= row.keys(), row
    for row in rows:
        if row["method"] == "none":
            assert row["nfe_speedup"] == 1.0 and row["wall_speedup"] == 1.0 and row["exact"] is None
        elif row["pair"] == "layer-skip":
            assert row["exact"] is True, row  # every core method is lossless and checked in the run
    iid = [r for r in rows if r["pair"] == "iid"]
    assert iid and all({"gamma", "alpha", "tau_formula"} <= r.keys() for r in iid)


def test_json_written_atomically(tmp_path, small_run):
    path = tmp_path / "out" / "core.json"
    report.write_json(path, small_run)
    assert json.loads(path.read_text()) == json.loads(json.dumps(small_run))
    assert [p.name for p in path.parent.iterdir()] == ["core.json"]  # no temp file left behind


def test_json_not_half_written_on_failure(tmp_path):
    path = tmp_path / "core.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        report.write_json(path, {"rows": [object()]})
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["core.json"]


def test_unknown_bench_is_rejected(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "video"])
    assert "invalid choice: 'video' (choose from 'core', 'ar-image', 'vlm')" in capsys.readouterr().err
