"""Small helpers with no model or library knowledge, usable from every layer."""

from .atomic import atomic_dir, atomic_path

__all__ = ["atomic_dir", "atomic_path"]
