"""A run's grades: each layer's outputs against the oracle (`LayerGrade`), its speed and memory beside them
(`LayerMetrics`), the whole run's (`RunMetrics`), and the verdict on them. Typed values, so that what a row
holds is written in one place: `as_dict()` gives result.json's `metrics.*` keys, in their order."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from dsv4 import oracle as ref
from dsv4.app.kv_memory import LayerMemory


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputStats:
    """What says whether a layer's output is degenerate, whatever an oracle rounding rows the same way says:
    its count of non-finite values, its largest |value| (of the finite ones), and how far it is from constant
    (None: no values)."""
    nonfinite: int
    max_abs: float | None
    spread: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"out_nonfinite": self.nonfinite, "out_max_abs": self.max_abs, "out_spread": self.spread}


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectionGrade:
    """A ratio-4 layer's top-k lists against the oracle's: the share of tokens whose set is the oracle's, the
    worst selected entry's score below the oracle's k-th (relative), whether every list has k entries, and
    per numerics the oracle offers (`oracle.INDEXER_NUMERICS`) the mean recall."""
    exact: float
    max_gap: float | None
    count_ok: bool
    recall: Mapping[str, float]

    def as_dict(self) -> dict[str, Any]:
        return ({"topk_exact": self.exact, "topk_max_gap": self.max_gap, "topk_count_ok": self.count_ok}
                | {f"topk_recall_vs_{n}": r for n, r in self.recall.items()})


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerGrade:
    """One layer's outputs against the oracle that rounds rows as its cache stores them. The optional grades
    are None where they say nothing: against exact float32 rows (the cache's rows are exact), against float
    weights and products (the linears are float), the selection (no indexer)."""
    layer: int
    compress_ratio: int
    rel_err: float
    cosine: float
    output: OutputStats
    rel_err_vs_f32_kv: float | None = None
    rel_err_vs_float_linear: float | None = None
    selection: SelectionGrade | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"layer": self.layer, "compress_ratio": self.compress_ratio, "rel_err": self.rel_err,
             "cosine": self.cosine} | self.output.as_dict()
        if self.rel_err_vs_f32_kv is not None:
            d["rel_err_vs_f32_kv"] = self.rel_err_vs_f32_kv
        if self.rel_err_vs_float_linear is not None:
            d["rel_err_vs_float_linear"] = self.rel_err_vs_float_linear
        return d | (self.selection.as_dict() if self.selection is not None else {})


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerSpeed:
    """A layer's prefill tokens per second and decode milliseconds per step (None: no such steps); with
    distributed ranks (`reduced`), the share of a decode step spent in the all-reduce."""
    prefill_tok_s: float | None
    decode_ms_step: float | None
    reduced: bool = False
    decode_allreduce_ms_step: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = {"prefill_tok_s": self.prefill_tok_s, "decode_ms_step": self.decode_ms_step}
        return d | ({"decode_allreduce_ms_step": self.decode_allreduce_ms_step} if self.reduced else {})


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerMetrics:
    """One layer's row: its grade, its speed, its cache's bytes (per token and request) and its pool's bytes
    held at the end of the run."""
    grade: LayerGrade
    speed: LayerSpeed
    memory: LayerMemory
    pool_bytes_at_end: int

    def as_dict(self) -> dict[str, Any]:
        return (self.grade.as_dict() | self.speed.as_dict() | self.memory.as_dict()
                | {"pool_bytes_at_end": self.pool_bytes_at_end})


@dataclass(frozen=True, slots=True, kw_only=True)
class RunMetrics:
    """The whole run's metrics: every layer's (by name), the budgets it was judged by, what each rank holds
    (`ranks`: runner.rank_memory's, every rank), what head padding costs, the job's memory -- estimated
    before the work, measured after the grading -- and the decode steps' times (every layer summed)."""
    layers: Mapping[str, LayerMetrics]
    error_budget: float
    f32_kv_budget: float
    ranks: Sequence[Mapping[str, Any]]
    padding: Mapping[str, int]
    kv_gib_per_1m_tokens: float
    estimated_peak: Mapping[str, int]
    peak_rss_bytes: int
    rss_at_start_bytes: int
    peak_device_bytes: int | None
    warm_up_s: float
    decode_step_ms: Sequence[float]

    @property
    def max_rel_err(self) -> float:
        errs = [m.grade.rel_err for m in self.layers.values()]
        return float("nan") if any(e != e for e in errs) else max(errs)

    def _worst(self, field: str) -> float:
        """The largest of the layers' `field` (rel_err where the layer has none)."""
        return max(v if (v := getattr(m.grade, field)) is not None else m.grade.rel_err
                   for m in self.layers.values())

    def topk_recall(self, numerics: str) -> float | None:
        """The lowest of the ratio-4 layers' recall against `numerics` (None without one)."""
        recalls = [m.grade.selection.recall[numerics] for m in self.layers.values() if m.grade.selection is not None]
        return min(recalls) if recalls else None

    @property
    def decode_ms_median_step(self) -> float | None:
        return statistics.median(self.decode_step_ms) if self.decode_step_ms else None

    def as_dict(self) -> dict[str, Any]:
        steps = self.decode_step_ms
        return ({n: m.as_dict() for n, m in self.layers.items()}
                | {"max_rel_err": self.max_rel_err, "error_budget": self.error_budget,
                   "f32_kv_budget": self.f32_kv_budget, "max_rel_err_vs_f32_kv": self._worst("rel_err_vs_f32_kv"),
                   "max_rel_err_vs_float_linear": self._worst("rel_err_vs_float_linear"),
                   "weight_bytes_per_rank": self.ranks[0]["weight_bytes"]}
                | {f"topk_recall_vs_{n}": self.topk_recall(n) for n in ref.INDEXER_NUMERICS}
                | dict(self.padding)
                | {"kv_gib_per_1m_tokens": self.kv_gib_per_1m_tokens, "ranks": list(self.ranks),
                   "estimated_peak": dict(self.estimated_peak), "peak_rss_bytes": self.peak_rss_bytes,
                   "rss_at_start_bytes": self.rss_at_start_bytes}
                | ({"peak_device_bytes": self.peak_device_bytes} if self.peak_device_bytes is not None else {})
                | {"warm_up_s": self.warm_up_s, "decode_ms_first_step": steps[0] if steps else None,
                   "decode_ms_median_step": self.decode_ms_median_step})


# ---- grading one layer against the oracle ---------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class OracleCase:
    """What the oracle replays for every layer of a run: the model (`spec.to_dump()`), the tokens in
    processing order, and the numerics the run's options use -- its rows' format (`exact`: no rounding to
    grade against float32 rows), the indexer's and the linears'."""
    model: dict
    hidden: torch.Tensor
    positions: torch.Tensor
    request_index: torch.Tensor
    row_format: str
    kv_scale: float | None
    exact_rows: bool
    indexer_numerics: str
    linear_numerics: str


def grade_layer(case: OracleCase, *, layer: int, ratio: int, weights: dict, out: torch.Tensor,
                topk: torch.Tensor | None, float_weights: dict | None) -> LayerGrade:
    """Layer `layer`'s output `out` (and its top-k lists, where it has an indexer) against the oracle given
    the same selection; against exact float32 rows where its rows are rounded, and against the float weights
    the fp8 ones were made from (`float_weights`) where its linears are fp8."""
    given = None if topk is None else topk.long()
    tokens = (case.hidden, case.positions, case.request_index)
    common = dict(topk=given, indexer_numerics=case.indexer_numerics, keep_scores=False)
    o = ref.oracle_outputs(case.model, ratio, weights, *tokens, row_format=case.row_format, kv_scale=case.kv_scale,
                           linear_numerics=case.linear_numerics, grade=True, **common)
    f32 = None
    if not case.exact_rows:         # what the cache's rounding costs against exact float32 rows
        f32 = ref.rel_err(out, ref.oracle_outputs(case.model, ratio, weights, *tokens, row_format="float32",
                                                  linear_numerics=case.linear_numerics, **common)["out"])
    float_linear = None
    if float_weights is not None:   # what the fp8 projections cost against float weights and products
        float_linear = ref.rel_err(out, ref.oracle_outputs(case.model, ratio, float_weights, *tokens,
                                                           row_format=case.row_format, kv_scale=case.kv_scale,
                                                           **common)["out"])
    return LayerGrade(layer=layer, compress_ratio=ratio, rel_err=ref.rel_err(out, o["out"]),
                      cosine=ref.cosine(out, o["out"]), output=output_stats(out), rel_err_vs_f32_kv=f32,
                      rel_err_vs_float_linear=float_linear,
                      selection=None if topk is None else selection_grade(o["grades"], case.indexer_numerics))


def selection_grade(grades: Mapping[str, Mapping], numerics: str) -> SelectionGrade:
    """The selection's grade from the oracle's per-request grades ({numerics: {request: grade}}): exactness,
    gap and list sizes against the run's own numerics; recall against each numerics the oracle offers (the
    model's weights as computed, exact, and the published FP4 numerics)."""
    own = list(grades[numerics].values())
    recall = {n: sum(x["recall"] for x in grades[n].values()) / len(grades[n]) for n in ref.INDEXER_NUMERICS}
    return SelectionGrade(exact=sum(x["exact"] for x in own) / len(own), max_gap=max(x["max_gap"] for x in own),
                          count_ok=min(x["count_ok"] for x in own) == 1.0, recall=recall)


# ---- the verdict ----------------------------------------------------------------------------------------
def output_stats(out: torch.Tensor) -> OutputStats:
    """`out`'s OutputStats: its distance from constant is the largest difference from the first token's row
    (with one token, from its first value)."""
    finite = torch.isfinite(out)
    vals = torch.where(finite, out.double(), 0.0)
    if not vals.numel():
        return OutputStats(nonfinite=0, max_abs=None, spread=None)
    first = vals[:1] if vals.shape[0] > 1 else vals[:1, :1]
    return OutputStats(nonfinite=int((~finite).sum()), max_abs=float(vals.abs().max()),
                       spread=float((vals - first).abs().max()))


def degenerate(stats: OutputStats) -> str | None:
    """Why a layer's output says it no longer computes attention, or None."""
    if stats.nonfinite:
        return f"{stats.nonfinite} outputs are not finite (NaN or inf)"
    if stats.max_abs == 0:
        return "every output is 0"
    if stats.spread == 0:
        return "its output is constant"
    return None


def verdict(grades: Mapping[str, LayerGrade], *, budget: float, gap: float, f32_budget: float) -> list[str]:
    """What is wrong with a run's layers (empty: nothing), one line per layer named as in `grades`."""
    return [f"layer {name} (idx {g.layer}): {', '.join(bad)}" for name, g in grades.items()
            if (bad := layer_problems(g, budget=budget, gap=gap, f32_budget=f32_budget))]


def layer_problems(g: LayerGrade, *, budget: float, gap: float, f32_budget: float) -> list[str]:
    """An output that is degenerate (non-finite, all zero, constant), an error against the oracle past
    `budget` (NaN included) or, where rows are rounded, against exact float32 rows past `f32_budget` -- an
    oracle rounding as the cache does cannot see rows rounded away --, a top-k list of the wrong size, or a
    selected entry scoring more than `gap` (relative) below the oracle's k-th best -- more than a near-tie."""
    bad = [b] if (b := degenerate(g.output)) else []
    if not g.output.nonfinite:      # (a non-finite output's errors are NaN: said once already)
        if not g.rel_err <= budget:
            bad.append(f"rel_err {g.rel_err:.3g} > budget {budget:.3g}")
        f32 = g.rel_err_vs_f32_kv
        if f32 is not None and not f32 <= f32_budget:
            bad.append(f"rel_err f32 KV {f32:.3g} > f32 KV budget {f32_budget:.3g}")
    s = g.selection
    if s is not None and not s.count_ok:
        bad.append("a top-k list of the wrong size")
    elif s is not None and s.max_gap is not None and not s.max_gap <= gap:
        bad.append(f"a top-k entry {s.max_gap:.3g} below the oracle's k-th score (allowed: {gap:.0e})")
    return bad
