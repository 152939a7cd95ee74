"""Train a draft for the AR image target: EAGLE's feature head (``kind="eagle"``), parallel
Medusa heads (``kind="medusa"``) or a small ``LlamaGenModel`` (``kind="chain"``), all on a
trained VQ's ids of the shapes dataset."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ...core.errors import check, check_choice
from ...models import load_checkpoint
from ...models.eagle import EagleDraftHead
from ...models.llamagen import LlamaGenModel
from ...models.medusa import GridMedusaHeads
from ...models.vq import TinyVQModel
from ..data import NUM_CLASSES
from ..loop import new_accelerator, train_loop
from .ar_image import AR_DATA_STYLE, token_data, train_ar_image
from .common import (batch_indices, check_checkpoint_dir, check_run_args, json_config, save_atomically,
                     warmup_cosine, write_log)

KINDS = ("eagle", "medusa", "chain")
MEDUSA_HEADS = 4  # the AR heads' default K: trees of 4-8 tokens (`mmspec bench cost`: c(8) about 1.1 c(1) here)
# the chain draft: a quarter-width, half-depth LlamaGen (the target's recipe defaults are 128 x 4)
CHAIN_MODEL_CONFIG = dict(dim=64, n_layers=2, n_heads=4, mlp_hidden=172, class_dropout_prob=0.1)
# EAGLE's training setup: loss weights (regression 1, classification 0.1), AdamW betas, clipping
CLS_WEIGHT = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 0.5


def _checkpoint_dir(path, name: str, what: str) -> Path:
    return check_checkpoint_dir(path, name, f"a folder saved by {what}")


def _load_target(target_dir, vq: TinyVQModel) -> LlamaGenModel:
    target = load_checkpoint(LlamaGenModel, target_dir).requires_grad_(False)
    cfg = target.config
    check((cfg.vocab_size, cfg.grid_size, cfg.num_classes) == (vq.config.codebook_size, vq.grid_size, NUM_CLASSES),
          "target_dir", f"an AR model over this VQ's ids (vocab {vq.config.codebook_size}, grid {vq.grid_size}, "
          f"{NUM_CLASSES} classes)", f"vocab {cfg.vocab_size}, grid {cfg.grid_size}, {cfg.num_classes} classes")
    return target


@torch.no_grad()
def heldout_agreement(head: EagleDraftHead, labels: torch.Tensor, ids: torch.Tensor,
                      batch_size: int = 32) -> float:
    """Top-1 agreement, teacher-forced: how often the argmax of the head's logits (from the
    target's true features) equals the target's argmax, over every predicted held-out position."""
    head.eval()
    matches = total = 0
    for y, x in zip(labels.split(batch_size), ids.split(batch_size)):
        out, ref = head.teacher_forced(y, x)
        matches += int((out.logits.argmax(-1) == ref.logits[:, 1:].argmax(-1)).sum())
        total += out.logits.shape[0] * out.logits.shape[1]
    return matches / total


@torch.no_grad()
def heldout_head_agreement(heads: GridMedusaHeads, labels: torch.Tensor, ids: torch.Tensor,
                           batch_size: int = 32) -> tuple[list[float], float]:
    """Per head, teacher-forced top-1 agreement with the target's argmax over every held-out root
    whose head-k token is in the grid, and the held-out loss (mean over batches)."""
    heads.eval()
    hits, counts, loss = 0.0, 0.0, 0.0
    for y, x in zip(labels.split(batch_size), ids.split(batch_size)):
        out = heads.loss(y, x)
        hits = hits + out["top1"] * out["count"]
        counts = counts + out["count"]
        loss += out["loss"].item() * len(y)
    return (hits / counts).tolist(), loss / len(labels)


@torch.no_grad()
def _heldout_loss(head: EagleDraftHead, labels, ids, batch_size: int = 32) -> float:
    head.eval()
    total = sum(head.loss(y, x, cls_weight=CLS_WEIGHT).item() * len(y)
                for y, x in zip(labels.split(batch_size), ids.split(batch_size)))
    return total / len(labels)


def train_ar_draft(out_dir: str | Path, *, kind: str, vq_dir: str | Path, target_dir: str | Path | None = None,
                   steps: int, batch_size: int, lr: float, seed: int = 0, dataset_size: int,
                   model_config: dict | None = None, heldout_size: int = 64, log_every: int = 50,
                   warmup: int = 100, log: Callable[[str], None] = print, medusa_heads: int = MEDUSA_HEADS) -> dict:
    """Train a draft for the AR image target in ``target_dir`` on ``ShapesDataset(dataset_size,
    seed)`` tokenized by the VQ in ``vq_dir``, and save it to ``out_dir`` with ``train_log.json``
    (written atomically), whose dict is returned.

    ``kind="eagle"``: an ``EagleDraftHead`` shaped like one target layer (``model_config``
    overrides its arguments), trained on the frozen target's features with EAGLE's loss
    (``EagleDraftHead.loss``: smooth-L1 + 0.1 x cross-entropy, teacher-forced), labels dropped
    with the target's ``class_dropout_prob`` so the unconditional half is learned too; AdamW
    (betas 0.9, 0.95, gradient clipping 0.5, as in EAGLE). Only the head's weights are saved; load
    it with ``load_checkpoint(EagleDraftHead, out_dir).bind(target)``. The log holds
    ``heldout_top1`` (``heldout_agreement`` with the labels kept), ``heldout_top1_uncond`` (null
    labels) and ``heldout_loss``.

    ``kind="medusa"``: ``GridMedusaHeads`` with ``medusa_heads`` heads (``model_config`` overrides
    its arguments), trained on the frozen target's features by ``GridMedusaHeads.loss`` (each
    head's cross-entropy to the target's own distribution, weighted 0.8 ** k; labels dropped as
    for eagle), AdamW as for eagle. The log holds ``heldout_top1`` (one agreement per head, labels
    kept), ``heldout_top1_uncond`` (null labels) and ``heldout_loss``.

    ``kind="chain"``: ``train_ar_image`` with ``CHAIN_MODEL_CONFIG`` (overridden by
    ``model_config``): a small ``LlamaGenModel`` on the same ids, its log holds ``heldout_loss``.
    ``target_dir`` is optional here (the draft only needs the VQ); when given it is checked
    against the VQ and recorded.

    Both logs add ``recipe="ar-draft"``, ``kind`` and ``target_dir``. The learning rate warms up
    for ``warmup`` steps, then follows a cosine down to 10%; runs are reproducible from ``seed``.
    """
    check_choice("kind", kind, KINDS)
    model_config = dict(model_config or {})
    vq_path = _checkpoint_dir(vq_dir, "vq_dir", "TinyVQModel.save_pretrained (e.g. by train_vq)")
    check(kind == "chain" or target_dir is not None, "target_dir",
          f"the folder of the AR target (kind='{kind}' drafts from its features)", target_dir)
    check(isinstance(medusa_heads, int) and medusa_heads >= 1, "medusa_heads", "an int >= 1", medusa_heads)
    target_path = None if target_dir is None else _checkpoint_dir(
        target_dir, "target_dir", "LlamaGenModel.save_pretrained (e.g. by train_ar_image)")
    if kind == "chain":
        return _train_chain(out_dir, vq_path, target_path, model_config, steps=steps, batch_size=batch_size,
                            lr=lr, seed=seed, dataset_size=dataset_size, heldout_size=heldout_size,
                            log_every=log_every, warmup=warmup, log=log)
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every,
                         log=log, warmup=warmup)

    accelerator = new_accelerator("train_ar_draft")
    start = time.perf_counter()
    vq = load_checkpoint(TinyVQModel, vq_path)
    target = _load_target(target_path, vq)
    labels, ids, held_labels, held_ids, held_seed = token_data(vq, dataset_size, heldout_size, seed)
    log(f"ar-draft ({kind}) tokenized {dataset_size} + {heldout_size} images into {ids.shape[1]} ids each")

    torch.manual_seed(seed)
    if kind == "medusa":
        head = GridMedusaHeads.from_target(target, **{"num_heads": medusa_heads, **model_config})
    else:
        head = EagleDraftHead.from_target(target, **model_config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=BETAS)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    dropout = torch.Generator().manual_seed(seed + 1)
    batches = ((labels[idx], ids[idx]) for idx in batch_indices(dataset_size, batch_size, steps, order))
    if kind == "medusa":
        step_loss = lambda h, b: h.loss(*b, generator=dropout)["loss"]  # noqa: E731
        loss_text = "soft cross-entropy(target's head) per head, weighted 0.8 ** k"
    else:
        step_loss = lambda h, b: h.loss(*b, generator=dropout, cls_weight=CLS_WEIGHT)  # noqa: E731
        loss_text = f"smooth_l1(features) + {CLS_WEIGHT} x soft cross-entropy(target's head)"
    final_loss = train_loop(head, optimizer, batches, step_loss, steps=steps, accelerator=accelerator,
                            schedule=schedule, grad_clip=GRAD_CLIP, name=f"ar-draft ({kind})", log=log,
                            log_every=log_every, state={"dropout": dropout})

    nulls = torch.full_like(held_labels, target.null_class)
    if kind == "medusa":
        top1, held_loss = heldout_head_agreement(head, held_labels, held_ids)
        top1_uncond, _ = heldout_head_agreement(head, nulls, held_ids)
        shown = f"{', '.join(f'{x:.4f}' for x in top1)} (uncond {', '.join(f'{x:.4f}' for x in top1_uncond)})"
    else:
        top1 = heldout_agreement(head, held_labels, held_ids)
        top1_uncond = heldout_agreement(head, nulls, held_ids)
        held_loss = _heldout_loss(head, held_labels, held_ids)
        shown = f"{top1:.4f} (uncond {top1_uncond:.4f})"
    log(f"ar-draft ({kind}) held-out top-1 agreement {shown}, loss {held_loss:.4f} ({heldout_size} images)")
    record = {
        "recipe": "ar-draft", "kind": kind, "seed": seed, "steps": steps, "config": json_config(head),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "data_style": AR_DATA_STYLE,
                  "optimizer": "AdamW", "schedule": f"linear warmup {warmup} steps, cosine to 10%", "betas": list(BETAS),
                  "weight_decay": optimizer.defaults["weight_decay"], "grad_clip": GRAD_CLIP,
                  "loss": loss_text,
                  "label_dropout": target.config.class_dropout_prob},
        "target_dir": str(target_path.resolve()), "vq_dir": str(vq_path.resolve()),
        "final_loss": final_loss, "heldout_top1": top1, "heldout_top1_uncond": top1_uncond,
        "heldout_loss": held_loss, "heldout": {"size": heldout_size, "seed": held_seed},
        "wall_time_s": time.perf_counter() - start,
    }
    save_atomically(head, out, record)
    return record


def _train_chain(out_dir, vq_path: Path, target_path: Path | None, model_config: dict, **run) -> dict:
    if target_path is not None:  # fail before training, not after
        _load_target(target_path, load_checkpoint(TinyVQModel, vq_path))
    record = train_ar_image(out_dir, vq_dir=vq_path, model_config={**CHAIN_MODEL_CONFIG, **model_config}, **run)
    record = {"recipe": "ar-draft", "kind": "chain", **{k: v for k, v in record.items() if k != "recipe"},
              "target_dir": None if target_path is None else str(target_path.resolve())}
    write_log(Path(out_dir), record)  # the folder is complete either way; only the log's labels change
    return record
