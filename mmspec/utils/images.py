"""One PNG grid writer for sample images: torchvision's ``make_grid`` for tensors, diffusers'
``make_image_grid`` for PIL images, no padding, written atomically."""

from __future__ import annotations

import os
from pathlib import Path

from .atomic import atomic_path


def save_image_grid(images, path: str | os.PathLike, nrow: int) -> Path:
    """Write ``images`` as one PNG, ``nrow`` images per row in order, and return its path.

    ``images``: an (N, 3, H, W) float tensor in [0, 1] on the CPU (scaled by 255 and rounded) or a
    list of N PIL images of one size, N a multiple of ``nrow``. The file appears whole or not at
    all (``atomic_path``)."""
    import numpy as np
    import PIL.Image
    import torch

    from .errors import check_int

    check_int(nrow, "nrow", 1)
    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[1] != 3 or images.shape[0] == 0 or not images.is_floating_point():
            raise ValueError(f"images must be a non-empty (N, 3, H, W) float tensor, got {tuple(images.shape)} "
                             f"{images.dtype}")
        from torchvision.utils import make_grid

        grid = make_grid(images, nrow=nrow, padding=0).permute(1, 2, 0).numpy()  # (rows H, nrow W, 3)
        picture = PIL.Image.fromarray((grid * 255).round().astype(np.uint8))
    else:
        from diffusers.utils import make_image_grid

        images = list(images)
        if not images or len(images) % nrow or not all(isinstance(im, PIL.Image.Image) for im in images):
            raise ValueError(f"images must be an (N, 3, H, W) tensor or a list of PIL images whose length is a "
                             f"multiple of nrow={nrow}, got {len(images)} items")
        picture = make_image_grid(images, rows=len(images) // nrow, cols=nrow)
    with atomic_path(path) as tmp:
        picture.save(tmp, format="PNG")
    return Path(path)
