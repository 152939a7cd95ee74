"""``python -m mmspec ...`` (what ``accelerate launch -m mmspec train vlm-draft ...`` runs)."""

import sys

from .cli import main

sys.exit(main())
