"""Knobs: a config dataclass's fields as typed, documented, validated user inputs.

``knob(default, min=..., max=..., choices=...)`` declares a field's allowed values; ``KnobSpec``
is what a validator or a UI needs of one knob; ``config_specs`` reads them off a config class
(type from the annotation, doc from the docstring's ``Args:``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..core.errors import check, is_int

_TYPE_WORDS = {bool: "a bool", int: "an int", float: "a float", str: "a str"}


def knob(default, *, min: float | None = None, max: float | None = None, choices: Iterable | None = None,
         name: str | None = None):
    """A config field that is a user knob: its default and allowed values (bounds inclusive);
    ``name`` replaces the prefixed knob name (a part's own knob beside knobs it shares with other
    parts under their common prefix, e.g. ``specvlm_branch`` beside ``tree_depth``)."""
    meta = {"min": min, "max": max, "choices": None if choices is None else tuple(choices), "name": name}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class KnobSpec:
    """One knob as a UI or a validator sees it.

    ``type`` is ``int``, ``float``, ``str`` or ``bool``; ``optional`` allows ``None``; ``choices``
    lists the allowed values of a str knob; ``min``/``max`` bound a number (inclusive, ``None``:
    unbounded). ``default`` is the value this modality and method use when the knob is not given.
    """

    name: str
    type: type
    default: Any
    doc: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    optional: bool = False
    part: str = ""

    def allowed(self) -> str:
        """What the knob accepts, in words: ``"an int >= 2"``, ``"one of 'random', 'repeat'"``."""
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            text = _TYPE_WORDS[self.type]
            if self.min is not None and self.max is not None:
                text += f" in [{_num(self.min)}, {_num(self.max)}]"
            elif self.min is not None:
                text += f" >= {_num(self.min)}"
            elif self.max is not None:
                text += f" <= {_num(self.max)}"
        return f"None or {text}" if self.optional else text

    def validate(self, value):
        """``value`` as the config stores it (an int given for a float knob becomes a float, a numpy
        integer for an int knob an int); ``ValueError`` naming the knob and what it accepts otherwise."""
        if value is None and self.optional:
            return None
        if self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value
        elif self.type is int:
            ok = is_int(value)
            value = int(value) if ok else value  # a numpy integer is stored as an int
        else:
            ok = isinstance(value, self.type)
        if ok and self.choices is not None:
            ok = value in self.choices
        if ok and self.min is not None:
            ok = value >= self.min
        if ok and self.max is not None:
            ok = value <= self.max
        check(ok, self.name, self.allowed(), value)
        return value


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def config_specs(config: type, prefix: str = "", info: Mapping[str, Mapping] | None = None,
                 part: str = "") -> dict[str, KnobSpec]:
    """The knobs of a config dataclass: type from its annotations, default from the field, doc from
    the class docstring's ``Args:`` section, bounds and choices from ``knob(...)`` metadata or
    ``info`` (for configs defined where ``knob`` cannot be imported, e.g. the core's)."""
    check(dataclasses.is_dataclass(config) and isinstance(config, type), "config", "a dataclass type", config)
    hints = typing.get_type_hints(config)
    docs = _arg_docs(config)
    specs = {}
    for f in dataclasses.fields(config):
        kind, optional = _plain_type(hints[f.name], f"{config.__name__}.{f.name}")
        meta = {**f.metadata, **dict((info or {}).get(f.name, {}))}
        check(f.default is not dataclasses.MISSING, f"{config.__name__}.{f.name}", "a field with a default", None)
        name = meta.get("name") or (f"{prefix}_{f.name}" if prefix else f.name)
        specs[f.name] = KnobSpec(name, kind, f.default, docs.get(f.name, ""), meta.get("choices"), meta.get("min"),
                                 meta.get("max"), optional, part)
    return specs


def _plain_type(hint, where: str) -> tuple[type, bool]:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else hint
    check(hint in _TYPE_WORDS, where, "annotated int, float, str or bool (optionally | None)", hint)
    return hint, optional


def _arg_docs(config: type) -> dict[str, str]:
    """``{field: text}`` from a Google-style ``Args:`` section of the class docstring (entries one
    level in, continuation lines deeper; the section ends at the first line back out)."""
    out, current = {}, None
    section = entry = None  # indentation of "Args:" and of its entries
    for line in (inspect.getdoc(config) or "").splitlines():
        text, indent = line.strip(), len(line) - len(line.lstrip())
        if text == "Args:":
            section, entry, current = indent, None, None
            continue
        if section is None or not text:
            continue
        m = re.fullmatch(r"(\w+)(?: \([^)]*\))?: (.*)", text)
        if m and (indent == entry if entry is not None else indent >= section):
            entry, current = indent, m.group(1)
            out[current] = m.group(2)
        elif current is not None and indent > entry:
            out[current] += " " + text
        else:
            section = None
    return out


def check_config(config) -> None:
    """Validate a config instance's knob fields by their specs (call it from ``__post_init__``);
    errors name the field."""
    for name, spec in config_specs(type(config)).items():
        spec.validate(getattr(config, name))
