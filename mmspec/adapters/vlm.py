"""Transformers vision-language models (LLaVA, Qwen2-VL, Qwen2.5-VL) as the core's ``Target``.

A VLM target is a text ``HFCausalLMTarget`` whose prompts carry images (and, for Qwen2-VL and
Qwen2.5-VL, videos). The prompt is text ids with the model's image placeholder token repeated once
per image feature, and its video placeholder token once per video feature (as the model's own
processor writes them); the pixels travel with the call as the decoder's ``conditioning`` and reach
the prompt pass only (the core's prefill, or a draft VLM's first feed). That pass runs the vision
tower and scatters its features into the placeholder embeddings, as the model's own ``forward``
does. Every later pass is plain text.

Positions. LLaVA's language model uses 1-D RoPE over all tokens, image tokens included, so the
core's positions are the model's. Qwen2-VL and Qwen2.5-VL use 3-D M-RoPE: the model's
``get_rope_index`` gives an image's or a video's tokens (temporal, height, width) grid ids starting
at the text position before it (a video's temporal ids step by ``tokens_per_second *
second_per_grid_ts`` on Qwen2.5-VL, by 1 on Qwen2-VL), and the text after it continues from that
start plus the grid's larger merged side, so a prompt's largest position is not its length minus
one. The prefill computes the prompt's ids with ``get_rope_index`` (token types text 0,
image 1, video 2) and keeps, per cache row, ``rope_deltas`` = the id ``get_rope_index`` gives a
text token right after the prompt, minus the prompt length; every later token at core position
``p`` (its length in the cache, padding excluded) gets the same id ``p + rope_deltas`` on all three
axes, as in the model's forward over the whole sequence, and as transformers' ``generate``
continues a prompt that ends with text. (The deltas ``get_rope_index`` returns, ``max(prompt ids)
+ 1 - prompt length``, are the same unless a video's temporal ids outrun the text after it.) Right
padding is harmless: pads are text, so they leave the valid tokens' ids and the row's delta
unchanged, and the core truncates them from the cache.

The prompt pass holds the prompts alone (a draft VLM's too: the core's draft runner gives the
conditioning to a pass over the prompts, as the target's prefill), so every placeholder id in it is
an image's or a video's and a generated placeholder id is text, as in transformers' ``generate``.

Limits: videos for Qwen2-VL and Qwen2.5-VL only (LLaVA refuses them); the prompt pass must hold
exactly as many image (video) placeholders as the images (videos) have features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration,
                          Qwen2VLForConditionalGeneration)

from ..core.errors import check
from ..core.types import ModelOutput
from .hf import HFCacheAdapter, HFCausalLMTarget

__all__ = ["VLMTarget"]

_MROPE = (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration)  # 3-D M-RoPE, image and video grids
_SUPPORTED = (LlavaForConditionalGeneration, *_MROPE)
_VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")  # the conditioning's video part


class _VLMCache(HFCacheAdapter):
    """An ``HFCacheAdapter`` that remembers each row's M-RoPE offset (Qwen2-VL, Qwen2.5-VL)."""

    rope_deltas: torch.Tensor | None = None  # (B, 1), set by the first pass
    per_call = ("rope_deltas",)


class VLMTarget(HFCausalLMTarget):
    """``LlavaForConditionalGeneration``, ``Qwen2VLForConditionalGeneration`` or
    ``Qwen2_5_VLForConditionalGeneration`` as a ``Target``
    over the model's text vocabulary; ``hidden`` is the language model's last hidden state (after
    its final norm: the LM head's input, EAGLE's feature).

    Images and videos are conditioning of the call, not state of the model: pass them to
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
        self.video_token_id = model.config.video_token_id if self.mrope else None
        self.language_model = model.model.language_model

    cache_class = _VLMCache

    def vision_inputs(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None, *,
                      pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                      second_per_grid_ts=None, **vision_kwargs) -> dict:
        """Check the prompts' images and videos (each in prompt order, row 0's first) and return
        them as the ``conditioning`` of a ``generate`` call.

        Args:
            pixel_values: what the model's image processor returns: LLaVA (images, C, H, W),
                Qwen2-VL / Qwen2.5-VL (patches, C * T * P * P). ``None``: no images.
            image_grid_thw: the (images, 3) patch grids; required for Qwen2-VL / Qwen2.5-VL, refused
                for LLaVA.
            pixel_values_videos: Qwen2-VL / Qwen2.5-VL only: what the model's video processor
                returns, (patches, C * T * P * P). ``None``: no videos.
            video_grid_thw: the (videos, 3) patch grids, required with ``pixel_values_videos``.
            second_per_grid_ts: Qwen2.5-VL only, optional: (videos,) seconds per temporal patch
                (the processor's; ``None``: 1 s, as the model's ``get_rope_index``).
            vision_kwargs: passed to the model's image features (LLaVA's ``vision_feature_layer``,
                ``image_sizes``, ...).
        """
        model = type(self.model).__name__
        conditioning = {}
        if pixel_values is None:
            check(image_grid_thw is None and not vision_kwargs, "image_grid_thw and vision_kwargs",
                  "nothing when pixel_values is None", sorted(vision_kwargs) or "image_grid_thw")
        elif self.mrope:
            self._check_patches(pixel_values, image_grid_thw, "pixel_values", "image_grid_thw", "images")
            conditioning = dict(vision_kwargs, image_grid_thw=image_grid_thw.to(self.device))
        else:
            check(isinstance(pixel_values, torch.Tensor), "pixel_values", "a tensor", type(pixel_values).__name__)
            check(image_grid_thw is None, "image_grid_thw", "None for LLaVA", "a tensor")
            conditioning = dict(vision_kwargs)
        if pixel_values is not None:
            conditioning["pixel_values"] = pixel_values.to(self.device, self.model.dtype)

        if pixel_values_videos is None:
            check(video_grid_thw is None and second_per_grid_ts is None, "video_grid_thw and second_per_grid_ts",
                  "None when pixel_values_videos is None", "video_grid_thw" if video_grid_thw is not None
                  else "second_per_grid_ts")
            return conditioning
        check(self.mrope, "pixel_values_videos", f"None for {model} (videos: Qwen2-VL, Qwen2.5-VL)", "a video")
        self._check_patches(pixel_values_videos, video_grid_thw, "pixel_values_videos", "video_grid_thw", "videos")
        conditioning.update(pixel_values_videos=pixel_values_videos.to(self.device, self.model.dtype),
                            video_grid_thw=video_grid_thw.to(self.device))
        if second_per_grid_ts is not None:
            check(isinstance(self.model, Qwen2_5_VLForConditionalGeneration), "second_per_grid_ts",
                  f"None for {model} (its video time steps are fixed)", second_per_grid_ts)
            seconds = torch.as_tensor(second_per_grid_ts, device=self.device)
            check(seconds.shape == video_grid_thw.shape[:1], "second_per_grid_ts",
                  f"one number per video ({video_grid_thw.shape[0]})", tuple(seconds.shape))
            conditioning["second_per_grid_ts"] = seconds
        return conditioning

    @staticmethod
    def _check_patches(pixels, grid, pixels_name: str, grid_name: str, what: str) -> None:
        """Qwen2-VL / Qwen2.5-VL: (n, 3) patch grids and as many patch rows as they hold."""
        check(isinstance(pixels, torch.Tensor) and pixels.dim() == 2, pixels_name,
              "a (patches, C * T * P * P) tensor", tuple(pixels.shape) if isinstance(pixels, torch.Tensor)
              else type(pixels).__name__)
        check(isinstance(grid, torch.Tensor) and grid.dim() == 2 and grid.shape[1] == 3, grid_name,
              f"an ({what}, 3) tensor", tuple(grid.shape) if isinstance(grid, torch.Tensor) else grid)
        patches = int(grid.prod(-1).sum())
        check(pixels.shape[0] == patches, pixels_name, f"{patches} patch rows ({grid_name}'s t * h * w, summed)",
              pixels.shape[0])

    @torch.no_grad()
    def __call__(self, tokens, positions, cache, tree_mask=None, **conditioning) -> ModelOutput:
        fresh = cache.fresh
        check(fresh or not conditioning, "conditioning", "given with the prompt pass only (a fresh cache)",
              sorted(conditioning))
        # (B, 1, T, S); given (3, B, T) M-RoPE ids, the block's shape is their first axis's
        mask = cache.open_block(positions[0] if positions.dim() == 3 else positions, tree_mask, self.model.dtype,
                                causal_prompt=True)  # a plain causal prompt pass: None, SDPA's is_causal
        embeds = self.input_embeds(tokens, **conditioning)  # first: it checks the placeholder counts
        if self.mrope and positions.dim() == 3:  # (3, B, T) ids given (a stream's, mmspec.adapters.vlm_stream)
            pass
        elif self.mrope:
            if cache.rope_deltas is None:  # the prompt pass: ids from the model's own rule
                positions, cache.rope_deltas = self._prompt_rope(tokens, conditioning)
            else:  # text only: the same id on the three axes, shifted per row
                positions = (positions + cache.rope_deltas).expand(3, *positions.shape)
        # the language model alone, as the VLM's forward calls it once the images are merged
        out = self.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                                  cache=cache.cache, use_cache=True)
        return self._score(out.last_hidden_state, prompt_embeds=embeds if fresh else None)

    def input_embeds(self, tokens: torch.Tensor, image_slots: torch.Tensor | None = None,
                     **conditioning) -> torch.Tensor:
        """(B, T, E) token embeddings with the images' and videos' features (``conditioning``, as
        ``vision_inputs`` returns it) scattered into their placeholders, as the model's forward does.
        ``image_slots`` (B, T) bool: which image placeholder ids are the images' (default: all; a
        training batch holding prompts and answers passes the prompts' only, since a generated
        placeholder id is text). Every video placeholder id is a video's."""
        embeds = self.model.get_input_embeddings()(tokens)
        videos = {k: conditioning.pop(k) for k in _VIDEO_KEYS if k in conditioning}
        if "pixel_values" in conditioning:
            images = self.model.model.get_image_features(**conditioning, return_dict=True).pooler_output
            slots = tokens == self.image_token_id if image_slots is None else image_slots
            embeds = self._scatter(embeds, slots, images, "pixel_values", "image")
        if videos:
            clips = self.model.model.get_video_features(videos["pixel_values_videos"], videos["video_grid_thw"],
                                                        return_dict=True).pooler_output
            embeds = self._scatter(embeds, tokens == self.video_token_id, clips, "pixel_values_videos", "video")
        return embeds

    @staticmethod
    def _scatter(embeds: torch.Tensor, slots: torch.Tensor, features, name: str, what: str) -> torch.Tensor:
        """``features`` (one (n_i, E) tensor per image or video) into the (B, T) ``slots``, in order."""
        feats = torch.cat(list(features), 0).to(embeds.device, embeds.dtype)  # (N, E)
        n = int(slots.sum())
        check(n == feats.shape[0], name, f"as many {what} features as the prompts' {n} {what} placeholders",
              feats.shape[0])
        return embeds.masked_scatter(slots[..., None].expand_as(embeds), feats)

    def _prompt_rope(self, tokens: torch.Tensor, conditioning: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(3, B, T) M-RoPE ids of whole prompts and the (B, 1) offsets of the text after them."""
        # token types as the model's processor writes them: text 0, image 1, video 2
        kinds = (tokens == self.image_token_id).int() + 2 * (tokens == self.video_token_id).int()
        grids = {k: conditioning[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                 if k in conditioning}
        # one more text column: the id the answer's first token gets (right pads are text: they lead to it too)
        positions, _ = self.model.model.get_rope_index(torch.cat([tokens, tokens[:, -1:]], 1),
                                                       mm_token_type_ids=F.pad(kinds, (0, 1)), **grids)
        return positions[..., :-1], positions[0, :, -1:] - tokens.shape[1]
