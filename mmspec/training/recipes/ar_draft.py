"""Train a draft for an AR image target: EAGLE's feature head (``kind="eagle"``), parallel
Medusa heads (``kind="medusa"``) or a small ``LlamaGenModel`` (``kind="chain"``), all on a
VQ's ids of the shapes dataset or, for the heads, of the user's own image folder.

The heads train for our bundled-style target (a ``LlamaGenModel`` folder, a ``TinyVQModel``
folder) or for a user's LlamaGen checkpoints in LlamaGen's own layout (a c2i GPT ``.safetensors``
file, ``mmspec.models.llamagen_convert``; a VQ ``.safetensors`` file, ``mmspec.models.llamagen_vq``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ...core.errors import check, check_choice, check_int
from ...models import load_checkpoint
from ...models.checkpoint import read_config, safetensors_numel
from ...models.eagle import EagleDraftHead
from ...models.llamagen import LlamaGenModel
from ...models.llamagen_convert import GPT_CONFIGS, load_llamagen_gpt, read_checkpoint, unwrap_state_dict
from ...models.llamagen_vq import LlamaGenVQModel, load_llamagen_vq
from ...models.medusa import GridMedusaHeads
from ...models.vq import TinyVQModel
from ..data import NUM_CLASSES
from ..data.imagefolder import ImageFolder
from ..loop import new_accelerator, train_loop
from .ar_image import AR_DATA_STYLE, token_data, tokenize, train_ar_image
from .common import (batch_indices, check_checkpoint_dir, check_run_args, heldout_seed, json_config,
                     save_atomically, warmup_cosine, write_log)

KINDS = ("eagle", "medusa", "chain")
MEDUSA_HEADS = 4  # the AR heads' default K: trees of 4-8 tokens (`mmspec bench cost`: c(8) about 1.1 c(1) here)
# the chain draft: a quarter-width, half-depth LlamaGen (the target's recipe defaults are 128 x 4)
CHAIN_MODEL_CONFIG = dict(dim=64, n_layers=2, n_heads=4, mlp_hidden=172, class_dropout_prob=0.1)
# EAGLE's training setup: loss weights (regression 1, classification 0.1), AdamW betas, clipping
CLS_WEIGHT = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 0.5
SHAPES_HELDOUT = 64  # held-out shapes images; an image folder holds out 10% of its images (at least 1)
LLAMAGEN_IMAGE_SIZE = 256  # a LlamaGen VQ checkpoint's default input side (its 256 px models)
_TARGET = "a folder saved by LlamaGenModel.save_pretrained (e.g. by train_ar_image)"
_VQ = "a folder saved by TinyVQModel.save_pretrained (e.g. by train_vq)"
_TARGET_OR_FILE = f"{_TARGET} or a LlamaGen c2i GPT checkpoint (.safetensors file)"
_VQ_OR_FILE = f"{_VQ} or a LlamaGen VQ checkpoint (.safetensors file)"


def _checkpoint_path(path, name: str, what: str) -> Path:
    """A folder saved by ``save_pretrained`` or a ``.safetensors`` file (its header checked)."""
    if isinstance(path, (str, os.PathLike)) and Path(path).is_file():
        check(str(path).endswith(".safetensors"), name,
              f"{what} (LlamaGen's .pt pickles are converted once: see mmspec.models.llamagen_convert)", str(path))
        safetensors_numel(Path(path), name)
        return Path(path)
    return check_checkpoint_dir(path, name, what)


def _layout(path: Path) -> str:
    return "folder" if path.is_dir() else "llamagen"


def _llamagen_vq_shape(state) -> dict:
    """``LlamaGenVQModel`` level widths and residual blocks read from a LlamaGen VQ state dict
    (``{}`` when a key is missing: ``load_llamagen_vq`` then names it)."""
    def mult(part: str, level: int) -> int:  # a level's width over the base width ch
        return state[f"{part}.conv_blocks.{level}.res.0.conv1.weight"].shape[0] // ch

    try:
        ch = state["encoder.conv_in.weight"].shape[0]
        levels = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.conv_blocks."))
        blocks = 1 + max(int(k.split(".")[4]) for k in state if k.startswith("encoder.conv_blocks.0.res."))
        return dict(encoder_ch_mult=[mult("encoder", i) for i in range(levels)],
                    decoder_ch_mult=[mult("decoder", levels - 1 - i) for i in range(levels)],  # deepest first
                    num_res_blocks=blocks)
    except (KeyError, ValueError, IndexError):
        return {}


def load_vq(path: Path, image_size: int | None = None):
    """The tokenizer at ``path``: a ``TinyVQModel`` or ``LlamaGenVQModel`` folder (by its
    config's class), or a LlamaGen VQ checkpoint file whose levels, widths and blocks are read from
    its shapes and whose input side is ``image_size`` (default ``LLAMAGEN_IMAGE_SIZE``)."""
    check_int(image_size, "image_size", 1, optional=True)
    if path.is_dir():
        config = read_config(path / "config.json", "vq_dir")
        vq = load_checkpoint(LlamaGenVQModel if config.get("_class_name") == "LlamaGenVQModel" else TinyVQModel, path)
        check(image_size in (None, vq.config.sample_size), "image_size",
              f"None or {vq.config.sample_size} (the VQ folder's sample_size)", image_size)
        return vq
    state = dict(unwrap_state_dict(read_checkpoint(path))[0])
    shape = _llamagen_vq_shape(state)
    size = LLAMAGEN_IMAGE_SIZE if image_size is None else image_size
    factor = 2 ** (len(shape.get("encoder_ch_mult", ())) - 1) if shape else 1
    check(size % factor == 0, "image_size", f"a multiple of the VQ's downsampling factor {factor} ({path})", size)
    return load_llamagen_vq(state, config=shape or "VQ-16", sample_size=size)


def _llamagen_heads(state, path: Path) -> str:
    """The LlamaGen config (``GPT-B`` ...) with the checkpoint's depth and width."""
    state, _ = unwrap_state_dict(state)
    dim = state["tok_embeddings.weight"].shape[1] if "tok_embeddings.weight" in state else None
    layers = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")), default=-1)
    named = [n for n, (L, _, D) in GPT_CONFIGS.items() if (L, D) == (layers, dim)]
    check(bool(named), "n_head", f"the checkpoint's attention heads ({path} has {layers} layers of width {dim}: "
          f"none of LlamaGen's configs {', '.join(GPT_CONFIGS)})", None)
    return named[0]


def load_target(path: Path, vq, n_head: int | None = None) -> LlamaGenModel:
    """The frozen AR target at ``path`` (a ``LlamaGenModel`` folder or a LlamaGen c2i GPT
    checkpoint file, its heads ``n_head`` or those of the LlamaGen config of its depth and
    width, its grid the VQ's unless the file holds ``freqs_cis``), checked against ``vq``: its
    vocabulary is the codebook and its grid the VQ's."""
    check_int(n_head, "n_head", 1, optional=True)
    if path.is_dir():
        target = load_checkpoint(LlamaGenModel, path)
    else:
        state = read_checkpoint(path)
        in_file = "freqs_cis" in unwrap_state_dict(state)[0]
        target = load_llamagen_gpt(state, gpt_model=None if n_head is not None else _llamagen_heads(state, path),
                                   n_head=n_head, grid_size=None if in_file else vq.grid_size)
    cfg, K, g = target.config, vq.config.codebook_size, vq.grid_size
    check((cfg.vocab_size, cfg.grid_size) == (K, g), "target_dir",
          f"an AR model over the VQ's ids (vocab = the VQ's codebook size {K}, grid = the VQ's grid {g}x{g})",
          f"{path}: vocab {cfg.vocab_size}, grid {cfg.grid_size}x{cfg.grid_size}")
    return target.requires_grad_(False)


def _load_target(target_dir, vq, n_head: int | None = None) -> LlamaGenModel:
    """A target for the shapes dataset: also its classes must be the dataset's."""
    target = load_target(Path(target_dir), vq, n_head)
    check(target.config.num_classes == NUM_CLASSES, "target_dir",
          f"an AR model over the shapes dataset's {NUM_CLASSES} classes (or give data_dir, an image folder of its "
          "classes)",
          f"{target.config.num_classes} classes")
    return target


def folder_token_data(vq, folder: ImageFolder, *, heldout_size: int | None, dataset_size: int, batch_size: int,
                      seed: int, log: Callable[[str], None] = print, chunk: int = 64):
    """``folder`` split (seeded) into held-out images (``heldout_size``, default 10% and at least
    1) and at most ``dataset_size`` training images, read at the VQ's ``sample_size`` and
    tokenized once: ``(labels, ids, held_labels, held_ids, record)``; ``record`` is the log's
    ``data``. Unreadable files are skipped, logged and counted; a split left without a
    readable held-out image or ``batch_size`` training images is refused naming the folder."""
    n = len(folder)
    held = max(1, n // 10) if heldout_size is None else heldout_size
    check(held < n, "heldout_size", f"an int below the folder's image count ({n} in {folder.root})", held)
    check(min(dataset_size, n - held) >= batch_size, "data_dir",
          f"a folder with at least batch_size ({batch_size}) training images beside {held} held out", f"{folder.root} "
          f"with {n} images")
    split_seed = heldout_seed(seed)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed)).tolist()
    held_idx, train_idx = order[:held], order[held:held + dataset_size]
    if n - held > dataset_size:
        log(f"ar-draft using {dataset_size} of the folder's {n - held} training images (dataset_size)")
    size, skipped = vq.config.sample_size, []

    def tokenized(indices):
        labels, ids = [torch.empty(0, dtype=torch.long)], [torch.empty(0, vq.grid_size ** 2, dtype=torch.long)]
        for images, y, bad in folder.batches(size, indices, chunk):
            skipped.extend(bad)
            if len(y):
                labels.append(y)
                ids.append(tokenize(vq, images))
        return torch.cat(labels), torch.cat(ids)

    labels, ids = tokenized(train_idx)
    held_labels, held_ids = tokenized(held_idx)
    first = str(min(skipped)) if skipped else None
    if skipped:
        log(f"skipped {len(skipped)} unreadable images (first: {first})")
    check(len(labels) + len(held_labels) > 0, "data_dir", "a folder with readable images",
          f"{folder.root} where all {len(skipped)} are unreadable (first: {first})")
    check(len(held_labels) > 0 and len(labels) >= batch_size, "data_dir",
          f"a folder with a readable held-out image and batch_size ({batch_size}) readable training images",
          f"{folder.root} with {len(held_labels)} and {len(labels)} ({len(skipped)} unreadable, first: {first})")
    record = {"kind": "imagefolder", "path": str(folder.root.resolve()), "classes": dict(folder.classes),
              "images": n, "train": len(labels), "heldout": len(held_labels), "skipped": len(skipped),
              "first_skipped": first, "image_size": size, "split_seed": split_seed}
    return labels, ids, held_labels, held_ids, record


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
                   model_config: dict | None = None, heldout_size: int | None = None, log_every: int = 50,
                   warmup: int = 100, log: Callable[[str], None] = print, medusa_heads: int = MEDUSA_HEADS,
                   data_dir: str | Path | None = None, n_head: int | None = None,
                   image_size: int | None = None) -> dict:
    """Train a draft for the AR image target ``target_dir`` on the ids that the VQ ``vq_dir``
    gives ``ShapesDataset(dataset_size, seed)`` (or, for the heads, the images of ``data_dir``),
    and save it to ``out_dir`` with ``train_log.json`` (written atomically), whose dict is returned.

    Target and VQ: a ``LlamaGenModel`` folder and a ``TinyVQModel`` (or ``LlamaGenVQModel``)
    folder; for the heads also a user's LlamaGen checkpoints in LlamaGen's layout: a c2i GPT
    ``.safetensors`` file (``n_head`` its attention heads, default: those of the LlamaGen config
    with its depth and width; its grid the VQ's) and a VQ ``.safetensors`` file (its levels read
    from the shapes; ``image_size`` the side it encodes, default 256). The target's vocabulary must
    be the codebook and its grid the VQ's.

    Data: without ``data_dir``, the shapes dataset (the target must have its ``NUM_CLASSES``
    classes), ``heldout_size`` held-out images (default 64). With it, an image folder
    ``DIR/<class>/<image>`` (``mmspec.training.data.imagefolder``: class ids from the folder
    names, every id below the target's ``num_classes``), split by a seeded permutation into
    ``heldout_size`` held-out images (default 10%, at least 1) and at most ``dataset_size``
    training images, each read at the VQ's input side and tokenized once; unreadable files are
    skipped and counted. A missing, empty or unusable folder is refused before any model loads.

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
    ``model_config``): a small ``LlamaGenModel`` on the shapes' ids (folders only, no
    ``data_dir``), its log holds ``heldout_loss``. ``target_dir`` is optional here (the draft only
    needs the VQ); when given it is checked against the VQ and recorded.

    Both logs add ``recipe="ar-draft"``, ``kind`` and ``target_dir``; the heads' also ``target``
    and ``vq`` (path, layout, sizes) and ``data`` (shapes, or the folder: path, class ids,
    image counts, ``skipped``). The learning rate warms up for ``warmup`` steps, then follows a
    cosine down to 10%; runs are reproducible from ``seed``.
    """
    check_choice("kind", kind, KINDS)
    model_config = dict(model_config or {})
    chain = kind == "chain"
    vq_path = check_checkpoint_dir(vq_dir, "vq_dir", _VQ) if chain else _checkpoint_path(vq_dir, "vq_dir", _VQ_OR_FILE)
    check(chain or target_dir is not None, "target_dir",
          f"the folder of the AR target (kind='{kind}' drafts from its features)", target_dir)
    check_int(medusa_heads, "medusa_heads", 1)
    target_path = None if target_dir is None else (
        check_checkpoint_dir(target_dir, "target_dir", _TARGET) if chain
        else _checkpoint_path(target_dir, "target_dir", _TARGET_OR_FILE))
    shapes_heldout = SHAPES_HELDOUT if heldout_size is None else heldout_size  # (a folder's default is its 10%)
    if chain:
        check(data_dir is None, "data_dir", "None for kind='chain' (the chain draft trains on the shapes dataset)",
              data_dir)
        return _train_chain(out_dir, vq_path, target_path, model_config, steps=steps, batch_size=batch_size,
                            lr=lr, seed=seed, dataset_size=dataset_size, heldout_size=shapes_heldout,
                            log_every=log_every, warmup=warmup, log=log)
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=shapes_heldout, log_every=log_every,
                         log=log, warmup=warmup)
    folder = None if data_dir is None else ImageFolder.scan(data_dir, "data_dir")

    accelerator = new_accelerator("train_ar_draft")
    start = time.perf_counter()
    vq = load_vq(vq_path, image_size)
    if folder is None:
        target = _load_target(target_path, vq, n_head)
        labels, ids, held_labels, held_ids, held_seed = token_data(vq, dataset_size, shapes_heldout, seed)
        data = {"kind": "shapes", "style": AR_DATA_STYLE, "train": dataset_size, "heldout": shapes_heldout}
    else:
        target = load_target(target_path, vq, n_head)
        folder.check_classes(target.config.num_classes, "data_dir")
        labels, ids, held_labels, held_ids, data = folder_token_data(
            vq, folder, heldout_size=heldout_size, dataset_size=dataset_size, batch_size=batch_size, seed=seed,
            log=log)
        held_seed = data["split_seed"]
    log(f"ar-draft ({kind}) tokenized {len(labels)} + {len(held_labels)} images into {ids.shape[1]} ids each")

    torch.manual_seed(seed)
    if kind == "medusa":
        head = GridMedusaHeads.from_target(target, **{"num_heads": medusa_heads, **model_config})
    else:
        head = EagleDraftHead.from_target(target, **model_config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, betas=BETAS)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    dropout = torch.Generator().manual_seed(seed + 1)
    batches = ((labels[idx], ids[idx]) for idx in batch_indices(len(labels), batch_size, steps, order))
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
    log(f"ar-draft ({kind}) held-out top-1 agreement {shown}, loss {held_loss:.4f} ({len(held_labels)} images)")
    record = {
        "recipe": "ar-draft", "kind": kind, "seed": seed, "steps": steps, "config": json_config(head),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": len(labels),
                  "data_style": AR_DATA_STYLE if folder is None else None,
                  "optimizer": "AdamW", "schedule": f"linear warmup {warmup} steps, cosine to 10%", "betas": list(BETAS),
                  "weight_decay": optimizer.defaults["weight_decay"], "grad_clip": GRAD_CLIP,
                  "loss": loss_text,
                  "label_dropout": target.config.class_dropout_prob},
        "target_dir": str(target_path.resolve()), "vq_dir": str(vq_path.resolve()),
        "target": {"path": str(target_path.resolve()), "layout": _layout(target_path),
                   "vocab_size": target.config.vocab_size, "grid_size": target.config.grid_size,
                   "num_classes": target.config.num_classes},
        "vq": {"path": str(vq_path.resolve()), "layout": _layout(vq_path), "codebook_size": vq.config.codebook_size,
               "image_size": vq.config.sample_size},
        "data": data,
        "final_loss": final_loss, "heldout_top1": top1, "heldout_top1_uncond": top1_uncond,
        "heldout_loss": held_loss, "heldout": {"size": len(held_labels), "seed": held_seed},
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
