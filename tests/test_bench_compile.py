"""``mmspec bench compile`` on a tiny AR pipeline: its rows are the documented arithmetic on the
JSON, the target is eager again afterwards, and bad settings are refused before anything loads."""

import json

import pytest
import torch

from mmspec import commands
from mmspec.bench import compile as compiled
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    torch.manual_seed(0)
    vq = TinyVQModel(sample_size=16, codebook_size=32).eval()
    target = LlamaGenModel(vocab_size=32, grid_size=vq.grid_size, num_classes=16, dim=16, n_layers=1, n_heads=2,
                           mlp_hidden=32, initializer_range=0.3).eval()
    SpeculativeARImagePipeline(transformer=target, vqvae=vq).save_pretrained(root / "ar")
    return root


def test_rows_and_json(tiny_dir, monkeypatch, capsys):
    small = dict(pipeline_dir=str(tiny_dir / "ar"), rows=(("none", "none", {}),), ways=("forward",), images=1)
    monkeypatch.setattr(compiled.CompileBenchConfig, "quick", classmethod(lambda cls, **kw: cls(**{**small, **kw})))
    path = tiny_dir / "compile.json"
    assert commands.main(["bench", "compile", "--quick", "--quiet", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["bench"] == "compile" and "machine" in data["setup"]
    (row,) = data["rows"]
    assert (row["way"], row["method"]) == ("forward", "none")
    assert row["gain"] == pytest.approx(row["eager_s"] / row["compiled_s"])
    assert row["first_call_s"] > 0 and isinstance(row["same_tokens"], bool)
    assert "| compiled | method" in capsys.readouterr().out


@pytest.mark.parametrize("way", compiled.WAYS)
def test_switch_restores_the_eager_target(way):
    torch.manual_seed(0)
    model = LlamaGenModel(vocab_size=16, grid_size=4, num_classes=4, dim=16, n_layers=2, n_heads=2, mlp_hidden=32).eval()
    switch = compiled._Switch(model, way)
    switch.use(True)
    assert ("forward" in model.__dict__) if way == "forward" else all(
        layer._compiled_call_impl is not None for layer in model.layers)
    switch.use(False)
    assert "forward" not in model.__dict__ and all(layer._compiled_call_impl is None for layer in model.layers)


def test_bad_settings_are_refused_before_loading(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="ways must be a non-empty tuple among"):
        compiled.run(compiled.CompileBenchConfig(pipeline_dir=missing, ways=("jit",)))
    with pytest.raises(ValueError, match="images must be an int >= 1"):
        compiled.run(compiled.CompileBenchConfig(pipeline_dir=missing, images=0))
    with pytest.raises(ValueError, match="method must be one of the ar-image methods"):
        compiled.run(compiled.CompileBenchConfig(pipeline_dir=missing, rows=(("x", "hydra", {}),)))
