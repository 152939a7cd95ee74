"""What a VLM draft head learns from, shared by the training recipes (``mmspec train vlm-eagle``,
...: ``mmspec.training.recipes.vlm_draft``) and serving-time adaptation
(``mmspec.pipelines.draft_adaptation``): a conversation as the target reads it (``Rendered``), a
right-padded batch of them (``collate_items``), the frozen target's teacher pass (``teacher``) and
the head's distillation loss on it (``distill``). Runtime code: it imports nothing of
``mmspec.training``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .medusa import MedusaHeads
from .vlm_draft import VLMDraftHead

if TYPE_CHECKING:
    from ..adapters.vlm import VLMTarget


@dataclass(frozen=True)
class Rendered:
    """A conversation as the target reads it: ``ids`` (the processor's, image placeholders
    expanded), ``answer`` (a bool per id: an assistant token a drafter predicts), ``vision``
    (what the processor returns for the image: ``pixel_values``, and ``image_grid_thw`` for
    Qwen2-VL / Qwen2.5-VL; empty for text only) and ``prompt_len`` (the ids before the first
    answer)."""

    ids: list[int]
    answer: list[bool]
    vision: dict
    prompt_len: int


VISION_KEYS = ("pixel_values", "image_grid_thw")


@torch.no_grad()
def teacher(target: VLMTarget, ids, mask, vision: dict, prompt_lens: torch.Tensor):
    """The target's features (last hidden, normed), merged input embeddings and logits over a
    right-padded batch (M-RoPE ids from the model's own ``get_rope_index`` for Qwen2-VL /
    Qwen2.5-VL, as its forward computes them). The images fill the placeholders before
    ``prompt_lens`` only: a placeholder id in an answer is text, as in decoding."""
    slots = (ids == target.image_token_id) & (torch.arange(ids.shape[1]) < prompt_lens[:, None])
    embeds = target.input_embeds(ids, image_slots=slots, **target.vision_inputs(**vision) if vision else {})
    positions = None
    if target.mrope:
        kinds = slots.int()
        grid = vision.get("image_grid_thw")
        positions, _ = target.model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid,
                                                         attention_mask=mask)
    hidden = target.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).last_hidden_state
    return hidden, embeds, target.model.lm_head(hidden)


def answer_mask(ids: torch.Tensor, prompt_lens, lengths: torch.Tensor) -> torch.Tensor:
    """(R, S) positions p whose next token p + 1 is an answer token, for rows whose answer runs
    from the prompt's end to the row's length (``collate_items``'s ``drafted`` for one-turn rows)."""
    p = torch.arange(ids.shape[1])
    starts = torch.as_tensor(prompt_lens)[:, None] - 1
    return (p >= starts) & (p <= lengths[:, None] - 2)


def collate_items(items: list[Rendered], pad_id: int) -> tuple:
    """``(ids, mask, vision, drafted, prompt_lens)``: right-padded ids and attention mask, the
    rows' images concatenated in row order, (R, S) the positions p whose next token p + 1 is an
    answer token (the drafted region) and (R,) where each row's prompt ends."""
    T = max(len(r.ids) for r in items)
    ids = torch.full((len(items), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    drafted = torch.zeros(len(items), T, dtype=torch.bool)
    for i, r in enumerate(items):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
        mask[i, : len(r.ids)] = 1
        drafted[i, : len(r.ids) - 1] = torch.tensor(r.answer[1:])
    keys = [k for k in VISION_KEYS if any(k in r.vision for r in items)]
    vision = {k: torch.cat([r.vision[k] for r in items if k in r.vision]) for k in keys}
    return ids, mask, vision, drafted, torch.tensor([r.prompt_len for r in items])


def distill(head: VLMDraftHead | MedusaHeads, ids, mask, vision, drafted, prompt_lens, rollout_steps: int) -> dict:
    """The head's ``distill_loss`` on a batch, its teacher (the frozen target) run on the fly; the
    heads read the images' placeholders within the prompts (``prompt_lens``), as in decoding."""
    feats, embeds, logits = teacher(head.target, ids, mask, vision, prompt_lens)
    return head.distill_loss(feats, ids, embeds, logits, prompt_lens, drafted, rollout_steps=rollout_steps)
