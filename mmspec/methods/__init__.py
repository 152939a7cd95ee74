"""One method registry for every modality, the CLI, the bench, the demo and batch generation.

::

    from mmspec import methods

    recipe = methods.resolve("ar-image", "zipar+gsd", {"zipar_window": 4})  # validation only
    parts = methods.build(recipe, {"target": model, "codebook": vq.codebook()})
    decoder = SpeculativeDecoder(model, parts.drafter, rule=parts.rule, schedule=parts.schedule)

``names(modality)`` lists the named methods, ``knobs(modality, method)`` their knobs (type,
default, doc, allowed values); ``register_part`` / ``register_method`` add a drafter, rule or
schedule and a named recipe of them (see ``registry``); a part declares the pipeline ``Component``
it needs and, for a trained drafter, its ``TrainingRecipe``: ``components(modality)`` and
``recipes()`` list them, ``recipe_for(modality, component)`` links them. ``modalities()``:
``"ar-image"`` (``methods.ar_image``), ``"vlm"`` (``methods.vlm``), ``"text"`` (``methods.text``),
``"continuous"`` (``methods.continuous``), ``"video"`` (``methods.video``: the streaming
pipeline's cache modes). ``method="auto"`` (``methods.auto``) chooses among an image or VLM
modality's methods from the machine's measured cost profile; ``validate`` checks any method name
and knobs, ``"auto"`` included.
"""

from .knobs import KnobSpec, check_config, knob
from .registry import (KINDS, REQUIRED, TIMINGS, Component, Composition, Method, MethodRecipe, Modality, Part,
                       TrainingRecipe, build, components, knobs, modalities, modality, names, option_name, parts,
                       parts_markdown, recipe_for, recipes, register_component, register_method, register_modality,
                       register_part, register_recipe, resolve)
from . import ar_image, continuous, text, video, vlm  # noqa: E402,F401  (the built-in registrations)
from . import auto  # noqa: E402  (method="auto": the choice from a machine's cost profile)
from .auto import validate  # noqa: E402

__all__ = [
    "KINDS", "REQUIRED", "TIMINGS", "Component", "Composition", "KnobSpec", "Method", "MethodRecipe", "Modality",
    "Part", "TrainingRecipe", "build", "check_config", "components", "knob", "knobs", "modalities", "modality", "names",
    "option_name", "parts", "parts_markdown", "recipe_for", "recipes", "register_component", "register_method",
    "register_modality", "register_part", "register_recipe", "resolve", "auto", "validate",
]
