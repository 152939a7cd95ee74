"""Bad input at every public entry point is refused early and clearly (issue 9).

One table per entry point: the two bundled pipelines (``assets/ar-image``, ``assets/vlm``), the
CLI (``generate``, ``bench``, ``train``, run in-process), the training recipes and pipeline
loading. Every case asserts

- the exact message fragment: the argument's name and the allowed values;
- that nothing was written: the test runs in ``tmp_path`` (also the working directory), whose
  recursive listing (names, sizes, mtimes) is the same after the call as before;
- that no model ran: for pipelines a forward-hook counter on every model component stays at 0
  (``test_the_hooks_see_a_real_call`` shows the counters do count); for the CLI, recipes and
  loading, the functions that would load a pipeline, data or a checkpoint are replaced by ones
  that fail the test if they are reached.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import DiffusionPipeline

from mmspec import commands, methods
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeVLMPipeline
from mmspec.training import recipes

ASSETS = Path(__file__).resolve().parents[1] / "assets"
AR_METHODS = ", ".join(repr(m) for m in methods.names("ar-image"))
VLM_METHODS = ", ".join(repr(m) for m in methods.names("vlm"))
SJD_KNOBS = ", ".join(sorted(methods.knobs("ar-image", "sjd")))
# the name and the allowed values, then the hint and the value (a list of generators may be allowed between)
GENERATOR = ("generator must be a torch.Generator or None",
             "for a seed, pass torch.Generator().manual_seed(seed), got 0")
IMAGE_FORMS = ("must be an RGB PIL image, an (H, W, 3) numpy array (uint8, or floats in [0, 1]) or a (3, H, W) "
               "float tensor in [0, 1]")


def listing(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """tmp_path as the working directory, with the inputs the cases name; yields the folder and
    checks afterwards that the call wrote nothing in it."""
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "not_an_image.png").write_text("not an image")
    (tmp_path / "empty_dir").mkdir()
    PIL.Image.new("RGB", (8, 8)).save(tmp_path / "image.png")
    vq = tmp_path / "vq"
    shutil.copytree(ASSETS / "ar-image" / "vqvae", vq)
    shutil.copytree(vq, tmp_path / "vq_no_config")
    (tmp_path / "vq_no_config" / "config.json").unlink()
    shutil.copytree(vq, tmp_path / "vq_truncated")
    cut(tmp_path / "vq_truncated" / "diffusion_pytorch_model.safetensors")
    target = tmp_path / "vlm_target"
    shutil.copytree(ASSETS / "vlm" / "target", target)
    shutil.copytree(target, tmp_path / "vlm_target_no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "vlm_target_no_tokenizer" / name).unlink()
    monkeypatch.chdir(tmp_path)
    before = listing(tmp_path)
    yield tmp_path
    assert listing(tmp_path) == before, "a refused call wrote or changed files"


def assert_fragments(err: BaseException, message) -> None:
    """``message``, or each fragment of a tuple of them, occurs in the error's text."""
    for fragment in (message,) if isinstance(message, str) else message:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"


def cut(file: Path) -> None:
    """Truncate a safetensors file to half its size (its header stays readable, its data does not)."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def forbid(monkeypatch, target, names):
    """Replace ``target.<name>`` for each name by a function that fails the test when reached."""
    for name in names:
        if hasattr(target, name):
            def reached(*args, _name=name, **kwargs):
                raise AssertionError(f"{target.__name__}.{_name} was reached: the input was not refused first")
            monkeypatch.setattr(target, name, reached)


# ---------------------------------------------------------------------------------------------
# Pipelines: every model component carries a forward-hook counter


def _hooked(pipe):
    """Every module of every model component records its component's name when it runs (the
    adapters call submodules, e.g. a VLM's base model and LM head, not always the top module)."""
    calls = []
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            for module in component.modules():
                module.register_forward_hook(lambda *a, _n=name: calls.append(_n))
    pipe.set_progress_bar_config(disable=True)
    return pipe, calls


@pytest.fixture(scope="module")
def ar_pipe():
    return _hooked(SpeculativeARImagePipeline.from_pretrained(ASSETS / "ar-image"))


@pytest.fixture(scope="module")
def vlm_pipe():
    return _hooked(SpeculativeVLMPipeline.from_pretrained(ASSETS / "vlm"))


def gen():
    return torch.Generator().manual_seed(0)


RGB = PIL.Image.new("RGB", (32, 32), (200, 40, 40))

AR_CASES = [
    ("seed int as generator", dict(generator=0), GENERATOR),
    ("generator list of the wrong length", dict(generator=[gen(), gen()]), "generator must be a torch.Generator"),
    ("empty prompt list", dict(prompt=[]),
     "prompt must be a non-empty string or a non-empty list of non-empty strings, got []"),
    ("blank prompt", dict(prompt=["a red circle", " "]), "prompt[1] must be a non-empty string, got ' '"),
    ("prompt of the wrong type", dict(prompt=[3]), "prompt[0] must be a non-empty string, got 3"),
    ("unknown class prompt", dict(prompt="a purple hexagon"),
     "prompt must be one of the class prompts: a red circle, a red square"),
    ("prompt and class_labels", dict(prompt="a red circle", class_labels=[0]),
     "prompt must be exactly one of prompt and class_labels"),
    ("class label out of range", dict(class_labels=[16]),
     "class_labels must be an int in [0, 16) or a non-empty list of them, got [16]"),
    ("bool class label", dict(class_labels=[True]), "class_labels must be an int in [0, 16)"),
    ("empty class_labels", dict(class_labels=[]), "class_labels must be an int in [0, 16)"),
    ("unknown method", dict(method="hydra"), f"method must be one of the ar-image methods ({AR_METHODS})"),
    ("method of the wrong type", dict(method=None), "method must be one of the ar-image methods"),
    ("composition the parts refuse", dict(method="gsd+lantern"), "method must be a composition with at most one rule"),
    ("knob of the wrong type", dict(method="sjd", method_knobs={"sjd_window": "16"}),
     "sjd_window must be an int >= 2, got '16'"),
    ("knob out of range", dict(method="zipar", method_knobs={"zipar_window": 17}), "zipar_window must be an int"),
    ("knob of another method", dict(method="sjd", method_knobs={"gsd_p_threshold": 0.1}),
     f"method_knobs must be knobs of 'sjd' (method knobs: {SJD_KNOBS})"),
    ("knobs not a mapping", dict(method="sjd", method_knobs=[("sjd_window", 4)]),
     "method_knobs must be a mapping of knob names to values (or None)"),
    ("temperature as a string", dict(temperature="1"), "temperature must be a number >= 0, got '1'"),
    ("negative temperature", dict(temperature=-0.5), "temperature must be a number >= 0, got -0.5"),
    ("nan temperature", dict(temperature=float("nan")), "temperature must be a number >= 0, got nan"),
    ("guidance_scale as a string", dict(guidance_scale="2"), "guidance_scale must be None or a number >= 0, got '2'"),
    ("float top_k", dict(top_k=2.5), "top_k must be None or an int >= 1, got 2.5"),
    ("top_p of 0", dict(top_p=0.0), "top_p must be None or a number in (0, 1], got 0.0"),
    ("bool num_images_per_prompt", dict(num_images_per_prompt=True),
     "num_images_per_prompt must be an int >= 1, got True"),
    ("zero num_images_per_prompt", dict(num_images_per_prompt=0), "num_images_per_prompt must be an int >= 1, got 0"),
    ("unknown output_type", dict(output_type="jpeg"),
     "output_type must be one of 'pil', 'np', 'pt', 'latent', got 'jpeg'"),
    ("return_dict as a string", dict(return_dict="no"), "return_dict must be True or False, got 'no'"),
    ("callback not callable", dict(callback_on_step_end=3), "callback_on_step_end must be None or a callable, got 3"),
]


@pytest.mark.parametrize("kwargs, message", [c[1:] for c in AR_CASES], ids=[c[0] for c in AR_CASES])
def test_ar_image_pipeline_refuses(ar_pipe, workdir, kwargs, message):
    pipe, calls = ar_pipe
    calls.clear()
    call = ({} if "prompt" in kwargs else {"class_labels": [0]}) | kwargs
    with pytest.raises(ValueError) as err:
        pipe(**call)
    assert_fragments(err.value, message)
    assert calls == []


VLM_CASES = [
    ("seed int as generator, sampled", dict(generator=0, temperature=1.0), GENERATOR),
    ("seed int as generator, greedy", dict(generator=0), GENERATOR),
    ("grey PIL image", dict(images=[RGB.convert("L")]),
     "images[0].mode must be 'RGB' (convert with image.convert('RGB')), got 'L'"),
    ("RGBA PIL image", dict(images=[RGB.convert("RGBA")]), "images[0].mode must be 'RGB'"),
    ("channels-first array", dict(images=[np.zeros((3, 32, 32), np.float32)]),
     "images[0].shape must be (H, W, 3) (channels last: transpose a (3, H, W) array with .transpose(1, 2, 0)), "
     "got (3, 32, 32)"),
    ("0-255 values as float array", dict(images=[np.full((32, 32, 3), 200.0, np.float32)]),
     "images[0] values must be floats in [0, 1] (divide 0-255 values by 255), got values in [200, 200]"),
    ("0-255 values as float tensor", dict(images=[torch.full((3, 32, 32), 255.0)]),
     "images[0] values must be floats in [0, 1]"),
    ("negative float values", dict(images=[np.full((32, 32, 3), -0.5)]), "images[0] values must be floats in [0, 1]"),
    ("int64 array", dict(images=[np.zeros((32, 32, 3), np.int64)]),
     "images[0].dtype must be uint8 or a float dtype, got 'int64'"),
    ("channels-last tensor", dict(images=[torch.zeros(32, 32, 3)]),
     "images[0].shape must be (3, H, W) (channels first"),
    ("uint8 tensor", dict(images=[torch.zeros(3, 32, 32, dtype=torch.uint8)]),
     "images[0].dtype must be a float dtype (values in [0, 1])"),
    ("a path instead of an image", dict(images=["scene.png"]), f"images[0] {IMAGE_FORMS}, got 'str'"),
    ("no images", dict(images=None), "images must be one image (or a list of images) per prompt (1), got None"),
    ("one image for two prompts", dict(prompts=["what ?", "where ?"]),
     "images must be one image (or a list of images) per prompt (2), got '1 images'"),
    ("empty prompt list", dict(images=[], prompts=[]),
     "prompts must be a non-empty string or a non-empty list of non-empty strings, got []"),
    ("prompt of the wrong type", dict(prompts=[3]), "prompts[0] must be a non-empty string, got 3"),
    ("blank prompt", dict(prompts="   "), "prompts must be a non-empty string"),
    ("unknown method", dict(method="hydra"), f"method must be one of the vlm methods ({VLM_METHODS})"),
    ("knob of the wrong type", dict(method="eagle", method_knobs={"tree_depth": "5"}),
     "tree_depth must be an int >= 1, got '5'"),
    ("float for an int knob", dict(method="eagle", method_knobs={"tree_depth": 2.5}),
     "tree_depth must be an int >= 1, got 2.5"),
    ("unknown knob", dict(method="eagle", method_knobs={"tree_width": 3}), "method_knobs must be knobs of 'eagle'"),
    ("knob of another method", dict(method="lookup", method_knobs={"tree_depth": 3}),
     "method_knobs must be knobs of 'lookup'"),
    ("float max_new_tokens", dict(max_new_tokens=3.0), "max_new_tokens must be an int >= 1, got 3.0"),
    ("zero max_new_tokens", dict(max_new_tokens=0), "max_new_tokens must be an int >= 1, got 0"),
    ("temperature as a string", dict(temperature="0"), "temperature must be None or a number >= 0, got '0'"),
    ("top_p as a string", dict(top_p="0.5"), "top_p must be None or a number in (0, 1], got '0.5'"),
    ("top_p above 1", dict(top_p=1.5), "top_p must be None or a number in (0, 1], got 1.5"),
    ("return_dict as an int", dict(return_dict=1), "return_dict must be True or False, got 1"),
]


@pytest.mark.parametrize("kwargs, message", [c[1:] for c in VLM_CASES], ids=[c[0] for c in VLM_CASES])
def test_vlm_pipeline_refuses(vlm_pipe, workdir, kwargs, message):
    pipe, calls = vlm_pipe
    calls.clear()
    call = dict(images=[RGB], prompts=["what is in the image ?"]) | kwargs
    with pytest.raises(ValueError) as err:
        pipe(**call)
    assert_fragments(err.value, message)
    assert calls == []


def test_the_hooks_see_a_real_call(ar_pipe, vlm_pipe):
    """The counters above would have counted: one valid call of each pipeline runs its models."""
    pipe, calls = vlm_pipe
    calls.clear()
    pipe(images=[np.full((32, 32, 3), 0.5)], prompts=["what is in the image ?"], max_new_tokens=2)
    assert "target" in calls
    pipe, calls = ar_pipe
    calls.clear()
    pipe(class_labels=[0], output_type="latent", generator=gen())
    assert calls.count("transformer") >= 2


# ---------------------------------------------------------------------------------------------
# CLI (generate, bench, train), in-process: one line on stderr, exit status 2 or 1, no traceback


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a pipeline, running a bench or a recipe fails the test when reached."""
    from mmspec.bench import continuous, core, cost, kernels, video
    from mmspec.pipelines import SpeculativeContinuousARPipeline, StreamingVideoPipeline

    for cls in (SpeculativeARImagePipeline, SpeculativeVLMPipeline, StreamingVideoPipeline,
                SpeculativeContinuousARPipeline):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("a pipeline loaded")))
    for bench in (core, video, kernels, continuous, cost):
        forbid(monkeypatch, bench, ["run"])
    forbid(monkeypatch, recipes, recipes.__all__)


VLM_ARGS = ["generate", "vlm", "--image", "image.png", "--prompt", "what ?"]
AR_ARGS = ["generate", "ar-image", "--prompt", "a red circle", "--out", "pngs"]
CLI_CASES = [
    ("--out names a file", ["generate", "ar-image", "--prompt", "a red circle", "--out", "a_file"],
     "mmspec generate ar-image", "argument --out: must be a folder, got the existing file 'a_file'"),
    ("--out under a file", ["generate", "ar-image", "--prompt", "a red circle", "--out", "a_file/pngs"],
     "mmspec generate ar-image", "argument --out: cannot create the folder 'a_file/pngs'"),
    ("--image missing", ["generate", "vlm", "--image", "missing.png", "--prompt", "what ?"],
     "mmspec generate vlm", "argument --image: no such file: 'missing.png'"),
    ("--image not an image", ["generate", "vlm", "--image", "not_an_image.png", "--prompt", "what ?"],
     "mmspec generate vlm", "argument --image: 'not_an_image.png' is not a readable image"),
    ("unknown ar-image method", AR_ARGS + ["--method", "hydra"],
     "mmspec generate ar-image", f"method must be one of the ar-image methods ({AR_METHODS})"),
    ("unknown vlm method", VLM_ARGS + ["--method", "hydra"],
     "mmspec generate vlm", "argument --method: invalid choice: 'hydra' (choose from"),
    ("knob value of the wrong type", AR_ARGS + ["--method", "sjd", "--knob", "sjd_window=abc"],
     "mmspec generate ar-image", "sjd_window must be an int >= 2, got 'abc'"),
    ("knob out of range", VLM_ARGS + ["--method", "eagle", "--knob", "tree_depth=0"],
     "mmspec generate vlm", "tree_depth must be an int >= 1, got 0"),
    ("unknown knob", AR_ARGS + ["--method", "sjd", "--knob", "zipar_window=4"],
     "mmspec generate ar-image", f"method_knobs must be knobs of 'sjd' (method knobs: {SJD_KNOBS})"),
    ("knob without a value", AR_ARGS + ["--method", "sjd", "--knob", "sjd_window"],
     "mmspec generate ar-image", "--knob must be KEY=VALUE, got 'sjd_window'"),
    ("negative temperature", AR_ARGS + ["--temperature", "-1"],
     "mmspec generate ar-image", "argument --temperature: must be a number >= 0, got -1.0"),
    ("top-p above 1", VLM_ARGS + ["--top-p", "1.5"],
     "mmspec generate vlm", "argument --top-p: must be a number in (0, 1], got 1.5"),
    ("max-new-tokens not an int", VLM_ARGS + ["--max-new-tokens", "ten"],
     "mmspec generate vlm", "argument --max-new-tokens: must be an int >= 1, got 'ten'"),
    ("blank prompt", ["generate", "vlm", "--image", "image.png", "--prompt", " "],
     "mmspec generate vlm", "argument --prompt: must be a non-empty text"),
    ("--model not a folder", AR_ARGS + ["--model", "missing_dir"],
     "mmspec generate ar-image", "argument --model: no such folder: 'missing_dir'"),
    ("unknown bench", ["bench", "audio"],
     "mmspec bench", "argument name: invalid choice: 'audio' (choose from 'core', 'ar-image', 'vlm', 'adapt', 'video', 'kernels', 'continuous', 'cost', 'auto', 'serve', 'compile', 'glm-image')"),
    ("bench --json names a folder", ["bench", "core", "--json", "empty_dir"],
     "mmspec bench", "argument --json: must be a file path, got the existing folder 'empty_dir'"),
    ("bench --json under a file", ["bench", "core", "--json", "a_file/core.json"],
     "mmspec bench", "argument --json: cannot write 'a_file/core.json'"),
    ("bench --pipeline for core", ["bench", "core", "--pipeline", "empty_dir"],
     "mmspec bench", "--pipeline is for 'bench vlm' and 'bench video' and 'bench adapt' and 'bench cost' only, got "
                     "'bench core'"),
    ("bench --pipeline missing", ["bench", "vlm", "--pipeline", "missing_dir"],
     "mmspec bench", "argument --pipeline: no such folder: 'missing_dir'"),
    ("bench --threads 0", ["bench", "core", "--threads", "0"],
     "mmspec bench", "argument --threads: must be an int >= 1, got 0"),
    ("bench --gpu-curve for vlm", ["bench", "vlm", "--gpu-curve", "a_file"],
     "mmspec bench", "--gpu-curve is for 'bench cost' only, got 'bench vlm'"),
    ("bench --gpu-curve missing", ["bench", "cost", "--gpu-curve", "missing.json"],
     "mmspec bench", "argument --gpu-curve: no such file: 'missing.json'"),
    ("bench --gpu-curve not JSON", ["bench", "cost", "--gpu-curve", "a_file"],
     "mmspec bench", "--gpu-curve must be a readable JSON file, got 'a_file'"),
    ("bench --calibrate for vlm", ["bench", "vlm", "--calibrate"],
     "mmspec bench", "--calibrate is for 'bench cost' and 'bench auto' only, got 'bench vlm'"),
    ("bench cost --quality without --calibrate", ["bench", "cost", "--quality", "a_file"],
     "mmspec bench", "--quality is for 'bench cost --calibrate' only (a profile), got 'bench cost'"),
    ("bench cost --calibrate --gpu-curve", ["bench", "cost", "--calibrate", "--gpu-curve", "a_file"],
     "mmspec bench", "--gpu-curve is for 'bench cost' without --calibrate (a projection, not a profile)"),
    ("bench cost --calibrate --profile-out, two targets", ["bench", "cost", "--calibrate", "--profile-out", "p.json"],
     "mmspec bench", "--profile-out and --pipeline name one pipeline: give one --target with them"),
    ("bench --target for core", ["bench", "core", "--target", "vlm"],
     "mmspec bench", "--target is for 'bench cost' and 'bench auto' only, got 'bench core'"),
    ("generate continuous --method auto, bad quality", ["generate", "continuous", "--prompt", "a red circle", "--out",
                                                        "imgs", "--method", "auto", "--knob", "auto_quality=any"],
     "mmspec generate continuous", "auto_quality must be"),
    ("train --out names a file", ["train", "vq", "--out", "a_file"],
     "mmspec train vq", "argument --out: must be a folder, got the existing file 'a_file'"),
    ("train --steps 0", ["train", "vq", "--out", "ckpt", "--steps", "0"],
     "mmspec train vq", "argument --steps: must be an int >= 1, got 0"),
    ("train --lr nan", ["train", "vq", "--out", "ckpt", "--lr", "nan"],
     "mmspec train vq", "argument --lr: must be a number > 0, got nan"),
    ("train unknown vlm-draft method", ["train", "vlm-draft", "--method", "hydra", "--target", "vlm_target",
                                        "--out", "ckpt"],
     "mmspec train vlm-draft",
     "argument --method: invalid choice: 'hydra' (choose from 'eagle', 'specvlm', 'vispec', 'medusa')"),
    ("--heads for an EAGLE head", ["train", "vlm-draft", "--method", "eagle", "--heads", "6", "--target", "vlm_target",
                                   "--out", "ckpt"],
     "mmspec train vlm-draft", "--heads is for --method medusa only, got --method eagle"),
    ("eagle draft without --target", ["train", "ar-draft", "--kind", "eagle", "--vq", "vq", "--out", "ckpt"],
     "mmspec train ar-draft", "--kind eagle needs --target DIR (the AR model it drafts for)"),
    ("no command", [], "mmspec", "the following arguments are required: command"),
]


@pytest.mark.parametrize("argv, prog, message", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_before_loading(workdir, no_loading, capsys, argv, prog, message):
    with pytest.raises(SystemExit) as exit_:
        commands.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: ") and message in lines[0], lines[0]


RUNTIME_CASES = [
    ("class prompt the model does not know", AR_ARGS + ["--prompt", "a purple hexagon", "--quiet"],
     "mmspec generate ar-image", "prompt must be one of the class prompts: a red circle"),
    ("--model without model_index.json", AR_ARGS + ["--model", "empty_dir", "--quiet"],
     "mmspec generate ar-image", "pipeline: missing empty_dir/model_index.json"),
    ("recipe given a VQ folder without its config",
     ["train", "ar-image", "--vq", "vq_no_config", "--out", "ckpt", "--threads", "1"],
     "mmspec train ar-image", "vq_dir must be a folder saved by TinyVQModel.save_pretrained (e.g. by train_vq), "
                              "got 'vq_no_config'"),
    ("recipe given a truncated VQ checkpoint",
     ["train", "ar-image", "--vq", "vq_truncated", "--out", "ckpt", "--threads", "1"],
     "mmspec train ar-image", "vq_dir: vq_truncated/diffusion_pytorch_model.safetensors is not a readable safetensors "
                              "file (Error while deserializing header: incomplete metadata, file not fully covered)"),
]


@pytest.mark.parametrize("argv, prog, message", [c[1:] for c in RUNTIME_CASES], ids=[c[0] for c in RUNTIME_CASES])
def test_cli_runtime_errors_are_one_line(workdir, monkeypatch, capsys, argv, prog, message):
    """Errors found while running (a prompt the model's classes lack, a corrupt input folder):
    exit status 1, one error line, nothing written; recipes never reach their data."""
    for module in (recipes.ar_image, recipes.ar_draft, recipes.vq):
        forbid(monkeypatch, module, ["load_checkpoint", "stack", "token_data"])
    with pytest.raises(SystemExit) as exit_:
        commands.main(argv)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]  # diffusers' loading bar may precede it
    assert len(errors) == 1 and errors[0].startswith(f"{prog}: error: ") and message in errors[0], err


# ---------------------------------------------------------------------------------------------
# Recipes (Python): arguments and input folders checked before any data or model loads

TINY = dict(steps=1, batch_size=2, lr=1e-3, dataset_size=2, log=lambda msg: None)
RECIPE_CASES = [
    ("out_dir names a file", "vq", dict(out_dir="a_file"),
     "out_dir must be a folder path (not an existing file), got 'a_file'"),
    ("out_dir not a path", "vq", dict(out_dir=3), "out_dir must be a folder path, got 3"),
    ("zero steps", "vq", dict(steps=0), "steps must be an int >= 1, got 0"),
    ("steps as a string", "vq", dict(steps="10"), "steps must be an int >= 1, got '10'"),
    ("bool batch_size", "vq", dict(batch_size=True), "batch_size must be an int >= 1, got True"),
    ("lr as a string", "vq", dict(lr="1e-3"), "lr must be a number > 0, got '1e-3'"),
    ("infinite lr", "vq", dict(lr=float("inf")), "lr must be a number > 0, got inf"),
    ("negative seed", "vq", dict(seed=-1), "seed must be an int >= 0, got -1"),
    ("dataset smaller than a batch", "vq", dict(dataset_size=1),
     "dataset_size must be an int >= batch_size (2), got 1"),
    ("log not callable", "vq", dict(log="stdout"), "log must be a callable taking one str (e.g. print), got 'stdout'"),
    ("negative warmup", "ar-image", dict(vq_dir="vq", warmup=-1), "warmup must be an int >= 0, got -1"),
    ("missing vq_dir", "ar-image", dict(vq_dir="missing"),
     "vq_dir must be a folder saved by TinyVQModel.save_pretrained (e.g. by train_vq), got 'missing'"),
    ("vq_dir without config.json", "ar-image", dict(vq_dir="vq_no_config"),
     "vq_dir must be a folder saved by TinyVQModel.save_pretrained (e.g. by train_vq), got 'vq_no_config'"),
    ("truncated VQ weights", "ar-image", dict(vq_dir="vq_truncated"),
     "vq_dir: vq_truncated/diffusion_pytorch_model.safetensors is not a readable safetensors file"),
    ("derived model_config keys", "ar-image", dict(vq_dir="vq", model_config={"vocab_size": 7}),
     "model_config must be free of vocab_size"),
    ("unknown draft kind", "ar-draft", dict(kind="hydra", vq_dir="vq"),
     "kind must be one of 'eagle', 'medusa', 'chain', got 'hydra'"),
    ("eagle draft without a target", "ar-draft", dict(kind="eagle", vq_dir="vq"), "target_dir must be the folder"),
    ("truncated VQ for a classifier", "classifier", dict(vq_dir="vq_truncated"),
     "vq_dir: vq_truncated/diffusion_pytorch_model.safetensors is not a readable safetensors file"),
    ("unknown VLM size", "vlm", dict(size="huge"), "size must be one of 'target', 'draft', got 'huge'"),
    ("unknown VLM draft method", "vlm-draft", dict(method="hydra", target_dir="vlm_target"),
     "method must be one of 'eagle', 'specvlm', 'vispec', 'medusa', got 'hydra'"),
    ("VLM target without its tokenizer", "vlm-draft", dict(method="eagle", target_dir="vlm_target_no_tokenizer"),
     "target_dir must be a transformers VLM folder with its processor (LLaVA, Qwen2-VL, Qwen2.5-VL; e.g. written by "
     "'mmspec train vlm') (with tokenizer.json or tokenizer_config.json)"),
]
RECIPES = {"vq": recipes.train_vq, "ar-image": recipes.train_ar_image, "ar-draft": recipes.train_ar_draft,
           "classifier": recipes.train_classifier, "vlm": recipes.train_vlm, "vlm-draft": recipes.train_vlm_draft}
# what a recipe would load: each is replaced by a test failure
LOADERS = ["load_checkpoint", "stack", "token_data", "ShapesDataset", "SceneQADataset", "TinyVQModel", "load_target",
           "build_processor", "new_llava", "LlamaGenModel", "ShapesClassifier"]


@pytest.mark.parametrize("recipe, kwargs, message", [c[1:] for c in RECIPE_CASES], ids=[c[0] for c in RECIPE_CASES])
def test_recipes_refuse_before_loading(workdir, monkeypatch, recipe, kwargs, message):
    for module in (recipes.vq, recipes.ar_image, recipes.ar_draft, recipes.classifier, recipes.vlm,
                   recipes.vlm_draft):
        forbid(monkeypatch, module, LOADERS)
    call = TINY | {"out_dir": "ckpt"} | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        RECIPES[recipe](call.pop("out_dir"), **call)


# ---------------------------------------------------------------------------------------------
# Loading: a pipeline folder is checked before anything in it is built


def _vlm_copy(root: Path) -> Path:
    folder = root / "vlm_copy"
    shutil.copytree(ASSETS / "vlm", folder)
    return folder


def _ar_copy(root: Path) -> Path:
    folder = root / "ar_copy"
    shutil.copytree(ASSETS / "ar-image", folder)
    return folder


def _no_config(root):
    folder = _vlm_copy(root)
    (folder / "target" / "config.json").unlink()
    return SpeculativeVLMPipeline, folder


def _truncated(root):
    folder = _vlm_copy(root)
    cut(folder / "eagle_head" / "diffusion_pytorch_model.safetensors")
    return SpeculativeVLMPipeline, folder


def _garbage_weights(root):
    folder = _ar_copy(root)
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 64)
    return SpeculativeARImagePipeline, folder


def _bin_weights(root):
    folder = _ar_copy(root)
    weights = folder / "vqvae" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_name("diffusion_pytorch_model.bin"))
    return SpeculativeARImagePipeline, folder


def _no_index(root):
    folder = _ar_copy(root)
    (folder / "model_index.json").unlink()
    return SpeculativeARImagePipeline, folder


def _bad_index(root):
    folder = _ar_copy(root)
    (folder / "model_index.json").write_text('{"transformer": ')
    return SpeculativeARImagePipeline, folder


def _index_missing_required(root):
    folder = _ar_copy(root)
    index = (folder / "model_index.json").read_text()
    (folder / "model_index.json").write_text(index.replace('"vqvae"', '"vq_model"'))
    return SpeculativeARImagePipeline, folder


def _other_pipeline(root):
    return SpeculativeVLMPipeline, _ar_copy(root)


def _no_component_folder(root):
    folder = _ar_copy(root)
    shutil.rmtree(folder / "eagle_head")
    return SpeculativeARImagePipeline, folder


def _no_tokenizer(root):
    folder = _vlm_copy(root)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / "processor" / name).unlink()
    return SpeculativeVLMPipeline, folder


def _default_config(root):
    folder = _vlm_copy(root)
    (folder / "target" / "config.json").write_text("{}")  # transformers' default LlavaConfig: 7B parameters
    return SpeculativeVLMPipeline, folder


def _bad_config_json(root):
    folder = _vlm_copy(root)
    (folder / "vispec_head" / "config.json").write_text("[1, 2")
    return SpeculativeVLMPipeline, folder


LOADING_CASES = [
    ("missing folder", lambda root: (SpeculativeARImagePipeline, root / "nowhere"), FileNotFoundError,
     "pretrained_model_name_or_path: no such folder"),
    ("not a path", lambda root: (SpeculativeARImagePipeline, 3), ValueError,
     "pretrained_model_name_or_path must be a path to a pipeline folder, got 3"),
    ("no model_index.json", _no_index, FileNotFoundError, "pipeline: missing {root}/ar_copy/model_index.json"),
    ("model_index.json not JSON", _bad_index, ValueError,
     "pipeline: {root}/ar_copy/model_index.json is not valid JSON"),
    ("a required component not named", _index_missing_required, ValueError, "model_index.json names vq_model, which "
     "SpeculativeARImagePipeline does not take (its components: transformer, vqvae, draft_model, eagle_head, medusa_head)"),
    ("a folder of another pipeline", _other_pipeline, ValueError,
     "names transformer, vqvae, which SpeculativeVLMPipeline does not take"),
    ("component folder without config.json", _no_config, FileNotFoundError,
     "target: missing {root}/vlm_copy/target/config.json (the component's config)"),
    ("config.json not JSON", _bad_config_json, ValueError,
     "vispec_head: {root}/vlm_copy/vispec_head/config.json is not valid JSON"),
    ("config.json of a default-size model", _default_config, ValueError,
     "target: {root}/vlm_copy/target/config.json describes a LlavaForConditionalGeneration of 7,062,902,784 "
     "parameters but its weights hold 2,932,800 values"),
    ("truncated safetensors", _truncated, ValueError,
     "eagle_head: {root}/vlm_copy/eagle_head/diffusion_pytorch_model.safetensors is not a readable safetensors file "
     "(Error while deserializing header: incomplete metadata, file not fully covered)"),
    ("garbage safetensors", _garbage_weights, ValueError,
     "transformer: {root}/ar_copy/transformer/diffusion_pytorch_model.safetensors is not a readable safetensors file"),
    ("weights not in safetensors", _bin_weights, FileNotFoundError,
     "vqvae: no *.safetensors weights in {root}/ar_copy/vqvae (found diffusion_pytorch_model.bin: only safetensors "
     "weights are loaded)"),
    ("component folder missing", _no_component_folder, FileNotFoundError,
     "eagle_head: missing folder {root}/ar_copy/eagle_head (model_index.json names this component)"),
    ("processor without tokenizer files", _no_tokenizer, FileNotFoundError,
     "processor: {root}/vlm_copy/processor has none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
     "vocab.json (a LlavaProcessor is loaded from them)"),
]


@pytest.mark.parametrize("make, error, message", [c[1:] for c in LOADING_CASES], ids=[c[0] for c in LOADING_CASES])
def test_loading_refuses_before_building(tmp_path, monkeypatch, make, error, message):
    root = tmp_path / "inputs"
    root.mkdir()
    cls, folder = make(root)
    monkeypatch.setattr(DiffusionPipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("diffusers' loader was reached")))
    before = listing(tmp_path)
    with pytest.raises(error, match=re.escape(message.format(root=root))):
        cls.from_pretrained(folder)
    assert listing(tmp_path) == before


def test_the_table_holds_at_least_40_cases():
    assert len(AR_CASES) + len(VLM_CASES) + len(CLI_CASES) + len(RUNTIME_CASES) + len(RECIPE_CASES) \
        + len(LOADING_CASES) >= 40



def test_the_cli_guards_are_reached_by_valid_input(workdir, no_loading):
    """The stand-ins do fail a call that gets past validation: valid arguments reach them."""
    with pytest.raises(pytest.fail.Exception, match="a pipeline loaded"):
        commands.main(AR_ARGS + ["--quiet"])
    with pytest.raises(AssertionError, match="was reached"):
        commands.main(["train", "vq", "--out", "ckpt", "--threads", "1"])


def test_the_recipe_guards_are_reached_by_valid_input(workdir, monkeypatch):
    forbid(monkeypatch, recipes.ar_image, LOADERS)
    with pytest.raises(AssertionError, match="load_checkpoint was reached"):
        recipes.train_ar_image("ckpt", vq_dir="vq", **TINY)


def test_the_loading_guard_is_reached_by_a_valid_folder(monkeypatch):
    monkeypatch.setattr(DiffusionPipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("diffusers' loader was reached")))
    with pytest.raises(pytest.fail.Exception, match="diffusers' loader was reached"):
        SpeculativeVLMPipeline.from_pretrained(ASSETS / "vlm")
