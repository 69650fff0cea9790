"""The `dsv4` command (`dsv4 [overrides]`, `python -m dsv4`, `python run.py`): Hydra composes the packaged
configs (pkg://dsv4.configs: the repository's configs/ as the package installs it, from any folder), then
dsv4.app.dispatch runs the job. Outputs go under the current folder (outputs/, multirun/), as Hydra's run dirs say."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Mapping

import hydra
from omegaconf import DictConfig, OmegaConf

from dsv4.checks.catalogue import null_group


def run_id() -> int:
    """`${dsv4.pid:}` in the run and sweep folders (configs/config.yaml): this process's id, so that two runs
    started in the same second (both `outputs/<time>/`) do not write one folder and lose a result; under
    torchrun the agent's, which every rank of one job shares, so the ranks keep one folder."""
    return os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()


OmegaConf.register_new_resolver("dsv4.pid", run_id, replace=True)


def group_choices(choices: Mapping[str, Any]) -> dict[str, str]:
    """The config groups picked for a job (Hydra's runtime choices without Hydra's own groups)."""
    return {k: v for k, v in choices.items() if not k.startswith("hydra") and v is not None}


# where the current job writes: the run's folder, and the sweep's in a multirun (for the Ctrl-C line)
_WHERE: dict[str, str | None] = {}


class CtrlC:
    """SIGINT's handler: inside a job Ctrl-C stops it at once; between jobs, while Hydra composes the next
    config, it is held until the next job starts or the command returns, because a KeyboardInterrupt in the
    middle of OmegaConf's bookkeeping leaves a broken node that Hydra then reports as an unrelated error
    (exit 1). A second Ctrl-C while one is held stops at once."""

    def __init__(self) -> None:
        self.in_job = False
        self.held = False
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.seen = True
        if self.in_job or self.held:
            raise KeyboardInterrupt
        self.held = True

    def job(self, run):
        """run() as a job: a held Ctrl-C stops it before it starts, a new one while it runs."""
        if self.held:
            raise KeyboardInterrupt
        self.in_job = True
        try:
            return run()
        finally:
            self.in_job = False


_CTRL_C = CtrlC()


@hydra.main(version_base="1.3", config_path="pkg://dsv4.configs", config_name="config")
def _job(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from dsv4.app.dispatch import run_command   # heavy imports only after composition (hydra#934)

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    _WHERE.update(out=hc.runtime.output_dir, sweep=hc.sweep.dir if multirun else None)
    task = OmegaConf.to_container(hc.overrides.task)      # as typed: a `${..}` in one is not resolved here
    return _CTRL_C.job(lambda: run_command(cfg, choices=group_choices(hc.runtime.choices), out_dir=hc.runtime.output_dir,
                                   multirun=multirun, overrides=task))


class QuietWhenClosed:
    """stdout or stderr that a reader may close (`python run.py 2>&1 | head -1`): from then on what is
    printed there goes nowhere, and the run goes on to its result, instead of failing at its next print (a
    progress line on stderr, as much as the table on stdout)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        try:
            return self.inner.write(text)
        except BrokenPipeError:
            self._closed()
            return len(text)

    def flush(self) -> None:
        try:
            self.inner.flush()
        except BrokenPipeError:
            self._closed()

    def _closed(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.inner.fileno())     # what is left goes nowhere too

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    """The command: Hydra composes and runs the job(s) (`_job`). A closed stdout or stderr does not stop it;
    Ctrl-C, anywhere in a run or a sweep, ends it with one line that says what was kept and what to do next,
    and SIGINT's status."""
    sys.stdout, sys.stderr = QuietWhenClosed(sys.stdout), QuietWhenClosed(sys.stderr)
    null = null_group(sys.argv[1:])         # Hydra's composition fails on it with a traceback
    if null:
        raise SystemExit(f"error: {null}")
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler   # not where it is ignored (nohup, &)
    if ours:
        signal.signal(signal.SIGINT, _CTRL_C)
    try:
        _job()
        if _CTRL_C.held:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        stopped()
    except BaseException:
        if not _CTRL_C.seen:
            raise
        stopped()           # a Ctrl-C inside a library's bookkeeping in a job can come out as another error
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def stopped() -> None:
    """The command's end after Ctrl-C: the one line (said by rank 0 alone under torchrun, where every rank
    gets the Ctrl-C), and SIGINT's status."""
    if os.environ.get("RANK", "0") == "0":
        print(interrupted(_WHERE.get("out"), _WHERE.get("sweep")), file=sys.stderr)
    raise SystemExit(130) from None


def interrupted(out_dir: str | None, sweep_dir: str | None) -> str:
    """What a run or sweep stopped by Ctrl-C kept, and how to go on."""
    if sweep_dir is not None:
        rows = len(list(Path(sweep_dir).glob("*/result.json")))
        return (f"interrupted: the sweep stopped; the rows of its {rows} finished cell(s) are kept in {sweep_dir}; "
                f"summarize them: python run.py mode=summarize +sweep_dir={sweep_dir} (or run the sweep again, "
                f"into a new folder, for every cell)")
    row = Path(out_dir) / "result.json" if out_dir else None
    if row is not None and row.exists():
        return f"interrupted: the run's result is kept in {row}"
    return (f"interrupted: the run stopped before its result; nothing was kept"
            f"{f' in {out_dir}' if out_dir else ''}; run it again")
