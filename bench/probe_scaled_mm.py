"""Which block-scaled layouts torch._scaled_mm accepts on this GPU (for o_proj=torch_fp8)."""
import torch

from dsv4.strategies.fp8_oproj import blockwise_scaled_mm, quantize_weight_blocks

torch.manual_seed(0)
M, N, K = 64, 1024, 4096
a = torch.randn(M, K, device="cuda")
w = torch.randn(N, K, device="cuda") / K ** 0.5
ab = a.unflatten(-1, (-1, 128))
sa = torch.exp2(torch.ceil(torch.log2(ab.abs().amax(-1) / 448)))
aq = (ab / sa[..., None]).to(torch.float8_e4m3fn).flatten(-2)
wq, ws = quantize_weight_blocks(w[None])
wq, ws = wq[0], ws[0]
ref = (aq.float().unflatten(-1, (-1, 128)) * sa[..., None]).flatten(-2) @ \
      (wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
variants = {
    "ours": lambda: blockwise_scaled_mm(aq, sa, wq, ws),
    "sa rowmajor, sw.t()": lambda: torch._scaled_mm(aq, wq.t(), scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16),
    "sa M-major, sw": lambda: torch._scaled_mm(aq, wq.t(), scale_a=sa.t().contiguous().t(), scale_b=ws,
                                               out_dtype=torch.bfloat16),
    "sa M-major, sw.t().contiguous()": lambda: torch._scaled_mm(aq, wq.t(), scale_a=sa.t().contiguous().t(),
                                                                scale_b=ws.t().contiguous(), out_dtype=torch.bfloat16),
}
for name, fn in variants.items():
    try:
        out = fn()
        print(f"{name:34s} ok  rel err {float((out.float() - ref).norm() / ref.norm()):.2e}")
    except Exception as e:   # noqa: BLE001 - a probe reports every variant
        print(f"{name:34s} FAILED {type(e).__name__}: {str(e)[:300]}")
