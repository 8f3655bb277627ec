"""FoxForCausalLM under transformers' Trainer."""

import torch
from transformers import Trainer, TrainingArguments

from foxlm.training import CHECKPOINTING_ARGUMENT


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, length, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, 97, (n, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_with_gradient_accumulation_trains_and_saves(make_model, tmp_path):
    model = make_model().train()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        label_smoothing_factor=0.1, **{CHECKPOINTING_ARGUMENT: True},
    )
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(24, 16))
    assert trainer.model_accepts_loss_kwargs
    trainer.train()
    assert model.model.gradient_checkpointing  # the argument name of this transformers version took effect
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").exists()
