"""Helpers of the sampled half of the method contract (``tests/test_method_contract.py``): the
target's exact law over a pipeline's first generated tokens, its chi-square test, the broken rule
every modality's control registers, and the tiny random VLM pipeline the VLM cases sample from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mmspec.core import SpeculativeSampling
from mmspec.core.types import Acceptance
from mmspec.core.exactness import chisquare_pvalue

MIN_EXPECTED = 0.5
"""A prefix whose expected count is below this is not expanded: every continuation of it would be
pooled by the chi-square test anyway (cells expecting < 5), so its mass goes to one exact cell."""


@dataclass
class Law:
    """The exact law of a pipeline's first ``n_tokens`` generated tokens: ``cells`` maps each
    answer prefix (its first ``n_tokens`` tokens, or fewer ending in ``eos``) to its probability;
    ``pruned`` holds the prefixes not expanded, whose total mass is the cell ``()``."""

    cells: dict[tuple[int, ...], float]
    pruned: set[tuple[int, ...]]
    n_tokens: int
    eos: int | None = None

    def cell(self, tokens: Sequence[int]) -> tuple[int, ...] | None:
        """The cell an answer falls in; ``None`` outside the target's support."""
        key = list(tokens)[: self.n_tokens]
        if self.eos is not None and self.eos in key:
            key = key[: key.index(self.eos) + 1]
        key = tuple(key)
        if any(key[:k] in self.pruned for k in range(len(key) + 1)):
            return ()
        return key if key in self.cells else None

    def pvalue(self, answers: Sequence[Sequence[int]]) -> float:
        """Pearson chi-square p-value of the answers' cells against the law (cells expecting fewer
        than 5 samples pooled, ``chisquare_pvalue``); an answer outside the support gives 0."""
        order = {c: i for i, c in enumerate(self.cells)}
        seen = [order.get(self.cell(a), -1) for a in answers]
        if min(seen) < 0:
            return 0.0
        probs = torch.tensor(list(self.cells.values()), dtype=torch.float64)
        return chisquare_pvalue(torch.tensor(seen), probs / probs.sum())


def exact_law(score: Callable[[list[tuple[int, ...]]], torch.Tensor], n_tokens: int, n_samples: int,
              eos: int | None = None) -> Law:
    """The target's exact law of its first ``n_tokens`` generated tokens, by enumeration.

    ``score(prefixes) -> (len(prefixes), V)``: the processed target's next-token probabilities
    after each prefix of generated tokens (a full forward per prefix, no cache). A prefix ending in
    ``eos`` is a finished answer, a cell of its own. A prefix expecting fewer than
    ``MIN_EXPECTED`` of ``n_samples`` samples is not expanded: its mass goes to the cell ``()``.
    """
    cells: dict[tuple[int, ...], float] = {(): 0.0}
    pruned: set[tuple[int, ...]] = set()
    open_ = {(): 1.0}
    for _ in range(n_tokens):
        keep = [p for p, m in open_.items() if m * n_samples >= MIN_EXPECTED]
        for p in set(open_) - set(keep):
            pruned.add(p)
            cells[()] += open_[p]
        if not keep:
            return Law(cells, pruned, n_tokens, eos)
        probs = score(keep).double().cpu()  # (len(keep), V)
        nxt = {}
        for prefix, row in zip(keep, probs):
            for t, pt in enumerate(row.tolist()):
                if pt > 0:
                    (cells if t == eos else nxt)[prefix + (t,)] = open_[prefix] * pt
        open_ = nxt
    cells.update(open_)
    return Law(cells, pruned, n_tokens, eos)


class NoResidual(SpeculativeSampling):
    """Broken: after a rejection the correction is drawn from p instead of the residual
    ``norm(max(p - q, 0))`` (token ids) or ``(p - q)^+ / (1 - beta)`` (densities)."""

    def reject(self, p, q, x):
        return p


class AcceptAll(SpeculativeSampling):
    """Broken (densities): every drafted token is accepted, then the bonus from the target."""

    def _chain_density(self, draft, p_all, generator):
        B, G = p_all.batch_shape[0], draft.tokens.shape[1]
        return Acceptance(path=torch.arange(G + 1).expand(B, G + 1), num_accepted=torch.full((B,), G),
                          next_token=p_all[:, G].sample(generator).token)


@dataclass(frozen=True)
class NoKnobs:
    """A part without knobs."""


# -- tiny pipelines -----------------------------------------------------------------------------------
def tiny_ar_pipeline(vocab_size: int = 12, grid_size: int = 3):
    """An AR image pipeline over a ``vocab_size``-code VQ and a ``grid_size**2``-token grid: a
    one-layer LlamaGen target and draft (4 classes, wide init so distributions are neither flat nor
    peaked) and random EAGLE and Medusa heads bound to the target."""
    from mmspec.models.eagle import EagleDraftHead
    from mmspec.models.llamagen import LlamaGenModel
    from mmspec.models.medusa import GridMedusaHeads
    from mmspec.models.vq import TinyVQModel
    from mmspec.pipelines import SpeculativeARImagePipeline

    def ar(seed):
        torch.manual_seed(seed)
        return LlamaGenModel(vocab_size=vocab_size, grid_size=grid_size, num_classes=4, dim=16, n_layers=1,
                             n_heads=2, mlp_hidden=32, initializer_range=0.5).eval()

    torch.manual_seed(0)
    vq = TinyVQModel(sample_size=4 * grid_size, block_out_channels=(8, 8, 8), codebook_size=vocab_size).eval()
    target = ar(1)
    eagle = EagleDraftHead.from_target(target).eval()
    medusa = GridMedusaHeads.from_target(target, num_heads=grid_size - 1).eval()
    with torch.no_grad():  # random heads: zero-initialised ones would all propose the root's argmax
        for p in [*eagle.parameters(), *medusa.parameters()]:
            p.normal_(0, 0.3)
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq, draft_model=ar(2), eagle_head=eagle,
                                      medusa_head=medusa)
    pipe.set_progress_bar_config(disable=True)
    return pipe


VLM_WORDS = ("<pad>", "<s>", "</s>", "<unk>", "<image>", "user", ":", "assistant", "what", "is", "this", "?", "a",
             "red", "blue", "circle", "square", "and")
VLM_QUESTION = "what is this ?"


def tiny_vlm_pipeline():
    """A VLM pipeline on a tiny random LLaVA (16x16 images: 4 image tokens; 18 words, EOS
    ``</s>``; matrices redrawn wide so answers vary), the processor's chat template of
    ``mmspec.models.vlm``, a noisy copy of the target as the draft VLM and random heads of every
    kind (eagle, specvlm, vispec, medusa)."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from mmspec.adapters.vlm import VLMTarget
    from mmspec.models.medusa import MedusaHeads
    from mmspec.models.vlm import CHAT_TEMPLATE, build_tokenizer
    from mmspec.models.vlm_draft import VLMDraftHead
    from mmspec.pipelines import SpeculativeVLMPipeline
    from tiny import noisy_copy, spread

    words = list(VLM_WORDS)
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8, projection_dim=16),
        text_config=dict(model_type="llama", vocab_size=len(words), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        image_token_index=words.index("<image>"), vision_feature_layer=-1, vision_feature_select_strategy="default",
        attn_implementation="sdpa")
    torch.manual_seed(0)
    target = spread(LlavaForConditionalGeneration(config), std=0.3)
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = 2, 0
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                image_mean=[0.5] * 3, image_std=[0.5] * 3, do_convert_rgb=True)
    processor = LlavaProcessor(image_processor=images, tokenizer=build_tokenizer(words), patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    view = VLMTarget(target)
    heads = {}
    for i, method in enumerate(("eagle", "specvlm", "vispec")):
        torch.manual_seed(0)
        head = VLMDraftHead.from_target(view, method=method, num_heads=4, intermediate_size=64, prune_ratio=2,
                                        pool_ratio=4, conv_ratio=4)
        heads[f"{method}_head"] = spread(head, std=0.3, seed=i).eval()
    torch.manual_seed(0)
    heads["medusa_head"] = spread(MedusaHeads.from_target(view, num_heads=3), std=0.3, seed=3).eval()
    pipe = SpeculativeVLMPipeline(target=target, processor=processor, draft_model=noisy_copy(target, 0.3).eval(),
                                  **heads)
    pipe.set_progress_bar_config(disable=True)
    return pipe
