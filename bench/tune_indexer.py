"""The ratio-4 layer's indexer on a GPU: scores (float32 keys with tf32x3 products, bf16 keys with a bf16
product, FP4 records -- indexer=mxfp4 -- decoded to bf16 as they are read, fp8 records against e4m3
queries -- indexer=triton_fp8's e4m3 product --, and the fp8 records scored by DeepGEMM --
indexer=deepgemm_fp8 -- where it runs) and the top-k lists (our radix select at several launch shapes,
torch.topk and, where installed, FlashInfer's beside it), each timed alone in a CUDA graph on a decode
step of 64 requests x 2 tokens (64 heads of 128 dims, K = 512) at 8k and 64k contexts (or those given),
then scores + top-k together per kind of keys. Every variant is checked against its reference before it
is timed: our kernel's scores of records equal those of bf16 rows holding the values the records decode
to (FP4 records: bit for bit; fp8 records against e4m3 queries: within 1e-6, as these random keys are not
FP4-simulated; DeepGEMM's: their relative error is shown).

  python bench/tune_indexer.py
  python bench/tune_indexer.py --contexts 8192 131072 --shipped     # the shipped launch shapes only
  python bench/tune_indexer.py --contexts 8192 65536 131072 --shipped --top-k-only

The shipped launch shapes (dsv4/kernels/indexer/indexer_logits.py, dsv4/kernels/indexer/topk_lists.py) come from this sweep.
"""
from __future__ import annotations

import torch

from dsv4.speed.timing import graph_time_us
from dsv4.values.seam import PagedCache
from dsv4.speed.gpu import require_gpu
from dsv4.speed.scorers import as_bf16_rows, stored_keys
from dsv4.oracle import rel_err
from dsv4.reports.report import table
from dsv4.values.sizes import cdiv
from dsv4.strategies import Fp8KeyLayout, Mxfp4KeyLayout, PlainRowLayout

NREQ, TOKENS, HEADS, DIM, K, BS = 64, 2, 64, 128, 512, 64
SCORE_SHAPES = [dict(), dict(stages=1), dict(num_warps=8), dict(blocks_per_program=8), dict(stages=3)]
TOPK_SHAPES = [dict(), dict(num_warps=4), dict(num_warps=8), dict(num_warps=16), dict(sample=1024), dict(sample=4096),
               dict(warp_cols=256)]


def case(context: int, dtype):
    g = torch.Generator(device="cuda").manual_seed(context)
    entries = context // 4 + 1
    P = cdiv(entries, BS)
    pages = torch.randperm(NREQ * P, device="cuda", generator=g).view(NREQ, P).int()
    data = (torch.randn(NREQ * P, BS, DIM, device="cuda", generator=g) / 4).to(dtype)
    keys = PagedCache(name="indexer", layout=PlainRowLayout(name=str(dtype), dtype=str(dtype).split(".")[1]),
                      data=data, block_size=BS, head_dim=DIM)
    T = NREQ * TOKENS
    req = torch.arange(NREQ, device="cuda").repeat_interleave(TOKENS)
    pos = context + torch.arange(TOKENS, device="cuda").repeat(NREQ)
    counts = ((pos + 1) // 4).int()
    q = torch.randn(T, HEADS, DIM, device="cuda", generator=g)
    w = torch.randn(T, HEADS, device="cuda", generator=g) * (DIM * HEADS) ** -0.5
    return q, w, keys, pages, req, counts, int(counts.max())


def record_keys(keys, lay):
    """`keys` as records of `lay` (FP4 or fp8 pages), and bf16 rows of the values the records hold (their
    reference)."""
    records = stored_keys(lay, keys.data.float())
    return records, as_bf16_rows(records)


def deepgemm():
    """deepgemm_fp8's scoring, or None where DeepGEMM cannot run here."""
    try:
        import deep_gemm  # noqa: F401

        from dsv4.strategies.indexer.deepgemm_fp8 import deepgemm_scores
    except Exception:  # noqa: BLE001 -- a broken install is as absent
        return None
    major = torch.cuda.get_device_capability()[0]
    return deepgemm_scores if major in (9, 10) else None


def vendor_scorer(vendor):
    """A vendor's scoring called as indexer_logits is (head weights unscaled)."""
    def scores(q, w, keys, pages, req, counts, *, width):
        return vendor(q, w, keys, pages, req, counts, width=width, w_scale=1.0)
    return scores


# keys as each indexer option stores them: (name, plain row dtype or record layout, scoring)
def key_kinds():
    kinds = [("float32", torch.float32, None), ("bfloat16", torch.bfloat16, None),
             ("mxfp4", Mxfp4KeyLayout(head_dim=DIM), None), ("fp8", Fp8KeyLayout(head_dim=DIM), None)]
    dg = deepgemm()
    if dg is not None:
        kinds.append(("fp8 deepgemm", Fp8KeyLayout(head_dim=DIM), dg))
    return kinds


def flashinfer_topk_rows(context: int, scores, counts, pages, req, want) -> list:
    """FlashInfer's top-k where it is installed: indexer.top_k=flashinfer (its deterministic ragged
    transform, then our page lookup) and, measured and left out, its page-table transform (one slot per
    entry, from a table made here) and both forms without determinism -> rows as main()'s."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        return []
    import flashinfer

    from dsv4.strategies.indexer.top_k.flashinfer import PREFER_LOWER_INDEX, FlashInferTopK

    T, width = scores.shape
    ent = torch.arange(width, device="cuda")
    table = (pages[:, ent // BS] * BS + ent % BS).int().contiguous()      # each entry's slot
    zeros = torch.zeros(T, dtype=torch.int32, device="cuda")
    variants = {
        "indexer.top_k=flashinfer": lambda: FlashInferTopK()(scores, counts, pages, req, topk=K, block_size=BS)[0],
        "FlashInfer ragged, non-deterministic":
            lambda: flashinfer.top_k_ragged_transform(scores, zeros, counts, K),
        "FlashInfer page table, deterministic": lambda: flashinfer.top_k_page_table_transform(
            scores, table, counts, K, row_to_batch=req.int(), tie_break=PREFER_LOWER_INDEX),
        "FlashInfer page table, non-deterministic": lambda: flashinfer.top_k_page_table_transform(
            scores, table, counts, K, row_to_batch=req.int()),
    }
    want_slots = table[req].gather(1, want.long()).sort(dim=-1).values
    rows = []
    for name, fn in variants.items():
        got = fn().sort(dim=-1).values
        ok = torch.equal(got, want_slots if "page table" in name else want)
        rows.append([context, name, graph_time_us(fn), ok])
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="*", type=int, default=[8192, 65536])
    ap.add_argument("--shipped", action="store_true", help="the shipped launch shapes only")
    ap.add_argument("--top-k-only", action="store_true", help="the top-k table alone (float32-key scores)")
    a = ap.parse_args()
    require_gpu("bench/tune_indexer.py")
    from dsv4.kernels.indexer.fp8_queries import fp8_queries_kernel       # Triton: only once the GPU is known
    from dsv4.kernels.indexer.indexer_logits import indexer_logits
    from dsv4.kernels.indexer.topk_lists import topk_lists

    shapes = SCORE_SHAPES[:1] if a.shipped else SCORE_SHAPES
    rows, topk_rows, step_rows = [], [], []
    for context in a.contexts:
        ref = None
        for name, kind, vendor in key_kinds() if not a.top_k_only else [("float32", torch.float32, None)]:
            plain = isinstance(kind, torch.dtype)
            q, w, keys, pages, req, counts, width = case(context, kind if plain else torch.bfloat16)
            ours = indexer_logits
            if name == "fp8":                    # triton_fp8's queries: e4m3 heads, their scales in the weights
                q8, w8 = fp8_queries_kernel(q, w, 1.0)
                q, w = q8.squeeze(1), w8
            if not plain:
                keys, twin = record_keys(keys, kind)
                base = indexer_logits(q.float() if name == "fp8" else q, w, twin, pages, req, counts, width=width)
                out = indexer_logits(q, w, keys, pages, req, counts, width=width)
                fin = torch.isfinite(base)
                # FP4 records: their bf16 values' scores bit for bit; fp8 records of these random (not
                # FP4-simulated) keys: the e4m3 product's sums may round otherwise
                same = torch.equal(base, out) if name == "mxfp4" else rel_err(out[fin], base[fin]) <= 1e-6
                if vendor is None and not same:
                    raise SystemExit(f"{name} records at context {context}: scores differ from their bf16 values'")
                del twin
            else:
                base = indexer_logits(q, w, keys, pages, req, counts, width=width)
            if name == "float32":
                ref = base
            if vendor is not None:
                ours = vendor_scorer(vendor)
            for shape in shapes[:1] if vendor is not None else shapes:
                out = ours(q, w, keys, pages, req, counts, width=width, **shape)
                fin = torch.isfinite(base)
                err = rel_err(out[fin], base[fin])
                us = graph_time_us(lambda: ours(q, w, keys, pages, req, counts, width=width, **shape))
                key_bytes = keys.page_bytes // BS
                rows.append([context, name, str(shape or "shipped"), us, key_bytes * NREQ * width / us / 1e3, err,
                             rel_err(out[fin], ref[fin])])
            step_us = graph_time_us(lambda: topk_lists(ours(q, w, keys, pages, req, counts, width=width), counts,
                                                       pages, req, topk=K, block_size=BS))
            step_rows.append([context, name, step_us])
        scores = ref
        topk_us = graph_time_us(lambda: scores.topk(K, dim=-1))
        want = scores.topk(K, dim=-1).indices.sort(dim=-1).values.int()
        topk_rows.append([context, "torch.topk (values, indices)", topk_us, True])
        for shape in TOPK_SHAPES[:1] if a.shipped else TOPK_SHAPES:
            local, _slots, lens = topk_lists(scores, counts, pages, req, topk=K, block_size=BS, **shape)
            ok = bool((lens == K).all()) and torch.equal(local.sort(dim=-1).values, want)
            us = graph_time_us(lambda: topk_lists(scores, counts, pages, req, topk=K, block_size=BS, **shape))
            topk_rows.append([context, f"topk_lists {shape or 'shipped'}", us, ok])
        topk_rows += flashinfer_topk_rows(context, scores, counts, pages, req, want)
    print(f"indexer scores, {NREQ} requests x {TOKENS} tokens, {HEADS} heads x {DIM}, CUDA graph (µs; records:"
          " rel err vs bf16 rows of their values):")
    print(table(["context", "keys", "launch", "µs", "key GB/s", "rel err vs shipped", "rel err vs float32 keys"],
                rows))
    print(f"\ntop-{K} lists over the float32-key scores, {NREQ * TOKENS} rows (same set as torch.topk):")
    print(table(["context", "kernel", "µs", "same set"], topk_rows))
    print(f"\nscores + top-{K} lists in one graph, by the keys each indexer option stores (µs):")
    print(table(["context", "keys", "µs"], step_rows))


if __name__ == "__main__":
    main()
