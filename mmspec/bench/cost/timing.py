"""Running and timing the rows: every forward pass of the target and the draft models, per call."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ... import methods
from ...core.errors import check_choice


@dataclass(frozen=True)
class Pass:
    """One forward pass of a watched model."""

    role: str  # "target", or the draft's component ("draft_model", "eagle_head", ...)
    width: int  # T: tokens per row in the block
    tree: bool  # it carried a tree mask (an HF model: an explicit attention mask)
    seconds: float
    prompt: bool  # the role's first pass in its call (the target's prefill, a draft's first feed)


class PassTimer:
    """Forward hooks that time every pass of the watched models into ``passes``.

    A pass begins at a watched module's forward pre-hook and ends at its forward hook; while one is
    in flight, other watched modules' hooks are ignored (an EAGLE head reads the target's
    embedding inside its own pass). CPU timings: no device is synchronised. ``new_call()`` before
    each generation call makes every role's next pass a prompt pass again. Use as a context
    manager, or ``remove()`` the hooks.
    """

    def __init__(self):
        self.passes: list[Pass] = []
        self._open: list | None = None  # [role, width, tree, start] of the pass in flight
        self._seen: set[str] = set()
        self._handles: list = []

    def new_call(self) -> None:
        self._seen, self._open = set(), None

    def watch_component(self, role: str, module, timing: str) -> None:
        """A method component's passes, timed as its registry ``Component.timing`` says:
        ``"tokens"`` (draft models: ``watch(.., 0, 3)``), ``"features"`` (EAGLE-style heads:
        ``watch(.., 1, 4)``), ``"heads"`` (``watch_heads``) or ``"span"`` (a transformers model
        from its input embedding to its LM head: ``watch_span``)."""
        if timing == "tokens":
            self.watch(role, module, 0, 3)
        elif timing == "features":
            self.watch(role, module, 1, 4)
        elif timing == "heads":
            self.watch_heads(role, module)
        else:
            check_choice("timing", timing, methods.TIMINGS)
            self.watch_span(role, module.get_input_embeddings(), module.get_output_embeddings(), module.base_model)

    def watch(self, role: str, module: torch.nn.Module, tokens_arg: int, mask_arg: int) -> None:
        """A model whose forward takes the block's tokens at position ``tokens_arg`` (or keyword
        ``tokens``) and the tree mask at ``mask_arg`` (or ``tree_mask``): native targets (0, 3),
        EAGLE heads (1, 4)."""

        def start(mod, args, kwargs):
            tokens = args[tokens_arg] if len(args) > tokens_arg else kwargs["tokens"]
            mask = args[mask_arg] if len(args) > mask_arg else kwargs.get("tree_mask")
            self._begin(role, tokens.shape[1], mask is not None)

        self._handles += [module.register_forward_pre_hook(start, with_kwargs=True),
                          module.register_forward_hook(partial(self._end, role))]

    def watch_heads(self, role: str, module: torch.nn.Module) -> None:
        """Parallel heads (``MedusaHeads``: ``heads(features, root, image)``): one call scores the
        whole tree from one feature per row, so its width is 1 (T for a (R, T, H) probe)."""

        def start(mod, args, kwargs):
            features = args[0] if args else kwargs["features"]
            self._begin(role, features.shape[1] if features.dim() == 3 else 1, False)

        self._handles += [module.register_forward_pre_hook(start, with_kwargs=True),
                          module.register_forward_hook(partial(self._end, role))]

    def watch_span(self, role: str, first: torch.nn.Module, last: torch.nn.Module, body: torch.nn.Module) -> None:
        """An HF model as ``VLMTarget`` runs it: from its input embedding ``first`` (the block's ids,
        and on a prompt pass the vision tower after it) through its LM head ``last``; ``body`` (the
        base model) says whether an explicit attention mask was passed (a tree, or a cache with holes)."""

        def start(mod, args, kwargs):
            if self._open is None:  # parallel heads embed their root tokens inside their own pass
                self._begin(role, args[0].shape[1], False)

        def masked(mod, args, kwargs):
            if self._open is not None and self._open[0] == role:
                self._open[2] = kwargs.get("attention_mask") is not None

        self._handles += [first.register_forward_pre_hook(start, with_kwargs=True),
                          body.register_forward_pre_hook(masked, with_kwargs=True),
                          last.register_forward_hook(partial(self._end, role))]

    def _begin(self, role: str, width: int, tree: bool) -> None:
        if self._open is None:
            self._open = [role, width, tree, time.perf_counter()]

    def _end(self, role: str, *hook_args) -> None:
        if self._open is None or self._open[0] != role:
            return
        seconds = time.perf_counter() - self._open[3]
        _, width, tree, _ = self._open
        self.passes.append(Pass(role, width, tree, seconds, prompt=role not in self._seen))
        self._seen.add(role)
        self._open = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "PassTimer":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass
class CallRecord:
    """One timed generation call: its wall time, the tokens it emitted and its passes."""

    wall: float
    tokens: int
    passes: list[Pass]


def warm_up(rows: list[tuple[str, Callable[[int], int]]], timer: PassTimer) -> list[Pass]:
    """One untimed call per row on prompt 0; returns their passes (the widths the rows use)."""
    n = len(timer.passes)
    for _, call in rows:
        timer.new_call()
        call(0)
    return timer.passes[n:]


def measure_calls(rows: list[tuple[str, Callable[[int], int]]], prompts: int, timer: PassTimer,
                  say=lambda msg: None, between: Callable[[], None] | None = None) -> dict[str, list[CallRecord]]:
    """Every row's ``call(i) -> tokens emitted`` on prompts 0..prompts-1, prompts outer and rows
    inner (drifts in machine speed hit every row alike); ``between()`` runs after each prompt's rows
    (the curve rounds, so the curves see the same machine as the calls)."""
    records = {label: [] for label, _ in rows}
    for i in range(prompts):
        say(f"prompt {i + 1}/{prompts}, {len(rows)} rows")
        for label, call in rows:
            timer.new_call()
            n = len(timer.passes)
            start = time.perf_counter()
            tokens = call(i)
            wall = time.perf_counter() - start
            records[label].append(CallRecord(wall, tokens, timer.passes[n:]))
        if between is not None:
            between()
    return records
