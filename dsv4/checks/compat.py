"""`check()`: every problem of a strategy combination for a device, before anything is allocated.

Pure: no torch, no CUDA, no kernel-library imports (a missing package is found with
`importlib.util.find_spec`). Generic rules read each strategy's `Needs`; the few rules that span
several choices live in CROSS_RULES. Each Problem names `group=value`, the supported set and an
override that fixes it.
"""
from __future__ import annotations

import importlib.util
from dataclasses import MISSING, dataclass, fields, is_dataclass, replace
from typing import Callable

from dsv4.checks.catalogue import NESTED_GROUPS
from dsv4.values.device import DeviceInfo
from dsv4.values.dtypes import ACTIVATION_DTYPES
from dsv4.values.errors import Problem
from dsv4.values.graph_config import DEFAULT_SIZES
from dsv4.formats.fp8_blocks import LinearNumerics
from dsv4.formats.indexer_numerics import IndexerNumerics
from dsv4.values.spec import ModelSpec
from dsv4.strategies.choice import Strategies
from dsv4.strategies.protocols import (CacheLayout, HeadPaddingPolicy, IndexerStrategy, LinearStrategy,
                                       MQAKernelStrategy, OProjStrategy)


# the groups whose strategies state their needs (head_padding's are read through the MQA kernel's)
NEEDS_GROUPS = ("mqa_kernel", "o_proj", "cache_layout", "indexer", "linear")


def _needing(c: "Combination") -> list[tuple[str, object]]:
    """(group, strategy) of every strategy whose Needs check() reads: the NEEDS_GROUPS' and the nested
    groups' (`indexer.top_k`)."""
    return [(g, c.choice(g)) for g in NEEDS_GROUPS + NESTED_GROUPS]

# what the activation dtype alone costs against the float32 oracle (tests/test_layer_vs_oracle.py)
DTYPE_ERROR_BUDGET = {"float32": 1e-5, "bfloat16": 3e-2}
# how far below the oracle's k-th score a selected entry may score (relative to the largest |score|), by
# the activation dtype and the indexer's numerics: a near-tie in float32; the rounding of bf16 queries and
# keys (tests: test_layer_vs_oracle, test_gpu_layer); under the FP4 numerics bf16's ~1e-3 moves a value
# across an FP4 rounding edge, a whole step (1/8 to 1/3 of it): up to 0.1 measured on dsv4_tiny
SELECTION_GAP = {("float32", IndexerNumerics.EXACT): 1e-5, ("bfloat16", IndexerNumerics.EXACT): 2e-2,
                 ("float32", IndexerNumerics.FP4): 1e-5, ("bfloat16", IndexerNumerics.FP4): 0.15}
# with fp8 projections the indexer's queries come from e4m3-quantized q_lora rows: bf16's rounding moves
# some of them across an e4m3 edge (a step of 6-12%) where the float32 oracle's do not. Measured on dsv4_tiny
# (seeds 0-2, linear=fp8_sim): up to 0.07 (exact) and 0.22 (fp4); float32 selections are the oracle's
FP8_LINEAR_SELECTION_GAP = {("bfloat16", IndexerNumerics.EXACT): 0.15, ("bfloat16", IndexerNumerics.FP4): 0.4}


def selection_gap(c: "Combination") -> float:
    """How far below the oracle's k-th score a selected entry may score, for this combination."""
    gap = SELECTION_GAP[c.dtype, c.indexer.numerics]
    if c.linear.numerics is LinearNumerics.FP8:
        gap = max(gap, FP8_LINEAR_SELECTION_GAP.get((c.dtype, c.indexer.numerics), 0.0))
    return gap


@dataclass(frozen=True, slots=True, kw_only=True)
class Combination:
    """Everything `check()` judges: the model, its strategies (an option of each group, read by group:
    `c.indexer`; changed with `with_choice`) and the run-level settings."""
    spec: ModelSpec
    strategies: Strategies
    tp_size: int = 1
    dtype: str = "float32"
    world_size: int | None = None      # processes of a torchrun launch (one per rank); None: not launched so
    graphs: bool = False               # graph.enabled: decode steps replayed as CUDA graphs
    capture_tokens: int = 0            # the most tokens of a captured step: the largest of graph.capture_sizes
    batch_invariant: bool = False      # a request's results independent of the rest of its steps
    index_page_keys: int | None = None  # the pool's entries per ratio-4 page (its indexer keys'); None: unknown

    @property
    def error_budget(self) -> float:
        """The relative error against the oracle a run of this combination may show: the activations'
        rounding plus what each strategy declares it adds (tests measure each; `run` judges by it)."""
        return DTYPE_ERROR_BUDGET[self.dtype] + sum(
            getattr(s, "error_budget", 0.0)
            for s in (self.mqa_kernel, self.o_proj, self.cache_layout, self.indexer, self.linear))

    @property
    def f32_kv_budget(self) -> float:
        """The relative error against the oracle with exact float32 rows a run may show: the error budget
        plus what the cache layout's rounding may cost (its `rounding_budget`)."""
        return self.error_budget + self.cache_layout.rounding_budget

    @property
    def mqa_kernel(self) -> MQAKernelStrategy:
        return self.strategies.mqa_kernel

    @property
    def o_proj(self) -> OProjStrategy:
        return self.strategies.o_proj

    @property
    def head_padding(self) -> HeadPaddingPolicy:
        return self.strategies.head_padding

    @property
    def cache_layout(self) -> CacheLayout:
        return self.strategies.cache_layout

    @property
    def indexer(self) -> IndexerStrategy:
        return self.strategies.indexer

    @property
    def linear(self) -> LinearStrategy:
        return self.strategies.linear

    def choice(self, group: str):
        """The strategy chosen for `group`: a group's (`indexer`), or a nested group's (`indexer.top_k`)."""
        strategy = self.strategies
        for key in group.split("."):
            strategy = getattr(strategy, key)
        return strategy

    def with_choice(self, group: str, strategy) -> "Combination":
        """This combination with `strategy` chosen for `group` (a nested group's in its parent's option)."""
        parent, _, key = group.rpartition(".")
        if not parent:
            return replace(self, strategies=replace(self.strategies, **{key: strategy}))
        return self.with_choice(parent, replace(self.choice(parent), **{key: strategy}))

    @property
    def local_heads(self) -> int | None:
        ok = self.tp_size >= 1 and self.spec.num_attention_heads % self.tp_size == 0
        return self.spec.num_attention_heads // self.tp_size if ok else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_rule(c: Combination, device: DeviceInfo) -> list[Problem]:
    H, G, tp = c.spec.num_attention_heads, c.spec.o_groups, c.tp_size
    if tp >= 1 and H % tp == 0 and G % tp == 0:
        return []
    ok = [d for d in _divisors(H) if G % d == 0]
    best = max((d for d in ok if d <= max(tp, 1)), default=1)
    return [Problem(group="tp_size", value=str(tp),
                    reason=f"must divide num_attention_heads={H} and o_groups={G} of model={c.spec.name} "
                           f"(heads and output groups are split across ranks)",
                    supported=tuple(map(str, ok)), fix=f"tp_size={best}")]


def _world_rule(c: Combination, device: DeviceInfo) -> list[Problem]:
    if c.world_size is None or c.world_size == c.tp_size:
        return []
    return [Problem(group="tp_size", value=str(c.tp_size),
                    reason=f"the job was launched as {c.world_size} processes (torchrun --nproc-per-node "
                           f"{c.world_size}), one per tensor-parallel rank, so tp_size must equal that world size",
                    supported=(str(c.world_size),), fix=f"tp_size={c.world_size}")]


def _padding_rule(c: Combination, device: DeviceInfo) -> list[Problem]:
    h = c.local_heads
    if h is None or c.head_padding.padded_heads(h) is not None:
        return []
    buckets = c.head_padding.supported()
    H, G = c.spec.num_attention_heads, c.spec.o_groups
    tps = [d for d in _divisors(H) if G % d == 0 and H // d <= max(buckets)]
    fix = f"tp_size={min(tps)}" if tps else "head_padding=none"
    return [Problem(group="head_padding", value=c.head_padding.name,
                    reason=f"its buckets cannot hold {h} heads per rank "
                           f"(num_attention_heads={H} / tp_size={c.tp_size})",
                    supported=tuple(map(str, buckets)), fix=fix)]


def _dtype_rule(c: Combination, device: DeviceInfo) -> list[Problem]:
    if c.dtype in ACTIVATION_DTYPES:
        return []
    return [Problem(group="dtype", value=c.dtype, reason="unknown activation dtype",
                    supported=ACTIVATION_DTYPES, fix="dtype=float32")]


def _graph_rule(c: Combination, device: DeviceInfo) -> list[Problem]:
    """graph.enabled=true needs a GPU and strategies whose calls a CUDA graph can capture, at every step size
    graph.capture_sizes captures."""
    if not c.graphs:
        return []
    if device.platform == "cpu":
        return [Problem(group="graph.enabled", value="true", reason="CUDA graphs need a GPU; this device is "
                        f"{device.describe()}", supported=("false",), fix="graph.enabled=false")]
    out = []
    for group, strat in _needing(c):
        needs = strat.needs(device)
        if not needs.graphs:
            out.append(Problem(group=group, value=strat.name, reason="cannot be captured in a CUDA graph "
                               "(graph.enabled=true)", fix="graph.enabled=false"))
        elif needs.graph_tokens and c.capture_tokens > needs.graph_tokens:
            out.append(Problem(group=group, value=strat.name,
                               reason=f"its calls of more than {needs.graph_tokens} tokens a step cannot be captured "
                                      f"in a CUDA graph, and graph.capture_sizes captures steps of "
                                      f"{c.capture_tokens}", fix=_capture_fix(needs.graph_tokens)))
    return out


def _capture_fix(most: int) -> str:
    """graph.capture_sizes of the default ones that a graph can capture, up to `most` tokens a step."""
    sizes = [s for s in DEFAULT_SIZES if s <= most]
    return f"graph.capture_sizes=[{','.join(map(str, sizes))}]" if sizes else "graph.enabled=false"


def _invariance_rule(c: Combination, device: DeviceInfo) -> list[Problem]:
    """batch_invariant=true needs every strategy to be able to give it on the device (Needs.batch_invariant);
    the fix names an option of the group that can -- one of the same numerics first, then a kernel before the
    reference -- or turns the setting off."""
    if not c.batch_invariant:
        return []
    from dsv4.checks.catalogue import options

    def able(group: str, option) -> bool:
        """It can give the setting, and runs here in this combination (every rule of its needs)."""
        return option.needs(device).batch_invariant and not _needs_rule(group, option, c.with_choice(group, option),
                                                                         device, None)

    def rank(strat, name: str, option) -> tuple:
        """Options of the strategy's numerics (and query format) first, then a kernel before the reference."""
        return (*(getattr(option, a, None) != getattr(strat, a, None) for a in ("numerics", "query_format")),
                name == "reference")

    out = []
    for group, strat in _needing(c):
        needs = strat.needs(device)
        if needs.batch_invariant:
            continue
        ables = {n: o for n, o in options(group).items() if able(group, o)}
        can = sorted(ables, key=lambda n: rank(strat, n, ables[n]))
        out.append(Problem(group=group, value=strat.name, reason=f"cannot be batch-invariant on "
                           f"{device.describe()} (batch_invariant=true): {needs.variance}",
                           fix=f"{group}={can[0]}" if can else "batch_invariant=false"))
    return out


CROSS_RULES: tuple[Callable[[Combination, DeviceInfo], list[Problem]], ...] = (
    _tp_rule, _world_rule, _padding_rule, _dtype_rule, _graph_rule, _invariance_rule)


def safe_choice(group: str) -> str:
    """The fix offered when a choice cannot run on a device: the group's default (configs/config.yaml; a
    nested group's in its parent's default option), which needs nothing (a test holds the defaults to that)."""
    from dsv4.checks.catalogue import defaults

    return f"{group}={defaults()[group]}"


def _paddings_for(heads: int, wanted) -> list[str]:
    """The shipped head paddings that give `heads` a count in `wanted`, the one that pads least first."""
    from dsv4.checks.catalogue import options

    fits = sorted((p, name) for name, opt in options("head_padding").items()
                  if (p := opt.padded_heads(heads)) is not None and p in wanted)
    return [name for _, name in fits]


def _layouts_storing(formats) -> list[str]:
    """The shipped cache layouts whose rows are in `formats` (RowFormat values), by name."""
    from dsv4.checks.catalogue import options

    return sorted(name for name, lay in options("cache_layout").items() if lay.row_format in formats)


FP8_FORMATS = {"ocp": "OCP e4m3 (float8_e4m3fn, bias 7, max 448)",
               "fnuz": "FNUZ e4m3 (float8_e4m3fnuz, bias 8, max 240, byte 0x80 = NaN)"}


def _fp8_note(reads: frozenset[str], stored: frozenset[str], layout: str, device: DeviceInfo) -> str:
    """Why an fp8 flavour mismatch matters, from the kernel's and the layout's `fp8_formats`."""
    def names(fs):
        return " or ".join(FP8_FORMATS.get(f, f) for f in sorted(fs))

    parts = []
    if reads:
        parts.append(f"on {device.describe()} it decodes fp8 cache bytes as {names(reads)}")
    if stored and not (reads and reads & stored):
        parts.append(f"cache_layout={layout} stores {names(stored)} bytes")
    if reads and stored and not (reads & stored):
        parts.append("the same byte read as the other flavour is worth half or twice its value")
    return f" ({'; '.join(parts)})" if parts else ""


def _shell_word(spec: str) -> str:
    """A pip requirement as one shell word: quoted when it holds a version bound (`>` is a redirect)."""
    return f"'{spec}'" if any(ch in spec for ch in "<>=!~ ") else spec


@dataclass(frozen=True, slots=True, kw_only=True)
class _Asker:
    """The strategy whose Needs are read, as its problems name it: `group=value`, and the fixes they offer --
    `fix_self` another option (the group's default), `fix_machine` what the strategy says fixes the machine."""
    group: str
    value: str
    fix_self: str
    fix_machine: str

    def problem(self, reason: str, fix: str | None, supported: tuple[str, ...] = ()) -> Problem:
        return Problem(group=self.group, value=self.value, reason=reason, supported=supported, fix=fix)


def _needs_rule(group: str, strat, c: Combination, device: DeviceInfo, here: str | None) -> list[Problem]:
    """Every problem of one strategy's Needs in `c` on `device`, a rule per family of Needs fields, in the
    order the problems are reported."""
    n = strat.needs(device)
    fix_self = safe_choice(group)
    who = _Asker(group=group, value=strat.name, fix_self=fix_self, fix_machine=n.fix or fix_self)
    return (_machine_needs(who, n, device) + _cache_needs(who, n, c, device) + _head_needs(who, n, c)
            + _dtype_needs(who, n, c) + _model_needs(who, n, c) + _projection_needs(who, n, c)
            + _range_problems(group, strat, n) + _page_needs(who, n, c) + _package_needs(who, n, device, here))


def _machine_needs(who: _Asker, n, device: DeviceInfo) -> list[Problem]:
    """The platform the strategy runs on, then (on one it runs on) the GPU architecture."""
    if n.platforms and device.platform not in n.platforms:
        return [who.problem(f"runs on {'/'.join(sorted(n.platforms))}, this device is {device.describe()}",
                            who.fix_machine, tuple(sorted(n.platforms)))]
    if n.archs and device.arch not in n.archs:
        return [who.problem(f"needs arch in {sorted(n.archs)}, this device is {device.describe()}",
                            who.fix_machine, tuple(sorted(n.archs)))]
    return []


def _cache_needs(who: _Asker, n, c: Combination, device: DeviceInfo) -> list[Problem]:
    """The cache layout's row format the strategy reads, then the fp8 flavour of its bytes."""
    layout, fmt = c.cache_layout.name, c.cache_layout.row_format
    stored = frozenset({fmt.fp8}) if fmt.fp8 else frozenset()
    if n.row_formats and fmt not in n.row_formats:
        readable = _layouts_storing(n.row_formats)
        return [Problem(group="cache_layout", value=layout, reason=f"{who.group}={who.value} reads only "
                        f"{readable}" + _fp8_note(n.fp8_formats, stored, layout, device),
                        supported=tuple(readable), fix=f"cache_layout={readable[0]}" if readable else None)]
    if n.fp8_formats and stored and not (n.fp8_formats & stored):
        others = [other for other in _layouts_storing(n.row_formats) if other != layout]
        return [Problem(group="cache_layout", value=layout, reason=f"{who.group}={who.value} reads the cache"
                        + _fp8_note(n.fp8_formats, stored, layout, device),
                        supported=tuple(others), fix=f"cache_layout={others[0]}" if others else None)]
    return []


def _head_needs(who: _Asker, n, c: Combination) -> list[Problem]:
    """The padded head counts the strategy takes."""
    h = c.local_heads
    hp = c.head_padding.padded_heads(h) if h is not None else None
    if not n.padded_heads or hp is None or hp in n.padded_heads:
        return []
    fits = _paddings_for(h, n.padded_heads)
    return [Problem(group="head_padding", value=c.head_padding.name,
                    reason=f"{who.group}={who.value} needs padded heads in {sorted(n.padded_heads)}; "
                           f"got {hp} ({h} heads per rank)",
                    supported=tuple(map(str, sorted(n.padded_heads))),
                    fix=f"head_padding={fits[0]}" if fits else None)]


def _dtype_needs(who: _Asker, n, c: Combination) -> list[Problem]:
    """The activation dtypes the strategy takes (an unknown dtype is _dtype_rule's)."""
    if not n.dtypes or c.dtype not in ACTIVATION_DTYPES or c.dtype in n.dtypes:
        return []
    return [Problem(group="dtype", value=c.dtype, reason=f"{who.group}={who.value} takes activations in "
                    f"{sorted(n.dtypes)}", supported=tuple(sorted(n.dtypes)), fix=f"dtype={sorted(n.dtypes)[0]}")]


def _model_needs(who: _Asker, n, c: Combination) -> list[Problem]:
    """The model's sizes the strategy needs: multiples, powers of two, exact values, one of a set."""
    spec, out = c.spec, []
    for field_name, m in n.model_multiples:
        if (value := getattr(spec, field_name)) % m:
            out.append(who.problem(f"needs model.{field_name} to be a multiple of {m}; model={spec.name} has "
                                   f"{value}", who.fix_self))
    for field_name in n.model_powers_of_two:
        if (value := getattr(spec, field_name)) < 1 or value & (value - 1):
            out.append(who.problem(f"needs model.{field_name} to be a power of two; model={spec.name} has "
                                   f"{value}", who.fix_machine))
    for field_name, want in n.model_values:
        if (value := getattr(spec, field_name)) != want:
            out.append(who.problem(f"needs model.{field_name} = {want}; model={spec.name} has {value}",
                                   who.fix_self, (str(want),)))
    for field_name, allowed in n.model_choices:
        if (value := getattr(spec, field_name)) not in allowed:
            out.append(who.problem(f"needs model.{field_name} in {list(allowed)}; model={spec.name} has {value}",
                                   who.fix_self, tuple(map(str, allowed))))
    return out


def _projection_needs(who: _Asker, n, c: Combination) -> list[Problem]:
    """Each rank's projection weights in whole blocks of `projection_multiple` rows and columns; the fix is a
    smaller tp_size whose cut keeps them whole, where there is one."""
    if not n.projection_multiple or c.local_heads is None or c.spec.o_groups % c.tp_size:
        return []
    m, spec = n.projection_multiple, c.spec
    cut = [f"{p} N={N} K={K}" for p, (N, K) in spec.projections(c.tp_size).items() if N % m or K % m]
    if not cut:
        return []
    fits = [d for d in _divisors(spec.num_attention_heads) if spec.o_groups % d == 0
            and all(N % m == 0 and K % m == 0 for N, K in spec.projections(d).values())]
    smaller = [d for d in fits if d < c.tp_size]
    fix = f"tp_size={max(smaller)} (or {who.fix_self})" if smaller else who.fix_self
    return [who.problem(f"stores each projection's weight in {m}x{m} blocks; on each of tp_size={c.tp_size} ranks "
                        f"of model={spec.name} {', '.join(cut)} (rows x columns) would cut a block", fix)]


def _page_needs(who: _Asker, n, c: Combination) -> list[Problem]:
    """The pool's indexer key pages the strategy reads."""
    keys = c.index_page_keys
    if not n.index_page_keys or keys is None or keys in n.index_page_keys:
        return []
    pages = sorted(n.index_page_keys)
    return [who.problem(f"reads indexer key pages of {pages} keys; the pool's ratio-4 pages hold {keys}",
                        f"workload.kv_pool.compressed_block_tokens={4 * min(n.index_page_keys)}",
                        tuple(map(str, pages)))]


def _package_needs(who: _Asker, n, device: DeviceInfo, here: str | None) -> list[Problem]:
    """The Python modules the strategy imports, looked for only on a device of this machine's platform."""
    if here is None or device.platform != here:
        return []
    # the top-level name only: find_spec("a.b") would import package "a"
    return [who.problem(f"Python module '{module}' not found (pip package {dist})",
                        f"pip install {_shell_word(dist)}  (or {who.fix_self})")
            for module, dist in n.modules if importlib.util.find_spec(module.partition(".")[0]) is None]


# what the layer's own pieces (front, norms, compressors, indexer scores, cache writes) run on a GPU whatever the
# options: our Triton kernels (on the CPU their torch code, which needs nothing beyond torch)
LAYER_MODULES = {"cuda": (("triton", "triton"),), "rocm": (("triton", "triton"),)}


def _layer_modules(device: DeviceInfo, here: str | None) -> list[Problem]:
    if here is None or device.platform != here:
        return []
    return [Problem(group="device.platform", value=device.platform, reason=f"the layer's own kernels on a GPU are "
                    f"Triton's: Python module '{module}' not found (pip package {dist})",
                    fix=f"pip install {_shell_word(dist)}")
            for module, dist in LAYER_MODULES.get(device.platform, ()) if importlib.util.find_spec(module) is None]


def _range_problems(group: str, strat, n) -> list[Problem]:
    """A setting of the strategy's own outside the values it works with (`Needs.setting_ranges`); the fix is
    the setting's default."""
    out = []
    for r in n.setting_ranges:
        value = getattr(strat, r.setting)
        if r.low <= value <= r.high:
            continue
        default = next((f.default for f in fields(strat) if f.name == r.setting), MISSING) \
            if is_dataclass(strat) else MISSING
        out.append(Problem(group=f"{group}.{r.setting}", value=f"{value:g}",
                           reason=r.below if value < r.low else r.above, supported=(f"{r.low:.3g} to {r.high:.3g}",),
                           fix=None if default is MISSING else f"{group}.{r.setting}={default}"))
    return out


def check(c: Combination, device: DeviceInfo, *, here: str | None = None) -> list[Problem]:
    """All problems of `c` on `device`. `here` is this machine's platform: packages are looked
    for only when `device` is of that platform (checking another machine's deployment cannot
    know what is installed there)."""
    problems: list[Problem] = _layer_modules(device, here)
    for group, strat in _needing(c):
        problems += _needs_rule(group, strat, c, device, here)
    for rule in CROSS_RULES:
        problems += rule(c, device)
    unique: list[Problem] = []
    for p in problems:
        if p not in unique:
            unique.append(p)
    return unique
