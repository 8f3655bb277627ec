"""Context parallelism of FoX training (docs/context-parallel.md) on the GPUs of one host: numerics and the longest
context. Run by benchmarks/run_context_parallel.sh (torchrun, NCCL; gloo on CPUs for a smoke test):

1. Numerics: the same model, data and AdamW steps (`--numerics-steps`, bf16 autocast, fp32 weights, activation
   checkpointing) on one GPU with whole sequences and on all GPUs with context parallelism: both loss curves and
   their largest and mean differences. The first step's losses differ only by bf16 rounding order; a curve within
   that noise afterwards is the goal.
2. The longest context: context doubled from `--start-context` until a training step runs out of memory, on one
   GPU and with context parallelism over all (one sequence per step, 3 steps, the last `--sweep-steps - 1` timed):
   tokens/s per GPU and peak memory at each context.

With `--fsdp2` the context-parallel side also shards weights, gradients and AdamW state over the same processes
(FSDP2's `fully_shard` per decoder layer and at the root), the composition docs/context-parallel.md describes.

Data: the Python standard library's sources as bytes (token ids < 256 of the 32000-token vocabulary), one file per
document, packed into one row with `position_ids` restarting at each file, labels -100 at each file's first token.
The sweeps train on one long document (no packing). Model: FoX (Pro), `--size` as in bench_training (760m: 24 x
1536, head dim 64, vocabulary 32000), ACP as `--acp` says. Results:
context_parallel_<device>_<time>.json in `--out` (default: $OUT, else benchmarks/results), rewritten after every
trial; a run past `--budget-minutes` stops its sweeps and says so. An out-of-memory step must fail on every rank at
once (they hold equal slices); if it does not, the NCCL timeout (`--nccl-timeout`) ends the run and the file holds
the trials before it.

    OUT=DIR bash benchmarks/run_context_parallel.sh [options]
"""

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the foxlm next to this script


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="760m", help="760m, 125m (tiny: CPU smoke test) (default: %(default)s)")
    parser.add_argument("--acp", choices=("on", "off"), default="on",
                        help="Adaptive Computation Pruning (default: on, FoX (Pro)'s default)")
    parser.add_argument("--numerics-context", type=int, default=16384, help="default: %(default)s")
    parser.add_argument("--numerics-steps", type=int, default=50, help="default: %(default)s (0 skips)")
    parser.add_argument("--lr", type=float, default=3e-4,
                        help="AdamW peak rate, 10 warmup steps (default: %(default)s)")
    parser.add_argument("--start-context", type=int, default=32768, help="default: %(default)s")
    parser.add_argument("--max-context", type=int, default=2**21, help="default: %(default)s")
    parser.add_argument("--sweep-steps", type=int, default=3, help="steps per trial, the first untimed (default: 3)")
    parser.add_argument("--budget-minutes", type=float, default=6.0,
                        help="no new trial after this many minutes; the one-GPU sweep may take half of what the "
                             "numerics leave (default: %(default)s)")
    parser.add_argument("--fsdp2", action="store_true",
                        help="shard weights, gradients and optimizer state over the group with FSDP2 (fully_shard "
                             "per decoder layer and at the root) on the context-parallel side")
    parser.add_argument("--one-gpu-sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="the longest context on one GPU too (default: on)")
    parser.add_argument("--nccl-timeout", type=int, default=300, help="seconds (default: %(default)s)")
    parser.add_argument("--out", default=None,
                        help="folder of the JSON result (default: $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    if args.sweep_steps < 2:
        parser.error(f"--sweep-steps must be at least 2 (one untimed), got {args.sweep_steps}")
    return args


if __name__ == "__main__":  # --help answers before torch loads
    ARGS = parse_args()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from foxlm.benchmarks.bench_training import SIZES, build_model, enable_checkpointing, synchronize  # noqa: E402
from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record  # noqa: E402
from foxlm.context_parallel import shard_batch, token_count  # noqa: E402
from foxlm.data import stdlib_source_files  # noqa: E402


class ByteStream:
    """The standard library's sources as one stream of byte tokens, with each file's first position marked."""

    def __init__(self, min_tokens):
        tokens, starts, total = [], [], 0
        for path in stdlib_source_files(min_bytes=2048):
            data = Path(path).read_bytes()
            tokens.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            starts.append(total)
            total += len(data)
            if total >= min_tokens:
                break
        if total < min_tokens:
            raise RuntimeError(f"the standard library's sources give {total} tokens, fewer than {min_tokens}")
        self.tokens = torch.cat(tokens).long()
        self.doc_start = torch.zeros(total, dtype=torch.bool)
        self.doc_start[torch.tensor(starts)] = True

    def batch(self, context, index, device, packed=True):
        """Row `index` of `context` tokens (wrapping around the stream): input_ids and labels, with `packed` the
        files as documents (position_ids restarting, labels -100 at each file's start), else one document."""
        start = (index * context) % (len(self.tokens) - context)
        ids = self.tokens[start: start + context]
        if not packed:
            return dict(input_ids=ids[None].to(device), labels=ids[None].to(device))
        doc_start = self.doc_start[start: start + context].clone()
        doc_start[0] = True
        # position = distance to the last document start at or before each token
        arange = torch.arange(context)
        last_start = torch.cummax(torch.where(doc_start, arange, 0), 0).values
        position_ids = arange - last_start
        labels = ids.masked_fill(doc_start, -100)
        batch = dict(input_ids=ids[None], position_ids=position_ids[None], labels=labels[None])
        return {k: v.to(device) for k, v in batch.items()}


def build(args, device, group=None):
    """The model, with context parallelism over `group` when given (and FSDP2 over it with `--fsdp2`)."""
    torch.manual_seed(0)
    with device:
        model = build_model("fox-pro", args.size, args.numerics_context, acp=args.acp == "on").train()
    enable_checkpointing(model)
    if group is not None:
        model.enable_context_parallel(group)
        if args.fsdp2:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(group, device.type)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
    return model


def sharded(model):
    """Whether FSDP2 shards the model (its parameters are DTensors)."""
    return hasattr(next(model.parameters()), "full_tensor")


def train_step(model, optimizer, batch, group):
    """One AdamW step as Trainer(bf16=True) takes it. With a group: the rank's slice, the loss divided by the
    group's token count, the gradients summed over the group (each rank's is its slice's part): by all-reduce, or
    under FSDP2, whose reduce-scatter averages, by scaling the loss with the group's size."""
    fsdp2 = group is not None and sharded(model)
    if group is not None:
        batch = shard_batch(batch, group)
        batch["num_items_in_batch"] = token_count(batch["shift_labels"], group)
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16):
        loss = model(**batch, use_cache=False).loss
    (loss * dist.get_world_size(group) if fsdp2 else loss).backward()
    if group is not None:
        if not fsdp2:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def optimizer_for(model, args):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=next(model.parameters()).is_cuda and not sharded(model))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))


def numerics(args, stream, device, group):
    """Loss curves of `--numerics-steps` steps: one process on whole sequences, then the group."""
    curves = {}
    for name, steps_group in (("one_gpu", None), ("context_parallel", group)):
        if steps_group is None and dist.get_rank() != 0:
            curves[name] = None
            continue
        model = build(args, device, steps_group)
        optimizer, scheduler = optimizer_for(model, args)
        losses = []
        for step in range(args.numerics_steps):
            losses.append(train_step(model, optimizer, stream.batch(args.numerics_context, step, device), steps_group))
            scheduler.step()
        curves[name] = losses
        del model, optimizer, scheduler
        release(device)
    return curves


def release(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def trial(args, model, optimizer, stream, context, device, group):
    """tokens/s per GPU and peak memory of `--sweep-steps` steps at `context`, or `oom`."""
    size = 1 if group is None else dist.get_world_size(group)
    row = dict(context=context, gpus=size)
    try:
        for step in range(args.sweep_steps):
            if step == 1:
                synchronize(device)
                start = time.perf_counter()
            train_step(model, optimizer, stream.batch(context, step, device, packed=False), group)
        synchronize(device)
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        row["oom"] = True
        return row
    elapsed = time.perf_counter() - start
    row["step_s"] = elapsed / (args.sweep_steps - 1)
    row["tokens_per_s_per_gpu"] = context / row["step_s"] / size
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def sweep(args, stream, device, group, deadline, write):
    """The context doubled until a step runs out of memory or time runs out; the rows (rank 0's)."""
    model = build(args, device, group)
    optimizer, _ = optimizer_for(model, args)
    rows, context = [], args.start_context
    while context <= args.max_context:
        if time.monotonic() > deadline:
            rows.append(dict(context=context, stopped_by_budget=True))
            break
        release(device)
        rows.append(trial(args, model, optimizer, stream, context, device, group))
        write(rows)
        if rows[-1].get("oom"):
            break
        context *= 2
    del model, optimizer
    release(device)
    return rows


def longest(rows):
    fits = [row["context"] for row in rows if "tokens_per_s_per_gpu" in row]
    return max(fits, default=None)


def summarize(record):
    one, cp = record.get("one_gpu", []), record.get("context_parallel", [])
    summary = dict(longest_context_one_gpu=longest(one), longest_context_parallel=longest(cp))
    if summary["longest_context_one_gpu"] and summary["longest_context_parallel"]:
        summary["context_ratio"] = summary["longest_context_parallel"] / summary["longest_context_one_gpu"]
    by_context = {row["context"]: row for row in one if "tokens_per_s_per_gpu" in row}
    size = record["world_size"]
    # tokens/s per GPU of the group at `size` times a context, over one GPU at that context
    summary["per_gpu_speed_at_longer_context"] = {
        f"{row['context']} vs {row['context'] // size}": row["tokens_per_s_per_gpu"]
        / by_context[row["context"] // size]["tokens_per_s_per_gpu"]
        for row in cp if "tokens_per_s_per_gpu" in row and row["context"] // size in by_context}
    curves = record.get("numerics")
    if curves and curves.get("one_gpu"):
        diffs = [abs(a - b) for a, b in zip(curves["one_gpu"], curves["context_parallel"])]
        summary["numerics"] = dict(first_step_diff=diffs[0], max_diff=max(diffs), mean_diff=sum(diffs) / len(diffs),
                                   final_loss_one_gpu=curves["one_gpu"][-1],
                                   final_loss_context_parallel=curves["context_parallel"][-1])
    return summary


def main(args):
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.nccl_timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    # The idle ranks wait here while rank 0 trains alone: on the CPU, without the NCCL timeout.
    waits = dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=1))
    deadline = time.monotonic() + 60 * args.budget_minutes  # the sweeps share what the numerics leave
    stream = ByteStream(max(args.max_context, args.numerics_context) + 1)
    out = args.out or os.environ.get("OUT") or RESULTS_DIR
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model("fox-pro", args.size, args.numerics_context).parameters())
    record = new_record(kind="context_parallel", world_size=size, size=args.size, model="fox-pro", acp=args.acp,
                        parameters=parameters, shape=SIZES[args.size], fsdp2=args.fsdp2,
                        precision="bf16 autocast, fp32 weights, activation checkpointing, AdamW",
                        data="stdlib sources as bytes: packed documents for the numerics, one stream for the sweeps")
    path = record_path(out, "context_parallel", record)

    def write(**fields):
        record.update(fields)
        if rank == 0:
            record["summary"] = summarize(record)
            os.makedirs(out, exist_ok=True)
            write_record(path, record)

    if args.numerics_steps:
        curves = numerics(args, stream, device, group)
        dist.barrier(group=waits)
        write(numerics=curves)
    halfway = time.monotonic() + (deadline - time.monotonic()) / 2
    if rank == 0 and args.one_gpu_sweep:
        write(one_gpu=sweep(args, stream, device, None, halfway, lambda rows: write(one_gpu=rows)))
    dist.barrier(group=waits)
    write(context_parallel=sweep(args, stream, device, group, deadline, lambda rows: write(context_parallel=rows)))
    if rank == 0:
        print(f"wrote {path}\n{record['summary']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
