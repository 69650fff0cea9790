"""batch_invariant=true: one request's outputs, cache rows and top-k lists are bit for bit the same whether it runs
alone, with 7 others or with 63, its tokens anywhere in the step and its prompt chunked any way, in prefill and
decode, at every layer type; without it the same comparison finds differences (the test can fail); check()
refuses the options that cannot give it, naming why, and mode=info lists it for every option."""
from __future__ import annotations

import random

import pytest
import torch

from dsv4 import api
from dsv4.values.errors import IncompatibleCombination
from dsv4.values.layer_types import by_ratio
from tests.conftest import run_py

POOL = ["workload.kv_pool.max_requests=64", "workload.kv_pool.swa_blocks=900", "workload.kv_pool.compressed_blocks=300"]
LONG = 100           # request 0's prompt; 2 decode steps of 2 tokens follow


def drive(job, *, others: int, chunk0: int, seed: int):
    """Request 0 (LONG tokens, prefill chunks of `chunk0`, then 2 decode steps of 2 tokens) among `others`
    requests of random lengths (some longer: wider steps) and chunks, the step's requests in a random order.
    Returns request 0's outputs and top-k lists per layer (by position) and its cache rows at the end."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(LONG + 4, job.spec.hidden_size, generator=g)
    lens = {0: LONG} | {r: rng.randint(5, 2 * LONG) for r in range(1, others + 1)}
    xs = {0: x0} | {r: torch.randn(n + 4, job.spec.hidden_size) for r, n in lens.items() if r}
    engine = api.build_engine(job)
    for r in lens:
        engine.add_request(r)
    done = dict.fromkeys(lens, 0)
    outs: dict[int, dict[int, torch.Tensor]] = {}
    lists: dict[int, dict[int, torch.Tensor]] = {}

    def step(chunk: dict[int, int]) -> None:
        order = list(chunk)
        rng.shuffle(order)
        x = torch.cat([xs[r][done[r]:done[r] + chunk[r]] for r in order])
        pos = torch.cat([torch.arange(done[r], done[r] + chunk[r]) for r in order])
        rid = [r for r in order for _ in range(chunk[r])]
        res = engine.step(x, pos, rid)
        mine = torch.tensor(rid) == 0
        for layer, y in res.outputs.items():
            for p, row in zip(pos[mine].tolist(), y.cpu()[mine]):
                outs.setdefault(layer, {})[p] = row
        for layer, t in res.topk.items():
            for p, row in zip(pos[mine].tolist(), t.cpu()[mine]):
                lists.setdefault(layer, {})[p] = row
        for r, k in chunk.items():
            done[r] += k

    while any(done[r] < n for r, n in lens.items()):
        chunk = {r: min(chunk0 if r == 0 else rng.choice([5, 32, 64]), n - done[r])
                 for r, n in lens.items() if done[r] < n and (r == 0 or rng.random() < 0.8)}
        if chunk:
            step(chunk)
    for _ in range(2):
        step(dict.fromkeys(lens, 2))
    return ({l: torch.stack([v[p] for p in sorted(v)]) for l, v in outs.items()},
            {l: torch.stack([v[p] for p in sorted(v)]) for l, v in lists.items()},
            cache_rows(engine, 0, done[0]))


def cache_rows(engine, rid, length) -> dict:
    """Request `rid`'s live rows of every cache of every layer (rank 0): its window's SWA rows, its compressed
    entries and indexer keys, read through their layouts."""
    pool = engine.pools[0]
    out = {}
    for layer, caches in pool.layers.items():
        for name, cache, group, rows in (
                ("swa", caches.swa, pool.swa, range(max(0, length - pool.window), length)),
                ("compressed", caches.compressed, pool.entries(caches.ratio), range(length // caches.ratio)),
                ("indexer", caches.indexer_keys, pool.entries(caches.ratio), range(length // caches.ratio))):
            if cache is None:
                continue
            table, bs = group.tables[rid], group.block_size
            slots = torch.tensor([table[r // bs] * bs + r % bs for r in rows], dtype=torch.int64)
            out[(layer, name)] = cache.read(slots.to(cache.data.device)).cpu()
    return out


def same(a, b) -> list[str]:
    """What differs between two drives' results (empty: bit for bit the same)."""
    diff = []
    for what, x, y in zip(("outputs", "top-k", "cache"), a, b):
        for key in x:
            if not torch.equal(x[key], y[key]):
                diff.append(f"{what} {key}")
    return diff


STEPS = ((7, 64, 2), (63, 64, 3), (63, 17, 4), (0, 100, 5), (7, 1, 6))     # (others, request 0's chunk, seed)


@pytest.mark.parametrize("extra,steps", [([], STEPS), (["indexer=exact", "cache_layout=fp8_ds_mla"], STEPS[2:3]),
                                         (["indexer=mxfp4", "dtype=bfloat16"], STEPS[2:3])],
                         ids=["reference", "exact-fp8_ds_mla", "mxfp4-bf16"])
def test_a_request_is_the_same_bits_in_any_step(extra, steps):
    job = api.compose(["model=dsv4_tiny", "batch_invariant=true", *POOL, *extra])
    assert {by_ratio(job.spec.compress_ratio(l)).name for l in job.workload.layer_indices(job.spec)} == \
        {"swa", "c4a", "c128a"}
    alone = drive(job, others=0, chunk0=64, seed=1)
    assert alone[1] and all(len(v) == LONG + 4 for v in alone[0].values())
    for others, chunk0, seed in steps:
        assert same(alone, drive(job, others=others, chunk0=chunk0, seed=seed)) == [], (others, chunk0)


@pytest.mark.parametrize("extra", [[], ["linear=fp8_sim"]], ids=["reference", "fp8_sim"])
def test_without_it_the_same_comparison_finds_differences(extra):
    """Without batch_invariant (and with linear=fp8_sim, which check() says cannot give it) the torch path
    reduces over the step's widths: request 0 among 63 others, some longer, does not give the bits it gives
    alone -- the comparison above can fail."""
    job = api.compose(["model=dsv4_tiny", *POOL, *extra])
    assert same(drive(job, others=0, chunk0=64, seed=1), drive(job, others=63, chunk0=17, seed=4))


H200 = ["deployment=h200", "model=dsv4_flash"]


@pytest.mark.parametrize("overrides,group,why,fix", [
    (["linear=fp8_sim"], "linear=fp8_sim", "rows of a fixed count", "linear=reference"),
    (H200, "mqa_kernel=flashmla_sparse", "tile scheduler", "mqa_kernel=triton_sparse"),
    (H200, "linear=deepgemm_triton_fp8", "tiles by the row count", "linear=triton_fp8"),
    (H200, "indexer=deepgemm_fp8", "scoring kernel", "indexer=triton_fp8"),
    (H200, "o_proj=deepgemm_fp8", "not been made independent", "o_proj=triton_fp8"),
    ([*H200, "backend=triton", "indexer.top_k=flashinfer"], "indexer.top_k=flashinfer", "equal scores",
     "indexer.top_k=triton"),
    (["deployment=mi300x", "model=dsv4_flash", "backend=triton", "o_proj=reference", "linear=reference"],
     "linear=reference", "ROCm", "batch_invariant=false"),
])
def test_an_option_that_cannot_is_refused_with_why(overrides, group, why, fix):
    """With why, and a fix: an option of the group that can (of the same numerics first, a kernel before the
    reference), or the setting off."""
    with pytest.raises(IncompatibleCombination) as e:
        api.compose(["model=dsv4_tiny", "batch_invariant=true", *overrides], running=False)
    line = [l for l in str(e.value).splitlines() if l.strip().startswith(f"- {group}:")]
    assert line and "cannot be batch-invariant" in line[0] and why in line[0], str(e.value)
    assert line[0].rstrip().endswith(f"fix: {fix}"), line[0]


@pytest.mark.parametrize("deployment,preset", [("cpu", "reference"), ("h200", "triton"), ("b200", "triton"),
                                               ("rtx_pro_6000", "triton")])
def test_each_platform_has_a_batch_invariant_preset(deployment, preset):
    """The CPU's reference preset and, on NVIDIA GPUs with fp8 tensor cores, the triton preset (our kernels
    and products) are accepted with batch_invariant=true; the kernels are then prepared for it."""
    job = api.compose([f"deployment={deployment}", "model=dsv4_flash", f"backend={preset}", "batch_invariant=true"],
                      running=False)
    assert job.combo.batch_invariant and job.choices["mqa_kernel"] == job.combo.mqa_kernel.name


def test_info_lists_it_for_every_option():
    p = run_py("model=dsv4_tiny", "mode=info")
    assert p.returncode == 0, p.stderr
    head = next(l for l in p.stdout.splitlines() if l.startswith("option"))
    assert "batch-invariant" in head
    rows = {l.split()[0]: l for l in p.stdout.splitlines() if l.startswith(("mqa_kernel=", "linear=", "indexer"))}
    assert "yes" in rows["mqa_kernel=reference*"] and "no: " in rows["mqa_kernel=flashmla_sparse"]


# ---- on a GPU: the same property with the kernels (DSV4-Flash's shapes, bf16, decode steps in CUDA graphs) ----
NO_GPU = not torch.cuda.is_available()
GPU_STEPS = ((7, 64, 2), (63, 64, 3), (63, 17, 4), (0, 100, 5))


def gpu_job(*extra):
    from tests.conftest import gpu_device

    dev = gpu_device()
    name = {"sm90": "h200", "sm100": "b200", "sm120": "rtx_pro_6000"}.get(dev.arch if dev else "")
    if name is None:
        pytest.skip(f"no deployment for this GPU ({dev.arch if dev else 'none'})")
    return api.compose([f"deployment={name}", "model=dsv4_flash", *POOL, *extra])


@pytest.mark.parametrize("extra", [["backend=triton"], ["backend=triton", "graph.enabled=false"],
                                   ["backend=triton", "mqa_kernel.variant=two_pass"],
                                   ["backend=triton", "linear=reference", "o_proj=reference"]],
                         ids=["triton", "triton-eager", "two_pass", "float-products"])
@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
def test_on_the_gpu_a_request_is_the_same_bits_in_any_step(extra):
    job = gpu_job("batch_invariant=true", *extra)
    alone = drive(job, others=0, chunk0=64, seed=1)
    for others, chunk0, seed in GPU_STEPS:
        assert same(alone, drive(job, others=others, chunk0=chunk0, seed=seed)) == [], (others, chunk0)


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
def test_on_the_gpu_without_it_the_comparison_finds_differences():
    """The triton preset without the setting: its planned launches give request 0 other bits among 7 others."""
    job = gpu_job("backend=triton")
    assert same(drive(job, others=0, chunk0=64, seed=1), drive(job, others=7, chunk0=64, seed=2))
