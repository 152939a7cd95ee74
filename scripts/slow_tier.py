"""Write tests/slow_tier.txt, the tests ``make test`` leaves to ``make test-slow``, from a pytest
``--durations`` log measured on the project's 2-core machine (a full run, alone).

    .venv/bin/python -m pytest -q -n 2 -m "" --durations=0 > durations.log   # both tiers
    .venv/bin/python scripts/slow_tier.py durations.log [--threshold 4.4]

A test whose call took at least ``--threshold`` seconds is listed by its node id. A fixture setup
that long lists its whole file: the fixture would otherwise move to the file's next test and stay
in the fast tier. The file is rewritten from the log alone, so time both tiers (``-m ""``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIER = ROOT / "tests" / "slow_tier.txt"
LINE = re.compile(r"^\s*([\d.]+)s\s+(call|setup|teardown)\s+(\S+)$")
HEADER = """# The slow tier: tests run by `make test-slow` (and CI, .ci/run), not by `make test`. Each line is a
# test file (every test in it) or a test's node id (one parametrization; without [params]: all).
# Written by scripts/slow_tier.py from a --durations log of both tiers on the 2-core machine:
# a call of {threshold:g} s or more lists the test, a fixture setup that long lists its file.
# Tests added between runs are listed by hand by the same rule.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--threshold", type=float, default=4.4)
    args = parser.parse_args()
    lines: set[str] = set()
    for raw in args.log.read_text().splitlines():
        m = LINE.match(raw)
        if m and float(m.group(1)) >= args.threshold:
            node = m.group(3)
            lines.add(node.split("::")[0] if m.group(2) == "setup" else node)
    files = {line for line in lines if "::" not in line}
    lines = files | {line for line in lines if line.split("::")[0] not in files}
    TIER.write_text(HEADER.format(threshold=args.threshold) + "".join(f"{line}\n" for line in sorted(lines)))
    print(f"{len(lines)} lines ({len(files)} files) -> {TIER.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
