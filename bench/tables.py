"""docs/benchmarks.md's tables made again from the rows under docs/bench/rows/ (dsv4/speed/tables.py): every
block between `<!-- table: NAME -->` and `<!-- end table -->` is replaced by the table the rows of NAME make,
with its stamp line; the text between the tables is left as it is. No GPU needed.

  python bench/tables.py            # write the tables into the document
  python bench/tables.py --check    # exit 1, with a diff, where the document differs from what the rows make

Rows come from `python run.py mode=bench +bench_rows=docs/bench/rows ...` and `python bench/layer_table.py
--rows docs/bench/rows ...` (dsv4/speed/rows.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsv4.speed.tables import differences, load, regenerate

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where the document's tables differ")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--rows", type=Path, default=ROOT / "docs" / "bench" / "rows", help="a folder of *.jsonl rows")
    a = ap.parse_args(argv)
    try:
        rows = load(a.rows)
        text = a.doc.read_text(encoding="utf-8")
        new = regenerate(text, rows)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        diffs = differences(text, rows)
        for name, diff in diffs.items():
            print(f"{a.doc}: the table {name} differs from what its rows make:\n{diff}")
        if diffs:
            print("fix: python bench/tables.py (a table's figures are changed in its rows, not by hand)",
                  file=sys.stderr)
        return 1 if diffs else 0
    if new != text:
        a.doc.write_text(new, encoding="utf-8")
    print(f"{a.doc}: {len(set(r['table'] for r in rows))} tables in the rows; the document's made from them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
