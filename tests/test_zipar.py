"""ZipAR's two orders (``NextSetSchedule(mode=...)``) against what they claim, on a stub target
whose tokens encode positions.

The stub wraps a tiny LlamaGen (so the schedule's position-addressed cache is written as for a
real model) but answers with a point mass: the token fed at position x, itself the token of
position c, predicts token ``(x + 1) + M * c``. Every generated token therefore says which
position it was decoded for and which position's token was fed to decode it: for a row's first
token, the seed. The reference order is transcribed, independently of the schedule, from the
public LlamaGen ZipAR code (``decode_n_tokens_zipar`` at ThisisBillhe/ZipAR@2a5695ca).
"""

import pytest
import torch

from mmspec.core import JacobiDrafter, LogitsProcessor, SpeculativeDecoder
from mmspec.core.schedule import NextSetSchedule
from mmspec.core.types import ModelOutput
from mmspec.models.llamagen import LlamaGenModel

P = 1  # class-conditional prompt: the class id at position 0
M = 40  # positions < M


class PositionStub:
    """Target whose token for position x + 1 is ``(x + 1) + M * code(input)``, code = token % M."""

    def __init__(self, grid):
        torch.manual_seed(0)
        self.model = LlamaGenModel(vocab_size=M * M, grid_size=grid, num_classes=4, dim=16, n_layers=1,
                                   n_heads=2, mlp_hidden=32).eval()
        self.vocab_size = M * M

    def new_cache(self, batch_size, max_len):
        return self.model.new_cache(batch_size, max_len)

    def __call__(self, tokens, positions, cache, tree_mask=None, **conditioning):
        out = self.model(tokens, positions, cache, tree_mask, **conditioning)  # writes the cache
        answer = (positions + 1) + M * (tokens % M)  # (B, T)
        logits = torch.full_like(out.logits, -1e4).scatter(-1, answer[..., None], 0.0)
        return ModelOutput(logits=logits)


def reference_order(H, W, s):
    """(cells decoded per pass, seed cell of each row r >= 1) of the public LlamaGen ZipAR code:
    row 0 runs alone (prefill + W - 1 passes); then each pass samples one token for every row in
    flight, in row order; when row r reaches s tokens, row r + 1 is queued with the latest token
    of row r - 1 (the code sums the token counts of rows 0 .. r - 1); rows join the next pass."""
    passes = [[(0, c)] for c in range(W)]
    count = [W] + [0] * (H - 1)
    ongoing, seeds = [1], {1: (0, W - 1)}
    while sum(count) < H * W:
        step = []
        for r in list(ongoing):
            step.append((r, count[r]))
            count[r] += 1
            if count[r] == s and r + 1 < H and r + 1 not in ongoing:
                seeds[r + 1] = (r - 1, count[r - 1] - 1)
                ongoing.append(r + 1)
        ongoing = [r for r in ongoing if count[r] < W]
        passes.append(step)
    return passes, seeds


def paper_order(H, W, s):
    """The paper's order: row r + 1 starts once row r has s tokens, seeded with row r's latest."""
    passes = [[(0, 0)]]
    count = [1] + [0] * (H - 1)
    seeds = {}
    while sum(count) < H * W:
        step = []
        for r in range(H):
            if count[r] == 0 and r >= 1 and count[r - 1] >= s:
                seeds[r] = (r - 1, count[r - 1] - 1)
            if (count[r] > 0 or r in seeds) and count[r] < W:
                step.append((r, count[r]))
        for r, c in step:
            count[r] += 1
        passes.append(step)
    return passes, seeds


def decode(H, W, s, mode, drafter=None):
    stub = PositionStub(max(H, W))
    record = []

    def cells(state):
        lengths = state.lengths[:H]
        return (lengths - torch.tensor([P] + [1] * (H - 1))).clamp(0, W).tolist()  # a window may run past W

    dec = SpeculativeDecoder(stub, drafter, processor=LogitsProcessor(temperature=0.0),
                             schedule=NextSetSchedule(H, W, s, mode=mode))
    out = dec.generate([[0]], H * W, callback=lambda step, state: record.append(cells(state)))
    counts = [[1] + [0] * (H - 1)] + record  # after the prefill, then after every pass
    passes = [[(0, 0)]] + [[(r, c) for r in range(H) for c in range(before[r], after[r])]
                           for before, after in zip(counts, counts[1:])]
    return out, passes


def pos(cell, W):
    return P + cell[0] * W + cell[1]


@pytest.mark.parametrize("H,W,s", [(4, 4, 1), (4, 4, 2), (5, 5, 1), (5, 5, 2), (5, 5, 3), (5, 5, 4), (6, 4, 3),
                                   (3, 5, 2), (2, 4, 1)])
@pytest.mark.parametrize("mode", ["paper", "reference"])
def test_decode_order_seeds_and_nfe(H, W, s, mode):
    out, passes = decode(H, W, s, mode)
    want_passes, seeds = (reference_order if mode == "reference" else paper_order)(H, W, s)
    assert passes == want_passes
    assert out.stats.target_forwards == len(want_passes) == NextSetSchedule.closed_form_nfe(H, W, s, mode)
    grid = out.sequences[0].view(H, W)
    assert (grid % M).flatten().tolist() == [P + i for i in range(H * W)]  # each token knows its cell
    fed = grid // M  # the position of the token fed to decode it
    for r in range(H):
        for c in range(W):
            src = seeds[r] if (c == 0 and r >= 1) else ((r, c - 1) if c >= 1 else None)
            assert int(fed[r, c]) == (0 if src is None else pos(src, W)), (r, c)


def test_reference_seeds_from_two_rows_up():
    """The point of the mode: with s < W, row r >= 2's first token is decoded from row r-2's token."""
    _, seeds = reference_order(5, 5, 2)
    assert seeds == {1: (0, 4), 2: (0, 4), 3: (1, 3), 4: (2, 3)}
    out, _ = decode(5, 5, 2, "reference")
    fed = (out.sequences[0].view(5, 5) // M)[:, 0].tolist()
    assert fed == [0, pos((0, 4), 5), pos((0, 4), 5), pos((1, 3), 5), pos((2, 3), 5)]


@pytest.mark.parametrize("mode", ["paper", "reference"])
def test_full_window_is_raster_order_in_both_modes(mode):
    """With s = W every row starts once the row above is complete: in the reference mode too, row
    r is then seeded by row r-1's own last token (the slot's real token), so this is raster AR."""
    out, passes = decode(4, 4, 4, mode)
    assert passes == [[(r, c)] for r in range(4) for c in range(4)]
    assert out.stats.target_forwards == 16 == NextSetSchedule.closed_form_nfe(4, 4, 4, mode)
    assert (out.sequences[0] // M).tolist() == list(range(16))  # each token decoded from its predecessor


def test_reference_mode_runs_a_jacobi_window_per_row():
    out, passes = decode(4, 4, 2, "reference", JacobiDrafter(M * M, 3, init="repeat"))
    assert (out.sequences[0] % M).tolist() == [P + i for i in range(16)]
    assert sorted(c for p in passes for c in p) == [(r, c) for r in range(4) for c in range(4)]
    assert out.stats.target_forwards <= NextSetSchedule.closed_form_nfe(4, 4, 2, "reference")


def test_mode_is_checked():
    with pytest.raises(ValueError, match="mode must be one of 'paper', 'reference', got 'code'"):
        NextSetSchedule(4, 4, 2, mode="code")
    with pytest.raises(ValueError, match="mode must be one of"):
        NextSetSchedule.closed_form_nfe(4, 4, 2, "lumina")
