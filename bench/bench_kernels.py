"""Kernel timings on a GPU, peers side by side in one process (CUDA-graph replay, median of repeats).

  sparse MQA decode: mqa_kernel=flashmla_sparse vs mqa_kernel=reference on the same fp8_ds_mla pages
  prefill (many query tokens): FlashMLA's decode kernel vs its bf16-gather + flash_mla_sparse_fwd path
  o_proj wo_a: deepgemm_fp8 vs torch_fp8 vs the bf16 reference einsum
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from dsv4.components.rope import Rope
from dsv4.values.device import detect
from dsv4.oracle import rel_err
from dsv4.strategies import DeepGemmFp8OProj, FlashMLASparse, ReferenceMQA, ReferenceOProj, TorchFp8OProj
from dsv4.speed.cases import POOL_BLOCKS, oproj_case, sparse_case
from dsv4.speed.gpu import require_gpu
from dsv4.speed.timing import graph_time_us
from dsv4.checks.catalogue import model_presets


def tiny_spec():
    """The small model whose RoPE tables the o_proj cases use (only its rotary settings matter here)."""
    return model_presets()["dsv4_tiny"]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_gpu("bench/bench_kernels.py")
    dev = detect()
    print(f"# {dev.describe()}  torch {torch.__version__}")
    scale = 512 ** -0.5
    print("\n## sparse MQA decode (q bf16, fp8_ds_mla pages of 153 MB per cache, SWA 128 + extra, sink); "
          "µs per call, CUDA-graph replay, median of 7")
    print("| case | T | FlashMLA µs | reference µs | ratio | rel err FlashMLA vs reference |")
    print("|---|---|---|---|---|---|")
    for label, H, eb, ew in (("Flash c4a: h64, 128+512", 64, 64, 512), ("Pro c4a: h128, 128+1024", 128, 64, 1024),
                             ("Flash swa: h64, 128", 64, None, 0)):
        for T in (1, 32, 128):
            q, kv, sink = sparse_case(T, H, extra_block=eb, extra_w=ew, seed=T, swa_blocks=POOL_BLOCKS,
                                      extra_blocks=POOL_BLOCKS)
            fm, ref = FlashMLASparse(), ReferenceMQA(chunk=128)
            prep = fm.prepare(device=dev)
            out, _ = fm(q, kv, sink=sink, scale=scale, prepared=prep)
            r, _ = ref(q, kv, sink=sink, scale=scale)
            t_fm = graph_time_us(lambda: fm(q, kv, sink=sink, scale=scale, prepared=prep))
            t_ref = graph_time_us(lambda: ref(q, kv, sink=sink, scale=scale), calls=5, repeats=5)
            print(f"| {label} | {T} | {t_fm:.1f} | {t_ref:.1f} | {t_ref / t_fm:.1f}x | {rel_err(out, r):.1e} |")
    print("\n## prefill-sized steps: decode kernel vs bf16 gather + flash_mla_sparse_fwd (h64, 128+512); µs")
    print("| T | decode kernel µs | gather+sparse_fwd µs (eager, incl. unique/gather) |")
    print("|---|---|---|")
    for T in (256, 1024, 4096):
        q, kv, sink = sparse_case(T, 64, extra_block=64, extra_w=512, seed=T, swa_blocks=POOL_BLOCKS,
                                  extra_blocks=POOL_BLOCKS)
        fm, fg = FlashMLASparse(), FlashMLASparse(prefill_gather_min_tokens=1)
        prep = fm.prepare(device=dev)
        t_dec = graph_time_us(lambda: fm(q, kv, sink=sink, scale=scale, prepared=prep), calls=5)
        ev = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fg(q, kv, sink=sink, scale=scale, prepared=prep)
            b.record()
            torch.cuda.synchronize()
            ev.append(a.elapsed_time(b) * 1e3)
        print(f"| {T} | {t_dec:.1f} | {statistics.median(ev):.1f} |")
    print("\n## o_proj (inverse RoPE + wo_a grouped), Flash shapes G=8, 4096 -> 1024 per group; µs")
    print("| T | deepgemm_fp8 | torch_fp8 | reference bf16 | rel err deepgemm vs f32 reference |")
    print("|---|---|---|---|---|")
    rope = Rope.for_layer(tiny_spec(), 4)
    for T in (1, 128, 4096):
        w, o, pos = oproj_case(T, 8)
        rot = rope.at(pos)
        row = [str(T)]
        outs = {}
        for strat in (DeepGemmFp8OProj(), TorchFp8OProj(), ReferenceOProj()):
            try:
                prep = strat.prepare(w, device=dev, dtype="bfloat16")
                outs[strat.name] = strat(o, rot, prepared=prep)
                row.append(f"{graph_time_us(lambda: strat(o, rot, prepared=prep)):.1f}")
            except Exception as e:  # noqa: BLE001 - report the cell, keep benchmarking the others
                row.append(f"failed: {type(e).__name__}")
                print(f"  {strat.name}: {e}", file=sys.stderr)
        f32 = ReferenceOProj()
        y32 = f32(o.float(), rot, prepared=f32.prepare(w, device=dev, dtype="float32"))
        row.append(f"{rel_err(outs['deepgemm_fp8'], y32):.1e}" if "deepgemm_fp8" in outs else "-")
        print("| " + " | ".join(row) + " |")
    oproj_breakdown(dev)


def oproj_breakdown(dev) -> None:
    """Where o_proj's time goes: the (unfused, torch-op) inverse-RoPE + fp8 quantization prologue, the
    grouped wo_a product alone in each precision."""
    import deep_gemm

    from dsv4.strategies.o_proj.fp8_common import fused_inverse_rope_fp8_quant, inverse_rope_fp8_quant
    from dsv4.strategies.linear.common import blockwise_scaled_mm

    rope = Rope.for_layer(tiny_spec(), 4)
    print("\n## o_proj breakdown, G=8 (µs): prologue = inverse RoPE + per-128 fp8 quant")
    print("| T | prologue, torch ops | prologue, Triton fused (GB/s) | wo_a DeepGEMM fp8_einsum | "
          "wo_a torch_fp8 (8 scaled_mm) | wo_a bf16 torch.einsum |")
    print("|---|---|---|---|---|---|")
    for T in (1, 128, 4096):
        w, o, pos = oproj_case(T, 8)
        rot = rope.at(pos)
        dg = DeepGemmFp8OProj().prepare(w, device=dev, dtype="bfloat16")
        x, xs = inverse_rope_fp8_quant(o, rot, 8)
        wq, ws = dg.weight, dg.scale
        z = torch.empty(T, 8, 1024, dtype=torch.bfloat16, device="cuda")
        og = o.view(T, 8, -1)
        wa = w.wo_a.cuda().bfloat16().view(8, 1024, -1)
        fused = graph_time_us(lambda: fused_inverse_rope_fp8_quant(o, rot, 8))
        moved = o.numel() * 2 + o.numel() + o.numel() // 128 * 4          # bf16 in, e4m3 out, scales out
        cells = [graph_time_us(lambda: inverse_rope_fp8_quant(o, rot, 8)),
                 f"{fused:.1f} ({moved / fused / 1e3:.0f})",
                 graph_time_us(lambda: deep_gemm.fp8_einsum("bhr,hdr->bhd", (x, xs), (wq, ws), z,
                                                            recipe=dg.recipe)),
                 graph_time_us(lambda: [blockwise_scaled_mm(x[:, g].contiguous(), xs[:, g], wq[g], ws[g])
                                        for g in range(8)]),
                 graph_time_us(lambda: torch.einsum("tgd,grd->tgr", og, wa))]
        print(f"| {T} | " + " | ".join(c if isinstance(c, str) else f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
