"""Compare the layer outputs of two dumps (`dump_dir=...`), e.g. a tp_size=2 run against a tp_size=1 run:

  python bench/compare_dumps.py DUMP_A DUMP_B

Prints, per layer, ‖a − b‖ / ‖b‖ of the attention outputs and whether the indexer selections are equal.
"""
from __future__ import annotations

import sys
from pathlib import Path

from safetensors.torch import load_file

from dsv4.oracle import rel_err


def main(a: str, b: str) -> None:
    ta, tb = load_file(str(Path(a) / "tensors.safetensors")), load_file(str(Path(b) / "tensors.safetensors"))
    for key in sorted(k for k in tb if k.endswith(".outputs.attn_out")):
        sel = key.replace("attn_out", "topk_indices")
        same = "-" if sel not in tb else ("equal" if bool((ta[sel] == tb[sel]).all()) else
                                          f"{float((ta[sel] != tb[sel]).float().mean()):.2%} differ")
        print(f"{key}: rel err {rel_err(ta[key], tb[key]):.2e}; indexer selections: {same}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
