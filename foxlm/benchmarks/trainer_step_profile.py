"""How busy is the GPU during a `Trainer` step of examples/train_accelerate.py? (one GPU, no FSDP)

Trains the example's model for `--steps` steps, times three unprofiled steps, then records four more with
torch.profiler (CUDA activity only, so the host's own speed is barely touched) and reports the GPU's busy time
(the union of kernel intervals) per step against the unprofiled step time, the kernel launches per step and the
kernels that take the most GPU time. A busy fraction well below 1 means the step waits on the host's launches.
Result: trainer_step_profile_<size>_b<batch>_<device>_<time>.json in --out.

    python benchmarks/trainer_step_profile.py --size 760m --context 4096 --batch-size 4
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from .run_record import RESULTS_DIR, new_record, record_path, write_record

# foxlm.pretrain's sizes (checked below), written here for --help, which answers without importing torch.
SIZES = ("tiny", "125m", "760m")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="760m")
    parser.add_argument("--variant", choices=("pro", "llama"), default="pro")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the result (default: %(default)s)")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help and wrong options answer before torch loads; main() parses the options again
    parse_args()

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from foxlm import pretrain  # noqa: E402  (the model, data and training arguments of examples/train_accelerate.py)

assert SIZES == tuple(pretrain.SIZES), "SIZES must name foxlm.pretrain's sizes"

UNPROFILED = (2, 5)  # steps timed without the profiler: 3, 4 and 5
PROFILED = (5, 9)  # steps recorded: 6 to 9


class StepProfiler(TrainerCallback):
    def __init__(self):
        self.marks, self.profiler = {}, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == PROFILED[0]:
            torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in UNPROFILED:
            torch.cuda.synchronize()
            self.marks[state.global_step] = time.perf_counter()
        if state.global_step == PROFILED[1]:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)


def busy_seconds(trace_events):
    """Union of the GPU kernel intervals of a chrome trace, in seconds."""
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace_events if e.get("cat") == "kernel")
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6, len(intervals)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this profile needs a CUDA GPU")
    steps = PROFILED[1] + 1
    example_args = pretrain.parse_args(
        ["--size", args.size, "--variant", args.variant, "--context", str(args.context),
         "--batch-size", str(args.batch_size), "--steps", str(steps), "--output-dir", tempfile.mkdtemp()])
    training_args = pretrain.training_arguments(example_args, on_gpu=True)
    blocks = pretrain.stdlib_blocks(args.context, (steps + 1) * args.batch_size * args.context)
    torch.manual_seed(example_args.seed)
    profiler = StepProfiler()
    Trainer(model=pretrain.build_model(example_args), args=training_args,
            train_dataset=pretrain.Blocks(blocks), callbacks=[profiler]).train()

    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.profiler.export_chrome_trace(str(trace))
        busy, kernels = busy_seconds(json.loads(trace.read_text())["traceEvents"])
    profiled_steps = PROFILED[1] - PROFILED[0]
    step_s = (profiler.marks[UNPROFILED[1]] - profiler.marks[UNPROFILED[0]]) / (UNPROFILED[1] - UNPROFILED[0])
    top = sorted(profiler.profiler.key_averages(), key=lambda event: -event.self_device_time_total)[:15]
    result = new_record(
        size=args.size, variant=args.variant, context=args.context, batch_size=args.batch_size,
        step_s=step_s, tokens_per_s=args.batch_size * args.context / step_s,
        gpu_busy_per_step_s=busy / profiled_steps, busy_fraction=busy / profiled_steps / step_s,
        kernels_per_step=kernels / profiled_steps,
        top_kernels_ms_per_step={event.key: event.self_device_time_total / 1e3 / profiled_steps for event in top},
    )
    path = record_path(args.out, f"trainer_step_profile_{args.size}_b{args.batch_size}", result)
    write_record(path, result)
    print(f"{args.size} {args.variant}, {args.batch_size} x {args.context} tokens: step {step_s * 1e3:.0f} ms, "
          f"GPU busy {result['busy_fraction']:.0%}, {result['kernels_per_step']:.0f} kernels per step; wrote {path}")


if __name__ == "__main__":
    main()
