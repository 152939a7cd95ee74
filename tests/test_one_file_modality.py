"""A modality is one file: ``tests/toy_modality.py`` declares the ``toy-seq`` modality (registry
methods, model, pipeline and one ``ModalitySpec``), and every way in sees it: ``mmspec batch``,
``mmspec generate``, the demo's tabs, the GPU check and the cost bench.

That nothing else names it is checked (no file of mmspec, pipelines/ or demos/ mentions
``toy-seq``); the toy is unregistered when the module's tests end, so other test files see the
built-in modalities only.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from mmspec import batch, methods, serve
from mmspec.bench import gpu_check as gc
from mmspec.bench.cost import CostBenchConfig, cost_targets
from mmspec.bench.cost import run as run_cost
from mmspec.commands import main

ROOT = Path(__file__).resolve().parents[1]
KIND = "toy-seq"


@pytest.fixture(scope="module")
def toy():
    """Import (register) the toy modality; unregister it afterwards."""
    module = importlib.import_module("toy_modality")
    yield module
    module.unregister()
    sys.modules.pop("toy_modality")
    assert KIND not in serve.SPECS and KIND not in methods.modalities()


@pytest.fixture(scope="module")
def assets(toy, tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    toy.build_pipeline(root / KIND)
    return root


def test_nothing_outside_the_toy_names_it(toy):
    offenders = [str(p.relative_to(ROOT)) for d in ("mmspec", "pipelines", "demos", "kernels")
                 for p in (ROOT / d).rglob("*.py") if KIND in p.read_text()]
    assert offenders == []
    assert KIND in methods.modalities() and methods.names(KIND) == ("none", "jacobi")
    assert serve.spec(KIND) is toy.SPEC and list(serve.SPECS)[-1] == KIND


def test_the_pipeline_decodes_and_jacobi_equals_none(toy, assets):
    pipe = serve.spec(KIND).load(assets / KIND)
    ref = pipe([[3, 1, 4], [1, 5, 9]], max_new_tokens=12)
    out = pipe([[3, 1, 4], [1, 5, 9]], method="jacobi", max_new_tokens=12)
    assert out.tokens == ref.tokens and len(ref.tokens[0]) == 12
    assert len(set(ref.tokens[0])) > 1  # the spread weights make greedy outputs vary
    with pytest.raises(ValueError, match=r"method must be one of the toy-seq methods \('none', 'jacobi'\)"):
        pipe([[3, 1, 4]], method="sd")


def test_batch_jobs_of_the_toy_kind(toy, assets, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "a", "kind": KIND, "prompt": "3 1 4"}) + "\n"
                    + json.dumps({"id": "b", "kind": KIND, "prompt": "1 5 9", "method": "jacobi",
                                  "max_new_tokens": 5}) + "\n")
    batch.run(jobs, tmp_path / "out", progress=False, models=serve.Models(assets))
    pipe = serve.spec(KIND).load(assets / KIND)
    assert (tmp_path / "out" / "a.txt").read_text().split() == [str(t) for t in pipe([[3, 1, 4]]).tokens[0]]
    assert len((tmp_path / "out" / "b.txt").read_text().split()) == 5
    records = [json.loads(line) for line in (tmp_path / "out" / batch.MANIFEST).read_text().splitlines()]
    assert [(r["id"], r["status"]) for r in records] == [("a", "ok"), ("b", "ok")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "c", "kind": KIND, "prompt": "three"}) + "\n")
    with pytest.raises(ValueError, match="prompt must be space-separated ints"):
        batch.run(bad, tmp_path / "out2", progress=False, models=serve.Models(assets))
    assert not (tmp_path / "out2").exists()


def test_mmspec_generate_runs_the_toy(toy, assets, capsys):
    assert main(["generate", KIND, "--prompt", "3 1 4", "--model", str(assets / KIND), "--method", "jacobi",
                 "--knob", "jacobi_window=3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    pipe = serve.spec(KIND).load(assets / KIND)
    assert lines[0].split() == [str(t) for t in pipe([[3, 1, 4]]).tokens[0]]
    with pytest.raises(SystemExit) as exit_:  # the registry's range, before any model loads
        main(["generate", KIND, "--prompt", "3 1 4", "--model", str(assets / KIND), "--knob", "jacobi_window=1",
              "--method", "jacobi"])
    assert exit_.value.code == 2 and "jacobi_window must be an int >= 2" in capsys.readouterr().err


def test_the_demo_has_a_toy_tab(toy):
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    sys.path.insert(0, str(ROOT))
    from demos import app

    assert ("Toy sequences", toy.toy_tab) in app.tabs()
    blocks = app.build()
    ids = {b.elem_id for b in blocks.blocks.values() if getattr(b, "elem_id", None)}
    assert {"tab-toy-sequences", "toy-prompt", "toy-run"} <= ids


def test_the_toy_tabs_click_answers(toy, assets, monkeypatch):
    monkeypatch.setattr(toy, "DEMO_MODELS", serve.Models(assets))
    pipe = serve.spec(KIND).load(assets / KIND)
    assert toy.toy_continue("3 1 4", "jacobi").split() == [str(t) for t in pipe([[3, 1, 4]]).tokens[0]]


def test_the_gpu_check_drives_the_toy(toy, assets, tmp_path):
    assert gc.pipeline_names()[-2:] == (KIND, "wan-tiny") and f"pipeline:{KIND}" in gc.step_names()
    assert gc.step_seconds(f"pipeline:{KIND}") == toy.ToySeqCheck.seconds
    report = gc.run(tmp_path, dry_run=True, steps=(f"pipeline:{KIND}",), say=lambda msg: None)
    assert gc.validate_report(report) == []
    step = next(s for s in report["steps"] if s["name"] == f"pipeline:{KIND}")
    assert step["status"] == "skipped" and step["reason"] == "dry run: no CUDA device"
    result = gc.check_pipeline(KIND, "cpu", dtypes=("float32",), speed_dtype="float32", rounds=1, quick=True,
                               model_dir=assets / KIND, compile_steps=False)
    assert result["problems"] == [] and [r["method"] for r in result["identity"]] == ["jacobi"]
    assert all(r["identical"] for r in result["identity"] + result["offload"])
    assert [r["method"] for r in result["speed"]["rows"]] == ["none", "jacobi"]


def test_the_cost_bench_times_the_toy(toy, assets):
    assert list(cost_targets())[-1] == KIND
    cfg = CostBenchConfig(targets=(KIND,), folders={KIND: str(assets / KIND)}, prompts=1, repeats=1, warmup=0,
                          widths=(1, 2, 4))
    assert cfg.target_rows(KIND) == toy.ToySeqCost.rows
    result = run_cost(cfg)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"none", "jacobi"} and rows["none"]["measured_x"] == 1.0
    assert all(r["target"] == KIND and r["ceiling_s"] > 0 for r in rows.values())
    assert set(result["curves"][KIND]["seconds"]) == {"target"}


def test_a_bad_spec_is_refused_before_it_is_served(toy):
    import dataclasses

    with pytest.raises(ValueError, match="kind must be a modality not served yet, got 'toy-seq'"):
        serve.register(toy.SPEC)
    with pytest.raises(ValueError, match="cost_target must be None or a 'module:attribute' string"):
        dataclasses.replace(toy.SPEC, cost_target=toy.ToySeqCost)
    assert torch.is_grad_enabled()  # nothing above left inference mode on
