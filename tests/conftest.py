"""Shared test helpers: the `--update-golden` option, the `compose_cfg` fixture (in-process Hydra
composition), the `no_alloc` fixture (any tensor allocated fails the test), `options(group)` (a config
group's option names), `run_py` (run.py in a subprocess), the RoPE frequencies of docs/numerics.md §2.3 and
the published float32 RoPE tables, a tiny spec and engine with helpers to drive it (`tiny_spec`, `make_engine`,
`hidden_for`, `drive`, `chunked`), and `through` (slot ids through block tables).

Without a GPU the Triton kernels' tests run interpreted: TRITON_INTERPRET=1 is set here, on import, since
triton.jit reads it when a kernel is defined and pytest imports this module before any test module."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dsv4.checks.catalogue import config_dir

CONFIGS = config_dir()      # the config tree: configs/, installed as the package dsv4.configs

ROOT = Path(__file__).resolve().parents[1]


def interpret_without_gpu() -> None:
    """TRITON_INTERPRET=1 where no CUDA GPU is seen, unless already set; a GPU machine is left as it is."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


interpret_without_gpu()     # before any test module is collected (nothing imported above defines a kernel)


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json from the current rules (review the diff, then commit)")


@pytest.fixture
def compose_cfg():
    """compose_cfg(overrides) -> DictConfig, composed in-process like `python run.py overrides`."""
    def _compose(overrides=()):
        GlobalHydra.instance().clear()
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
            return compose(config_name="config", overrides=list(overrides))
    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture
def no_alloc(monkeypatch):
    """Any torch tensor factory called while this is active fails the test."""
    def refuse(*a, **kw):
        raise AssertionError("a tensor was allocated while composing / checking")

    for name in ("zeros", "empty", "ones", "full", "rand", "randn", "randint", "tensor", "as_tensor", "arange",
                 "zeros_like", "empty_like", "ones_like", "full_like", "randn_like", "empty_strided", "from_numpy"):
        monkeypatch.setattr(torch, name, refuse)


def options(group: str) -> list[str]:
    """The options of config group `group`: the stems of configs/<group>/*.yaml, sorted."""
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def run_py(*args: str, run_dir: Path | None = None, importtime: bool = False, pythonpath: Path | None = None,
           extra_env: dict[str, str] | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python run.py *args` in ROOT, HYDRA_FULL_ERROR dropped from the environment (users' view of errors).
    run_dir: appended as hydra.run.dir=...; importtime: run under `-X importtime`; pythonpath: put first
    on PYTHONPATH; extra_env: set on top of the environment."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    env |= extra_env or {}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "run.py", *args,
           *([f"hydra.run.dir={run_dir}"] if run_dir is not None else [])]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def spec_rope_freqs(ratio: int) -> list[float]:
    """The 32 RoPE pair frequencies written from docs/numerics.md §2.3 (plain base 10000 for SWA-only
    layers; YaRN with base 160000, factor 16, original 65536, beta 32/1 for compressed layers)."""
    if ratio <= 1:
        return [10000.0 ** (-2 * i / 64) for i in range(32)]
    base, orig, factor = 160000.0, 65536, 16.0
    d = lambda n: 64 * math.log(orig / (2 * math.pi * n)) / (2 * math.log(base))  # noqa: E731
    lo, hi = max(math.floor(d(32.0)), 0), min(math.ceil(d(1.0)), 63)
    out = []
    for i in range(32):
        f = base ** (-2 * i / 64)
        r = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(f * (1 - r) + f / factor * r)
    return out


def published_rope_freqs(ratio: int, *, rope_theta=10000.0, compress_rope_theta=160000.0, factor=16.0,
                         original_seq_len=65536, beta_fast=32.0, beta_slow=1.0):
    """float32 [32]: the pair frequencies as DeepSeek's published V4 inference code computes them
    (inference/model.py, precompute_freqs_cis), step for step and in its dtype: float32 torch ops, the YaRN
    correction range in Python floats, `freqs / factor * (1 - smooth) + freqs * smooth`. Compressed
    layers (ratio > 1) use compress_rope_theta with YaRN; the others rope_theta without."""
    yarn = ratio > 1
    base = compress_rope_theta if yarn else rope_theta
    dim = 64
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn:
        d = lambda n: dim * math.log(original_seq_len / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
        low, high = max(math.floor(d(beta_fast)), 0), min(math.ceil(d(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        smooth = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def published_rope_kw(spec) -> dict:
    """published_rope_freqs' keywords from a ModelSpec."""
    ys = spec.rope_scaling
    return dict(rope_theta=spec.rope_theta, compress_rope_theta=spec.compress_rope_theta, factor=ys.factor,
                original_seq_len=ys.original_max_position_embeddings, beta_fast=ys.beta_fast, beta_slow=ys.beta_slow)


def published_freqs_cis(positions, freqs):
    """complex64 [len(positions), 32]: rows `positions` of the published table,
    torch.polar(1, torch.outer(positions, freqs)) (the angle a float32 product)."""
    ang = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(ang), ang)


def published_angles(positions, ratio: int):
    """float64 [..., 32]: the published float32 angles position × frequency (exact as float64), so that
    float64 cos/sin of them are the published table to float32 rounding."""
    f = published_rope_freqs(ratio)
    return (positions.reshape(-1).to(torch.float32)[:, None] * f).double().reshape(*positions.shape, 32)


def fp8_block_product(x, xs, w, ws):
    """z[t, g] = Σ_k x·xs · w·ws in float32: e4m3 x [T, G, K] with one scale per 1×128 block, e4m3 w [G, N, K]
    with one per 128×128 block -- the product every fp8 o_proj computes, simulated."""
    xd = (x.float().unflatten(-1, (-1, 128)) * xs[..., None]).flatten(-2)
    wd = w.float() * ws.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return torch.einsum("tgk,gnk->tgn", xd, wd)


def gpu_device():
    """The first CUDA GPU as a DeviceInfo (sm<major><minor>), or None without one."""
    from dsv4.values.device import DeviceInfo

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return DeviceInfo(platform="cuda", arch=f"sm{major}{minor}", name=torch.cuda.get_device_name())


def tiny_spec(**changes):
    from dsv4.values.spec import ModelSpec

    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "dsv4_tiny.yaml"))
    cfg.update(changes)
    return ModelSpec.from_config(cfg)


def make_engine(spec, *, layers=(0, 1, 2), layout="float32", tp_size=1, dtype="float32", seed=0,
                swa_block_size=8, compressed_block_tokens=32, swa_blocks=64, compressed_blocks=64, max_requests=8,
                head_padding=None, weights=None, ranks=None, all_reduce=None, mqa_kernel=None, o_proj=None,
                device=None, graphs=None, indexer=None, linear=None, fp8=None):
    """An Engine (the reference strategies unless given); returns (engine, {layer: full weights}). layout: a
    CacheLayout or a PlainRowLayout dtype name; ranks: the tensor-parallel ranks it holds (default all tp_size
    of them); all_reduce: the engine's (one rank per process); graphs: a GraphConfig (GPU); linear: the dense
    projections' option; fp8: {layer: the linears as fp8 blocks} (weights.in_fp8_blocks)."""
    from dsv4.components.builders import build_layer, build_pool
    from dsv4.components.kv_pool import PoolConfig
    from dsv4.components.engine import Engine
    from dsv4.components.weights import random_layer_weights
    from dsv4.values.device import DeviceInfo
    from dsv4.strategies import (ExactIndexer, NoHeadPadding, PlainRowLayout, ReferenceLinear, ReferenceMQA,
                                 ReferenceOProj, Strategies)

    dev = device or DeviceInfo(platform="cpu")
    lay = layout if not isinstance(layout, str) else PlainRowLayout(name=layout, dtype=layout)
    st = Strategies(mqa_kernel=mqa_kernel or ReferenceMQA(), o_proj=o_proj or ReferenceOProj(),
                    head_padding=head_padding or NoHeadPadding(), cache_layout=lay, indexer=indexer or ExactIndexer(),
                    linear=linear or ReferenceLinear())
    pool = PoolConfig(swa_block_size=swa_block_size, compressed_block_tokens=compressed_block_tokens,
                      swa_blocks=swa_blocks, compressed_blocks=compressed_blocks, max_requests=max_requests)
    W = weights or {l: random_layer_weights(spec, l, seed) for l in layers}
    ranks = range(tp_size) if ranks is None else ranks
    mods = {l: [build_layer(spec=spec, layer=l, weights=W[l], rank=r, tp_size=tp_size, strategies=st, device=dev,
                            dtype=dtype, fp8=(fp8 or {}).get(l)) for r in ranks] for l in layers}
    pools = [build_pool(spec=spec, layers=layers, layout=st.cache_layout, pool=pool, device=dev, dtype=dtype,
                        indexer=st.indexer)
             for _ in ranks]
    graph_runner = None
    if graphs is not None:
        from dsv4.components.graphs import StepGraphs
        graph_runner = StepGraphs(graphs)
    return Engine(spec=spec, layers=mods, pools=pools, device=dev.torch_device, all_reduce=all_reduce,
                  graphs=graph_runner), W


def hidden_for(lengths: dict, hidden_size: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randn(n, hidden_size, generator=g) for r, n in lengths.items()}


def drive(engine, X: dict, schedule):
    """Run `schedule` (a list of {rid: new tokens}) over hidden states X; returns per layer and
    request the outputs [L, hidden] and, for ratio-4 layers, the selections [L, K] in position order."""
    done = {r: 0 for r in X}
    for r in X:
        if r not in engine.lengths:
            engine.add_request(r)
    outs, topk = {}, {}
    for chunk in schedule:
        xs = [X[r][done[r]:done[r] + n] for r, n in chunk.items()]
        pos = torch.cat([torch.arange(done[r], done[r] + n) for r, n in chunk.items()])
        ids = [r for r, n in chunk.items() for _ in range(n)]
        o = engine.step(torch.cat(xs), pos, ids)
        off = 0
        for r, n in chunk.items():
            for l, y in o.outputs.items():
                outs.setdefault(l, {}).setdefault(r, []).append(y[off:off + n])
            for l, t in o.topk.items():
                topk.setdefault(l, {}).setdefault(r, []).append(t[off:off + n])
            off += n
            done[r] += n
    cat = lambda d: {l: {r: torch.cat(v) for r, v in per.items()} for l, per in d.items()}  # noqa: E731
    return cat(outs), cat(topk)


def chunked(lengths: dict, chunk: int) -> list:
    """Prefill every request `chunk` tokens at a time, all requests batched per step."""
    done = {r: 0 for r in lengths}
    steps = []
    while any(done[r] < n for r, n in lengths.items()):
        step = {r: min(chunk, n - done[r]) for r, n in lengths.items() if done[r] < n}
        for r, k in step.items():
            done[r] += k
        steps.append(step)
    return steps


def through(table, local, B: int):
    """Global (vLLM) slot ids of local entries through per-token block tables [T, blocks] (-1 stays -1)."""
    safe = local.clamp(min=0)
    return torch.where(local >= 0, table.gather(1, safe // B) * B + safe % B, torch.full_like(local, -1))
