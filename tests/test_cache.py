"""KV caches hold exactly the context they claim (must-show 6).

After truncate, gather and rolling, every logit computed through a cache equals a from-scratch
forward (no cache, full causal attention) of the same visible context at the same positions, to
1e-5; a rolling cache keeps constant memory over 10,000 appended tokens.
"""

import pytest
import torch

from mmspec.core import Tree
from mmspec.core.tree import node_path
from tiny import tiny_lm

V = 32
ATOL = 1e-5
PROMPTS = [[3, 14, 15, 9, 2], [6, 5, 3, 5, 8, 9, 7, 9, 31]]
# two trees of 7 nodes (root + 6): row 0 has the path 0-2-5, row 1 the path 0-1
TREES = [[0, 0, 1, 1, 2, 2], [0, 1, 1, 0, 4, 2]]
PATHS = [[0, 2, 5], [0, 1]]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def lm(n_layers):
    # init_std 0.1 keeps logits O(1): float32 rounding between the cached and the recomputed
    # attention then stays below 1e-6, a tenth of the tolerance (at 0.5 it reaches about 4e-5)
    return tiny_lm(0, vocab_size=V, dim=32, n_layers=n_layers, init_std=0.1)


def scratch(model, context, positions=None):
    """(len(context), V) logits of a from-scratch forward, at positions 0 .. len - 1 by default."""
    return model(torch.tensor([context]), None if positions is None else torch.tensor([positions])).logits[0]


def assert_logits(got, model, context):
    """``got`` (V,) are the logits after ``context``, recomputed from scratch at positions 0, 1, ..."""
    torch.testing.assert_close(got, scratch(model, context)[-1], atol=ATOL, rtol=0)


def prefill(model, cache, prompts):
    """Prefill right-padded prompts of different lengths, then cut the padding."""
    ids = torch.full((len(prompts), max(map(len, prompts))), 1)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    model(ids, cache=cache)
    cache.truncate(torch.tensor([len(p) for p in prompts]))


def append(model, cache, tokens, depths=None, tree_mask=None):
    """Feed (B, T) tokens after each row's cached context (a chain, or a tree at ``depths``)."""
    if depths is None:
        depths = torch.arange(tokens.shape[1])
    return model(tokens, cache.next_positions()[:, None] + depths, cache, tree_mask).logits  # (B, T, V)


def visible(seq, sink, window):
    """What StreamingLLM keeps of a committed sequence: the first ``sink`` and last ``window`` tokens."""
    return seq if len(seq) <= sink + window else seq[:sink] + seq[len(seq) - window:]


def padded_paths(paths):
    """Node paths -> (B, K) ``keep_block`` indices (-1 past each path) and (B,) lengths."""
    width = max(map(len, paths))
    idx = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
    return idx, torch.tensor([len(p) for p in paths])


def check_tree_block(model, logits, contexts, parents, tokens):
    """Every node's logits equal a recompute of the row's context plus the node's root path."""
    for b, context in enumerate(contexts):
        for i in range(tokens.shape[1]):
            path = node_path(parents[b], i)
            assert_logits(logits[b, i], model, context + tokens[b, path].tolist())


def test_tolerance_bites():
    """A wrong context or position moves the logits by far more than the tolerance."""
    model = lm(3)
    context = PROMPTS[1] + [4, 4, 20]
    ref = scratch(model, context)[-1]
    assert (scratch(model, context[1:])[-1] - ref).abs().max() > 1e3 * ATOL  # one token lost
    # RoPE sees only relative positions, so a uniform shift is invisible; a hole is not
    holed = list(range(len(context) - 1)) + [len(context)]
    assert (scratch(model, context, holed)[-1] - ref).abs().max() > 100 * ATOL


def test_truncate_and_keep_block():
    model = lm(3)
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(2, 32)
    prefill(model, cache, PROMPTS)
    assert cache.next_positions().tolist() == [5, 9]

    block = torch.randint(V, (2, 5), generator=g)
    logits = append(model, cache, block)
    for b in range(2):  # the padding past a short prompt is never attended
        for j in range(5):
            assert_logits(logits[b, j], model, PROMPTS[b] + block[b, : j + 1].tolist())
    n = torch.tensor([2, 4])
    cache.keep_block(5, None, n)
    assert cache.next_positions().tolist() == [7, 13]

    new = torch.tensor([[11], [23]])
    logits = append(model, cache, new)
    for b in range(2):
        assert_logits(logits[b, 0], model, PROMPTS[b] + block[b, : n[b]].tolist() + new[b].tolist())

    # truncating back into the prompt (a rejected first token) forgets everything after the cut
    cache.truncate(torch.tensor([3, 9]))
    logits = append(model, cache, new)
    assert_logits(logits[0, 0], model, PROMPTS[0][:3] + [11])
    assert_logits(logits[1, 0], model, PROMPTS[1] + [23])


def test_gather_tree_path():
    model = lm(3)
    g = torch.Generator().manual_seed(1)
    cache = model.new_cache(2, 32)
    prefill(model, cache, PROMPTS)
    tree = Tree(torch.tensor(TREES), max_depth=3, max_children=2)
    tokens = torch.randint(V, (2, 7), generator=g)
    logits = append(model, cache, tokens, tree.depths, tree.ancestor_mask)
    check_tree_block(model, logits, PROMPTS, TREES, tokens)

    idx, n = padded_paths(PATHS)
    cache.keep_block(7, idx, n)
    assert cache.next_positions().tolist() == [5 + 3, 9 + 2]
    new = torch.tensor([[17], [2]])
    logits = append(model, cache, new)
    for b in range(2):
        assert_logits(logits[b, 0], model, PROMPTS[b] + tokens[b, PATHS[b]].tolist() + new[b].tolist())


def test_tree_fed_in_two_forwards():
    """R > 0: a tree appended level by level (as drafters do) sees its earlier uncommitted nodes."""
    model = lm(3)
    g = torch.Generator().manual_seed(2)
    cache = model.new_cache(2, 32)
    prefill(model, cache, PROMPTS)
    tree = Tree(torch.tensor(TREES), max_depth=3, max_children=2)
    tokens = torch.randint(V, (2, 7), generator=g)
    start = cache.next_positions()[:, None]
    mask, depths = tree.ancestor_mask, tree.depths
    first = model(tokens[:, :4], start + depths[:, :4], cache, mask[:, :4, :4]).logits
    second = model(tokens[:, 4:], start + depths[:, 4:], cache, mask[:, 4:, :]).logits  # (B, 3, 7) mask
    check_tree_block(model, torch.cat([first, second], 1), PROMPTS, TREES, tokens)


def stream(model, cache, seq, block, sink, window):
    """Append seq (B, N) ``block`` tokens per forward, committing each block (which may evict), and
    compare every logit with a recompute of the visible context."""
    B, N = seq.shape
    for t in range(0, N, block):
        chunk = seq[:, t : t + block]
        T = chunk.shape[1]
        logits = append(model, cache, chunk)
        for b in range(B):
            before = visible(seq[b, :t].tolist(), sink, window)
            for j in range(T):
                assert_logits(logits[b, j], model, before + chunk[b, : j + 1].tolist())
        cache.keep_block(T, None, torch.full((B,), T))
        assert cache.next_positions().tolist() == [min(t + T, sink + window)] * B
    return logits


# Rolling caches are compared with a recompute on a 1-layer model. With one layer the cached keys
# and values are functions of the token alone (keys rotated on read by their new position), so the
# kept entries are exactly what a recompute of the visible tokens produces. With more layers the
# keys and values of deeper layers carry information from evicted tokens (they were computed while
# those tokens were visible): that is inherent to StreamingLLM, and no cache can equal a recompute.

@pytest.mark.parametrize("sink,window,block", [(4, 16, 1), (4, 16, 3), (0, 8, 3)])
def test_rolling_matches_recompute(sink, window, block):
    model = lm(1)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(V, (2, 61), generator=g)
    cache = model.new_cache(2, block, sink=sink, window=window)
    logits = stream(model, cache, seq, block, sink, window)
    if sink:  # the kept tokens really are re-positioned: at their original positions the logits differ
        context = visible(seq[0, :-1].tolist(), sink, window) + seq[0, -1:].tolist()
        original = list(range(sink)) + list(range(61 - window - 1, 61))
        assert (scratch(model, context, original)[-1] - logits[0, -1]).abs().max() > 10 * ATOL


def test_rolling_without_eviction_equals_static_cache():
    """Multi-layer: as long as nothing is evicted the rolling cache is the static cache, exactly."""
    sink, window = 4, 16
    model = lm(3)
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(V, (2, sink + window), generator=g)
    static = model.new_cache(2, sink + window)
    rolling = model.new_cache(2, 3, sink=sink, window=window)
    for t in range(0, seq.shape[1], 3):
        chunk = seq[:, t : t + 3]
        logits = append(model, rolling, chunk)
        assert torch.equal(logits, append(model, static, chunk))
        for b in range(2):
            assert_logits(logits[b, -1], model, seq[b, : t + chunk.shape[1]].tolist())
        n = torch.full((2,), chunk.shape[1])
        static.keep_block(chunk.shape[1], None, n)
        rolling.keep_block(chunk.shape[1], None, n)
    assert rolling.next_positions().tolist() == [sink + window] * 2


def test_rolling_with_tree():
    sink, window = 4, 16
    model = lm(1)
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(V, (2, 25), generator=g)
    cache = model.new_cache(2, 7, sink=sink, window=window)
    stream(model, cache, seq, 5, sink, window)  # full: 20 tokens kept of 25
    contexts = [visible(seq[b].tolist(), sink, window) for b in range(2)]

    tree = Tree(torch.tensor(TREES), max_depth=3, max_children=2)
    tokens = torch.randint(V, (2, 7), generator=g)
    logits = append(model, cache, tokens, tree.depths, tree.ancestor_mask)
    check_tree_block(model, logits, contexts, TREES, tokens)

    idx, n = padded_paths(PATHS)
    cache.keep_block(7, idx, n)  # 23 and 22 tokens: both rows evict
    assert cache.next_positions().tolist() == [sink + window] * 2
    new = torch.tensor([[9], [30]])
    logits = append(model, cache, new)
    for b in range(2):
        committed = seq[b].tolist() + tokens[b, PATHS[b]].tolist()
        assert_logits(logits[b, 0], model, visible(committed, sink, window) + new[b].tolist())


def test_rolling_rows_evict_at_different_times():
    sink, window = 2, 8
    model = lm(1)
    g = torch.Generator().manual_seed(6)
    prompts = [[5, 7], [1, 2, 3, 4, 5], [8, 8, 9, 9, 10, 10, 11, 11], list(range(15, 28))]
    cache = model.new_cache(4, 7, sink=sink, window=window)
    prefill(model, cache, prompts)  # the 13-token prompt is already cut to 2 + 8
    committed = [list(p) for p in prompts]
    trees = [TREES[b % 2] for b in range(4)]
    tree = Tree(torch.tensor(trees), max_depth=3, max_children=2)
    first_eviction = [None] * 4
    for step in range(6):
        contexts = [visible(c, sink, window) for c in committed]
        assert cache.next_positions().tolist() == [len(c) for c in contexts]
        tokens = torch.randint(V, (4, 7), generator=g)
        logits = append(model, cache, tokens, tree.depths, tree.ancestor_mask)
        check_tree_block(model, logits, contexts, trees, tokens)  # node 0: the next-token logits
        leaves = torch.randint(7, (4,), generator=g).tolist()
        paths = [node_path(trees[b], leaves[b]) for b in range(4)]
        idx, n = padded_paths(paths)
        cache.keep_block(7, idx, n)
        for b in range(4):
            if first_eviction[b] is None and len(contexts[b]) + len(paths[b]) > sink + window:
                first_eviction[b] = step
            committed[b] += tokens[b, paths[b]].tolist()
    assert None not in first_eviction and len(set(first_eviction)) >= 3, first_eviction


def test_rolling_memory_is_constant():
    sink, window, block, total = 4, 64, 8, 10_000
    model = lm(1)
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(V, (2, total), generator=g)
    cache = model.new_cache(2, block, sink=sink, window=window)
    buffers = [(buf.data_ptr(), buf.nbytes) for buf in (cache.k, cache.v)]
    nbytes = cache.nbytes()
    checked = 0
    for t in range(0, total, block):
        chunk = seq[:, t : t + block]
        logits = append(model, cache, chunk)
        if t % 2000 == 0 or t + block >= total:  # a recompute now and then, and at the end
            for b in range(2):
                assert_logits(logits[b, -1], model, visible(seq[b, :t].tolist(), sink, window)
                              + chunk[b].tolist())
            checked += 1
        cache.keep_block(block, None, torch.full((2,), block))
        assert [(buf.data_ptr(), buf.nbytes) for buf in (cache.k, cache.v)] == buffers
        assert cache.nbytes() == nbytes
        assert int(cache.lengths.max()) <= sink + window
        assert int(cache.next_positions().max()) <= sink + window
    assert checked == 6


def test_block_past_max_len_raises():
    model = lm(1)
    cache = model.new_cache(2, 8)
    append(model, cache, torch.zeros(2, 6, dtype=torch.long))
    cache.truncate(torch.tensor([6, 2]))
    with pytest.raises(ValueError, match="max_len"):
        append(model, cache, torch.zeros(2, 3, dtype=torch.long))  # row 0 would need 9 slots
    assert cache.next_positions().tolist() == [6, 2], "a refused block leaves the cache as it was"
    append(model, cache, torch.zeros(2, 2, dtype=torch.long))  # exactly full: fine

    rolling = model.new_cache(1, 3, sink=2, window=4)  # room for 2 + 4 kept tokens and a block of 3
    append(model, rolling, torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len"):
        append(model, rolling, torch.zeros(1, 4, dtype=torch.long))
