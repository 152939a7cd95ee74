"""LlamaGen's released class-conditional GPT checkpoints as a LlamaGenModel
(``mmspec.models.llamagen_convert``).

A tiny random state dict in LlamaGen's original key layout (dim 32, 2 layers, 2 heads, vocab 64,
a 4x4 grid, 10 classes plus the null row) is built here, and so is a small reference forward
written from the semantics of LlamaGen's ``autoregressive/models/gpt.py``: its 2-D RoPE table in
complex form (zero rows for the class token), its fused-qkv causal attention, its SwiGLU, its
class embedding at position 0 and the logits from ``output``. The converted model must give the
reference's logits (float64) without a cache and through the cache, and the methods must stay
greedy-identical to ``none`` on it.
"""

import pytest
import torch
from safetensors.torch import save_file

from mmspec.core import LogitsProcessor, SpeculativeDecoder
from mmspec.models import load_llamagen_gpt
from mmspec.models.llamagen import LlamaGenModel
from mmspec.models.llamagen_convert import llamagen_config_from_state_dict

DIM, LAYERS, HEADS, VOCAB, GRID, CLASSES = 32, 2, 2, 64, 4, 10
HIDDEN = 96  # LlamaGen's rule: find_multiple(int(2 * 4 * DIM / 3), multiple_of=32)
N = GRID * GRID


def original_state_dict(seed=0, std=0.3, dtype=torch.float64):
    """Random weights under LlamaGen's own parameter names and shapes."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (std * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)

    def norm():
        return (1 + 0.1 * torch.randn(DIM, generator=g, dtype=torch.float64)).to(dtype)

    sd = {"tok_embeddings.weight": w(VOCAB, DIM), "cls_embedding.embedding_table.weight": w(CLASSES + 1, DIM)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd.update({p + "attention.wqkv.weight": w(3 * DIM, DIM), p + "attention.wo.weight": w(DIM, DIM),
                   p + "feed_forward.w1.weight": w(HIDDEN, DIM), p + "feed_forward.w3.weight": w(HIDDEN, DIM),
                   p + "feed_forward.w2.weight": w(DIM, HIDDEN), p + "attention_norm.weight": norm(),
                   p + "ffn_norm.weight": norm()})
    sd.update({"norm.weight": norm(), "output.weight": w(VOCAB, DIM)})
    return sd


# -- the reference: LlamaGen's forward, written from gpt.py's semantics ----------------------------
def llamagen_rope_table(grid, head_dim, base=10000.0, cls_token_num=1):
    """(cls_token_num + grid**2, head_dim / 2) complex: row then column frequencies per token,
    and all-zero rows (not identity rows) for the class tokens, as LlamaGen builds its table."""
    quarter = head_dim // 4
    freqs = 1.0 / base ** (torch.arange(quarter, dtype=torch.float32) * 4 / head_dim)  # (D/4,)
    rows = torch.arange(grid).repeat_interleave(grid)  # raster index -> row
    cols = torch.arange(grid).repeat(grid)
    angles = torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], -1)  # (grid**2, D/2)
    table = torch.polar(torch.ones_like(angles), angles)
    return torch.cat([torch.zeros(cls_token_num, 2 * quarter, dtype=table.dtype), table])


def rotate(x, table):
    """x (B, T, H, D) times the table (T, D/2) as complex pairs (2j, 2j+1), in float32 like gpt.py."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * table[None, :, None]).flatten(3).to(x.dtype)


def rms(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_logits(sd, labels, image_ids):
    """(B,) labels and (B, n) image ids -> (B, 1 + n, V) logits of the sequence [class, ids]."""
    cls, tok = sd["cls_embedding.embedding_table.weight"], sd["tok_embeddings.weight"]
    h = torch.cat([cls[labels][:, None], tok[image_ids]], 1)  # (B, 1 + n, dim): the class token at position 0
    B, T, _ = h.shape
    table = llamagen_rope_table(GRID, DIM // HEADS)[:T]
    for i in range(LAYERS):
        p = f"layers.{i}."
        q, k, v = (rms(h, sd[p + "attention_norm.weight"]) @ sd[p + "attention.wqkv.weight"].T).split(DIM, -1)
        q, k, v = (t.view(B, T, HEADS, -1) for t in (q, k, v))
        q, k = rotate(q, table), rotate(k, table)
        y = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        h = h + y.transpose(1, 2).reshape(B, T, DIM) @ sd[p + "attention.wo.weight"].T
        x = rms(h, sd[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(x @ sd[p + "feed_forward.w1.weight"].T)
        h = h + (gate * (x @ sd[p + "feed_forward.w3.weight"].T)) @ sd[p + "feed_forward.w2.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["output.weight"].T


def reference_greedy(sd, labels, guidance_scale=None):
    """Greedy image tokens from the reference, the whole sequence recomputed per token (LlamaGen's
    CFG: ``uncond + s * (cond - uncond)``, the null class the unconditional half)."""
    labels = torch.tensor(labels)
    ids = torch.zeros(len(labels), 0, dtype=torch.long)
    for _ in range(N):
        logits = reference_logits(sd, labels, ids)[:, -1]
        if guidance_scale is not None:
            uncond = reference_logits(sd, torch.full_like(labels, CLASSES), ids)[:, -1]
            logits = uncond + guidance_scale * (logits - uncond)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


def converted(seed=0, dtype=torch.float64):
    sd = original_state_dict(seed)
    return sd, load_llamagen_gpt(sd, n_head=HEADS, grid_size=GRID, dtype=dtype)


def sample_sequence(seed=1):
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([0, 7, CLASSES])  # the last row: the null class
    return labels, torch.randint(0, VOCAB, (3, N), generator=g)


# -- config and logits ----------------------------------------------------------------------------
def test_config_is_read_from_the_original_layout():
    sd = original_state_dict()
    config = llamagen_config_from_state_dict({"model": sd}, n_head=HEADS, grid_size=GRID)
    assert config == dict(vocab_size=VOCAB, grid_size=GRID, num_classes=CLASSES, dim=DIM, n_layers=LAYERS,
                          n_heads=HEADS, mlp_hidden=HIDDEN, class_dropout_prob=0.1, rope_base=10000.0,
                          norm_eps=1e-5, cls_rope="zero")
    # a freqs_cis buffer (1 + grid**2 rows) gives the grid; it is not a weight
    with_buffer = {**sd, "freqs_cis": torch.view_as_real(llamagen_rope_table(GRID, DIM // HEADS))}  # (17, 8, 2)
    assert llamagen_config_from_state_dict(with_buffer, n_head=HEADS)["grid_size"] == GRID
    model = load_llamagen_gpt({"model": with_buffer}, n_head=HEADS)
    assert isinstance(model, LlamaGenModel) and not model.training and model.dtype == torch.float32


def test_logits_equal_the_llamagen_reference_without_cache():
    sd, model = converted()
    labels, ids = sample_sequence()
    tokens = torch.cat([labels[:, None], ids], 1)  # (3, 1 + N): every table row, class token included
    with torch.no_grad():
        ours = model(tokens).logits
    ref = reference_logits(sd, labels, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # both rotate in float32 (gpt.py's x.float())
    # the zeroed class-token q/k matters: the identity rule (our default) gives other logits
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    plain = LlamaGenModel(**{**config, "cls_rope": "identity"}).eval()
    plain.load_state_dict(model.state_dict(), assign=True)
    with torch.no_grad():
        assert (plain(tokens).logits[:, 1:] - ref[:, 1:]).abs().max() > 1e-2


def test_logits_equal_the_reference_through_the_kv_cache():
    sd, model = converted()
    labels, ids = sample_sequence(2)
    tokens = torch.cat([labels[:, None], ids], 1)
    ref = reference_logits(sd, labels, ids)
    cache = model.new_cache(3, 1 + N)
    chunks = []
    with torch.no_grad():
        for start, stop in [(0, 1), (1, 6), (6, 7), (7, 1 + N)]:  # a prefill, then blocks of several sizes
            positions = torch.arange(start, stop).expand(3, -1)
            chunks.append(model(tokens[:, start:stop], positions, cache=cache).logits)
    torch.testing.assert_close(torch.cat(chunks, 1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("guidance_scale", [None, 3.0])
def test_greedy_decoding_equals_the_reference_token_by_token(guidance_scale):
    sd, model = converted()
    labels = [0, 4, 9]
    dec = SpeculativeDecoder(model, processor=LogitsProcessor(temperature=0.0, guidance_scale=guidance_scale))
    kw = {} if guidance_scale is None else dict(uncond_input_ids=model.uncond_prompts(len(labels)))
    out = dec.generate(model.class_prompts(labels), model.num_image_tokens, **kw)
    assert torch.equal(out.sequences, reference_greedy(sd, labels, guidance_scale))


# -- the methods on a converted model: greedy-identical to the baseline -----------------------------
@pytest.fixture(scope="module")
def pipe():
    from mmspec.models.eagle import EagleDraftHead
    from mmspec.models.medusa import GridMedusaHeads
    from mmspec.models.vq import TinyVQModel
    from mmspec.pipelines import SpeculativeARImagePipeline

    torch.manual_seed(0)
    vq = TinyVQModel(sample_size=16, block_out_channels=(8, 8, 8), codebook_size=VOCAB).eval()  # a 4x4 grid
    target = load_llamagen_gpt(original_state_dict(3, dtype=torch.float32), n_head=HEADS, grid_size=GRID)
    eagle = EagleDraftHead.from_target(target).eval()
    medusa = GridMedusaHeads.from_target(target, num_heads=3).eval()
    with torch.no_grad():  # random heads: zero-initialised ones would all propose the root's argmax
        for p in medusa.parameters():
            p.normal_(0, 0.3)
    pipe = SpeculativeARImagePipeline(transformer=target, vqvae=vq, eagle_head=eagle, medusa_head=medusa)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("method,knobs", [
    ("sjd", {"sjd_init": "spatial", "sjd_window": 5}),
    ("mcsjd", {"mcsjd_init": "repeat", "mcsjd_window": 5}),
    ("zipar", {"zipar_window": GRID}),  # a full window: ZipAR is raster order, so lossless
    ("zipar+sjd", {"zipar_window": GRID, "sjd_init": "repeat"}),
    ("eagle", {}),
    ("medusa", {}),
])
def test_greedy_methods_equal_the_baseline_on_a_converted_model(pipe, method, knobs):
    kw = dict(class_labels=[3, 7], temperature=0.0, guidance_scale=2.0, output_type="latent")
    ref = pipe(**kw)
    out = pipe(method=method, method_knobs=knobs, **kw)
    assert torch.equal(out.tokens, ref.tokens)


# -- bad checkpoints: one line naming the key ----------------------------------------------------
def _without(key):
    sd = original_state_dict()
    del sd[key]
    return sd


def _t2i():
    sd = _without("cls_embedding.embedding_table.weight")
    sd["cls_embedding.cap_proj.fc1.weight"] = torch.zeros(DIM, 48)
    sd["cls_embedding.cap_proj.fc2.weight"] = torch.zeros(DIM, DIM)
    return sd


@pytest.mark.parametrize("make,kw,message", [
    (lambda: _without("layers.1.attention.wo.weight"), {},
     "state_dict is missing 'layers.1.attention.wo.weight'"),
    (lambda: {**original_state_dict(), "layers.0.attention.wo.weight": torch.zeros(DIM, DIM + 1)}, {},
     r"state_dict\['layers.0.attention.wo.weight'\] must be of shape \(32, 32\), got \(32, 33\)"),
    (lambda: {**original_state_dict(), "layers.0.attention.wqkv.bias": torch.zeros(3 * DIM)}, {},
     "state_dict has an unexpected key 'layers.0.attention.wqkv.bias'"),
    (_t2i, {}, r"state_dict is a text-to-image \(t2i\) checkpoint \(it has 'cls_embedding.cap_proj.fc1.weight'\): "
               r"this loader takes class-conditional \(c2i\) GPT checkpoints"),
    (original_state_dict, {"n_head": None}, "n_head must be an int >= 1, or give gpt_model"),
    (original_state_dict, {"grid_size": None}, "grid_size must be an int >= 1"),
    (original_state_dict, {"num_classes": 11}, "num_classes must be None or 10"),
    (original_state_dict, {"gpt_model": "GPT-B"}, r"gpt_model must be the checkpoint's config \(it has 2 layers"),
    (original_state_dict, {"gpt_model": "GPT-Q"}, "gpt_model must be one of 'GPT-B', 'GPT-L'"),
])
def test_bad_checkpoints_are_refused_naming_the_key(make, kw, message):
    kw = {"n_head": HEADS, "grid_size": GRID, **kw}
    with pytest.raises(ValueError, match=message) as err:
        load_llamagen_gpt(make(), **kw)
    assert "\n" not in str(err.value)


def test_safetensors_file_round_trip(tmp_path):
    sd = original_state_dict(dtype=torch.float32)
    path = tmp_path / "c2i_tiny.safetensors"
    save_file(sd, str(path))
    from_file = load_llamagen_gpt(path, n_head=HEADS, grid_size=GRID)
    from_dict = load_llamagen_gpt(sd, n_head=HEADS, grid_size=GRID)
    for key, value in from_dict.state_dict().items():
        assert torch.equal(from_file.state_dict()[key], value), key
    from_file.save_pretrained(tmp_path / "converted")  # our folder layout keeps cls_rope="zero"
    reloaded = LlamaGenModel.from_pretrained(tmp_path / "converted", use_safetensors=True).eval()
    assert reloaded.config.cls_rope == "zero"
    tokens = torch.tensor([[3, 5, 9, 2], [CLASSES, 1, 1, 0]])
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, from_file(tokens).logits)
    with pytest.raises(ValueError, match=r"checkpoint must be a path to an existing \.safetensors file"):
        load_llamagen_gpt(tmp_path / "c2i_tiny.pt", n_head=HEADS, grid_size=GRID)


def test_zero_prefix_rope_zeroes_only_the_class_token():
    from mmspec.core.rope import GridRope2D

    x = torch.randn(2, 3, 6, 8)  # (B, H, T, D)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 5, 6, 7, 8, 9]])
    zero, identity = GridRope2D(8, GRID, prefix_rope="zero"), GridRope2D(8, GRID)
    out, plain = zero(x, positions), identity(x, positions)
    assert torch.equal(out[..., 0, :], torch.zeros_like(out[..., 0, :]))
    assert torch.equal(plain[..., 0, :], x[..., 0, :])
    assert torch.equal(out[..., 1:, :], plain[..., 1:, :])
    with pytest.raises(ValueError, match="prefix_rope must be one of 'identity', 'zero'"):
        GridRope2D(8, GRID, prefix_rope="none")
    with pytest.raises(ValueError, match="cls_rope must be one of 'identity', 'zero'"):
        LlamaGenModel(vocab_size=VOCAB, grid_size=GRID, dim=DIM, n_heads=HEADS, cls_rope="zeroed")
