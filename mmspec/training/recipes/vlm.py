"""Train the tiny LLaVA-architecture VLMs (``mmspec.models.vlm``) on ``SceneQADataset``: the
``"target"`` the VLM methods accelerate and the small ``"draft"`` VLM (the ``sd`` baseline and the
transformers peer's assistant). Next-token cross-entropy on the answer tokens only (the chat frame,
question and image placeholders are context), AdamW with warmup and cosine decay.

``resolution`` sets the image side (``image_tokens(resolution)`` visual tokens per image); with
``init`` a trained VLM is fine-tuned instead of trained from scratch, its vision tower resampled to
the new resolution (``resize_vision``). ``images_per_prompt=K`` gives each question 1 to K images,
asked about the last (``SceneQADataset(images=K)``). The visual-heavy target (192 px, 576 visual
tokens per image, LLaVA-1.5's count; up to 4 images, 2,304 visual tokens, per prompt) is the 64 px
target fine-tuned this way twice: at 192 px, then with ``images_per_prompt=4``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from ...core.errors import check, check_choice, check_int
from ...models.vlm import IMAGE_SIZE, SIZES, build_processor, check_resolution, image_tokens, new_llava, resize_vision
from ..data.scene_qa import SceneQADataset, prompt_text, vocabulary
from ..loop import new_accelerator, train_loop
from .common import batch_indices, check_run_args, heldout_seed, save_atomically, warmup_cosine

IGNORE = -100


def processor_resolution(processor) -> int:
    """The image side a processor built by ``build_processor`` feeds its VLM."""
    return processor.image_processor.crop_size["height"]


def encode(processor, items) -> tuple[list[torch.Tensor], list[list[int]], list[int]]:
    """``(image, question, answer)`` items -> per item its pixels (k, 3, H, W) as rendered (``k``
    images: one for an image (3, H, W), k for a stack (k, 3, H, W)), the token ids of prompt +
    answer + ``</s>`` (``prompt_text``'s frame with k image parts, each ``<image>`` expanded to the
    processor's resolution) and the prompt's length."""
    tok = processor.tokenizer
    images, seqs, prompt_lens = [], [], []
    expanded = " ".join([tok.image_token] * image_tokens(processor_resolution(processor)))
    for image, question, answer in items:
        image = image.reshape(-1, *image.shape[-3:])
        prompt = tok(prompt_text(question, len(image)).replace(tok.image_token, expanded))["input_ids"]
        answer_ids = tok(answer)["input_ids"] + [tok.eos_token_id]
        images.append(image)
        seqs.append(prompt + answer_ids)
        prompt_lens.append(len(prompt))
    return images, seqs, prompt_lens


def collate(seqs: list[list[int]], prompt_lens: list[int], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (answer tokens only)."""
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, (s, n) in enumerate(zip(seqs, prompt_lens)):
        ids[i, : len(s)] = torch.tensor(s)
        labels[i, n : len(s)] = ids[i, n : len(s)]
        mask[i, : len(s)] = 1
    return ids, mask, labels


@torch.no_grad()
def heldout_loss(model, pixels, seqs, prompt_lens, pad_id: int, batch_size: int = 32) -> float:
    """Mean cross-entropy per answer token over the held-out set (eval mode)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(seqs), batch_size):
        ids, mask, labels = collate(seqs[i : i + batch_size], prompt_lens[i : i + batch_size], pad_id)
        n = int((labels[:, 1:] != IGNORE).sum())
        out = model(input_ids=ids, attention_mask=mask, pixel_values=torch.cat(pixels[i : i + batch_size]),
                    labels=labels)
        total, count = total + out.loss.item() * n, count + n
    return total / count


@torch.no_grad()
def short_answers(model, processor, items, shuffle_images: bool = False) -> list[bool]:
    """Per short ``(image, question, answer)`` item, whether ``model``'s greedy answer is exactly
    the item's (eval mode, one item per call). ``shuffle_images`` pairs each question with the next
    item's image, in the last image's place (the one the question is about): the control that
    shows the answers need the image."""
    model.eval()
    pixels, seqs, prompt_lens = encode(processor, items)
    eos = processor.tokenizer.eos_token_id
    right = []
    for i, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        ids = torch.tensor([seq[:n]])
        image = pixels[i].clone()
        if shuffle_images:
            image[-1] = pixels[(i + 1) % len(seqs)][-1]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=image,
                             max_new_tokens=len(seq) - n + 2, do_sample=False, eos_token_id=eos)
        right.append(out[0, n:].tolist()[: len(seq) - n] == seq[n:])
    return right


def train_vlm(out_dir: str | Path, *, size: str = "target", steps: int, batch_size: int, lr: float, seed: int = 0,
              dataset_size: int, heldout_size: int = 64, log_every: int = 50, warmup: int = 100,
              resolution: int = IMAGE_SIZE, images_per_prompt: int = 1, init: str | Path | None = None,
              log: Callable[[str], None] = print) -> dict:
    """Train ``new_llava(vocabulary(), size, resolution)`` on ``SceneQADataset(dataset_size, seed,
    resolution)`` (or fine-tune the VLM saved in ``init``, resampled to ``resolution`` by
    ``resize_vision``) and save it with its processor to ``out_dir`` (fp16 safetensors and the
    processor files, written atomically) with ``train_log.json``, whose dict is returned:
    ``recipe``, ``size``, ``seed``, ``steps``, ``resolution``, ``image_tokens``, ``images_per_prompt``,
    ``init``,
    ``config``, ``train`` (the arguments), ``final_loss``, ``heldout_loss`` (nats per answer
    token), ``heldout`` (size and seed), ``short_answer_accuracy`` (greedy exact match on
    ``heldout_size`` held-out short questions) and ``shuffled_image_accuracy`` (the same questions
    asked about another item's image), ``short_answers_by_images`` (with ``images_per_prompt > 1``:
    per number of images, ``items`` and both accuracies; else None), ``parameters``,
    ``wall_time_s``. Seeded: runs at the same thread count give the same weights.

    ``images_per_prompt=K > 1``: every item (held-out ones too) holds 1 to K images and is asked
    about the last (``SceneQADataset(images=K)``): the target learns to answer about the image
    nearest the question with up to K - 1 others before it."""
    check_choice("size", size, tuple(SIZES))
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                         dataset_size=dataset_size, heldout_size=heldout_size, log_every=log_every)
    check_int(warmup, "warmup", 1)
    check_resolution(resolution)
    check_int(images_per_prompt, "images_per_prompt", 1)
    check(init is None or (Path(init) / "config.json").is_file(), "init",
          "None or a folder holding a VLM saved by 'mmspec train vlm'", init)
    accelerator = new_accelerator("train_vlm")
    start = time.perf_counter()
    processor = build_processor(vocabulary(), resolution)  # its chat template writes prompt_text's frame
    pad_id = processor.tokenizer.pad_token_id
    K = images_per_prompt
    pixels, seqs, prompt_lens = encode(processor, SceneQADataset(dataset_size, seed, resolution, images=K))
    held_seed = heldout_seed(seed)
    held = encode(processor, SceneQADataset(heldout_size, held_seed, resolution, images=K))
    log(f"vlm-{size}: {dataset_size} image/question/answer triples at {resolution} px"
        f"{f', 1 to {K} images each' if K > 1 else ''}, longest sequence {max(map(len, seqs))} tokens")

    torch.manual_seed(seed)
    if init is None:
        model = new_llava(vocabulary(), size, resolution)
    else:
        from transformers import LlavaForConditionalGeneration

        model = resize_vision(LlavaForConditionalGeneration.from_pretrained(init, dtype=torch.float32), resolution)
        model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup=warmup, steps=steps))
    generator = torch.Generator().manual_seed(seed)

    def batches():
        for idx in batch_indices(len(seqs), batch_size, steps, generator):
            ids, mask, labels = collate([seqs[i] for i in idx], [prompt_lens[i] for i in idx], pad_id)
            yield dict(input_ids=ids, attention_mask=mask, pixel_values=torch.cat([pixels[i] for i in idx]),
                       labels=labels)

    loss_value = train_loop(model, optimizer, batches(), lambda m, batch: m(**batch).loss, steps=steps,
                            accelerator=accelerator, schedule=schedule, grad_clip=1.0, name=f"vlm-{size}", log=log,
                            log_every=log_every)
    held_loss = heldout_loss(model, *held, pad_id)
    short = SceneQADataset(heldout_size, held_seed, resolution, describe_prob=0.0, images=K)
    items = [short[i] for i in range(heldout_size)]
    hits, shuffled_hits = (short_answers(model, processor, items, shuffle) for shuffle in (False, True))
    accuracy, shuffled = sum(hits) / len(hits), sum(shuffled_hits) / len(hits)
    log(f"vlm-{size} held-out loss {held_loss:.4f} nats/answer token, short answers {accuracy:.3f} "
        f"({shuffled:.3f} with another item's image)")
    by_images = {}  # K > 1: the same figures per number of images in the prompt
    for k in range(1, K + 1) if K > 1 else ():
        rows = [i for i, item in enumerate(items) if len(item[0]) == k]  # item[0]: (k, 3, H, W)
        by_images[str(k)] = dict(items=len(rows), accuracy=sum(hits[i] for i in rows) / max(len(rows), 1),
                                 shuffled_image_accuracy=sum(shuffled_hits[i] for i in rows) / max(len(rows), 1))
    record = dict(recipe="vlm", size=size, seed=seed, steps=steps, resolution=resolution,
                  image_tokens=image_tokens(resolution), images_per_prompt=K, init=None if init is None else str(init),
                  config=model.config.to_dict(), short_answer_accuracy=accuracy, shuffled_image_accuracy=shuffled,
                  short_answers_by_images=by_images or None,
                  train=dict(batch_size=batch_size, lr=lr, dataset_size=dataset_size, warmup=warmup),
                  final_loss=loss_value, heldout_loss=held_loss, heldout=dict(size=heldout_size, seed=held_seed),
                  parameters=sum(p.numel() for p in model.parameters()),
                  wall_time_s=round(time.perf_counter() - start, 1))
    model.eval()
    save_atomically(model, out, record, extra=processor.save_pretrained)
    return record


HELDOUT_SCENES = 16
"""Held-out scenes bundled for the demo and the serving helpers (``assets/vlm/scenes``)."""


def save_heldout_scenes(folder: str | Path, count: int = HELDOUT_SCENES, seed: int = 0,
                        resolution: int = IMAGE_SIZE) -> list[Path]:
    """Write the first ``count`` images of ``SceneQADataset(count, heldout_seed(seed), resolution)``
    (the held-out scenes the VLM bench asks about first) to ``folder/00.png``, ``01.png``, ... as
    RGB uint8 (each pixel ``round(255 * clamp((x + 1) / 2, 0, 1))``): the files
    ``mmspec.serve.scene`` reads, so runtime code draws no data. Returns the paths written."""
    import numpy as np
    import PIL.Image

    check_int(count, "count", 1)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    data = SceneQADataset(count, heldout_seed(seed), resolution)
    paths = []
    for i in range(count):
        image = ((data[i][0] + 1) / 2).permute(1, 2, 0).clamp(0, 1).numpy()
        paths.append(out / f"{i:02d}.png")
        PIL.Image.fromarray((image * 255).round().astype(np.uint8)).save(paths[-1])
    return paths
