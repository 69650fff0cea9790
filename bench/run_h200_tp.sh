#!/usr/bin/env bash
# Tensor parallelism on one host's H200s, one process per GPU over NCCL (torchrun), N = 2, 4 or 8:
#   bash bench/run_h200_tp.sh check N    # whole-layer runs against the oracle at tp_size=N, outputs against tp_size=1
#   bash bench/run_h200_tp.sh bench N    # mode=bench's layer step at tp_size=N beside tp_size=1, DSV4-Flash and
#                                        # DSV4-Pro, flashmla and triton; DSV4-Flash's triton_sparse padded and not
#   bash bench/run_h200_tp.sh onegpu N   # N processes on one GPU over gloo: the process path's outputs (its
#                                        # timings mean nothing: the ranks share the GPU)
# Logs go to $OUT (or ./h200_tp). NVLink multicast stays off (NVLS, symmetric-memory multicast): on the lent
# shared hosts a program using it can take the GPUs out of service for everyone (the device notes, KINDS.md).
set -u
MODE=${1:?check, bench or onegpu}; N=${2:?tp_size}
OUT=${OUT:-h200_tp}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
log() { echo "### $*"; timeout 420 "$@" 2>&1 | grep -v "^W1\|^\s*$"; }
TP=(torchrun --nproc-per-node "$N" run.py tp_size="$N")
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,memory.used --format=csv
case $MODE in
  check|onegpu)
    extra=(); [ "$MODE" = onegpu ] && extra=(parallel.backend=gloo)
    for b in triton flashmla; do
      log python run.py deployment=h200 backend=$b dump_dir=/tmp/d_${b}_1 hydra.run.dir=/tmp/r_${b}_1
      log "${TP[@]}" deployment=h200 backend=$b "${extra[@]}" dump_dir=/tmp/d_${b}_$N hydra.run.dir=/tmp/r_${b}_$N
      log python bench/compare_dumps.py /tmp/d_${b}_$N /tmp/d_${b}_1
      cp /tmp/r_${b}_$N/result.json "$OUT/result_${b}_tp$N.json"
    done ;;
  bench)
    nvidia-smi topo -m | head -$((N + 1))
    for m in dsv4_flash dsv4_pro; do
      for b in flashmla triton; do log "${TP[@]}" mode=bench deployment=h200 model=$m backend=$b; done
    done
    # the head-padding ablation: the same kernel with the padding FlashMLA needs, and without
    log "${TP[@]}" mode=bench deployment=h200 model=dsv4_flash backend=triton head_padding=buckets_64_128 ;;
  *) echo "unknown mode $MODE: check, bench or onegpu" >&2; exit 2 ;;
esac
