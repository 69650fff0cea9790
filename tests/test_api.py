"""The Python API (`dsv4.compose`, `validate`, `build_layer`, `build_pool`, `build_engine`): the README's example
runs as written; a combination that cannot run raises dsv4's own error with check()'s message before anything
is allocated; strategy objects and model specs of the caller's own are checked like configured ones; and
`import dsv4` / `compose` stay light (no torch)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

import dsv4
from dsv4 import oracle
from dsv4.components.attention import DSV4Attention
from dsv4.components.engine import Engine
from dsv4.values.device import DeviceInfo, local_platform
from dsv4.strategies import FlashMLASparse
from tests.conftest import ROOT, tiny_spec

TINY = ["model=dsv4_tiny"]
on_cpu_host = pytest.mark.skipif(local_platform() != "cpu", reason="expects a host without an accelerator")


def readme_example() -> str:
    """The first ```python block after the README heading "Using the layer from Python"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Using the layer from Python\n", 1)
    assert len(section) == 2, "README.md has no section 'Using the layer from Python'"
    block = re.search(r"^```python\n(.*?)^```$", section[1], re.DOTALL | re.MULTILINE)
    assert block, "the section has no python code block"
    return block.group(1)


def test_readme_example_runs_as_written(capsys):
    code = readme_example()
    exec(compile(code, "README.md (Using the layer from Python)", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "positions 66..67: out [2, 256]" in out
    assert re.search(r"relative error against the oracle: \d\.\de-0[6-9]", out), out


def test_public_names_resolve_and_are_listed():
    assert dsv4.__all__ == sorted(dsv4.__all__) and set(dsv4.__all__) == set(dsv4._HOME)
    for name in dsv4.__all__:
        assert getattr(dsv4, name) is not None, name
    assert set(dsv4.__all__) <= set(dir(dsv4))
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        getattr(dsv4, "nosuch")


def test_import_and_compose_do_not_import_torch():
    code = ("import sys, dsv4\n"
            "assert not {'torch', 'hydra'} & {m.split('.')[0] for m in sys.modules}, 'import dsv4 was heavy'\n"
            "job = dsv4.compose(['deployment=h200'], running=False)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
            "assert not heavy, heavy[:5]\n"
            "print(job.device.describe())\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "cuda/sm90 (H200)"


def test_compose_is_the_command_lines_job():
    job = dsv4.compose([*TINY, "backend=reference", "tp_size=2", "dtype=bfloat16"])
    assert job.spec.name == "dsv4_tiny" and job.combo.tp_size == 2 and job.combo.dtype == "bfloat16"
    assert job.choices == {"deployment": "cpu", "backend": "reference", "workload": "default", "cache_layout": "bf16",
                           "head_padding": "none", "o_proj": "reference", "mqa_kernel": "reference",
                           "indexer": "fp4_sim", "linear": "reference", "model": "dsv4_tiny"}
    assert not hasattr(job, "cfg") and pickle.loads(pickle.dumps(job)) == job    # a plain value, no Hydra config


def test_tp_size_that_does_not_divide_the_heads_is_refused_with_the_fix(no_alloc):
    with pytest.raises(dsv4.IncompatibleCombination) as e:
        dsv4.compose([*TINY, "tp_size=3"])
    msg = str(e.value)
    assert msg.startswith("Incompatible attention combination for model=dsv4_tiny on cpu (CPU):")
    assert "  - tp_size=3: must divide num_attention_heads=8" in msg and "fix: tp_size=2" in msg
    assert [p.group for p in e.value.problems] == ["tp_size"]


def test_a_gpu_kernel_given_as_an_object_is_refused_on_the_cpu(no_alloc):
    with pytest.raises(dsv4.IncompatibleCombination) as e:
        dsv4.compose(TINY, mqa_kernel=FlashMLASparse())
    msg = str(e.value)
    assert "mqa_kernel=flashmla_sparse" in msg.splitlines()[1]            # the choices line names the object
    assert "mqa_kernel=flashmla_sparse: runs on cuda, this device is cpu (CPU)" in msg
    if importlib.util.find_spec("flash_mla") is None:                    # packages are looked for on this machine
        assert "Python module 'flash_mla' not found (pip package sgl-flash-mla)" in msg


def test_builders_check_a_job_changed_after_compose(no_alloc):
    job = dsv4.compose(TINY)
    bad = dataclasses.replace(job, combo=job.combo.with_choice("mqa_kernel", FlashMLASparse()))
    for build in (lambda: dsv4.build_layer(bad, 0), lambda: dsv4.build_pool(bad), lambda: dsv4.build_engine(bad)):
        with pytest.raises(dsv4.IncompatibleCombination, match="mqa_kernel=flashmla_sparse: runs on cuda"):
            build()


@on_cpu_host
def test_another_machines_deployment_is_checked_but_not_built_here(no_alloc):
    with pytest.raises(dsv4.IncompatibleCombination, match="fix: deployment=cpu"):
        dsv4.compose(["deployment=h200"])
    job = dsv4.compose(["deployment=h200"], running=False)             # what `mode=check deployment=h200` says
    assert job.device.arch == "sm90" and job.choices["mqa_kernel"] == "flashmla_sparse"
    with pytest.raises(dsv4.IncompatibleCombination, match="deployment=h200: describes a cuda/sm90"):
        dsv4.build_engine(job)


@pytest.mark.parametrize("overrides, match", [
    (["backend=nosuch"], r"Could not find 'backend/nosuch'(.|\n)*Available options in 'backend'(.|\n)*triton"),
    (["mqa_kernel.chunkk=3"], "mqa_kernel.chunkk"),
    (["cache_layout.dtype=float16"], "cache_layout=bf16"),
], ids=["unknown option", "unknown key", "invalid field"])
def test_bad_overrides_are_config_errors(overrides, match):
    with pytest.raises(dsv4.ConfigError, match=match):
        dsv4.compose(overrides)


def test_compose_keeps_an_outer_hydra_app_state():
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="dsv4.configs", version_base="1.3"):
        assert dsv4.compose(TINY).spec.name == "dsv4_tiny"
        assert compose(config_name="config").model.name == "dsv4_flash"   # the outer app still composes
    assert not GlobalHydra.instance().is_initialized()


def test_a_model_spec_of_ones_own_replaces_the_preset():
    spec = dataclasses.replace(tiny_spec(), name="my_model", sliding_window=32)
    job = dsv4.compose(TINY, spec=spec)
    assert job.spec is spec and job.combo.spec is spec and job.choices["model"] == "my_model"
    with pytest.raises(dsv4.ConfigError, match="model=broken: num_attention_heads"):
        dsv4.compose(TINY, spec=dataclasses.replace(spec, name="broken", o_groups=3))


def test_build_layer_and_its_pool():
    job = dsv4.compose([*TINY, "tp_size=2"])
    layer = dsv4.build_layer(job, 1, rank=1)
    assert isinstance(layer, DSV4Attention) and layer.ratio == 4 and layer.heads == 4
    pool = dsv4.build_pool(job, [0, 1])
    assert sorted(pool.layers) == [0, 1] and pool.layers[1].ratio == 4 and pool.layers[1].indexer_keys is not None
    assert sorted(dsv4.build_pool(job).layers) == [0, 1, 2]            # the workload's: one layer of each type
    with pytest.raises(dsv4.ConfigError, match="rank=2: expected 0..1"):
        dsv4.build_layer(job, 1, rank=2)
    with pytest.raises(dsv4.ConfigError, match="layer 7 out of range: model=dsv4_tiny has 3 layers"):
        dsv4.build_layer(job, 7)


def test_build_engine_holds_every_rank_and_matches_given_weights():
    job = dsv4.compose([*TINY, "tp_size=2", "cache_layout=float32"])
    W = {2: dsv4.random_layer_weights(job.spec, 2, seed=4)}
    engine = dsv4.build_engine(job, weights=W)
    assert isinstance(engine, Engine) and list(engine.layers) == [2] and len(engine.layers[2]) == 2
    one = dsv4.build_engine(dsv4.compose([*TINY, "cache_layout=float32"]), weights=W)
    x = torch.randn(130, job.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    for e in (engine, one):
        e.add_request(0)
    a = engine.step(x, torch.arange(130), [0] * 130).outputs[2]
    b = one.step(x, torch.arange(130), [0] * 130).outputs[2]
    assert oracle.rel_err(a, b) <= 1e-5
    with pytest.raises(dsv4.ConfigError, match=r"no weights for layers \[0\]"):
        dsv4.build_engine(job, layers=[0, 2], weights=W)


def test_a_device_of_ones_own_is_what_the_job_is_checked_for(no_alloc):
    h200 = DeviceInfo(platform="cuda", arch="sm90", name="H200")
    with pytest.raises(dsv4.IncompatibleCombination) as e:
        dsv4.compose(TINY, device=h200, mqa_kernel=FlashMLASparse(), running=False)
    msg = str(e.value)
    assert "on cuda/sm90 (H200):" in msg and "runs on cuda" not in msg
    assert "cache_layout=bf16: mqa_kernel=flashmla_sparse reads only ['fp8_ds_mla']" in msg


def test_weights_handed_in_are_judged_before_the_build():
    """The API's weights get the checkpoint loader's checks: names, shapes, floating dtypes, finite values;
    each a one-line error naming the layer and the tensor (a NaN used to give NaN or all-zero outputs)."""
    from dsv4.components.weights import random_layer_weights

    job = dsv4.compose(["model=dsv4_tiny"])
    good = random_layer_weights(job.spec, 2, 0)
    assert dsv4.build_layer(job, 2, weights=good) is not None
    nan = dict(good)
    nan["wq_b.weight"] = good["wq_b.weight"].clone()
    nan["wq_b.weight"][3, 5] = float("nan")
    cases = [(nan, ValueError, "'wq_b.weight'.*1 non-finite"),
             ({k: v for k, v in good.items() if k != "attn_sink"}, ValueError, r"missing \['attn_sink'\]"),
             (good | {"wq_c.weight": good["wq_b.weight"]}, ValueError, "not read by this layer"),
             (good | {"wkv.weight": good["wkv.weight"][:, :8]}, ValueError, r"'wkv.weight'.*shape"),
             (good | {"wkv.weight": good["wkv.weight"].int()}, TypeError, "floating-point tensor, got torch.int32"),
             (good | {"wkv.weight": [1.0]}, TypeError, "floating-point tensor, got list")]
    for weights, kind, message in cases:
        with pytest.raises(kind, match=message):
            dsv4.build_layer(job, 2, weights=weights)
        with pytest.raises(kind, match=message):
            dsv4.build_engine(job, weights={2: weights})


def test_bad_arguments_are_named_before_any_work(no_alloc):
    """Each argument of the API's builders and of compose() is judged first: a TypeError or ValueError that
    names it, never an IndexError or AttributeError from inside."""
    job = dsv4.compose(["model=dsv4_tiny"])
    cases = [(lambda: dsv4.build_layer(job, "1"), TypeError, "layer: an int, got str"),
             (lambda: dsv4.build_layer(job, 1.0), TypeError, "layer: an int, got float"),
             (lambda: dsv4.build_layer(job, 1, rank="0"), TypeError, "rank: an int"),
             (lambda: dsv4.build_layer(job, 9), ValueError, "layer 9 out of range"),
             (lambda: dsv4.build_layer("job", 1), TypeError, r"job: what dsv4.api.compose\(\) returns"),
             (lambda: dsv4.build_pool(job, 1), TypeError, "layers: a list of decoder layer indices, got int"),
             (lambda: dsv4.build_pool(job, [1, 1]), ValueError, "names a layer twice"),
             (lambda: dsv4.build_pool(job, []), ValueError, "layers: an empty list"),
             (lambda: dsv4.build_pool(job, [1], pool=3), TypeError, "pool: a dsv4.components.kv_pool.PoolConfig"),
             (lambda: dsv4.build_pool(job, [1], pool={"swa_blocks": 0}), ValueError, "swa_blocks"),
             (lambda: dsv4.build_engine(job, weights=[1]), TypeError, "weights: a mapping"),
             (lambda: dsv4.compose("model=dsv4_tiny"), TypeError, "overrides: a list of 'key=value' strings"),
             (lambda: dsv4.compose([], spec={"name": "x"}), TypeError, "spec: a dsv4.values.spec.ModelSpec, got dict"),
             (lambda: dsv4.compose([], device="cuda"), TypeError, "device: a dsv4.values.device.DeviceInfo, got str"),
             (lambda: dsv4.compose([], mqa_kernel="reference"), TypeError, r"compose\(\['mqa_kernel=reference'\]\)"),
             (lambda: dsv4.compose([], o_proj=object()), TypeError, "object does not satisfy OProjStrategy")]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
