"""``mmspec demo``: the Gradio demo (``demos/app.py`` of the repository), on 127.0.0.1 unless
``--host`` says otherwise."""

from __future__ import annotations

import sys

from .common import ROOT, positive_int

NAME = "demo"


def register_subcommand(subparsers) -> None:
    demo = subparsers.add_parser(NAME, help="launch the Gradio demo (localhost only unless --host says otherwise)")
    demo.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    demo.add_argument("--port", type=positive_int, default=None, help="port (default: 7860 or the next free one)")


def run(args) -> int:
    # the demo lives in the repository's demos/ folder, next to this package (editable installs)
    if not (ROOT / "demos" / "app.py").is_file():
        raise FileNotFoundError(f"{ROOT / 'demos' / 'app.py'} not found (run from a clone of the repository)")
    sys.path.insert(0, str(ROOT))
    from demos import app

    app.launch(args.host, args.port)
    return 0
