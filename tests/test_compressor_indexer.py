"""Compressor (docs/numerics.md §2.4, §5.3) and lightning indexer (§2.5), batched over a step's requests,
against our own float64 per-entry loops written from the spec text (nothing from `dsv4` computes an
expected value). The compressor runs as the layer runs it: the step's rows projected, the kept rows
written to state pages, each closing token pooling this step's rows and earlier ones from the pages."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.components.compressor import Compressor
from dsv4.components.engine import Engine, Segment
from dsv4.components.indexer import Indexer
from dsv4.components.kv_pool import KVPool, PageGroup, RowRule, CompressorState
from dsv4.values.seam import PagedCache
from dsv4.components.plan import PageTable, StepPlan
from dsv4.values.layer_types import by_ratio
from dsv4.components.rope import Rope
from dsv4.strategies import ExactIndexer, PlainRowLayout
from tests.conftest import published_angles, tiny_spec

EPS = 1e-6
HID = 24


# ---- our own spec re-derivation ---------------------------------------------------------------
def rope_vec(v, p: int, inverse=False):
    """float64 GPT-J rotation of the last 64 dims of one vector at position p, by the published float32 angles
    of the compressed layers' table."""
    v = v.double().clone()
    ang = published_angles(torch.tensor(p), 4)
    c, s = ang.cos(), ang.sin() * (-1 if inverse else 1)
    ev, od = v[-64::2].clone(), v[-63::2].clone()
    v[-64::2], v[-63::2] = ev * c - od * s, od * c + ev * s
    return v


def rms_w(v, w):
    return v * torch.rsqrt(v.square().mean() + EPS) * w


def spec_entries(x, W, R: int, D: int, dtype=None):
    """§5.3, one entry at a time, float64: entries 0..L//R-1 of tokens 0..L-1. With `dtype` the published
    code's roundings: the pooled value to `dtype` before the norm (`self.norm(kv.to(dtype))`), the norm's
    output to `dtype` (its RMSNorm returns that dtype)."""
    def rounded(v):
        return v if dtype is None else v.to(dtype).double()

    x = x.double()
    L = x.shape[0]
    a = x @ W["wkv"].double().T
    s = x @ W["wgate"].double().T + W["ape"].double()[torch.arange(L) % R]
    out = []
    for j in range(L // R):
        rows_a, rows_s = [], []
        if R == 4:
            for p in range(4 * j - 4, 4 * j):             # previous block: first halves, absent for j=0
                rows_a.append(a[p, :D] if p >= 0 else torch.zeros(D, dtype=torch.float64))
                rows_s.append(s[p, :D] if p >= 0 else torch.full((D,), -math.inf, dtype=torch.float64))
            for p in range(4 * j, 4 * j + 4):             # current block: second halves
                rows_a.append(a[p, D:])
                rows_s.append(s[p, D:])
        else:
            for p in range(j * R, j * R + R):
                rows_a.append(a[p])
                rows_s.append(s[p])
        A, S = torch.stack(rows_a), torch.stack(rows_s)
        wts = torch.exp(S - S.max(0).values)
        wts = wts / wts.sum(0)
        v = rounded((A * wts).sum(0))
        out.append(rope_vec(rounded(rms_w(v, W["norm"].double())), j * R))
    return torch.stack(out) if out else torch.zeros(0, D, dtype=torch.float64)


def rel(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def make_weights(R: int, D: int, seed: int):
    coff = 2 if R == 4 else 1
    g = torch.Generator().manual_seed(seed)
    return {"wkv": torch.randn(coff * D, HID, generator=g) * HID ** -0.5,
            "wgate": torch.randn(coff * D, HID, generator=g) * 2 * HID ** -0.5,
            "ape": torch.randn(R, coff * D, generator=g) * 0.5,
            "norm": 1 + 0.1 * torch.randn(D, generator=g)}


def make_compressor(W, R: int, D: int, dtype=None) -> Compressor:
    return Compressor(wkv=W["wkv"], wgate=W["wgate"], ape=W["ape"], norm=W["norm"], ratio=R, head_dim=D, eps=EPS,
                      dtype=dtype)


class Run:
    """One compressor over paged state, stepped as the layer steps it (reserve, plan, write the kept
    rows, close entries, commit or roll back)."""

    def __init__(self, W, R: int, D: int, rids=("r",), dtype=None) -> None:
        self.comp, self.R, self.D = make_compressor(W, R, D, dtype), R, D
        reach = by_ratio(R).reach
        self.pool = KVPool(groups={
            "swa": PageGroup(name="swa", block_size=16, num_blocks=64, rule=RowRule(keep=16), knob="swa_blocks"),
            f"state{R}": PageGroup(name="state", block_size=reach, num_blocks=4 * len(rids),
                                   rule=RowRule(keep=reach, tail_only=True), knob="max_requests"),
            f"entries{R}": PageGroup(name="entries", block_size=4, num_blocks=64, rule=RowRule(per=R),
                                     knob="compressed_blocks")}, layers={}, window=16)
        self.state = CompressorState(data=torch.zeros(self.pool.state(R).num_slots, 2 * self.comp.width), block_size=reach,
                               width=self.comp.width)
        self.engine = Engine(spec=tiny_spec(sliding_window=16), layers={}, pools=[self.pool], device="cpu")
        self.rope = Rope.for_layer(tiny_spec(), R)
        self.lengths = {r: 0 for r in rids}
        for r in rids:
            self.pool.add(r)

    def step(self, chunks: dict, *, commit: bool = True) -> dict:
        """chunks: rid -> hidden rows [n, HID] continuing that request. Returns rid -> (entry ids, entries)."""
        segs, off = [], 0
        for rid, x in chunks.items():
            segs.append(Segment(rid=rid, start=self.lengths[rid], offset=off, count=x.shape[0]))
            off += x.shape[0]
        res = self.pool.reserve({s.rid: (s.start, s.start + s.count) for s in segs})
        plan = self.engine.build_plan(self.pool, self.engine.plan_inputs(self.pool, segs), num_tokens=off)
        scores = torch.cat(list(chunks.values())) @ self.comp.weights().T
        self.comp.write_state(scores, plan, self.state)
        rows, bad = self.comp.close(scores, plan, self.state, plan.rope_rows(self.rope, shift=self.R))
        assert not bool(bad.any())
        closes = plan.entries[self.R].close_slots >= 0
        out = {}
        for sg in segs:
            t = torch.arange(sg.offset, sg.offset + sg.count)
            c = t[closes[t]]
            out[sg.rid] = ((plan.positions[c].long() + 1) // self.R - 1, rows[c])
            assert not bool(rows[t[~closes[t]]].any())                 # tokens that close nothing: zero rows
        if commit:
            new = {sg.rid: sg.start + sg.count for sg in segs}
            self.pool.commit(new)
            self.lengths.update(new)
        else:
            self.pool.rollback(res)
        return out

    def whole(self, x):
        ids, vals = self.step({"r": x})["r"]
        return ids, vals


# Shared, built once: a long random sequence and its spec entries per (R, D).
CASES = {(4, 128): 45, (4, 512): 21, (128, 128): 300}
_cache: dict = {}


def case(R: int, D: int):
    if (R, D) not in _cache:
        W = make_weights(R, D, seed=R + D)
        x = torch.randn(CASES[(R, D)], HID, generator=torch.Generator().manual_seed(7 * R + D))
        _cache[(R, D)] = (W, x, spec_entries(x, W, R, D))
    return _cache[(R, D)]


# ---- compressor -------------------------------------------------------------------------------
@pytest.mark.parametrize("R,D", list(CASES))
def test_compressor_whole_sequence_matches_spec_loop(R, D):
    W, x, ref = case(R, D)
    ids, vals = Run(W, R, D).whole(x)
    assert ids.tolist() == list(range(x.shape[0] // R))
    assert vals.shape == (x.shape[0] // R, D) and vals.dtype == torch.float32
    assert rel(vals, ref) <= 1e-5
    # every entry individually (entry 0 of R=4 has no previous block)
    for j in range(len(ids)):
        assert rel(vals[j], ref[j]) <= 1e-5, j


@pytest.mark.parametrize("R,D", [(4, 128), (128, 128)])
def test_compressor_rounds_to_the_activation_dtype_as_the_published_code(R, D):
    """In bf16 the pooled entry is rounded to bf16 before its RMSNorm and the norm's output again: the
    entries' NoPE dims are bf16 values, those of the float64 chain with the published roundings but for
    rare ties (a float32 pooled value within an ulp of a bf16 rounding boundary), and not what the chain
    without the first rounding gives."""
    W, x, _ = case(R, D)
    _, vals = Run(W, R, D, dtype=torch.bfloat16).whole(x)
    nope = vals[:, :-64]
    assert torch.equal(nope, nope.bfloat16().float())                     # the norm's output, rounded
    published = spec_entries(x, W, R, D, dtype=torch.bfloat16)[:, :-64].float()
    same = float((nope == published).float().mean())
    assert same >= 0.995, same
    assert (nope - published).abs().max() <= 2 ** -7 * published.abs().max()          # the others an ulp
    unrounded = spec_entries(x, W, R, D)[:, :-64].bfloat16().float()       # no rounding before the norm
    assert float((nope == unrounded).float().mean()) < same - 0.1
    assert rel(vals, spec_entries(x, W, R, D, dtype=torch.bfloat16)) <= 4e-3


def test_compressor_r4_entry0_pools_only_current_block():
    """j = 0: the absent previous-block rows carry no weight, so entry 0 = softmax over the 4 B halves."""
    R, D = 4, 128
    W, x, _ = case(R, D)
    _, vals = Run(W, R, D).whole(x[:4])
    xd = x[:4].double()
    a = (xd @ W["wkv"].double().T)[:, D:]
    s = (xd @ W["wgate"].double().T + W["ape"].double())[:, D:]
    v = (a * torch.softmax(s, 0)).sum(0)
    assert rel(vals[0], rope_vec(rms_w(v, W["norm"].double()), 0)) <= 1e-5
    # and entry 1 does use the previous block's first halves: dropping them changes it
    _, vals2 = Run(W, R, D).whole(x[:8])
    xd = x[4:8].double()
    a = (xd @ W["wkv"].double().T)[:, D:]
    s = (xd @ W["wgate"].double().T + W["ape"].double())[:, D:]
    wrong = rope_vec(rms_w((a * torch.softmax(s, 0)).sum(0), W["norm"].double()), 4)
    assert rel(vals2[1], wrong) > 1e-2


def _cuts(n: int):
    return st.lists(st.integers(1, n - 1), max_size=12, unique=True).map(sorted)


def _kept_rows(run: Run):
    """The state rows a later step can read: each request's last coff·R positions, through its table."""
    g = run.pool.state(run.R)
    out = {}
    for rid, n in run.lengths.items():
        for p in range(g.rule.first_kept(n), n):
            out[(rid, p)] = run.state.data[g.tables[rid][p // g.block_size] * g.block_size + p % g.block_size].clone()
    return out


@settings(max_examples=20, deadline=None)
@given(data=st.data(), rd=st.sampled_from([(4, 128), (128, 128), (4, 512)]))
def test_compressor_chunked_equals_whole_and_earlier_rows_are_not_mutated(data, rd):
    R, D = rd
    W, x, ref = case(R, D)
    n = x.shape[0]
    cuts = data.draw(_cuts(n), label="chunk boundaries")
    run = Run(W, R, D)
    got_ids, got = [], []
    for start, end in zip([0] + cuts, cuts + [n]):
        kept = _kept_rows(run)
        # a step that is rolled back leaves every row an earlier step wrote as it was ...
        ids0, vals0 = run.step({"r": x[start:end]}, commit=False)["r"]
        assert all(torch.equal(v, _kept_rows(run)[k]) for k, v in kept.items())
        # ... and the same step again gives the same answer
        ids, vals = run.step({"r": x[start:end]})["r"]
        assert torch.equal(ids0, ids) and torch.equal(vals0, vals)
        # the entries closed in this chunk are exactly those whose closing token jR+R-1 lies in it
        assert ids.tolist() == [j for j in range(n // R) if start <= j * R + R - 1 < end]
        got_ids += ids.tolist()
        got.append(vals)
    assert got_ids == list(range(n // R))
    assert rel(torch.cat(got), ref) <= 1e-5


@settings(max_examples=10, deadline=None)
@given(data=st.data(), rd=st.sampled_from([(4, 128), (128, 128)]))
def test_compressor_requests_interleaved_in_one_step_equal_alone(data, rd):
    """Two requests with different chunkings, batched in the same steps, give each its own entries."""
    R, D = rd
    W, x, ref = case(R, D)
    n = x.shape[0]
    y = x.flip(0).contiguous()
    ref_y = spec_entries(y, W, R, D)
    run = Run(W, R, D, rids=("a", "b"))
    done, got = {"a": 0, "b": 0}, {"a": [], "b": []}
    while done["a"] < n or done["b"] < n:
        chunk = {}
        for rid, src in (("a", x), ("b", y)):
            if done[rid] < n:
                k = data.draw(st.integers(1, 40), label=f"{rid} chunk")
                chunk[rid] = src[done[rid]:done[rid] + k]
        for rid, (ids, vals) in run.step(chunk).items():
            got[rid].append(vals)
            done[rid] += chunk[rid].shape[0]
    assert rel(torch.cat(got["a"]), ref) <= 1e-5 and rel(torch.cat(got["b"]), ref_y) <= 1e-5


@pytest.mark.parametrize("R,n", [(4, 0), (4, 3), (4, 4), (4, 11), (4, 12), (128, 127), (128, 128), (128, 255),
                                 (128, 256)])
def test_compressor_entry_count(R, n):
    W = make_weights(R, 128, seed=5)
    if not n:
        return
    x = torch.randn(n, HID, generator=torch.Generator().manual_seed(n))
    ids, vals = Run(W, R, 128).whole(x)
    assert ids.tolist() == list(range(n // R))
    assert vals.shape == (n // R, 128)


@pytest.mark.parametrize("R,D,j", [(4, 128, 0), (4, 128, 3), (4, 128, 9), (128, 128, 0), (128, 128, 1)])
def test_compressor_entry_depends_only_on_tokens_up_to_its_close(R, D, j):
    W, x, _ = case(R, D)
    close = j * R + R - 1
    _, base = Run(W, R, D).whole(x)
    g = torch.Generator().manual_seed(j)

    def entries_with(rows):
        y = x.clone()
        y[rows] = torch.randn(len(rows), HID, generator=g)
        return Run(W, R, D).whole(y)[1]

    later = entries_with(list(range(close + 1, x.shape[0])))       # perturb every later token
    assert rel(later[: j + 1], base[: j + 1]) <= 1e-6
    if len(base) > j + 1:
        assert rel(later[j + 1:], base[j + 1:]) > 1e-3               # ... which does change later entries
    assert rel(entries_with([close])[j], base[j]) > 1e-3             # the closing token matters
    first = 4 * j - 4 if R == 4 else j * R                           # earliest token the entry summarises
    if first >= 0:
        assert rel(entries_with([first])[j], base[j]) > 1e-3
    if first - 1 >= 0:
        assert rel(entries_with([first - 1])[j], base[j]) <= 1e-6    # ... and nothing before it


# ---- indexer ----------------------------------------------------------------------------------
def make_indexer(K: int, Hi: int = 8, Di: int = 128, qlora: int = 16, seed: int = 0) -> Indexer:
    g = torch.Generator().manual_seed(seed)
    return Indexer(wq_b=torch.randn(Hi * Di, qlora, generator=g) * qlora ** -0.5,
                   weights_proj=torch.randn(Hi, HID, generator=g) * HID ** -0.5, compressor=None,
                   n_heads=Hi, head_dim=Di, topk=K, strategy=ExactIndexer())


def scores_of(idx: Indexer, q, w, keys, positions, block: int = 4):
    """idx.scores for tokens at arbitrary positions over one shared set of keys: each token its own
    request of length position + 1, every request's entry table naming the same pages."""
    T, n = q.shape[0], keys.shape[0]
    lay = PlainRowLayout(name="float32", dtype="float32")
    pages = max(1, -(-n // block))
    cache = PagedCache(name="indexer", layout=lay, block_size=block, head_dim=keys.shape[1],
                       data=lay.allocate(num_blocks=pages, block_size=block, head_dim=keys.shape[1], device="cpu"))
    cache.write(torch.arange(n, dtype=torch.int32), keys)
    table = torch.arange(pages, dtype=torch.int32)[None].expand(T, pages).contiguous()
    plan = StepPlan.build(query_start=torch.arange(T + 1, dtype=torch.int32), seq_lens=(positions + 1).int(),
                          swa=PageTable(block_size=1, pages=torch.zeros(T, 0, dtype=torch.int32)), window=1,
                          entries={4: PageTable(block_size=block, pages=table)})
    return idx.scores(q, w, cache, plan)[:, :n]


def spec_scores(q, w, keys, positions):
    """I[t, j] = sum_h w[t,h] ReLU(q[t,h].k_j), -inf where j >= (p+1)//4; float64 loops."""
    T, n = q.shape[0], keys.shape[0]
    out = torch.empty(T, n, dtype=torch.float64)
    for t in range(T):
        vis = (int(positions[t]) + 1) // 4
        for j in range(n):
            if j >= vis:
                out[t, j] = -math.inf
            else:
                out[t, j] = float((w[t].double() * (q[t].double() @ keys[j].double()).clamp_min(0)).sum())
    return out


def test_indexer_queries_match_spec():
    idx = make_indexer(K=4)
    g = torch.Generator().manual_seed(11)
    T, Hi, Di = 5, 8, 128
    qr = torch.randn(T, 16, generator=g)
    pos = torch.tensor([0, 3, 17, 4096, 70001])
    q = idx.queries(qr @ idx.wq_b.T, Rope.for_layer(tiny_spec(), 4).at(pos))
    assert q.shape == (T, Hi, Di)
    qq = (qr.double() @ idx.wq_b.double().T).view(T, Hi, Di)
    ref_q = torch.stack([torch.stack([rope_vec(qq[t, h], int(pos[t])) for h in range(Hi)]) for t in range(T)])
    assert torch.equal(q[..., :64], qq[..., :64].float()) or rel(q[..., :64], qq[..., :64]) <= 1e-6
    assert rel(q, ref_q) <= 1e-5
    assert idx.weight_scale == Di ** -0.5 * Hi ** -0.5


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 20), T=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_indexer_scores_match_spec(n, T, seed):
    g = torch.Generator().manual_seed(seed)
    idx = make_indexer(K=4)
    q = torch.randn(T, 8, 128, generator=g)
    w = torch.randn(T, 8, generator=g)
    keys = torch.randn(n, 128, generator=g)
    pos = torch.randint(0, 4 * n + 3, (T,), generator=g)                 # at most n entries visible
    got = scores_of(idx, q, w, keys, pos)
    w = w * idx.weight_scale                        # the head weights as `scores` scales them
    ref = spec_scores(q, w, keys, pos)
    assert got.shape == (T, n)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert bool((got[torch.isinf(got)] < 0).all())                    # masked entries are -inf
    # float32 error scales with the terms' magnitudes, Σ_h |w_h| Σ_d |q_hd k_d|, not with the score, which
    # signed weights can cancel to near 0 (n=1, T=1, seed=25: a score of -0.093 off by 2.1e-5 relative)
    mag = (w.double().abs()[:, :, None] * (q.double().abs() @ keys.double().abs().T)).sum(1)
    fin = torch.isfinite(ref)
    assert bool(((got.double() - ref).abs()[fin] <= 1e-6 * mag[fin]).all())


def _check_selection(sel, scores, K):
    """sel [T, K] int32 against float64 scores [T, n] (-inf = not visible), no ties assumed."""
    T = scores.shape[0]
    assert sel.shape == (T, K) and sel.dtype == torch.int32
    for t in range(T):
        s = scores[t]
        vis = int(torch.isfinite(s).sum())
        k = min(K, vis)
        chosen = [int(i) for i in sel[t] if i >= 0]
        assert len(chosen) == k, (t, chosen, k)
        assert len(set(chosen)) == k
        assert int((sel[t] == -1).sum()) == K - k and bool((sel[t] >= -1).all())
        assert all(bool(torch.isfinite(s[i])) for i in chosen)
        true_top = set(sorted(range(len(s)), key=lambda i: -float(s[i]))[:k]) if k else set()
        assert set(chosen) == true_top


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), K=st.integers(1, 12), T=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_indexer_select_is_causal_top_k(n, K, T, seed):
    g = torch.Generator().manual_seed(seed)
    idx = make_indexer(K=K)
    pos = torch.randint(0, 4 * n + 8, (T,), generator=g)
    # distinct values per row (a random permutation, some negative): no ties, exact in float32
    scores = torch.stack([torch.randperm(n, generator=g) for _ in range(T)]).float() * 0.37 - 0.3 * n \
        if n else torch.zeros(T, 0)
    vis = torch.arange(n)[None, :] < ((pos + 1) // 4)[:, None]
    scores = scores.masked_fill(~vis, -math.inf)
    sel = idx.select(scores)
    _check_selection(sel, scores.double(), K)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 30), K=st.integers(1, 10), seed=st.integers(0, 10_000))
def test_indexer_scores_then_select_end_to_end(n, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = make_indexer(K=K, seed=seed)
    T = 6
    q = torch.randn(T, 8, 128, generator=g)
    w = torch.randn(T, 8, generator=g).abs() + 0.1
    keys = torch.randn(n, 128, generator=g)
    pos = torch.randint(0, 4 * n + 3, (T,), generator=g)
    ref = spec_scores(q, w, keys, pos)
    fin = ref[torch.isfinite(ref)].sort().values
    if len(fin) > 1 and float((fin[1:] - fin[:-1]).abs().min()) < 1e-4 * float(fin.abs().max()):
        return                                                          # near tie: set equality is moot
    _check_selection(idx.select(scores_of(idx, q, w, keys, pos)), ref, K)


def test_the_pieces_refuse_kernels_for_tensors_they_cannot_run_on():
    """The layer's own pieces run what its ops say: the Triton ops (chosen for a GPU, holding its Target) refuse
    CPU tensors with a one-line error rather than run their torch code instead."""
    from types import SimpleNamespace

    from dsv4.components.compressor import CompressPart
    from dsv4.components.layer_ops import TritonOps
    from dsv4.values.seam import RopeRows
    from dsv4.kernels.target import Target

    gpu = TritonOps(target=Target(arch="sm90", native_e4m3=True, processors=132))
    T, D = 3, 128
    rot = RopeRows(cos=torch.ones(T, 32), sin=torch.zeros(T, 32))
    x, slots, faults = torch.randn(T, 2, D), torch.zeros(T, dtype=torch.int32), torch.zeros(3, T, dtype=torch.bool)
    comp, idx = make_compressor(make_weights(4, D, 0), 4, D), make_indexer(K=4, Di=D)
    scores = torch.randn(T, 2 * comp.width)
    calls = [("front_rows", lambda: gpu.front_rows(x, x[:, 0], torch.ones(D), rot, slots, faults, None,
                                                   padded_heads=2, eps=EPS, dtype=torch.float32)),
             ("norm_rows", lambda: gpu.norm_rows(x[:, 0], torch.ones(D), eps=EPS, dtype=torch.float32)),
             ("rotate_rows", lambda: gpu.rotate_rows(x, rot)),
             ("compress", lambda: gpu.compress([CompressPart(comp, scores, None, 2, None)], None, rot, faults)),
             ("rotate_rows", lambda: idx.queries(torch.randn(T, 8 * D), rot, rotate=gpu.rotate_rows)),
             ("index_plan", lambda: gpu.index_plan(idx, SimpleNamespace(positions=slots))),
             ("index_scores", lambda: gpu.index_scores(idx, x, x[..., 0], None, None)),
             ("index_lists", lambda: gpu.index_lists(idx, scores, None))]
    for who, call in calls:
        with pytest.raises(ValueError, match=rf"^{who}: GPU tensors need TritonOps.*given TritonOps with cpu tensors$"):
            call()
