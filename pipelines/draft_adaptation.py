"""Keep a VLM's draft head learning while it serves (online speculative decoding: Liu et al., 2024,
"Online Speculative Decoding"): the answers a pipeline emits are the target's own (every method
is lossless), so each served (prompt, image, answer) is a distillation example of exactly the
traffic the head drafts for. ``DraftAdaptation`` keeps them in a buffer and, every ``every``
answers, takes one AdamW step of the head's own distillation loss (``distill_loss``: the recipe's
EAGLE / SpecVLM / ViSpec / Medusa loss) on them, the target's features and logits recomputed in
one teacher-forced pass over the buffer.

What is emitted never changes: the target verifies every draft, so a better or worse head only
changes how many tokens each pass accepts (``tests/test_draft_adaptation.py`` holds adapted
answers equal to the target's alone). Runtime code: the loss and batches come from
``mmspec.models.vlm_distill``, which the training recipes share; nothing of ``mmspec.training``. The paper keeps the verify passes' distributions instead of
recomputing them; here the teacher pass is recomputed because a tree's verify passes hold
rejected branches and the core keeps no per-token features after a pass. Its cost is one
teacher pass over ``every`` answers and one optimizer step per update (``seconds`` holds each
update's wall time; ``mmspec bench adapt`` reports their sum beside the serving time).

Randomness: an update draws from torch's global generator only (SpecVLM's pruning and Gumbel
choices in training mode) and puts its state back, so what the pipeline samples is unchanged.
"""

from __future__ import annotations

import time

import torch

from ..core.errors import check, check_int, is_int
from ..models.vlm_distill import Rendered, collate_items, distill


class DraftAdaptation:
    """Online distillation of one draft head from served answers.

    Args:
        lr: AdamW learning rate (betas 0.9, 0.95, as the recipes).
        every: answers per update (the buffer's size).
        grad_clip: global gradient-norm clip per update (the recipes' 0.5).
        rollout_steps: ViSpec's anti-shortcut steps (``distill_loss``), 1 for the others.

    ``updates`` counts the steps taken, ``losses`` their losses, ``seconds`` their wall times,
    ``served`` the answers seen.
    """

    def __init__(self, lr: float = 1e-4, every: int = 8, grad_clip: float = 0.5, rollout_steps: int = 1):
        check(isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0, "lr", "a number > 0", lr)
        check(is_int(every) and every >= 1, "every", "an int >= 1 (answers per update)", every)
        check(isinstance(grad_clip, (int, float)) and grad_clip > 0, "grad_clip", "a number > 0", grad_clip)
        check_int(rollout_steps, "rollout_steps", 1)
        self.lr, self.every, self.grad_clip, self.rollout_steps = float(lr), every, float(grad_clip), rollout_steps
        self.buffer: list[Rendered] = []
        self.updates, self.served = 0, 0
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self._optimizers: dict[int, torch.optim.Optimizer] = {}

    def check_head(self, head) -> None:
        """A head the adaptation can train: float32 parameters."""
        dtypes = {p.dtype for p in head.parameters()}
        check(dtypes == {torch.float32}, "draft head", "float32 weights to adapt (load the pipeline in float32)",
              sorted(str(d) for d in dtypes))

    def observe(self, head, items: list[Rendered], pad_id: int) -> float | None:
        """Add served answers (prompt ids + answer ids, the prompt's images) for ``head`` (bound to
        its target); at ``every`` buffered, take one step and return its loss (else None)."""
        self.buffer.extend(items)
        self.served += len(items)
        if len(self.buffer) < self.every:
            return None
        return self.step(head, pad_id)

    def step(self, head, pad_id: int) -> float:
        """One AdamW step of ``head``'s distillation loss on the buffer, which is then emptied."""
        self.check_head(head)
        optimizer = self._optimizers.get(id(head))
        if optimizer is None:
            optimizer = self._optimizers[id(head)] = torch.optim.AdamW(head.parameters(), lr=self.lr,
                                                                       betas=(0.9, 0.95), weight_decay=0.0)
        began = time.perf_counter()
        rng = torch.get_rng_state()
        was_training = head.training
        try:
            head.train()
            with torch.enable_grad():
                logs = distill(head, *collate_items(self.buffer, pad_id), self.rollout_steps)
                optimizer.zero_grad(set_to_none=True)
                logs["loss"].backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), self.grad_clip)
                optimizer.step()
        finally:
            head.train(was_training)
            torch.set_rng_state(rng)
        self.buffer.clear()
        self.updates += 1
        self.losses.append(float(logs["loss"].detach()))
        self.seconds.append(time.perf_counter() - began)
        return self.losses[-1]
