"""Decoding schedules: which positions the one loop decodes at each pass.

The decoder runs over *lanes*: sequences that each grow by "root + drafts -> accepted tokens +
next token" every pass. ``RasterSchedule`` has one lane per prompt (plain next-token order, the
default). ``NextSetSchedule`` gives every image row its own lane (ZipAR's next-set decoding), so
one pass advances several rows, each with its own root and (optionally) its own Jacobi window;
the lanes of one image share a position-addressed cache (``SlotKVCache``).

A schedule is a stateless factory (``mmspec.core.types.DecodingSchedule``): ``start`` checks a
call's arguments and returns that call's ``SchedulePlan``, which supplies the lanes' prompts, the
target view and cache the loop talks to, which lanes are fed and which emit at each pass, when
each lane is finished and how the lanes' tokens form each output sequence. Drafters and
acceptance rules see lanes as rows.
"""

from __future__ import annotations

import torch

from .cache import SlotKVCache
from .tokens import gather_tokens, token_mask
from .errors import check, check_choice, check_int, is_int
from .types import Drafter, ModelOutput


class RasterSchedule:
    """Next-token order: one lane per prompt, the loop's historical behaviour."""

    lanes = 1

    def check_drafter(self, drafter: Drafter) -> None:
        pass

    def start(self, input_ids, lengths, max_new_tokens: int, eos_token_id) -> "RasterPlan":
        return RasterPlan(input_ids, lengths, max_new_tokens, eos_token_id)


class RasterPlan:
    """One call in raster order: each row stops after ``max_new_tokens`` or at any EOS id."""

    def __init__(self, input_ids, lengths, max_new_tokens: int, eos_token_id):
        self.input_ids, self.lengths, self.lane_tokens = input_ids, lengths, max_new_tokens
        self.prompt_lens = lengths.clone()  # (R,)
        self.eos = None if eos_token_id is None else torch.tensor(eos_token_id, device=lengths.device)

    def bind(self, target, state):
        return target, target.new_cache(state.rows, state.max_len)

    def prefill_rows(self, state):
        return None

    def restart_rows(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Continuous batching (``SpeculativeDecoder.serve``): target rows ``rows`` now hold new
        prompts of ``lengths``; their generated tokens are counted from there."""
        self.prompt_lens = self.prompt_lens.clone()
        self.prompt_lens[rows] = lengths.to(self.prompt_lens)

    def step(self, state, done):
        """(fed, emitting) lanes for this pass; finished lanes are fed but keep nothing."""
        return ~done, ~done

    def emitting_rows(self, emitting):
        return None

    def per_output(self, emitted):
        return emitted

    def finished(self, state):
        B = state.batch_size
        prompt_lens = self.prompt_lens[:B]
        done = state.lengths[:B] - prompt_lens >= self.lane_tokens
        if self.eos is not None:
            gen = torch.arange(state.tokens.shape[1], device=prompt_lens.device)
            produced = (gen >= prompt_lens[:, None]) & (gen < state.lengths[:B, None])
            done |= (torch.isin(state.tokens[:B], self.eos) & produced).any(1)
        return done

    def collect(self, state, pad):
        B, max_new = state.batch_size, self.lane_tokens
        prompt_lens = self.prompt_lens[:B]
        cols = prompt_lens[:, None] + torch.arange(max_new, device=prompt_lens.device)
        seq = gather_tokens(state.tokens[:B], cols.clamp(max=state.tokens.shape[1] - 1))  # (B, max_new[, *s])
        n = (state.lengths[:B] - prompt_lens).clamp(max=max_new)
        if self.eos is not None:
            is_eos = torch.isin(seq, self.eos)
            first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, max_new)
            n = torch.minimum(n, first)
        seq = torch.where(token_mask(torch.arange(max_new, device=seq.device) < n[:, None], seq), seq, pad)
        return seq, n


class NextSetSchedule:
    """ZipAR's next-set decoding (He et al., 2025, "ZipAR: Parallel Auto-regressive Image
    Generation through Spatial Locality"): a row of the token grid starts once the row above has
    ``window`` tokens, and every pass advances all rows in flight.

    Each row is a lane. Row 0's lane holds the prompt and then its W tokens. Row r >= 1 starts with
    a *seed* fed at the position of (r-1, W-1), the raster predecessor of (r, 0); that slot is
    overwritten once row r-1's real last token is written. ``mode`` says when rows start and
    what seeds them:

    - ``"paper"``: row r starts once row r-1 has ``window`` tokens, seeded with row r-1's latest
      token (the paper's rule: (r, j) sees row r-1 up to column j + window - 1).
      ``NFE = (H - 1) * window + W``.
    - ``"reference"``: the public LlamaGen code's order: row 1 starts only once row 0 is complete,
      row r >= 2 once row r-1 has ``window`` tokens, seeded with row r-2's latest token (its
      bookkeeping indexes the row two above); should row r-1 be complete already (a Jacobi window
      can finish it in one pass), its own last token seeds instead, the slot's real token.
      ``NFE = 2W + (H - 2) * window`` (W for one row).

    Queries attend to written slots before their own position (empty slots are hidden in both
    modes: the paper's rule; the reference LlamaGen code attends to their zeros) and to the roots
    of other rows fed in the same pass that precede them in raster order. A finished row's last
    token is fed once more so that later rows see it. ``window = W`` is raster order (``H * W``
    passes) in both modes.

    Pure ZipAR decodes one token per row per pass (NFE above, prefill included). With a Jacobi
    drafter each row runs its own SJD window (``zipar+sjd``); drafts past a row's end are never
    kept. The lanes of one image draw their randomness from that image's generator.

    The schedule holds only its knobs; each call's state lives in the ``NextSetPlan`` that
    ``start`` returns, so one schedule object serves concurrent or nested calls.

    Args:
        grid_height: rows of the token grid (H; raster order).
        grid_width: tokens per row (W).
        window: ZipAR's ``s`` in [1, W]; the reference's LlamaGen default is 8 (for W = 24).
        mode: ``"paper"`` or ``"reference"`` (above).
    """

    MODES = ("paper", "reference")

    def __init__(self, grid_height: int, grid_width: int, window: int, mode: str = "paper"):
        check_int(grid_height, "grid_height", 1)
        check_int(grid_width, "grid_width", 1)
        check(is_int(window) and 1 <= window <= grid_width, "window", f"an int in [1, grid_width={grid_width}]", window)
        check_choice("mode", mode, self.MODES)
        self.H, self.W, self.window, self.mode = grid_height, grid_width, window, mode
        self.lanes = grid_height

    @staticmethod
    def closed_form_nfe(grid_height: int, grid_width: int, window: int, mode: str = "paper") -> int:
        """Target passes of pure ZipAR, prefill included."""
        check_choice("mode", mode, NextSetSchedule.MODES)
        if mode == "reference" and grid_height >= 2:
            return 2 * grid_width + (grid_height - 2) * window
        return (grid_height - 1) * window + grid_width

    def check_drafter(self, drafter: Drafter) -> None:
        check(drafter.lane_safe, "drafter",
              "a model-free chain drafter (none or JacobiDrafter with init random|repeat) with the "
              "next-set schedule", type(drafter).__name__)

    def start(self, input_ids, lengths, max_new_tokens: int, eos_token_id) -> "NextSetPlan":
        check(eos_token_id is None, "eos_token_id", "None with the next-set schedule (a grid has a fixed size)",
              None if eos_token_id is None else list(eos_token_id))
        check(max_new_tokens == self.H * self.W, "max_new_tokens",
              f"the grid's token count H * W = {self.H * self.W} with the next-set schedule", max_new_tokens)
        return NextSetPlan(self, input_ids, lengths)


class NextSetPlan:
    """One call of the next-set schedule: the lanes' geometry, which lanes the pending block fed,
    and the shared cache."""

    def __init__(self, schedule: NextSetSchedule, ids: torch.Tensor, lens: torch.Tensor):
        self.H, self.W, self.window, self.mode = schedule.H, schedule.W, schedule.window, schedule.mode
        self.lane_tokens = self.W
        # (R, S) prompts -> (R * H, S) lane prompts: row 0's lane gets the prompt, others nothing
        R, S = ids.shape
        lane_ids = torch.zeros(R, self.H, S, dtype=ids.dtype, device=ids.device)
        lane_ids[:, 0] = ids
        lane_lens = torch.zeros(R, self.H, dtype=lens.dtype, device=lens.device)
        lane_lens[:, 0] = lens
        self.prompt_lens = lens  # (R,) per target row (the CFG halves may differ)
        self.fed = lane_lens.flatten() > 0  # the prefill feeds row 0's lanes only
        self.input_ids, self.lengths = lane_ids.flatten(0, 1), lane_lens.flatten()

    def bind(self, target, state):
        R, H, W = state.rows // self.H, self.H, self.W
        device = state.tokens.device
        r = torch.arange(H, device=device)
        P = self.prompt_lens[:, None]
        # history index i of lane r sits at position offset + i (row 0's lane starts at 0)
        self.offset = torch.where(r == 0, 0, P + r * W - 1).flatten()  # (R * H,)
        self.base = torch.where(r == 0, P, 1).flatten()  # history index of the lane's first token
        self.last_lane = (r == H - 1).repeat(R)
        span = int(self.prompt_lens.max()) + H * W + state.max_len
        geometry = target.new_cache(1, 1)
        slot = SlotKVCache(geometry.k.shape[0], R, geometry.k.shape[2], geometry.k.shape[4], span,
                           rope=geometry.rope, dtype=geometry.k.dtype, device=device)
        self.cache = _LaneCache(self, slot)
        return _LaneTarget(self, target), self.cache

    def _emitted(self, state):
        return (state.lengths - self.base).clamp(min=0)  # (R_lanes,)

    def _started(self, state):
        return state.lengths > 0

    def prefill_rows(self, state):
        B = state.batch_size
        return torch.arange(0, B, self.H, device=state.tokens.device)

    def step(self, state, done):
        """Start every lane whose upper row has enough tokens (its seed enters the history),
        then: fed = started and not finished; emitting = fed and its row is not complete."""
        B, H, W = state.batch_size, self.H, self.W
        e = self._emitted(state).view(-1, H)
        started = self._started(state).view(-1, H)
        need = torch.full((H - 1,), self.window, device=e.device)  # tokens row r-1 needs before row r
        if self.mode == "reference" and H > 1:
            need[0] = W  # row 1 waits for row 0 to complete
        go = torch.zeros_like(started)
        go[:, 1:] = ~started[:, 1:] & (e[:, :-1] >= need)
        if self.cache.slot.static or bool(go.any()):  # static shapes read nothing: a no-op without go
            lane = torch.arange(state.rows, device=e.device)
            upper = (lane - 1).clamp(min=0)  # lane r-1 of each lane
            if self.mode == "reference":  # row r-2's latest, unless row r-1 is complete already
                incomplete = self._emitted(state)[upper] < W
                upper = torch.where((lane % H >= 2) & incomplete, lane - 2, upper)
            last = self.base[upper] + self._emitted(state)[upper].clamp(max=W) - 1
            seed = state.tokens[upper, last]  # (R * H,)
            go = go.flatten()
            state.tokens[:, 0] = torch.where(go, seed, state.tokens[:, 0])
            state.lengths = torch.where(go, 1, state.lengths)
        started = self._started(state)[:B]
        fed = started & ~done
        emitting = fed & (self._emitted(state)[:B] < W)
        self.fed = state.expand(fed)
        return fed, emitting

    def emitting_rows(self, emitting):
        return emitting.nonzero().squeeze(1)

    def per_output(self, emitted):
        return emitted.view(-1, self.H).sum(1)

    def finished(self, state):
        B = state.batch_size
        complete = self._emitted(state)[:B] >= self.W
        cached = (self.cache.cached[:B] - self.base[:B]) >= self.W
        return complete & (cached | self.last_lane[:B])

    def collect(self, state, pad):
        B, H, W = state.batch_size, self.H, self.W
        cols = self.base[:B, None] + torch.arange(W, device=state.tokens.device)
        seq = state.tokens[:B].gather(1, cols).view(B // H, H * W)
        return seq, torch.full((B // H,), H * W, dtype=torch.long, device=seq.device)


class _LaneCache:
    """The decoder-facing cache of the next-set schedule: one entry count per lane over a shared
    ``SlotKVCache`` per target row."""

    def __init__(self, plan: NextSetPlan, slot: SlotKVCache):
        self.plan, self.slot = plan, slot
        self.cached = torch.zeros_like(plan.offset)  # history tokens of each lane in the cache
        self.packing = None  # (lane index (R, A), valid (R, A), T) of the pending block

    def next_positions(self) -> torch.Tensor:
        return self.plan.offset + self.cached

    def keep_block(self, block_size: int, idx, n: torch.Tensor) -> None:
        check(idx is None, "drafter", "a chain drafter with the next-set schedule", "a tree")
        sch = self.plan
        n = torch.minimum(n, (sch.base + sch.W - self.cached).clamp(min=0))  # never past the row's end
        lanes, valid, T = self.packing
        R, A = lanes.shape
        keep_lane = torch.arange(T, device=n.device) < n[:, None]  # (R * H, T)
        keep = keep_lane.view(R, sch.H, T).gather(1, lanes[..., None].expand(R, A, T)) & valid[..., None]
        self.slot.commit(keep.flatten(1))
        self.cached = self.cached + n
        self.packing = None

    def truncate(self, lengths: torch.Tensor) -> None:
        """After the prefill: keep each lane's prompt, drop its right padding."""
        self.keep_block(0, None, lengths - self.cached)

    def check_overflow(self) -> None:
        self.slot.check_overflow()


class _LaneTarget:
    """Packs the fed lanes of each target row into one block over the shared slot cache."""

    def __init__(self, plan: NextSetPlan, target):
        self.plan, self.target = plan, target
        self.vocab_size = target.vocab_size

    def __call__(self, tokens, positions, cache: _LaneCache, tree_mask=None, **conditioning) -> ModelOutput:
        sch = self.plan
        RL, T = tokens.shape
        H = sch.H
        R = RL // H
        device = tokens.device
        fed = sch.fed.view(R, H)
        A = H if cache.slot.static else max(1, int(fed.sum(1).max()))  # static: every lane's place, one shape
        lanes = (~fed).to(torch.int8).sort(dim=1, stable=True).indices[:, :A]  # fed lanes first, in row order
        valid = torch.arange(A, device=device) < fed.sum(1, keepdim=True)  # (R, A)
        pick = lanes[..., None].expand(R, A, T)
        tok = torch.where(valid[..., None], tokens.view(R, H, T).gather(1, pick), 0)  # padding: id 0 at 0
        pos = torch.where(valid[..., None], positions.view(R, H, T).gather(1, pick), 0)
        if tree_mask is None:
            tm = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(R, A, T, T)
        else:
            tm = tree_mask.view(R, H, T, T).gather(1, lanes[..., None, None].expand(R, A, T, T))
        lane_of = torch.arange(A * T, device=device) // T  # (A*T,) each lane's index T times
        t_of = torch.arange(T, device=device).repeat(A)
        same = lane_of[:, None] == lane_of[None, :]
        own = tm[:, lane_of[:, None], t_of[:, None], t_of[None, :]] & same  # (R, AT, AT)
        flat_pos = pos.flatten(1)
        key_ok = valid[..., None].expand(R, A, T).flatten(1) & (t_of == 0)  # other lanes' roots only
        cross = ~same & key_ok[:, None, :] & (flat_pos[:, None, :] < flat_pos[:, :, None])
        out = self.target(tok.flatten(1), flat_pos, cache.slot, own | cross, **conditioning)
        cache.packing = (lanes, valid, T)

        # padding slots go to a spare lane H, so an unfed lane reads zeros whatever the other rows
        # fed (a lane's garbage must not depend on the batch: row b alone decodes the same)
        dest = torch.where(valid, lanes, H)[..., None, None]  # (R, A, 1, 1)

        def unpack(x):
            full = x.new_zeros(R, H + 1, T, x.shape[-1])
            full.scatter_(1, dest.expand(R, A, T, x.shape[-1]), x.view(R, A, T, -1))
            return full[:, :H].flatten(0, 1)

        return ModelOutput(unpack(out.logits), None if out.hidden is None else unpack(out.hidden))
