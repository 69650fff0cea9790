"""indexer=fp4_sim: the published indexer numerics (Hadamard rotation, FP4 e2m1 with power-of-two block
scales), against independent implementations written here from the formats' definitions, and through the
layer against the oracle, which applies them too; check() refuses the shapes they cannot take."""
from __future__ import annotations

import itertools

import pytest
import torch

from dsv4 import reference as ref
from dsv4.compat import check
from dsv4.device import DeviceInfo
from dsv4.strategies import ExactIndexer, Fp4SimIndexer
from dsv4.strategies.indexer import e2m1, fp4_qdq, pow2_ceil, rotate
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec


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
    """Two implementations (dsv4/strategies/indexer.py for the layer, dsv4/reference.py for the oracle), one
    result on random rows, zeros and extremes."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(500, 128, generator=g) * torch.exp(torch.randn(500, 1, generator=g) * 3)
    x[0], x[1, 7], x[2] = 0, 1e-30, 1e30
    strat = Fp4SimIndexer()
    got = strat.keys(x, strat.prepare(head_dim=128, device=DeviceInfo(platform="cpu")))
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
        o = ref.oracle_layer(spec.to_dump(), 4, W[layer], X[rid], kv_row_dtype="float32", indexer_numerics="fp4",
                             topk=topk[layer][rid].long())
        assert ref.rel_err(outs[layer][rid], o["out"]) <= 1e-5
        g = ref.grade_selection(topk[layer][rid], o["scores"], spec.index_topk)
        assert g["count_ok"] == 1.0 and g["exact"] == 1.0, g
    # the numerics matter: exact scores choose differently for some token of the long request
    exact = ref.oracle_layer(spec.to_dump(), 4, W[layer], X["long"], kv_row_dtype="float32")
    assert ref.grade_selection(topk[layer]["long"], exact["scores"], spec.index_topk)["exact"] < 1.0


def test_exact_is_the_default_and_changes_nothing():
    spec, W, X, outs, topk = run_layer(None, seed=5)
    spec2, W2, X2, outs2, topk2 = run_layer(ExactIndexer(), seed=5)
    for layer in outs:
        for rid in X:
            assert torch.equal(outs[layer][rid], outs2[layer][rid])


def test_check_refuses_fp4_sim_for_index_heads_it_cannot_rotate():
    from dsv4.compat import Combination
    from dsv4.strategies import NoHeadPadding, PlainRowLayout, ReferenceMQA, ReferenceOProj

    def problems(dim):
        c = Combination(spec=tiny_spec(index_head_dim=dim), mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(),
                        head_padding=NoHeadPadding(), cache_layout=PlainRowLayout(name="bf16", dtype="bfloat16"),
                        indexer=Fp4SimIndexer())
        return [p for p in check(c, DeviceInfo(platform="cpu")) if p.group == "indexer"]

    assert problems(128) == [] and problems(64) == []
    (p,) = problems(96)
    assert "power of two" in p.reason and p.fix == "indexer=exact"
    reasons = [q.reason for q in problems(80)]
    assert any("multiple of 32" in r for r in reasons) and any("power of two" in r for r in reasons)
