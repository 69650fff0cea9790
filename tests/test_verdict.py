"""A verdict that shared rounding cannot fool: the oracle rounds cached rows as the cache stores them, so rows
rounded away agree with it. A run fails when a layer's output is degenerate (zero, constant, non-finite) or its
error against exact float32 rows passes the cache layout's rounding budget; settings that round every row away
are refused by check() before any work."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch

from dsv4.app.dispatch import run_config
from dsv4.checks.catalogue import options
from dsv4.checks.compat import check
from dsv4.values.device import DeviceInfo
from dsv4.values.errors import IncompatibleCombination, ResultMismatch
from dsv4.strategies import Fp8PerTensorLayout
from dsv4.strategies.protocols import CacheLayout, Needs
from tests.conftest import run_py

TINY = ["model=dsv4_tiny", "workload=sweep", "workload.layers=[0,1]"]
PER_TENSOR = [*TINY, "cache_layout=fp8_per_tensor"]
CPU = DeviceInfo(platform="cpu")


@dataclass(frozen=True, kw_only=True)
class UnguardedFp8PerTensor(Fp8PerTensorLayout):
    """fp8_per_tensor rows that declare no range for their scales: check() lets any scale through, so the
    run itself must see rows rounded away."""

    def needs(self, device) -> Needs:
        return Needs(batch_invariant=True)


UNGUARDED = [*TINY, "cache_layout=fp8_per_tensor", "cache_layout._target_=tests.test_verdict.UnguardedFp8PerTensor",
             "cache_layout.name=unguarded_fp8_per_tensor"]


# ---- check(): a scale that rounds every row away, refused before the work ------------------------------------
@pytest.mark.parametrize("mode", ["check", "run"])
@pytest.mark.parametrize("setting,value,what", [
    ("kv_scale", "1e30", "divided by a scale above 512 they fall to e4m3's smallest step (2^-9) or to 0"),
    ("kv_scale", "1e-30", "divided by a scale below 0.00223 they pass e4m3's largest value (448)"),
    ("q_scale", "1e-5", "queries are RMS-normed (values ~1): divided by a scale below 0.00223")])
def test_a_scale_that_rounds_every_row_away_is_refused_before_the_work(compose_cfg, tmp_path, mode, setting,
                                                                         value, what):
    with pytest.raises(IncompatibleCombination) as e:
        run_config(compose_cfg([*PER_TENSOR, f"mode={mode}", f"cache_layout.{setting}={value}"]), out_dir=tmp_path)
    (line,) = [ln for ln in str(e.value).splitlines() if f"cache_layout.{setting}=" in ln]
    assert what in line and "(supported: 0.00223 to 512)" in line, line
    assert line.endswith(f"fix: cache_layout.{setting}=1.0"), line
    if mode == "run":       # refused before the work: the row is the refusal
        row = json.loads((tmp_path / "result.json").read_text())
        assert row["status"] == "incompatible" and row["problems"][0]["group"] == f"cache_layout.{setting}"


def test_the_scales_inside_e4m3s_range_pass_and_the_fix_clears_the_problem():
    import dsv4

    base = dsv4.compose(["model=dsv4_tiny", "cache_layout=fp8_per_tensor"], running=False).combo
    for ok in (1 / 448, 0.01, 1.0, 16.0, 512.0):
        assert check(base.with_choice("cache_layout", Fp8PerTensorLayout(kv_scale=ok, q_scale=ok)), CPU) == [], ok
    for bad in (1 / 449, 513.0, 1e30, 1e-30):
        (p,) = check(base.with_choice("cache_layout", Fp8PerTensorLayout(kv_scale=bad)), CPU)
        assert (p.group, p.value, p.fix) == ("cache_layout.kv_scale", f"{bad:g}", "cache_layout.kv_scale=1.0")


# ---- the verdict function, on crafted metrics ----------------------------------------------------------------
def layer(*, out_nonfinite=0, out_max_abs=2.0, out_spread=1.5, **changes):
    """A healthy layer's grade, with `changes` (its OutputStats' fields named as in the row: out_*)."""
    from dsv4.app.grades import LayerGrade, OutputStats

    output = OutputStats(nonfinite=out_nonfinite, max_abs=out_max_abs, spread=out_spread)
    return LayerGrade(**{"layer": 0, "compress_ratio": 1, "rel_err": 1e-7, "cosine": 1.0, "rel_err_vs_f32_kv": 3e-2}
                      | changes, output=output)


def judge(**changes) -> list[str]:
    from dsv4.app.grades import verdict

    return verdict({"swa": layer(**changes)}, budget=1e-4, gap=1e-5, f32_budget=0.1)


def test_a_healthy_layer_passes_the_verdict():
    assert judge() == []
    assert judge(rel_err_vs_f32_kv=None) == []                  # float32 rows: rel_err is against them already


@pytest.mark.parametrize("changes,reason", [
    (dict(out_max_abs=0.0, out_spread=0.0, rel_err_vs_f32_kv=1.0), "every output is 0"),
    (dict(out_spread=0.0), "its output is constant"),
    (dict(out_nonfinite=12, out_max_abs=0.0, rel_err=math.nan, rel_err_vs_f32_kv=math.nan),
     "12 outputs are not finite (NaN or inf)"),
    (dict(rel_err_vs_f32_kv=0.5), "rel_err f32 KV 0.5 > f32 KV budget 0.1"),
    (dict(rel_err_vs_f32_kv=math.nan), "rel_err f32 KV nan > f32 KV budget 0.1")])
def test_the_verdict_catches_a_degenerate_output_and_rows_rounded_past_their_budget(changes, reason):
    (wrong,) = judge(**changes)
    assert wrong.startswith(f"layer swa (idx 0): {reason}"), wrong
    if changes.get("out_nonfinite"):            # the NaN errors that follow from it are not said again
        assert wrong == f"layer swa (idx 0): {reason}"
    if changes.get("out_max_abs") == 0.0 and not changes.get("out_nonfinite"):     # zero, not also "constant"
        assert wrong == "layer swa (idx 0): every output is 0, rel_err f32 KV 1 > f32 KV budget 0.1"


def test_output_stats_see_zero_constant_and_non_finite_outputs():
    from dsv4.app.grades import degenerate, output_stats

    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    assert degenerate(output_stats(x)) is None
    assert degenerate(output_stats(x[:1])) is None                      # one token: its values differ
    assert degenerate(output_stats(torch.zeros(5, 16))) == "every output is 0"
    assert degenerate(output_stats(x[:1].expand(5, 16))) == "its output is constant"
    assert degenerate(output_stats(torch.full((1, 16), 0.25))) == "its output is constant"
    x[2, 3], x[4, 0] = math.nan, math.inf
    assert degenerate(output_stats(x)) == "2 outputs are not finite (NaN or inf)"


# ---- every layout declares its rounding budget; the shipped ones hold in a run -------------------------------
def test_every_shipped_layout_declares_a_rounding_budget():
    budgets = {name: lay.rounding_budget for name, lay in options("cache_layout").items()}
    assert budgets == {"bf16": 1e-2, "float32": 0.0, "fp8_ds_mla": 0.1, "fp8_ds_mla_fnuz": 0.1,
                       "fp8_per_tensor": 0.1}
    assert all(isinstance(lay, CacheLayout) for lay in options("cache_layout").values())


def test_fp8_rows_at_a_sane_scale_pass_within_their_rounding_budget(compose_cfg, tmp_path):
    run_config(compose_cfg(PER_TENSOR), out_dir=tmp_path)
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "ok"
    assert row["metrics.f32_kv_budget"] == pytest.approx(1.1e-4 + 0.1)
    assert 1e-2 < row["metrics.max_rel_err_vs_f32_kv"] < row["metrics.f32_kv_budget"] / 2    # e4m3's ~3.5e-2
    assert row["metrics.swa.out_max_abs"] > 0 and row["metrics.swa.out_spread"] > 0


# ---- the run itself fails where no check could know -------------------------------------------------------
def test_rows_saturated_to_one_value_fail_the_run_though_the_oracle_agrees(compose_cfg, tmp_path, capsys):
    """kv_scale=1e-30: every value saturates at +-448e-30; the oracle does the same and agrees (rel_err ~0),
    but against exact float32 rows the output is all error."""
    with pytest.raises(ResultMismatch, match=r"layer swa \(idx 0\): rel_err f32 KV 1 > f32 KV budget 0.1"):
        run_config(compose_cfg([*UNGUARDED, "cache_layout.kv_scale=1e-30"]), out_dir=tmp_path)
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "mismatch" and "rel_err f32 KV 1 > f32 KV budget 0.1" in row["error"]
    assert row["metrics.swa.rel_err"] < 1e-4                    # what the old verdict judged by alone
    assert "verdict: MISMATCH: layer swa (idx 0): rel_err f32 KV 1" in capsys.readouterr().out


def test_rows_rounded_to_zero_fail_the_run_from_the_cli(tmp_path):
    """kv_scale=1e30 through a layout that declares no range: every row is stored as 0, every output is 0,
    and the oracle rounding the same way agrees; the run exits 1 and its row says why."""
    r = run_py(*UNGUARDED, "cache_layout.kv_scale=1e30", run_dir=tmp_path, timeout=300,
               extra_env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error: the layers' outputs failed the verdict: layer swa (idx 0): every output is 0" in r.stderr
    assert "Traceback" not in r.stderr
    assert "verdict: MISMATCH: layer swa (idx 0): every output is 0" in r.stdout
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "mismatch" and "every output is 0" in row["error"]
    assert row["metrics.swa.out_max_abs"] == 0 and row["metrics.swa.rel_err"] == 0
