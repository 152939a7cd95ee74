"""One way to reject bad input: a ValueError that names the argument and what is allowed; and the
one int check (``is_int``, ``check_int``) every layer uses."""

from __future__ import annotations

from numbers import Integral


def check(ok: bool, name: str, allowed: str, got) -> None:
    """Raise ``ValueError("<name> must be <allowed>, got <got>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {got!r}")


def check_choice(name: str, got, choices) -> None:
    """Raise a ValueError listing the allowed values unless ``got`` is one of ``choices``."""
    choices = list(choices)
    check(got in choices, name, "one of " + ", ".join(repr(c) for c in choices), got)


def is_int(x) -> bool:
    """An int (or another ``numbers.Integral``, e.g. a numpy integer) and not a bool."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_int(value, name: str, low: int, high: int | None = None, optional: bool = False) -> None:
    """An int (not a bool) in ``[low, high]``; None too with ``optional``."""
    if optional and value is None:
        return
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    ok = is_int(value) and value >= low and (high is None or value <= high)
    check(ok, name, f"None or {allowed}" if optional else allowed, value)
