"""Datasets the project generates itself (nothing is downloaded), and a reader of the user's own
image folders (``ImageFolder``)."""

from .imagefolder import ImageFolder
from .shapes import CLASS_NAMES, CLASS_PROMPTS, NUM_CLASSES, STYLES, ShapesDataset, render

__all__ = ["CLASS_NAMES", "CLASS_PROMPTS", "NUM_CLASSES", "STYLES", "ImageFolder", "ShapesDataset", "render"]
