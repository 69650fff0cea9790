"""The commands the docs show still run: every `python run.py`, `dsv4`, `python -m dsv4` and `torchrun` line of
the ```bash blocks of README.md, docs/usage.md and docs/options.md, each in a process of its own on the CPU, in a
folder of the test's own (where `outputs/` and `multirun/` go).

A line runs as written unless TABLE says otherwise, and says why:

- what needs a GPU, another machine, torchrun's ranks or a checkpoint is judged by `mode=check` (its `mode=`
  replaced; torchrun's ranks are started, so the world size is judged too): refused where the doc's comment
  says `refused`, else accepted (a sweep: some cell accepted);
- a run of the published shapes, which takes a minute or more on a CPU, runs `model=dsv4_tiny` (or, where
  the tiny model cannot hold the line's setting, one layer on a short workload), and an experiment's sweep
  runs two of its cells: a command-line choice narrows a sweep, so the experiment's config, its summary and
  its report still run (tests/test_sweeps.py composes every cell of every experiment);
- a path of the doc's (`/tmp/case`, a checkpoint's folder, a sweep's `<date_time>`) becomes one in the test's
  folder.

`run.py` is the checkout's, `dsv4 ...` runs as `python -m dsv4 ...` and torchrun as `python -m
torch.distributed.run`, with this interpreter.

A line the docs gain, lose or change must be in TABLE (the first test says which), so a command never goes
untested; a renamed option or setting fails the line that names it."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_readme import assert_judged_as_commented, bash_commands

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/usage.md", "docs/options.md")
STARTS = ("python run.py", "dsv4 ", "python -m dsv4", "torchrun ")


def documented() -> dict[str, list[tuple[str, str]]]:
    """{command: [(doc, comment), ...]} of every line of the docs' bash blocks that runs the dsv4 command."""
    out: dict[str, list[tuple[str, str]]] = {}
    for doc in DOCS:
        for code, comment in bash_commands((ROOT / doc).read_text()):
            if code.startswith(STARTS):
                out.setdefault(code, []).append((doc, comment))
    return out


@dataclass(frozen=True, kw_only=True)
class As:
    """How a documented command runs here; `why` says what differs from the doc and why ("" as written)."""
    check: bool = False                      # judged by mode=check (replacing the line's mode=)
    add: tuple[str, ...] = ()                # overrides appended
    swap: tuple[tuple[str, str], ...] = ()   # (the doc's word, the test's): {tmp} the test's folder, {sweep} the
                                             # one sweep folder `before` made
    before: str = ""                         # a TABLE command run first (as TABLE says), in the same folder
    mkdir: tuple[str, ...] = ()              # folders made in the test's folder first
    why: str = ""
    slow: bool = True                        # another process that runs a job (a check alone takes a second)


GPU = "needs an H200: judged by mode=check for that deployment, as on the machine"
TORCHRUN = "torchrun's ranks started, each judging the job with mode=check (the world size included)"
TORCHRUN_GPU = "torchrun's ranks started on the CPU for an H200 deployment, each judging it with mode=check"
CHECKPOINT = ("reads a checkpoint not here: judged by mode=check, which does not read it, on an empty folder of "
              "the doc's name (the path must be a folder)")
TINY = "the published shapes take a minute or more on a CPU: model=dsv4_tiny, the same structure, and its short " \
       "sweep workload"
NARROW = "the experiment's sweep narrowed to a cell that runs and one that runs or is refused (each cell a job)"
CKPT_FLASH = (("/models/DeepSeek-V4-Flash", "{tmp}/DeepSeek-V4-Flash"),)

TABLE: dict[str, As] = {
    # README.md, Using it
    "python run.py model=dsv4_tiny": As(),
    "python run.py cache_layout=float32 dtype=float32": As(add=("model=dsv4_tiny", "workload=sweep"), why=TINY),
    "python run.py cache_layout=fp8_ds_mla": As(add=("model=dsv4_tiny", "workload=sweep"), why=TINY),
    "python run.py dtype=bfloat16 tp_size=8": As(
        add=("workload.layers=[1]", "workload.prompt_lens=[64,8]", "workload.decode_steps=1"),
        why="dsv4_tiny's 8 heads and 2 output groups cannot be cut into 8 ranks: DSV4-Flash's ratio-4 layer "
            "alone, on two short requests and one decode step"),
    "python run.py model=dsv4_tiny linear=fp8_sim": As(),
    "python run.py mode=check model=dsv4_tiny linear=fp8_sim tp_size=2": As(slow=False),
    "python run.py mode=check head_padding=buckets_64_128 tp_size=3": As(slow=False),
    "python run.py mode=info model=dsv4_pro": As(slow=False),
    "python run.py workload.prompt_lens=[1000,40] workload.decode_steps=8": As(
        add=("model=dsv4_tiny",), why="the published shapes take minutes on a CPU: model=dsv4_tiny, the doc's "
                                     "workload"),
    "python run.py -m experiment=cache_by_kernel": As(
        add=("mqa_kernel=reference,triton_sparse", "cache_layout=bf16"), why=NARROW),
    "torchrun --nproc-per-node 2 run.py model=dsv4_tiny tp_size=2": As(check=True, why=TORCHRUN),
    # docs/usage.md §1-§3
    "python run.py deployment=h200 backend=triton batch_invariant=true": As(check=True, why=GPU, slow=False),
    "torchrun --nproc-per-node 2 -m dsv4 model=dsv4_tiny tp_size=2": As(check=True, why=TORCHRUN),
    "torchrun --nproc-per-node 2 run.py deployment=h200 tp_size=2": As(check=True, why=TORCHRUN_GPU),
    "python run.py -m model=dsv4_tiny tp_size=1,2 parallel.launcher=spawn": As(
        add=("workload=sweep",), why="each cell a tiny model's job in its ranks' processes: the short sweep "
                                     "workload"),
    "torchrun --nproc-per-node 8 run.py mode=bench deployment=h200 tp_size=8": As(check=True, why=TORCHRUN_GPU),
    "python run.py model=dsv4_tiny dtype=float32 dump_dir=/tmp/case": As(
        swap=(("/tmp/case", "{tmp}/case"),), why="the dump goes into the test's folder"),
    # docs/usage.md §4
    "python run.py weights=checkpoint checkpoint.path=/models/DeepSeek-V4-Flash workload.layers=[2]": As(
        check=True, swap=CKPT_FLASH, mkdir=("DeepSeek-V4-Flash",), why=CHECKPOINT, slow=False),
    "python run.py weights=checkpoint checkpoint.path=/models/DeepSeek-V4-Flash workload.layers=[2,3] "
    "deployment=h200": As(check=True, swap=CKPT_FLASH, mkdir=("DeepSeek-V4-Flash",), why=CHECKPOINT, slow=False),
    "python run.py weights=checkpoint checkpoint.path=/models/DeepSeek-V4-Flash workload.layers=[2] "
    "deployment=h200 o_proj=torch_fp8 tp_size=8 dump_dir=/tmp/flash-layer2": As(
        check=True, swap=(*CKPT_FLASH, ("/tmp/flash-layer2", "{tmp}/flash-layer2")), mkdir=("DeepSeek-V4-Flash",),
        why=CHECKPOINT + "; the dump folder in the test's", slow=False),
    "python run.py weights=checkpoint checkpoint.path=/models/DeepSeek-V4-Pro model=dsv4_pro workload.layers=[0]": As(
        check=True, swap=(("/models/DeepSeek-V4-Pro", "{tmp}/DeepSeek-V4-Pro"),), mkdir=("DeepSeek-V4-Pro",),
        why=CHECKPOINT, slow=False),
    # docs/usage.md §5
    "python run.py -m experiment=padding_by_tp": As(
        add=("head_padding=none,buckets_64_128", "tp_size=2"), why=NARROW),
    "python run.py -m experiment=padding_by_tp parallel.launcher=spawn": As(
        add=("head_padding=none,buckets_64_128", "tp_size=2"), why=NARROW),
    "python run.py -m experiment=o_proj_ablation": As(add=("o_proj=reference,triton_fp8", "dtype=float32"), why=NARROW),
    "python run.py -m experiment=indexer_by_cache": As(
        add=("indexer=exact,fp4_sim", "cache_layout=bf16"), why=NARROW),
    "python run.py -m experiment=linear_ablation": As(
        add=("linear=reference,fp8_sim", "o_proj=reference", "dtype=float32"), why=NARROW),
    "python run.py -m experiment=cache_by_kernel deployment=h200 o_proj=reference indexer=triton_fp8": As(
        check=True, why=GPU + ", every cell of the matrix", slow=False),
    "python run.py -m model=dsv4_tiny workload=sweep mqa_kernel.chunk=16,64": As(),
    "python run.py mode=summarize +sweep_dir=multirun/cache_by_kernel/<date_time>": As(
        before="python run.py -m experiment=cache_by_kernel", swap=(("<date_time>", "{sweep}"),),
        why="summarizes the folder of the (narrowed) cache_by_kernel sweep run first"),
    "python run.py deployment=mi355x mode=info": As(slow=False),
    # docs/options.md
    "python run.py deployment=h200": As(check=True, why=GPU, slow=False),
    "python run.py mode=bench deployment=h200": As(check=True, why=GPU, slow=False),
    "python run.py deployment=h200 backend=triton": As(check=True, why=GPU, slow=False),
    "python run.py mode=check deployment=mi355x backend=aiter": As(slow=False),
    "python run.py mode=check deployment=mi300x backend=aiter cache_layout=fp8_ds_mla_fnuz": As(slow=False),
}
DOCUMENTED = documented()


def test_every_documented_command_is_in_the_table():
    assert not set(DOCUMENTED) - set(TABLE), f"commands the docs show that TABLE lacks: {set(DOCUMENTED) - set(TABLE)}"
    assert not set(TABLE) - set(DOCUMENTED), f"TABLE's commands no doc shows: {set(TABLE) - set(DOCUMENTED)}"
    assert all(a.why for a in TABLE.values() if a.check or a.add or a.swap or a.before), "say why a line changes"


def argv(command: str, how: As, folder: Path) -> list[str]:
    """The process to start for a documented command, as TABLE says (the checkout's run.py by its path)."""
    words = shlex.split(command)
    if how.check:
        words = [w for w in words if not w.startswith("mode=")] + ["mode=check"]
    words += how.add
    sweeps = [p for p in (folder / "multirun").glob("*/*") if p.is_dir()] if how.before else []
    marks = {"tmp": str(folder), "sweep": sweeps[0].name if len(sweeps) == 1 else "?"}
    swaps = {old: new.format(**marks) for old, new in how.swap}
    words = [next((w.replace(old, new) for old, new in swaps.items() if old in w), w) for w in words]
    if words[0] == "torchrun":
        words[:1] = [sys.executable, "-m", "torch.distributed.run"]
    elif words[:2] == ["python", "-m"] or words[:2] == ["python", "run.py"]:
        words[0] = sys.executable
    elif words[0] == "dsv4":
        words[:1] = [sys.executable, "-m", "dsv4"]
    return [str(ROOT / "run.py") if w == "run.py" else w for w in words]


def run_command(command: str, how: As, folder: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}     # the users' view of errors
    return subprocess.run(argv(command, how, folder), cwd=folder, env=env, capture_output=True, text=True,
                          timeout=600)


def cases():
    return [pytest.param(c, marks=[pytest.mark.slow] if TABLE[c].slow else [], id=c)
            for c in DOCUMENTED if c in TABLE]


@pytest.mark.parametrize("command", cases())
def test_a_documented_command_runs(tmp_path, command):
    how = TABLE[command]
    for name in how.mkdir:
        (tmp_path / name).mkdir()
    if how.before:
        first = run_command(how.before, TABLE[how.before], tmp_path)
        assert first.returncode == 0, first.stdout + first.stderr
    r = run_command(command, how, tmp_path)
    comment = " ".join(c for _, c in DOCUMENTED[command])
    sweep = " -m " in f" {command} "
    if how.check or re.search(r"\bmode=(check|info)\b", command):
        assert_judged_as_commented(r, comment)
        if "mode=info" not in command and "refused" not in comment:
            assert re.search(r"^OK: ", r.stdout, re.M), r.stdout + r.stderr    # a sweep: some cell accepted
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    if "mode=summarize" in command or sweep:
        assert list(tmp_path.glob("multirun/**/summary.csv")), r.stdout + r.stderr
    else:
        assert list(tmp_path.glob("outputs/*/result.json")), r.stdout + r.stderr
    if "dump_dir=" in command:
        assert {p.name for p in (tmp_path / "case").iterdir()} >= {"spec.json", "tensors.safetensors"}
