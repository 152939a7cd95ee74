"""Train the streaming video model: the frame autoencoder (``train_video_ae``) and the chunk-causal
video DiT over its latents (``train_video``), on procedural moving-shapes clips.

How ``train_video`` keeps rolling in distribution (the Self-Forcing lesson): every training clip
is longer than the attention the model gets (a clip of ``clip_frames`` frames; a chunk sees only
the sink and a window of at most ``window_frames`` frames, the window drawn per step, keys at
cache-order positions), and it runs the two-stream plan (``ChunkPlan.two_stream``), which is
exactly the rolling cache's computation. The context stream stands for the committed frames and
is, per step, the model's own stream over the batch through the inference pipeline (a
*self-rollout*: ``self_rollout``, ``TwoStreamLoss``; frames evicted inside the clip, re-cache at
its prompt switches), or the model's one-step predictions, or the clean latents, per clip noised
to a small t (diffusion forcing's noisy context; the commit pass still says t = 0 at inference,
so the model learns not to trust the context blindly). Clips with a prompt switch carry the new
prompt on every frame, context included (what a LongLive re-cache of the whole visible set
gives), and are trained only on the chunks from the switch on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from ...core.errors import check, check_int, is_int
from ...models import load_checkpoint
from ...models.video_ae import FrameAutoencoder
from ...models.video_dit import ChunkPlan, VideoDiTModel
from ...utils.atomic import atomic_path
from ..data.video import (PROMPT_VOCAB, VideoClipDataset, VideoPrompt, frame_colour, motion_direction,
                          pixel_centroid, prompt_at)
from ..loop import EMA, new_accelerator, train_loop
from .common import (batch_indices, check_checkpoint_dir, check_run_args, heldout_seed, json_config,
                     save_atomically, warmup_cosine)

# the model the bundled assets use; see VideoDiTModel for the meaning of each
# (sample_steps and guidance_scale are sampling defaults only: 8 Euler steps at CFG 3.5 were chosen
# on the bundled weights over 12 evaluation streams of seed 1 (colour 0.85, direction 0.66, against
# 0.54 and 0.45 at 4 steps and CFG 3; CFG 4 and more saturates the frames with colour))
DEFAULT_VIDEO_CONFIG = dict(chunk_frames=3, sink_frames=3, window_frames=9, dim=128, n_layers=4, n_heads=4,
                            mlp_hidden=384, rope_theta=100.0, prompt_dropout_prob=0.1, sample_steps=8,
                            time_shift=1.0, guidance_scale=3.5, conv_head=32)
_DERIVED = ("latent_channels", "latent_size", "prompt_vocab")
SAMPLES_PNG = "samples.png"
# the clips both video recipes (and the video bench's reference clips) draw: see STYLES in
# ..data.video. The first bundled model, trained on "scene" clips for 1,500 steps, drew blurred,
# fading objects that hardly moved (colour 0.54, direction 0.16 over its 12 evaluation streams)
VIDEO_DATA_STYLE = "simple"


# -- data --------------------------------------------------------------------------------------
def render_clips(dataset: VideoClipDataset) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Render a whole dataset: frames (N, F, 3, H, W), per-frame prompt ids (N, F, 3), switch
    frames (N,) (-1: none)."""
    items = [dataset[i] for i in range(len(dataset))]
    return (torch.stack([it["frames"] for it in items]), torch.stack([it["prompt_ids"] for it in items]),
            torch.tensor([it["switch_frame"] for it in items]))


@torch.no_grad()
def encode_clips(ae: FrameAutoencoder, frames: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """(N, F, 3, H, W) -> normalized latents (N, F, C, h, w)."""
    ae.eval()
    flat = frames.flatten(0, 1)
    return torch.cat([ae.encode(chunk) for chunk in flat.split(batch_size)]).unflatten(0, frames.shape[:2])


# -- the autoencoder ---------------------------------------------------------------------------
@torch.no_grad()
def heldout_recon(ae: FrameAutoencoder, frames: torch.Tensor, batch_size: int = 256) -> dict:
    """Mean squared error (frames in [-1, 1]) and PSNR (on [0, 1], from that MSE) of
    reconstructions of ``frames`` (N, 3, H, W), in eval mode, outputs clamped to [-1, 1]."""
    ae.eval()
    total = sum(F.mse_loss(ae(c).clamp(-1, 1), c, reduction="sum").item() for c in frames.split(batch_size))
    mse = total / frames.numel()
    return {"mse": mse, "psnr_db": 10 * math.log10(4.0 / mse)}  # peak-to-peak 2 in [-1, 1]


def fit_autoencoder(ae: FrameAutoencoder, images: torch.Tensor, *, steps: int, batch_size: int, lr: float,
                    seed: int, warmup: int, accelerator, name: str, log: Callable[[str], None],
                    log_every: int) -> float:
    """Train a ``FrameAutoencoder`` (or a subclass) on ``images`` with Adam, linear warm-up and
    cosine decay, batches drawn with a generator seeded ``seed`` and latent noise from one seeded
    ``seed + 1``; leave it in eval mode and return the final loss. The video autoencoder and the
    continuous-token ``ConvTokenizer`` recipes share it; each then measures its latent statistics."""
    optimizer = torch.optim.Adam(ae.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(seed + 1)
    batches = (images[idx] for idx in batch_indices(len(images), batch_size, steps, order))
    final_loss = train_loop(ae, optimizer, batches, lambda m, x: m.loss(x, noise), steps=steps,
                            accelerator=accelerator, schedule=schedule, name=name, log=log, log_every=log_every,
                            state={"noise": noise})
    ae.eval()
    return final_loss


def train_video_ae(out_dir: str | Path, *, steps: int, batch_size: int = 32, lr: float, seed: int = 0,
                   dataset_size: int, clip_frames: int = 8, heldout_size: int = 32, model_config: dict | None = None,
                   log_every: int = 50, warmup: int = 50, log: Callable[[str], None] = print) -> dict:
    """Train a ``FrameAutoencoder`` with Adam on ``dataset_size`` frames, the first of the clips of
    ``VideoClipDataset(ceil(dataset_size / clip_frames), seed, clip_frames, switch_prob=0.3,
    style=VIDEO_DATA_STYLE)``, and save it to ``out_dir`` (fp16 safetensors, written
    atomically) with ``train_log.json``, whose dict is returned: ``recipe``, ``seed``, ``steps``,
    ``config``, ``train``, ``final_loss``, ``heldout_recon_mse``, ``heldout_psnr_db`` (on
    ``heldout_size`` clips of a held-out seed), ``heldout``, ``latent_mean``/``latent_std``,
    ``wall_time_s``. After training, the latent statistics are measured on the training frames.
    Deterministic for a seed and a thread count."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                         heldout_size=heldout_size, log_every=log_every, log=log, warmup=warmup)
    check_int(clip_frames, "clip_frames", 1)
    accelerator = new_accelerator("train_video_ae")
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    ae = FrameAutoencoder(**(model_config or {}))
    size = ae.config.sample_size
    clips = -(-dataset_size // clip_frames)
    frames = render_clips(VideoClipDataset(clips, seed, clip_frames, size, switch_prob=0.3,
                                           style=VIDEO_DATA_STYLE))[0].flatten(0, 1)
    frames = frames[:dataset_size]
    log(f"video-ae rendered {len(frames)} frames ({clips} clips) in {time.perf_counter() - start:.0f}s")
    final_loss = fit_autoencoder(ae, frames, steps=steps, batch_size=batch_size, lr=lr, seed=seed, warmup=warmup,
                                 accelerator=accelerator, name="video-ae", log=log, log_every=log_every)
    ae.set_latent_stats(frames)
    held_seed = heldout_seed(seed)
    held = render_clips(VideoClipDataset(heldout_size, held_seed, clip_frames, size, switch_prob=0.3,
                                         style=VIDEO_DATA_STYLE))[0]
    recon = heldout_recon(ae, held.flatten(0, 1))
    log(f"video-ae held-out reconstruction MSE {recon['mse']:.5f} (PSNR {recon['psnr_db']:.1f} dB)")
    record = {
        "recipe": "video-ae", "seed": seed, "steps": steps, "config": json_config(ae),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "clip_frames": clip_frames,
                  "clips": clips, "data_style": VIDEO_DATA_STYLE, "optimizer": "Adam",
                  "schedule": f"linear warmup {warmup} steps, cosine to 10%"},
        "final_loss": final_loss, "heldout_recon_mse": recon["mse"], "heldout_psnr_db": recon["psnr_db"],
        "heldout": {"clips": heldout_size, "frames": heldout_size * clip_frames, "seed": held_seed},
        "latent_mean": ae.latent_mean.tolist(), "latent_std": ae.latent_std.tolist(),
        "wall_time_s": time.perf_counter() - start,
        # this process's CPU seconds: the wall time the run takes alone on one thread
        "cpu_time_s": time.process_time() - cpu_start,
    }
    save_atomically(ae, out, record)
    return record


# -- the video transformer ---------------------------------------------------------------------
# the strengths a self-rollout's chunks start from (TwoStreamLoss): drawn from U(low, high)
ROLLOUT_STRENGTH = (0.3, 0.8)
# the precisions of the loss's forward passes (TwoStreamLoss's ``autocast``)
AUTOCAST = ("fp32", "bf16")


def schedule_texts(prompt: torch.Tensor) -> list[tuple[int, list[str]]]:
    """A stream schedule ``[(start frame, texts), ...]`` (``StreamingVideoPipeline.stream``'s
    ``prompts``) from per-frame prompt ids (B, N, 3): an entry wherever some clip's prompt
    changes."""
    changed = (prompt[:, 1:] != prompt[:, :-1]).any(-1).any(0)  # (N - 1,)
    starts = [0] + [int(f) + 1 for f in changed.nonzero().flatten()]
    return [(f, [VideoPrompt(*map(int, row)).text for row in prompt[:, f]]) for f in starts]


@torch.no_grad()
def self_rollout(pipe, latents: torch.Tensor, prompt: torch.Tensor, window_frames: int, strength: float,
                 seed: int, guidance_scale: float | None = None,
                 num_inference_steps: int | None = None) -> torch.Tensor:
    """The model's own stream over a training batch, anchored to its clips: ``pipe.stream`` (the
    rolling ``SinkWindowCache``, the clean commit pass, LongLive's re-cache at every prompt change,
    CFG: the inference code itself) with ``video_latents=latents`` at ``strength`` (each chunk
    starts from the clip's chunk noised to that step's sigma and is denoised by the model from
    there), the window ``window_frames``, prompts from the per-frame ids (B, N, 3)
    (``schedule_texts``), noise from ``torch.Generator().manual_seed(seed)``. Returns the clean
    latents (B, N, C, h, w) the stream committed."""
    chunks = pipe.stream(prompts=schedule_texts(prompt), num_frames=latents.shape[1], video_latents=latents,
                         strength=strength, window_frames=window_frames, guidance_scale=guidance_scale,
                         num_inference_steps=num_inference_steps, generator=torch.Generator().manual_seed(seed),
                         output_type="latent")
    return torch.cat([chunk.latents for chunk in chunks], 1)


def flow_mix(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Rectified flow's ``x_t = (1 - t) x0 + t noise`` for latents (B, F, C, h, w) at per-frame
    times ``t`` (B, F): the model's training input at time t (its target is ``noise - x0``)."""
    t = t[..., None, None, None]
    return (1 - t) * x0 + t * noise


class TwoStreamLoss:
    """The video DiT's training loss on a batch ``(latents (B, N, C, h, w), prompt ids (B, N, 3),
    switch frames (B,))``: flow matching on the query stream of the two-stream plan.

    The context stream (what the query chunks attend to, labelled t = 0 as committed frames are)
    is, per step, one of:

    - a *self-rollout* (probability ``rollout_prob``; needs ``pipe``): the model's own stream over
      the batch through the inference code (``self_rollout``: rolling cache with this step's
      window, so frames are evicted inside the clip, re-cache at the clips' prompt switches, the
      pipeline's default steps and guidance), anchored to the clips by starting each chunk from
      the clip's chunk at a strength drawn from U(``rollout_strength``). This is the CPU-sized
      stand-in for Self-Forcing's training on its own rollouts (Huang et al., 2025): Self-Forcing
      scores the rollout with distribution matching (DMD); here the loss stays flow matching on
      the *true* next chunks given the self-generated context, which the anchoring keeps
      consistent with them (the object is where the clip has it, drawn by the model with its own
      errors), so the model learns to continue, and to correct, its own outputs;
    - the model's one-step predictions of x0 from the query stream at t ~ U(0.1, 0.6)
      (probability ``self_context_prob``, when no rollout);
    - else the clean latents, per clip noised to t ~ U(0, ``context_noise``) with probability
      ``noisy_context_prob`` (diffusion forcing's noisy context).

    With probability ``first_chunk_prob`` a step has no context at all: every clip is cut into
    its chunks and each chunk is trained as a stream's *first* chunk (alone, at positions ``0 ..
    chunk_frames - 1``, exactly what a stream's first chunk is denoised with), under its own
    prompt. The two-stream steps train drawing from nothing only on a clip's first chunk (one in
    ``num_frames / chunk_frames``) and mostly teach continuing visible frames; the first chunk
    is the sink every later chunk of a stream reads, so how well it is drawn lasts the stream.

    Args:
        window_choices: window sizes (frames) drawn uniformly per step.
        pipe: a ``StreamingVideoPipeline`` around the model being trained (for rollouts).
        first_chunk_prob: probability of a first-chunk step (above).
        autocast: ``"fp32"``, or ``"bf16"``: the loss's own forward passes (the one-step context
            predictions and the two-stream pass) under bfloat16 autocast on the batch's device, the error in
            float32 (weights, gradients and optimizer state stay float32); a self-rollout is the
            inference code and runs in float32 either way.
    """

    def __init__(self, model: VideoDiTModel, num_frames: int, window_choices: list[int], generator: torch.Generator,
                 noisy_context_prob: float = 0.3, context_noise: float = 0.2, self_context_prob: float = 0.25,
                 rollout_prob: float = 0.0, rollout_strength: tuple[float, float] = ROLLOUT_STRENGTH, pipe=None,
                 autocast: str = "fp32", first_chunk_prob: float = 0.0):
        cfg = model.config
        check(autocast in AUTOCAST, "autocast", f"one of {', '.join(AUTOCAST)}", autocast)
        self.autocast = autocast
        for name, value in (("noisy_context_prob", noisy_context_prob), ("context_noise", context_noise),
                            ("self_context_prob", self_context_prob), ("rollout_prob", rollout_prob),
                            ("first_chunk_prob", first_chunk_prob)):
            check(isinstance(value, (int, float)) and 0 <= value <= 1, name, "a number in [0, 1]", value)
        lo, hi = rollout_strength
        check(0 < lo <= hi <= 1, "rollout_strength", "(low, high) with 0 < low <= high <= 1", rollout_strength)
        check(rollout_prob == 0 or pipe is not None, "pipe", "a StreamingVideoPipeline when rollout_prob > 0", pipe)
        self.C, self.N, self.P = cfg.chunk_frames, num_frames, model.tokens_per_frame
        self.plans = {w: ChunkPlan.two_stream(num_frames, self.C, self.P, cfg.sink_frames, w) for w in window_choices}
        self.windows = list(window_choices)
        self.generator = generator
        self.noisy_context_prob, self.context_noise, self.self_context_prob = (noisy_context_prob, context_noise,
                                                                               self_context_prob)
        self.rollout_prob, self.rollout_strength, self.pipe = rollout_prob, (float(lo), float(hi)), pipe
        self.first_chunk_prob = first_chunk_prob
        self.last_rollout: dict | None = None  # the knobs of the last step's rollout (None: it had none)
        self.last_first_chunks = False  # whether the last step was a first-chunk step

    def _precision(self, like: torch.Tensor):
        return torch.autocast(like.device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16")

    def per_chunk(self, values: torch.Tensor) -> torch.Tensor:
        return values.repeat_interleave(self.C, dim=1)  # (B, chunks) -> (B, N)

    def __call__(self, model: VideoDiTModel, batch) -> dict:
        x0, prompt, switch = batch
        B, N = x0.shape[:2]
        g = self.generator
        rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
        randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        self.last_rollout = None
        # drawn only when on: at 0 a step makes the two-stream step's draws alone
        self.last_first_chunks = self.first_chunk_prob > 0 and float(rand(1)) < self.first_chunk_prob
        if self.last_first_chunks:
            return self._first_chunks(model, x0, prompt)
        window = self.windows[int(torch.randint(len(self.windows), (1,), generator=g))]
        plan = self.plans[window]
        rolled = self.rollout_prob > 0 and float(rand(1)) < self.rollout_prob
        if rolled:  # before the prompts are changed below: the stream sees the clips' own schedules
            lo, hi = self.rollout_strength
            strength = lo + (hi - lo) * float(rand(1))
            seed = int(torch.randint(2**62, (1,), generator=g))
            self.last_rollout = dict(window=window, strength=strength, seed=seed)
            rollout_context = self_rollout(self.pipe, x0, prompt, window, strength, seed)
        # a switched clip carries the new prompt everywhere and learns from the switch on
        prompt = torch.where((switch >= 0)[:, None, None], prompt[:, -1:].expand_as(prompt), prompt)
        prompt = model.drop_prompts(prompt, g)
        frame = torch.arange(N)
        weight = (frame[None, :] >= switch.clamp(min=0)[:, None]).float()  # (B, N)

        # context stream: clean, or noised to a small t
        noisy = rand(B) < self.noisy_context_prob
        t_ctx = torch.where(noisy[:, None], self.per_chunk(rand(B, N // self.C)) * self.context_noise, 0.0)
        context = flow_mix(x0, t_ctx, randn(x0.shape))
        if rolled:
            context, t_ctx = rollout_context, torch.zeros(B, N)
        elif float(rand(1)) < self.self_context_prob:  # the model's own one-step predictions
            t_s = self.per_chunk(0.1 + 0.5 * rand(B, N // self.C))
            x_s = flow_mix(x0, t_s, randn(x0.shape))
            with torch.no_grad(), self._precision(x0):
                v = model(torch.cat([x0, x_s], 1), torch.cat([torch.zeros(B, N), t_s], 1),
                          torch.cat([prompt, prompt], 1), plan=plan)[:, N:].float()
            context, t_ctx = x_s - t_s[..., None, None, None] * v, torch.zeros(B, N)

        # query stream: every chunk at its own t
        t_q = self.per_chunk(rand(B, N // self.C))
        noise = randn(x0.shape)
        x_q = flow_mix(x0, t_q, noise)
        with self._precision(x0):
            v = model(torch.cat([context, x_q], 1), torch.cat([t_ctx, t_q], 1), torch.cat([prompt, prompt], 1),
                      plan=plan)[:, N:].float()
        err = (v - (noise - x0)).pow(2).mean(dim=(2, 3, 4))  # (B, N)
        return {"loss": (err * weight).sum() / weight.sum()}

    def _first_chunks(self, model: VideoDiTModel, x0: torch.Tensor, prompt: torch.Tensor) -> dict:
        """A first-chunk step: the (B, N) clips as (B * N / C, C) chunk-long clips, each flow-
        matched alone (no plan, no cache: one chunk at positions 0 .. C - 1) under its own
        per-frame prompts (a chunk never straddles a switch: switches fall on chunk boundaries)."""
        B, N = x0.shape[:2]
        C, g = self.C, self.generator
        x0 = x0.reshape(B * N // C, C, *x0.shape[2:])
        prompt = model.drop_prompts(prompt.reshape(B * N // C, C, prompt.shape[-1]), g)
        t = torch.rand(B * N // C, generator=g)[:, None].expand(-1, C)
        noise = torch.randn(x0.shape, generator=g)
        x_t = flow_mix(x0, t, noise)
        with self._precision(x0):
            v = model(x_t, t, prompt).float()
        return {"loss": (v - (noise - x0)).pow(2).mean()}


@torch.no_grad()
def heldout_loss(model: VideoDiTModel, latents: torch.Tensor, prompts: torch.Tensor, seed: int,
                 batch_size: int = 16) -> float:
    """Flow-matching loss on held-out clips (no switches): clean context, the full trained window,
    each chunk at t from a generator seeded with ``seed``, in eval mode."""
    model.eval()
    cfg = model.config
    N = latents.shape[1]
    plan = ChunkPlan.two_stream(N, cfg.chunk_frames, model.tokens_per_frame, cfg.sink_frames, cfg.window_frames)
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for x0, p in zip(latents.split(batch_size), prompts.split(batch_size)):
        B = len(x0)
        t = torch.rand(B, N // cfg.chunk_frames, generator=g).repeat_interleave(cfg.chunk_frames, 1)
        noise = torch.randn(x0.shape, generator=g)
        x_t = flow_mix(x0, t, noise)
        v = model(torch.cat([x0, x_t], 1), torch.cat([torch.zeros(B, N), t], 1), p, plan=plan)
        total += (v[:, N:] - (noise - x0)).pow(2).mean().item() * B
    return total / len(latents)


@torch.no_grad()
def rollout(model: VideoDiTModel, ae: FrameAutoencoder, schedules: list[list[tuple[int, VideoPrompt]]],
            num_frames: int, generator: torch.Generator, guidance_scale: float | None = None,
            steps: int | None = None, recache_sink: bool = True) -> torch.Tensor:
    """The recipe's evaluation sampler: one stream per prompt schedule through the streaming
    pipeline's loop (``StreamingVideoPipeline.stream``, rolling cache; the one sampler of the video
    model), decoded to frames (B, F, 3, H, W) in [-1, 1].

    A schedule's later prompts start at chunk boundaries; at every frame where some stream switches,
    the cached K/V of all streams are recomputed under their prompts from the kept clean latents
    (LongLive's re-cache; with ``recache_sink`` the sink too, as the model was trained, else the sink
    keeps the old prompt's K/V)."""
    from ...pipelines.video import StreamingVideoPipeline

    model.eval()
    ae.eval()
    C = model.config.chunk_frames
    check(num_frames % C == 0, "num_frames", f"a multiple of chunk_frames ({C})", num_frames)
    starts = sorted({start for schedule in schedules for start, _ in schedule})
    prompts = [(start, [prompt_at(schedule, start).text for schedule in schedules]) for start in starts]
    pipe = StreamingVideoPipeline(vae=ae, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    chunks = pipe.stream(prompts=prompts, num_frames=num_frames, generator=generator, guidance_scale=guidance_scale,
                         num_inference_steps=steps, recache_sink=recache_sink, output_type="latent")
    z = torch.cat([chunk.latents for chunk in chunks], 1)  # (B, F, C, h, w)
    return ae.decode(z.flatten(0, 1)).clamp(-1, 1).unflatten(0, (len(schedules), num_frames))


def rollout_metrics(frames: torch.Tensor, schedules) -> dict:
    """Per frame colour accuracy and per step direction accuracy of generated clips, measured from
    pixels (``frame_colour``, ``pixel_centroid``, ``motion_direction``) against the schedules."""
    B, Fr = frames.shape[:2]
    want = torch.tensor([[prompt_at(s, f).ids for f in range(Fr)] for s in schedules])  # (B, F, 3)
    colour_ok = frame_colour(frames) == want[..., 0]
    rows = []
    for b in range(B):
        centroids = pixel_centroid(frames[b], want[b, :, 0])  # (F, 2), NaN where the colour is absent
        seen = ~centroids.isnan().any(-1)
        rows.append((motion_direction(centroids) == want[b, 1:, 2]) & seen[1:] & seen[:-1])
    direction_ok = torch.stack(rows)
    return {"colour_acc": colour_ok.float().mean().item(), "direction_acc": direction_ok.float().mean().item(),
            "colour_ok": colour_ok, "direction_ok": direction_ok}


def save_strip(frames: torch.Tensor, path: Path, every: int = 1, scale: int = 2) -> None:
    """A PNG of clips (B, F, 3, H, W): one row per clip, every ``every``-th frame."""
    from PIL import Image

    rows = torch.cat([torch.cat(list(clip[::every]), -1) for clip in frames], -2)  # (3, B*H, F'*W)
    img = ((rows + 1) / 2 * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
    image = Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST)
    with atomic_path(path) as tmp:
        image.save(tmp)


def eval_schedules(n: int, clip_frames: int, chunk: int) -> list[list[tuple[int, VideoPrompt]]]:
    """``n`` fixed evaluation schedules: prompts spread over the 64, every third one switching its
    colour (odd) or direction (even) at the chunk boundary nearest the middle."""
    schedules = []
    mid = (clip_frames // 2) // chunk * chunk
    for i in range(n):
        p = VideoPrompt.from_index((i * 23) % 64)
        if i % 3 == 2:
            ids = list(p.ids)
            field = 0 if i % 2 else 2
            ids[field] = (ids[field] + 1) % 4
            schedules.append([(0, p), (mid, VideoPrompt(*ids))])
        else:
            schedules.append([(0, p)])
    return schedules


def train_video(out_dir: str | Path, *, ae_dir: str | Path, steps: int, batch_size: int, lr: float, seed: int = 0,
                dataset_size: int, clip_frames: int = 18, heldout_size: int = 32, model_config: dict | None = None,
                switch_prob: float = 0.25, eval_frames: int = 48, eval_clips: int = 12, log_every: int = 50,
                warmup: int = 100, rollout_prob: float = 0.0, rollout_strength: tuple[float, float] = ROLLOUT_STRENGTH,
                autocast: str = "fp32", first_chunk_prob: float = 0.0, ema_decay: float | None = None,
                log: Callable[[str], None] = print) -> dict:
    """Train a ``VideoDiTModel`` with AdamW on ``VideoClipDataset(dataset_size, seed, clip_frames,
    switch_prob=switch_prob, style=VIDEO_DATA_STYLE)`` encoded once by the autoencoder in
    ``ae_dir``, with the two-stream loss (``TwoStreamLoss``; module docstring; ``rollout_prob``
    and ``rollout_strength``: its self-rollouts through the streaming pipeline; ``autocast``: the
    precision of its forward passes; ``first_chunk_prob``: its steps that train every chunk as a
    stream's first; ``ema_decay``: when set, the weights saved, measured and sampled are an ``EMA``
    of the trained ones, whose held-out loss is recorded as ``heldout_loss_raw``), and save it to
    ``out_dir`` (fp16 safetensors, atomically) with ``train_log.json`` and ``samples.png`` (``eval_clips`` streams of
    ``eval_frames`` frames, every other frame; every third stream switches its prompt mid-way).

    The record: ``recipe``, ``seed``, ``steps``, ``config``, ``train``, ``ae_dir``, ``final_loss``,
    ``heldout_loss`` (``heldout_size`` clips of a held-out seed), ``rollout`` (colour and direction
    accuracy of the sample streams, measured from pixels), ``heldout``, ``wall_time_s``.
    Other ``VideoDiTModel`` arguments default to ``DEFAULT_VIDEO_CONFIG``, overridden by
    ``model_config``. Deterministic for a seed and a thread count."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                         heldout_size=heldout_size, log_every=log_every, log=log, warmup=warmup)
    ae_path = check_checkpoint_dir(ae_dir, "ae_dir", "a folder saved by FrameAutoencoder (e.g. by train_video_ae)")
    model_config = dict(model_config or {})
    check(not set(model_config) & set(_DERIVED), "model_config",
          f"free of {', '.join(_DERIVED)} (they come from the autoencoder and the dataset)", model_config)
    config = {**DEFAULT_VIDEO_CONFIG, **model_config}
    C = config["chunk_frames"]
    check(is_int(clip_frames) and clip_frames % C == 0 and clip_frames > config["sink_frames"] + config["window_frames"],
          "clip_frames", f"a multiple of chunk_frames ({C}) longer than sink_frames + window_frames (so clips roll)",
          clip_frames)
    check(isinstance(switch_prob, (int, float)) and 0 <= switch_prob <= 1, "switch_prob", "a number in [0, 1]",
          switch_prob)
    check(is_int(eval_frames) and eval_frames >= C and eval_frames % C == 0, "eval_frames",
          f"a positive multiple of {C}", eval_frames)
    check_int(eval_clips, "eval_clips", 1)
    check(autocast in AUTOCAST, "autocast", f"one of {', '.join(AUTOCAST)}", autocast)
    check(ema_decay is None or (isinstance(ema_decay, float) and 0 < ema_decay < 1), "ema_decay",
          "None or a float in (0, 1)", ema_decay)

    accelerator = new_accelerator("train_video")
    start, cpu_start = time.perf_counter(), time.process_time()
    ae = load_checkpoint(FrameAutoencoder, ae_path)
    size = ae.config.sample_size
    frames, prompts, switches = render_clips(VideoClipDataset(dataset_size, seed, clip_frames, size,
                                                              switch_prob=switch_prob, switch_multiple=C,
                                                              style=VIDEO_DATA_STYLE))
    latents = encode_clips(ae, frames)
    del frames
    held_seed = heldout_seed(seed)
    held_frames, held_prompts, _ = render_clips(VideoClipDataset(heldout_size, held_seed, clip_frames, size,
                                                                 style=VIDEO_DATA_STYLE))
    held_latents = encode_clips(ae, held_frames)
    del held_frames
    log(f"video rendered and encoded {dataset_size} + {heldout_size} clips of {clip_frames} frames "
        f"in {time.perf_counter() - start:.0f}s")

    torch.manual_seed(seed)
    model = VideoDiTModel(**config, latent_channels=ae.config.latent_channels, latent_size=ae.latent_size,
                          prompt_vocab={k: list(v) for k, v in PROMPT_VOCAB.items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    windows = list(range(C, config["window_frames"] + 1, C))
    from ...pipelines.video import StreamingVideoPipeline

    pipe = StreamingVideoPipeline(vae=ae, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    loss = TwoStreamLoss(model, clip_frames, windows, torch.Generator().manual_seed(seed + 1),
                         rollout_prob=rollout_prob, rollout_strength=tuple(rollout_strength), pipe=pipe,
                         autocast=autocast, first_chunk_prob=first_chunk_prob)
    batches = ((latents[idx], prompts[idx], switches[idx])
               for idx in batch_indices(dataset_size, batch_size, steps, order))
    ema = EMA(model, ema_decay) if ema_decay is not None else None
    final_loss = train_loop(model, optimizer, batches, loss, steps=steps, accelerator=accelerator, schedule=schedule,
                            grad_clip=1.0, name="video", log=log, log_every=log_every,
                            on_step=None if ema is None else lambda step: ema.update(model),
                            state={"loss": loss.generator, **({} if ema is None else {"ema": ema})})
    train_time = time.perf_counter() - start

    held_raw = None
    if ema is not None:  # the saved, measured and sampled weights are the averages
        held_raw = heldout_loss(model, held_latents, held_prompts[:, 0], held_seed)
        ema.copy_to(model)
    held = heldout_loss(model, held_latents, held_prompts[:, 0], held_seed)
    schedules = eval_schedules(eval_clips, eval_frames, C)
    samples = rollout(model, ae, schedules, eval_frames, torch.Generator().manual_seed(seed))
    metrics = rollout_metrics(samples, schedules)
    log(f"video held-out loss {held:.4f}; {eval_clips} rollouts of {eval_frames} frames: colour accuracy "
        f"{metrics['colour_acc']:.3f}, direction accuracy {metrics['direction_acc']:.3f}")
    record = {
        "recipe": "video", "seed": seed, "steps": steps, "config": json_config(model),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "clip_frames": clip_frames,
                  "data_style": VIDEO_DATA_STYLE, "switch_prob": switch_prob, "windows": windows,
                  "optimizer": "AdamW", "betas": [0.9, 0.95],
                  "weight_decay": 0.01, "grad_clip": 1.0, "schedule": f"linear warmup {warmup} steps, cosine to 10%",
                  "noisy_context_prob": loss.noisy_context_prob, "context_noise": loss.context_noise,
                  "self_context_prob": loss.self_context_prob, "rollout_prob": loss.rollout_prob,
                  "rollout_strength": list(loss.rollout_strength), "autocast": autocast,
                  "first_chunk_prob": loss.first_chunk_prob, "ema_decay": ema_decay, "train_time_s": train_time},
        "ae_dir": str(ae_path.resolve()), "final_loss": final_loss, "heldout_loss": held,
        **({} if held_raw is None else {"heldout_loss_raw": held_raw}),
        "rollout": {"clips": eval_clips, "frames": eval_frames, "colour_acc": metrics["colour_acc"],
                    "direction_acc": metrics["direction_acc"], "schedules": [[(s, p.text) for s, p in sch]
                                                                              for sch in schedules]},
        "heldout": {"clips": heldout_size, "seed": held_seed},
        "wall_time_s": time.perf_counter() - start,
        # this process's CPU seconds: the wall time the run takes alone on one thread
        "cpu_time_s": time.process_time() - cpu_start,
    }
    save_atomically(model, out, record, extra=lambda folder: save_strip(samples, folder / SAMPLES_PNG, every=2))
    return record
