"""The front door: README.md stays a front page, and the docs site builds strictly.

``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the nav, a
docstring target that cannot be found and a griffe warning about a docstring, so running it here
puts all of those in ``make test``. The relative links of README.md (which MkDocs does not build)
and of docs/ are checked against the files on disk.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"
README_MAX_LINES = 250

# [text](target) and ![alt](target); a target ends at whitespace or ')' (an optional "title" follows)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def relative_links(path: Path) -> list[str]:
    """Targets of the Markdown links in ``path`` outside code blocks and inline code that point to a
    file of this repository (no scheme, no ``mailto:``, not a bare ``#anchor``), anchors dropped."""
    links, fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fence = not fence
            continue
        if fence:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue
            links.append(target.split("#", 1)[0])
    return links


def broken_links(path: Path) -> list[str]:
    """The relative link targets in ``path`` that name no existing file or folder."""
    return [t for t in relative_links(path) if not (path.parent / t).exists()]


def test_readme_is_a_front_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the front page keeps to {README_MAX_LINES}"


def test_relative_links_point_to_existing_files():
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    assert len(pages) > 10, "docs/ has lost its pages"
    assert relative_links(README), "README.md links to no page"
    broken = [f"{page.relative_to(ROOT)}: {t}" for page in pages for t in broken_links(page)]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_link_check_finds_broken_links(tmp_path):
    (tmp_path / "there.md").write_text("# there\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#top) ![img](missing.png) [web](https://example.com) [a](#anchor)\n"
                    "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n[gone](gone/page.md \"title\")\n")
    assert relative_links(page) == ["there.md", "missing.png", "gone/page.md"]
    assert broken_links(page) == ["missing.png", "gone/page.md"]


def test_mkdocs_build_strict(tmp_path):
    assert MKDOCS.exists(), f"{MKDOCS} is missing: install the docs extra (pip install -e '.[test,docs]')"
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    log = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING" in line or "ERROR" in line)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log or proc.stderr[-3000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "core" / "index.html").read_text(encoding="utf-8")
    assert "SpeculativeDecoder" in api, "the API reference rendered no members of mmspec.core"


def test_concepts_parts_table_is_current():
    """docs/concepts.md's table of drafters, rules and schedules is the registry's
    (``scripts/docs_tables.py`` rewrites it); a part added, renamed or redocumented fails this
    until the table is regenerated."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import docs_tables

    from mmspec import methods

    assert docs_tables.current(docs_tables.CONCEPTS.read_text()) == methods.parts_markdown(), (
        "docs/concepts.md's parts table is out of date: run .venv/bin/python scripts/docs_tables.py")
