"""Datasets the project generates itself (nothing is downloaded)."""

from .shapes import CLASS_NAMES, CLASS_PROMPTS, NUM_CLASSES, STYLES, ShapesDataset, render

__all__ = ["CLASS_NAMES", "CLASS_PROMPTS", "NUM_CLASSES", "STYLES", "ShapesDataset", "render"]
