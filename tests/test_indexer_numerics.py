"""indexer=fp4_sim: the published indexer numerics (Hadamard rotation, FP4 e2m1 with power-of-two block
scales), against independent implementations written here from the formats' definitions, and through the
layer against the oracle, which applies them too; check() refuses the shapes they cannot take.
indexer=mxfp4 and the fp8 records of triton_fp8 / deepgemm_fp8: the 68- and 132-byte key records byte for
byte against packers written here from the formats' definitions, their pages, memory accounting and
check() rules, deepgemm_fp8's step plan rows, the layer choosing what fp4_sim chooses, and the selection's
recall under each numerics."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from dsv4 import oracle as ref
from dsv4.checks.compat import check
from dsv4.values.device import DeviceInfo
from dsv4.strategies import ExactIndexer, Fp4SimIndexer, Mxfp4Indexer, Mxfp4KeyLayout
from dsv4.formats.fp4 import e2m1, fp4_qdq, pow2_ceil, rotate
from dsv4.formats.indexer_numerics import IndexerNumerics
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec
from tests.test_cache_layouts import e4m3_byte      # OCP e4m3fn from the format's definition


def e2m1_values() -> list[float]:
    """Every e2m1 magnitude from its bits: exponent e (2 bits, bias 1), mantissa m (1 bit); e = 0 is
    subnormal (m · 0.5)."""
    out = []
    for e, m in itertools.product(range(4), range(2)):
        out.append(m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
    return out          # codes 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6


def nearest_e2m1(v: float) -> float:
    """Round to nearest e2m1, a tie to the even code, by search over the codes."""
    vals = e2m1_values()
    a = abs(v)
    best = min(range(8), key=lambda c: (abs(a - vals[c]), c % 2))
    return -vals[best] if v < 0 or (v == 0 and str(v).startswith("-")) else vals[best]


def test_e2m1_rounding_is_nearest_with_ties_to_even():
    assert e2m1_values() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    g = torch.Generator().manual_seed(0)
    vals = torch.cat((torch.tensor(ties + [-t for t in ties] + [0.0, 6.0, -6.0, 1e-30, -1e-30]),
                      (torch.rand(4000, generator=g) * 12 - 6)))
    got = e2m1(vals)
    want = torch.tensor([nearest_e2m1(float(v)) for v in vals])
    assert torch.equal(got.abs(), want.abs()) and torch.equal(torch.signbit(got), torch.signbit(vals))
    assert e2m1(torch.tensor(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_pow2_ceil_is_exact_next_to_powers_of_two():
    t = torch.tensor([1.0, 2.0 ** -126, 2.0 ** 20, 1.0000001, 0.99999994, 3.0, 2.0 ** -10 * 1.0000001])
    assert pow2_ceil(t).tolist() == [1.0, 2.0 ** -126, 2.0 ** 20, 2.0, 1.0, 4.0, 2.0 ** -9]


def fp4_by_hand(x: torch.Tensor) -> torch.Tensor:
    """The published fp4_act_quant(x, 32, inplace=True), value by value: a block's scale is the power of two
    2^ceil(log2(max(amax, 6·2^-126) / 6)) (Python floats: amax/6 as float32 rounds it), each value divided
    by it, clamped to ±6, rounded to e2m1, multiplied back."""
    import numpy as np

    out = []
    for block in x.to(torch.bfloat16).float().view(-1, 32).tolist():
        amax = max(max(abs(v) for v in block), 6 * 2.0 ** -126)
        r = float(np.float32(amax) * np.float32(1 / 6))
        e = int(np.ceil(np.log2(np.float64(r))))
        s = 2.0 ** e
        out.append([nearest_e2m1(max(-6.0, min(6.0, v / s))) * s for v in block])
    return torch.tensor(out, dtype=torch.float32).view(x.shape)


def test_fp4_block_quantization_against_its_definition():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g) * torch.exp(torch.randn(40, 1, generator=g) * 4)
    x[0] = 0                                             # all-zero blocks stay zero
    x[1, :32] = 6 * 2.0 ** torch.arange(32.0) / 2 ** 16  # amax a power of two times 6: no rounding up of the scale
    x[2, :32] = torch.linspace(-6, 6, 32)                # on and between the grid at scale 1
    x[3] = 3e38                                          # huge values
    got = fp4_qdq(x).float()
    assert torch.equal(got, fp4_by_hand(x))
    assert bool((got[0] == 0).all())
    assert torch.equal(got[2, :32], torch.tensor([nearest_e2m1(float(v)) for v in x[2, :32].bfloat16().float()]))


def sylvester(n: int) -> torch.Tensor:
    """H[i, j] = (-1)^popcount(i & j), float64."""
    i = torch.arange(n)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool((bits > 0).any()):
        parity, bits = parity ^ (bits & 1), bits >> 1
    return (1 - 2 * parity).double()


def test_hadamard_rotation_is_the_orthonormal_sylvester_transform():
    """The butterflies equal x·H·n^-1/2 with H Sylvester's, computed in float64 and rounded once to bf16."""
    h = sylvester(128)
    assert torch.equal(h @ h.T, 128 * torch.eye(128, dtype=torch.float64))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 128, generator=g) * torch.exp(torch.randn(300, 1, generator=g) * 3)
    y = rotate(x)
    want = ((x.bfloat16().double() @ h) * 128 ** -0.5).float().bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    assert rotate(torch.randn(2, 3, 64)).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="power-of-two"):
        rotate(torch.zeros(2, 96))


def test_the_oracles_fp4_numerics_are_the_strategys():
    """Two implementations (dsv4/formats/fp4.py for the layer, dsv4/oracle.py for the oracle), one
    result on random rows, zeros and extremes."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 128, generator=g) * torch.exp(torch.randn(500, 1, generator=g) * 3)
    x[0], x[1, 7], x[2] = 0, 1e-30, 1e30
    assert Fp4SimIndexer.numerics is IndexerNumerics.FP4 and IndexerNumerics.FP4.value in ref.INDEXER_NUMERICS
    got = Fp4SimIndexer.numerics.apply(x)
    assert torch.equal(got, ref._fp4_indexer(x))


def run_layer(indexer, seed=3):
    spec = tiny_spec()
    eng, W = make_engine(spec, indexer=indexer, seed=seed)
    lengths = {"long": 300, "mid": 45}
    X = hidden_for({r: n + 4 for r, n in lengths.items()}, spec.hidden_size, seed=seed + 1)
    outs, topk = drive(eng, X, chunked(lengths, 37) + [{r: 2 for r in lengths}] * 2)
    return spec, W, X, outs, topk


def test_fp4_sim_layer_selects_what_the_oracle_selects():
    """The paged layer with indexer=fp4_sim against the oracle with the published numerics (written
    independently of the layer's, and checked against the formats' definitions above): the same outputs and,
    token for token, the same top-k sets."""
    spec, W, X, outs, topk = run_layer(Fp4SimIndexer())
    layer = next(l for l in outs if spec.compress_ratio(l) == 4)
    for rid in X:
        o = ref.oracle_layer(spec.to_dump(), 4, W[layer], X[rid], row_format="float32", indexer_numerics="fp4",
                             topk=topk[layer][rid].long())
        assert ref.rel_err(outs[layer][rid], o["out"]) <= 1e-5
        g = ref.grade_selection(topk[layer][rid], o["scores"], spec.index_topk)
        assert g["count_ok"] == 1.0 and g["exact"] == 1.0, g
    # the numerics matter: exact scores choose differently for some token of the long request
    exact = ref.oracle_layer(spec.to_dump(), 4, W[layer], X["long"], row_format="float32")
    assert ref.grade_selection(topk[layer]["long"], exact["scores"], spec.index_topk)["exact"] < 1.0


def test_exact_is_the_default_and_changes_nothing():
    spec, W, X, outs, topk = run_layer(None, seed=5)
    spec2, W2, X2, outs2, topk2 = run_layer(ExactIndexer(), seed=5)
    for layer in outs:
        for rid in X:
            assert torch.equal(outs[layer][rid], outs2[layer][rid])


def test_check_refuses_fp4_sim_for_index_heads_it_cannot_rotate():
    from dsv4.checks.catalogue import strategies
    from dsv4.checks.compat import Combination
    from dsv4.strategies import NoHeadPadding, PlainRowLayout, ReferenceMQA, ReferenceOProj

    def problems(dim):
        chosen = strategies(mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(), head_padding=NoHeadPadding(),
                            cache_layout=PlainRowLayout(name="bf16", dtype="bfloat16"), indexer=Fp4SimIndexer())
        c = Combination(spec=tiny_spec(index_head_dim=dim), strategies=chosen)
        return [p for p in check(c, DeviceInfo(platform="cpu")) if p.group == "indexer"]

    assert problems(128) == [] and problems(64) == []
    (p,) = problems(96)
    assert "power of two" in p.reason and p.fix == "indexer=exact"
    reasons = [q.reason for q in problems(80)]
    assert any("multiple of 32" in r for r in reasons) and any("power of two" in r for r in reasons)


# ---- mxfp4 records ------------------------------------------------------------------------------
def record_by_hand(row: list[float]) -> bytes:
    """One key's record from the definition: per block of 32 values the scale 2^k of `fp4_by_hand`, its
    byte k + 127; each value's e2m1 code (sign bit 3, the magnitude's index in the grid, bits 0-2; a
    negative value that rounds to zero keeps its sign); two codes a byte, the even dim in the low nibble;
    the Di/2 code bytes, then the Di/32 scale bytes."""
    import math
    import struct

    import numpy as np

    grid = e2m1_values()
    codes, scales = [], []
    for b0 in range(0, len(row), 32):
        block = [struct.unpack("<f", struct.pack("<f", v))[0] for v in row[b0:b0 + 32]]
        amax = max(max(abs(v) for v in block), 6 * 2.0 ** -126)
        k = int(np.ceil(np.log2(np.float64(np.float32(amax) * np.float32(1 / 6)))))
        scales.append(k + 127)
        for v in block:
            r = nearest_e2m1(max(-6.0, min(6.0, v / 2.0 ** k)))
            codes.append((8 if math.copysign(1.0, r) < 0 else 0) | grid.index(abs(r)))
    data = bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2))
    return data + bytes(scales)


def keys_over_decades(n: int, *, seed: int):
    """(the generator, n random 128-dim keys over 12 decades: key 0 zeros, key 1's first 32 dims -0.0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 6)
    x[0] = 0
    x[1, :32] = -0.0
    return g, x


def test_mxfp4_records_byte_for_byte():
    """Random keys over 12 decades, zeros, signed zeros, values on, between and at the ties of the grid, the
    largest and smallest scales: each record equals the hand-made one and decodes to fp4_sim's values."""
    g, x = keys_over_decades(40, seed=7)
    x[1, 32:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 4)    # ties at scale 1 (amax 5)
    x[1, 64:] = -1e-3 * torch.arange(64.0)
    x[2] = 3e38
    x[3] = 6 * 2.0 ** -126
    x[4, ::2] = -x[4, ::2].abs()
    rows = x.bfloat16().float()
    lay = Mxfp4KeyLayout(head_dim=128)
    data, scales = lay.pack(rows)
    assert lay.bytes_per_token(128) == 68 and data.shape == (40, 64) and scales.shape == (40, 4)
    for i in range(40):
        want = record_by_hand(rows[i].tolist())
        got = bytes(data[i].tolist()) + bytes(scales[i].tolist())
        assert got == want, i
    values = lay.unpack(data, scales)
    assert torch.equal(values, fp4_qdq(rows).float())
    assert bool(torch.isinf(values[2]).any())           # 3e38 rounds up to 4·2^126 = 2^128, as in the published code
    finite = values[torch.isfinite(values).all(1)]      # FP4-simulated keys pack to the same values
    assert len(finite) == 39 and torch.equal(lay.unpack(*lay.pack(finite)), finite)


def written_pages(lay, B: int, seed: int):
    """Three random rows written at slots 6, -1 and 9 of three pages of B records of `lay`: key t's data
    bytes at t·D, its scale bytes at B·D + t·S (D, S: the record's data and scale bytes), nothing else
    written. -> (cache, rows, their packed data and scales)."""
    D, S = lay.data_bytes, lay.scale_bytes
    cache = lay.allocate(num_blocks=3, block_size=B, head_dim=128, device="cpu")
    assert cache.shape == (3, B * (D + S)) and cache.dtype == torch.uint8
    rows = torch.randn(3, 128, generator=torch.Generator().manual_seed(seed))
    lay.access(cache, block_size=B, gpu=False).write(torch.tensor([6, -1, 9]), rows)
    data, scales = lay.pack(rows)
    for i, slot in ((0, 6), (2, 9)):
        page, t = divmod(slot, B)
        assert torch.equal(cache[page, t * D:(t + 1) * D], data[i])
        assert torch.equal(cache[page, B * D + t * S:B * D + (t + 1) * S], scales[i])
    assert int(cache.count_nonzero()) == int(data[[0, 2]].count_nonzero() + scales[[0, 2]].count_nonzero())
    return cache, rows, data, scales


def test_mxfp4_pages_hold_codes_then_scales():
    """A page of B records: key t's codes at t·64, its scales at B·64 + t·4; a skipped slot (-1) writes
    nothing; a read of -1 is zeros."""
    B, lay = 4, Mxfp4KeyLayout(head_dim=128)
    assert (lay.data_bytes, lay.scale_bytes) == (64, 4)
    cache, rows, _, _ = written_pages(lay, B, seed=8)
    back = lay.read(cache, torch.tensor([9, -1, 6]), block_size=B)
    assert torch.equal(back[0], fp4_qdq(rows[2]).float()) and bool((back[1] == 0).all())
    assert torch.equal(back[2], fp4_qdq(rows[0]).float())


@functools.cache
def fp4_sim_run(seed: int):
    return run_layer(Fp4SimIndexer(), seed=seed)


@pytest.mark.parametrize("option,record_bytes", [("mxfp4", 68), ("triton_fp8", 132)])
def test_record_layer_selects_what_fp4_sim_selects(option, record_bytes):
    """The same weights and tokens through the paged layer with indexer=fp4_sim (bf16-valued float32 keys)
    and with an option that stores the same keys as records (mxfp4's 68-byte FP4 records, triton_fp8's
    132-byte fp8 records, which hold them exactly): the same outputs and top-k lists, token for token; the
    records take their bytes per entry in the pool."""
    from dsv4.strategies import TritonFp8Indexer

    indexer = {"mxfp4": Mxfp4Indexer, "triton_fp8": TritonFp8Indexer}[option]()
    spec, _, X, outs, topk = fp4_sim_run(9)
    *_, outs2, topk2 = run_layer(indexer, seed=9)
    for layer in outs:
        for rid in X:
            assert torch.equal(outs[layer][rid], outs2[layer][rid])
            if layer in topk:
                assert torch.equal(topk[layer][rid], topk2[layer][rid])
    eng, _ = make_engine(spec, indexer=indexer, seed=9)
    keys = next(c.indexer_keys for c in eng.pools[0].layers.values() if c.indexer_keys is not None)
    assert keys.data.dtype == torch.uint8 and keys.page_bytes == keys.block_size * record_bytes


def test_mxfp4_memory_accounting_counts_its_records():
    from dsv4.app.kv_memory import indexer_entry_bytes, indexer_kind

    assert indexer_kind("bfloat16", Mxfp4Indexer()) == "mxfp4" and indexer_entry_bytes("mxfp4", 128) == 68
    assert indexer_kind("bfloat16", Fp4SimIndexer()) == "bf16" and indexer_kind("float32") == "float32"


def test_selection_recall():
    """grade_selection's recall: the share of the oracle's set a token selected, averaged over tokens."""
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0, -math.inf], [1.0, 2.0, 3.0, 4.0, 5.0]])
    assert ref.grade_selection(torch.tensor([[0, 2, -1], [4, 3, 0]]), scores, 3)["count_ok"] == 0.0   # 2 of 3
    g = ref.grade_selection(torch.tensor([[0, 2, 1], [4, 3, 0]]), scores, 3)
    assert g["exact"] == 0.5 and g["recall"] == (1 + 2 / 3) / 2


@pytest.mark.parametrize("name,own,other", [("fp4_sim", "fp4", "exact"), ("exact", "exact", "fp4")])
def test_a_run_reports_its_recall_against_both_numerics(compose_cfg, tmp_path, name, own, other):
    """result.json: the ratio-4 layers' top-k recall against the oracle under each numerics -- 1 for the
    run's own (but for a rare float32 near-tie that exact scores may order either way), clearly less for
    the other (the numerics matter on this workload)."""
    import json

    from dsv4.app.dispatch import run_config

    run_config(compose_cfg(["model=dsv4_tiny", "dtype=float32", f"indexer={name}"]), out_dir=tmp_path)
    row = json.loads((tmp_path / "result.json").read_text())
    assert row[f"metrics.topk_recall_vs_{own}"] == row[f"metrics.c4a.topk_recall_vs_{own}"] >= 0.999
    assert 0.5 < row[f"metrics.topk_recall_vs_{other}"] < 0.99


# ---- fp8 records (deepgemm_fp8, triton_fp8) -------------------------------------------------------
def fp8_record_by_hand(row: list[float]) -> bytes:
    """One key's fp8 record: the bf16-rounded values' scale 2^k, k = ceil(log2(max(amax, 1e-4) / 448)) with
    the division in float32; each value / 2^k clamped to ±448 and rounded to e4m3; the Di bytes, then the
    scale's four float32 bytes (little-endian)."""
    import struct

    import numpy as np

    amax = max(max(abs(v) for v in row), float(np.float32(1e-4)))
    m, e = math.frexp(float(np.float32(amax) / np.float32(448.0)))
    k = e - 1 if m == 0.5 else e
    data = bytes(e4m3_byte(max(-448.0, min(448.0, v / 2.0 ** k))) for v in row)
    return data + struct.pack("<f", 2.0 ** k)


def test_fp8_key_records_byte_for_byte():
    """Random keys over 12 decades, zeros, signed zeros, ties of the e4m3 grid, values past 448 times the
    scale: each record equals the hand-made one; FP4-simulated keys (what the options store) come back
    exactly."""
    from dsv4.strategies import Fp8KeyLayout
    from dsv4.formats.fp4 import fp4_sim

    g, x = keys_over_decades(24, seed=11)
    x[1, 32:] = torch.tensor([448.0, 9.0, 4.5, 17.0, -0.0078125 * 1.5, 2.0 ** -10, -(2.0 ** -10) * 3, 1e-6] * 12)
    x[2] = 3e38
    x[3, ::2] = -x[3, ::2].abs()
    rows = x.bfloat16().float()
    lay = Fp8KeyLayout(head_dim=128)
    data, scales = lay.pack(rows)
    assert lay.bytes_per_token(128) == 132 and data.shape == (24, 128) and scales.shape == (24, 4)
    for i in range(24):
        assert bytes(data[i].tolist()) + bytes(scales[i].tolist()) == fp8_record_by_hand(rows[i].tolist()), i
    keys = fp4_sim(torch.randn(64, 128, generator=g) * 3)
    assert torch.equal(lay.unpack(*lay.pack(keys)), keys)


def test_fp8_pages_hold_codes_then_scales():
    """A page of B records, DeepGEMM's paged layout: key t's bytes at t·128, its scale at B·128 + 4t; a
    skipped slot (-1) writes nothing; a read of -1 is zeros."""
    from dsv4.strategies import Fp8KeyLayout

    B, lay = 4, Fp8KeyLayout(head_dim=128)
    assert (lay.data_bytes, lay.scale_bytes) == (128, 4)
    cache, _, data, scales = written_pages(lay, B, seed=12)
    back = lay.read(cache, torch.tensor([9, -1, 6]), block_size=B)
    assert torch.equal(back[1], torch.zeros(128)) and torch.equal(back[0], lay.unpack(data[2], scales[2]))


def test_deepgemm_plan_rows():
    """deepgemm_fp8's step plan: each token's count of visible entries (at least 1: a row of padding
    alone made DeepGEMM fault) and its request's entries table, missing pages as page 0."""
    from dsv4.strategies.indexer.deepgemm_fp8 import token_rows

    req = torch.tensor([0, 1, 1, 2, 2, 2])
    counts = torch.tensor([5, 7, 8, 0, 1, 2], dtype=torch.int32)
    pages = torch.tensor([[4, -1], [5, 6], [7, 8]], dtype=torch.int32)
    lens, table = token_rows(token_request=req, counts=counts, pages=pages)
    assert lens.dtype == table.dtype == torch.int32
    assert lens.tolist() == [[5], [7], [8], [1], [1], [2]]
    assert table.tolist() == [[4, 0], [5, 6], [5, 6], [7, 8], [7, 8], [7, 8]]


def test_check_refuses_deepgemm_fp8_where_it_cannot_run():
    """deepgemm_fp8: CUDA sm90/sm100 only (fix: triton_fp8), 128-dim keys, the index heads its kernel takes
    on the arch, pages of the keys it reads (fix: the pool's page size)."""
    from dsv4.checks.catalogue import strategies
    from dsv4.checks.compat import Combination
    from dsv4.strategies import DeepGemmFp8Indexer, NoHeadPadding, PlainRowLayout, ReferenceMQA, ReferenceOProj

    def problems(device, page_keys=64, **spec):
        chosen = strategies(mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(), head_padding=NoHeadPadding(),
                            cache_layout=PlainRowLayout(name="bf16", dtype="bfloat16"), indexer=DeepGemmFp8Indexer())
        c = Combination(spec=tiny_spec(**spec), strategies=chosen, index_page_keys=page_keys)
        return [p for p in check(c, device) if p.group == "indexer"]

    h200, b200 = DeviceInfo(platform="cuda", arch="sm90"), DeviceInfo(platform="cuda", arch="sm100")
    assert problems(h200, index_n_heads=64) == [] and problems(b200, index_n_heads=8) == []
    for device in (DeviceInfo(platform="cpu"), DeviceInfo(platform="cuda", arch="sm80")):
        (p,) = problems(device, index_n_heads=64)
        assert p.fix == "indexer=triton_fp8"
    (p,) = problems(h200, index_n_heads=8)
    assert "index_n_heads in [32, 64]" in p.reason and p.supported == ("32", "64")
    (p,) = problems(h200, index_n_heads=64, index_head_dim=64)
    assert "index_head_dim = 128" in p.reason
    (p,) = problems(h200, page_keys=32, index_n_heads=64)
    assert p.fix == "workload.kv_pool.compressed_block_tokens=256"
    assert problems(b200, page_keys=32, index_n_heads=64) == []


def test_fp8_memory_accounting_counts_its_records():
    from dsv4.app.kv_memory import indexer_entry_bytes, indexer_kind
    from dsv4.strategies import DeepGemmFp8Indexer, TritonFp8Indexer

    for ix in (DeepGemmFp8Indexer(), TritonFp8Indexer()):
        assert indexer_kind("bfloat16", ix) == "fp8"
    assert indexer_entry_bytes("fp8", 128) == 132
