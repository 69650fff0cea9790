"""Which row counts torch._scaled_mm's block-scaled fp8 matmul accepts on this GPU (o_proj=torch_fp8)."""
import argparse

import torch

from dsv4.speed.gpu import require_gpu
from dsv4.oracle import rel_err
from dsv4.strategies.linear.common import blockwise_scaled_mm
from dsv4.strategies.o_proj.fp8_common import pow2_scale, quantize_weight_blocks


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    require_gpu("bench/probe_scaled_mm.py")
    torch.manual_seed(0)
    N, K = 1024, 4096
    w = torch.randn(N, K, device="cuda") / K ** 0.5
    wq, ws = quantize_weight_blocks(w[None])
    wq, ws = wq[0], ws[0]
    for M in (1, 8, 16, 24, 32, 33, 48, 64, 96, 128, 256):
        a = torch.randn(M, K, device="cuda")
        ab = a.unflatten(-1, (-1, 128))
        sa = pow2_scale(ab.abs().amax(-1), 1e-10)
        aq = (ab / sa[..., None]).to(torch.float8_e4m3fn).flatten(-2)
        ref = (aq.float().unflatten(-1, (-1, 128)) * sa[..., None]).flatten(-2) @ \
              (wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
        try:
            raw = torch._scaled_mm(aq, wq.t(), scale_a=sa.t().contiguous().t(), scale_b=ws.t(),
                                   out_dtype=torch.bfloat16)
            raw_s = f"raw ok ({rel_err(raw, ref):.1e})"
        except Exception as e:  # noqa: BLE001 - a probe reports every case
            raw_s = f"raw FAILED {type(e).__name__}"
        out = blockwise_scaled_mm(aq, sa, wq, ws)
        print(f"M={M:4d}  {raw_s:28s} padded: rel err {rel_err(out, ref):.1e}")


if __name__ == "__main__":
    main()
