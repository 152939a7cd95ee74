"""LlamaGen's VQ tokenizer in its own checkpoint layout (issue 28 part 1): a tiny random state dict
with LlamaGen's key names loads into ``LlamaGenVQModel`` and encodes and decodes as a reference
forward written here from LlamaGen's ``vq_model.py`` semantics (functional, from the state dict);
bad checkpoints are refused naming the key; the model serves ``SpeculativeARImagePipeline``."""

import pytest
import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from mmspec.models.llamagen_vq import LlamaGenVQModel, load_llamagen_vq

TINY = dict(encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 2], codebook_size=24, codebook_embed_dim=4)


def original_state_dict(seed=0, ch=32, z=32, ch_mult=(1, 2), blocks=1, K=24, D=4):
    """LlamaGen's key names and shapes for ``VQModel(encoder_ch_mult=ch_mult, ...)`` with
    ``Encoder(ch=ch, num_res_blocks=blocks)``, random values (and its codebook-usage buffer)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}

    def conv(name, c_out, c_in, k):
        sd[f"{name}.weight"] = torch.randn(c_out, c_in, k, k, generator=g) * (c_in * k * k) ** -0.5
        sd[f"{name}.bias"] = torch.randn(c_out, generator=g) * 0.1

    def norm(name, c):
        sd[f"{name}.weight"] = 1 + 0.1 * torch.randn(c, generator=g)
        sd[f"{name}.bias"] = 0.1 * torch.randn(c, generator=g)

    def res(name, c_in, c_out):
        norm(f"{name}.norm1", c_in), conv(f"{name}.conv1", c_out, c_in, 3)
        norm(f"{name}.norm2", c_out), conv(f"{name}.conv2", c_out, c_out, 3)
        if c_in != c_out:
            conv(f"{name}.nin_shortcut", c_out, c_in, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    n = len(ch_mult)
    conv("encoder.conv_in", ch, 3, 3)
    c_in = ch
    for i, m in enumerate(ch_mult):
        for j in range(blocks):
            res(f"encoder.conv_blocks.{i}.res.{j}", c_in, ch * m)
            c_in = ch * m
            if i == n - 1:
                attn(f"encoder.conv_blocks.{i}.attn.{j}", c_in)
        if i != n - 1:
            conv(f"encoder.conv_blocks.{i}.downsample.conv", c_in, c_in, 3)
    res("encoder.mid.0", c_in, c_in), attn("encoder.mid.1", c_in), res("encoder.mid.2", c_in, c_in)
    norm("encoder.norm_out", c_in), conv("encoder.conv_out", z, c_in, 3)
    conv("quant_conv", D, z, 1), conv("post_quant_conv", z, D, 1)
    sd["quantize.embedding.weight"] = torch.randn(K, D, generator=g)
    sd["quantize.codebook_used"] = torch.zeros(65536)
    c_in = ch * ch_mult[-1]
    conv("decoder.conv_in", c_in, z, 3)
    res("decoder.mid.0", c_in, c_in), attn("decoder.mid.1", c_in), res("decoder.mid.2", c_in, c_in)
    for k, i in enumerate(reversed(range(n))):
        for j in range(blocks + 1):
            res(f"decoder.conv_blocks.{k}.res.{j}", c_in, ch * ch_mult[i])
            c_in = ch * ch_mult[i]
            if i == n - 1:
                attn(f"decoder.conv_blocks.{k}.attn.{j}", c_in)
        if i != 0:
            conv(f"decoder.conv_blocks.{k}.upsample.conv", c_in, c_in, 3)
    norm("decoder.norm_out", c_in), conv("decoder.conv_out", 3, c_in, 3)
    return sd


# -- the reference: LlamaGen's forward, functionally, from the state dict ------------------------
def _gn(sd, name, x):
    return F.group_norm(x, 32, sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-6)


def _conv(sd, name, x, stride=1, padding=None):
    w = sd[f"{name}.weight"]
    return F.conv2d(x, w, sd[f"{name}.bias"], stride=stride, padding=w.shape[-1] // 2 if padding is None else padding)


def _swish(x):
    return x * torch.sigmoid(x)


def _res(sd, name, x):
    h = _conv(sd, f"{name}.conv1", _swish(_gn(sd, f"{name}.norm1", x)))
    h = _conv(sd, f"{name}.conv2", _swish(_gn(sd, f"{name}.norm2", h)))
    return (_conv(sd, f"{name}.nin_shortcut", x) if f"{name}.nin_shortcut.weight" in sd else x) + h


def _attn(sd, name, x):
    b, c, hh, ww = x.shape
    h = _gn(sd, f"{name}.norm", x)
    q = _conv(sd, f"{name}.q", h).reshape(b, c, -1).permute(0, 2, 1)  # b, hw, c
    k = _conv(sd, f"{name}.k", h).reshape(b, c, -1)
    w = torch.softmax(torch.bmm(q, k) * c ** -0.5, dim=2)  # w[b, i, j]: query i, key j
    v = _conv(sd, f"{name}.v", h).reshape(b, c, -1)
    return x + _conv(sd, f"{name}.proj_out", torch.bmm(v, w.permute(0, 2, 1)).reshape(b, c, hh, ww))


def ref_encode(sd, x, n=2, blocks=1):
    h = _conv(sd, "encoder.conv_in", x)
    for i in range(n):
        for j in range(blocks):
            h = _res(sd, f"encoder.conv_blocks.{i}.res.{j}", h)
            if i == n - 1:
                h = _attn(sd, f"encoder.conv_blocks.{i}.attn.{j}", h)
        if i != n - 1:
            h = _conv(sd, f"encoder.conv_blocks.{i}.downsample.conv", F.pad(h, (0, 1, 0, 1)), stride=2, padding=0)
    h = _res(sd, "encoder.mid.2", _attn(sd, "encoder.mid.1", _res(sd, "encoder.mid.0", h)))
    z = _conv(sd, "quant_conv", _conv(sd, "encoder.conv_out", _swish(_gn(sd, "encoder.norm_out", h))))
    zf = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=-1)
    e = F.normalize(sd["quantize.embedding.weight"], dim=-1)
    d = (zf ** 2).sum(1, keepdim=True) + (e ** 2).sum(1) - 2 * zf @ e.T  # LlamaGen's distance
    return d.argmin(1).view(z.shape[0], z.shape[2], z.shape[3])


def ref_decode(sd, ids, n=2, blocks=1):
    e = F.normalize(sd["quantize.embedding.weight"], dim=-1)
    h = _conv(sd, "decoder.conv_in", _conv(sd, "post_quant_conv", e[ids].permute(0, 3, 1, 2)))
    h = _res(sd, "decoder.mid.2", _attn(sd, "decoder.mid.1", _res(sd, "decoder.mid.0", h)))
    for k in range(n):
        for j in range(blocks + 1):
            h = _res(sd, f"decoder.conv_blocks.{k}.res.{j}", h)
            if k == 0:
                h = _attn(sd, f"decoder.conv_blocks.{k}.attn.{j}", h)
        if k != n - 1:
            h = _conv(sd, f"decoder.conv_blocks.{k}.upsample.conv", F.interpolate(h, scale_factor=2.0, mode="nearest"))
    return _conv(sd, "decoder.conv_out", _swish(_gn(sd, "decoder.norm_out", h)))


@pytest.fixture(scope="module")
def sd():
    return {k: v.double() for k, v in original_state_dict().items()}


@pytest.fixture(scope="module")
def vq(sd):
    return load_llamagen_vq(sd, config=dict(TINY, num_res_blocks=1), sample_size=16).double()


def test_loads_the_original_layout_and_matches_the_reference(vq, sd):
    assert (vq.grid_size, vq.downsample_factor, vq.config.ch, vq.config.z_channels) == (8, 2, 32, 32)
    x = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1
    ids = vq.encode(x)
    assert ids.shape == (2, 8, 8) and torch.equal(ids, ref_encode(sd, x))
    assert len(ids.unique()) > 3  # the comparison is not between two constant grids
    torch.testing.assert_close(vq.decode(ids), ref_decode(sd, ids), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(vq.codebook(), F.normalize(sd["quantize.embedding.weight"], dim=-1))


def test_loads_a_safetensors_file_and_a_wrapped_dict(tmp_path, sd):
    path = tmp_path / "vq.safetensors"
    save_file({k: v.float().contiguous() for k, v in original_state_dict().items()}, str(path))
    cfg = dict(TINY, num_res_blocks=1)
    a = load_llamagen_vq(path, config=cfg, sample_size=16)
    b = load_llamagen_vq({"model": original_state_dict()}, config=cfg, sample_size=16)
    ids = torch.randint(0, 24, (1, 8, 8), generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.decode(ids), b.decode(ids))
    assert isinstance(a, LlamaGenVQModel) and a.config.codebook_size == 24


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("decoder.conv_blocks.1.res.1.conv2.weight"),
     "checkpoint must be a state dict with 'decoder.conv_blocks.1.res.1.conv2.weight'"),
    (lambda s: s.__setitem__("encoder.mid.1.q.weight", torch.zeros(32, 32, 3, 3)),
     r"checkpoint must be 'encoder.mid.1.q.weight' of shape \(64, 64, 1, 1\)"),
    (lambda s: s.__setitem__("encoder.extra.weight", torch.zeros(1)),
     "checkpoint must be no keys beyond this config's parameters.*unexpected 'encoder.extra.weight'"),
    (lambda s: s.pop("quantize.embedding.weight"), "a LlamaGen VQ state dict .it has no 'quantize.embedding.weight'"),
])
def test_bad_checkpoints_are_refused_naming_the_key(edit, match):
    state = original_state_dict()
    edit(state)
    with pytest.raises(ValueError, match=match):
        load_llamagen_vq(state, config=dict(TINY, num_res_blocks=1), sample_size=16)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="config must be one of 'VQ-8', 'VQ-16'"):
        load_llamagen_vq(original_state_dict(), config="VQ-32")
    with pytest.raises(ValueError, match=r"checkpoint must be a path to an existing \.safetensors file"):
        load_llamagen_vq(tmp_path / "vq_ds16_c2i.pt")
    with pytest.raises(ValueError, match="sample_size must be a multiple of the downsampling factor 16"):
        LlamaGenVQModel(sample_size=200)
    with pytest.raises(ValueError, match="encoder_ch_mult must be a non-empty list"):
        LlamaGenVQModel(ch=16, encoder_ch_mult=[1, 1])


def test_named_config_builds_llamagens_vq16_layout():
    """``VQ-16``'s parameter names and shapes are those of LlamaGen's VQ_16 (a checkpoint-shaped
    random dict built as LlamaGen's constructor lays it out, at ch 32 to stay small)."""
    sd = original_state_dict(ch=32, z=32, ch_mult=(1, 1, 2, 2, 4), blocks=2, K=16, D=8)
    vq = load_llamagen_vq(sd, config="VQ-16", sample_size=32)
    assert vq.grid_size == 2 and vq.downsample_factor == 16 and vq.config.num_res_blocks == 2


def test_serves_the_ar_image_pipeline(vq, tmp_path):
    """As a pipeline's ``vqvae``: its ids grid decodes to images of ``sample_size``; the pipeline
    saves and loads it as safetensors with the same decoding."""
    from mmspec.models.llamagen import LlamaGenModel
    from mmspec.pipelines import SpeculativeARImagePipeline

    torch.manual_seed(0)
    gpt = LlamaGenModel(vocab_size=24, grid_size=8, num_classes=4, dim=32, n_layers=1, n_heads=2, mlp_hidden=64)
    pipe = SpeculativeARImagePipeline(transformer=gpt, vqvae=vq.float())
    pipe.set_progress_bar_config(disable=True)
    out = pipe(class_labels=[1], method="none", guidance_scale=2.0, generator=torch.Generator().manual_seed(0),
               output_type="pt")
    assert out.images.shape == (1, 3, 16, 16)
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path / "pipe")
    assert isinstance(loaded.vqvae, LlamaGenVQModel)
    ids = torch.randint(0, 24, (1, 8, 8), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(loaded.vqvae.decode(ids), pipe.vqvae.decode(ids))


def test_both_llamagen_checkpoints_run_the_pipeline_end_to_end(tmp_path):
    """A converted LlamaGen GPT and a LlamaGen VQ, both from their original layouts (tiny): the
    pipeline decodes their token grids to images, greedy ``sjd`` equals ``none``, and the saved
    pipeline folder loads back to the same images."""
    from test_llamagen_convert import GRID, HEADS, VOCAB, original_state_dict as gpt_state_dict

    from mmspec.models import load_llamagen_gpt
    from mmspec.pipelines import SpeculativeARImagePipeline

    gpt = load_llamagen_gpt(gpt_state_dict(5, dtype=torch.float32), n_head=HEADS, grid_size=GRID)
    vq = load_llamagen_vq(original_state_dict(K=VOCAB), config=dict(TINY, num_res_blocks=1, codebook_size=VOCAB),
                          sample_size=2 * GRID)  # one downsampling level: a GRID x GRID id grid
    pipe = SpeculativeARImagePipeline(transformer=gpt, vqvae=vq)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(class_labels=[1, 4], temperature=0.0, guidance_scale=2.0, output_type="pt")
    ref = pipe(**kw)
    out = pipe(method="sjd", method_knobs={"sjd_init": "repeat", "sjd_window": 4}, **kw)
    assert torch.equal(out.tokens, ref.tokens) and out.images.shape == (2, 3, 2 * GRID, 2 * GRID)
    assert out.stats["nfe"] <= ref.stats["nfe"]
    pipe.save_pretrained(tmp_path / "llamagen")
    loaded = SpeculativeARImagePipeline.from_pretrained(tmp_path / "llamagen")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.transformer.config.cls_rope == "zero"
    torch.testing.assert_close(loaded(**kw).images, ref.images)
