"""Train the tiny VQ tokenizer (``TinyVQModel()``, default config) on procedural shapes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from ...models.vq import TinyVQModel
from ..data import ShapesDataset
from ..loop import new_accelerator, train_loop
from .common import batch_indices, check_run_args, heldout_seed, json_config, save_atomically, stack


@torch.no_grad()
def heldout_recon_mse(model: TinyVQModel, images: torch.Tensor, batch_size: int = 64) -> float:
    """Mean squared error of the quantized reconstruction over ``images`` (N, C, H, W), in eval mode."""
    model.eval()
    total = 0.0
    for chunk in images.split(batch_size):
        total += F.mse_loss(model.decode(model.encode(chunk)), chunk, reduction="sum").item()
    return total / images.numel()


def train_vq(out_dir: str | Path, *, steps: int, batch_size: int = 16, lr: float, seed: int = 0,
             dataset_size: int, heldout_size: int = 64, log_every: int = 50,
             log: Callable[[str], None] = print) -> dict:
    """Train ``TinyVQModel()`` with Adam on ``ShapesDataset(dataset_size, seed)`` and save it to
    ``out_dir`` (safetensors, written atomically) with ``train_log.json``, whose dict is returned:
    ``recipe``, ``seed``, ``steps``, ``config`` (the model's), ``train`` (the arguments),
    ``final_loss``, ``heldout_recon_mse``, ``heldout`` (size and seed), ``wall_time_s``.

    Deterministic for a given seed and thread count: ``torch.manual_seed(seed)`` sets the init,
    a generator seeded from ``seed`` the batch order."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every, log=log)
    accelerator = new_accelerator("train_vq")
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = TinyVQModel()
    images, _ = stack(ShapesDataset(dataset_size, seed, model.config.sample_size))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    batches = (images[idx] for idx in batch_indices(dataset_size, batch_size, steps, generator))

    def loss(model, x):
        losses = model(x)[1]
        return {"loss": losses["loss"], "recon": losses["recon"]}

    final_loss = train_loop(model, optimizer, batches, loss, steps=steps, accelerator=accelerator, name="vq",
                            log=log, log_every=log_every)

    held_seed = heldout_seed(seed)
    held, _ = stack(ShapesDataset(heldout_size, held_seed, model.config.sample_size))
    mse = heldout_recon_mse(model, held)
    log(f"vq held-out reconstruction MSE {mse:.4f} ({heldout_size} images)")
    record = {
        "recipe": "vq", "seed": seed, "steps": steps, "config": json_config(model),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "optimizer": "Adam"},
        "final_loss": final_loss, "heldout_recon_mse": mse,
        "heldout": {"size": heldout_size, "seed": held_seed},
        "wall_time_s": time.perf_counter() - start,
    }
    save_atomically(model, out, record)
    return record
