#!/usr/bin/env bash
# What produced docs/benchmarks.md's two-GPU (#10) and Triton (#5) sections, on the lent 2 x H200 machine:
#   bash bench/run_h200_x2.sh check   # GPU tests, whole-layer runs vs the oracle, tp_size=2 vs tp_size=1 outputs
#   bash bench/run_h200_x2.sh bench   # mode=bench at tp_size=2 (flashmla, triton) and on one GPU
# Logs go to $OUT (or ./h200_x2). NVLink multicast stays off (NVLS, symmetric-memory multicast): on the lent
# shared hosts a program using it can take the GPUs out of service for everyone (the device notes, KINDS.md).
set -u
OUT=${OUT:-h200_x2}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
log() { echo "### $*"; timeout 420 "$@" 2>&1 | grep -v "^W1\|^\s*$"; }
if [ "${1:-}" = check ]; then
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw --format=csv
  nvidia-smi topo -m | head -4
  log python -m pytest -q -m gpu tests/test_triton_sparse.py tests/test_gpu_nvidia.py
  for b in triton flashmla; do
    log python run.py deployment=h200 backend=$b dump_dir=/tmp/d_${b}_1 hydra.run.dir=/tmp/r_${b}_1
    log torchrun --nproc-per-node 2 run.py deployment=h200 tp_size=2 backend=$b dump_dir=/tmp/d_${b}_2 \
      hydra.run.dir=/tmp/r_${b}_2
    log python bench/compare_dumps.py /tmp/d_${b}_2 /tmp/d_${b}_1
    cp /tmp/r_${b}_2/result.json "$OUT/result_${b}_tp2.json"
  done
else
  for b in flashmla triton; do
    log torchrun --nproc-per-node 2 run.py mode=bench deployment=h200 tp_size=2 backend=$b
  done
  log python run.py mode=bench deployment=h200
fi
