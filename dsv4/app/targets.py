"""The folders a job writes -- its run folder, a sweep's folder, the dump folder: judged before the work
(a folder that can be made and written, not a file or a dangling link, on a disk with room for what will be
written there) and held while the work runs (an exclusive lock on the folder, so that a second run on the
same folder is refused before its work instead of silently replacing the first one's result).

Pure Python, imported by the Hydra callbacks and `mode=check`: no torch."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv4.values.errors import ConfigError

MIB = 2 ** 20
# what a run folder receives: result.json, Hydra's .hydra/ records and the job's log (a few KiB each)
RUN_FOLDER_BYTES = 1 * MIB
# spec.json and the safetensors header, beyond the tensors themselves
DUMP_OVERHEAD_BYTES = 1 * MIB


class FolderBusy(ConfigError):
    """Another process holds the folder's lock: it is writing a result or a dump there now."""

    def __init__(self, what: str, path: Path) -> None:
        self.what, self.path = what, path
        self.reason = "another process is writing into this folder now (one's output would replace the other's)"
        self.fix = f"{what}=<a new folder>, or wait until it ends"
        super().__init__(f"{what}={path}: {self.reason}; fix: {self.fix}")


def unwritable(path: Path) -> str | None:
    """Why a folder cannot be made or written at `path` (a file, a dangling link, a read-only or virtual
    file system such as /proc, no permission), or None. Where the folder or a parent to be made is
    missing, the nearest folder that exists is tried by making a folder in it (removed at once), which is
    what the work will do; where the folder exists, by making a file in it (left unnamed where the system
    allows: nothing is seen)."""
    probe = path
    while not os.path.exists(probe):
        if os.path.islink(probe):
            where = "" if probe == path else f"{probe} "
            return f"{where}is a link to {os.readlink(probe)}, which does not exist"
        if probe.parent == probe:
            return f"{probe} does not exist"
        probe = probe.parent
    if probe == path and not path.is_dir():
        return "exists and is not a folder"
    if not probe.is_dir():
        return f"{probe} is not a writable folder"
    made = "file" if probe == path else "folder"
    try:
        if made == "file":
            with tempfile.TemporaryFile(dir=probe):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=probe, prefix=".dsv4-probe-"))
    except OSError as e:
        return f"{probe} is not a writable folder (making a {made} there: {e.strerror or e})"
    return None


def existing(path: Path) -> Path:
    """The nearest folder of `path` that exists (the disk the folder will be on)."""
    while not os.path.exists(path) and path.parent != path:
        path = path.parent
    return path


def short_of_space(path: Path, need: int, *, reused: int = 0) -> str | None:
    """Why the disk of `path` cannot take `need` more bytes (counting `reused`: the bytes of files there
    that the work replaces), or None."""
    free = shutil.disk_usage(existing(path)).free + reused
    if free >= need:
        return None
    return f"what will be written there needs ~{mib(need)}; its disk has {mib(free)} free"


def mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB" if n < 10 * MIB else f"{n / MIB:,.0f} MiB"


def judge(path: Path, need: int, *, reused: int = 0) -> str | None:
    """Why `path` cannot receive `need` bytes of output, or None: `unwritable`, then `short_of_space`."""
    return unwritable(path) or short_of_space(path, need, reused=reused)


def dump_bytes(job) -> int:
    """An upper bound of the dump's size (dsv4/app/dump.py): every layer's weights (`weight_bytes`), the inputs
    (hidden states float32, positions int64, request index int32) and per layer its outputs (float32) and,
    for indexed layers, its top-k lists (int32) for every token of the workload."""
    from dsv4.formats.fp8_blocks import LinearNumerics
    from dsv4.values.layer_types import by_ratio

    spec, wl = job.spec, job.workload
    layers = wl.layer_indices(spec)
    made_fp8 = job.run.weights == "random" and job.combo.linear.numerics is LinearNumerics.FP8
    weights = sum(weight_bytes(spec, spec.compress_ratio(l), fp8=made_fp8) for l in layers)
    tokens = sum(wl.total_len(i) for i in range(len(wl.prompt_lens)))
    indexed = sum(1 for l in layers if by_ratio(spec.compress_ratio(l)).indexed)
    per_token = 4 * spec.hidden_size * (1 + len(layers)) + 8 + 4 + 4 * spec.index_topk * indexed
    return weights + tokens * per_token + DUMP_OVERHEAD_BYTES


def weight_bytes(spec, ratio: int, *, fp8: bool) -> int:
    """A layer's weights as the dump stores them: float32, or with `fp8` (random weights made in the
    checkpoint's format, components/weights.in_fp8_blocks) its whole-block linears as e4m3 bytes and a float32
    scale per block. A checkpoint's are counted in float32: what it stores in fp8 is its own."""
    from dsv4.components.weights import FP8_LINEARS, weight_shapes
    from dsv4.formats.fp8_blocks import BLOCK

    total = 0
    for name, shape in weight_shapes(spec, ratio).items():
        n = math.prod(shape)
        blocked = fp8 and name in FP8_LINEARS and len(shape) == 2 and not shape[0] % BLOCK and not shape[1] % BLOCK
        total += n + 4 * (n // BLOCK ** 2) if blocked else 4 * n
    return total


def replaced_bytes(path: Path) -> int:
    """The bytes of the dump files already in `path` (replaced by a dump with dump_overwrite=true)."""
    return sum(p.stat().st_size for p in (path / "tensors.safetensors", path / "spec.json") if p.is_file())


def held_sweep(path: Path) -> str | None:
    """What shows that `path` already holds a sweep (its multirun.yaml, job folders), or None."""
    if not path.is_dir():
        return None
    shown = ["multirun.yaml"] if (path / "multirun.yaml").exists() else []
    jobs = [p.name for p in sorted(path.iterdir())
            if p.is_dir() and ((p / ".hydra").is_dir() or (p / "result.json").exists())]
    if jobs:
        shown.append(f"{len(jobs)} job folder(s): {', '.join(jobs[:3])}{', ...' if len(jobs) > 3 else ''}")
    return " and ".join(shown) or None


@contextmanager
def hold(path: Path, *, what: str) -> Iterator[Path]:
    """The folder `path` (made if missing), locked against every other process for the block: an exclusive
    flock on the folder itself, so nothing is left in it and a process that dies releases it with its
    descriptors. FolderBusy (naming `what`, the setting) if another process holds it. A file system that
    cannot lock a folder (some network mounts) is said on stderr, and the block runs unheld."""
    import fcntl
    import sys

    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(what, path) from None
        except OSError as e:
            print(f"note: {what}={path} cannot be locked here ({e.strerror or e}): a second run on it at the same "
                  f"time would not be refused", file=sys.stderr)
        yield path
    finally:
        os.close(fd)
