"""The built wheel works without the checkout: it is built from a copy of the sources, installed (not editable)
into a folder of its own, and its `dsv4` command and Python API run from another folder, reading the configs
the wheel ships. The installed torch, Hydra and the rest come from this environment (nothing is downloaded)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _can_build() -> str | None:
    """Why a wheel cannot be built here without a network, or None."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed (the build backend; it cannot be fetched offline)"
    import setuptools

    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {setuptools.__version__} needs the 'wheel' package to build wheels, and it is not installed"
    return None


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_can_build() is not None, reason=f"cannot build the wheel offline: {_can_build()}")]


def pip(*args: str, cwd: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "--no-build-isolation",
                        "--disable-pip-version-check", "--quiet"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"pip {args[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder holding the installed wheel with its bin/dsv4, the wheel file)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "outputs", "multirun", ".pytest_cache", ".hypothesis", ".whl"))
    pip("wheel", "--wheel-dir", str(base / "dist"), str(src), cwd=base)
    (whl,) = (base / "dist").glob("dsv4-*.whl")
    pip("install", "--target", str(base / "site"), str(whl), cwd=base)
    return base / "site", whl


def run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """A command with only the installed package on PYTHONPATH (ahead of any editable install of the checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "PYTHONPATH")}
    env |= {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "2"}
    cwd.mkdir(exist_ok=True)
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_wheel_ships_the_configs_and_the_command(installed):
    site, whl = installed
    names = set(zipfile.ZipFile(whl).namelist())
    # the repository's top-level configs/, installed as the package dsv4.configs
    shipped = {"dsv4/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml")}
    assert shipped and shipped <= names, sorted(shipped - names)[:5]
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "dsv4 = dsv4.app.cli:main" in zipfile.ZipFile(whl).read(entry).decode()
    assert (site / "bin" / "dsv4").is_file() and not (site / "run.py").exists()


def test_the_installed_package_is_the_one_imported(installed, tmp_path):
    site, _ = installed
    r = run_installed(site, tmp_path, sys.executable, "-c",
                      "import dsv4, dsv4.checks.catalogue; print(dsv4.__file__); print(dsv4.checks.catalogue.config_dir())")
    assert r.returncode == 0, r.stderr[-3000:]
    module, configs = r.stdout.split()
    assert Path(module) == site / "dsv4" / "__init__.py" and Path(configs) == site / "dsv4" / "configs"


def test_installed_command_checks_from_another_folder(installed, tmp_path):
    site, _ = installed
    r = run_installed(site, tmp_path, str(site / "bin" / "dsv4"), "model=dsv4_tiny", "mode=check")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("OK: model=dsv4_tiny on cpu (CPU), tp_size=1, 8 heads per rank padded to 8")
    assert "model=dsv4_tiny" in r.stdout.splitlines()[1]
    assert (tmp_path / "outputs").is_dir()                     # Hydra's run dirs go under the current folder


def test_installed_command_says_what_run_py_says(installed, tmp_path):
    site, _ = installed
    args = ("mode=check", "deployment=h200")
    ours = run_installed(site, tmp_path / "a", str(site / "bin" / "dsv4"), *args)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    checkout = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert ours.returncode == checkout.returncode == 0, ours.stderr[-2000:] + checkout.stderr[-2000:]
    assert ours.stdout == checkout.stdout and "cuda/sm90 (H200)" in ours.stdout


def test_installed_command_refuses_a_bad_combination_cleanly(installed, tmp_path):
    site, _ = installed
    r = run_installed(site, tmp_path, str(site / "bin" / "dsv4"), "model=dsv4_tiny", "mode=check", "tp_size=3")
    assert r.returncode == 1
    assert "tp_size=3: must divide" in r.stderr and "fix: tp_size=2" in r.stderr and "Traceback" not in r.stderr


def test_installed_command_runs_a_tiny_workload(installed, tmp_path):
    import json

    site, _ = installed
    r = run_installed(site, tmp_path, str(site / "bin" / "dsv4"), "model=dsv4_tiny", "workload=sweep",
                      "workload.prompt_lens=[40]", "workload.decode_steps=1", "cache_layout=float32", "hydra.run.dir=run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("run: model=dsv4_tiny layers") and "\ndsv4 run  model=dsv4_tiny on cpu (CPU)" in r.stdout
    row = json.loads((tmp_path / "run" / "result.json").read_text())
    assert row["status"] == "ok" and row["metrics.max_rel_err"] <= 1e-5


def test_installed_python_api_composes_the_packaged_configs(installed, tmp_path):
    site, _ = installed
    r = run_installed(site, tmp_path, sys.executable, "-c",
                      "import dsv4; job = dsv4.compose(['deployment=h200'], running=False); "
                      "print(job.spec.name, job.choices['mqa_kernel'], job.combo.cache_layout.name)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["dsv4_flash", "flashmla_sparse", "fp8_ds_mla"]
