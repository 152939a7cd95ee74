"""``serve.SharedQueue``: requests submitted from several threads at once are decoded in one shared
continuous batch, each caller gets its own answer (greedy: equal to the request run alone), methods
do not mix, bad input is refused in the caller's thread, and a decode error reaches every caller
of its group. The demo's "Answer in a shared batch" (``vlm_shared``) over the same queue."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from mmspec import serve

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["what shape is it ?", "describe the image in detail .", "what colour is the shape ?",
             "how many shapes are there ?"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def models():
    return serve.Models()


def _submit_together(shared, requests):
    """Submit every request from its own thread at the same moment -> futures, in order."""
    futures = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def send(i, kwargs):
        barrier.wait()
        futures[i] = shared.submit(**kwargs)

    threads = [threading.Thread(target=send, args=(i, r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return futures


def test_concurrent_requests_share_one_batch_and_equal_each_alone(models):
    shared = serve.SharedQueue(models, slots=2, window_s=0.3)
    images = [serve.scene(i) for i in range(len(QUESTIONS))]
    requests = [dict(image=im, question=q, seed=0, method="eagle", max_new_tokens=NEW_TOKENS)
                for im, q in zip(images, QUESTIONS)]
    results = [f.result(timeout=300) for f in _submit_together(shared, requests)]
    assert shared.groups == [len(QUESTIONS)]  # one group: all four decoded together
    for im, q, got in zip(images, QUESTIONS, results):
        alone = serve.run_vlm(models, [im], [q], [0], "eagle", max_new_tokens=NEW_TOKENS)[0]
        assert (got.text, got.tokens) == (alone.text, alone.tokens)
        assert got.stats["group"] == len(QUESTIONS) and got.stats["batch"] == 2
        assert got.stats["queued_seconds"] >= 0
    # different methods decode in different groups, each still equal to its request alone
    mixed = [dict(requests[0]), dict(requests[1], method="none")]
    results = [f.result(timeout=300) for f in _submit_together(shared, mixed)]
    assert sorted(shared.groups[1:]) == [1, 1]
    none_alone = serve.run_vlm(models, [images[1]], [QUESTIONS[1]], [0], "none", max_new_tokens=NEW_TOKENS)[0]
    assert results[1].tokens == none_alone.tokens


def test_bad_input_is_refused_when_submitted_and_errors_reach_every_caller(models, monkeypatch):
    shared = serve.SharedQueue(models, slots=2, window_s=0.2)
    with pytest.raises(ValueError, match="question"):
        shared.submit(serve.scene(0), "  ")
    with pytest.raises(ValueError, match="max_new_tokens"):
        shared.submit(serve.scene(0), "what shape is it ?", max_new_tokens=0)
    with pytest.raises(ValueError, match="method"):
        shared.submit(serve.scene(0), "what shape is it ?", method="nonesuch")
    with pytest.raises(ValueError, match="slots"):
        serve.SharedQueue(models, slots=0)
    with pytest.raises(ValueError, match="window_s"):
        serve.SharedQueue(models, window_s=-1)
    assert shared.groups == []  # nothing was queued

    def broken(*args, **kwargs):
        raise RuntimeError("decode failed")
        yield  # a generator, as the real runner is

    monkeypatch.setattr(serve.shared, "run_vlm_continuous", broken)
    futures = _submit_together(shared, [dict(image=serve.scene(i), question=QUESTIONS[i]) for i in range(2)])
    for f in futures:
        with pytest.raises(RuntimeError, match="decode failed"):
            f.result(timeout=60)
    monkeypatch.undo()
    ok = shared.submit(serve.scene(0), QUESTIONS[0], max_new_tokens=4).result(timeout=120)  # the worker goes on
    assert ok.stats["new_tokens"] >= 1 and shared.groups == [2, 1]


@pytest.mark.slow
def test_demo_shared_button_batches_users_together():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    sys.path.insert(0, str(ROOT))
    from demos import app

    knobs = [serve.method_defaults("vlm", "eagle").get(n) for n in serve.knob_specs("vlm")]
    out: dict[int, tuple] = {}
    barrier = threading.Barrier(3)

    def user(i):
        barrier.wait()
        out[i] = app.vlm_shared(serve.scene(i), QUESTIONS[i], "eagle", NEW_TOKENS, *knobs)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        pieces, base_md, ours_md, error = out[i]
        assert error == "" and pieces
        assert "Decoded in a shared batch of" in ours_md and "equal to the baseline's: yes" in ours_md
    assert max(app.SHARED.groups) >= 2  # users' requests shared a batch
    pieces, base_md, ours_md, error = app.vlm_shared(serve.scene(0), "", "eagle", NEW_TOKENS, *knobs)
    assert pieces is None and "question" in error


def test_a_request_sent_during_a_decode_waits_for_the_next_group(models, monkeypatch):
    """The group's cache is sized before it starts: a request that arrives while it decodes is not
    admitted into it but decoded next (a stand-in runner that holds the first group open)."""
    started, release, sizes = threading.Event(), threading.Event(), []

    def held(models, images, questions, seeds, method, knobs, max_new_tokens, slots):
        sizes.append(len(images))
        started.set()
        release.wait(60)
        for i in range(len(images)):
            yield i, serve.Result(stats={"batch": slots}, text="", tokens=[])

    monkeypatch.setattr(serve.shared, "run_vlm_continuous", held)
    shared = serve.SharedQueue(models, slots=2, window_s=0.0)
    first = shared.submit(serve.scene(0), QUESTIONS[0])
    assert started.wait(60)
    second = shared.submit(serve.scene(1), QUESTIONS[1])  # the first group is decoding
    release.set()
    first.result(timeout=60), second.result(timeout=60)
    assert sizes == [1, 1] and shared.groups == [1, 1]
