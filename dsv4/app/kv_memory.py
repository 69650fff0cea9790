"""KV memory accounting per layer type and for a whole model (docs/numerics.md §3.1, §3.6). Pure Python.

Per rank and per request: the SWA cache is bounded by the window; a ratio-R layer's compressed cache
grows by one row per R tokens; a ratio-4 layer's indexer keys by one entry per 4 tokens; compressor
state is the last coff·R tokens' (candidate, gate) float32 rows, on at most two pages of coff·R rows.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv4.formats.row_format import BF16_ROWS, FLOAT32_ROWS, FP8_KEYS, MXFP4_KEYS
from dsv4.values.layer_types import LAYER_TYPES, by_ratio
from dsv4.values.spec import ModelSpec

GIB = 2 ** 30
MILLION_TOKENS = 2 ** 20          # "1M context" = max_position_embeddings = 1,048,576
# the one published figure, for the model it was published for
PUBLISHED = {"dsv4_pro": ("vLLM blog (2026-04-24): DSV4-Pro, 61 layers, bf16 rows and bf16 indexer keys, one "
                          "1M-token sequence", 9.62 * GIB)}


def compressor_state_bytes(ratio: int, dim: int) -> int:
    """What one request's compressor state holds at most: (candidate, gate) float32 rows, each coff·dim
    wide, of the last coff·R positions, on pages of coff·R rows -- two of them where the window spans a
    page boundary (kv_pool's `state{R}` groups)."""
    coff = by_ratio(ratio).coff
    return 2 * (coff * ratio) * 2 * (coff * dim) * 4


def indexer_entry_bytes(kind: str, index_head_dim: int) -> int:
    """Bytes of one indexer key of each kind: plain float32 or bf16 rows, fp8 or mxfp4 records (§3.4)."""
    return {"float32": 4 * index_head_dim, "bf16": 2 * index_head_dim,
            "fp8": index_head_dim + 4, "mxfp4": index_head_dim // 2 + index_head_dim // 32}[kind]


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerMemory:
    layer_type: str
    row_bytes: int                       # one cached KV row in the layout
    swa_bytes_per_request: int           # the window's rows (bounded)
    kv_bytes_per_token: float            # compressed rows per context token
    indexer_bytes_per_token: float       # indexer keys per context token
    state_bytes_per_request: int         # compressor state pages (bounded)

    def bytes_for(self, tokens: int) -> float:
        return (self.kv_bytes_per_token + self.indexer_bytes_per_token) * tokens \
            + self.swa_bytes_per_request + self.state_bytes_per_request

    def as_dict(self) -> dict:
        return asdict(self)


def layer_memory(spec: ModelSpec, ratio: int, layout, *, indexer: str = "float32") -> LayerMemory:
    row = layout.bytes_per_token(spec.head_dim)
    kind = by_ratio(ratio)
    comp = row / ratio if kind.compressed else 0.0
    idx = indexer_entry_bytes(indexer, spec.index_head_dim) / ratio if kind.indexed else 0.0
    state = compressor_state_bytes(ratio, spec.head_dim) if kind.compressed else 0
    if kind.indexed:
        state += compressor_state_bytes(ratio, spec.index_head_dim)
    return LayerMemory(layer_type=kind.name, row_bytes=row, swa_bytes_per_request=spec.sliding_window * row,
                       kv_bytes_per_token=comp, indexer_bytes_per_token=idx, state_bytes_per_request=state)


def vllm_indexer_kind(layout) -> str:
    """The indexer record vLLM pairs with a main-cache layout: fp8 keys with fp8 rows, bf16 otherwise."""
    return "fp8" if layout.row_format.fp8 else "bf16"


def model_memory(spec: ModelSpec, layout, *, tokens: int = MILLION_TOKENS, indexer: str = "float32") -> dict:
    """Bytes of one `tokens`-long sequence over all the model's layers (MTP layer excluded)."""
    counts: dict[int, int] = {}
    for layer in range(spec.num_hidden_layers):
        r = spec.compress_ratio(layer)
        counts[r] = counts.get(r, 0) + 1
    per_type = {by_ratio(r).name: layer_memory(spec, r, layout, indexer=indexer) for r in sorted(counts)}
    total = sum(n * per_type[by_ratio(r).name].bytes_for(tokens) for r, n in counts.items())
    return {"tokens": tokens, "layers": {by_ratio(r).name: n for r, n in sorted(counts.items())},
            "per_type": per_type, "total_bytes": total}


def indexer_kind(dtype: str, indexer=None) -> str:
    """Our indexer keys' record (an `indexer_entry_bytes` kind) for activations of `dtype`, as the indexer
    option stores them (its `key_layout`; default: the group's, configs/config.yaml)."""
    from dsv4.checks.catalogue import default_option
    from dsv4.strategies import indexer_keys_layout

    if indexer is None:
        indexer = default_option("indexer")

    row = indexer_keys_layout(indexer, dtype=dtype, head_dim=128).row_format
    return {FLOAT32_ROWS: "float32", BF16_ROWS: "bf16", MXFP4_KEYS: "mxfp4", FP8_KEYS: "fp8"}[row]


def summary_lines(spec: ModelSpec, layout, dtype: str, indexer=None) -> list[str]:
    """What `run` prints: this run's caches, vLLM's equivalent, and the published accounting."""
    from dsv4.checks.catalogue import option

    mine = indexer_kind(dtype, indexer)
    ours = model_memory(spec, layout, indexer=mine)
    kind = vllm_indexer_kind(layout)
    theirs = model_memory(spec, layout, indexer=kind)
    bf16 = model_memory(spec, option("cache_layout", "bf16"), indexer="bf16")
    mix = ", ".join(f"{n} {t}" for t, n in ours["layers"].items())
    return [f"KV memory of one {MILLION_TOKENS:,}-token sequence, model={spec.name} ({mix}), "
            f"cache_layout={layout.name}, per tensor-parallel rank:",
            f"  {ours['total_bytes'] / GIB:.2f} GiB with this run's caches (indexer keys {mine}, "
            f"{indexer_entry_bytes(mine, spec.index_head_dim)} B/entry)",
            f"  {theirs['total_bytes'] / GIB:.2f} GiB with vLLM's {kind} indexer keys "
            f"({indexer_entry_bytes(kind, spec.index_head_dim)} B/entry) instead",
            f"  {bf16['total_bytes'] / GIB:.2f} GiB with bf16 rows and bf16 indexer keys"
            + (f" (published: {PUBLISHED[spec.name][1] / GIB:.2f} GiB, {PUBLISHED[spec.name][0]})"
               if spec.name in PUBLISHED else "")]


def memory_table(spec: ModelSpec, layouts, dtype: str, indexer=None) -> str:
    """Bytes per layer type for each layout, and the 1M-token total (what `info` prints), with the indexer
    keys as `indexer` stores them."""
    from dsv4.reports.report import table

    rows = []
    for layout in layouts:
        m = model_memory(spec, layout, indexer=indexer_kind(dtype, indexer))
        pt = m["per_type"]
        row = [layout.name, layout.bytes_per_token(spec.head_dim), pt[next(iter(pt))].swa_bytes_per_request / 1024]
        for t in (lt.name for lt in LAYER_TYPES):
            row.append(pt[t].kv_bytes_per_token + pt[t].indexer_bytes_per_token if t in pt else None)
        row.append(m["total_bytes"] / GIB)
        rows.append(row)
    return table(["cache_layout", "B/row", "SWA KiB/req/layer", "swa B/tok", "c4a B/tok", "c128a B/tok",
                  "GiB @1M tokens"], rows)
