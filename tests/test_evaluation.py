import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from foxlm import evaluation
from foxlm.evaluation import evaluate_models, format_bands, last_hidden_states, loss_and_predictions


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@torch.no_grad()
@pytest.mark.parametrize("length", [40, 41, 47])
def test_a_sliding_window_gives_each_position_half_a_window_to_a_window_of_context(llama, length):
    ids = torch.randint(0, 97, (1, length))
    window = 16
    hidden = last_hidden_states(llama, ids, window)
    full = llama.model(input_ids=ids).last_hidden_state[0]
    assert hidden.shape == full.shape
    torch.testing.assert_close(hidden[:window], full[:window], rtol=1e-5, atol=1e-5)  # the first window: as without
    assert not torch.allclose(hidden[window:], full[window:], atol=1e-3)  # later positions lose the far context
    for position in range(window, length):
        # Passes move by 8 and keep their last 8 positions: position p is in the pass ending at the next multiple of
        # 8 after it (or at the end), which starts `window` tokens before that end.
        end = min(window + 8 * ((position - window) // 8 + 1), length)
        alone = llama.model(input_ids=ids[:, end - window : end]).last_hidden_state[0, position - (end - window)]
        torch.testing.assert_close(hidden[position], alone, rtol=1e-5, atol=1e-5)
        assert window // 2 <= position - (end - window) + 1 <= window  # tokens it sees, itself included


@torch.no_grad()
def test_loss_with_a_window_at_least_the_document_is_the_loss_without(llama):
    documents = [torch.randint(0, 97, (n,)).tolist() for n in (30, 21)]
    loss, count, predictions = loss_and_predictions(llama, documents, 30)
    windowed, windowed_count, windowed_predictions = loss_and_predictions(llama, documents, 30, window=30)
    np.testing.assert_allclose(windowed, loss, rtol=1e-6)
    assert (windowed_count == count).all() and all((a == b).all() for a, b in zip(predictions, windowed_predictions))
    shorter = loss_and_predictions(llama, documents, 30, window=10)[0]
    np.testing.assert_allclose(shorter[:9], loss[:9], rtol=1e-5)  # predicting tokens 1..9 from the first window
    assert not np.allclose(shorter[10:], loss[10:], rtol=1e-3)
    with pytest.raises(ValueError, match="window must be at least 2 tokens, got 1"):
        loss_and_predictions(llama, documents, 30, window=1)


def test_band_table_columns_line_up_whatever_the_labels_length():
    bands = {"original (RoPE)": {"0-512": 3.5, "512-2048": 3.25},
             "converted, fine-tuned, sliding window": {"0-512": 3.75, "512-2048": None}}
    lines = format_bands(bands).splitlines()
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header
    assert lines[1].endswith("3.500        3.250") and lines[2].endswith("3.750            -")
    assert lines[2].startswith("converted, fine-tuned, sliding window ")


def test_labels_sharing_a_source_in_turn_load_it_once(llama, monkeypatch):
    loaded = []
    monkeypatch.setattr(evaluation, "load_causal_lm", lambda source, **kwargs: (loaded.append(source) or llama, None))
    documents = {"d": [torch.randint(0, 97, (30,)).tolist()]}
    models = {"a": "model-a", "a, window": "model-a", "b": "model-b"}
    results = evaluate_models(models, documents, 30, reference="a", windows={"a, window": 10})
    assert loaded == ["model-a", "model-b"]
    whole, windowed = (results["d"]["loss"][label] for label in ("a", "a, window"))
    np.testing.assert_allclose(windowed[:9], whole[:9], rtol=1e-5)  # the same model, run whole and over a window
    assert not np.allclose(windowed[10:], whole[10:], rtol=1e-3)

