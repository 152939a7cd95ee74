"""``mmspec train RECIPE``: rebuild a tiny checkpoint from a seed with one of the training recipes
(``mmspec.training.recipes``). The models drafters work for (tokenizers, targets, judges) are
entries of ``RECIPES``: a help line, the options of their own and the call that runs them; the
kinds a recipe accepts are read from its table (``continuous.TOKENIZER_KINDS``, ...). Trained
drafters declare their ``TrainingRecipe`` where their part is registered (``mmspec.methods``):
each is a subcommand of its own (``ar-eagle``, ``vlm-medusa``, ``continuous-sd``, ...), its
options, defaults, checks and report read from the recipe. ``ar-draft --kind K``, ``vlm-draft
--method M`` and ``continuous-draft`` stay in ``RECIPES`` as aliases (the Makefile and the docs
use them): they run the registered recipe whose ``alias`` names them, and their ``--kind`` /
``--method`` choices are those recipes."""

from __future__ import annotations

from typing import Callable, NamedTuple

from .. import methods
from .common import (TableChoices, existing_dir, non_negative_int, number, output_dir, positive_float, positive_int,
                     set_threads)

NAME = "train"


def _aliased(name: str) -> dict:
    """``{value: TrainingRecipe}``: the registered recipes the alias ``name`` runs, by the value of
    its selecting option (``"chain"`` for ``alias="ar-draft --kind chain"``; ``""`` where one
    recipe is the whole subcommand), in registration order."""
    found = {}
    for recipe in methods.recipes().values():
        words = recipe.alias.split()
        if words and words[0] == name:
            found[words[2] if len(words) == 3 else ""] = recipe
    return found


def _alias_defaults(name: str) -> dict:
    """The CLI defaults of an alias: those of the recipes it runs, which must agree."""
    found = _aliased(name)
    shared = {tuple(sorted(r.defaults.items())) for r in found.values()}
    if len(shared) != 1:
        names = ", ".join(r.name for r in found.values()) or "none"
        raise ValueError(f"the registered recipes of 'mmspec train {name}' ({names}) must share their defaults "
                         "(steps, batch_size, lr, dataset_size)")
    return dict(next(iter(found.values())).defaults)


# defaults sized from measured step times on this project's 2-core CPU: minutes to an hour per
# recipe (each recipe's step time and run time: docs/costs.md); the AR target takes 3,000 steps
# because at 2,000 it still drew blobs
TRAIN_DEFAULTS = {
    "vq": dict(steps=1500, batch_size=16, lr=1e-3, dataset_size=4096),
    "ar-image": dict(steps=3000, batch_size=32, lr=1e-3, dataset_size=32768),
    "ar-draft": _alias_defaults("ar-draft"),  # the drafters' recipes' (mmspec.methods.ar_image.TRAINING)
    "classifier": dict(steps=1600, batch_size=32, lr=3e-3, dataset_size=4096),
    "vlm": dict(steps=1600, batch_size=32, lr=1e-3, dataset_size=16000),
    "vlm-draft": _alias_defaults("vlm-draft"),  # mmspec.methods.vlm.TRAINING
    # dataset_size in frames for the autoencoder, in clips of 18 frames for the video transformer
    "video-ae": dict(steps=1500, batch_size=16, lr=2e-3, dataset_size=4096),
    "video": dict(steps=9600, batch_size=8, lr=1e-3, dataset_size=4096),
    # dataset_size in frames
    "video-judge": dict(steps=1000, batch_size=64, lr=3e-3, dataset_size=16384),
    # --kind conv (default): 1,500 Adam steps of a small conv autoencoder; --kind pca: an SVD, seconds
    "continuous-tokenizer": dict(steps=1500, batch_size=32, lr=2e-3, dataset_size=4096),
    "continuous-ar": dict(steps=18000, batch_size=32, lr=1e-3, dataset_size=16384),
    "continuous-draft": _alias_defaults("continuous-draft"),  # mmspec.methods.continuous.DRAFT_TRAINING
}


# the video recipe's loss knobs (mmspec.training.recipes.video.TwoStreamLoss): self-rollouts, the
# precision of its forward passes, first-chunk steps
VIDEO_ROLLOUT = dict(rollout_prob=0.3, rollout_strength=[0.3, 0.8], autocast="bf16", first_chunk_prob=0.3)
# the weights the video recipe saves: None, the trained ones (else an EMA with this decay)
VIDEO_EMA_DECAY = None


class TrainCommand(NamedTuple):
    """One ``mmspec train`` subcommand: its help line, ``options(parser)`` adding the recipe's own
    options, and ``run(args, common)`` training and printing the held-out figures (``common``: the
    keyword arguments every recipe takes); ``run`` None for an alias of registered recipes."""

    help: str
    options: Callable
    run: Callable | None


def _vq_option(p, required: bool = True, help: str = "folder written by 'mmspec train vq'") -> None:
    p.add_argument("--vq", required=required, type=existing_dir, metavar="DIR", help=help)


def _no_options(p) -> None:
    pass


def _run_vq(args, common) -> None:
    from ..training import recipes

    record = recipes.train_vq(args.out, **common)
    print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.4f}, "
          f"{record['wall_time_s']:.0f} s")


def _run_ar_image(args, common) -> None:
    from ..training import recipes

    record = recipes.train_ar_image(args.out, vq_dir=args.vq, **common)
    print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f}, {record['wall_time_s']:.0f} s")


def _ar_draft_options(p) -> None:
    import argparse
    from pathlib import Path

    def existing(text: str) -> str:  # a folder, or (eagle, medusa) a LlamaGen checkpoint file
        if not Path(text).exists():
            raise argparse.ArgumentTypeError(f"no such folder or file: {text!r}")
        return text

    p.add_argument("--kind", required=True, choices=tuple(_aliased("ar-draft")),
                   help="eagle: feature head on the target; medusa: parallel heads on the target's "
                        "features (root token, token above, column); chain: a small AR model")
    p.add_argument("--target", type=existing, metavar="DIR|FILE",
                   help="folder written by 'mmspec train ar-image', or for eagle and medusa a LlamaGen c2i GPT "
                        "checkpoint (.safetensors file, LlamaGen's layout); required for --kind eagle and medusa")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="medusa only: parallel heads, the tree's depth below the root (default 4, "
                        "less than the grid's width)")
    p.add_argument("--vq", required=True, type=existing, metavar="DIR|FILE",
                   help="folder written by 'mmspec train vq', or for eagle and medusa a LlamaGen VQ checkpoint "
                        "(.safetensors file)")
    p.add_argument("--data", type=existing_dir, metavar="DIR",
                   help="eagle and medusa only: train on this image folder, DIR/<class>/<image> (class folders "
                        "named by class id, or sorted names get ids 0..n-1; default: the procedural shapes)")
    p.add_argument("--n-head", type=positive_int, default=None,
                   help="eagle and medusa, a LlamaGen GPT --target: its attention heads (default: those of the "
                        "LlamaGen config with its depth and width, GPT-B ... GPT-7B)")
    p.add_argument("--image-size", type=positive_int, default=None,
                   help="eagle and medusa, a LlamaGen VQ --vq: the image side it encodes (default 256)")


def _classifier_options(p) -> None:
    _vq_option(p, required=False, help="also report the accuracy on this VQ's reconstructions of held-out images")


def _run_classifier(args, common) -> None:
    from ..training import recipes

    record = recipes.train_classifier(args.out, vq_dir=args.vq, **common)
    on_vq = "" if args.vq is None else f", {record['vq_recon_accuracy']:.4f} on VQ reconstructions"
    print(f"saved {args.out}: held-out accuracy {record['heldout_accuracy']:.4f}{on_vq}, "
          f"{record['wall_time_s']:.0f} s")


def _vlm_options(p) -> None:
    p.add_argument("--size", default="target",
                   help="target: the model the VLM methods accelerate; draft: the small VLM of "
                        "'sd' and the transformers peer (default target)",
                   ).choices = TableChoices("mmspec.models.vlm", "SIZES")
    p.add_argument("--resolution", type=int, default=64,
                   help="image side in pixels, a multiple of 8: (R / 8)^2 visual tokens per image (default 64)")
    p.add_argument("--images-per-prompt", type=positive_int, default=1,
                   help="each scene question comes with 1 to N images and is about the last (default 1)")
    p.add_argument("--init", default=None,
                   help="fine-tune this saved VLM (e.g. assets/vlm/target) instead of training from scratch; "
                        "its vision tower is resampled to --resolution")
    p.add_argument("--warmup", type=positive_int, default=100, help="linear warmup steps (default 100)")


def _run_vlm(args, common) -> None:
    from ..training import recipes

    record = recipes.train_vlm(args.out, size=args.size, resolution=args.resolution, init=args.init,
                               images_per_prompt=args.images_per_prompt,
                               warmup=args.warmup, **common)
    print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f} nats/answer token, short answers "
          f"{record['short_answer_accuracy']:.3f} ({record['shuffled_image_accuracy']:.3f} with another image), "
          f"{record['wall_time_s']:.0f} s")


def _vlm_draft_options(p) -> None:
    p.add_argument("--method", required=True, choices=tuple(_aliased("vlm-draft")),
                   help="eagle: all image tokens; specvlm: elastic visual compressor; "
                        "vispec: vision adaptor + global image feature; medusa: parallel heads "
                        "(root token + global image feature)")
    for flag, kind, default, help in methods.vlm.TRAINING["eagle"].options:
        if flag != "--rollout-steps":  # the heads' own options (mmspec.methods.vlm), below with its default
            p.add_argument(flag, type=kind, required=default is methods.REQUIRED, default=None,
                           metavar="N" if kind is int else "PATH", help=help)
    p.add_argument("--rollout-steps", type=positive_int, default=None,
                   help="anti-shortcut rollout steps (default: 2 for vispec, 1 otherwise)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="medusa only: parallel heads, the tree's depth below the root (default 6)")


def _run_video_ae(args, common) -> None:
    from ..training import recipes

    record = recipes.train_video_ae(args.out, **common)
    print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.5f} "
          f"(PSNR {record['heldout_psnr_db']:.1f} dB), {record['wall_time_s']:.0f} s")


def _video_options(p) -> None:
    p.add_argument("--ae", required=True, type=existing_dir, metavar="DIR",
                   help="folder written by 'mmspec train video-ae'")
    p.add_argument("--rollout-prob", type=number(float, 0, strict=False, high=1),
                   default=VIDEO_ROLLOUT["rollout_prob"],
                   help="share of steps whose context is the model's own stream through the rolling cache "
                        f"(self-rollout; default {VIDEO_ROLLOUT['rollout_prob']})")
    p.add_argument("--rollout-strength", type=number(float, 0, strict=True, high=1), nargs=2,
                   metavar=("LOW", "HIGH"), default=VIDEO_ROLLOUT["rollout_strength"],
                   help="each rollout starts its chunks from the clip's at a strength drawn from "
                        "[LOW, HIGH] (default %(default)s)")
    p.add_argument("--autocast", choices=("fp32", "bf16"), default=VIDEO_ROLLOUT["autocast"],
                   help="precision of the loss's forward passes: bf16 autocast (float32 weights, gradients "
                        "and rollouts; faster steps, timed in assets/README.md) or fp32 (default %(default)s)")
    p.add_argument("--first-chunk-prob", type=number(float, 0, strict=False, high=1),
                   default=VIDEO_ROLLOUT["first_chunk_prob"],
                   help="share of steps that train every chunk alone, as a stream's first chunk is drawn "
                        f"(default {VIDEO_ROLLOUT['first_chunk_prob']})")
    p.add_argument("--ema-decay", type=number(float, 0, strict=True, high=1, strict_high=True), default=VIDEO_EMA_DECAY,
                   help="save an exponential moving average of the weights with this decay, in (0, 1) "
                        "(default: none, the trained weights)")


def _run_video(args, common) -> None:
    from ..training import recipes

    record = recipes.train_video(args.out, ae_dir=args.ae, rollout_prob=args.rollout_prob,
                                 rollout_strength=tuple(args.rollout_strength), autocast=args.autocast,
                                 first_chunk_prob=args.first_chunk_prob, ema_decay=args.ema_decay, **common)
    print(f"saved {args.out}: held-out loss {record['heldout_loss']:.4f}, rollout colour accuracy "
          f"{record['rollout']['colour_acc']:.3f}, direction accuracy {record['rollout']['direction_acc']:.3f}, "
          f"{record['wall_time_s']:.0f} s")


def _video_judge_options(p) -> None:
    p.add_argument("--ae", type=existing_dir, metavar="DIR",
                   help="also report the accuracy on this autoencoder's reconstructions of held-out frames")


def _run_video_judge(args, common) -> None:
    from ..training import recipes

    record = recipes.train_video_judge(args.out, ae_dir=args.ae, **common)
    on_ae = "" if record["ae_recon"] is None else f", {record['ae_recon']['both']:.4f} on reconstructions"
    print(f"saved {args.out}: held-out accuracy (colour and shape) {record['heldout_accuracy']:.4f}{on_ae}, "
          f"{record['wall_time_s']:.0f} s")


def _continuous_tokenizer_options(p) -> None:
    p.add_argument("--kind", default="conv",
                   help="conv: a small noise-regularised conv autoencoder, 8 channels per 8x8 patch "
                        "(default); pca: PCA of 8x8 patches, 16 coefficients (closed form; steps unused)",
                   ).choices = TableChoices("mmspec.training.recipes.continuous", "TOKENIZER_KINDS")
    p.add_argument("--classifier", type=existing_dir, metavar="DIR",
                   help="also report this classifier's accuracy on reconstructions (e.g. assets/classifier)")


def _run_continuous_tokenizer(args, common) -> None:
    from ..training import recipes

    record = recipes.train_continuous_tokenizer(args.out, kind=args.kind, classifier_dir=args.classifier, **common)
    acc = "" if record["recon_accuracy"] is None else f", classifier accuracy {record['recon_accuracy']:.3f}"
    print(f"saved {args.out}: held-out reconstruction MSE {record['heldout_recon_mse']:.5f}{acc}, "
          f"{record['wall_time_s']:.0f} s")


def _continuous_options(p, draft: bool) -> None:
    p.add_argument("--tokenizer", required=True, type=existing_dir, metavar="DIR",
                   help="folder written by 'mmspec train continuous-tokenizer'")
    noise = methods.continuous.INPUT_NOISE  # the target's and the drafts' default alike
    p.add_argument("--input-noise", type=number(float, 0, strict=False), default=noise,
                   help=f"std of extra noise on the teacher-forced input latents (default {noise}; training only)")
    if draft:
        p.add_argument("--target", type=existing_dir, metavar="DIR",
                       help="folder written by 'mmspec train continuous-ar' (its diffusion schedule is copied; "
                            "required with --distill)")
        p.add_argument("--distill", type=number(float, 0, strict=False, high=1), default=0.0,
                       help="weight of distillation to the target's heads, in [0, 1] (default 0: data only)")


def _run_continuous_ar(args, common) -> None:
    from ..training import recipes

    record = recipes.train_continuous_ar(args.out, tokenizer_dir=args.tokenizer, input_noise=args.input_noise,
                                         **common)
    print(f"saved {args.out}: {methods.continuous.report(record)}")


RECIPES = {
    "vq": TrainCommand("the VQ tokenizer on procedural shapes", _no_options, _run_vq),
    "ar-image": TrainCommand("the class-conditional AR image model on a trained VQ's ids", _vq_option, _run_ar_image),
    "ar-draft": TrainCommand(
        "a draft for the AR image model: EAGLE's feature head, Medusa heads or a small chain model",
        _ar_draft_options, None),
    "classifier": TrainCommand("the shapes classifier whose features the AR image bench's FD uses", _classifier_options,
                               _run_classifier),
    "vlm": TrainCommand("a tiny LLaVA-architecture VLM on procedural image/question/answer data", _vlm_options,
                        _run_vlm),
    "vlm-draft": TrainCommand("a draft head for the VLM (eagle, specvlm, vispec, medusa) by online-logit distillation",
                              _vlm_draft_options, None),
    "video-ae": TrainCommand("the streaming video model's per-frame autoencoder on procedural moving shapes",
                             _no_options, _run_video_ae),
    "video": TrainCommand("the chunk-causal video transformer on a trained frame autoencoder's latents", _video_options,
                          _run_video),
    "video-judge": TrainCommand("the video bench's frame judge (colour and shape) on rendered frames",
                                _video_judge_options, _run_video_judge),
    "continuous-tokenizer": TrainCommand("the continuous tokenizer (a conv autoencoder, or --kind pca: closed form)",
                                         _continuous_tokenizer_options, _run_continuous_tokenizer),
    "continuous-ar": TrainCommand("the continuous-token AR target (backbone, mixture head, diffusion head)",
                                  lambda p: _continuous_options(p, draft=False), _run_continuous_ar),
    "continuous-draft": TrainCommand("a small continuous draft, optionally distilled to the target (--distill)",
                                     lambda p: _continuous_options(p, draft=True), None),
}
"""``{recipe: TrainCommand}``, in the order ``mmspec train --help`` lists them (``TRAIN_DEFAULTS``
has the same keys)."""


def _metavar(kind) -> str | None:
    return "DIR" if kind is str else None  # the registered recipes' str options are folders


def _registered_options(recipe):
    """``options(parser)`` for a registered ``TrainingRecipe``: its ``(flag, type, default, help)``."""

    def options(p) -> None:
        for flag, kind, default, help in recipe.options:
            if default is methods.REQUIRED:
                p.add_argument(flag, type=kind, required=True, metavar=_metavar(kind), help=help)
            else:
                shown = "" if default is None else f" (default {default})"
                p.add_argument(flag, type=kind, default=default, metavar=_metavar(kind), help=help + shown)

    return options


def registered_recipes() -> dict:
    """``{name: TrainingRecipe}`` of the registry (``mmspec.methods.recipes()``); a name the
    built-in ``RECIPES`` use is refused naming it."""
    found = methods.recipes()
    clash = sorted(set(found) & set(RECIPES))
    if clash:
        raise ValueError(f"registered training recipe {clash[0]!r} clashes with a built-in mmspec train recipe "
                         f"(built-in: {', '.join(RECIPES)})")
    return found


def register_subcommand(subparsers) -> None:
    import argparse

    train = subparsers.add_parser(NAME, help="rebuild a tiny checkpoint from a seed")
    recipes = train.add_subparsers(dest="recipe", required=True)
    entries = [(name, recipe.help, recipe.options, TRAIN_DEFAULTS[name] if recipe.run else _alias_defaults(name))
               for name, recipe in RECIPES.items()]
    entries += [(name, r.doc or f"train the {name} drafter", _registered_options(r), dict(r.defaults))
                for name, r in registered_recipes().items()]
    for name, help, options, defaults in entries:
        p = recipes.add_parser(name, help=help)
        options(p)
        p.add_argument("--out", required=True, type=output_dir, metavar="DIR",
                       help="checkpoint folder (replaced atomically)")
        if "steps" in defaults:  # not for closed-form fits
            p.add_argument("--steps", type=positive_int, default=defaults["steps"],
                           help=f"optimizer steps (default {defaults['steps']})")
            p.add_argument("--batch-size", type=positive_int, default=defaults["batch_size"],
                           help=f"(default {defaults['batch_size']})")
            p.add_argument("--lr", type=positive_float, default=defaults["lr"], help=f"(default {defaults['lr']})")
            p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                           help="save a checkpoint every N steps into --checkpoint-dir (default: none)")
            p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                           help="where checkpoints go (default: OUT.checkpoints beside --out)")
            p.add_argument("--resume", action="store_true",
                           help="continue from the last checkpoint in --checkpoint-dir (needs --checkpoint-every)")
            p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                           help="a progress bar on stderr: step, loss, rate, ETA (default: when stderr is a terminal)")
            p.add_argument("--log-with", default=None, metavar="NAME",
                           help="also log to this accelerate tracker (tensorboard, wandb, ...; its package installed)")
            p.add_argument("--logging-dir", default=None, metavar="DIR",
                           help="the tracker's files (default: OUT.logs beside --out)")
        p.add_argument("--seed", type=non_negative_int, default=0, help="init, data and batch order (default 0)")
        p.add_argument("--dataset-size", type=positive_int, default=defaults["dataset_size"],
                       help=f"training images (default {defaults['dataset_size']})")
        p.add_argument("--log-every", type=positive_int, default=50, help="steps between loss lines (default 50)")
        p.add_argument("--threads", type=positive_int, default=2, help="torch intra-op threads (default 2)")


def _registered_call(args):
    """``(TrainingRecipe, {option: value})`` that ``args`` run, or None for a built-in recipe. Through
    an alias: the recipe its selecting option names; an option given that this recipe lacks, or one
    it requires and is missing, raises ``ValueError`` naming them."""
    if args.recipe not in RECIPES:
        recipe = registered_recipes()[args.recipe]
        return recipe, recipe.option_values(vars(args))
    if RECIPES[args.recipe].run is not None:
        return None
    aliased = _aliased(args.recipe)
    recipe = next(iter(aliased.values()))
    words = recipe.alias.split()
    if len(words) == 3:  # "ar-draft --kind chain": the recipe --kind names
        selector = words[1]
        value = getattr(args, methods.option_name(selector))
        recipe = aliased[value]
        declared = {flag for flag, *_ in recipe.options}
        for flag in dict.fromkeys(f for r in aliased.values() for f, *_ in r.options):
            if flag not in declared and getattr(args, methods.option_name(flag), None) is not None:
                takers = [v for v, r in aliased.items() if flag in {f for f, *_ in r.options}]
                raise ValueError(f"{flag} is for {selector} {' or '.join(takers)} only, got {selector} {value}")
        for flag, kind, default, help in recipe.options:
            if default is methods.REQUIRED and getattr(args, methods.option_name(flag), None) is None:
                raise ValueError(f"{selector} {value} needs {flag} {_metavar(kind) or flag.lstrip('-').upper()} "
                                 f"({help})")
    return recipe, recipe.option_values(vars(args))


def check(args) -> None:
    """Arguments that need each other (``ValueError`` naming them): ``--resume`` without
    ``--checkpoint-every``, what an alias's recipe lacks or requires (``_registered_call``), then
    the registered recipe's ``check_options``."""
    _checkpoints(args)  # --resume without --checkpoint-every
    found = _registered_call(args)
    if found is not None and found[0].check_options is not None:
        found[0].check_options(found[1])


def _checkpoints(args):
    """The ``Checkpoints`` the flags ask for (None without ``--checkpoint-every``)."""
    from pathlib import Path

    from ..training.loop import Checkpoints

    every, resume = getattr(args, "checkpoint_every", None), getattr(args, "resume", False)
    if every is None:
        if resume:
            raise ValueError("--resume needs --checkpoint-every N (the run goes on saving checkpoints)")
        return None
    out = Path(args.out)
    folder = Path(args.checkpoint_dir) if args.checkpoint_dir else out.with_name(out.name + ".checkpoints")
    return Checkpoints(folder, every, resume)


def run(args) -> int:
    from pathlib import Path

    from ..training.loop import checkpointing, progress_bars, tracking

    log_with, logs = getattr(args, "log_with", None), getattr(args, "logging_dir", None)
    if log_with is not None and logs is None:
        logs = Path(args.out).with_name(Path(args.out).name + ".logs")
    with checkpointing(_checkpoints(args)), tracking(log_with, logs), progress_bars(getattr(args, "progress", None)):
        return _run(args)


def _run(args) -> int:
    set_threads(args.threads)
    common = dict(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                  dataset_size=args.dataset_size, log_every=args.log_every, log=print)
    found = _registered_call(args)
    if found is None:
        RECIPES[args.recipe].run(args, common)
        return 0
    recipe, options = found
    record = recipe.trainer()(args.out, **options, **common)
    if record is None:  # the other processes of an accelerate launch
        return 0
    if recipe.report is not None:
        shown = recipe.report(record)
    else:
        value = record[recipe.heldout_metric]
        shown = f"{recipe.heldout_metric} {f'{value:.4f}' if isinstance(value, float) else value}"
    print(f"saved {args.out}: {shown}")
    return 0
