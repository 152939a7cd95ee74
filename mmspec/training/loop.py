"""The one training loop every recipe runs, on ``accelerate.Accelerator``.

A recipe is data + model + loss + this loop::

    accelerator = new_accelerator("vq")
    ...
    final_loss = train_loop(model, optimizer, batches, lambda model, x: model(x)[1], steps=steps,
                            accelerator=accelerator, name="vq", log=log, log_every=log_every)

Per step: ``loss(model, batch)`` (a loss tensor, or a dict with ``"loss"`` and other values to
log), ``optimizer.zero_grad``, ``accelerator.backward``, optional gradient clipping by global norm,
``optimizer.step``, ``schedule.step``. With one process accelerate changes nothing: the weights are
bit-identical to the plain torch loop the recipes had. Under ``accelerate launch`` with N processes
the model is wrapped in DDP (gradients all-reduced), each process takes its ``shard`` of every
global batch, and logged values are means over processes. Recipes train on the CPU (tiny models;
gloo between processes).

Checkpoints (``Checkpoints``: passed to ``train_loop``, or set around a recipe with
``checkpointing(...)``, as ``mmspec train ... --checkpoint-every N [--resume]`` does): every
``every`` steps the loop writes ``<folder>/<name>/step-<n>`` whole or not at all (the previous
one is then removed): the model's weights, the optimizer's and the schedule's state, each
process's torch RNG state and the ``state`` objects' (an ``EMA``, the ``torch.Generator`` a loss
draws its dropout or augmentation from), as safetensors and JSON, nothing pickled. ``resume``
loads the last one and continues at the step after it, the first batches of ``batches`` skipped
(a recipe's batch order comes from its own seeded generator, so skipping replays it): a run
killed at any point (SIGKILL included) and resumed ends with the weights of a run never stopped,
bit for bit (``tests/test_train_resume.py``: one process and two).

Around the steps, none of it touching a weight: a ``tqdm`` bar on the main process (``progress``,
or ``progress_bars(...)`` around a recipe; by default only when stderr is a terminal), a rate
(tokens, or samples, per second) on every log line, accelerate's trackers (``new_accelerator(...,
log_with=...)`` or ``tracking(...)`` around a recipe, as ``mmspec train ... --log-with NAME``
does), and a held-out ``evaluate`` at each checkpoint and at the end, recorded in ``history`` and
in the checkpoints, so that a resumed run's history is an uninterrupted one's
(``tests/test_train_loop_extras.py``).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from ..core.errors import check, check_int, is_int
from ..utils import atomic_dir

LossFn = Callable[[nn.Module, Any], "torch.Tensor | dict"]


def new_accelerator(recipe: str, *, distributed: bool = False, find_unused_parameters: bool = False,
                    log_with=None, project_dir=None):
    """The recipes' ``Accelerator`` (CPU). Unless the recipe is ``distributed`` (splits its
    batches with ``shard``), a launch with more than one process is refused before any work:
    otherwise every process would train the same model and write the same folder.

    ``log_with``: accelerate's trackers (``"tensorboard"``, ``"wandb"``, ..., a ``GeneralTracker``
    instance, or a list of them), their files under ``project_dir``; None: those of the enclosing
    ``tracking(...)`` block, if any. A tracker whose package is not installed is refused here
    (accelerate alone would drop it silently). ``train_loop`` starts, feeds and finishes them.

    ``accelerate launch --config_file ds_or_fsdp.yaml -m mmspec train ...``: the launcher sets
    ``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_USE_FSDP`` and accelerate reads them here, but the
    ``cpu=True`` this builds with keeps them from taking effect: ``AcceleratorState`` selects
    DeepSpeed only when not ``cpu`` and FSDP only for accelerator devices (multi-GPU, XPU, ...), so
    the run is plain DDP over gloo on the CPU (a DeepSpeed config still needs ``deepspeed``
    importable: accelerate checks it first). The config's process count applies, and every recipe
    but vlm-draft refuses more than one process. Running the recipes under DeepSpeed or FSDP on
    GPUs would take ``cpu=False`` and batches moved to ``accelerator.device``; not done (untested).
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs

    if log_with is None and _TRACKING:
        log_with, project_dir = _TRACKING[-1]
    _check_trackers(log_with)
    accelerator = Accelerator(cpu=True, log_with=log_with, project_dir=project_dir, kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)])
    check(distributed or accelerator.num_processes == 1, "processes",
          f"1 for {recipe} (of the recipes only vlm-draft splits its batches across accelerate processes)",
          accelerator.num_processes)
    return accelerator


def _check_trackers(log_with) -> None:
    """Refuse a tracker that accelerate does not know, or one of its own whose package (named as
    the tracker) is not installed."""
    if log_with is None:
        return
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker, get_available_trackers
    from accelerate.utils import LoggerType

    known = ["all", *LOGGER_TYPE_TO_CLASS]
    installed = {str(t) for t in get_available_trackers()}
    for item in log_with if isinstance(log_with, (list, tuple)) else [log_with]:
        if isinstance(item, GeneralTracker):
            continue
        item = str(item)
        check(item in known, "log_with", f"one of {', '.join(known)}, or an accelerate GeneralTracker", item)
        check(item == "all" or item in installed or item not in LoggerType.list(), "log_with",
              f"a tracker whose package is installed (pip install {item})", item)


def shard(batch: torch.Tensor, accelerator) -> torch.Tensor:
    """This process's equal share of a global batch (the whole batch in one process)."""
    n = len(batch) // accelerator.num_processes
    return batch[accelerator.process_index * n :][:n]


class _LossStep(nn.Module):
    """The model and its loss as one module, so that DDP's hooks see the forward that builds the
    loss (a loss method called on the bare model would skip the gradient all-reduce)."""

    def __init__(self, model: nn.Module, loss: LossFn):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, batch):
        return self.loss(self.model, batch)


@dataclass(frozen=True)
class Checkpoints:
    """Save a checkpoint every ``every`` steps under ``folder`` (one sub-folder per loop name);
    ``resume``: continue from the last one there (from the start when there is none)."""

    folder: Path
    every: int
    resume: bool = False

    def __post_init__(self):
        check(is_int(self.every) and self.every >= 1, "every", "an int >= 1 (steps between checkpoints)", self.every)
        check(isinstance(self.resume, bool), "resume", "True or False", self.resume)
        object.__setattr__(self, "folder", Path(self.folder))


_ACTIVE: list = []


@contextmanager
def checkpointing(policy: Checkpoints | None):
    """Every ``train_loop`` inside the block that is given no ``checkpoints`` uses ``policy``."""
    _ACTIVE.append(policy)
    try:
        yield policy
    finally:
        _ACTIVE.pop()


_TRACKING: list = []


@contextmanager
def tracking(log_with, project_dir=None):
    """Every ``new_accelerator`` inside the block that is given no ``log_with`` logs to
    ``log_with`` (None: none), its files under ``project_dir``; a tracker whose package is not
    installed is refused on entry, before any work."""
    _check_trackers(log_with)
    _TRACKING.append((log_with, project_dir))
    try:
        yield log_with
    finally:
        _TRACKING.pop()


_PROGRESS: list = []


@contextmanager
def progress_bars(show: bool | None):
    """Every ``train_loop`` inside the block that is given no ``progress`` uses ``show`` (True,
    False, or None: when stderr is a terminal)."""
    check(show in (None, True, False), "show", "None, True or False", show)
    _PROGRESS.append(show)
    try:
        yield show
    finally:
        _PROGRESS.pop()


def _flatten(path: str, value, tensors: dict):
    """A nested dict / list of tensors and JSON values -> its JSON skeleton, the tensors (copied:
    safetensors refuses shared storage) moved to ``tensors`` under their path."""
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().clone()
        return {"$tensor": path}
    if isinstance(value, dict):
        return {"$dict": [[_flatten(f"{path}/k{i}", k, tensors), _flatten(f"{path}/{i}", v, tensors)]
                          for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, (list, tuple)):
        return {"$list": [_flatten(f"{path}/{i}", v, tensors) for i, v in enumerate(value)],
                "tuple": isinstance(value, tuple)}
    return value


def _unflatten(skeleton, tensors: dict):
    if isinstance(skeleton, dict) and "$tensor" in skeleton:
        return tensors[skeleton["$tensor"]]
    if isinstance(skeleton, dict) and "$dict" in skeleton:
        return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in skeleton["$dict"]}
    if isinstance(skeleton, dict) and "$list" in skeleton:
        items = [_unflatten(v, tensors) for v in skeleton["$list"]]
        return tuple(items) if skeleton["tuple"] else items
    return skeleton


def _save_state(folder: Path, name: str, value) -> None:
    tensors = {}
    skeleton = _flatten("", value, tensors)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(skeleton))


def _load_state(folder: Path, name: str):
    return _unflatten(json.loads((folder / f"{name}.json").read_text()), load_file(str(folder / f"{name}.safetensors")))


def _state_of(obj):
    return {"generator": obj.get_state()} if isinstance(obj, torch.Generator) else obj.state_dict()


def _restore(obj, state) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state["generator"])
    else:
        obj.load_state_dict(state)


def _last_checkpoint(folder: Path) -> tuple[int, Path] | None:
    found = [(int(p.name.split("-")[1]), p) for p in folder.glob("step-*") if p.is_dir()] if folder.is_dir() else []
    return max(found) if found else None


def _save_checkpoint(folder: Path, step: int, model, optimizer, schedule, state: dict, accelerator,
                     history: list = ()) -> None:
    """``folder/step-<step>``: every process writes its RNG state and process 0 the rest (``history``,
    the held-out evaluations so far, in ``meta.json``) into one staging folder, which process 0
    then publishes whole (``atomic_dir``) and the older ones go."""
    accelerator.wait_for_everyone()
    staging = folder / f".staging-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    accelerator.wait_for_everyone()
    rank = accelerator.process_index  # each process's RNG and state objects (a generator may differ)
    _save_state(staging, f"rng-{rank}", {"torch": torch.get_rng_state()})
    for key, obj in state.items():
        _save_state(staging, f"state-{key}-{rank}", _state_of(obj))
    if accelerator.is_main_process:
        _save_state(staging, "model", model.state_dict())
        _save_state(staging, "optimizer", optimizer.state_dict())
        if schedule is not None:
            _save_state(staging, "schedule", schedule.state_dict())
        (staging / "meta.json").write_text(json.dumps({"step": step, "processes": accelerator.num_processes,
                                                          "history": list(history)}))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        target = folder / f"step-{step:08d}"
        with atomic_dir(target) as tmp:
            for f in staging.iterdir():
                shutil.move(str(f), str(tmp / f.name))
        shutil.rmtree(staging, ignore_errors=True)
        for old in folder.glob("step-*"):  # the newest only
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def _load_checkpoint(path: Path, model, optimizer, schedule, state: dict, accelerator) -> dict:
    """Restore what ``_save_checkpoint`` wrote; returns its ``meta.json``."""
    meta = json.loads((path / "meta.json").read_text())
    check(meta["processes"] == accelerator.num_processes, "resume",
          f"a checkpoint of a run of {accelerator.num_processes} processes, as this one",
          f"{path}: {meta['processes']}")
    model.load_state_dict(_load_state(path, "model"))
    optimizer.load_state_dict(_load_state(path, "optimizer"))
    if schedule is not None:
        schedule.load_state_dict(_load_state(path, "schedule"))
    rank = accelerator.process_index
    for key, obj in state.items():
        _restore(obj, _load_state(path, f"state-{key}-{rank}"))
    torch.set_rng_state(_load_state(path, f"rng-{rank}")["torch"])
    return meta


def _samples(batch) -> int:
    """The length of the first tensor in ``batch`` (a tensor, or a sequence or mapping holding one);
    1 when there is none."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        if isinstance(item, (torch.Tensor, Mapping, list, tuple)):
            return _samples(item)
    return 1


def _held_out(model: nn.Module, evaluate: Callable[[nn.Module], dict]) -> dict:
    """``evaluate(model)`` in eval mode under ``no_grad``; every module's mode and torch's CPU RNG
    state are put back after, so training goes on as if it had not run."""
    modes = [(m, m.training) for m in model.modules()]
    rng = torch.get_rng_state()
    try:
        model.eval()
        with torch.no_grad():
            figures = evaluate(model)
    finally:
        torch.set_rng_state(rng)
        for m, training in modes:
            m.training = training
    check(isinstance(figures, Mapping) and "step" not in figures, "evaluate",
          "a function returning a dict of figures (without a 'step' key)", figures)
    return {k: v.item() if hasattr(v, "item") else v for k, v in figures.items()}  # one-element tensors: numbers


def train_loop(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable, loss: LossFn, *,
               steps: int, accelerator, schedule=None, grad_clip: float | None = None, name: str = "train",
               log: Callable[[str], None] = print, log_every: int = 50,
               on_step: Callable[[int], None] | None = None, checkpoints: Checkpoints | None = None,
               state: dict | None = None, count: Callable[[Any], int] | None = None, progress: bool | None = None,
               evaluate: Callable[[nn.Module], dict] | None = None, history: list | None = None) -> float:
    """Train ``model`` for ``steps`` steps on the first ``steps`` items of ``batches`` (this
    process's part of each batch) and return the last step's loss (mean over processes).

    Args:
        model: the module whose parameters ``optimizer`` holds (frozen parts outside it stay as
            they are); trained in train mode.
        optimizer, schedule: a torch optimizer and an optional LR scheduler stepped once per step.
        batches: an iterable of whatever ``loss`` takes.
        loss: ``loss(model, batch)`` -> loss tensor, or a dict with ``"loss"``; its other scalar
            entries are logged beside it.
        grad_clip: clip the gradients' global L2 norm to this value (None: no clipping).
        name, log, log_every: log ``"<name> step <i>/<steps>  loss <v> ...  <r> tok/s  <t>s"``
            every ``log_every`` steps and at the last (``<r>``: the tokens of every process per
            second of training since the start or the resume, evaluations left out).
        on_step: called with the step number (from 1) after each optimizer and schedule step
            (an ``EMA``'s ``update``, say).
        checkpoints: save and resume (module docstring); default the ``checkpointing`` block's.
        state: ``{name: object}`` checkpointed beside the model: anything with ``state_dict`` /
            ``load_state_dict`` (an ``EMA``) or a ``torch.Generator`` the loss draws from.
        count: ``count(batch)`` -> the tokens in this process's batch (answer tokens, image
            tokens, ...); None: samples, the length of the batch's first tensor (logged as
            ``samples/s``).
        progress: a ``tqdm`` bar on the main process (step, ETA, last logged loss, rate); None:
            the ``progress_bars`` block's, else only when stderr is a terminal.
        evaluate: ``evaluate(model)`` -> ``{figure: number}`` on held-out data, run on the main
            process (eval mode, ``no_grad``, torch's CPU RNG state put back after: the weights are
            those of a run without it) at each checkpoint and after the last step, logged as
            ``"<name> step <n> held-out <figure> <v>  ..."`` and sent to the trackers.
        history: a list the evaluations are appended to, as ``{"step": n, **figures}`` (on the
            main process); each checkpoint keeps them (``meta.json``), so after a resume it holds
            the earlier ones too, as an uninterrupted run's would.

    Trackers (``new_accelerator(log_with=...)``): started under the run's ``name`` (unless the
    caller started them), sent the logged values and the rate (``tokens_per_s`` or
    ``samples_per_s``) at each log line and the figures (``heldout/<figure>``) at each evaluation,
    and finished at the end (each tracker's ``finish``: ``accelerator.end_training`` would also end
    the process group that a recipe still uses after the loop).
    """
    check_int(steps, "steps", 1)
    check(grad_clip is None or grad_clip > 0, "grad_clip", "None or a number > 0", grad_clip)
    check(progress in (None, True, False), "progress", "None, True or False", progress)
    parts = [_LossStep(model, loss), optimizer] + ([schedule] if schedule is not None else [])
    step_module, optimizer, *rest = accelerator.prepare(*parts)
    schedule = rest[0] if rest else None
    step_module.train()
    policy = checkpoints if checkpoints is not None else (_ACTIVE[-1] if _ACTIVE else None)
    state = dict(state or {})
    folder = None if policy is None else policy.folder / name.replace(" ", "-")
    first = 1
    evaluations = history if history is not None else []  # {"step": n, **figures}, a checkpoint's first
    found = _last_checkpoint(folder) if policy is not None and policy.resume else None
    if found is not None and found[0] < steps:
        meta = _load_checkpoint(found[1], model, optimizer, schedule, state, accelerator)
        first = found[0] + 1
        evaluations.extend(meta.get("history", []))
        log(f"{name} resumed at step {first} from {found[1]}")
    if progress is None:
        progress = _PROGRESS[-1] if _PROGRESS and _PROGRESS[-1] is not None else _is_terminal(sys.stderr)
    tracked = bool(getattr(accelerator, "log_with", None))
    started = tracked and not accelerator.trackers  # trackers the caller started are its own to finish
    if started:
        accelerator.init_trackers(name.replace(" ", "-"))
    bar = tqdm(total=steps, initial=first - 1, desc=name, unit="step", dynamic_ncols=True,
               disable=not (progress and accelerator.is_main_process))
    unit, rate_key = ("samples/s", "samples_per_s") if count is None else ("tok/s", "tokens_per_s")

    def say(line: str) -> None:
        if bar.disable:
            log(line)
        else:  # the bar cleared, the line written, the bar redrawn
            with tqdm.external_write_mode():
                log(line)

    def held_out(step: int) -> None:
        nonlocal evaluating
        if evaluate is None or not accelerator.is_main_process:
            return
        began = time.perf_counter()
        figures = _held_out(model, evaluate)
        evaluating += time.perf_counter() - began
        evaluations.append({"step": step, **figures})
        say(f"{name} step {step} held-out " + "  ".join(f"{k} {_shown(v)}" for k, v in figures.items()))
        if tracked:
            accelerator.log({f"heldout/{k}": v for k, v in figures.items() if isinstance(v, (int, float))}, step=step)

    start = time.perf_counter()
    evaluating, counted = 0.0, 0  # seconds spent in evaluate; this process's tokens since start
    batches = iter(batches)
    for _ in range(first - 1):  # the checkpoint's steps' batches: the recipe's order replayed
        next(batches)
    final = float("nan")
    try:
        for step in range(first, steps + 1):
            batch = next(batches)
            counted += _samples(batch) if count is None else int(count(batch))
            out = step_module(batch)
            out = out if isinstance(out, dict) else {"loss": out}
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(out["loss"])
            if grad_clip is not None:
                accelerator.clip_grad_norm_(step_module.parameters(), grad_clip)
            optimizer.step()
            if schedule is not None:
                schedule.step()
            if on_step is not None:
                on_step(step)
            seconds = time.perf_counter() - start
            training = max(seconds - evaluating, 1e-9)
            if step % log_every == 0 or step == steps:
                scalars = {k: torch.as_tensor(v).detach().float() for k, v in out.items()
                           if isinstance(v, (torch.Tensor, float)) and torch.as_tensor(v).numel() == 1}
                values = {k: float(accelerator.reduce(scalars[k], "mean"))
                          for k in ["loss", *(k for k in scalars if k != "loss")]}
                rate = float(accelerator.reduce(torch.tensor(float(counted), dtype=torch.float64), "sum")) / training
                final = values["loss"]
                shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
                say(f"{name} step {step}/{steps}  {shown}  {rate:.1f} {unit}  {seconds:.0f}s")
                if tracked:
                    accelerator.log({**values, rate_key: rate}, step=step)
            if not bar.disable:  # this process's rate times the processes: no sync per step
                shown = "" if final != final else f"loss {final:.4f}  "  # nan: nothing logged yet
                estimate = counted * accelerator.num_processes / training
                bar.set_postfix_str(f"{shown}{estimate:.1f} {unit}", refresh=False)
                bar.update(1)
            if step == steps or (policy is not None and step % policy.every == 0):
                held_out(step)
            if policy is not None and step % policy.every == 0 and step < steps:
                _save_checkpoint(folder, step, model, optimizer, schedule, state, accelerator, evaluations)
    finally:
        bar.close()
        if started:
            for tracker in accelerator.trackers:
                tracker.finish()
            accelerator.trackers.clear()
    return final


def _is_terminal(stream) -> bool:
    return stream is not None and hasattr(stream, "isatty") and stream.isatty()


def _shown(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


class EMA:
    """An exponential moving average of a module's floating-point weights and buffers, kept in
    float32: after update ``n`` (from 1) each average moves toward the module's value by
    ``1 - d``, ``d = min(decay, (1 + n) / (10 + n))`` (diffusers' ``EMAModel`` without its
    power warm-up, so early updates follow the weights closely). ``copy_to`` writes the averages
    into a module of the same structure, cast to its dtypes."""

    def __init__(self, model: nn.Module, decay: float):
        check(isinstance(decay, float) and 0 < decay < 1, "decay", "a float in (0, 1)", decay)
        self.decay = decay
        self.updates = 0
        self.shadow = {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    def state_dict(self) -> dict:
        return {"updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.current_decay()
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].lerp_(v.detach().float(), 1 - d)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        state = model.state_dict()
        for k, v in self.shadow.items():
            state[k].copy_(v.to(state[k].dtype))
