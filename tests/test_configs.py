"""Every config composes, instantiates on CPU without allocating, and passes `check`; the `_target_`s
name public dsv4 objects and the strategy classes are frozen keyword-only dataclasses; the model specs
carry the real values; and the command line (`run.py`) reports user errors cleanly, with `mode=check`
staying torch-free.

Options are discovered from configs/<group>/*.yaml, so a new YAML is tested with no edit here.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
from collections import Counter
from itertools import product
from pathlib import Path

import pytest
from hydra.utils import instantiate
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

import dsv4.strategies
from tests.conftest import CONFIGS, options, run_py
from dsv4.checks.catalogue import GROUPS, NESTED_GROUPS, folder, instantiate_group, option
from dsv4.checks.catalogue import options as shipped
from dsv4.app.job import make_job, problems_for
from dsv4.app.modes.info import info
from dsv4.values.settings import MODES
from dsv4.checks.compat import check
from dsv4.values.device import DeviceInfo, local_platform
from dsv4.values.spec import ModelSpec
from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, IndexerStrategy, LinearStrategy,
                                       MQAKernelStrategy, OProjStrategy, TopKStrategy)

ALL_GROUPS = ("mqa_kernel", "o_proj", "head_padding", "cache_layout", "indexer", "linear", "backend", "model",
              "workload", "deployment")
PROTOCOLS = {"mqa_kernel": MQAKernelStrategy, "o_proj": OProjStrategy, "head_padding": HeadPaddingPolicy,
             "cache_layout": CacheLayout, "indexer": IndexerStrategy, "linear": LinearStrategy,
             "indexer.top_k": TopKStrategy}
HYDRA_KEYS = {"_target_", "_convert_", "_recursive_", "_partial_", "_args_"}
KERNEL_LIBS = ("flash_mla", "flashinfer", "deep_gemm", "aiter")


def load_yaml(path: Path):
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def yaml_overrides(path: Path) -> dict[str, str]:
    """`override /group: option` entries of a preset's defaults list."""
    out = {}
    for entry in load_yaml(path).get("defaults", []):
        if isinstance(entry, dict):
            for k, v in entry.items():
                if k.startswith("override /"):
                    out[k[len("override /"):]] = v
    return out


OPTION_CASES = [pytest.param(g, o, id=f"{g}={o}") for g in ALL_GROUPS for o in options(g)]
PAIR_CASES = [pytest.param(b, d, id=f"backend={b},deployment={d}")
              for b, d in product(options("backend"), options("deployment"))]
STRATEGY_YAMLS = [pytest.param(g, p, id=f"{g}={p.stem}") for g in GROUPS + NESTED_GROUPS
                  for p in sorted(folder(g).glob("*.yaml"))]


def _targets() -> list[tuple[str, str]]:
    found = []

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "_target_":
                    found.append((where, v))
                else:
                    walk(v, where)
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for path in sorted(CONFIGS.rglob("*.yaml")):
        walk(load_yaml(path), str(path.relative_to(CONFIGS)))
    return found


TARGETS = _targets()


# ---- discovery -------------------------------------------------------------------------------------
def test_every_group_folder_is_covered_and_nonempty():
    folders = {p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    # experiment/ holds sweeps, not options of the combination: tests/test_sweeps.py composes them
    assert folders == set(ALL_GROUPS) | {"experiment"}, "a config group was added or removed: update ALL_GROUPS"
    for g in ALL_GROUPS:
        assert options(g), f"configs/{g}/ has no option"
    assert set(GROUPS) <= set(ALL_GROUPS)


def test_nested_groups_are_the_folders_inside_the_groups():
    """A folder inside a strategy group's folder is a nested group (NESTED_GROUPS: configs/indexer/top_k/),
    whose options an option's field names."""
    inner = {f"{g}.{p.name}" for g in GROUPS for p in (CONFIGS / g).iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert inner == set(NESTED_GROUPS)
    for nested in NESTED_GROUPS:
        parent, _, key = nested.rpartition(".")
        assert all(getattr(opt, key).name == load_yaml(folder(parent) / f"{name}.yaml")[key]
                   for name, opt in shipped(parent).items())


def test_glob_discovery_matches_hydra_group_options():
    from hydra import initialize_config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
            loader = GlobalHydra.instance().config_loader()
            for g in ALL_GROUPS:
                assert sorted(loader.get_group_options(g)) == options(g)
    finally:
        GlobalHydra.instance().clear()


# ---- every option, every backend x deployment pair -------------------------------------------------
def platform_ok(job) -> bool:
    """Whether every strategy of the combination runs on the job's device (platform and arch, by its needs)."""
    needs = [getattr(job.combo, g).needs(job.device)
             for g in ("mqa_kernel", "o_proj", "cache_layout", "indexer", "linear")]
    return all((not n.platforms or job.device.platform in n.platforms) and (not n.archs or job.device.arch in n.archs)
               for n in needs)


def assert_verdict(job):
    """With the default model dsv4_flash a shipped option is valid wherever its platform is -- except that
    the cache layout a kernel reads may depend on the arch (aiter_sparse: fp8_ds_mla_fnuz on gfx942,
    fp8_ds_mla on gfx950), which check() then refuses with a fix that makes it valid; elsewhere check()
    refuses it, each problem with a fix. (The full golden matrix is its own test.)"""
    problems = check(job.combo, job.device)
    if platform_ok(job) and problems and all(p.group == "cache_layout" for p in problems):
        (p,) = problems
        fix = CONFIGS / "cache_layout" / f"{p.fix.split('=', 1)[1]}.yaml"
        fixed = instantiate(OmegaConf.load(fix), _convert_="all")
        assert check(job.combo.with_choice("cache_layout", fixed), job.device) == [], p.line()
    elif platform_ok(job):
        assert problems == []
        if job.device.platform == local_platform():
            assert check(job.combo, job.device, here=local_platform()) == []
    else:
        assert problems and all(p.fix for p in problems), [p.line() for p in problems]
        assert any(job.device.describe() in p.reason for p in problems)



@pytest.mark.parametrize("group,option", OPTION_CASES)
def test_option_composes_instantiates_and_checks(compose_cfg, no_alloc, group, option):
    cfg = compose_cfg([f"{group}={option}"])
    job = make_job(cfg)
    assert_verdict(job)
    if group in GROUPS:
        assert getattr(job.combo, group).name == option
        assert job.choices[group] == option
    elif group == "model":
        assert job.spec.name == option
    elif group == "deployment":
        node = load_yaml(CONFIGS / "deployment" / f"{option}.yaml")
        assert job.device == DeviceInfo.from_config(node["device"])
        assert job.combo.tp_size == node.get("tp_size", 1)
    elif group == "backend":
        for g, opt in yaml_overrides(CONFIGS / "backend" / f"{option}.yaml").items():
            assert getattr(job.combo, g).name == opt
    elif group == "workload":
        assert OmegaConf.to_container(cfg.workload) == load_yaml(CONFIGS / "workload" / f"{option}.yaml")


@pytest.mark.parametrize("backend,deployment", PAIR_CASES)
def test_backend_deployment_pair_composes_and_checks(compose_cfg, no_alloc, backend, deployment):
    cfg = compose_cfg([f"backend={backend}", f"deployment={deployment}"])
    job = make_job(cfg)
    assert_verdict(job)
    dep = load_yaml(CONFIGS / "deployment" / f"{deployment}.yaml")
    assert job.device == DeviceInfo.from_config(dep["device"])
    direct = yaml_overrides(CONFIGS / "deployment" / f"{deployment}.yaml")
    # the backend picked on the command line wins over the deployment's default backend
    for g, opt in yaml_overrides(CONFIGS / "backend" / f"{backend}.yaml").items():
        if g not in direct:
            assert getattr(job.combo, g).name == opt, g


# ---- _target_s and strategy classes ------------------------------------------------------------------
def test_targets_were_found():
    assert len(TARGETS) >= len(STRATEGY_YAMLS) >= len(GROUPS)


@pytest.mark.parametrize("where,target", TARGETS, ids=[f"{w}:{t}" for w, t in TARGETS])
def test_target_resolves_to_a_public_dsv4_name(where, target):
    assert target.startswith("dsv4."), where
    assert "._" not in target, f"{where}: {target} is not a public name"
    obj = get_object(target)
    assert obj is not None
    if target.startswith("dsv4.strategies."):
        assert target.count(".") == 2 and target.rsplit(".", 1)[1] in dsv4.strategies.__all__, (
            f"{where}: strategies are re-exported from dsv4.strategies")


@pytest.mark.parametrize("group,path", STRATEGY_YAMLS)
def test_strategy_class_and_yaml(group, path):
    node = load_yaml(path)
    cls = get_object(node["_target_"])
    assert inspect.isclass(cls) and dataclasses.is_dataclass(cls)
    assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    assert "__slots__" in cls.__dict__, f"{cls.__name__} has no slots"
    assert all(f.kw_only for f in dataclasses.fields(cls)), f"{cls.__name__} is not kw_only"
    assert node.get("_convert_") == "all", f"{path.name}: strategy YAMLs need _convert_: all"
    assert node.get("name") == path.stem, f"{path.name}: name must equal the file stem"
    kw = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    inspect.signature(cls).bind(**kw)                       # YAML keys bind to the constructor
    with pytest.raises(TypeError):
        cls(*kw.values())                                   # kw_only: positional construction fails

    inst = instantiate_group(OmegaConf.load(path), group)
    assert type(inst) is cls
    assert inst.name == path.stem
    assert type(inst).__mro__ == (cls, object), "strategies subclass nothing"
    assert isinstance(inst, PROTOCOLS[group])
    assert not hasattr(inst, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        inst.name = "changed"
    for f in dataclasses.fields(inst):
        assert not isinstance(getattr(inst, f.name), (DictConfig, ListConfig, list, dict)), f.name
    hash(inst)                                              # primitive, hashable fields only


# ---- model specs -------------------------------------------------------------------------------------
def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_config(load_yaml(CONFIGS / "model" / f"{name}.yaml"))


# docs/numerics.md §1.1
REAL = {
    "dsv4_flash": dict(hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
                       o_groups=8, index_topk=512, n_ratios=44, mix={1: 2, 4: 21, 128: 20},
                       swa=[0, 1], csa=list(range(2, 43, 2)), hca=list(range(3, 42, 2))),
    "dsv4_pro": dict(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                     o_groups=16, index_topk=1024, n_ratios=62, mix={4: 30, 128: 31},
                     swa=[], csa=list(range(2, 61, 2)), hca=[0, 1] + list(range(3, 60, 2))),
}


@pytest.mark.parametrize("name", REAL)
def test_real_model_spec_values(name):
    s, e = spec_of(name), REAL[name]
    assert s.name == name
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_groups", "index_topk"):
        assert getattr(s, k) == e[k], k
    assert (s.head_dim, s.qk_rope_head_dim, s.nope_dim, s.o_lora_rank, s.sliding_window) == (512, 64, 448, 1024, 128)
    assert (s.index_n_heads, s.index_head_dim) == (64, 128)
    assert (s.rope_theta, s.compress_rope_theta) == (10000.0, 160000.0)
    rs = s.rope_scaling
    assert (rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow) == (16.0, 65536, 32.0, 1.0)
    assert s.max_position_embeddings == 1048576 and s.rms_norm_eps == 1e-6
    assert s.heads_per_group == 8
    assert s.softmax_scale == pytest.approx(512 ** -0.5)

    assert len(s.compress_ratios) == e["n_ratios"] == s.num_hidden_layers + 1
    assert s.compress_ratios[-1] == 0, "the trailing MTP entry is 0"
    ratios = [s.compress_ratio(l) for l in range(s.num_hidden_layers)]
    assert Counter(ratios) == Counter(e["mix"])
    assert [l for l, r in enumerate(ratios) if r == 1] == e["swa"]
    assert [l for l, r in enumerate(ratios) if r == 4] == e["csa"]
    assert [l for l, r in enumerate(ratios) if r == 128] == e["hca"]


def test_tiny_model_has_the_real_structure_and_its_stated_properties():
    s, flash = spec_of("dsv4_tiny"), spec_of("dsv4_flash")
    assert (s.head_dim, s.qk_rope_head_dim, s.index_head_dim) == (flash.head_dim, flash.qk_rope_head_dim,
                                                                  flash.index_head_dim)
    assert s.rope_scaling == flash.rope_scaling
    assert {0, 4, 128} <= set(s.compress_ratios[:s.num_hidden_layers])
    assert [s.layer_type(l) for l in s.one_layer_per_type()] == ["swa", "c4a", "c128a"]
    assert s.index_n_heads >= 8
    assert s.num_attention_heads % s.o_groups == 0

    wl = load_yaml(CONFIGS / "workload" / "default.yaml")
    longest = max(wl["prompt_lens"])
    assert longest == 300
    p = longest - 1                                           # last position of the 300-token request
    assert (p + 1) // 4 > s.index_topk, "a ratio-4 layer must see more entries than index_topk"
    assert (p + 1) // 128 >= 2, "a ratio-128 layer must have at least 2 entries"
    assert s.sliding_window < min(wl["prompt_lens"]), "the window must slide within every prompt"


def test_spec_rejects_a_negative_compress_ratio():
    cfg = load_yaml(CONFIGS / "model" / "dsv4_tiny.yaml")
    cfg["compress_ratios"] = [0, 4, -3, 0]
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelSpec.from_config(cfg)


# ---- in-process app behaviour --------------------------------------------------------------------------
def info_rows() -> set[str]:
    """mode=info's rows: every option of every group and nested group (indexer.top_k)."""
    return {f"{g}={o}" for g in GROUPS + NESTED_GROUPS for o in shipped(g)}


def test_info_lists_every_strategy_option_with_a_verdict(compose_cfg, no_alloc):
    """Every option of every group and every indexer.top_k; on the CPU ok exactly for what runs there."""
    job = make_job(compose_cfg([]))
    rows = parse_info(info(job))
    assert set(rows) == info_rows()
    assert {k for k in rows if k.startswith("indexer.top_k=")} == {"indexer.top_k=triton", "indexer.top_k=flashinfer"}
    for key, (verdict, _) in rows.items():
        g, o = key.split("=")
        strat = option(g, o)
        plats = strat.needs(job.device).platforms if hasattr(strat, "needs") else frozenset()
        assert verdict == ("ok" if not plats or "cpu" in plats else "no"), key
    starred = sorted(k for k, (_, star) in rows.items() if star)
    assert starred == sorted([f"{g}={getattr(job.combo, g).name}" for g in GROUPS] + ["indexer.top_k=triton"])


def test_info_says_no_with_the_reason(compose_cfg):
    job = make_job(compose_cfg(["tp_size=3"]))
    text = info(job)
    rows = parse_info(text)
    assert all(verdict == "no" for verdict, _ in rows.values())
    option_lines = text.split("\n\n")[0].splitlines()[4:]
    assert len(option_lines) == len(rows)
    assert all("tp_size=3: must divide" in why for why in option_lines), text


def test_cpu_deployment_can_run_on_a_gpu_host(compose_cfg, monkeypatch):
    import dsv4.app.job

    job = make_job(compose_cfg(["deployment=cpu"]), choices={"deployment": "cpu"})
    monkeypatch.setattr(dsv4.app.job, "local_platform", lambda: "cuda")
    assert problems_for(job, running=True) == []


def parse_info(text: str) -> dict[str, tuple[str, bool]]:
    """{option: (verdict, is_current)} from the table `mode=info` prints."""
    lines = text.splitlines()
    sep = next(i for i, line in enumerate(lines) if re.fullmatch(r"[- ]+", line) and "-" in line)
    body = []
    for line in lines[sep + 1:]:
        if not line.strip():          # the options table ends at the first blank line
            break
        body.append(line)
    rows = {}
    for line in body:
        opt, verdict = line.split()[:2]
        rows[opt.rstrip("*")] = (verdict, opt.endswith("*"))
    assert len(rows) == len(body), "duplicate option rows"
    return rows


# ---- the command line, in subprocesses ----------------------------------------------------------------
on_cpu_host = pytest.mark.skipif(local_platform() != "cpu", reason="expects a host without an accelerator")


def imported(stderr: str) -> set[str]:
    """Module names from `python -X importtime` output."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def assert_light(names: set[str]) -> None:
    assert "dsv4.checks.compat" in names, "importtime output was not parsed"
    heavy = sorted(n for n in names if n.split(".")[0] in ("torch", "triton", *KERNEL_LIBS))
    assert heavy == [], f"mode=check imported {heavy[:5]}"


@on_cpu_host
def test_cli_check_defaults_ok_without_importing_torch(tmp_path):
    r = run_py("mode=check", run_dir=tmp_path, importtime=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("OK: model=dsv4_flash")
    assert_light(imported(r.stderr))
    assert not (tmp_path / "result.json").exists()


def test_cli_tp_size_error_is_clean(tmp_path):
    r = run_py("mode=check", "tp_size=3", run_dir=tmp_path)
    assert r.returncode != 0
    for s in ("tp_size=3", "supported: 1, 2, 4, 8", "fix: tp_size=2", "Nothing was allocated"):
        assert s in r.stderr, s
    assert "Traceback" not in r.stderr


def test_cli_head_padding_buckets_too_small(tmp_path):
    r = run_py("mode=check", "model.num_attention_heads=256", "head_padding=buckets_64_128", run_dir=tmp_path)
    assert r.returncode != 0
    for s in ("head_padding=buckets_64_128", "supported: 64, 128", "fix: tp_size=2"):
        assert s in r.stderr, s
    assert "Traceback" not in r.stderr


def test_cli_unknown_backend_lists_options(tmp_path):
    r = run_py("backend=nosuch", "mode=check", run_dir=tmp_path)
    assert r.returncode != 0
    assert "Available options in 'backend'" in r.stderr
    assert all(o in r.stderr for o in options("backend"))
    assert "reference" in r.stderr


def test_cli_override_typo_is_named(tmp_path):
    r = run_py("mode=check", "mqa_kernel.chunkk=3", run_dir=tmp_path)
    assert r.returncode != 0
    assert "chunkk" in r.stderr


@on_cpu_host
def test_cli_check_another_machines_deployment(tmp_path):
    r = run_py("mode=check", "deployment=h200", run_dir=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cuda/sm90" in r.stdout


@on_cpu_host
def test_cli_run_on_the_wrong_machine_fails_before_allocating(tmp_path):
    import json

    r = run_py("deployment=h200", run_dir=tmp_path, importtime=True)
    assert r.returncode != 0
    assert "deployment=h200" in r.stderr and "fix: deployment=cpu" in r.stderr
    names = imported(r.stderr)
    assert "dsv4.app.dispatch" in names and not any(n.split(".")[0] == "torch" for n in names), "torch was loaded"
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "incompatible"
    assert [p["group"] for p in row["problems"]] == ["deployment"]


@pytest.fixture(scope="module")
def bad_mode(tmp_path_factory):
    return run_py("mode=nosuch", run_dir=tmp_path_factory.mktemp("bad_mode"))


def test_cli_unknown_mode_lists_modes(bad_mode):
    assert bad_mode.returncode != 0
    assert "mode=nosuch" in bad_mode.stderr
    assert all(m in bad_mode.stderr for m in MODES)


def test_every_mode_has_its_entry():
    """The app's table of modes holds every mode the settings accept (summarize reads a sweep, not a job)."""
    from dsv4.app.modes import JOB_MODES

    assert set(JOB_MODES) | {"summarize"} == set(MODES)


def test_cli_unknown_mode_has_no_traceback(bad_mode):
    assert bad_mode.returncode != 0
    assert "Traceback" not in bad_mode.stderr


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Kernel-library packages that `find_spec` finds but that raise when imported."""
    root = tmp_path_factory.mktemp("stubs")
    for mod in KERNEL_LIBS:
        (root / mod).mkdir()
        (root / mod / "__init__.py").write_text(f"raise RuntimeError('stub {mod} was imported')\n")
    return root


def test_stubs_are_found_but_raise_on_import(stubs):
    env = dict(os.environ, PYTHONPATH=str(stubs))
    code = ("import importlib.util as u, sys\n"
            f"assert all(u.find_spec(m) for m in {KERNEL_LIBS!r})\n"
            "import flash_mla\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "stub flash_mla was imported" in r.stderr


@on_cpu_host
@pytest.mark.parametrize("mode", ["check", "info"])
def test_cli_check_and_info_never_import_kernel_libraries(stubs, tmp_path, compose_cfg, mode):
    r = run_py(f"mode={mode}", run_dir=tmp_path, pythonpath=stubs)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stub" not in r.stderr and "Traceback" not in r.stderr
    if mode == "info":
        rows = parse_info(r.stdout)
        assert set(rows) == info_rows()
        assert all(verdict in ("ok", "no") for verdict, _ in rows.values())
        cfg = compose_cfg([])
        assert sorted(k for k, (_, star) in rows.items() if star) == sorted(
            [f"{g}={cfg[g].name}" for g in GROUPS] + ["indexer.top_k=triton"])


def test_backend_presets_are_read_from_their_yaml_and_compose_the_layer_bench():
    """The catalogue reads the backend presets (configs/backend/); the whole-layer bench composes its rows from
    them: every preset whose kernel is not the reference and that check() accepts on the device, with its
    head padding and cache layout, plus the projections it swaps in."""
    import dsv4
    from dsv4.speed.layer import backends
    from dsv4.checks.catalogue import GROUPS, backend_presets, option

    presets = backend_presets()
    assert sorted(presets) == options("backend")
    for name, chosen in presets.items():
        assert set(chosen) == set(GROUPS), name
        for group, opt in chosen.items():
            assert option(group, opt).name, (name, group)
    h200 = backends(dsv4.compose(["deployment=h200"], running=False))
    assert [(b.label, b.combo.head_padding.name, b.combo.cache_layout.name) for b in h200] == [
        ("flashmla_sparse + deepgemm_fp8 + deepgemm_triton_fp8", "buckets_64_128", "fp8_ds_mla"),
        ("flashmla_sparse + deepgemm_fp8 + deepgemm_fp8", "buckets_64_128", "fp8_ds_mla"),
        ("flashmla_sparse + deepgemm_fp8 + triton_fp8", "buckets_64_128", "fp8_ds_mla"),
        ("flashmla_sparse + deepgemm_fp8 + reference", "buckets_64_128", "fp8_ds_mla"),
        ("triton_sparse + triton_fp8 + triton_fp8", "none", "fp8_ds_mla"),
        ("triton_sparse + triton_fp8 + reference", "none", "fp8_ds_mla"),
        ("triton_sparse + reference + triton_fp8", "none", "fp8_ds_mla"),
        ("triton_sparse + deepgemm_fp8 + triton_fp8", "none", "fp8_ds_mla")]
    b200 = backends(dsv4.compose(["deployment=b200"], running=False))
    assert ("flashinfer_sparse + deepgemm_fp8 + deepgemm_fp8", "buckets_pow2", "bf16") in \
        [(b.label, b.combo.head_padding.name, b.combo.cache_layout.name) for b in b200]
