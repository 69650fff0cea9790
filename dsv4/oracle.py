"""The oracle: a whole-sequence float32 recomputation of one DSV4 attention layer.

No paging, no caches, no incremental state, and nothing shared with `dsv4.components`: every
request's full history is recomputed densely, as docs/numerics.md §5 writes it. Everything paged and
incremental is tested against this. It takes the dump contract's plain data (the `model` dict of
spec.json and weights under checkpoint names), so a dump can be recomputed anywhere.

Cached KV rows (SWA and compressed) are rounded as the run's cache stored them (`row_format`); the
indexer's queries and keys follow the run's indexer numerics (`indexer_numerics`: "exact", or "fp4" --
the published code's Hadamard rotation and FP4 simulation, written here from their definitions).
The dense projections follow the run's `linear_numerics`: "float" (the weights' values, float32), or
"fp8" -- the published fp8 linear, written here from its definition: each activation row quantized per
128 values to e4m3 over a power-of-two scale before `wq_a`, `wkv`, `wq_b`, the indexer's `wq_b` and
`wo_b`. Weights given as e4m3 (`NAME.weight`) with block scales (`NAME.scale`, one per 128x128 block), as
the checkpoint and an fp8 run's dump store them, are multiplied at their exact values.
With random weights the indexer's top-k has near ties, so outputs can be recomputed over a given
selection (`topk`) and the selection graded separately (`grade_selection`).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import torch

from dsv4.formats.indexer_numerics import IndexerNumerics
from dsv4.formats.row_format import RowFormat, RowKind

ROW_ROUNDINGS = (RowKind.PLAIN, RowKind.FP8_DS_MLA, RowKind.FP8_PER_TENSOR)    # the cache rows it rounds as
INDEXER_NUMERICS = tuple(n.value for n in IndexerNumerics)      # "exact", "fp4"
LINEAR_NUMERICS = ("float", "fp8")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)         # the FP4 magnitudes, by code 0..7


def _fp4_indexer(x):
    """x [..., n] -> its orthonormal Hadamard rotation in bf16, then FP4 in bf16 (per 32 values a scale
    2^ceil(log2(max(amax, 6·2^-126) / 6)), each value/scale to the nearest e2m1 magnitude, a tie to the
    even code), as float32. The Hadamard entries are (-1)^popcount(i & j) (Sylvester's order)."""
    n = x.shape[-1]
    y = ((x.to(torch.bfloat16).double() @ _hadamard(n)) * n ** -0.5).float().to(torch.bfloat16).float()
    b = y.unflatten(-1, (-1, 32))
    amax = b.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126) * torch.tensor(1 / 6, dtype=torch.float32)
    scale = torch.exp2(torch.ceil(torch.log2(amax.double()))).float()
    v = (b / scale).clamp(-6, 6)
    grid = torch.tensor(E2M1, dtype=torch.float64)
    dist = (v.abs().double()[..., None] - grid).abs() + torch.arange(8) % 2 * 1e-12   # a tie goes to the even code
    mag = grid[dist.argmin(-1)].float()
    return (torch.where(v < 0, -mag, mag) * scale).flatten(-2).to(torch.bfloat16).float()


@functools.cache
def _hadamard(n: int):
    """The n x n Hadamard matrix (-1)^popcount(i & j), float64 (made once per n)."""
    i = torch.arange(n)
    return 1.0 - 2.0 * _popcount(i[:, None] & i[None, :]).remainder(2).double()


def _popcount(t):
    c = torch.zeros_like(t)
    while bool((t > 0).any()):
        c, t = c + (t & 1), t >> 1
    return c


def _rms(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _freqs(model: Mapping[str, Any], ratio: int):
    """float32 [32], as DeepSeek's published precompute_freqs_cis computes them (float32 torch ops)."""
    plain = ratio <= 1
    base = model["rope_theta"] if plain else model["compress_rope_theta"]
    f = 1.0 / (base ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    if plain:
        return f
    ys = model["rope_scaling"]
    orig = ys["original_max_position_embeddings"]
    d = lambda n: 64 * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    lo, hi = max(math.floor(d(ys["beta_fast"])), 0), min(math.ceil(d(ys["beta_slow"])), 63)
    hi = hi + 0.001 if hi == lo else hi
    smooth = 1 - ((torch.arange(32, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return f / ys["factor"] * (1 - smooth) + f * smooth


def _rope(x, pos, f, inverse=False):
    """GPT-J pairs on the last 64 dims; pos broadcasts against x[..., 0]. The published table: float32
    angle = position × f, cos/sin by torch.polar."""
    ang = pos.to(torch.float32)[..., None] * f.to(torch.float32)
    cis = torch.polar(torch.ones_like(ang), ang)
    c, s = cis.real, cis.imag * (-1 if inverse else 1)
    r = x[..., -64:].unflatten(-1, (32, 2))
    ev, od = r[..., 0], r[..., 1]
    return torch.cat((x[..., :-64], torch.stack((ev * c - od * s, od * c + ev * s), -1).flatten(-2)), -1)


def _e4m3(x):
    return x.to(torch.float8_e4m3fn).float()


def _fp8_rows(x):
    """x [..., K] as the published fp8 linear reads it: per 128 values the power-of-two scale
    s = 2^ceil(log2(max(amax, 1e-4) / 448)), each value e4m3(x / s) · s."""
    b = x.unflatten(-1, (-1, 128))
    s = torch.exp2(torch.ceil(torch.log2(b.abs().amax(-1, keepdim=True).clamp_min(1e-4).double() / 448))).float()
    return (_e4m3((b / s).clamp(-448, 448)) * s).flatten(-2)


def _weight_values(w: Mapping[str, Any]) -> dict[str, Any]:
    """Every tensor as float32; an e4m3 `NAME.weight` times its `NAME.scale` per 128x128 block."""
    out = {}
    for k, v in w.items():
        if k.endswith(".scale"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            s = w[k.removesuffix(".weight") + ".scale"].float()
            v = v.float() * s.repeat_interleave(128, 0)[:v.shape[0]].repeat_interleave(128, 1)[:, :v.shape[1]]
        out[k] = v.float()
    return out


def round_rows(rows, row_format: str, kv_scale: float | None = None):
    """What a cached row reads back as (docs/numerics.md §3.2, §3.3), for the rows a dump names
    (`row_format`, a RowFormat's label): fp8 formats quantize the bf16 row."""
    fmt = RowFormat.from_label(row_format, kv_scale=kv_scale)
    if fmt.kind not in ROW_ROUNDINGS:
        raise NotImplementedError(f"oracle: row_format={row_format!r} is not a KV cache's rows")
    if fmt.exact:
        return rows
    if fmt.kind is RowKind.PLAIN:
        return rows.to(getattr(torch, fmt.element)).float()
    x = rows.bfloat16().float()
    if fmt.kind is RowKind.FP8_DS_MLA:        # 7 blocks of 64 NoPE dims, power-of-two scale each; FNUZ
        fnuz = fmt.fp8 == "fnuz"              # e4m3 (max 240) is quantized to vLLM's range ±224
        qmax, fp8 = (224, torch.float8_e4m3fnuz) if fnuz else (448, torch.float8_e4m3fn)
        nope = x[..., :448].unflatten(-1, (7, 64))
        scale = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True).clamp_min(1e-4) / qmax)))
        nope = (nope / scale).clamp(-qmax, qmax).to(fp8).float() * scale
        return torch.cat((nope.flatten(-2), x[..., 448:]), -1)
    return _e4m3((x / fmt.kv_scale).clamp(-448, 448)) * fmt.kv_scale


def _compress(x, wkv, wgate, ape, norm, R, D, f, eps):
    """All complete compressed entries of one request, one at a time (docs/numerics.md §5.3)."""
    L = x.shape[0]
    a = x @ wkv.T
    s = x @ wgate.T + ape[torch.arange(L) % R]
    out = []
    for j in range(L // R):
        if R == 4:
            prev = [(a[p, :D], s[p, :D]) if p >= 0 else (torch.zeros(D), torch.full((D,), -math.inf))
                    for p in range(4 * j - 4, 4 * j)]
            cur = [(a[p, D:], s[p, D:]) for p in range(4 * j, 4 * j + 4)]
            A = torch.stack([r[0] for r in prev + cur])
            S = torch.stack([r[1] for r in prev + cur])
        else:
            A, S = a[j * R:(j + 1) * R], s[j * R:(j + 1) * R]
        v = _rms((A * torch.softmax(S, 0)).sum(0), norm, eps)
        out.append(_rope(v, torch.tensor(j * R), f))
    return torch.stack(out) if out else torch.zeros(0, D)


def oracle_layer(model: Mapping[str, Any], ratio: int, w: Mapping[str, Any], x, *, row_format: str,
                 kv_scale: float | None = None, topk=None, indexer_numerics: str = "exact",
                 linear_numerics: str = "float") -> dict[str, Any]:
    """One request's whole history x [L, hidden] at positions 0..L-1.

    Returns `out` [L, hidden]; for ratio 4 also `scores` [L, n] (the indexer's, -inf where not
    visible), `scores_by` (those scores under each of INDEXER_NUMERICS, `scores` among them) and `topk`
    [L, K] (the selection attended over: `topk` if given, else the oracle's own).
    """
    if indexer_numerics not in INDEXER_NUMERICS:
        raise ValueError(f"indexer_numerics={indexer_numerics!r} is not one of {INDEXER_NUMERICS}")
    if linear_numerics not in LINEAR_NUMERICS:
        raise ValueError(f"linear_numerics={linear_numerics!r} is not one of {LINEAR_NUMERICS}")
    w = _weight_values(w)
    lin = _fp8_rows if linear_numerics == "fp8" else (lambda a: a)    # what the dense projections read
    x = x.float()
    L, D, W, eps = x.shape[0], model["head_dim"], model["sliding_window"], model["rms_norm_eps"]
    H = w["attn_sink"].shape[0]
    G = model["o_groups"]
    f = _freqs(model, ratio)
    pos = torch.arange(L)
    qr = _rms(lin(x) @ w["wq_a.weight"].T, w["q_norm.weight"], eps)
    q = _rope(_rms((lin(qr) @ w["wq_b.weight"].T).view(L, H, D), None, eps), pos[:, None], f)
    raw = round_rows(_rope(_rms(lin(x) @ w["wkv.weight"].T, w["kv_norm.weight"], eps), pos, f), row_format, kv_scale)

    keys, res = raw, {}
    p_, i_ = pos[:, None], pos[None, :]
    mask = (i_ <= p_) & (i_ > p_ - W)                              # the sliding window, [L, L]
    if ratio > 1:
        c = "compressor."
        comp = round_rows(_compress(x, w[c + "wkv.weight"], w[c + "wgate.weight"], w[c + "ape"],
                                    w[c + "norm.weight"], ratio, D, f, eps), row_format, kv_scale)
        n = comp.shape[0]
        j_ = torch.arange(n)[None, :]
        visible = j_ < ((pos + 1) // ratio)[:, None]               # causally complete entries
        if ratio == 4:
            c = "indexer.compressor."
            Hi, Di, K = model["index_n_heads"], model["index_head_dim"], model["index_topk"]
            kidx = _compress(x, w[c + "wkv.weight"], w[c + "wgate.weight"], w[c + "ape"],
                             w[c + "norm.weight"], 4, Di, f, eps)
            iq = _rope((lin(qr) @ w["indexer.wq_b.weight"].T).view(L, Hi, Di), pos[:, None], f)
            hw = (x @ w["indexer.weights_proj.weight"].T) * Di ** -0.5 * Hi ** -0.5
            by = {}                     # the scores under each numerics the oracle offers (for grading)
            for numerics in INDEXER_NUMERICS:
                qn, kn = (_fp4_indexer(iq), _fp4_indexer(kidx)) if numerics == IndexerNumerics.FP4.value else (iq, kidx)
                sc = (torch.einsum("lhd,nd->lhn", qn, kn).relu() * hw[..., None]).sum(1)
                by[numerics] = sc.masked_fill(~visible, -math.inf)
            scores = by[indexer_numerics]
            topk = _own_topk(scores, K) if topk is None else torch.as_tensor(topk).long()
            chosen = torch.zeros(L, n + 1, dtype=torch.bool)
            chosen.scatter_(1, torch.where(topk >= 0, topk, n), True)
            visible = chosen[:, :n]
            res |= {"scores": scores, "scores_by": by, "topk": topk}
        keys = torch.cat((raw, comp))
        mask = torch.cat((mask, visible), 1)
    logits = torch.einsum("lhd,nd->lhn", q, keys) * D ** -0.5
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    sink = w["attn_sink"][None, :, None].expand(L, H, 1)
    prob = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]     # the sink takes mass only
    o = _rope(torch.einsum("lhn,nd->lhd", prob, keys), pos[:, None], f, inverse=True)
    wa = w["wo_a.weight"].view(G, -1, (H // G) * D)
    z = torch.einsum("lgd,grd->lgr", o.reshape(L, G, -1), wa)
    res["out"] = lin(z.flatten(1)) @ w["wo_b.weight"].T
    return res


def oracle_outputs(model: Mapping[str, Any], ratio: int, w: Mapping[str, Any], hidden, positions,
                   request_index, *, row_format: str, kv_scale: float | None = None, topk=None,
                   indexer_numerics: str = "exact", linear_numerics: str = "float") -> dict[str, Any]:
    """Recompute every token of a run (tokens in any order, grouped by `request_index`).

    Each request's tokens must be its whole history 0..L-1. Returns `out` [T, hidden] aligned with
    the inputs and, for ratio 4, `scores` ({request: (rows, scores)}), `scores_by` (the same under each
    of INDEXER_NUMERICS) and the oracle's own `topk` [T, K].
    """
    T = hidden.shape[0]
    out = torch.zeros(T, hidden.shape[1])
    own_topk = torch.full((T, model["index_topk"]), -1, dtype=torch.int64) if ratio == 4 else None
    scores, scores_by = {}, {numerics: {} for numerics in INDEXER_NUMERICS}
    for r in torch.unique(request_index).tolist():
        rows = torch.nonzero(request_index == r).squeeze(1)
        rows = rows[torch.argsort(positions[rows])]
        if positions[rows].tolist() != list(range(len(rows))):
            raise ValueError(f"request {r}: tokens are not its whole history 0..L-1")
        given = None if topk is None else topk[rows]
        res = oracle_layer(model, ratio, w, hidden[rows], row_format=row_format, kv_scale=kv_scale, topk=given,
                           indexer_numerics=indexer_numerics, linear_numerics=linear_numerics)
        out[rows] = res["out"]
        if ratio == 4:
            scores[r] = (rows, res["scores"])
            for numerics, sc in res["scores_by"].items():
                scores_by[numerics][r] = (rows, sc)
            own_topk[rows] = _own_topk(res["scores"], model["index_topk"])
    return {"out": out, "scores": scores, "scores_by": scores_by, "topk": own_topk}


def _own_topk(scores, K: int):
    """Local indices [L, K] of the K best visible entries, -1 padded."""
    L, n = scores.shape
    k = min(K, n)
    out = torch.full((L, K), -1, dtype=torch.int64)
    if k:
        val, idx = scores.topk(k, -1)
        out[:, :k] = torch.where(torch.isinf(val), -1, idx)
    return out


def grade_selection(run_topk, scores, K: int) -> dict[str, float]:
    """How a run's top-k compares with the oracle's scores, token by token.

    `exact`: share of tokens whose selected set equals the oracle's own. `recall`: the mean over tokens of
    the share of the oracle's set that was selected. `max_gap`: the largest amount (relative to the
    token's largest |score|) by which a selected entry scores below the oracle's k-th best; near-ties
    give ~1e-7, a wrong selection gives O(1). `count_ok`: every token selected exactly min(K, visible)
    distinct entries.
    """
    exact, recall, gaps, count_ok, n_tok = 0, 0.0, [0.0], True, 0
    for tok in range(run_topk.shape[0]):
        s = scores[tok]
        vis = int(torch.isfinite(s).sum())
        k = min(K, vis)
        sel = run_topk[tok][run_topk[tok] >= 0].long()
        n_tok += 1
        if len(sel) != k or len(set(sel.tolist())) != k or (k and int(sel.max()) >= vis):
            count_ok = False
            continue
        if k == 0:
            exact += 1
            recall += 1.0
            continue
        kth = s.topk(k).values[-1]
        own = set(s.topk(k).indices.tolist())
        exact += own == set(sel.tolist())
        recall += len(own & set(sel.tolist())) / k
        scale = float(s[torch.isfinite(s)].abs().max()) or 1.0
        gaps.append(float((kth - s[sel].min()).clamp(min=0)) / scale)
    return {"exact": exact / max(n_tok, 1), "recall": recall / max(n_tok, 1), "max_gap": max(gaps),
            "count_ok": float(count_ok)}


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def cosine(out, ref) -> float:
    a, b = out.double().flatten(), ref.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
