"""mqa_kernel=triton_sparse against the reference kernel on the same pages.

Without a GPU the two-pass kernels run under TRITON_INTERPRET=1 on tiny shapes (CI); on an NVIDIA GPU
they are compiled (tests marked gpu). Both walk the same cases: SWA-only, ratio-4 and ratio-128 layers;
fp8_ds_mla (OCP and FNUZ) and bf16 pages; head counts that are not powers of two; several launch shapes,
the planner's two included; steps run through the workspace in token chunks; lists full of -1; queries
with no valid row; sinks of ±inf. The one-pass Hopper kernel (Gluon) walks the fp8_ds_mla cases on an
sm90 GPU only: Gluon has no interpreter, so CI compiles it for sm90 instead (test_compile_targets.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.triton_mode import BIG, DEVICE, GPU, MARK

from dsv4.speed.cases import sparse_case
from dsv4.oracle import rel_err
from dsv4.strategies import Fp8DsMlaFnuzLayout, Fp8DsMlaLayout, PlainRowLayout, ReferenceMQA
from dsv4.strategies.mqa_kernel.triton_sparse import TritonSparseMQA

pytestmark = MARK
ARCH = ("rocm" if torch.version.hip else "sm%d%d" % torch.cuda.get_device_capability()) if GPU else "cpu"


def kernel(variant, layout="fp8_ds_mla", **launch):
    """TritonSparseMQA with that variant; skips the Hopper one where it cannot run."""
    if variant == "hopper" and (ARCH != "sm90" or layout != "fp8_ds_mla"):
        pytest.skip(f"variant=hopper runs on sm90 with fp8_ds_mla pages (here: {ARCH}, {layout}; on the CPU "
                    "Gluon has no interpreter, CI compiles it instead)")
    return TritonSparseMQA(variant=variant, **launch)


VARIANTS = ["two_pass", "hopper"]
LAYOUTS = {"fp8_ds_mla": Fp8DsMlaLayout(), "fp8_ds_mla_fnuz": Fp8DsMlaFnuzLayout(),
           "bf16": PlainRowLayout(name="bf16", dtype="bfloat16")}
SCALE = 512 ** -0.5
LOG2E = 1 / math.log(2)


def case(T, H, extra, layout="fp8_ds_mla", seed=0, **kw):
    eb, ew = extra
    small = dict(swa_w=16 if not BIG else 128, swa_blocks=4, extra_blocks=4) if not BIG else {}
    return sparse_case(T, H, extra_block=eb, extra_w=ew if BIG else min(ew, 24), seed=seed,
                       layout=LAYOUTS[layout], device=DEVICE, **small, **kw)


def check_against_reference(out, lse, q, kv, sink):
    ref, ref_lse = ReferenceMQA()(q.float(), kv, sink=sink, scale=SCALE)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    # bf16 output and P rounded to bf16 before P·V (as FlashMLA does): ~2-5e-3 norm-wise
    assert rel_err(out, ref) <= 8e-3
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and bool((lse[~fin] == float("inf")).all())
    assert bool(((lse[fin] - ref_lse[fin]).abs() <= 1e-4 * ref_lse[fin].abs().clamp_min(1)).all())
    assert bool((out.float()[~fin] == 0).all())


LAYER_TYPES = {"swa": (None, 0), "c4a": (64, 512), "c128a": (2, 256)}


@pytest.mark.parametrize("layer", list(LAYER_TYPES))
@pytest.mark.parametrize("layout,variant", [(lay, "two_pass") for lay in LAYOUTS] + [("fp8_ds_mla", "hopper")])
@pytest.mark.parametrize("H", [1, 5, 16, 64] + ([96, 128] if BIG else []))
@pytest.mark.parametrize("T", [1, 37] if BIG else [1, 3])
def test_matches_reference_on_the_same_pages(layer, layout, H, T, variant):
    q, kv, sink = case(T, H, LAYER_TYPES[layer], layout, seed=T * 7 + H)
    launch = dict(block_n=16 if not BIG else 32) if variant == "two_pass" else {}
    out, lse = kernel(variant, layout, **launch)(q, kv, sink=sink, scale=SCALE)
    check_against_reference(out, lse, q, kv, sink)


# the planner's two shapes (small steps, large steps) and others a config may set
LAUNCHES = [dict(block_n=16, block_h=16, block_d=64, num_warps_pv=8), dict(block_n=32, block_h=64, block_d=128),
            dict(block_n=16, block_h=32, block_d=256, num_warps=8), dict()]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "planned")
def test_launch_shapes_agree(launch):
    """Every launch shape gives the reference's answer, for decode-sized and prefill-sized steps."""
    for T in (4, 40):
        q, kv, sink = case(T, 8, LAYER_TYPES["c4a"], seed=3 + T)
        out, lse = TritonSparseMQA(variant="two_pass", **launch)(q, kv, sink=sink, scale=SCALE)
        check_against_reference(out, lse, q, kv, sink)


@pytest.mark.parametrize("splits", [1, 2, 3, 64])
def test_hopper_splits_agree(splits):
    """The Hopper kernel cut into runs of list blocks per (token, 64 heads), merged by split_combine, gives
    the reference's answer: splits left empty by short lists, or more splits than blocks, included."""
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import HopperLaunch

    kernel("hopper")                            # skips where it cannot run
    for T, H, layer in ((4, 64, "c4a"), (3, 20, "c128a"), (2, 128, "swa"), (5, 64, "c4a")):
        q, kv, sink = case(T, H, LAYER_TYPES[layer], seed=T + H)
        if T == 5:
            kv.swa_lens[0] = 0                  # a token with no SWA row, one with no row at all
            kv.extra_lens[:2] = 0
        out, lse = sparse_mqa(q, kv, sink=sink, scale=SCALE, variant="hopper", hopper=HopperLaunch(splits=splits))
        check_against_reference(out, lse, q, kv, sink)


@pytest.mark.parametrize("buffers", [2, 3])
@pytest.mark.parametrize("H", [1, 8, 12, 16, 24, 32])
def test_few_heads_kernel_agrees(H, buffers):
    """The few-heads Hopper kernel (8, 16 or 32 heads per program, transposed products) gives the reference's
    answer with either number of K buffers, whole and split, on every layer type; lists that end inside a
    block, a token with no SWA row and one with no row at all included."""
    from dsv4.kernels.mqa.sparse_mqa import LOG2E, pool_args
    from dsv4.kernels.mqa.sparse_mqa_hopper import sparse_mqa_hopper

    kernel("hopper")                            # skips where it cannot run
    if buffers == 3 and H > 16:
        pytest.skip("three K buffers and 32 heads' Q do not fit in an SM's shared memory")
    for T, layer, splits in ((5, "c4a", 1), (3, "c128a", 1), (2, "swa", 1), (5, "c4a", 3), (1, "c128a", 4)):
        q, kv, sink = case(T, H, LAYER_TYPES[layer], seed=T + H + splits)
        if T == 5:
            kv.swa_lens[0] = 0
            kv.extra_lens[:2] = 0
        ex = (pool_args(kv.extra), kv.extra_indices.int(), kv.extra_lens.int()) if kv.extra is not None else ()
        out, lse = sparse_mqa_hopper(q, sink.float(), SCALE * LOG2E, pool_args(kv.swa), kv.swa_indices.int(),
                                     kv.swa_lens.int(), *ex, splits=splits, buffers=buffers)
        check_against_reference(out, lse, q, kv, sink)


@pytest.mark.parametrize("H", [8, 16])
@pytest.mark.parametrize("extra", [None, "topk", "nested"])
def test_a_runs_tokens_read_their_rows_once_and_agree(H, extra):
    """Programs that take a run's tokens together (StepPlan.runs: a request's MTP tokens) and read the union
    of their lists once give each token the reference's answer, and the per-token kernel's to P's bf16
    rounding: SWA windows full and not, ratio-4 top-k lists (each token's own), ratio-128 lists (nested),
    runs of one to three tokens, a request with none, padding rows; planned, split, and groups of 4."""
    from dataclasses import replace

    from dsv4.speed.cases import runs_case
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import HopperLaunch

    kernel("hopper")                            # skips where it cannot run
    q, kv, sink = runs_case([2, 1, 3, 0, 2, 2], [300, 5, 256, 9, 129, 8192], H, extra=extra, extra_w=512,
                            extra_block=2 if extra == "nested" else 64, pool_blocks=64, padding=3, seed=H,
                            device=DEVICE)
    alone, _ = sparse_mqa(q, replace(kv, runs=None, extra_nested=False), sink=sink, scale=SCALE, variant="hopper")
    for group, splits in ((0, 0), (2, 3), (32 // H, 1)):
        out, lse = sparse_mqa(q, kv, sink=sink, scale=SCALE, variant="hopper",
                              hopper=HopperLaunch(group=group, splits=splits))
        check_against_reference(out, lse, q, kv, sink)
        assert rel_err(out, alone) <= 4e-3


def test_l2_prefetch_changes_no_output():
    """The 64-head kernel's L2 prefetch of the next block's rows (programs of PREFETCH_MIN_BLOCKS blocks or
    more, asked of either pool or both) leaves every output bit as it is, and the answer is the
    reference's; lists that end inside a block and a token with no compressed row included."""
    from dsv4.kernels.mqa.sparse_mqa import LOG2E, pool_args
    from dsv4.kernels.mqa.sparse_mqa_hopper import PREFETCH_MIN_BLOCKS, sparse_mqa_hopper

    kernel("hopper")                            # skips where it cannot run
    q, kv, sink = case(6, 64, LAYER_TYPES["c4a"], seed=23)
    kv.extra_lens[1] = 0
    kv.extra_lens[2] = 300
    assert (kv.swa_indices.shape[1] + kv.extra_indices.shape[1]) // 64 >= PREFETCH_MIN_BLOCKS.value
    args = (q, sink.float(), SCALE * LOG2E, pool_args(kv.swa), kv.swa_indices.int(), kv.swa_lens.int(),
            pool_args(kv.extra), kv.extra_indices.int(), kv.extra_lens.int())
    outs = [sparse_mqa_hopper(*args, prefetch=pf) for pf in ((False, False), (True, True), (False, True))]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    check_against_reference(*outs[1], q, kv, sink)


def test_prefetch_asks_only_pools_larger_than_l2():
    """prefetched_pools: a pool's rows are prefetched where the pool is larger than L2, so that rows L2
    already holds are not asked for twice."""
    from dsv4.kernels.mqa.sparse_mqa import pool_args
    from dsv4.kernels.mqa.sparse_mqa_hopper import prefetched_pools

    _, kv, _ = sparse_case(1, 8, extra_block=2, extra_w=8, seed=3, swa_blocks=4, extra_blocks=4, device="cpu")
    swa, ext = pool_args(kv.swa), pool_args(kv.extra)
    assert ext.data.nbytes < swa.data.nbytes
    assert prefetched_pools(swa, ext, ext.data.nbytes) == (True, False)
    assert prefetched_pools(swa, ext, swa.data.nbytes) == (False, False)
    assert prefetched_pools(swa, None, 0) == (True, True)


@pytest.mark.parametrize("cuts", [(0, 10, 25, 40, 40), (0, 0, 3, 5, 9, 12, 13, 17, 20, 21, 22, 25, 27, 29, 30, 31, 33,
                                                  35, 36, 38, 40)])
def test_split_combine_merges_as_one_softmax(cuts):
    """split_combine's merge of per-split (output, max, sum) equals one softmax over all the scores with
    the sink in the denominator; a head whose every split is empty gets 0 and lse +inf. Four splits (the last
    one empty), and twenty (the first empty)."""
    from dsv4.kernels.mqa.split_combine import combine_splits

    g = torch.Generator().manual_seed(21)
    T, H, D, N = 3, 5, 512, 40
    s2 = torch.randn(T, H, N, generator=g) * 4  # scores x scale x log2(e)
    s2[:, 4] = float("-inf")                     # head 4 sees no row
    v = torch.randn(T, N, D, generator=g)
    sink = torch.randn(H, generator=g)
    S = len(cuts) - 1
    acc, ml = torch.zeros(S, T, H, D), torch.zeros(S, T, H, 2)
    for i in range(S):
        part = s2[..., cuts[i]:cuts[i + 1]]
        m = part.amax(-1) if part.shape[-1] else torch.full((T, H), float("-inf"))
        p = torch.exp2(part - torch.where(m == float("-inf"), 0.0, m)[..., None])
        acc[i], ml[i, ..., 0], ml[i, ..., 1] = p @ v[:, cuts[i]:cuts[i + 1]], m, p.sum(-1)
    out, lse = torch.empty(T, H, D, device=DEVICE), torch.empty(T, H, device=DEVICE)
    combine_splits(acc.to(DEVICE).flatten(), ml.to(DEVICE).flatten(), sink.to(DEVICE), out, lse, S)
    M = s2[:, :4].amax(-1)
    w = torch.exp2(s2[:, :4] - M[..., None])
    denom = w.sum(-1) + torch.exp2(sink[:4] * LOG2E - M)
    assert rel_err(out[:, :4].cpu(), (w @ v) / denom[..., None]) <= 1e-6
    assert torch.allclose(lse[:, :4].cpu(), (M + torch.log2(w.sum(-1))) * math.log(2), rtol=1e-6, atol=1e-6)
    assert bool((out[:, 4] == 0).all()) and bool((lse[:, 4] == float("inf")).all())


def test_planned_launch_follows_the_step_size():
    from dsv4.kernels.mqa.sparse_plan import Launch, plan_launch

    assert plan_launch(1, 64, 640, 132) == Launch(64, 16, 64, 8)          # b=1 decode: more, smaller programs
    assert plan_launch(256, 64, 640, 132) == Launch(128, 64, 128, 4)      # b=128, s_q=2
    assert plan_launch(256, 5, 640, 132).block_h == 16                    # no wider than the heads need


def test_long_steps_run_through_the_workspace_in_chunks(monkeypatch):
    """A step whose p would overflow the workspace runs in token chunks, with the same answer."""
    from dsv4.kernels.mqa import sparse_mqa as mod

    q, kv, sink = case(7, 8, LAYER_TYPES["c4a"], seed=5)
    whole, whole_lse = TritonSparseMQA(block_n=16, variant="two_pass")(q, kv, sink=sink, scale=SCALE)
    monkeypatch.setattr(mod, "WORKSPACE_BYTES", 4096)                     # a few tokens of p at a time
    out, lse = TritonSparseMQA(block_n=16, variant="two_pass")(q, kv, sink=sink, scale=SCALE)
    check_against_reference(out, lse, q, kv, sink)
    assert torch.equal(out, whole) and torch.equal(lse, whole_lse)


@pytest.mark.parametrize("key,value", [("block_d", 96), ("block_n", 48), ("block_h", 8), ("num_warps", 0),
                                       ("variant", "one_pass")])
def test_bad_launch_shape_is_refused_at_construction(key, value):
    with pytest.raises(ValueError, match=key):
        TritonSparseMQA(**{"variant": "two_pass", key: value})


@pytest.mark.parametrize("variant", ["auto", "hopper"])
def test_launch_shapes_need_the_two_pass_variant(variant):
    """The launch fields are the two-pass kernel's: with a variant that can run the Hopper kernel they
    would do nothing, so they are refused with the fix."""
    with pytest.raises(ValueError, match="variant=two_pass"):
        TritonSparseMQA(block_n=64, variant=variant)
    TritonSparseMQA(block_n=64, variant="two_pass")


def test_kernel_plan(monkeypatch):
    """auto takes the Hopper kernel on sm90 for fp8_ds_mla pages, whatever the step's size (small steps
    split over list blocks, a large step's MTP tokens at 8 heads two per program); an explicit hopper that
    cannot run is an error naming the reason and the fix."""
    from dsv4.formats.row_format import BF16_ROWS, FP8_DS_MLA, FP8_DS_MLA_FNUZ
    from dsv4.kernels.mqa.sparse_plan import hopper_group, hopper_heads, hopper_splits, plan_kernel

    ocp = FP8_DS_MLA.code
    h200 = dict(arch="sm90", layouts=(ocp, ocp), head_dim=512, native=True, dtype="bfloat16")
    assert plan_kernel("auto", **h200) == "hopper"
    assert plan_kernel("two_pass", **h200) == "two_pass"
    assert plan_kernel("hopper", **h200) == "hopper"
    # heads per program: a tensor-parallel rank's few heads are not padded to 64
    assert [hopper_heads(h) for h in (1, 8, 9, 16, 20, 32, 33, 64, 128)] == [8, 8, 16, 16, 32, 32, 64, 64, 64]
    # programs per (token, head block): about one program per SM in all, each at least one block of 64 rows
    assert hopper_splits(256, 64, 640, 132) == 1 and hopper_splits(132, 8, 640, 132) == 1
    assert hopper_splits(64, 8, 640, 132) == 2 and hopper_splits(64, 48, 640, 132) == 2
    assert hopper_splits(1, 64, 640, 132) == 10                              # b=1: one block each
    assert hopper_splits(16, 64, 640, 132) == 8 and hopper_splits(64, 64, 640, 132) == 2
    assert hopper_splits(16, 64, 128, 132) == 2                              # SWA only: two blocks in all
    assert hopper_splits(1, 128, 640, 132) == 10 and hopper_splits(100, 128, 640, 132) == 1
    # a run's tokens per program: two at 8 heads where the groups fill the GPU unsplit, else one
    assert hopper_group(256, 8, 640, 132) == 2 and hopper_group(512, 5, 128, 132) == 2
    assert hopper_group(128, 8, 640, 132) == 1                               # 64 groups would split
    assert hopper_group(512, 16, 640, 132) == 1 and hopper_group(512, 64, 640, 132) == 1
    assert hopper_splits(256, 8, 640, 132, group=2) == 1 and hopper_splits(128, 8, 640, 132, group=2) == 2
    for change, why in ((dict(arch="sm89"), "sm90"), (dict(arch="rocm"), "sm90"),
                        (dict(layouts=(BF16_ROWS.code,) * 2), "fp8_ds_mla"),
                        (dict(layouts=(ocp, FP8_DS_MLA_FNUZ.code)), "fp8_ds_mla"), (dict(native=False), "native_fp8"),
                        (dict(head_dim=576), "512"), (dict(dtype="float16"), "bfloat16")):
        other = {**h200, **change}
        assert plan_kernel("auto", **other) == "two_pass"
        with pytest.raises(ValueError, match=why):
            plan_kernel("hopper", **other)
    from dsv4.kernels.mqa import sparse_plan as mod

    monkeypatch.setattr(mod, "gluon_error", lambda: "Triton 3.4 has no usable Gluon")   # an older Triton
    assert plan_kernel("auto", **h200) == "two_pass"
    with pytest.raises(ValueError, match="no usable Gluon"):
        plan_kernel("hopper", **h200)


def test_gluon_needs_triton_3_6(monkeypatch):
    import triton

    from dsv4.kernels.mqa import sparse_plan as mod

    mod.gluon_error.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.5.1")
        assert ">= 3.6" in mod.gluon_error() and "3.5.1" in mod.gluon_error()
        mod.gluon_error.cache_clear()
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        assert mod.gluon_error() == ""                     # the module imports with any Triton from 3.6 on
    finally:
        mod.gluon_error.cache_clear()


def test_launch_settings_are_not_dropped_when_the_hopper_kernel_runs(monkeypatch):
    """sparse_mqa() itself (not only the strategy) refuses two-pass launch settings for a step it would
    run on the Hopper kernel, instead of ignoring them."""
    from dsv4.kernels.mqa import sparse_mqa as mod
    from dsv4.kernels.mqa.sparse_plan import TwoPassLaunch

    q, kv, sink = case(3, 8, LAYER_TYPES["c4a"], seed=2)
    monkeypatch.setattr(mod, "plan_kernel", lambda *a, **kw: "hopper")
    with pytest.raises(ValueError, match="variant='two_pass'"):
        mod.sparse_mqa(q, kv, sink=sink, scale=SCALE, two_pass=TwoPassLaunch(block_n=16))


def test_a_call_is_planned_by_the_target_its_strategy_prepared(monkeypatch):
    """The device is an input: the strategy's prepare() resolves the device's facts once, and its calls plan
    by that prepared value (here one that says sm90 with 7 processors), not by asking the GPU again."""
    from dsv4.values.device import DeviceInfo
    from dsv4.kernels.mqa import sparse_mqa as mod
    from dsv4.kernels.target import Target, device_arch, target_of

    dev = torch.device(DEVICE)
    strat = TritonSparseMQA()
    here = strat.prepare(device=DeviceInfo(platform="cpu") if dev.type == "cpu" else
                         DeviceInfo(platform="cuda", arch=device_arch(dev)))
    assert here == target_of(dev)
    seen = []

    def plan(variant, **facts):
        seen.append(facts["arch"])
        return "two_pass"

    def launch_plan(tokens, heads, columns, processors, _plan=mod.plan_launch):
        seen.append(processors)
        return _plan(tokens, heads, columns, processors)

    monkeypatch.setattr(mod, "plan_kernel", plan)
    monkeypatch.setattr(mod, "plan_launch", launch_plan)
    q, kv, sink = case(3, 8, LAYER_TYPES["c4a"], seed=4)
    want, _ = strat(q, kv, sink=sink, scale=SCALE, prepared=here)
    given = Target(arch="sm90", native_e4m3=here.native_e4m3, processors=7, interpret=here.interpret)
    got, _ = strat(q, kv, sink=sink, scale=SCALE, prepared=given)
    assert seen == [here.arch, here.processors, "sm90", 7]
    assert rel_err(got.float(), want.float()) <= 1e-2      # 7 processors: other launch shapes, the same sums


@pytest.mark.parametrize("variant", VARIANTS)
def test_lengths_outside_the_list_are_clamped(variant):
    """A negative length reads no row and one past the list's width reads the whole list, as the
    reference does."""
    q, kv, sink = case(6, 8, LAYER_TYPES["c4a"], seed=13)
    kv.swa_lens[:2], kv.extra_lens[2:4] = -200, kv.extra_indices.shape[1] + 1000
    kv.extra_lens[0] = -1
    out, lse = kernel(variant, **(dict(block_n=16) if variant == "two_pass" else {}))(q, kv, sink=sink, scale=SCALE)
    check_against_reference(out, lse, q, kv, sink)
    assert bool((lse[0] == float("inf")).all()) and bool((out[0] == 0).all())       # no row at all


@pytest.mark.gpu
@pytest.mark.skipif(not BIG, reason="a 2.2 GB page pool: GPU only")
@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_past_2gib_of_pages(variant):
    """Rows whose byte offsets in the pool pass 2^31 (60,000 pages of 37,440 B) are found: offsets are 64-bit."""
    from dsv4.values.seam import PagedCache

    lay, blocks = LAYOUTS["fp8_ds_mla"], 60_000
    pool = PagedCache(name="swa", layout=lay, block_size=64, head_dim=512,
                      data=lay.allocate(num_blocks=blocks, block_size=64, head_dim=512, device=DEVICE))
    g = torch.Generator(device=DEVICE).manual_seed(14)
    used = torch.cat([torch.arange(256, device=DEVICE), pool.num_slots - 1 - torch.arange(2048, device=DEVICE)])
    pool.write(used.int(), torch.randn(used.numel(), 512, generator=g, device=DEVICE))
    T = 8
    idx = used[torch.randint(0, used.numel(), (T, 128), generator=g, device=DEVICE)].int()
    q, kv, sink = case(T, 64, LAYER_TYPES["swa"], seed=15)
    kv = type(kv)(swa=pool, swa_indices=idx, swa_lens=torch.full((T,), 128, device=DEVICE).int())
    assert pool.data.numel() > 2 ** 31
    out, lse = kernel(variant)(q, kv, sink=sink, scale=SCALE)
    check_against_reference(out, lse, q, kv, sink)


@pytest.mark.parametrize("variant", VARIANTS)
def test_empty_lists_and_sink_infinities(variant):
    q, kv, sink = case(6, 8, LAYER_TYPES["c4a"], seed=9)
    kv.swa_indices[0] = -1                              # a list full of -1 with a length that says otherwise
    kv.swa_lens[1] = 0                                  # no SWA row, no compressed row: output 0, lse +inf
    kv.extra_lens[1] = 0
    kv.swa_indices[2, :3] = kv.swa.num_slots + 5        # slots outside the pool count as padding
    sink = sink.clone()
    sink[:2], sink[2:4] = float("inf"), float("-inf")
    for launch in LAUNCHES[:2] if variant == "two_pass" else [{}]:
        out, lse = kernel(variant, **launch)(q, kv, sink=sink, scale=SCALE)
        assert bool((out[:, :2] == 0).all())            # an infinite sink takes all the mass
        assert bool((out[1] == 0).all()) and bool((lse[1] == float("inf")).all())
        check_against_reference(out, lse, q, kv, sink)


@pytest.mark.parametrize("layout,variant", [("fp8_ds_mla", "two_pass"), ("fp8_ds_mla_fnuz", "two_pass"),
                                            ("fp8_ds_mla", "hopper")])
def test_each_64_dims_take_their_own_scale_on_odd_page_sizes(layout, variant):
    """Rows whose 7 e4m3 groups differ in magnitude by 2^3 steps (so each group has its own scale byte),
    compressed pages of 3 slots (not a power of two): every group of output dims matches the reference."""
    q, kv, sink = case(4, 8, (3, 24), layout, seed=11, q_std=0.05)
    g = torch.Generator(device=DEVICE).manual_seed(12)
    steps = (2.0 ** torch.arange(-12, 9, 3, device=DEVICE)).repeat_interleave(64)
    for cache in (kv.swa, kv.extra):
        rows = torch.randn(cache.num_slots, 512, generator=g, device=DEVICE)
        rows[:, :448] *= steps
        cache.write(torch.arange(cache.num_slots, dtype=torch.int32, device=DEVICE), rows)
    ref, _ = ReferenceMQA()(q.float(), kv, sink=sink, scale=SCALE)
    for launch in LAUNCHES if variant == "two_pass" else [{}]:
        out, lse = kernel(variant, layout, **launch)(q, kv, sink=sink, scale=SCALE)
        check_against_reference(out, lse, q, kv, sink)
        for d in range(0, 512, 64):
            assert rel_err(out[..., d:d + 64], ref[..., d:d + 64]) <= 8e-3, (launch, d)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "fp8_ds_mla_fnuz"])
def test_both_e4m3_decodings(native, layout):
    """The hardware e4m3 conversion (OCP bytes on sm89+) and the integer decoding read the same values;
    FNUZ bytes always take the integer decoding."""
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import TwoPassLaunch

    q, kv, sink = case(5, 16, LAYER_TYPES["c4a"], layout, seed=6)
    out, lse = sparse_mqa(q, kv, sink=sink, scale=SCALE, two_pass=TwoPassLaunch(block_n=16), native_fp8=native,
                          variant="two_pass")
    check_against_reference(out, lse, q, kv, sink)


@pytest.mark.parametrize("variant", VARIANTS)
def test_many_tokens_prefill_step(variant):
    """A prefill-sized step: every token its own lists."""
    q, kv, sink = case(300 if BIG else 40, 16, LAYER_TYPES["c4a"], seed=4)
    out, lse = kernel(variant, **(dict(block_n=16) if variant == "two_pass" else {}))(q, kv, sink=sink, scale=SCALE)
    check_against_reference(out, lse, q, kv, sink)


def test_auto_runs_what_the_plan_says():
    """variant=auto gives the answer of the kernel plan_kernel names for the step (on the CPU: two_pass)."""
    q, kv, sink = case(40 if not BIG else 300, 64, LAYER_TYPES["c4a"], seed=8)
    out, lse = TritonSparseMQA()(q, kv, sink=sink, scale=SCALE)
    check_against_reference(out, lse, q, kv, sink)
    planned = "hopper" if ARCH == "sm90" else "two_pass"
    same, same_lse = kernel(planned)(q, kv, sink=sink, scale=SCALE)
    assert torch.equal(out, same) and torch.equal(lse, same_lse)


def test_groups_of_a_runs_tokens_are_refused_without_the_runs_or_past_32_columns():
    """A group size the few-heads kernel cannot take is refused before anything is launched: no groups of
    the runs given, or more heads x tokens than its 32 columns."""
    from dsv4.kernels.mqa.sparse_mqa import LOG2E, pool_args
    from dsv4.kernels.mqa.sparse_mqa_hopper import sparse_mqa_hopper

    q, kv, sink = case(4, 8, LAYER_TYPES["swa"], seed=3)
    args = (q, sink.float(), SCALE * LOG2E, pool_args(kv.swa), kv.swa_indices.int(), kv.swa_lens.int())
    groups = torch.zeros(4, 2, dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="groups of the step's runs"):
        sparse_mqa_hopper(*args, group=2)
    with pytest.raises(ValueError, match="8 x 8"):
        sparse_mqa_hopper(*args, groups=groups, group=8)
