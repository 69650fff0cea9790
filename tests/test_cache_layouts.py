"""KV cache layouts byte for byte (docs/numerics.md §3.1 slot ids, §3.2 fp8_ds_mla, §3.3 per-tensor fp8).

Every expected byte here comes from an independent packer written from the spec text in plain
Python (struct + math, one value at a time): bf16 round-to-nearest-even from the float32 bits, OCP
e4m3fn encode/decode, the UE8M0 block exponent as the smallest e with amax <= 448 * 2^e, and the page
geometry (all tokens' 576 data bytes, then all tokens' 8 scale bytes, stride a multiple of 576).
The implementation is never asked to compute an expected byte; its `pack`/`unpack` are themselves
checked against this packer. The codecs of the packer are checked once against torch's own casts.
"""
from __future__ import annotations

import itertools
import math
import random
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4.values.seam import PagedCache
from dsv4.values.errors import InvalidRequest
from dsv4.formats.fp8 import per_tensor_query, per_tensor_scales
from dsv4.formats.fp8_ds_mla import write_kept_records, write_records_sync_free
from dsv4.strategies import (Fp8DsMlaFnuzLayout, Fp8DsMlaLayout, Fp8KeyLayout, Fp8PerTensorLayout, Mxfp4KeyLayout,
                             PlainRowLayout)

D, NOPE, ROPE, TILE = 512, 448, 64, 64
DATA_B, SCALE_B, TOKEN_B = 576, 8, 584          # §3.2: 448 + 128 data bytes, 7 + 1 scale bytes
E4M3_MAX = 448.0


# ==================================================================================================
# Independent reference packer (spec text only)
# ==================================================================================================
def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def bf16_bits(v: float) -> int:
    """bf16 (round to nearest, ties to even) of a float32-representable value, as 16 bits."""
    b = f32_bits(v)
    assert (b & 0x7F800000) != 0x7F800000, "reference packer: non-finite input"
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def bf16(v: float) -> float:
    return bits_f32(bf16_bits(v) << 16)


def e4m3_byte(v: float) -> int:
    """OCP e4m3fn (bias 7, 3 mantissa bits, no inf, max 448) of v clamped to ±448, RNE."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), E4M3_MAX)
    if a == 0.0:
        return sign
    E = max(math.frexp(a)[1] - 1, -6)            # floor(log2 a), subnormals share 2^-6's spacing
    k = round(a / 2.0 ** (E - 3))                # exact quotient; Python rounds half to even
    if k == 0:
        return sign
    if k < 8:                                    # subnormal: exponent field 0, value k * 2^-9
        return sign | k
    if k == 16:
        E, k = E + 1, 8
    byte = sign | ((E + 7) << 3) | (k - 8)
    assert byte & 0x7F != 0x7F                   # never NaN (|v| <= 448)
    return byte


def e4m3_value(b: int) -> float:
    assert b & 0x7F != 0x7F, "NaN code"
    s = -1.0 if b & 0x80 else 1.0
    ef, m = (b >> 3) & 0xF, b & 7
    return s * (m * 2.0 ** -9 if ef == 0 else (1 + m / 8) * 2.0 ** (ef - 7))


E4M3_TABLE = [None if c & 0x7F == 0x7F else e4m3_value(c) for c in range(256)]


def block_exponent(xs) -> int:
    """§3.2: amax = max(|x|, 1e-4); e = ceil(log2(amax/448)) -- the least e with amax <= 448*2^e."""
    amax = max(max(abs(x) for x in xs), 1e-4)
    e = math.ceil(math.log2(amax / E4M3_MAX))
    while E4M3_MAX * 2.0 ** e < amax:
        e += 1
    while E4M3_MAX * 2.0 ** (e - 1) >= amax:
        e -= 1
    return e


def ref_record(row) -> tuple[bytes, bytes]:
    """One token: (576 data bytes, 8 scale bytes) from a row of 512 float32 values."""
    x = [bf16(v) for v in row]
    data, exps = bytearray(), []
    for k in range(NOPE // TILE):
        blk = x[k * TILE:(k + 1) * TILE]
        e = block_exponent(blk)
        exps.append(min(max(e + 127, 0), 255))
        data += bytes(e4m3_byte(max(-E4M3_MAX, min(E4M3_MAX, v / 2.0 ** e))) for v in blk)
    for v in row[NOPE:]:
        b = bf16_bits(v)
        data += bytes((b & 0xFF, b >> 8))        # little-endian bf16
    assert len(data) == DATA_B
    return bytes(data), bytes(exps + [0])


def ref_dequant(data: bytes, scales: bytes) -> list[float]:
    out = [E4M3_TABLE[data[i]] * 2.0 ** (scales[i // TILE] - 127) for i in range(NOPE)]
    for j in range(ROPE):
        out.append(bits_f32((data[NOPE + 2 * j] | data[NOPE + 2 * j + 1] << 8) << 16))
    return out


def ds_stride(B: int) -> int:
    return math.ceil(B * TOKEN_B / DATA_B) * DATA_B


def ranges(kind: str, B: int, slot: int) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of the whole cache that belong to `slot`."""
    if kind == "fp8_ds_mla":
        page, t = divmod(slot, B)
        base = page * ds_stride(B)
        return [(base + t * DATA_B, base + (t + 1) * DATA_B),
                (base + B * DATA_B + t * SCALE_B, base + B * DATA_B + (t + 1) * SCALE_B)]
    bpt = {"float32": 4 * D, "bf16": 2 * D, "fp8_per_tensor": D}[kind]
    return [(slot * bpt, (slot + 1) * bpt)]


def ref_row_bytes(kind: str, row, kv_scale: float = 1.0) -> list[bytes]:
    """The bytes of one row, one chunk per range of `ranges`."""
    if kind == "fp8_ds_mla":
        return list(ref_record(row))
    if kind == "float32":
        return [struct.pack(f"<{D}f", *row)]
    if kind == "bf16":
        return [b"".join(struct.pack("<H", bf16_bits(v)) for v in row)]
    if kind == "fp8_per_tensor":
        return [bytes(e4m3_byte(max(-E4M3_MAX, min(E4M3_MAX, bf16(v) / kv_scale))) for v in row)]
    raise AssertionError(kind)


def cache_total_bytes(kind: str, nb: int, B: int) -> int:
    return nb * (ds_stride(B) if kind == "fp8_ds_mla" else B * ranges(kind, B, 0)[0][1])


def ref_image(kind: str, nb: int, B: int, writes: dict, kv_scale: float = 1.0) -> bytearray:
    """The whole cache after writing {slot: row} into zeroed storage."""
    img = bytearray(cache_total_bytes(kind, nb, B))
    for slot, row in writes.items():
        for (lo, hi), chunk in zip(ranges(kind, B, slot), ref_row_bytes(kind, row, kv_scale)):
            assert hi - lo == len(chunk)
            img[lo:hi] = chunk
    return img


def raw_bytes(t) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1).clone()


def assert_bytes_equal(actual: torch.Tensor, expected) -> None:
    exp = torch.frombuffer(bytearray(expected), dtype=torch.uint8)
    assert actual.numel() == exp.numel(), (actual.numel(), exp.numel())
    bad = torch.nonzero(actual != exp).flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(f"{bad.numel()} bytes differ; first at offset {i}: got {int(actual[i])}, "
                             f"want {int(exp[i])} (offsets {bad[:8].tolist()})")


def range_mask(kind: str, B: int, total: int, slots) -> torch.Tensor:
    m = torch.zeros(total, dtype=torch.bool)
    for s in slots:
        for lo, hi in ranges(kind, B, s):
            m[lo:hi] = True
    return m


LAYOUTS = {
    "fp8_ds_mla": lambda: Fp8DsMlaLayout(),
    "fp8_per_tensor": lambda: Fp8PerTensorLayout(kv_scale=0.5),
    "bf16": lambda: PlainRowLayout(name="bf16", dtype="bfloat16"),
    "float32": lambda: PlainRowLayout(name="float32", dtype="float32"),
}
KV_SCALE = {"fp8_per_tensor": 0.5}


def make_cache(kind: str, B: int, nb: int) -> PagedCache:
    lay = LAYOUTS[kind]()
    return PagedCache(name="kv", layout=lay, block_size=B, head_dim=D,
                      data=lay.allocate(num_blocks=nb, block_size=B, head_dim=D, device="cpu"))


def scaled_rows(n: int, seed: int, lo: int = -20, hi: int = 20) -> torch.Tensor:
    """Random float32 rows (not bf16-exact) with an independent power-of-two scale per 64 dims."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(lo, hi + 1, (n, D // TILE, 1), generator=g).float())
    return (torch.randn(n, D // TILE, TILE, generator=g) * scale).reshape(n, D)


# ==================================================================================================
# The reference codecs agree with torch's own casts (so the packer below is trustworthy)
# ==================================================================================================
def test_reference_codecs_agree_with_torch_casts():
    codes = [c for c in range(256) if c & 0x7F != 0x7F]
    torch_vals = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert [e4m3_value(c) for c in codes] == torch_vals
    # encode: every code, every midpoint between neighbours (ties), and random values incl. subnormals
    pos = sorted({e4m3_value(c) for c in codes if e4m3_value(c) >= 0})
    mids = [(a + b) / 2 for a, b in itertools.pairwise(pos)]
    g = torch.Generator().manual_seed(0)
    rnd = (torch.randn(4000, generator=g) * torch.exp2(torch.randint(-14, 9, (4000,), generator=g).float()))
    vals = pos + mids + [-v for v in pos + mids] + rnd.clamp(-448, 448).tolist()
    ours = [e4m3_byte(v) for v in vals]
    theirs = torch.tensor(vals, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert ours == theirs
    # hand-checked codes
    assert [e4m3_byte(v) for v in (448.0, -448.0, 432.0, 400.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10,
                                    -(2.0 ** -11), 1.0)] == [0x7E, 0xFE, 0x7E, 0x7C, 0x08, 0x01, 0x00, 0x02, 0x80, 0x38]
    # bf16 RNE from float32 bits
    x = torch.randint(-2 ** 31, 2 ** 31, (4000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x) & (x.abs() < 3e38)]
    assert [bf16_bits(v) for v in x.tolist()] == (x.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    assert bf16_bits(bits_f32(0x3F808000)) == 0x3F80 and bf16_bits(bits_f32(0x3F818000)) == 0x3F82   # ties to even


# ==================================================================================================
# fp8_ds_mla: geometry
# ==================================================================================================
@pytest.mark.parametrize("B", [64, 2, 3, 1])
def test_ds_mla_page_geometry(B):
    lay = Fp8DsMlaLayout()
    assert lay.bytes_per_token(512) == 584
    want = math.ceil(B * 584 / 576) * 576
    assert lay.page_bytes(B, 512) == want and want % 576 == 0
    assert {64: 37440, 2: 1728}.get(B, want) == want            # §3.1's pool sizes
    t = lay.allocate(num_blocks=3, block_size=B, head_dim=512, device="cpu")
    assert t.dtype == torch.uint8 and tuple(t.shape) == (3, want) and not bool(t.any())
    with pytest.raises(ValueError):
        lay.page_bytes(B, 128)                                  # indexer keys are not fp8_ds_mla rows


# ==================================================================================================
# fp8_ds_mla: byte-exact pages
# ==================================================================================================
def rows_random(n):
    return scaled_rows(n, seed=11)


def rows_zeros(n):
    return torch.zeros(n, D)


def rows_huge(n):
    r = scaled_rows(n, seed=12, lo=-2, hi=2)
    r[:, 2 * TILE + 5] = 1e30                                  # one huge value in NoPE block 2
    return r


def rows_limits(n):
    """Values at the e4m3 edges, relative to the block's power-of-two scale."""
    r = torch.zeros(n, D)
    e = 3
    y = [448, -448, 446, 432, 400, 240, 232, 2 ** -6, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 2 ** -11, -(2 ** -9),
         -(2 ** -11), 7 * 2 ** -9 + 2 ** -10, 13 * 2 ** -10]
    r[:, :len(y)] = torch.tensor(y, dtype=torch.float64).mul(2.0 ** e).float()       # block 0: amax = 448*2^3
    r[:, 64:66] = torch.tensor([-448 * 2.0 ** -5, 448 * 2.0 ** -6])                 # block 1: amax negative, exact
    r[:, 128:130] = torch.tensor([446 * 2.0 ** 7, -3.0])                            # block 2: max rounds up to 448
    r[:, 192:194] = torch.tensor([450.0, 1.0])                                      # block 3: just above 448 -> e=1
    r[:, 256:259] = torch.tensor([1e-5, -3e-6, 2.0 ** -30])                         # block 4: amax clamp regime
    r[:, 320:322] = torch.tensor([1.1e-4, 2.0 ** -40])                              # block 5: just above the clamp
    r[:, 384] = 2.0 ** -30                                                          # block 6: lone tiny value
    r[:, 448:] = torch.linspace(-3e4, 3e4, ROPE)
    r[:, 449] = -0.0
    r[:, 450] = 2.0 ** -130
    for i in range(1, n):
        r[i, :NOPE] *= 2.0 ** (7 * i - 10)                                         # shift the scales per row
    return r


def rows_not_bf16(n):
    r = scaled_rows(n, seed=13, lo=-4, hi=4)
    r[:, 0] = bits_f32(f32_bits(448.0) + 0x40)               # 448*(1+2^-17): bf16 -> 448, so e = 0, not 1
    r[:, 1:TILE] = r[:, 1:TILE].clamp(-400, 400)
    r[:, TILE] = bits_f32(f32_bits(448.0 * 2 ** -4) + 0x7FFF)  # just below a bf16 tie: bf16 -> 28, e = -4 not -3
    r[:, TILE + 1:2 * TILE] = r[:, TILE + 1:2 * TILE].clamp(-20, 20)
    r[:, 448] = bits_f32(0x3F808000)                          # 1 + 2^-8: tie -> 1.0 (0x3F80)
    r[:, 449] = bits_f32(0x3F818000)                          # 1 + 3*2^-8: tie -> 0x3F82
    r[:, 450] = bits_f32(0xBF808001)                          # just above the tie -> 0xBF81
    return r


CASES = {"random": rows_random, "zeros": rows_zeros, "huge": rows_huge, "limits": rows_limits,
         "not_bf16": rows_not_bf16}


@pytest.mark.parametrize("B", [64, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_ds_mla_pages_are_byte_exact(case, B):
    nb = 3
    rows = CASES[case](5)
    slots = random.Random(B * 7 + len(case)).sample(range(nb * B), min(5, nb * B - 1))
    rows = rows[: len(slots)]
    lay = Fp8DsMlaLayout()
    cache = lay.allocate(num_blocks=nb, block_size=B, head_dim=D, device="cpu")
    lay.access(cache, block_size=B, gpu=False).write(torch.tensor(slots), rows)
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (nb, ds_stride(B))
    writes = {s: r.tolist() for s, r in zip(slots, rows)}
    assert_bytes_equal(raw_bytes(cache), ref_image("fp8_ds_mla", nb, B, writes))

    flat, stride = cache.view(-1), ds_stride(B)
    for s in slots:                                       # scale groups start at B*576 within the page
        page, t = divmod(s, B)
        scl = flat[page * stride + B * DATA_B + t * SCALE_B:][:SCALE_B].tolist()
        assert scl[7] == 0 and all(105 <= b <= 254 for b in scl[:7])
        if case == "zeros":
            assert scl[:7] == [127 + math.ceil(math.log2(1e-4 / 448))] * 7 == [105] * 7
            assert not bool(flat[page * stride + t * DATA_B:][:DATA_B].any())
        if case == "limits" and s == slots[0]:            # hand-derived bytes of row 0
            assert scl[:6] == [127 + 3, 127 - 5, 127 + 7, 128, 105, 106]
            data = flat[page * stride + t * DATA_B:][:DATA_B].tolist()
            assert data[:16] == [0x7E, 0xFE, 0x7E, 0x7E, 0x7C, 0x77, 0x76, 0x08, 0x01, 0x00, 0x02, 0x00,
                                 0x81, 0x80, 0x08, 0x06]
            assert data[128] == 0x7E and data[192] == 0x76           # 446*2^7 -> 448*2^7; 450 -> 224*2^1
        if case == "not_bf16":
            assert scl[0] == 127 and scl[1] == 127 - 4
            data = flat[page * stride + t * DATA_B:][:DATA_B].tolist()
            assert data[NOPE:NOPE + 6] == [0x80, 0x3F, 0x82, 0x3F, 0x81, 0xBF]
    if case == "huge":                                    # the huge value only moves its own block's scale
        plain = rows.clone()
        plain[:, 2 * TILE + 5] = rows[:, 2 * TILE + 4]
        for r_h, r_p in zip(rows.tolist(), plain.tolist()):
            (dh, sh), (dp, sp) = ref_record(r_h), ref_record(r_p)
            assert sh[2] == 127 + math.ceil(math.log2(bf16(1e30) / 448)) and sh[2] != sp[2]
            assert sh[:2] + sh[3:] == sp[:2] + sp[3:]
            assert dh[:2 * TILE] + dh[3 * TILE:] == dp[:2 * TILE] + dp[3 * TILE:]


# ==================================================================================================
# fp8_ds_mla: round trip and pack/unpack
# ==================================================================================================
@pytest.mark.parametrize("B", [64, 2, 3])
def test_ds_mla_round_trip(B):
    nb = 6
    rows = scaled_rows(9, seed=21 + B)
    rows[3] = 0.0
    slots = random.Random(B).sample(range(nb * B), len(rows))
    lay = Fp8DsMlaLayout()
    cache = lay.allocate(num_blocks=nb, block_size=B, head_dim=D, device="cpu")
    lay.access(cache, block_size=B, gpu=False).write(torch.tensor(slots, dtype=torch.int32), rows)

    rd = torch.tensor(slots + [-1, -1])
    got = lay.read(cache, rd, block_size=B)
    assert got.dtype == torch.float32 and tuple(got.shape) == (len(rd), D)
    assert torch.equal(got[-2:], torch.zeros(2, D))                       # -1 slots read as zeros
    xb = rows.bfloat16().float()
    assert torch.equal(got[:len(slots), NOPE:], xb[:, NOPE:])              # RoPE dims exact bf16
    for i, row in enumerate(rows.tolist()):
        x = [bf16(v) for v in row]
        e = torch.tensor([block_exponent(x[k * TILE:(k + 1) * TILE]) for k in range(7)], dtype=torch.float64)
        bound = xb[i, :NOPE].double().abs() / 16 + torch.exp2(e - 10).repeat_interleave(TILE)
        err = (got[i, :NOPE].double() - xb[i, :NOPE].double()).abs()
        assert bool((err <= bound).all()), f"row {i}: max excess {float((err - bound).max())}"
        assert got[i].tolist() == ref_dequant(*ref_record(row))          # exactly the spec's dequant
    assert not torch.equal(got[:len(slots), :NOPE], xb[:, :NOPE])          # it was quantized
    # a [T, N] table of slots reads as [T, N, 512]
    two = lay.read(cache, rd.view(1, -1).expand(2, -1), block_size=B)
    assert tuple(two.shape) == (2, len(rd), D) and torch.equal(two[1], got)


def test_ds_mla_pack_and_unpack_agree_with_reference():
    lay = Fp8DsMlaLayout()
    rows = torch.cat((scaled_rows(6, seed=31), rows_limits(2), rows_not_bf16(2), rows_zeros(1)))
    data, scales = lay.pack(rows)
    assert data.dtype == scales.dtype == torch.uint8
    assert tuple(data.shape) == (len(rows), DATA_B) and tuple(scales.shape) == (len(rows), SCALE_B)
    recs = [ref_record(r) for r in rows.tolist()]
    assert data.tolist() == [list(d) for d, _ in recs]
    assert scales.tolist() == [list(s) for _, s in recs]
    my_data = torch.tensor([list(d) for d, _ in recs], dtype=torch.uint8)
    my_scl = torch.tensor([list(s) for _, s in recs], dtype=torch.uint8)
    un = lay.unpack(my_data.view(1, len(rows), DATA_B), my_scl.view(1, len(rows), SCALE_B))
    assert tuple(un.shape) == (1, len(rows), D)
    assert un[0].tolist() == [ref_dequant(d, s) for d, s in recs]


# ==================================================================================================
# fp8_per_tensor
# ==================================================================================================
@pytest.mark.parametrize("kv_scale", [1.0, 0.5])
def test_fp8_per_tensor_bytes_and_read(kv_scale):
    B, nb = 3, 3
    lay = Fp8PerTensorLayout(kv_scale=kv_scale)
    assert lay.page_bytes(B, D) == B * D and lay.bytes_per_token(D) == D
    cache = lay.allocate(num_blocks=nb, block_size=B, head_dim=D, device="cpu")
    assert cache.dtype == torch.float8_e4m3fn and tuple(cache.shape) == (nb, B, D)
    rows = scaled_rows(4, seed=41, lo=-12, hi=6)
    rows[0, :6] = torch.tensor([1000.0, -1e6, 448 * kv_scale, 449 * kv_scale, -460 * kv_scale, 3e-30])
    rows[1, :3] = torch.tensor([bits_f32(0x3F808000), bits_f32(f32_bits(448.0 * kv_scale) + 0x40), -0.0])
    slots = [7, 0, 4, 8]
    lay.access(cache, block_size=B, gpu=False).write(torch.tensor(slots + [-1]), torch.cat((rows, torch.ones(1, D))))
    writes = {s: r.tolist() for s, r in zip(slots, rows)}
    assert_bytes_equal(raw_bytes(cache), ref_image("fp8_per_tensor", nb, B, writes, kv_scale))
    assert raw_bytes(cache)[7 * D:7 * D + 5].tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0xFE]   # clamped at ±448

    got = lay.read(cache, torch.tensor(slots + [-1]), block_size=B)
    want = [[e4m3_value(b) * kv_scale for b in ref_row_bytes("fp8_per_tensor", r, kv_scale)[0]] for r in writes.values()]
    assert got[:-1].tolist() == want and torch.equal(got[-1], torch.zeros(D))


@pytest.mark.parametrize("q_scale,kv_scale", [(1.0, 1.0), (0.5, 0.25)])
def test_fp8_per_tensor_query_and_kernel_scales(q_scale, kv_scale):
    lay = Fp8PerTensorLayout(kv_scale=kv_scale, q_scale=q_scale)
    sigma = D ** -0.5
    bmm1, bmm2 = per_tensor_scales(lay.row_format, sigma)
    assert bmm1 == pytest.approx(sigma * q_scale * kv_scale, rel=1e-12) and bmm2 == kv_scale

    g = torch.Generator().manual_seed(5)
    q = (torch.randn(6, D, generator=g) * 3).bfloat16().float()           # a bf16 query (what vLLM has)
    k = torch.randn(10, D, generator=g) * 2
    q8 = per_tensor_query(lay.row_format, q)
    assert q8.dtype == torch.float8_e4m3fn
    assert q8.view(torch.uint8).tolist() == [[e4m3_byte(v / q_scale) for v in r] for r in q.tolist()]

    cache = lay.allocate(num_blocks=3, block_size=4, head_dim=D, device="cpu")
    lay.access(cache, block_size=4, gpu=False).write(torch.arange(10), k)
    k8 = cache.view(-1, D)[:10].float()                                   # raw e4m3 values, no scale
    qf, k8f = q8.float().double(), k8.double()
    logits8 = bmm1 * qf @ k8f.T
    ref = sigma * q.double() @ k.double().T
    rel = 2.0 ** -4 + 2.0 ** -8                                           # e4m3 half-ulp + bf16 rounding
    eq = q.double().abs() * rel + 2.0 ** -10 * q_scale
    ek = k.double().abs() * rel + 2.0 ** -10 * kv_scale
    bound = sigma * (eq @ (k.double().abs() + ek).T + q.double().abs() @ ek.T)
    assert bool(((logits8 - ref).abs() <= bound).all())
    if (q_scale, kv_scale) != (1.0, 1.0):                                 # the scales matter
        assert not bool(((sigma * qf @ k8f.T - ref).abs() <= bound).all())
    p = torch.softmax(ref, -1)
    out8 = bmm2 * p @ k8f
    assert bool(((out8 - p @ k.double()).abs() <= p @ ek + 1e-12).all())


def test_fp8_query_of_a_float32_query_is_rounded_once():
    """§3.3: fp8 q = e4m3(q / q_scale), one rounding (an earlier fp8_query rounded a float32 q to bf16 first)."""
    lay = Fp8PerTensorLayout(q_scale=1.0)
    q = torch.tensor([1.0625 + 2.0 ** -12, -(1.0625 + 2.0 ** -12), 3.0 + 2.0 ** -20])
    # 1.0625 + 2^-12 lies above the e4m3 midpoint 1.0625 -> 1.125 (0x39); bf16 first makes it the tie -> 1.0
    assert per_tensor_query(lay.row_format, q).view(torch.uint8).tolist() == [e4m3_byte(v) for v in q.tolist()] == [0x39, 0xB9, 0x44]


# ==================================================================================================
# A layout's writer, chosen once per cache
# ==================================================================================================
@pytest.mark.parametrize("lay", [Fp8DsMlaLayout(), Fp8DsMlaFnuzLayout(), Fp8KeyLayout(), Mxfp4KeyLayout()],
                         ids=lambda lay: lay.name)
def test_the_sync_free_record_writer_stores_the_host_writers_bytes(lay):
    """A GPU cache's record writer (every row packed, nothing read on the host) leaves the bytes the host's
    writer does, around -1 slots and for a call of padding alone."""
    dim, B = (D if lay.name.startswith("fp8_ds_mla") else 128), 3
    g = torch.Generator().manual_seed(61)
    pages = torch.randint(0, 256, (4, lay.page_bytes(B, dim)), generator=g, dtype=torch.uint8)
    rows = torch.randn(6, dim, generator=g) * 3
    for slots in ([5, -1, 0, 11, -1, 7], [-1] * 6):
        host, free = pages.clone(), pages.clone()
        write_kept_records(lay, host, torch.tensor(slots, dtype=torch.int32), rows, block_size=B)
        write_records_sync_free(lay, free, torch.tensor(slots, dtype=torch.int32), rows, block_size=B)
        assert torch.equal(free, host) and torch.equal(host, pages) == (max(slots) < 0)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_host_cache_has_no_store_for_the_kernels(kind):
    """Our kernels store rows into GPU caches only: a host cache's rows go through its writer."""
    cache = make_cache(kind, 3, 2)
    assert cache.store is None and cache.access.store is None


# ==================================================================================================
# Isolation of requests sharing a pool (the real PagedCache write path)
# ==================================================================================================
@pytest.mark.parametrize("kind", list(LAYOUTS))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_writes_of_one_request_never_touch_another(kind, data):
    B = data.draw(st.sampled_from([1, 2, 3, 5, 64]), label="block_size")
    nb = data.draw(st.integers(2, 5), label="blocks")
    n_slots = nb * B
    perm = data.draw(st.permutations(range(n_slots)), label="perm")
    n_a = data.draw(st.integers(1, min(8, n_slots - 1)), label="n_a")
    n_b = data.draw(st.integers(1, min(8, n_slots - n_a)), label="n_b")
    slots_a, slots_b = list(perm[:n_a]), list(perm[n_a:n_a + n_b])
    pads = data.draw(st.lists(st.integers(0, n_b), max_size=3), label="pads")       # -1 slots inside B's mapping
    map_b = list(slots_b)
    for p in sorted(pads, reverse=True):
        map_b.insert(p, -1)
    seed = data.draw(st.integers(0, 2 ** 20), label="seed")
    rows_a = scaled_rows(n_a, seed, lo=-12, hi=12)
    rows_b = scaled_rows(len(map_b), seed + 1, lo=-12, hi=12)

    cache = make_cache(kind, B, nb)
    cache.write(torch.tensor(slots_a), rows_a)
    before = raw_bytes(cache.data)
    cache.write(torch.tensor(map_b, dtype=torch.int32), rows_b)
    after = raw_bytes(cache.data)

    total = after.numel()
    in_a, in_b = range_mask(kind, B, total, slots_a), range_mask(kind, B, total, slots_b)
    assert not bool((in_a & in_b).any())
    assert torch.equal(after[in_a], before[in_a])                 # A's data and scale bytes untouched
    assert torch.equal(after[~in_b], before[~in_b])               # nothing outside B's own ranges moved
    writes = {s: r.tolist() for s, r in zip(slots_a, rows_a)}
    writes.update({s: r.tolist() for s, r in zip(map_b, rows_b) if s >= 0})
    assert_bytes_equal(after, ref_image(kind, nb, B, writes, KV_SCALE.get(kind, 1.0)))


# ==================================================================================================
# Bad input through PagedCache.write
# ==================================================================================================
def _prefilled(kind: str, B: int = 3, nb: int = 3):
    cache = make_cache(kind, B, nb)
    cache.write(torch.tensor([0, 4, nb * B - 1]), scaled_rows(3, seed=51, lo=-3, hi=3))
    return cache


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_non_finite_row_is_refused_and_nothing_is_written(kind, bad):
    """A row that is not finite -- or is finite in float32 but overflows bf16 (|x| >= 3.3961e38), which a
    layout would store as inf (bf16) or as a NaN code with exponent byte 255 poisoning its 64-dim block
    (fp8_ds_mla) -- is refused by the layer before any layout sees it: through the engine, the step
    fails naming the row and the layer's pages keep every byte they had."""
    from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec

    spec = tiny_spec()
    eng, _ = make_engine(spec, layout=LAYOUTS[kind](), layers=(0,), swa_block_size=64)
    X = hidden_for({"a": 10}, spec.hidden_size)
    drive(eng, {"a": X["a"][:6]}, chunked({"a": 6}, 6))
    layer = eng.layers[0][0]
    layer.kv_norm[100] = bad                                       # the normed row's dim 100 takes it
    before = [raw_bytes(t) for t in eng.pools[0].layers[0].tensors()]
    with pytest.raises(InvalidRequest, match=r"non-finite swa row \(layer 0, request 'a', position 6\)"):
        eng.step(X["a"][6:9], torch.arange(6, 9), ["a"] * 3)
    assert all(torch.equal(b, raw_bytes(t)) for b, t in zip(before, eng.pools[0].layers[0].tensors()))
    assert eng.lengths["a"] == 6


def test_rows_past_bf16_range_are_refused_like_non_finite_ones():
    from dsv4.components.front import stored_badly

    rows = scaled_rows(4, seed=55, lo=-2, hi=2)
    rows[1, 5] = 3.4e38                    # finite in float32, inf in bf16
    rows[2, 7] = 3.3e38                    # still a finite bf16 value
    rows[3, 0] = float("nan")
    assert bool(torch.isfinite(rows[:3]).all())
    assert stored_badly(rows).tolist() == [False, True, False, True]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_minus_one_slots_are_skipped(kind):
    B, nb = 3, 3
    cache = make_cache(kind, B, nb)
    rows = scaled_rows(5, seed=54)
    cache.write(torch.tensor([-1, 4, -1, nb * B - 1, -1]), rows)
    want = ref_image(kind, nb, B, {4: rows[1].tolist(), nb * B - 1: rows[3].tolist()}, KV_SCALE.get(kind, 1.0))
    assert_bytes_equal(raw_bytes(cache.data), want)
    cache.write(torch.full((5,), -1), rows * 3)                           # all padding: nothing at all
    assert_bytes_equal(raw_bytes(cache.data), want)


# ==================================================================================================
# Through the engine: SWA and compressed caches are fp8_ds_mla pages, indexer keys float32 rows
# ==================================================================================================
def _fp8_engine():
    from tests.conftest import make_engine, tiny_spec

    spec = tiny_spec()
    eng, _ = make_engine(spec, layout=Fp8DsMlaLayout(), swa_block_size=64, compressed_block_tokens=256, swa_blocks=8,
                         compressed_blocks=8)
    return spec, eng, eng.pools[0]


def _check_stored_record(flat: list, data_lo: int, scale_lo: int, read_row: torch.Tensor) -> None:
    """Bytes of one stored row are a genuine fp8_ds_mla record and read() dequantizes exactly them."""
    data, scl = bytes(flat[data_lo:data_lo + DATA_B]), bytes(flat[scale_lo:scale_lo + SCALE_B])
    assert scl[7] == 0
    vals = ref_dequant(data, scl)
    assert read_row.tolist() == vals
    d2, s2 = ref_record(vals)
    assert ref_dequant(d2, s2) == vals                                    # a fixed point of the quantizer
    for k in range(7):
        qmax = max(abs(E4M3_TABLE[b]) for b in data[k * TILE:(k + 1) * TILE])
        assert 105 <= scl[k] <= 247
        if scl[k] > 105:                      # amax/2^e > 224, so the largest code is >= 224 (224: a tie case)
            assert qmax >= 224, (k, scl[k], qmax)
        if scl[k] == 105 or qmax > 224:       # then the bytes themselves are reproduced
            assert s2[k] == scl[k] and d2[k * TILE:(k + 1) * TILE] == data[k * TILE:(k + 1) * TILE]
    assert d2[NOPE:] == data[NOPE:]


@pytest.fixture
def one_thread():
    """The tiny model's ops are small; a second intra-op thread only adds contention on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_engine_stores_swa_and_compressed_rows_as_fp8_ds_mla_pages(one_thread):
    from tests.conftest import chunked, drive, hidden_for

    spec, eng, pool = _fp8_engine()
    lengths = {"a": 256, "b": 40}                # a: two C128 entries (one full page), a full C4 page
    X = hidden_for({r: n + 1 for r, n in lengths.items()}, spec.hidden_size)
    outs, _ = drive(eng, X, chunked(lengths, 128) + [{"a": 1, "b": 1}])
    lengths = {r: n + 1 for r, n in lengths.items()}
    assert all(bool(torch.isfinite(y).all()) for per in outs.values() for y in per.values())

    checked = {}
    for layer in (0, 1, 2):
        c = pool.layers[layer]
        ratio = spec.compress_ratio(layer)
        assert ratio == c.ratio == {0: 1, 1: 4, 2: 128}[layer]
        caches = {"swa": c.swa, "compressed": c.compressed, "indexer": c.indexer_keys}
        assert {n for n, v in caches.items() if v is not None} == \
            {"swa"} | ({"compressed"} if ratio > 1 else set()) | ({"indexer"} if ratio == 4 else set())
        for name, cache in caches.items():
            if cache is None:
                continue
            group = pool.swa if name == "swa" else pool.entries(ratio)
            if name == "indexer":
                assert cache.data.dtype == torch.float32 and tuple(cache.data.shape) == (8, 64, 128)
                for rid, n in lengths.items():
                    tab, cnt = group.tables[rid], n // 4
                    slots = [tab[i // 64] * 64 + i % 64 for i in range(cnt)]
                    keys = cache.data.view(-1, 128)[slots]
                    assert torch.equal(cache.read(torch.tensor(slots)), keys)
                    assert not torch.equal(keys.bfloat16().float(), keys)      # unrounded float32 rows
                continue
            B = 64 if name == "swa" else 256 // ratio
            assert cache.block_size == B and cache.page_bytes == ds_stride(B)
            assert cache.data.dtype == torch.uint8 and tuple(cache.data.shape) == (8, ds_stride(B))
            assert ds_stride(B) == {64: 37440, 2: 1728}[B]
            flat = cache.data.view(-1).tolist()
            live = []
            for rid, n in lengths.items():
                tab = group.tables[rid]
                idx = range(n) if name == "swa" else range(n // ratio)
                live += [tab[i // B] * B + i % B for i in idx if tab[i // B] >= 0]
            assert live, (layer, name)
            got = cache.read(torch.tensor(live))
            for s, row in zip(live, got):
                (dlo, _), (slo, _) = ranges("fp8_ds_mla", B, s)
                _check_stored_record(flat, dlo, slo, row)
            checked[(layer, name)] = len(live)
            if name == "compressed":              # never freed: every byte outside the live rows is zero
                mask = range_mask("fp8_ds_mla", B, len(flat), live)
                assert not bool(cache.data.view(-1)[~mask].any())
    assert checked[(1, "compressed")] == 257 // 4 + 41 // 4 and checked[(2, "compressed")] == 257 // 128
    assert checked[(0, "swa")] == (257 - 192) + 41                         # a's pages 0..2 left the window
    assert pool.swa.tables["a"][:3] == [-1, -1, -1]
