"""`mode=bench`'s kernel tables: every sparse MQA kernel and output projection this machine runs, side by
side in one process, on the same inputs."""
from __future__ import annotations

from dsv4.speed.cases import (DECODE_CASES, POOL_BLOCKS, SMALL_CASES, available_options, oproj_case, pad_heads,
                                sparse_case)
from dsv4.speed.timing import CEILINGS, graph_time_us
from dsv4.oracle import rel_err
from dsv4.reports.report import table
from dsv4.speed.rows import printed_rows

MQA_HEADERS = ["case", "b", "s_q", "mqa_kernel", "µs", "TFLOP/s", "GB/s", "of bf16 peak", "of copy BW", "time / first",
               "rel err vs first"]
O_PROJ_HEADERS = ["T", "o_proj", "µs", "time / first", "rel err vs first"]
LINEAR_HEADERS = ["product", "M", "N", "K", "linear", "µs", "GB/s", "TFLOP/s", "time / first", "rel err vs fp8_sim"]


def bench_mqa(job, *, record=None) -> str:
    """Every sparse MQA kernel on DECODE_CASES and SMALL_CASES; `record` (dsv4/speed/rows.py) takes the rows."""
    from dataclasses import replace

    kernels = available_options(job, "mqa_kernel")
    # on sm90, where auto runs the one-pass Hopper kernel, triton_sparse's two-pass kernel beside it
    if job.device.arch == "sm90":
        kernels += [replace(k, variant="two_pass") for k in kernels if getattr(k, "variant", None) == "auto"]
    ceil = CEILINGS.get(job.device.arch, {})
    rows = []
    for label, H, eb, ew, b, sq in DECODE_CASES + SMALL_CASES:
        T = b * sq
        q, kv, sink = sparse_case(T, H, extra_block=eb, extra_w=ew, seed=T + H, swa_blocks=POOL_BLOCKS,
                                  extra_blocks=POOL_BLOCKS, full=True)
        n = 128 + ew
        flops, nbytes = 2 * T * H * n * 1024, T * (n * 584 + 2 * H * 512 * 2)
        ref_out = None
        base = None
        for k in kernels:
            name = k.name if getattr(k, "variant", "auto") == "auto" else f"{k.name} ({k.variant})"
            # a kernel that takes only some head counts runs at the smallest that holds H, zero heads added
            widths = sorted(w for w in k.needs(job.device).padded_heads if w >= H)
            qk, sk = pad_heads(q, sink, widths[0]) if widths and H not in widths else (q, sink)
            if qk is not q:
                name += f" (padded to {qk.shape[1]})"
            prep = k.prepare(device=job.device)
            # as the layers after the first of a type in a step call it: the step's plan made by the first
            # call and reused (FlashMLA's tile-scheduler metadata and padded lists), the kernel alone timed
            plan = k.plan(tokens=T, layer_type=kv.layer_type)
            out = k(qk, kv, sink=sk, scale=512 ** -0.5, prepared=prep, plan=plan)[0][:, :H]
            ref_out = out if ref_out is None else ref_out
            us = graph_time_us(lambda: k(qk, kv, sink=sk, scale=512 ** -0.5, prepared=prep, plan=plan),
                               calls=20 if k.name != "reference" else 3, repeats=7 if k.name != "reference" else 3)
            base = base or us
            tf, gb = flops / us / 1e6, nbytes / us / 1e3
            rows.append([label, b, sq, name, f"{us:.1f}", f"{tf:.0f}", f"{gb:.0f}",
                         f"{tf / ceil['tflops']:.0%}" if ceil else "-", f"{gb / ceil['gbps']:.0%}" if ceil else "-",
                         f"{us / base:.2f}", f"{rel_err(out, ref_out):.1e}"])
    if record is not None:
        record(printed_rows("bench/mqa", MQA_HEADERS, rows, keys=4, unit=None))
    return table(MQA_HEADERS, rows)


def bench_o_proj(job, *, record=None) -> str:
    """Every o_proj option at 1, 128 and 4096 tokens; `record` (dsv4/speed/rows.py) takes the rows."""
    from dsv4.components.rope import Rope

    strategies = available_options(job, "o_proj")
    rope = Rope.for_layer(job.spec, 4)
    rows = []
    for T in (1, 128, 4096):
        w, o, pos = oproj_case(T, 8)
        rot = rope.at(pos)
        base = ref = None
        for s in strategies:
            prep = s.prepare(w, device=job.device, dtype="bfloat16")
            y = s(o, rot, prepared=prep)
            ref = y if ref is None else ref
            us = graph_time_us(lambda: s(o, rot, prepared=prep))
            base = base or us
            rows.append([T, s.name, f"{us:.1f}", f"{us / base:.2f}", f"{rel_err(y, ref):.1e}"])
    if record is not None:
        record(printed_rows("bench/o_proj", O_PROJ_HEADERS, rows, keys=2, unit=None))
    return table(O_PROJ_HEADERS, rows)


def layer_products(spec, tp_size: int = 1) -> dict[str, tuple[int, int]]:
    """The dense products a ratio-4 layer runs through `linear`, as (N, K) on one rank: x by [wq_a|wkv],
    the q_lora row by [wq_b|indexer wq_b], z by wo_b."""
    p = spec.projections(tp_size)
    return {"x @ [wq_a|wkv]": (p["wq_a"][0] + p["wkv"][0], spec.hidden_size),
            "qr @ [wq_b|indexer wq_b]": (p["wq_b"][0] + p.get("indexer.wq_b", (0, 0))[0], spec.q_lora_rank),
            "z @ wo_b": p["wo_b"]}


def bench_linear(job, rows=(1, 64, 128, 8192), *, record=None) -> str:
    """Every `linear` option this machine runs on the layer's products, random bf16 activations and weights
    made in the checkpoint's fp8 format, each timed in a CUDA graph (back-to-back calls: weights that fit
    in L2 stay there, as in a replayed layer) beside the bf16 product (linear=reference); the error of each
    against fp8_sim, the published numerics in torch (not timed). `record` (dsv4/speed/rows.py) takes the rows."""
    import torch

    from dsv4.formats.fp8_blocks import LinearNumerics, quantize_blocks
    from dsv4.strategies import Fp8SimLinear, LinearWeight

    opts = [o for o in available_options(job, "linear") if o.name != "fp8_sim"]
    sim = Fp8SimLinear()
    out = []
    g = torch.Generator().manual_seed(0)
    for product, (N, K) in layer_products(job.spec, job.combo.tp_size).items():
        w = torch.randn(N, K, generator=g) * K ** -0.5
        weight = LinearWeight(values=w, fp8=quantize_blocks(w))
        fp8_bytes = N * K + N * K // 128 // 128 * 4
        for M in rows:
            x = torch.randn(M, K, generator=g).to(device="cuda", dtype=torch.bfloat16)
            want = sim(x, sim.prepare(weight, device=job.device, dtype="bfloat16"))
            base = None
            for opt in opts:
                prep = opt.prepare(weight, device=job.device, dtype="bfloat16")
                y = opt(x, prep)
                us = graph_time_us(lambda: opt(x, prep))
                base = base or us
                fp8 = opt.numerics is LinearNumerics.FP8
                nbytes = (fp8_bytes if fp8 else 2 * N * K) + 2 * M * (K + N)
                out.append([product, M, N, K, opt.name, f"{us:.1f}", f"{nbytes / us / 1e3:.0f}",
                            f"{2 * M * N * K / us / 1e6:.0f}", f"{us / base:.2f}", f"{rel_err(y, want):.1e}"])
    if record is not None:
        record(printed_rows("bench/linear", LINEAR_HEADERS, out, keys=5, unit=None))
    return table(LINEAR_HEADERS, out)
