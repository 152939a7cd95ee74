"""``SpeculativePipeline``: the diffusers contract, written once for every modality's pipeline.

A modality subclasses it with its main components, a ``modality`` name from the method registry,
``base_components(requires)`` (the modality's base components for ``methods.build``: ``"target"``,
...) with ``_method_components`` naming the attributes that hold them, a ``check_inputs`` that
calls ``check_shared_inputs`` and its own checks, and a ``__call__``: check inputs, encode the
conditioning, one ``self.decode(...)`` (one ``SpeculativeDecoder.generate``), decode the outputs.
Its ``__init__`` takes the main components and ``**components``, and registers
``self.method_modules(components)`` beside them. The base gives it:

- the method components from the registry (``methods.components(modality)``: every trained
  drafter's model or head): ``_optional_components``, keyword arguments of ``__init__`` (a
  generated signature, refreshed from the registry whenever diffusers' ``from_pretrained``,
  ``save_pretrained`` or ``components`` or the folder check reads it, so a component registered
  after the class was defined appears too), ``method_modules``
  (unknown names refused naming the argument and the allowed names) and ``method_components``
  (each bound as its ``Component.bind`` says);

- ``from_pretrained``: ``check_pipeline_folder`` first, then diffusers' loader in float32
  (checkpoints ship as fp16);
- ``check_shared_inputs``: the method and its knobs through the registry, refused when a part needs
  a component this pipeline lacks; generator lists (one per output row); flags; the callback and
  its tensor inputs; all before any model runs;
- ``decode``: the progress bar (``set_progress_bar_config``), ``callback_on_step_end`` with its
  returned dict honoured, ``pipe._interrupt = True`` stopping after the current pass (the
  subclass's ``__call__`` ends with ``self.maybe_free_model_hooks()``);
- ``postprocess_images``: diffusers' ``VaeImageProcessor`` for ``output_type``.

Callbacks: ``callback_on_step_end(pipe, step, timestep, callback_kwargs) -> dict`` after every
decode pass; ``step`` counts passes from 0, ``timestep`` is the tokens decoded so far per output
(an image's tokens, or the longest answer's), ``callback_kwargs`` holds the requested
``callback_on_step_end_tensor_inputs`` (``_callback_tensor_inputs``):

- ``"tokens"``: (B, n) each row's generated tokens so far, right-padded with 0 (a copy; read-only:
  tokens the target has read cannot change without a new prefill, so returning it is refused);
- ``"next_tokens"``: (B,) each row's last emitted token, the one the next pass feeds the target;
  a returned ``"next_tokens"`` replaces it (in the output too), and decoding continues from it.

Drafts are never callback inputs: each pass drafts anew from the (edited) history and the
target verifies every draft. A callback may also set ``pipe._guidance_scale`` (diffusers' CFG
cut-off): the next pass on uses the new scale (``SpeculativePipeline.decode``).

The returned dict must be a dict (``{}`` to change nothing). Tensor inputs need a raster schedule
(ZipAR decodes several lanes per image; ``method="zipar..."`` refuses them).

Model offload (``pipe.enable_model_cpu_offload()``): ``model_cpu_offload_seq`` chains the main
flow only, the target and then the model that turns its tokens into pixels
(``"transformer->vqvae"``); drafts and heads, which run between the target's passes, get unchained
hooks. ``decode`` first moves the target and the models the method uses to the execution device
(``onload_models``) and builds the decoder there, so caches, history and the heads' reads of the
target's weights happen there and the target stays for the whole decode. Decoding pixels
(``decode`` under ``apply_forward_hook``) offloads the target; ``maybe_free_model_hooks`` offloads
the rest. Models the method does not use stay on the CPU. Greedy outputs equal those without
offload (``tests/test_offload.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable

import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor

from .. import methods
from ..core import LogitsProcessor, SpeculativeDecoder
from ..core.decoder import DecodeOutput, DecodeState
from ..core.errors import check, check_choice
from ..core.gate import GatedDrafter, SpeedGate
from ..core.shapes import forced_static_shapes
from ..methods import auto
from . import checks

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
RECOMPILE_LIMIT = 64
"""Compiled entries per forward under ``enable_compiled_steps`` (dynamo's ``recompile_limit``)."""


class PipelineBase(DiffusionPipeline):
    """What every mmspec pipeline shares, the speculative ones and the streaming video one:
    ``from_pretrained`` with the folder checked first, ``interrupt``, and the callback checks.

    Weights are safetensors only. ``save_pretrained`` writes them (diffusers' default);
    ``save_pretrained(safe_serialization=False)`` writes ``.bin`` pickles instead, which
    ``from_pretrained`` refuses (``FileNotFoundError`` naming the ``.bin`` file it found): loading a
    pickle can run code, so no mmspec loader reads one."""

    _callback_tensor_inputs: list[str] = []

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader, computing in float32 by default (checkpoints ship as fp16), after
        ``check_pipeline_folder`` has checked every component folder (nothing is built before)."""
        from .loading import check_pipeline_folder

        check_pipeline_folder(pretrained_model_name_or_path, cls, provided=kwargs)
        kwargs.setdefault("dtype", torch.float32)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @property
    def interrupt(self) -> bool:
        """Set ``pipe._interrupt = True`` (from a callback) to stop after the current pass (a
        speculative pipeline) or chunk (a video stream); outputs keep what was made. Every call
        starts with it False."""
        return getattr(self, "_interrupt", False)

    def check_callback(self, callback_on_step_end, callback_on_step_end_tensor_inputs):
        """The callback and the tensor inputs it asks for (names among ``_callback_tensor_inputs``),
        checked before any model runs; returns the inputs."""
        checks.check_callback(callback_on_step_end, "callback_on_step_end")
        inputs = callback_on_step_end_tensor_inputs
        check(isinstance(inputs, (list, tuple)) and all(k in self._callback_tensor_inputs for k in inputs),
              "callback_on_step_end_tensor_inputs", f"a list of names among {self._callback_tensor_inputs}", inputs)
        return inputs


class _RegistryComponents:
    """``_optional_components``: the method components of the class's modality, read from the
    registry on every access (a part registered after the class still appears)."""

    def __get__(self, obj, owner) -> list[str]:
        if not owner.modality:
            return []
        owner._refresh_signature()
        return [c.name for c in methods.components(owner.modality)]


class SpeculativePipeline(PipelineBase):
    """Base of the speculative pipelines: the diffusers contract over the core's one loop."""

    modality: str = ""
    """The method registry's modality (``"ar-image"``, ``"vlm"``)."""
    _method_components: dict[str, str] = {}
    """Base component name (``methods.register_modality``'s ``components``) -> the attribute of
    this pipeline that holds it (``"target"`` -> ``"transformer"``); the registry's method
    components are attributes of their ``Component.name``."""
    _optional_components = _RegistryComponents()
    _callback_tensor_inputs = ["tokens", "next_tokens"]
    _callback_replaceable = ("next_tokens",)

    # -- method components (from the registry) ----------------------------------------------------
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._refresh_signature()

    @classmethod
    def _refresh_signature(cls) -> None:
        """Give the class's ``__init__`` a signature listing the registry's method components
        (keyword-only, default ``None``) after its own parameters; ``**components`` takes them."""
        init = cls.__dict__.get("__init__")
        if init is None or not cls.modality:
            return
        names = tuple(c.name for c in methods.components(cls.modality))
        if getattr(init, "_mmspec_components", None) == names:
            return
        if not hasattr(init, "_mmspec_own"):
            own = inspect.signature(init, follow_wrapped=False).parameters.values()
            init._mmspec_own = [p for p in own if p.kind is not p.VAR_KEYWORD]
        extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
        init.__signature__ = inspect.Signature(init._mmspec_own + extra)
        init._mmspec_components = names

    @classmethod
    def _get_signature_keys(cls, obj):
        (obj if isinstance(obj, type) else type(obj))._refresh_signature()
        return super()._get_signature_keys(obj)

    def method_modules(self, given: dict[str, Any]) -> dict[str, Any]:
        """``{name: module or None}`` for every method component of this modality, from the
        ``**components`` an ``__init__`` received; unknown names raise ``ValueError`` naming them
        and the allowed names."""
        type(self)._refresh_signature()
        allowed = [c.name for c in methods.components(self.modality)]
        unknown = sorted(set(given) - set(allowed))
        check(not unknown, "components", f"method components of {self.modality!r} among {', '.join(allowed)}",
              unknown[0] if len(unknown) == 1 else unknown)
        return {name: given.get(name) for name in allowed}

    def bind_modules(self, base: dict[str, Any]) -> None:
        """Bind the method components present to ``base`` (``{"target": ...}``) now, so a head
        that does not fit the target is refused when the pipeline is built."""
        for component in methods.components(self.modality):
            module = getattr(self, component.name, None)
            if module is not None:
                component.bind(module, base)

    def base_components(self, requires: tuple[str, ...]) -> dict[str, Any]:
        """The modality's base components ``methods.build`` takes (``"target"`` first) for a
        recipe that needs ``requires``; it may also hold a method component already bound (under
        its ``provides`` name), which ``method_components`` then keeps."""
        raise NotImplementedError

    def method_components(self, requires: tuple[str, ...]) -> dict[str, Any]:
        """The components ``methods.build`` takes (``"target"`` first) for a recipe that needs
        ``requires`` (``MethodRecipe.requires``): the base ones and each registry component the recipe
        needs, bound (``Component.bind``); ``None`` where missing or not needed."""
        out = self.base_components(requires)
        for component in methods.components(self.modality):
            if component.provides in out:  # bound by base_components already
                continue
            module = getattr(self, component.name, None)
            needed = module is not None and component.provides in requires
            out[component.provides] = component.bind(module, out) if needed else None
        return out

    def component_attribute(self, name: str) -> str:
        """The attribute holding the component ``methods.build`` calls ``name``."""
        for component in methods.components(self.modality):
            if component.provides == name:
                return component.name
        return self._method_components.get(name, name)

    # -- inputs -----------------------------------------------------------------------------------

    def onload_models(self, recipe: methods.MethodRecipe) -> None:
        """Under model offload, move the target and the models ``recipe`` uses to the execution
        device now, before anything reads them outside ``forward`` (``new_cache``, heads reading
        the target's embedding and LM head, a VLM target's embeddings); without offload hooks
        nothing happens. The target comes last: it leads ``model_cpu_offload_seq``, so its hook
        offloads nothing, while a later chain member's hook (the VQ's, for its codebook) offloads
        its predecessor, the target."""
        names = (*recipe.requires, "target")
        onload(*(getattr(self, self.component_attribute(name)) for name in names))

    def check_method(self, method, method_knobs) -> methods.MethodRecipe:
        """``method`` and its knobs through the registry; a part that needs a component this
        pipeline lacks is refused naming it."""
        recipe = checks.check_method(self.modality, method, method_knobs)
        for need in recipe.requires:
            attr = self.component_attribute(need)
            check(getattr(self, attr, None) is not None, "method",
                  f"a method whose parts this pipeline holds (it has no {attr})", method)
        return recipe

    def check_shared_inputs(self, *, method, method_knobs, batch_size: int, generator, return_dict,
                            callback_on_step_end, callback_on_step_end_tensor_inputs) -> methods.MethodRecipe:
        """The arguments every speculative pipeline takes, checked before any model runs;
        ``batch_size`` is the number of output rows (a generator list has one per row). Returns the
        resolved recipe; ``method="auto"`` resolves to the method ``choose_method`` picks."""
        self._auto = None
        checks.check_generator(generator, batch_size)
        checks.check_flag(return_dict, "return_dict")
        inputs = self.check_callback(callback_on_step_end, callback_on_step_end_tensor_inputs)
        if method == "auto":
            recipe = self.choose_method(method_knobs, batch_size, raster_only=bool(inputs))
        else:
            recipe = self.check_method(method, method_knobs)
        check(not inputs or recipe.part("schedule") is None, "callback_on_step_end_tensor_inputs",
              f"[] with method {method!r} (its schedule decodes several lanes per output)", inputs)
        return recipe

    # -- method="auto" ----------------------------------------------------------------------------
    def set_cost_profile(self, profile: "auto.CostProfile | str | None") -> None:
        """The cost profile ``method="auto"`` chooses from: a ``CostProfile``, a path to one, or
        None (the default: this pipeline's profile for this machine in ``auto.cache_dir()``, written
        by ``mmspec bench cost --calibrate``)."""
        if profile is not None and not isinstance(profile, auto.CostProfile):
            profile = auto.CostProfile.load(profile)
        check(profile is None or profile.modality == self.modality, "profile",
              f"a cost profile of a {self.modality!r} pipeline", None if profile is None else profile.modality)
        self._cost_profile = profile

    def model_fingerprint(self) -> str:
        """SHA-256 of what the pipeline computes with: each model component's class and config
        (``mmspec.models.binding.target_fingerprint``: paths, dtype and versions left out) and a
        digest of its first and last weights (a retrained head changes the profile's key), computed
        once per pipeline object: heads that adapt while serving keep the key they were loaded with."""
        from ..models.binding import target_fingerprint

        cached = getattr(self, "_model_fingerprint", None)
        if cached is not None:  # the weights at first use: heads adapting online keep their profile
            return cached
        parts = {}
        for name in sorted(self.components):
            module = getattr(self, name, None)
            if module is None or not hasattr(module, "config") or not isinstance(module, torch.nn.Module):
                continue
            params = list(module.parameters())
            digest = [float(p.detach().double().sum()) for p in (params[:1] + params[-1:])]
            parts[name] = [target_fingerprint(module), sum(p.numel() for p in params), digest]
        self._model_fingerprint = auto.fingerprint(parts)
        return self._model_fingerprint

    def profile_identity(self) -> tuple[str, str, str]:
        """``(model fingerprint, machine, dtype)``: what a cost profile of this pipeline is keyed by
        (the machine of the device the target's weights are on, ``auto.machine_id``)."""
        weight = next(getattr(self, self.component_attribute("target")).parameters())
        return self.model_fingerprint(), auto.machine_id(weight.device.type), str(weight.dtype).replace("torch.", "")

    def cost_profile(self) -> "auto.CostProfile | None":
        """The profile set with ``set_cost_profile``, else this pipeline's on this machine, or None."""
        given = getattr(self, "_cost_profile", None)
        if given is not None:
            return given
        return auto.find_profile(self.modality, *self.profile_identity())

    def choose_method(self, method_knobs, batch_size: int, raster_only: bool = False) -> methods.MethodRecipe:
        """``method="auto"``: the recipe of the candidate ``auto.choose`` picks for ``batch_size``
        rows among those this pipeline holds the components for (raster-order ones only when
        callback tensor inputs are asked for); the choice is kept for ``decode`` (its online gate)
        and reported in the output's stats."""
        knobs = auto.check_auto_knobs(self.modality, method_knobs)
        profile = self.cost_profile()
        available = None
        if profile is not None:
            available = []
            for label, row in profile.rows.items():
                recipe = auto.recipe(self.modality, row.method, row.knobs)
                held = all(getattr(self, self.component_attribute(need), None) is not None
                           for need in recipe.requires)
                if held and not (raster_only and recipe.part("schedule") is not None):
                    available.append(label)
        b = knobs["auto_batch_size"] or batch_size
        choice = auto.choose(profile, b, knobs["auto_quality"], available,
                             hint=" (run `mmspec bench cost --calibrate`, or pipe.set_cost_profile(path))")
        self._auto = (choice, knobs)
        return self.check_method(choice.method, choice.knobs)

    def auto_stats(self, gate: GatedDrafter | None) -> dict:
        """What ``method="auto"`` chose and did, for the output's stats (empty for other methods)."""
        if getattr(self, "_auto", None) is None:
            return {}
        choice, knobs = self._auto
        out = {"auto": choice.reason, "auto_method": choice.label, "auto_predicted_x": round(choice.predicted_x, 4),
               "auto_batch_size": choice.batch_size, "auto_lossless": choice.row is None or choice.row.lossless}
        if gate is not None:
            log = gate.log
            out.update(auto_passes_on=log.passes_on, auto_passes_off=log.passes_off, auto_switches=log.switches,
                       auto_decisions=[list(d) for d in log.decisions])
        return out

    @property
    def guidance_scale(self) -> float | None:
        """The classifier-free guidance scale in use (the call's ``guidance_scale``; ``None`` for a
        pipeline without guidance). A ``callback_on_step_end`` may set ``pipe._guidance_scale``
        (diffusers' pattern) and the next pass uses it; see ``decode``."""
        return getattr(self, "_guidance_scale", None)

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the current scale guides: not ``None`` and not 1 (0 is the unconditional model,
        as the ``guidance_scale`` argument means it; diffusers' pipelines test ``> 1``)."""
        return self.guidance_scale is not None and self.guidance_scale != 1.0

    # -- compiled steps ---------------------------------------------------------------------------
    def enable_compiled_steps(self, mode: str = "reduce-overhead", fullgraph: bool = True,
                              backend: str = "inductor") -> None:
        """Compile the decoding steps: the forward of the target and of every draft model or head
        this pipeline holds, each ``torch.compile(forward, mode=mode, fullgraph=fullgraph,
        dynamic=False, backend=backend)``, and decode with static shapes (``mmspec.core.shapes``:
        caches attend over their whole buffer, masked; draft models catch up a fixed number of
        entries), so each (batch, block width) compiles once and later calls replay it. On CUDA,
        ``mode="reduce-overhead"`` is meant to replay the steps as CUDA graphs (gpt-fast's recipe;
        not yet run on a GPU); on the CPU the steps are compiled by Inductor. The first call of
        each shape compiles (tens of seconds for the bundled models here). A module may keep some
        calls eager (``eager_for``: a VLM head's first feed, stale stacked Medusa weights); the
        VLM pipeline compiles its transformers language models and runs their prompt passes
        eagerly (``_step_modules``). While compiled, each cache owner's ``new_cache`` hands out one
        cache per (batch, length), emptied each call, its buffers marked static
        (``_pooled_caches``). ``disable_compiled_steps()`` restores the eager forwards and fresh
        caches.

        Args:
            mode: ``torch.compile``'s mode (``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
                ``"max-autotune-no-cudagraphs"``); Inductor's only.
            fullgraph: refuse graph breaks (``True``: a step that cannot be one graph raises).
            backend: ``torch.compile``'s backend (``"inductor"``; ``"eager"`` traces without
                generating code, which is how the tests count recompiles quickly).
        """
        check_choice("mode", mode, COMPILE_MODES)
        checks.check_flag(fullgraph, "fullgraph")
        check(isinstance(backend, str) and bool(backend), "backend", "a torch.compile backend name", backend)
        self.disable_compiled_steps()
        options = dict(fullgraph=fullgraph, dynamic=False, backend=backend)
        if backend == "inductor":
            options["mode"] = mode
        # every (batch, width) bucket of every module is one entry of its forward's code object, which
        # the draft model shares with a target of its class: dynamo's default limit of 8 is too few
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        steps = list(self._step_modules())
        self._compiled_steps = [name for name, _ in steps]
        self._compiled_objects = []
        for name, module in steps:
            module.forward = _compiled_forward(module, options, self._eager_for(name, module))
            self._compiled_objects.append(module)
        for owner in self._cache_owners():
            owner.new_cache = _pooled_caches(type(owner).new_cache.__get__(owner))
            self._compiled_objects.append(owner)

    def disable_compiled_steps(self) -> None:
        """Back to the eager forwards (and to the device's own shape policy)."""
        for obj in getattr(self, "_compiled_objects", None) or ():
            vars(obj).pop("forward", None)
            vars(obj).pop("new_cache", None)
        self._compiled_steps = self._compiled_objects = None

    def enable_phase_timing(self, on: bool = True) -> None:
        """Time every phase of every pass (``prefill``, ``draft``, ``verify``, ``accept``,
        ``commit``) of the following calls into ``out.stats["seconds"]``: ``generate(...,
        profile=True)``, which synchronises the device after each phase (on a GPU this slows the
        call). ``on=False`` turns it off."""
        checks.check_flag(on, "on")
        self._phase_timing = on

    @property
    def compiled_steps(self) -> list[str] | None:
        """The components whose forwards are compiled (``enable_compiled_steps``), else ``None``."""
        return getattr(self, "_compiled_steps", None)

    def _step_modules(self):
        """(name, module) of each module whose forward is a decoding step: the target and every
        method component this pipeline holds."""
        names = [self.component_attribute("target")] + [c.name for c in methods.components(self.modality)]
        for name in names:
            module = getattr(self, name, None)
            if isinstance(module, torch.nn.Module):
                yield name, module

    def _eager_for(self, name: str, module):
        """``eager_for(*args, **kwargs) -> bool``: which calls of a step module compiled steps run
        eagerly (``None``: none); by default the module's own ``eager_for`` method."""
        return getattr(module, "eager_for", None)

    def _cache_owners(self):
        """What hands out the decode's caches (``new_cache``), pooled while compiled: the step
        modules that have one."""
        return [module for _, module in self._step_modules() if callable(getattr(module, "new_cache", None))]

    # -- decoding ---------------------------------------------------------------------------------
    def decode(self, recipe: methods.MethodRecipe, processor: LogitsProcessor, input_ids, max_new_tokens: int, *,
               tokens_done: Callable[[DecodeState], int], callback_on_step_end=None,
               callback_on_step_end_tensor_inputs=(), on_step: Callable[[DecodeState], None] | None = None,
               guidance_scale: float | None = None, **generate_kwargs) -> DecodeOutput:
        """One ``SpeculativeDecoder.generate`` with ``recipe``'s parts, under the progress bar.

        ``tokens_done(state)``: the progress, in tokens per output (at most ``max_new_tokens``), from
        ``state.generated`` (host ints the loop read with its stop flag: the bar reads no device value);
        ``on_step(state)``: the subclass's own per-pass hook (a streamer); ``guidance_scale``: the
        call's, as given (``pipe.guidance_scale`` during the call); ``generate_kwargs`` go to
        ``generate`` (``generator``, ``conditioning``, ``eos_token_id``, ...).

        A step is one target pass, which commits a variable number of tokens per row (one for
        ``method="none"``). When a callback sets ``pipe._guidance_scale``, drafts and verification
        use the new scale from the next pass on: each row's tokens up to its committed length at
        that pass used the old scale, the rest the new (a method equals ``"none"`` switched at the
        same committed length, ``tests/test_callbacks.py``). A call that started guided keeps its
        unconditional rows: ``None`` or 1 then merges with scale 1 (the conditional logits, to
        float rounding), 0 gives the unconditional ones. A call that started without guidance
        has no unconditional rows, so a guiding scale is refused (``ValueError`` naming
        ``guidance_scale``)."""
        decoder = self.build_decoder(recipe, processor)
        gate = decoder.drafter if isinstance(decoder.drafter, GatedDrafter) else None
        self._interrupt = False
        self._guidance_scale = guidance_scale
        vocab = getattr(decoder.target, "vocab_size", None)
        with self.progress_bar(total=max_new_tokens) as bar:
            seen, applied = 0, guidance_scale

            def step_end(step: int, state: DecodeState) -> bool:
                nonlocal seen, applied
                done = min(max_new_tokens, tokens_done(state))
                bar.update(max(0, done - seen))
                seen = max(seen, done)
                if on_step is not None:
                    on_step(state)
                if callback_on_step_end is not None:
                    kwargs = {k: self.callback_tensor_input(k, state) for k in callback_on_step_end_tensor_inputs}
                    returned = callback_on_step_end(self, step - 1, done, kwargs)
                    self.apply_callback_outputs(returned, state, callback_on_step_end_tensor_inputs, vocab)
                    if self._guidance_scale != applied:
                        state.processor = _with_guidance(state.processor, self._guidance_scale)
                        applied = self._guidance_scale
                return self.interrupt

            with forced_static_shapes() if self.compiled_steps else contextlib.nullcontext():
                out = decoder.generate(input_ids, max_new_tokens, callback=step_end,
                                       profile=getattr(self, "_phase_timing", False), **generate_kwargs)
            bar.update(max(0, max_new_tokens - seen) if not self.interrupt else 0)
        out.stats.extra.update(self.auto_stats(gate))
        return out

    def build_decoder(self, recipe: methods.MethodRecipe, processor: LogitsProcessor, target=None) -> SpeculativeDecoder:
        """The ``SpeculativeDecoder`` of ``recipe``'s parts over this pipeline's models (onloaded):
        what ``decode`` runs, and what continuous batching serves jobs through
        (``serve_tokens``). Under ``method="auto"`` (``auto_online``) its drafter is gated
        (``mmspec.core.gate.GatedDrafter``). ``target``: another view of the target that the
        parts and the decoder use instead of the pipeline's (a VLM stream's
        ``ContextTarget``)."""
        components = self.method_components(recipe.requires)  # before the onload: a getter may fire a hook
        if target is not None:
            components["target"] = target
        self.onload_models(recipe)
        parts = methods.build(recipe, components)
        drafter = parts.drafter
        chosen = getattr(self, "_auto", None)
        settings = chosen[0].gate_settings() if chosen is not None and chosen[1]["auto_online"] else None
        if settings is not None and drafter is not None:  # method="auto": speculation re-decided during the call
            every = chosen[1]["auto_every"]
            drafter = GatedDrafter(drafter, SpeedGate(**settings, every=every, probe=4 * every))
        return SpeculativeDecoder(components["target"], drafter, rule=parts.rule, processor=processor,
                                  schedule=parts.schedule, device=self._execution_device)

    def serve_tokens(self, recipe: methods.MethodRecipe, processor: LogitsProcessor, jobs, max_new_tokens: int, *,
                     slots: int, **serve_kwargs):
        """Continuous batching: ``SpeculativeDecoder.serve`` of ``jobs`` (``mmspec.core.Job``) with
        ``recipe``'s parts, yielding each ``Served`` job as it finishes (``serve_kwargs``:
        ``eos_token_id``, ...). No progress bar or callbacks: jobs finish out of order. Compiled
        steps are refused (a refill's prefill has its own shapes)."""
        check(not self.compiled_steps, "compiled steps", "off for continuous batching (disable_compiled_steps())",
              self.compiled_steps)
        decoder = self.build_decoder(recipe, processor)
        gate = decoder.drafter if isinstance(decoder.drafter, GatedDrafter) else None
        try:
            for served in decoder.serve(jobs, max_new_tokens, slots=slots, **serve_kwargs):
                served.stats.extra.update(self.auto_stats(gate))  # method="auto": its choice so far
                yield served
        finally:
            self.maybe_free_model_hooks()

    def callback_tensor_input(self, name: str, state: DecodeState) -> torch.Tensor:
        """The tensor input ``name`` (one of ``_callback_tensor_inputs``) a callback receives."""
        return _tensor_input(name, state)

    def apply_callback_outputs(self, returned, state: DecodeState, requested, vocab: int | None) -> None:
        """Honour what a callback returned (``_callback_replaceable`` inputs), else refuse it."""
        _apply_callback_outputs(returned, state, requested, vocab)

    # -- outputs ----------------------------------------------------------------------------------
    @property
    def image_processor(self) -> VaeImageProcessor:
        """diffusers' image post-processing: pixels in [-1, 1] -> ``output_type``."""
        if getattr(self, "_image_processor", None) is None:
            self._image_processor = VaeImageProcessor(do_resize=False, do_normalize=True)
        return self._image_processor

    def postprocess_images(self, pixels: torch.Tensor, output_type: str):
        """(N, 3, H, W) pixels in [-1, 1] -> PIL images, an (N, H, W, 3) array or an (N, 3, H, W)
        tensor in [0, 1] (``VaeImageProcessor.postprocess``)."""
        return self.image_processor.postprocess(pixels.float(), output_type=output_type)


def _compiled_forward(module, options: dict, eager_for=None):
    """``torch.compile`` of the module's forward; calls for which ``eager_for(*args, **kwargs)``
    (a host-side test, e.g. a first feed whose shape is the call's) is true run the uncompiled
    forward."""
    eager = type(module).forward.__get__(module)
    compiled = torch.compile(eager, **options)
    if eager_for is None:
        return compiled

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        return eager(*args, **kwargs) if eager_for(*args, **kwargs) else compiled(*args, **kwargs)

    return forward


def _pooled_caches(new_cache):
    """``new_cache(batch_size, max_len)`` that hands out one cache per size, emptied
    (``reset``) on each call, its key/value buffers marked static for dynamo: compiled steps then
    see the same tensors every call (tested), which a CUDA graph needs to replay on the buffers it
    recorded (Inductor skips cudagraphs for a graph that mutates a non-static input; not yet run
    on a GPU). Caches without ``reset``, or asked
    for with other arguments, are built anew."""
    pool: dict = {}

    def pooled(batch_size: int, max_len: int, *args, **kwargs):
        if args or kwargs:
            return new_cache(batch_size, max_len, *args, **kwargs)
        cache = pool.get((batch_size, max_len))
        if cache is not None:
            cache.reset()
            return cache
        cache = new_cache(batch_size, max_len)
        if callable(getattr(cache, "reset", None)):
            for buffer in (cache.k, cache.v, cache.overflowed):
                torch._dynamo.mark_static_address(buffer)
            pool[(batch_size, max_len)] = cache
        return cache

    return pooled


def onload(*modules) -> None:
    """Run each module's offload hook now, as a call of its ``forward`` would (what diffusers'
    ``apply_forward_hook`` does for ``decode``): under model offload the module moves to the
    execution device, a chained hook first offloading its predecessor. Modules without a hook
    (and ``None``) are left as they are."""
    for module in modules:
        hook = getattr(module, "_hf_hook", None)
        if hook is not None:
            hook.pre_forward(module)


def _with_guidance(logits, scale):
    """The call's logits processor with a callback's new guidance scale (see ``decode``)."""
    checks.check_number(scale, "guidance_scale", 0, optional=True)
    off = scale is None or scale == 1.0
    if not logits.uses_guidance:
        check(off, "guidance_scale", "None or 1.0 when set by callback_on_step_end in a call that started "
              "without guidance (its batch has no unconditional rows; pass a guidance_scale to the call "
              "to switch guidance between passes)", scale)
        return logits
    return dataclasses.replace(logits, guidance_scale=1.0 if scale is None else float(scale))


def _tensor_input(name: str, state: DecodeState) -> torch.Tensor:
    B = state.batch_size
    if name == "next_tokens":
        return state.roots.clone()  # (B,)
    start, n = state.prompt_lengths[:B], state.lengths[:B] - state.prompt_lengths[:B]
    span = torch.arange(int(n.max()), device=n.device)
    cols = (start[:, None] + span).clamp(max=state.tokens.shape[1] - 1)
    return state.tokens[:B].gather(1, cols).masked_fill(span >= n[:, None], 0)  # (B, n)


def _apply_callback_outputs(returned, state: DecodeState, requested, vocab: int | None) -> None:
    """Honour what a callback returned: replaceable tensor inputs are written into the state."""
    check(isinstance(returned, dict), "callback_on_step_end", "a callable returning a dict ({} to change nothing)",
          type(returned).__name__)
    for key, value in returned.items():
        check(key in requested and key in SpeculativePipeline._callback_replaceable, "callback_on_step_end",
              "a callable returning only requested tensor inputs it may replace "
              f"({', '.join(k for k in requested if k in SpeculativePipeline._callback_replaceable) or 'none'})",
              f"a dict with {key!r}")
        B = state.batch_size
        ok = (isinstance(value, torch.Tensor) and value.shape == (B,) and not value.is_floating_point()
              and bool((value >= 0).all()) and (vocab is None or bool((value < vocab).all())))
        check(ok, "next_tokens", f"a ({B},) integer tensor of token ids in [0, {vocab})", value)
        rows = torch.arange(state.rows, device=state.tokens.device)
        state.tokens[rows, state.lengths - 1] = state.expand(value.to(state.tokens))  # both CFG halves
