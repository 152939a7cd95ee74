"""Small helpers with no model or library knowledge, usable from every layer."""

from .atomic import atomic_dir, atomic_path


def one_line(err: BaseException) -> str:
    """An exception's message on one line (its lines stripped and joined), or its type's name."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


__all__ = ["atomic_dir", "atomic_path", "one_line"]
