"""What the cache layouts share: their rounding budgets (`CacheLayout.rounding_budget`), what storing rows
costs against exact float32 rows -- the bound a run's "rel_err f32 KV" is judged by, besides the
combination's error budget, so that a cache whose rounding the oracle repeats cannot hide a layer that no
longer computes attention (rows rounded away agree with an oracle that rounds them away too).

"rel_err f32 KV" is the run's output against the oracle with the run's own top-k selection, indexer and
linear numerics, but exact float32 rows: what rounding rows costs, plus what the activations and kernels
cost (which the error budget covers). Measured with the CPU reference (dsv4_tiny and dsv4_flash, random
weights, seeds 0-4, float32 and bf16 activations, linear=reference and fp8_sim, indexer exact, fp4_sim and
mxfp4), the worst of a layer's:
  - bf16 rows: 2.2e-3 (1.1e-2 with fp8 linears, whose e4m3 rounding edges the rows' rounding moves);
  - e4m3 rows (fp8_ds_mla, its FNUZ bytes, fp8_per_tensor at kv_scale 1): 3.5e-2 (6.0e-2 with fp8 linears
    and bf16 activations, within their budgets plus this).
A budget is about 3-5x the rows' own cost; rows rounded away cost 1.
"""
from __future__ import annotations

BF16_ROWS_ROUNDING_BUDGET = 1e-2
FP8_ROWS_ROUNDING_BUDGET = 1e-1
