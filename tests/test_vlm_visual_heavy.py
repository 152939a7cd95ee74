"""The visual-heavy VLM (issue 47): a higher-resolution target by warm start, SpecVLM's gate
overridden per call (``specvlm_branch`` / ``specvlm_ratio``), the pipeline's phase timing and
``mmspec bench vlm --scenario visual-heavy``.

- ``resize_vision`` at the same resolution is the model itself (equal logits); at a higher one the
  vision tower reads ``(R / 8)^2`` patches, its CLS position is kept and a constant position grid
  stays constant (bicubic resampling of the patch positions).
- ``train_vlm(resolution=, init=)`` fine-tunes the saved model (its language model unchanged at a
  negligible learning rate) and records the resolution, image tokens and short-answer accuracies.
- Forced SpecVLM branches keep the visual tokens their ratio says and stay lossless on the bundled
  pipeline; bad combinations are refused naming the knob.
- Phase timing fills ``stats["seconds"]`` with every phase, inside the call's wall time.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmspec.models.vlm import image_tokens, new_llava, resize_vision
from mmspec.training.data.scene_qa import vocabulary


def _vision(model, pixels):
    return model.model.get_image_features(pixel_values=pixels, vision_feature_layer=-1,
                                          vision_feature_select_strategy="default", return_dict=True).pooler_output


def test_resize_vision_at_the_same_resolution_is_the_model():
    torch.manual_seed(0)
    model = new_llava(vocabulary(), "draft").eval()
    same = resize_vision(model, 64).eval()
    pixels = torch.rand(2, 3, 64, 64) * 2 - 1
    with torch.no_grad():
        assert torch.equal(torch.cat(list(_vision(model, pixels))), torch.cat(list(_vision(same, pixels))))


def test_resize_vision_reads_more_patches():
    torch.manual_seed(0)
    model = new_llava(vocabulary(), "draft").eval()
    key = "model.vision_tower.embeddings.position_embedding.weight"
    state = model.state_dict()
    with torch.no_grad():
        model.get_parameter(key)[1:] = 0.25  # a constant grid resamples to the same constant
    big = resize_vision(model, 128).eval()
    new = big.get_parameter(key)
    assert new.shape[0] == 1 + image_tokens(128) == 257
    assert torch.equal(new[0], state[key][0]) and torch.allclose(new[1:], torch.full_like(new[1:], 0.25))
    with torch.no_grad():
        feats = _vision(big, torch.rand(1, 3, 128, 128))
    assert feats[0].shape[0] == 256
    for name, value in big.state_dict().items():  # every other weight is the model's
        if name != key and not name.endswith("position_ids"):
            assert torch.equal(value, model.state_dict()[name]), name
    with pytest.raises(ValueError, match="resolution"):
        resize_vision(model, 100)


def test_fine_tune_at_a_higher_resolution_starts_from_init(tmp_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec.models.vlm import build_processor
    from mmspec.training.recipes import train_vlm

    torch.manual_seed(0)
    init = tmp_path / "init"
    start = new_llava(vocabulary(), "draft")
    start.save_pretrained(init)
    build_processor(vocabulary()).save_pretrained(init)
    record = train_vlm(tmp_path / "hd", size="draft", steps=1, batch_size=2, lr=1e-12, dataset_size=4,
                       heldout_size=2, warmup=1, resolution=128, init=init, log=lambda m: None)
    assert record["resolution"] == 128 and record["image_tokens"] == 256 and record["init"] == str(init)
    assert 0 <= record["short_answer_accuracy"] <= 1 and 0 <= record["shuffled_image_accuracy"] <= 1
    model = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hd")
    assert model.config.vision_config.image_size == 128
    assert AutoProcessor.from_pretrained(tmp_path / "hd").image_processor.crop_size["height"] == 128
    lm, lm0 = model.model.language_model.state_dict(), start.model.language_model.state_dict()
    assert all(torch.allclose(lm[k].float(), lm0[k].half().float()) for k in lm0)  # fp16 save of init's
    with pytest.raises(ValueError, match="init"):
        train_vlm(tmp_path / "x", size="draft", steps=1, batch_size=2, lr=1e-3, dataset_size=4, init=tmp_path / "no")


@pytest.fixture(scope="module")
def pipe(bundled_vlm_pipe):
    return bundled_vlm_pipe


@pytest.fixture(scope="module")
def scenes():
    from mmspec.bench.vlm import bench_prompts

    return bench_prompts(2)


@pytest.mark.parametrize("branch,ratio,kept", [("pool", 4, 16), ("pool", 64, 1), ("prune", 4, 16), ("prune", 64, 1),
                                                ("conv", 0, 16), ("resampler", 0, 2), ("text", 0, 0)])
def test_forced_branches_keep_what_their_ratio_says(pipe, branch, ratio, kept):
    from mmspec.adapters.vlm import VLMTarget

    head = pipe.specvlm_head.bind(VLMTarget(pipe.target)).compressed(branch, ratio)
    image = torch.randn(64, head.config.hidden_size)
    out, choice = head.compressor(image, torch.zeros(head.config.hidden_size), False, branch, ratio)
    assert len(out) == kept and choice == ("prune", "pool", "conv", "resampler", "text").index(branch)


@pytest.mark.parametrize("knobs", [{"specvlm_branch": "pool", "specvlm_ratio": 64},
                                   {"specvlm_branch": "prune", "specvlm_ratio": 8},
                                   {"specvlm_branch": "text"}])
def test_forced_branches_are_lossless(pipe, scenes, knobs):
    images, prompts = scenes
    ref = pipe(images=images, prompts=prompts, method="none", max_new_tokens=24)
    out = pipe(images=images, prompts=prompts, method="specvlm", max_new_tokens=24, method_knobs=knobs)
    assert out.tokens == ref.tokens


@pytest.mark.parametrize("knobs,match", [({"specvlm_branch": "conv", "specvlm_ratio": 16}, "specvlm_ratio"),
                                         ({"specvlm_branch": "pool", "specvlm_ratio": 8}, "square"),
                                         ({"specvlm_branch": "zoom"}, "specvlm_branch"),
                                         ({"specvlm_ratio": -1}, "specvlm_ratio")])
def test_bad_overrides_are_refused(pipe, scenes, knobs, match):
    images, prompts = scenes
    with pytest.raises(ValueError, match=match):
        pipe(images=images, prompts=prompts, method="specvlm", max_new_tokens=4, method_knobs=knobs)


def test_a_head_without_the_compressor_refuses_a_branch(pipe):
    with pytest.raises(ValueError, match="branch"):
        pipe.eagle_head.compressed("pool", 16)
    assert pipe.eagle_head.compressed() is pipe.eagle_head


def test_phase_timing_fills_every_phase_inside_the_wall_time(pipe, scenes):
    from mmspec.core.stats import PHASES

    images, prompts = scenes
    assert "seconds" not in pipe(images=images[:1], prompts=prompts[:1], method="eagle", max_new_tokens=8).stats
    pipe.enable_phase_timing()
    try:
        stats = pipe(images=images[:1], prompts=prompts[:1], method="eagle", max_new_tokens=8).stats
    finally:
        pipe.enable_phase_timing(False)
    assert set(stats["seconds"]) == set(PHASES) and all(v > 0 for v in stats["seconds"].values())
    assert sum(stats["seconds"].values()) <= stats["wall_seconds"]
    with pytest.raises(ValueError, match="on"):
        pipe.enable_phase_timing("yes")


def test_visual_heavy_scenario_runs_on_the_bundled_192px_vlm():
    from mmspec.bench import vlm

    rows = ("none", "eagle", "specvlm", vlm._forced("pool", 64), "vispec", "medusa")
    result = vlm.run(vlm.VLMBenchConfig(scenario="visual-heavy", prompts=1, max_new_tokens=8, rows=rows))
    assert result["setup"]["image_tokens"] == 576 and result["setup"]["resolution"] == 192
    by = {r["method"]: r for r in result["rows"]}
    assert all(r["greedy_identical"] is True for r in result["rows"])
    assert by["eagle"]["visual_tokens_kept"] == 576 and by["specvlm-pool64"]["visual_tokens_kept"] == 9
    assert by["vispec"]["visual_tokens_kept"] == 1 and by["medusa"]["visual_tokens_kept"] is None
    assert sum(int(n) for n in by["specvlm"]["gate_choices"].split()[1::2]) == 1
    assert all(by[m]["draft_ms_per_pass"] > 0 and by[m]["verify_ms_per_pass"] > 0
               for m in ("eagle", "specvlm", "specvlm-pool64", "vispec", "medusa"))
    assert all(by[m]["prefill_ms_per_prompt"] > 0 and by[m]["decode_ms_per_prompt"] > 0 for m in by)
    assert by["none"]["decode_speedup"] == 1.0
    seconds = by["none"]["seconds"]  # one prompt; the bound is its time over its time outside the decode
    assert 1 < result["setup"]["wall_speedup_bound"] == pytest.approx(
        seconds / (seconds - by["none"]["decode_ms_per_prompt"] / 1e3))
    json.dumps(result)
    with pytest.raises(ValueError, match="scenario"):
        vlm.VLMBenchConfig(scenario="video")


def test_several_images_per_prompt_multiply_the_visual_tokens():
    """``--images-per-prompt 2``: each prompt holds two held-out scenes (1,152 visual tokens); the
    per-image count is still reported, the rows stay exact, and the stream scenario refuses it."""
    from mmspec.bench import vlm

    rows = ("none", "eagle", vlm._forced("prune", 16))
    result = vlm.run(vlm.VLMBenchConfig(scenario="visual-heavy", prompts=1, max_new_tokens=8, rows=rows,
                                        images_per_prompt=2))
    setup = result["setup"]
    assert setup["images_per_prompt"] == 2 and setup["image_tokens"] == 576
    assert all(r["greedy_identical"] is True for r in result["rows"])
    assert {r["method"]: r["visual_tokens_kept"] for r in result["rows"]} == {
        "none": None, "eagle": 576, "specvlm-prune16": 36}
    with pytest.raises(ValueError, match="images_per_prompt must be 1 for the stream scenario"):
        vlm.VLMBenchConfig(scenario="stream", images_per_prompt=2)
    with pytest.raises(ValueError, match="images_per_prompt must be an int >= 1"):
        vlm.VLMBenchConfig(images_per_prompt=0)


def test_stream_scenario_reports_latency_against_a_control():
    """``--scenario stream`` at 5 rounds: every row's answers checked exact, the control's series
    and each row's slope against it reported, the cache of one size, and the series as long as
    the rounds."""
    from mmspec.bench import vlm

    result = vlm.run(vlm.VLMBenchConfig(scenario="stream", frames=20, rows=("none", "eagle"), check_every=2,
                                        stream_new_tokens=8))
    setup, by = result["setup"], {r["method"]: r for r in result["rows"]}
    assert by["eagle"]["exact"] is True and by["eagle"]["checked"] == 3 and by["none"]["exact"] is None
    assert all(r["answers"] == 5 and r["slope_vs_control_pct"] is not None and r["control_ms_first_10pct"] > 0
               for r in result["rows"])
    series = setup["series"]
    assert series["frames"] == [4, 8, 12, 16, 20] and setup["trimmed_mb_start"] > 0
    assert all(len(series[k]) == 5 for k in ("resident_mb", "ms_none", "ms_eagle", "ms_control_none",
                                             "ms_control_eagle"))
    json.dumps(result)


# -- several images per prompt in the recipes (the target asked about the last) ------------------

def test_scene_items_with_several_images_ask_about_the_last():
    """``SceneQADataset(images=3)``: item ``i`` holds 1 to 3 images (every count occurs over 24
    items), the last is ``images=1``'s item ``i`` with the same question and answer, and the earlier
    ones are other scenes; ``images=0`` is refused naming ``images``."""
    from mmspec.training.data.scene_qa import SceneQADataset

    one, three = SceneQADataset(24, 3, 32), SceneQADataset(24, 3, 32, images=3)
    counts = set()
    for i in range(24):
        image, question, answer = one[i]
        stack, q3, a3 = three[i]
        assert stack.shape[1:] == image.shape and 1 <= len(stack) <= 3
        assert torch.equal(stack[-1], image) and (q3, a3) == (question, answer)
        assert all(not torch.equal(earlier, image) for earlier in stack[:-1])
        counts.add(len(stack))
    assert counts == {1, 2, 3}
    with pytest.raises(ValueError, match="images"):
        SceneQADataset(4, 0, images=0)


def test_training_frame_of_several_images_is_the_pipelines(bundled_vlm_pipe):
    """``encode`` writes a k-image item as the pipeline's chat template writes a prompt with those k
    images (the same ids), with its k images' pixels in order."""
    from mmspec.training.data.scene_qa import SceneQADataset
    from mmspec.training.recipes.vlm import encode

    pipe = bundled_vlm_pipe
    items = [SceneQADataset(6, 5, 64, images=4)[i] for i in range(6)]
    pixels, seqs, prompt_lens = encode(pipe.processor, items)
    for (stack, question, _), px, seq, n in zip(items, pixels, seqs, prompt_lens):
        assert torch.equal(px, stack)
        ids, _ = pipe.prepare_inputs([[(x + 1) / 2 for x in stack]], [question])
        assert ids[0] == seq[:n]
        assert seq[:n].count(pipe.target.config.image_token_id) == 64 * len(stack)


def test_recipes_train_on_several_images_and_the_heads_follow_the_target(tmp_path):
    """``train_vlm(images_per_prompt=2)`` records it; ``train_vlm_draft`` on that target draws its
    scene data the same way (recorded in ``data``); a bad count is refused naming the argument."""
    from mmspec.training.recipes import train_vlm, train_vlm_draft

    run = dict(steps=1, batch_size=2, lr=1e-3, dataset_size=4, heldout_size=2, warmup=1, log=lambda m: None)
    record = train_vlm(tmp_path / "t", size="draft", images_per_prompt=2, **run)
    assert record["images_per_prompt"] == 2 and 0 <= record["short_answer_accuracy"] <= 1
    by = record["short_answers_by_images"]
    assert set(by) == {"1", "2"} and sum(v["items"] for v in by.values()) == 2
    head = train_vlm_draft(tmp_path / "h", method="medusa", target_dir=tmp_path / "t", tau_tokens=0,
                           medusa_heads=2, **run)
    assert head["data"]["images_per_prompt"] == 2
    with pytest.raises(ValueError, match="images_per_prompt"):
        train_vlm(tmp_path / "x", size="draft", images_per_prompt=0, **run)


def test_cli_generate_vlm_takes_several_images(bundled_vlm_pipe, capsys):
    """``mmspec generate vlm --image A --image B``: one prompt with both images, in order; its
    answer is the pipeline's for ``images=[[A, B]]`` (one ``--image``: ``images=[A]``)."""
    from pathlib import Path

    import PIL.Image

    from mmspec import commands

    scenes = Path(__file__).resolve().parents[1] / "assets" / "vlm" / "scenes"
    paths = [str(scenes / "00.png"), str(scenes / "01.png")]
    images = [PIL.Image.open(p).convert("RGB") for p in paths]
    question = "describe the image in detail ."
    answers = []
    for given, expected in (([paths[0]], images[0]), (paths, images), (paths[::-1], images[::-1])):
        argv = ["generate", "vlm", "--prompt", question, "--method", "medusa", "--max-new-tokens", "12", "--quiet"]
        for p in given:
            argv += ["--image", p]
        assert commands.main(argv) == 0
        ref = bundled_vlm_pipe(images=[expected], prompts=[question], method="none", max_new_tokens=12)
        answers.append(capsys.readouterr().out.strip())
        assert answers[-1] == ref.texts[0].strip()
    assert len(set(answers)) == 3  # the images and their order reach the model


def test_short_answer_control_replaces_only_the_last_image(bundled_vlm_pipe):
    """``short_answers(shuffle_images=True)`` asks each question with the next item's last image in
    its own last image's place; the earlier images stay the item's own."""
    from mmspec.training.data.scene_qa import SceneQADataset
    from mmspec.training.recipes.vlm import short_answers

    items = [SceneQADataset(8, 2, 64, describe_prob=0.0, images=3)[i] for i in range(8)]
    seen = []

    class Recorder:  # stands in for the model: records what each call is shown, answers nothing
        def eval(self):
            return self

        def generate(self, input_ids, pixel_values, **kw):
            seen.append(pixel_values.clone())
            return input_ids

    assert short_answers(Recorder(), bundled_vlm_pipe.processor, items, shuffle_images=True) == [False] * 8
    for i, shown in enumerate(seen):
        own, following = items[i][0], items[(i + 1) % 8][0]
        assert len(shown) == len(own) and torch.equal(shown[:-1], own[:-1])
        assert torch.equal(shown[-1], following[-1])
