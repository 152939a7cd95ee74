"""``SpeculativeVLMPipeline.stream()`` on the bundled VLM (issue 47): StreamingVLM's bounded cache
with speculative answers.

- The first round's context is the ordinary prompt, so its answer equals the pipeline's.
- Exact: over rounds with evictions, every method's greedy answer equals the target alone's from
  the same cache contents (``fork``).
- Re-indexing: after pruning, every kept text key at layer 0 (which depends on its token and
  position only) equals the key computed directly at its new position; the keys left at their
  old positions do not (the control).
- Bounded: the context, the previous text and the kept frames stay within the policy's bounds
  over many rounds, and the cache's bytes never change.
- ``ask(remember=False)`` leaves the context as it was.
"""

from __future__ import annotations

import pytest
import torch

from mmspec.adapters.vlm_stream import StreamPolicy, VLMStream

POLICY = dict(vision_window=2, text_window=2, text_sink=6, text_sliding_window=6)


@pytest.fixture(scope="module")
def pipe(bundled_vlm_pipe):
    return bundled_vlm_pipe


@pytest.fixture(scope="module")
def scenes():
    from mmspec.bench.vlm import bench_prompts

    return bench_prompts(8)


QUESTIONS = ("what colour is the main shape ?", "describe the image .", "where is the shape ?")


def test_the_first_round_is_the_ordinary_prompt(pipe, scenes):
    images, _ = scenes
    session = pipe.stream(**POLICY)
    session.add_frames([images[0]])
    answer = session.ask(QUESTIONS[0], method="eagle", max_new_tokens=32)
    assert answer.tokens == pipe(images=[images[0]], prompts=[QUESTIONS[0]], max_new_tokens=32).tokens[0]


def test_every_method_equals_the_target_alone_on_the_same_cache(pipe, scenes):
    images, _ = scenes
    session = pipe.stream(**POLICY)
    for i in range(6):
        session.add_frames(images[i : i + 1 + i % 2])  # chunks of one and two frames
        question = QUESTIONS[i % 3]
        ref = session.fork().ask(question, method="none", max_new_tokens=40)
        for method in ("lookup", "specvlm", "vispec", "medusa"):
            assert session.fork().ask(question, method=method, max_new_tokens=40).tokens == ref.tokens, (i, method)
        drafted = session.ask(question, method="eagle", max_new_tokens=40)
        assert drafted.tokens == ref.tokens, i
        assert drafted.stats["nfe"] <= ref.stats["nfe"]
    assert session.stream.evictions >= 4


def test_a_forgotten_answer_leaves_the_context_as_it_was(pipe, scenes):
    """``ask(remember=False)``: the context (tokens, positions, cache length) is unchanged, the
    round may be asked again, the same question gets the same answer each time, and the
    remembered answer after it equals one on a fork that never saw it (its garbage past the
    context is never read)."""
    images, _ = scenes
    session = pipe.stream(**POLICY)
    for i in range(4):
        session.add_frames(images[i : i + 2])
        session.ask(QUESTIONS[i % 3], method="eagle", max_new_tokens=24)
    session.add_frames(images[4:6])
    clean = session.fork()
    before = (list(session.stream.tokens), session.stream.ids.clone(), int(session.stream.cache.lengths[0]))
    first = session.ask(QUESTIONS[1], method="eagle", max_new_tokens=24, remember=False)
    again = session.ask(QUESTIONS[1], method="none", max_new_tokens=24, remember=False)
    assert first.tokens == again.tokens and first.stats["context_tokens"] == again.stats["context_tokens"]
    after = (session.stream.tokens, session.stream.ids, int(session.stream.cache.lengths[0]))
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2]
    kept = session.ask(QUESTIONS[0], method="medusa", max_new_tokens=24)
    assert kept.tokens == clean.ask(QUESTIONS[0], method="none", max_new_tokens=24).tokens
    assert session.stream.context_tokens() > before[2]  # a remembered answer joins the context
    with pytest.raises(ValueError, match="remember must be True or False"):
        session.ask(QUESTIONS[0], remember=1)


def _layer0_keys(target, token_ids, positions):
    """Layer 0's keys of text tokens at ``positions``, computed directly: (H, n, D)."""
    lm = target.language_model
    attn, norm = lm.layers[0].self_attn, lm.layers[0].input_layernorm
    x = norm(lm.embed_tokens(torch.tensor([token_ids])))
    k = attn.k_proj(x).view(1, len(token_ids), -1, attn.head_dim).transpose(1, 2)
    cos, sin = lm.rotary_emb(k, torch.tensor([positions]))
    half = k.shape[-1] // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], -1)
    return (k * cos[:, None] + rotated * sin[:, None])[0]


def test_pruning_re_indexes_positions_exactly(pipe, scenes):
    images, _ = scenes
    session = pipe.stream(**POLICY)
    stream, target = session.stream, session.stream.target
    for i in range(4):
        session.add_frames([images[i]])
        session.ask(QUESTIONS[0], max_new_tokens=12)
    assert stream.evictions >= 1  # keys were moved and rotated
    image_id = target.image_token_id
    text = [j for j, t in enumerate(stream.tokens) if t != image_id]
    ids = [stream.tokens[j] for j in text]
    kept = stream.cache.k[0, 0, :, text]
    direct = _layer0_keys(target, ids, text)
    assert torch.allclose(kept, direct, atol=1e-5), (kept - direct).abs().max()
    # the control: the same keys at positions off by the frames one eviction removed are far off
    assert not torch.allclose(kept, _layer0_keys(target, ids, [j + session.frame_tokens for j in text]), atol=1e-2)


def test_the_cache_stays_within_the_policy(pipe, scenes):
    images, _ = scenes
    session = pipe.stream(**POLICY)
    stream = session.stream
    nbytes = stream.cache.nbytes()
    longest = 0
    for i in range(12):
        session.add_frames([images[i % len(images)]])
        assert sum(1 for r in stream.rounds if r.vision) <= POLICY["vision_window"]
        assert sum(1 for r in stream.rounds if r.answer) <= POLICY["text_window"]
        assert len(stream.previous) <= POLICY["text_sink"] + POLICY["text_sliding_window"]
        session.ask(QUESTIONS[i % 3], method="medusa", max_new_tokens=24)
        longest = max(longest, stream.context_tokens())
        assert stream.cache.nbytes() == nbytes
    frames = POLICY["vision_window"] * session.frame_tokens
    text = POLICY["text_window"] * (24 + 16) + POLICY["text_sink"] + POLICY["text_sliding_window"]
    assert longest <= len(session.sink_ids) + frames + session.frame_tokens + text
    assert stream.evictions >= 10


def test_bad_use_is_refused(pipe, scenes):
    images, _ = scenes
    session = pipe.stream(**POLICY)
    with pytest.raises(ValueError, match="round"):
        session.ask("what shape ?")  # no frames yet
    session.add_frames([images[0]])
    with pytest.raises(ValueError, match="method"):
        session.ask("what shape ?", method="sd")
    session.ask("what shape ?", max_new_tokens=4)
    with pytest.raises(ValueError, match="one question per round"):
        session.ask("what colour ?", max_new_tokens=4)
    with pytest.raises(ValueError, match="frames"):
        session.add_frames([])
    with pytest.raises(ValueError, match="vision_window"):
        pipe.stream(vision_window=0)
    with pytest.raises(ValueError, match="target"):
        VLMStream(object(), [1], StreamPolicy(), 64)
    small = pipe.stream(capacity=100, **POLICY)
    with pytest.raises(ValueError, match="capacity"):
        small.add_frames([images[0], images[1]])


# --- a tiny random Qwen2.5-VL: M-RoPE re-indexing ----------------------------------------------

@pytest.fixture(scope="module")
def qwen():
    import numpy as np
    from transformers import Qwen2_5_VLProcessor

    from mmspec.adapters.vlm import VLMTarget
    from mmspec.models.vlm_draft import VLMDraftHead
    from mmspec.pipelines import SpeculativeVLMPipeline
    from test_vlm_adapter import tiny_qwen2_5_vl
    from test_vlm_inputs import qwen_processor

    model = tiny_qwen2_5_vl()
    torch.manual_seed(1)
    head = VLMDraftHead.from_target(VLMTarget(model), method="vispec")
    pipe = SpeculativeVLMPipeline(target=model, processor=qwen_processor(Qwen2_5_VLProcessor), vispec_head=head)
    pipe.set_progress_bar_config(disable=True)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (8, 12, 3), dtype=np.uint8) for _ in range(8)]
    return pipe, frames


def test_qwen_stream_first_round_and_every_method_exact(qwen):
    pipe, frames = qwen
    session = pipe.stream(vision_window=2, text_window=2, text_sink=4, text_sliding_window=4, capacity=400)
    session.add_frames(frames[:1])
    first = session.fork().ask("what colour is the shape ?", max_new_tokens=8)
    assert first.tokens == pipe(images=frames[:1], prompts=["what colour is the shape ?"], max_new_tokens=8).tokens[0]
    for i in range(6):
        if i:
            session.add_frames(frames[i : i + 1 + i % 2])
        ref = session.fork().ask("what is the shape ?", max_new_tokens=10)
        assert session.fork().ask("what is the shape ?", method="lookup", max_new_tokens=10).tokens == ref.tokens
        assert session.ask("what is the shape ?", method="vispec", max_new_tokens=10).tokens == ref.tokens, i
    stream = session.stream
    assert stream.evictions >= 3 and stream.ids.shape[0] == 3
    assert int(stream.ids.max()) < len(stream.tokens)  # M-RoPE ids stay inside the kept context


def test_qwen_pruning_re_indexes_every_axis(qwen):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb

    pipe, frames = qwen
    session = pipe.stream(vision_window=1, text_window=1, text_sink=2, text_sliding_window=2, capacity=300)
    for i in range(4):
        session.add_frames(frames[i : i + 2])
        session.ask("what is the shape ?", max_new_tokens=6)
    stream, target = session.stream, session.stream.target
    assert stream.evictions >= 2
    lm = target.language_model
    text = [j for j, t in enumerate(stream.tokens) if t != target.image_token_id]
    attn, norm = lm.layers[0].self_attn, lm.layers[0].input_layernorm
    x = norm(lm.embed_tokens(torch.tensor([[stream.tokens[j] for j in text]])))
    k = attn.k_proj(x).view(1, len(text), -1, attn.head_dim).transpose(1, 2)

    def keys_at(ids):
        cos, sin = lm.rotary_emb(k, ids[:, None])
        return apply_rotary_pos_emb(k, k, cos, sin)[1][0]

    kept = stream.cache.k[0, 0, :, text]
    ids = stream.ids[:, text]
    assert torch.allclose(kept, keys_at(ids), atol=1e-5), (kept - keys_at(ids)).abs().max()
    assert not torch.allclose(kept, keys_at(ids + 5), atol=1e-2)  # the control: other ids, other keys
