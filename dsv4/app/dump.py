"""The dump contract (docs/design.md §3): everything needed to recompute a run elsewhere.

`spec.json` holds the model fields, the layers, how cached rows were rounded, how the indexer and the
dense projections computed (`indexer_numerics`, `linear_numerics`) and the choices;
`tensors.safetensors` the inputs, every layer's weights under DeepSeek's checkpoint names -- the linears
held as fp8 blocks as the checkpoint stores them (`NAME.weight` e4m3, `NAME.scale` float32 per 128x128
block, the values of its UE8M0 bytes), the others in float32 --, its outputs and (ratio-4 layers) the
indexer's selection. Dumps without `linear_numerics` (float weights only) load as "float". `recompute()`
redoes every output from those two files alone with the whole-sequence oracle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_dump(path: str | Path, *, spec, layers: dict[int, dict], record: dict[str, Any], row_format: str,
               choices: dict[str, str], kv_scale: float | None = None, indexer_numerics: str = "exact",
               fp8: dict[int, dict] | None = None, linear_numerics: str = "float") -> Path:
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"model": spec.to_dump(),
            "layers": [{"index": l, "compress_ratio": spec.compress_ratio(l)} for l in layers],
            "row_format": row_format, "indexer_numerics": indexer_numerics, "linear_numerics": linear_numerics,
            "softmax_scale": spec.softmax_scale,
            "choices": dict(choices)}
    if kv_scale is not None:
        meta["kv_scale"] = kv_scale
    tensors = {"inputs.hidden_states": record["hidden"].float(),
               "inputs.positions": record["positions"].to(torch.int64),
               "inputs.request_index": record["request_index"].to(torch.int32)}
    for l, weights in layers.items():
        stored = (fp8 or {}).get(l, {})
        for name, w in weights.items():
            if name in stored:
                tensors[f"layers.{l}.attn.{name}"] = stored[name].weight
                tensors[f"layers.{l}.attn.{name.removesuffix('.weight')}.scale"] = stored[name].scale.float()
            else:
                tensors[f"layers.{l}.attn.{name}"] = w.float()
        tensors[f"layers.{l}.outputs.attn_out"] = record["outputs"][l].float()
        if l in record["topk"]:
            tensors[f"layers.{l}.outputs.topk_indices"] = record["topk"][l].to(torch.int32)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "tensors.safetensors"))
    (path / "spec.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def recompute(path: str | Path) -> dict[int, dict[str, Any]]:
    """Recompute each layer of a dump with the oracle over the dump's own selection.

    Returns per layer: `out` (oracle), `dumped` (the run's), `topk` (the run's selection) and, for ratio-4
    layers, `grades`: that selection graded per request against the oracle's scores under each indexer
    numerics (`oracle.grade_selection`; the dump's own numerics under `meta["indexer_numerics"]`).
    """
    from safetensors.torch import load_file

    from dsv4.oracle import oracle_outputs

    path = Path(path)
    meta = json.loads((path / "spec.json").read_text())
    t = load_file(str(path / "tensors.safetensors"))
    res = {}
    for layer in meta["layers"]:
        l, ratio = layer["index"], layer["compress_ratio"]
        prefix = f"layers.{l}.attn."
        w = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
        topk = t.get(f"layers.{l}.outputs.topk_indices")
        o = oracle_outputs(meta["model"], ratio, w, t["inputs.hidden_states"], t["inputs.positions"],
                           t["inputs.request_index"], kv_scale=meta.get("kv_scale"),
                           row_format=meta.get("row_format", meta.get("kv_row_dtype")),    # older dumps' name
                           topk=None if topk is None else topk.long(),
                           indexer_numerics=meta.get("indexer_numerics", "exact"),
                           linear_numerics=meta.get("linear_numerics", "float"), keep_scores=False,
                           grade=True)
        res[l] = {"out": o["out"], "dumped": t[f"layers.{l}.outputs.attn_out"], "grades": o.get("grades"),
                  "topk": topk}
    return res
