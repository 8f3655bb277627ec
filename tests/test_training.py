"""FoxForCausalLM under transformers' Trainer."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from foxlm.training import CHECKPOINTING_ARGUMENT
from tests.conftest import counting_backend


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


def test_compiled_layer_parts_train_like_the_eager_model_and_share_graphs_across_layers(make_model):
    """compile_layer_parts on a LoRA model under activation checkpointing, on a packed batch: the loss and the
    gradients of the eager model, and the same graphs whatever the depth (every layer runs them)."""
    from peft import get_peft_model
    from transformers import DataCollatorWithFlattening

    from foxlm import compile_layer_parts, fox_lora_config

    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": (ids := torch.randint(3, 97, (n,), generator=generator).tolist()), "labels": ids}
                for n in (20, 20, 11)]
    batch = DataCollatorWithFlattening()(examples)
    graph_counts = []
    for layers in (2, 4):
        torch.manual_seed(0)
        model = get_peft_model(make_model(num_hidden_layers=layers), fox_lora_config(make_model(), r=4)).train()
        # as Trainer turns it on; transformers 5.23 renamed it, older versions know only the old name
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()

        def loss_and_grads():
            model.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

        eager_loss, eager_grads = loss_and_grads()
        graphs = []
        torch._dynamo.reset()
        assert compile_layer_parts(model, backend=counting_backend(graphs)) == 4 * layers
        compiled_loss, compiled_grads = loss_and_grads()
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
        for compiled, eager in zip(compiled_grads, eager_grads, strict=True):
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)
        graph_counts.append(len(graphs))
    assert graph_counts[0] > 0 and graph_counts[0] == graph_counts[1], graph_counts


def test_compile_layer_parts_needs_a_fox_model():
    from foxlm import compile_layer_parts

    with pytest.raises(ValueError, match="no FoxDecoderLayer"):
        compile_layer_parts(torch.nn.Linear(2, 2))
