"""The six seams of the layer, as structural Protocols, and the data they exchange.

Nothing here is subclassed: a strategy is any frozen, keyword-only dataclass with these members.
Requirements are data (`Needs`), read by the one pure `dsv4.checks.compat.check()`. torch is imported only
for type checking, so `mode=check` never loads it.

What a strategy's `prepare` returns (typed `Any` here) is the option's own frozen dataclass, defined
beside it (or in its group's common module), or None where it keeps nothing: the layer holds it and
hands it to every call unchanged. State a call keeps between calls has an owner of its own type inside
it (e.g. flashmla_sparse's PageViews, the fp8 linears' arrival counters); the value is never rebuilt
or added to after build.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from dsv4.formats.fp8_blocks import Fp8Blocks, Fp8Rows, LinearNumerics
from dsv4.formats.indexer_numerics import IndexerNumerics, QueryFormat
from dsv4.formats.row_format import RowFormat

if TYPE_CHECKING:
    from torch import Tensor

    from dsv4.values.seam import PagedCache, RopeRows, SparseKV
    from dsv4.values.device import DeviceInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingRange:
    """A numeric setting of the option's own and the values it can work with: outside [low, high] it computes
    nothing useful (a scale against its format's range that rounds every value away). `below` and `above` say
    what happens there; check() refuses such a value with that reason, its default as the fix."""
    setting: str
    low: float
    high: float
    below: str
    above: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Needs:
    """What a strategy requires of the machine and of the other strategies. Empty = anything."""
    platforms: frozenset[str] = frozenset()        # {"cuda"}, {"rocm"}
    archs: frozenset[str] = frozenset()            # {"sm90", "sm100"}
    row_formats: frozenset[RowFormat] = frozenset()   # the cache rows it reads: {FP8_DS_MLA}
    padded_heads: frozenset[int] = frozenset()     # {64, 128}
    dtypes: frozenset[str] = frozenset()           # activation dtypes: {"bfloat16"}
    modules: tuple[tuple[str, str], ...] = ()      # (import name, pip distribution)
    model_multiples: tuple[tuple[str, int], ...] = ()   # (ModelSpec field, what it must be a multiple of)
    model_values: tuple[tuple[str, int], ...] = ()      # (ModelSpec field, the value it must equal)
    model_powers_of_two: tuple[str, ...] = ()           # ModelSpec fields that must be powers of two
    model_choices: tuple[tuple[str, tuple[int, ...]], ...] = ()   # (ModelSpec field, the values it may take)
    index_page_keys: frozenset[int] = frozenset()       # indexer keys per ratio-4 entry page it reads
    # the output rows (N) and input columns (K) of every projection it multiplies, on each rank, must be
    # multiples of this (fp8 weights in 128x128 blocks); 0 = any
    projection_multiple: int = 0
    # e4m3 flavours a kernel decodes fp8 cache bytes as on this device (a layout's own is its
    # RowFormat.fp8). "ocp" = float8_e4m3fn (bias 7, max 448), "fnuz" = float8_e4m3fnuz (bias 8, max
    # 240, no -0: byte 0x80 is NaN). Read as FNUZ a byte is worth half what it is as OCP, so check()
    # refuses a kernel and a layout whose flavours differ. Empty = none / any.
    fp8_formats: frozenset[str] = frozenset()
    # the override that lifts the platform/arch requirement when the strategy has a wider setting
    # (e.g. "mqa_kernel.variant=auto"); empty = the group's safe choice (the reference)
    fix: str = ""
    # whether its calls can be captured in a CUDA graph (no host sync, no allocation that depends on
    # values); check() refuses graph.enabled=true with one that cannot
    graphs: bool = True
    # with `graphs`: the most tokens of a step whose calls a graph can capture (0: any), for an option that
    # takes another path from more tokens; check() refuses graph.capture_sizes that capture larger steps
    graph_tokens: int = 0
    # whether it can give a request's results bit for bit the same whatever else is in its steps, and how
    # they are chunked (batch_invariant=true; docs/notes/2026-12-04-batch-invariance.md), and why not where
    # it cannot: check() refuses it then, mode=info lists why. An option that can and whose arithmetic changes
    # for it takes `prepare(..., batch_invariant=True)`.
    batch_invariant: bool = False
    variance: str = "its arithmetic has not been made independent of the step"
    # its own numeric settings and the values it works with (a scale against its format's range)
    setting_ranges: tuple[SettingRange, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearWeight:
    """One rank's weight of a dense projection y = x·Wᵀ: its values [N, K] (float32) and, where the
    checkpoint stores it in fp8 (or random weights were made in that format), those blocks as stored;
    `values` are then their exact dequantization."""
    values: Tensor
    fp8: Fp8Blocks | None = None

    @staticmethod
    def cat(parts: list["LinearWeight"]) -> "LinearWeight":
        """Several projections of one input as one product (their output rows stacked); the fp8 blocks
        come along only when every part has them."""
        import torch

        fp8 = [p.fp8 for p in parts]
        where = parts[0].values.device
        return LinearWeight(values=torch.cat([p.values.to(where) for p in parts]),
                            fp8=Fp8Blocks.cat(fp8) if all(f is not None for f in fp8) else None)


@dataclass(frozen=True, slots=True, kw_only=True)
class OProjWeights:
    """One rank's grouped `wo_a` [G·o_lora, hpg·D] (its groups); `wo_b` is the layer's `linear` product.

    A checkpoint's own fp8 `wo_a` may come along: its e4m3 bytes [G·o_lora, hpg·D] and their 128×128
    block scales [G·o_lora/128, hpg·D/128] (UE8M0 or float32), as stored; fp8 strategies then use
    them unchanged instead of quantizing `wo_a` (which is their dequantized float copy)."""
    wo_a: Tensor
    groups: int
    wo_a_fp8: Tensor | None = None
    wo_a_scale: Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheAccess:
    """How rows get into one cache, chosen by its layout once, when the cache is made on its device
    (`CacheLayout.access`), so that no write asks a tensor where it lives."""
    write: Callable[[Tensor, Tensor], None]   # (global slots, rows): rows stored at their slots (-1: skip)
    # how the layer's own kernels store rows as they make them (kernels/front/cache_write.RowStore), None
    # where they cannot (a CPU cache, a layout they have no store for): then rows go through `write`
    store: Any = None


@runtime_checkable
class CacheLayout(Protocol):
    """Bytes of one cached KV row, and how rows are written to and read from paged storage."""
    name: str
    error_budget: float      # relative error vs the oracle (same cache rounding) this option may add
    # relative error vs the oracle with exact float32 rows that storing rows this way may cost: a run's
    # "rel_err f32 KV" must stay within the combination's error_budget plus this (0: rows kept exact)
    rounding_budget: float

    @property
    def row_format(self) -> RowFormat: ...      # what a stored row is: kernels, check() and the oracle read it

    def needs(self, device: DeviceInfo) -> Needs: ...
    def bytes_per_token(self, head_dim: int) -> int: ...
    def page_bytes(self, block_size: int, head_dim: int) -> int: ...
    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str) -> Tensor: ...
    def read(self, cache: Tensor, slots: Tensor, *, block_size: int) -> Tensor: ...
    # how rows get into `cache` (its writer and the kernels' store), chosen once for its device (`gpu`)
    def access(self, cache: Tensor, *, block_size: int, gpu: bool) -> CacheAccess: ...


@runtime_checkable
class TopKStrategy(Protocol):
    """How the indexer's scores become the MQA kernel's lists on a GPU: an option of the group nested in the
    indexer's (`indexer.top_k`, configs/indexer/top_k/). The torch path (components/indexer.py) is their
    specification."""
    name: str

    def needs(self, device: DeviceInfo) -> Needs: ...
    # scores [T, >= width] float32 (row t visible below counts[t]) -> (local entry indices [T, topk], their
    # global slots through each token's request's entries table `pages` [T, topk], their counts [T]) int32,
    # the valid entries of a row first
    def __call__(self, scores: Tensor, counts: Tensor, pages: Tensor, token_request: Tensor, *, topk: int,
                 block_size: int) -> tuple[Tensor, Tensor, Tensor]: ...


@runtime_checkable
class IndexerStrategy(Protocol):
    """The lightning indexer of ratio-4 layers: its numerics (`numerics`: what its RoPE'd queries and its
    closed keys become before they are scored and stored; the layer's kernels apply them on a GPU, the
    oracle recomputes them), its keys' record (`key_layout`) and, on a GPU, the kernel that scores them
    (`scores`, taking the queries in `query_format`) and the top-k its scores go through (`top_k`, an option
    of its own)."""
    name: str
    error_budget: float
    numerics: IndexerNumerics
    query_format: QueryFormat
    top_k: TopKStrategy

    def needs(self, device: DeviceInfo) -> Needs: ...
    # once per layer: what `scores` needs made on the device (the device's facts our kernel plans by), or None
    def prepare(self, *, head_dim: int, device: DeviceInfo) -> Any: ...
    # how its keys are stored; None: plain rows in the activation dtype (the pool's PlainRowLayout)
    def key_layout(self, *, dtype: str, head_dim: int) -> CacheLayout | None: ...
    # once per step on a GPU, shared by the step's ratio-4 layers: what `scores` needs made per step
    # (DeepGEMM's lens, block table rows and schedule), or None
    def plan(self, *, token_request: Tensor, counts: Tensor, pages: Tensor, block_size: int) -> Any: ...
    # on a GPU: the step's scores [T, >= width] float32 of q [T, Hi, Di] over each token's request's keys
    # (a PagedCache in its key_layout, through the entries table `pages`), entries j < counts[t] visible;
    # the top-k reads only those. q and w may already be in its `query_format` (e4m3 queries, their scales
    # in w: the layer's front kernel made them). `plan`: what plan() gave for the step (None: the call makes
    # its own); `prepared`: what prepare() gave
    def scores(self, q: Tensor, w: Tensor, keys: PagedCache, pages: Tensor, token_request: Tensor,
               counts: Tensor, *, width: int, w_scale: float, plan: Any = None, prepared: Any = None) -> Tensor: ...


@runtime_checkable
class HeadPaddingPolicy(Protocol):
    """How many heads the q/out buffers are allocated at, for a rank's real head count."""
    name: str

    def padded_heads(self, heads: int) -> int | None: ...   # None: this policy cannot hold `heads`
    def supported(self) -> tuple[int, ...]: ...              # () = any head count


@runtime_checkable
class MQAKernelStrategy(Protocol):
    """Sparse MQA with attention sink: q [T, Hp, D] over the rows `kv` names, V = K.

    `plan` is called once per step and layer type (FlashInfer's plan/run split): what it returns -- a
    kernel's per-step state, e.g. FlashMLA's tile-scheduler metadata, which the first call fills and the
    other layers of that type reuse -- travels in the step plan and is passed to every call of that
    step's layers of that type. `previous` is what it returned for the step before (buffers to keep),
    None for the first step or a graph capture."""
    name: str
    error_budget: float      # relative error vs the oracle (same cache rounding) this option may add

    def needs(self, device: DeviceInfo) -> Needs: ...
    def prepare(self, *, device: DeviceInfo) -> Any: ...     # once per layer: device-dependent choices
    def plan(self, *, tokens: int, layer_type: str, previous: Any = None) -> Any: ...
    def __call__(self, q: Tensor, kv: SparseKV, *, sink: Tensor, scale: float, prepared: Any = None,
                 plan: Any = None) -> tuple[Tensor, Tensor | None]: ...
    # returns out [T, Hp, D] in q's dtype and lse [T, Hp] float32 (natural log, sink not included), or
    # None for a kernel whose API returns no lse (FlashInfer's DSV4 decode, aiter's)


@runtime_checkable
class OProjStrategy(Protocol):
    """Inverse RoPE on the attention output, then the grouped `wo_a`: z [T, G·o_lora] in the activation
    dtype, the input of `wo_b` (which the layer's `linear` multiplies: the ranks' partial sums)."""
    name: str
    error_budget: float      # relative error vs the oracle (same cache rounding) this option may add

    def needs(self, device: DeviceInfo) -> Needs: ...
    def prepare(self, weights: OProjWeights, *, device: DeviceInfo, dtype: str) -> Any: ...   # once, at build
    def __call__(self, o: Tensor, rot: RopeRows, *, prepared: Any) -> Tensor: ...
    # rot: the layer's RoPE at the tokens' positions (the rotation to undo)


@runtime_checkable
class LinearStrategy(Protocol):
    """How the layer's dense projections store their weights and multiply: `wq_a` and `wkv` (one product
    of x), `wq_b` with the indexer's `wq_b` (one product of the normalised q_lora rows) and `wo_b` (of
    o_proj's z). `numerics` says what the oracle recomputes them with: products in the activation dtype
    (FLOAT), or the published fp8 linear (FP8: activation rows quantized per 128 values, e4m3 weights in
    128x128 blocks, float32 accumulation). The kernel is chosen once, in `prepare`. `fp8_input`: it also
    takes rows already quantized (`Fp8Rows`), which the kernel that makes them writes (the q_lora norm), so
    that no launch quantizes them in between. `float_tail_rows`: steps of at most this many rows multiply x by
    the fp8 projection and the layer's float weights (the compressors') in one launch, float32 out -- the
    option prepares `common.Fp8Linear`, and `common.with_tail` adds the float weight to it; 0: never."""
    name: str
    error_budget: float      # relative error vs the oracle (the same numerics) this option may add
    numerics: LinearNumerics
    fp8_input: bool
    float_tail_rows: int

    def needs(self, device: DeviceInfo) -> Needs: ...
    def prepare(self, weight: LinearWeight, *, device: DeviceInfo, dtype: str) -> Any: ...   # once, at build
    # x [T, K] in the activation dtype (or, with fp8_input, Fp8Rows) -> x·Wᵀ [T, N] in `out_dtype` (default:
    # x's dtype); FLOAT options accumulate in float32 and may return it (out_dtype=float32), as the compressors need
    def __call__(self, x: Tensor | Fp8Rows, prepared: Any, *, out_dtype: Any = None) -> Tensor: ...
