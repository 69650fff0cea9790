"""The lightning indexer of ratio-4 layers (DSV4_SPEC §2.5): exact float32 scores, causal top-k, batched
over every token of a step.

score[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j), w = weights_proj(x) · Di^-½ · Hi^-½, over the compressed
entries j < (p+1)//4 of the token's request (its keys on the ratio-4 entry pages). The selection is the
local entry indices of the top min(K, visible) scores, -1 padded to K, best first (so the valid ones
come first and their count is the list's length); its order carries no meaning beyond that.
(Quantized fp8/fp4 scoring and the Hadamard rotation only change rounding; they are not done here.)

Scores are one call over the step (our Triton kernel on a GPU, dsv4/kernels/indexer_logits.py; torch
here, which is the CPU path and the kernel's reference) and the top-k one `torch.topk`.
"""
from __future__ import annotations

TOKENS_PER_READ = 64        # the torch path gathers keys for this many tokens at a time


class Indexer:
    def __init__(self, *, wq_b, weights_proj, compressor, n_heads: int, head_dim: int, topk: int,
                 exact_scores: bool = True) -> None:
        self.wq_b, self.weights_proj, self.compressor = wq_b.float(), weights_proj.float(), compressor
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        # False with bf16 activations: the queries already carry bf16 rounding (2^-9), so the GPU kernel's
        # scores take one tf32 product (2^-11) instead of float32-exact tf32x3 (three)
        self.exact_scores = exact_scores

    @property
    def weight_scale(self) -> float:
        return self.head_dim ** -0.5 * self.n_heads ** -0.5

    def queries(self, q_raw, rot):
        """q_raw [T, Hi·Di] float32 (qr @ wq_bᵀ) -> q [T, Hi, Di] float32, RoPE on the last 64 dims."""
        from dsv4.components.front import rotate_rows

        return rotate_rows(q_raw.view(-1, self.n_heads, self.head_dim), rot)

    def scores(self, q, w, keys, plan):
        """[T, width] float32 scores of every entry slot of each token's request; -inf where not visible
        (j >= count). q [T, Hi, Di], w [T, Hi] (already scaled), keys: the PagedCache of indexer keys."""
        ents = plan.entries[4]
        if q.is_cuda:
            from dsv4.kernels.indexer_logits import indexer_logits
            return indexer_logits(q, w, keys, ents.table.pages, plan.token_request, ents.counts, width=ents.width,
                                  exact=self.exact_scores)
        import torch

        T, width = q.shape[0], ents.width
        cols = torch.arange(width, device=q.device, dtype=torch.int32)[None, :]
        out = torch.full((T, width), float("-inf"), dtype=torch.float32, device=q.device)
        for t0 in range(0, T, TOKENS_PER_READ):
            sl = slice(t0, t0 + TOKENS_PER_READ)
            visible = cols < ents.counts[sl, None]
            slots = ents.table.slots(plan.token_request[sl], torch.where(visible, cols, torch.full_like(cols, -1)))
            k = keys.read(slots)                                                     # [t, width, Di]
            logits = (torch.einsum("thd,tnd->thn", q[sl], k).relu() * w[sl, :, None]).sum(1)
            out[sl] = logits.masked_fill(~visible, float("-inf"))
        return out

    def lists(self, scores, plan):
        """The selection as the MQA kernel reads it: (local indices [T, K] int32 as `select` gives them,
        their global slots [T, K] int32 through each token's table, -1 padded, and how many are valid
        [T] int32). On a GPU: torch.topk, then one kernel (dsv4/kernels/topk_lists.py)."""
        import torch

        ents = plan.entries[4]
        if scores.is_cuda:
            from dsv4.kernels.topk_lists import topk_lists_kernel
            val, idx = scores.topk(min(self.topk, scores.shape[1]), dim=-1)
            return topk_lists_kernel(val, idx, ents.table.pages, plan.token_request, topk=self.topk,
                                     block_size=ents.table.block_size)
        local = self.select(scores)
        return local, ents.table.slots(plan.token_request, local), (local >= 0).sum(1, dtype=torch.int32)

    def select(self, scores):
        """Local indices [T, K] int32 of the top min(K, visible) entries, best first, -1 padded."""
        import torch

        T, n = scores.shape
        k = min(self.topk, n)
        out = torch.full((T, self.topk), -1, dtype=torch.int32, device=scores.device)
        if k:
            val, idx = scores.topk(k, dim=-1)
            out[:, :k] = torch.where(torch.isinf(val), -1, idx).to(torch.int32)
        return out
