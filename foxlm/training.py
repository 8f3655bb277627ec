"""Fine-tuning helpers: the recommended LoRA setup for FoX models, optimizer parameter groups, a step and
wall-clock budget for `Trainer` runs, and `Trainer` with context parallelism."""

import math
import time

import torch
import torch.distributed as dist
from peft import LoraConfig
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from accelerate.data_loader import BatchSamplerShard
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import has_length

from .context_parallel import slice_batch

# LLaMA's projections: LoRA adapts these. Registered for model_type "fox", so that
# `get_peft_model(model, LoraConfig(...))` without `target_modules` picks the same projections.
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION_PROJECTIONS = LORA_TARGET_MODULES[:4]
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault("fox", LORA_TARGET_MODULES)
# `TrainingArguments(**{CHECKPOINTING_ARGUMENT: True})`: transformers 5.23 renamed `gradient_checkpointing` to
# `activation_checkpointing` (the old name still works there, with a warning; older versions know only it).
CHECKPOINTING_ARGUMENT = next(name for name in ("activation_checkpointing", "gradient_checkpointing")
                              if name in TrainingArguments.__dataclass_fields__)
# FoX's own modules: small, and new after a conversion, so they train in full (PEFT `modules_to_save`).
FOX_MODULES = ["fgate_proj", "fgate_bias", "k_shift_proj", "v_shift_proj", "q_norm", "k_norm", "output_norm",
               "ogate_proj"]


def fox_lora_config(model, r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGET_MODULES, **kwargs):
    """`LoraConfig` for a FoX model: LoRA on the attention and MLP projections (or `target_modules`, e.g.
    `ATTENTION_PROJECTIONS`), forget gates (and any other FoX modules the model has) fully trainable and saved with
    the adapter.

    `get_peft_model` draws the LoRA A matrices from torch's global RNG: seed it just before (`transformers.set_seed`)
    for repeatable runs, since `TrainingArguments(seed=...)` only takes effect when the `Trainer` is built, after.
    A resumed run needs no seed: it reads the adapter back from the checkpoint."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        modules_to_save=[name for name in FOX_MODULES if name in present],
        **kwargs,
    )


def compile_layer_parts(model, **compile_kwargs):
    """Regional compilation for training: `torch.compile` (with `compile_kwargs`) each decoder layer's norms,
    attention and MLP in place (`nn.Module.compile`), after PEFT has wrapped the projections, so that their
    elementwise work, dtype casts and LoRA's small products can fuse into fewer kernels. Every layer runs the same
    compiled graphs (their weights are graph inputs), so the compile time does not grow with the depth. The decoder
    layer itself is left alone: transformers' activation checkpointing wraps its forward, and inside that wrapper a
    compiled layer would run eagerly. Returns the number of modules compiled."""
    from .modeling_fox import FoxDecoderLayer

    parts = [part for layer in model.modules() if isinstance(layer, FoxDecoderLayer)
             for part in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)]
    if not parts:
        raise ValueError(f"compile_layer_parts needs a FoX model; {type(model).__name__} has no FoxDecoderLayer.")
    for part in parts:
        part.compile(**compile_kwargs)
    return len(parts)


def optimizer_param_groups(model, weight_decay=0.1):
    """Two AdamW groups: weight decay on matrices and embeddings; none on biases, norm scales and gate biases.

    Pass the result to `torch.optim.AdamW`, or to `Trainer(optimizers=(AdamW(groups, ...), None))`.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name or name.endswith("fgate_bias.bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class TrainingBudget(TrainerCallback):
    """Ends a `Trainer` run after `max_steps` optimizer steps or `max_minutes` of wall-clock time, whichever comes
    first, and drives its learning rate: linear warmup over `warmup_steps`, then a cosine decay over that same
    budget, so the rate reaches zero when training stops, however fast the machine is.

        budget = TrainingBudget(max_steps=300, max_minutes=7, warmup_steps=20)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, budget.lr_factor)
        Trainer(..., args=TrainingArguments(max_steps=300, ...), optimizers=(optimizer, scheduler),
                callbacks=[budget])

    The clock starts when training does (a resumed run gets `max_minutes` again; its steps carry on). With several
    processes, rank 0's clock decides for all of them, read at the end of each step, so that every rank takes the
    same learning rate and stops after the same step.
    """

    def __init__(self, max_steps, max_minutes=None, warmup_steps=0):
        if max_steps < 1 or (max_minutes is not None and max_minutes <= 0):
            raise ValueError(f"need max_steps >= 1 and max_minutes > 0, got {max_steps} and {max_minutes}")
        self.max_steps, self.max_minutes, self.warmup_steps = max_steps, max_minutes, warmup_steps
        self.start = None
        self.stopped_by_time = False
        self.shared_minutes = None  # with several processes: rank 0's minutes at the end of the last step

    def minutes(self):
        if self.shared_minutes is not None:
            return self.shared_minutes
        return 0.0 if self.start is None else (time.monotonic() - self.start) / 60

    def progress(self, step):
        """Fraction of the budget used after `step` steps: of the steps or of the minutes, whichever is further."""
        fraction = step / self.max_steps
        if self.max_minutes:
            fraction = max(fraction, self.minutes() / self.max_minutes)
        return min(fraction, 1.0)

    def lr_factor(self, step):
        warmup = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return warmup * 0.5 * (1 + math.cos(math.pi * self.progress(step)))

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()
        if self.max_minutes and args.world_size > 1:
            self.shared_minutes = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if self.max_minutes and args.world_size > 1:
            elapsed = torch.tensor([(time.monotonic() - self.start) / 60], dtype=torch.float64, device=args.device)
            dist.broadcast(elapsed, src=0)
            self.shared_minutes = elapsed.item()
        if self.max_minutes and self.minutes() >= self.max_minutes and state.global_step < self.max_steps:
            self.stopped_by_time = True
            control.should_training_stop = True


class ContextParallelCollator:
    """A data collator for context parallelism: this rank's slice (`slice_batch`) of each batch that `collator`
    makes. The rank and group size are read once, so that it also runs in DataLoader worker processes."""

    def __init__(self, collator, group, pad_token_id=0):
        self.collator, self.pad_token_id = collator, pad_token_id
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def __call__(self, features):
        return slice_batch(self.collator(features), self.rank, self.size, self.pad_token_id)


class ContextParallelTrainer(Trainer):
    """`Trainer` with FoX context parallelism over groups of `context_parallel_size` consecutive ranks (a
    (data, context) DeviceMesh over all processes): `Trainer(..., context_parallel_size=2)` under `torchrun` or
    `accelerate launch`. The model (FoX, or PEFT around it) is switched with `enable_context_parallel`. As accelerate
    does for its own context parallelism, the training batches are sharded over the data-parallel groups only: the
    ranks of a group read the same batches, and `ContextParallelCollator` gives each its slice. So `Trainer`'s own
    dataloader stays in place, and resuming mid-epoch skips the right batches. DDP or FSDP2 keep working over all
    processes: with `average_tokens_across_devices` (the default) Trainer divides every rank's summed loss by the
    token count of all ranks and scales it by their number, so that averaging the gradients over all ranks gives the
    gradient of the whole batch's loss (docs/context-parallel.md). accelerate's own `ParallelismConfig(sp_size/cp_size)`
    runs DeepSpeed's Ulysses or PyTorch's ring attention over SDPA, neither of which takes FoX's attention.

    The training dataset must have a length (map-style): the groups' shares come from accelerate's batch sampler.
    Evaluation inside Trainer is not supported (its loop gathers logits and averages per-rank mean losses); it
    raises rather than evaluate whole sequences as slices."""

    def __init__(self, *args, context_parallel_size, **kwargs):
        super().__init__(*args, **kwargs)
        self.context_parallel_size = context_parallel_size
        world = self.args.world_size
        if context_parallel_size < 1 or world % context_parallel_size:
            raise ValueError(f"context_parallel_size ({context_parallel_size}) must divide the number of processes "
                             f"({world}).")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.args.device.type, (world // context_parallel_size, context_parallel_size),
                                mesh_dim_names=("dp", "cp"))
        self.context_parallel_group = mesh["cp"].get_group()
        self.data_parallel_rank, self.data_parallel_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        self.model.enable_context_parallel(self.context_parallel_group)
        pad = getattr(self.model.config, "pad_token_id", None) or 0
        self.data_collator = ContextParallelCollator(self.data_collator, self.context_parallel_group, pad)

    def get_train_dataloader(self):
        if self.train_dataset is not None and not has_length(self.train_dataset):
            raise ValueError("ContextParallelTrainer needs a train_dataset with a length (map-style): the ranks of a "
                             "context-parallel group must read the same batches, which accelerate's batch sampler "
                             "assigns.")
        dataloader = super().get_train_dataloader()
        shard = next((s for s in (dataloader.batch_sampler, dataloader.sampler) if isinstance(s, BatchSamplerShard)),
                     None)
        if shard is not None:  # one process has none
            # accelerate shards batches over every process; here the ranks of a group share theirs (what
            # accelerate's prepare_data_loader does for a "cp" mesh dimension).
            shard.num_processes, shard.process_index = self.data_parallel_size, self.data_parallel_rank
        return dataloader

    def get_eval_dataloader(self, eval_dataset=None):
        raise NotImplementedError(
            "ContextParallelTrainer does not evaluate: Trainer's evaluation averages per-rank losses and gathers "
            "logits, which are slices here. Evaluate the model with foxlm.context_parallel.shard_batch, or on one "
            "process after disable_context_parallel().")
