"""Compile our Triton kernels for GPUs this machine does not have, with the Triton wheel's own compilers
(ptxas for NVIDIA, LLVM for AMD; no GPU and no driver needed): the portability check behind
`backend=triton`, `o_proj=triton_fp8` and `linear=triton_fp8`. Compiling is not running: the numbers are
checked on the H200 (tests marked gpu) and on the CPU under TRITON_INTERPRET=1.

  python -m dsv4.kernels.compile_check                              # every job below
  python -m dsv4.kernels.compile_check cuda:80/fp8_ds_mla hip:gfx942/fp8_ds_mla_fnuz cuda:89/o_proj

Each argument is TARGET/WHAT; TARGET is cuda:<sm> or hip:<gfx arch>; WHAT names a row format the two-pass
sparse MQA kernels read (sparse_plan.READS: mqa_kernel=triton_sparse's kernels reading such pages; OCP e4m3
bytes take the hardware conversion where sparse_mqa would use it, NVIDIA sm89+) or one of JOBS: `o_proj`
(o_proj=triton_fp8's grouped e4m3 product and linear=triton_fp8's product and activation quantizer at their
planned launches and batch_invariant's fixed ones, and its few-row joint launch of x's products, NVIDIA sm89+
only), `hopper` (triton_sparse's one-pass
Gluon kernels, sm90 only) or `layer` (the layer's front, compressor, cache-writer and indexer kernels). What is
compiled is each module's own `compile_cases(gpu)`: the specializations its wrappers launch. Exits non-zero if
any kernel fails to compile.
"""
from __future__ import annotations

import importlib
import sys
import time

# A100, L40/4090, H200, B200, RTX PRO 6000, MI300
TARGETS = ("cuda:80", "cuda:89", "cuda:90", "cuda:100", "cuda:120", "hip:gfx942")
FP8_TARGETS = ("cuda:89", "cuda:90", "cuda:100", "cuda:120")                # e4m3 tensor-core dots
HOPPER_TARGETS = ("cuda:90",)                                                # warpgroup MMAs
LAYER_TARGETS = ("cuda:80", "cuda:90", "hip:gfx942")                        # the layer's own kernels
# the jobs other than a row format's: the modules whose compile_cases each compiles, and its default targets
JOBS = {
    "o_proj": (("products.inv_rope_fp8", "products.fp8_grouped_gemm", "products.fp8_linear",
               "products.joint_linear"), FP8_TARGETS),
    "hopper": (("mqa.sparse_mqa_hopper", "mqa.sparse_mqa_hopper_few", "mqa.split_combine"), HOPPER_TARGETS),
    "layer": (("front.layer_front", "front.compress", "front.cache_write", "indexer.fp8_queries",
               "indexer.indexer_logits", "indexer.topk_lists"), LAYER_TARGETS),
}


def _gpu(target: str):
    from triton.backends.compiler import GPUTarget

    backend, arch = target.split(":")
    return GPUTarget(backend, int(arch) if backend == "cuda" else arch, 32 if backend == "cuda" else 64)


# largest shared memory one program may use (bytes); Triton checks it only when a kernel is loaded
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376, "gfx942": 65536}


def signature(case) -> dict[str, str]:
    """A case's Triton signature: its constexprs, its pointers and floats as typed, every other argument i32.
    Refuses a case that names an argument the kernel does not have or leaves one of its constexprs unset."""
    fn = case.kernel
    named = set(case.constexprs) | set(case.pointers) | case.floats | case.divisible
    unknown = named - set(fn.arg_names)
    unset = {p.name for p in fn.params if p.is_constexpr and p.name not in case.constexprs and not p.has_default}
    if unknown or unset:
        raise ValueError(f"{fn.__name__}'s compile case: no arguments {sorted(unknown)}; constexprs "
                         f"{sorted(unset)} not set")
    return {a: "constexpr" if a in case.constexprs else case.pointers.get(a) or ("fp32" if a in case.floats else "i32")
            for a in fn.arg_names}


def compile_case(case, gpu) -> None:
    """Compile a CompileCase as the launcher would specialize it (pointers and its divisible ints divisible by
    16) and check its shared memory against the target's limit."""
    import triton
    from triton.compiler import ASTSource

    fn = case.kernel
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    sig = signature(case)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in case.constexprs and (sig[a].startswith("*") or a in case.divisible)}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in case.constexprs.items()})
    k = triton.compile(src, target=gpu, options=dict(num_warps=case.num_warps, num_stages=1, **case.options))
    limit = SHARED_LIMIT.get(gpu.arch)
    if limit is not None and k.metadata.shared > limit:
        raise ValueError(f"{fn.__name__} needs {k.metadata.shared} B of shared memory, {gpu.arch} has {limit}")


def cases_for(gpu, what: str) -> list:
    """The compile cases of job `what` on `gpu`: its modules' (JOBS), or the two-pass sparse MQA kernels' for
    the row format labelled `what`."""
    if what in JOBS:
        return [case for name in JOBS[what][0]
                for case in importlib.import_module(f"dsv4.kernels.{name}").compile_cases(gpu)]
    from dsv4.formats.row_format import RowFormat
    from dsv4.kernels.mqa import sparse_mqa

    return sparse_mqa.compile_cases(gpu, rows=(RowFormat.from_label(what),))


def compile_for(target: str, what: str) -> float:
    """Compile `what` for `target`; seconds taken. Raises what Triton raises."""
    gpu = _gpu(target)
    t0 = time.perf_counter()
    for case in cases_for(gpu, what):
        compile_case(case, gpu)
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    from dsv4.kernels.mqa.sparse_plan import READS

    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    jobs = [a.split("/") for a in argv] or ([(t, rows.label) for t in TARGETS for rows in READS]
                                            + [(t, what) for what, (_, targets) in JOBS.items() for t in targets])
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
