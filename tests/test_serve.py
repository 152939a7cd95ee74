"""``mmspec.serve``'s registry of runners, without loading a model: every batch job kind has a
runner for a registry modality, and unknown kinds are refused naming the known ones."""

from __future__ import annotations

import pytest

from mmspec import batch, methods, serve


def test_every_job_kind_has_a_runner_of_its_modality():
    assert set(serve.RUNNERS) == set(batch.KIND_SPECS)
    for kind, runner in serve.RUNNERS.items():
        assert runner is serve.runner(kind) and runner.kind == kind and methods.names(kind)
        assert runner.batchable is batch.KIND_SPECS[kind].batchable


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="kind must be one of 'ar-image', 'continuous', 'video', 'vlm', got 'image'"):
        serve.runner("image")
    with pytest.raises(ValueError, match="modality must be one of"):
        serve.base.register(serve.Runner("image", "SpeculativeARImagePipeline", serve.ar_batchable, serve.run_ar))
    with pytest.raises(ValueError, match="kind must be one of"):
        serve.Models("/nonexistent").pipeline("image")  # refused before any folder is read


def test_open_image_reads_a_file_or_says_why_not(tmp_path):
    import PIL.Image

    PIL.Image.fromarray(serve.scene(0)).convert("RGBA").save(tmp_path / "scene.png")
    assert (serve.open_image(tmp_path / "scene.png") == serve.scene(0)).all()  # RGBA read as RGB
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="image must be a readable image file, got '.*notes.png'"):
        serve.open_image(tmp_path / "notes.png")
    PIL.Image.new("RGB", (8, 8)).save(tmp_path / "tiny.png")
    with pytest.raises(ValueError, match="image must be at least 16 x 16 pixels"):
        serve.open_image(tmp_path / "tiny.png")
