"""mqa_kernel=aiter_sparse: AMD's aiter MLA decode (PyPI amd-aiter, import aiter; ROCm only).

Targeted at amd-aiter 0.1.7.post2.dev18 (the release on PyPI when this was written; its wheel's Python
sources were read). NOT RUN ON AMD HARDWARE: what is tested, on the CPU, is the marshalling, against a
torch model of the functions' contracts (tests/test_aiter_marshalling.py).

That release has no DeepSeek-V4 kernel (aiter's V4 decode for gfx950, "v40", came later upstream) and no
attention sink anywhere. What it has, and what this uses:

* `aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
  max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None, ...)`: DeepSeek-V3's absorbed-MLA
  decode (ASM stage 1 + Triton reduce), which vLLM also runs as V3.2's sparse decode with pages of one
  token. q [B, H, 576] and kv_buffer [N, 1, 1, 576] (bf16 here), per batch row b the KV rows
  kv_indices[kv_indptr[b] : kv_indptr[b+1]] (ragged CSR; page size 1, so kv_last_page_lens = 1);
  logits = sm_scale · q·k over all 576 dims, V = the first 512 dims of a row, o [B, H, 512] bf16. In
  non-persistent mode its bf16 kernels take 16 or 128 heads (`get_meta_param` asserts it).
* `aiter.dtypes.fp8`: float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950.

How V4 (512-dim rows, V = K, a sink per head) goes through the V3-shaped MLA decode:

* A row sits in the 576-wide record as [its 512 dims | 64 more]. For cache rows the 64 are zero, so
  q·k is V4's and V (the first 512) is the whole row.
* The sink is one more key, row 0 of the buffer: zero in its first 512 dims (it adds nothing to the
  output) and 1 in dims 512..514, where each head's query carries sink_h / sm_scale split over three
  bf16 values (their sum keeps ~24 bits). That key's logit is the head's sink, so the kernel's softmax
  is §2.7's: the sink in the denominator only; a query with no row gets 0. Sinks beyond ±SINK_LIMIT
  (±inf on padded heads) are clamped: exp() of it against any real logit is 0 or dominant either way.
* The kernel reads bf16 (or per-tensor-scaled fp8) rows, not the fp8_ds_mla record: each row a call
  attends to is decoded once from the pages into a bf16 buffer (exact: an e4m3 value times a power of
  two fits bf16), as vLLM's ROCm path gathers rows for prefill. The e4m3 NoPE bytes are decoded as
  `aiter.dtypes.fp8`, the device's fp8 type, so on gfx942 the caches must hold FNUZ bytes
  (cache_layout=fp8_ds_mla_fnuz) and on gfx950 OCP bytes (fp8_ds_mla); check() refuses the other.
* Every query token is a batch row of its own (qo_indptr = 0..T, max_seqlen_q = 1), prefill tokens
  too. 128 heads go as they are; other multiples of 16 as rows of 16 heads sharing their token's KV
  list (what the persistent mode does internally). Other head counts: head_padding=buckets_mult16.
* Non-persistent mla_decode_fwd fills no log-sum-exp it returns, so the lse is None (the layer does not
  use it), as for flashinfer_sparse.

Everything but `__call__` is pure marshalling, importable and testable without aiter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dsv4.formats.fp8_ds_mla import decode_records, record_offsets
from dsv4.formats.index_lists import attended, distinct_rows
from dsv4.formats.row_format import FP8_DS_MLA, FP8_DS_MLA_FNUZ
from dsv4.strategies.protocols import Needs
from dsv4.values.seam import SparseKV


AITER_VERSION = "0.1.7.post2.dev18"


FP8_FORMAT = {"gfx942": "fnuz", "gfx950": "ocp"}                 # aiter's dtypes.fp8 per arch


RECORD = {"fnuz": FP8_DS_MLA_FNUZ, "ocp": FP8_DS_MLA}           # the rows holding that flavour


TORCH_FP8 = {"fnuz": "float8_e4m3fnuz", "ocp": "float8_e4m3fn"}


D, QK_DIM = 512, 576                                            # V4 rows; aiter's MLA record (512 + 64)


SINK_DIMS = (512, 513, 514)                                     # where the sink key and term live


SINK_LIMIT = 1.0e4


PADDED_HEADS = frozenset(range(16, 129, 16))


NATIVE_HEADS = 128                                              # heads one kernel row takes besides 16


def format_of(dtype) -> str | None:
    """"ocp" / "fnuz" for a torch fp8 dtype (aiter's dtypes.fp8 is uint8 on other GPUs: None)."""
    return {v: k for k, v in TORCH_FP8.items()}.get(str(dtype).removeprefix("torch."))


# ---- pages -> rows ------------------------------------------------------------------------------------
def decode_record_rows(pages, slots, *, block_size: int, fp8):
    """Rows of fp8_ds_mla-geometry pages [num_blocks, page_bytes] uint8 at `slots` (>= 0), their 448
    NoPE bytes decoded as the torch dtype `fp8` times 2^(exponent byte - 127) per 64 dims, their 64
    RoPE dims as bf16 -> [n, 512] float32. Byte for byte §3.2; the flavour is the caller's to pick."""
    di, si = record_offsets(pages, slots, block_size)
    flat = pages.reshape(-1)
    return decode_records(flat[di], flat[si], fp8)


def read_rows(cache, slots, *, fmt: str):
    """`cache`'s rows at `slots`, decoded the way this device's aiter reads fp8 (`fmt`). Refuses a
    cache whose bytes are another record or the other e4m3 flavour: read as `fmt` they would be worth
    half or twice their value (and FNUZ 0x80 is NaN)."""
    row, want = cache.layout.row_format, RECORD[fmt]
    if row.kind is not want.kind:
        raise ValueError(f"mqa_kernel=aiter_sparse reads fp8_ds_mla pages, the {cache.name} cache is "
                         f"{cache.layout.name} (check() refuses this); fix: cache_layout={want.label}")
    if row != want:
        raise ValueError(f"mqa_kernel=aiter_sparse decodes e4m3 as {TORCH_FP8[fmt]} on this device; the "
                         f"{cache.name} cache holds {row.label} bytes (check() refuses this); fix: "
                         f"cache_layout={want.label}")
    return cache.read(slots)


# ---- index marshalling --------------------------------------------------------------------------------
def mla_buffer(kv: SparseKV, ids, *, fmt: str):
    """The kv_buffer [N + 1, 1, 1, 576] bf16 and each entry's row in it ([T, W] int32, -1 kept):
    row 0 is the sink key (zeros, then 1 at SINK_DIMS), rows 1.. the distinct rows `ids` names, each
    decoded once: its 512 dims, then 64 zeros."""
    buf, rows = distinct_rows(kv, ids, width=QK_DIM, lead=1, read=lambda cache, slots: read_rows(cache, slots, fmt=fmt))
    buf[0, list(SINK_DIMS)] = 1.0
    return buf.view(-1, 1, 1, QK_DIM), rows


def head_rows(heads: int) -> tuple[int, int]:
    """(kernel rows per query token, heads per kernel row): 128 heads as one row, other multiples of
    16 as rows of 16 heads."""
    if heads == NATIVE_HEADS:
        return 1, NATIVE_HEADS
    if heads in PADDED_HEADS:
        return heads // 16, 16
    raise ValueError(f"mqa_kernel=aiter_sparse runs 16 or 128 heads per kernel row (heads per rank a multiple "
                     f"of 16 up to 128), got {heads} (check() refuses this); fix: head_padding=buckets_mult16")


def ragged(rows, counts, per_token: int) -> dict[str, Any]:
    """CSR arguments: each query token's list is [0 (the sink key), its rows...]; a token split into
    `per_token` kernel rows repeats its list for each. -> qo_indptr, kv_indptr, kv_indices,
    kv_last_page_lens (int32) and max_seqlen_q."""
    import torch

    T, dev = rows.shape[0], rows.device
    lists = torch.cat((torch.zeros(T, 1, dtype=torch.int32, device=dev), rows.to(torch.int32)), 1)
    n = counts.to(device=dev, dtype=torch.int64) + 1
    if per_token > 1:
        lists, n = lists.repeat_interleave(per_token, 0), n.repeat_interleave(per_token)
    B = lists.shape[0]
    keep = torch.arange(lists.shape[1], device=dev)[None, :] < n[:, None]
    indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(n, 0).to(torch.int32)
    return dict(qo_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev), kv_indptr=indptr,
                kv_indices=lists[keep].contiguous(), kv_last_page_lens=torch.ones(B, dtype=torch.int32, device=dev),
                max_seqlen_q=1)


def sink_query(q, sink, scale: float):
    """q [T, H, 512] -> [T, H, 576] bf16: q, then each head's sink / scale as three bf16 terms at
    SINK_DIMS (against the sink key's ones their sum is the sink logit / scale), then zeros."""
    import torch

    T, H, _ = q.shape
    x = sink.to(device=q.device, dtype=torch.float64).clamp(-SINK_LIMIT, SINK_LIMIT) / scale
    terms = []
    for _ in SINK_DIMS:
        t = x.to(torch.bfloat16)
        terms.append(t)
        x = x - t.double()
    out = torch.zeros(T, H, QK_DIM, dtype=torch.bfloat16, device=q.device)
    out[..., :D] = q
    out[..., SINK_DIMS[0]:SINK_DIMS[-1] + 1] = torch.stack(terms, -1)[None]
    return out


def call_args(q, kv: SparseKV, *, sink, scale: float, fmt: str) -> dict[str, Any]:
    """The arguments of one `mla_decode_fwd` call for all T query tokens (positional names as in the
    function), plus `rows_per_token` for reading the output back."""
    import torch

    if q.dim() != 3 or q.shape[-1] != D:
        raise ValueError(f"mqa_kernel=aiter_sparse: q must be [T, H, {D}], got {tuple(q.shape)}")
    T, H, _ = q.shape
    per_token, heads = head_rows(H)
    ids, counts = attended(kv)
    buf, rows = mla_buffer(kv, ids, fmt=fmt)
    args = dict(q=sink_query(q, sink, scale).view(T * per_token, heads, QK_DIM), kv_buffer=buf,
                o=torch.empty(T * per_token, heads, D, dtype=torch.bfloat16, device=q.device))
    args.update(ragged(rows, counts, per_token))
    args.update(sm_scale=float(scale), rows_per_token=per_token)
    return args


@dataclass(frozen=True, slots=True, kw_only=True)
class AiterPrepared:
    """A layer's choice for its device: the fp8 format its architecture's aiter reads (an FP8_FORMAT value),
    which every call checks aiter's own fp8 type against."""
    fp8_format: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AiterSparseMQA:
    name: str = "aiter_sparse"
    error_budget: ClassVar[float] = 1e-2     # vs the oracle: bf16 probabilities

    def needs(self, device) -> Needs:
        fmt = FP8_FORMAT.get(device.arch)
        fmts = frozenset({fmt}) if fmt else frozenset(FP8_FORMAT.values())
        return Needs(platforms=frozenset({"rocm"}), archs=frozenset(FP8_FORMAT),
                     row_formats=frozenset(RECORD[f] for f in fmts), padded_heads=PADDED_HEADS,
                     dtypes=frozenset({"bfloat16"}), modules=(("aiter", "amd-aiter"),), fp8_formats=fmts,
                     graphs=False)      # the attended rows are gathered by torch.unique, which reads sizes

    def prepare(self, *, device) -> AiterPrepared:
        fmt = FP8_FORMAT.get(device.arch)
        if fmt is None:
            raise ValueError(f"mqa_kernel=aiter_sparse runs on rocm/gfx942 or rocm/gfx950, not {device.describe()} "
                             "(check() refuses this); fix: mqa_kernel=reference")
        return AiterPrepared(fp8_format=fmt)

    def plan(self, *, tokens: int, layer_type: str, previous=None) -> None:
        return None

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared: AiterPrepared | None = None, plan=None):
        import importlib

        if prepared is None:
            raise ValueError("mqa_kernel=aiter_sparse needs the state prepare(device=...) returned")
        if q.shape[0] == 0:
            return q.new_zeros(q.shape), None
        aiter = importlib.import_module("aiter")
        mla = importlib.import_module("aiter.mla")
        fmt = prepared.fp8_format
        if format_of(aiter.dtypes.fp8) != fmt:
            raise ValueError(f"mqa_kernel=aiter_sparse was prepared for {TORCH_FP8[fmt]} caches, but aiter's fp8 "
                             f"type here is {aiter.dtypes.fp8}: the deployment's device.arch is not this GPU's")
        a = call_args(q, kv, sink=sink, scale=scale, fmt=fmt)
        mla.mla_decode_fwd(a["q"], a["kv_buffer"], a["o"], a["qo_indptr"], a["kv_indptr"], a["kv_indices"],
                           a["kv_last_page_lens"], a["max_seqlen_q"], sm_scale=a["sm_scale"])
        return a["o"].view(q.shape).to(q.dtype), None
