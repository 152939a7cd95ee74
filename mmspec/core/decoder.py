"""The one decoding loop: propose -> verify in one target pass -> accept -> commit -> emit.

Every method in mmspec is this loop with a different drafter, acceptance rule or logits
pipeline. Target-only decoding is the same loop with ``NullDrafter`` (nothing to verify but the
root), so the baseline and the methods share every line of cache and sampling code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .acceptance import GreedyMatch, SpeculativeSampling
from .errors import check
from .logits import LogitsPipeline
from .stats import Stats
from .types import Drafter, Target


@dataclass
class DecodeState:
    """What drafters may read: every target row's token history and the sampling setup.

    With guidance the target runs ``R = 2B`` rows, ``[cond; uncond]``; both halves receive the same
    generated tokens, so ``tokens[:B]`` and ``tokens[B:]`` differ only in their prompts.
    """

    tokens: torch.Tensor  # (R, capacity) prompt then generated tokens, garbage past lengths
    lengths: torch.Tensor  # (R,)
    batch_size: int
    logits: LogitsPipeline
    generator: torch.Generator | None
    max_len: int  # slots a cache needs for this call (prompt + new tokens + two blocks)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def roots(self) -> torch.Tensor:
        """(B,) each row's last token: emitted, but not yet in the target's cache."""
        B = self.batch_size
        return self.tokens[torch.arange(B, device=self.tokens.device), self.lengths[:B] - 1]

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """(B, ...) -> (R, ...): the uncond half of a guided batch mirrors the cond half."""
        return x if self.rows == self.batch_size else torch.cat([x, x], 0)


@dataclass
class DecodeOutput:
    sequences: torch.Tensor  # (B, max_new_tokens) generated tokens, pad_token_id after the end
    lengths: torch.Tensor  # (B,) generated tokens per row (EOS included)
    stats: Stats


def pad_prompts(prompts, pad: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, S) tensor or a list of 1-D token sequences -> right-padded (B, S) ids and lengths."""
    if isinstance(prompts, torch.Tensor):
        check(prompts.dim() == 2 and prompts.shape[1] >= 1, "input_ids", "a (batch, length>=1) tensor",
              tuple(prompts.shape))
        return prompts.to(device), torch.full((prompts.shape[0],), prompts.shape[1], device=device)
    seqs = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    check(len(seqs) > 0 and all(len(s) > 0 for s in seqs), "input_ids", "non-empty token sequences",
          [len(s) for s in seqs])
    ids = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids.to(device), torch.tensor([len(s) for s in seqs], device=device)


class NullDrafter:
    """Proposes nothing: the loop then decodes one target token per pass (the baseline)."""

    vocab_size = None
    max_block = 1
    forwards = 0

    def start(self, state):
        pass

    def propose(self, state):
        from .tree import DraftTree, Tree

        B = state.batch_size
        empty = torch.zeros(B, 0, dtype=torch.long, device=state.tokens.device)
        return DraftTree(empty, Tree(empty, max_depth=0, max_children=0))

    def update(self, state, draft, acceptance, target_probs, target_out):
        pass


class SpeculativeDecoder:
    """Speculative decoding over any ``Target`` with any ``Drafter`` and acceptance rule.

    Args:
        target: scores blocks with a KV cache (``mmspec.core.types.Target``).
        drafter: proposes chains or trees; ``None`` decodes with the target alone.
        rule: acceptance rule; defaults to ``GreedyMatch`` for greedy logits and lossless
            ``SpeculativeSampling`` otherwise.
        logits: the logits pipeline shared by draft and target.
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, rule=None,
                 logits: LogitsPipeline | None = None):
        self.target = target
        self.drafter = drafter if drafter is not None else NullDrafter()
        self.logits = logits if logits is not None else LogitsPipeline()
        self.rule = rule if rule is not None else (GreedyMatch() if self.logits.greedy else SpeculativeSampling())
        dv = self.drafter.vocab_size
        check(dv is None or dv == target.vocab_size, "drafter.vocab_size",
              f"equal to the target's vocabulary size ({target.vocab_size})", dv)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, *, uncond_input_ids=None,
                 generator: torch.Generator | None = None, eos_token_id: int | None = None,
                 pad_token_id: int = 0,
                 callback: Callable[[int, DecodeState], None] | None = None) -> DecodeOutput:
        """Generate up to ``max_new_tokens`` per row.

        Args:
            input_ids: (B, S) tensor or a list of B token sequences of any lengths.
            uncond_input_ids: the unconditional prompts for classifier-free guidance (same forms);
                required exactly when the logits pipeline has a guidance scale.
            generator: the only source of randomness.
            eos_token_id: a row stops after emitting it.
            pad_token_id: fills ``sequences`` after each row's end (any int; never fed to a model).
            callback: called after every decode pass with (step, state).
        """
        check(isinstance(max_new_tokens, int) and max_new_tokens >= 1, "max_new_tokens", "an int >= 1",
              max_new_tokens)
        guided = self.logits.uses_guidance
        if guided and uncond_input_ids is None:
            raise ValueError("uncond_input_ids must be given when guidance_scale is set "
                             f"(guidance_scale={self.logits.guidance_scale}); or set guidance_scale=None")
        if not guided and uncond_input_ids is not None:
            raise ValueError("uncond_input_ids is only used with guidance: set guidance_scale or drop it")
        device = _device_of(self.target)
        ids, lens = pad_prompts(input_ids, 0, device)  # padding is cut from caches, never attended
        B = ids.shape[0]
        if guided:
            uids, ulens = pad_prompts(uncond_input_ids, 0, device)
            check(uids.shape[0] == B, "uncond_input_ids", f"{B} sequences (one per prompt)", uids.shape[0])
            width = max(ids.shape[1], uids.shape[1])
            ids = torch.cat([_pad_to(ids, width, 0), _pad_to(uids, width, 0)])
            lens = torch.cat([lens, ulens])
        block = self.drafter.max_block
        capacity = ids.shape[1] + max_new_tokens + 2 * block + 1
        history = torch.full((ids.shape[0], capacity), 0, dtype=torch.long, device=device)
        history[:, : ids.shape[1]] = ids
        state = DecodeState(history, lens.clone(), B, self.logits, generator, capacity)
        stats = Stats()
        draft_forwards_before = self.drafter.forwards
        cache = self.target.new_cache(state.rows, capacity)

        # 1. prefill the prompts; the first token comes from the target alone
        with stats.timed("prefill", device):
            positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
            out = self.target(ids, positions, cache)
            cache.truncate(lens)
            last = out.logits[torch.arange(state.rows, device=device), lens - 1]  # (R, V)
            first = self.rule.sample(self.logits(last), generator)  # (B,)
            stats.target_forwards += 1
            self._emit(state, first[:, None], torch.ones(B, dtype=torch.long, device=device))
            self.drafter.start(state)

        prompt_lens = lens[:B]
        done = self._finished(state, prompt_lens, max_new_tokens, eos_token_id)
        step = 0
        while not bool(done.all()):
            # 2. draft a chain or tree from every row's root
            with stats.timed("draft", device):
                draft = self.drafter.propose(state)
                tree = draft.tree
                tokens = torch.cat([state.roots[:, None], draft.tokens], 1)  # (B, T)
                T = tokens.shape[1]
                positions = cache.next_positions()[:, None] + state.expand(tree.depths)
                mask = None if tree.is_chain else state.expand(tree.ancestor_mask)
            # 3. verify every drafted token in one target pass
            with stats.timed("verify", device):
                out = self.target(state.expand(tokens), positions, cache, mask)
                probs = self.logits(out.logits)  # (B, T, V)
                stats.target_forwards += 1
            # 4. accept
            with stats.timed("accept", device):
                acc = self.rule(draft, probs, generator)
            # 5. commit caches and emit the accepted tokens plus the next token
            with stats.timed("commit", device):
                # the root and the accepted drafts enter the cache; finished rows stop growing
                keep = torch.where(done, 0, acc.num_accepted + 1)
                idx = None if tree.is_chain else state.expand(acc.path.clamp(min=0))
                cache.keep_block(T, idx, state.expand(keep))
                self.drafter.update(state, draft, acc, probs, out)
                path_tokens = tokens.gather(1, acc.path[:, 1:].clamp(min=0))  # (B, D)
                new = torch.cat([path_tokens, path_tokens.new_zeros(B, 1)], 1)
                new.scatter_(1, acc.num_accepted[:, None], acc.next_token[:, None])
                stats.record_step(keep)
                self._emit(state, new, keep)
                done = self._finished(state, prompt_lens, max_new_tokens, eos_token_id)
            step += 1
            if callback is not None:
                callback(step, state)

        stats.draft_forwards = self.drafter.forwards - draft_forwards_before
        sequences, out_lens = self._collect(state, prompt_lens, max_new_tokens, eos_token_id, pad_token_id)
        return DecodeOutput(sequences, out_lens, stats)

    @staticmethod
    def _emit(state: DecodeState, new: torch.Tensor, count: torch.Tensor) -> None:
        """Append ``new[b, :count[b]]`` to every target row's history (both CFG halves)."""
        new, count = state.expand(new), state.expand(count)
        cols = state.lengths[:, None] + torch.arange(new.shape[1], device=new.device)
        state.tokens.scatter_(1, cols.clamp(max=state.tokens.shape[1] - 1), new)
        state.lengths = state.lengths + count

    @staticmethod
    def _finished(state, prompt_lens, max_new, eos):
        B = state.batch_size
        done = state.lengths[:B] - prompt_lens >= max_new
        if eos is not None:
            gen = torch.arange(state.tokens.shape[1], device=prompt_lens.device)
            produced = (gen >= prompt_lens[:, None]) & (gen < state.lengths[:B, None])
            done |= ((state.tokens[:B] == eos) & produced).any(1)
        return done

    @staticmethod
    def _collect(state, prompt_lens, max_new, eos, pad):
        B = state.batch_size
        cols = prompt_lens[:, None] + torch.arange(max_new, device=prompt_lens.device)
        seq = state.tokens[:B].gather(1, cols.clamp(max=state.tokens.shape[1] - 1))
        n = (state.lengths[:B] - prompt_lens).clamp(max=max_new)
        if eos is not None:
            is_eos = seq == eos
            first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, max_new)
            n = torch.minimum(n, first)
        seq = torch.where(torch.arange(max_new, device=seq.device) < n[:, None], seq, pad)
        return seq, n


def _pad_to(ids: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=pad)


def _device_of(target) -> torch.device:
    if getattr(target, "device", None) is not None:
        return torch.device(target.device)
    try:
        return next(target.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")
