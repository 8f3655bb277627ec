"""Pretrain a FoX model with `Trainer` on one or several GPUs through `accelerate launch` (DDP or FSDP), save it
sharded, and check that the saved model reloads with the logits of the trained one.

    accelerate launch --config_file examples/accelerate/fsdp.yaml --num_processes 2 \\
        examples/train_accelerate.py --size 760m --context 4096 --batch-size 4 --steps 40
    accelerate launch --config_file examples/accelerate/ddp.yaml --num_processes 2 examples/train_accelerate.py
    python examples/train_accelerate.py --size tiny --steps 20        # one process, GPU or CPU

Data: the Python standard library's sources as bytes (token = byte + 3; ids 0, 1, 2 are pad, bos, eos),
concatenated and cut into blocks of `--context` tokens: nothing to download, no tokenizer. The 125m and 760m sizes
are the paper's (12 x 768 and 24 x 1536, head dim 64) with the 32000-entry vocabulary of
`benchmarks/bench_training.py`, so their tokens/s compare with that benchmark's; `tiny` has a byte vocabulary.

Precision: bf16 on a GPU (Trainer's `bf16=True`: fp32 master weights, bf16 compute; under FSDP the mixed precision
policy of the accelerate config), fp32 on a CPU. FSDP wraps every `FoxDecoderLayer` (the model's
`_no_split_modules`, which accelerate's transformer-based auto-wrap reads). On a CPU, `accelerate launch` runs the
processes over gloo as plain data parallelism: accelerate turns FSDP on only for accelerator process groups.

Written to `--output-dir`, which must be absent or empty (`--force` replaces a run foxlm wrote there): `model/`
(safetensors shards of at most `--max-shard-size`, config, model code; staged and renamed into place) and
`train_metrics.json` (losses, steady-state tokens/s, the reload check). The process exits with an error if the
reloaded model's logits differ from the trained model's.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from foxlm import FoxConfig, FoxForCausalLM
from foxlm.data import pack_into_blocks, stdlib_source_files
from foxlm.outputs import check_target, make_output_folder, staged_folder, write_file_atomic
from foxlm.training import CHECKPOINTING_ARGUMENT

OFFSET = 3  # byte b is token b + 3
SIZES = {
    "tiny": dict(vocab_size=256 + OFFSET, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16),
    "125m": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
    "760m": dict(vocab_size=32000, hidden_size=1536, num_hidden_layers=24, num_attention_heads=24),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="tiny", help="model size (default: %(default)s)")
    parser.add_argument("--variant", choices=("pro", "llama"), default="pro",
                        help="FoX (Pro) or FoX (LLaMA) (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="sequences per device and step (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--timing-warmup", type=int, default=3,
                        help="steps left out of the steady-state tokens/s (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--max-shard-size", default="500MB",
                        help="largest safetensors file of the saved model (default: %(default)s)")
    parser.add_argument("--output-dir", default="foxlm-train-accelerate", help="default: %(default)s")
    parser.add_argument("--force", action="store_true",
                        help="replace what an earlier run wrote in --output-dir (only a folder foxlm wrote)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_model(args):
    kwargs = dict(**SIZES[args.size], max_position_embeddings=max(args.context, 4096),
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = FoxConfig.fox_pro(**kwargs) if args.variant == "pro" else FoxConfig.fox_llama(**kwargs)
    return FoxForCausalLM(config)


def training_arguments(args, on_gpu):
    """The run's `TrainingArguments` (also used by `foxlm bench trainer-profile`, which profiles this step)."""
    return TrainingArguments(
        output_dir=str(Path(args.output_dir) / "trainer"), per_device_train_batch_size=args.batch_size,
        max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 10),
        weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        bf16=on_gpu, use_cpu=not on_gpu, dataloader_drop_last=True, seed=args.seed, disable_tqdm=True,
        **{CHECKPOINTING_ARGUMENT: args.gradient_checkpointing},
    )


def stdlib_blocks(context, num_tokens):
    """(n, context) blocks of the standard library's bytes, read in a fixed order until `num_tokens` are there."""
    documents, total = [], 0
    for path in stdlib_source_files(min_bytes=1):
        if total >= num_tokens:
            break
        document = [byte + OFFSET for byte in path.read_bytes()] + [2]
        documents.append(document)
        total += len(document)
    return pack_into_blocks(documents, context)


class Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class StepTimer(TrainerCallback):
    """Wall time of the optimizer steps after the first `warmup` (compilation, autotuning and allocator growth)."""

    def __init__(self, warmup):
        self.warmup, self.start, self.end, self.timed_steps = warmup, None, None, 0

    def _now(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.warmup:
            self.start = self._now()
        elif state.global_step > self.warmup:
            self.end, self.timed_steps = self._now(), state.global_step - self.warmup


def check_reload(trainer, model_dir, batch):
    """Largest |logit difference| between the trained (possibly sharded) model and the one reloaded from disk.

    Every process runs the trained model (FSDP gathers each layer's shards as it goes); the main process reloads.
    Both run as in training: under autocast if mixed precision is on, and with bf16 weights where FSDP's mixed
    precision policy casts them, so only kernel rounding separates them."""
    accelerator = trainer.accelerator
    bf16_weights = trainer.is_fsdp_enabled and accelerator.mixed_precision == "bf16"
    model = trainer.model_wrapped.eval()
    batch = batch.to(accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        trained = model(input_ids=batch, use_cache=False).logits.float()
    if not accelerator.is_main_process:
        return None
    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16_weights else torch.float32)
    reloaded = reloaded.to(accelerator.device).eval()
    with torch.no_grad(), accelerator.autocast():
        logits = reloaded(input_ids=batch, use_cache=False).logits.float()
    diff = (logits - trained).abs().max().item()
    return dict(max_abs_diff=diff, max_rel_diff=diff / trained.abs().max().item(), model_class=type(reloaded).__name__)


def main(argv=None):
    args = parse_args(argv)
    # Every process checks (all see the same folder, so all go on or all stop) before any of them writes.
    output_dir = check_target(args.output_dir, force=args.force)
    on_gpu = torch.cuda.is_available()
    training_args = training_arguments(args, on_gpu)
    with training_args.main_process_first(desc="creating the output folder"):
        if training_args.process_index == 0:
            make_output_folder(output_dir, holds="foxlm pretraining run")
    world_size = training_args.world_size
    tokens_per_step = args.batch_size * args.context * world_size
    blocks = stdlib_blocks(args.context, (args.steps + 1) * tokens_per_step)
    torch.manual_seed(args.seed)
    model = build_model(args)
    timer = StepTimer(min(args.timing_warmup, args.steps - 1))
    trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(blocks), callbacks=[timer])
    train_output = trainer.train()

    # Every process takes part in gathering the full state dict (FSDP); the main process writes it in shards.
    model_dir = output_dir / "model"
    accelerator = trainer.accelerator
    state_dict = accelerator.get_state_dict(trainer.model_wrapped)
    parameters = sum(tensor.numel() for tensor in state_dict.values())  # before save_pretrained consumes it
    if accelerator.is_main_process:
        with staged_folder(model_dir, force=True, holds="model") as staging:  # this run's folder, checked above
            accelerator.unwrap_model(trainer.model_wrapped).save_pretrained(
                staging, state_dict=state_dict, max_shard_size=args.max_shard_size)
    accelerator.wait_for_everyone()
    reload = check_reload(trainer, model_dir, blocks[:2, : min(args.context, 256)])

    if not accelerator.is_main_process:
        return
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    timed = timer.timed_steps
    metrics = dict(
        size=args.size, variant=args.variant, context=args.context, per_device_batch=args.batch_size,
        world_size=world_size, distributed_type=str(accelerator.distributed_type),
        fsdp_version=accelerator.state.fsdp_plugin.fsdp_version if trainer.is_fsdp_enabled else None,
        device=torch.cuda.get_device_name() if on_gpu else "cpu", mixed_precision=accelerator.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing,
        parameters=parameters, steps=args.steps, tokens_per_step=tokens_per_step,
        train_runtime_s=train_output.metrics["train_runtime"],
        tokens_per_s_overall=args.steps * tokens_per_step / train_output.metrics["train_runtime"],
        tokens_per_s=timed * tokens_per_step / (timer.end - timer.start) if timed else None,
        tokens_per_s_per_device=timed * tokens_per_step / (timer.end - timer.start) / world_size if timed else None,
        timed_steps=timed, first_loss=losses[0], last_loss=losses[-1], losses=losses,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9 if on_gpu else None,
        saved_files=sorted(os.listdir(model_dir)), reload=reload,
    )
    write_file_atomic(output_dir / "train_metrics.json", json.dumps(metrics, indent=1))
    print(json.dumps({key: value for key, value in metrics.items() if key not in ("losses", "saved_files")}))
    # Relative to the largest logit: the kernels' rounding in bf16 compute, float error in fp32.
    tolerance = 1e-4 if accelerator.mixed_precision == "no" else 2e-2
    if not torch.isfinite(torch.tensor(losses)).all() or reload["max_rel_diff"] > tolerance:
        raise SystemExit(f"error: non-finite loss or the reloaded model differs (max rel diff "
                         f"{reload['max_rel_diff']:.2e} > {tolerance})")


if __name__ == "__main__":
    main()
