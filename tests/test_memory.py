"""Memory accounting against the spec's arithmetic (docs/numerics.md §3.6) and the published 1M-token figure."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dsv4.app.kv_memory import GIB, MILLION_TOKENS, compressor_state_bytes, layer_memory, model_memory
from dsv4.values.spec import ModelSpec
from dsv4.strategies import Fp8DsMlaLayout, Fp8PerTensorLayout, PlainRowLayout
from tests.conftest import CONFIGS

BF16 = PlainRowLayout(name="bf16", dtype="bfloat16")


def spec(name):
    return ModelSpec.from_config(OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")))


def test_per_layer_type_bytes_match_the_spec():
    s = spec("dsv4_flash")
    c4 = layer_memory(s, 4, Fp8DsMlaLayout(), indexer="fp8")
    assert c4.kv_bytes_per_token + c4.indexer_bytes_per_token == 584 / 4 + 132 / 4 == 179   # §3.6 "179 B/token"
    assert layer_memory(s, 128, Fp8DsMlaLayout()).kv_bytes_per_token == pytest.approx(4.5625)   # 584/128
    swa = layer_memory(s, 1, Fp8DsMlaLayout())
    assert swa.swa_bytes_per_request == 128 * 584 and swa.kv_bytes_per_token == 0 == swa.state_bytes_per_request
    assert layer_memory(s, 4, Fp8PerTensorLayout()).row_bytes == 512
    # compressor state: fp32 (a, s+ape) rows of the last coff*R tokens (§3.1: 8 KiB / 4 KiB per token row), on
    # at most two pages of coff*R rows
    assert compressor_state_bytes(4, 512) == 2 * 8 * 2 * 1024 * 4
    assert compressor_state_bytes(128, 512) == 2 * 128 * 2 * 512 * 4
    assert layer_memory(s, 4, BF16).state_bytes_per_request == compressor_state_bytes(4, 512) + compressor_state_bytes(4, 128)


def test_published_one_million_token_figure_for_pro():
    """vLLM's blog: 9.62 GiB per 1M-token sequence for DSV4-Pro's 61 layers in bf16 (rows and indexer keys)."""
    m = model_memory(spec("dsv4_pro"), BF16, indexer="bf16")
    assert m["tokens"] == MILLION_TOKENS and m["layers"] == {"c4a": 30, "c128a": 31}
    assert m["total_bytes"] / GIB == pytest.approx(9.62, rel=5e-3)
    fp8 = model_memory(spec("dsv4_pro"), Fp8DsMlaLayout(), indexer="fp8")["total_bytes"]
    assert 0.5 < fp8 / m["total_bytes"] < 0.6           # "fp8 attention ... roughly halves that"


def test_flash_counts_every_layer_type():
    m = model_memory(spec("dsv4_flash"), Fp8DsMlaLayout())
    assert m["layers"] == {"swa": 2, "c4a": 21, "c128a": 20}
    per = m["per_type"]
    want = sum(n * per[t].bytes_for(MILLION_TOKENS) for t, n in m["layers"].items())
    assert m["total_bytes"] == want
    assert per["c4a"].indexer_bytes_per_token == 512 / 4          # our float32 indexer keys
