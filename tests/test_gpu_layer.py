"""The whole layer step on a GPU: every layer type and backend against the oracle, CUDA-graph replay equal
to eager bit for bit, no host sync inside a layer, any chunking of the same requests the same outputs,
and a refused step that leaves every other row as it was. Skipped without a CUDA GPU.

The tiny model keeps the runs short; its head_dim, RoPE and ratios are the real model's, so every
kernel runs at its real row size. FlashMLA and DeepGEMM need sm90/sm100 and 64/128 padded heads.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from dsv4 import oracle as ref
from dsv4.values.errors import InvalidRequest
from dsv4.values.graph_config import GraphConfig
from dsv4.strategies import (
    BucketHeadPadding,
    DeepGemmFp8Linear,
    DeepGemmFp8OProj,
    ExactIndexer,
    FlashMLASparse,
    Fp4SimIndexer,
    Fp8DsMlaLayout,
    Mxfp4Indexer,
    NoHeadPadding,
    ReferenceOProj,
    TritonFp8Linear,
    TritonFp8OProj,
    TritonSparseMQA,
)
from dsv4.components.weights import in_fp8_blocks, random_layer_weights
from dsv4.formats.fp8_blocks import LinearNumerics
from tests.conftest import chunked, drive, gpu_device, hidden_for, make_engine, tiny_spec

DEV = gpu_device()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEV is None, reason="needs a CUDA GPU")]
HOPPER = DEV is not None and DEV.arch in ("sm90", "sm100")
FLASHINFER = importlib.util.find_spec("flashinfer")

BACKENDS = {
    "flashmla+deepgemm": lambda: dict(mqa_kernel=FlashMLASparse(), o_proj=DeepGemmFp8OProj(),
                                      head_padding=BucketHeadPadding(name="buckets_64_128", buckets=(64, 128))),
    "triton+triton_fp8": lambda: dict(mqa_kernel=TritonSparseMQA(), o_proj=TritonFp8OProj(),
                                      head_padding=NoHeadPadding()),
    "triton+reference": lambda: dict(mqa_kernel=TritonSparseMQA(), o_proj=ReferenceOProj(),
                                     head_padding=NoHeadPadding()),
    # the presets as shipped: the dense projections in fp8 too
    "flashmla+deepgemm+fp8": lambda: dict(mqa_kernel=FlashMLASparse(), o_proj=DeepGemmFp8OProj(),
                                          head_padding=BucketHeadPadding(name="buckets_64_128", buckets=(64, 128)),
                                          linear=DeepGemmFp8Linear()),
    "triton+triton_fp8+fp8": lambda: dict(mqa_kernel=TritonSparseMQA(), o_proj=TritonFp8OProj(),
                                          head_padding=NoHeadPadding(), linear=TritonFp8Linear()),
}
# rel err vs the oracle (rows rounded as the fp8 cache stored them; the dense projections' numerics as the
# backend's): bf16 activations, the fp8 o_proj, and fp8 projections whose e4m3 edges bf16 moves
BOUND = {"flashmla+deepgemm": 6e-2, "triton+triton_fp8": 6e-2, "triton+reference": 3e-2,
         "flashmla+deepgemm+fp8": 9e-2, "triton+triton_fp8+fp8": 9e-2}
GAP = {"flashmla+deepgemm+fp8": 0.15, "triton+triton_fp8+fp8": 0.15}      # compat.FP8_LINEAR_SELECTION_GAP
LENGTHS = {"long": 300, "mid": 45, "short": 9}
DECODE = [{r: 2 for r in LENGTHS}] * 3


def engine(backend: str, *, graphs: bool = False, seed: int = 0, weights=None, spec_changes=None, **kw):
    """(spec, engine, weights): with fp8 dense projections the weights are made in the checkpoint's fp8 format
    (their float values the blocks' dequantization, what the oracle multiplies)."""
    if backend.startswith("flashmla+deepgemm") and not HOPPER:
        pytest.skip("FlashMLA and DeepGEMM need sm90/sm100")
    spec = tiny_spec(**(dict(o_lora_rank=128) if "+reference" not in backend else {}),   # fp8 wo_a: 128x128 blocks
                     **(spec_changes or {}))
    gc = GraphConfig(enabled=True, capture_sizes=(1, 2, 4, 8, 16, 32), max_context=512) if graphs else None
    strategies = BACKENDS[backend]()
    fp8 = None
    if numerics(backend) == "fp8":
        made = {l: in_fp8_blocks(w) for l, w in (weights or {l: random_layer_weights(spec, l, seed)
                                                            for l in (0, 1, 2)}).items()}
        weights, fp8 = {l: m[0] for l, m in made.items()}, {l: m[1] for l, m in made.items()}
    eng, W = make_engine(spec, layout=Fp8DsMlaLayout(), dtype="bfloat16", device=DEV, seed=seed, weights=weights,
                         graphs=gc, swa_block_size=64, compressed_block_tokens=256, fp8=fp8, **strategies, **kw)
    return spec, eng, W


def numerics(backend: str) -> str:
    """The dense projections' numerics of a backend, as the oracle takes them."""
    lin = BACKENDS[backend]().get("linear")
    return "fp8" if lin is not None and lin.numerics is LinearNumerics.FP8 else "float"


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_every_layer_type_matches_the_oracle(backend, graphs):
    spec, eng, W = engine(backend, graphs=graphs)
    X = hidden_for({r: n + 6 for r, n in LENGTHS.items()}, spec.hidden_size, seed=1)
    X = {r: x.cuda() for r, x in X.items()}
    outs, topk = drive(eng, X, chunked(LENGTHS, 37) + DECODE)
    for layer in outs:
        for rid in LENGTHS:
            sel = topk.get(layer, {}).get(rid)
            o = ref.oracle_layer(spec.to_dump(), spec.compress_ratio(layer), W[layer], X[rid].cpu(),
                                 row_format="fp8_ds_mla", topk=None if sel is None else sel.cpu().long(),
                                 linear_numerics=numerics(backend))
            err = ref.rel_err(outs[layer][rid].cpu(), o["out"])
            assert err <= BOUND[backend], (layer, rid, err)
            if sel is not None:
                g = ref.grade_selection(sel.cpu(), o["scores"], spec.index_topk)
                # bf16 activations move scores by ~1e-3 relative: only near-ties may be chosen differently
                assert g["count_ok"] == 1.0 and g["max_gap"] <= GAP.get(backend, 2e-2), g


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_mxfp4_keys_select_what_fp4_sim_selects(graphs):
    """indexer=mxfp4 (68-byte records, decoded by the scoring kernel) and indexer=fp4_sim (bf16 rows of the
    same values), same weights and tokens: the same selections and outputs bit for bit. (Against the float32
    oracle, bf16 activations move values across FP4 rounding edges, so selections are graded by the CPU tests
    in float32: tests/test_indexer_numerics.py.)"""
    runs = {}
    for name, numerics in (("fp4_sim", Fp4SimIndexer()), ("mxfp4", Mxfp4Indexer())):
        spec, eng, _ = engine("triton+reference", graphs=graphs, seed=4, indexer=numerics)
        X = {r: x.cuda() for r, x in hidden_for({r: n + 6 for r, n in LENGTHS.items()}, spec.hidden_size,
                                                seed=5).items()}
        runs[name] = drive(eng, X, chunked(LENGTHS, 37) + DECODE)
    (outs, topk), (outs2, topk2) = runs["fp4_sim"], runs["mxfp4"]
    for layer in outs:
        for rid in LENGTHS:
            assert torch.equal(outs[layer][rid], outs2[layer][rid]), (layer, rid)
    assert topk
    for layer in topk:
        for rid in LENGTHS:
            assert torch.equal(topk[layer][rid], topk2[layer][rid]), (layer, rid)


def overlap(a, b) -> float:
    """The mean share of the valid entries of lists a [T, K] that lists b [T, K] also hold (1 for no entry)."""
    shares = []
    for x, y in zip(a.tolist(), b.tolist()):
        sa, sb = {i for i in x if i >= 0}, {i for i in y if i >= 0}
        shares.append(len(sa & sb) / len(sa) if sa else 1.0)
    return sum(shares) / len(shares)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fp8_keys_select_what_fp4_sim_selects(graphs):
    """indexer=triton_fp8 (132-byte fp8 records of fp4_sim's keys and e4m3 queries, our kernel's e4m3
    product of their exact values): fp4_sim's selections and outputs bit for bit. indexer=deepgemm_fp8
    (the same records and queries, DeepGEMM's fp8_paged_mqa_logits; sm90/sm100): fp4_sim's sets but for
    near-ties DeepGEMM's sums order otherwise, recall >= 0.98, and the outputs within 1e-2. triton_fp8
    with indexer.top_k=flashinfer: fp4_sim's sets, the outputs within 1e-3 (its lists' order). 64 index
    heads (the real model's; DeepGEMM takes 32 or 64 on sm90)."""
    from dsv4.strategies import DeepGemmFp8Indexer, FlashInferTopK, TritonFp8Indexer

    options = [("fp4_sim", Fp4SimIndexer()), ("triton_fp8", TritonFp8Indexer())]
    options += [("deepgemm_fp8", DeepGemmFp8Indexer())] if HOPPER else []
    options += [("flashinfer top-k", TritonFp8Indexer(top_k=FlashInferTopK()))] if FLASHINFER is not None else []
    runs = {}
    for name, numerics in options:
        spec, eng, _ = engine("triton+reference", graphs=graphs, seed=4, indexer=numerics,
                              spec_changes=dict(index_n_heads=64))
        X = {r: x.cuda() for r, x in hidden_for({r: n + 6 for r, n in LENGTHS.items()}, spec.hidden_size,
                                                seed=5).items()}
        runs[name] = drive(eng, X, chunked(LENGTHS, 37) + DECODE)
    outs, topk = runs.pop("fp4_sim")
    assert topk
    for name, (outs2, topk2) in runs.items():
        for layer in outs:
            for rid in LENGTHS:
                if name == "deepgemm_fp8":
                    assert ref.rel_err(outs2[layer][rid], outs[layer][rid]) <= 1e-2, (name, layer, rid)
                elif name == "flashinfer top-k":          # the same rows, attended in FlashInfer's list order
                    assert ref.rel_err(outs2[layer][rid], outs[layer][rid]) <= 1e-3, (name, layer, rid)
                else:
                    assert torch.equal(outs[layer][rid], outs2[layer][rid]), (name, layer, rid)
        for layer in topk:
            for rid in LENGTHS:
                if name == "deepgemm_fp8":
                    assert overlap(topk[layer][rid], topk2[layer][rid]) >= 0.98, (layer, rid)
                elif name == "flashinfer top-k":
                    assert torch.equal(topk[layer][rid].sort(-1).values, topk2[layer][rid].sort(-1).values)
                else:
                    assert torch.equal(topk[layer][rid], topk2[layer][rid]), (name, layer, rid)


@pytest.mark.parametrize("backend,top_k", [(b, "triton") for b in BACKENDS] + [("triton+reference", "flashinfer")])
def test_graph_replay_equals_eager_bit_for_bit(backend, top_k):
    """Steps whose token count is a capture size: the replayed graph and the eager forward, on engines
    with the same weights and history, give identical outputs and selections (with our top-k and with
    FlashInfer's, indexer.top_k=flashinfer)."""
    if top_k == "flashinfer" and FLASHINFER is None:
        pytest.skip("indexer.top_k=flashinfer needs flashinfer-python")
    from dsv4.checks.catalogue import option

    select = option("indexer.top_k", top_k)
    spec, g_eng, W = engine(backend, graphs=True, indexer=ExactIndexer(top_k=select))
    _, e_eng, _ = engine(backend, weights=W, indexer=ExactIndexer(top_k=select))
    X = {r: x.cuda() for r, x in hidden_for({r: n + 40 for r, n in LENGTHS.items()}, spec.hidden_size, seed=2).items()}
    schedule = chunked(LENGTHS, 64)
    drive(g_eng, X, schedule)
    drive(e_eng, X, schedule)
    for step in ({r: 2 for r in LENGTHS}, {"long": 8, "mid": 8, "short": 16}):    # 6 tokens: padded to 8; 32
        xs = torch.cat([X[r][g_eng.lengths[r]:g_eng.lengths[r] + n] for r, n in step.items()])
        pos = torch.cat([torch.arange(g_eng.lengths[r], g_eng.lengths[r] + n) for r, n in step.items()])
        ids = [r for r, n in step.items() for _ in range(n)]
        a = g_eng.step(xs, pos, ids)
        b = e_eng.step(xs, pos, ids, eager=True)
        assert a.graph_size is not None and b.graph_size is None
        for layer in a.outputs:
            if a.graph_size == xs.shape[0]:
                assert torch.equal(a.outputs[layer], b.outputs[layer]), layer
            else:                                  # padded rows change GEMM shapes: equal within rounding
                assert ref.rel_err(a.outputs[layer], b.outputs[layer]) <= 1e-2, layer
        for layer in a.topk:
            assert torch.equal(a.topk[layer], b.topk[layer]) if a.graph_size == xs.shape[0] else True


@pytest.mark.parametrize("backend", ["flashmla+deepgemm+fp8", "triton+triton_fp8+fp8"])
def test_dependent_launch_changes_no_bit(backend, monkeypatch):
    """Our kernels launched as programmatic dependents (Target.pdl, on sm90+) only start earlier: the steps,
    replayed and eager, give the same outputs and selections as with the attribute off."""
    import dsv4.kernels.target as target

    if DEV.arch != "sm90" and DEV.arch != "sm100":
        pytest.skip("programmatic dependent launch: sm90+")
    spec, on, W = engine(backend, graphs=True)
    assert all(m.ops.target.pdl for mods in on.layers.values() for m in mods)
    monkeypatch.setattr(target, "PDL_SM", 10 ** 9)
    _, off, _ = engine(backend, graphs=True, weights=W)
    assert not any(m.ops.target.pdl for mods in off.layers.values() for m in mods)
    X = {r: x.cuda() for r, x in hidden_for({r: n + 40 for r, n in LENGTHS.items()}, spec.hidden_size, seed=3).items()}
    schedule = chunked(LENGTHS, 64) + [{r: 1 for r in LENGTHS}, {r: 2 for r in LENGTHS}, {"long": 4, "mid": 4}]
    (out_on, topk_on), (out_off, topk_off) = drive(on, X, schedule), drive(off, X, schedule)
    for layer, per in out_on.items():
        for r, y in per.items():
            assert torch.equal(y, out_off[layer][r]), (layer, r)
    for layer, per in topk_on.items():
        for r, t in per.items():
            assert torch.equal(t, topk_off[layer][r]), (layer, r)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_layer_forward_makes_no_host_sync(backend):
    """torch's sync debug mode raises on any synchronizing call (.item(), .tolist(), nonzero, a D2H copy)
    inside the layer's forward."""
    spec, eng, W = engine(backend)
    X = {r: x.cuda() for r, x in hidden_for({r: n + 2 for r, n in LENGTHS.items()}, spec.hidden_size, seed=3).items()}
    drive(eng, X, chunked(LENGTHS, 128))
    segs = eng.validate(torch.cat([X[r][n:n + 2] for r, n in LENGTHS.items()]),
                        torch.cat([torch.arange(n, n + 2) for n in LENGTHS.values()]),
                        [r for r in LENGTHS for _ in range(2)])
    pool = eng.pools[0]
    pool.reserve({s.rid: (s.start, s.start + s.count) for s in segs})
    plan = eng.build_plan(pool, eng.plan_inputs(pool, segs), num_tokens=6)
    plan = plan.with_type_plans(eng.type_plans(plan, 0))
    x = torch.cat([X[r][n:n + 2] for r, n in LENGTHS.items()]).to(torch.bfloat16)
    for layer, ranks in eng.layers.items():
        ranks[0](x, plan, pool.layers[layer])          # compiles, fills JIT caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer, ranks in eng.layers.items():
            ranks[0](x, plan, pool.layers[layer])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["triton+reference"])
def test_any_chunking_gives_the_same_outputs(backend):
    spec, eng, W = engine(backend)
    X = {r: x.cuda() for r, x in hidden_for({"a": 270, "b": 23}, spec.hidden_size, seed=7).items()}
    whole, _ = drive(eng, X, [{"a": 270, "b": 23}])
    for chunk in (5, 37, 1):
        _, e2, _ = engine(backend, weights=W)
        outs, _ = drive(e2, X, chunked({"a": 270, "b": 23}, chunk))
        for layer in whole:
            for r in whole[layer]:
                assert ref.rel_err(outs[layer][r], whole[layer][r]) <= 2e-2, (chunk, layer, r)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_refused_step_leaves_every_other_row_as_it_was(graphs):
    """A NaN arising in one layer's SWA row, on the device, in eager and in graph mode: the step is refused
    with the row named and every row any request can read is unchanged; the next step works."""
    from tests.test_bad_input import assert_rolled_back, live_rows, snapshot

    spec, eng, W = engine("triton+reference", graphs=graphs)
    X = {r: x.cuda() for r, x in hidden_for({"a": 90, "b": 90}, spec.hidden_size, seed=4).items()}
    drive(eng, {r: X[r][:40] for r in X}, chunked({"a": 40, "b": 40}, 40))
    swa = next(l for l in eng.layers if spec.compress_ratio(l) == 1)
    kv_rows = eng.layers[swa][0].w_in[spec.q_lora_rank:]
    saved = kv_rows.clone()
    kv_rows[:, 3] = float("inf")
    before, rows0 = snapshot(eng), live_rows(eng)
    with pytest.raises(InvalidRequest, match=rf"non-finite swa row \(layer {swa}, request 'b', position 40\)"):
        eng.step(X["b"][40:42], torch.arange(40, 42), ["b", "b"])
    assert_rolled_back(before, rows0, eng)
    kv_rows.copy_(saved)
    out = eng.step(torch.cat((X["a"][40:42], X["b"][40:42])), torch.cat((torch.arange(40, 42),) * 2), ["a"] * 2 + ["b"] * 2)
    assert all(bool(torch.isfinite(y).all()) for y in out.outputs.values())


def _knobs():
    """Triton's knobs where this Triton has its post-compile hook (called after each compilation or load
    from its cache), else None."""
    import triton

    knobs = getattr(triton, "knobs", None)
    return knobs if hasattr(getattr(knobs, "runtime", None), "jit_post_compile_hook") else None


@pytest.mark.parametrize("backend", ["triton+triton_fp8", "flashmla+deepgemm", "triton+triton_fp8+fp8",
                                     "flashmla+deepgemm+fp8"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_steps_after_warm_up_compile_nothing(backend, graphs):
    """After warm_up() (every capture size captured; without graphs, each size run once on an empty step),
    one prefill and one eager decode step, further decode steps of new lengths, request mixes and token
    counts -- replayed and eager -- compile no Triton kernel: neither our launcher nor Triton's post-compile
    hook sees a new variant."""
    from dsv4.kernels.launch import compiled

    sizes = (1, 2, 4, 8, 16, 32)
    spec, eng, _ = engine(backend, graphs=graphs)
    eng.warm_up(sizes)
    if graphs:
        assert sorted(eng.graphs.captured) == list(eng.graphs.config.capture_sizes) == list(sizes)
    lengths = {"a": 150, "b": 31, "c": 6}
    X = {r: x.cuda() for r, x in hidden_for({r: n + 60 for r, n in lengths.items()}, spec.hidden_size,
                                             seed=9).items()}
    drive(eng, X, [lengths])                                    # a prefill: eager, its own picks compiled

    def step(chunk, eager=False):
        xs = torch.cat([X[r][eng.lengths[r]:eng.lengths[r] + n] for r, n in chunk.items()])
        pos = torch.cat([torch.arange(eng.lengths[r], eng.lengths[r] + n) for r, n in chunk.items()])
        return eng.step(xs, pos, [r for r, n in chunk.items() for _ in range(n)], eager=eager)

    step({"a": 2, "b": 2}, eager=True)                         # the first eager decode step
    knobs, seen = _knobs(), []
    hook = None
    if knobs is not None:
        hook = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = lambda *a, **k: seen.append(k.get("repr", "?"))
    before = compiled()
    try:
        mixes = [{"a": 1}, {"a": 1, "b": 1, "c": 1}, {"b": 3, "c": 2}, {"a": 4, "b": 4, "c": 4},
                 {"a": 2, "c": 1}, {"a": 7, "b": 5, "c": 1}, {"c": 16}, {"a": 1, "b": 2}]
        for i, chunk in enumerate(mixes):
            replayed = step(chunk)
            assert (replayed.graph_size is not None) == graphs
            step({r: 1 for r in chunk}, eager=True)
            assert compiled() == before and not seen, (chunk, i, seen, compiled())
    finally:
        if knobs is not None:
            knobs.runtime.jit_post_compile_hook = hook
