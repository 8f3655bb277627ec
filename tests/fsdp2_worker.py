"""One process of tests/test_accelerate.py's FSDP2 check, started by torchrun (gloo on a CPU, NCCL on GPUs).

Shards a tiny FoX (Pro) with FSDP2 the way accelerate's transformer-based auto-wrap does (one `fully_shard` per
module of a class named in `_no_split_modules`, then the root), trains a few SGD steps with the global batch split
over the processes, gathers the full state dict, saves it in safetensors shards and reloads it. Rank 0 compares
against the same steps trained in one process and writes what it measured to the JSON path given as argument.
"""

import copy
import gc
import json
import sys

import torch
import torch.distributed as dist
from conftest import tiny_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

STEPS, LR = 3, 0.5


def train(model, batch):
    # SGD: the update is linear in the gradient, so sharded and single-process training agree to float error.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def main(result_path, model_dir):
    device = torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model().train().to(device)
    reference = copy.deepcopy(model)
    batch = torch.randint(3, 97, (2 * world, 24), generator=torch.Generator().manual_seed(0)).to(device)

    wrap_classes = {type(m) for m in model.modules() if type(m).__name__ in model._no_split_modules}
    wrapped = [m for m in model.modules() if type(m) in wrap_classes]
    for module in wrapped:
        fully_shard(module)
    fully_shard(model)
    layer_params = [p for layer in wrapped for p in layer.parameters()]
    sharded = all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in layer_params if p.numel() > 1)

    train(model, batch[2 * rank : 2 * rank + 2])
    model.eval()
    with torch.no_grad():
        sharded_logits = model(input_ids=batch, use_cache=False).logits
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(model_dir, state_dict=state_dict, max_shard_size="100KB")
    dist.barrier()
    if rank == 0:
        train(reference, batch)
        reloaded = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
        with torch.no_grad():
            reloaded_logits = reloaded(input_ids=batch, use_cache=False).logits
            reference_logits = reference.eval()(input_ids=batch, use_cache=False).logits
        result = dict(
            world_size=world,
            wrap_classes=sorted(c.__name__ for c in wrap_classes),
            wrapped_modules=len(wrapped),
            layers_sharded=sharded,
            reload_max_abs_diff=(reloaded_logits - sharded_logits).abs().max().item(),
            single_process_max_abs_diff=(reference_logits - sharded_logits).abs().max().item(),
        )
        with open(result_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        main(*sys.argv[1:])
        dist.barrier()  # no process tears its group down while the other still trains or reloads
    finally:
        # The sharded model's device mesh holds the process group: collected here, the group and its worker threads
        # go while the interpreter is whole, not during its shutdown (where gloo can abort the process).
        gc.collect()
        dist.destroy_process_group()
