"""Chosen rows of `mode=bench`'s whole-layer table (dsv4/speed/layer.py), for a run with little time.

  python bench/layer_table.py --cases 64x2@8192 64x2@65536 --backends "flashmla_sparse + deepgemm_fp8 + deepgemm_fp8"
  python bench/layer_table.py --no-prefill deployment=h200 model=dsv4_pro
  python bench/layer_table.py --cases 64x2@131072 --layer-types c4a --indexers deepgemm_fp8 mxfp4 --no-prefill
  python bench/layer_table.py --padding --tp-sizes 8 --cases 256x2@8192     # the head-padding table at that step
  python bench/layer_table.py --grid peers [model=dsv4_pro]   # every point the engines publish, beside their figures
  python bench/layer_table.py --grid peers --no-decode        # its prefill points only
  python bench/layer_table.py --grid peers --no-prefill --max-requests 16   # the few-request decode points
  python bench/layer_table.py --grid peers --rows docs/bench/rows   # its rows where docs/benchmarks.md's come from

Every row measured is also appended, stamped, to a file of rows under --rows (dsv4/speed/rows.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dsv4 import api
from dsv4.values.errors import USER_ERRORS
from dsv4.speed.gpu import require_gpu
from dsv4.speed.grid import bench_grid
from dsv4.speed.layer import DECODE_CASES, ERROR, bench_layer_step
from dsv4.speed.padding import TP_SIZES, bench_padding
from dsv4.speed.rows import open_rows


def case(text: str) -> tuple[int, int, int]:
    """"64x2@8192" -> (64 requests, 2 tokens each, 8192 context)."""
    reqs, rest = text.split("x")
    tokens, context = rest.split("@")
    return int(reqs), int(tokens), int(context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", type=case, default=DECODE_CASES)
    ap.add_argument("--backends", nargs="*", default=None,
                    help="labels, e.g. 'flashmla_sparse + deepgemm_fp8 + deepgemm_fp8'")
    ap.add_argument("--indexers", nargs="*", default=None, help="indexer options for the ratio-4 layer, e.g. mxfp4")
    ap.add_argument("--layer-types", nargs="*", default=None, help="e.g. c4a (default: swa c4a c128a)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="with --grid: its prefill points only")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="with --grid: its decode points of at most this many requests only (e.g. 16)")
    ap.add_argument("--padding", action="store_true", help="mode=bench's head-padding table at each case instead")
    ap.add_argument("--tp-sizes", nargs="*", type=int, default=None, help="the padding table's (default: 1 2 4 8)")
    ap.add_argument("--grid", choices=["peers"], default=None,
                    help="peers: the points where vLLM and SGLang publish (dsv4/speed/peers.py) instead of --cases")
    ap.add_argument("--rows", type=Path, default=Path("outputs/bench_rows"),
                    help="the folder the rows go to (docs/bench/rows: those docs/benchmarks.md's tables are made from)")
    ap.add_argument("overrides", nargs="*", default=[], help="Hydra overrides (deployment=h200 unless one is given)")
    a = ap.parse_args()
    require_gpu("bench/layer_table.py")
    # Hydra overrides written after a list option (`--backends X model=dsv4_pro`) land in that list: move them
    for key in ("backends", "indexers", "layer_types"):
        given = getattr(a, key) or []
        a.overrides += [x for x in given if "=" in x]
        setattr(a, key, [x for x in given if "=" not in x] or (None if getattr(a, key) is None else []))
    if not any(o.startswith("deployment=") for o in a.overrides):
        a.overrides.insert(0, "deployment=h200")
    try:                  # a deployment this machine is not (a GPU table on a CPU): refused, as mode=bench does
        job = api.compose(a.overrides)
    except USER_ERRORS as e:
        raise SystemExit(f"error: {e}") from None
    record = open_rows(a.rows)
    try:
        tables(a, job, record)
    finally:
        if record.path.exists():
            print(f"rows: {record.path}")


def tables(a, job, record) -> None:
    """The table the arguments ask for, printed, its rows handed to `record`."""
    failed: list[str] = []

    def echo(line: str) -> None:
        print("  row:", line, flush=True)
        if ERROR in line:
            failed.append(line)

    if a.grid:
        try:
            modes = tuple(m for m, off in (("decode", a.no_decode), ("prefill", a.no_prefill)) if not off)
            print(bench_grid(job, labels=a.backends, modes=modes, max_requests=a.max_requests,
                             **({"layer_types": a.layer_types} if a.layer_types else {}),
                             echo=echo, record=record))
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        return
    if a.padding:
        for step in a.cases:
            print(f"{step[0]} requests x {step[1]} tokens at {step[2]} context:\n"
                  + bench_padding(job, step=step, layer_types=a.layer_types, tp_sizes=a.tp_sizes or TP_SIZES,
                                  record=record))
        return
    print(bench_layer_step(job, a.cases, labels=a.backends, indexers=a.indexers, layer_types=a.layer_types,
                           prefill=not a.no_prefill, echo=echo, record=record))
    if failed:            # every row was still measured; the tracebacks are above
        raise SystemExit(f"error: {len(failed)} of the table's rows failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
