"""The KV compressor (DSV4_SPEC §2.4): ratio 4 with overlapping windows (CSA), ratio 128 plain (HCA).

Every token contributes a candidate `a` and gate logits `s + ape[p mod R]` (float32). The entry j
that closes at position jR+R-1 pools, per channel, a softmax over its rows: for R=128 the block's
128 tokens; for R=4 the previous block's first halves and the current block's second halves. Then
RMSNorm and RoPE at the block start jR.

State carried between steps: the last coff·R tokens' (a, s) rows in a ring indexed by position, which
is all a later closing token can reach back to. `step` returns the new ring instead of mutating the
old one, so a refused or failed step leaves the request as it was.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.components.norms import rms_norm


@dataclass(frozen=True, slots=True)
class CompressorState:
    a: Any      # [coff*R, coff*D] float32, row = position % (coff*R)
    s: Any


class Compressor:
    def __init__(self, *, wkv, wgate, ape, norm, ratio: int, head_dim: int, rope, eps: float) -> None:
        self.ratio, self.dim, self.rope, self.eps = ratio, head_dim, rope, eps
        self.coff = 2 if ratio == 4 else 1
        self.wkv, self.wgate, self.ape, self.norm = wkv.float(), wgate.float(), ape.float(), norm.float()

    @property
    def ring(self) -> int:
        return self.coff * self.ratio

    def new_state(self, device) -> CompressorState:
        import torch

        z = torch.zeros(self.ring, self.coff * self.dim, dtype=torch.float32, device=device)
        return CompressorState(a=z, s=z.clone())

    def step(self, x, start: int, state: CompressorState):
        """One request's contiguous tokens at positions start..start+n-1.

        Returns (entry ids [m] int64, entries [m, D] float32, new state).
        """
        import torch

        R, D, ring, n = self.ratio, self.dim, self.ring, x.shape[0]
        dev = x.device
        pos = torch.arange(start, start + n, device=dev)
        a = x.float() @ self.wkv.T
        s = x.float() @ self.wgate.T + self.ape[pos % R]
        base = max(0, start - ring)
        hist = torch.arange(base, start, device=dev) % ring
        A = torch.cat((state.a[hist], a))          # rows for positions base..start+n-1
        S = torch.cat((state.s[hist], s))
        end = start + n
        ids = torch.arange(start // R, end // R, device=dev)
        if len(ids):
            cur = ids[:, None] * R + torch.arange(R, device=dev)[None, :] - base     # [m, R]
            if R == 4:
                prev = cur - R
                ok = (prev + base >= 0)[..., None]
                pa = torch.where(ok, A[prev.clamp(min=0), :D], 0.0)
                ps = torch.where(ok, S[prev.clamp(min=0), :D], float("-inf"))
                rows_a = torch.cat((pa, A[cur, D:]), 1)
                rows_s = torch.cat((ps, S[cur, D:]), 1)
            else:
                rows_a, rows_s = A[cur], S[cur]
            v = (rows_a * torch.softmax(rows_s, dim=1)).sum(1)
            v = self.rope.apply(rms_norm(v, self.norm, self.eps), ids * R)
        else:
            v = torch.zeros(0, D, device=dev)
        keep = torch.arange(max(base, end - ring), end, device=dev)
        new_a, new_s = state.a.clone(), state.s.clone()
        new_a[keep % ring] = A[keep - base]
        new_s[keep % ring] = S[keep - base]
        return ids, v, CompressorState(a=new_a, s=new_s)
