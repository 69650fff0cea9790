"""What one launch costs the host on this machine: an eager layer step is bound by it
(docs/notes/2026-12-02-eager-host-time.md).
Median host µs per call, called back to back, of a one-argument Triton kernel (Triton's launch and ours),
one of the layer's Triton launchers, small torch ops and bf16 GEMMs of a decode step's size.

  python bench/host_overhead.py
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv4.speed.gpu import require_gpu


def tiny_kernel():
    """A Triton kernel of one pointer and one int (Triton imported here: only once the GPU is known)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _tiny(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, i, mask=i < n)

    return _tiny


def host_us(fn, calls: int = 200, repeats: int = 5) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_gpu("bench/host_overhead.py")
    from dsv4.kernels.launch import launch
    from dsv4.kernels.front.layer_front import kv_rows_kernel

    _tiny = tiny_kernel()
    dev = "cuda"
    x = torch.zeros(1024, dtype=torch.int32, device=dev)
    bad = torch.zeros(128, dtype=torch.bool, device=dev)
    slots = torch.arange(128, dtype=torch.int32, device=dev)
    a = torch.randn(128, 4096, device=dev).bfloat16()
    w = torch.randn(1024, 4096, device=dev).bfloat16()
    kv = torch.randn(128, 512, device=dev).bfloat16()
    norm, cs = torch.ones(512, device=dev), torch.ones(128, 32, device=dev)
    faults = torch.zeros(3, 128, dtype=torch.bool, device=dev)
    cases = {"Triton kernel of one pointer and one int, kernel[grid](...)": lambda: _tiny[(1,)](x, 100, BLOCK=1024),
             "the same through dsv4.kernels.launch": lambda: launch(_tiny, (1,), x, 100, BLOCK=1024),
             "kv_rows_kernel (the layer's KV-row launcher)": lambda: kv_rows_kernel(kv, norm, cs, cs, slots, faults,
                                                                                    eps=1e-6, dtype=torch.bfloat16),
             "torch.where(bool, -1, int32)": lambda: torch.where(bad, -1, slots),
             "torch.add(int32, 1)": lambda: torch.add(slots, 1),
             "torch.empty": lambda: torch.empty(128, 512, device=dev),
             "bf16 [128, 4096] @ [4096, 1024]": lambda: a @ w.T,
             "the same, float32 out (torch.mm out_dtype)": lambda: torch.mm(a, w.T, out_dtype=torch.float32)}
    for name, fn in cases.items():
        print(f"{host_us(fn):8.1f} µs  {name}")


if __name__ == "__main__":
    main()
