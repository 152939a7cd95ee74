"""Check a pipeline folder before diffusers (or transformers) reads any of it.

``check_pipeline_folder(path, SpeculativeVLMPipeline)`` runs first in ``from_pretrained``:

- the folder exists and its ``model_index.json`` is a JSON object naming the components;
- every component the pipeline needs is named, and no name the pipeline does not take (a value
  that is not a ``[library, class name]`` list is a pipeline setting, an argument of its
  ``__init__``);
- each named component's folder exists with what its class loads from: ``config.json`` and
  readable ``*.safetensors`` weights for a model (each file's header is read, so a truncated file
  is refused naming it and its component), the processor's or tokenizer's files otherwise;
- no library gets the chance to build a model its weights do not describe: each model is built on
  the meta device from its config (no memory), and a model with more than twice the parameters its
  weights hold is refused. A missing ``config.json`` made transformers build a default-size LLaVA
  (7B parameters; issue 9 saw memory pass 20 GB before the process was killed).

Errors are ``FileNotFoundError`` (something missing) or ``ValueError`` (something wrong), each
naming the file, the component and what is expected.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

from ..models.checkpoint import check_model_folder, read_config

MODEL_INDEX = "model_index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# a config may describe at most this many times the values its weights hold (tied weights and
# buffers make the two differ a little; a default-size config differs by orders of magnitude)
SIZE_FACTOR, SIZE_SLACK = 2, 1_000_000


def check_pipeline_folder(path, pipeline_cls=None, *, provided=()) -> dict[str, tuple[str, str]]:
    """Check the pipeline folder ``path`` for ``pipeline_cls`` (any diffusers pipeline class;
    ``None`` skips the component-name checks) before anything is loaded.

    ``provided``: component names the caller passes as objects to ``from_pretrained`` (their
    folders are not read). Returns ``{component: (library, class name)}`` of the components that
    will be loaded from the folder."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"pretrained_model_name_or_path must be a path to a pipeline folder, got {path!r}")
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"pretrained_model_name_or_path: no such folder {str(path)!r} (expected a local "
                                f"pipeline folder holding {MODEL_INDEX}, e.g. assets/vlm)")
    index = read_config(root / MODEL_INDEX, "pipeline")
    entries = {k: v for k, v in index.items() if not k.startswith("_")}
    # a list names a component; any other value is a pipeline setting (register_to_config), passed
    # to the pipeline's __init__ as diffusers does (WanPipeline's boundary_ratio)
    for name, entry in entries.items():
        ok = not isinstance(entry, list) or (len(entry) == 2 and (all(isinstance(e, str) for e in entry)
                                                                 or entry == [None, None]))
        if not ok:
            raise ValueError(f"{root / MODEL_INDEX}: component {name!r} must be [library, class name] "
                             f"(or [null, null] when absent), got {entry!r}")
    named = {k: tuple(v) for k, v in entries.items() if isinstance(v, list) and v[0] is not None}
    if pipeline_cls is not None:
        _check_component_names(root, pipeline_cls, entries, named, set(provided))
    for name, (library, class_name) in named.items():
        if name not in provided:
            check_component(root / name, name, _import(library, class_name, name))
    return {k: v for k, v in named.items() if k not in provided}


def check_component(folder: Path, name: str, cls: type) -> None:
    """One component folder against what ``cls`` loads from (see the module docstring)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{name}: missing folder {folder} (model_index.json names this component)")
    kind = _kind(cls)
    if kind == "model":
        config, stored = check_model_folder(folder, name)
        if stored == 0:
            raise ValueError(f"{name}: the *.safetensors files in {folder} hold no tensors")
        described = _parameters_on_meta(cls, folder, name)
        if described > SIZE_FACTOR * stored + SIZE_SLACK:
            raise ValueError(f"{name}: {folder / 'config.json'} describes a {cls.__name__} of {described:,} "
                             f"parameters but its weights hold {stored:,} values: the config does not belong "
                             "to these weights (refused before building the model)")
    elif kind == "scheduler":
        read_config(folder / "scheduler_config.json", name)
    elif kind in ("processor", "tokenizer", "image_processor"):
        needs = {"processor": [PROCESSOR_FILES, TOKENIZER_FILES], "tokenizer": [TOKENIZER_FILES],
                 "image_processor": [PROCESSOR_FILES]}[kind]
        for files in needs:
            present = [f for f in files if (folder / f).is_file()]
            if not present:
                raise FileNotFoundError(f"{name}: {folder} has none of {', '.join(files)} (a {cls.__name__} "
                                        "is loaded from them)")
            for f in present:
                if f.endswith(".json"):
                    read_config(folder / f, name)


def _check_component_names(root: Path, pipeline_cls, entries: dict, named: dict, provided: set) -> None:
    if hasattr(pipeline_cls, "_refresh_signature"):  # the registry's method components, as now registered
        pipeline_cls._refresh_signature()
    params = inspect.signature(pipeline_cls.__init__).parameters
    takes = [k for k, p in params.items() if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    optional = set(getattr(pipeline_cls, "_optional_components", []) or [])
    optional |= {k for k in takes if params[k].default is not inspect.Parameter.empty}
    unknown = sorted(set(entries) - set(takes))
    if unknown:
        raise ValueError(f"{root / MODEL_INDEX} names {', '.join(unknown)}, which {pipeline_cls.__name__} does "
                         f"not take (its components: {', '.join(takes)}): is this a folder for another pipeline?")
    missing = [k for k in takes if k not in optional and k not in named and k not in provided]
    if missing:
        raise ValueError(f"{root / MODEL_INDEX} must name the {pipeline_cls.__name__} components "
                         f"{', '.join(missing)} (as [library, class name]); it names {', '.join(named) or 'none'}")


def _import(library: str, class_name: str, name: str) -> type:
    try:
        return getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{name}: model_index.json names {library}.{class_name}, which cannot be imported "
                         f"({err})") from None


def _kind(cls: type) -> str:
    bases = {c.__name__ for c in inspect.getmro(cls)}
    for kind, marks in (("model", ("PreTrainedModel", "ModelMixin")), ("processor", ("ProcessorMixin",)),
                        ("tokenizer", ("PreTrainedTokenizerBase",)),
                        ("image_processor", ("ImageProcessingMixin", "FeatureExtractionMixin")),
                        ("scheduler", ("SchedulerMixin",))):
        if bases & set(marks):
            return kind
    return "other"


def _parameters_on_meta(cls: type, folder: Path, name: str) -> int:
    """Parameters of the model ``folder``'s config describes, built without memory (parameters on
    the meta device, as both libraries build before loading weights; tied weights tied)."""
    from accelerate import init_empty_weights

    try:
        with init_empty_weights():
            if hasattr(cls, "load_config"):  # diffusers ModelMixin
                model = cls.from_config(cls.load_config(folder))
            else:  # transformers PreTrainedModel
                model = cls._from_config(cls.config_class.from_pretrained(folder))
            if hasattr(model, "tie_weights"):
                model.tie_weights()
    except Exception as err:
        raise ValueError(f"{name}: {folder / 'config.json'} does not describe a {cls.__name__} "
                         f"({type(err).__name__}: {err})") from None
    return sum(p.numel() for p in model.parameters())

