"""RoPE (docs/numerics.md §2.3) against DeepSeek's published float32 tables and our own float64
re-derivation of the spec formulas.

Expected values never come from `dsv4`: the published computation (frequencies, float32 angle, torch.polar)
is written out in tests/conftest.py (`published_rope_freqs`, `published_freqs_cis`) and compared bit for bit;
the YaRN ramp and the GPT-J rotation are written out again here in float64, with tolerances of float32
rounding.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from tests.conftest import (CONFIGS, published_angles, published_freqs_cis, published_rope_freqs, published_rope_kw,
                            spec_rope_freqs, tiny_spec)
from dsv4 import oracle
from dsv4.components.rope import Rope, rope_frequencies
from dsv4.values.seam import RopeRows
from dsv4.values.spec import ModelSpec

NOPE, ROPE = 448, 64
BASE, ORIG, FACTOR, BETA_FAST, BETA_SLOW = 160000.0, 65536, 16.0, 32.0, 1.0
MAX_POS = 1_048_576                      # orig_max · factor = max_position_embeddings of the shipped models
SAMPLE = [0, 1, 2, 3, 63, 64, 4095, 4096, 10_000, 65_535, 65_536, 100_000, 524_287, 999_983, 1_000_000,
          MAX_POS - 1]


def load_spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")))


SHIPPED = {name: load_spec(name) for name in ("dsv4_flash", "dsv4_pro", "dsv4_tiny")}


# ---- our own spec re-derivation (float64) -------------------------------------------------------
def plain_freqs(theta: float) -> list[float]:
    return [theta ** (-2 * i / 64) for i in range(32)]


def corr_dim(n: float, base: float = BASE, orig: int = ORIG) -> float:
    """d(n) = 64 ln(orig / (2 pi n)) / (2 ln base)   (spec §2.3)."""
    return 64 * math.log(orig / (2 * math.pi * n)) / (2 * math.log(base))


def yarn_low_high() -> tuple[float, float]:
    low = min(max(math.floor(corr_dim(BETA_FAST)), 0), 63)
    high = min(max(math.ceil(corr_dim(BETA_SLOW)), 0), 63)
    if high == low:
        high += 0.001
    return low, high


def yarn_freqs() -> list[float]:
    return spec_rope_freqs(4)


def rope64(x, pos, ratio, inverse=False):
    """float64 GPT-J rotation of x[..., -64:] by the published float32 angles; x [T, ..., D], pos [T]."""
    x = x.double()
    ang = published_angles(pos, ratio)                      # [T, 32]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(1)
    c, s = ang.cos(), ang.sin()
    if inverse:
        s = -s
    out = x.clone()
    ev, od = x[..., -64::2], x[..., -63::2]
    out[..., -64::2] = ev * c - od * s
    out[..., -63::2] = od * c + ev * s
    return out


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def arel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


def f32(freqs) -> torch.Tensor:
    return torch.tensor(freqs, dtype=torch.float32)


# ---- frequencies --------------------------------------------------------------------------------
@pytest.mark.parametrize("theta", [10000.0, 50000.0])
def test_swa_only_frequencies_are_plain_rope(theta):
    spec = tiny_spec(rope_theta=theta)
    f = rope_frequencies(spec, 1)
    assert len(f) == 32
    assert torch.equal(f32(f), published_rope_freqs(1, rope_theta=theta))
    assert arel(f, plain_freqs(theta)) <= 2.0 ** -23                # float32 rounding of the spec's values
    assert f[0] == 1.0
    # ratio 0 in the config means SWA-only as well (vLLM: max(1, ratio))
    assert rope_frequencies(spec, 0) == f


def test_yarn_correction_range_numbers():
    # d(32) = 64 ln(65536/(64 pi)) / (2 ln 160000) = 15.45..., d(1) = 24.70...
    assert 15.4 < corr_dim(BETA_FAST) < 15.5
    assert 24.7 < corr_dim(BETA_SLOW) < 24.8
    assert yarn_low_high() == (15, 25)


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_layer_frequencies_are_yarn(ratio):
    spec = tiny_spec()
    f = rope_frequencies(spec, ratio)
    assert len(f) == 32
    assert torch.equal(f32(f), published_rope_freqs(ratio))
    assert arel(f, yarn_freqs()) <= 4 * 2.0 ** -24                   # a few float32 roundings off the spec's
    extrap = [BASE ** (-2 * i / 64) for i in range(32)]
    low, high = yarn_low_high()
    for i in range(32):
        if i <= low:                    # high-frequency pairs keep the extrapolated frequency
            assert f[i] == pytest.approx(extrap[i], rel=2e-7)
        elif i >= high:                 # low-frequency pairs are interpolated: divided by factor
            assert f[i] == pytest.approx(extrap[i] / FACTOR, rel=2e-7)
        else:                           # the ramp lies strictly between
            assert extrap[i] / FACTOR < f[i] < extrap[i]
    assert f[0] == 1.0 and f[15] == pytest.approx(BASE ** (-30 / 64), rel=2e-7)
    assert f[31] == pytest.approx(BASE ** (-62 / 64) / 16, rel=2e-7)
    # differs from the SWA-only table (other base, YaRN)
    assert arel(f, plain_freqs(10000.0)) > 0.1


def test_for_layer_uses_the_layer_table():
    spec = tiny_spec()
    assert torch.equal(f32(Rope.for_layer(spec, 1).freqs), published_rope_freqs(1))
    assert torch.equal(f32(Rope.for_layer(spec, 4).freqs), published_rope_freqs(4))
    assert torch.equal(f32(Rope.for_layer(spec, 128).freqs), published_rope_freqs(128))
    assert Rope.for_layer(spec, 4) == Rope.for_layer(spec, 128)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_give_the_published_frequencies(name):
    spec = SHIPPED[name]
    for ratio in sorted(set(spec.compress_ratios)):
        want = published_rope_freqs(ratio, **published_rope_kw(spec))
        assert torch.equal(f32(Rope.for_layer(spec, ratio).freqs), want), ratio
        assert torch.equal(oracle._freqs(spec.to_dump(), ratio), want), ratio     # the oracle's own


# ---- tables: the published float32 numbers, bit for bit ------------------------------------------
@functools.lru_cache(maxsize=1)
def published_table(freqs: tuple[float, ...]):
    """The whole published table [MAX_POS, 32]: polar(1, outer(arange(seqlen), freqs)) at seqlen = MAX_POS."""
    return published_freqs_cis(torch.arange(MAX_POS), f32(freqs))


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_tables_are_the_published_ones_bit_for_bit(ratio):
    g = torch.Generator().manual_seed(ratio)
    pos = torch.cat((torch.tensor(SAMPLE), torch.randint(0, MAX_POS, (2000,), generator=g)))
    for name in ("dsv4_flash", "dsv4_pro"):
        spec = SHIPPED[name]
        freqs = published_rope_freqs(ratio, **published_rope_kw(spec))
        want = published_table(tuple(freqs.tolist()))[pos]
        assert torch.equal(want, published_freqs_cis(pos, freqs))      # rows do not depend on the table length
        rope = Rope.for_layer(spec, ratio)
        c, s = rope.cos_sin(pos)
        assert c.dtype == s.dtype == torch.float32 and c.shape == s.shape == (len(pos), 32)
        assert torch.equal(c, want.real) and torch.equal(s, want.imag), name
        rows = rope.at(pos.view(-1, 8))                                  # any positions shape
        assert torch.equal(rows.cos, want.real.view(-1, 8, 32)) and torch.equal(rows.sin, want.imag.view(-1, 8, 32))
        # the oracle rotates by the same table: equal outputs, forward and inverse
        x = torch.randn(len(pos), 2, 512, generator=g)
        for inverse in (False, True):
            ours = rope.apply(x, pos, inverse=inverse)
            theirs = oracle._rope(x, pos[:, None], oracle._freqs(spec.to_dump(), ratio), inverse=inverse)
            assert torch.equal(ours, theirs), (name, inverse)


@pytest.mark.parametrize("ratio", [1, 4])
def test_float32_tables_differ_from_float64_angles_as_published(ratio):
    """The float32 angle p·f is off by up to half an ulp of p·f: the published table's cos/sin are ~3e-4 from
    the float64 ones at 10k positions, ~2e-3 at 100k, ~2e-2 at 1M. Float64 angles would fail this."""
    rope = Rope.for_layer(tiny_spec(), ratio)
    f64 = torch.tensor(spec_rope_freqs(ratio), dtype=torch.float64)

    def gap(p: int) -> float:
        c, s = rope.cos_sin(torch.tensor([p]))
        ang = p * f64
        return max(float((c.double() - ang.cos()).abs().max()), float((s.double() - ang.sin()).abs().max()))

    assert gap(0) == 0.0 and gap(1) <= 1e-7
    assert 1e-4 <= gap(10_000) <= 1e-3
    assert 5e-4 <= gap(100_000) <= 1e-2
    assert 5e-3 <= gap(MAX_POS - 1) <= 1e-1


@pytest.mark.parametrize("ratio", [1, 128])
@pytest.mark.parametrize("n", [1, 37, 5000])
def test_cos_sin_cache_layout(ratio, n):
    rope = Rope.for_layer(tiny_spec(), ratio)
    cache = rope.cos_sin_cache(n)
    assert cache.shape == (n, 64) and cache.dtype == torch.float32
    want = published_freqs_cis(torch.arange(n), published_rope_freqs(ratio))
    assert torch.equal(cache[:, :32], want.real) and torch.equal(cache[:, 32:], want.imag)
    assert torch.equal(cache[0], torch.cat((torch.ones(32), torch.zeros(32))))


# ---- apply ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("shape", [(7, 512), (5, 3, 512), (4, 2, 128)])
def test_apply_matches_gptj_rotation_and_leaves_nope_untouched(ratio, shape):
    g = torch.Generator().manual_seed(hash((ratio, shape)) % 2**31)
    x = torch.randn(*shape, generator=g)
    pos = torch.randint(0, 70000, (shape[0],), generator=g)
    rope = Rope.for_layer(tiny_spec(), ratio)
    y = rope.apply(x, pos)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y[..., :-64], x[..., :-64])                 # pass-through, bit exact
    assert rel(y, rope64(x, pos, ratio)) <= 1e-6
    assert not torch.allclose(y[..., -64:], x[..., -64:])          # it did rotate
    yi = rope.apply(x, pos, inverse=True)
    assert torch.equal(yi[..., :-64], x[..., :-64])
    assert rel(yi, rope64(x, pos, ratio, inverse=True)) <= 1e-6


@settings(max_examples=40, deadline=None)
@given(i=st.integers(0, 31), p=st.integers(0, 200000), a=st.floats(-3, 3), b=st.floats(-3, 3))
def test_apply_rotates_interleaved_pair_by_p_times_f(i, p, a, b):
    """Only pair (2i, 2i+1) of the last 64 dims is non-zero: it is rotated in place by the published angle
    fl32(p·f_i)."""
    rope = Rope(freqs=tuple(published_rope_freqs(4).tolist()))
    x = torch.zeros(1, 512)
    x[0, NOPE + 2 * i], x[0, NOPE + 2 * i + 1] = a, b
    y = rope.apply(x, torch.tensor([p]))[0].double()
    ang = float(published_angles(torch.tensor([p]), 4)[0, i])
    c, s = math.cos(ang), math.sin(ang)
    exp = torch.zeros(512, dtype=torch.float64)
    exp[NOPE + 2 * i], exp[NOPE + 2 * i + 1] = a * c - b * s, b * c + a * s
    assert (y - exp).abs().max() <= 1e-6 * (abs(a) + abs(b) + 1)


@pytest.mark.parametrize("ratio", [1, 4])
def test_inverse_after_forward_is_identity_and_norm_is_preserved(ratio):
    g = torch.Generator().manual_seed(3 + ratio)
    x = torch.randn(16, 4, 512, generator=g) * 3
    pos = torch.randint(0, 1 << 20, (16,), generator=g)
    rope = Rope.for_layer(tiny_spec(), ratio)
    y = rope.apply(x, pos)
    assert rel(rope.apply(y, pos, inverse=True), x) <= 1e-6
    assert rel(rope.apply(rope.apply(x, pos, inverse=True), pos), x) <= 1e-6
    n0 = x[..., -64:].double().norm(dim=-1)
    n1 = y[..., -64:].double().norm(dim=-1)
    assert float(((n1 - n0).abs() / n0).max()) <= 1e-6
    # pair-wise norms are preserved too (each pair is its own 2-D rotation)
    p0 = x[..., -64:].double().unflatten(-1, (32, 2)).norm(dim=-1)
    p1 = y[..., -64:].double().unflatten(-1, (32, 2)).norm(dim=-1)
    assert float(((p1 - p0).abs() / p0.clamp_min(1e-3)).max()) <= 1e-5


def test_inverse_sign_convention():
    """§2.3, the inverse negates the sine: o=[1,2,3,4] with 2 NoPE + 2 RoPE dims, cos=0, sin=1 -> inverse
    gives [1,2,4,-3]."""
    cos, sin = torch.ones(1, 32), torch.zeros(1, 32)
    cos[0, 0], sin[0, 0] = 0.0, 1.0                             # pair 0 at angle pi/2; others angle 0
    rows = RopeRows(cos=cos, sin=sin)
    x = torch.zeros(1, 512)
    x[0, 446:450] = torch.tensor([1.0, 2.0, 3.0, 4.0])        # two NoPE dims then the first RoPE pair
    x[0, 450:] = torch.arange(62, dtype=torch.float32) - 30   # other pairs: angle 0, unchanged
    inv = rows.rotate(x, inverse=True)
    assert inv[0, 446:450].tolist() == [1.0, 2.0, 4.0, -3.0]
    fwd = rows.rotate(x)
    assert fwd[0, 446:450].tolist() == [1.0, 2.0, -4.0, 3.0]
    assert torch.equal(inv[0, 450:], x[0, 450:]) and torch.equal(fwd[0, 450:], x[0, 450:])
    assert torch.equal(inv[0, :448], x[0, :448])


@settings(max_examples=25, deadline=None)
@given(p=st.integers(0, 300000), q=st.integers(0, 300000), shift=st.integers(-300000, 300000),
       ratio=st.sampled_from([1, 4]))
def test_relative_rotation_property(p, q, shift, ratio):
    """<R(p) u, R(p') v> = <u, R(θ(p') - θ(p)) v> for the table's angles θ, so it depends only on p - p' up to
    the float32 rounding of θ (at most 2^-24 · p per angle, the frequencies being at most 1)."""
    shift = max(shift, -min(p, q))
    g = torch.Generator().manual_seed(p * 7 + q)
    u, v = torch.randn(1, 512, generator=g), torch.randn(1, 512, generator=g)
    rope = Rope.for_layer(tiny_spec(), ratio)

    def dot(a, b):
        ra = rope.apply(u, torch.tensor([a]))[0, -64:].double()
        rb = rope.apply(v, torch.tensor([b]))[0, -64:].double()
        return float(ra @ rb)

    d0, d1 = dot(p, q), dot(p + shift, q + shift)
    scale = float(u[0, -64:].norm() * v[0, -64:].norm())
    rounding = 2.0 ** -24 * (p + q + (p + shift) + (q + shift))
    assert abs(d0 - d1) <= (2e-6 + rounding) * scale
    # and it equals <u, R(θ(q) - θ(p)) v> computed in float64
    dang = published_angles(torch.tensor([q]), ratio) - published_angles(torch.tensor([p]), ratio)   # [1, 32]
    c, s = dang.cos()[0], dang.sin()[0]
    vv = v[0, -64:].double()
    ev, od = vv[0::2], vv[1::2]
    rv = torch.stack((ev * c - od * s, od * c + ev * s), -1).flatten()
    assert abs(d0 - float(u[0, -64:].double() @ rv)) <= 2e-6 * scale


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("p", [1_000_000, 1_048_575, 999_983])
def test_large_positions_rotate_by_the_published_angles(ratio, p):
    g = torch.Generator().manual_seed(p % 1000 + ratio)
    x = torch.randn(3, 8, 512, generator=g)
    pos = torch.tensor([p, p - 1, p - 12345])
    rope = Rope.for_layer(tiny_spec(), ratio)
    assert rel(rope.apply(x, pos)[..., -64:], rope64(x, pos, ratio)[..., -64:]) <= 1e-6
    assert rel(rope.apply(x, pos, inverse=True)[..., -64:], rope64(x, pos, ratio, inverse=True)[..., -64:]) <= 1e-6
