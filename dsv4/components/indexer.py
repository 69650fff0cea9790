"""The lightning indexer of ratio-4 layers (docs/numerics.md §2.5): scores over the request's keys, causal top-k,
batched over every token of a step.

score[t, j] = Σ_h w[t,h] · ReLU(q[t,h] · k_j), w = weights_proj(x) · Di^-½ · Hi^-½, over the compressed
entries j < (p+1)//4 of the token's request (its keys on the ratio-4 entry pages), accumulated in float32.
The keys are stored as the `indexer` option says (its `key_layout`: rows in the activation dtype, packed
FP4 records or fp8 records) and the queries are rounded to their dtype before the product (`score_dtype`):
exact float32 for float32 keys, a bf16 product for bf16 keys and records (the published code's). The
selection is the local entry indices of the top min(K, visible) scores, -1 padded to K, the valid ones
first (so their count is the list's length); their order carries no meaning.
What the queries and keys are before they are scored and stored is the `indexer` strategy's
(`strategy.numerics`, dsv4/strategies/indexer/): as computed (`exact`), or Hadamard-rotated and FP4-simulated
as the published code trains and runs them (`fp4_sim`).

Scores are one call over the step and the top-k another: torch here, which is the CPU path and the kernels'
specification; on a GPU the layer's Triton ops (dsv4/components/layer_ops.py, chosen once when the layer is
built) call the strategy's scoring kernel (ours, dsv4/kernels/indexer/indexer_logits.py, or DeepGEMM's) and its
`top_k` (ours, dsv4/kernels/indexer/topk_lists.py, or FlashInfer's) instead, with its per-step `plan`.
"""
from __future__ import annotations

from dsv4.components.compressor import CompressPart
from dsv4.components.front import rotate_rows
from dsv4.values.fixed_order import KEY_BLOCK, asked, pad_keys, stable_top
from dsv4.formats.indexer_numerics import IndexerNumerics
from dsv4.values.layer_types import INDEXED
from dsv4.strategies.protocols import IndexerStrategy

TOKENS_PER_READ = 64        # the torch path gathers keys for this many tokens at a time, at most,
READ_ELEMENTS = 2 ** 22     # and at most this many key values (16 MiB in float32): a step's memory stays
                            # bounded however long its requests' histories


class Indexer:
    def __init__(self, *, wq_b, weights_proj, compressor, n_heads: int, head_dim: int, topk: int,
                 strategy: IndexerStrategy, device=None, batch_invariant: bool = False) -> None:
        """`strategy`: the `indexer` option; `batch_invariant`: the torch path scores keys in fixed blocks and
        selects among equal scores the lower index first, and the strategy is prepared for it (its kernels'
        fixed launches), so that a token's scores and selection do not depend on the rest of its step."""
        self.wq_b, self.weights_proj, self.compressor = wq_b.float(), weights_proj.float(), compressor
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.batch_invariant = batch_invariant
        self.strategy = strategy
        self.prepared = self.strategy.prepare(head_dim=head_dim, device=device or wq_b.device,
                                              **asked(batch_invariant))

    @property
    def weight_scale(self) -> float:
        return self.head_dim ** -0.5 * self.n_heads ** -0.5

    def queries(self, q_raw, rot, dtype=None, *, rotate=rotate_rows):
        """q_raw [T, Hi·Di] float32 (qr @ wq_bᵀ) -> q [T, Hi, Di], RoPE on the last 64 dims in float32
        (`rotate`: the layer's ops' rotate_rows, by default the torch code's), then the strategy's numerics,
        in `dtype` (the keys' dtype, to which `scores` rounds them; float32 if None)."""
        q = q_raw.view(-1, self.n_heads, self.head_dim)
        if self.strategy.numerics is IndexerNumerics.EXACT:
            return rotate(q, rot, dtype)
        q = self.strategy.numerics.apply(rotate(q, rot))
        return q if dtype is None else q.to(dtype)

    @staticmethod
    def score_dtype(keys):
        """The dtype the queries are rounded to before they are scored against `keys` (a PagedCache): the
        keys' own, or bf16 for FP4 and fp8 records (uint8 pages; their values are bf16 values)."""
        import torch

        return torch.bfloat16 if keys.data.dtype == torch.uint8 else keys.data.dtype

    def key_part(self, scores, state, fault_row: int, cache):
        """Its compressor's part of the layer's compress step (`compressor.compress_all`), its keys taking
        the strategy's numerics."""
        return CompressPart(self.compressor, scores, state, fault_row, cache, numerics=self.strategy.numerics)

    def scores(self, q, w, keys, plan):
        """[T, width] float32 scores of every entry slot of each token's request; -inf where not visible
        (j >= count). q [T, Hi, Di] float32 (rounded here to the keys' dtype) or already in it, w [T, Hi]
        float32 the head weights (weights_proj's output, scaled here by `weight_scale`), keys: the PagedCache
        of indexer keys. (The Triton ops' strategy kernel may leave the invisible ones unwritten and its rows
        wider than `width`: `lists` reads the visible ones only.)"""
        import torch

        ents = plan.entries[INDEXED.ratio]
        q = q.to(self.score_dtype(keys)).float()
        w = w * self.weight_scale

        T, width = q.shape[0], ents.width
        cols = torch.arange(width, device=q.device, dtype=torch.int32)[None, :]
        out = torch.full((T, width), float("-inf"), dtype=torch.float32, device=q.device)
        per_read = max(1, min(TOKENS_PER_READ, READ_ELEMENTS // max(1, width * self.head_dim)))
        for t0 in range(0, T, per_read):
            sl = slice(t0, t0 + per_read)
            visible = cols < ents.counts[sl, None]
            slots = ents.table.slots(plan.token_request[sl], torch.where(visible, cols, torch.full_like(cols, -1)))
            k = keys.read(slots)                                                     # [t, width, Di]
            if self.batch_invariant:            # products of fixed shape: blocks of KEY_BLOCK keys
                k = pad_keys(k, 1)
                dots = torch.cat([torch.einsum("thd,tnd->thn", q[sl], k[:, j:j + KEY_BLOCK])
                                  for j in range(0, k.shape[1], KEY_BLOCK)], -1)[..., :width]
            else:
                dots = torch.einsum("thd,tnd->thn", q[sl], k)
            logits = (dots.relu() * w[sl, :, None]).sum(1)
            out[sl] = logits.masked_fill(~visible, float("-inf"))
        return out

    def lists(self, scores, plan):
        """The selection as the MQA kernel reads it: (local indices [T, K] int32 as `select` gives them,
        their global slots [T, K] int32 through each token's table, -1 padded, and how many are valid
        [T] int32). (The Triton ops' strategy `top_k`, dsv4/strategies/indexer/top_k/: our radix select, valid
        entries in index order, or FlashInfer's, where `select` gives them best first.)"""
        import torch

        ents = plan.entries[INDEXED.ratio]
        local = self.select(scores)
        return local, ents.table.slots(plan.token_request, local), (local >= 0).sum(1, dtype=torch.int32)

    def select(self, scores):
        """Local indices [T, K] int32 of the top min(K, visible) entries, best first, -1 padded."""
        import torch

        T, n = scores.shape
        k = min(self.topk, n)
        out = torch.full((T, self.topk), -1, dtype=torch.int32, device=scores.device)
        if k:
            val, idx = stable_top(scores, k) if self.batch_invariant else scores.topk(k, dim=-1)
            out[:, :k] = torch.where(torch.isinf(val), -1, idx).to(torch.int32)
        return out
