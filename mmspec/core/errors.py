"""One way to reject bad input: a ValueError that names the argument and what is allowed."""

from __future__ import annotations


def check(ok: bool, name: str, allowed: str, got) -> None:
    """Raise ``ValueError("<name> must be <allowed>, got <got>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {got!r}")


def check_choice(name: str, got, choices) -> None:
    """Raise a ValueError listing the allowed values unless ``got`` is one of ``choices``."""
    choices = list(choices)
    check(got in choices, name, "one of " + ", ".join(repr(c) for c in choices), got)
