"""Image-token views of transformers' Emu3, Janus and Chameleon as the core's ``Target``.

A view's vocabulary is the image codebook: core ids ``0..K-1`` are VQ codebook indices (the ids the
model's VQ decoder takes), and its logits are the model's image-token scores in codebook order.
Emu3 with a grid ``width`` adds one more core id, ``K``, for its end-of-line token.

Prompts are text in the model's own vocabulary, *shifted past the view's vocabulary*: core id
``t >= vocab_size`` is model id ``t - vocab_size`` (``encode_prompt`` does the shift). The core never
samples such an id (it samples from ``0..vocab_size-1``), so a token's kind is its value alone: a
view keeps no per-row prompt lengths, and the same view serves as target and as draft, for CFG
rows of any prompt lengths.

Conditioning is text only; prompts with image placeholders (image understanding) are not supported.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import (ChameleonForConditionalGeneration, Emu3ForConditionalGeneration,
                          JanusForConditionalGeneration)

from ..core.errors import check, is_int
from ..core.types import ModelOutput
from .hf import HFCacheAdapter, HFCausalLMTarget

__all__ = ["ChameleonImageTarget", "Emu3ImageTarget", "ImageTokenTarget", "JanusImageTarget",
           "chameleon_prompts", "emu3_prompts", "image_target", "janus_prompts"]

_EMU3_BOI, _EMU3_WRAPPER = "<|image start|>", "<|image token|>"
_CHAMELEON_BOI = "<racm3:break>"


class ImageTokenTarget(HFCausalLMTarget):
    """A transformers image generator as a ``Target`` over its image codebook.

    Runs ``backbone`` (the decoder that returns ``last_hidden_state``) on ``embed(tokens)`` and
    returns ``score(hidden)``; subclasses define those two for their family.
    """

    def __init__(self, model, backbone, vocab_size: int):
        super().__init__(model)
        self.model_vocab_size = self.vocab_size
        self.backbone = backbone
        self.vocab_size = vocab_size

    def encode_prompt(self, prompts):
        """Model-vocabulary prompts, a (B, S) tensor or a list of sequences, -> core ids (same form)."""
        is_tensor = isinstance(prompts, torch.Tensor)
        seqs = [prompts] if is_tensor else [torch.as_tensor(p, dtype=torch.long) for p in prompts]
        bad = [s.tolist() for s in seqs if ((s < 0) | (s >= self.model_vocab_size)).any()]
        check(not bad, "prompts", f"ids of the model's vocabulary, in [0, {self.model_vocab_size})", bad[:1])
        return prompts + self.vocab_size if is_tensor else [(s + self.vocab_size).tolist() for s in seqs]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) core ids -> (B, T, H) input embeddings."""
        raise NotImplementedError

    def score(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) last hidden states -> (B, T, vocab_size) logits."""
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, **model_kwargs) -> ModelOutput:
        hidden = self.backbone(inputs_embeds=self.embed(tokens), **model_kwargs).last_hidden_state
        return ModelOutput(logits=self.score(hidden).float(), hidden=hidden)


class _LMHeadImageTarget(ImageTokenTarget):
    """Image tokens that are entries of the LM vocabulary (Emu3, Chameleon): core id ``c`` is model id
    ``image_token_ids[c]``, scored by the LM head."""

    def __init__(self, model, backbone, image_token_ids: Sequence[int]):
        super().__init__(model, backbone, len(image_token_ids))
        self.image_token_ids = torch.tensor(image_token_ids, dtype=torch.long, device=self.device)

    def embed(self, tokens):
        ids = torch.where(tokens >= self.vocab_size, tokens - self.vocab_size,
                          self.image_token_ids[tokens.clamp(max=self.vocab_size - 1)])
        return self.model.get_input_embeddings()(ids)

    def score(self, hidden):
        # the full head then a gather: the model's own logits at its own cost (generate() runs it too)
        return self.model.get_output_embeddings()(hidden)[..., self.image_token_ids]


class _GridCache(HFCacheAdapter):
    """An ``HFCacheAdapter`` that remembers each row's image-wrapper position (Emu3's EOL schedule)."""

    wrapper_pos: torch.Tensor | None = None  # (B,)
    per_call = ("wrapper_pos",)


class Emu3ImageTarget(_LMHeadImageTarget):
    """``Emu3ForConditionalGeneration``'s visual tokens (``<|visual token XXXXXX|>``, XXXXXX the
    codebook index).

    Args:
        model: the Emu3 model ("eager" or "sdpa" attention).
        width: the grid width W. When given, the view follows Emu3's own generation schedule
            (``Emu3PrefixConstrainedLogitsHelper``): after every W codes the only allowed token is
            the end-of-line token, core id ``K``, so a grid of H rows is ``H * (W + 1)`` tokens,
            each row ending in ``K``. Every prompt must then contain ``<|image token|>``; the
            schedule counts from its first occurrence, as Emu3's does, and is read from the first
            pass on each cache (the core's prefill, or a draft's first feed, sees whole prompts).
            The schedule knows no height: it does not emit Emu3's EOF/EOI after the last row, so
            ask for exactly ``H * (W + 1)`` tokens. ``None`` decodes a plain codebook stream
            without EOL tokens, a context Emu3 was not trained on.
    """

    def __init__(self, model, width: int | None = None):
        _check_model(model, Emu3ForConditionalGeneration)
        check(width is None or (is_int(width) and width >= 1), "width", "an int >= 1 or None", width)
        mapping = model.model.vocabulary_mapping
        ids = _codebook_ids(mapping.img2bpe, model.config.vq_config.codebook_size)
        if width is not None:  # the EOL token and the wrapper the schedule counts from
            ids.append(_special(mapping.vocab_map, "<|extra_200|>"))
            self.wrapper_id = _special(mapping.vocab_map, _EMU3_WRAPPER)
        super().__init__(model, model.model, ids)
        self.width = width
        self.cache_class = _GridCache
        self.codebook_size = model.config.vq_config.codebook_size

    @torch.no_grad()
    def __call__(self, tokens, positions, cache, tree_mask=None) -> ModelOutput:
        if self.width is None:
            return super().__call__(tokens, positions, cache, tree_mask)
        if cache.wrapper_pos is None:
            cache.wrapper_pos = self._wrapper_positions(tokens)
        out = super().__call__(tokens, positions, cache, tree_mask)
        # Emu3's offset of the token being predicted from the wrapper; EOL at every (W + 1)-th
        offset = positions + 1 - cache.wrapper_pos[:, None]  # (B, T)
        eol = (offset > 0) & (offset % (self.width + 1) == 0)
        is_eol = torch.arange(self.vocab_size, device=tokens.device) == self.codebook_size  # (V,)
        allowed = torch.where(eol[..., None], is_eol, ~is_eol)  # (B, T, V)
        # the dtype's min rather than -inf keeps the CFG merge finite
        return ModelOutput(out.logits.masked_fill(~allowed, torch.finfo(out.logits.dtype).min), out.hidden)

    def _wrapper_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        hit = tokens == self.vocab_size + self.wrapper_id
        check(bool(hit.any(1).all()), "input_ids",
              f"prompts that contain Emu3's image wrapper token {_EMU3_WRAPPER!r} when width is set",
              f"{int((~hit.any(1)).sum())} row(s) without it")
        return hit.to(torch.int8).argmax(1)  # the first occurrence


class ChameleonImageTarget(_LMHeadImageTarget):
    """``ChameleonForConditionalGeneration``'s image tokens (``IMGIMG...`` entries, ids from
    ``model.model.vocabulary_mapping``). transformers masks them out of the model's logits for text
    generation; the view scores them with the LM head directly and offers nothing else."""

    def __init__(self, model):
        _check_model(model, ChameleonForConditionalGeneration)
        ids = _codebook_ids(model.model.vocabulary_mapping.img2bpe, model.config.vq_config.num_embeddings)
        super().__init__(model, model.model, ids)


class JanusImageTarget(ImageTokenTarget):
    """``JanusForConditionalGeneration``'s image path: codebook ids are embedded with
    ``prepare_embeddings_for_image_generation`` (generation embeddings + aligner), prompt ids with
    the text embeddings, and every position is scored by ``generation_head``, as Janus's
    ``generate(generation_mode="image")`` does. A full image is
    ``model.config.vision_config.num_image_tokens`` tokens."""

    def __init__(self, model):
        _check_model(model, JanusForConditionalGeneration)
        super().__init__(model, model.model.language_model, model.config.vq_config.num_embeddings)

    def embed(self, tokens):
        is_code = tokens < self.vocab_size
        embeds = self.model.get_input_embeddings()((tokens - self.vocab_size).clamp(min=0))  # (B, T, H)
        embeds[is_code] = self.model.prepare_embeddings_for_image_generation(tokens[is_code]).to(embeds.dtype)
        return embeds

    def score(self, hidden):
        return self.model.model.generation_head(hidden)


def image_target(model, **options) -> ImageTokenTarget:
    """The image-token view of an Emu3, Janus or Chameleon model; ``options`` go to its class
    (``width`` for Emu3)."""
    _check_model(model, tuple(cls for cls, _ in _VIEWS))
    view = next(view for cls, view in _VIEWS if isinstance(model, cls))
    return view(model, **options)


def emu3_prompts(model, texts: Sequence[Sequence[int]], size_ids: Sequence[int],
                 negative: Sequence[int] = ()) -> tuple[list[list[int]], list[list[int]]]:
    """Emu3's text-to-image prompts, ``bos text <|image start|> H*W <|image token|>``, in the model's
    vocabulary: (cond, uncond), the uncond prompts with ``negative`` in place of the text.

    ``size_ids`` is the tokenised ``f"{H}*{W}"`` (Emu3's processor writes the grid size as text).
    """
    _check_model(model, Emu3ForConditionalGeneration)
    vocab = model.config.vocabulary_map
    boi, wrapper = (_special(vocab, name) for name in (_EMU3_BOI, _EMU3_WRAPPER))
    bos = _bos(model.config.get_text_config().bos_token_id)
    suffix = [boi, *size_ids, wrapper]
    return [[bos, *t, *suffix] for t in texts], [[bos, *negative, *suffix] for _ in texts]


def janus_prompts(model, texts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Janus's image-generation prompts, ``bos text <begin_of_image>``, in the model's vocabulary:
    (cond, uncond), the uncond prompts with every token but BOS and BOI replaced by the pad token,
    as Janus's ``generate(generation_mode="image")`` builds them. Token ids come from
    ``model.generation_config`` (``bos_token_id``, ``pad_token_id``,
    ``generation_kwargs["boi_token_id"]``)."""
    _check_model(model, JanusForConditionalGeneration)
    config = model.generation_config
    boi = (config.generation_kwargs or {}).get("boi_token_id")
    check(boi is not None, 'model.generation_config.generation_kwargs["boi_token_id"]', "set", boi)
    check(config.pad_token_id is not None, "model.generation_config.pad_token_id", "set", None)
    bos = _bos(config.bos_token_id)
    cond = [[bos, *t, boi] for t in texts]
    uncond = [[x if x in (bos, boi) else config.pad_token_id for x in p] for p in cond]
    return cond, uncond


def chameleon_prompts(model, texts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Chameleon image prompts, ``bos text <racm3:break>`` (its image-start token), in the model's
    vocabulary: (cond, uncond), the uncond prompts without text."""
    _check_model(model, ChameleonForConditionalGeneration)
    boi = _special(model.config.vocabulary_map, _CHAMELEON_BOI)
    bos = _bos(model.config.bos_token_id)
    return [[bos, *t, boi] for t in texts], [[bos, boi] for _ in texts]


_VIEWS = ((Emu3ForConditionalGeneration, Emu3ImageTarget), (JanusForConditionalGeneration, JanusImageTarget),
          (ChameleonForConditionalGeneration, ChameleonImageTarget))


def _check_model(model, cls) -> None:
    classes = cls if isinstance(cls, tuple) else (cls,)
    check(isinstance(model, classes), "model",
          "an image generator: " + " or ".join(c.__name__ for c in classes), type(model).__name__)


def _codebook_ids(img2bpe: dict[int, int], size: int) -> list[int]:
    """Model ids of codebook indices 0..size-1 from a family's ``img2bpe`` map."""
    check(sorted(img2bpe) == list(range(size)), "model.config.vocabulary_map",
          f"an image token for every codebook index 0..{size - 1}", f"{len(img2bpe)} image tokens")
    return [img2bpe[c] for c in range(size)]


def _special(vocab: dict[str, int] | None, name: str) -> int:
    check(vocab is not None and name in vocab, "model.config.vocabulary_map", f"a map with {name!r}", None)
    return vocab[name]


def _bos(bos: int | None) -> int:
    check(bos is not None, "the model's bos_token_id", "set", bos)
    return bos
