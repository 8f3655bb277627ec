"""One process of tests/test_finetune_context_parallel.py, started by torchrun (gloo, two CPU processes).

It checks `teacher_on_slice` on packed documents against the teacher on the whole sequence, and runs `foxlm
finetune` for the case RECORDED of CASES with context parallelism over both processes, recording each micro-batch's
next-token and KL terms of every rank (`record_terms`). Rank 0 writes the results to the JSON path given as
argument; the test runs the same case in one process and compares. (The other case the test launches directly:
`torchrun -m foxlm.cli finetune`.) With `--killed-after STEP ARGUMENTS` it runs `foxlm finetune ARGUMENTS` and stops
every rank as a kill would, right after checkpoint STEP is saved.
"""

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import finetune_args, kill_after_checkpoint

from foxlm import distillation
from foxlm.cli import main as foxlm

# The tiny LLaMA's context is 128 and so is the training context: each of two ranks holds 64 tokens of a block.
CASES = {
    # KL below position 48: on rank 0's slice only. LoRA, activation checkpointing; evaluation on rank 0.
    "teacher_inside_first_slice": ["--teacher-context", "48", "--gradient-checkpointing", "--eval-length", "256",
                                   "--eval-docs", "2", "--no-needle", "--skip-original"],
    # KL below position 100: rank 1's first 36 positions too, whose prefix is on rank 0. Full fine-tuning.
    "teacher_across_slices": ["--teacher-context", "100", "--full", "--skip-eval"],
}
RECORDED = "teacher_inside_first_slice"
# Two optimizer steps of two blocks each.
# RoPE dropped whole: the converted model is then far from the original and the KL term weighs (partial RoPE starts
# so close to the original that its KL is near 0).
COMMON = ["--steps", "2", "--drop-rope", "--transfer-steps", "2", "--teacher-samples", "512"]


def case_args(root, name):
    return finetune_args(Path(root), name, *COMMON, *CASES[name])


@contextlib.contextmanager
def record_terms(terms):
    """Appends (ce, kl) of each micro-batch of each process (rows: ranks) to `terms` while `foxlm finetune` runs:
    the shares that DistillationTrainer divided by the whole batch's token count, unrounded."""
    original = distillation.DistillationTrainer.compute_loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = original(self, model, inputs, *args, **kwargs)
        mine = torch.stack([self._terms["ce"][-1], self._terms["kl"][-1]]).double()
        if dist.is_initialized():
            parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, mine)
            mine = torch.stack(parts)
        terms.append(mine.reshape(-1, 2).tolist())
        return loss

    distillation.DistillationTrainer.compute_loss = compute_loss
    try:
        yield terms
    finally:
        distillation.DistillationTrainer.compute_loss = original


def packed_teacher_case():
    """`teacher_on_slice` on one packed row of documents of 5, 15 and 4 tokens (the second crosses the slice
    boundary at 12) with KL below position 10: each rank's teacher states at its KL positions against the teacher
    on the whole row, and, as a control, against the teacher on the rank's slice alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foxlm.context_parallel import ContextParallel, shard_batch

    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=64)).eval()
    lengths = (5, 15, 4)
    input_ids = torch.randint(3, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = input_ids.masked_fill(position_ids == 0, -100)  # as DataCollatorWithFlattening labels them
    group = dist.group.WORLD
    local = shard_batch(dict(input_ids=input_ids, position_ids=position_ids, labels=labels), group)
    cp = ContextParallel(group, 4, 2)
    hidden, kl_mask = distillation.teacher_on_slice(cp, teacher.model, local, local["shift_labels"], 10)
    with torch.no_grad():  # as DistillationTrainer calls the teacher: no cache, so transformers separates documents
        whole = teacher.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        whole = cp.local_tokens(whole)
        alone = teacher.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                              use_cache=False).last_hidden_state
    used = kl_mask & (local["shift_labels"] != -100)
    result = torch.tensor([(hidden - whole)[used].abs().max().item(), (alone - whole)[used].abs().max().item(),
                           float(used.sum())])
    parts = [torch.empty_like(result) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, result)
    return {"diff": [p[0].item() for p in parts], "alone_diff": [p[1].item() for p in parts],
            "kl_positions": [int(p[2]) for p in parts]}


def killed_run(step, arguments):
    """`foxlm finetune ARGUMENTS` on every rank, stopped as a kill would stop it right after checkpoint STEP."""
    trainer_class = distillation.ContextParallelDistillationTrainer

    class KilledTrainer(trainer_class):
        def __init__(self, *args, callbacks, **kwargs):
            super().__init__(*args, callbacks=[*callbacks, kill_after_checkpoint(step)], **kwargs)

    distillation.ContextParallelDistillationTrainer = KilledTrainer
    foxlm(["finetune", *arguments])


def main(result_path, root):
    dist.init_process_group("gloo")  # foxlm finetune takes it (the test's direct torchrun launch has it start one)
    results = {"packed_teacher": packed_teacher_case()}
    with record_terms([]) as terms:
        foxlm(["finetune", *case_args(root, RECORDED)])
    results[RECORDED] = {"terms": terms}
    if dist.get_rank() == 0:
        Path(result_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--killed-after":  # --killed-after STEP FINETUNE_ARGUMENTS...
        killed_run(int(sys.argv[2]), sys.argv[3:])
    else:
        main(sys.argv[1], sys.argv[2])
