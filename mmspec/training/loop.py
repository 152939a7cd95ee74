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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..core.errors import check

LossFn = Callable[[nn.Module, Any], "torch.Tensor | dict"]


def new_accelerator(recipe: str, *, distributed: bool = False, find_unused_parameters: bool = False):
    """The recipes' ``Accelerator`` (CPU). Unless the recipe is ``distributed`` (splits its
    batches with ``shard``), a launch with more than one process is refused before any work:
    otherwise every process would train the same model and write the same folder."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)])
    check(distributed or accelerator.num_processes == 1, "processes",
          f"1 for {recipe} (of the recipes only vlm-draft splits its batches across accelerate processes)",
          accelerator.num_processes)
    return accelerator


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


def train_loop(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable, loss: LossFn, *,
               steps: int, accelerator, schedule=None, grad_clip: float | None = None, name: str = "train",
               log: Callable[[str], None] = print, log_every: int = 50,
               on_step: Callable[[int], None] | None = None) -> float:
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
        name, log, log_every: log ``"<name> step <i>/<steps>  loss <v> ... <t>s"`` every
            ``log_every`` steps and at the last.
        on_step: called with the step number (from 1) after each optimizer and schedule step
            (an ``EMA``'s ``update``, say).
    """
    check(isinstance(steps, int) and steps >= 1, "steps", "an int >= 1", steps)
    check(grad_clip is None or grad_clip > 0, "grad_clip", "None or a number > 0", grad_clip)
    parts = [_LossStep(model, loss), optimizer] + ([schedule] if schedule is not None else [])
    step_module, optimizer, *rest = accelerator.prepare(*parts)
    schedule = rest[0] if rest else None
    step_module.train()
    start = time.perf_counter()
    batches = iter(batches)
    final = float("nan")
    for step in range(1, steps + 1):
        out = step_module(next(batches))
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
        if step % log_every == 0 or step == steps:
            scalars = {k: torch.as_tensor(v).detach().float() for k, v in out.items()
                       if isinstance(v, (torch.Tensor, float)) and torch.as_tensor(v).numel() == 1}
            values = {k: float(accelerator.reduce(scalars[k], "mean")) for k in ["loss", *(k for k in scalars if k != "loss")]}
            final = values["loss"]
            shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
            log(f"{name} step {step}/{steps}  {shown}  {time.perf_counter() - start:.0f}s")
    return final


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
