"""Compare the layer outputs of two dumps (`dump_dir=...`), e.g. a tp_size=2 run against a tp_size=1 run:

  python bench/compare_dumps.py DUMP_A DUMP_B

Prints, per layer, ‖a − b‖ / ‖b‖ of the attention outputs and whether the indexer selections are equal.
Runs anywhere (no GPU).
"""
from __future__ import annotations

import argparse
from pathlib import Path

TENSORS = "tensors.safetensors"


def load(folder: str) -> dict:
    """A dump's tensors; a folder that is not a dump is refused in one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / TENSORS
    if not path.is_file():
        raise SystemExit(f"error: {folder}: not a dump folder (no {TENSORS} there); give two folders that runs "
                         f"wrote with dump_dir=...")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SystemExit(f"error: {path}: not a readable safetensors file ({e}); dump the run again") from None


def main(a: str, b: str) -> None:
    from dsv4.oracle import rel_err

    ta, tb = load(a), load(b)
    keys = sorted(k for k in tb if k.endswith(".outputs.attn_out"))
    missing = [k for k in keys if k not in ta or ta[k].shape != tb[k].shape]
    if not keys or missing:
        why = f"no layer outputs in {b}" if not keys else f"{missing[0]} differs or is missing in {a}"
        raise SystemExit(f"error: {a} and {b} are not dumps of the same layers and workload ({why})")
    for key in keys:
        sel = key.replace("attn_out", "topk_indices")
        if sel not in tb or sel not in ta:
            same = "-"
        elif ta[sel].shape != tb[sel].shape:
            same = f"of other shapes ({list(ta[sel].shape)} and {list(tb[sel].shape)})"
        else:
            diff = float((ta[sel] != tb[sel]).float().mean())
            same = "equal" if diff == 0 else f"{diff:.2%} differ"
        print(f"{key}: rel err {rel_err(ta[key], tb[key]):.2e}; indexer selections: {same}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump_a", help="a folder a run wrote with dump_dir=...")
    ap.add_argument("dump_b", help="the one to compare it with (the reference)")
    args = ap.parse_args()
    main(args.dump_a, args.dump_b)
