"""Compressor (DSV4_SPEC §2.4, §5.3) and lightning indexer (§2.5, §5.4) against our own float64
per-entry loops written from the spec text (nothing from `dsv4` computes an expected value)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import spec_rope_freqs, tiny_spec
from dsv4.components.compressor import Compressor
from dsv4.components.indexer import Indexer
from dsv4.components.rope import Rope

EPS = 1e-6
HID = 24


# ---- our own spec re-derivation ---------------------------------------------------------------
FREQS = spec_rope_freqs(4)


def rope_vec(v, p: int, inverse=False):
    """float64 GPT-J rotation of the last 64 dims of one vector at position p."""
    v = v.double().clone()
    ang = torch.tensor([p * f for f in FREQS], dtype=torch.float64)
    c, s = ang.cos(), ang.sin() * (-1 if inverse else 1)
    ev, od = v[-64::2].clone(), v[-63::2].clone()
    v[-64::2], v[-63::2] = ev * c - od * s, od * c + ev * s
    return v


def rms_w(v, w):
    return v * torch.rsqrt(v.square().mean() + EPS) * w


def spec_entries(x, W, R: int, D: int):
    """§5.3, one entry at a time, float64: entries 0..L//R-1 of tokens 0..L-1."""
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
        v = (A * wts).sum(0)
        out.append(rope_vec(rms_w(v, W["norm"].double()), j * R))
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


def make_compressor(W, R: int, D: int) -> Compressor:
    return Compressor(wkv=W["wkv"], wgate=W["wgate"], ape=W["ape"], norm=W["norm"], ratio=R, head_dim=D,
                      rope=Rope.for_layer(tiny_spec(), R), eps=EPS)


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
    comp = make_compressor(W, R, D)
    st0 = comp.new_state("cpu")
    ids, vals, _ = comp.step(x, 0, st0)
    assert ids.tolist() == list(range(x.shape[0] // R))
    assert vals.shape == (x.shape[0] // R, D) and vals.dtype == torch.float32
    assert rel(vals, ref) <= 1e-5
    # every entry individually (entry 0 of R=4 has no previous block)
    for j in range(len(ids)):
        assert rel(vals[j], ref[j]) <= 1e-5, j


def test_compressor_r4_entry0_pools_only_current_block():
    """j = 0: the absent previous-block rows carry no weight, so entry 0 = softmax over the 4 B halves."""
    R, D = 4, 128
    W, x, _ = case(R, D)
    comp = make_compressor(W, R, D)
    _, vals, _ = comp.step(x[:4], 0, comp.new_state("cpu"))
    xd = x[:4].double()
    a = (xd @ W["wkv"].double().T)[:, D:]
    s = (xd @ W["wgate"].double().T + W["ape"].double())[:, D:]
    v = (a * torch.softmax(s, 0)).sum(0)
    assert rel(vals[0], rope_vec(rms_w(v, W["norm"].double()), 0)) <= 1e-5
    # and entry 1 does use the previous block's first halves: dropping them changes it
    _, vals2, _ = comp.step(x[:8], 0, comp.new_state("cpu"))
    xd = x[4:8].double()
    a = (xd @ W["wkv"].double().T)[:, D:]
    s = (xd @ W["wgate"].double().T + W["ape"].double())[:, D:]
    wrong = rope_vec(rms_w((a * torch.softmax(s, 0)).sum(0), W["norm"].double()), 4)
    assert rel(vals2[1], wrong) > 1e-2


def _cuts(n: int):
    return st.lists(st.integers(1, n - 1), max_size=12, unique=True).map(sorted)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), rd=st.sampled_from([(4, 128), (128, 128), (4, 512)]))
def test_compressor_chunked_equals_whole_and_state_is_not_mutated(data, rd):
    R, D = rd
    W, x, ref = case(R, D)
    n = x.shape[0]
    cuts = data.draw(_cuts(n), label="chunk boundaries")
    comp = make_compressor(W, R, D)
    state = comp.new_state("cpu")
    got_ids, got = [], []
    for start, end in zip([0] + cuts, cuts + [n]):
        before_a, before_s = state.a.clone(), state.s.clone()
        ids, vals, new = comp.step(x[start:end], start, state)
        # the state passed in is untouched (a failed/refused step leaves the request as it was)
        assert torch.equal(state.a, before_a) and torch.equal(state.s, before_s)
        assert new is not state and new.a.data_ptr() != state.a.data_ptr()
        # the entries closed in this chunk are exactly those whose closing token jR+R-1 lies in it
        assert ids.tolist() == [j for j in range(n // R) if start <= j * R + R - 1 < end]
        # re-running the same step from the same (unmutated) state gives the same answer
        ids2, vals2, _ = comp.step(x[start:end], start, state)
        assert torch.equal(ids, ids2) and torch.equal(vals, vals2)
        got_ids += ids.tolist()
        got.append(vals)
        state = new
    assert got_ids == list(range(n // R))
    assert rel(torch.cat(got), ref) <= 1e-5


def test_compressor_failed_step_leaves_state_unchanged():
    R, D = 4, 128
    W, x, ref = case(R, D)
    comp = make_compressor(W, R, D)
    _, _, state = comp.step(x[:10], 0, comp.new_state("cpu"))
    a0, s0 = state.a.clone(), state.s.clone()
    with pytest.raises(Exception):
        comp.step(torch.randn(3, HID + 1), 10, state)      # bad input: the step fails
    assert torch.equal(state.a, a0) and torch.equal(state.s, s0)
    ids, vals, _ = comp.step(x[10:20], 10, state)          # the request continues as if nothing happened
    assert ids.tolist() == [2, 3, 4]                        # closing tokens 11, 15, 19
    assert rel(vals, ref[2:5]) <= 1e-5


@pytest.mark.parametrize("R,n", [(4, 0), (4, 3), (4, 4), (4, 11), (4, 12), (128, 127), (128, 128), (128, 255),
                                 (128, 256)])
def test_compressor_entry_count(R, n):
    W = make_weights(R, 128, seed=5)
    x = torch.randn(n, HID, generator=torch.Generator().manual_seed(n))
    ids, vals, _ = make_compressor(W, R, 128).step(x, 0, make_compressor(W, R, 128).new_state("cpu"))
    assert ids.tolist() == list(range(n // R))
    assert vals.shape == (n // R, 128)


@pytest.mark.parametrize("R,D,j", [(4, 128, 0), (4, 128, 3), (4, 128, 9), (128, 128, 0), (128, 128, 1)])
def test_compressor_entry_depends_only_on_tokens_up_to_its_close(R, D, j):
    W, x, _ = case(R, D)
    comp = make_compressor(W, R, D)
    close = j * R + R - 1
    _, base, _ = comp.step(x, 0, comp.new_state("cpu"))
    g = torch.Generator().manual_seed(j)

    def entries_with(rows):
        y = x.clone()
        y[rows] = torch.randn(len(rows), HID, generator=g)
        return comp.step(y, 0, comp.new_state("cpu"))[1]

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
                   n_heads=Hi, head_dim=Di, topk=K, rope=Rope.for_layer(tiny_spec(), 4))


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
    x, qr = torch.randn(T, HID, generator=g), torch.randn(T, 16, generator=g)
    pos = torch.tensor([0, 3, 17, 4096, 70001])
    q, w = idx.queries(x, qr, pos)
    assert q.shape == (T, Hi, Di) and w.shape == (T, Hi)
    qq = (qr.double() @ idx.wq_b.double().T).view(T, Hi, Di)
    ref_q = torch.stack([torch.stack([rope_vec(qq[t, h], int(pos[t])) for h in range(Hi)]) for t in range(T)])
    assert torch.equal(q[..., :64], qq[..., :64].float()) or rel(q[..., :64], qq[..., :64]) <= 1e-6
    assert rel(q, ref_q) <= 1e-5
    ref_w = (x.double() @ idx.weights_proj.double().T) * Di ** -0.5 * Hi ** -0.5
    assert rel(w, ref_w) <= 1e-6


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 20), T=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_indexer_scores_match_spec(n, T, seed):
    g = torch.Generator().manual_seed(seed)
    idx = make_indexer(K=4)
    q = torch.randn(T, 8, 128, generator=g)
    w = torch.randn(T, 8, generator=g)
    keys = torch.randn(n, 128, generator=g)
    pos = torch.randint(0, 4 * n + 8, (T,), generator=g)
    got = idx.scores(q, w, keys, pos)
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
    pos = torch.randint(0, 4 * n + 4, (T,), generator=g)
    ref = spec_scores(q, w, keys, pos)
    fin = ref[torch.isfinite(ref)].sort().values
    if len(fin) > 1 and float((fin[1:] - fin[:-1]).abs().min()) < 1e-4 * float(fin.abs().max()):
        return                                                          # near tie: set equality is moot
    _check_selection(idx.select(idx.scores(q, w, keys, pos)), ref, K)
