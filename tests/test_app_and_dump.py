"""The app end to end: `run` on the CPU, result.json, and the dump contract recomputed from files alone."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dsv4.app.dispatch import run_config
from dsv4.app.dump import recompute
from dsv4.oracle import rel_err
from tests.conftest import run_py

TINY = ["model=dsv4_tiny", "dtype=float32", "workload.kv_pool.swa_block_size=8",
        "workload.kv_pool.compressed_block_tokens=32"]


ROW_DTYPE = {"float32": "float32", "bf16": "bfloat16", "fp8_ds_mla": "fp8_ds_mla", "fp8_per_tensor": "fp8_per_tensor"}


@pytest.mark.parametrize("layout,tol", [("float32", 1e-5), ("bf16", 1e-4), ("fp8_ds_mla", 2e-3),
                                        ("fp8_per_tensor", 2e-3)])
def test_run_writes_result_and_a_dump_that_recomputes(compose_cfg, tmp_path, layout, tol):
    dump = tmp_path / "dump"
    cfg = compose_cfg(TINY + [f"cache_layout={layout}", f"dump_dir={dump}"])
    worst = run_config(cfg, out_dir=tmp_path)
    assert worst <= tol
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "ok" and row["schema"] == 1
    assert row["choices.cache_layout"] == layout and row["device.platform"] == "cpu"
    for t in ("swa", "c4a", "c128a"):
        assert row[f"metrics.{t}.rel_err"] <= tol
        assert row[f"metrics.{t}.prefill_tok_s"] > 0 and row[f"metrics.{t}.decode_ms_step"] > 0
    if layout != "float32":           # what the rounding costs, reported beside the matched-rounding error
        assert row["metrics.c4a.rel_err_vs_f32_kv"] > 10 * row["metrics.c4a.rel_err"]
        assert row["metrics.c4a.rel_err_vs_f32_kv"] < (1e-2 if layout == "bf16" else 1e-1)

    spec = json.loads((dump / "spec.json").read_text())
    extra = {"kv_scale"} if layout == "fp8_per_tensor" else set()
    assert set(spec) == {"model", "layers", "row_format", "indexer_numerics", "linear_numerics", "softmax_scale",
                         "choices"} | extra
    assert spec["indexer_numerics"] == "fp4"          # backend=reference's indexer: fp4_sim
    assert spec["row_format"] == ROW_DTYPE[layout]
    assert spec.get("kv_scale", 1.0) == 1.0
    assert set(spec["model"]) == {"hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
                                  "o_lora_rank", "o_groups", "sliding_window", "index_topk", "index_n_heads",
                                  "index_head_dim", "rope_theta", "compress_rope_theta", "rope_scaling",
                                  "rms_norm_eps"}
    assert set(spec["model"]["rope_scaling"]) == {"factor", "original_max_position_embeddings", "beta_fast",
                                                  "beta_slow"}
    assert spec["layers"] == [{"index": 0, "compress_ratio": 1}, {"index": 1, "compress_ratio": 4},
                              {"index": 2, "compress_ratio": 128}]
    assert spec["softmax_scale"] == pytest.approx(512 ** -0.5)

    t = load_file(str(dump / "tensors.safetensors"))
    T, hid = t["inputs.hidden_states"].shape
    assert hid == 256 and t["inputs.positions"].dtype == torch.int64 and t["inputs.request_index"].dtype == torch.int32
    m = spec["model"]
    D, G, r = m["head_dim"], m["o_groups"], m["o_lora_rank"]
    shapes = {"wq_a.weight": [m["q_lora_rank"], hid], "wkv.weight": [D, hid], "q_norm.weight": [m["q_lora_rank"]],
              "wq_b.weight": [m["num_attention_heads"] * D, m["q_lora_rank"]], "kv_norm.weight": [D],
              "wo_a.weight": [G * r, m["num_attention_heads"] // G * D], "wo_b.weight": [hid, G * r],
              "attn_sink": [m["num_attention_heads"]]}
    for l, ratio in ((0, 1), (1, 4), (2, 128)):
        for name, shape in shapes.items():
            assert list(t[f"layers.{l}.attn.{name}"].shape) == shape, name
        assert list(t[f"layers.{l}.outputs.attn_out"].shape) == [T, hid]
        has_comp = any(k.startswith(f"layers.{l}.attn.compressor.") for k in t)
        has_idx = any(k.startswith(f"layers.{l}.attn.indexer.") for k in t)
        assert has_comp == (ratio > 1) and has_idx == (ratio == 4)
    assert t["layers.1.outputs.topk_indices"].shape == (T, m["index_topk"])
    assert t["layers.1.outputs.topk_indices"].dtype == torch.int32

    # an independent recomputation from the two files alone
    graded = 0
    for l, res in recompute(dump).items():
        assert rel_err(res["dumped"], res["out"]) <= tol, l
        for g in (res["grades"] or {}).get(spec["indexer_numerics"], {}).values():
            assert g["count_ok"] == 1.0 and g["max_gap"] <= 1e-5 and g["tokens"] > 0
            graded += 1
    assert graded == len(torch.unique(t["inputs.request_index"]))       # each request of the ratio-4 layer


def test_run_bfloat16_activations(compose_cfg, tmp_path):
    worst = run_config(compose_cfg(TINY[1:] + ["model=dsv4_tiny", "dtype=bfloat16"]), out_dir=tmp_path)
    assert 1e-4 < worst < 3e-2        # bf16 activations cost accuracy, visibly but boundedly


def test_tp_size_two_matches_tp_one(compose_cfg, tmp_path):
    a = run_config(compose_cfg(TINY + ["cache_layout=float32", "tp_size=2"]), out_dir=tmp_path / "tp2")
    assert a <= 1e-5
    row = json.loads((tmp_path / "tp2" / "result.json").read_text())
    assert row["settings.tp_size"] == 2


def test_default_run_is_the_quick_start(tmp_path):
    """`python run.py` with its defaults (DSV4-Flash shapes, one layer of each type) on the CPU."""
    p = run_py(run_dir=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    for t in ("swa", "c4a", "c128a"):
        assert f"\n{t} " in p.stdout
    row = json.loads((tmp_path / "result.json").read_text())
    assert row["status"] == "ok" and row["choices.model"] == "dsv4_flash"
    assert row["metrics.max_rel_err"] <= 1e-4
    assert 1e-3 < row["metrics.c4a.rel_err_vs_f32_kv"] < 1e-2      # what bf16 rows cost on random weights


def test_a_dump_of_fp4_sim_recomputes_with_its_numerics(compose_cfg, tmp_path):
    """indexer=fp4_sim: the dump says so, and its recomputation scores with those numerics: the oracle's own
    selection is the run's, token for token."""
    dump = tmp_path / "dump"
    assert run_config(compose_cfg(TINY + ["indexer=fp4_sim", f"dump_dir={dump}"]), out_dir=tmp_path) <= 1e-5
    spec = json.loads((dump / "spec.json").read_text())
    assert spec["indexer_numerics"] == "fp4" and spec["choices"]["indexer"] == "fp4_sim"
    res = recompute(dump)
    layer = res[1]
    assert rel_err(layer["dumped"], layer["out"]) <= 1e-5
    assert layer["grades"]["fp4"] and all(g["exact"] == 1.0 for g in layer["grades"]["fp4"].values())


def test_a_dump_of_fp8_linears_carries_them_as_stored_and_recomputes(compose_cfg, tmp_path):
    """linear=fp8_sim: the dump holds the fp8 linears as the checkpoint stores them (`NAME.weight` e4m3 and
    `NAME.scale` per 128x128 block) and says `linear_numerics: fp8`; the oracle recomputes every layer from
    the files alone with those numerics; the same dump read as float (an older dump, without the key) does
    not match -- the numerics matter."""
    from dsv4.components.weights import FP8_LINEARS

    dump = tmp_path / "dump"
    assert run_config(compose_cfg(TINY + ["model.o_lora_rank=128", "linear=fp8_sim", f"dump_dir={dump}"]),
                out_dir=tmp_path) <= 1e-3
    spec = json.loads((dump / "spec.json").read_text())
    assert spec["linear_numerics"] == "fp8" and spec["choices"]["linear"] == "fp8_sim"
    t = load_file(str(dump / "tensors.safetensors"))
    for name in FP8_LINEARS:
        w = t[f"layers.1.attn.{name}"]
        s = t[f"layers.1.attn.{name.removesuffix('.weight')}.scale"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == (w.shape[0] // 128, w.shape[1] // 128)
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))            # powers of two
    for layer in recompute(dump).values():
        assert rel_err(layer["dumped"], layer["out"]) <= 1e-3
    del spec["linear_numerics"]
    (dump / "spec.json").write_text(json.dumps(spec))
    assert max(rel_err(r["dumped"], r["out"]) for r in recompute(dump).values()) > 1e-2


def test_a_run_says_what_it_runs_before_the_work_and_each_step_as_it_ends(tmp_path):
    """Piped (not a terminal), the run's first line says what runs, before any work, and stderr gets one line
    per finished step: a log shows the run advance instead of nothing until the end."""
    r = run_py("model=dsv4_tiny", "workload.prompt_lens=[20,9]", "workload.decode_steps=1", run_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("run: model=dsv4_tiny layers [0, 1, 2] on cpu") and "indexer=fp4_sim" in first
    assert "2 requests of [20, 9] tokens" in first
    assert [line for line in r.stderr.splitlines() if line.endswith(" done")] == [
        "  prefill step 1/2 done", "  decode step 2/2 done"]
