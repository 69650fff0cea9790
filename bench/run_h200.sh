#!/usr/bin/env bash
# The whole-layer runs behind docs/benchmarks.md, on one lent H200, in one call: each stage has its own time
# limit, so a failing stage leaves the others' logs. Logs go to $OUT (or ./h200).
#   bash bench/run_h200.sh
set -u
OUT=${OUT:-h200}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stage() { local name=$1 limit=$2; shift 2; echo "### $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
          echo "### $name exit $?"; grep -v "^  row:" "$OUT/$name.log" | tail -n 70; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used --format=csv
FLASHMLA="flashmla_sparse + deepgemm_fp8 + deepgemm_triton_fp8"; TRITON="triton_sparse + triton_fp8 + triton_fp8"
stage grid_flash 400 python3 bench/layer_table.py --grid peers --backends "$FLASHMLA" "$TRITON"
stage grid_pro 400 python3 bench/layer_table.py --grid peers --backends "$FLASHMLA" "$TRITON" model=dsv4_pro
stage gpu_tests_layer 330 python3 -m pytest -q -m gpu --maxfail=12 --tb=short -p no:cacheprovider \
  tests/test_gpu_layer.py tests/test_launch.py
stage gpu_tests_kernels 330 python3 -m pytest -q -m gpu --maxfail=12 --tb=short -p no:cacheprovider \
  tests/test_layer_kernels.py tests/test_gpu_nvidia.py
stage run_flashmla 60 python3 run.py deployment=h200 hydra.run.dir=/tmp/r_flashmla
stage run_triton 60 python3 run.py deployment=h200 backend=triton hydra.run.dir=/tmp/r_triton
stage profile 120 python3 bench/profile_layer.py --layer c4a --top 30 --eager
stage tune_indexer 150 python3 bench/tune_indexer.py
stage host_overhead 60 python3 bench/host_overhead.py
