"""A trained drafter is one file: ``tests/toy_drafter.py`` declares its component, drafter,
method and training recipe, and nothing else in mmspec names it.

That no other file is touched holds by construction: this test adds nothing to mmspec; it imports
the toy module (which registers the ``toy`` method of ``"ar-image"``, its ``toy_head`` component
and its ``ar-toy`` recipe) and finds the toy in the AR pipeline's components, in
``save_pretrained`` / ``from_pretrained``, in ``mmspec train``, in the demo's method dropdown and
in batch jobs; greedy decoding with it equals ``method="none"``. The toy is unregistered when the
module's tests end, so other test files see the built-in methods only.
"""

import importlib
import inspect
import json
import sys

import pytest
import torch

from mmspec import methods
from mmspec.commands import main
from mmspec.models import load_checkpoint
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.vq import TinyVQModel
from mmspec.pipelines import SpeculativeARImagePipeline

COLOURS, SHAPES = ("red", "green", "blue", "yellow"), ("circle", "square", "triangle", "star")
ID2LABEL = {str(4 * i + j): f"a {c} {s}, {c} {s}" for i, c in enumerate(COLOURS) for j, s in enumerate(SHAPES)}


@pytest.fixture(scope="module")
def toy():
    """Import (register) the toy drafter; unregister it afterwards."""
    module = importlib.import_module("toy_drafter")
    yield module
    mod = methods.modality("ar-image")
    mod.parts.pop("toy"), mod.methods.pop("toy"), mod.component_specs.pop("toy_head")
    from mmspec.methods import registry

    registry._RECIPES.pop("ar-toy")
    sys.modules.pop("toy_drafter")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    torch.manual_seed(1)
    target = LlamaGenModel(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32,
                           n_layers=1, n_heads=2, mlp_hidden=64, initializer_range=0.3, id2label=ID2LABEL).eval()
    root = tmp_path_factory.mktemp("ar")
    target.save_pretrained(root / "transformer")
    vq.save_pretrained(root / "vqvae")
    return root


@pytest.fixture(scope="module")
def trained(toy, target_dir, tmp_path_factory):
    """``mmspec train ar-toy``: a few steps, written to a folder."""
    out = tmp_path_factory.mktemp("toy") / "head"
    code = main(["train", "ar-toy", "--target", str(target_dir / "transformer"), "--out", str(out),
                 "--steps", "300", "--dataset-size", "4096", "--log-every", "1000", "--threads", "1"])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def pipe(toy, trained, target_dir):
    p = SpeculativeARImagePipeline(transformer=load_checkpoint(LlamaGenModel, target_dir / "transformer"),
                                   vqvae=load_checkpoint(TinyVQModel, target_dir / "vqvae"),
                                   toy_head=load_checkpoint(toy.ToyBigramHead, trained))
    p.set_progress_bar_config(disable=True)
    return p


def test_the_registry_and_the_pipeline_see_the_toy(toy, pipe):
    assert "toy" in methods.names("ar-image") and "ar-toy" in methods.recipes()
    assert [c.name for c in methods.components("ar-image")][-1] == "toy_head"
    assert "toy_head" in SpeculativeARImagePipeline._optional_components
    param = inspect.signature(SpeculativeARImagePipeline.__init__).parameters["toy_head"]
    assert param.default is None
    assert pipe.components["toy_head"] is pipe.toy_head and pipe.draft_model is None


def test_mmspec_train_writes_a_loadable_folder(toy, trained, capsys):
    log = json.loads((trained / "train_log.json").read_text())
    assert log["recipe"] == "ar-toy" and log["steps"] == 300
    assert log["heldout_top1"] > 0.05  # chance is 1/512: the table learned the target's argmax
    head = load_checkpoint(toy.ToyBigramHead, trained)
    assert head.config.vocab_size == 512 and any(trained.glob("*.safetensors"))
    with pytest.raises(SystemExit):
        main(["train", "ar-toy", "--help"])
    assert "--target" in capsys.readouterr().out


def test_greedy_decoding_with_the_toy_equals_none(pipe):
    ref = pipe(class_labels=[3, 7], temperature=0.0, output_type="latent")
    out = pipe(class_labels=[3, 7], method="toy", method_knobs={"toy_gamma": 2}, temperature=0.0,
               output_type="latent")
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats["nfe"] < ref.stats["nfe"]  # the trained table's drafts are accepted


def test_save_pretrained_and_from_pretrained_round_trip_the_toy(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["toy_head"] == ["toy_drafter", "ToyBigramHead"] and index["draft_model"] == [None, None]
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded.toy_head.table.weight, pipe.toy_head.table.weight)
    kw = dict(class_labels=[5], method="toy", temperature=0.0, output_type="latent")
    assert torch.equal(loaded(**kw).tokens, pipe(**kw).tokens)


def test_the_demo_dropdown_lists_the_toy(toy):
    gr = pytest.importorskip("gradio")
    from demos import app

    with gr.Blocks():
        _, method, *_ = app._class_prompt_inputs("ar-image", "toy-test", "gsd")
    assert "toy" in [c[0] if isinstance(c, tuple) else c for c in method.choices]


def test_a_batch_job_runs_the_toy(pipe, tmp_path):
    from mmspec import batch, serve

    models = serve.Models()
    models._loaded["ar-image"] = pipe  # the tiny pipeline stands in for the bundled one
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "toy-0", "kind": "ar-image", "method": "toy", "prompt": "a red circle",
                                "temperature": 0.0, "seed": 0}) + "\n")
    summary = batch.run(jobs, tmp_path / "out", progress=False, models=models)
    assert (summary.ok, summary.failed) == (1, 0)
    record = json.loads((tmp_path / "out" / batch.MANIFEST).read_text().splitlines()[0])
    assert record["method"] == "toy" and record["status"] == "ok" and (tmp_path / "out" / record["output"]).is_file()


def test_a_pipeline_without_the_component_refuses_the_method(toy, target_dir):
    bare = SpeculativeARImagePipeline(transformer=load_checkpoint(LlamaGenModel, target_dir / "transformer"),
                                      vqvae=load_checkpoint(TinyVQModel, target_dir / "vqvae"))
    with pytest.raises(ValueError, match="it has no toy_head"):
        bare(class_labels=[0], method="toy")
    with pytest.raises(ValueError, match="components must be method components of 'ar-image' among "
                                         "draft_model, eagle_head, medusa_head, toy_head, got 'hydra_head'"):
        SpeculativeARImagePipeline(transformer=bare.transformer, vqvae=bare.vqvae, hydra_head=bare.vqvae)
    with pytest.raises(ValueError, match="toy_head"):  # bound to the target when the pipeline is built
        SpeculativeARImagePipeline(transformer=bare.transformer, vqvae=bare.vqvae,
                                   toy_head=toy.ToyBigramHead(vocab_size=7))
