"""Transformers causal LMs as the core's ``Target``, on a static cache with one length per row.

The keys and values live in the core's ``StaticKVCache`` (preallocated ``max_len`` slots per row,
each row writing its next block at its own length, gpt-fast's ``input_pos`` write); a transformers
``Cache`` whose layers write into and read from those buffers is what the model is handed. Rows
that keep different numbers of tokens (unequal prompts, unequal acceptances) need neither padding
nor compaction, and a pass reads nothing from the device: the core's calls (``keep_block``,
``truncate``) move per-row lengths on the device, and every forward gets a 4-D additive attention
mask that shows each query the slots below its row's block and the block by the tree mask
(``mmspec.core.cache.visibility_mask``); a prompt pass into an empty cache may ask for none
(``open_block(causal_prompt=True)``, the VLM adapter's): its mask is the plain causal one, which
transformers' SDPA then applies as ``is_causal``, with the same result (bit for bit, tested).
With static shapes (``mmspec.core.shapes``: off the CPU, or compiled steps) the mask spans the
whole buffer, so every pass has one shape per block width; on the CPU the key range ends at the
longest row (one host read per forward).

Keys are cached after RoPE (the model rotates them before ``Cache.update``), so the core cache
holds them as given, with no rotation of its own. transformers 5.x returns a user-supplied 4-D
mask unchanged (``masking_utils._preprocess_mask_arguments``) and both "eager" and "sdpa"
attention add it to the scores, so those two implementations are supported; FlashAttention kernels
take no such mask.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..core.cache import StaticKVCache
from ..core.errors import check
from ..core.types import ModelOutput

__all__ = ["HFCacheAdapter", "HFCausalLMTarget"]


class _CoreLayer(CacheLayerMixin):
    """One transformers cache layer whose keys and values are a layer of the adapter's buffers."""

    is_compileable = True
    is_sliding = False

    def __init__(self, adapter: "HFCacheAdapter", index: int):
        super().__init__()
        self.adapter, self.index = adapter, index
        self.keys, self.values = adapter.k[index], adapter.v[index]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated by the adapter
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.adapter._store(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.adapter.causal_length or self.adapter.max_len, 0

    def get_seq_length(self) -> int:
        """The longest row's length (a host read: the adapter always passes positions itself)."""
        return int(self.adapter.lengths.max())

    def get_max_length(self) -> int:
        return self.adapter.max_len


class _CoreCache(Cache):
    """The transformers ``Cache`` the model is handed: one ``_CoreLayer`` per layer."""

    def __init__(self, adapter: "HFCacheAdapter", num_layers: int):
        super().__init__(layers=[_CoreLayer(adapter, i) for i in range(num_layers)])
        self.adapter = adapter

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0 on a causal prompt pass (``HFCacheAdapter.open_block(causal_prompt=True)``), where
        transformers builds the mask itself; the longest row's length otherwise."""
        return 0 if self.adapter.causal_length else super().get_query_offset(layer_idx)

    @property
    def prompt_pass(self) -> bool:
        """Whether the forward running on it is the cache's first (what compiled steps keep eager,
        ``pipelines.vlm``)."""
        return self.adapter.passes == 1


class HFCacheAdapter(StaticKVCache):
    """A ``StaticKVCache`` (its decoder-facing calls, buffers and static-shape policy) handed to a
    transformers model as ``cache``: a ``Cache`` whose layers write into and read from its
    buffers. Keys arrive rotated, so the cache applies no RoPE of its own.

    Args:
        config: the model's config (its text config gives layers, key/value heads and head size).
        batch_size: rows.
        max_len: slots per row (prompt, answer and the widest block); a write past it raises
            (at the write, or with static shapes at the decode's end: ``check_overflow``).
        dtype: of the keys and values (the model's).
        device: where they live (the model's).
    """

    per_call: tuple[str, ...] = ()
    """Attributes a subclass sets on the prompt pass; ``reset`` clears them."""

    def __init__(self, config, batch_size: int, max_len: int, dtype=torch.float32, device=None):
        text = config.get_text_config()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        super().__init__(text.num_hidden_layers, batch_size, heads, head_dim, max_len, rope=None, dtype=dtype,
                         device=device)
        self.cache = _CoreCache(self, text.num_hidden_layers)
        self.passes = 0  # forwards so far (host): the first is the prompt pass
        self._block = None
        self.causal_length = None  # the block's length while a causal prompt pass runs without a mask

    @property
    def fresh(self) -> bool:
        """No forward has run on this cache yet (the next is the prompt pass)."""
        return self.passes == 0

    def open_block(self, positions: torch.Tensor, tree_mask: torch.Tensor | None = None,
                   dtype=torch.float32, causal_prompt: bool = False) -> torch.Tensor | None:
        """Open a block at ``positions`` (B, T) past each row's length (``StaticKVCache.step``):
        returns its (B, 1, T, S) additive mask (0 where visible, the dtype's min elsewhere, so no
        softmax row is all -inf); the model's layers then store the block through ``cache``.

        ``causal_prompt``: where the block is the prompt pass of an empty cache without static
        shapes and without a tree mask, every row's mask is the plain causal one over the block's
        own T slots; then None is returned, so transformers builds the mask itself and its SDPA
        runs with ``is_causal``: PyTorch's flash kernel then skips the blocks above the diagonal
        instead of adding a dense mask to them, with the same logits and keys bit for bit
        (``tests/test_vlm_adapter.py``)."""
        first = self.passes == 0
        self._block = self.step(positions, tree_mask)
        self.passes += 1
        seen = self._block.mask
        T = positions.shape[1]
        plain = causal_prompt and first and tree_mask is None and not self.static and seen.shape[-1] == T
        self.causal_length = T if plain else None
        if plain:
            return None
        return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)

    def _store(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        check(self._block is not None, "the cache", "opened with open_block() before the model's forward",
              "not opened")
        check(keys.shape[1] == self.k.shape[2] and keys.shape[3] == self.k.shape[4], "the model's keys",
              f"{self.k.shape[2]} heads of {self.k.shape[4]} (from the model's config)",
              f"{keys.shape[1]} heads of {keys.shape[3]}")
        _, k, v = self._update(self._block, layer, None, keys, values)
        return k, v

    def load_row(self, row: int, other: "HFCacheAdapter", other_row: int) -> None:
        """``StaticKVCache.load_row``; refused where a prompt pass set per-row state (``per_call``:
        Qwen2-VL's M-RoPE offsets, Emu3's wrapper position, GLM-Image's rotary tables), which this
        copy does not carry (continuous batching supports the families without it, e.g. LLaVA)."""
        for name in self.per_call:
            check(getattr(self, name) is None and getattr(other, name) is None, "the target",
                  f"a model whose prompt pass sets no per-row state for continuous batching ({type(self).__name__}"
                  f" keeps {name!r} from its prompt pass, not carried between caches)", name)
        super().load_row(row, other, other_row)

    def reset(self) -> None:
        """Empty the cache for a new call, keeping its buffers (pooled by compiled steps)."""
        super().reset()
        self.passes = 0
        self._block = None
        self.causal_length = None
        for name in self.per_call:  # what a subclass read from the prompt pass
            setattr(self, name, None)


class HFCausalLMTarget:
    """A transformers causal LM (``LlamaForCausalLM`` and kin) as the core's ``Target``.

    ``hidden`` is the base model's last hidden state (for Llama-style models, after the final
    norm: the LM head's input; the causal LM's ``hidden_states[-1]``). Needs
    ``attn_implementation`` "eager" or "sdpa" and full attention in every layer: a sliding window
    would also have to be in the mask.
    """

    cache_class = HFCacheAdapter

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
        """An empty static cache of ``max_len`` slots per row, in the model's dtype."""
        return self.cache_class(self.model.config, batch_size, max_len, self.model.dtype, self.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: HFCacheAdapter,
                 tree_mask: torch.Tensor | None = None) -> ModelOutput:
        mask = cache.open_block(positions, tree_mask, self.model.dtype)  # (B, 1, T, S)
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
