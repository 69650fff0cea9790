"""Tensor parallelism across processes with torch.distributed: one process per rank.

Each process builds only its rank's layer modules (its heads, sinks and output groups; wq_b and wo_a
column-parallel, wo_b row-parallel) and its own KV pools; the compressor and indexer are replicated
(docs/numerics.md §1.2). The ranks' partial outputs are summed by an all-reduce over the process group --
gloo on the CPU, nccl on GPUs.

Three ways ranks come about (`parallel.launcher`):
  auto      launched by `torchrun --nproc-per-node N run.py ...`: this process is one rank (the world
            size comes from torchrun's environment and must equal tp_size); otherwise ranks are
            simulated in this one process (their partial outputs summed, no torch.distributed)
  spawn     this job starts tp_size processes itself (what a Hydra multirun over tp_size uses)
  simulated always the single-process stand-in

A rank that fails prints `rank R failed: ...` and exits with status 1 at once. The others are then
stopped by the launcher (torchrun and spawn end the remaining workers when one fails); a collective
that still waits gives up after `parallel.timeout_s`, so no rank hangs.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from dsv4.values.errors import ConfigError
from dsv4.values.settings import at_least, one_of, parse

LAUNCHERS = ("auto", "spawn", "simulated")
BACKENDS = ("auto", "gloo", "nccl")
MIN_TIMEOUT_S = 1.0       # joining the group alone takes a moment: a shorter wait fails every launch
MAX_TIMEOUT_S = 1e9       # ~30 years: what the group's timeout (a timedelta) holds, with room


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    launcher: str = one_of(LAUNCHERS, "auto")
    backend: str = one_of(BACKENDS, "auto")
    timeout_s: float = at_least(MIN_TIMEOUT_S, 60.0)

    @classmethod
    def from_config(cls, cfg: Any) -> "ParallelConfig":
        config = parse(cls, cfg, "parallel")
        if config.timeout_s > MAX_TIMEOUT_S:         # beyond what a timedelta (the group's timeout) holds
            raise ConfigError(f"parallel.timeout_s={config.timeout_s:g}: expected at most {MAX_TIMEOUT_S:g} s; "
                              f"fix: parallel.timeout_s=60")
        world = torchrun_world_size()
        if world is not None and world > 1 and config.launcher != "auto":
            # each of torchrun's processes would start (spawn) or simulate every rank itself: the processes
            # wait on each other's ports or write one folder twice
            raise ConfigError(f"parallel.launcher={config.launcher}: this process is one of the {world} ranks torchrun "
                              f"started; fix: parallel.launcher=auto (or run without torchrun)")
        return config


def torchrun_world_size() -> int | None:
    """The world size when this process was started by torchrun (or any launcher that sets the
    env:// variables), else None."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def backend_for(platform: str, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "gloo" if platform == "cpu" else "nccl"


@dataclass(frozen=True, slots=True, kw_only=True)
class Ranks:
    """Which tensor-parallel ranks this process runs, and how their partial outputs are summed."""
    rank: int = 0                   # this process's rank (0 when simulated)
    world_size: int = 1             # processes in the group (1 when simulated)
    tp_size: int = 1
    distributed: bool = False

    @property
    def local(self) -> list[int]:
        return [self.rank] if self.distributed else list(range(self.tp_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t):
        """Sum of every rank's `t` (in place); the identity when simulated (the engine sums locally)."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def gather(self, obj: Any) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


def init(*, platform: str, tp_size: int, config: ParallelConfig) -> Ranks:
    """Join the process group torchrun (or `spawn`) set up in the environment; pin this rank's GPU."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = backend_for(platform, config.backend)
    if backend == "nccl" and world > torch.cuda.device_count():
        from dsv4.values.errors import ConfigError

        raise ConfigError(f"{world} processes over NCCL need a GPU each, this machine has "
                          f"{torch.cuda.device_count()}; fix: as many GPUs as processes, or parallel.backend=gloo "
                          "(the ranks then share GPUs: outputs as on separate GPUs, timings not)")
    if platform != "cpu":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % max(torch.cuda.device_count(), 1))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=config.timeout_s))
    return Ranks(rank=rank, world_size=world, tp_size=tp_size, distributed=True)


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def fail_rank(rank: int, e: BaseException, *, timeout_s: float | None = None) -> None:
    """Say which rank failed and why, then leave at once (no atexit handlers, no collective teardown
    that would wait for the others). The traceback only where it helps: not for a user error, nor for a
    failure of the process group itself (`group_failure`)."""
    import traceback

    from dsv4.values.errors import USER_ERRORS

    group = group_failure(e, timeout_s)
    if group is not None:
        print(f"rank {rank} failed: {group}", file=sys.stderr, flush=True)
        os._exit(1)
    if not isinstance(e, USER_ERRORS):
        traceback.print_exception(e)
    print(f"rank {rank} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def group_failure(e: BaseException, timeout_s: float | None) -> str | None:
    """A rank's failure that is the process group's, not its own work's -- no answer from the other ranks within
    parallel.timeout_s, or another rank gone -- in one line (its traceback would show only torch.distributed's
    insides); None for any other failure."""
    import re

    import torch.distributed as dist

    text = str(e).strip()
    if not (isinstance(e, dist.DistError) or re.search(r"gloo|nccl|c10d|TCPStore", text, re.IGNORECASE)):
        return None
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(e).__name__)  # less its C++ source
    if "timed out" in text.lower():
        wait = f"parallel.timeout_s={timeout_s:g} s" if timeout_s else "parallel.timeout_s"
        more = f"parallel.timeout_s={max(60.0, 4 * timeout_s):g}" if timeout_s else "a larger parallel.timeout_s"
        return (f"no answer from the other ranks within {wait} ({first}); fix: {more} if they were only slow, "
                f"else another rank's message says why")
    return f"lost the other ranks ({first}); another rank's message says why"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(local_rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(*args)


def spawn(fn: Callable, world: int, *args) -> None:
    """Run fn(*args) in `world` new processes set up as torchrun would (env://). Returns when all have
    finished; if one fails, the others are ended and this raises (torch.multiprocessing.spawn)."""
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(world, free_port(), fn, args), nprocs=world, join=True)


# ---- a job's ranks ------------------------------------------------------------------------------------
def processes(job) -> int:
    """How many processes run the job's ranks: one per rank under torchrun or parallel.launcher=spawn."""
    if job.combo.world_size is not None:
        return job.combo.world_size
    return job.combo.tp_size if job.parallel.launcher == "spawn" and job.combo.tp_size > 1 else 1


def backend_problems(job) -> list:
    """NCCL for a job whose ranks are processes on the CPU: refused before any starts (NCCL joins GPUs)."""
    from dsv4.values.errors import Problem

    if processes(job) > 1 and job.device.platform == "cpu" and backend_for("cpu", job.parallel.backend) == "nccl":
        return [Problem(group="parallel.backend", value="nccl", reason=f"NCCL joins ranks on GPUs; this job's "
                        f"{processes(job)} rank processes run on the CPU ({job.device.describe()})",
                        supported=("auto", "gloo"), fix="parallel.backend=auto")]
    return []


def run_ranks(job, execute: Callable) -> float | None:
    """`execute(job, ranks=None)` on this process's ranks: launched by torchrun, this process is one rank;
    with parallel.launcher=spawn and tp_size > 1 it starts the tp_size rank processes (each given the job)
    and waits for them; otherwise the ranks are simulated here."""
    import json

    from dsv4.values.errors import RankFailed, ResultMismatch

    if job.combo.world_size is not None:
        return _run_rank(job, execute)
    if processes(job) > 1:
        try:
            spawn(_run_rank, job.combo.tp_size, job, execute)
        except Exception as e:        # the failing rank printed its message; this one names the job
            row = job.out_dir / "result.json"
            if row.exists() and json.loads(row.read_text()).get("status") == "mismatch":   # rank 0 judged it
                raise ResultMismatch(json.loads(row.read_text()).get("error") or "outputs outside the error "
                                     f"budget (row: {row})") from None
            raise RankFailed(f"a rank of the tp_size={job.combo.tp_size} job failed ({e}); its message is "
                             f"above") from None
        row = job.out_dir / "result.json"
        return json.loads(row.read_text()).get("metrics.max_rel_err") if row.exists() else None
    return execute(job)


def _run_rank(job, execute: Callable) -> float | None:
    """One rank's process: join the group, run, leave. A failure ends this process at once with the
    rank's message (fail_rank); the launcher ends the others."""
    try:
        ranks = init(platform=job.device.platform, tp_size=job.combo.tp_size, config=job.parallel)
        value = execute(job, ranks)       # its gather is the last collective: no barrier, so other ranks
        shutdown()                        # do not wait (under the group's timeout) while rank 0 grades
        return value
    except Exception as e:
        fail_rank(int(os.environ["RANK"]), e, timeout_s=job.parallel.timeout_s)
