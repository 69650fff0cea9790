"""Every folder a job writes is judged before the work, with one line and a fix: the run's and the sweep's
folder (before Hydra makes them: empty, a file, a dangling link, unwritable, a full disk), and the dump
folder (the same, by `check` as well as `run`, with room for the dump's estimated size)."""
from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dsv4.app.dispatch import run_config
from dsv4.app.callbacks import FoldersCallback
from dsv4.values.errors import IncompatibleCombination
from dsv4.app.job import make_job
from dsv4.app.targets import RUN_FOLDER_BYTES, dump_bytes, unwritable
from tests.conftest import run_py

TINY = ("model=dsv4_tiny", "workload.prompt_lens=[20,9]", "workload.decode_steps=1")
Usage = namedtuple("Usage", "total used free")


def full_disk(monkeypatch, free: int) -> None:
    """Every disk has `free` bytes left (shutil.disk_usage, as dsv4.app.targets reads it)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 ** 12, 10 ** 12 - free, free))


def read_only(monkeypatch) -> None:
    """Every folder refuses new files and folders as a read-only mount does (EROFS)."""
    def refuse(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    import dsv4.app.targets

    monkeypatch.setattr(dsv4.app.targets.tempfile, "TemporaryFile", refuse)
    monkeypatch.setattr(dsv4.app.targets.tempfile, "mkdtemp", refuse)


def dangling(tmp_path) -> Path:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone" / "folder")
    return link


def run_start(path) -> None:
    FoldersCallback().on_run_start(config=OmegaConf.create({"hydra": {"run": {"dir": str(path)}}}))


def sweep_start(path) -> None:
    FoldersCallback().on_multirun_start(config=OmegaConf.create({"hydra": {"sweep": {"dir": str(path)}}}))


# ---- the run's and the sweep's folder --------------------------------------------------------------------
def test_a_run_folder_naming_a_file_is_one_line_not_a_traceback(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = run_py("model=dsv4_tiny", "mode=check", run_dir=blocker)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: hydra.run.dir={blocker}: exists and is not a folder; fix: hydra.run.dir=<a writable folder>"]


@pytest.mark.parametrize("start", [run_start, sweep_start])
def test_an_empty_run_or_sweep_folder_is_refused(start, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"error: hydra\.(run|sweep)\.dir is empty: the job's files would land in "
                                         r"the current folder; fix: hydra\.(run|sweep)\.dir=PATH"):
        start("")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("start", [run_start, sweep_start])
def test_a_run_or_sweep_folder_that_cannot_be_written_is_refused(start, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cases = {blocker: "exists and is not a folder", blocker / "sub": f"{blocker} is not a writable folder",
             dangling(tmp_path): "is a link to .*gone/folder, which does not exist",
             Path("/proc/dsv4-out"): "/proc is not a writable folder"}
    for path, why in cases.items():
        with pytest.raises(SystemExit, match=f"dir={path}: {why}.*fix: hydra"):
            start(path)
    full_disk(monkeypatch, RUN_FOLDER_BYTES - 1)
    with pytest.raises(SystemExit, match="needs ~1.0 MiB; its disk has 1.0 MiB free"):
        start(tmp_path / "new")
    monkeypatch.undo()
    read_only(monkeypatch)
    with pytest.raises(SystemExit, match=f"{tmp_path} is not a writable folder .*Read-only file system"):
        start(tmp_path / "new")
    monkeypatch.undo()
    start(tmp_path / "new")                     # a good folder passes


def test_a_run_folder_that_is_written_is_not_read_only_for_the_probe(tmp_path):
    """The probe of a folder leaves nothing in it, nor in the folder above one still to be made."""
    assert unwritable(tmp_path) is None and unwritable(tmp_path / "a" / "b") is None
    assert not list(tmp_path.iterdir())


# ---- the dump folder -------------------------------------------------------------------------------------
def refused(compose_cfg, tmp_path, dump: str, match: str) -> None:
    for mode in ("check", "run"):
        with pytest.raises(IncompatibleCombination, match=match):
            run_config(compose_cfg([*TINY, f"mode={mode}", f"dump_dir={dump}"]), out_dir=tmp_path / mode)


def test_an_empty_dump_dir_is_refused(compose_cfg, tmp_path):
    refused(compose_cfg, tmp_path, "", r"dump_dir=: is empty \(no folder named\)   fix: dump_dir=PATH")


def test_a_dangling_link_or_proc_as_dump_dir_is_refused_before_the_work(compose_cfg, tmp_path):
    link = dangling(tmp_path)
    refused(compose_cfg, tmp_path, str(link), f"dump_dir={link}: is a link to .*, which does not exist")
    refused(compose_cfg, tmp_path, "/proc/dsv4-dump", r"dump_dir=/proc/dsv4-dump: /proc is not a writable folder")
    assert not (tmp_path / "gone").exists()


def test_a_read_only_dump_dir_is_refused(compose_cfg, tmp_path, monkeypatch):
    read_only(monkeypatch)
    refused(compose_cfg, tmp_path, str(tmp_path / "dump"), "is not a writable folder .*Read-only file system")


def test_a_dump_dir_on_a_full_disk_is_refused_before_the_work(compose_cfg, tmp_path, monkeypatch):
    need = dump_bytes(make_job(compose_cfg(TINY)))
    full_disk(monkeypatch, need - 1)
    refused(compose_cfg, tmp_path, str(tmp_path / "dump"), r"the dump \(weights, inputs, outputs\): what will be "
                                                           r"written there needs ~.* MiB; its disk has .* MiB free")
    full_disk(monkeypatch, need)
    run_config(compose_cfg([*TINY, "mode=check", f"dump_dir={tmp_path / 'dump'}"]), out_dir=tmp_path / "fits")


@pytest.mark.parametrize("linear", ["reference", "fp8_sim"])
def test_the_dump_estimate_is_an_upper_bound_of_the_dump(compose_cfg, tmp_path, linear):
    cfg = compose_cfg([*TINY, f"linear={linear}", f"dump_dir={tmp_path / 'dump'}"])
    run_config(cfg, out_dir=tmp_path / "run")
    written = sum(p.stat().st_size for p in (tmp_path / "dump").iterdir())
    assert written <= dump_bytes(make_job(cfg)) <= 1.5 * written
