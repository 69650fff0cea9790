"""How a paged cache stores one row, as one typed value (`RowFormat`) that the layer's readers take fields
of: the sparse MQA kernels and the indexer's scoring kernel pick their decoding by it (its `code`, the one
table of row-format codes our Triton kernels branch on), `check()` matches a kernel's `Needs.row_formats`
against it, the memory report and the oracle round rows by it, and the dump records its label. A cache
layout is described by its format and read by nobody through its name, so a new layout is its class and its
YAML (docs/options.md §9.1)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RowKind(enum.Enum):
    """The bytes of one row (docs/numerics.md §3)."""
    PLAIN = "plain"                      # the row's values in `element`, nothing else
    FP8_DS_MLA = "fp8_ds_mla"            # 448 e4m3 NoPE dims over a power of two per 64, 64 bf16 RoPE dims, scales
    FP8_PER_TENSOR = "fp8_per_tensor"    # e4m3 values over one scale for the whole cache (`kv_scale`)
    FP8_KEY = "fp8_key"                  # an indexer key: e4m3 values over one float32 scale (DeepGEMM's record)
    MXFP4 = "mxfp4"                      # an indexer key: e2m1 codes over one UE8M0 scale per 32 dims


class RowCode(enum.IntEnum):
    """A row format as our Triton kernels take it: one int constexpr (`RowFormat.code`), the same number in
    every kernel that reads or stores rows. NONE: no cache at all (a row-making kernel hands its rows back)."""
    NONE = 0
    FP8_DS_MLA = 1          # OCP e4m3 NoPE bytes
    FP8_DS_MLA_FNUZ = 2     # FNUZ e4m3 NoPE bytes
    PLAIN = 3               # rows in any of PLAIN_ELEMENTS: the kernels read the element from the tensor
    MXFP4 = 4
    FP8_KEY = 5
    FP8_PER_TENSOR = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class RowFormat:
    """What a stored row is. Two formats are the same format when kind, element and e4m3 flavour agree;
    the scales of a per-tensor format are its parameters, not part of what it is."""
    kind: RowKind
    element: str = ""                    # PLAIN: the rows' dtype, one of PLAIN_ELEMENTS
    fp8: str = ""                        # the e4m3 flavour of its fp8 bytes: "ocp" | "fnuz"; "" for none
    kv_scale: float = field(default=1.0, compare=False)   # FP8_PER_TENSOR: a row is stored as e4m3(row / kv_scale)
    q_scale: float = field(default=1.0, compare=False)    # FP8_PER_TENSOR: an fp8 query is e4m3(q / q_scale)

    @property
    def label(self) -> str:
        """Its name in dumps and messages: the element of plain rows, else the record's name."""
        if self.kind is RowKind.PLAIN:
            return self.element
        if self.kind is RowKind.FP8_DS_MLA and self.fp8 == "fnuz":
            return "fp8_ds_mla_fnuz"
        return "fp8" if self.kind is RowKind.FP8_KEY else self.kind.value

    @property
    def exact(self) -> bool:
        """Whether rows are stored exactly as float32 values."""
        return self.kind is RowKind.PLAIN and self.element == "float32"

    @property
    def code(self) -> int:
        """Its RowCode, as the int our kernels take as a constexpr."""
        code = ROW_CODES.get((self.kind, self.fp8))
        if code is None:
            raise ValueError(f"no kernel reads rows of {self.kind.value} with {self.fp8 or 'no'} e4m3 bytes")
        return code.value

    @staticmethod
    def from_label(label: str, *, kv_scale: float | None = None) -> RowFormat:
        """The format a dump's label names (`label`), with its per-tensor scale where it has one."""
        if label in PLAIN_ELEMENTS:
            return plain_rows(label)
        for f in FORMATS:
            if f.label == label:
                if f.kind is RowKind.FP8_PER_TENSOR:
                    if kv_scale is None:
                        raise ValueError(f"rows stored as {label} need their kv_scale")
                    return RowFormat(kind=f.kind, fp8=f.fp8, kv_scale=kv_scale)
                return f
        raise ValueError(f"no row format is named {label!r} (have {', '.join(f.label for f in FORMATS)})")


PLAIN_ELEMENTS = ("float32", "bfloat16", "float16")      # the dtypes plain rows may be stored in
FLOAT32_ROWS = RowFormat(kind=RowKind.PLAIN, element="float32")
BF16_ROWS = RowFormat(kind=RowKind.PLAIN, element="bfloat16")
FP8_DS_MLA = RowFormat(kind=RowKind.FP8_DS_MLA, fp8="ocp")
FP8_DS_MLA_FNUZ = RowFormat(kind=RowKind.FP8_DS_MLA, fp8="fnuz")
FP8_PER_TENSOR = RowFormat(kind=RowKind.FP8_PER_TENSOR, fp8="ocp")
FP8_KEYS = RowFormat(kind=RowKind.FP8_KEY, fp8="ocp")
MXFP4_KEYS = RowFormat(kind=RowKind.MXFP4)
# RowFormat.code by what a format is (kind, e4m3 flavour): the one table of the kernels' row codes
ROW_CODES = {(RowKind.PLAIN, ""): RowCode.PLAIN, (RowKind.FP8_DS_MLA, "ocp"): RowCode.FP8_DS_MLA,
             (RowKind.FP8_DS_MLA, "fnuz"): RowCode.FP8_DS_MLA_FNUZ,
             (RowKind.FP8_PER_TENSOR, "ocp"): RowCode.FP8_PER_TENSOR, (RowKind.FP8_KEY, "ocp"): RowCode.FP8_KEY,
             (RowKind.MXFP4, ""): RowCode.MXFP4}
FORMATS = (FLOAT32_ROWS, BF16_ROWS, FP8_DS_MLA, FP8_DS_MLA_FNUZ, FP8_PER_TENSOR, FP8_KEYS, MXFP4_KEYS)


def plain_rows(element: str) -> RowFormat:
    """The format of rows stored as they are in `element` (one of PLAIN_ELEMENTS)."""
    if element not in PLAIN_ELEMENTS:
        raise ValueError(f"plain rows are stored in one of {PLAIN_ELEMENTS}, not {element!r}")
    return RowFormat(kind=RowKind.PLAIN, element=element)
