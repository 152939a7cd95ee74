"""HFCausalLMTarget: transformers causal LMs in the speculation core, batched, on a static cache."""

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from mmspec.adapters.hf import HFCausalLMTarget
from mmspec.core import (JacobiDrafter, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         SpeculativeDecoder, Tree)
from mmspec.core.decoder import pad_prompts
from mmspec.core.shapes import forced_static_shapes
from mmspec.models import TinyCausalLM, TinyLMConfig
from tiny import noisy_copy

VOCAB = 64
NEW_TOKENS = 24
ATTN = ["eager", "sdpa"]  # the two implementations that add a custom 4-D float mask


def tiny_llama(attn: str = "sdpa", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=None,  # else generate() stops at Llama's default eos (2)
                         attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


def tiny_native(seed: int = 1) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, mlp_hidden=64)).eval()




def prompts_of_lengths(lengths=(3, 7, 1, 5), seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy decoding of one unpadded prompt."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def reference_logits(model, context: list[int]) -> torch.Tensor:
    """(V,) next-token logits of a cache-free forward over ``context`` at positions 0..len-1."""
    return model(torch.tensor([context])).logits[0, -1]


def step_and_check(model, target, cache, contexts, tokens):
    """Feed one token per row; its logits must equal a from-scratch forward of the visible context."""
    positions = cache.next_positions()[:, None]
    out = target(torch.tensor(tokens)[:, None], positions, cache)
    for b, context in enumerate(contexts):
        context.append(tokens[b])
        torch.testing.assert_close(out.logits[b, -1], reference_logits(model, context), atol=1e-5, rtol=0)
    assert cache.next_positions().tolist() == [len(c) for c in contexts]


DRAFTERS = {
    "chain-native": lambda target: ModelChainDrafter(tiny_native(), gamma=4),
    "chain-hf": lambda target: ModelChainDrafter(HFCausalLMTarget(noisy_copy(target, 0.2, 1)), gamma=4),
    "tree-native": lambda target: ModelTreeDrafter(tiny_native(), top_k=3, depth=3, total_tokens=10),
    "tree-hf": lambda target: ModelTreeDrafter(HFCausalLMTarget(noisy_copy(target, 0.2, 1)), top_k=3,
                                               depth=3, total_tokens=10),
    "jacobi": lambda target: JacobiDrafter(VOCAB, window=5),
}


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_matches_transformers_generate(attn, drafter):
    model = tiny_llama(attn)
    prompts = prompts_of_lengths()
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert all(len(set(row)) > 2 for row in expected), "the target's greedy text is trivially constant"

    decoder = SpeculativeDecoder(HFCausalLMTarget(model), DRAFTERS[drafter](model),
                                 processor=LogitsProcessor(temperature=0))
    out = decoder.generate(prompts, NEW_TOKENS)

    assert out.sequences.tolist() == expected
    assert out.lengths.tolist() == [NEW_TOKENS] * len(prompts)
    if drafter.endswith("-hf"):  # the close draft must make live rows keep different counts
        emitted = out.stats.accept_lengths
        live = emitted[(emitted > 0).all(1)]
        assert (live.max(1).values != live.min(1).values).any()
        assert out.stats.tau > 1.5


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("static", [False, True], ids=["exact-widths", "static-shapes"])
def test_keep_block_tree_path_and_truncate(attn, static):
    """Rows keep different parts of a block at their own lengths; with static shapes every block
    attends over the whole buffer, masked, and scores the same."""
    model = tiny_llama(attn)
    target = HFCausalLMTarget(model)
    prompts = [[5, 9, 14, 2, 33], [7, 21, 40]]
    ids, lens = pad_prompts(prompts)
    with forced_static_shapes() if static else contextlib.nullcontext():
        cache = target.new_cache(2, 64)
    assert cache.static == static
    target(ids, torch.arange(ids.shape[1]).expand_as(ids), cache)
    cache.truncate(lens)
    assert cache.next_positions().tolist() == [5, 3]

    # root + 5 nodes; node 2 is a child of the root and node 5 a child of node 2
    tree = Tree(torch.tensor([[0, 0, 1, 2, 2]]).expand(2, 5), max_depth=2, max_children=2)
    block = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]])
    out = target(block, cache.next_positions()[:, None] + tree.depths, cache, tree.ancestor_mask)
    torch.testing.assert_close(out.logits[0, 5], reference_logits(model, prompts[0] + [11, 13, 16]),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(model.lm_head(out.hidden), out.logits)  # hidden is the LM head's input

    # row 0 keeps the path 0 -> 2 -> 5, row 1 only its root
    cache.keep_block(6, torch.tensor([[0, 2, 5], [0, -1, -1]]), torch.tensor([3, 1]))
    assert cache.next_positions().tolist() == [8, 4]
    contexts = [prompts[0] + [11, 13, 16], prompts[1] + [21]]
    step_and_check(model, target, cache, contexts, [30, 31])

    cache.truncate(torch.tensor([7, 5]))  # row 0 forgets its last two tokens, row 1 is shorter already
    contexts[0] = contexts[0][:7]
    step_and_check(model, target, cache, contexts, [32, 33])

    # a chain block kept as a prefix (idx=None): row 0 keeps 2 of 3, row 1 all 3
    chain = torch.tensor([[41, 42, 43], [51, 52, 53]])
    target(chain, cache.next_positions()[:, None] + torch.arange(3), cache)
    cache.keep_block(3, None, torch.tensor([2, 3]))
    contexts[0] += [41, 42]
    contexts[1] += [51, 52, 53]
    step_and_check(model, target, cache, contexts, [34, 35])
    cache.check_overflow()


@pytest.mark.parametrize("attn", ATTN)
def test_tree_growth_sees_earlier_uncommitted_nodes(attn):
    """A drafter growing a tree level by level: the second level's mask spans R = 2 earlier nodes."""
    model = tiny_llama(attn)
    target = HFCausalLMTarget(model)
    prompts = [[3, 8, 1, 60], [9, 4]]
    ids, lens = pad_prompts(prompts)
    cache = target.new_cache(2, 64)
    target(ids, torch.arange(ids.shape[1]).expand_as(ids), cache)
    cache.truncate(lens)
    roots = [10, 20]
    step_and_check(model, target, cache, [prompts[0][:], prompts[1][:]], roots)
    root_pos = cache.next_positions() - 1

    level1 = torch.tensor([[11, 12], [21, 22]])  # both children of the root
    mask1 = torch.eye(2, dtype=torch.bool).expand(2, 2, 2)
    out1 = target(level1, (root_pos + 1)[:, None].expand(2, 2), cache, mask1)
    level2 = torch.tensor([[13, 14], [23, 24]])  # 13 is a child of 12, 14 a child of 11 (crossed)
    mask2 = torch.tensor([[False, True, True, False], [True, False, False, True]]).expand(2, 2, 4)
    out2 = target(level2, (root_pos + 2)[:, None].expand(2, 2), cache, mask2)
    for b in range(2):
        path = prompts[b] + [roots[b]]
        (a0, a1), (c0, c1) = level1[b].tolist(), level2[b].tolist()
        cases = [(out1.logits[b, 0], path + [a0]), (out1.logits[b, 1], path + [a1]),
                 (out2.logits[b, 0], path + [a1, c0]), (out2.logits[b, 1], path + [a0, c1])]
        for logits, context in cases:
            torch.testing.assert_close(logits, reference_logits(model, context), atol=1e-5, rtol=0)

    # the next round drops the uncommitted tree: only prompts and roots stay
    cache.truncate(lens + 1)
    assert cache.next_positions().tolist() == [5, 3]
    step_and_check(model, target, cache, [prompts[0] + [10], prompts[1] + [20]], [15, 25])


def test_a_write_past_max_len_is_refused():
    """Exact widths refuse the block at once; static shapes write into the never-visible spare
    slot and ``check_overflow`` (the decoder's, after the loop) refuses the decode."""
    model = tiny_llama()
    target = HFCausalLMTarget(model)
    ids = torch.tensor(prompts_of_lengths((5, 5)))
    cache = target.new_cache(2, 6)
    target(ids, torch.arange(5).expand(2, 5), cache)
    with pytest.raises(ValueError, match="max_len=6"):
        target(ids[:, :2], 5 + torch.arange(2).expand(2, 2), cache)
    with forced_static_shapes():
        cache = target.new_cache(2, 6)
    target(ids, torch.arange(5).expand(2, 5), cache)
    target(ids[:, :2], 5 + torch.arange(2).expand(2, 2), cache)
    with pytest.raises(ValueError, match="max_len=6"):
        cache.check_overflow()


def test_rejects_sliding_window_attention():
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match="full attention in every layer"):
        HFCausalLMTarget(Qwen2ForCausalLM(config))


def test_scores_equal_the_causal_lms():
    """The adapter's logits and hidden states (base model + LM head, the 4-D mask over the static
    buffer) equal the causal LM's own forward with ``output_hidden_states``."""
    model = tiny_llama()
    target = HFCausalLMTarget(model)
    ids = torch.tensor(prompts_of_lengths((5, 5)))
    for static in (False, True):
        with forced_static_shapes() if static else contextlib.nullcontext():
            cache = target.new_cache(2, 16)
        with torch.no_grad():
            ours = target(ids, torch.arange(5).expand(2, 5), cache)
            ref = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(ours.logits, ref.logits.float(), atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.hidden, ref.hidden_states[-1], atol=1e-6, rtol=0)
