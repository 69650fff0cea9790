"""Every setting validated once, before any work: one line naming the key, the value and what is allowed;
unknown keys refused with the closest known one; a workload the pool cannot hold and a dump folder that
cannot be written refused by `check` as by `run`; a run whose outputs leave the combination's error budget
ends `mismatch`, with a non-zero exit."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from dsv4.app.dispatch import run_config
from dsv4.values.errors import ConfigError, IncompatibleCombination, ResultMismatch
from dsv4.strategies import ReferenceMQA
from dsv4.strategies.protocols import Needs
from tests.conftest import run_py

TINY = ["model=dsv4_tiny", "workload=sweep", "workload.layers=[0,1]"]

BAD = [
    ("seed=abc", "seed=abc: expected a whole number >= 0"),
    ("tp_size=abc", "tp_size=abc: expected a whole number >= 1"),
    ("tp_size=2.5", "tp_size=2.5: expected a whole number >= 1"),
    ("tp_size=0", "tp_size=0: expected a whole number >= 1"),
    ("dtype=float16", "dtype=float16: expected one of float32, bfloat16"),
    ("workload.prompt_lens=abc", "workload.prompt_lens=abc: expected a list of whole numbers >= 1"),
    ("workload.prompt_lens=[10,0]", "workload.prompt_lens[1]=0: expected a whole number >= 1"),
    ("workload.prompt_lens=[]", "workload.prompt_lens=[]: expected at least one request"),
    ("workload.prefill_chunk=1.5", "workload.prefill_chunk=1.5: expected a whole number >= 1"),
    ("workload.decode_steps=-1", "workload.decode_steps=-1: expected a whole number >= 0"),
    ("workload.kv_pool.swa_block_size=0", "workload.kv_pool.swa_block_size=0: expected a whole number >= 1"),
    ("mqa_kernel.chunk=0", "mqa_kernel.chunk=0: expected a whole number >= 1"),
    ("mqa_kernel.chunk=-1", "mqa_kernel.chunk=-1: expected a whole number >= 1"),
    ("model.hidden_size=0", "model.hidden_size=0: expected a whole number >= 1"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps=0: expected a finite number > 0"),
    ("graph.max_context=0", "graph.max_context=0: expected a whole number >= 1"),
    ("graph.enabled=maybe", "graph.enabled=maybe: expected true or false"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0: expected a finite number >= 1.0"),
    ("device.platform=tpu", "device.platform=tpu: expected one of cpu, cuda, rocm"),
    ("mode=nosuch", "mode=nosuch: expected one of run, check, info, bench, summarize"),
    ("+mqa_kernal=x", "mqa_kernal: unknown setting (did you mean mqa_kernel?)"),
    ("+mqa_kernel.chnk=3", "mqa_kernel.chnk: unknown setting (did you mean mqa_kernel.chunk?)"),
    ("+workload.prompt_len=[4]", "workload.prompt_len: unknown setting (did you mean workload.prompt_lens?)"),
    ("+graph.sizes=[1]", "graph.sizes: unknown setting"),
    ("workload.layers=[]", "workload.layers=[]: expected at least one layer index"),
    ("mqa_kernel._target_=nosuch.Foo", "mqa_kernel._target_=nosuch.Foo: cannot import nosuch"),
    ("summary.tables=[bogus]", "summary.tables: unknown metric 'bogus'"),
    ("overlap=maybe", "overlap=maybe: expected true or false"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("mode", ["run", "check"])
def test_a_bad_setting_is_one_line_before_any_work(compose_cfg, tmp_path, override, message, mode):
    cfg = compose_cfg([*TINY, f"mode={mode}", override])
    with pytest.raises(ConfigError) as e:
        run_config(cfg, out_dir=tmp_path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "result.json").exists() or json.loads((tmp_path / "result.json").read_text())[
        "status"] == "error"                                             # a run's row says it; nothing else


@pytest.mark.parametrize("override,message", [BAD[2], BAD[20], BAD[11]], ids=["tp_size", "unknown key", "chunk"])
def test_the_cli_prints_the_line_and_exits_1_without_a_traceback(tmp_path, override, message):
    r = run_py(*TINY, override, run_dir=tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip().startswith(f"error: {message}")
    assert "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr


def test_a_workload_the_pool_cannot_hold_is_refused_by_check_and_run(compose_cfg, tmp_path):
    for mode in ("check", "run"):
        cfg = compose_cfg([*TINY, f"mode={mode}", "workload.prompt_lens=[100000]"])
        with pytest.raises(IncompatibleCombination) as e:
            run_config(cfg, out_dir=tmp_path / mode)
        msg = str(e.value)
        assert "workload.kv_pool.compressed_blocks=" in msg and "ratio-4 compressed" in msg, msg
        assert "fix: workload.kv_pool.compressed_blocks=" in msg
    cfg = compose_cfg([*TINY, "mode=check", "workload.prompt_lens=[10,10,10]", "workload.kv_pool.max_requests=2"])
    with pytest.raises(IncompatibleCombination, match="holds 3 requests at once") as e:
        run_config(cfg, out_dir=tmp_path)
    assert str(e.value).count("- workload.kv_pool.max_requests=") == 1           # one line per knob
    cfg = compose_cfg([*TINY, "mode=check", "workload.layers=[7]"])
    with pytest.raises(IncompatibleCombination, match="workload.layers=.7.: model=dsv4_tiny has layers 0..2"):
        run_config(cfg, out_dir=tmp_path)


def test_the_default_workloads_fit_their_pools(compose_cfg, tmp_path, capsys):
    for workload in ("default", "sweep"):
        run_config(compose_cfg(["mode=check", f"workload={workload}"]), out_dir=tmp_path)
        assert capsys.readouterr().out.startswith("OK:")


def test_an_unwritable_dump_dir_is_refused_before_the_run(compose_cfg, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for mode in ("check", "run"):
        cfg = compose_cfg([*TINY, f"mode={mode}", f"dump_dir={blocker}/case"])
        with pytest.raises(IncompatibleCombination, match=r"dump_dir=.*a_file/case: .*a_file is not a writable folder"):
            run_config(cfg, out_dir=tmp_path / mode)
    row = json.loads((tmp_path / "run" / "result.json").read_text())      # run: the refusal is the row
    assert row["status"] == "incompatible" and row["problems"][0]["group"] == "dump_dir"
    assert not (tmp_path / "check" / "result.json").exists()


# ---- a wrong result fails the run ------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SinkFlippedMQA:
    """The reference kernel with one sign wrong (the attention sink's): what a one-line bug looks like."""
    name: str = "sink_flipped"
    error_budget: ClassVar[float] = 0.0

    def needs(self, device) -> Needs:
        return Needs()

    def prepare(self, *, device) -> None:
        return None

    def plan(self, *, tokens: int, layer_type: str, previous=None) -> None:
        return None

    def __call__(self, q, kv, *, sink, scale: float, prepared=None, plan=None):
        return ReferenceMQA()(q, kv, sink=-sink, scale=scale)


BROKEN = [*TINY, "mqa_kernel._target_=tests.test_settings.SinkFlippedMQA", "~mqa_kernel.chunk",
          "mqa_kernel.name=sink_flipped"]


def test_a_broken_strategy_makes_the_run_a_mismatch(compose_cfg, tmp_path, capsys):
    with pytest.raises(ResultMismatch, match=r"layer swa \(idx 0\): rel_err .* > budget 0.00011"):
        run_config(compose_cfg(BROKEN), out_dir=tmp_path)
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "mismatch" and "rel_err" in row["error"]
    assert row["metrics.error_budget"] == pytest.approx(1.1e-4)
    assert "verdict: MISMATCH: layer swa (idx 0)" in capsys.readouterr().out
    run_config(compose_cfg(TINY), out_dir=tmp_path / "ok")                # the same run, the reference kernel: ok
    good = json.loads((tmp_path / "ok" / "result.json").read_text())
    assert good["status"] == "ok" and good["metrics.max_rel_err"] <= good["metrics.error_budget"]


def test_a_mismatch_exits_non_zero_from_the_cli(tmp_path):
    r = run_py(*BROKEN, run_dir=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "error: the layers' outputs failed the verdict: layer swa (idx 0)" in r.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "mismatch"


def test_a_mismatch_in_a_sweep_cell_is_its_row(compose_cfg, tmp_path):
    assert run_config(compose_cfg(BROKEN), out_dir=tmp_path, multirun=True) is None
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "mismatch"


def test_a_sweep_with_a_mismatch_cell_fails():
    from dsv4.reports.report import Status
    from dsv4.reports.sweep_summary import failure

    n = {s: 0 for s in Status} | {Status.OK: 3, Status.MISMATCH: 1}
    assert failure(n, 4) == "1 of 4 jobs gave outputs outside their error budget"
    assert failure(n | {Status.MISMATCH: 0}, 4) is None


def test_the_verdict_fails_nan_errors_and_wrong_selections():
    from dsv4.app.grades import LayerGrade, OutputStats, SelectionGrade, verdict

    def grade(layer: int, rel_err: float, **selection) -> LayerGrade:
        return LayerGrade(layer=layer, compress_ratio=4 if selection else 1, rel_err=rel_err, cosine=1.0,
                          output=OutputStats(nonfinite=0, max_abs=1.0, spread=1.0),
                          selection=SelectionGrade(exact=1.0, recall={}, **selection) if selection else None)

    ok = {"swa": grade(0, 1e-7), "c4a": grade(1, 2e-7, count_ok=True, max_gap=3e-8)}
    assert verdict(ok, budget=1e-5, gap=1e-5, f32_budget=0.1) == []
    nan = ok | {"swa": grade(0, float("nan"))}
    assert verdict(nan, budget=1e-5, gap=1e-5, f32_budget=0.1) == ["layer swa (idx 0): rel_err nan > budget 1e-05"]
    off = ok | {"c4a": grade(1, 2e-7, count_ok=True, max_gap=0.3)}
    assert verdict(off, budget=1e-5, gap=1e-5, f32_budget=0.1) == [
        "layer c4a (idx 1): a top-k entry 0.3 below the oracle's k-th score (allowed: 1e-05)"]
    short = ok | {"c4a": grade(1, 2e-7, count_ok=False, max_gap=3e-8)}
    assert verdict(short, budget=1e-5, gap=1e-5, f32_budget=0.1) == [
        "layer c4a (idx 1): a top-k list of the wrong size"]


def test_a_mismatch_of_spawned_ranks_stays_a_mismatch(tmp_path):
    r = run_py(*BROKEN, "tp_size=2", "parallel.launcher=spawn", run_dir=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "error: layer swa (idx 0): rel_err" in r.stderr and "Traceback" not in r.stderr.split("error:")[-1]
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "mismatch"


def test_a_string_setting_the_command_line_parsed_as_a_number_stays_a_string(compose_cfg, tmp_path, monkeypatch):
    from dsv4.app.job import make_job

    monkeypatch.chdir(tmp_path)
    assert make_job(compose_cfg([*TINY, "dump_dir=2024"])).run.dump_dir == "2024"
    with pytest.raises(ConfigError, match="checkpoint=null: expected a group of settings"):
        make_job(compose_cfg([*TINY, "checkpoint=null"]))


@pytest.mark.parametrize("override", ["model.rope_theta=inf", "model.rope_theta=1e400", "model.rms_norm_eps=-inf",
                                      "parallel.timeout_s=nan", "model.rope_scaling.factor=inf",
                                      "cache_layout=fp8_per_tensor cache_layout.kv_scale=inf"])
def test_every_float_setting_is_finite(override):
    """A float setting that is not a finite number (inf, nan, a literal past float range) is refused when it
    is read, with the key, never accepted to fail (or quietly give inf) later."""
    import dsv4
    from dsv4.values.errors import ConfigError

    with pytest.raises(ConfigError, match=r"=(inf|-inf|nan).*finite number"):
        dsv4.compose(["model=dsv4_tiny", *override.split()], running=False)
