"""Interrupted Trainer runs resume exactly: full fine-tuning and LoRA, from the checkpoint folder on disk.

The runs use `foxlm finetune`'s recipe: AdamW over `optimizer_param_groups`, the `TrainingBudget` schedule, packed
batches (`DataCollatorWithFlattening`), gradient accumulation and gradient checkpointing. The interrupted run stops
right after its step-3 checkpoint (as if killed there), and a fresh model and a fresh Trainer resume from that folder,
so everything the resume needs is read back from disk, config.json included (`Trainer` reads it through the base
`PreTrainedConfig`).
"""

import torch
from peft import get_peft_model
from transformers import DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

from foxlm import fox_lora_config, optimizer_param_groups
from foxlm.data import padding_free_examples
from foxlm.training import CHECKPOINTING_ARGUMENT, TrainingBudget

STEPS, CHECKPOINT_STEP = 6, 3


class StopAfter(TrainerCallback):
    """Ends training after `step` optimizer steps, like a kill right after that step's checkpoint."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def train(model, output_dir, stop_after=None, resume_from_checkpoint=None):
    """`STEPS` steps with a checkpoint every `CHECKPOINT_STEP`; the same arguments for every run, so the learning
    rate schedule of an interrupted run is the uninterrupted run's."""
    documents = torch.randint(3, 97, (24, 12), generator=torch.Generator().manual_seed(0)).tolist()
    budget = TrainingBudget(max_steps=STEPS, warmup_steps=2)
    optimizer = torch.optim.AdamW(optimizer_param_groups(model), lr=3e-3, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, budget.lr_factor)
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        save_steps=CHECKPOINT_STEP, report_to=[], use_cpu=True, seed=0, **{CHECKPOINTING_ARGUMENT: True},
    )
    callbacks = [budget] + ([StopAfter(stop_after)] if stop_after else [])
    trainer = Trainer(model=model, args=args, train_dataset=padding_free_examples(documents, max_length=12),
                      data_collator=DataCollatorWithFlattening(), optimizers=(optimizer, scheduler),
                      callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def lora_model(make_model, seed):
    """The tiny FoX with LoRA; LoRA's A matrices are drawn from the global RNG, so seed before `get_peft_model`."""
    model = make_model(seed=0).train()
    torch.manual_seed(seed)
    return get_peft_model(model, fox_lora_config(model, r=4, lora_alpha=8))


def assert_same_weights(model, expected):
    state, expected_state = model.state_dict(), expected.state_dict()
    assert state.keys() == expected_state.keys()
    different = [name for name in state if not torch.equal(state[name], expected_state[name])]
    assert not different, f"weights differ: {different[:5]}"


def assert_trained(model, initial):
    assert any(not torch.equal(value, initial[name]) for name, value in model.state_dict().items())


def test_full_fine_tuning_resumed_from_a_checkpoint_equals_an_uninterrupted_run(make_model, tmp_path):
    uninterrupted = make_model(seed=0).train()
    initial = {name: value.clone() for name, value in uninterrupted.state_dict().items()}
    train(uninterrupted, tmp_path / "uninterrupted")
    assert_trained(uninterrupted, initial)

    interrupted = train(make_model(seed=0).train(), tmp_path / "run", stop_after=CHECKPOINT_STEP)
    assert interrupted.state.global_step == CHECKPOINT_STEP
    checkpoint = tmp_path / "run" / f"checkpoint-{CHECKPOINT_STEP}"
    assert (checkpoint / "config.json").exists()
    # Other initial weights: only the checkpoint's can make the resumed run equal to the uninterrupted one.
    resumed_model = make_model(seed=1).train()
    resumed = train(resumed_model, tmp_path / "run", resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    assert_same_weights(resumed_model, uninterrupted)


def test_two_identical_lora_runs_give_identical_adapters(make_model, tmp_path):
    first, second = lora_model(make_model, seed=0), lora_model(make_model, seed=0)
    # The seed before get_peft_model is what makes them equal: another one draws other LoRA A matrices.
    other = lora_model(make_model, seed=1).state_dict()
    assert not all(torch.equal(value, other[name]) for name, value in first.state_dict().items())
    initial = {name: value.clone() for name, value in first.state_dict().items()}
    train(first, tmp_path / "first")
    train(second, tmp_path / "second")
    assert_trained(first, initial)
    assert_same_weights(second, first)


def test_lora_fine_tuning_resumed_from_a_checkpoint_equals_an_uninterrupted_run(make_model, tmp_path):
    uninterrupted = lora_model(make_model, seed=0)
    train(uninterrupted, tmp_path / "uninterrupted")

    train(lora_model(make_model, seed=0), tmp_path / "run", stop_after=CHECKPOINT_STEP)
    checkpoint = tmp_path / "run" / f"checkpoint-{CHECKPOINT_STEP}"
    assert (checkpoint / "adapter_model.safetensors").exists()
    # Another seed, so other LoRA A matrices: only the checkpoint's adapter can make the runs equal.
    resumed_model = lora_model(make_model, seed=1)
    resumed = train(resumed_model, tmp_path / "run", resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    assert_same_weights(resumed_model, uninterrupted)
