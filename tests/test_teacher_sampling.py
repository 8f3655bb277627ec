"""The refill probe of benchmarks/teacher_sampling.py samples what foxlm's sampler would, so that its timing compares
like with like."""

import importlib.util
from pathlib import Path

import pytest
import torch
from test_distillation import tiny_llama

from foxlm.distillation import sample_documents

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "teacher_sampling.py"


def load_script():
    spec = importlib.util.spec_from_file_location("teacher_sampling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_that_ends_documents(eos=5):
    """test_distillation's tiny LLaMA with EOS likely enough that documents end at many lengths."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight[eos] *= 0
        model.lm_head.weight[eos] += model.model.norm.weight.sign() * 0.3
    return model, eos


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_a_refilled_row_samples_each_document_as_if_it_were_alone(temperature):
    """Rows start new documents at different steps, finished rows leave the batch and the cache drops the slots no
    row reads: every token must still come from the model's distribution given its own document only (its
    log-probabilities as sampled against one float64 forward of the document alone)."""
    model, eos = llama_that_ends_documents()
    documents = load_script().sample_with_refill(model, num_tokens=600, eos_token_id=eos, max_length=24, batch_size=5,
                                                 seed=3, temperature=temperature)
    lengths = [len(tokens) for tokens, _ in documents]
    assert len(set(lengths)) > 5 and sum(lengths) >= 600
    assert all(tokens[-1] == eos and eos not in tokens[:-1] and len(tokens) <= 25 for tokens, _ in documents)
    reference = model.double()
    with torch.no_grad():
        for tokens, sampled_log_probs in documents:
            inputs = torch.tensor([[eos] + tokens[:len(sampled_log_probs) - 1]])
            log_probs = (reference(inputs).logits[0] / temperature).log_softmax(-1)
            expected = log_probs.gather(-1, torch.tensor(tokens[:len(sampled_log_probs)])[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sampled_log_probs, dtype=torch.float64), expected,
                                       atol=1e-4, rtol=0)


def test_refilled_rows_do_not_wait_for_a_batchs_longest_document():
    """Steps: about num_tokens / batch_size plus one document's length, where `sample_documents` takes max_length
    steps a batch; the cache: about the longest running document, not every step. Each token's position is its place
    in its own document (the keys its row reads, less one), from 0 again in a refilled row."""
    model, eos = llama_that_ends_documents()
    widths, restarts = [], []

    def check_positions(module, args, kwargs):
        mask, positions = kwargs["attention_mask"], kwargs["position_ids"][:, 0]
        assert torch.equal(positions, mask.sum(-1) - 1) and mask[:, -1].all()
        widths.append(mask.shape[1])
        restarts.append(int((positions == 0).sum()))

    hook = model.register_forward_pre_hook(check_positions, with_kwargs=True)
    documents = load_script().sample_with_refill(model, num_tokens=2000, eos_token_id=eos, max_length=40,
                                                 batch_size=8, seed=0, temperature=1.0)
    hook.remove()
    assert sum(len(tokens) for tokens, _ in documents) >= 2000 and sum(restarts[1:]) > 40
    assert len(widths) <= 2000 // 8 + 41 + 1
    assert max(widths) <= 64 + 41 + 1 < len(widths)
    generate_steps = []
    model.register_forward_pre_hook(lambda *_: generate_steps.append(1))
    sample_documents(model, num_tokens=2000, eos_token_id=eos, max_length=40, batch_size=8, seed=0)
    assert len(generate_steps) > len(widths)
