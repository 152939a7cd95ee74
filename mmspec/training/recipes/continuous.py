"""Continuous-token recipes: the continuous tokenizer (a learned conv autoencoder, or PCA of
patches), the continuous AR target (backbone + mixture head + diffusion head, MAR's joint loss) and
its small draft, optionally distilled to the target.

``train_continuous_tokenizer`` trains the conv tokenizer in minutes (or fits PCA in seconds).
``train_continuous_ar`` and ``train_continuous_draft`` train ``ContinuousARModel`` on ``ShapesDataset(style=AR_DATA_STYLE)`` latents
on the shared ``train_loop``. The draft's acceptance booster (``distill > 0``; not in the papers):
the frozen target teaches the draft on the same teacher-forced inputs, (i) the mixture head by the
cross-entropy of target-mixture samples (a Monte-Carlo forward KL(p_target || q_draft) up to the
target's entropy), raising the ``sd`` rule's acceptance ``1 - TV(p, q)``, and (ii) the diffusion
head by epsilon matching at the target's noised inputs (the D of the path rule's acceptance is a
weighted epsilon distance), raising ``path``'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional as F

from ...core.errors import check, check_choice, check_int
from ...models import load_checkpoint
from ...models.continuous import ContinuousARModel
from ...models.continuous_tokenizer import ConvTokenizer, PatchPCATokenizer
from ..data import CLASS_NAMES, CLASS_PROMPTS, NUM_CLASSES, ShapesDataset
from ..loop import new_accelerator, train_loop
from .ar_image import AR_DATA_STYLE
from .video import fit_autoencoder
from .common import (batch_indices, check_checkpoint_dir, check_out_dir, check_run_args, heldout_seed, json_config,
                     save_atomically, stack, warmup_cosine)

Tokenizer = ConvTokenizer | PatchPCATokenizer

__all__ = ["TOKENIZER_KINDS", "DEFAULT_DRAFT_CONFIG", "DEFAULT_TARGET_CONFIG", "encode_dataset", "train_continuous_ar",
           "train_continuous_draft", "train_continuous_tokenizer"]

# The sampling chain: MAR's 20-step respacing of the 1,000-step cosine schedule without its first
# step, t = 999, where alphas_cumprod is 2.4e-9 (beta clipped at 0.999). That step scales epsilon
# differences by ~1/sqrt(alphas_cumprod): measured on a 15-step-trained target/draft pair, its mean
# log P/Q was -1.4e6 (every other step between -0.2 and -8), so the lossless path rule could accept
# nothing. The chain starts at t = 946 from N(0, I) instead (q(x_946 | x_0) = N(0.08 x_0, 0.993 I)).
# Training is unaffected (all 1,000 steps); only sampling reads this.
SAMPLING_TIMESTEPS = [0, 53, 105, 158, 210, 263, 315, 368, 421, 473, 526, 578, 631, 684, 736, 789, 841, 894, 946]
# the spec's backbone sizes (specs/continuous_tokens.md section 4) with 16 mixture components (the
# spec's 8 at 4x4 patches gave no objects; see the README's continuous-token section)
DEFAULT_TARGET_CONFIG = dict(dim=128, n_layers=4, n_heads=4, mlp_hidden=344, class_dropout_prob=0.1,
                             mixture_components=16, mixture_hidden=128, diffusion_width=128, diffusion_blocks=3,
                             diffusion_timesteps=SAMPLING_TIMESTEPS)
DEFAULT_DRAFT_CONFIG = dict(dim=64, n_layers=2, n_heads=4, mlp_hidden=172, class_dropout_prob=0.1,
                            mixture_components=16, mixture_hidden=64, diffusion_width=96, diffusion_blocks=2,
                            diffusion_timesteps=SAMPLING_TIMESTEPS)
# fixed by the tokenizer and the dataset (and, for a draft, by its target), not by model_config
_DERIVED = ("token_dim", "grid_size", "num_classes", "id2label")
_SHARED_WITH_TARGET = ("diffusion_train_steps", "diffusion_sampling_steps", "diffusion_timesteps")


# ---------------------------------------------------------------------------------- tokenizer

@torch.no_grad()
def recon_accuracy(classifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    from ...eval.quality import class_accuracy

    return class_accuracy(classifier, images.clamp(-1, 1), labels)


TOKENIZER_KINDS = ("conv", "pca")


def train_continuous_tokenizer(out_dir: str | Path, *, kind: str = "conv", dataset_size: int = 2000, seed: int = 0,
                               heldout_size: int = 256, latent_dim: int | None = None, patch_size: int = 8,
                               steps: int = 1500, batch_size: int = 32, lr: float = 2e-3, latent_noise: float = 0.2,
                               classifier_dir: str | Path | None = None, log_every: int = 100,
                               log: Callable[[str], None] = print) -> dict:
    """Build a continuous tokenizer on ``ShapesDataset(dataset_size, seed, style=AR_DATA_STYLE)`` and
    save it to ``out_dir`` (fp16 safetensors, atomically) with ``train_log.json``, whose dict is
    returned.

    ``kind="conv"`` (default) trains a ``ConvTokenizer`` (``patch_size`` a power of two: one
    stride-2 level per factor of 2, widths 32, 64, 64, ...; ``latent_dim`` channels, default 8)
    for ``steps`` Adam steps of ``batch_size`` at ``lr`` (warm-up, cosine) with ``latent_noise``
    on its latents before decoding, then measures its latent statistics on the training images.
    ``kind="pca"`` fits a ``PatchPCATokenizer`` in closed form (``latent_dim`` default 16; the
    step arguments are unused).

    The record: ``recipe``, ``kind``, ``seed``, ``config``, ``train``, ``heldout_recon_mse`` (of
    the saved fp16 tokenizer, on ``heldout_size`` held-out images), ``latent_std`` (held-out),
    ``classifier_dir`` with ``classifier_accuracy`` on the originals, ``recon_accuracy`` on the
    reconstructions and ``noisy_recon_accuracy`` on decodes of the held-out latents plus N(0, 0.3^2)
    noise (how gracefully the decoder takes a sampler's errors; None without ``classifier_dir``),
    ``wall_time_s``."""
    out = check_out_dir(out_dir)
    check_choice("kind", kind, TOKENIZER_KINDS)
    for name, value, low in (("dataset_size", dataset_size, 1), ("seed", seed, 0), ("heldout_size", heldout_size, 1),
                             ("steps", steps, 1), ("batch_size", batch_size, 1), ("patch_size", patch_size, 1),
                             ("log_every", log_every, 1)):
        check_int(value, name, low)
    check_int(latent_dim, "latent_dim", 1, optional=True)
    check(kind == "pca" or patch_size & (patch_size - 1) == 0 and patch_size >= 2, "patch_size",
          "a power of two >= 2 with kind='conv'", patch_size)
    check(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0, "lr", "a number > 0", lr)
    check(isinstance(latent_noise, (int, float)) and not isinstance(latent_noise, bool) and latent_noise >= 0,
          "latent_noise", "a number >= 0", latent_noise)
    check(callable(log), "log", "a callable taking one str (e.g. print)", log)
    classifier = None
    if classifier_dir is not None:
        from ...models.classifier import ShapesClassifier

        path = check_checkpoint_dir(classifier_dir, "classifier_dir", "a folder saved by 'mmspec train classifier'")
        classifier = load_checkpoint(ShapesClassifier, path)
    start = time.perf_counter()
    images, _ = stack(ShapesDataset(dataset_size, seed, 64, style=AR_DATA_STYLE))
    if kind == "pca":
        tokenizer = PatchPCATokenizer(patch_size=patch_size, latent_dim=latent_dim or 16)
        tokenizer.fit(images)
        train = {"dataset_size": dataset_size, "data_style": AR_DATA_STYLE, "method": "SVD of centred patches"}
    else:
        levels = patch_size.bit_length() - 1
        torch.manual_seed(seed)
        tokenizer = ConvTokenizer(latent_channels=latent_dim or 8, channels=[32] + [64] * (levels - 1),
                                  stem_channels=16, sample_size=64, latent_noise=latent_noise)
        fit_autoencoder(tokenizer, images, steps=steps, batch_size=batch_size, lr=lr, seed=seed, warmup=50,
                        accelerator=new_accelerator("continuous-tokenizer"), name="continuous-tokenizer", log=log,
                        log_every=log_every)
        train = {"dataset_size": dataset_size, "data_style": AR_DATA_STYLE, "steps": steps, "batch_size": batch_size,
                 "lr": lr, "optimizer": "Adam", "schedule": "linear warmup 50 steps, cosine to 10%"}
    with torch.no_grad():  # report what ships: fp16 weights (the latent statistics from them)
        for p in tokenizer.parameters():
            p.copy_(p.half().float())
        if kind == "conv":
            tokenizer.set_latent_stats(images)
            for b in tokenizer.buffers():
                b.copy_(b.half().float())
    del images
    held_seed = heldout_seed(seed)
    held, held_labels = stack(ShapesDataset(heldout_size, held_seed, 64, style=AR_DATA_STYLE))
    with torch.no_grad():
        latents = tokenizer.encode(held)
        recon = tokenizer.decode(latents)
        mse = F.mse_loss(recon, held).item()
        latent_std = latents.std().item()
        noisy = tokenizer.decode(latents + 0.3 * torch.randn(latents.shape, generator=torch.Generator().manual_seed(
            held_seed)))
    acc = acc_recon = acc_noisy = None
    if classifier is not None:
        acc, acc_recon = recon_accuracy(classifier, held, held_labels), recon_accuracy(classifier, recon, held_labels)
        acc_noisy = recon_accuracy(classifier, noisy, held_labels)
    log(f"continuous-tokenizer ({kind}) held-out reconstruction MSE {mse:.5f}, latent std {latent_std:.3f}"
        + ("" if acc is None else f", classifier accuracy {acc_recon:.3f} on reconstructions ({acc:.3f} on "
                                  f"originals, {acc_noisy:.3f} with latent noise 0.3)"))
    record = {
        "recipe": "continuous-tokenizer", "kind": kind, "seed": seed, "config": json_config(tokenizer),
        "train": train, "heldout_recon_mse": mse, "latent_std": latent_std,
        "heldout": {"size": heldout_size, "seed": held_seed},
        "classifier_dir": None if classifier_dir is None else str(Path(classifier_dir).resolve()),
        "classifier_accuracy": acc, "recon_accuracy": acc_recon, "noisy_recon_accuracy": acc_noisy,
        "torch_threads": torch.get_num_threads(), "wall_time_s": time.perf_counter() - start,
    }
    save_atomically(tokenizer, out, record)
    return record


# ---------------------------------------------------------------------------------- AR models

@torch.no_grad()
def encode_dataset(tokenizer: Tokenizer, size: int, seed: int, style: str = AR_DATA_STYLE,
                   chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``ShapesDataset(size, seed, style=style)`` as (labels (N,), latents (N, T, d) float32),
    rendered and encoded ``chunk`` images at a time (memory holds latents, not pixels)."""
    data = ShapesDataset(size, seed, tokenizer.config.sample_size, style=style)
    labels, latents = [], []
    for s in range(0, size, chunk):
        images, y = stack(torch.utils.data.Subset(data, range(s, min(s + chunk, size))))
        labels.append(y)
        latents.append(tokenizer.encode(images).float())
    return torch.cat(labels), torch.cat(latents)


@torch.no_grad()
def heldout_losses(model: ContinuousARModel, labels: torch.Tensor, latents: torch.Tensor, seed: int,
                   batch_size: int = 64) -> dict[str, float]:
    """Mean held-out ``loss`` parts in eval mode (labels kept; diffusion timesteps and positions
    from a generator seeded with ``seed``)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    totals: dict[str, float] = {}
    for y, x in zip(labels.split(batch_size), latents.split(batch_size)):
        for k, v in model.loss(y, x, generator=g).items():
            totals[k] = totals.get(k, 0.0) + v.item() * len(y)
    return {k: v / len(labels) for k, v in totals.items()}


def _load_tokenizer(tokenizer_dir) -> tuple[Path, Tokenizer]:
    path = check_checkpoint_dir(tokenizer_dir, "tokenizer_dir",
                                "a folder saved by 'mmspec train continuous-tokenizer'")
    name = json.loads((path / "config.json").read_text()).get("_class_name")
    classes = {c.__name__: c for c in (ConvTokenizer, PatchPCATokenizer)}
    check(name in classes, "tokenizer_dir", f"a folder holding a {' or a '.join(classes)} (config.json's _class_name)",
          f"{tokenizer_dir} ({name})")
    return path, load_checkpoint(classes[name], path)


def _model_config(tokenizer: Tokenizer, defaults: dict, model_config: dict | None) -> dict:
    model_config = dict(model_config or {})
    check(not set(model_config) & set(_DERIVED), "model_config",
          f"free of {', '.join(_DERIVED)} (they come from the tokenizer and the dataset)", model_config)
    return {**defaults, **model_config, "token_dim": tokenizer.token_dim, "grid_size": tokenizer.grid_size,
            "num_classes": NUM_CLASSES,
            "id2label": {str(i): f"{p}, {n}" for i, (p, n) in enumerate(zip(CLASS_PROMPTS, CLASS_NAMES))}}


def _train(kind: str, out: Path, model: ContinuousARModel, loss, *, tokenizer_path: Path, labels, latents, held,
           steps, batch_size, lr, seed, dataset_size, heldout_size, held_seed, warmup, log_every, log, start,
           extra: dict, state: dict | None = None) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.02)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, steps=steps))
    order = torch.Generator().manual_seed(seed)
    batches = ((labels[idx], latents[idx]) for idx in batch_indices(dataset_size, batch_size, steps, order))
    train_start = time.perf_counter()
    final = train_loop(model, optimizer, batches, loss, steps=steps, accelerator=new_accelerator(kind),
                       schedule=schedule, grad_clip=1.0, name=kind, log=log, log_every=log_every, state=state)
    train_s = time.perf_counter() - train_start
    held_losses = heldout_losses(model, *held, seed=held_seed)
    log(f"{kind} held-out " + "  ".join(f"{k} {v:.4f}" for k, v in held_losses.items()) + f" ({heldout_size} images)")
    record = {
        "recipe": kind, "seed": seed, "steps": steps, "config": json_config(model),
        "train": {"batch_size": batch_size, "lr": lr, "dataset_size": dataset_size, "data_style": AR_DATA_STYLE,
                  "optimizer": "AdamW", "betas": [0.9, 0.95], "weight_decay": 0.02, "grad_clip": 1.0,
                  "schedule": f"linear warmup {warmup} steps, cosine to 10%", **extra},
        "tokenizer_dir": str(tokenizer_path.resolve()), "final_loss": final, "heldout_loss": held_losses["loss"],
        "heldout_losses": held_losses, "heldout": {"size": heldout_size, "seed": held_seed},
        "train_time_s": train_s, "s_per_step": train_s / steps, "torch_threads": torch.get_num_threads(),
        "wall_time_s": time.perf_counter() - start,
    }
    save_atomically(model, out, record)
    return record


def train_continuous_ar(out_dir: str | Path, *, tokenizer_dir: str | Path, steps: int, batch_size: int, lr: float,
                        seed: int = 0, dataset_size: int, model_config: dict | None = None, heldout_size: int = 64,
                        diffusion_positions: int = 64, input_noise: float = 0.0, log_every: int = 50,
                        warmup: int = 100, log: Callable[[str], None] = print) -> dict:
    """Train the continuous AR target (``ContinuousARModel``: backbone, mixture head and diffusion
    head jointly, loss = mixture NLL + diffusion loss on ``diffusion_positions`` random tokens per
    image) with AdamW on the latents of ``ShapesDataset(dataset_size, seed, style=AR_DATA_STYLE)`` under
    the tokenizer in ``tokenizer_dir``; save to ``out_dir`` (fp16 safetensors, atomically) with
    ``train_log.json``, whose dict is returned (``heldout_losses``, ``s_per_step``, ...).
    ``model_config`` overrides ``DEFAULT_TARGET_CONFIG``; token_dim, grid_size, num_classes and
    id2label come from the tokenizer and the dataset."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                         heldout_size=heldout_size, log_every=log_every, log=log, warmup=warmup)
    check_int(diffusion_positions, "diffusion_positions", 1)
    check(isinstance(input_noise, (int, float)) and not isinstance(input_noise, bool) and input_noise >= 0,
          "input_noise", "a number >= 0", input_noise)
    start = time.perf_counter()
    tok_path, tokenizer = _load_tokenizer(tokenizer_dir)
    config = _model_config(tokenizer, DEFAULT_TARGET_CONFIG, model_config)
    labels, latents = encode_dataset(tokenizer, dataset_size, seed)
    held_seed = heldout_seed(seed)
    held = encode_dataset(tokenizer, heldout_size, held_seed)
    log(f"continuous-ar encoded {dataset_size} + {heldout_size} images into {tuple(latents.shape[1:])} latents")
    torch.manual_seed(seed)
    model = ContinuousARModel(**config)
    g = torch.Generator().manual_seed(seed + 1)
    loss = lambda m, b: m.loss(*b, generator=g, diffusion_positions=diffusion_positions,  # noqa: E731
                               input_noise=input_noise if m.training else 0.0)
    return _train("continuous-ar", out, model, loss, tokenizer_path=tok_path, labels=labels, latents=latents,
                  held=held, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                  heldout_size=heldout_size, held_seed=held_seed, warmup=warmup, log_every=log_every, log=log,
                  start=start, extra={"diffusion_positions": diffusion_positions, "input_noise": input_noise},
                  state={"diffusion": g})


def distill_loss(draft: ContinuousARModel, target: ContinuousARModel, labels: torch.Tensor, latents: torch.Tensor,
                 generator: torch.Generator, distill: float, diffusion_positions: int = 64,
                 input_noise: float = 0.0) -> dict[str, torch.Tensor]:
    """The draft's loss: its own data losses (``ContinuousARModel.loss`` on the same inputs) times
    ``1 - distill`` plus ``distill`` times the distillation terms on the frozen ``target``:
    ``"kd_mixture"``, the draft mixture's mean NLL of one sample per token from the target's
    (unguided, untempered) mixture, and ``"kd_eps"``, the mean squared epsilon difference of the two
    diffusion heads at the target's noised inputs (same x_t and t, ``diffusion_positions`` tokens
    per image). Both models read the same teacher-forced tokens (they share the state kernel;
    ``input_noise`` widens its noise as in ``ContinuousARModel.tokens_from_latents``)."""
    N, d = draft.num_image_tokens, draft.config.token_dim
    if draft.training:
        labels = draft.drop_labels(labels, generator)
    tokens = draft.tokens_from_latents(labels, latents, generator, input_noise)
    z = draft(tokens).cond  # (B, N, dim)
    with torch.no_grad():
        zt = target(tokens).cond  # (B, N, dim_t)
        log_pi, mu, sigma = target.heads["mixture"].raw_params(zt)
        comp = torch.multinomial(log_pi.exp().flatten(0, 1), 1, generator=generator).view(*log_pi.shape[:2], 1, 1)
        m_mu = mu.gather(2, comp.expand(-1, -1, 1, d))[:, :, 0]
        m_sigma = sigma.gather(2, comp.expand(-1, -1, 1, d))[:, :, 0]
        x_teacher = m_mu + m_sigma * torch.randn(m_mu.shape, generator=generator)  # (B, N, d)
    mixture = draft.heads["mixture"].nll(z, latents).mean()
    kd_mixture = draft.heads["mixture"].nll(z, x_teacher).mean()
    B = latents.shape[0]
    k = min(diffusion_positions, N)
    pos = torch.rand(B, N, generator=generator).argsort(1)[:, :k]
    zk = z.gather(1, pos[..., None].expand(-1, -1, z.shape[-1])).flatten(0, 1)
    xk = latents.gather(1, pos[..., None].expand(-1, -1, d)).flatten(0, 1)
    head = draft.heads["diffusion"]
    diffusion = head.loss(zk, xk, generator).mean()
    S = head.schedule
    t = torch.randint(0, S.train_steps, (xk.shape[0],), generator=generator)
    ab = S.train_alphas_cumprod[t][:, None].to(xk.dtype)
    x_t = ab.sqrt() * xk + (1 - ab).sqrt() * torch.randn(xk.shape, generator=generator)
    with torch.no_grad():
        ztk = zt.gather(1, pos[..., None].expand(-1, -1, zt.shape[-1])).flatten(0, 1)
        eps_t = target.heads["diffusion"].net(x_t, t, ztk)[:, :d]
    kd_eps = ((head.net(x_t, t, zk)[:, :d] - eps_t) ** 2).mean()
    w = distill
    loss = (1 - w) * (mixture + diffusion) + w * (kd_mixture + kd_eps)
    return {"loss": loss, "mixture": mixture, "diffusion": diffusion, "kd_mixture": kd_mixture, "kd_eps": kd_eps}


def train_continuous_draft(out_dir: str | Path, *, tokenizer_dir: str | Path, steps: int, batch_size: int, lr: float,
                           seed: int = 0, dataset_size: int, target_dir: str | Path | None = None,
                           distill: float = 0.0, model_config: dict | None = None, heldout_size: int = 64,
                           diffusion_positions: int = 64, input_noise: float = 0.0, log_every: int = 50,
                           warmup: int = 100, log: Callable[[str], None] = print) -> dict:
    """Train a small continuous draft (``DEFAULT_DRAFT_CONFIG``, its own mixture and diffusion
    heads) like ``train_continuous_ar``; with ``distill`` in (0, 1] and the target in
    ``target_dir`` (required then) the loss mixes in ``distill_loss``'s distillation terms. With a
    ``target_dir`` the draft copies the target's diffusion schedule (``sd``'s part refuses a draft
    whose schedule differs). ``input_noise`` widens the teacher-forced states' noise in training
    as in ``train_continuous_ar`` (both models read the same noised states when distilling).
    The record's ``train`` adds ``target_dir``, ``distill`` and ``input_noise``."""
    out = check_run_args(out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                         heldout_size=heldout_size, log_every=log_every, log=log, warmup=warmup)
    check(isinstance(distill, (int, float)) and not isinstance(distill, bool) and 0.0 <= distill <= 1.0, "distill",
          "a number in [0, 1]", distill)
    check(isinstance(input_noise, (int, float)) and not isinstance(input_noise, bool) and input_noise >= 0,
          "input_noise", "a number >= 0", input_noise)
    check(distill == 0 or target_dir is not None, "target_dir",
          "a folder written by 'mmspec train continuous-ar' when distill > 0", target_dir)
    start = time.perf_counter()
    tok_path, tokenizer = _load_tokenizer(tokenizer_dir)
    target = None
    model_config = dict(model_config or {})
    if target_dir is not None:
        tpath = check_checkpoint_dir(target_dir, "target_dir", "a folder written by 'mmspec train continuous-ar'")
        target = load_checkpoint(ContinuousARModel, tpath)
        target.requires_grad_(False)
        check(target.config.token_dim == tokenizer.token_dim and target.config.grid_size == tokenizer.grid_size,
              "target_dir", f"a target over this tokenizer's {tokenizer.grid_size}x{tokenizer.grid_size} grid of "
              f"{tokenizer.token_dim}-dim latents", str(target_dir))
        for key in _SHARED_WITH_TARGET:
            check(key not in model_config, "model_config", f"free of {key} (copied from the target)", model_config)
            model_config[key] = target.config[key]
    config = _model_config(tokenizer, DEFAULT_DRAFT_CONFIG, model_config)
    labels, latents = encode_dataset(tokenizer, dataset_size, seed)
    held_seed = heldout_seed(seed)
    held = encode_dataset(tokenizer, heldout_size, held_seed)
    log(f"continuous-draft encoded {dataset_size} + {heldout_size} images into {tuple(latents.shape[1:])} latents")
    torch.manual_seed(seed)
    model = ContinuousARModel(**config)
    g = torch.Generator().manual_seed(seed + 1)
    if distill > 0:
        loss = lambda m, b: distill_loss(m, target, *b, generator=g, distill=distill,  # noqa: E731
                                         diffusion_positions=diffusion_positions,
                                         input_noise=input_noise if m.training else 0.0)
    else:
        loss = lambda m, b: m.loss(*b, generator=g, diffusion_positions=diffusion_positions,  # noqa: E731
                               input_noise=input_noise if m.training else 0.0)
    extra = {"diffusion_positions": diffusion_positions, "distill": distill, "input_noise": input_noise,
             "target_dir": None if target_dir is None else str(Path(target_dir).resolve())}
    record = _train("continuous-draft", out, model, loss, tokenizer_path=tok_path, labels=labels, latents=latents,
                    held=held, steps=steps, batch_size=batch_size, lr=lr, seed=seed, dataset_size=dataset_size,
                    heldout_size=heldout_size, held_seed=held_seed, warmup=warmup, log_every=log_every, log=log,
                    start=start, extra=extra, state={"diffusion": g})
    return record
