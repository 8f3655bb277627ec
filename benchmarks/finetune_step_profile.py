"""Where a `foxlm finetune` step goes: `foxlm finetune` with the given options, steps timed without the profiler,
then a few recorded by torch.profiler with the teacher's forward, the student's forward and the loss head (chunked
logits, CE and KL) labelled; the rest of a step is the backward, the optimizer and whatever Trainer does between.

    python benchmarks/finetune_step_profile.py -- --model SmolLM2.gguf --teacher-samples 0 --transfer-steps 10 \\
        --steps 12 --skip-eval --output-dir /tmp/profile-run

Needs --steps of at least 4 + 2 x --profile-steps. Writes finetune_step_profile_<device>_<date>.json in --out:
the unprofiled step time, per profiled step each label's host (CPU) time, its kernels' summed device time and on a
GPU its span on the GPU's timeline, the fraction of the step the GPU is busy (the union of its kernels), and the
operations that take the most time.
"""

import argparse
import contextlib
import gzip
import json
import tempfile
import time
from pathlib import Path

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record
from foxlm.outputs import write_file_atomic

LABELS = ("teacher forward", "student forward", "loss head")


def labelled(function, label):
    import torch

    def run(*args, **kwargs):
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile-steps", type=int, default=3, help="steps recorded (default: %(default)s)")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the result (default: %(default)s)")
    parser.add_argument("--keep-trace", action="store_true",
                        help="also write the profiled steps' Chrome trace (gzipped JSON, for chrome://tracing or "
                             "Perfetto) beside the result")
    parser.add_argument("finetune_args", nargs=argparse.REMAINDER, help="after --: options of foxlm finetune")
    args = parser.parse_args(argv)
    args.finetune_args = [a for a in args.finetune_args if a != "--"]
    import torch
    from transformers import TrainerCallback

    from foxlm import distillation, finetune
    from foxlm.benchmarks.trainer_step_profile import busy_seconds

    on_gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    first_timed, first_profiled = 2, 2 + args.profile_steps
    last_profiled = first_profiled + args.profile_steps
    marks, recording = {}, {}

    class StepProfile(TrainerCallback):
        def on_step_end(self, callback_args, state, control, **kwargs):
            sync()
            marks[state.global_step] = time.perf_counter()
            if state.global_step == first_profiled:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if on_gpu:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                recording["profiler"] = torch.profiler.profile(activities=activities)
                recording["profiler"].__enter__()
            elif state.global_step == last_profiled:
                recording["profiler"].__exit__(None, None, None)

    class ProfiledTrainer(distillation.DistillationTrainer):
        def __init__(self, *trainer_args, callbacks, **kwargs):
            super().__init__(*trainer_args, callbacks=[*callbacks, StepProfile()], **kwargs)
            student = distillation.language_model_parts(self.accelerator.unwrap_model(self.model))[0]
            student.forward = labelled(student.forward, "student forward")
            if self.teacher is not None:
                teacher = distillation.language_model_parts(self.teacher)[0]
                teacher.forward = labelled(teacher.forward, "teacher forward")

    with contextlib.ExitStack() as patches:
        for name, value in (("DistillationTrainer", ProfiledTrainer), ("chunked_distillation_loss",
                            labelled(distillation.chunked_distillation_loss, "loss head"))):
            patches.callback(setattr, distillation, name, getattr(distillation, name))
            setattr(distillation, name, value)
        finetune.main(args.finetune_args, prog="finetune (profiled)")
    if "profiler" not in recording or last_profiled not in marks:
        if "profiler" in recording:
            recording["profiler"].__exit__(None, None, None)
        raise SystemExit(f"error: the run ended before step {last_profiled}; give --steps of at least {last_profiled}")

    profiler, steps = recording["profiler"], args.profile_steps
    events = profiler.key_averages()
    step_s = (marks[first_profiled] - marks[first_timed]) / (first_profiled - first_timed)
    # A label gives two events on a GPU: the host's range (its time, and its kernels' summed device time) and the
    # range on the GPU's timeline, first kernel to last, gaps included.
    per_step = {label: {} for label in LABELS}
    for event in events:
        if event.key not in LABELS:
            continue
        if event.device_type == torch.autograd.DeviceType.CPU:
            per_step[event.key].update(host_ms=event.cpu_time_total / 1e3 / steps,
                                       kernel_ms=event.device_time_total / 1e3 / steps)
        else:
            per_step[event.key]["gpu_span_ms"] = event.device_time_total / 1e3 / steps
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    top = sorted((e for e in events if e.key not in LABELS), key=lambda e: -getattr(e, key))[:15]
    result = new_record(finetune_args=args.finetune_args, step_s=step_s, profiled_steps=steps, per_step=per_step, **{
        f"top_{'device' if on_gpu else 'cpu'}_ms_per_step": {e.key: getattr(e, key) / 1e3 / steps for e in top}})
    path = Path(record_path(args.out, "finetune_step_profile", result))
    if on_gpu or args.keep_trace:
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            profiler.export_chrome_trace(str(trace))
            text = trace.read_text()
        if on_gpu:
            busy, kernels = busy_seconds(json.loads(text)["traceEvents"])
            result.update(gpu_busy_fraction=busy / steps / step_s, kernels_per_step=kernels / steps)
        if args.keep_trace:
            write_file_atomic(path.with_suffix(".trace.json.gz"), gzip.compress(text.encode()))
    write_record(path, result)
    print(f"step {step_s:.3f} s; per step: " + ", ".join(
        f"{label} {v.get('host_ms', 0):.0f} ms host / {v.get('kernel_ms', 0):.0f} ms of kernels" for label, v in
        per_step.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
