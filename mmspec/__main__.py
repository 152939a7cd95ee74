"""``python -m mmspec ...`` (what ``accelerate launch -m mmspec train vlm-draft ...`` runs)."""

import sys

from .commands import main

sys.exit(main())
