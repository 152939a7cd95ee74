"""Train the class-conditional AR image model (``LlamaGenModel``) on a trained VQ's token ids."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ...core.errors import check
from ...models.llamagen import LlamaGenModel
from ...models import load_checkpoint
from ...models.vq import TinyVQModel
from ..data import CLASS_NAMES, CLASS_PROMPTS, NUM_CLASSES, ShapesDataset
from ..loop import new_accelerator, train_loop
from .common import (batch_indices, check_checkpoint_dir, check_run_args, heldout_seed, json_config, save_atomically, stack,
                     warmup_cosine)

# small enough for a CPU; mlp_hidden ~ 8/3 dim as in LlamaGen
DEFAULT_MODEL_CONFIG = dict(dim=128, n_layers=4, n_heads=4, mlp_hidden=344, class_dropout_prob=0.1)
# the scenes the AR image models learn: large upright main objects on smooth backgrounds (on the
# VLM's "scene" style the first target learned colour but not shape, and on "bold" the second drew
# blobs; issue 10). The continuous-token recipes and both image benches use the same style.
AR_DATA_STYLE = "upright"
# fixed by the tokenizer and the dataset, not by model_config
_DERIVED = ("vocab_size", "grid_size", "num_classes")


@torch.no_grad()
def tokenize(vq: TinyVQModel, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """images (N, C, H, W) -> raster-order ids (N, grid * grid), long."""
    vq.eval()
    return torch.cat([vq.encode(chunk).flatten(1) for chunk in images.split(batch_size)])


def _tokenized(vq: TinyVQModel, dataset: ShapesDataset, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, ids) of a dataset, drawn and tokenized ``chunk`` images at a time so memory holds
    ids (2 KB per image) rather than pixels (48 KB)."""
    labels, ids = [], []
    for start in range(0, len(dataset), chunk):
        images, y = stack(torch.utils.data.Subset(dataset, range(start, min(start + chunk, len(dataset)))))
        labels.append(y)
        ids.append(tokenize(vq, images))
    return torch.cat(labels), torch.cat(ids)


def token_data(vq: TinyVQModel, dataset_size: int, heldout_size: int, seed: int, style: str = AR_DATA_STYLE,
               chunk: int = 2048):
    """``ShapesDataset(dataset_size, seed, style=style)`` and its held-out set as labels and raster
    ids: ``(labels, ids, held_labels, held_ids, held_seed)``."""
    size = vq.config.sample_size
    labels, ids = _tokenized(vq, ShapesDataset(dataset_size, seed, size, style=style), chunk)
    held_seed = heldout_seed(seed)
    held_labels, held_ids = _tokenized(vq, ShapesDataset(heldout_size, held_seed, size, style=style), chunk)
    return labels, ids, held_labels, held_ids, held_seed


@torch.no_grad()
def heldout_loss(model: LlamaGenModel, labels: torch.Tensor, ids: torch.Tensor, batch_size: int = 64) -> float:
    """Mean next-token cross-entropy over all held-out tokens, in eval mode (labels kept)."""
    model.eval()
    total = sum(model.loss(y, x).item() * len(y) for y, x in zip(labels.split(batch_size), ids.split(batch_size)))
    return total / len(labels)


def train_ar_image(out_dir: str | Path, *, vq_dir: str | Path, steps: int, batch_size: int, lr: float,
                   seed: int = 0, dataset_size: int, model_config: dict | None = None, heldout_size: int = 64,
                   log_every: int = 50, warmup: int = 100, log: Callable[[str], None] = print) -> dict:
    """Train a ``LlamaGenModel`` with AdamW on ``ShapesDataset(dataset_size, seed, style=AR_DATA_STYLE)`` tokenized once
    by the VQ in ``vq_dir``, and save it to ``out_dir`` (safetensors, written atomically) with
    ``train_log.json``, whose dict is returned: ``recipe``, ``seed``, ``steps``, ``config`` (the
    model's), ``train`` (the arguments), ``vq_dir``, ``final_loss``, ``heldout_loss``, ``heldout``
    (size and seed), ``wall_time_s``.

    ``vocab_size``, ``grid_size`` and ``num_classes`` come from the VQ and the dataset; other
    ``LlamaGenModel`` arguments default to ``DEFAULT_MODEL_CONFIG`` and are overridden by
    ``model_config``. The learning rate warms up linearly for ``warmup`` steps, then follows a
    cosine down to 10% of ``lr``. Label dropout uses a generator seeded from ``seed``: runs are reproducible."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every,
                         log=log, warmup=warmup)
    vq_path = check_checkpoint_dir(vq_dir, "vq_dir", "a folder saved by TinyVQModel.save_pretrained (e.g. by train_vq)")
    model_config = dict(model_config or {})
    check(not set(model_config) & set(_DERIVED), "model_config",
          f"free of {', '.join(_DERIVED)} (they come from the VQ and the dataset)", model_config)

    accelerator = new_accelerator("train_ar_image")
    start = time.perf_counter()
    vq = load_checkpoint(TinyVQModel, vq_path)
    labels, ids, held_labels, held_ids, held_seed = token_data(vq, dataset_size, heldout_size, seed)
    log(f"ar-image tokenized {dataset_size} + {heldout_size} images into {ids.shape[1]} ids each")

    torch.manual_seed(seed)
    config = {**DEFAULT_MODEL_CONFIG, **model_config, "vocab_size": vq.config.codebook_size,
              "grid_size": vq.grid_size, "num_classes": NUM_CLASSES,
              "id2label": {str(i): f"{p}, {n}" for i, (p, n) in enumerate(zip(CLASS_PROMPTS, CLASS_NAMES))}}
    model = LlamaGenModel(**config)
    # LlamaGen's c2i optimizer settings
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    dropout = torch.Generator().manual_seed(seed + 1)
    batches = ((labels[idx], ids[idx]) for idx in batch_indices(dataset_size, batch_size, steps, order))
    final_loss = train_loop(model, optimizer, batches, lambda m, b: m.loss(*b, generator=dropout), steps=steps,
                            accelerator=accelerator, schedule=schedule, grad_clip=1.0, name="ar-image", log=log,
                            log_every=log_every, state={"dropout": dropout})

    held = heldout_loss(model, held_labels, held_ids)
    log(f"ar-image held-out loss {held:.4f} ({heldout_size} images)")
    record = {
        "recipe": "ar-image", "seed": seed, "steps": steps, "config": json_config(model),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "data_style": AR_DATA_STYLE, "optimizer": "AdamW", "schedule": f"linear warmup {warmup} steps, cosine to 10%",
                  "betas": [0.9, 0.95], "weight_decay": 0.05, "grad_clip": 1.0},
        "vq_dir": str(vq_path.resolve()), "final_loss": final_loss, "heldout_loss": held,
        "heldout": {"size": heldout_size, "seed": held_seed},
        "wall_time_s": time.perf_counter() - start,
    }
    save_atomically(model, out, record)
    return record
