"""The method registry: parts, named methods and modalities, and the one way a name becomes core objects.

A *part* is a named drafter, acceptance rule or decoding schedule with a frozen config dataclass
(its knobs), a builder ``build(config, components) -> core object``, the model components it
needs, and whether it keeps the target's distribution. A *method* is a named, documented recipe of
parts (``"gsd"`` = Jacobi drafter + grouped rule). A *modality* (``"ar-image"``, ``"vlm"``,
``"text"``) lists the parts and methods it supports, the components its callers pass, and default
knob overrides. A part may declare the pipeline component it needs (``Component``: attribute name,
class, how it binds to the target) and, for a trained drafter, its training recipe
(``TrainingRecipe``): pipelines derive their optional components from ``components(modality)`` and
``mmspec train`` its extra subcommands from ``recipes()``, so a new drafter is one file.

Any ``a+b+c`` of a modality's parts resolves wherever the parts' declared partners allow it, so
the grammar is the same for every modality.

Knobs are flat and prefixed by the part's knob prefix (``sjd_window``, ``tree_depth``), validated
from the config's field types and metadata (``knob(default, min=..., choices=...)``) before any
model exists.
"""

from __future__ import annotations

import dataclasses
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..core.errors import check, check_choice
from ..utils.refs import is_ref, load_ref
from .knobs import KnobSpec, config_specs

KINDS = ("schedule", "drafter", "rule")
"""A recipe holds at most one part of each kind, in this order."""

Traits = Iterable[str] | Callable[[Any], Iterable[str]]


@dataclass(frozen=True)
class Part:
    """A named drafter, rule or schedule.

    Args:
        name: what methods call it (``"sjd"``), unique within a modality.
        kind: ``"schedule"``, ``"drafter"`` or ``"rule"``.
        config: the frozen config dataclass of its knobs.
        build: ``build(config, components) -> core object``; ``components`` maps component names
            to objects (``"target"`` always, plus what ``requires`` names).
        requires: model components it needs besides the target, e.g. ``("draft_model",)``.
        lossless: whether decoding keeps the target's distribution (greedy bit-identical).
        doc: one line: what it is and the paper it comes from.
        prefix: its knob prefix (the name unless several parts share knobs, e.g. the VLM's trees).
        traits: properties partners can ask for, e.g. ``"lane_safe"`` (a model-free chain drafter
            the next-set schedule can run per row) or ``"deterministic"`` (drafts with q = 1);
            static, or a function of the config.
        partners: ``{kind: names or traits}``: a partner of that kind, when the recipe has one, must
            be one of these names or carry one of these traits (``gsd``: ``{"drafter": ("sjd",)}``).
        implies: ``{kind: part}`` added when the recipe has no part of that kind (``gsd`` -> ``sjd``).
        knob_info: per field ``{"min", "max", "choices"}`` for configs without ``knob`` metadata.
        prefixed: False keeps the knobs' field names unprefixed, for parts whose knobs are their
            pipeline's own arguments (video's ``sink_frames``); names still must not collide.
    """

    name: str
    kind: str
    config: type
    build: Callable[[Any, Mapping[str, Any]], Any]
    requires: tuple[str, ...] = ()
    lossless: bool = True
    doc: str = ""
    prefix: str = ""
    traits: Traits = ()
    partners: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    implies: Mapping[str, str] = field(default_factory=dict)
    knob_info: Mapping[str, Mapping] = field(default_factory=dict)
    prefixed: bool = True
    specs: Mapping[str, KnobSpec] = field(init=False, repr=False, compare=False, default=None)
    """``{field: KnobSpec}`` of the config, named with the prefix (derived)."""

    def __post_init__(self):
        check(isinstance(self.name, str) and re.fullmatch(r"[a-z][a-z0-9_-]*", self.name) is not None, "name",
              "a lower-case part name without '+' (letters, digits, '_', '-')", self.name)
        check_choice("kind", self.kind, KINDS)
        check(callable(self.build), "build", "a callable build(config, components)", self.build)
        check(dataclasses.is_dataclass(self.config) and self.config.__dataclass_params__.frozen, "config",
              "a frozen dataclass type (its knobs)", self.config)
        check(isinstance(self.requires, tuple) and all(isinstance(r, str) for r in self.requires), "requires",
              "a tuple of component names", self.requires)
        check(isinstance(self.lossless, bool), "lossless", "True or False", self.lossless)
        for kind, allowed in self.partners.items():
            check_choice("partners", kind, KINDS)
            check(isinstance(allowed, tuple), f"partners[{kind!r}]", "a tuple of part names or traits", allowed)
        for kind in self.implies:
            check_choice("implies", kind, KINDS)
        if not self.prefix:
            object.__setattr__(self, "prefix", self.name.replace("-", "_"))
        check(re.fullmatch(r"[a-z][a-z0-9_]*", self.prefix) is not None, "prefix", "a lower-case identifier",
              self.prefix)
        object.__setattr__(self, "specs", config_specs(self.config, self.prefix if self.prefixed else "",
                                                           self.knob_info, self.name))

    def traits_of(self, config) -> frozenset[str]:
        return frozenset(self.traits(config) if callable(self.traits) else self.traits)

    def make_config(self, values: Mapping[str, Any]):
        """The config from ``{field: validated value}``; a cross-field error raised by the config
        is re-named with this part's prefix (``delta`` -> ``lantern_delta``)."""
        try:
            return self.config(**values)
        except ValueError as err:
            msg = str(err)
            head = msg.split(" ", 1)[0]
            if head in self.specs:
                msg = self.specs[head].name + msg[len(head):]
            raise ValueError(msg) from None


@dataclass(frozen=True)
class Method:
    """A named recipe: its parts (``"zipar+gsd"``) and knob presets, documented."""

    name: str
    parts: str
    doc: str = ""
    knobs: Mapping[str, Any] = field(default_factory=dict)


def _identity(obj, components):
    return obj


TIMINGS = ("tokens", "features", "heads", "span")
"""How a ``Component``'s passes are timed (``Component.timing``)."""


@dataclass(frozen=True)
class Component:
    """A pipeline component a part needs (a trained drafter's model or head).

    Args:
        name: the pipeline's attribute and ``__init__`` argument, and its ``model_index.json`` key
            (``"medusa_head"``).
        cls: the model class (a diffusers ``ModelMixin`` or transformers ``PreTrainedModel``), or
            ``"module:Class"``, imported when first asked for (``load_class``), so registering
            imports no model.
        bind: ``bind(obj, components) -> the object build receives``; ``components`` holds the
            target (and the modality's other base components). Default: ``obj`` itself.
        provides: the name parts ``require`` and ``build`` reads (default: ``name``), e.g. the
            VLM's ``draft_model`` provides ``"draft"``, its ``VLMTarget`` view.
        doc: one line: what it is.
        timing: how ``mmspec bench cost`` times its passes (``TIMINGS``): ``"tokens"``, a model
            called as ``forward(tokens, positions, cache, tree_mask)`` (a draft model);
            ``"features"``, a head called as ``forward(features, tokens, positions, cache,
            tree_mask)`` (EAGLE's); ``"heads"``, parallel heads scoring a whole draft from one
            feature per row (Medusa's); ``"span"``, a transformers model run from its input
            embedding to its LM head (a VLM draft model).
    """

    name: str
    cls: type | str
    bind: Callable[[Any, Mapping[str, Any]], Any] = _identity
    provides: str = ""
    doc: str = ""
    timing: str = "tokens"

    def __post_init__(self):
        check(isinstance(self.name, str) and re.fullmatch(r"[a-z][a-z0-9_]*", self.name) is not None, "name",
              "a lower-case identifier (the pipeline attribute)", self.name)
        check(isinstance(self.cls, type) or is_ref(self.cls), "cls", "a class or a 'module:Class' string", self.cls)
        check(callable(self.bind), "bind", "a callable bind(obj, components)", self.bind)
        check_choice("timing", self.timing, TIMINGS)
        if not self.provides:
            object.__setattr__(self, "provides", self.name)

    def load_class(self) -> type:
        """The component's class (``cls`` imported when given as ``"module:Class"``)."""
        return load_ref(self.cls)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()
"""The default of a ``TrainingRecipe`` option that must be given."""


def option_name(flag: str) -> str:
    """The keyword an option's value is passed as: ``"--rollout-steps"`` -> ``"rollout_steps"``."""
    return flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class TrainingRecipe:
    """How to train a drafter's component: an ``mmspec train`` subcommand.

    Args:
        name: the subcommand (``"ar-toy"``); must not clash with the built-in recipes.
        train: ``train(out_dir, **options) -> dict`` (the training log), writing a checkpoint
            folder the component's class loads with ``from_pretrained``; ``options`` are the CLI
            options below plus ``steps``, ``batch_size``, ``lr``, ``seed``, ``dataset_size``,
            ``log_every`` and ``log``. A callable, or ``"module:function"``, imported when the
            recipe runs (``trainer``), so registering imports no training code (the bundled
            drafters name ``mmspec.training.recipes.registered``'s functions so).
        options: the recipe's own CLI options: ``(flag, type, default, help)`` tuples, e.g.
            ``("--target", str, None, "the AR pipeline folder")``; the option's value is passed as
            the flag's name without dashes (``target=...``); a default of ``REQUIRED`` makes the
            flag required. ``train`` validates the values (the types only parse them).
        heldout_metric: the key of the returned log that ``mmspec train`` prints.
        defaults: ``steps``, ``batch_size``, ``lr``, ``dataset_size`` defaults of the CLI.
        doc: one line for ``mmspec train --help``.
        check_options: ``check_options(options)``: checks between options (``{name: value}``) run
            before anything loads, raising ``ValueError`` that names the flags.
        report: ``report(log) -> str``: what ``mmspec train`` prints after ``saved DIR: ``
            (default: the held-out metric and its value). ``train`` may return None (the other
            processes of an ``accelerate launch``): nothing is printed then.
        alias: the built-in subcommand that also runs this recipe, as typed:
            ``"ar-draft --kind chain"`` (its ``--kind`` choices list the recipes naming it) or
            ``"continuous-draft"``; ``""`` for none.
    """

    name: str
    train: Callable[..., dict | None] | str
    heldout_metric: str
    options: tuple[tuple[str, type, Any, str], ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=lambda: dict(steps=100, batch_size=8, lr=1e-3,
                                                                     dataset_size=256))
    doc: str = ""
    check_options: Callable[[Mapping[str, Any]], None] | None = None
    report: Callable[[dict], str] | None = None
    alias: str = ""

    def __post_init__(self):
        check(isinstance(self.name, str) and re.fullmatch(r"[a-z][a-z0-9-]*", self.name) is not None, "name",
              "a lower-case subcommand name", self.name)
        check(callable(self.train) or is_ref(self.train), "train",
              "a callable train(out_dir, **options) -> dict or a 'module:function' string", self.train)
        check(isinstance(self.heldout_metric, str) and self.heldout_metric != "", "heldout_metric",
              "the key of the training log to report", self.heldout_metric)
        for opt in self.options:
            check(isinstance(opt, tuple) and len(opt) == 4 and isinstance(opt[0], str) and opt[0].startswith("--")
                  and callable(opt[1]), "options", "(flag, type, default, help) tuples with flags like '--target'",
                  opt)
        missing = sorted({"steps", "batch_size", "lr", "dataset_size"} - set(self.defaults))
        check(not missing, "defaults", "steps, batch_size, lr and dataset_size", missing)
        for name in ("check_options", "report"):
            value = getattr(self, name)
            check(value is None or callable(value), name, "a callable or None", value)
        check(isinstance(self.alias, str) and (self.alias == "" or re.fullmatch(
            r"[a-z][a-z0-9-]*( --[a-z][a-z0-9-]* [a-z][a-z0-9_-]*)?", self.alias) is not None), "alias",
              "'' or a subcommand as typed, with at most one selecting option ('ar-draft --kind chain')", self.alias)

    def trainer(self) -> Callable[..., dict | None]:
        """The ``train`` callable (``train`` imported when given as ``"module:function"``); a name
        that does not import raises ``ValueError`` naming the recipe."""
        try:
            fn = load_ref(self.train)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"recipe {self.name!r}: train names {self.train}, which cannot be imported "
                             f"({err})") from None
        check(callable(fn), f"recipe {self.name!r}'s train", "a callable train(out_dir, **options)", fn)
        return fn

    def option_values(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """``{name: value}`` of the recipe's options (``--rollout-steps`` is ``rollout_steps``):
        the value in ``given`` unless that is None, the default otherwise (None for a required
        option not given)."""
        out = {}
        for flag, _, default, _ in self.options:
            name = option_name(flag)
            value = given.get(name)
            out[name] = value if value is not None else (None if default is REQUIRED else default)
        return out


@dataclass
class Modality:
    """What one modality supports: its parts, named methods (in listing order), the components
    its callers pass to ``build`` (``components``: the base ones, ``"target"`` among them;
    ``component_specs``: the parts' declared ``Component``s, in registration order) and default
    knob overrides (``{"tree_depth": 6}``); ``trained_by`` maps a component's name to the name of
    the training recipe registered with it."""

    name: str
    components: tuple[str, ...]
    doc: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, Part] = field(default_factory=dict)
    methods: dict[str, Method] = field(default_factory=dict)
    component_specs: dict[str, Component] = field(default_factory=dict)
    trained_by: dict[str, str] = field(default_factory=dict)

    def accepted_components(self) -> tuple[str, ...]:
        declared = [c.provides for c in self.component_specs.values()]
        extra = [r for p in self.parts.values() for r in p.requires]
        return tuple(dict.fromkeys(self.components + tuple(declared) + tuple(extra)))


@dataclass(frozen=True)
class MethodRecipe:
    """A resolved method: validated parts and configs, no model involved.

    ``parts`` are part names in kind order (schedule, drafter, rule); ``configs`` maps each part to
    its config; ``knobs`` every knob of the recipe with its resolved value; ``requires`` the model
    components ``build`` needs besides the target; ``lossless`` holds when every part is."""

    name: str
    modality: str
    parts: tuple[str, ...]
    kinds: tuple[str, ...]
    configs: dict[str, Any]
    knobs: dict[str, Any]
    requires: tuple[str, ...]
    lossless: bool
    doc: str

    def part(self, kind: str) -> str | None:
        """The part of ``kind`` (``"drafter"``, ...) or None."""
        check_choice("kind", kind, KINDS)
        return dict(zip(self.kinds, self.parts)).get(kind)


@dataclass
class Composition:
    """The core objects of a recipe; ``None`` where the recipe has no part of that kind (the
    decoder then uses no drafter, its exact rule and raster order)."""

    drafter: Any
    rule: Any
    schedule: Any


_MODALITIES: dict[str, Modality] = {}
_RECIPES: dict[str, TrainingRecipe] = {}


def register_modality(name: str, *, components: Iterable[str], defaults: Mapping[str, Any] | None = None,
                      doc: str = "") -> Modality:
    """Declare a modality, the component names its callers pass to ``build`` (``"target"`` among
    them) and default knob overrides (checked against its parts when a method resolves)."""
    check(isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9-]*", name) is not None, "name",
          "a lower-case modality name", name)
    check(name not in _MODALITIES, "name", "a modality not registered yet", name)
    components = tuple(components)
    check("target" in components, "components", "component names including 'target'", components)
    mod = Modality(name, components, doc, dict(defaults or {}))
    _MODALITIES[name] = mod
    return mod


def modality(name: str) -> Modality:
    check_choice("modality", name, sorted(_MODALITIES))
    return _MODALITIES[name]


def register_part(part: Part | None = None, *, modalities: Iterable[str], component: Component | None = None,
                  recipe: TrainingRecipe | None = None, **fields) -> Part:
    """Add a part to ``modalities``: ``register_part(Part(...), modalities=...)`` or the Part's
    fields as keywords (``name=..., kind=..., config=..., build=..., ...``).

    ``component``: the pipeline component the part requires (``register_component`` for each of
    ``modalities``); ``recipe``: how to train it (``register_recipe``)."""
    if part is None:
        part = Part(**fields)
    else:
        check(not fields, "register_part", "a Part or its fields as keywords, not both", sorted(fields))
    check(isinstance(part, Part), "part", "a mmspec.methods.Part", part)
    mods = [modality(m) for m in ([modalities] if isinstance(modalities, str) else modalities)]
    check(len(mods) > 0, "modalities", "at least one registered modality", modalities)
    for mod in mods:
        check(part.name not in mod.parts, "name", f"a part name not yet used in {mod.name!r}", part.name)
    if component is not None:
        check(isinstance(component, Component), "component", "a mmspec.methods.Component", component)
        check(component.provides in part.requires, "component",
              f"a component the part requires ({', '.join(part.requires) or 'it requires none'})", component.provides)
        for mod in mods:
            _check_component(mod, component)
    check(recipe is None or component is not None, "recipe", "given with the component it trains", recipe)
    if recipe is not None:
        _check_recipe(recipe)
    # everything is checked above, so nothing below refuses: a refused part leaves no trace
    for mod in mods:
        mod.parts[part.name] = part
        if component is not None:
            register_component(mod.name, component)
        if recipe is not None:
            mod.trained_by[component.name] = recipe.name
    if recipe is not None:
        register_recipe(recipe)
    return part


def register_component(modality_name: str, component: Component) -> Component:
    """Declare a pipeline component of ``modality_name`` (what ``register_part(component=...)``
    does): its pipelines take it as an optional ``__init__`` argument, save and load it. The same
    name twice is refused unless it is the same component."""
    mod = modality(modality_name)
    check(isinstance(component, Component), "component", "a mmspec.methods.Component", component)
    _check_component(mod, component)
    mod.component_specs[component.name] = component
    return component


def register_recipe(recipe: TrainingRecipe) -> TrainingRecipe:
    """Add ``recipe`` to ``recipes()`` (an ``mmspec train`` subcommand)."""
    _check_recipe(recipe)
    _RECIPES[recipe.name] = recipe
    return recipe


def _check_component(mod: Modality, component: Component) -> None:
    known = mod.component_specs.get(component.name)
    check(known is None or known == component, "component",
          f"a component name not yet declared in {mod.name!r} (or the same component)", component.name)
    check(component.name not in mod.components, "component",
          f"a name other than the base components of {mod.name!r} ({', '.join(mod.components)})", component.name)
    check(all(c.provides != component.provides for c in mod.component_specs.values() if c.name != component.name),
          "component", f"a 'provides' name not yet declared in {mod.name!r}", component.provides)


def _check_recipe(recipe: TrainingRecipe) -> None:
    check(isinstance(recipe, TrainingRecipe), "recipe", "a mmspec.methods.TrainingRecipe", recipe)
    known = _RECIPES.get(recipe.name)
    check(known is None or known == recipe, "recipe", "a training recipe name not yet registered", recipe.name)


def components(modality_name: str) -> tuple[Component, ...]:
    """The pipeline components the parts of a modality declared, in registration order."""
    return tuple(modality(modality_name).component_specs.values())


def recipes() -> dict[str, TrainingRecipe]:
    """The registered training recipes by name, in registration order (``mmspec train`` lists them)."""
    return dict(_RECIPES)


def recipe_for(modality_name: str, component_name: str) -> TrainingRecipe | None:
    """The training recipe registered with a component of ``modality_name`` (``register_part(...,
    component=, recipe=)``), or None; an unknown component raises ``ValueError`` naming it."""
    mod = modality(modality_name)
    check_choice("component", component_name, tuple(mod.component_specs))
    return _RECIPES.get(mod.trained_by.get(component_name, ""))


def modalities() -> tuple[str, ...]:
    """The registered modalities, in registration order."""
    return tuple(_MODALITIES)


def register_method(name: str, parts: str | None = None, *, modalities: Iterable[str], doc: str = "",
                    knobs: Mapping[str, Any] | None = None) -> Method:
    """Name a recipe for ``modalities``: ``parts`` is a ``+`` composition of their parts (default:
    ``name``; ``""`` for no part), ``knobs`` presets that user knobs override. The recipe is
    resolved here, so a bad registration fails at import time."""
    check(isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9_+-]*", name) is not None, "name",
          "a lower-case method name", name)
    method = Method(name, name if parts is None else parts, doc, dict(knobs or {}))
    mods = [modality(m) for m in ([modalities] if isinstance(modalities, str) else modalities)]
    check(len(mods) > 0, "modalities", "at least one registered modality", modalities)
    for mod in mods:
        check(name not in mod.methods, "name", f"a method name not yet used in {mod.name!r}", name)
        _resolve(mod, name, method.parts, method.knobs, {}, doc)
    for mod in mods:
        mod.methods[name] = method
    return method


def names(modality_name: str) -> tuple[str, ...]:
    """The named methods of a modality, in registration order (what the bench, CLI and demo list)."""
    return tuple(modality(modality_name).methods)


def parts(modality_name: str) -> dict[str, Part]:
    """The parts a modality supports, by name."""
    return dict(modality(modality_name).parts)


def parts_markdown() -> str:
    """Every registered part as a Markdown table (modality, kind, name, lossless, models it needs,
    its one-line doc): the table docs/concepts.md carries (``scripts/docs_tables.py`` writes it,
    ``tests/test_docs.py`` checks it is current)."""
    lines = ["| modality | kind | part | lossless | needs | what it is |", "|---|---|---|---|---|---|"]
    for mod in modalities():
        for part in sorted(parts(mod).values(), key=lambda p: (KINDS.index(p.kind), p.name)):
            needs = ", ".join(f"`{r}`" for r in part.requires) or "-"
            doc = " ".join(part.doc.split()).replace("|", "\\|")
            lines.append(f"| {mod} | {part.kind} | `{part.name}` | {'yes' if part.lossless else '**no**'} | {needs} | "
                         f"{doc} |")
    return "\n".join(lines) + "\n"


def resolve(modality_name: str, method: str, knobs: Mapping[str, Any] | None = None) -> MethodRecipe:
    """Validate ``method`` and ``knobs`` for a modality; no model is needed.

    ``method`` is a named method or a ``+`` composition of the modality's parts. Unknown methods,
    parts or knobs, wrong knob types, out-of-range values and compositions the parts do not allow
    raise ``ValueError`` naming the argument and the allowed values."""
    mod = modality(modality_name)
    check(knobs is None or (isinstance(knobs, Mapping) and all(isinstance(k, str) for k in knobs)),
          "method_knobs", "a mapping of knob names to values (or None)", knobs)
    check(isinstance(method, str) and method.strip() != "", "method", _method_choices(mod), method)
    named = mod.methods.get(method)
    if named is not None:
        return _resolve(mod, method, named.parts, named.knobs, dict(knobs or {}), named.doc)
    return _resolve(mod, method, method, {}, dict(knobs or {}), "")


def knobs(modality_name: str, method: str) -> dict[str, KnobSpec]:
    """``{knob: KnobSpec}`` of every knob ``method`` accepts, defaults as this modality uses them
    (``"auto"``: its own, ``mmspec.methods.auto``)."""
    if method == "auto":
        from .auto import CANDIDATES, knob_specs

        if modality_name in CANDIDATES:
            return knob_specs(modality_name)
    recipe = resolve(modality_name, method)
    mod = modality(modality_name)
    out = {}
    for part_name in recipe.parts:
        for spec in mod.parts[part_name].specs.values():
            out[spec.name] = dataclasses.replace(spec, default=recipe.knobs[spec.name])
    return out


def build(recipe: MethodRecipe, components: Mapping[str, Any]) -> Composition:
    """Build ``recipe``'s core objects from model ``components`` (``{"target": ..., ...}``).

    Unknown component names and a missing (or ``None``) component the recipe needs raise
    ``ValueError`` naming it, before any part is built."""
    check(isinstance(recipe, MethodRecipe), "recipe", "a MethodRecipe from mmspec.methods.resolve",
          type(recipe).__name__)
    mod = modality(recipe.modality)
    check(isinstance(components, Mapping), "components", "a mapping of component names to objects",
          type(components).__name__)
    allowed = mod.accepted_components()
    unknown = sorted(set(components) - set(allowed))
    check(not unknown, "components", f"names among {', '.join(allowed)} for {mod.name!r}", unknown)
    check(components.get("target") is not None, "target", f"the target model for method {recipe.name!r}", None)
    for part_name in recipe.parts:
        for need in mod.parts[part_name].requires:
            check(components.get(need) is not None, need,
                  f"given for method {recipe.name!r} (its part {part_name!r} needs it)", None)
    view = types.MappingProxyType(dict(components))
    built = {kind: mod.parts[p].build(recipe.configs[p], view) for kind, p in zip(recipe.kinds, recipe.parts)}
    return Composition(built.get("drafter"), built.get("rule"), built.get("schedule"))


def _method_choices(mod: Modality) -> str:
    by_kind = [", ".join(p.name for p in mod.parts.values() if p.kind == k) for k in KINDS]
    grammar = " | ".join(g for g in by_kind if g)
    return (f"one of the {mod.name} methods ({', '.join(repr(m) for m in mod.methods)}) or a '+' "
            f"composition of its parts ({grammar})")


def _resolve(mod: Modality, name: str, spec: str, presets: Mapping[str, Any], given: dict, doc: str) -> MethodRecipe:
    tokens = [] if spec == "" or spec == "none" else spec.split("+")
    for t in tokens:
        check(t in mod.parts, "method", _method_choices(mod), name)
    check(len(set(tokens)) == len(tokens), "method", "a composition naming each part at most once", name)
    chosen: dict[str, Part] = {}
    for t in tokens:
        part = mod.parts[t]
        check(part.kind not in chosen, "method",
              f"a composition with at most one {part.kind} ({chosen.get(part.kind, part).name} or {t})", name)
        chosen[part.kind] = part
    for part in list(chosen.values()):  # a rule's implied drafter, ...
        for kind, implied in part.implies.items():
            if kind not in chosen:
                check(implied in mod.parts, "method", f"parts registered in {mod.name!r} ({part.name} implies "
                      f"{implied})", name)
                chosen[kind] = mod.parts[implied]
    ordered = [chosen[k] for k in KINDS if k in chosen]

    # knobs: config defaults < modality defaults < method presets < the caller's
    specs = {s.name: s for p in ordered for s in p.specs.values()}
    check(len(specs) == sum(len(p.specs) for p in ordered), "method",
          "parts whose knobs have distinct names (their prefixes collide)", name)
    for source, values in (("method_knobs", given), ("knobs", presets)):  # the caller's, the registration's
        unknown = sorted(set(values) - set(specs))
        check(not unknown, source, f"knobs of {name!r} (method knobs: {', '.join(sorted(specs)) or 'none'})",
              unknown[0] if len(unknown) == 1 else unknown)
    values: dict[str, Any] = {}
    for knob_name, spec in specs.items():
        if knob_name in given:
            values[knob_name] = spec.validate(given[knob_name])
        elif knob_name in presets:
            values[knob_name] = spec.validate(presets[knob_name])
        elif knob_name in mod.defaults:
            values[knob_name] = spec.validate(mod.defaults[knob_name])
        else:
            values[knob_name] = spec.default
    configs = {p.name: p.make_config({f: values[s.name] for f, s in p.specs.items()}) for p in ordered}

    # every part's declared partners, by name or trait
    for part in ordered:
        for kind, allowed in part.partners.items():
            other = chosen.get(kind)
            if other is None:
                continue
            if other.name in allowed or other.traits_of(configs[other.name]) & set(allowed):
                continue
            fits = [p.name for p in mod.parts.values() if p.kind == kind
                    and (p.name in allowed or p.traits_of(_default_config(p, mod)) & set(allowed))]
            why = f" ({other.name!r} is not {' or '.join(allowed)} with these knobs)" if other.name in fits else ""
            check(False, "method", f"{part.name!r} with a {kind} among {', '.join(fits) or 'none'}"
                  + ("" if kind in part.implies else " or none") + why, name)
    requires = tuple(dict.fromkeys(r for p in ordered for r in p.requires))
    doc = doc or " + ".join(p.doc for p in ordered) or "the target alone"
    return MethodRecipe(name, mod.name, tuple(p.name for p in ordered), tuple(p.kind for p in ordered), configs,
                        values, requires, all(p.lossless for p in ordered), doc)


def _default_config(part: Part, mod: Modality):
    return part.make_config({f: mod.defaults.get(s.name, s.default) for f, s in part.specs.items()})
