"""Ctrl-C (SIGINT) ends a run or a sweep with one line saying what was kept and what to do next, and the
status of SIGINT (130), not a page of traceback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


def sigint_as_at_a_terminal() -> None:
    """SIGINT at its default in the child, as a command typed at a terminal has it, even where these tests run
    as a background job (whose SIGINT the shell ignores, and dsv4, like any program, leaves ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.Popen([sys.executable, str(ROOT / "run.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sigint_as_at_a_terminal)


def interrupt_when(proc, ready, timeout=240):
    """SIGINT to proc once ready() holds; (returncode, stderr)."""
    end = time.time() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < end, "never ready"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_says_what_was_kept_and_how_to_summarize(tmp_path):
    sweep = start(tmp_path, "-m", "model=dsv4_tiny", "workload=sweep", "mqa_kernel.chunk=16,32,64,128,256")
    code, err = interrupt_when(sweep, lambda: any((tmp_path / "multirun").glob("*/*/result.json")))
    last = err.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in err, err
    assert last.startswith("interrupted: the sweep stopped; the rows of its") and "mode=summarize +sweep_dir=" in last
    sweep_dir = last.split("+sweep_dir=")[1].split()[0]
    assert (tmp_path / sweep_dir).is_dir() and list((tmp_path / sweep_dir).glob("*/result.json"))


@pytest.mark.slow
def test_ctrl_c_in_a_run_says_nothing_was_kept(tmp_path):
    run = start(tmp_path, "model=dsv4_tiny", "workload.decode_steps=50")
    lines: list[str] = []
    code, err = interrupt_when(run, lambda: lines.append(run.stdout.readline()) or lines[-1].startswith("run: "))
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted: the run stopped before its result")


def test_ctrl_c_between_jobs_is_held_until_the_next_job_starts():
    """Hydra composes a sweep's next config between jobs; a KeyboardInterrupt there would break an OmegaConf
    node and surface as an unrelated error with exit 1, so it waits for the next job (or the command's end)."""
    from dsv4.app.cli import CtrlC

    ran: list[int] = []
    between = CtrlC()
    between(signal.SIGINT, None)                     # between jobs: held, nothing raised
    assert between.held
    with pytest.raises(KeyboardInterrupt):
        between.job(lambda: ran.append(1))
    assert ran == []

    inside = CtrlC()

    def job():
        inside(signal.SIGINT, None)                  # inside a job: stops it at once
        ran.append(1)

    with pytest.raises(KeyboardInterrupt):
        inside.job(job)
    assert ran == [] and not inside.in_job and not inside.held


@pytest.fixture
def sigint_default():
    """This process's SIGINT as at a terminal (see `sigint_as_at_a_terminal`), restored afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_that_a_library_turns_into_another_error_still_ends_as_interrupted(monkeypatch, capsys,
                                                                                   sigint_default):
    """A KeyboardInterrupt inside a library's bookkeeping can leave it broken and raise something else; the
    command still ends with the one line and SIGINT's status, not that error."""
    import dsv4.app.cli as cli

    def broken():
        try:
            cli._CTRL_C(signal.SIGINT, None)
        except KeyboardInterrupt:
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'") from None

    monkeypatch.setattr(cli, "_CTRL_C", cli.CtrlC())
    monkeypatch.setattr(cli, "_WHERE", {})
    monkeypatch.setattr(cli, "_job", lambda: cli._CTRL_C.job(broken))
    monkeypatch.setattr(sys, "stdout", sys.stdout)              # main() wraps both
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip().startswith("interrupted: the run stopped before its result")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    monkeypatch.setattr(cli, "_CTRL_C", cli.CtrlC())                # no Ctrl-C: the error is the error
    monkeypatch.setattr(cli, "_job", lambda: cli._CTRL_C.job(lambda: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        cli.main()
