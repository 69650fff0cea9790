"""indexer=deepgemm_fp8 and indexer=triton_fp8: `fp4_sim`'s numerics, the keys stored as fp8 records.

One key of Di dims is Di e4m3 bytes and one float32 scale (132 B for the 128-dim keys of DSV4): the
bf16-rounded key divided by its scale 2^ceil(log2(max(amax, 1e-4) / 448)) -- a power of two, as the
fp8_ds_mla records' --, rounded to e4m3. A page of B keys holds its B code rows first, then its B scales:
DeepGEMM's paged fp8 indexer cache ([num_blocks, B, 1, Di + 4] as `fp8_paged_mqa_logits` reads it, B = 64
on sm90). The keys being FP4-simulated (e2m1 values times a power of two per 32 dims), the power-of-two
scale keeps them exactly wherever a block's scale is within 2^-13 of the key's largest -- every key the
model makes in practice -- so both options score `fp4_sim`'s keys.

The queries are `fp4_sim`'s too. `deepgemm_fp8` rounds each head to e4m3 with its own power-of-two scale
(exact for FP4 values, as for the keys) and folds the scale into the head's weight (ReLU(s·x) = s·ReLU(x),
s > 0); DeepGEMM's fp8 tensor-core products then sum them in its own order and precision, so near-ties
may rank differently than under `fp4_sim`. `triton_fp8`, for GPUs without DeepGEMM, takes the same e4m3
queries and folded weights to our Triton kernel, which multiplies them with the records' e4m3 bytes on
the tensor cores as they are stored (NVIDIA sm89+; elsewhere both decoded to their bf16 values) and
sums the exact products in float32 -- on the H200 bit for bit what `fp4_sim`'s bf16 values give.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dsv4.formats.row_format import FP8_KEYS, RowFormat
from dsv4.strategies import key_records
from dsv4.strategies.fp8_layouts import E4M3_MAX
from dsv4.strategies.indexer import (
    FP4_NEEDS,
    fp4_keys,
    fp4_needs,
    fp4_queries,
    no_plan,
    no_prepare,
    pow2_ceil,
)
from dsv4.strategies.protocols import Needs
from dsv4.strategies.top_k import DEFAULT_TOP_K, check_top_k

AMAX_MIN = 1e-4                 # the smallest amax a scale is taken from (a zero key: scale 2^-22)
DEEPGEMM_PAGES = {"sm90": (64,), "sm100": (32, 64)}               # keys per page it reads, per arch
DEEPGEMM_HEADS = {"sm90": (32, 64), "sm100": (8, 16, 32, 64)}       # index heads it takes, per arch


def pow2_e4m3(x):
    """x float32 [..., Di] -> (x over its power-of-two fp8 scale, rounded to e4m3, and that scale [..., 1]
    float32: 2^ceil(log2(max(amax, 1e-4) / 448)) over the last dim; x / scale is exact)."""
    import torch

    s = pow2_ceil(x.abs().amax(-1, keepdim=True).clamp_min(AMAX_MIN) / E4M3_MAX)
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp8KeyLayout:
    """uint8 pages [num_blocks, B·(Di + 4)] of fp8 key records (the module docstring)."""
    name: str = "fp8"
    error_budget: ClassVar[float] = 0.0      # the values of FP4-simulated keys, exactly
    head_dim: int = 128

    @property
    def row_format(self) -> RowFormat:
        return FP8_KEYS

    @property
    def data_bytes(self) -> int:
        return self.head_dim

    @property
    def scale_bytes(self) -> int:
        return 4

    # the record layouts' shared methods (dsv4/strategies/key_records.py)
    needs, bytes_per_token, page_bytes = key_records.needs, key_records.bytes_per_token, key_records.page_bytes
    allocate, write, read = key_records.allocate, key_records.write, key_records.read

    def pack(self, rows):
        """[N, Di] -> (e4m3 bytes [N, Di] uint8, the float32 scales' bytes [N, 4] uint8), from the
        bf16-rounded rows."""
        import torch

        q, s = pow2_e4m3(rows.bfloat16().float())
        return q.view(torch.uint8), s.flatten().contiguous().view(torch.uint8).view(*s.shape[:-1], 4)

    def unpack(self, data, scales):
        """(data [..., Di], scales [..., 4]) -> [..., Di] float32."""
        import torch

        return data.contiguous().view(torch.float8_e4m3fn).float() * scales.contiguous().view(torch.float32)

    def kernel_store(self, cache, block_size: int):
        """On a GPU, the compress kernel stores the keys as these records (dsv4/kernels/cache_write.py)."""
        if not cache.is_cuda:
            return None
        from dsv4.kernels.cache_write import fp8_key_store
        return fp8_key_store(cache, block_size, self.head_dim)


def deepgemm_pages(cache):
    """The [num_blocks, B, 1, Di + 4] uint8 view fp8_paged_mqa_logits reads of a PagedCache of fp8 keys."""
    B, data = cache.block_size, cache.data
    return data.view(data.shape[0], B, 1, data.shape[1] // B)


def fp8_queries(q, w, w_scale: float):
    """q [T, Hi, Di] (FP4-simulated values) and head weights w [T, Hi] -> (q in e4m3 [T, 1, Hi, Di], each
    head divided by its power-of-two scale; the weights times w_scale and that scale [T, Hi] float32). The
    specification of the GPU's one launch (dsv4/kernels/fp8_queries.py)."""
    q8, s = pow2_e4m3(q.float())
    return q8.unsqueeze(1), (w.float() * w_scale) * s.squeeze(-1)


def e4m3_queries(q, w, w_scale: float):
    """(q8, wq) as `fp8_queries` makes them (one launch: dsv4/kernels/fp8_queries.py), or q and w as they
    are where q is already e4m3 (the layer's front kernel made both, w_scale folded in)."""
    import torch

    from dsv4.kernels.fp8_queries import fp8_queries_kernel

    return (q, w) if q.dtype == torch.float8_e4m3fn else fp8_queries_kernel(q, w, w_scale)


def triton_fp8_scores(q, w, keys, pages, token_request, counts, *, width: int, w_scale: float, plan=None):
    """The step's scores by our Triton kernel (dsv4/kernels/indexer_logits.py): e4m3 queries, their scales
    in the head weights, against the fp8 records as stored (no per-step plan)."""
    from dsv4.kernels.indexer_logits import indexer_logits

    q8, wq = e4m3_queries(q, w, w_scale)
    return indexer_logits(q8, wq, keys, pages, token_request, counts, width=width)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepGemmPlan:
    """One step's inputs of fp8_paged_mqa_logits besides the queries and keys, made once and shared by the
    step's ratio-4 layers: every token its own batch row (next_n = 1; pairing a request's two tokens as
    next_n = 2 measured slower on the H200, 113 µs against 83 at 128k: docs/benchmarks.md)."""
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
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    # near-ties ranked in DeepGEMM's summation order may swap an entry of the top-k: the layer's output
    # moves by the swapped rows' share
    error_budget: ClassVar[float] = 1e-2
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = True
    scores, prepare = staticmethod(deepgemm_scores), no_prepare
    queries, keys = fp4_queries, fp4_keys

    def needs(self, device) -> Needs:
        heads = DEEPGEMM_HEADS.get(device.arch, DEEPGEMM_HEADS["sm90"])
        return Needs(platforms=frozenset({"cuda"}), archs=frozenset(DEEPGEMM_HEADS),
                     modules=(("deep_gemm", "sgl-deep-gemm"),),
                     model_values=(("index_head_dim", 128),), model_choices=(("index_n_heads", heads),),
                     index_page_keys=frozenset(DEEPGEMM_PAGES.get(device.arch, DEEPGEMM_PAGES["sm90"])),
                     model_multiples=FP4_NEEDS["model_multiples"], model_powers_of_two=FP4_NEEDS["model_powers_of_two"],
                     fix="indexer=triton_fp8")

    def key_layout(self, *, dtype: str, head_dim: int):
        return Fp8KeyLayout(head_dim=head_dim)

    def plan(self, *, token_request, counts, pages, block_size: int) -> DeepGemmPlan:
        return deepgemm_plan(token_request=token_request, counts=counts, pages=pages, block_size=block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class TritonFp8Indexer:
    """fp4_sim's queries and keys; keys stored as Fp8KeyLayout records, scored by our Triton kernel (e4m3
    queries as deepgemm_fp8's)."""
    name: str = "triton_fp8"
    top_k: str = DEFAULT_TOP_K                # how the scores become lists on a GPU (top_k.TOP_K)
    __post_init__ = check_top_k
    # the exact values of fp4_sim's queries and keys, their exact products summed in float32 (the e4m3
    # tensor cores' sums equal the bf16 ones' bit for bit on the H200: tests/test_gpu_layer.py)
    error_budget: ClassVar[float] = 0.0
    transforms: ClassVar[bool] = True
    fp4: ClassVar[bool] = True
    oracle_numerics: ClassVar[str] = "fp4"
    fp8_queries: ClassVar[bool] = True
    scores, prepare, plan = staticmethod(triton_fp8_scores), no_prepare, no_plan
    queries, keys, needs = fp4_queries, fp4_keys, fp4_needs

    def key_layout(self, *, dtype: str, head_dim: int):
        return Fp8KeyLayout(head_dim=head_dim)

