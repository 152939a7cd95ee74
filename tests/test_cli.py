"""``mmspec bench core --json`` writes the documented schema; bad arguments fail clearly."""

import json

import pytest

from mmspec import commands
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
    with pytest.raises(SystemExit) as exit_:
        commands.main(["bench", "audio"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("mmspec bench: error: argument name: invalid choice: 'audio' "
                                       "(choose from 'core', 'ar-image', 'vlm', 'adapt', 'video', 'kernels', 'continuous', 'cost', 'auto', 'serve', 'compile', 'glm-image')\n")


BAD_METHOD = ["generate", "ar-image", "--prompt", "a red circle", "--out", "pngs", "--method", "hydra"]


@pytest.mark.parametrize("argv", [["--debug", *BAD_METHOD], [*BAD_METHOD, "--debug"],
                                  ["generate", "--debug", *BAD_METHOD[1:]]], ids=["before", "after", "between"])
def test_debug_reraises_with_the_traceback(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"method must be one of the ar-image methods \('none', 'sd'"):
        commands.main(argv)
    assert capsys.readouterr().err == "" and list(tmp_path.iterdir()) == []


def test_without_debug_the_same_error_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        commands.main(BAD_METHOD)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("mmspec generate ar-image: error: method must be one of the ar-image methods ('none', 'sd'")


def test_debug_reraises_usage_errors():
    with pytest.raises(commands.UsageError, match="invalid choice: 'audio'"):
        commands.main(["--debug", "bench", "audio"])


def test_help_lists_debug_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_:
        commands.main(["generate", "vlm", "--help"])
    assert exit_.value.code == 0 and "--debug" in capsys.readouterr().out


def test_generate_lists_the_registered_modalities_with_a_bundled_pipeline():
    from mmspec import methods
    from mmspec.commands import generate

    gen = next(a for a in commands.build_parser()._actions if a.dest == "command").choices["generate"]
    kinds = next(a for a in gen._actions if a.dest == "kind").choices
    assert tuple(kinds) == tuple(generate.commands()) == ("ar-image", "vlm", "video", "continuous")
    assert set(methods.modalities()) - set(generate.commands()) == {"text"}  # no bundled text pipeline
    for name, parser in kinds.items():  # where a modality takes --method, its choices are the registry's names
        method = next((a for a in parser._actions if "--method" in a.option_strings), None)
        assert method is None or method.choices is None or (
            tuple(method.choices) == methods.auto.method_names(name, methods.names(name)))  # "auto" first where it applies
