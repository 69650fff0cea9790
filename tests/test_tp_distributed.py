"""Tensor parallelism across processes (torch.distributed, gloo on the CPU): one process per rank gives
what one process with all heads gives; torchrun and parallel.launcher=spawn launch it; a wrong world
size is refused; one rank's failure ends the whole job, non-zero, with that rank's message, in bounded time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from dsv4.app import parallel
from dsv4.oracle import rel_err
from tests.conftest import ROOT, chunked, drive, hidden_for, make_engine, tiny_spec

SPEC = dict(o_groups=4)            # dsv4_tiny with 4 output groups: 8 heads split 2 or 4 ways
LENGTHS = {"a": 150, "b": 37, "c": 9}
SCHEDULE = chunked(LENGTHS, 64) + [{r: 2 for r in LENGTHS}] * 3 + [{"a": 1, "c": 3}]   # prefill, MTP decode
TOTAL = {r: sum(step.get(r, 0) for step in SCHEDULE) for r in LENGTHS}


def _tp_worker(tp: int, out_path: str) -> None:
    """One rank: its heads and groups only, its own pools, wo_b's partial sums all-reduced."""
    ranks = parallel.init(platform="cpu", tp_size=tp, config=parallel.ParallelConfig(timeout_s=60))
    spec = tiny_spec(**SPEC)                                  # the full weights, same seed on every rank
    eng, _ = make_engine(spec, tp_size=tp, ranks=[ranks.rank], all_reduce=ranks.all_reduce)
    assert eng.layers[0][0].heads == 8 // tp
    outs, topk = drive(eng, hidden_for(TOTAL, spec.hidden_size), SCHEDULE)
    if ranks.is_main:
        torch.save({"outs": outs, "topk": topk}, out_path)
    parallel.shutdown()


@pytest.fixture(scope="module")
def tp1():
    eng, _ = make_engine(tiny_spec(**SPEC))
    return drive(eng, hidden_for(TOTAL, eng.spec.hidden_size), SCHEDULE)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_processes_per_rank_match_one_process(tp, tp1, tmp_path):
    out = tmp_path / "out.pt"
    parallel.spawn(_tp_worker, tp, tp, str(out))
    got = torch.load(out)
    ref_outs, ref_topk = tp1
    for layer in ref_outs:                                     # swa, c4a, c128a
        for r in LENGTHS:
            # float32 products of other shapes (each rank's share of the weights) round other last bits
            assert rel_err(got["outs"][layer][r], ref_outs[layer][r]) <= 3e-5, (tp, layer, r)
    for layer in ref_topk:
        for r in LENGTHS:
            assert torch.equal(got["topk"][layer][r], ref_topk[layer][r])


# ---- through run.py ---------------------------------------------------------------------------------
SMALL = ["model=dsv4_tiny", "workload.prompt_lens=[140,33]", "workload.prefill_chunk=64", "workload.decode_steps=2"]


def torchrun(n: int, *args: str, cwd, script: str | None = None, timeout: float = 240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
           str(parallel.free_port()), script or str(ROOT / "run.py"), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_torchrun_two_ranks_writes_one_result_with_per_rank_memory(tmp_path):
    r = torchrun(2, *SMALL, "tp_size=2", "hydra.run.dir=out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("dsv4 run") == 1 and "2 processes (cpu ranks, torch.distributed)" in r.stdout
    row = json.loads((tmp_path / "out" / "result.json").read_text())
    assert row["status"] == "ok" and row["settings.tp_size"] == 2 and row["settings.processes"] == 2
    assert [m["rank"] for m in row["metrics.ranks"]] == [0, 1]
    assert all(m["kv_pool_bytes"] > 0 and m["weight_bytes"] > 0 for m in row["metrics.ranks"])
    # float32 against the whole-sequence oracle, within the run's own budget: its bf16 KV rows may round a
    # value the other way where the CPU's float32 products differ in the last bit (2e-5 on some CPUs)
    assert row["metrics.max_rel_err"] <= row["metrics.error_budget"] <= 2e-4
    for name in ("swa", "c4a", "c128a"):
        assert row[f"metrics.{name}.decode_allreduce_ms_step"] >= 0


@pytest.mark.slow
def test_torchrun_world_size_must_equal_tp_size(tmp_path):
    r = torchrun(2, *SMALL, "tp_size=1", cwd=tmp_path)
    assert r.returncode != 0
    assert "tp_size=1: the job was launched as 2 processes" in r.stderr and "fix: tp_size=2" in r.stderr
    assert r.stderr.count("Incompatible attention combination") == 1       # said once, by rank 0


def test_more_nccl_ranks_than_gpus_is_refused_before_joining(monkeypatch):
    """NCCL cannot put two ranks on one GPU; the process says so, with the fix, instead of NCCL's error."""
    from dsv4.values.errors import ConfigError

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(torch.cuda.device_count() + 1))
    with pytest.raises(ConfigError, match="over NCCL need a GPU each.*fix: .*parallel.backend=gloo"):
        parallel.init(platform="cuda", tp_size=2, config=parallel.ParallelConfig())


FAILING = """
import os, runpy
if os.environ["RANK"] == "1":
    from dsv4.components import engine
    step, calls = engine.Engine.step, []
    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure in step 3 (stands in for CUDA out of memory)")
        return step(self, *a, **k)
    engine.Engine.step = failing
runpy.run_path({run!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_one_failing_rank_ends_the_job_with_its_message(tmp_path):
    script = tmp_path / "failing_run.py"
    script.write_text(FAILING.format(run=str(ROOT / "run.py")))
    t0 = time.monotonic()
    r = torchrun(2, *SMALL, "tp_size=2", "parallel.timeout_s=30", cwd=tmp_path, script=str(script), timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "rank 1 failed: RuntimeError: injected failure in step 3" in r.stderr
    assert elapsed < 60, elapsed              # rank 0 is stopped, not left waiting in its all-reduce
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("result.json"))


@pytest.mark.slow
def test_spawn_launcher_in_a_multirun_over_tp_size(tmp_path):
    """What a Hydra sweep over tp_size uses: each job starts its own rank processes."""
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", *SMALL, "tp_size=1,2", "parallel.launcher=spawn",
           "hydra.sweep.dir=sweep"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads((tmp_path / "sweep" / str(i) / "result.json").read_text()) for i in (0, 1)]
    assert [row["settings.processes"] for row in rows] == [1, 2]
    assert all(row["status"] == "ok" and row["metrics.max_rel_err"] <= row["metrics.error_budget"] for row in rows)


# ---- mode=bench's tensor-parallel step table, on the CPU ---------------------------------------------
def _bench_worker(tp: int, out_path: str) -> None:
    from dsv4.api import compose
    from dsv4.speed.tp_step import bench_tp_step

    ranks = parallel.init(platform="cpu", tp_size=tp, config=parallel.ParallelConfig(timeout_s=60))
    job = compose(["model=dsv4_tiny", f"tp_size={tp}"])
    text = bench_tp_step(job, ranks, step=(3, 2, 300))
    if ranks.is_main:
        with open(out_path, "w") as f:
            f.write(text)
    parallel.shutdown()


@pytest.mark.slow
def test_tp_step_bench_times_each_layer_and_its_all_reduce(tmp_path):
    """The table `torchrun ... mode=bench tp_size=N` prints (timed on GPUs; here its rows on gloo): a row per
    layer type with both tp sizes' step times and a non-zero all-reduce, and each rank's memory, the
    weights per rank smaller at tp_size=2 than at 1."""
    out = tmp_path / "table.txt"
    parallel.spawn(_bench_worker, 2, 2, str(out))
    lines = out.read_text().splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    for kind in ("swa", "c4a", "c128a"):
        one, two, reduce = (float(v) for v in rows[kind][1:4])
        assert one > 0 and two > 0 and 0 < reduce < two, rows[kind]
    weights = next(ln.split() for ln in lines if ln.strip().startswith("weights"))
    assert float(weights[2]) < float(weights[1]), weights
    assert any(ln.strip().startswith("peak (process max RSS)") for ln in lines)
