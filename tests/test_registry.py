"""The method registry (``mmspec.methods``): adding a method is one drafter, its registration and
this test; every bad name, knob or composition is refused with a message naming it.

The toy drafter below is registered for the ``"ar-image"`` and ``"text"`` modalities in this file
only (a fixture restores the registry afterwards). Lossless claims are checked bit for bit under
greedy decoding, and under sampling by the core's distribution test: seed 0, N = 20,000 rows of
the first 3 tokens of an 8-token tiny LM against the exact joint (512 cells), chi-square at
p >= 1e-3; the same test must reject the toy with an always-accept rule.
"""

import re
from dataclasses import dataclass

import pytest
import torch

from mmspec import methods
from mmspec.core import LogitsProcessor, SpeculativeDecoder, SpeculativeSampling
from mmspec.core.exactness import P_THRESHOLD, chisquare_pvalue, exact_joint, sequence_index
from mmspec.core.tree import DraftTree, Tree
from mmspec.methods import registry
from mmspec.models.llamagen import LlamaGenModel
from tiny import reference_greedy, spread, tiny_lm


# -- the toy drafter: one class, one config, one registration -----------------------------------
class RepeatDrafter:
    """Drafts each row's last token ``gamma`` times: deterministic (q = None), no model."""

    vocab_size = None
    forwards = 0
    lane_safe = True  # reads only each row's own last token: the next-set schedule may run it per row

    def __init__(self, gamma: int):
        self.gamma, self.max_block = gamma, gamma + 1

    def start(self, state):
        pass

    def propose(self, state):
        B = state.batch_size
        last = state.tokens[torch.arange(B), state.lengths[:B] - 1]  # (B,)
        tokens = last[:, None].repeat(1, self.gamma)  # (B, gamma)
        return DraftTree(tokens, Tree.chain(B, self.gamma, tokens.device))

    def update(self, state, draft, acceptance, target_probs, target_out):
        pass


@dataclass(frozen=True)
class RepeatConfig:
    """Repeat drafting.

    Args:
        gamma: draft tokens per round.
    """

    gamma: int = methods.knob(3, min=1, max=16)

    def __post_init__(self):
        methods.check_config(self)


def register_repeat():
    methods.register_part(
        name="repeat", kind="drafter", config=RepeatConfig, lossless=True,
        build=lambda cfg, components: RepeatDrafter(cfg.gamma),
        traits=("lane_safe", "deterministic"),  # model-free chain; q = 1 drafts
        doc="the last token, repeated", modalities=("ar-image", "text"))
    methods.register_method("repeat", doc="repeat drafting, exact verification", modalities=("ar-image", "text"))


@pytest.fixture
def repeat():
    saved = {name: (dict(m.parts), dict(m.methods), dict(m.defaults)) for name, m in registry._MODALITIES.items()}
    register_repeat()
    yield
    for name, (parts, named, defaults) in saved.items():
        mod = registry._MODALITIES[name]
        mod.parts, mod.methods, mod.defaults = parts, named, defaults


def decode(target, recipe, prompts, n, components=None, logits=None, seed=0, **kw):
    parts = methods.build(recipe, {"target": target, **(components or {})})
    dec = SpeculativeDecoder(target, parts.drafter, rule=parts.rule, schedule=parts.schedule,
                             processor=logits or LogitsProcessor(temperature=0.0))
    return dec.generate(prompts, n, generator=torch.Generator().manual_seed(seed), **kw)


def tiny_ar(seed=0):
    torch.manual_seed(seed)
    return LlamaGenModel(vocab_size=32, grid_size=4, num_classes=4, dim=32, n_layers=2, n_heads=2, mlp_hidden=64,
                         initializer_range=0.2).eval()


# -- adding a method ------------------------------------------------------------------------------
def test_a_registered_drafter_resolves_by_name_with_its_knob_validated(repeat):
    for modality in ("ar-image", "text"):
        assert "repeat" in methods.names(modality)
        recipe = methods.resolve(modality, "repeat", {"repeat_gamma": 5})
        assert recipe.parts == ("repeat",) and recipe.lossless and recipe.requires == ()
        assert recipe.knobs == {"repeat_gamma": 5} and recipe.configs["repeat"] == RepeatConfig(5)
        spec = methods.knobs(modality, "repeat")["repeat_gamma"]
        assert (spec.type, spec.default, spec.min, spec.max, spec.doc) == (int, 3, 1, 16, "draft tokens per round.")
    with pytest.raises(ValueError, match=re.escape("repeat_gamma must be an int in [1, 16], got 17")):
        methods.resolve("text", "repeat", {"repeat_gamma": 17})
    with pytest.raises(ValueError, match=re.escape("repeat_gamma must be an int in [1, 16], got 2.0")):
        methods.resolve("ar-image", "repeat", {"repeat_gamma": 2.0})
    with pytest.raises(ValueError, match="method must be one of the vlm methods"):
        methods.resolve("vlm", "repeat")  # not registered for the VLM


def test_a_registered_drafter_composes_where_the_parts_allow(repeat):
    # ZipAR takes lane-safe drafters, LANTERN deterministic (q = 1) drafts: both compose by name
    assert methods.resolve("ar-image", "zipar+repeat").parts == ("zipar", "repeat")
    lantern = methods.resolve("ar-image", "repeat+lantern", {"lantern_delta": 0.05})
    assert lantern.parts == ("repeat", "lantern") and not lantern.lossless and lantern.requires == ("codebook",)
    # GSD is SJD's test replaced: only the Jacobi drafter
    with pytest.raises(ValueError, match=re.escape("method must be 'gsd' with a drafter among sjd")):
        methods.resolve("ar-image", "repeat+gsd")
    with pytest.raises(ValueError, match=re.escape("at most one drafter (repeat or sjd), got 'repeat+sjd'")):
        methods.resolve("ar-image", "repeat+sjd")
    with pytest.raises(ValueError, match="method must be one of the text methods"):
        methods.resolve("text", "zipar+repeat")  # the text modality has no next-set schedule


def test_a_registered_drafter_is_lossless_under_greedy(repeat):
    # text: a tiny LM with spread weights, whose greedy continuations repeat tokens
    lm = spread(tiny_lm(0, vocab_size=16, dim=32))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    base = decode(lm, methods.resolve("text", "none"), prompts, 24)
    out = decode(lm, methods.resolve("text", "repeat"), prompts, 24)
    assert torch.equal(out.sequences, base.sequences)
    assert out.sequences[0].tolist() == reference_greedy(lm, prompts[0], 24)
    assert out.stats.target_forwards < base.stats.target_forwards  # repeats were accepted
    # ar-image: a tiny LlamaGen with classifier-free guidance, alone and under LANTERN at delta 0
    model = tiny_ar()
    labels = [0, 3, 1]
    guided = LogitsProcessor(temperature=0.0, guidance_scale=3.0)
    kw = dict(logits=guided, uncond_input_ids=model.uncond_prompts(len(labels)))
    base = decode(model, methods.resolve("ar-image", "none"), model.class_prompts(labels), 16, **kw)
    out = decode(model, methods.resolve("ar-image", "repeat"), model.class_prompts(labels), 16, **kw)
    assert torch.equal(out.sequences, base.sequences)
    codebook = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    relaxed = decode(model, methods.resolve("ar-image", "repeat+lantern", {"lantern_delta": 0.0}),
                     model.class_prompts(labels), 16, {"codebook": codebook}, **kw)
    assert torch.equal(relaxed.sequences, base.sequences)  # delta 0: LANTERN's test is exact
    grid = decode(model, methods.resolve("ar-image", "zipar+repeat", {"zipar_window": 2}), model.class_prompts(labels),
                  16, **kw)  # the next-set schedule runs the toy per row
    assert grid.sequences.shape == (3, 16) and grid.stats.target_forwards < base.stats.target_forwards


def test_a_registered_drafter_runs_in_the_pipeline_by_name(repeat):
    from mmspec.models.vq import TinyVQModel
    from mmspec.pipelines import SpeculativeARImagePipeline

    torch.manual_seed(0)
    vq = TinyVQModel().eval()
    torch.manual_seed(1)
    target = LlamaGenModel(vocab_size=vq.config.codebook_size, grid_size=vq.grid_size, num_classes=16, dim=32,
                           n_layers=1, n_heads=2, mlp_hidden=64, initializer_range=0.3).eval()
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(class_labels=[3, 7], temperature=0.0, output_type="latent")
    base = pipe(method="none", **kw)
    out = pipe(method="repeat", method_knobs={"repeat_gamma": 5}, **kw)
    assert torch.equal(out.images, base.images) and out.stats["nfe"] < base.stats["nfe"]
    with pytest.raises(ValueError, match="repeat_gamma"):
        pipe(method="repeat", method_knobs={"repeat_gamma": 0}, **kw)


class AlwaysAccept(SpeculativeSampling):
    """Broken: accept every draft."""

    def accept_prob(self, p, q, x):
        return torch.ones_like(p[:, 0])


@pytest.mark.parametrize("broken", [False, True])
def test_a_registered_drafter_keeps_the_sampled_distribution(repeat, broken):
    lm = tiny_lm(0, vocab_size=8)
    prompt, n, N, sampled = [3, 1, 4], 3, 20_000, LogitsProcessor(temperature=1.0)
    parts = methods.build(methods.resolve("text", "repeat", {"repeat_gamma": 2}), {"target": lm})
    dec = SpeculativeDecoder(lm, parts.drafter, rule=AlwaysAccept() if broken else parts.rule, processor=sampled)
    out = dec.generate(torch.tensor([prompt]).expand(N, -1), n, generator=torch.Generator().manual_seed(0))
    p = chisquare_pvalue(sequence_index(out.sequences[:, :n], 8), exact_joint(lm, prompt, n, sampled))
    assert (p < P_THRESHOLD) if broken else (p >= P_THRESHOLD), p


# -- what the built-in modalities list ----------------------------------------------------------
def test_names_per_modality():
    ar = ("none", "sd", "eagle", "lantern", "sjd", "gsd", "zipar", "zipar+sjd", "zipar+gsd", "sjd+lantern",
          "zipar+sjd+lantern")  # the methods the AR bench has always run, in its order (others may join)
    assert [m for m in methods.names("ar-image") if m in ar] == list(ar)
    assert methods.names("vlm") == ("none", "sd", "lookup", "eagle", "specvlm", "vispec", "medusa")
    assert methods.names("text") == ("none", "sd", "tree", "tree-sampled", "jacobi")


def test_recipes_and_modality_defaults():
    gsd = methods.resolve("ar-image", "zipar+gsd", {"zipar_window": 4})
    assert gsd.parts == ("zipar", "sjd", "gsd") and gsd.kinds == ("schedule", "drafter", "rule")
    assert gsd.part("rule") == "gsd" and not gsd.lossless and gsd.knobs["zipar_window"] == 4
    assert methods.resolve("ar-image", "lantern").requires == ("eagle_head", "codebook")
    assert methods.resolve("ar-image", "sd").lossless and methods.resolve("vlm", "vispec").requires == ("vispec_head",)
    # one tree config, each modality's defaults: EAGLE-2 (LANTERN's) for ar-image, the bench's for text
    assert {k: v.default for k, v in methods.knobs("ar-image", "eagle").items()} == {
        "eagle_top_k": 10, "eagle_depth": 4, "eagle_total_tokens": 59, "eagle_mode": "topk"}
    assert {k: v.default for k, v in methods.knobs("text", "tree").items()} == {
        "tree_top_k": 4, "tree_depth": 4, "tree_total_tokens": 16, "tree_mode": "topk"}
    assert methods.resolve("text", "tree-sampled").knobs == {"tree_top_k": 2, "tree_depth": 3, "tree_total_tokens": 16,
                                                             "tree_mode": "sample"}
    assert {k: v.default for k, v in methods.knobs("vlm", "eagle").items()} == {
        "tree_top_k": 8, "tree_depth": 6, "tree_total_tokens": 24}
    assert methods.resolve("vlm", "eagle", {"tree_depth": 5}).configs["eagle"].depth == 5
    for name in ("ar-image", "vlm", "text"):  # every modality default is a knob of one of its parts
        mod = methods.modality(name)
        knob_names = {s.name for p in mod.parts.values() for s in p.specs.values()}
        assert set(mod.defaults) <= knob_names
    for name in ("ar-image", "vlm", "text"):  # every knob documented, for the CLI's and a UI's help
        for part in methods.parts(name).values():
            assert part.doc and all(spec.doc for spec in part.specs.values()), (name, part.name)
    spec = methods.knobs("ar-image", "sjd")["sjd_init"]
    assert spec.choices == ("random", "repeat", "spatial") and spec.allowed() == "one of 'random', 'repeat', 'spatial'"
    assert methods.knobs("ar-image", "lantern")["lantern_lam"].allowed() == "None or a float >= 1"


# -- refused, with the message ------------------------------------------------------------------
AR_METHODS = ", ".join(repr(m) for m in methods.names("ar-image"))


@pytest.mark.parametrize("modality, method, knobs, message", [
    ("audio", "none", None, "modality must be one of 'ar-image', 'continuous', 'text', 'video', 'vlm', got 'audio'"),
    ("ar-image", "hydra", None, f"method must be one of the ar-image methods ({AR_METHODS}) or a '+' composition "
                                 "of its parts (zipar | sd, eagle, medusa, sjd"),
    ("ar-image", "hydra", None, "| gsd, lantern), got 'hydra'"),
    ("ar-image", "", None, "method must be one of the ar-image methods"),
    ("ar-image", 3, None, "method must be one of the ar-image methods"),
    ("ar-image", "sjd+", None, "got 'sjd+'"),
    ("ar-image", "none+sjd", None, "got 'none+sjd'"),
    ("vlm", "zipar", None, "method must be one of the vlm methods ('none', 'sd', 'lookup', 'eagle', 'specvlm', "
                           "'vispec', 'medusa') or a '+' composition of its parts (sd, lookup, eagle, specvlm, "
                           "vispec, medusa)"),
    ("ar-image", "sjd+sjd", None, "method must be a composition naming each part at most once, got 'sjd+sjd'"),
    ("ar-image", "gsd+lantern", None, "method must be a composition with at most one rule (gsd or lantern)"),
    ("ar-image", "sd+eagle", None, "method must be a composition with at most one drafter (sd or eagle)"),
    ("ar-image", "zipar+eagle", None, "method must be 'zipar' with a drafter among sjd"),
    ("ar-image", "zipar+sd", None, "or none, got 'zipar+sd'"),
    ("ar-image", "zipar+sjd", {"sjd_init": "spatial"},
     "or none ('sjd' is not lane_safe with these knobs), got 'zipar+sjd'"),
    ("ar-image", "sd+gsd", None, "method must be 'gsd' with a drafter among sjd"),
    ("ar-image", "sd+lantern", None, "method must be 'lantern' with a drafter among eagle, sjd"),
    ("ar-image", "sd", {"gsd_p_threshold": 0.1},
     "method_knobs must be knobs of 'sd' (method knobs: sd_gamma), got 'gsd_p_threshold'"),
    ("ar-image", "sjd", {"gsd_p_threshold": 0.1}, "method_knobs must be knobs of 'sjd' (method knobs: sjd_init"),
    ("ar-image", "none", {"sjd_window": 8}, "method_knobs must be knobs of 'none' (method knobs: none), got 'sjd_window'"),
    ("vlm", "lookup", {"tree_depth": 3},
     "method_knobs must be knobs of 'lookup' (method knobs: lookup_max_ngram, lookup_num_tokens), got 'tree_depth'"),
    ("vlm", "eagle", {"tree_width": 3}, "method_knobs must be knobs of 'eagle'"),
    ("ar-image", "sjd", [("sjd_window", 8)], "method_knobs must be a mapping of knob names to values (or None)"),
    ("ar-image", "sjd", {"sjd_window": 1}, "sjd_window must be an int >= 2, got 1"),
    ("ar-image", "sjd", {"sjd_window": 8.0}, "sjd_window must be an int >= 2, got 8.0"),
    ("ar-image", "sjd", {"sjd_window": True}, "sjd_window must be an int >= 2, got True"),
    ("ar-image", "sjd", {"sjd_window": "8"}, "sjd_window must be an int >= 2, got '8'"),
    ("ar-image", "sjd", {"sjd_init": "left"}, "sjd_init must be one of 'random', 'repeat', 'spatial', got 'left'"),
    ("ar-image", "sjd", {"sjd_init": None}, "sjd_init must be one of 'random', 'repeat', 'spatial', got None"),
    ("ar-image", "lantern", {"lantern_delta": 2.0}, "lantern_delta must be a float in [0, 1], got 2.0"),
    ("ar-image", "lantern", {"lantern_delta": False}, "lantern_delta must be a float in [0, 1], got False"),
    ("ar-image", "lantern", {"lantern_k": 0}, "lantern_k must be None or an int >= 1, got 0"),
    ("ar-image", "lantern", {"lantern_lam": 0.5}, "lantern_lam must be None or a float >= 1, got 0.5"),
    ("ar-image", "lantern", {"lantern_lam": 2.0, "lantern_delta": 0.2},
     "lantern_delta must be left at its default 0.1 when lam is set"),
    ("ar-image", "gsd", {"gsd_p_threshold": float("nan")}, "gsd_p_threshold must be a float >= 0, got nan"),
    ("ar-image", "gsd", {"gsd_half_width": 0}, "gsd_half_width must be an int >= 1, got 0"),
    ("ar-image", "zipar", {"zipar_window": 0}, "zipar_window must be an int >= 1, got 0"),
    ("ar-image", "eagle", {"eagle_mode": "beam"}, "eagle_mode must be one of 'topk', 'sample', got 'beam'"),
    ("vlm", "eagle", {"tree_depth": 0}, "tree_depth must be an int >= 1, got 0"),
    ("vlm", "sd", {"sd_gamma": 2.5}, "sd_gamma must be an int >= 1, got 2.5"),
    ("text", "jacobi", {"jacobi_init": "spatial"}, "jacobi_init must be one of 'random', 'repeat', got 'spatial'"),
])
def test_resolve_refuses(modality, method, knobs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        methods.resolve(modality, method, knobs)


def test_build_refuses_missing_and_unknown_components():
    target = tiny_ar()
    with pytest.raises(ValueError, match=re.escape("draft_model must be given for method 'sd' (its part 'sd' needs it)")):
        methods.build(methods.resolve("ar-image", "sd"), {"target": target})
    with pytest.raises(ValueError, match=re.escape("codebook must be given for method 'sjd+lantern'")):
        methods.build(methods.resolve("ar-image", "sjd+lantern"), {"target": target, "codebook": None})
    with pytest.raises(ValueError, match=re.escape("components must be names among target, draft, eagle_head, "
                                                   "specvlm_head, vispec_head, medusa_head for 'vlm', got ['draft_model']")):
        methods.build(methods.resolve("vlm", "sd"), {"target": target, "draft_model": target})
    with pytest.raises(ValueError, match="target must be the target model"):
        methods.build(methods.resolve("text", "none"), {})
    with pytest.raises(ValueError, match=re.escape("zipar_window must be an int in [1, 4] (the grid's width), got 8")):
        methods.build(methods.resolve("ar-image", "zipar"), {"target": target})  # the grid is known only here
    with pytest.raises(ValueError, match="recipe must be a MethodRecipe"):
        methods.build("sjd", {"target": target})


def test_lantern_builds_its_neighbour_table_once_per_codebook():
    from mmspec.core.relaxed import latent_neighbours

    target, recipe = tiny_ar(), methods.resolve("ar-image", "sjd+lantern", {"lantern_k": 5})
    codebook = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    first = methods.build(recipe, {"target": target, "codebook": codebook}).rule.neighbours
    again = methods.build(recipe, {"target": target, "codebook": codebook.clone()}).rule.neighbours
    assert again.data_ptr() == first.data_ptr()  # the same content: the table is reused
    assert torch.equal(first, latent_neighbours(codebook, 6))
    other = methods.build(recipe, {"target": target, "codebook": codebook.flip(0)}).rule.neighbours
    assert torch.equal(other, latent_neighbours(codebook.flip(0), 6)) and not torch.equal(other, first)


def test_registration_is_checked():
    with pytest.raises(ValueError, match="name must be a part name not yet used in 'ar-image'"):
        methods.register_part(methods.parts("ar-image")["sjd"], modalities=("ar-image",))
    with pytest.raises(ValueError, match="kind must be one of 'schedule', 'drafter', 'rule', got 'verifier'"):
        methods.Part(name="x", kind="verifier", config=RepeatConfig, build=lambda c, m: None)
    with pytest.raises(ValueError, match="name must be a lower-case part name without"):
        methods.Part(name="a+b", kind="drafter", config=RepeatConfig, build=lambda c, m: None)
    with pytest.raises(ValueError, match="method must be 'gsd' with a drafter among sjd"):
        methods.register_method("sd-gsd", "sd+gsd", modalities=("ar-image",))  # resolved when registered
    with pytest.raises(ValueError, match=re.escape("knobs must be knobs of 'sd-8' (method knobs: sd_gamma), "
                                                   "got 'sjd_window'")):
        methods.register_method("sd-8", "sd", knobs={"sjd_window": 8}, modalities=("ar-image",))
    assert "sd-gsd" not in methods.names("ar-image") and "sd-8" not in methods.names("ar-image")

    @dataclass
    class Mutable:
        gamma: int = 3

    with pytest.raises(ValueError, match="config must be a frozen dataclass type"):
        methods.Part(name="x", kind="drafter", config=Mutable, build=lambda c, m: None)


def test_components_and_training_recipes_are_declared_and_checked():
    from mmspec.models.medusa import GridMedusaHeads

    ar = {c.name: c for c in methods.components("ar-image")}
    assert list(ar) == ["draft_model", "eagle_head", "medusa_head"]
    assert ar["medusa_head"].load_class() is GridMedusaHeads  # "module:Class", imported when asked
    assert [(c.name, c.provides) for c in methods.components("vlm")][0] == ("draft_model", "draft")
    assert [c.name for c in methods.components("continuous")] == ["draft_model"]
    assert "draft" in methods.modality("vlm").accepted_components()
    with pytest.raises(ValueError, match="name must be a lower-case identifier"):
        methods.Component("Head", GridMedusaHeads)
    with pytest.raises(ValueError, match="cls must be a class or a 'module:Class' string"):
        methods.Component("head", "no colon")
    with pytest.raises(ValueError, match="component must be a component name not yet declared in 'ar-image'"):
        methods.register_component("ar-image", methods.Component("medusa_head", "x:Y"))
    with pytest.raises(ValueError, match=r"component must be a name other than the base components of 'ar-image' \(target, codebook\)"):
        methods.register_component("ar-image", methods.Component("codebook", "x:Y"))
    methods.register_component("ar-image", ar["medusa_head"])  # the same component again: allowed
    with pytest.raises(ValueError, match=r"component must be a component the part requires \(it requires none\)"):
        methods.register_part(name="nohead", kind="drafter", config=RepeatConfig, build=lambda cfg, c: None,
                              modalities=("text",), component=methods.Component("nohead_head", "x:Y"))
    assert "nohead" not in methods.parts("text")  # refused before anything was added
    with pytest.raises(ValueError, match="heldout_metric must be the key of the training log"):
        methods.TrainingRecipe("x", lambda out, **kw: {}, heldout_metric="")
    with pytest.raises(ValueError, match="options must be"):
        methods.TrainingRecipe("x", lambda out, **kw: {}, "m", options=(("target", str, None, "h"),))
    for alias in ("ar-draft --kind", "ar-draft kind chain", "Ar-draft", "ar-draft --kind chain --x y"):
        with pytest.raises(ValueError, match=r"alias must be '' or a subcommand as typed"):
            methods.TrainingRecipe("x", lambda out, **kw: {}, "m", alias=alias)
    with pytest.raises(ValueError, match="report must be a callable or None"):
        methods.TrainingRecipe("x", lambda out, **kw: {}, "m", report="held-out")
    with pytest.raises(ValueError, match="check_options must be a callable or None"):
        methods.TrainingRecipe("x", lambda out, **kw: {}, "m", check_options=3)
    with pytest.raises(ValueError, match="component must be one of 'draft_model', 'eagle_head', 'medusa_head'"):
        methods.recipe_for("ar-image", "codebook")
    with pytest.raises(ValueError, match="recipe must be given with the component it trains"):
        methods.register_part(name="norecipe", kind="drafter", config=RepeatConfig, build=lambda cfg, c: None,
                              modalities=("text",), recipe=methods.TrainingRecipe("x", lambda out, **kw: {}, "m"))


def test_training_recipes_are_linked_to_their_components():
    assert methods.modalities() == ("ar-image", "continuous", "text", "video", "vlm")
    assert methods.recipe_for("ar-image", "medusa_head") is methods.recipes()["ar-medusa"]
    assert methods.recipe_for("vlm", "draft_model").name == "vlm-sd"
    recipe = methods.TrainingRecipe(
        "x", lambda out, **kw: {}, "m", alias="ar-draft --kind x",
        options=(("--target", str, methods.REQUIRED, "t"), ("--rollout-steps", int, 2, "r"), ("--heads", int, None, "h")))
    assert recipe.option_values({"target": "d", "rollout_steps": None, "other": 1}) == \
        {"target": "d", "rollout_steps": 2, "heads": None}
    assert recipe.option_values({}) == {"target": None, "rollout_steps": 2, "heads": None}
    assert repr(methods.REQUIRED) == "REQUIRED" and methods.option_name("--rollout-steps") == "rollout_steps"
