#!/usr/bin/env bash
# Context parallelism of FoX training on the GPUs of one host (2 by default, NGPUS overrides): numerics of
# --numerics-steps steps against one GPU, and the longest context that trains on one GPU and on all of them, with
# tokens/s per GPU (benchmarks/context_parallel_training.py says what each part does). Options go to that script.
# Result: context_parallel_<device>_<time>.json in $OUT if set, else benchmarks/results.
#
#   OUT=DIR bash benchmarks/run_context_parallel.sh                 # 760M FoX (Pro), ACP on
#   OUT=DIR bash benchmarks/run_context_parallel.sh --acp off
#   NGPUS=4 OUT=DIR bash benchmarks/run_context_parallel.sh --fsdp2 --no-one-gpu-sweep  # FSDP2 over the same GPUs
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast here
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Each context is a new kernel shape: the first launch configuration of each list, not an autotuning per shape.
export FOXLM_AUTOTUNE=${FOXLM_AUTOTUNE:-0}
python -m torch.distributed.run --standalone --nproc_per_node "${NGPUS:-2}" benchmarks/context_parallel_training.py "$@"
