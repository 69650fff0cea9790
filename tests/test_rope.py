"""RoPE (DSV4_SPEC §2.3, §5.1, §6.2) against our own float64 re-derivation of the spec formulas.

Expected values never come from `dsv4`: frequencies, YaRN ramp and the GPT-J rotation are written
out again here from the spec text, in float64.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import spec_rope_freqs, tiny_spec
from dsv4.components.rope import Rope, rope_frequencies

NOPE, ROPE = 448, 64
BASE, ORIG, FACTOR, BETA_FAST, BETA_SLOW = 160000.0, 65536, 16.0, 32.0, 1.0


# ---- our own spec re-derivation ---------------------------------------------------------------
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


def rope64(x, pos, freqs, inverse=False):
    """float64 GPT-J rotation of x[..., -64:]; x [T, ..., D], pos [T]."""
    x = x.double()
    f = torch.tensor(freqs, dtype=torch.float64)
    ang = pos.double()[:, None] * f                         # [T, 32]
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
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs()).max())


# ---- frequencies --------------------------------------------------------------------------------
@pytest.mark.parametrize("theta", [10000.0, 50000.0])
def test_swa_only_frequencies_are_plain_rope(theta):
    spec = tiny_spec(rope_theta=theta)
    f = rope_frequencies(spec, 1)
    assert len(f) == 32
    assert arel(f, plain_freqs(theta)) <= 1e-12
    assert f[0] == 1.0
    # ratio 0 in the config means SWA-only as well (vLLM: max(1, ratio))
    assert arel(rope_frequencies(spec, 0), plain_freqs(theta)) <= 1e-12


def test_yarn_correction_range_numbers():
    # d(32) = 64 ln(65536/(64 pi)) / (2 ln 160000) = 15.45..., d(1) = 24.70...
    assert 15.4 < corr_dim(BETA_FAST) < 15.5
    assert 24.7 < corr_dim(BETA_SLOW) < 24.8
    assert yarn_low_high() == (15, 25)


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_layer_frequencies_are_yarn(ratio):
    spec = tiny_spec()
    f = rope_frequencies(spec, ratio)
    ref = yarn_freqs()
    assert len(f) == 32
    assert arel(f, ref) <= 1e-12
    extrap = [BASE ** (-2 * i / 64) for i in range(32)]
    low, high = yarn_low_high()
    for i in range(32):
        if i <= low:                    # high-frequency pairs keep the extrapolated frequency
            assert f[i] == pytest.approx(extrap[i], rel=1e-12)
        elif i >= high:                 # low-frequency pairs are interpolated: divided by factor
            assert f[i] == pytest.approx(extrap[i] / FACTOR, rel=1e-12)
        else:                           # the ramp lies strictly between
            assert extrap[i] / FACTOR < f[i] < extrap[i]
    assert f[0] == 1.0 and f[15] == pytest.approx(BASE ** (-30 / 64), rel=1e-12)
    assert f[31] == pytest.approx(BASE ** (-62 / 64) / 16, rel=1e-12)
    # differs from the SWA-only table (other base, YaRN)
    assert arel(f, plain_freqs(10000.0)) > 0.1


def test_for_layer_uses_the_layer_table():
    spec = tiny_spec()
    assert arel(Rope.for_layer(spec, 1).freqs, plain_freqs(10000.0)) <= 1e-12
    assert arel(Rope.for_layer(spec, 4).freqs, yarn_freqs()) <= 1e-12
    assert arel(Rope.for_layer(spec, 128).freqs, yarn_freqs()) <= 1e-12


# ---- apply ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("shape", [(7, 512), (5, 3, 512), (4, 2, 128)])
def test_apply_matches_gptj_rotation_and_leaves_nope_untouched(ratio, shape):
    g = torch.Generator().manual_seed(hash((ratio, shape)) % 2**31)
    x = torch.randn(*shape, generator=g)
    pos = torch.randint(0, 70000, (shape[0],), generator=g)
    rope = Rope.for_layer(tiny_spec(), ratio)
    freqs = plain_freqs(10000.0) if ratio == 1 else yarn_freqs()
    y = rope.apply(x, pos)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y[..., :-64], x[..., :-64])                 # pass-through, bit exact
    assert rel(y, rope64(x, pos, freqs)) <= 1e-6
    assert not torch.allclose(y[..., -64:], x[..., -64:])          # it did rotate
    yi = rope.apply(x, pos, inverse=True)
    assert torch.equal(yi[..., :-64], x[..., :-64])
    assert rel(yi, rope64(x, pos, freqs, inverse=True)) <= 1e-6


@settings(max_examples=40, deadline=None)
@given(i=st.integers(0, 31), p=st.integers(0, 200000), a=st.floats(-3, 3), b=st.floats(-3, 3))
def test_apply_rotates_interleaved_pair_by_p_times_f(i, p, a, b):
    """Only pair (2i, 2i+1) of the last 64 dims is non-zero: it is rotated by angle p*f_i in place."""
    rope = Rope(freqs=tuple(yarn_freqs()))
    x = torch.zeros(1, 512)
    x[0, NOPE + 2 * i], x[0, NOPE + 2 * i + 1] = a, b
    y = rope.apply(x, torch.tensor([p]))[0].double()
    ang = p * yarn_freqs()[i]
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


def test_inverse_sign_convention_spec_6_2():
    """§6.2: o=[1,2,3,4] with 2 NoPE + 2 RoPE dims, cos=0, sin=1 -> inverse gives [1,2,4,-3]."""
    rope = Rope(freqs=(math.pi / 2,) + (0.0,) * 31)         # pair 0 at angle pi/2 at p=1; others angle 0
    x = torch.zeros(1, 512)
    x[0, 446:450] = torch.tensor([1.0, 2.0, 3.0, 4.0])        # two NoPE dims then the first RoPE pair
    x[0, 450:] = torch.arange(62, dtype=torch.float32) - 30   # other pairs: angle 0, unchanged
    inv = rope.apply(x, torch.tensor([1]), inverse=True)
    assert inv[0, 446:450].tolist() == [1.0, 2.0, 4.0, -3.0]
    fwd = rope.apply(x, torch.tensor([1]))
    assert fwd[0, 446:450].tolist() == [1.0, 2.0, -4.0, 3.0]
    assert torch.equal(inv[0, 450:], x[0, 450:]) and torch.equal(fwd[0, 450:], x[0, 450:])
    assert torch.equal(inv[0, :448], x[0, :448])


@settings(max_examples=25, deadline=None)
@given(p=st.integers(0, 300000), q=st.integers(0, 300000), shift=st.integers(-300000, 300000),
       ratio=st.sampled_from([1, 4]))
def test_relative_rotation_property(p, q, shift, ratio):
    """<R(p) u, R(p') v> depends only on p - p' (compare at (p, p') and (p+s, p'+s))."""
    shift = max(shift, -min(p, q))
    g = torch.Generator().manual_seed(p * 7 + q)
    u, v = torch.randn(1, 512, generator=g), torch.randn(1, 512, generator=g)
    rope = Rope.for_layer(tiny_spec(), ratio)
    freqs = plain_freqs(10000.0) if ratio == 1 else yarn_freqs()

    def dot(a, b):
        ra = rope.apply(u, torch.tensor([a]))[0, -64:].double()
        rb = rope.apply(v, torch.tensor([b]))[0, -64:].double()
        return float(ra @ rb)

    d0, d1 = dot(p, q), dot(p + shift, q + shift)
    scale = float(u[0, -64:].norm() * v[0, -64:].norm())
    assert abs(d0 - d1) <= 2e-6 * scale
    # and it equals <u, R(q - p) v> computed in float64
    exp = float(u[0, -64:].double() @ rope64(v, torch.tensor([q - p]), freqs)[0, -64:])
    assert abs(d0 - exp) <= 2e-6 * scale


@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("p", [1_000_000, 1_048_575, 999_983])
def test_large_positions_are_accurate(ratio, p):
    g = torch.Generator().manual_seed(p % 1000 + ratio)
    x = torch.randn(3, 8, 512, generator=g)
    pos = torch.tensor([p, p - 1, p - 12345])
    freqs = plain_freqs(10000.0) if ratio == 1 else yarn_freqs()
    rope = Rope.for_layer(tiny_spec(), ratio)
    y = rope.apply(x, pos)
    ref = rope64(x, pos, freqs)
    assert rel(y[..., -64:], ref[..., -64:]) <= 1e-5
    assert rel(rope.apply(x, pos, inverse=True)[..., -64:], rope64(x, pos, freqs, inverse=True)[..., -64:]) <= 1e-5


@pytest.mark.parametrize("ratio", [1, 128])
@pytest.mark.parametrize("n", [1, 37, 5000])
def test_cos_sin_cache_layout(ratio, n):
    rope = Rope.for_layer(tiny_spec(), ratio)
    cache = rope.cos_sin_cache(n)
    assert cache.shape == (n, 64) and cache.dtype == torch.float32
    freqs = torch.tensor(plain_freqs(10000.0) if ratio == 1 else yarn_freqs(), dtype=torch.float64)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * freqs
    assert float((cache[:, :32].double() - ang.cos()).abs().max()) <= 1e-6
    assert float((cache[:, 32:].double() - ang.sin()).abs().max()) <= 1e-6
    assert torch.equal(cache[0], torch.cat((torch.ones(32), torch.zeros(32))))
