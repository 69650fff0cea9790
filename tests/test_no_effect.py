"""A setting given on the command line (or to `api.compose`) that changes nothing in the chosen job is named
once, with why: a warning, and the job still runs."""
from __future__ import annotations

import warnings

import pytest

from dsv4 import api
from tests.conftest import run_py

TINY = ["model=dsv4_tiny"]

INERT = [  # (overrides, the one that has no effect, words of its why)
    (["overlap=false"], "overlap=false", "side stream is a GPU's"),
    (["graph.max_context=100"], "graph.max_context=100", "graph.enabled=false"),
    (["parallel.timeout_s=5"], "parallel.timeout_s=5", "tp_size=1"),
    (["dump_overwrite=true"], "dump_overwrite=true", "no dump_dir"),
    (["checkpoint.path=/nowhere"], "checkpoint.path=/nowhere", "weights=random"),
    (["workload.layers=[0,2]", "indexer=exact"], "indexer=exact", "no ratio-4 layer"),
    (["indexer.top_k=triton"], "indexer.top_k=triton", "torch.topk"),
    (["summary.baseline=null"], "summary.baseline=null", "sweep (-m)"),
]


def said(overrides, **kw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.compose(TINY + overrides, **kw)
    return [str(w.message) for w in caught if "has no effect" in str(w.message)]


@pytest.mark.parametrize("overrides,inert,why", INERT, ids=[i[1] for i in INERT])
def test_a_setting_without_effect_is_named_with_why(overrides, inert, why):
    lines = said(overrides)
    assert len(lines) == 1 and lines[0].startswith(f"{inert} has no effect: ") and why in lines[0], lines


@pytest.mark.parametrize("overrides", [
    ["model=dsv4_flash", "deployment=h200", "graph.max_context=100", "overlap=false", "indexer.top_k=triton"],
    ["tp_size=2", "parallel.timeout_s=5"],
    ["indexer=exact", "seed=3", "workload.prefill_chunk=7"],
])
def test_a_setting_with_effect_is_not(overrides):
    assert said(overrides, running=False) == []


def test_the_command_line_names_it_once_on_stderr_and_runs():
    p = run_py(*TINY, "overlap=false", "mode=check")
    assert p.returncode == 0 and p.stdout.startswith("OK: "), p.stderr
    assert p.stderr.count("has no effect") == 1 and "warning: overlap=false has no effect" in p.stderr, p.stderr
