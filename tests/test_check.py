"""Unit tests of the pure `dsv4.checks.compat.check()`.

Hand-made DeviceInfo values stand in for machines this CPU box is not; small fake strategies (plain
frozen dataclasses with a `needs(device)` method, nothing subclassed) stand in for the vendor
strategies that will arrive later (FlashMLA, FlashInfer, DeepGEMM ...).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from omegaconf import OmegaConf

from tests.conftest import CONFIGS
from dsv4.checks.catalogue import strategies
from dsv4.checks.compat import Combination, check
from dsv4.values.device import DeviceInfo
from dsv4.values.errors import IncompatibleCombination, Problem
from dsv4.formats.row_format import FP8_DS_MLA as FP8_DS_MLA_ROWS, RowFormat
from dsv4.values.spec import ModelSpec
from dsv4.strategies import NoHeadPadding, ReferenceMQA, ReferenceOProj
from dsv4.strategies.protocols import CacheLayout, MQAKernelStrategy, Needs, OProjStrategy

# ---- devices ---------------------------------------------------------------------------------
CPU = DeviceInfo(platform="cpu", name="CPU")
SM90 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
SM100 = DeviceInfo(platform="cuda", arch="sm100", name="B200")
GFX942 = DeviceInfo(platform="rocm", arch="gfx942", name="MI300X")
SM80 = DeviceInfo(platform="cuda", arch="sm80", name="A100")
DEVICES = {"cpu": CPU, "sm90": SM90, "sm100": SM100, "gfx942": GFX942}


def load_spec(name: str) -> ModelSpec:
    return ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")))


def load_option(group: str, option: str):
    """A shipped strategy option, instantiated the way the app does it."""
    from dsv4.checks.catalogue import instantiate_group

    return instantiate_group(OmegaConf.load(CONFIGS.joinpath(*group.split("."), f"{option}.yaml")), group)


FLASH = load_spec("dsv4_flash")     # 64 heads, 8 output groups
PRO = load_spec("dsv4_pro")         # 128 heads, 16 output groups


# ---- fake strategies, written the way a future vendor strategy would be -------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class FakeKernel:
    """Stands in for an MQA kernel or an o_proj strategy: only `name` and `needs` matter to check()."""
    name: str
    need: Needs = Needs()
    error_budget: ClassVar[float] = 0.0

    def needs(self, device) -> Needs:
        return self.need

    def __call__(self, *args, **kwargs):  # the protocols' call member; never called by check()
        raise AssertionError("check() must not call a strategy")

    def prepare(self, *args, **kwargs):
        raise AssertionError("check() must not prepare a strategy")

    def plan(self, *args, **kwargs):
        raise AssertionError("check() must not plan a step")


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeLayout:
    """Stands in for a byte-packed cache layout such as fp8_ds_mla."""
    name: str
    need: Needs = Needs()
    error_budget: ClassVar[float] = 0.0
    rounding_budget: ClassVar[float] = 0.1

    @property
    def row_format(self) -> RowFormat:
        return FP8_DS_MLA_ROWS

    def needs(self, device) -> Needs:
        return self.need

    def bytes_per_token(self, head_dim: int) -> int:
        return 584

    def page_bytes(self, block_size: int, head_dim: int) -> int:
        return block_size * 584

    def allocate(self, **kw):
        raise AssertionError("check() must not allocate")

    def read(self, *a, **kw):
        raise AssertionError("check() must not read")

    def access(self, *a, **kw):
        raise AssertionError("check() must not build a cache")


FLASHMLA = FakeKernel(name="flashmla_sparse", need=Needs(
    platforms=frozenset({"cuda"}), archs=frozenset({"sm90", "sm100"}), row_formats=frozenset({FP8_DS_MLA_ROWS}),
    padded_heads=frozenset({64, 128}), modules=(("flash_mla", "sgl-flash-mla"),)))
FP8_EINSUM = FakeKernel(name="fp8_einsum", need=Needs(
    platforms=frozenset({"cuda"}), dtypes=frozenset({"bfloat16"}), modules=(("deep_gemm", "sgl-deep-gemm"),)))
FP8_DS_MLA = FakeLayout(name="fp8_ds_mla")
FP8_DS_MLA_CUDA = FakeLayout(name="fp8_ds_mla", need=Needs(platforms=frozenset({"cuda"})))

BF16 = load_option("cache_layout", "bf16")
NONE = load_option("head_padding", "none")
B64_128 = load_option("head_padding", "buckets_64_128")
POW2 = load_option("head_padding", "buckets_pow2")


def combo(spec=FLASH, *, mqa_kernel=None, o_proj=None, head_padding=None, cache_layout=None, indexer=None,
          linear=None, tp_size=1, dtype="float32", **kw) -> Combination:
    chosen = strategies(mqa_kernel=mqa_kernel or ReferenceMQA(), o_proj=o_proj or ReferenceOProj(),
                        head_padding=head_padding or NoHeadPadding(), cache_layout=cache_layout or BF16,
                        indexer=indexer, linear=linear)
    return Combination(spec=spec, strategies=chosen, tp_size=tp_size, dtype=dtype, **kw)


def flashmla_combo(**changes) -> Combination:
    """The FlashMLA backend as it will ship: every choice compatible on sm90/sm100."""
    kw = dict(mqa_kernel=FLASHMLA, head_padding=B64_128, cache_layout=FP8_DS_MLA, tp_size=8, dtype="bfloat16")
    kw.update(changes)
    return combo(**kw)


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


needs_missing_kernel_libs = pytest.mark.skipif(
    not (missing("flash_mla") and missing("deep_gemm")),
    reason="flash_mla / deep_gemm are installed here; the missing-module cases need them absent")


def apply_fix(c: Combination, fix: str) -> Combination:
    """Paste a `key=value` fix into the combination, the way the user would on the command line."""
    m = re.fullmatch(r"(\w+)=(\S+)", fix)
    assert m, f"fix {fix!r} is not a single pasteable key=value override"
    key, value = m.groups()
    if key == "tp_size":
        return replace(c, tp_size=int(value))
    if key == "dtype":
        return replace(c, dtype=value)
    if key == "cache_layout" and value == FP8_DS_MLA.name:
        return c.with_choice("cache_layout", FP8_DS_MLA)
    # any other fix must name a shipped option of a config group
    path = CONFIGS / key / f"{value}.yaml"
    assert path.exists(), f"fix {fix!r} names no shipped option ({path} is missing)"
    return c.with_choice(key, load_option(key, value))


# ---- sanity: the fakes are valid strategies -----------------------------------------------------
def test_fakes_satisfy_the_protocols():
    assert isinstance(FLASHMLA, MQAKernelStrategy)
    assert isinstance(FP8_EINSUM, OProjStrategy)
    assert isinstance(FP8_DS_MLA, CacheLayout)


# ---- shipped and well-formed combinations pass ----------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES.values(), ids=DEVICES.keys())
def test_reference_combination_is_valid_everywhere(dev):
    for here in (None, dev.platform, "cpu"):
        assert check(combo(), dev, here=here) == []
        assert check(combo(spec=PRO, tp_size=8, head_padding=B64_128), dev, here=here) == []


@pytest.mark.parametrize("dev", [SM90, SM100], ids=["sm90", "sm100"])
def test_flashmla_backend_is_valid_on_hopper_and_blackwell(dev):
    # tp 8: 8 heads per rank padded to 64; tp 1: 64 heads; Pro tp 1: 128 heads
    assert check(flashmla_combo(), dev) == []
    assert check(flashmla_combo(tp_size=1), dev) == []
    assert check(flashmla_combo(spec=PRO, tp_size=1), dev) == []


# ---- every problem at once ------------------------------------------------------------------------
@needs_missing_kernel_libs
def test_every_problem_is_collected_at_once_on_a_matching_machine():
    c = combo(mqa_kernel=FLASHMLA, o_proj=FP8_EINSUM, head_padding=NONE, cache_layout=BF16, tp_size=8,
              dtype="float32")
    problems = check(c, SM90, here="cuda")
    got = sorted((p.group, p.value) for p in problems)
    assert got == sorted([
        ("cache_layout", "bf16"),            # flashmla reads only fp8_ds_mla
        ("head_padding", "none"),            # 8 heads per rank, flashmla needs 64 or 128
        ("mqa_kernel", "flashmla_sparse"),   # module flash_mla missing
        ("o_proj", "fp8_einsum"),            # module deep_gemm missing
        ("dtype", "float32"),                # fp8_einsum takes bfloat16 activations
    ]), [p.line() for p in problems]
    assert len(set(problems)) == len(problems)


def test_every_problem_is_collected_at_once_on_the_wrong_machine():
    c = combo(mqa_kernel=FLASHMLA, o_proj=FP8_EINSUM, head_padding=NONE, cache_layout=BF16, tp_size=3,
              dtype="float16")
    problems = check(c, GFX942, here="cpu")
    groups = [p.group for p in problems]
    assert {"mqa_kernel", "o_proj", "cache_layout", "tp_size", "dtype"} <= set(groups), [p.line() for p in problems]
    by_gv = {(p.group, p.value): p for p in problems}
    assert by_gv[("mqa_kernel", "flashmla_sparse")].supported == ("cuda",)
    assert by_gv[("o_proj", "fp8_einsum")].supported == ("cuda",)
    assert by_gv[("tp_size", "3")].fix == "tp_size=2"
    # the unknown dtype is reported once (by the dtype rule), not again by fp8_einsum's needs
    assert sum(1 for p in problems if p.group == "dtype") == 1
    # no module problems: a rocm device is checked from a cpu machine
    assert not any("Python module" in p.reason for p in problems)


@pytest.mark.parametrize("dev,supported", [(CPU, ("cuda",)), (GFX942, ("cuda",)), (SM80, ("sm100", "sm90"))],
                         ids=["cpu", "gfx942", "sm80"])
def test_platform_then_arch_problem_names_supported_set_and_reference_fix(dev, supported):
    problems = check(flashmla_combo(), dev)
    assert len(problems) == 1, [p.line() for p in problems]
    (p,) = problems
    assert (p.group, p.value) == ("mqa_kernel", "flashmla_sparse")
    assert p.supported == supported
    assert p.fix == "mqa_kernel=reference"
    assert dev.describe() in p.reason
    assert check(apply_fix(flashmla_combo(), p.fix), dev) == []


def _scenarios():
    """(device, combination) pairs with many problems, for the generic message checks."""
    return [
        (SM90, combo(mqa_kernel=FLASHMLA, o_proj=FP8_EINSUM, head_padding=NONE, cache_layout=BF16, tp_size=8)),
        (SM80, combo(mqa_kernel=FLASHMLA, head_padding=NONE, cache_layout=BF16, tp_size=3, dtype="float16")),
        (GFX942, combo(spec=PRO, o_proj=FP8_EINSUM, head_padding=NONE, cache_layout=BF16, tp_size=32)),
        (CPU, combo(spec=replace(FLASH, num_attention_heads=256), head_padding=B64_128)),
        (SM100, combo(spec=replace(FLASH, num_attention_heads=48), mqa_kernel=FakeKernel(
            name="flashinfer_sparse", need=Needs(padded_heads=frozenset({8, 16, 32, 64, 128}))), tp_size=8)),
    ]


@pytest.mark.parametrize("i", range(len(_scenarios())))
def test_each_problem_names_group_value_supported_set_and_a_fix(i):
    dev, c = _scenarios()[i]
    problems = check(c, dev, here=None)
    assert len(problems) >= 1
    for p in problems:
        line = p.line()
        assert line.startswith(f"- {p.group}={p.value}: "), line
        assert p.reason and p.reason in line
        assert p.supported, f"no supported set: {line}"
        assert f"(supported: {', '.join(p.supported)})" in line
        assert p.fix and f"fix: {p.fix}" in line, line
        assert set(p.as_dict()) == {"group", "value", "reason", "supported", "fix"}


@pytest.mark.parametrize("i", range(len(_scenarios())))
def test_each_fix_pasted_clears_its_group(i):
    dev, c = _scenarios()[i]
    for p in check(c, dev):
        fixed = apply_fix(c, p.fix)
        key = p.fix.split("=", 1)[0]
        after = check(fixed, dev)
        assert p not in after, (p.line(), [q.line() for q in after])
        if key in ("tp_size", "head_padding") or key == p.group:
            assert not [q for q in after if q.group == p.group], (p.line(), [q.line() for q in after])


def test_cache_layout_platform_fix_names_a_shipped_option():
    c = combo(cache_layout=FP8_DS_MLA_CUDA)             # this fp8_ds_mla runs on cuda only
    (p,) = check(c, GFX942)
    assert (p.group, p.value, p.supported) == ("cache_layout", "fp8_ds_mla", ("cuda",))
    assert check(apply_fix(c, p.fix), GFX942) == []


# ---- missing kernel libraries -------------------------------------------------------------------
@needs_missing_kernel_libs
@pytest.mark.parametrize("dev", [SM90, SM100], ids=["sm90", "sm100"])
def test_missing_module_reported_when_checking_this_machines_platform(dev):
    problems = check(flashmla_combo(), dev, here="cuda")
    assert len(problems) == 1, [p.line() for p in problems]
    (p,) = problems
    assert (p.group, p.value) == ("mqa_kernel", "flashmla_sparse")
    assert "Python module 'flash_mla' not found (pip package sgl-flash-mla)" in p.reason
    assert "pip install sgl-flash-mla" in p.fix and "mqa_kernel=reference" in p.fix
    assert "ImportError" not in p.line()


def test_missing_module_fix_quotes_a_version_bound():
    """`pip install pkg>=1.0` would redirect to a file named =1.0: the fix quotes a requirement with a bound."""
    kernel = FakeKernel(name="k", need=Needs(modules=(("dsv4_no_such_module", "no-such-pkg>=1.0"),)))
    (p,) = check(combo(mqa_kernel=kernel), CPU, here="cpu")
    assert p.fix == "pip install 'no-such-pkg>=1.0'  (or mqa_kernel=reference)"


@pytest.mark.parametrize("dev", [SM90, GFX942], ids=["sm90", "gfx942"])
def test_a_gpu_needs_triton_for_the_layers_own_kernels_and_the_cpu_does_not(dev, monkeypatch):
    """The front, compressors and cache writes are Triton kernels on a GPU whatever the options: without Triton
    check() says so on a GPU of this machine's platform; the CPU (torch code) and another machine's device never."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    (p,) = check(combo(), dev, here=dev.platform)
    assert (p.group, p.value, p.fix) == ("device.platform", dev.platform, "pip install triton"), p.line()
    assert check(combo(), dev, here=None) == []
    assert check(combo(), CPU, here="cpu") == []


@needs_missing_kernel_libs
@pytest.mark.parametrize("here", [None, "cpu", "rocm"])
def test_missing_module_not_reported_for_another_platforms_device(here):
    assert check(flashmla_combo(), SM90, here=here) == []
    # and with other problems present, still none of them is about modules
    problems = check(combo(mqa_kernel=FLASHMLA, o_proj=FP8_EINSUM, tp_size=8), SM90, here=here)
    assert problems and not any("module" in p.reason for p in problems)


def test_installed_module_is_found_without_importing_it(tmp_path, monkeypatch):
    for mod in ("flash_mla", "deep_gemm"):
        pkg = tmp_path / mod
        pkg.mkdir()
        (pkg / "__init__.py").write_text(f"raise RuntimeError('stub {mod} was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("flash_mla", "deep_gemm"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    c = combo(mqa_kernel=FLASHMLA, o_proj=FP8_EINSUM, head_padding=B64_128, cache_layout=FP8_DS_MLA, tp_size=8,
              dtype="bfloat16")
    assert check(c, SM90, here="cuda") == []
    assert "flash_mla" not in sys.modules and "deep_gemm" not in sys.modules


def test_missing_dotted_module_is_a_problem_not_a_crash():
    k = FakeKernel(name="aiter_sparse", need=Needs(modules=(("dsv4_no_such_pkg.ops", "dsv4-no-such-pkg"),)))
    problems = check(combo(mqa_kernel=k), GFX942, here="rocm")
    assert [p.group for p in problems] == ["mqa_kernel"]
    assert "Python module 'dsv4_no_such_pkg.ops' not found" in problems[0].reason


def test_dotted_module_lookup_does_not_import_the_parent(tmp_path, monkeypatch):
    pkg = tmp_path / "aiter"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('stub aiter was imported')\n")
    (pkg / "ops.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "aiter", raising=False)
    k = FakeKernel(name="aiter_sparse", need=Needs(modules=(("aiter.ops", "amd-aiter"),)))
    assert check(combo(mqa_kernel=k), GFX942, here="rocm") == []
    assert "aiter" not in sys.modules


# ---- head padding ---------------------------------------------------------------------------------
def test_padded_head_mismatch_suggests_head_padding_64_128():
    c = flashmla_combo(head_padding=NONE)           # 64 heads / tp 8 = 8 heads, flashmla needs 64 or 128
    (p,) = check(c, SM90)
    assert (p.group, p.value) == ("head_padding", "none")
    assert p.supported == ("64", "128")
    assert p.fix == "head_padding=buckets_64_128"
    assert "got 8" in p.reason and "mqa_kernel=flashmla_sparse" in p.reason
    assert check(apply_fix(c, p.fix), SM90) == []


def test_padded_head_mismatch_suggests_pow2_buckets():
    spec = replace(FLASH, num_attention_heads=48)   # 6 heads per rank at tp 8
    k = FakeKernel(name="flashinfer_sparse", need=Needs(padded_heads=frozenset({8, 16, 32, 64, 128})))
    c = combo(spec=spec, mqa_kernel=k, tp_size=8)
    (p,) = check(c, SM100)
    assert (p.group, p.value, p.fix) == ("head_padding", "none", "head_padding=buckets_pow2")
    assert "got 6" in p.reason
    assert check(apply_fix(c, p.fix), SM100) == []


def test_padded_head_fix_is_offered_only_when_an_option_resolves_it():
    k = FakeKernel(name="flashmla_prefill_sm100", need=Needs(padded_heads=frozenset({128})))
    c = combo(mqa_kernel=k, head_padding=B64_128, tp_size=8)     # 8 heads -> padded to 64
    (p,) = check(c, SM100)
    assert p.fix is None, p.line()            # no shipped padding option turns 8 heads into 128
    assert "needs padded heads in [128]; got 64 (8 heads per rank)" in p.reason
    k16 = FakeKernel(name="k8", need=Needs(padded_heads=frozenset({8})))
    c16 = combo(mqa_kernel=k16, head_padding=B64_128, tp_size=8)
    (p16,) = check(c16, SM100)
    assert p16.fix == "head_padding=buckets_pow2"
    assert not [q for q in check(apply_fix(c16, p16.fix), SM100) if q.group == "head_padding"]


def test_too_many_heads_for_the_buckets_suggests_a_tp_size():
    c = combo(spec=replace(FLASH, num_attention_heads=256), head_padding=B64_128)
    (p,) = check(c, CPU)
    assert (p.group, p.value) == ("head_padding", "buckets_64_128")
    assert p.supported == ("64", "128")
    assert p.fix == "tp_size=2"
    assert "256" in p.reason
    assert check(apply_fix(c, p.fix), CPU) == []


# ---- tp_size --------------------------------------------------------------------------------------
def divisors(n: int) -> tuple[str, ...]:
    return tuple(str(d) for d in range(1, n + 1) if n % d == 0)


@pytest.mark.parametrize("spec,tp,fix", [(FLASH, 3, "tp_size=2"), (FLASH, 16, "tp_size=8"), (FLASH, 0, "tp_size=1"),
                                         (PRO, 3, "tp_size=2"), (PRO, 32, "tp_size=16"), (PRO, 12, "tp_size=8")],
                         ids=["flash-3", "flash-16", "flash-0", "pro-3", "pro-32", "pro-12"])
def test_tp_size_not_dividing_heads_and_groups(spec, tp, fix):
    c = combo(spec=spec, tp_size=tp, head_padding=B64_128)
    problems = check(c, CPU)
    assert [(p.group, p.value) for p in problems] == [("tp_size", str(tp))], [p.line() for p in problems]
    (p,) = problems
    assert p.supported == divisors(math.gcd(spec.num_attention_heads, spec.o_groups))
    assert p.fix == fix
    assert f"num_attention_heads={spec.num_attention_heads}" in p.reason and f"o_groups={spec.o_groups}" in p.reason
    assert check(apply_fix(c, p.fix), CPU) == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), heads=st.integers(1, 512), tp=st.integers(1, 64))
def test_tp_problem_iff_tp_does_not_divide_heads_and_groups(data, heads, tp):
    groups = data.draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]), label="groups")
    c = combo(spec=replace(FLASH, num_attention_heads=heads, o_groups=groups), tp_size=tp)
    problems = check(c, CPU)
    tp_problems = [p for p in problems if p.group == "tp_size"]
    should_fail = heads % tp != 0 or groups % tp != 0
    assert bool(tp_problems) == should_fail
    assert problems == tp_problems          # nothing else can be wrong with this combination
    if tp_problems:
        (p,) = tp_problems
        assert p.supported == divisors(math.gcd(heads, groups))
        fixed = apply_fix(c, p.fix)
        assert fixed.tp_size <= max(tp, 1)
        assert not [q for q in check(fixed, CPU) if q.group == "tp_size"]


# ---- the error users see ----------------------------------------------------------------------------
def test_incompatible_combination_message_has_every_problem_line():
    dev, c = _scenarios()[0]
    problems = check(c, dev)
    assert len(problems) >= 3
    err = IncompatibleCombination(problems, header="Incompatible attention combination for model=dsv4_flash "
                                                   "on cuda/sm90 (H200):", choices="mqa_kernel=flashmla_sparse")
    msg = str(err)
    assert isinstance(err, ValueError)
    assert err.problems == problems
    lines = msg.splitlines()
    assert lines[0].startswith("Incompatible attention combination for model=dsv4_flash")
    assert "mqa_kernel=flashmla_sparse" in lines[1]
    for p in problems:
        assert f"  {p.line()}" in lines
    assert "Nothing was allocated" in lines[-1]


def test_problem_line_without_supported_or_fix():
    p = Problem(group="deployment", value="h200", reason="elsewhere")
    assert p.line() == "- deployment=h200: elsewhere"


def test_the_catalogue_holds_the_shipped_yamls_and_defaults_that_need_nothing():
    """catalogue.options(group) is every YAML of configs/<group>/ by name (a nested group's in its parent's
    folder); each group's default (the fix check() offers when a choice cannot run on a device) needs
    nothing, so it runs anywhere."""
    from dsv4.checks.catalogue import GROUPS, NESTED_GROUPS, defaults, option, options
    from dsv4.values.errors import ConfigError

    for group in GROUPS + NESTED_GROUPS:
        assert list(options(group)) == sorted(p.stem for p in CONFIGS.joinpath(*group.split(".")).glob("*.yaml"))
        assert all(opt.name == name for name, opt in options(group).items())
    assert set(defaults()) == set(GROUPS + NESTED_GROUPS)
    assert defaults()["indexer.top_k"] == "triton"
    cpu = DeviceInfo(platform="cpu")
    for group, name in defaults().items():
        if group != "head_padding":                   # head paddings have no needs
            needs = option(group, name).needs(cpu)
            # nothing required (what it can give -- batch invariance, on the CPU -- is not a requirement)
            assert needs.batch_invariant, group
            assert dataclasses.replace(needs, batch_invariant=False, variance=Needs().variance) == Needs(), group
    with pytest.raises(ConfigError, match="not a shipped option"):
        option("o_proj", "nope")


# ---- mqa_kernel=triton_sparse: variant=hopper narrows what it runs on -------------------------------------
def test_triton_sparse_hopper_variant_needs_sm90_and_fp8_ds_mla_pages():
    from dsv4.strategies.mqa_kernel.triton_sparse import TritonSparseMQA

    fp8 = load_option("cache_layout", "fp8_ds_mla")
    auto, hopper = TritonSparseMQA(), TritonSparseMQA(variant="hopper")
    for dev in (SM80, SM90, SM100, GFX942):                        # auto and two_pass run on every Triton GPU
        assert check(combo(mqa_kernel=auto, cache_layout=fp8, dtype="bfloat16"), dev) == []
    assert check(combo(mqa_kernel=hopper, cache_layout=fp8, dtype="bfloat16"), SM90) == []
    for dev in (SM80, SM100, GFX942):
        probs = check(combo(mqa_kernel=hopper, cache_layout=fp8, dtype="bfloat16"), dev)
        assert [(p.group, p.value) for p in probs][:1] == [("mqa_kernel", "triton_sparse")], probs
        assert probs[0].supported in (("cuda",), ("sm90",)) and probs[0].fix == "mqa_kernel.variant=auto"
    for layout in ("bf16", "fp8_ds_mla_fnuz"):                     # pages it does not read, even on sm90
        probs = check(combo(mqa_kernel=hopper, cache_layout=load_option("cache_layout", layout),
                            dtype="bfloat16"), SM90)
        assert probs and all(p.group in ("mqa_kernel", "cache_layout") for p in probs), probs
        assert ("cache_layout", "cache_layout=fp8_ds_mla") in [(p.group, p.fix) for p in probs], probs


# ---- indexer.top_k: FlashInfer's top-k is refused where it cannot run, with its own fix ----------------------
@pytest.mark.parametrize("indexer", ["exact", "fp4_sim", "mxfp4", "triton_fp8", "deepgemm_fp8"])
def test_flashinfer_top_k_runs_on_cuda_only(indexer):
    """indexer.top_k=flashinfer on ROCm or the CPU: one problem of its own (group indexer.top_k, fix
    indexer.top_k=triton), whatever the indexer; the same indexer with our top-k has none of it; on CUDA
    its package is looked for here only, and a missing one is named."""
    fi = replace(load_option("indexer", indexer), top_k=load_option("indexer.top_k", "flashinfer"))
    assert load_option("indexer", indexer).top_k == load_option("indexer.top_k", "triton")
    for dev in (CPU, GFX942):
        probs = [p for p in check(combo(indexer=fi, dtype="bfloat16"), dev) if p.group == "indexer.top_k"]
        assert [(p.value, p.supported, p.fix) for p in probs] == [("flashinfer", ("cuda",), "indexer.top_k=triton")]
        ours = check(combo(indexer=replace(fi, top_k=load_option("indexer.top_k", "triton")), dtype="bfloat16"), dev)
        assert not [p for p in ours if p.group == "indexer.top_k"]
    assert not [p for p in check(combo(indexer=fi, dtype="bfloat16"), SM90) if p.group == "indexer.top_k"]
    missing = [p for p in check(combo(indexer=fi, dtype="bfloat16"), SM90, here="cuda") if p.group == "indexer.top_k"]
    assert bool(missing) == (importlib.util.find_spec("flashinfer") is None)
    assert all("flashinfer-python" in p.fix and "indexer.top_k=triton" in p.fix for p in missing)


def test_an_unknown_top_k_is_refused_when_the_option_is_made():
    """A top-k that is not an option is refused when the indexer option is made; a name that is none of the
    shipped ones when the config is read, with the names it could be."""
    from dsv4.checks.catalogue import instantiate_group
    from dsv4.values.errors import ConfigError
    from dsv4.strategies import ExactIndexer

    with pytest.raises(ValueError, match=r"indexer=exact: top_k='radix' is not a top-k option"):
        ExactIndexer(top_k="radix")
    node = OmegaConf.load(CONFIGS / "indexer" / "exact.yaml")
    node.top_k = "radix"
    with pytest.raises(ConfigError, match=r"indexer.top_k=radix is not a shipped option \(one of flashinfer, triton\)"):
        instantiate_group(node, "indexer")
