"""Rewrite the generated tables of the docs from the code (``tests/test_docs.py`` fails while one
is out of date):

    .venv/bin/python scripts/docs_tables.py

docs/concepts.md: every registered drafter, rule and schedule (``mmspec.methods.parts_markdown``),
between the ``<!-- parts: generated ... -->`` and ``<!-- end parts -->`` lines.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONCEPTS = ROOT / "docs" / "concepts.md"
SECTION = re.compile(r"(<!-- parts: generated[^\n]*-->\n)(.*?)(<!-- end parts -->)", re.S)


def current(text: str) -> str:
    """The generated section's body in ``text`` (``ValueError`` when the markers are missing)."""
    m = SECTION.search(text)
    if m is None:
        raise ValueError("docs/concepts.md must hold the '<!-- parts: generated ... -->' ... "
                         "'<!-- end parts -->' lines")
    return m.group(2)


def main() -> None:
    from mmspec import methods

    text = CONCEPTS.read_text()
    current(text)
    CONCEPTS.write_text(SECTION.sub(lambda m: m.group(1) + methods.parts_markdown() + m.group(3), text))
    print(f"wrote the parts table of {CONCEPTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
