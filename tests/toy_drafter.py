"""A trained drafter in one file: the example of ``docs/guides/add-a-drafter.md``.

``toy`` drafts a chain for the AR image modality from a bigram table (the next token's logits
given the last token, one table lookup per draft token), trained by distilling the target's
next-token distribution after one token. Everything the rest of mmspec needs is declared here:

- the component class (``ToyBigramHead``, a diffusers ``ModelMixin``: saved and loaded as a
  pipeline component ``toy_head``);
- the drafter (``ToyBigramDrafter``, the core's ``Drafter`` protocol);
- the registration: a part with its ``Component`` and ``TrainingRecipe``, and the method ``toy``.

Importing this module registers it; pipelines, ``mmspec train ar-toy``, the demo's dropdown and
batch jobs then see it (``tests/test_one_file_method.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmspec import methods
from mmspec.core import DrafterBase, DraftTree, Tree
from mmspec.core.errors import check

MODALITY = "ar-image"


class ToyBigramHead(ModelMixin, ConfigMixin):
    """The next token's logits given the last token: a (V, V) table."""

    @register_to_config
    def __init__(self, vocab_size: int = 512):
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)  # (..., V)


class ToyBigramDrafter(DrafterBase):
    """A greedy chain of ``gamma`` tokens from the bigram table (deterministic drafts, q = 1)."""

    def __init__(self, head: ToyBigramHead, gamma: int):
        self.head, self.gamma, self.max_block = head, gamma, gamma + 1

    @torch.no_grad()
    def propose(self, state) -> DraftTree:
        B = state.batch_size
        x = state.tokens[torch.arange(B, device=state.tokens.device), state.lengths[:B] - 1]  # (B,) the roots
        drafts = []
        for _ in range(self.gamma):
            x = self.head(x.to(self.head.device)).argmax(-1).to(state.tokens.device)
            drafts.append(x)
        self.forwards += 1
        tokens = torch.stack(drafts, 1)  # (B, gamma)
        return DraftTree(tokens, Tree.chain(B, self.gamma, tokens.device))


@dataclass(frozen=True)
class ToyConfig:
    """The toy bigram drafter.

    Args:
        gamma: draft tokens per pass.
    """

    gamma: int = methods.knob(3, min=1)

    def __post_init__(self):
        methods.check_config(self)


def _bind(head: ToyBigramHead, components) -> ToyBigramHead:
    vocab = components["target"].vocab_size
    check(head.config.vocab_size == vocab, "toy_head", f"a ToyBigramHead over the target's {vocab} tokens",
          head.config.vocab_size)
    return head


def train_toy(out_dir, *, target: str | None, steps: int, batch_size: int, lr: float, seed: int,
              dataset_size: int, log_every: int = 50, log=print) -> dict:
    """Distil the target's next-token distribution after (class, token) into the table; writes a
    ``ToyBigramHead`` folder (fp16 safetensors and ``train_log.json``, atomically) and returns the
    log, with ``heldout_top1``: how often the table's argmax is the target's on held-out pairs."""
    from mmspec.models import load_checkpoint
    from mmspec.models.llamagen import LlamaGenModel
    from mmspec.training.recipes.common import save_atomically

    check(target is not None and Path(target).is_dir(), "target", "a LlamaGenModel folder (--target DIR)", target)
    t0 = time.perf_counter()
    model = load_checkpoint(LlamaGenModel, target).requires_grad_(False)
    V, C = model.vocab_size, model.config.num_classes
    g = torch.Generator().manual_seed(seed)
    classes = torch.randint(0, C, (dataset_size,), generator=g)
    tokens = torch.randint(0, V, (dataset_size,), generator=g)
    with torch.no_grad():  # (N, V): the target's next-token distribution after [class, token]
        prompts = torch.tensor(model.class_prompts(classes.tolist()))
        probs = model(torch.cat([prompts, tokens[:, None]], 1)).logits[:, -1].softmax(-1)
    held = max(1, dataset_size // 4)
    torch.manual_seed(seed)
    head = ToyBigramHead(vocab_size=V)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for step in range(steps):
        idx = held + torch.randint(0, dataset_size - held, (batch_size,), generator=g)
        loss = -(probs[idx] * head(tokens[idx]).log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            log(f"step {step + 1}: loss {loss.item():.4f}")
    with torch.no_grad():
        top1 = (head(tokens[:held]).argmax(-1) == probs[:held].argmax(-1)).float().mean().item()
    record = {"recipe": "ar-toy", "steps": steps, "seed": seed, "heldout_top1": top1,
              "wall_time_s": time.perf_counter() - t0}
    save_atomically(head, Path(out_dir), record)
    return record


COMPONENT = methods.Component("toy_head", ToyBigramHead, _bind, doc="the toy bigram table")
RECIPE = methods.TrainingRecipe(
    "ar-toy", train_toy, heldout_metric="heldout_top1",
    options=(("--target", str, None, "folder of the AR target (LlamaGenModel.save_pretrained)"),),
    defaults=dict(steps=200, batch_size=64, lr=0.05, dataset_size=2048),
    doc="the toy bigram drafter of tests/toy_drafter.py, distilled from an AR target")

methods.register_part(
    name="toy", kind="drafter", config=ToyConfig, requires=("toy_head",), traits=("deterministic",),
    build=lambda cfg, c: ToyBigramDrafter(c["toy_head"], cfg.gamma),
    doc="a bigram table drafting a greedy chain (the one-file drafter example)",
    modalities=(MODALITY,), component=COMPONENT, recipe=RECIPE)
methods.register_method("toy", doc="a bigram table's greedy chain; exact speculative sampling", modalities=(MODALITY,))
