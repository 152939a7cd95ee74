"""The continuous-token modality served to people: ``serve.run_continuous``, the ``continuous``
batch kind and the demo's "Continuous tokens" tab, on a tiny random-init pipeline saved in a temp
assets folder (16 classes named by the class prompts, 64 px images so the bundled classifier
applies; the classifier folder is linked in)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from mmspec import batch, serve
from mmspec.models.continuous import ContinuousARModel
from mmspec.models.continuous_tokenizer import PatchPCATokenizer
from mmspec.pipelines import SpeculativeContinuousARPipeline

ROOT = Path(__file__).resolve().parents[1]
TIMESTEPS = [50, 300, 600]  # a short chain, as tests/test_continuous_pipeline.py


def _model(seed: int, dim: int = 16, layers: int = 1) -> ContinuousARModel:
    """tests/test_continuous_pipeline.py's tiny model with every class prompt as a class."""
    torch.manual_seed(seed)
    prompts = serve.ar_prompts()
    model = ContinuousARModel(token_dim=3, grid_size=4, num_classes=len(prompts), dim=dim, n_layers=layers,
                              n_heads=2, mlp_hidden=32, mixture_components=2, mixture_hidden=16, diffusion_width=16,
                              diffusion_blocks=1, diffusion_timesteps=TIMESTEPS,
                              id2label={str(i): p for i, p in enumerate(prompts)}).eval()
    with torch.no_grad():  # the diffusion head's zero-initialised output layers would make every head agree
        for p in model.heads["diffusion"].parameters():
            p.add_(0.05 * torch.randn(p.shape))
    return model


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("assets")
    torch.manual_seed(0)
    tokenizer = PatchPCATokenizer(sample_size=64, patch_size=16, latent_dim=3).fit(torch.rand(4, 3, 64, 64) * 2 - 1)
    SpeculativeContinuousARPipeline(tokenizer=tokenizer, transformer=_model(1, 24, 2),
                                    draft_model=_model(2)).save_pretrained(root / "continuous")
    (root / "classifier").symlink_to(ROOT / "assets" / "classifier")
    return root


@pytest.fixture(scope="module")
def models(assets) -> serve.Models:
    return serve.Models(assets)


class _NoModels:
    """Models that fail if anything asks for them."""

    def __getattr__(self, name):
        raise AssertionError(f"a model was loaded ({name})")


# ---------------------------------------------------------------- serve

def test_run_continuous_images_stats_and_seeds(models):
    (a,) = serve.run_continuous(models, ["a red circle"], [0], "sd")
    assert a.image.shape == (64, 64, 3) and a.image.dtype == np.uint8
    assert a.stats["nfe"] >= 1 and a.stats["batch"] == 1 and a.extra == {"lossless": True, "head": "mixture"}
    assert a.commit_pass.shape == (16,) and a.commit_pass[0] == 0  # the prefill's token
    assert np.all(np.diff(a.commit_pass) >= 0) and a.commit_pass[-1] < a.stats["nfe"]
    (n,) = serve.run_continuous(models, ["a red circle"], [0], "none")
    assert n.commit_pass.tolist() == list(range(16)) and n.stats["nfe"] == 16  # the baseline: a pass per token
    (b,) = serve.run_continuous(models, ["A Red  Circle"], [0], "sd")  # same prompt, same seed
    assert np.array_equal(a.image, b.image)
    (c,) = serve.run_continuous(models, ["a red circle"], [1], "sd")
    assert not np.array_equal(a.image, c.image)
    (d,) = serve.run_continuous(models, ["a blue star"], [0], "cspd", {"cspd_inner_temperature": 10.0})
    assert d.extra == {"lossless": False, "head": "diffusion"} and d.image.shape == (64, 64, 3)
    # a batch: one image per prompt, no per-row pass map (the callback gives a mean over rows)
    rows = serve.run_continuous(models, ["a red circle", "a blue star"], [0, 1], "none")
    assert [r.image.shape for r in rows] == [(64, 64, 3)] * 2 and all(r.commit_pass is None for r in rows)
    assert 0 <= serve.class_confidence(models, [a.image], ["a red circle"])[0] <= 1


def test_run_continuous_checks_before_loading():
    for kwargs, message in ((dict(prompts=["a purple moon"]), "prompt must be one of the class prompts"),
                            (dict(method="fast"), "method must be one of the continuous methods"),
                            (dict(knobs={"sd_gamma": 0}, method="sd"), "sd_gamma must be an int >= 1"),
                            (dict(seeds=[-1]), "seed"),
                            (dict(guidance_scale=-1.0), "guidance_scale must be a number >= 0"),
                            (dict(temperature=0.0), "temperature must be a number > 0")):
        call = dict(prompts=["a red circle"], seeds=[0]) | kwargs
        with pytest.raises(ValueError, match=message):
            serve.run_continuous(_NoModels(), **call)


# ---------------------------------------------------------------- batch

JOBS = [
    {"id": "c0", "kind": "continuous", "prompt": "a red circle", "method": "sd", "seed": 0},
    {"id": "c1", "kind": "continuous", "prompt": "a blue star", "method": "cspd", "seed": 1,
     "cspd_inner_temperature": 10.0, "guidance_scale": 1.5},
]


def _jobs_file(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "jobs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("line, expected", [
    ('{"id": "b", "kind": "continuous", "prompt": "a red circle", "method": "fast"}',
     "line 3: method must be one of the continuous methods"),
    ('{"id": "b", "kind": "continuous", "prompt": "a red circle", "method": "sd", "sd_gamma": 0}',
     "line 3: sd_gamma must be an int >= 1, got 0"),
    ('{"id": "b", "kind": "continuous", "prompt": "a red circle", "method": "sd", "cspd_max_tries": 5}',
     "line 3: method_knobs must be knobs of 'sd'"),
    ('{"id": "b", "kind": "continuous", "prompt": "a purple moon"}', "line 3: prompt must be one of the class prompts"),
    ('{"id": "b", "kind": "continuous"}', "line 3: prompt must be given for a 'continuous' job"),
    ('{"id": "b", "kind": "continuous", "prompt": "a red circle", "temperature": 0}',
     "line 3: temperature must be a number > 0"),
    ('{"id": "b", "kind": "continuous", "prompt": "a red circle", "guidance_scale": -1}',
     "line 3: guidance_scale must be a number >= 0"),
    ('{"id": "b", "kind": "continuous", "prompt": "a red circle", "seed": "7"}', "line 3: seed"),
])
def test_bad_line_is_refused_before_any_model_loads(tmp_path, line, expected):
    path = _jobs_file(tmp_path, [json.dumps(JOBS[0]), json.dumps(JOBS[1]), line])
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        batch.run(path, out, progress=False, models=_NoModels())
    assert "1 bad line(s), nothing was run" in str(err.value) and expected in str(err.value)
    assert not out.exists()


def test_batch_writes_pngs_and_manifest_then_resumes(models, tmp_path):
    from accelerate.state import PartialState

    path = _jobs_file(tmp_path, [json.dumps(j) for j in JOBS])
    out = tmp_path / "out"
    try:
        summary = batch.run(path, out, batch_size=4, progress=False, models=models)
        assert (summary.total, summary.skipped, summary.ok, summary.failed) == (2, 0, 2, 0)
        records = [json.loads(line) for line in (out / batch.MANIFEST).read_text().splitlines()]
        assert [(r["id"], r["kind"], r["status"], r["output"]) for r in records] == [
            ("c0", "continuous", "ok", "c0.png"), ("c1", "continuous", "ok", "c1.png")]
        assert all(r["stats"]["nfe"] >= 1 and r["stats"]["batch"] == 1 for r in records)  # one job per call
        assert sorted(p.name for p in out.iterdir()) == ["c0.png", "c1.png", batch.MANIFEST]  # no temporary files
        # each file is the image serve gives for that job alone
        direct = serve.run_continuous(models, ["a blue star"], [1], "cspd", {"cspd_inner_temperature": 10.0},
                                      guidance_scale=1.5)[0]
        assert np.array_equal(np.asarray(PIL.Image.open(out / "c1.png")), direct.image)
        # a rerun finds both jobs done: no model, nothing rewritten
        before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*.png")}
        again = batch.run(path, out, progress=False, models=_NoModels())
        assert (again.skipped, again.ok, again.failed) == (2, 0, 0)
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*.png")} == before
    finally:
        PartialState._reset_state()  # leave no process state behind for other tests


# ---------------------------------------------------------------- demo tab

@pytest.fixture(scope="module")
def app(models):
    sys.path.insert(0, str(ROOT))
    from demos import app

    saved, app.MODELS = app.MODELS, models
    yield app
    app.MODELS = saved


def _knobs(method: str) -> list:
    defaults = serve.method_defaults("continuous", method)
    return [defaults.get(name) for name in serve.knob_specs("continuous")]


def test_demo_tab_side_by_side(app, models):
    assert "Continuous tokens" in [label for label, _ in app.tabs()]
    base, ours, base_md, ours_md, error = app.continuous_generate("a red circle", "cspd", 3, 2.0, *_knobs("cspd"))
    assert error == ""
    assert base.shape == ours.shape == (64, 64, 3) and base.dtype == ours.dtype == np.uint8
    assert base_md.startswith("**baseline (none)** - NFE")
    assert "speed-up" in ours_md and "**lossy**" in ours_md and "p(requested class)" in ours_md
    assert "diffusion head" in ours_md  # the baseline's head differs: said beside the speed-up
    assert np.array_equal(base, serve.run_continuous(models, ["a red circle"], [3], "none")[0].image)
    *_, sd_md, _ = app.continuous_generate("a red circle", "sd", 3, 2.0, *_knobs("sd"))
    assert "sd: lossless" in sd_md and "head" not in sd_md


@pytest.mark.parametrize("seed, method, message", [
    (-1, "sd", "**Error:** seed must be an int in [0, 2**63)"),
    (1.5, "sd", "**Error:** seed must be an int"),
    (0, "fast", "**Error:** method must be one of the continuous methods"),
])
def test_demo_tab_bad_input_is_one_line(app, seed, method, message):
    out = app.continuous_generate("a red circle", method, seed, 2.0, *_knobs("sd"))
    assert out[:4] == (None, None, "", "")
    assert out[4].startswith(message) and "\n" not in out[4]
