"""Vision-aware EAGLE draft heads for transformers VLM targets (``mmspec.adapters.vlm.VLMTarget``).

One module, three ways of showing the draft the image (``method``):

- ``"eagle"``: EagleVLM, the EAGLE-2 baseline of SpecVLM (Huang et al., 2025, "SpecVLM: Fast
  Speculative Decoding in Vision-Language Models"): the draft sees every image token; its input
  at an image position is the target's projector output there, paired with the target's feature
  as at text positions.
- ``"specvlm"``: SpecVLM's elastic visual compressor, dynamic-selection mode: a question-aware gate
  (its input: the mean image embedding and the mean target feature over the question) picks one
  branch per input, top-1 at inference and straight-through Gumbel-softmax in training:
  random pruning (``prune_ratio``), average pooling (``pool_ratio``), a learned strided
  convolution (``conv_ratio``), a ``resampler_queries``-query cross-attention resampler, or
  text-only (no visual tokens).
- ``"vispec"``: ViSpec's vision adaptor (Kang et al., 2025, "ViSpec: Accelerating Vision-Language
  Models with Vision-Aware Speculative Decoding"): ``vispec_queries`` learned queries attend over
  an image's embeddings; the first ``vispec_queries - 1`` outputs replace the image span, the last
  is the global image feature ``g``, joined to every text feature by ``img_fc([f; g])`` (initialised
  to ``[I | 0]``, so training starts as plain EAGLE).

Compressed visual tokens enter the decoder layer directly (bypassing ``fc``) at the *last*
positions of their image span, so every later entry keeps its original position (ViSpec's rule;
SpecVLM is silent on placement, and we use the same). The draft's KV cache then holds fewer slots
than the target's: ``_DraftCache`` maps positions to slots with a per-row offset.

The rest is EAGLE (Li et al., 2024), shared with the LlamaGen head in
``mmspec.models.eagle_base.EagleHead``: one Llama decoder layer over ``fc([embed(x_p); f_{p-1}])``,
the target's token embedding and LM head shared (borrowed at ``bind``, never saved), the
predicted feature ``f^_p`` turned into logits by the target's LM head. As in SpecVLM's EagleVLM
the layer keeps its input RMSNorm (EAGLE-1 drops it); ``input_norm=False`` drops it.
Features are the target's last hidden state after its final norm (``VLMTarget`` returns it).
"""

from __future__ import annotations

import math

import torch
from diffusers import ModelMixin  # noqa: F401  (diffusers finds a component's loader by base-class name here)
from diffusers.configuration_utils import register_to_config
from torch import nn
from torch.nn import functional as F

from ..core.cache import StaticKVCache
from ..core.errors import check, check_choice, check_int, is_int
from ..core.rope import Rope1D
from ..core.types import ModelOutput
from .eagle_base import EagleHead

METHODS = ("eagle", "specvlm", "vispec")
BRANCHES = ("prune", "pool", "conv", "resampler", "text")


def _square(n: int) -> int | None:
    s = math.isqrt(n)
    return s if s * s == n else None


class _QueryAttention(nn.Module):
    """``n`` learned queries, one non-causal multi-head attention over a set of vectors, no RoPE
    (ViSpec's ``ImgAdaptor``; SpecVLM's Q-Former-like resampler)."""

    def __init__(self, dim: int, heads: int, n: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Parameter(torch.randn(n, dim) * (dim // heads) ** -0.5)
        self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, dim) -> (n, dim)
        h = self.heads
        q = self.q.view(len(self.q), h, -1).transpose(0, 1)  # (h, n, d)
        k = self.k_proj(x).view(len(x), h, -1).transpose(0, 1)
        v = self.v_proj(x).view(len(x), h, -1).transpose(0, 1)
        y = F.scaled_dot_product_attention(q, k, v)  # (h, n, d)
        return self.o_proj(y.transpose(0, 1).reshape(len(self.q), -1))


class ElasticVisualCompressor(nn.Module):
    """SpecVLM's elastic visual compressor, dynamic selection: ``forward(image, gate_input)``
    returns one branch's tokens for one image span (N, dim) -> (n_branch, dim) and the branch id.

    Branch sizes for N tokens: prune keeps ``ceil(N / prune_ratio)`` (random in training, evenly
    strided at inference so drafts are reproducible), pool and conv work on the square token grid
    (``sqrt(ratio)`` windows; a non-square span is pooled as a 1 x N row), the resampler returns
    ``resampler_queries`` tokens, text-only none."""

    def __init__(self, dim: int, heads: int, prune_ratio: int, pool_ratio: int, conv_ratio: int,
                 resampler_queries: int):
        super().__init__()
        self.prune_ratio, self.pool_ratio = prune_ratio, pool_ratio
        self.conv_side = math.isqrt(conv_ratio)
        self.pool_side = math.isqrt(pool_ratio)
        self.conv = nn.Conv2d(dim, dim, self.conv_side, stride=self.conv_side)
        self.resampler = _QueryAttention(dim, heads, resampler_queries)
        self.gate = nn.Linear(2 * dim, len(BRANCHES))
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def gate_logits(self, image: torch.Tensor, question: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.cat([image.mean(0), question], -1))

    def branch(self, name: str, image: torch.Tensor, ratio: int | None = None) -> torch.Tensor:
        """One branch's tokens; ``ratio`` replaces the trained ratio of the parameter-free branches
        (prune: any int >= 1; pool: a square), as ``check_override`` allows."""
        N, D = image.shape
        if name == "text":
            return image[:0]
        if name == "prune":
            keep = math.ceil(N / (ratio or self.prune_ratio))
            if self.training:
                idx = torch.randperm(N, device=image.device)[:keep].sort().values
            else:
                idx = torch.linspace(0, N - 1, keep, device=image.device).round().long()
            return image[idx]
        if name == "resampler":
            return self.resampler(image)
        side = _square(N)
        grid = image.T.reshape(1, D, side, side) if side else image.T.reshape(1, D, 1, N)
        if name == "pool":
            pool_side = math.isqrt(ratio) if ratio else self.pool_side
            k = pool_side if side else (1, pool_side ** 2)
            out = F.avg_pool2d(grid, k, ceil_mode=True)
        else:
            if not side or side % self.conv_side:
                grid = F.pad(grid, (0, (-grid.shape[-1]) % self.conv_side, 0, (-grid.shape[-2]) % self.conv_side))
            out = self.conv(grid)
        return out.flatten(2)[0].T

    @staticmethod
    def check_override(branch: str, ratio: int) -> None:
        """An inference override of the gate: ``branch`` one of ``"gate"`` (the gate's own top-1
        choice, SpecVLM's dynamic selection) or ``BRANCHES``; ``ratio`` 0 (the trained ratio) or,
        for the parameter-free ``"prune"`` (an int >= 1) and ``"pool"`` (a square int), the
        compression to apply instead. The learned ``"conv"`` and ``"resampler"`` keep theirs."""
        check_choice("branch", branch, ("gate",) + BRANCHES)
        check_int(ratio, "ratio", 0)
        if ratio:
            check(branch in ("prune", "pool"), "ratio", "0 unless branch is 'prune' or 'pool' (the learned "
                  "branches and the gate's choice keep their trained ratios)", ratio)
            check(branch == "prune" or _square(ratio) is not None, "ratio",
                  "a square int (4, 16, 64, ...) for the 'pool' branch", ratio)

    def forward(self, image: torch.Tensor, question: torch.Tensor, hard_gumbel: bool,
                branch: str = "gate", ratio: int = 0) -> tuple[torch.Tensor, int]:
        if branch != "gate":
            return self.branch(branch, image, ratio), BRANCHES.index(branch)
        logits = self.gate_logits(image, question)
        if hard_gumbel:  # straight-through: the chosen branch is scaled by its (== 1) soft weight
            weights = F.gumbel_softmax(logits, tau=1.0, hard=True)
            choice = int(weights.argmax())
            return self.branch(BRANCHES[choice], image) * weights[choice], choice
        choice = int(logits.argmax())
        return self.branch(BRANCHES[choice], image), choice


class _DraftCache(StaticKVCache):
    """The head's KV cache: compressed prompts hold fewer slots than positions, so entry positions
    ``1 .. n`` occupy ``n - offset[r]`` slots of row r. ``plan`` is the prompt's visual part,
    prepared by ``VLMDraftHead.start`` and consumed by the first feed."""

    offset: torch.Tensor
    plan: dict | None = None

    def truncate(self, lengths: torch.Tensor) -> None:
        super().truncate((lengths.to(self.lengths) - self.offset).clamp(min=0))

    def load_row(self, row: int, other: "_DraftCache", other_row: int) -> None:
        """``StaticKVCache.load_row`` plus the row's slot offset and global image feature (the
        plan's, consumed by the first feed: ``other`` is fed already)."""
        check(other.plan is None and self.plan is None, "other", "a head cache whose first feed has run, as this "
              "one's (their plans consumed)", "planned")
        super().load_row(row, other, other_row)
        self.offset = self.offset.clone()
        self.offset[row] = other.offset[other_row]
        if getattr(other, "g", None) is not None:
            g = getattr(self, "g", None)
            self.g = other.g.new_zeros(self.batch_size, other.g.shape[-1]) if g is None else g.clone()
            self.g[row] = other.g[other_row]


class VLMDraftHead(EagleHead):
    """EAGLE draft head for a ``VLMTarget`` (see the module docstring for ``method``).

    Build with ``VLMDraftHead.from_target(vlm_target, method=...)``, or load a trained one with
    ``load_checkpoint(VLMDraftHead, path).bind(vlm_target)``; drive it with
    ``mmspec.core.EagleTreeDrafter(head, ...)``, which calls ``start`` after the target's prefill
    and ``forward`` for every feed.

    Args:
        method: ``"eagle"``, ``"specvlm"`` or ``"vispec"``.
        hidden_size, vocab_size, image_token_id: the target language model's (checked at ``bind``).
        num_heads, intermediate_size: the decoder layer's attention heads and SwiGLU width.
        rms_norm_eps, rope_theta: the layer's norm epsilon and 1-D rotary base.
        input_norm: keep the layer's input RMSNorm (SpecVLM's EagleVLM) or drop it (EAGLE-1).
        prune_ratio, pool_ratio, conv_ratio, resampler_queries: SpecVLM's branches (pool and
            conv ratios are squares: windows of sqrt(ratio) x sqrt(ratio) tokens).
        vispec_queries: ViSpec's queries per image (compressed tokens + 1 global feature).
        initializer_range: std of the normal init of the linear weights.
    """

    cache_class = _DraftCache
    target_kind, bind_hint = "VLM", "vlm_target"

    @register_to_config
    def __init__(self, method: str = "eagle", hidden_size: int = 192, vocab_size: int = 128,
                 image_token_id: int = 4, num_heads: int = 6, intermediate_size: int = 512,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, input_norm: bool = True,
                 prune_ratio: int = 16, pool_ratio: int = 16, conv_ratio: int = 4, resampler_queries: int = 2,
                 vispec_queries: int = 2, initializer_range: float = 0.02):
        check_choice("method", method, METHODS)
        for name, value in dict(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                intermediate_size=intermediate_size, prune_ratio=prune_ratio,
                                resampler_queries=resampler_queries).items():
            check_int(value, name, 1)
        check(hidden_size % num_heads == 0 and (hidden_size // num_heads) % 2 == 0, "num_heads",
              f"a divisor of hidden_size ({hidden_size}) leaving an even head dimension", num_heads)
        for name, value in dict(pool_ratio=pool_ratio, conv_ratio=conv_ratio).items():
            check(is_int(value) and value >= 1 and _square(value), name, "a square int >= 1 (4, 9, 16, ...)", value)
        check(is_int(vispec_queries) and vispec_queries >= 2, "vispec_queries",
              "an int >= 2 (compressed tokens + the global feature)", vispec_queries)
        H = hidden_size
        super().__init__(H, num_heads, intermediate_size, rms_norm_eps, Rope1D(H // num_heads, rope_theta),
                         input_norm, initializer_range)
        if method == "specvlm":
            self.compressor = ElasticVisualCompressor(H, num_heads, prune_ratio, pool_ratio, conv_ratio,
                                                      resampler_queries)
        if method == "vispec":
            self.adaptor = _QueryAttention(H, num_heads, vispec_queries)
            self.img_fc = nn.Linear(2 * H, H, bias=False)
            with torch.no_grad():  # [I | 0]: starts as plain EAGLE
                self.img_fc.weight.zero_()
                self.img_fc.weight[:, :H] = torch.eye(H)

    # -- binding ---------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, method: str = "eagle", **overrides) -> "VLMDraftHead":
        """A fresh head sized like one of ``target``'s (a ``VLMTarget``) language-model layers,
        stamped with it (``stamp``) and bound to it."""
        text = target.model.config.text_config
        args = dict(method=method, hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                    image_token_id=target.image_token_id, num_heads=text.num_attention_heads,
                    intermediate_size=text.intermediate_size, rms_norm_eps=text.rms_norm_eps)
        return cls(**{**args, **overrides}).stamp(target).bind(target)

    def _target_config(self, target) -> dict:
        text = target.model.config.text_config
        return dict(hidden_size=text.hidden_size, vocab_size=text.vocab_size, image_token_id=target.image_token_id)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.model.get_input_embeddings()(tokens).to(self.fc.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.target.model.lm_head
        return F.linear(hidden.to(head.weight.dtype), head.weight).float()

    # -- the visual part of a prompt -------------------------------------------------------------
    def plan(self, features: torch.Tensor, tokens: torch.Tensor, embeds: torch.Tensor, lengths: torch.Tensor,
             hard_gumbel: bool = False, question_ends: torch.Tensor | None = None,
             compression: tuple[str, int] = ("gate", 0)) -> dict:
        """What the prompt's images become, per row: ``spans`` [(start, end)] of image
        placeholders among positions < lengths[r], ``visual`` a list of (n, H) tensors (one per
        span: compressed tokens; for ``"eagle"`` the span's embeddings), ``g`` (R, H) the global
        image feature (zeros without images, or unless ``"vispec"``), ``branches`` the chosen
        SpecVLM branch per span (-1 elsewhere).

        features (R, S, H) the target's features, tokens (R, S), embeds (R, S, H) the target's
        merged input embeddings, lengths (R,) valid prompt lengths. ``question_ends`` (R,), default
        ``lengths``: where the question the SpecVLM gate reads ends (training passes the prompt
        lengths, so the gate never sees the answer: at inference it reads the prompt only).
        ``compression``: ``(branch, ratio)``, SpecVLM's gate overridden at inference
        (``ElasticVisualCompressor.check_override``); ``("gate", 0)`` lets the gate choose."""
        R, S, H = features.shape
        method = self.config.method
        is_image = tokens == self.config.image_token_id
        spans, visual, branches = [], [], []
        g = features.new_zeros(R, H)
        for r in range(R):
            n = int(lengths[r])
            row = is_image[r, :n].tolist()
            row_spans = []
            j = 0
            while j < n:
                if row[j]:
                    k = j
                    while k + 1 < n and row[k + 1]:
                        k += 1
                    row_spans.append((j, k))
                    j = k + 1
                else:
                    j += 1
            row_visual, row_branches = [], []
            last_image = max((b for _, b in row_spans), default=-1)
            q_end = n if question_ends is None else min(n, int(question_ends[r]))
            question = features[r, last_image + 1 : q_end].mean(0) if q_end > last_image + 1 else features.new_zeros(H)
            for a, b in row_spans:
                image = embeds[r, a : b + 1].to(self.fc.weight.dtype)
                if method == "eagle":
                    row_visual.append(image)
                    row_branches.append(-1)
                elif method == "specvlm":
                    out, choice = self.compressor(image, question.to(image.dtype), hard_gumbel, *compression)
                    row_visual.append(out)
                    row_branches.append(choice)
                else:
                    out = self.adaptor(image)
                    row_visual.append(out[:-1])
                    row_branches.append(-1)
                    g[r] = g[r] + out[-1].to(g.dtype)  # several images: their global features add
            spans.append(row_spans)
            visual.append(row_visual)
            branches.append(row_branches)
        return dict(spans=spans, visual=visual, g=g, branches=branches)

    def _text_inputs(self, features: torch.Tensor, tokens: torch.Tensor, g: torch.Tensor | None,
                     plan: dict | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``fc([embed(x_p); f_{p-1}])`` (ViSpec: ``f`` through ``img_fc([f; g])`` first). With an
        ``"eagle"`` plan, image placeholders at ``positions`` take their image embeddings."""
        f = features.to(self.fc.weight.dtype)
        if self.config.method == "vispec":
            f = self.img_fc(torch.cat([f, g[:, None].expand_as(f).to(f.dtype)], -1))
        emb = self.embed(tokens)
        if plan is not None and self.config.method == "eagle":
            emb = emb.clone()
            for r, (spans, visual) in enumerate(zip(plan["spans"], plan["visual"])):
                for (a, b), vis in zip(spans, visual):
                    cols = torch.nonzero((positions[r] >= a) & (positions[r] <= b)).flatten()
                    emb[r, cols] = vis[positions[r, cols] - a]
        return self.fuse(emb, f)

    def _merge(self, x: torch.Tensor, positions: torch.Tensor, plan: dict):
        """Entries of a first feed with the prompt's images compressed (``"specvlm"``,
        ``"vispec"``): x (R, W, H) text inputs at ``positions`` (R, W); each image span's entries
        are dropped and its compressed tokens enter at the span's last positions. Returns inputs
        (R, T, H) and positions (R, T) sorted by position and right-padded, the source column of
        each entry (-1: a compressed or pad entry) and the number of entries each row dropped."""
        R, W, H = x.shape
        rows = []
        for r in range(R):
            pos = positions[r]
            keep = torch.ones(W, dtype=torch.bool, device=x.device)
            extra_x, extra_pos = [], []
            for (a, b), vis in zip(plan["spans"][r], plan["visual"][r]):
                keep &= ~((pos >= a) & (pos <= b))
                c = min(len(vis), b - max(a, 1) + 1)  # entries start at position 1
                extra_x.append(vis[len(vis) - c :].to(x.dtype))
                extra_pos.append(torch.arange(b - c + 1, b + 1, device=x.device))
            cols = torch.nonzero(keep).flatten()
            all_x = torch.cat([x[r, keep], *extra_x], 0)
            all_pos = torch.cat([pos[keep], *extra_pos], 0)
            all_col = torch.cat([cols, *(torch.full_like(p, -1) for p in extra_pos)], 0)
            order = all_pos.argsort(stable=True)
            rows.append((all_x[order], all_pos[order], all_col[order]))
        T = max(len(p) for _, p, _ in rows)
        inputs = x.new_zeros(R, T, H)
        pos_out = positions.new_zeros(R, T)
        col_out = positions.new_full((R, T), -1)
        for r, (rx, rp, rc) in enumerate(rows):
            n = len(rp)
            inputs[r, :n], pos_out[r, :n], col_out[r, :n] = rx, rp, rc
            if n < T:  # pad entries continue the row's positions; they are cut before being seen
                pos_out[r, n:] = rp[-1] + 1 + torch.arange(T - n, device=x.device)
        offsets = torch.tensor([W - len(rp) for _, rp, _ in rows], device=x.device)
        return inputs, pos_out, col_out, offsets

    def _layer(self, x: torch.Tensor, positions: torch.Tensor, plan: dict | None, step_of) -> tuple:
        """The decoder layer over a block of W columns: straight for ``"eagle"`` or without a
        plan; compressed entries merged in otherwise, outputs scattered back to the W columns
        (zeros at dropped image columns). ``step_of(positions)`` gives the cache step (or None).
        Returns (hidden (R, W, H), offsets (R,))."""
        R, W, H = x.shape
        if plan is None or self.config.method == "eagle":
            return self.decoder_layer(x, positions, step_of(positions)), torch.zeros(R, dtype=torch.long, device=x.device)
        inputs, pos, cols, offsets = self._merge(x, positions, plan)
        h = self.decoder_layer(inputs, pos, step_of(pos))
        out = h.new_zeros(R, W + 1, H)  # column W absorbs compressed and pad entries
        index = torch.where(cols >= 0, cols, W)[..., None].expand(-1, -1, H)
        out.scatter_(1, index, h)
        return out[:, :W], offsets

    # -- drafting --------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int) -> _DraftCache:
        cache = super().new_cache(batch_size, max_len)
        cache.offset = torch.zeros(batch_size, dtype=torch.long, device=self.fc.weight.device)
        return cache

    def eager_for(self, features, tokens, positions, cache=None, tree_mask=None) -> bool:
        """Whether compiled steps (``SpeculativePipeline.enable_compiled_steps``) run this call
        eagerly: the first feed into a planned cache (the prompt's images, a shape of the call's)
        and the cache-free reference path."""
        return cache is None or cache.plan is not None

    def compressed(self, branch: str = "gate", ratio: int = 0) -> "VLMDraftHead | _Compressed":
        """This ``"specvlm"`` head drafting with its gate overridden (``branch``, ``ratio``: see
        ``ElasticVisualCompressor.check_override``): a view for ``EagleTreeDrafter`` that shares
        every weight; ``("gate", 0)`` returns the head itself. The override travels with the call,
        so views of one head with different overrides may draft at the same time."""
        ElasticVisualCompressor.check_override(branch, ratio)
        if (branch, ratio) == ("gate", 0):
            return self
        check(self.config.method == "specvlm", "branch", "'gate' for a head without SpecVLM's compressor "
              f"(method={self.config.method!r})", branch)
        return _Compressed(self, (branch, ratio))

    @torch.no_grad()
    def start(self, cache: _DraftCache, state, compression: tuple[str, int] = ("gate", 0)) -> None:
        """After the target's prefill: plan the prompt's images from the target's features
        (``state.prefill.hidden``), its merged input embeddings (``state.prefill.prompt_embeds``)
        and the prompt lengths, for the first feed to use (``compression``: ``plan``'s)."""
        self.target  # noqa: B018 -- a head drafts only once bound to its target (raises otherwise)
        embeds = state.prefill.prompt_embeds
        hidden = state.prefill.hidden
        check(embeds is not None and embeds.shape[:2] == hidden.shape[:2], "state.prefill",
              "a VLMTarget's prompt pass output (its prompt_embeds match its hidden states)", None)
        S = hidden.shape[1]
        cache.plan = self.plan(hidden, state.tokens[:, :S], embeds, state.prompt_lengths, compression=compression)
        cache.g = cache.plan["g"]

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                cache: _DraftCache | None = None, tree_mask: torch.Tensor | None = None) -> ModelOutput:
        """Entries ``(f_{p-1}, x_p)`` at positions p (``FeatureHead``): features (R, T, H), tokens
        (R, T), positions (R, T). The first feed into a cache that ``start`` planned applies the
        prompt's images (it must start at position 1 on the empty cache). Returns the predicted
        features ``hidden`` and ``logits`` (zeros at the columns of dropped image entries)."""
        if cache is None and tree_mask is not None:
            raise ValueError("tree_mask needs a cache: the reference path (cache=None) is causal")
        plan = None if cache is None else cache.plan
        g = getattr(cache, "g", None)
        if g is None:
            g = features.new_zeros(len(tokens), features.shape[-1])
        if plan is not None:
            check(bool((positions[:, 0] == 1).all()) and int(cache.lengths.max()) == 0, "positions",
                  "the first feed into a planned cache: positions starting at 1 on an empty cache",
                  positions[:, 0].tolist())
        x = self._text_inputs(features, tokens, g, plan, positions)
        step_of = (lambda pos: None) if cache is None else (lambda pos: cache.step(pos, tree_mask))
        h, offsets = self._layer(x, positions, plan, step_of)
        if plan is not None:
            cache.offset, cache.plan = offsets, None
        return ModelOutput(logits=self.logits(h), hidden=h)

    # -- training --------------------------------------------------------------------------------
    def distill_loss(self, features: torch.Tensor, tokens: torch.Tensor, embeds: torch.Tensor,
                     teacher_logits: torch.Tensor, lengths: torch.Tensor, loss_mask: torch.Tensor,
                     rollout_steps: int = 1, logit_weight: float = 0.1, feature_weight: float = 1.0,
                     prompt_lengths: torch.Tensor | None = None) -> dict:
        """Online-logit distillation (SpecVLM): the teacher's features and logits computed on the
        fly for the batch, loss ``feature_weight * SmoothL1(f^_p, f_p) + logit_weight *
        CE(softmax(z_p), f^_p's logits)`` over entries p with ``loss_mask[:, p]``.

        ``rollout_steps > 1`` is ViSpec's anti-shortcut training: step m feeds the draft its own
        step m-1 predictions as the features of the text entries (``f^_{p-1}`` in place of
        ``f_{p-1}``), and the steps' losses are averaged.

        features (R, S, H), tokens (R, S), embeds (R, S, H) merged embeddings, teacher_logits
        (R, S, V), lengths (R,) valid lengths, loss_mask (R, S) bool over positions; prompt_lengths
        (R,) where the prompts end (the SpecVLM gate's question stops there, as in ``start``),
        by default one past each row's first scored position (``answer_mask`` scores from the
        prompt's last position on)."""
        R, S, H = features.shape
        if prompt_lengths is None:
            first = loss_mask.int().argmax(1)  # the first scored position (0 when none)
            prompt_lengths = torch.where(loss_mask.any(1), first + 1, lengths)
        plan = self.plan(features, tokens, embeds, lengths, hard_gumbel=self.training, question_ends=prompt_lengths)
        positions = torch.arange(1, S, device=tokens.device).expand(R, S - 1)
        mask = loss_mask[:, 1:S].clone()  # entry p = column p - 1
        for r in range(R):  # image entries are not scored (compressed ones have no output)
            for a, b in plan["spans"][r]:
                mask[r, max(a - 1, 0) : b] = False
        target_f = features[:, 1:].float()
        target_p = teacher_logits[:, 1:].float().softmax(-1)
        feats = features[:, :-1]
        total, logs = 0.0, {}
        for m in range(rollout_steps):
            x = self._text_inputs(feats, tokens[:, 1:], plan["g"], plan, positions)
            h, _ = self._layer(x, positions, plan, lambda pos: None)  # (R, S-1, H): f^_p at column p - 1
            n = mask.sum().clamp(min=1)
            feat_loss = (F.smooth_l1_loss(h.float(), target_f, reduction="none").mean(-1) * mask).sum() / n
            logp = self.logits(h).log_softmax(-1)
            ce = (-(target_p * logp).sum(-1) * mask).sum() / n
            top1 = ((logp.argmax(-1) == target_p.argmax(-1)) & mask).sum() / n
            total = total + feature_weight * feat_loss + logit_weight * ce
            logs[f"step{m}_top1"] = top1.detach()
            if m + 1 < rollout_steps:  # next step: the entry at p reads f^_{p-1}
                pred = torch.where(mask[..., None], h, features[:, 1:].to(h.dtype))
                feats = torch.cat([features[:, :1].to(h.dtype), pred[:, :-1]], 1)
        logs["loss"] = total / rollout_steps
        logs["branches"] = [b for row in plan["branches"] for b in row]
        return logs


class _Compressed:
    """``VLMDraftHead.compressed``'s view: the head, whose ``start`` plans with a fixed compression."""

    def __init__(self, head: VLMDraftHead, compression: tuple[str, int]):
        self.head, self.compression = head, compression

    def start(self, cache: _DraftCache, state) -> None:
        self.head.start(cache, state, compression=self.compression)

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    def __call__(self, *args, **kwargs):
        return self.head(*args, **kwargs)
