"""DSV4Attention: the one concrete attention module, for one tensor-parallel rank.

It is assembled from injected pieces (keyword-only) and contains no platform branches: the sparse
MQA kernel, the output projection, the head padding and the cache layout are strategies; the device
only decides where tensors live. Forward follows DSV4_SPEC §2.2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsv4.components.kv_pool import LayerKV, StepMeta
from dsv4.components.norms import rms_norm
from dsv4.spec import LAYER_TYPES
from dsv4.strategies.protocols import SparseKV


@dataclass(slots=True)
class LayerStepResult:
    out: Any                    # [T, hidden]: this rank's partial sum of the layer output
    topk: Any | None            # [T, index_topk] int32 local compressed indices (ratio-4 layers)
    states: dict                # (rid, compressor name) -> new state, committed by the engine


class DSV4Attention(torch.nn.Module):
    def __init__(self, *, spec, layer: int, ratio: int, heads: int, padded_heads: int, weights: dict, rope,
                 compressor=None, indexer=None, mqa_kernel, mqa_prepared=None, o_proj, o_proj_prepared,
                 dtype, device: str) -> None:
        super().__init__()
        if padded_heads < heads:
            raise ValueError(f"padded_heads ({padded_heads}) < heads ({heads})")
        if (compressor is None) != (ratio == 1) or (indexer is None) != (ratio != 4):
            raise ValueError(f"ratio {ratio}: a compressor iff ratio > 1, an indexer iff ratio == 4")
        self.spec, self.layer, self.ratio, self.heads, self.padded_heads = spec, layer, ratio, heads, padded_heads
        self.rope, self.compressor, self.indexer = rope, compressor, indexer
        self.mqa_kernel, self.o_proj, self.o_proj_prepared = mqa_kernel, o_proj, o_proj_prepared
        self.mqa_prepared = mqa_prepared
        self.dtype, self.eps = dtype, spec.rms_norm_eps
        for name in ("wq_a.weight", "wkv.weight", "wq_b.weight"):
            self.register_buffer(name.split(".")[0], weights[name].to(device=device, dtype=dtype))
        for name in ("q_norm.weight", "kv_norm.weight"):
            self.register_buffer(name.split(".")[0], weights[name].to(device=device, dtype=torch.float32))
        sink = torch.full((padded_heads,), float("-inf"), device=device)    # padded heads: no effect
        sink[:heads] = weights["attn_sink"].to(device)
        self.register_buffer("attn_sink", sink)

    def forward(self, x, meta: StepMeta, kv: LayerKV) -> LayerStepResult:
        T, D, H = x.shape[0], self.spec.head_dim, self.heads
        pos = meta.positions
        xa = x.to(self.dtype)
        qr = rms_norm(xa @ self.wq_a.T, self.q_norm, self.eps).to(self.dtype)
        latent = rms_norm(xa @ self.wkv.T, self.kv_norm, self.eps).to(self.dtype)
        q = (qr @ self.wq_b.T).view(T, H, D)
        q = self.rope.apply(rms_norm(q, None, self.eps).to(self.dtype), pos).to(self.dtype)

        def token(i: int) -> str:          # names row i in an error (only built when one is raised)
            seg = meta.segments[int(meta.segment_of_token[i])]
            return f"layer {self.layer}, request {seg.rid!r}, position {int(pos[i])}"
        kv.caches["swa"].write(kv.swa_write_slots(meta), self.rope.apply(latent, pos), where=token)

        states: dict = {}
        topk = extra = None
        if self.compressor is not None:
            self._compress(x, meta, kv, self.compressor, "compressed", states)
            if self.indexer is not None:
                self._compress(x, meta, kv, self.indexer.compressor, "indexer", states)
                topk = self._select(x, qr, meta, kv)
                local = topk.long()
            else:
                n_c = (pos + 1) // self.ratio
                width = max(1, int(n_c.max()))
                local = torch.arange(width, device=pos.device)[None, :].expand(T, width)
                local = torch.where(local < n_c[:, None], local, torch.full_like(local, -1))
            extra = (kv.caches["compressed"], kv.global_slots("compressed", meta, local),
                     (local >= 0).sum(1).to(torch.int32))

        swa_idx, swa_lens = kv.swa_indices(meta)
        sparse = SparseKV(swa=kv.caches["swa"], swa_indices=swa_idx, swa_lens=swa_lens,
                          extra=extra[0] if extra else None, extra_indices=extra[1] if extra else None,
                          extra_lens=extra[2] if extra else None, layer_type=LAYER_TYPES[self.ratio],
                          scratch=meta.scratch)
        qp = q if self.padded_heads == H else torch.cat((q, q.new_zeros(T, self.padded_heads - H, D)), 1)
        out, _lse = self.mqa_kernel(qp, sparse, sink=self.attn_sink, scale=self.spec.softmax_scale,
                                    prepared=self.mqa_prepared)
        y = self.o_proj(out[:, :H], pos, rope=self.rope, prepared=self.o_proj_prepared)
        return LayerStepResult(out=y, topk=topk, states=states)

    def _compress(self, x, meta: StepMeta, kv: LayerKV, comp, cache: str, states: dict) -> None:
        """Run a compressor over each request's tokens; write closed entries to `cache`."""
        for seg in meta.segments:
            state = kv.requests[seg.rid].states.get(cache) or comp.new_state(x.device)
            ids, vals, states[(seg.rid, cache)] = comp.step(x[seg.rows], seg.start, state)
            if len(ids):
                slots = kv.request_rows(cache, seg.rid, int(ids[-1]) + 1)[ids]
                kv.caches[cache].write(slots, vals, where=lambda i, seg=seg, ids=ids: (
                    f"layer {self.layer}, request {seg.rid!r}, {cache} entry {int(ids[i])} closed at position "
                    f"{(int(ids[i]) + 1) * self.ratio - 1}"))

    def _select(self, x, qr, meta: StepMeta, kv: LayerKV):
        q, w = self.indexer.queries(x, qr, meta.positions)
        topk = torch.full((x.shape[0], self.indexer.topk), -1, dtype=torch.int32, device=x.device)
        for seg in meta.segments:
            n = (seg.start + seg.count) // 4
            keys = kv.caches["indexer"].read(kv.request_rows("indexer", seg.rid, n))
            r = seg.rows
            topk[r] = self.indexer.select(self.indexer.scores(q[r], w[r], keys, meta.positions[r]))
        return topk
