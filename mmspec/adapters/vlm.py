"""Transformers vision-language models (LLaVA, Qwen2-VL) as the core's ``Target``.

A VLM target is a text ``HFCausalLMTarget`` whose prompts carry images. The prompt is text ids
with the model's image placeholder token repeated once per image feature (as the model's own
processor writes it); the pixels are bound to the target beforehand with ``bind_images``. The first
pass on every fresh cache (the core's prefill, or a draft runner's first feed when the same view
also drafts) runs the vision tower and scatters its features into the placeholder embeddings, as
the model's own ``forward`` does. Every later pass is plain text.

Positions. LLaVA's language model uses 1-D RoPE over all tokens, image tokens included, so the
core's positions are the model's. Qwen2-VL uses 3-D M-RoPE: its ``get_rope_index`` gives an image's
tokens (temporal, height, width) grid ids starting at the text position before it, and the text
after an image continues from ``max(image ids) + 1``, so a prompt's largest position is smaller
than its length. The prefill computes the prompt's ids with ``get_rope_index`` and keeps, per
cache row, ``rope_deltas = max(prompt ids) + 1 - prompt length`` (transformers' own quantity);
every later token at core position ``p`` (its number of valid slots, holes excluded) gets the same
id ``p + rope_deltas`` on all three axes. Right padding is harmless: pads are text, so they leave
the valid tokens' ids and the row's delta unchanged, and the core truncates them from the cache.

Limits: images only (no Qwen2-VL video inputs); the placeholder count is checked by the model, so a
fresh cache's first pass must hold exactly the bound images' placeholders (a draft runner's first
feed includes the first generated token: should the model generate its image token there, that
pass fails).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration

from ..core.errors import check
from ..core.types import ModelOutput
from .hf import HFCacheAdapter, HFCausalLMTarget

__all__ = ["VLMTarget"]

_SUPPORTED = (LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration)


class _VLMCache(HFCacheAdapter):
    """An ``HFCacheAdapter`` that remembers each row's M-RoPE offset (Qwen2-VL)."""

    rope_deltas: torch.Tensor | None = None  # (B, 1), set by the first pass


class VLMTarget(HFCausalLMTarget):
    """``LlavaForConditionalGeneration`` or ``Qwen2VLForConditionalGeneration`` as a ``Target``
    over the model's text vocabulary; ``hidden`` is the language model's last hidden state (after
    its final norm: the LM head's input, EAGLE's feature). After a prefill, ``prompt_embeds``
    holds the prompt's merged input embeddings (B, S, H), image features at the placeholders.

    Bind the images of a batch with ``bind_images`` before ``SpeculativeDecoder.generate``: they
    stay bound, and every fresh cache's first pass consumes them, until rebound or ``clear_images``.
    """

    def __init__(self, model):
        check(isinstance(model, _SUPPORTED), "model",
              "a vision-language model: " + " or ".join(c.__name__ for c in _SUPPORTED), type(model).__name__)
        super().__init__(model)
        self.image_token_id = model.config.image_token_id
        self.mrope = isinstance(model, Qwen2VLForConditionalGeneration)
        self.image_inputs: dict[str, torch.Tensor] = {}
        # the merged input embeddings of the last fresh-cache pass (image features scattered into
        # the placeholders): what a vision-aware draft (mmspec.models.vlm_draft) reads
        self.prompt_embeds: torch.Tensor | None = None
        self._capture = False
        model.model.language_model.register_forward_pre_hook(self._capture_embeds, with_kwargs=True)

    def _capture_embeds(self, module, args, kwargs):
        if self._capture:
            self.prompt_embeds = kwargs["inputs_embeds"].detach()

    def bind_images(self, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None = None,
                    **vision_kwargs) -> None:
        """Bind the pixels of the prompts' images, in prompt order (row 0's images first).

        Args:
            pixel_values: what the model's image processor returns: LLaVA (images, C, H, W),
                Qwen2-VL (patches, C * T * P * P). ``None`` binds no images (text-only prompts).
            image_grid_thw: Qwen2-VL's (images, 3) patch grids; required for Qwen2-VL, refused
                for LLaVA.
            vision_kwargs: passed to the model's forward on the prefill (e.g. LLaVA's
                ``vision_feature_layer``, ``image_sizes``).
        """
        if pixel_values is None:
            check(image_grid_thw is None and not vision_kwargs, "image_grid_thw and vision_kwargs",
                  "nothing when pixel_values is None", sorted(vision_kwargs) or "image_grid_thw")
            self.image_inputs = {}
            return
        check(isinstance(pixel_values, torch.Tensor), "pixel_values", "a tensor", type(pixel_values).__name__)
        if self.mrope:
            check(isinstance(image_grid_thw, torch.Tensor) and image_grid_thw.dim() == 2
                  and image_grid_thw.shape[1] == 3, "image_grid_thw", "an (images, 3) tensor for Qwen2-VL",
                  None if image_grid_thw is None else tuple(image_grid_thw.shape))
            vision_kwargs = dict(vision_kwargs, image_grid_thw=image_grid_thw.to(self.device))
        else:
            check(image_grid_thw is None, "image_grid_thw", "None for LLaVA", "a tensor")
        self.image_inputs = dict(vision_kwargs, pixel_values=pixel_values.to(self.device, self.model.dtype))

    def clear_images(self) -> None:
        self.image_inputs = {}

    def new_cache(self, batch_size: int, max_len: int) -> _VLMCache:
        return _VLMCache(DynamicCache(config=self.model.config), batch_size, self.device)

    @torch.no_grad()
    def __call__(self, tokens, positions, cache, tree_mask=None) -> ModelOutput:
        if self.mrope:
            if cache.rope_deltas is None:  # the prompt pass: ids from the model's own rule
                positions, cache.rope_deltas = self._prompt_rope(tokens)
            else:  # text only: the same id on the three axes, shifted per row
                positions = (positions + cache.rope_deltas).expand(3, *positions.shape)
        return super().__call__(tokens, positions, cache, tree_mask)

    def forward(self, tokens: torch.Tensor, **model_kwargs) -> ModelOutput:
        fresh = model_kwargs["past_key_values"].get_seq_length() == 0
        images = self.image_inputs if fresh else {}
        self._capture = fresh
        try:
            out = self.model(input_ids=tokens, output_hidden_states=True, **images, **model_kwargs)
        finally:
            self._capture = False
        return ModelOutput(logits=out.logits.float(), hidden=out.hidden_states[-1])

    def _prompt_rope(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(3, B, T) M-RoPE ids of whole prompts and the (B, 1) offsets of the text after them."""
        grid = self.image_inputs.get("image_grid_thw")
        kinds = (tokens == self.image_token_id).int()  # text 0, image 1 (no video)
        return self.model.model.get_rope_index(tokens, image_grid_thw=grid if kinds.any() else None,
                                               mm_token_type_ids=kinds)
