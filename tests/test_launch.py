"""dsv4.kernels.launch against `kernel[grid](...)`: the same results whatever specialization a call needs.

On a GPU the compiled variants are launched directly after the first call of each specialization: calls
that differ in an integer's divisibility by 16 or value 1, in a pointer's 16-byte alignment or in a
constexpr must each get their own variant. Without a GPU (the interpreter) `launch` is `kernel[grid]`."""
from __future__ import annotations

import pytest
import torch

from tests.triton_mode import DEVICE, INTERPRET, MARK

import triton
import triton.language as tl

from dsv4.kernels.launch import as_dense, as_f32, as_i32, full_rows, launch, rows_dense, variants
from dsv4.values.sizes import cdiv, next_pow2

pytestmark = MARK


@triton.jit
def _ramp(x_ptr, n, step, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, i * step, mask=i < n)


@pytest.mark.parametrize("order", ["aligned first", "odd first"])
def test_every_specialization_gets_its_own_variant(order):
    calls = [(0, 16, 3, 64), (0, 17, 3, 64), (0, 1, 1, 64), (1, 16, 2, 64), (3, 33, 5, 32), (0, 48, 1, 16)]
    if order == "odd first":
        calls = calls[::-1]
    for offset, n, step, block in calls:
        buf = torch.full((256,), -1, dtype=torch.int32, device=DEVICE)
        x = buf[offset:]                                     # offsets 1 and 3: pointers not 16-byte aligned
        for _ in range(2):                                   # the second call takes the direct launch
            x.fill_(-1)
            launch(_ramp, (cdiv(n, block),), x, n, step, BLOCK=block)
        want = torch.full_like(x, -1)
        want[:n] = torch.arange(n, dtype=torch.int32, device=DEVICE) * step
        assert torch.equal(x, want), (offset, n, step, block)
    if not INTERPRET:                                        # distinct variants were kept, not one reused
        assert variants(_ramp) >= 4


def test_argument_helpers_return_their_input_when_it_already_fits():
    f = torch.randn(4, 6, device=DEVICE)
    i = torch.arange(6, dtype=torch.int32, device=DEVICE)
    cols = f[:, 1:]                                          # strided rows, adjacent columns
    assert as_f32(f) is f and as_i32(i) is i and as_dense(f) is f and rows_dense(cols) is cols
    assert as_f32(f.T).is_contiguous() and torch.equal(as_f32(f.T), f.T)
    assert as_i32(i.long()).dtype == torch.int32 and as_f32(i).dtype == torch.float32
    assert rows_dense(f.T).stride(1) == 1
    heads = torch.randn(4, 3 * 5 + 7, device=DEVICE)[:, :15].view(4, 3, 5)      # rows of dense [3, 5] blocks
    assert rows_dense(heads) is heads and rows_dense(heads.transpose(1, 2)).is_contiguous()


def test_full_rows_reads_a_column_slice_without_a_copy():
    """A column slice [:, :n] of a contiguous tensor: that tensor (the same memory, its first n columns
    the slice's); a slice that does not start a row, or whose last row would run past the storage, and
    transposed rows: copied, contiguous."""
    base = torch.randn(4, 10, device=DEVICE)
    assert full_rows(base) is base
    for view in (base[:, :7], base[1:, :7]):
        wide = full_rows(view)
        assert wide.is_contiguous() and wide.data_ptr() == view.data_ptr() and wide.shape[1] == 10
        assert torch.equal(wide[:, :7], view)
    for view in (base[:, 2:9], base.T):
        copy = full_rows(view)
        assert copy.is_contiguous() and copy.data_ptr() != base.data_ptr() and torch.equal(copy, view)


def test_host_grid_arithmetic_is_tritons():
    for n in range(300):
        assert next_pow2(n) == triton.next_power_of_2(n)
        for b in (1, 3, 16, 64):
            assert cdiv(n, b) == triton.cdiv(n, b)
