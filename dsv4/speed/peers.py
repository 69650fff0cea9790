"""The serving engines' published whole-layer latencies on the H200 and the H100, at the points of the layer
grid (`bench/layer_table.py --grid peers`), and the grid itself.

Source: the DSV4 attention tables of ai-dynamo/aiconfigurator at commit 095f58a (the same files in its
`aiconfigurator-core` 0.12.0 wheel): `systems/data/{h200_sxm,h100_sxm}/sparse_attention/{vllm/0.24.0,
sglang/0.5.14}/dsv4_{csa,hca}_{generation,context}_module_perf.parquet`; `peers_h200.csv` and `peers_h100.csv`
keep the rows of this grid (`fp8_block` projections, tensor parallelism 1), the same points on both cards.
How they were measured (its collectors `collect_dsv4_attn.py`): one real attention layer of the engine
(vLLM's `DeepseekV4FlashMLAAttention`, SGLang's `self_attn` with its multi-stream overlap) with every
projection an fp8 128x128 block-scaled DeepGEMM product, captured as one CUDA graph and replayed; the mean of
back-to-back replays without an L2 flush; dummy weights; fp8_ds_mla KV cache; one token per request in
decode; tensor parallelism 1. SGLang's ratio-4 rows carry aiconfigurator's own correction for its dummy
weights' all-equal indexer scores (they send SGLang's top-k down a slow tie-breaking path), each card's with
its own calibration table. Ours are
medians of replays with random weights: compare at the same point, not to the microsecond.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

# (requests, context) of the decode points; one token per request
DECODE_POINTS = ((1, 8192), (16, 8192), (32, 8192), (64, 1024), (64, 8192), (64, 16384), (128, 4096), (256, 4096),
                 (1, 65536), (8, 65536), (16, 32768))
PREFILL_POINTS = (4096, 8192, 16384)          # tokens of one request, nothing cached before it
MODELS = ("dsv4_flash", "dsv4_pro")
LAYER_TYPES = ("c4a", "c128a")                # the engines publish no SWA-only layer

TABLES = {"H200": Path(__file__).with_name("peers_h200.csv"), "H100": Path(__file__).with_name("peers_h100.csv")}


@dataclass(frozen=True, slots=True)
class Point:
    """One point of the grid: a decode step of `requests` x 1 token at `context`, or (prefill) one request
    of `tokens` fresh tokens."""
    model: str
    layer: str
    mode: str                 # "decode" | "prefill"
    requests: int
    tokens: int
    context: int

    def label(self) -> str:
        return f"{self.requests} @ {self.context}" if self.mode == "decode" else f"prefill {self.tokens}"


def card_of(gpu_name: str) -> str:
    """The card (a key of TABLES) whose published rows a GPU of this name is compared with."""
    for card in TABLES:
        if card in gpu_name.upper():
            return card
    raise ValueError(f"the engines publish their DSV4 layer latencies on the {' and the '.join(TABLES)} only; "
                     f"this GPU is {gpu_name}")


def published(card: str = "H200") -> dict[Point, dict[str, float]]:
    """Each point's latency per engine ("vllm", "sglang") on `card` (a key of TABLES), µs."""
    out: dict[Point, dict[str, float]] = {}
    with open(TABLES[card], newline="") as f:
        for r in csv.DictReader(f):
            p = Point(r["model"], r["layer"], r["mode"], int(r["requests"]), int(r["tokens_per_request"]),
                      int(r["context"]))
            out.setdefault(p, {})[r["engine"]] = float(r["latency_us"])
    return out


def grid(model: str, layers=LAYER_TYPES, *, max_requests: int | None = None) -> list[Point]:
    """The points of `model`, decode then prefill, per layer type; `max_requests`: only the decode points of at
    most that many requests (the few-request step's)."""
    return [Point(model, lt, "decode", n, 1, c) for lt in layers for n, c in DECODE_POINTS
            if max_requests is None or n <= max_requests] + \
           [Point(model, lt, "prefill", 1, t, 0) for lt in layers for t in PREFILL_POINTS]


def faster(figures: dict[str, float]) -> tuple[str, float]:
    """The faster engine at a point and its latency."""
    engine = min(figures, key=figures.get)
    return engine, figures[engine]
