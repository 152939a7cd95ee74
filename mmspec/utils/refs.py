"""References to code by name (``"package.module:attribute"``), imported only when used, so a
declaration can name code of a heavier layer (a CLI command, a Gradio tab, a bench driver)
without importing it."""

from __future__ import annotations

import importlib
import re
from typing import Any

_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_ref(value: Any) -> bool:
    """Whether ``value`` is a ``"module:attribute"`` string."""
    return isinstance(value, str) and _REF.fullmatch(value) is not None


def load_ref(value: Any) -> Any:
    """The object a ``"module:attribute"`` string names (the module imported, dotted attributes
    followed); any other value is returned as it is. ``ValueError`` names a string that is not a
    reference; ``ImportError`` / ``AttributeError`` say what is missing."""
    if not isinstance(value, str):
        return value
    if not is_ref(value):
        raise ValueError(f"reference must be 'module:attribute', got {value!r}")
    module, _, attr = value.partition(":")
    obj = importlib.import_module(module)
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj
