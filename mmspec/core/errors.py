"""The core's path to ``mmspec.utils.errors`` (``check``, ``check_choice``, ``is_int``,
``check_int``): one way to reject bad input, shared with the kernels, which sit below the core and
so import it from ``mmspec.utils``."""

from ..utils.errors import check, check_choice, check_int, is_int

__all__ = ["check", "check_choice", "check_int", "is_int"]
