"""``mmspec.serve``'s modality specs, without loading a model: every served kind is a registry
modality with methods, what it references resolves, and unknown kinds and bad specs are refused
naming what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from mmspec import methods, serve


def test_every_served_kind_is_a_registry_modality_and_its_references_resolve():
    from mmspec.commands.generate import GenerateCommand
    from mmspec.utils.refs import load_ref

    assert tuple(serve.SPECS) == ("ar-image", "vlm", "video", "continuous")  # the demo's tab order
    for kind, spec in serve.SPECS.items():
        assert spec is serve.spec(kind) and spec.kind == kind and methods.names(kind)
        assert isinstance(load_ref(spec.generate), GenerateCommand)
        for ref in (spec.slot_jobs, spec.device_check, spec.cost_target):
            assert ref is None or callable(load_ref(ref))
    assert [k for k, s in serve.SPECS.items() if s.slot_jobs] == ["ar-image", "vlm"]
    assert [k for k, s in serve.SPECS.items() if s.cost_target] == ["ar-image", "vlm", "continuous"]


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="kind must be one of 'ar-image', 'vlm', 'video', 'continuous', got 'image'"):
        serve.spec("image")
    spec = serve.spec("ar-image")
    with pytest.raises(ValueError, match="modality must be one of"):
        serve.register(dataclasses.replace(spec, kind="image"))
    with pytest.raises(ValueError, match="kind must be a modality not served yet, got 'ar-image'"):
        serve.register(spec)
    with pytest.raises(ValueError, match="demo_tab must be None, a function name in demos/app.py or a "
                                         "'module:function' string, got 'ar tab'"):
        dataclasses.replace(spec, demo_tab="ar tab")
    with pytest.raises(ValueError, match="per_job must be fields of job_fields"):
        dataclasses.replace(spec, per_job=("image",))
    with pytest.raises(ValueError, match="generate must be None or a 'module:attribute' string"):
        dataclasses.replace(spec, generate="mmspec.commands.generate.AR_IMAGE")
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


def test_references_load_what_they_name_and_refuse_what_is_not_one():
    from mmspec.utils.refs import is_ref, load_ref

    assert load_ref("mmspec.serve:spec") is serve.spec
    assert load_ref("mmspec.serve.base:ModalitySpec.load") is serve.ModalitySpec.load  # dotted attributes
    assert load_ref(serve.spec) is serve.spec  # anything else comes back as it is
    assert is_ref("a.b:c") and not is_ref("a.b.c") and not is_ref(3)
    with pytest.raises(ValueError, match="reference must be 'module:attribute', got 'mmspec.serve.spec'"):
        load_ref("mmspec.serve.spec")
    with pytest.raises(AttributeError):
        load_ref("mmspec.serve:no_such_name")


def test_a_components_timing_is_one_the_cost_bench_knows():
    assert methods.TIMINGS == ("tokens", "features", "heads", "span")
    assert {c.name: c.timing for c in methods.components("ar-image")} == {
        "draft_model": "tokens", "eagle_head": "features", "medusa_head": "heads"}
    assert methods.components("vlm")[0].timing == "span"
    with pytest.raises(ValueError, match="timing must be one of 'tokens', 'features', 'heads', 'span', got 'layers'"):
        methods.Component("x_head", "mmspec.models.eagle:EagleDraftHead", timing="layers")
