"""One process of tests/test_context_parallel.py, started by torchrun (gloo on a CPU, NCCL on GPUs).

Every case builds a tiny FoX, keeps a copy for the single-process reference, switches the model to context
parallelism over all processes and runs one forward and backward of its slice of a batch (`shard_batch`,
`token_count`). Against the reference on the whole batch: the rank's logits, the loss summed over ranks, and the
gradients of every parameter and of the input embeddings summed over ranks. Rank 0 writes the largest differences
(and the error messages of the cases that must fail) to the JSON path given as argument.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
from conftest import tiny_config, tiny_model

from foxlm import FoxForSequenceClassification
from foxlm.compat import enable_activation_checkpointing
from foxlm.context_parallel import shard_batch, token_count

T = 23  # not a multiple of the group size: shard_batch pads


def packed_batch(B, generator, doc_lengths=(9, 5, 9)):
    """B rows of T tokens, each packed from documents of `doc_lengths`, labeled as DataCollatorWithFlattening does
    (-100 at the first token of each document)."""
    input_ids = torch.randint(3, 97, (B, T), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in doc_lengths]).expand(B, T).clone()
    labels = input_ids.masked_fill(position_ids == 0, -100)
    return dict(input_ids=input_ids, labels=labels, position_ids=position_ids)


CASES = {
    # FoX (Pro): GQA 4/2, token shift, QK-norm, output gate, ACP on; packed documents; activation checkpointing.
    "pro_packed_checkpointed": dict(model={}, batch="packed", B=2, checkpointing=True),
    # One kv head for two ranks: replicated.
    "one_kv_head_replicated": dict(model=dict(num_key_value_heads=1), batch="packed", B=2),
    # No packing, no position ids given: the ranks' default positions feed RoPE.
    "rope_unpacked": dict(model=dict(use_rope=True), batch="plain", B=2),
    # Packed documents given as boundaries (cu_seq_lens_q, one row), the FoX (LLaMA) variant without shift or norms.
    "llama_cu_seqlens": dict(model=dict(qk_norm=False, use_output_gate=False, use_output_norm=False,
                                        use_k_shift=False, use_v_shift=False, acp_eps=None), batch="cu", B=1),
    # Heads that two ranks do not divide (`path`: how ContextParallel splits them). 3/3: query heads 2 and 1.
    "uneven_3_heads": dict(model=dict(num_attention_heads=3, num_key_value_heads=3), batch="packed", B=2,
                           path="uneven"),
    # 3/1 on the FoX (LLaMA) variant (ACP's bound measured per head in the kernel), documents as boundaries.
    "uneven_3_over_1_llama_cu_seqlens": dict(model=dict(num_attention_heads=3, num_key_value_heads=1, qk_norm=False,
                                                        use_output_gate=False, use_output_norm=False),
                                             batch="cu", B=1, path="uneven"),
    # 5/1: heads 3 and 2, the one kv head sent to both ranks.
    "uneven_5_over_1": dict(model=dict(num_attention_heads=5, num_key_value_heads=1), batch="packed", B=2,
                            path="uneven"),
    # SmolLM2-135M's 9/3: heads 5 and 4, kv head 1 read on both ranks by 2 and 1 query heads, so each rank copies
    # its kv heads to one per query head.
    "uneven_9_over_3_checkpointed": dict(model=dict(num_attention_heads=9, num_key_value_heads=3), batch="packed",
                                         B=2, checkpointing=True, path="uneven, local kv copy"),
    # FSDP2 (`fully_shard` per decoder layer and at the root) over the same ranks: parameters sharded, gathered for
    # each layer's forward and backward around the attention's all-to-alls, gradients reduce-scattered.
    "fsdp2_sharded_checkpointed": dict(model={}, batch="packed", B=2, checkpointing=True, fsdp2=True),
}


def make_batch(kind, B, generator):
    if kind == "plain":
        input_ids = torch.randint(3, 97, (B, T), generator=generator)
        return dict(input_ids=input_ids, labels=input_ids.clone())
    batch = packed_batch(B, generator)
    if kind == "cu":
        lengths = torch.tensor([9, 5, 9])
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int()
        del batch["position_ids"]
    return batch


def max_diff(a, b):
    return (a - b).abs().max().item()


def head_labels(cp, config, B, T_local):
    """Whether this rank's attention inputs hold the heads it should: q, k, v and log f labeled with their head
    numbers, exchanged, read back per local query head against `local_heads` (what ACP's per-head bound is cut with;
    on a CPU the bound is not used, so the outputs cannot tell). The kv head read is the kernel's GQA one."""
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    label = lambda n: torch.arange(n, dtype=torch.float32)[None, None, :, None].expand(B, T_local, n, 2)  # noqa: E731
    q, k, v, log_f = cp.attention_inputs(label(H), label(H_kv), label(H_kv), label(H)[..., 0])
    heads = cp.local_heads(torch.arange(H, dtype=torch.float32)[None])[0]
    read = k[0, :, torch.arange(len(heads)) // (q.shape[2] // k.shape[2]), 0]  # (T, local query heads)
    right = torch.tensor(int(q.shape[1] == T_local * cp.size and q[0, :, :, 0].eq(heads).all().item()
                             and log_f[0].eq(heads).all().item() and read.eq(heads // (H // H_kv)).all().item()
                             and k.eq(v).all().item()))
    dist.all_reduce(right, op=dist.ReduceOp.MIN, group=cp.group)  # rank 0's heads come first either way
    return bool(right)


def run_case(case, group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    model = tiny_model(**case["model"]).train()
    if case.get("checkpointing"):
        enable_activation_checkpointing(model)
    reference = copy.deepcopy(model)
    batch = make_batch(case["batch"], case["B"], torch.Generator().manual_seed(0))
    embed = model.get_input_embeddings()
    inputs = {k: v for k, v in batch.items() if k != "input_ids"}

    # The single-process reference: transformers' mean over the shifted labels.
    ref_embeds = embed(batch["input_ids"]).detach().requires_grad_()
    ref = reference(inputs_embeds=ref_embeds, use_cache=False, **inputs)
    ref.loss.backward()

    model.enable_context_parallel(group)
    embeds = embed(batch["input_ids"]).detach().requires_grad_()  # before FSDP2 shards the embedding
    if case.get("fsdp2"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    local = shard_batch({"inputs_embeds": embeds, **inputs}, group)
    out = model(**local, num_items_in_batch=token_count(local["shift_labels"], group))
    out.loss.backward()
    # Read before any other forward: FSDP2 keeps the root's parameters unsharded after one, hiding their gradients.
    grads = {"inputs_embeds": (embeds.grad, ref_embeds.grad)}
    grads.update({name: (p.grad, dict(reference.named_parameters())[name].grad)
                  for name, p in model.named_parameters() if p.grad is not None})

    cp = model.model.context_parallel
    path = "even" if cp.even else "uneven, local kv copy" if cp.kv_local_index is not None else "uneven"
    T_local = local["inputs_embeds"].shape[1]
    real = slice(rank * T_local, min((rank + 1) * T_local, T))
    logits_diff = torch.tensor(max_diff(out.logits[:, : real.stop - real.start], ref.logits[:, real]))
    dist.all_reduce(logits_diff, op=dist.ReduceOp.MAX, group=group)  # the first slice would match without exchange
    # The control: the same slice without the exchange (each rank alone) must differ, or the test could not fail.
    with torch.no_grad():
        alone = model.disable_context_parallel()(inputs_embeds=local["inputs_embeds"]).logits
    alone_diff = torch.tensor(max_diff(alone[:, : real.stop - real.start], ref.logits[:, real]))
    dist.all_reduce(alone_diff, op=dist.ReduceOp.MAX, group=group)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    missing = [name for name, p in reference.named_parameters() if (p.grad is None) != (name not in grads)]
    grad_diffs = {}
    for name, (grad, ref_grad) in grads.items():
        if hasattr(grad, "full_tensor"):  # FSDP2's shard of the mean over the ranks: gathered, times the ranks
            grad = grad.full_tensor() * size
        else:
            dist.all_reduce(grad, group=group)
        grad_diffs[name] = max_diff(grad, ref_grad)
    worst = max(grad_diffs, key=grad_diffs.get)
    return {"logits": logits_diff.item(), "logits_without_exchange": alone_diff.item(),
            "loss": abs(loss.item() - ref.loss.item()), "loss_value": ref.loss.item(),
            "grad": grad_diffs[worst], "worst_grad": worst, "parameters": len(grad_diffs) - 1,
            "grad_presence_differs": missing,
            "grad_scale": max(g.abs().max().item() for _, g in grads.values()), "slice_tokens": T_local,
            "size": size, "path": path, "head_labels": head_labels(cp, model.config, case["B"], T_local)}


class Stream(torch.utils.data.IterableDataset):  # a training dataset without a length
    def __iter__(self):
        yield {"input_ids": [5, 6, 7]}


def trainer_case(output_dir):
    """ContextParallelTrainer against the same SGD steps in one process, on the same packed batches in the same order.
    Two processes: one context-parallel group, two examples a batch. Four: two groups of two (data parallelism over
    the groups), one example a batch, the groups' two batches of a step being the one process's two examples."""
    from torch.utils.data import SequentialSampler
    from transformers import DataCollatorWithFlattening, TrainingArguments

    from foxlm.training import ContextParallelTrainer

    groups = dist.get_world_size() // 2

    class InOrder(ContextParallelTrainer):  # batches in order; accelerate gives batch i to group i % groups
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    generator = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(3, 97, (n,), generator=generator).tolist()} for n in (7, 12, 9, 14, 8, 11)]
    collator = DataCollatorWithFlattening()
    steps, lr = 3, 0.5
    model = tiny_model()
    reference = copy.deepcopy(model).train()
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=lr)  # noqa: E731  linear in the gradient: exact comparison
    optimizer = sgd(reference)
    reference_losses = []
    for step in range(steps):
        loss = reference(**collator(examples[2 * step: 2 * step + 2]), use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_losses.append(loss.item())

    optimizer = sgd(model)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2 // groups, max_steps=steps,
                             logging_steps=1,
                             max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no", seed=0)
    trainer = InOrder(model=model, args=args, train_dataset=examples, data_collator=collator,
                      optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
                      context_parallel_size=2)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    reference_params = dict(reference.named_parameters())
    return {"losses": losses, "reference_losses": reference_losses, "batches_per_epoch": len(
        trainer.get_train_dataloader()), "params": max(max_diff(p.detach(), reference_params[name].detach())
                                                       for name, p in model.named_parameters()),
            "eval_error": error_of(lambda _: trainer.get_eval_dataloader(), None, NotImplementedError),
            "iterable_error": error_of(lambda _: ContextParallelTrainer(
                model=tiny_model(), args=args, train_dataset=Stream(), data_collator=collator,
                context_parallel_size=2).get_train_dataloader(), None)}


def error_of(build, group, kind=ValueError):
    try:
        build(group)
    except kind as error:
        return str(error)
    return None


def all_cases(trainer_dir):
    group = dist.group.WORLD
    results = {name: run_case(case, group) for name, case in CASES.items()}
    results["errors"] = {
        "heads": error_of(lambda g: tiny_model(num_attention_heads=1, num_key_value_heads=1).enable_context_parallel(g),
                          group),
        "padding_mask": error_of(lambda g: tiny_model().enable_context_parallel(g)(
            input_ids=torch.ones(1, 4, dtype=torch.long), attention_mask=torch.tensor([[0, 1, 1, 1]])), group),
        "classification": error_of(lambda g: FoxForSequenceClassification(tiny_config()).enable_context_parallel(g),
                                   group),
        "cache": error_of(lambda g: tiny_model().enable_context_parallel(g)(
            input_ids=torch.ones(1, 4, dtype=torch.long), use_cache=True), group),
    }
    results["trainer"] = trainer_case(trainer_dir)
    return results


def main(result_path, trainer_dir):
    dist.init_process_group("gloo")
    # Four processes: two context-parallel groups of two, for the trainer case alone.
    results = {"trainer": trainer_case(trainer_dir)} if dist.get_world_size() == 4 else all_cases(trainer_dir)
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
