"""Continuous batching (``SpeculativeDecoder.serve``): a finished row's slot is refilled by the next
job's prefill while the other rows keep decoding, and every job's tokens equal the job decoded
alone (``generate`` on it, batch of one).

Jobs differ in length (EOS and prompt lengths), there are more jobs than slots, and each test
checks that a job entered a slot between two passes of the batch (a refill while others decode).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmspec.adapters.hf import HFCacheAdapter
from mmspec.adapters.vlm import VLMTarget
from mmspec.core import (DrafterBase, Job, LogitsProcessor, NextSetSchedule, NullDrafter, SpeculativeDecoder,
                         StaticKVCache)
from mmspec.core.drafters import _empty_draft
from mmspec.pipelines import SpeculativeARImagePipeline, SpeculativeVLMPipeline
from mmspec.serve.vlm import scene

QUESTIONS = ["what color is the shape ?", "describe the image in detail .", "how many shapes are there ?",
             "what shape is it ?", "describe the image ."]
NEW_TOKENS = 20
SLOTS = 2


@pytest.fixture(scope="module")
def vlm():
    pipe = SpeculativeVLMPipeline.from_pretrained("assets/vlm")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ar():
    pipe = SpeculativeARImagePipeline.from_pretrained("assets/ar-image")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def events(monkeypatch):
    """The order of the batch's passes and admissions: ``"pass"`` / ``"admit"`` per call."""
    log: list[str] = []
    admit, one_pass = SpeculativeDecoder._admit, SpeculativeDecoder._pass

    def logged_admit(self, *args):
        log.append("admit")
        return admit(self, *args)

    def logged_pass(self, *args):
        log.append("pass")
        return one_pass(self, *args)

    monkeypatch.setattr(SpeculativeDecoder, "_admit", logged_admit)
    monkeypatch.setattr(SpeculativeDecoder, "_pass", logged_pass)
    return log


def refills_between_passes(log: list[str]) -> int:
    """Admissions after the first pass, each with a pass after it: a slot refilled mid-decode."""
    first, last = log.index("pass"), len(log) - 1 - log[::-1].index("pass")
    return sum(e == "admit" for e in log[first:last])


def vlm_alone(pipe, method: str) -> list[list[int]]:
    return [pipe(images=[scene(i)], prompts=[q], method=method, max_new_tokens=NEW_TOKENS, temperature=0).tokens[0]
            for i, q in enumerate(QUESTIONS)]


def vlm_served(pipe, method: str) -> dict[int, list[int]]:
    images = [scene(i) for i in range(len(QUESTIONS))]
    return {s.index: s.tokens.tolist() for s, _ in pipe.serve(images, QUESTIONS, slots=SLOTS, method=method,
                                                                max_new_tokens=NEW_TOKENS, temperature=0)}


@pytest.mark.parametrize("method", ["none", "eagle", "sd", "vispec", "medusa", "lookup"])
def test_vlm_greedy_jobs_equal_each_job_alone(vlm, events, method):
    alone = vlm_alone(vlm, method)
    events.clear()
    served = vlm_served(vlm, method)
    assert sorted(served) == list(range(len(QUESTIONS)))
    assert [served[i] for i in range(len(QUESTIONS))] == alone
    assert len({len(a) for a in alone}) > 1  # jobs of different lengths
    assert refills_between_passes(events) >= 1
    assert events.count("admit") == len(QUESTIONS)


def test_vlm_drafts_keep_their_acceptance_after_a_refill(vlm):
    """A restarted drafter drafts for the new row as it would alone: each job takes the passes it
    takes alone (restart_rows copies the drafter's state, not only the target's)."""
    images = [scene(i) for i in range(len(QUESTIONS))]
    alone = [vlm(images=[scene(i)], prompts=[q], method="eagle", max_new_tokens=NEW_TOKENS, temperature=0)
             for i, q in enumerate(QUESTIONS)]
    served = {s.index: s for s, _ in vlm.serve(images, QUESTIONS, slots=SLOTS, method="eagle",
                                                max_new_tokens=NEW_TOKENS, temperature=0)}
    assert [served[i].target_forwards for i in range(len(QUESTIONS))] == [a.stats["nfe"] for a in alone]
    assert [served[i].counts[-1] for i in range(len(QUESTIONS))] == [len(a.tokens[0]) for a in alone]


def test_a_refill_that_does_not_copy_the_prompt_keys_fails_the_equality(vlm, monkeypatch):
    """The exactness test's power: a refill that takes the new row's length but keeps the slot's
    old keys/values (no copy of the prompt pass) changes the answers."""
    alone = vlm_alone(vlm, "none")

    def lengths_only(self, row, other, other_row):
        self.lengths = self.lengths.clone()
        self.lengths[row] = other.lengths[other_row]

    monkeypatch.setattr(HFCacheAdapter, "load_row", lengths_only)
    served = vlm_served(vlm, "none")
    assert [served[i] for i in range(len(QUESTIONS))] != alone


def ar_jobs_and_alone(pipe, method: str, temperature: float, n_jobs: int = 5):
    """Decoder-level AR jobs (class prompts with their null-class uncond rows, guidance 2) and each
    decoded alone, ``NEW_TOKENS`` tokens of the grid, one generator per job."""
    recipe = pipe.check_method(method, None)
    logits = LogitsProcessor(temperature=temperature, guidance_scale=2.0)
    model = pipe.transformer
    labels = [0, 3, 5, 1, 2][:n_jobs]

    def gen(i):
        return torch.Generator().manual_seed(1000 + i)

    uncond = model.uncond_prompts(1)
    alone = []
    for i, c in enumerate(labels):
        out = pipe.build_decoder(recipe, logits).generate(model.class_prompts([c]), NEW_TOKENS, uncond_input_ids=uncond,
                                                          generator=[gen(i)])
        alone.append(out.sequences[0, : int(out.lengths[0])].tolist())
    jobs = [Job(p, uncond_input_ids=uncond[0], generator=gen(i)) for i, p in enumerate(model.class_prompts(labels))]
    return pipe.build_decoder(recipe, logits), jobs, alone


@pytest.mark.parametrize("method,temperature", [("none", 0.0), ("sjd", 0.0), ("sjd", 1.0)])
def test_ar_guided_jobs_equal_each_job_alone(ar, events, method, temperature):
    """Guidance doubles the rows: slot b and b + slots are one job's [cond; uncond] pair, refilled
    together. Greedy is exact; sampled SJD draws each job's numbers from its own generator in the
    order it does alone (equal here; in general up to batched float rounding)."""
    decoder, jobs, alone = ar_jobs_and_alone(ar, method, temperature)
    events.clear()
    served = {s.index: s.tokens.tolist() for s in decoder.serve(jobs, NEW_TOKENS, slots=SLOTS)}
    assert [served[i] for i in range(len(jobs))] == alone
    assert refills_between_passes(events) >= 1


def test_ar_pipeline_serve_equals_the_pipeline_alone(ar):
    """``SpeculativeARImagePipeline.serve``: whole grids, greedy SJD, two slots for three images."""
    labels = [0, 3, 5]
    alone = [ar(class_labels=[c], method="sjd", temperature=0.0, output_type="latent").tokens[0] for c in labels]
    served = {s.index: grid for s, grid in ar.serve(class_labels=labels, slots=SLOTS, method="sjd", temperature=0.0)}
    assert all(torch.equal(served[i], alone[i]) for i in range(len(labels)))


@pytest.mark.parametrize("drafter", ["tree", "chain", "jacobi"])
def test_text_drafters_restart_rows_with_eos_and_unequal_prompts(drafter, events):
    """The restartable text drafters on a tiny LM: three slots, six prompts of 1 to 5 tokens, an
    EOS id that ends some rows early, greedy and sampled (per-job generators)."""
    from tiny import noisy_copy, spread, tiny_lm

    from mmspec.core import JacobiDrafter, ModelChainDrafter, ModelTreeDrafter

    target = spread(tiny_lm(0, vocab_size=16, dim=32))
    draft = noisy_copy(target)
    make = {"tree": lambda: ModelTreeDrafter(draft, top_k=2, depth=2, total_tokens=6),
            "chain": lambda: ModelChainDrafter(draft, gamma=3), "jacobi": lambda: JacobiDrafter(16, window=4)}[drafter]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1], [2], [3, 3, 3, 4], [5, 1, 2]]
    for temperature in (0.0, 1.0):
        def gen(i):
            return torch.Generator().manual_seed(100 + i)

        logits = LogitsProcessor(temperature=temperature)
        alone = []
        for i, p in enumerate(prompts):
            out = SpeculativeDecoder(target, make(), processor=logits).generate([p], 12, eos_token_id=7,
                                                                             generator=[gen(i)])
            alone.append(out.sequences[0, : int(out.lengths[0])].tolist())
        events.clear()
        served = {s.index: s.tokens.tolist() for s in SpeculativeDecoder(target, make(), processor=logits).serve(
            [Job(p, generator=gen(i)) for i, p in enumerate(prompts)], 12, slots=3, eos_token_id=7)}
        assert [served[i] for i in range(len(prompts))] == alone
        assert refills_between_passes(events) >= 1


def test_load_row_copies_one_row_and_refuses_other_shapes():
    big = StaticKVCache(2, 3, 2, 4, max_len=10)
    small = StaticKVCache(2, 1, 2, 4, max_len=5)
    small.k.normal_(), small.v.normal_()
    small.lengths = torch.tensor([4])
    big.load_row(1, small, 0)
    assert big.lengths.tolist() == [0, 4, 0]
    assert torch.equal(big.k[:, 1, :, :6], small.k[:, 0]) and torch.equal(big.v[:, 1, :, :6], small.v[:, 0])
    assert not big.k[:, [0, 2]].any()
    with pytest.raises(ValueError, match="other"):
        StaticKVCache(2, 1, 2, 4, max_len=5).load_row(0, big, 0)  # more slots than the batch holds
    with pytest.raises(ValueError, match="other"):
        big.load_row(0, StaticKVCache(1, 1, 2, 4, max_len=5), 0)  # other layers


class _Frozen(DrafterBase):
    """A drafter with per-row state it cannot restart (the default)."""

    def propose(self, state):
        return _empty_draft(state)


def test_refuses_what_cannot_refill_rows(ar):
    model = ar.transformer
    jobs = [Job([1]), Job([2])]
    with pytest.raises(ValueError, match="drafter"):
        next(SpeculativeDecoder(model, _Frozen()).serve(jobs, 4, slots=1))
    with pytest.raises(ValueError, match="schedule"):
        next(SpeculativeDecoder(model, NullDrafter(), schedule=NextSetSchedule(16, 16, 4)).serve(jobs, 4, slots=1))
    with pytest.raises(ValueError, match="generator"):
        next(SpeculativeDecoder(model).serve([Job([1], generator=torch.Generator()), Job([2])], 4, slots=1))
    with pytest.raises(ValueError, match="uncond_input_ids"):
        next(SpeculativeDecoder(model, processor=LogitsProcessor(guidance_scale=2.0)).serve(jobs, 4, slots=1))


def test_refuses_qwen2_vl_whose_prompt_pass_keeps_per_row_rope_offsets():
    from test_vlm_adapter import qwen_inputs, row_images, tiny_qwen2_vl

    prompts, images = qwen_inputs(2)
    target = VLMTarget(tiny_qwen2_vl())
    jobs = [Job(p, conditioning=target.vision_inputs(**row_images("qwen2-vl", images, b)))
            for b, p in enumerate(prompts)]
    decoder = SpeculativeDecoder(target, processor=LogitsProcessor(temperature=0.0))
    with pytest.raises(ValueError, match="rope_deltas"):
        list(decoder.serve(jobs, 4, slots=1))


# ---------------------------------------------------------------- serving layer and mmspec batch

def test_run_vlm_continuous_yields_each_runs_own_result(vlm):
    from mmspec import serve

    models = serve.Models()
    models._loaded["vlm"] = vlm  # the module's pipeline, loaded once
    images = [scene(i) for i in range(len(QUESTIONS))]
    seeds = list(range(len(QUESTIONS)))
    alone = [serve.run_vlm(models, [im], [q], [s], "eagle", max_new_tokens=NEW_TOKENS)[0]
             for im, q, s in zip(images, QUESTIONS, seeds)]
    order, got = [], {}
    for index, result in serve.run_vlm_continuous(models, images, QUESTIONS, seeds, "eagle",
                                                  max_new_tokens=NEW_TOKENS, slots=SLOTS):
        order.append(index)
        got[index] = result
    assert sorted(order) == list(range(len(QUESTIONS))) and order != sorted(order)  # yielded as each ends
    for i, a in enumerate(alone):
        assert (got[i].text, got[i].tokens) == (a.text, a.tokens)
        assert got[i].stats["batch"] == SLOTS and got[i].stats["new_tokens"] == len(a.tokens)
        assert len(got[i].commit_pass) == len(a.tokens) and got[i].commit_pass[0] == 0
        assert list(got[i].commit_pass) == sorted(got[i].commit_pass)


def test_batch_continuous_writes_the_static_files_as_jobs_finish_and_resumes(tmp_path, monkeypatch):
    import json

    import PIL.Image

    from mmspec import batch, serve

    PIL.Image.fromarray(serve.scene(1)).save(tmp_path / "scene.png")
    questions = [QUESTIONS[i] for i in (1, 3, 0, 2, 4)]  # a long answer first: a shorter one ends before it
    jobs = [{"id": f"ans-{i}", "kind": "vlm", "image": "scene.png", "question": q, "method": "eagle",
             "max_new_tokens": 16} for i, q in enumerate(questions)]
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    models = serve.Models()
    static = batch.run(path, tmp_path / "static", batch_size=SLOTS, progress=False, models=models)
    appended: list[str] = []
    append = batch.append_record
    monkeypatch.setattr(batch, "append_record", lambda m, rec: (appended.append(rec["id"]), append(m, rec)))
    cont = batch.run(path, tmp_path / "cont", batch_size=SLOTS, progress=False, models=models, continuous=True)
    assert (static.ok, cont.ok, cont.failed) == (len(jobs), len(jobs), 0)
    files = {p.name: p.read_bytes() for p in (tmp_path / "static").iterdir() if p.suffix == ".txt"}
    assert {p.name: p.read_bytes() for p in (tmp_path / "cont").iterdir() if p.suffix == ".txt"} == files
    assert sorted(appended) == sorted(j["id"] for j in jobs) and appended != [j["id"] for j in jobs]  # finish order
    # resumable (through the command line): a lost file is redone alone, a finished folder does no work
    from mmspec import commands

    (tmp_path / "cont" / "ans-1.txt").unlink()
    appended.clear()
    assert commands.main(["batch", str(path), "--out", str(tmp_path / "cont"), "--batch-size", str(SLOTS),
                          "--continuous", "--quiet"]) == 0
    assert appended == ["ans-1"]
    assert (tmp_path / "cont" / "ans-1.txt").read_bytes() == files["ans-1.txt"]
    assert batch.run(path, tmp_path / "cont", batch_size=SLOTS, progress=False, models=models,
                     continuous=True).skipped == len(jobs)


def test_make_streams_keeps_one_stream_per_group_and_process():
    from batch_jobs import job as any_job

    from mmspec import batch

    def job(i, method="eagle", temperature=0.0, kind="vlm"):
        return any_job(i, kind, temperature, method)

    jobs = [job(0), job(1), job(2, "sd"), job(3), job(4, temperature=0.5), job(5, kind="ar-image", method="sjd"),
            job(6)]
    units = [[j.id for j in u] for u in batch.make_streams(jobs, slots=2)]
    assert units == [["j0", "j1", "j3", "j6"], ["j2"], ["j4"], ["j5"]]  # sampled VLM and AR jobs alone
    units = [[j.id for j in u] for u in batch.make_streams(jobs, slots=2, parts=2)]
    assert units == [["j0", "j1"], ["j2"], ["j3", "j6"], ["j4"], ["j5"]]


def test_run_ar_continuous_images_equal_run_ar(ar):
    from mmspec import serve

    models = serve.Models()
    models._loaded["ar-image"] = ar
    prompts, seeds = ["a red circle", "a blue star", "a green square"], [0, 1, 2]
    alone = [serve.run_ar(models, [p], [s], "sjd", temperature=0.0)[0] for p, s in zip(prompts, seeds)]
    got = dict(serve.run_ar_continuous(models, prompts, seeds, "sjd", temperature=0.0, slots=SLOTS))
    for i, a in enumerate(alone):
        assert got[i].tokens == a.tokens and np.array_equal(got[i].image, a.image)
        assert got[i].extra == {"lossless": True} and got[i].stats["nfe"] == a.stats["nfe"]


def test_pipeline_serve_checks_its_inputs_before_any_model_runs(vlm):
    with pytest.raises(ValueError, match="slots"):
        next(vlm.serve([scene(0)], ["what shape is it ?"], slots=0))
    with pytest.raises(ValueError, match="generator"):
        next(vlm.serve([scene(0)], ["what shape is it ?"], slots=1, generator=torch.Generator()))
    with pytest.raises(ValueError, match="method"):
        next(vlm.serve([scene(0)], ["what shape is it ?"], slots=1, method="nope"))


def test_admit_holds_jobs_until_they_may_enter():
    """``serve(admit=...)``: a job enters only when ``admit`` says so (here: after the first job
    has run 3 passes alone), the tokens are unchanged, and refusing while no row decodes is an
    error naming ``admit``."""
    from tiny import spread, tiny_lm

    target = spread(tiny_lm(0, vocab_size=16, dim=32))
    logits = LogitsProcessor(temperature=0.0)
    prompts = [[1, 2, 3], [4, 5], [6, 7]]
    alone = [SpeculativeDecoder(target, None, processor=logits).generate([p], 8).sequences[0].tolist()
             for p in prompts]
    asked = []

    def admit(j, idle):
        asked.append((j, idle))
        return j == 0 or len(asked) > 4

    served = {s.index: s.tokens.tolist() for s in SpeculativeDecoder(target, None, processor=logits).serve(
        [Job(p) for p in prompts], 8, slots=2, admit=admit)}
    assert [served[i] for i in range(3)] == alone
    assert asked[0] == (0, True) and (1, False) in asked[1:4]  # job 1 held while job 0 decoded
    with pytest.raises(ValueError, match="admit must be"):
        list(SpeculativeDecoder(target, None, processor=logits).serve([Job(p) for p in prompts], 8, slots=2,
                                                                    admit=lambda j, idle: False))


@pytest.mark.statistical
@pytest.mark.parametrize("broken", [False, True])
def test_sampled_jobs_keep_the_target_law(small_vocab_pair, broken, monkeypatch):
    """Sampled continuous batching is exact in law: seed 0, N = 6,000 jobs of one prompt through 48
    slots with Jacobi drafts (rows finish at different passes, so refills happen while others
    decode), the first 3 tokens against the exact joint (8**3 cells) by Pearson chi-square, pass at
    p >= 1e-3. A refill that copies only the row's length (not its keys and values) must fail."""
    from mmspec.core import JacobiDrafter
    from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index

    target, _ = small_vocab_pair
    V, n, N = target.vocab_size, 3, 6_000
    prompt = [3, 1, 4]
    if broken:
        def length_only(self, row, other, other_row):
            self.lengths = self.lengths.clone()
            self.lengths[row] = other.lengths[other_row]

        monkeypatch.setattr(StaticKVCache, "load_row", length_only)
    logits = LogitsProcessor(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    jobs = [Job(prompt, generator=torch.Generator().manual_seed(int(s)))
            for s in torch.randint(0, 2**62, (N,), generator=g)]
    decoder = SpeculativeDecoder(target, JacobiDrafter(V, window=3), processor=logits)
    tokens = torch.stack([s.tokens[:n] for s in decoder.serve(jobs, n, slots=48)])
    p = chisquare_pvalue(sequence_index(tokens, V), exact_joint(target, prompt, n, logits))
    assert (p >= P_THRESHOLD) != broken, f"p={p:.2e}"
