#!/usr/bin/env bash
# FSDP scaling of FoX training: the 760M-like FoX (Pro) trained with examples/train_accelerate.py under
# examples/accelerate/fsdp.yaml (FSDP2, bf16) on 1 GPU and on 2 GPUs, same per-GPU batch; prints tokens/s of both
# and their ratio. Each run also saves the model (sharded safetensors) and checks that it reloads with the trained
# model's logits. Results: fsdp_<size>_<n>gpu.json per run and fsdp_scaling_<device>_<date>.json with the ratio,
# in $OUT if set, else benchmarks/results. About 4 minutes on two H200s.
#
#   bash benchmarks/run_fsdp_scaling.sh                      # SIZE, CONTEXT, BATCH, STEPS override the defaults
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # no NVLink multicast on the lent machines
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SIZE=${SIZE:-760m} CONTEXT=${CONTEXT:-4096} BATCH=${BATCH:-4} STEPS=${STEPS:-30}
RESULTS=${OUT:-benchmarks/results}
WORK=$(mktemp -d)  # the saved models (GBs) stay out of $OUT
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULTS"

for GPUS in 1 2; do
  python -m accelerate.commands.launch --config_file examples/accelerate/fsdp.yaml --num_processes "$GPUS" \
    examples/train_accelerate.py --size "$SIZE" --context "$CONTEXT" --batch-size "$BATCH" --steps "$STEPS" \
    --timing-warmup 5 --max-shard-size 1GB --output-dir "$WORK/${GPUS}gpu"
  cp "$WORK/${GPUS}gpu/train_metrics.json" "$RESULTS/fsdp_${SIZE}_${GPUS}gpu.json"
done

python - "$RESULTS" "$SIZE" <<'PY'
import datetime, json, sys
results, size = sys.argv[1:]
one, two = (json.load(open(f"{results}/fsdp_{size}_{n}gpu.json")) for n in (1, 2))
ratio = two["tokens_per_s"] / one["tokens_per_s"]
date = datetime.date.today().isoformat()
summary = dict(size=size, context=one["context"], per_device_batch=one["per_device_batch"], device=one["device"],
               tokens_per_s_1gpu=one["tokens_per_s"], tokens_per_s_2gpu=two["tokens_per_s"], scaling=ratio,
               target=1.8, met=ratio >= 1.8, peak_memory_gb_1gpu=one["peak_memory_gb"],
               peak_memory_gb_2gpu=two["peak_memory_gb"], reload=[one["reload"], two["reload"]])
path = f"{results}/fsdp_scaling_{one['device'].replace(' ', '_')}_{date}.json"
json.dump(summary, open(path, "w"), indent=1)
print(f"FSDP {size}: 1 GPU {one['tokens_per_s']:.0f} tokens/s, 2 GPUs {two['tokens_per_s']:.0f} tokens/s, "
      f"scaling {ratio:.2f}x (target 1.8x); wrote {path}")
PY
