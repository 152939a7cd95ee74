"""The RoPE family (``mmspec.core.rope``).

- Each member equals, bit for bit, the implementation it replaced (kept below verbatim as the
  oracle, from commit de1d01b): ``tiny_lm.rotate`` (1-D), ``llamagen.rotate_2d`` (2-D grid),
  ``VLMDraftHead.rope`` (1-D from a cached table), on random inputs in float32, bfloat16 and float16.
- ``MRope`` equals transformers' Qwen2-VL rotary application (``Qwen2VLRotaryEmbedding`` +
  ``apply_rotary_pos_emb``, tiny config built here) bit for bit given the same frequencies, and
  to float32 rounding with its own.
- ``Rope3D`` is relative on each axis and is the 1-D RoPE of the time run when h = w = 0.
- Tables are shared: the same positions tensor gives the same tables object until it changes, and
  a 3-layer model computes its angles once per forward (twice with a rolling cache).
"""

import pytest
import torch
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

from mmspec.core.rope import GridRope2D, MRope, Rope1D, Rope3D, RotaryEmbedding, frequencies

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# -- the replaced implementations, verbatim (the oracles) ------------------------------------------

def old_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """mmspec/models/tiny_lm.py: rotate."""
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = positions.to(torch.float32)[:, None, :, None] * inv_freq  # (B, 1, T, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def old_rotate_2d(x: torch.Tensor, positions: torch.Tensor, grid_size: int, base: float) -> torch.Tensor:
    """mmspec/models/llamagen.py: rotate_2d."""
    D = x.shape[-1]
    n = D // 4
    inv_freq = base ** (-4 * torch.arange(n, device=x.device, dtype=torch.float32) / D)  # (D/4,)
    raster = (positions - 1).clamp(min=0)
    row, col = raster // grid_size, raster % grid_size  # (B, T)
    angles = torch.cat([row[..., None] * inv_freq, col[..., None] * inv_freq], -1)  # (B, T, D/2)
    angles = angles.masked_fill((positions == 0)[..., None], 0.0)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # (B, 1, T, D/2)
    x0, x1 = x.float().unflatten(-1, (D // 2, 2)).unbind(-1)  # (B, H, T, D/2) each
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(-2).to(x.dtype)


class OldTableRope:
    """mmspec/models/vlm_draft.py: VLMDraftHead.rope (``self.config.rope_theta`` -> ``theta``)."""

    def __init__(self, theta):
        self.theta, self._rope_table = theta, None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        table = self._rope_table
        top = int(positions.max()) + 1
        if table is None or table[0].shape[0] < top or table[0].shape[1] != D // 2 or table[0].device != x.device:
            size = max(top, 2 * (0 if table is None else table[0].shape[0]), 512)
            inv_freq = self.theta ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
            angles = torch.arange(size, device=x.device, dtype=torch.float32)[:, None] * inv_freq
            table = self._rope_table = (angles.cos(), angles.sin())
        cos, sin = table[0][positions][:, None], table[1][positions][:, None]  # (B, 1, T, D/2)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def qk(seed, B=3, H=4, T=37, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g) * 3).to(dtype), (torch.randn(B, H, T, D, generator=g) * 3).to(dtype)


def random_positions(seed, B=3, T=37, high=3000):
    return torch.randint(0, high, (B, T), generator=torch.Generator().manual_seed(seed))


# 1. bit for bit against the replaced implementations --------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,theta", [(16, 10000.0), (48, 500.0), (64, 1e6)])
def test_rope_1d_equals_tiny_lm_rotate(dtype, D, theta):
    x, _ = qk(0, D=D, dtype=dtype)
    positions = random_positions(1)
    assert torch.equal(Rope1D(D, theta)(x, positions), old_rotate(x, positions, theta))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,grid,base", [(8, 6, 100.0), (64, 16, 10000.0), (32, 5, 10000.0)])
def test_grid_rope_2d_equals_llamagen_rotate_2d(dtype, D, grid, base):
    x, _ = qk(2, D=D, dtype=dtype)
    positions = torch.cat([torch.zeros(3, 1, dtype=torch.long), random_positions(3, T=36, high=grid * grid + 9)], 1)
    assert torch.equal(GridRope2D(D, grid, base)(x, positions), old_rotate_2d(x, positions, grid, base))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_1d_equals_the_vlm_heads_table_rope(dtype):
    """The old head grew its table over calls; several calls with growing positions cover that."""
    rope, old = Rope1D(32, 10000.0), OldTableRope(10000.0)
    for seed, high in enumerate([10, 600, 5000, 40]):
        x, _ = qk(10 + seed, D=32, dtype=dtype)
        positions = random_positions(20 + seed, high=high)
        assert torch.equal(rope(x, positions), old(x, positions))


# 2. M-RoPE against transformers' Qwen2-VL --------------------------------------------------------

def qwen2_vl_rotary(head_dim, sections, theta):
    config = Qwen2VLTextConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=2,
                               rope_parameters=dict(rope_type="default", rope_theta=theta, mrope_section=sections))
    return Qwen2VLRotaryEmbedding(config)


@pytest.mark.parametrize("head_dim,sections,theta", [(16, [2, 3, 3], 10000.0), (64, [16, 8, 8], 1e6),
                                                     (32, [8, 4, 4], 500.0)])
def test_mrope_equals_qwen2_vl(head_dim, sections, theta):
    hf = qwen2_vl_rotary(head_dim, sections, theta)
    q, k = qk(4, D=head_dim)
    coords = torch.randint(0, 50, (3, 3, 37), generator=torch.Generator().manual_seed(5))  # (3, B, T) t/h/w ids
    cos, sin = hf(q, coords)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)  # q, k (B, H, T, D)
    same_freq = MRope(head_dim, sections, theta, inv_freq=hf.inv_freq)
    assert torch.equal(same_freq(q, coords), q_hf) and torch.equal(same_freq(k, coords), k_hf)
    own = MRope(head_dim, sections, theta)  # theta ** (-2j / D) vs transformers' 1 / theta ** (2j / D)
    torch.testing.assert_close(own(q, coords), q_hf, rtol=1e-5, atol=1e-4)
    assert not torch.equal(own.inv_freq, hf.inv_freq), "the formulas differ in the last bit: this test knows it"


def test_mrope_of_text_positions_is_1d_rope():
    x, _ = qk(6, D=32)
    positions = random_positions(7)
    mrope = MRope(32, [4, 6, 6], 10000.0)
    assert torch.equal(mrope(x, positions), Rope1D(32, 10000.0)(x, positions))
    assert torch.equal(mrope(x, positions), mrope(x, positions.expand(3, *positions.shape)))


# 3. the 3-D RoPE of a video DiT ------------------------------------------------------------------

def dots(rope, q, k, cq, ck):
    """Per-(row, token) q . k after rotating q at coordinates cq and k at ck (3, B, T)."""
    return (rope(q, cq).double() * rope(k, ck).double()).sum(-1)


def test_rope_3d_is_relative_per_axis():
    """Shifting q's and k's coordinates by the same random offset on each axis (independently)
    keeps every q . k (up to float32 rounding); changing the difference on any one axis does not,
    so the check has teeth."""
    rope = Rope3D(48, 10000.0)
    q, k = qk(8, D=48)
    g = torch.Generator().manual_seed(9)
    cq, ck = torch.randint(0, 30, (2, 3, 3, 37), generator=g)
    shift = torch.randint(0, 200, (3, 1, 1), generator=g)
    reference = dots(rope, q, k, cq, ck)
    torch.testing.assert_close(dots(rope, q, k, cq + shift, ck + shift), reference, rtol=1e-4, atol=1e-3)
    for axis in range(3):
        moved = cq.clone()
        moved[axis] += 7
        assert (dots(rope, q, k, moved, ck) - reference).abs().max() > 1.0, axis


def test_rope_3d_at_zero_height_and_width_is_1d_along_time():
    rope = Rope3D(48, 10000.0)
    d_t = 2 * rope.sections[0]
    assert rope.sections == [8, 8, 8]  # Wan's split of 24 pairs
    x, _ = qk(10, D=48)
    t = random_positions(11, high=500)
    coords = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)])
    out = rope(x, coords)
    assert torch.equal(out[..., :d_t], Rope1D(d_t, 10000.0, layout="interleaved")(x[..., :d_t], t))
    assert torch.equal(out[..., d_t:], x[..., d_t:])


def test_rope_3d_frame_shape_maps_sequence_positions():
    rope = Rope3D(24, 100.0, sections=(4, 4, 4), frame_shape=(3, 5))
    p = torch.arange(45)[None]  # three frames of 3 x 5 tokens
    coords = torch.stack([p // 15, p // 5 % 3, p % 5])
    x, _ = qk(12, B=1, T=45, D=24)
    assert torch.equal(rope(x, p), rope(x, coords))
    with pytest.raises(ValueError, match="positions must be"):
        Rope3D(24)(x, p)


# 4. tables shared across layers, bad arguments ---------------------------------------------------

def test_tables_computed_once_per_positions_tensor():
    rope = Rope1D(16)
    positions = random_positions(13)
    other = random_positions(14)
    first = rope.tables(positions)
    assert rope.tables(other) is not first
    assert rope.tables(positions) is first  # two tensors remembered: a rolling cache's q and k positions
    positions.add_(1)  # an in-place change is seen (version counter)
    changed = rope.tables(positions)
    assert changed is not first and not torch.equal(changed.cos, first.cos)
    torch.testing.assert_close(changed.cos, rope.tables(positions.clone()).cos, rtol=0, atol=0)
    with torch.inference_mode():  # no version counter: recomputed every time, still right
        p = positions.clone()
        assert torch.equal(rope.tables(p).cos, changed.cos)


@pytest.mark.parametrize("build,message", [
    (lambda: Rope1D(15), "head_dim must be a positive multiple of 2"),
    (lambda: GridRope2D(6, 4), "head_dim must be a positive multiple of 4"),
    (lambda: GridRope2D(8, 0), "grid_size must be an int >= 1"),
    (lambda: Rope1D(16, theta=0.0), "theta must be > 0"),
    (lambda: MRope(16, [2, 3]), "sections must be three pair counts"),
    (lambda: MRope(16, [2, 3, 4]), "sections must be non-negative pair counts summing to 8"),
    (lambda: Rope3D(16, frame_shape=(0, 4)), "frame_shape must be"),
    (lambda: RotaryEmbedding(frequencies(16, 1.0), layout="pairs"), "layout must be one of 'half', 'interleaved'"),
])
def test_bad_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_wrong_head_dim_or_coordinates():
    rope = MRope(16, [2, 3, 3])
    x, _ = qk(15, D=16)
    with pytest.raises(ValueError, match="x must be a tensor whose last dimension is the head dimension 16"):
        rope(x[..., :8], random_positions(16))
    with pytest.raises(ValueError, match=r"positions must be a \(B, T\) tensor or \(3, B, T\) coordinates"):
        rope(x, torch.zeros(2, 3, 37, dtype=torch.long))


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_models_compute_the_angles_once_per_forward(monkeypatch, mode):
    """A 3-layer model: one angle computation per forward, with or without a cache (the cache's
    per-layer calls hit the tables); a rolling cache rotates keys at their own positions: two.
    Also under ``inference_mode`` (the decoder's), where the tables cannot be remembered by tensor
    version and the cache step keeps them."""
    from tiny import tiny_lm

    from mmspec.models.llamagen import LlamaGenModel

    calls = []
    real = RotaryEmbedding.angles
    monkeypatch.setattr(RotaryEmbedding, "angles", lambda self, p: calls.append(1) or real(self, p))
    lm = tiny_lm(0, n_layers=3)
    torch.manual_seed(0)
    gen = LlamaGenModel(vocab_size=16, grid_size=4, num_classes=4, dim=16, n_layers=3, n_heads=2, mlp_hidden=32)
    tokens = torch.randint(0, 4, (2, 9))
    for model, cache in [(lm, None), (lm, lm.new_cache(2, 16)), (gen, None), (gen, gen.new_cache(2, 16)),
                         (lm, lm.new_cache(2, 16, sink=1, window=4))]:
        calls.clear()
        with mode():
            model(tokens, cache=cache)
        assert len(calls) == (2 if cache is not None and hasattr(cache, "window") else 1), (type(model), cache)
