"""transformers' ``GlmImageForConditionalGeneration`` (GLM-Image's AR prior) as the core's ``Target``.

The prior scores its ``vision_vocab_size`` image tokens with ``lm_head``, and generated ids are
fed back as ids of the same (text) embedding table, so core ids are model ids: the core samples
``0..vision_vocab_size-1`` (what diffusers' ``GlmImagePipeline`` samples from), prompts hold any
model ids.

Rotary positions are 3-D (temporal, height, width). The view mirrors the model's own generation:
the prompt's positions and the decode table come from ``GlmImageModel.get_rope_index`` (text
positions, then each target grid's row/column positions, the small preview grid first, then an
end marker), and a token at logical position ``p`` of a row whose prompt has ``L`` tokens gets
``table[p]``: the prompt's positions for ``p < L``, decode entry ``p - L`` after (clamped to the
last entry, as the model's replicate padding does). The table is built on the prefill from the
prompt's ``image_grid_thw`` and ``images_per_sample`` (the processor's outputs, passed as the
decode's ``conditioning``); a row's prompt ends with the image-start token, as the processor
writes it, which is how the prefill finds its length among right padding.

Text-to-image only: prompts with source images (``pixel_values``) are refused.
"""

from __future__ import annotations

import torch
from transformers import GlmImageForConditionalGeneration

from ..core import LogitsProcessor
from ..core.errors import check
from ..core.types import ModelOutput
from .hf import HFCacheAdapter, HFCausalLMTarget

__all__ = ["GlmImagePriorTarget", "prior_logits", "prior_prompts"]


class _RopeCache(HFCacheAdapter):
    """An ``HFCacheAdapter`` with each row's 3-D rotary table, set on the prefill."""

    rope_table: torch.Tensor | None = None  # (B, 3, P)
    per_call = ("rope_table",)


class GlmImagePriorTarget(HFCausalLMTarget):
    """The image-token prior of ``GlmImageForConditionalGeneration`` ("eager" or "sdpa" attention)."""

    cache_class = _RopeCache

    def __init__(self, model):
        check(isinstance(model, GlmImageForConditionalGeneration), "model", "a GlmImageForConditionalGeneration",
              type(model).__name__)
        super().__init__(model)
        self.vocab_size = model.config.text_config.vision_vocab_size
        self.backbone = model.model.language_model

    @property
    def tok_embeddings(self) -> torch.nn.Embedding:
        """The image tokens' input embeddings (GSD's latent proximity)."""
        return torch.nn.Embedding.from_pretrained(self.backbone.embed_tokens.weight[: self.vocab_size].detach())

    @torch.no_grad()
    def __call__(self, tokens, positions, cache: _RopeCache, tree_mask=None, *, image_grid_thw=None,
                 images_per_sample=None, pixel_values=None) -> ModelOutput:
        check(pixel_values is None, "pixel_values", "None: GLM-Image's prior view decodes text-to-image only",
              "source images")
        if cache.rope_table is None:
            cache.rope_table = self._rope_tables(tokens, image_grid_thw, images_per_sample)
        index = positions.clamp(max=cache.rope_table.shape[-1] - 1)  # (B, T)
        rope = cache.rope_table.gather(2, index[:, None, :].expand(-1, 3, -1)).transpose(0, 1)  # (3, B, T)
        mask = cache.open_block(positions, tree_mask, self.model.dtype)
        hidden = self.backbone(input_ids=tokens, attention_mask=mask, position_ids=rope, cache=cache.cache,
                               use_cache=True).last_hidden_state
        return self._score(hidden)

    def _rope_tables(self, tokens, image_grid_thw, images_per_sample) -> torch.Tensor:
        """(B, S) right-padded prompts -> (B, 3, P) rotary positions of every logical position."""
        check(image_grid_thw is not None, "conditioning", "the processor's image_grid_thw (the target grids)", None)
        B = tokens.shape[0]
        grids = (torch.split(image_grid_thw, images_per_sample.tolist()) if images_per_sample is not None
                 else [image_grid_thw] * B)
        check(len(grids) == B, "images_per_sample", f"{B} entries (one per prompt)", len(grids))
        start = tokens == self.model.config.image_start_token_id
        check(bool(start.any(1).all()), "input_ids",
              f"prompts ending with the image-start token {self.model.config.image_start_token_id}",
              f"{int((~start.any(1)).sum())} row(s) without it")
        lengths = (tokens.shape[1] - start.flip(1).to(torch.int8).argmax(1)).tolist()
        inner = self.model.model
        saved = inner._cached_decode_position_ids, inner._prefill_len
        tables = []
        try:
            for b in range(B):
                prompt, decode = inner.get_rope_index(tokens[b:b + 1, : lengths[b]], image_grid_thw=grids[b])[0], \
                    inner._cached_decode_position_ids
                check(decode is not None, "image_grid_thw", "the target grids of every prompt", grids[b])
                tables.append(torch.cat([prompt[:, 0], decode[0]], 1))  # (3, L + D)
        finally:  # get_rope_index caches the decode table on the model: leave the model as it was
            inner._cached_decode_position_ids, inner._prefill_len = saved
        width = max(t.shape[1] for t in tables)
        # the last entry repeated, as the model pads its decode tables
        return torch.stack([torch.nn.functional.pad(t[None].float(), (0, width - t.shape[1]), mode="replicate")[0]
                            for t in tables]).long().to(tokens.device)


def prior_prompts(inputs) -> tuple[list[list[int]], dict]:
    """The processor's (left-padded) batch -> unpadded prompts and the decode's ``conditioning``."""
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    rows = [row[m.bool()].tolist() for row, m in zip(ids, mask)] if mask is not None else ids.tolist()
    conditioning = {"image_grid_thw": inputs["image_grid_thw"]}
    if inputs.get("images_per_sample") is not None:
        conditioning["images_per_sample"] = inputs["images_per_sample"]
    return rows, conditioning


def prior_logits(model, do_sample: bool = True) -> LogitsProcessor:
    """The sampling ``model.generate(do_sample=...)`` applies, from ``model.generation_config``:
    temperature, top-k and top-p (greedy when ``do_sample`` is False). Other logits processors
    (repetition penalty, ...) are refused rather than silently dropped."""
    config = model.generation_config
    for name, neutral in (("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0), ("min_p", None),
                          ("typical_p", 1.0), ("epsilon_cutoff", 0.0), ("eta_cutoff", 0.0)):
        value = getattr(config, name, neutral)
        check(value in (neutral, None), f"generation_config.{name}", f"{neutral} (not supported by the prior view)",
              value)
    if not do_sample:
        return LogitsProcessor(temperature=0.0)
    # generate() fills unset fields with the global defaults (top_k 50)
    defaults = config._get_default_generation_params()
    def value(name):
        return getattr(config, name) if getattr(config, name) is not None else defaults.get(name)
    top_k = value("top_k") or None
    top_p = value("top_p") if value("top_p") not in (None, 1.0) else None
    temperature = value("temperature") if value("temperature") is not None else 1.0
    return LogitsProcessor(temperature=temperature, top_k=top_k, top_p=top_p)
