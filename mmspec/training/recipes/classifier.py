"""Train the shapes classifier (``ShapesClassifier()``, default config): the feature extractor of
the AR image bench's Frechet distance and class accuracy."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from ...core.errors import check, check_int
from ...eval.quality import class_accuracy, reconstruct
from ...models import load_checkpoint
from ...models.classifier import ShapesClassifier
from ...models.vq import TinyVQModel
from ..data import NUM_CLASSES, ShapesDataset
from ..loop import new_accelerator, train_loop
from .common import batch_indices, gaussian_blur, check_checkpoint_dir, check_run_args, heldout_seed, json_config, save_atomically, stack, warmup_cosine


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per image: random horizontal and vertical flips (shapes are drawn at random rotations, so a
    mirror image is another sample of its class), and for half of them a Gaussian blur (one sigma
    in [0.5, 2] px per batch), so the classifier still knows a VQ reconstruction's soft edges."""
    B = len(images)
    hflip, vflip, blur = (torch.rand(3, B, generator=generator) < 0.5)[:, :, None, None, None]
    sigma = 0.5 + 1.5 * torch.rand(1, generator=generator).item()
    images = torch.where(hflip, images.flip(3), images)
    images = torch.where(vflip, images.flip(2), images)
    return torch.where(blur, gaussian_blur(images, sigma, radius=3), images)


def train_classifier(out_dir: str | Path, *, steps: int, batch_size: int, lr: float, seed: int = 0,
                     dataset_size: int, heldout_size: int = 1024, vq_dir: str | Path | None = None,
                     warmup: int = 50, weight_decay: float = 0.05, log_every: int = 50,
                     log: Callable[[str], None] = print) -> dict:
    """Train ``ShapesClassifier()`` with AdamW on ``ShapesDataset(dataset_size, seed)`` images
    (randomly flipped and blurred, see ``augment``) and save it to ``out_dir`` (safetensors,
    written atomically) with ``train_log.json``, whose dict is returned: ``recipe``, ``seed``,
    ``steps``, ``config`` (the model's), ``train`` (the arguments), ``final_loss``,
    ``heldout_accuracy``, ``heldout`` (size and seed), ``vq_dir`` and ``vq_recon_accuracy`` (the
    accuracy on the VQ's reconstructions of the held-out images; both None without ``vq_dir``),
    ``wall_time_s``.

    The learning rate warms up linearly for ``warmup`` steps, then follows a cosine down to 10% of
    ``lr``. Deterministic for a given seed and thread count: ``torch.manual_seed(seed)`` sets the
    init, generators seeded from ``seed`` the batch order and the augmentation."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every, log=log)
    check_int(warmup, "warmup", 1)
    check(isinstance(weight_decay, (int, float)) and not isinstance(weight_decay, bool) and weight_decay >= 0,
          "weight_decay", "a number >= 0", weight_decay)
    vq_path = None if vq_dir is None else check_checkpoint_dir(
        vq_dir, "vq_dir", "None or a folder saved by TinyVQModel.save_pretrained (e.g. by train_vq)")

    accelerator = new_accelerator("train_classifier")
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = ShapesClassifier(num_classes=NUM_CLASSES)
    size = model.config.sample_size
    images, labels = stack(ShapesDataset(dataset_size, seed, size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    augmentation = torch.Generator().manual_seed(seed + 1)
    batches = ((images[idx], labels[idx]) for idx in batch_indices(dataset_size, batch_size, steps, order))

    def loss(model, batch):
        x, y = batch
        logits = model(augment(x, augmentation))  # (B, num_classes)
        return {"loss": F.cross_entropy(logits, y), "batch_accuracy": (logits.argmax(-1) == y).float().mean()}

    final_loss = train_loop(model, optimizer, batches, loss, steps=steps, accelerator=accelerator, schedule=schedule,
                            name="classifier", log=log, log_every=log_every, state={"augmentation": augmentation})
    del images, batches

    model.eval()
    held_seed = heldout_seed(seed)
    held_images, held_labels = stack(ShapesDataset(heldout_size, held_seed, size))
    accuracy = class_accuracy(model, held_images, held_labels)
    log(f"classifier held-out accuracy {accuracy:.4f} ({heldout_size} images)")
    vq_accuracy = None
    if vq_path is not None:
        vq = load_checkpoint(TinyVQModel, vq_path)
        vq_accuracy = class_accuracy(model, reconstruct(vq, held_images), held_labels)
        log(f"classifier accuracy on VQ reconstructions {vq_accuracy:.4f} ({heldout_size} images)")
    record = {
        "recipe": "classifier", "seed": seed, "steps": steps, "config": json_config(model),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "optimizer": "AdamW",
                  "weight_decay": weight_decay, "schedule": f"linear warmup {warmup} steps, cosine to 10%",
                  "augment": "random flips; Gaussian blur (sigma 0.5-2 px) on half the images"},
        "final_loss": final_loss, "heldout_accuracy": accuracy,
        "heldout": {"size": heldout_size, "seed": held_seed},
        "vq_dir": None if vq_path is None else str(vq_path.resolve()), "vq_recon_accuracy": vq_accuracy,
        "wall_time_s": time.perf_counter() - start,
    }
    save_atomically(model, out, record)
    return record
