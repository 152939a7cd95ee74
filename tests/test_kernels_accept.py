"""Fused guided acceptance: the Triton kernels in Triton's interpreter on the CPU, decision for
decision against the core's own rule objects (``SpeculativeSampling``, ``GroupedAcceptance``,
``GreedyMatch``) behind the core's ``LogitsProcessor``, on the uniforms the core draws from the same
seeded generator; the torch reference likewise.

Tolerances: accepted lengths and tokens equal; accept probabilities within 1e-6 (fp32 softmax in a
different summation order).

Then the decoder's seam (``mmspec.core.fused``): which accept steps reach the kernel, and with the
uniforms the rule objects would draw."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import mmspec.core.fused as fused_mod
from mmspec.core import (GreedyMatch, GroupedAcceptance, GroupedAcceptanceConfig, JacobiDrafter,
                         LatentProximityAcceptance, LogitsProcessor, ModelChainDrafter, ModelTreeDrafter,
                         NextSetSchedule, SpeculativeDecoder, SpeculativeSampling, latent_neighbours)
from mmspec.core.fused import fused_acceptance, fused_knobs
from mmspec.core.tree import DraftTree, Tree
from mmspec.kernels import dispatch
from mmspec.kernels.guided_accept import Grouping, guided_accept, guided_accept_reference
from mmspec.kernels.interpret import run_interpreted
from tiny import noisy_copy, tiny_lm

accept_mod = importlib.import_module("mmspec.kernels.guided_accept")
needs_triton = pytest.mark.skipif(not dispatch.TRITON_AVAILABLE, reason="triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a CUDA GPU")
SEED = 11


def _case(B, G, V, *, guidance=None, temperature=1.0, top_k=None, drafted=True, ties=False, group=None,
          dtype=torch.float32, seed=0):
    """One chain block whose drafts the target often accepts: drafted q is the target's processed
    distribution blurred by noise, drafts drawn from it; deterministic drafts are the target's
    argmax, a quarter of them replaced at random. ``ties``: integer logits (ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * B if guidance is not None else B
    logits = torch.randint(-3, 4, (rows, G + 1, V), generator=g).float() if ties else \
        2 * torch.randn(rows, G + 1, V, generator=g)
    pipe = LogitsProcessor(temperature=temperature, top_k=top_k, guidance_scale=guidance)
    target_logits = pipe.merge_guidance(logits)[:, :G]  # (B, G, V)
    q = None
    if drafted and temperature > 0:
        blurred = target_logits + 0.7 * torch.randn(B, G, V, generator=g)
        q = LogitsProcessor(temperature=temperature, top_k=top_k)(blurred)  # (B, G, V)
        tokens = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    else:
        tokens = target_logits.argmax(-1)
        swap = torch.rand(B, G, generator=g) < 0.25
        tokens = torch.where(swap, torch.randint(V, (B, G), generator=g), tokens)
    knobs = dict(guidance_scale=guidance, temperature=temperature, top_k=top_k)
    return dict(logits=logits.to(dtype), tokens=tokens, q=q, knobs=knobs, pipe=pipe, group=group)


def _gsd(V: int, half_width: int, p_threshold: float, d_threshold: float, seed: int) -> GroupedAcceptance:
    emb = torch.randn(V, 4, generator=torch.Generator().manual_seed(seed))
    return GroupedAcceptance(emb, GroupedAcceptanceConfig(p_threshold, d_threshold, half_width))


CASES = {
    "exact-drafted-cfg": _case(48, 4, 37, guidance=3.0),
    "exact-onehot-V300": _case(24, 3, 300, temperature=0.8, drafted=False, seed=1),
    "exact-topk-ties-cfg": _case(16, 3, 37, guidance=2.0, top_k=7, ties=True, seed=2),
    "gsd-drafted-cfg": _case(24, 3, 37, guidance=3.0, group=_gsd(37, 3, 0.2, 8.0, 0), seed=3),
    "gsd-onehot-ties": _case(16, 3, 37, drafted=False, ties=True, group=_gsd(37, 4, 0.15, 6.0, 1), seed=4),
    "greedy-cfg-ties": _case(32, 5, 37, guidance=1.5, temperature=0, ties=True, seed=5),
    "nothing-drafted": _case(8, 0, 37, seed=6),
    "two-blocks-V5000": _case(3, 2, 5000, seed=7),
    "exact-drafted-fp16": _case(16, 4, 37, guidance=3.0, dtype=torch.float16, seed=8),
}


def _rule(case):
    if case["knobs"]["temperature"] == 0:
        return GreedyMatch()
    return case["group"] if case["group"] is not None else SpeculativeSampling()


def _core(case):
    """The core's decision on this block: its pipeline, its rule, a generator seeded with SEED."""
    B, G = case["tokens"].shape
    draft = DraftTree(case["tokens"], Tree.chain(B, G), case["q"])
    return _rule(case)(draft, case["pipe"](case["logits"]), torch.Generator().manual_seed(SEED))


def _kwargs(case) -> dict:
    """The kernel's arguments, with the uniforms the core's rule draws from the same generator:
    ``rand((B, G))`` for the accept tests, then ``rand((B, 1))`` for the draw."""
    B, G = case["tokens"].shape
    gen = torch.Generator().manual_seed(SEED)
    u_accept, u_sample = torch.rand((B, G), generator=gen), torch.rand((B, 1), generator=gen)[:, 0]
    group = Grouping.of(case["group"]) if case["group"] is not None else None
    return dict(logits=case["logits"], tokens=case["tokens"], q=case["q"], u_accept=u_accept, u_sample=u_sample,
                group=group, **case["knobs"])


@pytest.fixture(scope="module")
def kernel_outputs() -> dict:
    """Every case through the kernels, once, in Triton's interpreter in a child process."""
    if not dispatch.TRITON_AVAILABLE:
        pytest.skip("triton is not installed (torch's CPU-only wheels, e.g. on aarch64, come without it)")
    calls = {f"accept/{n}": ("guided_accept_triton", (), _kwargs(c)) for n, c in CASES.items()}
    return run_interpreted(calls)


def _assert_same_decisions(got, core):
    assert torch.equal(got.num_accepted, core.num_accepted), (got.num_accepted, core.num_accepted)
    assert torch.equal(got.next_token, core.next_token)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_decides_as_the_core(kernel_outputs, name):
    case = CASES[name]
    got = kernel_outputs[f"accept/{name}"]
    assert not isinstance(got, Exception), got
    _assert_same_decisions(got, _core(case))
    ref = guided_accept_reference(**_kwargs(case))
    torch.testing.assert_close(got.accept_prob, ref.accept_prob, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_decides_as_the_core(name):
    case = CASES[name]
    _assert_same_decisions(guided_accept_reference(**_kwargs(case)), _core(case))


def test_cases_bite():
    """The blocks mix accepts and rejects, and other uniforms change the decisions: equal
    decisions above are not an accident of all-accept or all-reject blocks."""
    for name, case in CASES.items():
        B, G = case["tokens"].shape
        n = _core(case).num_accepted
        if G:
            assert 0 < int(n.sum()) < B * G and bool((n < G).any()), name
        if case["knobs"]["temperature"] != 0:
            kw = _kwargs(case)
            other = guided_accept_reference(**dict(kw, u_accept=1 - kw["u_accept"], u_sample=1 - kw["u_sample"]))
            core = _core(case)
            assert not (torch.equal(other.num_accepted, core.num_accepted)
                        and torch.equal(other.next_token, core.next_token)), name


def test_gsd_groups_are_not_trivial():
    """The grouped cases' accept probabilities differ from exact speculative sampling's (for
    deterministic drafts they only grow: the group's mass includes p(x))."""
    for name in ("gsd-drafted-cfg", "gsd-onehot-ties"):
        kw = _kwargs(CASES[name])
        grouped = guided_accept_reference(**kw).accept_prob
        exact = guided_accept_reference(**dict(kw, group=None)).accept_prob
        assert (grouped - exact).abs().max() > 1e-3, name
        if kw["q"] is None:
            assert bool((grouped >= exact).all()), name


def test_reference_with_top_p_is_the_pipeline():
    """Top-p is not fused; the reference (which the dispatcher takes for it) applies the pipeline's."""
    case = CASES["exact-drafted-cfg"]
    pipe = LogitsProcessor(temperature=1.0, top_p=0.8, guidance_scale=3.0)
    B, G = case["tokens"].shape
    core = SpeculativeSampling()(DraftTree(case["tokens"], Tree.chain(B, G), case["q"]), pipe(case["logits"]),
                                 torch.Generator().manual_seed(SEED))
    got = guided_accept(**dict(_kwargs(case)), top_p=0.8)
    assert torch.equal(got.num_accepted, core.num_accepted) and torch.equal(got.next_token, core.next_token)


# -- dispatch and bad input ------------------------------------------------------------------------
def test_dispatch_takes_the_reference_on_cpu(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the dispatcher chose the Triton kernel for CPU tensors")

    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(accept_mod, "guided_accept_triton", no_kernel)
    kw = _kwargs(CASES["gsd-drafted-cfg"])
    got, ref = guided_accept(**kw), guided_accept_reference(**kw)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_forced_triton_fails_clearly(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = _kwargs(CASES["exact-drafted-cfg"])
    with pytest.raises(dispatch.KernelUnavailableError, match="guided acceptance kernel, but the tensors are on cpu"):
        guided_accept(**kw)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(dispatch.KernelUnavailableError, match="top-p"):
        guided_accept(**kw, top_p=0.9)
    calls = []
    monkeypatch.setattr(accept_mod, "guided_accept_triton", lambda *a, **k: calls.append(k))
    guided_accept(**kw)
    assert len(calls) == 1


@pytest.mark.parametrize("bad,message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=0), "top_k must be None or an int >= 1"),
    (dict(u_accept=torch.rand(48, 3)), r"u_accept must be a \(48, 4\) tensor"),
    (dict(u_sample=None), "u_sample must be"),
    (dict(guidance_scale=None), r"logits must be \(48, 5, V\)"),
    (dict(q=torch.rand(48, 4, 36)), "q must be None or"),
    (dict(temperature=0, group=Grouping(torch.zeros(37, 4))), "group must be None with temperature 0"),
    (dict(group=Grouping(torch.zeros(36, 4))), r"group must be None or a Grouping with \(37, E\)"),
])
def test_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        guided_accept_reference(**dict(_kwargs(CASES["exact-drafted-cfg"]), **bad))


# -- the decoder's accept step ---------------------------------------------------------------------
def _decoders():
    """name -> (decoder kwargs, generator factory, whether the fused kernel implements the pair)."""
    target = tiny_lm(0, vocab_size=24, dim=16, n_layers=1)
    draft = noisy_copy(target, 0.3)
    sampled = LogitsProcessor(temperature=1.0, guidance_scale=2.0)
    greedy = LogitsProcessor(temperature=0, guidance_scale=2.0)
    gsd = GroupedAcceptance(target.embed.weight, GroupedAcceptanceConfig(0.1, 8.0, 3))
    per_row = lambda: [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]  # noqa: E731
    one = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    jacobi = lambda: JacobiDrafter(24, window=4)  # noqa: E731
    return target, {
        "sd-greedy": (dict(drafter=ModelChainDrafter(draft, 3), processor=greedy), one, True),
        "sd-sampled": (dict(drafter=ModelChainDrafter(draft, 3), processor=sampled), per_row, True),
        "sd-top-k": (dict(drafter=ModelChainDrafter(draft, 3), processor=LogitsProcessor(0.7, top_k=5)), one, True),
        "gsd": (dict(drafter=jacobi(), rule=gsd, processor=sampled), per_row, True),
        "target-only": (dict(processor=sampled), per_row, True),
        "zipar+sjd": (dict(drafter=JacobiDrafter(24, window=3, init="repeat"), processor=sampled,
                           schedule=NextSetSchedule(2, 4, 2)), one, True),
        "tree": (dict(drafter=ModelTreeDrafter(draft, top_k=2, depth=2, total_tokens=5), processor=sampled), one, False),
        "lantern": (dict(drafter=jacobi(), rule=LatentProximityAcceptance(latent_neighbours(target.embed.weight)),
                         processor=sampled), per_row, False),
        "top-p": (dict(drafter=jacobi(), processor=LogitsProcessor(1.0, top_p=0.8)), one, False),
        "greedy-rule-sampled": (dict(drafter=jacobi(), rule=GreedyMatch(), processor=sampled), one, False),
        "exact-rule-greedy": (dict(drafter=jacobi(), rule=SpeculativeSampling(), processor=greedy), one, False),
    }


def test_decoder_accepts_through_the_fused_kernel_where_dispatch_picks_it(monkeypatch):
    """The wiring, without the interpreter (tests/test_kernels_e2e.py runs the kernel itself): a
    dispatch that picks Triton for every input it can take (auto mode on CUDA), the torch
    reference standing in for the kernel. The pairs the kernel implements go through it on every
    decode pass, with the rule's own uniforms, so the tokens equal the rule objects' draw for draw;
    the others (trees, LANTERN, top-p, rule and pipeline disagreeing on greedy) never call it."""
    target, decoders = _decoders()
    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[1].shape)
        return guided_accept_reference(*args, **kwargs)

    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(fused_mod, "guided_accept_triton", kernel)

    def generate(kw, gen):
        prompts, uncond = ([[1, 2, 3]], [[0]]) if "schedule" in kw else ([[1, 2, 3], [4, 5]], [[0], [0, 0]])
        n = 8 if "schedule" in kw else 12
        guided = kw["processor"].uses_guidance
        return SpeculativeDecoder(target, **kw).generate(prompts, n, uncond_input_ids=uncond if guided else None,
                                                          generator=gen())

    for name, (kw, gen, fused) in decoders.items():
        calls.clear()
        rules = generate(kw, gen)
        assert calls == [], name  # auto mode on the CPU: the rule objects
        with monkeypatch.context() as m:
            m.setattr(fused_mod, "kernel_dispatch", SimpleNamespace(
                considered=lambda device: True, preferred=dispatch.preferred,
                use_triton=lambda op, device, unsupported=None, preferred=True: unsupported is None and preferred))
            got = generate(kw, gen)
        assert torch.equal(got.sequences, rules.sequences), name
        assert len(calls) == (got.stats.target_forwards - 1 if fused else 0), (name, len(calls))


def test_fused_acceptance_forced_refuses_what_the_kernel_cannot_take(monkeypatch):
    """``MMSPEC_KERNELS=triton``: top-p and float64 logits raise (before anything launches); rules
    the kernel does not implement are not its business and go to the rule objects."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    B, G, V = 2, 3, 11
    logits = torch.randn(B, G + 1, V)
    draft = DraftTree(torch.randint(V, (B, G)), Tree.chain(B, G), None)
    with pytest.raises(dispatch.KernelUnavailableError, match="top-p"):
        fused_acceptance(SpeculativeSampling(), LogitsProcessor(top_p=0.9), draft, logits, None)
    with pytest.raises(dispatch.KernelUnavailableError, match="float64"):
        fused_acceptance(SpeculativeSampling(), LogitsProcessor(), draft, logits.double(), None)
    lantern = LatentProximityAcceptance(latent_neighbours(torch.randn(V, 4)))
    assert fused_acceptance(lantern, LogitsProcessor(), draft, logits, None) is None
    assert fused_knobs(GreedyMatch(), LogitsProcessor(temperature=0, top_p=0.5, top_k=2))["top_p"] is None
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(dispatch.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        fused_acceptance(SpeculativeSampling(), LogitsProcessor(), draft, logits, None)


# -- compiled kernels on a GPU --------------------------------------------------------------------
# The kernels take fp32, fp16 or bf16 logits and compute in fp32, so the reference on the same
# (rounded) logits is the truth for every dtype, with one tolerance: the GPU's fast exp and another
# summation order move accept probabilities by ulps, which 1e-5 covers; a decision may flip only
# where a uniform sits within that of a threshold, so at most one row may differ.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _on_cuda(kwargs: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("knobs", [dict(guidance=4.0), dict(guidance=4.0, top_k=1000),
                                   dict(guidance=4.0, temperature=0)])
def test_kernel_on_cuda_at_image_vocabulary(monkeypatch, dtype, knobs):
    """A 16k image vocabulary (4 tiles of 4096), logits upcast on load: GPU rounding (FMA,
    fast exp, fp32 cumsum in torch's CUDA reference) may flip a decision whose uniform sits on a
    threshold, so at most 1 row in 128 may differ; accept probabilities within 1e-5."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    case = _case(128, 6, 16384, **knobs, dtype=dtype, seed=12)
    _decides_as_the_reference(guided_accept(**_on_cuda(_kwargs(case))), guided_accept_reference(**_kwargs(case)))


def _decides_as_the_reference(got, ref) -> None:
    """At most one row's decision differs (a uniform on a threshold, under GPU rounding); accept
    probabilities within 1e-5."""
    differ = (got.num_accepted.cpu() != ref.num_accepted) | (got.next_token.cpu() != ref.next_token)
    assert int(differ.sum()) <= 1
    torch.testing.assert_close(got.accept_prob.cpu(), ref.accept_prob, atol=1e-5, rtol=0)


@pytest.mark.cuda
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_on_cuda_at_the_interpreter_cases(monkeypatch, name, dtype):
    """The interpreter's cases compiled (exact, top-k with ties, GSD groups, greedy, no drafts, two
    vocabulary blocks), logits in each dtype."""
    monkeypatch.setenv(dispatch.ENV, "triton")
    kw = dict(_kwargs(CASES[name]), logits=CASES[name]["logits"].to(dtype))
    _decides_as_the_reference(guided_accept(**_on_cuda(kw)), guided_accept_reference(**kw))
