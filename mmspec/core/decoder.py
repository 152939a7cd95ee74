"""The one decoding loop: propose -> verify in one target pass -> accept -> commit -> emit.

Every method in mmspec is this loop with a different drafter, acceptance rule or logits
pipeline. Target-only decoding is the same loop with ``NullDrafter`` (nothing to verify but the
root), so the baseline and the methods share every line of cache and sampling code.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .acceptance import GreedyMatch, SpeculativeSampling
from .distributions import DensityProcessor
from .drafters import EagleTreeDrafter, ModelTreeDrafter, NullDrafter
from .errors import check, check_int, is_int
from .fused import fused_acceptance
from .logits import LogitsProcessor
from .sampling import Generators, as_generators, repeat_rows, select_rows
from .schedule import RasterSchedule
from .stats import Stats
from .tokens import gather_tokens, scatter_tokens_
from .tree import DraftTree, Tree
from .types import (Acceptance, AcceptanceRule, DecodeState, DecodingSchedule, Drafter, ModelOutput, SchedulePlan,
                    Target)

__all__ = ["DecodeOutput", "DecodeState", "Job", "Served", "SpeculativeDecoder", "pad_prompts"]


@dataclass
class DecodeOutput:
    sequences: torch.Tensor  # (B, max_new_tokens[, *token_shape]) generated tokens, pad_token_id after the end
    lengths: torch.Tensor  # (B,) generated tokens per row (EOS included)
    stats: Stats


@dataclass
class Job:
    """One prompt of a continuous batch (``SpeculativeDecoder.serve``).

    Attributes:
        input_ids: its prompt, 1-D token ids (a sequence or a tensor).
        conditioning: keyword inputs of its prompt pass (a VLM's ``pixel_values`` for its own
            images), as ``generate(conditioning=...)`` takes them for a batch of one.
        uncond_input_ids: its unconditional prompt; required exactly when the logits processor
            has a guidance scale.
        generator: its randomness (``generate(generator=...)`` of the job alone); None: torch's
            global generator. Every job of a call has one, or none has.
    """

    input_ids: Any
    conditioning: Mapping[str, Any] | None = None
    uncond_input_ids: Any = None
    generator: torch.Generator | None = None


@dataclass
class Served:
    """A finished job of ``SpeculativeDecoder.serve``.

    Attributes:
        index: the job's index in ``jobs``.
        tokens: (n,) its generated tokens (EOS included when emitted), what ``generate`` of the job
            alone returns as ``sequences[0, :lengths[0]]``.
        counts: its generated-token count (at most ``len(tokens)``) after its prefill and after
            each pass it was decoded in (``counts[0] == 1``): the pass that committed each token
            (``mmspec.serve.passes.commit_passes``).
        target_forwards: its prefill plus the batch passes it was decoded in.
        stats: the call's running counters (all jobs; complete once the last job is served).
    """

    index: int
    tokens: torch.Tensor
    counts: list[int]
    target_forwards: int
    stats: Stats


@dataclass
class _Run:
    """What every pass of one call reads: its state, schedule plan, target view and cache."""

    state: DecodeState
    plan: SchedulePlan
    target: Target
    cache: Any
    stats: Stats
    device: torch.device


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


class SpeculativeDecoder:
    """Speculative decoding over any ``Target`` with any ``Drafter`` and acceptance rule.

    Args:
        target: scores blocks with a KV cache (``mmspec.core.types.Target``).
        drafter: proposes chains or trees (``mmspec.core.types.Drafter``; inherit ``DrafterBase``
            for its defaults); ``None`` decodes with the target alone.
        rule: acceptance rule (``AcceptanceRule``); defaults to ``GreedyMatch`` for greedy logits
            and lossless ``SpeculativeSampling`` otherwise.
        processor: the logits processor shared by draft and target (``LogitsProcessor``, or
            ``DensityProcessor`` for continuous tokens).
        schedule: which positions each pass decodes (``DecodingSchedule``, see
            ``mmspec.core.schedule``); default raster next-token order. Drafters and rules see the
            schedule's lanes as rows. A schedule keeps no per-call state, so decoders may share one.
        device: where the prompts, the history and the positions live; default the target's
            (its ``device``, else its first parameter's). A pipeline under model offload passes
            its execution device: its models sit on the CPU between calls.

    Continuous tokens: a target with a non-empty ``token_shape`` (e.g. ``(2, d)``) returns
    features (``ModelOutput.cond``) and per-token heads instead of logits; ``processor`` is then a
    ``DensityProcessor`` (the default), the rule one with ``continuous = True`` (speculative
    sampling on densities by default), drafts are chains and the order is raster. Prompts are still
    ids; the history holds them broadcast over the token shape in the target's ``token_dtype``.
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, rule: AcceptanceRule | None = None,
                 processor: LogitsProcessor | DensityProcessor | None = None,
                 schedule: DecodingSchedule | None = None,
                 device: torch.device | str | None = None):
        self.target = target
        self.device = None if device is None else torch.device(device)
        self.token_shape = tuple(getattr(target, "token_shape", ()))
        self.schedule = schedule if schedule is not None else RasterSchedule()
        self.drafter = drafter if drafter is not None else NullDrafter()
        if processor is None:
            processor = DensityProcessor() if self.token_shape else LogitsProcessor()
        self.processor = processor
        self.rule = rule if rule is not None else (GreedyMatch() if self.processor.greedy else SpeculativeSampling())
        for name, value, proto in (("drafter", self.drafter, Drafter), ("rule", self.rule, AcceptanceRule),
                                   ("schedule", self.schedule, DecodingSchedule)):
            check(isinstance(value, proto), name, f"a {proto.__name__} (members: {_members(proto)})",
                  type(value).__name__)
        if self.token_shape:
            self._check_continuous()
        else:
            check(isinstance(self.processor, LogitsProcessor), "processor",
                  "a LogitsProcessor for a token-id target (DensityProcessor is for continuous tokens)",
                  type(self.processor).__name__)
            check(not getattr(self.drafter, "token_shape", ()), "drafter",
                  "a drafter of token ids for a token-id target", type(self.drafter).__name__)
        dv = self.drafter.vocab_size
        check(dv is None or dv == target.vocab_size, "drafter.vocab_size",
              f"equal to the target's vocabulary size ({target.vocab_size})", dv)
        self.schedule.check_drafter(self.drafter)

    def _check_continuous(self) -> None:
        """What continuous tokens need of the other seams, refused with the reason."""
        shape = self.token_shape
        check(isinstance(self.processor, DensityProcessor), "processor",
              f"a DensityProcessor for continuous tokens (token_shape={shape})", type(self.processor).__name__)
        check(isinstance(self.schedule, RasterSchedule), "schedule",
              "RasterSchedule for continuous tokens (next-set orders need lane drafts of token ids)",
              type(self.schedule).__name__)
        check(getattr(self.rule, "continuous", False), "rule",
              "a rule that verifies densities (continuous = True, e.g. SpeculativeSampling) for continuous tokens",
              type(self.rule).__name__)
        d = self.drafter
        check(not isinstance(d, (ModelTreeDrafter, EagleTreeDrafter)), "drafter",
              "a chain drafter for continuous tokens: recursive rejection among tree siblings needs the residual's "
              "normalised density, whose normaliser 1 - beta has no closed form", type(d).__name__)
        check(isinstance(d, NullDrafter) or tuple(getattr(d, "token_shape", ())) == shape, "drafter",
              f"a drafter of continuous tokens of shape {shape} (a ModelChainDrafter over a continuous draft model)",
              type(d).__name__)

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int, *, uncond_input_ids=None,
                 generator: Generators = None, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int = 0, conditioning: Mapping[str, Any] | None = None,
                 callback: Callable[[int, DecodeState], None] | None = None,
                 profile: bool = False) -> DecodeOutput:
        """Generate up to ``max_new_tokens`` per row.

        Args:
            input_ids: (B, S) tensor or a list of B token sequences of any lengths.
            uncond_input_ids: the unconditional prompts for classifier-free guidance (same forms);
                required exactly when the logits processor has a guidance scale.
            generator: the only source of randomness: one ``torch.Generator``, or a list of B
                (diffusers' convention), row b drawing only from generator b (with guidance both
                halves of a row share it), so that row b equals that prompt decoded alone with the
                same generator.
            eos_token_id: an id or a list of ids; a row stops after emitting any of them.
            pad_token_id: fills ``sequences`` after each row's end (any int; never fed to a model).
            conditioning: keyword inputs of the prompt pass (e.g. a VLM's ``pixel_values`` for
                every target row, the uncond half included): given to the target's prefill and
                to a draft model's first feed, never bound to a model object.
            callback: called after every decode pass with (step, state); returning ``True``
                stops decoding after that pass (diffusers' interrupt; rows keep what they emitted).
                A pass is one target forward, committing a variable number of tokens per row;
                ``step`` counts passes from 1. The callback may set ``state.processor`` to a processor
                of the same type differing only in ``guidance_scale`` (still guided exactly when
                the call was: the batch's ``[cond; uncond]`` rows are fixed at prefill): drafts and
                the target's verification use it from the next pass on, so the output equals a
                decode whose scale changes at each row's committed length at that pass.
            profile: time every phase into ``Stats.seconds`` (synchronises the device after each
                phase of each pass); the call's total ``Stats.wall_seconds`` is always measured.
        """
        t0 = time.perf_counter()
        check_int(max_new_tokens, "max_new_tokens", 1)
        check(isinstance(profile, bool), "profile", "True or False", profile)
        check(is_int(pad_token_id), "pad_token_id", "an int", pad_token_id)
        check(conditioning is None or isinstance(conditioning, Mapping), "conditioning",
              "None or a mapping of keyword inputs for the prompt pass", type(conditioning).__name__)
        check(callback is None or callable(callback), "callback", "None or a callable (step, state)", callback)
        eos = _eos_ids(eos_token_id)
        self.processor.check_eos(eos, eos_token_id)
        guided = self.processor.uses_guidance
        if guided and uncond_input_ids is None:
            raise ValueError("uncond_input_ids must be given when guidance_scale is set "
                             f"(guidance_scale={self.processor.guidance_scale}); or set guidance_scale=None")
        if not guided and uncond_input_ids is not None:
            raise ValueError("uncond_input_ids is only used with guidance: set guidance_scale or drop it")
        device = self.device if self.device is not None else _device_of(self.target)
        ids, lens = pad_prompts(input_ids, 0, device)  # padding is cut from caches, never attended
        B = ids.shape[0]
        generator = as_generators(generator, B)
        if guided:
            uids, ulens = pad_prompts(uncond_input_ids, 0, device)
            check(uids.shape[0] == B, "uncond_input_ids", f"{B} sequences (one per prompt)", uids.shape[0])
            width = max(ids.shape[1], uids.shape[1])
            ids = torch.cat([_pad_to(ids, width, 0), _pad_to(uids, width, 0)])
            lens = torch.cat([lens, ulens])
        sched = self.schedule
        plan = sched.start(ids, lens, max_new_tokens, eos)  # checks the call; one row per lane
        ids, lens = plan.input_ids, plan.lengths
        generator = repeat_rows(generator, sched.lanes)  # an image's lanes share its generator
        B = B * sched.lanes
        block = self.drafter.max_block
        capacity = ids.shape[1] + plan.lane_tokens + 2 * block + 1
        ids = self.processor.prompt_tokens(ids, self.target)  # (R, S, *token_shape): ids, or broadcast over it
        history = torch.zeros((ids.shape[0], capacity) + tuple(ids.shape[2:]), dtype=ids.dtype, device=device)
        history[:, : ids.shape[1]] = ids
        conditioning = dict(conditioning or {})
        meters = self.processor.new_meters()
        state = DecodeState(history, lens.clone(), B, self.processor, generator, capacity,
                            prompt_lengths=lens.clone(), conditioning=conditioning, new_tokens=max_new_tokens,
                            meters=meters)
        stats = Stats(profile=profile, heads=meters)
        draft_forwards_before = self.drafter.forwards
        target, cache = plan.bind(self.target, state)

        # 1. prefill the prompts; the first token comes from the target alone
        with stats.timed("prefill", device):
            state.prefill = self._prefill(state, target, cache, ids, lens, conditioning, plan)
            stats.target_forwards += 1
            self.drafter.start(state)
            state.prefill = None

        run = _Run(state, plan, target, cache, stats, device)
        done = plan.finished(state)
        finished = _host_read(state, done)
        step = 0
        while not finished:
            done = self._pass(run, done)
            finished = _host_read(state, done)
            step += 1
            if callback is not None:
                processor = state.processor
                stop = callback(step, state) is True
                if state.processor is not processor:
                    _check_swapped_processor(processor, state.processor)
                if stop:
                    break  # interrupted by the caller: every row keeps what it has emitted

        stats.draft_forwards = self.drafter.forwards - draft_forwards_before
        check_overflow = getattr(cache, "check_overflow", None)
        if check_overflow is not None:  # static shapes defer the cache's bound check to here
            check_overflow()
        sequences, out_lens = plan.collect(state, pad_token_id)
        if device.type == "cuda":  # one sync per call, so the wall time covers the queued work
            torch.cuda.synchronize(device)
        stats.wall_seconds = time.perf_counter() - t0
        return DecodeOutput(sequences, out_lens, stats)

    @torch.inference_mode()
    def serve(self, jobs: Sequence[Job], max_new_tokens: int, *, slots: int,
              eos_token_id: int | Sequence[int] | None = None, pad_token_id: int = 0,
              profile: bool = False, admit: Callable[[int, bool], bool] | None = None) -> Iterator[Served]:
        """Continuous batching: decode ``jobs`` in a batch of ``slots`` rows, yielding each job
        (``Served``) as soon as it finishes; its row is then refilled with the next job's prompt
        while the other rows keep decoding.

        The batch is this loop's (``generate``'s passes, shared line for line): between passes,
        every row that is done is handed back and, while jobs remain, a new job enters it. The
        job's prompt is prefilled alone (its own conditioning, a target pass into a cache of its
        size, its first token sampled from the target alone with its generator, as ``generate``
        does) and its keys/values copied into the row of the batch cache (``load_row``); its
        history row, lengths and generator are reset and the drafter is told
        (``Drafter.restart_rows``). So each job's tokens are those of ``generate`` on the job
        alone (greedy: the same tokens; sampled: the same draws from its generator, up to the
        floating-point differences of batched arithmetic).

        Args:
            jobs: the prompts (``Job``), in the order they enter.
            max_new_tokens: tokens per job at most (one limit for every job).
            slots: rows decoded at once (the batch; with guidance 2 * slots target rows).
            eos_token_id: as in ``generate``.
            pad_token_id: as in ``generate``.
            profile: as in ``generate``.
            admit: ``admit(j, idle) -> bool``, asked before job ``j`` (the next in order) enters a
                free row: whether it may enter now (a server whose jobs arrive over time; None:
                always). ``idle`` says no row is decoding; then it must answer True (nothing
                else could make progress), else ``ValueError`` naming ``admit``.

        Needs a raster schedule, token ids and a drafter that restarts rows (``restarts_rows``);
        the target's cache must load rows (``StaticKVCache.load_row``: refused for caches that
        keep per-row prompt state, e.g. Qwen2-VL's M-RoPE offsets). The batch cache holds the
        longest prompt + ``max_new_tokens`` + two blocks per row. ``Served.stats`` counts every
        prefill (one per job, plus one for the idle batch) and every batch pass.
        """
        t0 = time.perf_counter()
        check_int(max_new_tokens, "max_new_tokens", 1)
        check_int(slots, "slots", 1)
        check(isinstance(profile, bool), "profile", "True or False", profile)
        check(is_int(pad_token_id), "pad_token_id", "an int", pad_token_id)
        jobs = list(jobs)
        check(len(jobs) > 0 and all(isinstance(j, Job) for j in jobs), "jobs", "a non-empty sequence of Job",
              [type(j).__name__ for j in jobs][:4])
        check(getattr(self.drafter, "restarts_rows", False), "drafter",
              "a drafter that restarts rows for continuous batching (restarts_rows = True: NullDrafter, "
              "JacobiDrafter, ModelChainDrafter, ModelTreeDrafter, EagleTreeDrafter, ParallelHeadsDrafter, "
              "PromptLookupDrafter)", type(self.drafter).__name__)
        check(isinstance(self.schedule, RasterSchedule), "schedule",
              "RasterSchedule for continuous batching (a next-set prompt's lanes share one cache)",
              type(self.schedule).__name__)
        check(not self.token_shape, "target", "a token-id target for continuous batching", self.token_shape)
        eos = _eos_ids(eos_token_id)
        guided = self.processor.uses_guidance
        for i, job in enumerate(jobs):
            check((job.uncond_input_ids is not None) == guided, f"jobs[{i}].uncond_input_ids",
                  "given exactly when guidance_scale is set", job.uncond_input_ids is not None)
            check(job.conditioning is None or isinstance(job.conditioning, Mapping), f"jobs[{i}].conditioning",
                  "None or a mapping of keyword inputs for its prompt pass", type(job.conditioning).__name__)
            check(job.generator is None or isinstance(job.generator, torch.Generator), f"jobs[{i}].generator",
                  "None or a torch.Generator", type(job.generator).__name__)
        seeded = [j.generator is not None for j in jobs]
        check(all(seeded) or not any(seeded), "jobs", "a generator for every job or for none", seeded)
        device = self.device if self.device is not None else _device_of(self.target)
        prompts = [pad_prompts([j.input_ids] + ([j.uncond_input_ids] if guided else []), 0, device) for j in jobs]
        B = min(slots, len(jobs))
        R = 2 * B if guided else B
        capacity = max(ids.shape[1] for ids, _ in prompts) + max_new_tokens + 2 * self.drafter.max_block + 1

        # 0. the batch starts as B idle rows (a one-token prompt each, prefilled together) so that
        # the drafter starts on the batch's shape; every job then enters through the same admission
        ids = torch.zeros((R, 1), dtype=torch.long, device=device)
        lens = torch.ones(R, dtype=torch.long, device=device)
        plan = self.schedule.start(ids, lens, max_new_tokens, eos)
        history = torch.zeros((R, capacity), dtype=torch.long, device=device)
        generator = tuple(torch.Generator() for _ in range(B)) if all(seeded) else None
        state = DecodeState(history, lens.clone(), B, self.processor, generator, capacity, prompt_lengths=lens.clone(),
                            conditioning={}, new_tokens=max_new_tokens)
        stats = Stats(profile=profile)
        draft_forwards_before = self.drafter.forwards
        target, cache = plan.bind(self.target, state)
        with stats.timed("prefill", device):
            state.prefill = self._prefill(state, target, cache, ids, lens, {}, plan)
            stats.target_forwards += 1
            self.drafter.start(state)
            state.prefill = None
        run = _Run(state, plan, target, cache, stats, device)

        nxt = 0  # the next job to enter
        job_of: list[int | None] = [None] * B  # the job each row decodes (None: idle)
        counts: list[list[int]] = [[] for _ in range(B)]
        after_pass = False
        while True:
            idle = torch.tensor([j is None for j in job_of], device=device)
            done = plan.finished(state) | idle
            values = torch.cat([done.long(), state.lengths[:B] - state.prompt_lengths[:B]]).tolist()
            state.generated = values[B:]
            finished = [b for b in range(B) if job_of[b] is not None and values[b]]
            if after_pass:
                for b in range(B):
                    if job_of[b] is not None:
                        counts[b].append(state.generated[b])
            if finished:
                check_overflow = getattr(cache, "check_overflow", None)
                if check_overflow is not None:  # static shapes: the bound check before a row is handed back
                    check_overflow()
                stats.draft_forwards = self.drafter.forwards - draft_forwards_before
                stats.wall_seconds = time.perf_counter() - t0
                sequences, out_lens = plan.collect(state, pad_token_id)
                for b in finished:
                    n = int(out_lens[b])
                    yield Served(job_of[b], sequences[b, :n].clone(), [min(c, n) for c in counts[b]],
                                 len(counts[b]), stats)
                    job_of[b] = None
            admitted = False
            for b in range(B):
                if job_of[b] is None:
                    if nxt == len(jobs):
                        break
                    if admit is not None:
                        idle = all(x is None for x in job_of)
                        may = admit(nxt, idle)
                        check(may is True or (may is False and not idle), "admit",
                              "a callable returning True or False, True when no row is decoding", may)
                        if not may:
                            break
                    j, nxt = nxt, nxt + 1
                    with stats.timed("prefill", device):
                        self._admit(run, b, jobs[j], *prompts[j])
                    stats.target_forwards += 1
                    job_of[b], counts[b], admitted = j, [1], True
            if admitted:  # a job may end at its prefill: check before the next pass
                after_pass = False
                continue
            if all(j is None for j in job_of):
                break
            self._pass(run, done)
            after_pass = True
        stats.draft_forwards = self.drafter.forwards - draft_forwards_before
        stats.wall_seconds = time.perf_counter() - t0

    def _admit(self, run: _Run, b: int, job: Job, ids: torch.Tensor, lens: torch.Tensor) -> None:
        """Job ``job`` (its prompts ``ids`` (R1, S), ``lens`` (R1,): cond, then uncond with
        guidance) enters batch row ``b``: prefilled alone, copied into the row, drafter told."""
        state, plan, cache = run.state, run.plan, run.cache
        generator = None if job.generator is None else (job.generator,)
        sub = DecodeState(torch.zeros((ids.shape[0], state.tokens.shape[1]), dtype=state.tokens.dtype,
                                      device=ids.device), lens.clone(), 1, state.processor, generator, state.max_len,
                          prompt_lengths=lens.clone(), conditioning=dict(job.conditioning or {}),
                          new_tokens=state.new_tokens)
        sub.tokens[:, : ids.shape[1]] = ids
        # a cache of the batch's kind sized to the prompt: the prefill alone, as generate runs it
        one = run.target.new_cache(ids.shape[0], ids.shape[1])
        out = self._prefill(sub, run.target, one, ids, lens, sub.conditioning)
        rows = state.target_rows(b)
        index = torch.tensor(rows, device=ids.device)
        for i, r in enumerate(rows):
            cache.load_row(r, one, i)
        state.tokens[index] = sub.tokens
        state.lengths = state.lengths.index_copy(0, index, sub.lengths)
        state.prompt_lengths = state.prompt_lengths.index_copy(0, index, lens)
        plan.restart_rows(index, lens)
        if isinstance(state.generator, tuple):
            state.generator = state.generator[:b] + (job.generator,) + state.generator[b + 1:]
        state.generated = list(state.generated or [0] * state.batch_size)
        state.generated[b] = 1  # host counts (catch-up feeds read them): the prefill's token
        sub.generated = [1]
        sub.prefill = out
        self.drafter.restart_rows(state, [b], [sub])

    def _prefill(self, state: DecodeState, target: Target, cache, ids: torch.Tensor, lens: torch.Tensor,
                 conditioning: Mapping[str, Any], plan: SchedulePlan | None = None) -> ModelOutput:
        """The prompt pass of ``state``'s rows (``ids`` (R, S), ``lens`` (R,)) into ``cache``, and
        each row's first token sampled from the target alone and emitted (``plan.prefill_rows``
        picks the lanes that sample one; every row without a plan). Returns the pass's output."""
        device = ids.device
        positions = torch.arange(ids.shape[1], device=device).expand(ids.shape[:2])
        out = target(ids, positions, cache, **conditioning)
        cache.truncate(lens)
        rows, at = torch.arange(state.rows, device=device), (lens - 1).clamp(min=0)
        probs = state.processor.last_distribution(state, out, rows, at)  # (B,) after each prompt's last position
        sel = None if plan is None else plan.prefill_rows(state)
        B, generator = state.batch_size, state.generator
        first = state.tokens.new_zeros((B,) + state.token_shape)
        count = torch.ones(B, dtype=torch.long, device=device)
        if sel is None:
            first = self.rule.sample(probs, generator)
        else:
            first[sel] = self.rule.sample(probs[sel], select_rows(generator, sel))
            count = torch.zeros_like(count).index_fill_(0, sel, 1)
        self._emit(state, first[:, None], count)
        return out

    def _pass(self, run: "_Run", done: torch.Tensor) -> torch.Tensor:
        """One decode pass over every row not ``done`` (B,): draft, verify in one target pass,
        accept, commit, emit. Returns the rows done after it (the plan's ``finished``)."""
        state, plan, target, cache, stats, device = run.state, run.plan, run.target, run.cache, run.stats, run.device
        B, generator = state.batch_size, state.generator
        fed, emitting = plan.step(state, done)
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
            out = target(state.expand(tokens), positions, cache, mask)
            # (B, T) distributions; token ids' (B, T, V) probabilities are built when read
            probs = state.processor.pass_distribution(state, out, positions)
            stats.target_forwards += 1
        # 4. accept
        with stats.timed("accept", device):
            sel = plan.emitting_rows(emitting)
            if sel is None:
                acc, probs = self._accept(state, draft, probs, out.logits, generator)
            else:  # only lanes that emit draw randomness
                acc, probs = self._accept(state, _select(draft, sel), probs, out.logits,
                                          select_rows(generator, sel), sel)
                acc = _scatter(acc, sel, B, tree.max_depth)
        # 5. commit caches and emit the accepted tokens plus the next token
        with stats.timed("commit", device):
            # the root and the accepted drafts enter the cache; finished rows stop growing
            keep = torch.where(fed, torch.where(emitting, acc.num_accepted + 1, 1), 0)
            idx = None if tree.is_chain else state.expand(acc.path.clamp(min=0))
            cache.keep_block(T, idx, state.expand(keep))
            if probs is None and getattr(self.drafter, "reads_target_probs", True):
                probs = state.processor(out.logits)  # (B, T, V)
            self.drafter.update(state, draft, acc, probs, out)
            if acc.tokens is not None:  # the rule emits other tokens than the drafts on the path
                path_tokens = acc.tokens.to(tokens.dtype)  # (B, D, *token_shape)
            else:
                path_tokens = gather_tokens(tokens, acc.path[:, 1:].clamp(min=0))  # (B, D)
            new = torch.cat([path_tokens, path_tokens.new_zeros((B, 1) + state.token_shape)], 1)
            scatter_tokens_(new, acc.num_accepted[:, None], acc.next_token[:, None].to(new.dtype))
            emitted = torch.where(emitting, keep, 0)
            stats.record_step(plan.per_output(emitted))
            state.processor.record_tests(stats, draft.tokens.shape[1], acc.num_accepted, emitting)
            self._emit(state, new, emitted)
            return plan.finished(state)

    def _accept(self, state: DecodeState, draft: DraftTree, probs, logits: torch.Tensor | None,
                generator: Generators, rows: torch.Tensor | None = None):
        """(the rule's decision on the verified block, the pass's target probabilities or None).

        The fused acceptance kernel decides from the raw ``logits`` (all rows) where the kernels'
        dispatch picks it (``mmspec.core.fused``), and then the (B, T, V) probabilities are not
        built here; otherwise the rule object decides on ``probs`` (given for continuous tokens,
        else built now from ``logits``). ``rows``: the lanes decided (None: all); ``draft`` and
        ``generator`` are already theirs, ``probs`` is all rows'."""
        fused = fused_acceptance(self.rule, state.processor, draft, logits, generator, rows)
        if fused is not None:
            return fused, probs
        if probs is None:
            probs = state.processor(logits)  # (B, T, V)
        return self.rule(draft, probs if rows is None else probs[rows], generator), probs

    @staticmethod
    def _emit(state: DecodeState, new: torch.Tensor, count: torch.Tensor) -> None:
        """Append ``new[b, :count[b]]`` to every target row's history (both CFG halves)."""
        new, count = state.expand(new), state.expand(count)
        cols = state.lengths[:, None] + torch.arange(new.shape[1], device=new.device)
        scatter_tokens_(state.tokens, cols.clamp(max=state.tokens.shape[1] - 1), new)
        state.lengths = state.lengths + count


def _host_read(state: DecodeState, done: torch.Tensor) -> bool:
    """The pass's one host read (a device sync): whether every row is done, and in the same
    transfer each row's generated-token count into ``state.generated`` for progress bars."""
    B = state.batch_size
    values = torch.cat([done.all().view(1).long(), state.lengths[:B] - state.prompt_lengths[:B]]).tolist()
    state.generated = values[1:]
    return bool(values[0])


def _check_swapped_processor(old, new) -> None:
    """A callback's new ``state.processor``: ``old`` with another guidance scale, still guided
    exactly when ``old`` was (the uncond rows exist only when the prefill had them)."""
    same_kind = type(new) is type(old) and dataclasses.replace(new, guidance_scale=old.guidance_scale) == old
    check(same_kind, "state.processor", f"a {type(old).__name__} differing from the call's only in guidance_scale",
          new)
    check(new.uses_guidance == old.uses_guidance, "guidance_scale",
          "a number >= 0 (this call's batch has [cond; uncond] rows)" if old.uses_guidance else
          "None or 1.0 (this call started without guidance, so its batch has no unconditional rows; "
          "pass a guidance_scale to the call to switch guidance on and off between passes)", new.guidance_scale)


def _members(proto) -> str:
    """The members a protocol asks for, for error messages."""
    names = set(proto.__annotations__) | {n for n, v in vars(proto).items() if callable(v) and
                                          (not n.startswith("_") or n == "__call__")}
    return ", ".join(sorted(names))


def _eos_ids(eos_token_id) -> tuple[int, ...] | None:
    """None, an int, or a non-empty list/tuple of ints -> None or a tuple of ints."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if is_int(eos_token_id) else eos_token_id
    check(isinstance(ids, (list, tuple)) and len(ids) > 0 and all(is_int(i) and i >= 0 for i in ids),
          "eos_token_id", "None, an int >= 0, or a non-empty list of ints >= 0", eos_token_id)
    return tuple(ids)


def _select(draft: DraftTree, sel: torch.Tensor) -> DraftTree:
    """The drafts of rows ``sel`` only."""
    tree = draft.tree
    sub = Tree(tree.parents[sel], max_depth=tree.max_depth, max_children=tree.max_children)
    return DraftTree(draft.tokens[sel], sub, None if draft.q is None else draft.q[sel])


def _scatter(acc: Acceptance, sel: torch.Tensor, B: int, depth: int) -> Acceptance:
    """An acceptance of rows ``sel`` widened to B rows; the others accept nothing."""
    path = torch.full((B, depth + 1), -1, dtype=torch.long, device=sel.device)
    path[:, 0] = 0
    path[sel] = acc.path
    num = torch.zeros(B, dtype=torch.long, device=sel.device).index_copy_(0, sel, acc.num_accepted)
    nxt = torch.zeros(B, dtype=torch.long, device=sel.device).index_copy_(0, sel, acc.next_token)
    return Acceptance(path=path, num_accepted=num, next_token=nxt)


def _pad_to(ids: torch.Tensor, width: int, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=pad)


def _device_of(target) -> torch.device:
    if getattr(target, "device", None) is not None:
        return torch.device(target.device)
    try:
        return next(target.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")
