"""What a job will hold at its peak, known before it allocates, and what the machine has to give it.

The parts: the KV pools (exact: every rank's pages as configured, in each layout's page bytes), the layers'
weights (each rank's copy of its shard in the activation dtype, the float32 values the run keeps), the
largest step's workspaces, and what `run` keeps to grade the work (every token's input, outputs and
selection; the oracle's largest layer, which recomputes queries in bounded chunks). The pools are counted
exactly; the rest are upper estimates from the shapes, checked against the measured peak by the tests.
On a CPU deployment every part is in the host's memory; on an accelerator the pools, weights and steps
are on the device and the grading on the host. Pure Python: `mode=check` imports no torch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from dsv4.components.indexer import READ_ELEMENTS, TOKENS_PER_READ
from dsv4.components.kv_pool import page_groups
from dsv4.components.weights import SHARDED, weight_shapes
from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.layer_types import by_ratio
from dsv4.memory import GIB
from dsv4.parallel import processes
from dsv4.strategies import indexer_keys_layout

MIB = 2 ** 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# per token of a step, per head-dim value of its (padded) heads: the activations the layer makes at once
# (queries, their normed and rotated forms, the attention output and its inverse rotation, the o_proj's
# input and the partial products), and per hidden value (input, outputs, projections)
STEP_HEAD_VALUES = 10
STEP_HIDDEN_VALUES = 8
# what the torch runtime itself takes in the host's memory once the first layer runs (operator libraries,
# allocator pools): measured at ~90 MiB on the CPU; beside an accelerator its runtime, libraries and compiled
# kernels, measured at ~1.1-1.3 GiB on the H200 (CUDA 13, Triton, DeepGEMM). Counted once per process.
RUNTIME_BYTES = {True: 128 * MIB, False: 3 * GIB // 2}
# the oracle's chunks: oracle.QUERY_CHUNK queries and oracle.CHUNK_ELEMENTS scores at most (the indexer's
# READ_ELEMENTS; a test holds them equal, the oracle imports torch); at most this many float32 buffers of a
# read's or a chunk's size live at once
ORACLE_QUERIES, READ_BUFFERS = 256, 8


@dataclass(frozen=True, slots=True, kw_only=True)
class JobMemory:
    """Bytes of a job's parts at its peak: on a CPU deployment summed over every rank (all on this machine);
    on an accelerator over the ranks of one process (its device)."""
    kv_pools: int          # exact
    weights: int           # each rank's copy of its shard, activation dtype (prepared products included)
    float_weights: int     # the float32 values the run keeps (for the oracle; with fp8 linears also their
                           # blocks and the float values they were made from), on the host
    step: int              # the largest step's workspaces (and, with CUDA graphs, the captured ones)
    record: int            # the workload's inputs, outputs and selections kept for grading, on the host
    oracle: int            # the oracle's largest layer, on the host
    on_host: bool          # a CPU deployment: the device's memory is the host's

    @property
    def device(self) -> int:
        """What the deployment's device must hold (everything, on a CPU deployment)."""
        dev = self.kv_pools + self.weights + self.step
        return dev + self.host if self.on_host else dev

    @property
    def host(self) -> int:
        return self.float_weights + self.record + self.oracle + RUNTIME_BYTES[self.on_host]

    def parts(self) -> dict[str, int]:
        return {"kv_pools": self.kv_pools, "weights": self.weights, "float_weights": self.float_weights,
                "step": self.step, "record": self.record, "oracle": self.oracle}

    def describe(self) -> str:
        """One line: the peak and its parts, in MiB."""
        def mib(keys):
            return ", ".join(f"{k.replace('_', ' ')} {self.parts()[k] / MIB:,.0f}" for k in keys)
        if self.on_host:
            return (f"peak ~{self.device / MIB:,.0f} MiB ({mib(self.parts())}, the runtime "
                    f"{RUNTIME_BYTES[True] // MIB} MiB)")
        return (f"device peak ~{self.device / MIB:,.0f} MiB ({mib(('kv_pools', 'weights', 'step'))} MiB), host "
                f"~{self.host / MIB:,.0f} MiB ({mib(('float_weights', 'record', 'oracle'))}, the runtime "
                f"{RUNTIME_BYTES[False] // MIB} MiB)")


def ranks_counted(job) -> int:
    """The ranks whose pools, weights and steps one memory holds: every rank on a CPU deployment (this
    machine's, whether simulated in one process or one process each), those of one process on an accelerator."""
    return job.combo.tp_size if job.device.platform == "cpu" else job.combo.tp_size // processes(job)


def job_page_groups(job) -> dict:
    """The page groups of one rank's pool for the job's layers (`kv_pool.page_groups`), as `build_pool` makes them."""
    spec = job.spec
    ratios = {spec.compress_ratio(l) for l in job.workload.layer_indices(spec)}
    return page_groups(window=spec.sliding_window, ratios=ratios, pool=job.pool)


def pool_bytes(job) -> int:
    """The KV pools of `ranks_counted` ranks, as `build_pool` allocates them: each layer's SWA rows,
    compressed rows, indexer keys (ratio 4) and compressor state on its page groups."""
    spec, c = job.spec, job.combo
    layers = job.workload.layer_indices(spec)
    groups = job_page_groups(job)
    keys = indexer_keys_layout(c.indexer, dtype=c.dtype, head_dim=spec.index_head_dim)
    total = 0
    for l in layers:
        r = spec.compress_ratio(l)
        kind = by_ratio(r)
        swa = groups["swa"]
        total += swa.num_blocks * c.cache_layout.page_bytes(swa.block_size, spec.head_dim)
        if kind.compressed:
            ents, state = groups[f"entries{r}"], groups[f"state{r}"]
            total += ents.num_blocks * c.cache_layout.page_bytes(ents.block_size, spec.head_dim)
            total += state.num_slots * 2 * kind.coff * spec.head_dim * 4
            if kind.indexed:
                total += ents.num_blocks * keys.page_bytes(ents.block_size, spec.index_head_dim)
                total += state.num_slots * 2 * kind.coff * spec.index_head_dim * 4
    return total * ranks_counted(job)


def estimate(job) -> JobMemory:
    """The job's peak by part (`run`'s: the workload, then the oracle; `bench` holds less)."""
    spec, c, wl = job.spec, job.combo, job.workload
    layers = wl.layer_indices(spec)
    itemsize = DTYPE_BYTES[c.dtype]
    shapes = {l: weight_shapes(spec, spec.compress_ratio(l)) for l in layers}
    numel = {l: sum(math.prod(s) for s in shapes[l].values()) for l in layers}
    cut = sum(math.prod(s) for l in layers for name, s in shapes[l].items() if name in SHARDED)
    float_weights = 4 * sum(numel.values())
    if c.linear.numerics is LinearNumerics.FP8:     # the fp8 blocks too, and the float values they were made
        float_weights = 2 * float_weights + sum(numel.values())    # from, for the float-linear comparison
    ranks = ranks_counted(job)
    weights = itemsize * ranks * ((sum(numel.values()) - cut) + cut // c.tp_size)     # a replica each, a shard each

    heads = spec.num_attention_heads // c.tp_size
    padded = c.head_padding.padded_heads(heads) or heads
    lengths = [wl.total_len(i) for i in range(len(wl.prompt_lens))]
    tokens = max(sum(k for k in chunk.values()) for _, chunk in wl.steps())
    if job.graphs.enabled and job.device.platform != "cpu":
        tokens = max(tokens, max(job.graphs.capture_sizes))
    per_token = itemsize * (STEP_HEAD_VALUES * padded * spec.head_dim + STEP_HIDDEN_VALUES * spec.hidden_size)
    longest = max(lengths)
    compressed = [r for r in (spec.compress_ratio(l) for l in layers) if by_ratio(r).compressed]
    entries = longest // min(compressed) if compressed else 0          # the most compressed entries a query sees
    indexed = sum(1 for l in layers if by_ratio(spec.compress_ratio(l)).indexed)
    reads = 4 * READ_BUFFERS * min(READ_ELEMENTS, TOKENS_PER_READ * (longest // 4) * spec.index_head_dim) \
        if indexed else 0
    step = ranks * tokens * per_token + reads

    total = sum(lengths)
    record = total * (4 * spec.hidden_size * (2 + len(layers)) + 12 + 4 * spec.index_topk * indexed)
    widest = max(by_ratio(spec.compress_ratio(l)).coff for l in layers)
    # per position of the longest request: its compressor's candidates, gates and their APE (coff·D each,
    # float32), its raw KV row and output row; then the chunked scores; then a float32 copy of the layer's
    # weights when they are stored as fp8 blocks
    chunk = min(READ_ELEMENTS, min(ORACLE_QUERIES, longest) * max(spec.num_attention_heads, spec.index_n_heads)
                * (spec.sliding_window + entries + ORACLE_QUERIES))
    oracle = longest * 4 * (3 * widest * spec.head_dim + spec.head_dim + spec.hidden_size) + 4 * READ_BUFFERS * chunk
    oracle += 4 * max(numel.values())
    return JobMemory(kv_pools=pool_bytes(job), weights=weights, float_weights=float_weights, step=step,
                     record=record, oracle=oracle, on_host=job.device.platform == "cpu")


def host_available() -> tuple[int, str]:
    """Bytes this machine can still give a process, and where that figure comes from: MemAvailable of
    /proc/meminfo, or less where the process's cgroup is limited (a container's limit minus its use)."""
    avail, source = None, "/proc/meminfo MemAvailable"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        source = "free physical pages"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and int(limit) - used < avail:
            avail, source = int(limit) - used, "the cgroup's memory.max less its memory.current"
    except (OSError, ValueError):
        pass
    return avail, source
