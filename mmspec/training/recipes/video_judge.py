"""Train the video bench's frame judge (``FrameJudge``): the colour and shape of the main object in
procedural moving-shapes frames, ground truth from ``render_clip``."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from ...core.errors import check, check_int
from ...models import load_checkpoint
from ...models.video_ae import FrameAutoencoder
from ...models.video_judge import FIELDS, FrameJudge
from ..data.shapes import PALETTE
from ..data.video import PROMPT_VOCAB, VideoClipDataset, frame_colour
from ..loop import new_accelerator, train_loop
from .common import (batch_indices, gaussian_blur, check_checkpoint_dir, check_run_args, heldout_seed, json_config,
                     save_atomically, warmup_cosine)
from .video import render_clips


def judge_frames(size: int, seed: int, clip_frames: int, resolution: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` frames (N, 3, H, W) in [-1, 1] and their (N, 2) (colour, shape) ids: every frame of
    ``VideoClipDataset(ceil(size / clip_frames), seed, clip_frames, switch_prob=0.3)`` (colour
    switches included), cut to ``size``."""
    clips = -(-size // clip_frames)
    frames, prompt_ids, _ = render_clips(VideoClipDataset(clips, seed, clip_frames, resolution, switch_prob=0.3))
    return frames.flatten(0, 1)[:size], prompt_ids.flatten(0, 1)[:size, :2]


def augment(frames: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per frame: random flips (shapes are drawn at random rotations: a mirror image is another
    sample of the same labels); on half of them a blur (one sigma in [0.4, 1.2] px per batch) and
    on a quarter Gaussian pixel noise (std 0.05), so decoded frames' soft edges and grain do not
    surprise the judge. Colours are never changed: they are labels."""
    B = len(frames)
    hflip, vflip, blur, noisy = (torch.rand(4, B, generator=generator) < torch.tensor([[.5], [.5], [.5], [.25]]))
    sigma = 0.4 + 0.8 * torch.rand(1, generator=generator).item()
    m = lambda mask: mask[:, None, None, None]  # noqa: E731
    frames = torch.where(m(hflip), frames.flip(3), frames)
    frames = torch.where(m(vflip), frames.flip(2), frames)
    frames = torch.where(m(blur), gaussian_blur(frames, sigma, radius=2), frames)
    noise = 0.05 * torch.randn(frames.shape, generator=generator)
    return torch.where(m(noisy), frames + noise, frames).clamp(-1, 1)


@torch.no_grad()
def judge_accuracy(judge: FrameJudge, frames: torch.Tensor, ids: torch.Tensor) -> dict:
    """Accuracies of ``judge`` on frames (N, 3, H, W) with (N, 2) (colour, shape) ids:
    ``colour``, ``shape`` and ``both`` (the prompt's colour and shape right), and ``pixel_colour``
    (``frame_colour`` from pixels, for comparison)."""
    pred = judge.eval().predict(frames)
    ok = {f: pred[f] == ids[:, i] for i, f in enumerate(FIELDS)}
    return {"colour": ok["colour"].float().mean().item(), "shape": ok["shape"].float().mean().item(),
            "both": (ok["colour"] & ok["shape"]).float().mean().item(),
            "pixel_colour": (frame_colour(frames) == ids[:, 0]).float().mean().item()}


def train_video_judge(out_dir: str | Path, *, steps: int, batch_size: int, lr: float, seed: int = 0,
                      dataset_size: int, clip_frames: int = 8, heldout_size: int = 2048,
                      ae_dir: str | Path | None = None, warmup: int = 50, weight_decay: float = 0.05,
                      log_every: int = 50, log: Callable[[str], None] = print) -> dict:
    """Train ``FrameJudge()`` with AdamW (cross-entropy of both heads) on ``dataset_size`` rendered
    frames (``judge_frames``, flipped, blurred and noised by ``augment``) and save it to ``out_dir``
    (fp16 safetensors, atomically) with ``train_log.json``, whose dict is returned: ``recipe``,
    ``seed``, ``steps``, ``config``, ``train``, ``final_loss``, ``heldout_accuracy`` (colour and
    shape both right), ``heldout`` (per-field accuracies, the pixel colour measure's, size, seed),
    ``ae_dir`` and ``ae_recon`` (the same accuracies on the autoencoder's reconstructions of the
    held-out frames; None without ``ae_dir``), ``wall_time_s``, ``cpu_time_s``.
    Deterministic for a seed and a thread count."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                         heldout_size=heldout_size, log_every=log_every, log=log, warmup=warmup)
    check_int(clip_frames, "clip_frames", 1)
    check(isinstance(weight_decay, (int, float)) and not isinstance(weight_decay, bool) and weight_decay >= 0,
          "weight_decay", "a number >= 0", weight_decay)
    ae_path = None if ae_dir is None else check_checkpoint_dir(
        ae_dir, "ae_dir", "None or a folder saved by FrameAutoencoder (e.g. by train_video_ae)")

    accelerator = new_accelerator("train_video_judge")
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    palette = [[round(v, 6) for v in rgb] for rgb in PALETTE.tolist()]  # the data's colours, saved in the config
    judge = FrameJudge(labels={f: list(PROMPT_VOCAB[f]) for f in FIELDS}, palette=palette)
    size = judge.config.sample_size
    frames, ids = judge_frames(dataset_size, seed, clip_frames, size)
    log(f"video-judge rendered {len(frames)} frames in {time.perf_counter() - start:.0f}s")
    optimizer = torch.optim.AdamW(judge.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    augmentation = torch.Generator().manual_seed(seed + 1)
    batches = ((frames[idx], ids[idx]) for idx in batch_indices(dataset_size, batch_size, steps, order))

    def loss(model, batch):
        x, y = batch
        logits = model(augment(x, augmentation))
        ce = {f: F.cross_entropy(logits[f], y[:, i]) for i, f in enumerate(FIELDS)}
        both = (logits["colour"].argmax(-1) == y[:, 0]) & (logits["shape"].argmax(-1) == y[:, 1])
        return {"loss": ce["colour"] + ce["shape"], "shape_ce": ce["shape"], "batch_accuracy": both.float().mean()}

    final_loss = train_loop(judge, optimizer, batches, loss, steps=steps, accelerator=accelerator, schedule=schedule,
                            name="video-judge", log=log, log_every=log_every, state={"augmentation": augmentation})
    del frames, batches
    judge.eval()
    held_seed = heldout_seed(seed)
    held_frames, held_ids = judge_frames(heldout_size, held_seed, clip_frames, size)
    held = judge_accuracy(judge, held_frames, held_ids)
    log(f"video-judge held-out accuracy {held['both']:.4f} (colour {held['colour']:.4f}, shape {held['shape']:.4f}; "
        f"pixel colour {held['pixel_colour']:.4f}) on {heldout_size} frames")
    recon = None
    if ae_path is not None:
        ae = load_checkpoint(FrameAutoencoder, ae_path)
        with torch.no_grad():
            rec = torch.cat([ae(c).clamp(-1, 1) for c in held_frames.split(256)])
        recon = judge_accuracy(judge, rec, held_ids)
        log(f"video-judge accuracy on the autoencoder's reconstructions {recon['both']:.4f}")
    record = {
        "recipe": "video-judge", "seed": seed, "steps": steps, "config": json_config(judge),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "clip_frames": clip_frames,
                  "optimizer": "AdamW", "weight_decay": weight_decay,
                  "schedule": f"linear warmup {warmup} steps, cosine to 10%",
                  "augment": "random flips; blur (sigma 0.4-1.2 px) on half, pixel noise (std 0.05) on a quarter"},
        "final_loss": final_loss, "heldout_accuracy": held["both"],
        "heldout": {**held, "frames": heldout_size, "seed": held_seed},
        "ae_dir": None if ae_path is None else str(ae_path.resolve()), "ae_recon": recon,
        "wall_time_s": time.perf_counter() - start,
        # this process's CPU seconds: the wall time the run takes alone on one thread
        "cpu_time_s": time.process_time() - cpu_start,
    }
    save_atomically(judge, out, record)
    return record
