"""The core's seams: typed protocols every implementation meets, imports that point one way, no
modality named in the core's code, schedules that keep per-call state off ``self``, opt-in phase timing, and EOS lists."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mmspec.core as core
from mmspec.core import (AcceptanceRule, DecodingSchedule, Drafter, DrafterBase, FeatureHead, GreedyMatch,
                         GroupedAcceptance, JacobiDrafter, LatentProximityAcceptance, LogitsProcessor,
                         ModelChainDrafter, ModelTreeDrafter, NextSetSchedule, NullDrafter, PromptLookupDrafter,
                         RasterSchedule, SchedulePlan, SpeculativeDecoder, SpeculativeSampling, Target,
                         latent_neighbours)
from mmspec.core.tree import DraftTree, Tree
from mmspec.models.llamagen import LlamaGenModel
from tiny import spread, tiny_lm

CORE = Path(core.__file__).parent


# -- imports point one way ---------------------------------------------------------------------
def _core_imports(path: Path) -> set[str]:
    """Core modules a module imports at any level (TYPE_CHECKING blocks and function bodies too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(a.name for a in node.names)
    return found


def test_core_imports_form_a_dag():
    graph = {p.stem: _core_imports(p) & {q.stem for q in CORE.glob("*.py")} - {"__init__"}
             for p in CORE.glob("*.py") if p.stem != "__init__"}
    order, state = [], {}

    def visit(m, stack):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(stack + [m])}"
        state[m] = "open"
        for n in sorted(graph[m]):
            visit(n, stack + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    assert "decoder" not in graph["types"] and "types" in graph["decoder"]
    assert order.index("types") < order.index("decoder")


def test_each_core_module_imports_alone():
    """One fresh interpreter imports each core module first, forgetting every ``mmspec`` module
    between them (torch stays loaded, to keep this cheap): an import cycle would surface as a
    partially initialised module."""
    modules = sorted(p.stem for p in CORE.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    for k in [k for k in sys.modules if k == 'mmspec' or k.startswith('mmspec.')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module('mmspec.core.' + m)\n"
        "print(len(" + repr(modules) + "))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(len(modules))


# -- the core names no modality in its code -----------------------------------------------------
MODALITY_WORDS = {"video", "vlm", "chunk", "recache", "image", "pixel", "vision", "visual", "audio", "speech"}
"""Words no identifier the core defines and no string it holds may contain (docstrings and
comments may cite papers and examples). Not listed, because the core still uses them for what is
generic: ``frame`` (a group of ``frame_size`` tokens that rolls together, ``Rope3D``'s
``frame_shape``) and ``latent`` (LANTERN's latent proximity; the two-row state / latent tokens).
The continuous-token words (``continuous``, ``density``, ``diffusion``) are unlisted too: the core
holds continuous tokens as a token space (``TokenDist``, ``DensityProcessor``, the density rules, the
decoder's construction checks); the decode loop itself names none of them (``LOOP_WORDS``)."""


def _words(text: str) -> list[str]:
    """Lower-case words of an identifier or string: split at non-letters and camelCase humps."""
    return [w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", text)]


def _modality_names(source: str) -> list[str]:
    """``name (line)`` for every identifier the source defines (functions, classes, arguments,
    assigned names and attributes, keywords, imported modules and names) and every string constant
    outside docstrings and bare string statements whose words hold a ``MODALITY_WORDS`` word
    (plural ``s`` too)."""
    tree = ast.parse(source)
    bare = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names = [node.id]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names = [node.attr]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.asname or a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.asname or a.name for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare:
            names = [node.value]
        for name in names:
            if any(w in MODALITY_WORDS or w.rstrip("s") in MODALITY_WORDS for w in _words(name)):
                found.append(f"{name!r} ({getattr(node, 'lineno', '?')})")
    return found


def test_the_core_names_no_modality_in_its_code():
    found = {p.name: _modality_names(p.read_text()) for p in sorted(CORE.glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found


LOOP_WORDS = {"continuous", "density", "diffusion", "latent"}
"""What the decode loop (``generate``, ``_prefill``, ``_pass``) must not name: it asks the token
space (the call's ``LogitsProcessor`` or ``DensityProcessor``: ``check_eos``, ``prompt_tokens``,
``new_meters``, ``last_distribution``, ``pass_distribution``, ``record_tests``) instead of
branching on it. Nor may it build ``LOOP_NAMES`` (head meters, a sliced model output): the token
space does."""
LOOP_NAMES = {"HeadMeter", "ModelOutput"}


def _loop_names(source: str, functions=("generate", "_prefill", "_pass")) -> list[str]:
    """``name (line)`` for every identifier (defined or read) and string constant outside
    docstrings in ``functions`` whose words hold a ``LOOP_WORDS`` word (plural ``s`` too), and
    every ``LOOP_NAMES`` name called."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not (isinstance(fn, ast.FunctionDef) and fn.name in functions):
            continue
        bare = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(fn):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, (ast.arg, ast.keyword)) and node.arg
                    else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in bare else None)
            if name and any(w in LOOP_WORDS or w.rstrip("s") in LOOP_WORDS for w in _words(name)):
                found.append(f"{name!r} ({node.lineno})")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LOOP_NAMES:
                found.append(f"{node.func.id!r} ({node.lineno})")
    return found


def test_the_decode_loop_asks_the_token_space_instead_of_branching():
    assert _loop_names((CORE / "decoder.py").read_text()) == []
    planted = "def _pass(self, state):\n    if state.continuous:\n        m = HeadMeter()\n"
    assert [f.split(" ")[0] for f in _loop_names(planted)] == ["'continuous'", "'HeadMeter'"]


def test_the_modality_scanner_flags_a_planted_name():
    """The scanner sees a modality word in a definition, an argument, an attribute, a keyword, an
    import and a string, in any case and plural; not in a docstring or a loaded external name."""
    planted = ('"""Streams video frames."""\n'
               "from .adapters.video import Cache\n"
               "class VideoCache:\n"
               "    '''A cache of images.'''\n"
               "    def begin_chunk(self, num_images):\n"
               "        self.recache_open = f'{num_images} images'\n"
               "        return torch.cat(x.chunk(2), dim=0, vlm=True)\n")
    found = _modality_names(planted)
    for name in ("'adapters.video'", "'VideoCache'", "'begin_chunk'", "'num_images'", "'recache_open'",
                 "' images'", "'vlm'"):
        assert any(f.startswith(name) for f in found), (name, found)
    assert not any("Streams" in f or "A cache of" in f or f.startswith("'chunk'") for f in found), found
    assert _modality_names("def step(self, tokens):\n    return tokens.chunk(2)\n") == []


# -- every implementation meets its protocol ------------------------------------------------------
def test_implementations_meet_their_protocols():
    lm = tiny_lm(0, vocab_size=8)
    emb = torch.randn(8, 4)
    for d in (NullDrafter(), ModelChainDrafter(lm), ModelTreeDrafter(lm), JacobiDrafter(8, 4),
              PromptLookupDrafter()):
        assert isinstance(d, Drafter) and isinstance(d, DrafterBase), type(d).__name__
    for r in (GreedyMatch(), SpeculativeSampling(), GroupedAcceptance(emb), LatentProximityAcceptance(
            latent_neighbours(emb, 3), core.LatentProximityConfig(k=3)), core.CSpDAcceptance()):
        assert isinstance(r, AcceptanceRule), type(r).__name__
    for s in (RasterSchedule(), NextSetSchedule(2, 2, 1)):
        assert isinstance(s, DecodingSchedule)
    assert isinstance(lm, Target)
    ids, lens = torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2])
    assert isinstance(RasterSchedule().start(ids, lens, 4, None), SchedulePlan)
    assert isinstance(NextSetSchedule(2, 2, 1).start(ids, lens, 4, None), SchedulePlan)


def test_feature_heads_meet_their_protocol():
    from mmspec.models.eagle import EagleDraftHead

    torch.manual_seed(0)
    target = LlamaGenModel(vocab_size=16, grid_size=2, num_classes=2, dim=16, n_layers=1, n_heads=2, mlp_hidden=32)
    assert isinstance(EagleDraftHead.from_target(target), FeatureHead)


def test_drafter_defaults_are_declared():
    """``DrafterBase`` documents every default; a drafter sets what differs and writes ``propose``."""

    class Repeat(DrafterBase):
        lane_safe = True
        max_block = 3

        def propose(self, state):
            B = state.batch_size
            tokens = state.roots[:, None].repeat(1, 2)
            return DraftTree(tokens, Tree.chain(B, 2, tokens.device))

    d = Repeat()
    assert (d.vocab_size, d.forwards, DrafterBase.lane_safe) == (None, 0, False)
    model = spread(tiny_lm(0, vocab_size=16))
    out = SpeculativeDecoder(model, d, processor=LogitsProcessor(temperature=0)).generate([[1, 2, 3]], 8)
    ref = SpeculativeDecoder(model, processor=LogitsProcessor(temperature=0)).generate([[1, 2, 3]], 8)
    assert torch.equal(out.sequences, ref.sequences)
    with pytest.raises(NotImplementedError, match="must implement propose"):
        DrafterBase().propose(None)


def test_a_drafter_missing_a_member_is_refused():
    class NoLaneSafe:
        vocab_size, max_block, forwards = None, 1, 0

        def start(self, state): ...

        def propose(self, state): ...

        def update(self, *args): ...

    with pytest.raises(ValueError, match=r"^drafter must be a Drafter \(members: .*lane_safe"):
        SpeculativeDecoder(tiny_lm(0), NoLaneSafe())
    with pytest.raises(ValueError, match=r"^rule must be an? AcceptanceRule|^rule must be a AcceptanceRule"):
        SpeculativeDecoder(tiny_lm(0), rule=object())
    with pytest.raises(ValueError, match=r"^schedule must be a DecodingSchedule"):
        SpeculativeDecoder(tiny_lm(0), schedule=object())


# -- schedules keep per-call state in the plan they return ---------------------------------------
def _image_model(seed=0):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=32, grid_size=4, num_classes=4, dim=32, n_layers=2, n_heads=2,
                         mlp_hidden=64, initializer_range=0.2).eval()


@pytest.mark.parametrize("drafter", ["none", "sjd"])
def test_one_schedule_serves_nested_calls(drafter):
    """Decoder A's callback runs decoder B (same schedule object, other prompts and lengths);
    both equal decodes with their own schedule objects."""
    model = _image_model()

    def make(schedule):
        d = None if drafter == "none" else JacobiDrafter(32, window=3, init="random")
        return SpeculativeDecoder(model, d, processor=LogitsProcessor(temperature=1.0, guidance_scale=2.0),
                                  schedule=schedule)

    def gen(dec, labels, seed, callback=None):
        return dec.generate(model.class_prompts(labels), 16, uncond_input_ids=model.uncond_prompts(len(labels)),
                            generator=torch.Generator().manual_seed(seed), callback=callback)

    ref_a = gen(make(NextSetSchedule(4, 4, 2)), [0, 1], 1)
    ref_b = gen(make(NextSetSchedule(4, 4, 3)), [3], 2)  # different geometry per call is fine too

    shared = NextSetSchedule(4, 4, 2)
    dec_a, dec_b = make(shared), make(shared)
    inner = []

    def during_a(step, state):
        if step in (2, 5):  # a whole generate of B inside A, twice, mid-decode
            inner.append(gen(dec_b, [3], 2))

    out_a = gen(dec_a, [0, 1], 1, during_a)
    assert torch.equal(out_a.sequences, ref_a.sequences)
    assert out_a.stats.target_forwards == ref_a.stats.target_forwards
    ref_b_same = gen(make(NextSetSchedule(4, 4, 2)), [3], 2)
    assert len(inner) == 2 and all(torch.equal(o.sequences, ref_b_same.sequences) for o in inner)
    assert not hasattr(shared, "cache") and not hasattr(shared, "prompt_lens")  # nothing left on self
    assert ref_b.sequences.shape == (1, 16)


# -- phase timing is opt-in -----------------------------------------------------------------------
def test_phase_timing_is_opt_in():
    model = spread(tiny_lm(0, vocab_size=16))
    dec = SpeculativeDecoder(model, ModelChainDrafter(tiny_lm(1, vocab_size=16)), processor=LogitsProcessor(temperature=0))
    plain = dec.generate([[1, 2, 3]], 10)
    assert plain.stats.seconds is None and "seconds" not in plain.stats.as_dict()
    assert plain.stats.wall_seconds > 0 and plain.stats.as_dict()["wall_seconds"] == plain.stats.wall_seconds
    prof = dec.generate([[1, 2, 3]], 10, profile=True)
    phases = prof.stats.as_dict()["seconds"]
    assert set(phases) == {"prefill", "draft", "verify", "accept", "commit"} and all(v > 0 for v in phases.values())
    assert sum(phases.values()) <= prof.stats.wall_seconds
    assert torch.equal(plain.sequences, prof.sequences)
    with pytest.raises(ValueError, match="^profile must be True or False"):
        dec.generate([[1, 2, 3]], 10, profile="yes")


def test_timing_without_profile_does_not_sync(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
    stats = core.Stats()
    with stats.timed("draft", torch.device("cuda")):
        pass
    assert calls == [] and stats.seconds is None
    stats = core.Stats(profile=True)
    with stats.timed("draft", torch.device("cuda")):
        pass
    assert len(calls) == 1 and stats.seconds["draft"] > 0


# -- EOS lists ------------------------------------------------------------------------------------
def test_eos_list_stops_at_any_of_them():
    model = spread(tiny_lm(0, vocab_size=16), std=0.6)
    dec = SpeculativeDecoder(model, ModelChainDrafter(tiny_lm(1, vocab_size=16)), processor=LogitsProcessor(temperature=0))
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    free = dec.generate(prompts, 16)
    firsts = [int(free.sequences[b, 2]) for b in range(len(prompts))]  # the third token of every row
    eos = sorted(set(firsts))
    assert len(eos) >= 2  # the rows stop at different ids of the list
    out = dec.generate(prompts, 16, eos_token_id=eos, pad_token_id=-1)
    for b in range(len(prompts)):
        row = free.sequences[b].tolist()
        end = next(i for i, t in enumerate(row) if t in eos) + 1  # the first of any EOS id ends the row
        assert int(out.lengths[b]) == end <= 3
        assert out.sequences[b, :end].tolist() == row[:end] and set(out.sequences[b, end:].tolist()) <= {-1}
    # one id behaves as the one-element list
    one = dec.generate(prompts, 16, eos_token_id=eos[0])
    assert torch.equal(one.sequences, dec.generate(prompts, 16, eos_token_id=[eos[0]]).sequences)


@pytest.mark.parametrize("bad", [[], [1, "2"], 1.5, True, [-1], "3"])
def test_bad_eos_is_refused(bad):
    dec = SpeculativeDecoder(tiny_lm(0))
    with pytest.raises(ValueError, match=r"^eos_token_id must be None, an int >= 0, or a non-empty list"):
        dec.generate([[1]], 4, eos_token_id=bad)
