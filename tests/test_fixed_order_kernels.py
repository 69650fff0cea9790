"""Our Triton kernels under batch_invariant=true (Target.fixed_order): a row's product, a token's indexer scores
and a token's attention are bit for bit the same whatever else is in the call -- alone, among others in any
order, repeated, in a step large enough for the prefill launches, with its lists padded wider. Interpreted on
the CPU (small shapes: the launch logic and the chunking), compiled on a GPU (marked gpu: the arithmetic of
the real launches). The layer-level property: tests/test_batch_invariant.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.triton_mode import BIG, DEVICE, GPU, INTERPRET, MARK

from dsv4.kernels.target import target_of

pytestmark = MARK


def fixed():
    """This machine's Target with the fixed launches."""
    return replace(target_of(torch.device(DEVICE)), fixed_order=True)


def steps(T: int, big: int, seed: int) -> list[torch.Tensor]:
    """Row selections of a call of T rows: each alone, all reversed, and `big` rows drawn with repeats."""
    g = torch.Generator().manual_seed(seed)
    return [torch.tensor([t]) for t in range(T)] + [torch.arange(T).flip(0), torch.randint(0, T, (big,), generator=g)]


# ---- our fp8 product ---------------------------------------------------------------------------------------
FP8 = not INTERPRET and not torch.version.hip and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not INTERPRET and not FP8, reason="needs NVIDIA fp8 tensor cores (sm89+)")
@pytest.mark.parametrize("N,K", [(128, 2048)] + ([(1536, 4096), (4096, 8192), (40960, 1024)] if BIG else []))
def test_a_product_row_is_the_same_in_any_step(N, K):
    """Up to FEW_ROWS rows quantized inside the product, more by their own launch first, more than the counters
    hold in several launches: every row's result the same bits."""
    from dsv4.formats.fp8_blocks import quantize_blocks
    from dsv4.kernels.products.fp8_linear import fp8_linear

    g = torch.Generator().manual_seed(N + K)
    b = quantize_blocks(torch.randn(N, K, generator=g) * K ** -0.5)
    w, ws = b.weight.to(DEVICE), b.scale.to(DEVICE)
    M = 40 if not BIG else 300
    x = (torch.randn(M, K, generator=g) * 3).bfloat16().to(DEVICE)
    tgt = fixed()
    want = fp8_linear(x, w, ws, target=tgt)
    for rows in steps(M, 600 if not BIG else 5000, seed=N)[::7 if not BIG else 31] + steps(M, 600, 1)[-2:]:
        got = fp8_linear(x[rows.to(DEVICE)], w, ws, target=tgt)
        assert torch.equal(got, want[rows.to(DEVICE)]), len(rows)


@pytest.mark.skipif(not INTERPRET and not FP8, reason="needs NVIDIA fp8 tensor cores (sm89+)")
def test_a_split_added_inside_the_programs_gives_the_split_launchs_sums():
    """`inline` (where the tiles alone fill the GPU): each program adds the split's parts itself, in split
    order -- the same bits as the parts spread over programs and added by the tile's last one."""
    from dsv4.formats.fp8_blocks import quantize_blocks
    from dsv4.kernels.products.fp8_linear import fp8_linear

    g = torch.Generator().manual_seed(5)
    b = quantize_blocks(torch.randn(256, 2048, generator=g) * 0.05)
    w, ws = b.weight.to(DEVICE), b.scale.to(DEVICE)
    x = (torch.randn(70, 2048, generator=g) * 3).bfloat16().to(DEVICE)
    for split in (2, 4):
        spread = fp8_linear(x, w, ws, target=fixed(), split=split, inline=False, out_dtype=torch.float32)
        inline = fp8_linear(x, w, ws, target=fixed(), split=split, inline=True, out_dtype=torch.float32)
        assert torch.equal(inline, spread), split


def test_the_fixed_launch_keeps_its_split_and_takes_a_warpgroup_tile_only_on_hopper():
    """The K split is the weight's alone at every row count; the tile follows the rows only where a row's
    sums are the same in any tile (warpgroup MMAs of 64 rows and more, sm90)."""
    from dsv4.kernels.products.fp8_linear import FIXED_M, fixed_launch, fixed_plan, plan
    from dsv4.kernels.target import Target

    for arch in ("sm90", "sm89", "sm100"):
        tgt = Target(arch=arch, native_e4m3=True, processors=132, fixed_order=True)
        for N, K in ((1536, 4096), (40960, 1024), (4096, 8192)):
            for M in (1, 16, 64, 256, 8192):
                p, q, fixed_p = fixed_launch(M, N, K, tgt), plan(M, N, K, tgt), fixed_plan(N, K, tgt)
                assert p.split == fixed_p.split and p.quantize_first
                tile = (q.block_m, q.block_n) if arch == "sm90" and q.block_m >= FIXED_M and q.split == 1 else \
                    (fixed_p.block_m, fixed_p.block_n)
                assert (p.block_m, p.block_n) == tile, (arch, N, K, M)


def test_the_hopper_kernel_merges_inside_its_programs_only_where_the_spread_runs_overflow_the_gpu():
    from dsv4.kernels.mqa.sparse_plan import FIXED_SPLITS, fixed_inline

    assert FIXED_SPLITS == 2
    assert fixed_inline(67, 64, FIXED_SPLITS, 132) and fixed_inline(34, 128, FIXED_SPLITS, 132)
    assert not fixed_inline(66, 64, FIXED_SPLITS, 132)
    assert not fixed_inline(512, 32, FIXED_SPLITS, 132)      # programs of 32 heads: the few-heads kernel
    assert not fixed_inline(512, 64, 1, 132)


# ---- the indexer's scores ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tokens_scores_are_the_same_in_any_step(dtype):
    """A token's row of scores, whatever tokens share its call and its program, at any width."""
    from dsv4.kernels.indexer.indexer_logits import PREFILL_TOKENS, indexer_logits
    from tests.test_layer_kernels import INDEXER_SPANS, dev, indexer_case

    q, w, keys, plan, idx = indexer_case(INDEXER_SPANS, 8, 64, seed=5, dtype=dtype)
    keys = replace(keys, data=dev(keys.data))
    ents = plan.entries[4]
    pages, req, counts = dev(ents.table.pages), dev(plan.token_request), dev(ents.counts)
    tgt = fixed()

    def scores(rows, width):
        r = rows.to(DEVICE)
        return indexer_logits(dev(q)[r], dev(w)[r], keys, pages, req[r], counts[r], width=width,
                              w_scale=idx.weight_scale, target=tgt)

    T = plan.num_tokens
    want = scores(torch.arange(T), ents.width)
    for rows in steps(T, PREFILL_TOKENS + 10 if BIG else 9, seed=2):
        for width in (ents.width, ents.width + 37):
            got = scores(rows, width)
            assert torch.equal(got[:, :ents.width], want[rows.to(DEVICE)]), (len(rows), width)
            assert bool(torch.isinf(got[:, ents.width:]).all())


# ---- the sparse MQA ----------------------------------------------------------------------------------------
VARIANTS = ["two_pass"] + (["hopper"] if GPU and torch.cuda.get_device_capability() == (9, 0) else [])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layer", ["swa", "c4a", "c128a"])
@pytest.mark.parametrize("H", [64] + ([8, 128] if BIG else []))
def test_a_tokens_attention_is_the_same_in_any_step(variant, layer, H):
    """A token's output and lse, whatever tokens share its call, with its lists padded wider, in a step of
    many tokens: the Hopper kernel's runs of blocks are its own lists' and are always merged (by split_combine
    in a small step, inside its programs in a large one); the two-pass kernel takes one launch."""
    from dsv4.kernels.mqa.sparse_mqa import sparse_mqa
    from tests.test_triton_sparse import LAYER_TYPES, SCALE, case

    T = 5 if not BIG else 40
    q, kv, sink = case(T, H, LAYER_TYPES[layer], seed=H)
    tgt = fixed()

    def attend(rows, pad: int):
        r = rows.to(DEVICE)

        def lists(idx, lens):
            idx = idx[r]
            return torch.cat((idx, idx.new_full((len(r), pad), -1)), 1).contiguous(), lens[r].contiguous()

        extra = {}
        if kv.extra is not None:
            ei, el = lists(kv.extra_indices, kv.extra_lens)
            extra = dict(extra_indices=ei, extra_lens=el)
        si, sl = lists(kv.swa_indices, kv.swa_lens)
        rows_kv = replace(kv, swa_indices=si, swa_lens=sl, runs=None, extra_nested=False, **extra)
        return sparse_mqa(q[r].contiguous(), rows_kv, sink=sink, scale=SCALE, variant=variant, target=tgt)

    out, lse = attend(torch.arange(T), 0)
    for rows in steps(T, 7 if not BIG else 700, seed=3):
        for pad in (0, 64):
            o, l = attend(rows, pad)
            r = rows.to(DEVICE)
            assert torch.equal(o, out[r]) and torch.equal(l, lse[r]), (len(rows), pad)
