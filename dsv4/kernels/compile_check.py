"""Compile our Triton kernels for GPUs this machine does not have, with the Triton wheel's own compilers
(ptxas for NVIDIA, LLVM for AMD; no GPU and no driver needed): the portability check behind
`backend=triton`, `o_proj=triton_fp8` and `linear=triton_fp8`. Compiling is not running: the numbers are
checked on the H200 (tests marked gpu) and on the CPU under TRITON_INTERPRET=1.

  python -m dsv4.kernels.compile_check                              # every job below
  python -m dsv4.kernels.compile_check cuda:80/fp8_ds_mla hip:gfx942/fp8_ds_mla_fnuz cuda:89/o_proj

Each argument is TARGET/WHAT; TARGET is cuda:<sm> or hip:<gfx arch>; WHAT names a row format of
LAYOUT_CODES (mqa_kernel=triton_sparse's two-pass kernels reading such pages; OCP e4m3 bytes take the hardware
conversion where sparse_mqa would use it, NVIDIA sm89+), `o_proj` (o_proj=triton_fp8's grouped e4m3
product and linear=triton_fp8's product and activation quantizer at their planned launches and
batch_invariant's fixed ones, NVIDIA sm89+ only), `hopper` (triton_sparse's one-pass Gluon kernels, sm90
only) or `layer` (the layer's front, compressor, cache-writer and indexer kernels: layer_front, compress,
cache_write, indexer_logits, topk_lists, fp8_queries). Exits non-zero if any kernel fails to compile.
"""
from __future__ import annotations

import sys
import time

# A100, L40/4090, H200, B200, RTX PRO 6000, MI300
TARGETS = ("cuda:80", "cuda:89", "cuda:90", "cuda:100", "cuda:120", "hip:gfx942")
FP8_TARGETS = ("cuda:89", "cuda:90", "cuda:100", "cuda:120")                # e4m3 tensor-core dots
HOPPER_TARGETS = ("cuda:90",)                                                # warpgroup MMAs
LAYER_TARGETS = ("cuda:80", "cuda:90", "hip:gfx942")                        # the layer's own kernels


def _arg_type(name: str, layout: int) -> str:
    """Triton signature type of a kernel argument, from its name (the kernels' naming convention)."""
    if name.endswith("_u8"):
        return "*u8" if layout else "*bf16"               # bf16 pools pass the same bf16 tensor three times
    if name.endswith("_w64"):
        return "*i64" if layout else "*bf16"
    if name.endswith("_bf") or name in ("q_ptr", "out_ptr", "p_ptr"):
        return "*bf16"
    if name in ("ml_ptr", "sink_ptr", "lse_ptr"):
        return "*fp32"
    if name.endswith(("_idx", "_len")):
        return "*i32"
    return "fp32" if name == "qk_scale" else "i32"


def _gpu(target: str):
    from triton.backends.compiler import GPUTarget

    backend, arch = target.split(":")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)


# largest shared memory one program may use (bytes); Triton checks it only when a kernel is loaded
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376, "gfx942": 65536}


def _compile(fn, const: dict, types, divisible: set, gpu, num_warps: int, **options) -> None:
    """Compile fn as the launcher would specialize it (pointers and the named ints divisible by 16) and
    check its shared memory against the target's limit."""
    import triton
    from triton.compiler import ASTSource

    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    sig = {a: "constexpr" if a in const else types(a) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in const and (sig[a].startswith("*") or a in divisible)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=attrs)
    k = triton.compile(src, target=gpu, options=dict(num_warps=num_warps, num_stages=1, **options))
    limit = SHARED_LIMIT.get(gpu.arch)
    if limit is not None and k.metadata.shared > limit:
        raise ValueError(f"{fn.__name__} needs {k.metadata.shared} B of shared memory, {gpu.arch} has {limit}")


def compile_for(target: str, what: str) -> float:
    """Compile `what` for `target`; seconds taken. Raises what Triton raises. A layout: both sparse-MQA
    kernels at the planner's two launches (large steps, decode), page sizes 64 and 3. `o_proj`: the fused
    prologue and the grouped product at both allowed token blocks, 4 stages. `hopper`: the one-pass
    kernels (64 heads; 8, 16 and 32) with their register splits, whole and split, and the splits' merge."""
    import triton.language as tl

    gpu = _gpu(target)
    t0 = time.perf_counter()
    if what == "hopper":
        from dsv4.kernels.mqa import sparse_mqa_hopper as hop
        from dsv4.kernels.mqa import sparse_mqa_hopper_few as few
        from dsv4.kernels.mqa import split_combine

        # SWA pages of 64 rows (divisible by 16, as launched), compressed pages of 2 (a ratio-128 layer);
        # whole programs and splits of them: 64 heads, and 8/16/32 with their K buffers; the merge
        def types(a):
            return {"acc_ptr": "*fp32", "groups_ptr": "*i32"}.get(a) or _arg_type(a, 1)

        ints = {"s_w", "e_w", "s_stride", "e_stride", "s_slots", "e_slots", "H", "s_bs"}
        for split, inline in ((False, False), (True, False), (False, True)):
            _compile(hop._hopper_kernel, dict(D=512, WG1_REGS=hop.WG1_REGS, PRODUCER_REGS=hop.PRODUCER_REGS,
                                              SPLIT=split, INLINE=inline), types, ints, gpu, 4, maxnreg=hop.MAXNREG)
            # per heads: one token per program, or a run's tokens up to 32 columns, compressed lists of
            # each token in turn or nested
            for nh, g, nested in ((8, 1, False), (16, 1, False), (32, 1, False), (8, 2, False), (8, 2, True),
                                  (16, 2, False), (8, 4, True)):
                _compile(few._few_heads_kernel, dict(NH=nh, D=512, NBUF=few.BUFFERS,
                                                     PRODUCER_REGS=few.PRODUCER_REGS, SPLIT=split, G=g,
                                                     NESTED=nested),
                         types, ints, gpu, 4, maxnreg=few.MAXNREG)
        _compile(split_combine._combine_kernel, dict(BH=split_combine.BH, DB=split_combine.DB, D=512), types,
                 {"H"}, gpu, 4)
        return time.perf_counter() - t0
    if what == "layer":
        _compile_layer(gpu)
        return time.perf_counter() - t0
    if what == "o_proj":
        from dsv4.kernels.products.fp8_grouped_gemm import _grouped_fp8_kernel
        from dsv4.kernels.products.fp8_linear import _act_quant_kernel, _fp8_linear_kernel
        from dsv4.kernels.products.inv_rope_fp8 import _inv_rope_fp8_kernel

        types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "z_ptr": "*bf16",
                 "o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "s_ptr": "*fp32"}
        _compile(_inv_rope_fp8_kernel, dict(HEAD_DIM=512, ROPE=64, BPP=16), lambda a: types.get(a, "i32"),
                 {"n_blocks", "groups_per_token"}, gpu, 4)
        for bm, warps in ((64, 4), (128, 8)):
            _compile(_grouped_fp8_kernel, dict(BM=bm, DOT=tl.float8e4nv, STAGES=4), lambda a: types.get(a, "i32"),
                     {"N", "K"}, gpu, warps)
        # linear=triton_fp8: its planned launches for DSV4-Flash's products at decode and prefill row counts,
        # and batch_invariant's fixed ones (split over programs or inside them)
        from dsv4.kernels.products.fp8_linear import fixed_launch, plan
        from dsv4.kernels.target import Target

        lin = types | {"y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
        tgt = Target(arch=f"sm{gpu.arch}", native_e4m3=True, processors=132)
        shapes = ((1536, 4096), (40960, 1024), (4096, 8192))
        launches = {(plan(M, N, K, tgt), False) for M in (1, 64, 8192) for N, K in shapes}
        launches |= {(fixed_launch(M, N, K, tgt), inline) for M in (1, 256) for N, K in shapes
                     for inline in (False, True)}
        for p, inline in sorted(launches, key=str):
            for quant in {False, not p.quantize_first}:      # rows quantized elsewhere (the q_lora norm), or here
                _compile(_fp8_linear_kernel, dict(BM=p.block_m, BN=p.block_n, SPLIT=p.split, QUANT=quant,
                                                  DOT=tl.float8e4nv, STAGES=p.num_stages, INLINE=inline),
                         lambda a, q=quant: (lin | ({"x_ptr": "*bf16", "xs_ptr": "*bf16"} if q else {})).get(a, "i32"),
                         {"N", "K", "xs_row", "xs_col"}, gpu, p.num_warps)
        _compile(_act_quant_kernel, dict(BM=32, EMULATE=False), lambda a: {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                                                                          "s_ptr": "*fp32"}.get(a, "i32"),
                 {"K", "s_row", "s_col"}, gpu, 4)
        return time.perf_counter() - t0
    from dsv4.kernels.mqa import sparse_mqa as mod
    from dsv4.kernels.target import E4M3_SM

    code = {f.label: c for f, c in mod.LAYOUT_CODES.items()}[what]
    native = gpu.backend == "cuda" and gpu.arch >= E4M3_SM and code == 1
    ints = {"s_w", "e_w", "s_stride", "e_stride", "s_slots", "e_slots", "H", "NC"}
    for plan in (mod.plan_launch(256, 64, 640, 132), mod.plan_launch(1, 64, 640, 132)):
        for fn, extra, warps in ((mod._scores_kernel, {}, 4),
                                 (mod._pv_kernel, dict(DB=plan.block_d, NBC=mod.ML_BLOCKS), plan.num_warps_pv)):
            const = dict(S_LAYOUT=code, E_LAYOUT=code, S_BS=64, E_BS=3, HAS_EXTRA=True, BH=plan.block_h,
                         BN=plan.block_n, D=512, DOT=tl.bfloat16, NATIVE=native, **extra)
            _compile(fn, const, lambda a: _arg_type(a, code), ints, gpu, warps)
    return time.perf_counter() - t0


# how the row-making kernels store (kernels/cache_write.RowStore): their rows out (0), fp8_ds_mla records
# (OCP, FNUZ) and plain bf16 rows, with the pointer types each passes
_FP8_CACHE = {"cache_ptr": "*u8", "cache_bf_ptr": "*bf16", "cache_w64_ptr": "*i64"}
STORES = ((0, {"cache_ptr": "*fp32", "cache_bf_ptr": "*fp32", "cache_w64_ptr": "*fp32"}), (1, _FP8_CACHE),
          (2, _FP8_CACHE), (3, {"cache_ptr": "*bf16", "cache_bf_ptr": "*bf16", "cache_w64_ptr": "*bf16"}))


def _compile_layer(gpu) -> None:
    """The layer's kernels as their launchers specialize them: bf16 and float32 activations, ratios 4
    (head_dim 512 and the indexer's 128) and 128, fp8_ds_mla records (OCP and FNUZ bytes) on pages of 64
    and 3 rows, plain float32 and bf16 rows, the indexer's keys also as mxfp4 and fp8 records (with the
    FP4 numerics in the front and compress kernels, one compressor a launch or a layer's two), the indexer
    with 64 heads of 128 dims on pages of 64 entries at its planned launches (float32 and bf16 keys, the
    records), the fp8 indexers' queries, the top-k lists and the page lookup of a selection made elsewhere."""
    import triton.language as tl

    from dsv4.kernels.front import cache_write, compress, layer_front
    from dsv4.kernels.indexer import fp8_queries, indexer_logits, topk_lists
    from dsv4.kernels.target import E4M3_SM

    def types(table):
        return lambda a: table.get(a, "fp32" if a in ("eps", "w_scale", "iw_scale") else "i32")

    f32 = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "w_ptr": "*fp32", "norm_ptr": "*fp32", "ape_ptr": "*fp32",
           "sc_ptr": "*fp32", "st_ptr": "*fp32", "pos_ptr": "*i32", "slot_ptr": "*i32", "start_ptr": "*i32",
           "req_ptr": "*i64", "close_ptr": "*i32", "keep_ptr": "*i32", "pages_ptr": "*i32", "store_ptr": "*i32",
           "faults_ptr": "*i1", "cnt_ptr": "*i32"}
    for dt, name in ((tl.bfloat16, "*bf16"), (tl.float32, "*fp32")):
        for kv in {name, "*fp32"}:                       # the SWA projection's output, or the float32 one
            for kind, cache in STORES:
                fp8 = kind == cache_write.FP8_DS_MLA.value      # fp8_ds_mla rows with the fp8 indexers' queries
                _compile(layer_front._front_kernel, dict(D=512, BH=4, NQB=16, DI=128, BHI=8, NIB=8, DTYPE=dt,
                                                         FP4=kind == cache_write.PLAIN_ROWS.value or fp8, FP8=fp8,
                                                         FAULT_ROWS=3, KIND=kind, BS=64, SOFT=False),
                         types({**f32, **cache, "q_ptr": name, "qo_ptr": name, "kv_ptr": kv, "out_ptr": "*fp32",
                                "iq_ptr": name, "iqo_ptr": "*u8" if fp8 else name, "iw_ptr": "*fp32",
                                "iwq_ptr": "*fp32"}),
                         {"kv_stride", "H", "PH", "HI", "iw_stride"}, gpu, 4)
            for fp8 in (False, True):                     # the rows, or as an fp8 linear reads them
                _compile(layer_front._norm_rows_kernel, dict(BLOCK=1024, SOFT=False, FP8=fp8),
                         types({**f32, "x_ptr": kv, "out_ptr": name, "q_ptr": "*fp8e4nv" if fp8 else name,
                                "s_ptr": "*fp32" if fp8 else name}), {"x_stride", "N", "s_row", "s_col"}, gpu, 4)
        _compile(layer_front._rotate_rows_kernel, dict(D=128, BH=8, SOFT=False),
                 types({**f32, "x_ptr": "*fp32", "out_ptr": name}), {"H"}, gpu, 4)
    def job(n: str, dim: int, coff: int, kind: int, cache: dict) -> tuple[dict, dict]:
        """One compressor's constexprs and pointer types in the compress kernel (n: '' or '2')."""
        ptrs = {**{k.replace("_ptr", f"{n}_ptr"): f32[k] for k in ("sc_ptr", "ape_ptr", "norm_ptr", "st_ptr",
                                                                    "store_ptr")},
                f"out{n}_ptr": "*fp32", **{k.replace("cache", f"cache{n}"): v for k, v in cache.items()}}
        return {f"D{n}": dim, f"BLOCK{n}": min(1024, 2 * coff * dim), f"KIND{n}": kind, f"BS{n}": 64}, ptrs

    # the indexer's keys: plain rows (exact or fp4_sim numerics), mxfp4 or fp8 records (FP4 numerics)
    indexer_stores = [(k, c, False) for k, c in STORES[:1] + STORES[3:]] + [(k, c, True) for k, c in STORES[3:]]
    u8 = {"cache_ptr": "*u8", "cache_bf_ptr": "*u8", "cache_w64_ptr": "*u8"}
    indexer_stores += [(cache_write.FP4_RECORD.value, u8, True), (cache_write.FP8_KEY_RECORD.value, u8, True)]
    pairs = [((4, 512, k, c, False), None) for k, c in STORES[:2]]
    pairs += [((4, 128, k, c, fp4), None) for k, c, fp4 in indexer_stores]
    pairs += [((128, 512, k, c, False), None) for k, c in STORES[:3]]
    pairs += [((4, 512, k, c, False), (128, k2, c2, fp4)) for k, c in STORES[1:2] for k2, c2, fp4 in indexer_stores]
    # one compressor a launch, or a layer's and its indexer's; bf16 activations (the first also float32)
    for i, ((ratio, dim, kind, cache, fp4), second) in enumerate(pairs):
        coff = compress.RATIOS[ratio]
        const, ptrs = job("", dim, coff, kind, cache)
        dim2, kind2, cache2, fp4_2 = (dim, kind, cache, fp4) if second is None else second
        const2, ptrs2 = job("2", dim2, coff, kind2, cache2)
        for dt in (tl.bfloat16, tl.float32) if i == 0 else (tl.bfloat16,):
            _compile(compress._compress_kernel, dict(R=ratio, COFF=coff, SB=64, RB=compress.ROWS_PER_CHUNK,
                                                     SOFT=False, JOBS=1 if second is None else 2, FP4=fp4,
                                                     FP4_2=fp4_2, DTYPE=dt, **const, **const2),
                     types({**f32, **ptrs, **ptrs2}), {"sc_stride", "sc2_stride"}, gpu, 4)
    pages = {"rows_ptr": "*bf16", "slot_ptr": "*i32", "u8_ptr": "*u8", "bf_ptr": "*bf16", "w64_ptr": "*i64"}
    for bs, fnuz in ((64, False), (3, True)):
        _compile(cache_write._fp8_ds_mla_kernel, dict(BS=bs, FNUZ=fnuz, SOFT=False), types(pages),
                 {"row_stride", "page_stride"}, gpu, 2)
    for name in ("*fp32", "*bf16"):
        _compile(cache_write._write_rows_kernel, dict(BLOCK=512, SOFT=False),
                 types({"rows_ptr": "*fp32", "slot_ptr": "*i32", "cache_ptr": name}), {"row_stride", "D"}, gpu, 4)
    for name in ("*bf16", "*fp32"):                      # the fp8 indexers' queries
        _compile(fp8_queries._fp8_queries_kernel, dict(HP=64, DP=128),
                 types({"q_ptr": name, "w_ptr": "*fp32", "q8_ptr": "*u8", "wq_ptr": "*fp32", "w_scale": "fp32"}),
                 {"H", "D"}, gpu, 4)
    il = indexer_logits
    # the planned decode and prefill shapes, over plain rows; and bf16's over FP4 records (bf16 queries) and
    # fp8 records (e4m3 queries: an e4m3 product where the target has one, else decoded to bf16)
    fp8 = "fp8" if gpu.backend == "cuda" and gpu.arch >= E4M3_SM else "bf16"
    shapes = [(dtype, plan, 0, prec) for (dtype, _size), plan in il.LAUNCH.items()
              for prec in [il.INPUT_PRECISION[gpu.backend] if dtype == "float32" else "bf16"]]
    shapes += [(rows.label, plan, record, "bf16" if rows.label == "mxfp4" else fp8)
               for (dtype, _size), plan in il.LAUNCH.items() if dtype == "bfloat16"
               for rows, record in il.RECORDS.items()]
    for dtype, plan, record, prec in shapes:
        e4m3 = dtype == "fp8"
        name = {"float32": "*fp32"}.get(dtype, "*u8" if e4m3 else "*bf16")
        _compile(il._indexer_kernel, dict(BS=64, TG=il.TOKENS_PER_PROGRAM, HP=64, DP=128, BN=plan.block_n,
                                          NBLK=plan.blocks, PREC=prec, RECORD=record, Q_E4M3=e4m3,
                                          STAGES=plan.stages if gpu.backend == "cuda" and gpu.arch >= 90 else 1),
                 types({**f32, "q_ptr": name, "k_ptr": "*u8" if record else name, "out_ptr": "*fp32",
                        "w_scale": "fp32"}),
                 {"H", "DI", "width", "w_stride"}, gpu,
                 plan.num_warps)
    tk = topk_lists
    for nw in (tk.NARROW_WARPS, tk.NUM_WARPS):
        _compile(tk._topk_lists_kernel, dict(BLOCK=tk.BLOCK, RADIX=tk.RADIX, KP=512, CAP=tk.MIN_CAP, SAMPLE=tk.SAMPLE,
                                             NW=nw, CW=tk.WARP_COLS),
                 types({"scores_ptr": "*fp32", "cnt_ptr": "*i32", "pages_ptr": "*i32", "req_ptr": "*i64",
                        "local_ptr": "*i32", "slots_ptr": "*i32", "lens_ptr": "*i32", "cand_ptr": "*i32",
                        "ncand_ptr": "*i32"}), {"width", "pages_stride", "cand_stride"}, gpu, nw)
    _compile(tk._slot_lists_kernel, dict(KP=512),
             types({"local_ptr": "*i32", "pages_ptr": "*i32", "req_ptr": "*i64", "slots_ptr": "*i32",
                    "lens_ptr": "*i32"}),
             {"pages_stride", "K"}, gpu, 4)


def main(argv: list[str]) -> int:
    from dsv4.kernels.mqa.sparse_mqa import LAYOUT_CODES

    jobs = [a.split("/") for a in argv] or ([(t, lay.label) for t in TARGETS for lay in LAYOUT_CODES]
                                            + [(t, "o_proj") for t in FP8_TARGETS]
                                            + [(t, "hopper") for t in HOPPER_TARGETS]
                                            + [(t, "layer") for t in LAYER_TARGETS])
    failed = 0
    for target, what in jobs:
        try:
            print(f"{target:12s} {what:16s} compiled in {compile_for(target, what):.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - report every target, then fail
            failed += 1
            print(f"{target:12s} {what:16s} FAILED: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
