"""The golden compatibility matrix: `check()` verdicts of every backend preset and every single-strategy
swap on it, on every device we describe, against `tests/golden/compat_matrix.json`.

A rule change (a strategy's `needs()`, a CROSS_RULES function) changes verdicts, this test fails with
the cells that changed, and `python -m pytest tests/test_compat_matrix.py --update-golden` rewrites
the file, so the change is a reviewable diff. Packages are not looked for (`here=None`): the matrix
is the same on every machine.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from dsv4.checks.catalogue import GROUPS, NESTED_GROUPS
from dsv4.checks.catalogue import options as shipped
from dsv4.app.job import make_job
from dsv4.checks.compat import check
from dsv4.values.device import DeviceInfo
from tests.conftest import CONFIGS, ROOT, options

GOLDEN = ROOT / "tests" / "golden" / "compat_matrix.json"
SETTINGS = {"model": "dsv4_flash", "tp_size": 1, "dtype": "bfloat16"}
DEVICES = {
    "cpu": DeviceInfo(platform="cpu", name="CPU"),
    "sm80": DeviceInfo(platform="cuda", arch="sm80", name="A100"),
    "sm89": DeviceInfo(platform="cuda", arch="sm89", name="L40S"),
    "sm90": DeviceInfo(platform="cuda", arch="sm90", name="H200"),
    "sm100": DeviceInfo(platform="cuda", arch="sm100", name="B200"),
    "sm120": DeviceInfo(platform="cuda", arch="sm120", name="RTX PRO 6000"),
    "gfx942": DeviceInfo(platform="rocm", arch="gfx942", name="MI300X"),
    "gfx950": DeviceInfo(platform="rocm", arch="gfx950", name="MI355X"),
}


@pytest.fixture(scope="module")
def combos():
    """{case: Combination}: each backend preset, and each preset with one strategy group (or a nested group:
    its indexer's top-k) swapped."""
    out = {}
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
            base = [f"model={SETTINGS['model']}", f"tp_size={SETTINGS['tp_size']}", f"dtype={SETTINGS['dtype']}"]
            for backend in options("backend"):
                preset = make_job(compose(config_name="config", overrides=base + [f"backend={backend}"])).combo
                out[f"backend={backend}"] = preset
                for group in GROUPS:
                    for option in options(group):
                        if option != getattr(preset, group).name:
                            cfg = compose(config_name="config", overrides=base + [f"backend={backend}",
                                                                                  f"{group}={option}"])
                            out[f"backend={backend} {group}={option}"] = make_job(cfg).combo
                for group in NESTED_GROUPS:          # the preset's indexer with each other top-k
                    for option in shipped(group):
                        if option != preset.choice(group).name:
                            cfg = compose(config_name="config", overrides=base + [f"backend={backend}",
                                                                                  f"{group}={option}"])
                            out[f"backend={backend} {group}={option}"] = make_job(cfg).combo
    finally:
        GlobalHydra.instance().clear()
    return out


def verdict(combo, device) -> str | list[str]:
    problems = check(combo, device, here=None)
    return "ok" if not problems else sorted({f"{p.group}={p.value}" for p in problems})


def matrix(combos) -> dict:
    return {
        "about": "check() verdicts (ok, or the group=value choices a problem names) per case and device; "
                 "regenerate: python -m pytest tests/test_compat_matrix.py --update-golden",
        "settings": SETTINGS,
        "devices": {k: d.describe() for k, d in DEVICES.items()},
        "verdicts": {case: {k: verdict(c, d) for k, d in DEVICES.items()} for case, c in combos.items()},
    }


def differences(current: dict, golden: dict) -> list[str]:
    """Readable lines, one per cell that differs (plus any change of settings or devices)."""
    out = [f"{key}: golden {golden.get(key)!r}, now {current.get(key)!r}"
           for key in ("settings", "devices") if current.get(key) != golden.get(key)]
    cur, old = current["verdicts"], golden.get("verdicts", {})
    for case in sorted(set(cur) | set(old)):
        if case not in old:
            out.append(f"{case}: new case")
        elif case not in cur:
            out.append(f"{case}: case removed")
        else:
            for dev in sorted(set(cur[case]) | set(old[case])):
                if cur[case].get(dev) != old[case].get(dev):
                    out.append(f"{case} on {dev}: golden {old[case].get(dev)!r}, now {cur[case].get(dev)!r}")
    return out


def test_compat_matrix_matches_golden(combos, request):
    current = matrix(combos)
    if request.config.getoption("--update-golden"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(current, indent=2) + "\n")
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing: run python -m pytest tests/test_compat_matrix.py --update-golden")
    diff = differences(current, json.loads(GOLDEN.read_text()))
    assert not diff, ("check() verdicts changed; if intended, rerun with --update-golden and review the diff:\n  "
                      + "\n  ".join(diff))


def test_matrix_covers_every_preset_swap_and_device():
    golden = json.loads(GOLDEN.read_text())
    swaps = sum(len(shipped(g)) - 1 for g in GROUPS + NESTED_GROUPS)
    assert len(golden["verdicts"]) == len(options("backend")) * (1 + swaps)
    assert all(set(v) == set(DEVICES) for v in golden["verdicts"].values())
    # the shipped presets are valid where they are meant to run
    assert golden["verdicts"]["backend=reference"] == {k: "ok" for k in DEVICES}
    assert golden["verdicts"]["backend=flashmla"]["sm90"] == "ok"
    assert golden["verdicts"]["backend=flashmla"]["sm100"] == "ok"
    assert golden["verdicts"]["backend=flashinfer"]["sm100"] == "ok"
    # on sm120 FlashInfer's kernel reads fp8_ds_mla pages; DeepGEMM's fp8 products are sm90/sm100 only
    # (hence deployment=rtx_pro_6000 takes o_proj=reference and linear=triton_fp8)
    assert golden["verdicts"]["backend=flashinfer cache_layout=fp8_ds_mla"]["sm120"] == ["linear=deepgemm_fp8",
                                                                                        "o_proj=deepgemm_fp8"]
    # fp8 projections: our Triton product on NVIDIA sm89+, refused elsewhere; the float ones run anywhere
    assert golden["verdicts"]["backend=triton"]["sm90"] == "ok"
    assert golden["verdicts"]["backend=triton"]["sm80"] == ["linear=triton_fp8", "o_proj=triton_fp8"]
    assert golden["verdicts"]["backend=triton linear=reference"]["sm80"] == ["o_proj=triton_fp8"]
    assert golden["verdicts"]["backend=triton o_proj=reference"]["sm80"] == ["linear=triton_fp8"]
    assert golden["verdicts"]["backend=reference linear=fp8_sim"] == {k: "ok" for k in DEVICES}
    assert golden["verdicts"]["backend=flashmla"]["gfx942"] != "ok"
    # FlashInfer's top-k: CUDA only, refused as its own choice; with the FlashMLA preset it runs on sm90
    assert golden["verdicts"]["backend=flashmla indexer.top_k=flashinfer"]["sm90"] == "ok"
    for backend in options("backend"):
        cell = golden["verdicts"][f"backend={backend} indexer.top_k=flashinfer"]
        assert all("indexer.top_k=flashinfer" in cell[dev] for dev in ("cpu", "gfx942", "gfx950")), backend


def test_changing_a_rule_fails_the_comparison(combos, monkeypatch):
    """Let FlashMLA's kernel claim sm120 too: the comparison names exactly the cells that changed."""
    from dsv4.strategies import FlashMLASparse

    original = FlashMLASparse.needs
    monkeypatch.setattr(FlashMLASparse, "needs",
                        lambda self, device: replace(original(self, device), archs=original(self, device).archs | {"sm120"}))
    diff = differences(matrix(combos), json.loads(GOLDEN.read_text()))
    assert diff, "a rule change left the matrix unchanged"
    assert all(" on sm120:" in line and "flashmla" in line for line in diff), diff
    assert any(line.startswith("backend=flashmla on sm120: golden") for line in diff), diff
