"""mqa_kernel=flashinfer_sparse: FlashInfer's DeepSeek-V4 sparse MLA (package flashinfer-python, import flashinfer).

One public entry point, `flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4` (targeted at flashinfer-python
0.6.15.post1), serves two architectures with two argument forms (docs/numerics.md §4.3, §4.4):

* sm100 / sm103, "trtllm_combined" (TRTLLM-gen kernels): plain rows, bf16 or per-tensor fp8 e4m3 (§3.3),
  both pools `[num_blocks, B, 512]` ("HND" accepts the 3-d form), q in the pools' dtype. One index table
  per query token, `[T, 128 + roundup4(K)]` int32: the first 128 columns name SWA rows, the rest
  compressed rows, -1 padded; `sparse_topk_lens[t] = 128 + n_compressed(t)`. The kernel derives how many
  of the 128 SWA columns are live from `seq_lens` (window = min(128, pos + 1), pos = seq_len - q_len + i).
  We make every query token its own request of one token (varlen q: `cum_seq_lens_q = 0..T`,
  `max_q_len = 1`) with `seq_lens[t] = n_swa(t)`, so the derived window is exactly the token's SWA count;
  the SWA entries are put first in window order, so the window's columns are exactly the live ones (the
  kernel does not skip a -1 inside the window, and a query always reads >= 1 SWA column: see
  combined_sparse_indices for a query without SWA rows, which the layer never makes).
  The kernel addresses a slot as `pool_base + slot * 512` elements (page size 1 inside the kernel), so
  the pools must be contiguous rows; for an SWA-only layer the SWA pool also stands in as the
  (required) compressed pool, which no column then names.
* sm120 / sm121, "sm120_two_pool" (the packed sparse backend): fp8_ds_mla pages viewed `[nb, B, 1, 584]`
  ("NHD"; the page stride is read from the view, so our 576-aligned padding is kept), q bf16, the SWA list
  as `sparse_indices [T, 128]` + `swa_topk_lens`, the compressed list as `extra_sparse_indices
  [T, 1, roundup64(K)]` + `extra_sparse_topk_lens`; `bmm2_scale` must be 1.

Both forms take the attention sink `[Hp]` f32 and heads padded to 8, 16, 32, 64 or 128, and need the model's
sliding window to be 128 (the combined table has exactly 128 SWA columns; the sm120 decode kernels are
specialised for an SWA top-k of 128). Lists are compacted first (valid entries of a SparseKV -- slot in the
pool and column below the length, as ReferenceMQA reads them -- in their order, then -1), so lengths are
exact counts.

The API returns no log-sum-exp, so this strategy returns None in its place (the layer does not use it).
The 128 MiB workspace is the strategy's per-step plan: allocated zeroed for the first step and handed on
to every later one (`plan(previous=...)`), shared by all layers; a call without a plan makes its own.
Not run on hardware: that FlashInfer's call can be captured in a CUDA graph is vLLM's use of it, not
something tested here.

Everything but `__call__` is pure marshalling, importable and testable without flashinfer
(tests/test_flashinfer_marshalling.py runs `__call__` end to end against a torch model of the API's
documented contract).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsv4.formats.fp8 import per_tensor_query, per_tensor_scales
from dsv4.formats.fp8_ds_mla import fp8_ds_mla_pages
from dsv4.formats.index_lists import compact, pad_columns, valid_entries
from dsv4.formats.row_format import BF16_ROWS, FP8_DS_MLA, FP8_PER_TENSOR, RowKind
from dsv4.values.sizes import round_up
from dsv4.strategies.protocols import Needs
from dsv4.values.seam import SparseKV


SWA_COLUMNS = 128                          # FlashInfer's fixed SWA width (the model's sliding window)


PADDED_HEADS = frozenset({8, 16, 32, 64, 128})


WORKSPACE_BYTES = 128 * 1024 * 1024


INDEX_ROW_MULTIPLE = 4                     # combined table rows: 16-byte vector loads of int32


SM120_EXTRA_MULTIPLE = 64                  # sm120 compressed list width: its split tile (fewer distinct shapes)


MODES = {"sm100": "trtllm_combined", "sm103": "trtllm_combined",
         "sm120": "sm120_two_pool", "sm121": "sm120_two_pool"}


ROWS = {"trtllm_combined": frozenset({BF16_ROWS, FP8_PER_TENSOR}),      # the rows each mode reads
        "sm120_two_pool": frozenset({FP8_DS_MLA})}


def _swa_list(kv: SparseKV):
    if kv.swa_indices.shape[1] > SWA_COLUMNS:
        raise ValueError(f"mqa_kernel=flashinfer_sparse: the SWA lists are {kv.swa_indices.shape[1]} wide; "
                         f"FlashInfer's DSV4 kernels take at most {SWA_COLUMNS} SWA rows per query "
                         f"(model.sliding_window must be {SWA_COLUMNS})")
    idx, n = compact(kv.swa_indices, kv.swa_lens, kv.swa.num_slots)
    return pad_columns(idx, SWA_COLUMNS), n


def combined_sparse_indices(kv: SparseKV):
    """sm100 form (§4.3): -> (indices [T, 128 + roundup4(K)] int32, sparse_topk_lens [T] int32).

    Columns 0..127: the token's SWA slots in window order, -1 after them (fewer than 128 at the start
    of a sequence); then its compressed slots, -1 padded; lens = 128 + n_compressed.

    The kernel reads at least one SWA column per query (a token's window holds the token itself) and
    does not skip a -1 it reads. A query with no SWA row -- which the layer never makes -- therefore gets
    slot 0 as a placeholder in column 0: with no compressed row either, the call's output row is zeroed
    afterwards (`no_rows`), exactly what ReferenceMQA gives; with compressed rows only, it is not
    expressible and attends to the placeholder too."""
    import torch

    swa, n_swa = _swa_list(kv)
    swa[:, 0] = torch.where(n_swa > 0, swa[:, 0], torch.zeros_like(swa[:, 0]))
    if kv.extra is None:
        comp = swa.new_empty((swa.shape[0], 0))
        n_c = torch.zeros(swa.shape[0], dtype=torch.int32, device=swa.device)
    else:
        comp, n_c = compact(kv.extra_indices, kv.extra_lens, kv.extra.num_slots)
        comp = pad_columns(comp, round_up(comp.shape[1], INDEX_ROW_MULTIPLE))
    return torch.cat((swa, comp), 1).contiguous(), (n_c + SWA_COLUMNS).to(torch.int32)


def varlen_args(indices) -> dict[str, Any]:
    """seq_lens / cum_seq_lens_q / max_q_len for a combined table: every query token is a request of
    one token whose seq_len is its SWA count, so the kernel's derived window min(128, seq_len) covers
    exactly the live SWA columns (the count is >= 1, see combined_sparse_indices)."""
    import torch

    T = indices.shape[0]
    n_swa = (indices[:, :SWA_COLUMNS] >= 0).sum(1)
    return dict(seq_lens=n_swa.clamp(min=1).to(torch.int32).contiguous(),
                cum_seq_lens_q=torch.arange(T + 1, dtype=torch.int32, device=indices.device), max_q_len=1)


def no_rows(kv: SparseKV):
    """[T] bool: the queries that name no row at all (their output is 0)."""
    has = valid_entries(kv.swa_indices, kv.swa_lens, kv.swa.num_slots).any(1)
    if kv.extra is not None:
        has = has | valid_entries(kv.extra_indices, kv.extra_lens, kv.extra.num_slots).any(1)
    return ~has


def two_pool_args(kv: SparseKV) -> dict[str, Any]:
    """sm120 form (§4.4): the SWA list as `sparse_indices [T, 128]` + `swa_topk_lens`, the compressed
    list as `extra_sparse_indices [T, 1, roundup64(K)]` + `extra_sparse_topk_lens` (absent for an
    SWA-only layer)."""
    swa, n_swa = _swa_list(kv)
    out: dict[str, Any] = dict(sparse_indices=swa, swa_topk_lens=n_swa.contiguous())
    if kv.extra is not None:
        comp, n_c = compact(kv.extra_indices, kv.extra_lens, kv.extra.num_slots)
        comp = pad_columns(comp, max(SM120_EXTRA_MULTIPLE, round_up(comp.shape[1], SM120_EXTRA_MULTIPLE)))
        out.update(extra_sparse_indices=comp.unsqueeze(1), extra_sparse_topk_lens=n_c.contiguous())
    return out


def kv_pool_views(cache) -> tuple[Any, str]:
    """(view of `cache.data` the kernel reads, kv_layout). Views, never copies: the kernel reads the
    live pages. Plain rows: `[num_blocks, B, 512]` ("HND", one KV head implied), which must be
    contiguous (the kernel steps 512 elements per slot); fp8_ds_mla: `[num_blocks, B, 1, 584]` ("NHD")."""
    import torch

    row = cache.layout.row_format
    if row == FP8_DS_MLA:
        return fp8_ds_mla_pages(cache), "NHD"
    if row in ROWS["trtllm_combined"]:
        data = cache.data
        if data.dim() != 3 or data.shape[-1] != 512 or not data.is_contiguous():
            raise ValueError(f"mqa_kernel=flashinfer_sparse: the {cache.name} cache must be contiguous "
                             f"[num_blocks, B, 512] rows, got shape {tuple(data.shape)} strides {data.stride()}")
        if data.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"mqa_kernel=flashinfer_sparse: {cache.name} rows are {data.dtype}, "
                             "not bfloat16 / float8_e4m3fn")
        return data, "HND"
    raise ValueError(f"mqa_kernel=flashinfer_sparse reads bf16 or fp8_per_tensor rows (sm100/sm103) or "
                     f"fp8_ds_mla pages (sm120/sm121), not {row.label} rows (check() refuses this); fix: cache_layout=bf16")


def scales(layout, softmax_scale: float) -> tuple[float, float]:
    """(bmm1_scale, bmm2_scale): logits = bmm1 · q·k, out = bmm2 · P·v, in the stored (q, k) units.
    Per-tensor fp8 folds the q and kv scales in (§3.3); bf16 rows and fp8_ds_mla pages (dequantized
    by the kernel) take the softmax scale and 1."""
    row = layout.row_format
    if row.kind is RowKind.FP8_PER_TENSOR:
        b1, b2 = per_tensor_scales(row, softmax_scale)
        return float(b1), float(b2)
    if row in (BF16_ROWS, FP8_DS_MLA):
        return float(softmax_scale), 1.0
    raise ValueError(f"mqa_kernel=flashinfer_sparse has no scales for {row.label} rows (check() refuses this); "
                     "fix: cache_layout=bf16")


def kernel_query(layout, q):
    """q as the kernel takes it: e4m3(q / q_scale) over per-tensor fp8 rows, else bf16."""
    import torch

    if layout.row_format.kind is RowKind.FP8_PER_TENSOR:
        return per_tensor_query(layout.row_format, q).contiguous()
    return q.to(torch.bfloat16).contiguous()


def call_args(q, kv: SparseKV, *, sink, scale: float, mode: str, workspace, out=None) -> dict[str, Any]:
    """The keyword arguments of one `trtllm_batch_decode_sparse_mla_dsv4` call for all T tokens."""
    import torch

    if q.dim() != 3 or q.shape[-1] != 512:
        raise ValueError(f"mqa_kernel=flashinfer_sparse: q must be [T, Hp, 512], got {tuple(q.shape)}")
    if q.shape[1] not in PADDED_HEADS:
        raise ValueError(f"mqa_kernel=flashinfer_sparse takes {sorted(PADDED_HEADS)} (padded) heads, got "
                         f"{q.shape[1]} (check() refuses this); fix: head_padding=buckets_pow2")
    if mode not in ROWS:
        raise ValueError(f"mqa_kernel=flashinfer_sparse: unknown mode {mode!r} (one of {sorted(ROWS)})")
    layout = kv.swa.layout
    for c in (kv.swa, kv.extra):
        if c is not None and c.layout.row_format not in ROWS[mode]:
            raise ValueError(f"mqa_kernel=flashinfer_sparse ({mode}) reads {sorted(f.label for f in ROWS[mode])} "
                             f"rows, the {c.name} cache is {c.layout.name} (check() refuses this)")
    swa_view, kv_layout = kv_pool_views(kv.swa)
    extra_view = kv_pool_views(kv.extra)[0] if kv.extra is not None else None
    bmm1, bmm2 = scales(layout, scale)
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    args: dict[str, Any] = dict(
        workspace_buffer=workspace, out=out, bmm1_scale=bmm1, bmm2_scale=bmm2,
        sinks=sink.to(device=q.device, dtype=torch.float32).contiguous(), kv_layout=kv_layout)
    if mode == "trtllm_combined":
        indices, topk_lens = combined_sparse_indices(kv)
        args.update(query=kernel_query(layout, q), swa_kv_cache=swa_view, sparse_indices=indices,
                    compressed_kv_cache=extra_view if extra_view is not None else swa_view,
                    sparse_topk_lens=topk_lens, **varlen_args(indices))
    else:
        args.update(query=q.to(torch.bfloat16).contiguous(), swa_kv_cache=swa_view,
                    compressed_kv_cache=extra_view, **two_pool_args(kv))
    return args


@dataclass(frozen=True, slots=True, kw_only=True)
class FlashInferPrepared:
    """A layer's choices for its device: the argument form its architecture takes (a MODES value) and the
    size of the workspace the plan allocates."""
    mode: str
    workspace_bytes: int


@dataclass(slots=True)
class FlashInferPlan:
    """The kernel's zeroed workspace, made once and handed from step to step."""
    workspace: Any = field(default=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class FlashInferSparse:
    name: str = "flashinfer_sparse"
    error_budget: ClassVar[float] = 1e-2     # vs the oracle: bf16 probabilities, fp8 queries on sm100

    def needs(self, device) -> Needs:
        mode = MODES.get(device.arch)
        rows = ROWS[mode] if mode else ROWS["trtllm_combined"] | ROWS["sm120_two_pool"]
        return Needs(platforms=frozenset({"cuda"}), archs=frozenset(MODES), row_formats=rows,
                     padded_heads=PADDED_HEADS,
                     dtypes=frozenset({"bfloat16"}) if mode == "sm120_two_pool" else frozenset(),
                     modules=(("flashinfer", "flashinfer-python"),),
                     model_values=(("sliding_window", SWA_COLUMNS),))

    def prepare(self, *, device) -> FlashInferPrepared:
        mode = MODES.get(device.arch)
        if mode is None:
            raise ValueError(f"mqa_kernel=flashinfer_sparse runs on sm100/sm103 (TRTLLM-gen) or sm120/sm121, "
                             f"not {device.describe()} (check() refuses this); fix: mqa_kernel=reference")
        return FlashInferPrepared(mode=mode, workspace_bytes=WORKSPACE_BYTES)

    def plan(self, *, tokens: int, layer_type: str, previous: "FlashInferPlan | None" = None) -> "FlashInferPlan":
        return previous if previous is not None else FlashInferPlan()

    @staticmethod
    def workspace(plan: "FlashInferPlan | None", prepared: FlashInferPrepared, device):
        """The zeroed workspace, made on first use and kept in the plan (every layer of every step)."""
        import torch

        plan = plan if plan is not None else FlashInferPlan()
        if plan.workspace is None:
            plan.workspace = torch.zeros(prepared.workspace_bytes, dtype=torch.int8, device=device)
        return plan.workspace

    def __call__(self, q, kv: SparseKV, *, sink, scale: float, prepared: FlashInferPrepared | None = None,
                 plan: "FlashInferPlan | None" = None):
        import importlib

        if prepared is None:
            raise ValueError("mqa_kernel=flashinfer_sparse needs the state prepare(device=...) returned")
        if q.shape[0] == 0:
            return q.new_zeros(q.shape), None
        decode = importlib.import_module("flashinfer.mla").trtllm_batch_decode_sparse_mla_dsv4
        args = call_args(q, kv, sink=sink, scale=scale, mode=prepared.mode,
                         workspace=self.workspace(plan, prepared, q.device))
        out = decode(**args)
        if prepared.mode == "trtllm_combined":         # queries with no row read a placeholder: 0 instead
            out.masked_fill_(no_rows(kv)[:, None, None], 0)
        return out.to(q.dtype), None                      # the API returns no log-sum-exp
