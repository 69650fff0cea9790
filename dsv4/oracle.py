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
selection (`topk`) and the selection graded separately (`grade_selection`). Queries are recomputed in
chunks over the keys they can see, so a long history costs memory in proportion to its length.
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


QUERY_CHUNK = 256        # queries recomputed at once, at most: memory grows with the history, not its square
CHUNK_ELEMENTS = 2 ** 22  # and at most this many (query, head, key) scores of a chunk (16 MiB in float32)


def oracle_layer(model: Mapping[str, Any], ratio: int, w: Mapping[str, Any], x, *, row_format: str,
                 kv_scale: float | None = None, topk=None, indexer_numerics: str = "exact",
                 linear_numerics: str = "float", keep_scores: bool = True, grade: bool = False,
                 query_chunk: int = QUERY_CHUNK) -> dict[str, Any]:
    """One request's whole history x [L, hidden] at positions 0..L-1.

    Returns `out` [L, hidden]; for ratio 4 also `topk` [L, K] (the selection attended over: `topk` if
    given, else the oracle's own), `own_topk` [L, K] (the oracle's own), with `keep_scores` `scores`
    [L, n] (the indexer's, -inf where not visible) and `scores_by` (those scores under each of
    INDEXER_NUMERICS, `scores` among them), and with `grade` (and `topk` given) `grades`: the given
    selection graded against the scores of each numerics (`grade_selection`).
    Queries are recomputed at most `query_chunk` at a time (fewer where the keys are many: CHUNK_ELEMENTS),
    each over the keys it can see (its window and the compressed entries), so nothing [L, L] is held and a
    chunk's scores stay bounded; `keep_scores` is what holds [L, n].
    """
    _check_numerics(indexer_numerics, linear_numerics)
    w = _weight_values(w)
    lin = _fp8_rows if linear_numerics == "fp8" else (lambda a: a)    # what the dense projections read
    x = x.float()
    L, H, f = x.shape[0], w["attn_sink"].shape[0], _freqs(model, ratio)
    # every numerics the oracle offers where its scores are kept or graded; the run's own alone otherwise
    scored = INDEXER_NUMERICS if keep_scores or grade else (indexer_numerics,)
    raw, comp, kidx = _history_keys(model, ratio, w, x, f, lin, row_format=row_format, kv_scale=kv_scale,
                                    scored=scored)
    given = None if topk is None else torch.as_tensor(topk).long()
    gathered = _Gathered(L, w["wo_b.weight"].shape[0], model["index_topk"], ratio == 4, given,
                         keep_scores=keep_scores, grade=grade)
    seen = model["sliding_window"] + (0 if comp is None else comp.shape[0])  # keys a query is scored against
    step = max(1, min(query_chunk, CHUNK_ELEMENTS // (max(H, model["index_n_heads"]) * (seen + query_chunk))))
    for a in range(0, L, step):
        b = min(L, a + step)
        gathered.add(a, b, _queries(model, ratio, w, x, a, b, raw=raw, comp=comp, kidx=kidx, f=f, lin=lin, H=H,
                                    topk=None if given is None else given[a:b], indexer_numerics=indexer_numerics))
    return gathered.result()


def _check_numerics(indexer_numerics: str, linear_numerics: str) -> None:
    if indexer_numerics not in INDEXER_NUMERICS:
        raise ValueError(f"indexer_numerics={indexer_numerics!r} is not one of {INDEXER_NUMERICS}")
    if linear_numerics not in LINEAR_NUMERICS:
        raise ValueError(f"linear_numerics={linear_numerics!r} is not one of {LINEAR_NUMERICS}")


def _history_keys(model, ratio, w, x, f, lin, *, row_format, kv_scale, scored):
    """The keys of the request's whole history: its raw rows and (ratio > 1) compressed entries, each
    rounded as the cache stores it, and (ratio 4) the indexer's keys under each numerics in `scored`."""
    D, eps = model["head_dim"], model["rms_norm_eps"]
    pos = torch.arange(x.shape[0])
    raw = round_rows(_rope(_rms(lin(x) @ w["wkv.weight"].T, w["kv_norm.weight"], eps), pos, f), row_format, kv_scale)
    comp, kidx = None, {}
    if ratio > 1:
        c = "compressor."
        comp = round_rows(_compress(x, w[c + "wkv.weight"], w[c + "wgate.weight"], w[c + "ape"],
                                    w[c + "norm.weight"], ratio, D, f, eps), row_format, kv_scale)
    if ratio == 4:
        c = "indexer.compressor."
        keys = _compress(x, w[c + "wkv.weight"], w[c + "wgate.weight"], w[c + "ape"], w[c + "norm.weight"], 4,
                         model["index_head_dim"], f, eps)
        kidx = {n: _fp4_indexer(keys) if n == IndexerNumerics.FP4.value else keys for n in scored}
    return raw, comp, kidx


class _Gathered:
    """oracle_layer's result, filled in chunk by chunk: the outputs, (ratio 4) the selections, the scores
    where kept and the grades of the given selection where asked."""
    __slots__ = ("out", "sel", "parts", "graded", "given", "K", "indexed")

    def __init__(self, L: int, hidden: int, K: int, indexed: bool, given, *, keep_scores: bool,
                 grade: bool) -> None:
        self.out = torch.zeros(L, hidden)
        self.sel = {name: torch.full((L, K), -1, dtype=torch.int64) for name in ("topk", "own_topk")} \
            if indexed else {}
        self.parts: dict[str, list] = {"scores": [], "scores_by": []} if keep_scores else {}
        self.graded: dict[str, list] | None = {numerics: [] for numerics in INDEXER_NUMERICS} \
            if grade and given is not None else None
        self.given, self.K, self.indexed = given, K, indexed

    def add(self, a: int, b: int, part: dict[str, Any]) -> None:
        """Queries a..b-1's results."""
        self.out[a:b] = part["out"]
        if not self.indexed:
            return
        for name, rows in self.sel.items():
            rows[a:b] = part[name]
        for name in self.parts:
            self.parts[name].append(part[name])
        if self.graded is not None:
            for numerics, sc in part["scores_by"].items():
                self.graded[numerics].append(grade_selection(self.given[a:b], sc, self.K))

    def result(self) -> dict[str, Any]:
        res: dict[str, Any] = {"out": self.out}
        if not self.indexed:
            return res
        res |= self.sel
        if self.parts:
            res["scores"] = torch.cat(self.parts["scores"])
            res["scores_by"] = {n: torch.cat([p[n] for p in self.parts["scores_by"]]) for n in INDEXER_NUMERICS}
        if self.graded is not None:
            res["grades"] = {n: merge_grades(g) for n, g in self.graded.items()}
        return res


def _queries(model, ratio, w, x, a, b, *, raw, comp, kidx, f, lin, H, topk, indexer_numerics):
    """Queries a..b-1 of one request (docs/numerics.md §5), over the raw rows of their windows and the
    compressed entries complete before them; `kidx`: the indexer keys under each numerics scored."""
    D, W, eps, G = model["head_dim"], model["sliding_window"], model["rms_norm_eps"], model["o_groups"]
    C, pos = b - a, torch.arange(a, b)
    lo = max(0, a - W + 1)                                         # the first raw row the chunk's windows reach
    qr = _rms(lin(x[a:b]) @ w["wq_a.weight"].T, w["q_norm.weight"], eps)
    q = _rope(_rms((lin(qr) @ w["wq_b.weight"].T).view(C, H, D), None, eps), pos[:, None], f)
    i_ = torch.arange(lo, b)[None, :]
    keys, mask = raw[lo:b], (i_ <= pos[:, None]) & (i_ > pos[:, None] - W)       # the sliding window
    res: dict[str, Any] = {}
    if ratio > 1:
        n = comp.shape[0]
        visible = torch.arange(n)[None, :] < ((pos + 1) // ratio)[:, None]       # causally complete entries
        if ratio == 4:
            Hi, Di, K = model["index_n_heads"], model["index_head_dim"], model["index_topk"]
            iq = _rope((lin(qr) @ w["indexer.wq_b.weight"].T).view(C, Hi, Di), pos[:, None], f)
            hw = (x[a:b] @ w["indexer.weights_proj.weight"].T) * Di ** -0.5 * Hi ** -0.5
            by = {}                     # the scores under each numerics in kidx (all of them for grading)
            for numerics in kidx:
                qn = _fp4_indexer(iq) if numerics == IndexerNumerics.FP4.value else iq
                sc = (torch.einsum("lhd,nd->lhn", qn, kidx[numerics]).relu() * hw[..., None]).sum(1)
                by[numerics] = sc.masked_fill(~visible, -math.inf)
            scores = by[indexer_numerics]
            own = _own_topk(scores, K)
            topk = own if topk is None else topk
            chosen = torch.zeros(C, n + 1, dtype=torch.bool)
            chosen.scatter_(1, torch.where(topk >= 0, topk, n), True)
            visible = chosen[:, :n]
            res |= {"scores": scores, "scores_by": by, "topk": topk, "own_topk": own}
        keys = torch.cat((keys, comp))
        mask = torch.cat((mask, visible), 1)
    logits = torch.einsum("lhd,nd->lhn", q, keys) * D ** -0.5
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    sink = w["attn_sink"][None, :, None].expand(C, H, 1)
    prob = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]     # the sink takes mass only
    o = _rope(torch.einsum("lhn,nd->lhd", prob, keys), pos[:, None], f, inverse=True)
    wa = w["wo_a.weight"].view(G, -1, (H // G) * D)
    z = torch.einsum("lgd,grd->lgr", o.reshape(C, G, -1), wa)
    res["out"] = lin(z.flatten(1)) @ w["wo_b.weight"].T
    return res


def oracle_outputs(model: Mapping[str, Any], ratio: int, w: Mapping[str, Any], hidden, positions,
                   request_index, *, row_format: str, kv_scale: float | None = None, topk=None,
                   indexer_numerics: str = "exact", linear_numerics: str = "float", keep_scores: bool = True,
                   grade: bool = False) -> dict[str, Any]:
    """Recompute every token of a run (tokens in any order, grouped by `request_index`).

    Each request's tokens must be its whole history 0..L-1. Returns `out` [T, hidden] aligned with
    the inputs and, for ratio 4, the oracle's own `topk` [T, K]; with `keep_scores` `scores` ({request:
    (rows, scores)}) and `scores_by` (the same under each of INDEXER_NUMERICS); with `grade` (and `topk`)
    `grades` ({numerics: {request: grade_selection of its tokens}}).
    """
    T = hidden.shape[0]
    out = torch.zeros(T, hidden.shape[1])
    own_topk = torch.full((T, model["index_topk"]), -1, dtype=torch.int64) if ratio == 4 else None
    scores, scores_by = {}, {numerics: {} for numerics in INDEXER_NUMERICS}
    grades: dict[str, dict] = {numerics: {} for numerics in INDEXER_NUMERICS}
    for r in torch.unique(request_index).tolist():
        rows = torch.nonzero(request_index == r).squeeze(1)
        rows = rows[torch.argsort(positions[rows])]
        if positions[rows].tolist() != list(range(len(rows))):
            raise ValueError(f"request {r}: tokens are not its whole history 0..L-1")
        given = None if topk is None else topk[rows]
        res = oracle_layer(model, ratio, w, hidden[rows], row_format=row_format, kv_scale=kv_scale, topk=given,
                           indexer_numerics=indexer_numerics, linear_numerics=linear_numerics,
                           keep_scores=keep_scores, grade=grade)
        out[rows] = res["out"]
        if ratio == 4:
            own_topk[rows] = res["own_topk"]
            if keep_scores:
                scores[r] = (rows, res["scores"])
                for numerics, sc in res["scores_by"].items():
                    scores_by[numerics][r] = (rows, sc)
            for numerics, g in res.get("grades", {}).items():
                grades[numerics][r] = g
    return {"out": out, "topk": own_topk} | ({"scores": scores, "scores_by": scores_by} if keep_scores else {}) \
        | ({"grades": grades} if grade and topk is not None and ratio == 4 else {})


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
            "count_ok": float(count_ok), "tokens": n_tok}


def merge_grades(parts) -> dict[str, float]:
    """One grade of the tokens of several `grade_selection` results (e.g. one per query chunk)."""
    n = sum(g["tokens"] for g in parts)
    return {"exact": sum(g["exact"] * g["tokens"] for g in parts) / max(n, 1),
            "recall": sum(g["recall"] * g["tokens"] for g in parts) / max(n, 1),
            "max_gap": max((g["max_gap"] for g in parts), default=0.0),
            "count_ok": min((g["count_ok"] for g in parts), default=1.0), "tokens": n}


def rel_err(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def cosine(out, ref) -> float:
    a, b = out.double().flatten(), ref.double().flatten()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))
