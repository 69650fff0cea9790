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
from dsv4.values.layer_types import INDEXED, by_ratio
from dsv4.app.kv_memory import GIB
from dsv4.app.parallel import processes
from dsv4.strategies import indexer_keys_layout

MIB = 2 ** 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# per token of a step, per head-dim value of its (padded) heads: the activations the layer makes at once
# (queries, their normed and rotated forms, the attention output and its inverse rotation, the o_proj's
# input and the partial products), and per hidden value (input, outputs, projections)
STEP_HEAD_VALUES = 10
STEP_HIDDEN_VALUES = 8
# per token of a step, float32 values per value of: the input projection's rows (q_lora, kv, the compressors'
# and the indexer's rows), the o_proj's grouped rows, and the indexer's query heads (rotated, FP4-simulated)
STEP_PROJ_VALUES, STEP_INDEX_QUERY_VALUES = 3, 16
STEP_HOST_BYTES = 128           # per token of a step, the engine's host-side lists (positions, ids, flags)
# per (token, row) of an index list a step plan makes (the window's slots, a dense ratio's entries, the
# indexer's selection): int32 lists and their int64 / boolean temporaries while the slots are looked up
PLAN_ENTRY_BYTES = 44
# at most the bytes a cache layout's `read` holds per value it returns (the gathered bytes, a record's
# byte offsets in int64, the float32 values decoded and masked), by its rows' RowKind value
READ_VALUE_BYTES = {"plain": 12, "fp8_per_tensor": 14, "fp8_ds_mla": 28, "fp8_key": 32, "mxfp4": 40}
# per (closing token, pooled position) of a compressor's step (the torch path), float32 values per value of
# a candidate row: the step's rows and the state's gathered, their gates, the masked and pooled forms
COMPRESS_VALUES, COMPRESS_INDEX_BYTES = 12, 64
# per (query, row) of the reference MQA's chunk: the float32 scores of a head (the scores, scaled, masked, their
# exponentials) and, per value of a row, the concatenated rows (and the fixed order's padded copy)
MQA_SCORE_VALUES = 3
# the Python objects of a workload's steps ([(phase, {request: tokens})]) that a run holds: per step and per
# request of a step
STEP_LIST_BYTES, STEP_REQUEST_BYTES = 256, 112
# what the torch runtime itself takes in the host's memory once the first layer runs (operator libraries,
# allocator pools): measured at ~90 MiB on the CPU; beside an accelerator its runtime, libraries and compiled
# kernels, measured at ~1.1-1.3 GiB on the H200 (CUDA 13, Triton, DeepGEMM). Counted once per process.
RUNTIME_BYTES = {True: 128 * MIB, False: 3 * GIB // 2}
# the oracle's chunks: oracle.QUERY_CHUNK queries and oracle.CHUNK_ELEMENTS scores at most (the indexer's
# READ_ELEMENTS; a test holds them equal, the oracle imports torch); at most this many float32 buffers of a
# read's or a chunk's size live at once
ORACLE_QUERIES, READ_BUFFERS = 256, 8
# the oracle's FP4 simulation of the indexer's keys (before the chunks) or a chunk's queries: float64 distances
# to the 8 e2m1 magnitudes, two such [..., 8] buffers at once and their indices, per value
ORACLE_FP4_BYTES = 2 * 8 * 8 + 24
# the grading's float64 copies of a layer's outputs and the oracle's (rel_err, cosine: after the oracle's
# chunks are gone) and the outputs of two oracle passes kept, per token and hidden value; per token and top-k
# entry the int64 selections it holds (the run's as int64, the oracle's own, a request's copies and those of a
# second oracle pass)
GRADE_COPY_BYTES, GRADE_KEPT_BYTES, GRADE_TOPK_BYTES = 24, 8, 8 * 6
TABLE_PAGES = 16         # engine.TABLE_PAGES: block tables are padded to a multiple of this many pages (a test
                         # holds them equal; the engine imports torch)


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
        """What the deployment's device must hold (everything, on a CPU deployment, where a step's workspaces
        are gone before the grading starts: the larger of the two counts)."""
        if self.on_host:
            return self.kv_pools + self.weights + self.host - self.oracle + max(self.step, self.oracle)
        return self.kv_pools + self.weights + self.step

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
                    f"{RUNTIME_BYTES[True] // MIB} MiB; step and oracle one after the other)")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The sizes a job's buffers scale with, read once from its model, options and workload."""
    tokens: int          # the most tokens of one step (a captured graph's size included)
    requests: int
    longest: int         # the longest request's positions, decode steps included
    total: int           # every request's positions
    heads: int           # query heads of a rank, padded
    window: int
    topk: int
    ratios: tuple        # the compress ratios of the job's layers (1: SWA only), one per layer
    widths: dict         # ratio -> the entries a step's table holds for the longest request (TABLE_PAGES wide)


def shape(job) -> Shape:
    spec, c, wl = job.spec, job.combo, job.workload
    tokens = wl.max_step_tokens()
    if job.graphs.enabled and job.device.platform != "cpu":
        tokens = max(tokens, max(job.graphs.capture_sizes))
    heads = spec.num_attention_heads // c.tp_size
    lengths = [wl.total_len(i) for i in range(len(wl.prompt_lens))]
    ratios = tuple(spec.compress_ratio(l) for l in wl.layer_indices(spec))
    widths = {}
    for r in {r for r in ratios if by_ratio(r).compressed}:
        bs = job.pool.compressed_block_size(r)
        pages = -(-(max(lengths) // r) // bs)
        widths[r] = -(-max(pages, 1) // TABLE_PAGES) * TABLE_PAGES * bs
    return Shape(tokens=tokens, requests=len(lengths), longest=max(lengths), total=sum(lengths),
                 heads=c.head_padding.padded_heads(heads) or heads, window=spec.sliding_window, topk=spec.index_topk,
                 ratios=ratios, widths=widths)


def read_bytes(layout) -> int:
    """Bytes a layout's `read` holds per value it returns, at most."""
    return READ_VALUE_BYTES[layout.row_format.kind.value]


def activation_bytes(job, sh: Shape) -> int:
    """One rank's activations of a step's layer: queries, outputs, projections (and the indexer's queries)."""
    spec, c = job.spec, job.combo
    itemsize = DTYPE_BYTES[c.dtype]
    coff = max(by_ratio(r).coff for r in sh.ratios)
    indexed = any(by_ratio(r).indexed for r in sh.ratios)
    proj = spec.q_lora_rank + spec.head_dim + 2 * coff * spec.head_dim + spec.o_groups * spec.o_lora_rank
    index = spec.index_n_heads * spec.index_head_dim if indexed else 0
    if indexed:
        proj += 4 * spec.index_head_dim + spec.index_n_heads
    per_token = itemsize * (STEP_HEAD_VALUES * sh.heads * spec.head_dim + STEP_HIDDEN_VALUES * spec.hidden_size) \
        + 4 * (STEP_PROJ_VALUES * proj + STEP_INDEX_QUERY_VALUES * index)
    return sh.tokens * per_token


def plan_bytes(sh: Shape) -> int:
    """One rank's step plan: each token's window slots, and every entry of a dense ratio (built, then kept)."""
    dense = max((w for r, w in sh.widths.items() if not by_ratio(r).indexed), default=0)
    return PLAN_ENTRY_BYTES * sh.tokens * (sh.window + dense)


def compressor_bytes(job, sh: Shape) -> int:
    """A compressor's step on the torch path, the widest of the job's: each closing token pools coff·R
    positions of coff·D-wide rows (a step's tokens close at most tokens/R entries, and one more per request)."""
    spec, out = job.spec, 0
    for r in {r for r in sh.ratios if by_ratio(r).compressed}:
        coff = by_ratio(r).coff
        closing = min(sh.tokens, sh.tokens // r + sh.requests)
        dim = max(spec.head_dim, spec.index_head_dim if by_ratio(r).indexed else 0)
        pooled = closing * coff * r
        out = max(out, pooled * (4 * COMPRESS_VALUES * coff * dim + COMPRESS_INDEX_BYTES))
    return out


def indexer_bytes(job, sh: Shape) -> int:
    """A ratio-4 layer's indexer on the torch path: the scores of every entry slot of each token's request,
    the keys read for a few tokens at a time (READ_ELEMENTS values, or one token's whole table), their
    per-head products, then the top-k: its values and indices, the lists and their slots."""
    spec, c = job.spec, job.combo
    if not any(by_ratio(r).indexed for r in sh.ratios):
        return 0
    width, Di, Hi = sh.widths[INDEXED.ratio], spec.index_head_dim, spec.index_n_heads
    per_read = max(1, min(TOKENS_PER_READ, READ_ELEMENTS // max(1, width * Di)))
    read = min(per_read, sh.tokens) * width
    keys = indexer_keys_layout(c.indexer, dtype=c.dtype, head_dim=Di)
    k = min(sh.topk, width)
    return (4 * sh.tokens * width + read * (Di * read_bytes(keys) + 12 * Hi + 24)
            + sh.tokens * (25 * k + (4 + PLAN_ENTRY_BYTES) * sh.topk))


def mqa_bytes(job, sh: Shape) -> int:
    """The MQA call of the widest layer: an option that gathers rows (the reference: `chunk` queries at a time)
    holds each query's rows -- its window and its compressed entries (the top-k, or every entry of a dense
    ratio) -- read through the cache layout, concatenated, and its scores per head."""
    c, spec = job.combo, job.spec
    chunk = getattr(c.mqa_kernel, "chunk", None)
    if chunk is None:                       # a kernel that reads the pages itself: its output is an activation
        return 0
    q = min(chunk, sh.tokens)
    rows = 0
    for r in set(sh.ratios):
        kind = by_ratio(r)
        rows = max(rows, sh.window + (sh.topk if kind.indexed else sh.widths[r] if kind.compressed else 0))
    per_value = read_bytes(c.cache_layout) + 4 + (4 if c.batch_invariant else 0)
    return q * rows * (spec.head_dim * per_value + 4 * MQA_SCORE_VALUES * sh.heads + 9)


def step_parts(job, sh: Shape | None = None) -> dict[str, int]:
    """The largest step's workspaces by what drives them (`step_bytes` is their sum): the activations
    (tokens of a step), the plan (the window, a dense ratio's entries), the compressor's pooling, the
    indexer's scores and lists (its entries, index_topk) and the MQA call's gathered rows (window + top-k)."""
    sh = sh or shape(job)
    spec, ranks = job.spec, ranks_counted(job)
    indexed = sum(1 for r in sh.ratios if by_ratio(r).indexed)
    kept = sh.tokens * (4 * spec.hidden_size * len(sh.ratios) + 4 * sh.topk * indexed + STEP_HOST_BYTES)
    return {"activations": ranks * activation_bytes(job, sh) + kept, "plan": ranks * plan_bytes(sh),
            "compressor": compressor_bytes(job, sh), "indexer": indexer_bytes(job, sh), "mqa": mqa_bytes(job, sh)}


def step_bytes(job, sh: Shape) -> int:
    """The largest step: every rank's activations and plan, the engine's per-step host lists, each layer's
    outputs and selections kept until the step ends, and one layer's workspaces at a time (its compressor,
    indexer and MQA call, summed: their buffers may overlap)."""
    return sum(step_parts(job, sh).values())


def record_bytes(job, sh: Shape) -> int:
    """What `run` keeps to grade: every token's input, position and request, each layer's outputs and
    selections; and the workload's steps as Python objects."""
    spec, wl = job.spec, job.workload
    indexed = sum(1 for r in sh.ratios if by_ratio(r).indexed)
    rows = sh.total * (4 * spec.hidden_size * (2 + len(sh.ratios)) + 12 + 4 * sh.topk * indexed)
    return rows + wl.num_steps() * (STEP_LIST_BYTES + STEP_REQUEST_BYTES * sh.requests)


def oracle_bytes(job, sh: Shape, layer_values: int) -> int:
    """The grading of the largest layer: per position of the longest request its compressor's candidates,
    gates and their APE (coff·D each, float32), its raw KV rows and outputs; the chunked scores (chunks of
    ORACLE_QUERIES queries at most, fewer where a query sees many keys, one at the least) and each chunk's keys;
    the FP4 simulation of the indexer's keys and a chunk's queries; the selections and the float64 copies of
    the outputs it compares; a float32 copy of the layer's weights when they are stored as fp8 blocks."""
    spec = job.spec
    widest = max(by_ratio(r).coff for r in sh.ratios)
    indexed = any(by_ratio(r).indexed for r in sh.ratios)
    compressed = [r for r in sh.ratios if by_ratio(r).compressed]
    entries = sh.longest // min(compressed) if compressed else 0          # the most compressed entries a query sees
    heads = max(spec.num_attention_heads, spec.index_n_heads)
    seen = sh.window + entries
    step = max(1, min(ORACLE_QUERIES, READ_ELEMENTS // (heads * (seen + ORACLE_QUERIES))))
    chunk = step * heads * (seen + step)
    out = sh.longest * 4 * (3 * widest * spec.head_dim + 4 * spec.head_dim + 2 * spec.hidden_size)
    out += 4 * READ_BUFFERS * chunk + 8 * spec.head_dim * (seen + step)
    if indexed:
        out += ORACLE_FP4_BYTES * spec.index_head_dim * max(sh.longest // 4, step * spec.index_n_heads)
        out += GRADE_TOPK_BYTES * sh.topk * (sh.total + sh.longest)
    out = max(out, GRADE_COPY_BYTES * sh.total * spec.hidden_size)
    return out + GRADE_KEPT_BYTES * sh.total * spec.hidden_size + 4 * layer_values


def estimate(job) -> JobMemory:
    """The job's peak by part (`run`'s: the workload, then the oracle; `bench` holds less). Closed form: its
    cost does not grow with any setting."""
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
    sh = shape(job)
    return JobMemory(kv_pools=pool_bytes(job), weights=weights, float_weights=float_weights,
                     step=step_bytes(job, sh), record=record_bytes(job, sh),
                     oracle=oracle_bytes(job, sh, max(numel.values())), on_host=job.device.platform == "cpu")


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
