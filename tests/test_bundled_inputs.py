"""What runtime code reads from the saved artifacts instead of importing training code or a bench
(issue 48): the bundled held-out VLM scenes (``assets/vlm/scenes``) are what the VLM bench draws,
and the AR class prompts (the transformer config's ``id2label``) are the training data's; the
registry's training recipes name their ``train`` functions, imported when they run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

from mmspec import methods, serve
from mmspec.serve.base import ASSETS

SCENES = ASSETS / "vlm" / "scenes"


def test_bundled_scenes_are_the_benchs_held_out_scenes():
    from mmspec.bench.vlm import bench_prompts

    assert sorted(p.name for p in SCENES.iterdir()) == [f"{i:02d}.png" for i in range(16)]
    images, _ = bench_prompts(16)
    for i in range(16):
        drawn = (images[i].permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8)
        got = serve.scene(i)
        assert got.shape == (64, 64, 3) and got.dtype == np.uint8
        assert np.array_equal(got, drawn), i
    assert not np.array_equal(serve.scene(0), serve.scene(1))
    with pytest.raises(ValueError, match="scene must be an int in \\[0, 16\\), got 16"):
        serve.scene(16)


def test_the_scene_recipe_writes_the_bundled_files(tmp_path):
    from mmspec.training.recipes.vlm import save_heldout_scenes

    paths = save_heldout_scenes(tmp_path, count=3)
    assert [p.name for p in paths] == ["00.png", "01.png", "02.png"]
    for i, p in enumerate(paths):
        with PIL.Image.open(p) as im:
            assert im.mode == "RGB" and np.array_equal(np.asarray(im), serve.scene(i))


def test_ar_prompts_are_the_saved_labels_and_the_training_classes():
    from mmspec.training.data.shapes import CLASS_PROMPTS

    assert serve.ar_prompts() == tuple(CLASS_PROMPTS)
    assert serve.check_ar_prompt("  A Red   Circle ") == "a red circle"
    with pytest.raises(ValueError, match="prompt must be one of the class prompts: a red circle, a red square"):
        serve.check_ar_prompt("a purple circle")


def test_serving_and_the_registry_import_no_training_or_bench_code():
    """Importing the runtime (serving, pipelines, the method registry) and listing the registered
    recipes loads no module of ``mmspec.training`` or ``mmspec.bench`` (a fresh interpreter); nor
    do the served modalities' specs pull in the code they reference (the CLI, Gradio, the demo)."""
    code = ("import sys, mmspec.serve, mmspec.pipelines, mmspec.methods as m\n"
            "m.recipes(); mmspec.serve.ar_prompts(); mmspec.serve.scene(3)\n"
            "print(sorted(n for n in sys.modules if n.startswith(('mmspec.training', 'mmspec.bench', "
            "'mmspec.commands', 'gradio', 'demos'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registered_recipes_name_their_train_functions():
    from mmspec.training.recipes import registered

    for name, recipe in methods.recipes().items():
        assert isinstance(recipe.train, str) and recipe.train.startswith("mmspec.training.recipes.registered:")
        assert recipe.trainer() is getattr(registered, recipe.train.partition(":")[2]), name
    callable_recipe = methods.TrainingRecipe("ar-own", lambda out, **kw: {"x": 1.0}, "x")
    assert callable_recipe.trainer() is callable_recipe.train
    broken = methods.TrainingRecipe("ar-broken", "mmspec.training.recipes.registered:nope", "x")
    with pytest.raises(ValueError, match="recipe 'ar-broken': train names mmspec.training.recipes.registered:nope, "
                                         "which cannot be imported"):
        broken.trainer()
    with pytest.raises(ValueError, match="train must be a callable train\\(out_dir, \\*\\*options\\) -> dict or a "
                                         "'module:function' string, got 'not a name'"):
        methods.TrainingRecipe("ar-bad", "not a name", "x")
