"""Transformers causal LMs as the core's ``Target``, over a ``DynamicCache`` with per-row holes.

An HF cache has one sequence length for all rows, so rows that keep different numbers of tokens
(unequal prompts, unequal acceptances) leave *holes*: slots a row no longer uses. The adapter keeps
a validity mask over the slots and gives every forward a 4-D additive attention mask that hides
them. Keys are cached after RoPE, so a hole needs no position bookkeeping: a row's next position is
simply its number of valid slots.

transformers 5.x returns a user-supplied 4-D mask unchanged (``masking_utils.
_preprocess_mask_arguments``) and both "eager" and "sdpa" attention add it to the scores, so those
two implementations are supported; FlashAttention kernels take no such mask.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..core.cache import visibility_mask
from ..core.errors import check
from ..core.types import ModelOutput

__all__ = ["HFCacheAdapter", "HFCausalLMTarget"]


class HFCacheAdapter:
    """A transformers ``DynamicCache`` behind the decoder-facing calls of ``mmspec.core.cache``.

    ``valid`` (B, S) marks the slots each row still uses. Blocks are appended at the physical end;
    ``keep_block`` and ``truncate`` drop entries by marking them invalid and cropping the slots no
    row uses (always with a negative ``crop``: transformers 5.x rejects positive lengths). Holes
    cost memory and attention work, so both calls ``compact`` the cache whenever its physical
    length exceeds twice the longest row's logical length.
    """

    def __init__(self, cache: DynamicCache, batch_size: int, device=None):
        self.cache = cache
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        # whether some row has an invalid slot: kept on the host by the calls that already read
        # the device (truncate, keep_block, compact), so ``step`` needs no sync
        self.holes = False

    @property
    def seq_length(self) -> int:
        """Physical slots, holes included (the ``DynamicCache``'s length)."""
        return self.valid.shape[1]

    def next_positions(self) -> torch.Tensor:
        return self.valid.sum(1)

    def step(self, T: int, tree_mask: torch.Tensor | None = None, dtype=torch.float32) -> torch.Tensor:
        """Open a block of T slots: returns its (B, 1, T, S + T) additive mask and counts the slots
        as valid until ``keep_block`` or ``truncate`` decides. A causal block (no ``tree_mask``)
        on a cache with no holes gets ``None``: the model's own causal mask is the same
        visibility, and no mask is built.

        Visibility is ``visibility_mask``'s: the slots before the last ``R + T`` are visible where
        valid, the last ``R + T`` follow ``tree_mask`` (B, T, R + T) (causal when None). Hidden
        entries get the dtype's min rather than -inf, so no softmax row is ever all -inf.
        """
        B, S = self.valid.shape
        width = T if tree_mask is None else tree_mask.shape[-1]
        check(width <= S + T, "tree_mask", f"at most {S + T} wide (cached slots + block)", width)
        ends = torch.full((B,), S + T, device=self.valid.device)
        self.valid = torch.cat([self.valid, self.valid.new_ones(B, T)], 1)
        if tree_mask is None and not self.holes:
            return None  # a causal block on a cache with no holes: the model's own causal mask
        seen = visibility_mask(ends, T, S + T, tree_mask) & self.valid[:, None, None, :]  # (B, 1, T, S + T)
        mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
        return mask.masked_fill(~seen, torch.finfo(dtype).min)

    def truncate(self, lengths: torch.Tensor) -> None:
        """Keep each row's first ``lengths[b]`` valid slots (its positions below ``lengths[b]``)."""
        self.valid &= self.valid.cumsum(1) <= lengths.to(self.valid.device)[:, None]
        S = self.seq_length
        if S == 0:
            return
        slot = torch.arange(1, S + 1, device=self.valid.device)
        used, longest = torch.stack([(self.valid.any(0) * slot).max(), self.next_positions().max()]).tolist()
        self._crop(S - used)
        self.holes = bool((~self.valid).any())  # once per decode (the prompts' padding)
        self._maybe_compact(longest)

    def keep_block(self, block_size: int, idx: torch.Tensor | None, n: torch.Tensor) -> None:
        """Of the last ``block_size`` slots keep entries ``idx[b, :n[b]]`` (the first ``n[b]`` when
        ``idx`` is None) at the block's front; the block is cropped to ``max(n)`` slots and a row
        that kept fewer leaves holes."""
        B, S = self.valid.shape
        start = S - block_size
        kept = self.valid[:, :start].sum(1) + n
        m, longest, fewest = torch.stack([n.max(), kept.max(), n.min()]).tolist()
        if idx is not None:
            src = start + idx[:, :m].clamp(min=0)  # (B, m)
            for layer in self.cache.layers:
                for buf in (layer.keys, layer.values):  # (B, H, S, D)
                    index = src[:, None, :, None].expand(B, buf.shape[1], m, buf.shape[3])
                    buf[:, :, start:start + m] = buf.gather(2, index)
        self._crop(block_size - m)
        self.valid[:, start:] = torch.arange(m, device=n.device) < n[:, None]
        self.holes = self.holes or fewest < m
        self._maybe_compact(longest)

    def compact(self) -> None:
        """Move every row's valid slots to the front, in order, and crop the slots no row uses."""
        B, S = self.valid.shape
        order = (~self.valid).to(torch.int8).sort(dim=1, stable=True).indices  # (B, S) valid slots first
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(B, layer.keys.shape[1], S, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        self.valid = self.valid.gather(1, order)
        ends = self.next_positions()
        longest, shortest = torch.stack([ends.max(), ends.min()]).tolist()
        self._crop(S - longest)
        self.holes = shortest < longest  # every row's valid slots are a prefix now

    def _maybe_compact(self, longest: int) -> None:
        # a compaction copies the cache once, as every DynamicCache append already does
        if self.seq_length > 2 * longest:
            self.compact()

    def _crop(self, n_remove: int) -> None:
        if n_remove > 0:
            self.cache.crop(-n_remove)
            self.valid = self.valid[:, : self.seq_length - n_remove]


class HFCausalLMTarget:
    """A transformers causal LM (``LlamaForCausalLM`` and kin) as the core's ``Target``.

    ``hidden`` is the base model's last hidden state (for Llama-style models, after the final
    norm: the LM head's input; the causal LM's ``hidden_states[-1]``). Needs
    ``attn_implementation`` "eager" or "sdpa" and full attention in every layer: a sliding window
    would also have to be in the mask.
    """

    def __init__(self, model):
        config = model.config.get_text_config()
        impl = model.config._attn_implementation
        check(impl in ("eager", "sdpa"), "the model's attn_implementation",
              '"eager" or "sdpa" (the only ones that add a custom 4-D float mask)', impl)
        layer_types = getattr(config, "layer_types", None) or []
        window = getattr(config, "sliding_window", None)
        check(window is None and all(t == "full_attention" for t in layer_types), "the model's attention",
              "full attention in every layer (no sliding_window, no other layer_types)",
              {"sliding_window": window, "layer_types": sorted(set(layer_types))})
        for name in ("final_logit_softcapping", "logit_scale"):  # heads that do more than a linear map
            check(getattr(config, name, None) in (None, 1.0), f"the model's {name}", "None (a plain linear LM head)",
                  getattr(config, name, None))
        self.model = model
        self.vocab_size = config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, batch_size: int, max_len: int) -> HFCacheAdapter:
        """An empty cache; ``max_len`` is not needed, a ``DynamicCache`` grows as it goes."""
        return HFCacheAdapter(DynamicCache(config=self.model.config), batch_size, self.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HFCacheAdapter,
                 tree_mask: torch.Tensor | None = None) -> ModelOutput:
        mask = cache.step(tokens.shape[1], tree_mask, self.model.dtype)  # (B, 1, T, S + T)
        return self.forward(tokens, attention_mask=mask, position_ids=positions, cache=cache.cache, use_cache=True)

    def forward(self, tokens: torch.Tensor, **model_kwargs) -> ModelOutput:
        """Score (B, T) tokens; ``model_kwargs`` carry the mask, positions and cache. The one hook for
        subclasses that embed or score tokens another way (``mmspec.adapters.ar_image_hf``).

        Runs the base model and the LM head on its last hidden state (what the causal LM's own
        forward does), so ``hidden`` costs nothing: ``output_hidden_states`` would record every
        layer's output on every pass."""
        return self._score(self.model.base_model(input_ids=tokens, **model_kwargs).last_hidden_state)

    def _score(self, hidden: torch.Tensor, **extra) -> ModelOutput:
        """``ModelOutput`` of the last hidden state: float32 logits from the LM head."""
        logits = self.model.get_output_embeddings()(hidden)
        return ModelOutput(logits=logits.float(), hidden=hidden, **extra)
