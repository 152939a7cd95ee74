"""A user's image folder in the layout of HuggingFace datasets' ``imagefolder`` with class
sub-folders, read with PIL (the ``datasets`` package is not a dependency)::

    DIR/<class>/<image>.png|jpg|jpeg|webp|bmp

Class ids: when every class folder's name is an integer (``DIR/207/...``, e.g. ImageNet ids) the
names are the ids; otherwise the sorted names get ids ``0 .. n-1``. Class folders are the
sub-folders holding at least one image file (hidden ones, starting with ``.``, are ignored);
images are the files directly inside them, by extension (case-insensitive).

Pixels are prepared as LlamaGen's c2i training does (ADM's ``center_crop_arr``): RGB, halved
with a box filter while the shorter side is at least twice the target, resized bicubic so the
shorter side is the target, centre-cropped square, then scaled to [-1, 1] (what the VQ
tokenizers' ``encode`` takes). A file PIL cannot read is reported, never raised: ``batches``
yields it among the unreadable paths.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ...core.errors import check

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
# what PIL raises on a corrupt, truncated or hostile file (UnidentifiedImageError is an OSError)
UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def class_ids(names: Sequence[str]) -> dict[str, int]:
    """``{folder name: class id}``: the names themselves when all are integers, else the
    position in sorted order."""
    if all(re.fullmatch(r"[0-9]+", n) for n in names):
        ids = {n: int(n) for n in names}
        check(len(set(ids.values())) == len(ids), "class folders", "integer names naming distinct ids",
              sorted(names, key=int))
        return ids
    return {n: i for i, n in enumerate(sorted(names))}


def read_image(path: str | os.PathLike, size: int) -> torch.Tensor:
    """One image file -> (3, size, size) float32 in [-1, 1] (module docstring); raises one of
    ``UNREADABLE`` when PIL cannot read it."""
    with Image.open(path) as img:
        img = img.convert("RGB")  # decodes the whole file: truncation shows here
    while min(img.size) >= 2 * size:
        img = img.resize(tuple(s // 2 for s in img.size), resample=Image.BOX)
    scale = size / min(img.size)
    img = img.resize(tuple(max(size, round(s * scale)) for s in img.size), resample=Image.BICUBIC)
    left, top = (img.size[0] - size) // 2, (img.size[1] - size) // 2
    pixels = np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.uint8)  # (H, W, 3)
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 127.5 - 1.0


@dataclass(frozen=True)
class ImageFolder:
    """The image files of a class-folder dataset and their class ids (module docstring). Build
    it with ``ImageFolder.scan(root)``; nothing is decoded until ``batches``."""

    root: Path
    files: tuple[Path, ...]  # sorted by class folder, then file name
    labels: tuple[int, ...]  # the class id of each file
    classes: dict[str, int]  # class folder name -> class id

    @classmethod
    def scan(cls, root: str | os.PathLike, name: str = "data") -> "ImageFolder":
        """List ``root``'s class folders and image files; refuses (``ValueError`` naming
        ``root``) a missing folder or one without class folders holding images."""
        check(isinstance(root, (str, os.PathLike)) and Path(root).is_dir(), name,
              "an existing image folder (DIR/<class>/<image>)", str(root))
        root = Path(root)
        found = {d.name: _images_in(d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")}
        found = {k: v for k, v in found.items() if v}
        check(bool(found), name, f"a folder of class folders holding images "
              f"({', '.join(IMAGE_EXTENSIONS)}): DIR/<class>/<image>", f"{root} (no class folder holds an image)")
        ids = class_ids(list(found))
        files = tuple(f for k in found for f in found[k])
        labels = tuple(ids[k] for k in found for _ in found[k])
        return cls(root, files, labels, ids)

    def __len__(self) -> int:
        return len(self.files)

    def check_classes(self, num_classes: int, name: str = "data") -> None:
        """Every class id must be one the model has: ``< num_classes``."""
        worst = max(self.classes, key=self.classes.get)
        check(self.classes[worst] < num_classes, name,
              f"class folders whose ids are below the target's num_classes ({num_classes})",
              f"{self.root} with class folder {worst!r} = id {self.classes[worst]}")

    def batches(self, size: int, indices: Sequence[int], batch_size: int = 64
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[Path]]]:
        """The files at ``indices``, ``batch_size`` at a time, read by ``read_image``:
        ``(images (n, 3, size, size), labels (n,), unreadable paths)`` per batch, the readable
        ones in ``indices`` order."""
        for start in range(0, len(indices), batch_size):
            images, labels, bad = [], [], []
            for i in indices[start:start + batch_size]:
                try:
                    images.append(read_image(self.files[i], size))
                    labels.append(self.labels[i])
                except UNREADABLE:
                    bad.append(self.files[i])
            images = torch.stack(images) if images else torch.empty(0, 3, size, size)
            yield images, torch.tensor(labels, dtype=torch.long), bad
