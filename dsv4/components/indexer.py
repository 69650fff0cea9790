"""The lightning indexer of ratio-4 layers (DSV4_SPEC §2.5): exact float32 scores, causal top-k.

score[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j), w = weights_proj(x) · Di^-½ · Hi^-½, over the
compressed entries j < (p+1)//4 visible to the token at position p. The result is the local entry
indices of the top min(K, n_visible) scores, -1 padded to K; their order does not matter.
(Quantized fp8/fp4 scoring and the Hadamard rotation only change rounding; they are not done here.)
"""
from __future__ import annotations


class Indexer:
    def __init__(self, *, wq_b, weights_proj, compressor, n_heads: int, head_dim: int, topk: int,
                 rope) -> None:
        self.wq_b, self.weights_proj, self.compressor = wq_b.float(), weights_proj.float(), compressor
        self.n_heads, self.head_dim, self.topk, self.rope = n_heads, head_dim, topk, rope

    def queries(self, x, qr, positions):
        """q [T, Hi, Di] (RoPE'd) and head weights w [T, Hi], float32."""
        q = (qr.float() @ self.wq_b.T).view(-1, self.n_heads, self.head_dim)
        q = self.rope.apply(q, positions)
        w = (x.float() @ self.weights_proj.T) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, w

    def scores(self, q, w, keys, positions):
        """[T, n] float32; entries not yet visible to a token are -inf."""
        import torch

        logits = (torch.einsum("thd,nd->thn", q, keys.float()).relu() * w[..., None]).sum(1)
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] < ((positions + 1) // 4)[:, None]
        return logits.masked_fill(~visible, float("-inf"))

    def select(self, scores):
        """Local indices [T, K] int32 of the top min(K, visible) entries, -1 padded."""
        import torch

        T, n = scores.shape
        k = min(self.topk, n)
        out = torch.full((T, self.topk), -1, dtype=torch.int32, device=scores.device)
        if k:
            val, idx = scores.topk(k, dim=-1)
            out[:, :k] = torch.where(torch.isinf(val), -1, idx).to(torch.int32)
        return out
