"""One int check: ``mmspec.core.errors.is_int`` / ``check_int``. No other module defines its own
(``is_int`` or ``_is_int``) or spells out the bool-excluding idiom
``isinstance(x, int) and not isinstance(x, bool)``; a scanner over the source tree says where, and
flags a planted one."""

import ast
from pathlib import Path

import numpy as np
import pytest

from mmspec.core.errors import check_int, is_int

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("mmspec", "pipelines", "kernels", "demos", "scripts")
HOME = Path("mmspec/utils/errors.py")
INT_NAMES = {"int", "Integral"}


def _isinstance_of(node: ast.AST) -> tuple[str, str] | None:
    """``(dump of x, type name)`` for ``isinstance(x, T)`` with T a plain name (``numbers.Integral``
    counts as ``Integral``), else None; a ``not`` in front is looked through."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node = node.operand
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and len(node.args) == 2):
        return None
    kind = node.args[1]
    name = kind.id if isinstance(kind, ast.Name) else kind.attr if isinstance(kind, ast.Attribute) else None
    return (ast.dump(node.args[0]), name) if name else None


def own_int_checks(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` of each int check ``source`` makes for itself: a function named ``is_int``
    or ``_is_int``, or one ``and``/``or`` testing the same value with ``isinstance(x, int)`` (or
    ``Integral``) and ``isinstance(x, bool)``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("is_int", "_is_int"):
            found.append((node.lineno, f"def {node.name}"))
        elif isinstance(node, ast.BoolOp):
            tests = [t for t in map(_isinstance_of, node.values) if t]
            ints = {x for x, name in tests if name in INT_NAMES}
            if any(name == "bool" and x in ints for x, name in tests):
                found.append((node.lineno, "isinstance(x, int) beside isinstance(x, bool)"))
    return sorted(found)


def test_no_module_checks_ints_its_own_way():
    found = [f"{path.relative_to(ROOT)}:{line}: {what} (use mmspec.core.errors.is_int / check_int)"
             for top in SOURCES for path in sorted((ROOT / top).rglob("*.py"))
             if path.relative_to(ROOT) != HOME
             for line, what in own_int_checks(path.read_text())]
    assert found == [], "\n".join(found)


def test_the_scanner_flags_a_planted_check():
    planted = ("def _is_int(x, low):\n"
               "    return isinstance(x, int) and not isinstance(x, bool) and x >= low\n"
               "ok = n is None or (isinstance(n, numbers.Integral) and not isinstance(n, bool))\n"
               "bad = not isinstance(v, int) or isinstance(v, bool)\n")
    assert [line for line, _ in own_int_checks(planted)] == [1, 2, 3, 4]
    fine = ("ok = is_int(n) and n >= 1\n"
            "real = isinstance(x, (int, float)) and not isinstance(x, bool)\n"
            "mixed = isinstance(a, int) and not isinstance(b, bool)\n")
    assert own_int_checks(fine) == []
    assert own_int_checks((ROOT / HOME).read_text()) != []  # the one check, found where it lives


def test_is_int_takes_integers_not_bools():
    assert is_int(3) and is_int(-1) and is_int(np.int64(2))
    assert not any(is_int(x) for x in (True, False, 2.0, "2", None, np.bool_(True)))


@pytest.mark.parametrize("value, kwargs, message", [
    (0, {}, "n must be an int >= 1, got 0"),
    (True, {}, "n must be an int >= 1, got True"),
    (9, {"high": 8}, r"n must be an int in \[1, 8\], got 9"),
    (2.0, {"optional": True}, "n must be None or an int >= 1, got 2.0"),
])
def test_check_int_names_the_argument_and_the_range(value, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_int(value, "n", 1, **kwargs)
    check_int(1, "n", 1, **kwargs)
    check_int(None, "n", 1, optional=True)
