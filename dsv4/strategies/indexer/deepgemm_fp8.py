"""indexer=deepgemm_fp8: `fp4_sim`'s numerics, the keys stored as fp8 records (Fp8KeyLayout,
dsv4/strategies/indexer/key_layouts.py: 132 B per 128-dim key, pages of 64 keys as DeepGEMM's paged fp8
indexer cache), scored by `deep_gemm.fp8_paged_mqa_logits` (sm90, sm100; package sgl-deep-gemm).

The queries are `fp4_sim`'s, each head rounded to e4m3 with its own power-of-two scale (exact for FP4
values, as for the keys), the scale folded into the head's weight (ReLU(s·x) = s·ReLU(x), s > 0);
DeepGEMM's fp8 tensor-core products then sum them in its own order and precision, so near-ties may rank
differently than under `fp4_sim`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.strategies.indexer.common import FP4_NEEDS, check_top_k
from dsv4.strategies.indexer.key_layouts import Fp8KeyLayout, e4m3_queries
from dsv4.strategies.indexer.top_k.triton import TritonTopK
from dsv4.strategies.protocols import Needs, TopKStrategy


DEEPGEMM_PAGES = {"sm90": (64,), "sm100": (32, 64)}               # keys per page it reads, per arch


DEEPGEMM_HEADS = {"sm90": (32, 64), "sm100": (8, 16, 32, 64)}       # index heads it takes, per arch


def deepgemm_pages(cache):
    """The [num_blocks, B, 1, Di + 4] uint8 view fp8_paged_mqa_logits reads of a PagedCache of fp8 keys."""
    B, data = cache.block_size, cache.data
    return data.view(data.shape[0], B, 1, data.shape[1] // B)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmPlan:
    """One step's inputs of fp8_paged_mqa_logits besides the queries and keys, made once and shared by the
    step's ratio-4 layers: every token its own batch row (next_n = 1: a request's tokens stay adjacent in the
    schedule and share their key pages through L2; pairing them as next_n = 2 was slower,
    docs/notes/2026-12-02-indexer-scores.md)."""
    lens: Any               # [T, 1] int32: entries each token sees, >= 1
    table: Any              # [T, P] int32: its request's entries table (page 0 for a missing page)
    schedule: Any           # get_paged_mqa_logits_metadata over `lens`


def token_rows(*, token_request, counts, pages):
    """DeepGemmPlan's lens and table from each token's request [T], its visible entries [T] and the
    entries tables [B, P]: torch on the device, no sync (a CUDA graph captures it)."""
    # every row at least one entry, through pages that exist: a step of padding rows alone (a graph
    # capture's warm-up) made the kernel fault on the H200 without; what such rows score is never read
    lens = counts.clamp(min=1).view(-1, 1).int()
    return lens, pages.index_select(0, token_request.clamp(min=0)).clamp(min=0).int()


def deepgemm_plan(*, token_request, counts, pages, block_size: int) -> DeepGemmPlan:
    """The step's DeepGemmPlan (`token_rows` and DeepGEMM's schedule over them, in the same stream)."""
    import deep_gemm

    lens, table = token_rows(token_request=token_request, counts=counts, pages=pages)
    return DeepGemmPlan(lens=lens, table=table,
                        schedule=deep_gemm.get_paged_mqa_logits_metadata(lens, block_size, deep_gemm.get_num_sms()))


def deepgemm_scores(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float,
                    plan: DeepGemmPlan | None = None):
    """[T, >= width] float32 scores by deep_gemm.fp8_paged_mqa_logits, every token its own batch row, its
    request's block table row and its count of visible entries (the step's DeepGemmPlan; made here for a
    call without one); entries at or past the count may hold anything (the top-k reads each row's first
    `count`). q in e4m3 [T, 1, Hi, Di] is taken as `fp8_queries` makes it, w then its folded weights (the
    layer's front kernel made both); otherwise they are made here."""
    import deep_gemm
    import torch

    if not width or not q.shape[0]:
        return torch.empty(q.shape[0], width, dtype=torch.float32, device=q.device)
    if plan is None:
        plan = deepgemm_plan(token_request=token_request, counts=counts, pages=pages, block_size=keys.block_size)
    q8, wq = e4m3_queries(q, w, w_scale)
    return deep_gemm.fp8_paged_mqa_logits(q8, deepgemm_pages(keys), wq, plan.lens, plan.table, plan.schedule,
                                          width, clean_logits=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmFp8Indexer:
    """fp4_sim's queries and keys; keys stored as Fp8KeyLayout records, scored by DeepGEMM (sm90, sm100;
    package sgl-deep-gemm)."""
    name: str = "deepgemm_fp8"
    top_k: TopKStrategy = field(default_factory=TritonTopK)     # how its scores become lists on a GPU
    # near-ties ranked in DeepGEMM's summation order may swap an entry of the top-k: the layer's output
    # moves by the swapped rows' share
    error_budget: ClassVar[float] = 1e-2
    numerics: ClassVar[IndexerNumerics] = IndexerNumerics.FP4
    query_format: ClassVar[QueryFormat] = QueryFormat.E4M3

    def __post_init__(self) -> None:
        check_top_k(self)

    def needs(self, device) -> Needs:
        heads = DEEPGEMM_HEADS.get(device.arch, DEEPGEMM_HEADS["sm90"])
        return Needs(platforms=frozenset({"cuda"}), archs=frozenset(DEEPGEMM_HEADS),
                     modules=(("deep_gemm", "sgl-deep-gemm"),),
                     model_values=(("index_head_dim", 128),), model_choices=(("index_n_heads", heads),),
                     index_page_keys=frozenset(DEEPGEMM_PAGES.get(device.arch, DEEPGEMM_PAGES["sm90"])),
                     model_multiples=FP4_NEEDS.model_multiples, model_powers_of_two=FP4_NEEDS.model_powers_of_two,
                     fix="indexer=triton_fp8",
                     variance="DeepGEMM's scoring kernel has not been shown independent of the step")

    def prepare(self, *, head_dim: int, device) -> None:
        return None

    def key_layout(self, *, dtype: str, head_dim: int) -> Fp8KeyLayout:
        return Fp8KeyLayout(head_dim=head_dim)

    def plan(self, *, token_request, counts, pages, block_size: int) -> DeepGemmPlan:
        return deepgemm_plan(token_request=token_request, counts=counts, pages=pages, block_size=block_size)

    def scores(self, q, w, keys, pages, token_request, counts, *, width: int, w_scale: float,
               plan: DeepGemmPlan | None = None, prepared=None):
        return deepgemm_scores(q, w, keys, pages, token_request, counts, width=width, w_scale=w_scale, plan=plan)
