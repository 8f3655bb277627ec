#!/usr/bin/env bash
# FSDP scaling of FoX training: the 760M-like FoX (Pro) trained with examples/train_accelerate.py under
# examples/accelerate/fsdp.yaml (FSDP2, bf16) on 1 GPU and on 2 GPUs, same per-GPU batch, plus one GPU without FSDP
# (plain `python`, the baseline a single-GPU user has); prints tokens/s of each and the 2-GPU / 1-GPU ratios. Each
# run also saves the model (safetensors shards) and checks that it reloads with the trained model's logits.
# Result: fsdp_scaling_<size>_b<batch>_<device>_<time>.json (every run's metrics and the ratios) in $OUT if set,
# else benchmarks/results. About 2.5 minutes on two H200s. 8 sequences of 4096 tokens per GPU keep the GPU busy; at 4
# the step partly waits on the host's launches (benchmarks/trainer_step_profile.py), and the ratio moves with it.
#
#   bash benchmarks/run_fsdp_scaling.sh                      # SIZE, CONTEXT, BATCH, STEPS override the defaults
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast here
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SIZE=${SIZE:-760m} CONTEXT=${CONTEXT:-4096} BATCH=${BATCH:-8} STEPS=${STEPS:-30}
RESULTS=${OUT:-benchmarks/results}
WORK=$(mktemp -d)  # the saved models (GBs) stay out of $OUT
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULTS"
TRAIN=(examples/train_accelerate.py --size "$SIZE" --context "$CONTEXT" --batch-size "$BATCH" --steps "$STEPS"
       --timing-warmup 5 --max-shard-size 1GB)

FIRST_GPU=${CUDA_VISIBLE_DEVICES-0}  # the first visible GPU (none if CUDA_VISIBLE_DEVICES is empty)
CUDA_VISIBLE_DEVICES=${FIRST_GPU%%,*} python "${TRAIN[@]}" --output-dir "$WORK/plain"
for GPUS in 1 2; do
  python -m accelerate.commands.launch --config_file examples/accelerate/fsdp.yaml --num_processes "$GPUS" \
    "${TRAIN[@]}" --output-dir "$WORK/fsdp${GPUS}"
done

python - "$WORK" "$RESULTS" <<'PY'
import datetime, json, sys
work, results = sys.argv[1:]
runs = {name: json.load(open(f"{work}/{name}/train_metrics.json")) for name in ("plain", "fsdp1", "fsdp2")}
for run in runs.values():
    run.pop("saved_files")
plain, one, two = (runs[name]["tokens_per_s"] for name in ("plain", "fsdp1", "fsdp2"))
first = runs["fsdp1"]
summary = dict(size=first["size"], variant=first["variant"], context=first["context"],
               per_device_batch=first["per_device_batch"], device=first["device"],
               tokens_per_s_1gpu_no_fsdp=plain, tokens_per_s_1gpu=one, tokens_per_s_2gpu=two,
               scaling=two / one, scaling_over_no_fsdp=two / plain, target=1.8, met=two / one >= 1.8, runs=runs)
stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
device = first["device"].replace(" ", "_")
path = f"{results}/fsdp_scaling_{first['size']}_b{first['per_device_batch']}_{device}_{stamp}.json"
json.dump(summary, open(path, "w"), indent=1)
print(f"FSDP {first['size']}, {first['per_device_batch']} sequences per GPU: 1 GPU without FSDP {plain:.0f} tokens/s, "
      f"FSDP 1 GPU {one:.0f}, FSDP 2 GPUs {two:.0f}: scaling {two / one:.2f}x over FSDP on one GPU "
      f"({two / plain:.2f}x over no FSDP; target 1.8x); wrote {path}")
PY
