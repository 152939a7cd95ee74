"""Online draft adaptation (``SpeculativeVLMPipeline.enable_draft_adaptation``,
``mmspec.pipelines.draft_adaptation``) on the bundled VLM: the answers stay exactly the target's alone while
the head learns from them, the head's weights move only at each ``every``-th answer, the global
RNG is left as it was, and bad settings and half-precision heads are refused.
(What it buys is measured by ``mmspec bench adapt``: docs/guides/train.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmspec.pipelines import SpeculativeVLMPipeline
from mmspec.pipelines.draft_adaptation import DraftAdaptation
from mmspec.training.data.shapes import render

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "vlm"
QUESTION = "tell me about the shape ."  # phrased as no training template is


def images(n: int, offset: int = 0):
    return [(render(i % 16, torch.Generator().manual_seed(50 + offset + i), 64, style="bold") + 1) / 2
            for i in range(n)]


@pytest.fixture(scope="module")
def pipe():
    pipe = SpeculativeVLMPipeline.from_pretrained(ASSETS)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_adapting_heads_answer_as_the_target_alone_and_learn(pipe, method):
    component = {"eagle": "eagle_head", "medusa": "medusa_head"}[method]
    head = getattr(pipe, component)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    adaptation = pipe.enable_draft_adaptation(lr=1e-3, every=4)
    try:
        rng = torch.get_rng_state()
        for call in range(3):  # 3 calls of 2 prompts: updates after answers 4 (call 2) and 8 (never)
            batch = images(2, offset=2 * call)
            plain = pipe(batch, [QUESTION] * 2, max_new_tokens=24, method="none")
            drafted = pipe(batch, [QUESTION] * 2, max_new_tokens=24, method=method)
            assert drafted.tokens == plain.tokens
            if call == 0:
                assert adaptation.updates == 0 and all(torch.equal(before[k], v) for k, v in head.state_dict().items())
        assert adaptation.served == 6 and adaptation.updates == 1 and len(adaptation.buffer) == 2
        assert all(x == x for x in adaptation.losses)  # finite
        assert any(not torch.equal(before[k], v) for k, v in head.state_dict().items())
        assert torch.equal(torch.get_rng_state(), rng)  # an update leaves the global generator as it was
        assert not head.training
    finally:
        pipe.disable_draft_adaptation()
        head.load_state_dict(before)


def test_methods_without_a_head_leave_the_buffer_alone(pipe):
    adaptation = pipe.enable_draft_adaptation(every=1)
    try:
        pipe(images(1), [QUESTION], max_new_tokens=8, method="lookup")
        assert adaptation.served == 0 and adaptation.updates == 0
    finally:
        pipe.disable_draft_adaptation()


def test_calls_with_several_images_for_a_prompt_are_not_adapted_on(pipe):
    """A call where a prompt holds two images is served but not observed (its rows cannot be split
    one image per answer); the next single-image call is."""
    adaptation = pipe.enable_draft_adaptation(every=100)
    try:
        a, b = images(2)
        pipe([[a, b]], [QUESTION], max_new_tokens=8, method="eagle")
        assert adaptation.served == 0
        pipe([a], [QUESTION], max_new_tokens=8, method="eagle")
        assert adaptation.served == 1
    finally:
        pipe.disable_draft_adaptation()


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0), "lr must be a number > 0"),
    (dict(every=0), "every must be an int >= 1"),
    (dict(rollout_steps=0), "rollout_steps must be an int >= 1"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftAdaptation(**kwargs)


def test_a_half_precision_head_is_refused(pipe):
    head = pipe.eagle_head
    adaptation = DraftAdaptation(every=1)
    head.half()
    try:
        with pytest.raises(ValueError, match="draft head must be float32 weights"):
            adaptation.check_head(head)
    finally:
        head.float()


def test_the_adapt_bench_runs_its_arms_on_one_stream():
    """``mmspec bench adapt`` at a tiny size: three arms, every answer the target's, an update
    every 2 answers in the adapted arm only."""
    from mmspec.bench.adapt import AdaptBenchConfig, run

    result = run(AdaptBenchConfig(prompts=4, window=2, every=2, max_new_tokens=12))
    rows = {row["arm"]: row for row in result["rows"]}
    assert list(rows) == ["none", "frozen", "adapted"]
    assert all(row["identical"] and row["identical_answers"] == 4 for row in rows.values())
    assert rows["adapted"]["updates"] == 2 and rows["frozen"]["updates"] == 0 and rows["adapted"]["adapt_s"] > 0
    assert rows["none"]["tau_first"] == rows["none"]["tau_last"] == 1.0
    assert result["setup"]["windows"] == [[0, 2], [2, 4]]


def test_mmspec_batch_adapts_the_vlm_heads_and_writes_the_same_answers(tmp_path):
    """``mmspec batch --adapt-drafts``: 4 eagle jobs answered one by one with the head adapting
    every 2 answers write the same files as a run with frozen heads."""
    import json

    import PIL.Image

    from mmspec import commands, serve

    images = []
    for i, image in enumerate(globals()["images"](4)):
        PIL.Image.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy()).save(tmp_path / f"{i}.png")
        images.append(f"{i}.png")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"id": f"a{i}", "kind": "vlm", "image": name, "question": QUESTION,
                                        "method": "eagle", "max_new_tokens": 16}) + "\n"
                            for i, name in enumerate(images)))
    assert commands.main(["batch", str(jobs), "--out", str(tmp_path / "frozen"), "--batch-size", "1", "--quiet"]) == 0
    models = serve.Models(adapt_drafts=dict(lr=1e-3, every=2))
    from mmspec.batch import run

    run(jobs, tmp_path / "adapted", batch_size=1, progress=False, models=models)
    assert models.pipeline("vlm").draft_adaptation.updates == 2
    for i in range(4):
        assert (tmp_path / "adapted" / f"a{i}.txt").read_text() == (tmp_path / "frozen" / f"a{i}.txt").read_text()


def test_qwen2_vl_rows_are_split_per_image_for_adaptation():
    """A Qwen2-VL pipeline answering two prompts of different image grids in one call: each buffered
    row holds its own ids, patches (24 and 16) and grid, as the prompt asked alone would (a split
    at the wrong patch fails here: the vision tower would not notice), an update moves the head,
    and the answers stay the target's."""
    from test_vlm_adapter import tiny_qwen2_vl
    from test_vlm_inputs import qwen_processor
    from transformers import Qwen2VLProcessor

    from mmspec.adapters.vlm import VLMTarget
    from mmspec.models.vlm_draft import VLMDraftHead

    model = tiny_qwen2_vl()
    torch.manual_seed(0)
    head = VLMDraftHead.from_target(VLMTarget(model), method="eagle")
    pipe = SpeculativeVLMPipeline(target=model, processor=qwen_processor(Qwen2VLProcessor), eagle_head=head)
    pipe.set_progress_bar_config(disable=True)
    questions = ["what colour is the shape ?", "describe the image in detail ."]
    rng = torch.Generator().manual_seed(4)
    images = [torch.rand(3, 8, 12, generator=rng), torch.rand(3, 8, 8, generator=rng)]  # 24 and 16 patches
    plain = pipe(images, questions, max_new_tokens=8, method="none")
    adaptation = pipe.enable_draft_adaptation(lr=1e-3, every=3)  # the two answers stay in the buffer
    drafted = pipe(images, questions, max_new_tokens=8, method="eagle")
    assert drafted.tokens == plain.tokens
    for item, image, question, answer in zip(adaptation.buffer, images, questions, plain.tokens):
        alone = pipe.prepare_inputs([image], [question])  # the row as if it had been asked alone
        assert item.ids == alone.input_ids[0] + answer and item.prompt_len == len(alone.input_ids[0])
        assert all(torch.equal(item.vision[k], alone.vision[k]) for k in ("pixel_values", "image_grid_thw"))
    before = head.fc.weight.clone()
    adaptation.step(head, pad_id=0)
    assert adaptation.updates == 1 and not torch.equal(before, head.fc.weight)
