"""What the recipes share: argument checks, the dataset as tensors, seeded batches, and the
atomic checkpoint folder (``save_pretrained`` + ``train_log.json``). The loop is
``mmspec.training.loop``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.nn import functional as F

from ...core.errors import check, check_int, is_int
from ...models.checkpoint import check_model_folder
from ...utils.atomic import atomic_dir, atomic_path
from ..data import ShapesDataset

TRAIN_LOG = "train_log.json"
# held-out images come from ShapesDataset(heldout_size, seed + HELDOUT_SEED_OFFSET): a seed no
# nearby training run uses, so held-out scenes never appear in training
HELDOUT_SEED_OFFSET = 1_000_003


def check_run_args(out_dir, *, steps, batch_size, lr, seed, dataset_size, heldout_size, log_every, log=print,
                   warmup=None) -> Path:
    """Validate the arguments every recipe takes (``warmup`` when the recipe has one); returns
    ``out_dir`` as a Path. Nothing is read or written."""
    check_int(steps, "steps", 1)
    check_int(batch_size, "batch_size", 1)
    check(isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0, "lr",
          "a number > 0", lr)
    check_int(seed, "seed", 0)
    check(is_int(dataset_size) and dataset_size >= batch_size, "dataset_size", f"an int >= batch_size ({batch_size})",
          dataset_size)
    check_int(heldout_size, "heldout_size", 1)
    check_int(log_every, "log_every", 1)
    check(warmup is None or (is_int(warmup) and warmup >= 0), "warmup", "an int >= 0", warmup)
    check(callable(log), "log", "a callable taking one str (e.g. print)", log)
    return check_out_dir(out_dir)


def check_out_dir(out_dir, name: str = "out_dir") -> Path:
    """A folder path that is not an existing file and whose nearest existing parent is a
    writable folder (so a run does not fail at its very end, when it saves)."""
    check(isinstance(out_dir, (str, os.PathLike)) and str(out_dir) != "", name, "a folder path", out_dir)
    out = Path(out_dir)
    check(not out.exists() or out.is_dir(), name, "a folder path (not an existing file)", str(out_dir))
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    check(parent.is_dir() and os.access(parent, os.W_OK | os.X_OK), name,
          "a path under a writable folder", f"{out_dir} ({parent} is not a writable folder)")
    return out


def check_checkpoint_dir(path, name: str, what: str, processor: bool = False) -> Path:
    """A folder saved by ``save_pretrained``: ``config.json`` a JSON object and every
    ``*.safetensors`` file's header readable (a truncated file is refused naming it); with
    ``processor``, also the processor's and tokenizer's files. Reads no tensor data."""
    check(isinstance(path, (str, os.PathLike)) and str(path) != "", name, what, path)
    folder = Path(path)
    check(folder.is_dir() and (folder / "config.json").is_file(), name, what, str(path))
    check_model_folder(folder, name)
    if processor:
        for files in (("processor_config.json", "preprocessor_config.json"),
                      ("tokenizer.json", "tokenizer_config.json")):
            check(any((folder / f).is_file() for f in files), name, f"{what} (with {' or '.join(files)})", str(path))
    return folder


def heldout_seed(seed: int) -> int:
    return seed + HELDOUT_SEED_OFFSET


def stack(dataset: ShapesDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Render the whole dataset once: images (N, 3, H, W), labels (N,)."""
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.tensor(labels)


def batch_indices(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """``steps`` index batches: epochs of a seeded permutation, the ragged tail of each dropped."""
    per_epoch = n // batch_size
    for step in range(steps):
        if step % per_epoch == 0:
            perm = torch.randperm(n, generator=generator)
        i = step % per_epoch
        yield perm[i * batch_size : (i + 1) * batch_size]


def warmup_cosine(step: int, *, warmup: int, steps: int, floor: float = 0.1) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then a cosine from 1 down to ``floor``.

    After the warmup this is transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` with
    ``min_lr_rate=floor`` (bit for bit at the recipes' floor 0.1); during it ours is one step ahead (``(step + 1) / warmup``,
    theirs starts at 0), which the bundled checkpoints were trained with
    (``tests/test_recipes_common.py``)."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def json_config(model) -> dict:
    """The model's registered config, JSON-ready (diffusers' private ``_`` keys dropped)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in model.config.items() if not k.startswith("_")}


def save_atomically(model, out_dir: Path, record: dict, dtype: torch.dtype = torch.float16,
                    extra: Callable[[Path], object] | None = None) -> None:
    """``model.save_pretrained`` (weights cast to ``dtype``: checkpoints ship as fp16 safetensors),
    ``extra(folder)`` if given (e.g. a processor's ``save_pretrained``) and ``train_log.json`` into
    one folder that replaces ``out_dir`` only once complete (``mmspec.utils.atomic_dir``): on any
    failure an existing ``out_dir`` is left as it was and nothing else remains."""
    from diffusers.utils import logging as diffusers_logging

    with atomic_dir(out_dir) as tmp:
        original = next(model.parameters()).dtype
        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # not its "modules kept in float32" notice on every cast
        try:
            model.to(dtype).save_pretrained(tmp)
            if extra is not None:
                extra(tmp)
        finally:
            model.to(original)
            diffusers_logging.set_verbosity(level)
        write_log(tmp, record)


def write_log(folder: Path, record: dict) -> None:
    """``train_log.json`` in ``folder``, written atomically."""
    with atomic_path(Path(folder) / TRAIN_LOG) as tmp:
        tmp.write_text(json.dumps(record, indent=2) + "\n")


def gaussian_blur(images: torch.Tensor, sigma: float, radius: int) -> torch.Tensor:
    """Separable Gaussian blur of (B, C, H, W) images, ``2 radius + 1`` taps, reflect padding (the
    classifier's and the video judge's augmentation): torchvision's ``gaussian_blur`` to 1e-6, but
    in two 1-D passes, whose rounding the bundled checkpoints were trained with
    (``tests/test_recipes_common.py``)."""
    n = 2 * radius + 1
    taps = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=images.dtype) / sigma) ** 2)
    taps = taps / taps.sum()
    C = images.shape[1]
    x = F.pad(images, (radius,) * 4, mode="reflect")
    x = F.conv2d(x, taps.view(1, 1, 1, n).expand(C, 1, 1, n), groups=C)
    return F.conv2d(x, taps.view(1, 1, n, 1).expand(C, 1, n, 1), groups=C)
