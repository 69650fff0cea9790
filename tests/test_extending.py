"""A cache layout of one's own is its class and its YAML (docs/options.md §9.1). The layouts here
are defined in this file and named by YAML files that a fixture writes into a folder of its own, put on
Hydra's search path: no file of the package names them, and yet they compose, check() judges them by their
row format (never by name), and a run through them matches the oracle, which rounds rows as they store them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import dsv4
from dsv4 import oracle
from dsv4.checks.compat import check
from dsv4.formats.row_format import BF16_ROWS, RowFormat, plain_rows
from dsv4.strategies.protocols import CacheAccess, CacheLayout, Needs
from tests.conftest import run_py

LAYOUTS = {"fp16_rows": "Fp16Rows", "my_bf16_rows": "MyBf16Rows"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Fp16Rows:
    """float16 rows [pages, block_size, head_dim]: a row format that no shipped layout stores and no kernel
    but the reference reads."""
    name: str = "fp16_rows"
    error_budget: ClassVar[float] = 1e-4     # vs the oracle, which rounds rows as they are stored
    rounding_budget: ClassVar[float] = 1e-3  # vs exact float32 rows: float16's rounding costs ~2.7e-4

    @property
    def row_format(self) -> RowFormat:
        return plain_rows("float16")

    def needs(self, device) -> Needs:
        return Needs()

    def bytes_per_token(self, head_dim: int) -> int:
        return 2 * head_dim

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * self.bytes_per_token(head_dim)

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        return torch.zeros(num_blocks, block_size, head_dim, dtype=torch.float16, device=device)

    def read(self, cache, slots, *, block_size: int):
        rows = cache.view(-1, cache.shape[-1])[slots.clamp(min=0).long()].float()
        return torch.where((slots >= 0)[..., None], rows, torch.zeros((), dtype=rows.dtype))

    def access(self, cache, *, block_size: int, gpu: bool) -> CacheAccess:
        def write(slots, rows) -> None:
            flat, keep = cache.view(-1, cache.shape[-1]), slots >= 0  # the CPU's scatter (reads the mask)
            flat[slots[keep].long()] = rows[keep].to(flat.dtype)

        return CacheAccess(write=write)       # no kernel store: rows go through `write`


@dataclass(frozen=True, slots=True, kw_only=True)
class MyBf16Rows:
    """bf16 rows under a name of its own, in the container the in-place kernels read bf16 rows from."""
    name: str = "my_bf16_rows"
    error_budget: ClassVar[float] = 1e-4
    rounding_budget: ClassVar[float] = 1e-2  # bf16 rows' (dsv4/strategies/cache_layout/common.py)

    @property
    def row_format(self) -> RowFormat:
        return BF16_ROWS

    def allocate(self, *, num_blocks: int, block_size: int, head_dim: int, device: str):
        return torch.zeros(num_blocks, block_size, head_dim, dtype=torch.bfloat16, device=device)

    # two bytes a value too: the rest as Fp16Rows does it
    needs, bytes_per_token, page_bytes = Fp16Rows.needs, Fp16Rows.bytes_per_token, Fp16Rows.page_bytes
    read, access = Fp16Rows.read, Fp16Rows.access


@pytest.fixture
def layout_dir(tmp_path):
    """A config folder holding the layouts' YAML files (cache_layout/<name>.yaml), and the override that puts
    it on Hydra's search path."""
    (tmp_path / "cache_layout").mkdir()
    for name, cls in LAYOUTS.items():
        (tmp_path / "cache_layout" / f"{name}.yaml").write_text(
            f"# {cls}, defined in tests/test_extending.py\n_target_: tests.test_extending.{cls}\nname: {name}\n")
    return f"hydra.searchpath=[file://{tmp_path}]"


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_layout_composes_from_its_yaml_alone(layout_dir, name):
    job = dsv4.compose(["model=dsv4_tiny", "backend=reference", f"cache_layout={name}", layout_dir])
    lay = job.combo.cache_layout
    assert type(lay).__name__ == LAYOUTS[name] and lay.name == name and isinstance(lay, CacheLayout)
    assert job.choices["cache_layout"] == name


def test_check_judges_a_layout_by_its_row_format():
    job = dsv4.compose(["deployment=h200", "backend=triton"], running=False)
    for mine, problems in ((MyBf16Rows(), set()), (Fp16Rows(), {("cache_layout", "fp16_rows")})):
        got = check(job.combo.with_choice("cache_layout", mine), job.device)
        assert {(p.group, p.value) for p in got} == problems
    (p,) = check(job.combo.with_choice("cache_layout", Fp16Rows()), job.device)
    assert p.supported == ("bf16", "fp8_ds_mla", "fp8_ds_mla_fnuz") and p.fix == "cache_layout=bf16"
    flashmla = dsv4.compose(["deployment=h200"], running=False)
    (p,) = check(flashmla.combo.with_choice("cache_layout", MyBf16Rows()), flashmla.device)
    assert (p.group, p.value, p.fix) == ("cache_layout", "my_bf16_rows", "cache_layout=fp8_ds_mla")
    assert "mqa_kernel=flashmla_sparse reads only ['fp8_ds_mla']" in p.reason


def test_a_layout_of_ones_own_runs_against_the_oracle(layout_dir):
    """Every layer type of dsv4_tiny through fp16 rows: a prefill and two decode steps, against the oracle
    that rounds the cached rows to float16 as they were stored (and against bf16 rounding, which differs)."""
    job = dsv4.compose(["model=dsv4_tiny", "backend=reference", "indexer=exact", "cache_layout=fp16_rows",
                        layout_dir])
    spec = job.spec
    layers = spec.one_layer_per_type()
    weights = {l: dsv4.random_layer_weights(spec, l, seed=3) for l in layers}
    engine = dsv4.build_engine(job, weights=weights)
    x = torch.randn(70, spec.hidden_size, generator=torch.Generator().manual_seed(4))
    engine.add_request("r")
    outs, topk = {l: [] for l in layers}, {l: [] for l in layers}
    for start, n in [(0, 66), (66, 2), (68, 2)]:
        step = engine.step(x[start:start + n], torch.arange(start, start + n), ["r"] * n)
        for l in layers:
            outs[l].append(step.outputs[l])
            if step.topk.get(l) is not None:
                topk[l].append(step.topk[l])
    label = job.combo.cache_layout.row_format.label
    assert label == "float16"
    for l in layers:
        sel = torch.cat(topk[l]).long() if topk[l] else None
        got = torch.cat(outs[l])
        want = oracle.oracle_layer(spec.to_dump(), spec.compress_ratio(l), weights[l], x, row_format=label, topk=sel)
        other = oracle.oracle_layer(spec.to_dump(), spec.compress_ratio(l), weights[l], x, row_format="bfloat16",
                                    topk=sel)
        err = oracle.rel_err(got, want["out"])
        assert err < 1e-5, (spec.layer_type(l), err)
        assert oracle.rel_err(got, other["out"]) > 10 * err, spec.layer_type(l)


def test_run_py_runs_a_layout_of_ones_own(layout_dir, tmp_path):
    r = run_py("model=dsv4_tiny", "cache_layout=fp16_rows", layout_dir, run_dir=tmp_path / "run", timeout=300,
               extra_env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "cache_layout=fp16_rows" in out and "row_format=float16" in out and "verdict: ok" in out, out[-3000:]
