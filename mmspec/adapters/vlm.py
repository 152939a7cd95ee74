"""Transformers vision-language models (LLaVA, Qwen2-VL, Qwen2.5-VL) as the core's ``Target``.

A VLM target is a text ``HFCausalLMTarget`` whose prompts carry images. The prompt is text ids
with the model's image placeholder token repeated once per image feature (as the model's own
processor writes it); the pixels travel with the call as the decoder's ``conditioning`` and reach
the prompt pass only (the core's prefill, or a draft VLM's first feed). That pass runs the vision
tower and scatters its features into the placeholder embeddings, as the model's own ``forward``
does. Every later pass is plain text.

Positions. LLaVA's language model uses 1-D RoPE over all tokens, image tokens included, so the
core's positions are the model's. Qwen2-VL and Qwen2.5-VL use 3-D M-RoPE: the model's
``get_rope_index`` gives an image's tokens (temporal, height, width) grid ids starting at the text
position before it, and the text after an image continues from ``max(image ids) + 1``, so a
prompt's largest position is smaller than its length. The prefill computes the prompt's ids with
``get_rope_index`` and keeps, per cache row, ``rope_deltas = max(prompt ids) + 1 - prompt length``
(transformers' own quantity); every later token at core position ``p`` (its length in the cache,
padding excluded) gets the same id ``p + rope_deltas`` on all three axes. Right padding is harmless:
pads are text, so they leave the valid tokens' ids and the row's delta unchanged, and the core
truncates them from the cache.

The prompt pass holds the prompts alone (a draft VLM's too: the core's draft runner gives the
conditioning to a pass over the prompts, as the target's prefill), so every placeholder id in it is
an image's and a generated placeholder id is text, as in transformers' ``generate``.

Limits: images only (no video inputs, so Qwen2.5-VL's ``second_per_grid_ts``, a video's time
step, never enters ``get_rope_index``); the prompt pass must hold exactly as many placeholders as
the images have features.
"""

from __future__ import annotations

import torch
from transformers import (LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLForConditionalGeneration)

from ..core.errors import check
from ..core.types import ModelOutput
from .hf import HFCacheAdapter, HFCausalLMTarget

__all__ = ["VLMTarget"]

_MROPE = (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)  # 3-D M-RoPE, image grids
_SUPPORTED = (LlavaForConditionalGeneration, *_MROPE)


class _VLMCache(HFCacheAdapter):
    """An ``HFCacheAdapter`` that remembers each row's M-RoPE offset (Qwen2-VL, Qwen2.5-VL)."""

    rope_deltas: torch.Tensor | None = None  # (B, 1), set by the first pass
    per_call = ("rope_deltas",)


class VLMTarget(HFCausalLMTarget):
    """``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration`` or
    ``Qwen2_5_VLForConditionalGeneration`` as a ``Target``
    over the model's text vocabulary; ``hidden`` is the language model's last hidden state (after
    its final norm: the LM head's input, EAGLE's feature).

    Images are conditioning of the call, not state of the model: pass them to
    ``SpeculativeDecoder.generate(conditioning=target.vision_inputs(pixel_values, ...))``. The
    prompt pass (a fresh cache's first pass) runs the vision tower, scatters its features into the
    placeholder embeddings as the model's own ``forward`` does, and returns those merged input
    embeddings as ``ModelOutput.prompt_embeds`` (what vision-aware draft heads read). Every later
    pass is plain text.
    """

    def __init__(self, model):
        check(isinstance(model, _SUPPORTED), "model",
              "a vision-language model: " + " or ".join(c.__name__ for c in _SUPPORTED), type(model).__name__)
        super().__init__(model)
        self.image_token_id = model.config.image_token_id
        self.mrope = isinstance(model, _MROPE)
        self.language_model = model.model.language_model

    cache_class = _VLMCache

    def vision_inputs(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None = None,
                      **vision_kwargs) -> dict:
        """Check the prompts' images (in prompt order, row 0's first) and return them as the
        ``conditioning`` of a ``generate`` call.

        Args:
            pixel_values: what the model's image processor returns: LLaVA (images, C, H, W),
                Qwen2-VL / Qwen2.5-VL (patches, C * T * P * P). ``None``: text-only prompts.
            image_grid_thw: the (images, 3) patch grids; required for Qwen2-VL / Qwen2.5-VL, refused
                for LLaVA.
            vision_kwargs: passed to the model's image features (LLaVA's ``vision_feature_layer``,
                ``image_sizes``, ...).
        """
        if pixel_values is None:
            check(image_grid_thw is None and not vision_kwargs, "image_grid_thw and vision_kwargs",
                  "nothing when pixel_values is None", sorted(vision_kwargs) or "image_grid_thw")
            return {}
        check(isinstance(pixel_values, torch.Tensor), "pixel_values", "a tensor", type(pixel_values).__name__)
        if self.mrope:
            check(isinstance(image_grid_thw, torch.Tensor) and image_grid_thw.dim() == 2
                  and image_grid_thw.shape[1] == 3, "image_grid_thw",
                  f"an (images, 3) tensor for {type(self.model).__name__}",
                  None if image_grid_thw is None else tuple(image_grid_thw.shape))
            vision_kwargs = dict(vision_kwargs, image_grid_thw=image_grid_thw.to(self.device))
        else:
            check(image_grid_thw is None, "image_grid_thw", "None for LLaVA", "a tensor")
        return dict(vision_kwargs, pixel_values=pixel_values.to(self.device, self.model.dtype))

    @torch.no_grad()
    def __call__(self, tokens, positions, cache, tree_mask=None, **conditioning) -> ModelOutput:
        fresh = cache.fresh
        check(fresh or not conditioning, "conditioning", "given with the prompt pass only (a fresh cache)",
              sorted(conditioning))
        mask = cache.open_block(positions, tree_mask, self.model.dtype)  # (B, 1, T, S)
        if self.mrope:
            if cache.rope_deltas is None:  # the prompt pass: ids from the model's own rule
                positions, cache.rope_deltas = self._prompt_rope(tokens, conditioning.get("image_grid_thw"))
            else:  # text only: the same id on the three axes, shifted per row
                positions = (positions + cache.rope_deltas).expand(3, *positions.shape)
        embeds = self.input_embeds(tokens, **conditioning)
        # the language model alone, as the VLM's forward calls it once the images are merged
        out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                  cache=cache.cache, use_cache=True)
        return self._score(out.last_hidden_state, prompt_embeds=embeds if fresh else None)

    def input_embeds(self, tokens: torch.Tensor, image_slots: torch.Tensor | None = None,
                     **conditioning) -> torch.Tensor:
        """(B, T, E) token embeddings with the images' features (``conditioning``, as
        ``vision_inputs`` returns it) scattered into the placeholders, as the model's forward does.
        ``image_slots`` (B, T) bool: which placeholder ids are the images' (default: all; a
        training batch holding prompts and answers passes the prompts' only, since a generated
        placeholder id is text)."""
        embeds = self.model.get_input_embeddings()(tokens)
        if "pixel_values" not in conditioning:
            return embeds
        images = self.model.model.get_image_features(**conditioning, return_dict=True).pooler_output
        feats = torch.cat(list(images), 0).to(embeds.device, embeds.dtype)  # (N, E)
        slots = tokens == self.image_token_id if image_slots is None else image_slots
        check(int(slots.sum()) == feats.shape[0], "pixel_values",
              f"as many image features as the prompts' {int(slots.sum())} image placeholders", feats.shape[0])
        return embeds.masked_scatter(slots[..., None].expand_as(embeds), feats)

    def _prompt_rope(self, tokens: torch.Tensor, grid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(3, B, T) M-RoPE ids of whole prompts and the (B, 1) offsets of the text after them."""
        kinds = (tokens == self.image_token_id).int()  # text 0, image 1 (no video)
        return self.model.model.get_rope_index(tokens, image_grid_thw=grid if kinds.any() else None,
                                               mm_token_type_ids=kinds)
