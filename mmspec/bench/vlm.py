"""``mmspec bench vlm``: every VLM method and the transformers peer on the bundled tiny VLM, one run.

The same held-out scenes and description questions for every row, one prompt per call (batch 1,
the papers' protocol), greedy, ``max_new_tokens`` with a stop at ``</s>``. One untimed warm-up
call per row. Rows:

- ``none``: our loop, the target alone; ``hf-generate``: transformers' plain ``generate``;
- the peer, transformers' assisted generation: ``hf-assisted`` (``assistant_model=`` the small
  draft VLM, transformers' default schedule) and ``hf-lookup`` (``prompt_lookup_num_tokens=10``);
- ours: ``sd``, ``lookup``, ``eagle``, ``specvlm``, ``vispec``.

Scenarios (``--scenario``): ``scenes`` (the default) runs the rows above on the bundled 64 px VLM
(``assets/vlm``: 64 visual tokens per image, about 80 prompt tokens in all); ``visual-heavy`` runs
``HEAVY_ROWS`` on the 192 px VLM (``assets/vlm-hd``: 576 visual tokens per image, LLaVA-1.5's
count), where the image dominates the context: ``eagle`` (every visual token in the head),
``specvlm`` with its gate choosing per request (SpecVLM's dynamic selection) and forced to each
branch at several ratios, ``vispec`` and ``medusa``. Its extra columns, from the core's phase
timing (``enable_phase_timing``; on the CPU over the same timed calls, on a GPU over one more round
after them, since timing each phase syncs the device): the head's draft time per target pass
and the target's verify time per pass (milliseconds), the prefill's time per prompt (the target's
prompt pass and the drafter's start) and the decode's (every phase after it), the decode speed-up
over ``none`` (a ratio of decode times: the rows' tokens are the same), the visual tokens the head
keeps per image and, for the gated row, how often the gate chose each branch. The setup's
``wall_speedup_bound`` is the wall x a drafter would reach with a decode of no time: ``none``'s
seconds over its seconds outside the decode phases (prefill, the processor, the call's own work).
``stream`` runs ``STREAM_ROWS`` on the bundled VLM's ``stream()`` session over 2,000 frames
(``run_stream``: latency and memory over the stream, exactness against the target alone on
forks). ``images_per_prompt`` (``--images-per-prompt
K``) puts K held-out scenes in each prompt of ``scenes`` or ``visual-heavy``, one image part each:
K times the visual tokens (the images' own count is reported per image).

Per row: target passes per prompt (NFE, counted by a forward hook on the target, prefill
included), tau = generated tokens per target pass after the prefill, ``(tokens - 1) / (NFE - 1)``
(EAGLE's convention: the bonus token counts; target-only decoding gives 1), tokens per second
over all prompts (prefill included), speed-ups as ratios measured in this run against the faster
target-only row (``none`` or ``hf-generate``) and against ``hf-assisted``, ``greedy_identical`` (every prompt's tokens equal ``none``'s), the
draft's parameters (the shared embedding and LM head of the heads excluded) and its recipe's
training time. ``hf-assisted`` also reports whether the assistant's vision tower ran at all.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import methods
from ..core.errors import check, check_choice, check_int
from ..training.data.scene_qa import _DESCRIBE, SceneQADataset
from ..training.recipes.common import heldout_seed

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MODALITY = "vlm"
OURS = methods.names(MODALITY)
PEER = ("hf-generate", "hf-assisted", "hf-lookup")
DEEP = {"tree_top_k": 4, "tree_depth": 10, "tree_total_tokens": 16}  # a deeper, narrower tree
# every named VLM method of the registry after the peers, then a deeper tree for each method with tree knobs
DEFAULT_ROWS = (("none",) + PEER + tuple(m for m in OURS if m != "none")
                + tuple((f"{m}-deep", m, DEEP) for m in OURS if set(DEEP) <= set(methods.knobs(MODALITY, m))))
SHOWCASE_ROWS = ("none", "hf-generate", "hf-assisted", "lookup", "eagle", "specvlm", "vispec")


def _forced(branch: str, ratio: int = 0) -> tuple:
    label = f"specvlm-{branch}{ratio or ''}"
    return (label, "specvlm", {"specvlm_branch": branch, "specvlm_ratio": ratio})


# the gate's own choice, then each branch forced: the parameter-free ones at several ratios
HEAVY_ROWS = ("none", "eagle", "specvlm", _forced("pool", 4), _forced("pool", 16), _forced("pool", 64),
              _forced("prune", 16), _forced("prune", 64), _forced("conv"), _forced("resampler"), _forced("text"),
              "vispec", "medusa")
STREAM_ROWS = ("none", "eagle", "medusa")
SCENARIOS = {"scenes": (ASSETS / "vlm", DEFAULT_ROWS), "visual-heavy": (ASSETS / "vlm-hd", HEAVY_ROWS),
             "stream": (ASSETS / "vlm", STREAM_ROWS)}
"""``--scenario``: its bundled pipeline folder and rows (``stream``: the methods answering)."""


@dataclass
class VLMBenchConfig:
    pipeline_dir: str | None = None  # None: the scenario's
    rows: tuple | None = None  # None: the scenario's
    prompts: int = 24  # held-out scenes, each with a description question
    max_new_tokens: int = 128
    scenario: str = "scenes"
    device: str = "cpu"
    frames: int = 2000  # stream: frames in all, chunk_frames a round, a question each round
    chunk_frames: int = 4
    check_every: int = 25  # stream: every N-th round each row's answer is checked against none's (forked)
    stream_new_tokens: int = 32  # stream: an answer's length limit
    images_per_prompt: int = 1  # scenes / visual-heavy: held-out scenes in each prompt, one image part each

    def __post_init__(self):
        check_choice("scenario", self.scenario, tuple(SCENARIOS))
        check_int(self.images_per_prompt, "images_per_prompt", 1)
        check(self.images_per_prompt == 1 or self.scenario != "stream", "images_per_prompt",
              "1 for the stream scenario (its frames come in chunks: chunk_frames)", self.images_per_prompt)
        folder, rows = SCENARIOS[self.scenario]
        self.pipeline_dir = str(folder) if self.pipeline_dir is None else self.pipeline_dir
        self.rows = rows if self.rows is None else self.rows

    @classmethod
    def quick(cls, **kw) -> "VLMBenchConfig":
        return cls(**{"prompts": 4, "frames": 200, **kw})


def bench_prompts(n: int, resolution: int = 64) -> tuple[list, list[str]]:
    """``n`` held-out scenes drawn at ``resolution`` (images in [0, 1]) with the description
    questions in turn."""
    data = SceneQADataset(n, heldout_seed(0), resolution)
    images = [(data[i][0] + 1) / 2 for i in range(n)]
    return images, [_DESCRIBE[i % len(_DESCRIBE)] for i in range(n)]


@torch.no_grad()
def _head_view(pipe, images, prompts) -> dict:
    """What the ``specvlm`` head's gate chooses for each prompt (SpecVLM's rule: the top-1 gate
    logit over the mean image embedding and the mean target feature over the question) and the
    visual tokens each choice keeps, from the target's prompt pass, as the drafter's ``start`` sees
    it."""
    from ..adapters.vlm import VLMTarget
    from ..models.vlm_draft import BRANCHES

    target = VLMTarget(pipe.target)
    head = pipe.specvlm_head.bind(target)
    counts, kept = dict.fromkeys(BRANCHES, 0), []
    for image, prompt in zip(images, prompts):
        ids, vision = pipe.prepare_inputs([image], [prompt])
        tokens = torch.tensor(ids, device=target.device)
        cache = target.new_cache(1, tokens.shape[1])
        positions = torch.arange(tokens.shape[1], device=target.device)[None]
        out = target(tokens, positions, cache, **target.vision_inputs(**vision))
        plan = head.plan(out.hidden, tokens, out.prompt_embeds, torch.tensor([tokens.shape[1]], device=target.device))
        for b, visual in zip(plan["branches"][0], plan["visual"][0]):
            counts[BRANCHES[b]] += 1
            kept.append(len(visual))
    return dict(counts=counts, kept=sum(kept) / max(1, len(kept)))


def _kept_tokens(pipe, method: str, knobs: dict, image_tokens: int) -> float | None:
    """Visual tokens per image the row's draft keeps (None for drafts without an image span)."""
    if method == "eagle":
        return image_tokens
    if method == "vispec":
        return pipe.vispec_head.config.vispec_queries - 1
    if method == "specvlm" and knobs.get("specvlm_branch", "gate") != "gate":
        head = pipe.specvlm_head
        dummy = torch.zeros(image_tokens, head.config.hidden_size, device=head.fc.weight.device)
        return len(head.compressor.branch(knobs["specvlm_branch"], dummy, knobs.get("specvlm_ratio", 0)))
    return None


class _Counter:
    """Counts forward calls of a module (a hook, removed on exit)."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def __enter__(self):
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, *args):
        self.calls += 1

    def __exit__(self, *exc):
        self.handle.remove()


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _train_seconds(folder: Path) -> float | None:
    log = folder / "train_log.json"
    return json.loads(log.read_text()).get("wall_time_s") if log.is_file() else None


def _hf_call(pipe, row: str, image, prompt: str, max_new_tokens: int) -> list[int]:
    ids, vision = pipe.prepare_inputs([image], [prompt])
    input_ids = torch.tensor(ids)
    kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **vision,
              max_new_tokens=max_new_tokens, do_sample=False)
    if row == "hf-assisted":
        kw["assistant_model"] = pipe.draft_model
    elif row == "hf-lookup":
        kw["prompt_lookup_num_tokens"] = 10
    out = pipe.target.generate(**kw)
    return out[0, input_ids.shape[1] :].tolist()


def _drafts(method: str) -> tuple[str, ...]:
    """The pipeline components a row drafts with (the registry's ``requires``; the draft VLM's view
    ``draft`` is the pipeline's ``draft_model``)."""
    if method in PEER:
        return ("draft_model",) if method == "hf-assisted" else ()
    return tuple("draft_model" if c == "draft" else c for c in methods.resolve(MODALITY, method).requires)


def _available(pipe, row: str) -> str | None:
    """Why ``row`` cannot run on this pipeline (a missing component), or None."""
    missing = [c for c in _drafts(row) if getattr(pipe, c) is None]
    return f"no {missing[0]}" if missing else None


STREAM_QUESTIONS = ("what colour is the main shape ?", "what shape is in the image ?", "where is the shape ?",
                    "describe the image .")
STREAM_POLICY = dict(vision_window=4, text_window=4, text_sink=32, text_sliding_window=32)


def run_stream(cfg: VLMBenchConfig, progress=None) -> dict:
    """The ``stream`` scenario: one stream of ``cfg.frames`` held-out scenes in chunks of
    ``cfg.chunk_frames``, a question after every chunk (``STREAM_QUESTIONS`` in turn), on the
    bundled VLM's ``stream()`` session (``STREAM_POLICY``). Each row is its own stream, all fed the
    same frames and questions, rounds outer and rows inner (interleaved). Per row: answer latency
    (the question's feed and the decode) in ms, its least-squares slope in ms per 1,000 frames with
    a bootstrap interval (``stats.fit_slope``), the first and last 10% of rounds' mean latency,
    ``slope_vs_control_pct`` (below), NFE per answer, the context's longest length and the cache's
    bytes (fixed at the start), and ``exact``: every ``check_every``-th round the row's answer equals the target alone's on the
    same stream, asked first and forgotten (``remember=False``). ``rss_mb_start`` /
    ``rss_mb_end``: the process's peak resident set before the first round and after the last;
    ``resident_mb_*``: its resident set after each round (mean
    of the first and last 10% of rounds, and its slope in MB per 1,000 frames with its interval).
    ``trimmed_mb_start`` / ``trimmed_mb_end``: the resident set after glibc's ``malloc_trim(0)``
    has returned the heap's free pages, before the first round and after the last (None where
    there is no glibc): what the process holds rather than what the allocator keeps. ``series``:
    per round its frames so far, the resident set and each row's and control's milliseconds. The heap is
    trimmed only there, never between rounds: with a trim after every round the same work grew
    50% slower over 2,000 frames (docs/vlm.md).

    ``control_*``: the row's control, a stream pinned once its windows are full (a fork of one
    stream for every row) and asked one fixed question (the first of ``STREAM_QUESTIONS``) by the
    row's method every round without remembering it (``ask(remember=False)``). It does the same work every round, so its slope is
    the machine's drift for that kind of work. ``slope_vs_control_pct``: the slope of the row's
    latency as a percentage of its control's in the same round (per 1,000 frames, with its
    interval), which cancels that drift."""
    import resource

    from ..pipelines import SpeculativeVLMPipeline
    from ..eval.stats import fit_slope
    from .machine import rss_mb, trim_heap

    say = progress or (lambda msg: None)
    pipe = SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir).to(cfg.device)
    pipe.set_progress_bar_config(disable=True)
    images, _ = bench_prompts(64)
    rounds = cfg.frames // cfg.chunk_frames
    check(rounds >= 3, "frames", f"at least 3 chunks of {cfg.chunk_frames} frames", cfg.frames)
    labels = [_spec(r)[0] for r in cfg.rows]
    sessions = {label: pipe.stream(chunk_frames=cfg.chunk_frames, **STREAM_POLICY) for label in labels}
    acc = {label: dict(ms=[], nfe=[], longest=0, checked=0, exact=True) for label in labels}
    # each row's control: a stream pinned once its windows are full, asked one fixed question by the
    # row's method every round and never remembering it, so every round it does the same work
    pinned = pipe.stream(chunk_frames=cfg.chunk_frames, **STREAM_POLICY)
    for i in range(STREAM_POLICY["vision_window"] + STREAM_POLICY["text_window"]):
        pinned.add_frames([images[(i * cfg.chunk_frames + j) % len(images)] for j in range(cfg.chunk_frames)])
        pinned.ask(STREAM_QUESTIONS[i % len(STREAM_QUESTIONS)], max_new_tokens=cfg.stream_new_tokens)
    pinned.add_frames(images[: cfg.chunk_frames])
    controls = {label: pinned.fork() for label in labels}
    control_ms = {label: [] for label in labels}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss = []  # the process's resident set after each round, MB (machine.rss_mb)
    trimmed = [rss_mb() if trim_heap() else None]
    nbytes = {label: s.stream.cache.nbytes() for label, s in sessions.items()}
    for i in range(rounds):
        if i % 50 == 0:
            say(f"vlm stream: round {i + 1}/{rounds}")
        chunk = [images[(i * cfg.chunk_frames + j) % len(images)] for j in range(cfg.chunk_frames)]
        question = STREAM_QUESTIONS[i % len(STREAM_QUESTIONS)]
        for label, method, knobs in (_spec(r) for r in cfg.rows):
            session, a = sessions[label], acc[label]
            session.add_frames(chunk)
            ref = session.ask(question, max_new_tokens=cfg.stream_new_tokens, remember=False) \
                if i % cfg.check_every == 0 and method != "none" else None
            out = session.ask(question, method=method, method_knobs=knobs or None,
                              max_new_tokens=cfg.stream_new_tokens)
            a["ms"].append(1e3 * out.stats["seconds"])
            a["nfe"].append(out.stats["nfe"])
            a["longest"] = max(a["longest"], session.stream.context_tokens())
            if ref is not None:
                a["checked"] += 1
                a["exact"] = a["exact"] and out.tokens == ref.tokens
            check(session.stream.cache.nbytes() == nbytes[label], "the stream's cache", "of a fixed size",
                  session.stream.cache.nbytes())
            out = controls[label].ask(STREAM_QUESTIONS[0], method=method, method_knobs=knobs or None,
                                      max_new_tokens=cfg.stream_new_tokens, remember=False)
            control_ms[label].append(1e3 * out.stats["seconds"])
        rss.append(rss_mb())
    trimmed.append(rss_mb() if trim_heap() else None)
    rows = []
    frames = [(i + 1) * cfg.chunk_frames for i in range(rounds)]
    tenth = max(1, rounds // 10)
    base = sum(acc[labels[0]]["ms"]) if labels else None
    for label in labels:
        a = acc[label]
        fit = fit_slope(frames, a["ms"])
        rel = fit_slope(frames, [100 * m / c for m, c in zip(a["ms"], control_ms[label])])
        c = control_ms[label]
        drift = fit_slope(frames, c)
        rows.append(dict(method=label, frames=cfg.frames, answers=rounds, ms_per_answer=sum(a["ms"]) / rounds,
                         ms_first_10pct=sum(a["ms"][:tenth]) / tenth, ms_last_10pct=sum(a["ms"][-tenth:]) / tenth,
                         slope_ms_per_1000_frames=fit["slope"], slope_ci=[fit["ci_low"], fit["ci_high"]],
                         control_ms_first_10pct=sum(c[:tenth]) / tenth, control_ms_last_10pct=sum(c[-tenth:]) / tenth,
                         control_slope_ms_per_1000_frames=drift["slope"],
                         control_slope_ci=[drift["ci_low"], drift["ci_high"]],
                         slope_vs_control_pct=rel["slope"], slope_vs_control_ci=[rel["ci_low"], rel["ci_high"]],
                         nfe_per_answer=sum(a["nfe"]) / rounds, longest_context=a["longest"],
                         cache_mb=nbytes[label] / 2 ** 20, wall_speedup=base / sum(a["ms"]),
                         exact=a["exact"] if a["checked"] else None, checked=a["checked"]))
    rss_fit = fit_slope(frames, rss)
    setup = dict(scenario="stream", pipeline=cfg.pipeline_dir, device=cfg.device, frames=cfg.frames,
                 chunk_frames=cfg.chunk_frames, max_new_tokens=cfg.stream_new_tokens, policy=STREAM_POLICY,
                 threads=torch.get_num_threads(), rss_mb_start=rss0,
                 rss_mb_end=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                 resident_mb_first_10pct=sum(rss[:tenth]) / tenth, resident_mb_last_10pct=sum(rss[-tenth:]) / tenth,
                 resident_slope_mb_per_1000_frames=rss_fit.get("slope"),
                 resident_slope_ci=[rss_fit.get("ci_low"), rss_fit.get("ci_high")],
                 trimmed_mb_start=trimmed[0], trimmed_mb_end=trimmed[1],
                 series=dict(frames=frames, resident_mb=rss, **{f"ms_{label}": acc[label]["ms"] for label in labels},
                             **{f"ms_control_{label}": control_ms[label] for label in labels}),
                 wall_speedup=f"answer time of {labels[0]} over the row's, same stream contents",
                 order="rounds outer, rows inner; each row its own stream of the same frames and questions")
    return dict(bench="vlm", setup=setup, rows=rows, notes=[])


def run(cfg: VLMBenchConfig, progress=None) -> dict:
    from transformers import __version__ as transformers_version

    from ..pipelines import SpeculativeVLMPipeline

    if cfg.scenario == "stream":
        return run_stream(cfg, progress)
    say = progress or (lambda msg: None)
    for _, method, knobs in (_spec(r) for r in cfg.rows):  # bad rows fail before the pipeline loads
        if method not in PEER:
            methods.resolve(MODALITY, method, knobs)
    pipe = SpeculativeVLMPipeline.from_pretrained(cfg.pipeline_dir).to(cfg.device)
    pipe.set_progress_bar_config(disable=True)
    heavy = cfg.scenario == "visual-heavy"
    on_cpu = torch.device(cfg.device).type == "cpu"
    pipe.enable_phase_timing(heavy and on_cpu)  # elsewhere its per-phase syncs would slow the timed calls
    resolution = pipe.processor.image_processor.crop_size["height"]
    K = cfg.images_per_prompt
    scenes, prompts = bench_prompts(cfg.prompts * K, resolution)
    images = scenes if K == 1 else [scenes[i * K : (i + 1) * K] for i in range(cfg.prompts)]  # a prompt's K images
    image_tokens = pipe.prepare_inputs(images[:1], prompts[:1])[0][0].count(pipe.target.config.image_token_id) // K
    folder = Path(cfg.pipeline_dir)
    notes, specs = [], []
    for label, method, knobs in (_spec(r) for r in cfg.rows):
        missing = _available(pipe, method)
        if missing:
            notes.append(f"{label}: skipped ({missing})")
        else:
            specs.append((label, method, knobs))

    def call(method, knobs, i):
        if method in PEER:
            return _hf_call(pipe, method, images[i], prompts[i], cfg.max_new_tokens), None
        out = pipe(images=[images[i]], prompts=[prompts[i]], method=method, max_new_tokens=cfg.max_new_tokens,
                   method_knobs=knobs or None)
        return out.tokens[0], out.stats

    errors = {}
    for label, method, knobs in specs:  # warm-up, untimed; a peer that cannot run is reported
        try:
            call(method, knobs, 0)
        except Exception as err:
            errors[label] = f"{type(err).__name__}: {err}"
            notes.append(f"{label}: failed on the first prompt: {errors[label]}")
    live = [s for s in specs if s[0] not in errors]
    acc = {label: dict(tokens=[], seconds=0.0, nfe=0, draft_nfe=0, vision=0, draft_s=0.0, verify_s=0.0,
                       prefill_s=0.0, decode_s=0.0) for label, _, _ in live}

    def add_phases(a, seconds):  # the core's phase timing of one call
        a["draft_s"] += seconds["draft"]
        a["verify_s"] += seconds["verify"]
        a["prefill_s"] += seconds["prefill"]
        a["decode_s"] += sum(v for k, v in seconds.items() if k != "prefill")

    for i in range(cfg.prompts):  # prompts outer, rows inner: drifts in machine speed hit every row alike
        say(f"vlm bench: prompt {i + 1}/{cfg.prompts}")
        for label, method, knobs in live:
            a = acc[label]
            vision = _Counter(pipe.draft_model.model.vision_tower) if method == "hf-assisted" else None
            with _Counter(pipe.target.model.language_model) as target_calls:  # our adapter and generate call it
                if vision is not None:
                    vision.__enter__()
                start = time.perf_counter()
                toks, stats = call(method, knobs, i)
                a["seconds"] += time.perf_counter() - start
                if vision is not None:
                    vision.__exit__()
                    a["vision"] += vision.calls
            a["tokens"].append(toks)
            a["nfe"] += target_calls.calls
            a["draft_nfe"] += 0 if stats is None else stats["draft_nfe"]
            if stats is not None and "seconds" in stats:
                add_phases(a, stats["seconds"])
    if heavy and not on_cpu:  # phase costs from one more round, timed phase by phase (synced)
        pipe.enable_phase_timing(True)
        for i in range(cfg.prompts):
            for label, method, knobs in live:
                if method in OURS:
                    add_phases(acc[label], call(method, knobs, i)[1]["seconds"])
        pipe.enable_phase_timing(False)
    rows = []
    for label, method, knobs in specs:
        if label in errors:
            rows.append(dict(method=label, prompts=cfg.prompts, greedy_identical="failed", error=errors[label]))
            continue
        a = acc[label]
        made = sum(map(len, a["tokens"]))
        drafts = _drafts(method)
        draft_params = sum(_params(getattr(pipe, c)) for c in drafts)
        train_s = _train_seconds(folder / drafts[0]) if drafts else None
        rows.append(dict(method=label, knobs=knobs, prompts=cfg.prompts, tokens=made, nfe=a["nfe"] / cfg.prompts,
                         tau=(made - cfg.prompts) / max(1, a["nfe"] - cfg.prompts), seconds=a["seconds"],
                         tokens_per_s=made / a["seconds"],
                         draft_nfe=a["draft_nfe"] / cfg.prompts if method in OURS else None,
                         draft_params=draft_params, draft_train_s=train_s,
                         assistant_sees_image=(a["vision"] > 0) if method == "hf-assisted" else None))
        if heavy and method in OURS:
            passes = max(1, a["nfe"] - cfg.prompts)  # the passes after the prefill: each drafted once
            rows[-1].update(draft_ms_per_pass=1e3 * a["draft_s"] / passes, verify_ms_per_pass=1e3 * a["verify_s"] / passes,
                            prefill_ms_per_prompt=1e3 * a["prefill_s"] / cfg.prompts,
                            decode_ms_per_prompt=1e3 * a["decode_s"] / cfg.prompts,
                            visual_tokens_kept=_kept_tokens(pipe, method, knobs or {}, image_tokens))
    if heavy and any(m == "specvlm" and (k or {}).get("specvlm_branch", "gate") == "gate" for _, m, k in live):
        gate = _head_view(pipe, images, prompts)
        for r in rows:
            if r["method"] == "specvlm":
                r.update(visual_tokens_kept=gate["kept"], gate_choices=" ".join(
                    f"{b} {n}" for b, n in gate["counts"].items() if n))
    ref = acc["none"]["tokens"] if "none" in acc else None
    by_name = {r["method"]: r for r in rows if "error" not in r}
    # "target only" is the faster of our loop without a drafter and transformers' plain generate
    alone = [by_name[n]["tokens_per_s"] for n in ("none", "hf-generate") if n in by_name]
    base = by_name.get("none", {}).get("decode_ms_per_prompt")
    for r in rows:
        if "error" in r:
            continue
        r["greedy_identical"] = None if ref is None else acc[r["method"]]["tokens"] == ref
        if base and r.get("decode_ms_per_prompt"):  # the same tokens (greedy): a ratio of decode times
            r["decode_speedup"] = base / r["decode_ms_per_prompt"]
        r["wall_speedup"] = r["tokens_per_s"] / max(alone) if alone else None
        r["wall_speedup_vs_peer"] = (r["tokens_per_s"] / by_name["hf-assisted"]["tokens_per_s"]
                                     if "hf-assisted" in by_name else None)
    if "hf-assisted" in by_name:
        notes.append("hf-assisted: transformers " + transformers_version + " runs the assistant VLM "
                     + ("with" if by_name["hf-assisted"]["assistant_sees_image"] else "without")
                     + " its image (vision-tower calls counted); it refuses batches larger than 1")
    setup = dict(scenario=cfg.scenario, pipeline=cfg.pipeline_dir, device=cfg.device, resolution=resolution,
                 images_per_prompt=K, image_tokens=image_tokens, phase_timing="during the timed calls" if on_cpu else
                 "one more round after them, synced after every phase",
                 prompts=cfg.prompts, max_new_tokens=cfg.max_new_tokens, batch_size=1, temperature=0.0,
                 threads=torch.get_num_threads(), transformers=transformers_version,
                 tau="(generated tokens - 1) / (target passes - 1): tokens per pass after the prefill, bonus counted",
                 speedup="tokens/s over the faster target-only row (none or hf-generate) in this run",
                 wall_speedup_bound=_wall_bound(by_name.get("none"), acc.get("none")),
                 order="prompts outer, rows inner; one untimed warm-up call per row")
    return dict(bench="vlm", setup=setup, rows=rows, notes=notes)


def _wall_bound(row: dict | None, a: dict | None) -> float | None:
    """The wall x a drafter would reach if its decode took no time: the target alone's seconds per
    prompt over its seconds outside the decode phases (the prefill, the processor, the call's own
    work). None without phase timing or a ``none`` row."""
    if row is None or a is None or not a["decode_s"]:
        return None
    return a["seconds"] / (a["seconds"] - a["decode_s"])


def _spec(row) -> tuple[str, str, dict]:
    """A row is a method name or ``(label, method, knobs)``."""
    return (row, row, {}) if isinstance(row, str) else tuple(row)


VLM_COLUMNS = [
    ("method", "method"), ("nfe", "NFE/prompt"), ("tau", "tau"), ("tokens_per_s", "tokens/s"),
    ("wall_speedup", "wall x"), ("wall_speedup_vs_peer", "x vs peer"), ("greedy_identical", "greedy ="),
    ("draft_nfe", "draft NFE/prompt"), ("draft_params", "draft params"), ("draft_train_s", "draft train s"),
    ("assistant_sees_image", "assistant sees image"), ("draft_ms_per_pass", "draft ms/pass"),
    ("verify_ms_per_pass", "verify ms/pass"), ("prefill_ms_per_prompt", "prefill ms/prompt"),
    ("decode_ms_per_prompt", "decode ms/prompt"), ("decode_speedup", "decode x"),
    ("visual_tokens_kept", "visual tokens in draft"),
    ("gate_choices", "gate chose"), ("answers", "answers"), ("ms_per_answer", "ms/answer"),
    ("ms_first_10pct", "ms first 10%"), ("ms_last_10pct", "ms last 10%"),
    ("slope_ms_per_1000_frames", "slope ms/1000 frames"), ("slope_ci", "slope 95% CI"),
    ("control_slope_ms_per_1000_frames", "control slope ms/1000 frames"), ("control_slope_ci", "control 95% CI"),
    ("slope_vs_control_pct", "slope vs control %/1000 frames"), ("slope_vs_control_ci", "vs control 95% CI"),
    ("nfe_per_answer", "NFE/answer"), ("longest_context", "longest context"), ("cache_mb", "cache MB"),
    ("exact", "= none"),
]


def public(result: dict) -> dict:
    return result
