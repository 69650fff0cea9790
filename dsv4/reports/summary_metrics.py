"""The numbers a sweep's summary can show, by name, and which of them a sweep asks for (`summary:` in
its config: tables, heatmaps, a baseline cell for costs).

Each metric knows its colour scale: errors span decades, so they are drawn on a log scale, where
3.24e-7 and 3.28e-7 look alike; times and bytes on a linear scale from zero, where a colour is
proportional to the value.
"""
from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dsv4.values.errors import ConfigError

Row = dict[str, Any]


class Scale(enum.Enum):
    LOG = "log"              # errors: a decade is the unit
    LINEAR = "linear"        # costs (time, bytes, heads): from zero


@dataclass(frozen=True, slots=True, kw_only=True)
class Metric:
    name: str
    title: str
    value: Callable[[Row], float | None]
    scale: Scale = Scale.LINEAR
    cost: bool = False                               # a ratio to a baseline cell means something
    text: Callable[[Row], str | None] | None = None  # the table's text, when the bare number says too little

    def format(self, v: float | None) -> str:
        """A number as a cell shows it; errors (log scale) always in one notation, so decades line up."""
        if v is None:
            return "-"
        if v != 0 and (self.scale is Scale.LOG or abs(v) < 1e-2 or abs(v) >= 1e5):
            return f"{v:.2e}"
        return f"{v:.3g}"


def _layers(key: str, combine: Callable[[list[float]], float]) -> Callable[[Row], float | None]:
    """`combine` over the row's per-layer `metrics.<layer>.<key>` values."""
    layer = re.compile(rf"metrics\.[^.]+\.{key}")

    def value(row: Row) -> float | None:
        vals = [v for k, v in row.items() if layer.fullmatch(k) and v is not None]
        return combine(vals) if vals else None
    return value


def _worst_layer(key: str) -> Callable[[Row], float | None]:
    """The row's `metrics.max_<key>`, or for rows written without it the worst of its layers' values."""
    worst = _layers(key, max)
    return lambda row: row[f"metrics.max_{key}"] if row.get(f"metrics.max_{key}") is not None else worst(row)


def _field(key: str) -> Callable[[Row], float | None]:
    return lambda row: row.get(f"metrics.{key}")


def _kib(n: float | None) -> float | None:
    return n / 1024 if n is not None else None


def _padded_heads_text(row: Row) -> str | None:
    heads, padded = row.get("metrics.heads_per_rank"), row.get("metrics.padded_heads_per_rank")
    if heads is None or padded is None:
        return None
    return f"{heads} → {padded}" if padded != heads else f"{heads}"


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric(name="max_rel_err", scale=Scale.LOG, value=_worst_layer("rel_err"),
           title="max_rel_err: vs the float32 oracle that rounds cached rows as the cache does (worst layer)"),
    Metric(name="max_rel_err_vs_f32_kv", scale=Scale.LOG, value=_worst_layer("rel_err_vs_f32_kv"),
           title="max_rel_err_vs_f32_kv: vs the float32 oracle on exact float32 rows, what the cache's rounding "
                 "costs (worst layer)"),
    Metric(name="max_rel_err_vs_float_linear", scale=Scale.LOG, value=_worst_layer("rel_err_vs_float_linear"),
           title="max_rel_err_vs_float_linear: vs the float32 oracle with the float weights and products, what "
                 "fp8 projections cost (worst layer; for float ones the same as max_rel_err)"),
    Metric(name="weight_mib_per_rank", cost=True, value=lambda r: _kib(_kib(r.get("metrics.weight_bytes_per_rank"))),
           title="weight MiB per rank (the workload's layers: projections, norms, sinks, as the options hold them)"),
    Metric(name="decode_ms_step", cost=True, value=_layers("decode_ms_step", sum),
           title="decode ms/step (sum over the workload's layers, wall time)"),
    Metric(name="prefill_tok_s", value=_layers("prefill_tok_s", min),
           title="prefill tokens/s (slowest layer, wall time)"),
    Metric(name="kv_gib_per_1m_tokens", value=_field("kv_gib_per_1m_tokens"),
           title="KV GiB per 1M-token sequence (per rank)"),
    Metric(name="padded_heads_per_rank", value=_field("padded_heads_per_rank"), text=_padded_heads_text,
           title="heads per rank → padded heads (the q/out buffers' head count)"),
    Metric(name="padding_kib_per_token", value=lambda r: _kib(r.get("metrics.padding_bytes_per_token")),
           title="padding KiB per token and layer, per rank (q and kernel-output rows of the padded heads)"),
    Metric(name="topk_recall_vs_exact", value=_field("topk_recall_vs_exact"),
           title="top-k recall vs the oracle with the model's indexer as computed (exact numerics; lowest "
                 "ratio-4 layer)"),
    Metric(name="topk_recall_vs_fp4", value=_field("topk_recall_vs_fp4"),
           title="top-k recall vs the oracle with the published Hadamard + FP4 indexer numerics (lowest "
                 "ratio-4 layer)"),
)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    """`{KEY: VALUE}`: the cell each cost is compared with, the other swept values the same."""
    key: str
    value: str

    @classmethod
    def from_config(cls, node: Any) -> Baseline:
        if not isinstance(node, Mapping) or len(node) != 1:
            raise ConfigError(f"summary.baseline={node!r}: expected one KEY: VALUE, e.g. "
                              f"summary.baseline={{head_padding:none}}")
        [(key, value)] = node.items()
        return cls(key=str(key), value=str(value))

    def row_key(self, rows: list[Row]) -> str | None:
        """The row field of `key`: a choice, a setting or an override, whichever the rows have."""
        return next((f for f in (f"choices.{self.key}", f"settings.{self.key}", f"overrides.{self.key}")
                     if any(f in r for r in rows)), None)


@dataclass(frozen=True, slots=True, kw_only=True)
class SummaryView:
    """What a sweep's summary shows: a pivot table per `tables` metric, a heatmap per `heatmaps` metric,
    and with a baseline every cost table again relative to the baseline cell."""
    tables: tuple[Metric, ...]
    heatmaps: tuple[Metric, ...]
    baseline: Baseline | None = None

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> SummaryView:
        if node is None:
            return DEFAULT_VIEW
        if not isinstance(node, Mapping):
            raise ConfigError(f"summary={node!r}: expected a mapping with tables, heatmaps and baseline")
        unknown = sorted(set(node) - {"tables", "heatmaps", "baseline"})
        if unknown:
            raise ConfigError(f"summary.{unknown[0]}: unknown key; summary takes tables, heatmaps, baseline")
        baseline = node.get("baseline")
        return cls(tables=_metrics(node, "tables", DEFAULT_VIEW.tables),
                   heatmaps=_metrics(node, "heatmaps", DEFAULT_VIEW.heatmaps),
                   baseline=Baseline.from_config(baseline) if baseline is not None else None)


def _metrics(node: Mapping[str, Any], key: str, default: tuple[Metric, ...]) -> tuple[Metric, ...]:
    names = node.get(key)
    if names is None:
        return default
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"summary.{key}={names!r}: expected a list of metric names ({', '.join(METRICS)})")
    bad = [n for n in names if n not in METRICS]
    if bad:
        raise ConfigError(f"summary.{key}: unknown metric {bad[0]!r}; available: {', '.join(METRICS)}")
    return tuple(METRICS[n] for n in names)


DEFAULT_VIEW = SummaryView(tables=tuple(METRICS[n] for n in ("max_rel_err", "decode_ms_step", "kv_gib_per_1m_tokens")),
                           heatmaps=(METRICS["max_rel_err"], METRICS["decode_ms_step"]))


def versus(metric: Metric, rows: list[Row], baseline: Baseline, same: list[str]) -> Metric | None:
    """`metric` divided by its value in the baseline cell that agrees with the row on every key of `same`
    (the other swept keys); None when no row has the baseline's key."""
    key = baseline.row_key(rows)
    if key is None:
        return None
    others = [k for k in same if k != key]
    base = {tuple(str(r.get(k)) for k in others): metric.value(r)
            for r in rows if r.get("status") == "ok" and str(r.get(key)) == baseline.value}

    def ratio(row: Row) -> float | None:
        v, b = metric.value(row), base.get(tuple(str(row.get(k)) for k in others))
        return v / b if v is not None and b else None
    return Metric(name=f"{metric.name}_vs_baseline", value=ratio, text=lambda r: (f"{x:.2f}×" if (x := ratio(r))
                                                                                     is not None else None),
                  title=f"{metric.title}, relative to {baseline.key}={baseline.value}")
