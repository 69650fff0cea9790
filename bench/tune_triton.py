"""Tuning sweep for the Triton kernels on a GPU, FlashMLA beside them in the same process.

  python bench/tune_triton.py            # launch parameters of mqa_kernel=triton_sparse on mode=bench's
                                         # decode cases, prefill at 4096 tokens, the fused o_proj prologue
                                         # vs a copy
  python bench/tune_triton.py quick      # the launch sweep on three decode cases
  python bench/tune_triton.py planned    # triton_sparse as shipped (variant=auto) and both its kernels beside FlashMLA,
                                         # around the planners' switches and at prefill size
  python bench/tune_triton.py split      # the Hopper kernel split over list blocks on small steps and few heads,
                                         # FlashMLA (padded to 64 heads) and the two-pass kernel beside it
  python bench/tune_triton.py few        # a rank's few heads (8, 16, 32): the few-heads Hopper kernel at two and
                                         # three K buffers beside FlashMLA and the 64-head kernel, both padded to 64
  python bench/tune_triton.py oproj      # o_proj=triton_fp8's grouped e4m3 product beside DeepGEMM, torch_fp8, bf16
  python bench/tune_triton.py linear     # linear=triton_fp8's product: launch variants (rows per program, columns,
                                         # K split, activation quantized inside or by its own launch) on DSV4-Flash's
                                         # products by row count, DeepGEMM's fp8_gemm_nt and the bf16 product beside
  python bench/tune_triton.py products   # the few-row products of DSV4-Flash and DSV4-Pro with their weights cold:
                                         # launches of linear=triton_fp8's product, DeepGEMM, a copy of the bytes
  python bench/tune_triton.py prefetch   # the 64-head kernel's L2 prefetch off, on and as picked, by program
                                         # length and pool size (pools that L2 holds and larger ones), FlashMLA beside
  python bench/tune_triton.py runs       # 8 and 16 heads on lists as a step plan makes them (MTP tokens sharing
                                         # their windows): each token alone, two tokens of a run per program and
                                         # as planned, FlashMLA beside

The shipped defaults (configs/mqa_kernel/triton_sparse.yaml, configs/o_proj/triton_fp8.yaml,
inv_rope_fp8_quant's) come from these sweeps.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from dsv4.speed.cases import DECODE_CASES, POOL_BLOCKS, oproj_case, pad_heads, runs_case, sparse_case
from dsv4.speed.timing import graph_time_us
from dsv4.components.rope import Rope
from dsv4.oracle import rel_err
from dsv4.strategies import FlashMLASparse, TritonSparseMQA
from dsv4.values.device import detect
from dsv4.speed.gpu import require_gpu
from dsv4.checks.catalogue import model_presets

CASES = DECODE_CASES[:5] + [("h64 128+512", 64, 64, 512, 2048, 2)]
# (the planner's large-step shape, its small-step shape, and the neighbours measured in the journal,
# docs/archive/benchmarks-journal.md)
CONFIGS = [dict(block_n=128, block_h=64, block_d=128, num_warps_pv=4), dict(block_n=64, block_h=16, block_d=64,
           num_warps_pv=8), dict(block_n=64, block_h=64, block_d=128, num_warps_pv=4),
           dict(block_n=128, block_h=64, block_d=64, num_warps_pv=4), dict(block_n=128, block_h=64, block_d=256,
           num_warps_pv=8), dict(block_n=128, block_h=64, block_d=128, num_warps=8, num_warps_pv=4),
           dict(block_n=64, block_h=32, block_d=64, num_warps_pv=8)]


def tiny_spec():
    """The small model whose RoPE tables the o_proj cases use (only its rotary settings matter here)."""
    return model_presets()["dsv4_tiny"]


def _compiled_stats():
    """Registers and spills of the last compiled scores and P·V kernels launched (Triton returns them from run)."""
    from dsv4.kernels.mqa import sparse_mqa as mod

    seen = {}
    for key, kernel in (("s", mod._scores_kernel), ("v", mod._pv_kernel)):
        def spy(*a, _run=kernel.run, _key=key, **kw):
            k = _run(*a, **kw)
            seen[_key] = k
            return k
        kernel.run = spy
    return seen


class _Skip:
    """Stands in for the P·V kernel to time the scores pass alone."""
    def __getitem__(self, grid):
        return lambda *a, **kw: None


SCALE = 512 ** -0.5                 # the softmax scale of a 512-dim latent


def flashmla():
    """FlashMLA's sparse decode strategy and its preparation on this GPU: the peer in every table."""
    fm = FlashMLASparse()
    return fm, fm.prepare(device=detect())


def decode(cases=CASES) -> None:
    from dsv4.kernels.mqa import sparse_mqa as mod

    scale = SCALE
    fm, fprep = flashmla()
    seen = _compiled_stats()
    for label, H, eb, ew, b, sq in cases:
        T = b * sq
        q, kv, sink = sparse_case(T, H, extra_block=eb, extra_w=ew, seed=T + H, swa_blocks=POOL_BLOCKS,
                                  extra_blocks=POOL_BLOCKS, full=True)
        ref, call = flashmla_steady(fm, fprep, q, kv, sink, scale)
        t_fm = graph_time_us(call)
        print(f"\n{label}, b={b}, s_q={sq}: FlashMLA {t_fm:.1f} µs\n| config | µs | / FlashMLA | scores pass µs | "
              "regs scores/P·V | spills scores/P·V | rel err |\n|---|---|---|---|---|---|---|")
        for c in CONFIGS + [dict()]:
            if c.get("block_h", 0) > max(H, 16):
                continue
            k = functools.partial(TritonSparseMQA(**c, variant="two_pass"), sink=sink, scale=scale)
            name = " ".join(f"{a}={v}" for a, v in c.items()) or "planned"
            try:
                out, _ = k(q, kv)
                us = graph_time_us(lambda: k(q, kv))
                keep, mod._pv_kernel = mod._pv_kernel, _Skip()
                try:
                    us_s = graph_time_us(lambda: k(q, kv))
                finally:
                    mod._pv_kernel = keep
                s, v = seen.get("s"), seen.get("v")
                print(f"| {name} | {us:.1f} | {us / t_fm:.2f} | {us_s:.1f} | {s.n_regs}/{v.n_regs} | "
                      f"{s.n_spills}/{v.n_spills} | {rel_err(out, ref):.1e} |", flush=True)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not a stop
                print(f"| {name} | {type(e).__name__}: {str(e)[:80]} |", flush=True)


def planned() -> None:
    """mqa_kernel=triton_sparse as shipped (variant=auto) and its two kernels beside FlashMLA on the same pages:
    mode=bench's decode cases, the steps around both planners' switches, and prefill-sized steps."""
    fm, prep = flashmla()
    variants = {v: TritonSparseMQA(variant=v) for v in ("auto", "two_pass", "hopper")}
    print("| case | FlashMLA µs | auto µs | two_pass µs | hopper µs | auto / FlashMLA | rel diff auto |\n"
          "|---|---|---|---|---|---|---|")
    cases = DECODE_CASES + [("h64 128+512", 64, 64, 512, b, 1) for b in (8, 16, 32, 48, 64, 96)] + [
        ("h64 128+512 prefill", 64, 64, 512, 4096, 1), ("h128 128+1024 prefill", 128, 64, 1024, 2048, 1)]
    for label, H, eb, ew, b, sq in cases:
        T = b * sq
        q, kv, sink = sparse_case(T, H, extra_block=eb, extra_w=ew, seed=T + H, swa_blocks=POOL_BLOCKS,
                                  extra_blocks=POOL_BLOCKS, full=True)
        a, call = flashmla_steady(fm, prep, q, kv, sink, SCALE)
        o, _ = variants["auto"](q, kv, sink=sink, scale=SCALE)
        t_f = graph_time_us(call)
        t = {v: graph_time_us(lambda: k(q, kv, sink=sink, scale=SCALE)) for v, k in variants.items()}
        print(f"| {label} b={b} s_q={sq} | {t_f:.1f} | {t['auto']:.1f} | {t['two_pass']:.1f} | {t['hopper']:.1f} | "
              f"{t['auto'] / t_f:.2f} | {rel_err(o, a):.1e} |", flush=True)


# (label, heads, compressed page size, compressed list width, requests, tokens per request): small steps,
# where the Hopper kernel's (token, 64 heads) programs leave SMs idle, and tensor-parallel ranks of
# DSV4-Flash (8 heads per rank at TP8, 16 at TP4) and DSV4-Pro (32 at TP4)
SPLIT_CASES = [("h64 128+512", 64, 64, 512, b, sq)
               for b, sq in ((1, 1), (4, 2), (8, 1), (16, 1), (32, 1), (48, 1), (64, 1))] + [
    ("h64 128 SWA only", 64, None, 0, 16, 1), ("h8 128+512", 8, 64, 512, 128, 2),
    ("h32 128+1024", 32, 64, 1024, 128, 2)]
SPLITS = (0, 1, 2, 4, 8, 16)


def flashmla_steady(fm, prep, q, kv, sink, scale):
    """FlashMLA as the layers after the first of their type in a step call it: the step's plan (tile-scheduler
    metadata, padded lists) made by a first call and reused, so a timed call is its kernel alone.
    -> (that first call's output, the call to time)."""
    plan = fm.plan(tokens=q.shape[0], layer_type=kv.layer_type)
    out, _ = fm(q, kv, sink=sink, scale=scale, prepared=prep, plan=plan)
    return out, lambda: fm(q, kv, sink=sink, scale=scale, prepared=prep, plan=plan)


def padded_case(fm, prep, H, eb, ew, T, scale):
    """A case's pages and queries, those padded to 64 heads (as head_padding pads them), and FlashMLA's output
    and time on the padded ones (`flashmla_steady`). -> (q, kv, sink, padded q, padded sink, FlashMLA's output,
    its µs)."""
    q, kv, sink = sparse_case(T, H, extra_block=eb, extra_w=ew, seed=T + H, swa_blocks=POOL_BLOCKS,
                              extra_blocks=POOL_BLOCKS, full=True)
    qp, sp = pad_heads(q, sink, 64)
    a, call = flashmla_steady(fm, prep, qp, kv, sp, scale)
    return q, kv, sink, qp, sp, a, graph_time_us(call)


def split(cases=SPLIT_CASES) -> None:
    """The Hopper kernel at several splits per (token, 64 heads) (0: planned, sparse_plan.hopper_splits)
    beside FlashMLA (its heads padded to 64, as the head_padding policy pads them; `flashmla_steady`), the
    two-pass kernel and auto, on the same pages."""
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import HopperLaunch

    fm, prep = flashmla()
    scale = SCALE
    splits = " | ".join(f"hopper splits={s or 'planned'}" for s in SPLITS)
    print(f"| case | FlashMLA µs | two_pass µs | auto µs | {splits} | rel diff planned |")
    print("|---" * (5 + len(SPLITS)) + "|")
    for label, H, eb, ew, b, sq in cases:
        q, kv, sink, _, _, a, t_f = padded_case(fm, prep, H, eb, ew, b * sq, scale)
        t_v = {v: graph_time_us(lambda: TritonSparseMQA(variant=v)(q, kv, sink=sink, scale=scale))
               for v in ("two_pass", "auto")}
        cells, err = [], ""
        for s in SPLITS:
            def run(s=s):
                return sparse_mqa(q, kv, sink=sink, scale=scale, variant="hopper", hopper=HopperLaunch(splits=s))
            o, _ = run()
            if not s:
                err = f"{rel_err(o, a[:, :H]):.1e}"
            cells.append(f"{graph_time_us(run):.1f}")
        print(f"| {label} b={b} s_q={sq} | {t_f:.1f} | {t_v['two_pass']:.1f} | {t_v['auto']:.1f} | "
              + " | ".join(cells) + f" | {err} |", flush=True)


# (label, heads, compressed page size, compressed list width, requests, tokens per request): the
# tensor-parallel ranks' head counts of DSV4-Flash (8 at TP8, 16 at TP4) and DSV4-Pro (32 at TP4)
FEW_CASES = [("h8 128+512", 8, 64, 512, 128, 2), ("h16 128+512", 16, 64, 512, 128, 2),
             ("h32 128+1024", 32, 64, 1024, 128, 2), ("h8 128+512", 8, 64, 512, 1, 1),
             ("h8 128+512", 8, 64, 512, 16, 1), ("h8 128+512", 8, 64, 512, 64, 1), ("h16 128+512", 16, 64, 512, 32, 2),
             ("h8 128+256 c128", 8, 2, 256, 128, 2), ("h8 128 SWA only", 8, None, 0, 128, 2)]


def few(cases=FEW_CASES) -> None:
    """The few-heads Hopper kernel (sparse_mqa_hopper_few.py) at two and three K buffers beside FlashMLA
    and the 64-head Hopper kernel, both given the queries padded to 64 heads (what head_padding=
    buckets_64_128 does), on the same pages; the error against FlashMLA's output."""
    from dsv4.kernels.mqa import sparse_mqa_hopper_few as few_mod
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import hopper_heads

    fm, prep = flashmla()
    scale = SCALE
    print("| case | FlashMLA (padded) µs | 64-head kernel (padded) µs | few-heads, 2 buffers | 3 buffers | auto µs | "
          "auto / FlashMLA | rel diff |")
    print("|---" * 8 + "|")
    for label, H, eb, ew, b, sq in cases:
        q, kv, sink, qp, sp, a, t_f = padded_case(fm, prep, H, eb, ew, b * sq, scale)

        def run(qq, ss):
            return sparse_mqa(qq, kv, sink=ss, scale=scale, variant="hopper")
        cells = [f"{graph_time_us(lambda: run(qp, sp)):.1f}"]
        shipped = few_mod.BUFFERS
        for n in (2, 3):
            if n == 3 and hopper_heads(H) > 16:        # three do not fit beside 32 heads' Q
                cells.append("-")
                continue
            few_mod.BUFFERS = n                       # what sparse_mqa_hopper launches with
            try:
                cells.append(f"{graph_time_us(lambda: run(q, sink)):.1f}")
            finally:
                few_mod.BUFFERS = shipped
        o = TritonSparseMQA(variant="auto")(q, kv, sink=sink, scale=scale)[0]
        t_a = graph_time_us(lambda: TritonSparseMQA(variant="auto")(q, kv, sink=sink, scale=scale))
        print(f"| {label} b={b} s_q={sq} | {t_f:.1f} | " + " | ".join(cells) + f" | {t_a:.1f} | {t_a / t_f:.2f} | "
              f"{rel_err(o, a[:, :H]):.1e} |", flush=True)


# (label, pages of the compressed pool, its list width, b, s_q, SWA pool pages of 64 rows, compressed pool pages)
PREFETCH_CASES = [("128+512", 64, 512, 128, 2, POOL_BLOCKS, POOL_BLOCKS),
                  ("128+512, compressed pool in L2", 64, 512, 128, 2, POOL_BLOCKS, 64),
                  ("128+512, both pools in L2", 64, 512, 128, 2, 16, 64),
                  ("128+512, both pools in L2", 64, 512, 64, 2, 16, 64),
                  ("128+256", 64, 256, 64, 2, POOL_BLOCKS, POOL_BLOCKS),
                  ("128+256", 64, 256, 128, 2, POOL_BLOCKS, POOL_BLOCKS),
                  ("128+512 ratio 128", 2, 512, 128, 2, POOL_BLOCKS, POOL_BLOCKS * 32),
                  ("128+512 ratio 128, compressed pool in L2", 2, 512, 128, 2, POOL_BLOCKS, POOL_BLOCKS),
                  ("128+512 ratio 128", 2, 512, 64, 2, POOL_BLOCKS, POOL_BLOCKS * 32),
                  ("128+1024", 64, 1024, 128, 2, POOL_BLOCKS, POOL_BLOCKS)]


def prefetch(cases=PREFETCH_CASES) -> None:
    """The 64-head Hopper kernel with its L2 prefetch of the next block's rows off, on (both pools) and as
    sparse_mqa picks it (`prefetched_pools`: pools larger than L2), FlashMLA beside; outputs compared."""
    from dsv4.kernels.target import target_of
    from dsv4.kernels.mqa.sparse_mqa import LOG2E, pool_args
    from dsv4.kernels.mqa.sparse_mqa_hopper import prefetched_pools, sparse_mqa_hopper
    from dsv4.kernels.mqa.sparse_plan import hopper_splits

    fm, prep = flashmla()
    scale = SCALE
    print("| 64 heads | pools MB (SWA + compressed) | FlashMLA µs | off | on | picked (SWA, compressed) | on / off | "
          "picked / off | outputs equal |")
    print("|---" * 9 + "|")
    for label, eb, ew, b, sq, swa_blocks, extra_blocks in cases:
        T = b * sq
        q, kv, sink = sparse_case(T, 64, extra_block=eb, extra_w=ew, seed=T + ew + extra_blocks,
                                  swa_blocks=swa_blocks, extra_blocks=extra_blocks, full=True)
        _, call = flashmla_steady(fm, prep, q, kv, sink, scale)
        t_f = graph_time_us(call)
        swa, ext = pool_args(kv.swa), pool_args(kv.extra)
        args = (q, sink.float(), scale * LOG2E, swa, kv.swa_indices.int(), kv.swa_lens.int(), ext,
                kv.extra_indices.int(), kv.extra_lens.int())
        tgt = target_of(q.device)
        splits = hopper_splits(T, 64, kv.swa_indices.shape[1] + ew, tgt.processors)
        pick = prefetched_pools(swa, ext, tgt.l2_bytes)
        runs = [functools.partial(sparse_mqa_hopper, *args, splits=splits, prefetch=pf)
                for pf in ((False, False), (True, True), pick)]
        outs = [f()[0] for f in runs]
        t_off, t_on, t_pick = (graph_time_us(f) for f in runs)
        print(f"| {label}, b={b}, s_q={sq} | {swa.data.nbytes / 1e6:.0f} + {ext.data.nbytes / 1e6:.0f} | {t_f:.1f} | "
              f"{t_off:.1f} | {t_on:.1f} | {t_pick:.1f} {pick} | {t_on / t_off:.2f} | {t_pick / t_off:.2f} | "
              f"{all(torch.equal(o, outs[0]) for o in outs)} |", flush=True)


# (label, heads, compressed lists: None, "topk" or "nested", their width (top-k), compressed page size,
# requests, tokens per request, context after the step)
RUNS_CASES = [("h8 128+512 top-k", 8, "topk", 512, 64, 128, 2, 8192),
              ("h8 128+512 top-k", 8, "topk", 512, 64, 256, 2, 8192),
              ("h16 128+512 top-k", 16, "topk", 512, 64, 128, 2, 8192),
              ("h8 128+512 top-k", 8, "topk", 512, 64, 64, 2, 8192),
              ("h8 128+512 top-k", 8, "topk", 512, 64, 16, 2, 8192),
              ("h8 128+512 top-k", 8, "topk", 512, 64, 128, 1, 8192),
              ("h8 128+512 top-k", 8, "topk", 512, 64, 256, 1, 8192),
              ("h8 128 SWA only", 8, None, 0, 64, 128, 2, 8192),
              ("h8 128 SWA only", 8, None, 0, 64, 64, 2, 8192),
              ("h16 128 SWA only", 16, None, 0, 64, 128, 2, 8192),
              ("h8 128+256 ratio 128", 8, "nested", 0, 2, 128, 2, 32768),
              ("h16 128+256 ratio 128", 16, "nested", 0, 2, 128, 2, 32768)]


def runs(cases=RUNS_CASES) -> None:
    """The few-heads Hopper kernel on a step plan's lists (SWA windows from random page tables, so that a
    request's tokens share their windows' rows): each token alone, a run's tokens two per program reading
    the union of their lists once, and as planned (sparse_plan.hopper_group), FlashMLA beside (padded to
    64 heads); the differences to the lone kernel's output and to FlashMLA's."""
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from dsv4.kernels.mqa.sparse_plan import HopperLaunch

    fm, prep = flashmla()
    print("| case | FlashMLA (padded) µs | each token alone µs | 2 tokens per program µs | planned µs | "
          "2 / alone | planned / FlashMLA | rel diff 2 vs alone | 2 vs FlashMLA |")
    print("|---" * 9 + "|")
    for label, H, extra, ew, eb, b, sq, ctx in cases:
        q, kv, sink = runs_case([sq] * b, [ctx] * b, H, extra=extra, extra_w=ew, extra_block=eb, seed=b + H)
        qp, sp = pad_heads(q, sink, 64)
        a, call = flashmla_steady(fm, prep, qp, kv, sp, SCALE)
        t_f = graph_time_us(call)
        alone_kv = dataclasses.replace(kv, runs=None, extra_nested=False)       # each token's lists alone

        def run(group):
            if group is None:
                return sparse_mqa(q, alone_kv, sink=sink, scale=SCALE, variant="hopper")
            return sparse_mqa(q, kv, sink=sink, scale=SCALE, variant="hopper", hopper=HopperLaunch(group=group))
        alone, two = run(None)[0], run(2)[0]
        t = {g: graph_time_us(lambda g=g: run(g)) for g in (None, 2, 0)}
        print(f"| {label} b={b} s_q={sq} | {t_f:.1f} | {t[None]:.1f} | {t[2]:.1f} | {t[0]:.1f} | "
              f"{t[2] / t[None]:.2f} | {t[0] / t_f:.2f} | {rel_err(two, alone):.1e} | {rel_err(two, a[:, :H]):.1e} |",
              flush=True)


def prologue() -> None:
    from dsv4.kernels.products.inv_rope_fp8 import inv_rope_fp8_quant

    rope = Rope.for_layer(tiny_spec(), 4)
    w, o, pos = oproj_case(4096, 8)
    rope.at(pos)
    c, s = rope.cos_sin(pos)
    moved = o.numel() * 2 + o.numel() + o.numel() // 128 * 4
    dst = torch.empty_like(o)
    t_copy = graph_time_us(lambda: dst.copy_(o))
    print(f"\nprologue at T=4096 (64 heads x 512): copy of o {t_copy:.1f} µs = {2 * o.numel() * 2 / t_copy / 1e3:.0f} GB/s")
    print("| blocks/program | warps | µs | GB/s |\n|---|---|---|---|")
    for bpp in (2, 4, 8, 16, 32):
        for nw in (1, 2, 4, 8):
            t = graph_time_us(lambda: inv_rope_fp8_quant(o, c, s, 8, blocks_per_program=bpp, num_warps=nw))
            print(f"| {bpp} | {nw} | {t:.1f} | {moved / t / 1e3:.0f} |", flush=True)


def oproj() -> None:
    """The grouped wo_a product alone (launch variants of ours, DeepGEMM's fp8_einsum, 8 torch._scaled_mm,
    the bf16 einsum) on the same fp8 bytes, then each whole fp8 o_proj strategy; DSV4-Flash shapes."""
    import deep_gemm

    from dsv4.kernels.products.fp8_grouped_gemm import grouped_fp8_gemm
    from dsv4.strategies import DeepGemmFp8OProj, ReferenceOProj, TorchFp8OProj, TritonFp8OProj
    from dsv4.strategies.o_proj.fp8_common import fused_inverse_rope_fp8_quant, quantize_weight_blocks
    from dsv4.strategies.linear.common import blockwise_scaled_mm

    dev, rope, G = detect(), Rope.for_layer(tiny_spec(), 4), 8
    print("\nwo_a alone, G=8, 4096 -> 1024 per group (µs; rel err vs DeepGEMM)\n| T | launch | triton_fp8 | rel err | "
          "DeepGEMM fp8_einsum | torch_fp8 (8 scaled_mm) | bf16 einsum |\n|---|---|---|---|---|---|---|")
    for T in (1, 64, 128, 1024, 4096):
        w, o, pos = oproj_case(T, G)
        rot = rope.at(pos)
        x, xs = fused_inverse_rope_fp8_quant(o, rot, G)
        wq, ws = quantize_weight_blocks(w.wo_a.cuda().view(G, 1024, -1))
        z = torch.empty(T, G, 1024, dtype=torch.bfloat16, device="cuda")
        t_dg = graph_time_us(lambda: deep_gemm.fp8_einsum("bhr,hdr->bhd", (x, xs), (wq, ws), z, recipe=(1, 128, 128)))
        ref = z.clone()
        t_tf = graph_time_us(lambda: [blockwise_scaled_mm(x[:, g].contiguous(), xs[:, g], wq[g], ws[g])
                                      for g in range(G)])
        xb, wb = o.reshape(T, G, -1), w.wo_a.cuda().bfloat16().view(G, 1024, -1)
        t_bf = graph_time_us(lambda: torch.einsum("tgd,grd->tgr", xb, wb))
        for bm, nw, st in ((64, 4, 4), (64, 4, 3), (128, 8, 3), (128, 8, 4), (128, 4, 3)):
            try:
                out = grouped_fp8_gemm(x, xs, wq, ws, block_m=bm, num_warps=nw, num_stages=st)
                t = graph_time_us(lambda: grouped_fp8_gemm(x, xs, wq, ws, block_m=bm, num_warps=nw, num_stages=st))
                print(f"| {T} | m{bm} w{nw} s{st} | {t:.1f} | {rel_err(out, ref):.1e} | {t_dg:.1f} | {t_tf:.1f} | "
                      f"{t_bf:.1f} |", flush=True)
            except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row, not a stop
                print(f"| {T} | m{bm} w{nw} s{st} | {type(e).__name__}: {str(e)[:80]} |", flush=True)
    print("\nwhole o_proj (prologue + wo_a), µs\n| T | reference | deepgemm_fp8 | torch_fp8 | triton_fp8 |"
          "\n|---|---|---|---|---|")
    for T in (1, 128, 4096):
        w, o, pos = oproj_case(T, G)
        rot = rope.at(pos)
        row = []
        for s in (ReferenceOProj(), DeepGemmFp8OProj(), TorchFp8OProj(), TritonFp8OProj()):
            prep = s.prepare(w, device=dev, dtype="bfloat16")
            row.append(graph_time_us(lambda: s(o, rot, prepared=prep)))
        print(f"| {T} | " + " | ".join(f"{t:.1f}" for t in row) + " |", flush=True)


LINEAR_SHAPES = {"x @ [wq_a|wkv]": (1536, 4096), "qr @ [wq_b|indexer wq_b]": (40960, 1024), "z @ wo_b": (4096, 8192)}


def linear(rows=(1, 16, 64, 128, 1024, 8192)) -> None:
    """linear=triton_fp8's product by launch (as planned first), bf16 x: in-kernel quantization or a separate
    act_quant launch (pre); DeepGEMM (with its act_quant launch) and bf16 beside; µs and rel err vs planned."""
    import deep_gemm

    from dsv4.formats.fp8_blocks import quantize_blocks
    from dsv4.kernels.products.fp8_linear import act_quant_fp8, fp8_linear, plan
    from dsv4.kernels.target import target_of

    tgt = target_of(torch.device("cuda"))
    print("\n| product | M | launch | µs | rel err |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for product, (N, K) in LINEAR_SHAPES.items():
        b = quantize_blocks(torch.randn(N, K, generator=g) * K ** -0.5)
        w, ws, wb = b.weight.cuda(), b.scale.cuda(), b.dequantize().cuda().bfloat16()
        for M in rows:
            x = torch.randn(M, K, generator=g).cuda().bfloat16()
            ref = fp8_linear(x, w, ws)
            y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")

            def dg():
                xq, xs = act_quant_fp8(x, mn_major_scales=True)
                deep_gemm.fp8_gemm_nt((xq, xs), (w, ws), y)
            rows_out = [("planned " + str(plan(M, N, K, tgt)), graph_time_us(lambda: fp8_linear(x, w, ws)), ref),
                        ("deepgemm + act_quant", graph_time_us(dg), y), ("bf16", graph_time_us(lambda: x @ wb.T), None)]
            small = M <= 128
            grid = ([dict(block_m=bm, block_n=bn, split=sp, num_warps=4, num_stages=4)
                     for bm in ((16, 64) if M <= 16 else (64,)) for bn in (64, 128) for sp in (1, 2, 4, 8)
                     if (K // 128) % sp == 0 and (K // 128) // sp >= 2] if small else
                    [dict(block_m=bm, block_n=bn, split=1, num_warps=nw, num_stages=st)
                     for bm in (64, 128) for bn in (128, 256) for nw in (4, 8) for st in (3, 4)])
            for cfg in grid:
                for pre in (False, True):
                    label = " ".join(f"{k}={v}" for k, v in cfg.items()) + (" pre" if pre else "")
                    try:
                        if pre:
                            def fn(cfg=cfg):
                                xq, xs = act_quant_fp8(x)
                                return fp8_linear(xq, w, ws, xs=xs, **cfg)
                        else:
                            def fn(cfg=cfg):
                                return fp8_linear(x, w, ws, **cfg)
                        out = fn()
                        rows_out.append((label, graph_time_us(fn), out))
                    except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row, not a stop
                        rows_out.append((label + f" {type(e).__name__}", float("nan"), None))
            best = min((r for r in rows_out[3:] if r[1] == r[1]), key=lambda r: r[1])
            for label, us, out in rows_out[:3] + [best]:
                err = "-" if out is None else f"{rel_err(out, ref):.1e}"
                print(f"| {product} | {M} | {label}{' (best)' if label == best[0] else ''} | {us:.1f} | {err} |",
                      flush=True)


PRODUCT_SHAPES = {"dsv4_flash": {"x @ [wq_a|wkv]": (1536, 4096), "qr @ [wq_b|indexer wq_b]": (40960, 1024),
                                 "z @ wo_b": (4096, 8192)},
                  "dsv4_pro": {"x @ [wq_a|wkv]": (2048, 7168), "qr @ [wq_b|indexer wq_b]": (73728, 1536),
                               "z @ wo_b": (7168, 16384)}}
COLD_BYTES = 256 << 20        # weight copies rotated per timed call: past any L2, every call reads DRAM


def products(rows=(1, 16), splits=(1, 2, 4, 8), stages=(3, 4)) -> None:
    """The few-row products with their weights cold (copies rotated past L2, as a layer step reads them): our
    planned launch and a sweep of launches (bf16 x, quantized inside; the dots as 16-row tiles or transposed,
    `swap`), DeepGEMM with its act_quant launch, and a device copy of the weight's bytes; µs, and the weight's
    bytes / time as a share of copy bandwidth."""
    import deep_gemm

    from dsv4.formats.fp8_blocks import quantize_blocks
    from dsv4.kernels.products.fp8_linear import act_quant_fp8, fp8_linear, plan
    from dsv4.kernels.target import target_of

    tgt = target_of(torch.device("cuda"))
    print("\n| model | product | M | launch | µs | share of copy BW | rel err |\n|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for model, shapes in PRODUCT_SHAPES.items():
        for product, (N, K) in shapes.items():
            b = quantize_blocks(torch.randn(N, K, generator=g) * K ** -0.5)
            nbytes = N * K
            copies = max(2, -(-COLD_BYTES // nbytes))
            ws = [(b.weight.cuda(), b.scale.cuda()) for _ in range(copies)]
            dst = torch.empty_like(ws[0][0])
            t_copy = graph_time_us(lambda: [dst.copy_(w) for w, _ in ws]) / copies
            copy_bw = 2 * nbytes / t_copy           # bytes/µs, read + write
            print(f"| {model} | {product} | - | device copy of the weight | {t_copy:.1f} | 1.0 | - |", flush=True)
            for M in rows:
                x = torch.randn(M, K, generator=g).cuda().bfloat16()
                ref = fp8_linear(x, *ws[0])
                y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")

                def dg():
                    for w, s in ws:
                        xq, xs = act_quant_fp8(x, mn_major_scales=True)
                        deep_gemm.fp8_gemm_nt((xq, xs), (w, s), y)
                results = [("planned " + str(plan(M, N, K, tgt)), lambda: [fp8_linear(x, w, s) for w, s in ws]),
                           ("deepgemm + act_quant", dg)]
                grid = [dict(block_m=16, block_n=bn, split=sp, num_warps=nw, num_stages=st, swap=sw)
                        for bn, nw, sw in ((64, 4, False), (128, 4, False), (64, 4, True), (128, 4, True))
                        for sp in splits for st in stages
                        if (K // 128) % sp == 0 and (K // 128) // sp >= 2 and N % bn == 0]
                results += [(" ".join(f"{k}={v}" for k, v in cfg.items()),
                             lambda cfg=cfg: [fp8_linear(x, w, s, **cfg) for w, s in ws]) for cfg in grid]
                timed = []
                for label, fn in results:
                    try:
                        out = fn()
                        out = y if label.startswith("deepgemm") else out[0]
                        timed.append((label, graph_time_us(fn, calls=2) / copies, rel_err(out, ref)))
                    except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row, not a stop
                        timed.append((f"{label} {type(e).__name__}", float("nan"), float("nan")))
                ok = [t for t in timed[2:] if t[1] == t[1]]
                best = sorted(ok, key=lambda t: t[1])[:3]
                for label, us, err in timed[:2] + best:
                    share = nbytes / us / copy_bw
                    print(f"| {model} | {product} | {M} | {label} | {us:.1f} | {share:.2f} | {err:.1e} |", flush=True)


SWEEPS = {"decode": lambda: (decode(), prologue()), "quick": lambda: decode([CASES[0], CASES[3], CASES[4]]),
          "planned": planned, "split": split, "few": few, "oproj": oproj, "linear": linear, "prefetch": prefetch,
          "runs": runs, "products": products}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", nargs="?", choices=list(SWEEPS), default="decode",
                    help="which sweep (default: the launch parameters on the decode cases, then the o_proj prologue)")
    sweep = ap.parse_args().sweep
    require_gpu("bench/tune_triton.py")
    SWEEPS[sweep]()


if __name__ == "__main__":
    main()
