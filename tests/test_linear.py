"""The `linear` group: the published fp8 numerics (dsv4/formats/fp8_blocks.py) against a float64 statement
of them, the options that run on a CPU against it and against the oracle with the same numerics (every
layer type, prefill and decode, tp_size 1 and 2), fp8 weights kept as stored, and the rules check() applies."""
from __future__ import annotations

import pytest
import torch

from tests.triton_mode import INTERPRET, VERSION

from dsv4 import oracle as ref
from dsv4.checks.compat import Combination, check
from dsv4.components.weights import FP8_LINEARS, in_fp8_blocks, random_layer_weights, shard_fp8
from dsv4.values.device import DeviceInfo
from dsv4.formats.fp8_blocks import (Fp8Blocks, LinearNumerics, act_quant, block_product, dequantize_blocks,
                                     fp8_linear_reference, pow2_scale, quantize_blocks)
from dsv4.strategies import Fp8SimLinear, LinearWeight, ReferenceLinear
from dsv4.checks.catalogue import option as shipped, strategies
from tests.conftest import chunked, drive, hidden_for, make_engine, tiny_spec

CPU = DeviceInfo(platform="cpu")


def e4m3_nearest(y):
    """y (float64, |y| <= 448, float32 values) to the nearest e4m3 value, a tie to the even code."""
    codes = torch.arange(127, dtype=torch.uint8)                 # the non-negative finite codes (0x7f: NaN)
    vals = codes.view(torch.float8_e4m3fn).double()
    # between two e4m3 neighbours a float32 y that is not a tie is more than 1e-12 nearer one of them
    key = (y.abs()[..., None] - vals).abs() + (codes % 2).double() * 1e-13
    return torch.sign(y) * vals[key.argmin(-1)]


def act_quant_f64(x):
    """act_quant written out from its definition in float64: the scale 2^ceil(log2(amax · fp32(1/448)))
    of each 128 values (amax at least 1e-4), then each value / scale to the nearest e4m3 value."""
    b = x.double().unflatten(-1, (-1, 128))
    v = (b.abs().amax(-1, keepdim=True).clamp_min(1e-4).float() * torch.tensor(1 / 448, dtype=torch.float32)).double()
    s = torch.exp2(torch.ceil(torch.log2(v)))
    return e4m3_nearest((b / s).clamp(-448, 448)).flatten(-2), s.squeeze(-1)


def test_act_quant_is_the_published_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 512, generator=g) * torch.logspace(-6, 3, 6)[:, None]
    x[0, :128] = 0                                         # an all-zero block: amax clamped at 1e-4
    x[1, 128] = 448.0 * 2 ** 3                              # amax/448 a power of two: scale exactly 2^3
    q, s = act_quant(x)
    want_q, want_s = act_quant_f64(x)
    assert torch.equal(s.double(), want_s)
    assert torch.equal(q.double(), want_q)
    assert float(s[1, 1]) == 8.0 and float(s[0, 0]) == float(pow2_scale(torch.tensor(0.0)))
    assert bool((s == torch.exp2(torch.log2(s).round())).all())     # powers of two


def test_block_product_is_a_float64_simulation_of_the_published_gemm():
    """With every block's values in one binade (here: ±(1 + k/8) times a power of two per row block) each
    128-wide partial product of e4m3 values is exact in float32 whatever the order of its sums, and so is
    the power-of-two scaling: summed in K order, the block product is bit for bit the float64 simulation
    rounded to float32 per step. On general values it differs by float32 summation order only."""
    g = torch.Generator().manual_seed(1)

    def one_binade(rows, cols):
        mant = 1 + torch.randint(0, 8, (rows, cols), generator=g) / 8
        sign = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
        exps = torch.randint(-6, 6, (rows, cols // 128), generator=g).float()
        return sign * mant * torch.exp2(exps).repeat_interleave(128, 1)
    x, w = one_binade(5, 384), one_binade(256, 384)
    xq, xs = act_quant(x)
    wb = quantize_blocks(w)
    y = block_product(xq, xs, wb.weight, wb.scale)
    sim = torch.zeros(5, 256, dtype=torch.float64)
    for kb in range(3):
        part = xq.double()[:, kb * 128:(kb + 1) * 128] @ wb.weight.double()[:, kb * 128:(kb + 1) * 128].T
        part = part.float().double()      # the tensor core's float32 partial (exact here: 128 products of 8 bits)
        sw = wb.scale.double().repeat_interleave(128, 0)[None, :, kb]
        sim = (sim + part * xs[:, kb, None].double() * sw).float().double()
    assert torch.equal(y.double(), sim)
    x, w = torch.randn(5, 384, generator=g), torch.randn(256, 384, generator=g) / 20
    xq, xs = act_quant(x)
    wb = quantize_blocks(w)
    ref_y = (xq.double() * xs.double().repeat_interleave(128, 1)) @ dequantize_blocks(wb.weight, wb.scale).double().T
    assert ref.rel_err(block_product(xq, xs, wb.weight, wb.scale), ref_y) < 1e-6


def test_weight_blocks_round_trip_and_shard_on_block_edges():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(384, 256, generator=g)
    b = quantize_blocks(w)
    assert b.weight.dtype == torch.float8_e4m3fn and tuple(b.scale.shape) == (3, 2)
    assert torch.equal(quantize_blocks(b.dequantize()).weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert ref.rel_err(b.dequantize(), w) < 0.05
    assert torch.equal(b.rows(128, 384).dequantize(), b.dequantize()[128:384])
    assert torch.equal(b.cols(128, 256).dequantize(), b.dequantize()[:, 128:])
    with pytest.raises(ValueError, match="cut a 128x128 scale block"):
        b.rows(0, 64)
    with pytest.raises(ValueError, match="whole 128x128 blocks"):
        quantize_blocks(torch.randn(100, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_sim_is_the_published_linear(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 256, generator=g) * 3).to(dtype)
    w = LinearWeight(values=torch.randn(384, 256, generator=g) / 16)
    lin = Fp8SimLinear()
    p = lin.prepare(w, device=CPU, dtype=str(dtype).removeprefix("torch."))
    assert p.weight.dtype == torch.float8_e4m3fn                  # kept as e4m3 bytes, not dequantized
    y = lin(x, p)
    want = fp8_linear_reference(x, Fp8Blocks(weight=p.weight, scale=p.scale))
    assert y.dtype == dtype
    if dtype == torch.float32:
        assert ref.rel_err(y, want) < 1e-6                        # float32 summation order only
    else:
        assert (y.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    # the float option on the same values is far from it: the fp8 numerics really apply
    assert ref.rel_err(ReferenceLinear()(x.float(), ReferenceLinear().prepare(w, device=CPU, dtype="float32")),
                       want.float()) > 1e-2


def test_stored_blocks_are_used_as_they_are():
    """A weight that comes with fp8 blocks is multiplied with those bytes, not re-quantized from its values."""
    g = torch.Generator().manual_seed(4)
    blocks = quantize_blocks(torch.randn(128, 128, generator=g))
    bumped = Fp8Blocks(weight=blocks.weight, scale=blocks.scale * 2)            # other scales than its values'
    p = Fp8SimLinear().prepare(LinearWeight(values=blocks.dequantize(), fp8=bumped), device=CPU, dtype="float32")
    assert torch.equal(p.scale, bumped.scale.float())


def test_random_weights_in_fp8_blocks_and_their_shards():
    spec = tiny_spec(o_lora_rank=128)
    w = random_layer_weights(spec, 1, 0)
    values, stored = in_fp8_blocks(w)
    assert set(stored) == set(FP8_LINEARS)
    for name, b in stored.items():
        assert torch.equal(values[name], b.dequantize())
    for name in set(w) - set(FP8_LINEARS):
        assert torch.equal(values[name], w[name])
    half = shard_fp8(stored, spec, 1, 2)
    assert torch.equal(half["wq_b.weight"].dequantize(), values["wq_b.weight"][4 * 512:])
    assert torch.equal(half["wo_b.weight"].dequantize(), values["wo_b.weight"][:, 128:])
    assert torch.equal(half["wo_a.weight"].dequantize(), values["wo_a.weight"][128:])
    assert half["wq_a.weight"] is stored["wq_a.weight"]


LENGTHS = {"long": 300, "mid": 45, "short": 9}
DECODE = [{r: 2 for r in LENGTHS}] * 2


INTERPRETED = pytest.mark.skipif(not INTERPRET or VERSION < (3, 7), reason="the interpreted Triton kernel: "
                                 "a CPU machine with triton>=3.7 (GPU runs: tests/test_gpu_layer.py)")


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("option", ["reference", "fp8_sim", pytest.param("triton_fp8", marks=INTERPRETED)])
def test_cpu_options_match_the_oracle_with_their_numerics(option, tp_size):
    """Every layer type, chunked prefill then MTP decode, float32 activations: each option against the
    oracle with its own numerics (tight), and the fp8 ones visibly away from the float oracle. (triton_fp8:
    its kernel interpreted.)"""
    spec = tiny_spec(o_lora_rank=128)
    lin = shipped("linear", option)
    W = {l: random_layer_weights(spec, l, 5) for l in (0, 1, 2)}
    fp8 = None
    if lin.numerics is LinearNumerics.FP8:
        made = {l: in_fp8_blocks(w) for l, w in W.items()}
        W, fp8 = {l: m[0] for l, m in made.items()}, {l: m[1] for l, m in made.items()}
    eng, _ = make_engine(spec, tp_size=tp_size, weights=W, linear=lin, fp8=fp8)
    X = hidden_for({r: n + 4 for r, n in LENGTHS.items()}, spec.hidden_size, seed=6)
    outs, topk = drive(eng, X, chunked(LENGTHS, 37) + DECODE)
    assert {spec.compress_ratio(l) for l in outs} == {1, 4, 128}
    for layer, per in outs.items():
        ratio = spec.compress_ratio(layer)
        for rid, out in per.items():
            sel = topk.get(layer, {}).get(rid)
            kw = dict(row_format="float32", topk=None if sel is None else sel.long())
            o = ref.oracle_layer(spec.to_dump(), ratio, W[layer], X[rid], linear_numerics=lin.numerics.value, **kw)
            assert ref.rel_err(out, o["out"]) < 1e-3, (option, layer, rid)
            if ratio == 4:
                g = ref.grade_selection(sel, o["scores"], spec.index_topk)
                assert g["count_ok"] == 1.0 and g["max_gap"] <= 1e-5, g
            if lin.numerics is LinearNumerics.FP8:
                other = ref.oracle_layer(spec.to_dump(), ratio, W[layer], X[rid], linear_numerics="float", **kw)
                assert ref.rel_err(out, other["out"]) > 1e-2


@INTERPRETED
def test_few_row_steps_take_x_products_in_one_launch(monkeypatch):
    """bf16 activations, linear=triton_fp8 (interpreted): a compressed layer's steps of at most
    `float_tail_rows` rows multiply x by [wq_a | wkv] and by the compressors' float weights in one launch, longer
    steps in two products; the outputs are those of the two products apart at every step. batch_invariant
    keeps them apart (the joint launch's split follows its own plan)."""
    import dsv4.kernels.products.joint_linear as joint
    import dsv4.strategies.linear.triton_fp8 as option

    calls = []
    one_launch = joint.joint_linear
    monkeypatch.setattr(joint, "joint_linear", lambda x, *a, **k: calls.append(x.shape[0]) or one_launch(x, *a, **k))
    spec = tiny_spec(o_lora_rank=128)
    made = {l: in_fp8_blocks(random_layer_weights(spec, l, 5)) for l in (0, 1, 2)}
    W, fp8 = {l: m[0] for l, m in made.items()}, {l: m[1] for l, m in made.items()}
    lengths = {"a": 30, "b": 9}
    X = hidden_for({r: n + 2 for r, n in lengths.items()}, spec.hidden_size, seed=3)
    schedule = chunked(lengths, 20) + [{r: 1 for r in lengths}] * 2       # 29 rows, then 10, 2 and 2
    outs = {}
    for rows in (16, 0):
        monkeypatch.setattr(option.TritonFp8Linear, "float_tail_rows", rows)
        eng, _ = make_engine(spec, weights=W, linear=shipped("linear", "triton_fp8"), fp8=fp8, dtype="bfloat16")
        layers = {spec.compress_ratio(l): eng.layers[l][0] for l in (0, 1, 2)}
        assert {r: l.joint_rows for r, l in layers.items()} == {1: 0, 4: rows, 128: rows}
        assert (layers[4].x_joint is None) == (rows == 0)
        calls.clear()
        outs[rows], _ = drive(eng, X, schedule)
        assert calls == ([10, 10, 2, 2, 2, 2] if rows else []), calls      # two compressed layers a step
        from dsv4.components.attention import _Branch
        empty = layers[4]._project(torch.zeros(0, spec.hidden_size, dtype=torch.bfloat16), _Branch(None))
        assert [t.shape[0] for t in (empty[0], empty[1], *empty[2])] == [0] * (2 + len(empty[2]))
    for layer, per in outs[16].items():
        for rid, out in per.items():
            assert ref.rel_err(out, outs[0][layer][rid]) < 1e-2, (layer, rid)
    monkeypatch.setattr(option.TritonFp8Linear, "float_tail_rows", 16)
    from dsv4.components.builders import build_layer
    from dsv4.strategies import ExactIndexer, NoHeadPadding, PlainRowLayout, ReferenceMQA, ReferenceOProj, Strategies

    st = Strategies(mqa_kernel=ReferenceMQA(), o_proj=ReferenceOProj(), head_padding=NoHeadPadding(),
                    cache_layout=PlainRowLayout(name="float32", dtype="float32"), indexer=ExactIndexer(),
                    linear=shipped("linear", "triton_fp8"))
    for invariant in (False, True):
        layer = build_layer(spec=spec, layer=1, weights=W[1], rank=0, tp_size=1, strategies=st,
                            device=DeviceInfo(platform="cpu"), dtype="bfloat16", fp8=fp8[1], batch_invariant=invariant)
        assert layer.ratio > 1 and layer.joint_rows == (0 if invariant else 16)


def test_fp8_layer_holds_e4m3_weights():
    """The fp8 option keeps the projections' bytes as stored: its layer holds e4m3 weights, one byte per
    value where bf16 takes two, plus a float32 scale per 128x128 block (the compressors' and norms' weights
    stay as they are)."""
    spec = tiny_spec(o_lora_rank=128)
    W = {1: random_layer_weights(spec, 1, 0)}
    values, stored = in_fp8_blocks(W[1])
    sizes = {}
    for option, fp8 in (("reference", None), ("fp8_sim", {1: stored})):
        eng, _ = make_engine(spec, layers=(1,), weights={1: values}, dtype="bfloat16", linear=shipped("linear", option),
                             fp8=fp8)
        layer = eng.layers[1][0]
        sizes[option] = sum(b.numel() * b.element_size() for b in layer.buffers())
        if option == "fp8_sim":
            assert layer.wq_b.dtype == layer.wo_b.dtype == layer.w_in.dtype == torch.float8_e4m3fn
            assert layer.wq_b.data_ptr() == layer.q_proj.weight.data_ptr()
    owned = [stored[n] for n in ("wq_a.weight", "wkv.weight", "wq_b.weight", "indexer.wq_b.weight", "wo_b.weight")]
    saved = sum(b.weight.numel() - 4 * b.scale.numel() for b in owned)      # 2 bf16 bytes -> 1 e4m3 byte
    assert sizes["reference"] - sizes["fp8_sim"] == saved, sizes


def combo(linear, *, tp_size=1, dtype="bfloat16", spec=None):
    chosen = strategies(linear=shipped("linear", linear), mqa_kernel=shipped("mqa_kernel", "reference"),
                        o_proj=shipped("o_proj", "reference"), head_padding=shipped("head_padding", "none"),
                        cache_layout=shipped("cache_layout", "bf16"))
    return Combination(spec=spec or tiny_spec(o_lora_rank=128), strategies=chosen, tp_size=tp_size, dtype=dtype)


def test_check_refuses_what_cannot_run_with_a_fix():
    h200 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
    a100 = DeviceInfo(platform="cuda", arch="sm80", name="A100")
    assert check(combo("fp8_sim"), CPU) == []
    assert check(combo("triton_fp8"), h200) == [] and check(combo("deepgemm_fp8"), h200) == []
    cut = check(combo("fp8_sim", tp_size=2, spec=tiny_spec()), CPU)          # wo_b: 64 input columns per rank
    assert len(cut) == 1 and "wo_b N=256 K=64" in cut[0].reason and cut[0].fix == "tp_size=1 (or linear=reference)"
    assert check(combo("fp8_sim", tp_size=2), CPU) == []                     # o_lora_rank 128: whole blocks
    on_cpu = check(combo("triton_fp8"), CPU)
    assert [(p.group, p.fix) for p in on_cpu] == [("linear", "linear=reference")]
    old = check(combo("triton_fp8"), a100)
    assert "needs arch in" in old[0].reason and old[0].fix == "linear=reference"
    f32 = check(combo("deepgemm_fp8", dtype="float32"), h200)
    assert [(p.group, p.fix) for p in f32] == [("dtype", "dtype=bfloat16")]
    for p in cut + on_cpu + old + f32:
        assert "\n" not in str(p)


def test_error_budget_counts_the_linear():
    assert combo("fp8_sim").error_budget == pytest.approx(combo("reference").error_budget + Fp8SimLinear.error_budget)


def test_deepgemm_option_hands_deepgemm_the_published_operands(monkeypatch):
    """linear=deepgemm_fp8 through a stand-in `deep_gemm.fp8_gemm_nt` that computes the block product: bf16
    rows are quantized (act_quant, scales in DeepGEMM's block-major layout) before the call; rows that come
    quantized (Fp8Rows, as the q_lora norm makes them) are passed as they are; the result is fp8_sim's."""
    import sys
    import types

    from dsv4.components.front import norm_rows
    from dsv4.strategies import DeepGemmFp8Linear

    calls = []

    def fp8_gemm_nt(a, b, d):
        calls.append((a[0], a[1]))
        d.copy_(block_product(a[0], a[1], b[0], b[1]).to(d.dtype))
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt))
    g = torch.Generator().manual_seed(8)
    w = LinearWeight(values=torch.randn(256, 384, generator=g) / 20)
    x = torch.randn(5, 384, generator=g).bfloat16()
    lin, sim = DeepGemmFp8Linear(), Fp8SimLinear()
    dev = DeviceInfo(platform="cpu", arch="sm90")                    # tensors stay on the CPU
    want = sim(x, sim.prepare(w, device=dev, dtype="bfloat16"))
    p = lin.prepare(w, device=dev, dtype="bfloat16")
    y = lin(x, p)
    (xq, xs), = calls
    assert xq.dtype == torch.float8_e4m3fn and xs.stride() == (1, 8)     # block-major, rows padded to 4
    assert torch.equal(xq.view(torch.uint8), act_quant(x)[0].view(torch.uint8))
    assert y.dtype == torch.bfloat16 and ref.rel_err(y, want) < 1e-2
    rows = norm_rows(x, torch.ones(384), eps=1e-6, dtype=torch.bfloat16, fp8=True)
    calls.clear()
    y2 = lin(rows, p)
    assert calls[0][0] is rows.values and calls[0][1] is rows.scales
    assert ref.rel_err(y2, sim(rows, sim.prepare(w, device=dev, dtype="bfloat16"))) < 1e-2
    assert lin(x[:0], p).shape == (0, 256)


def test_deepgemm_triton_option_takes_ours_up_to_its_rows(monkeypatch):
    """linear=deepgemm_triton_fp8: a step of at most `triton_rows` rows is our Triton product (the same
    bytes as linear=triton_fp8, DeepGEMM not called), a larger one DeepGEMM's (a stand-in computing the
    block product); both the published numerics. check() asks for what both need."""
    import sys
    import types

    from dsv4.strategies import DeepGemmTritonFp8Linear, TritonFp8Linear

    calls = []

    def fp8_gemm_nt(a, b, d):
        calls.append(a[0].shape[0])
        d.copy_(block_product(a[0], a[1], b[0], b[1]).to(d.dtype))
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt))
    g = torch.Generator().manual_seed(9)
    w = LinearWeight(values=torch.randn(256, 384, generator=g) / 20)
    x = torch.randn(5, 384, generator=g).bfloat16()
    dev = DeviceInfo(platform="cpu", arch="sm90")
    sim = Fp8SimLinear()
    want = sim(x, sim.prepare(w, device=dev, dtype="bfloat16"))
    ours = TritonFp8Linear()
    mine = ours(x, ours.prepare(w, device=dev, dtype="bfloat16"))
    for rows, deepgemm in ((16, False), (5, False), (4, True), (0, True)):
        lin = DeepGemmTritonFp8Linear(triton_rows=rows)
        calls.clear()
        y = lin(x, lin.prepare(w, device=dev, dtype="bfloat16"))
        assert calls == ([5] if deepgemm else []), rows
        assert ref.rel_err(y, want) < 1e-2
        if not deepgemm:
            assert torch.equal(y, mine)
    h200 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
    l40 = DeviceInfo(platform="cuda", arch="sm89", name="L40S")
    assert check(combo("deepgemm_triton_fp8"), h200) == []
    refused = check(combo("deepgemm_triton_fp8"), l40)
    assert [(p.group, p.fix) for p in refused] == [("linear", "linear=reference")]
    assert "needs arch in" in refused[0].reason
    from dsv4.values.errors import ConfigError
    from dsv4.values.settings import option
    with pytest.raises(ConfigError, match="triton_rows"):
        option({"_target_": "dsv4.strategies.DeepGemmTritonFp8Linear", "triton_rows": -1}, "linear")
