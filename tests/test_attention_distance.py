"""benchmarks/attention_distance.py: the rebuilt Forgetting Attention weights against foxlm's attention, the
statistics against cases whose answer is known (uniform attention, attention on itself alone), and a whole run on a
tiny LLaMA and its conversion."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import save_llama_and_corpus, tiny_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("attention_distance", ROOT / "benchmarks" / "attention_distance.py")
attention_distance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(attention_distance)


def uniform_statistics(T, min_position, local):
    """Mean distance, local mass and first-token mass of causal attention spread evenly over every key."""
    queries = torch.arange(min_position, T, dtype=torch.float64)
    return ((queries / 2).mean().item(), (queries.clamp(max=local - 1) + 1).div(queries + 1).mean().item(),
            (1 / (queries + 1)).mean().item())


def test_rebuilt_weights_give_foxlms_attention_output():
    from foxlm.kernels import forgetting_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 37, 4, 8), torch.randn(1, 37, 2, 8), torch.randn(1, 37, 2, 8)
    log_fgate = F.logsigmoid(torch.randn(1, 37, 4) * 2 + 1)
    weights = attention_distance.forgetting_attention_weights(q, k, log_fgate, 8 ** -0.5)
    out = torch.einsum("hij,hjd->ihd", weights, v[0].double().repeat_interleave(2, dim=1).transpose(0, 1))
    want = forgetting_attention(q.double(), k.double(), v.double(), log_fgate.double(), backend="reference")[0]
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 37, dtype=torch.float64))


@pytest.mark.parametrize("remembers", [True, False])
def test_fox_statistics_of_uniform_and_of_self_only_attention(remembers):
    # q = 0: equal scores, so the gates alone shape the weights: f = 1 spreads them evenly over the keys, f ~ 0 puts
    # all of each query's weight on itself.
    model = tiny_model()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.fgate_proj.weight.zero_()
            layer.self_attn.fgate_proj.bias.fill_(40.0 if remembers else -40.0)
    T, min_position, local = 40, 8, 5
    layers = attention_distance.layer_statistics(model, torch.randint(3, 97, (1, T)), min_position, local)
    want = uniform_statistics(T, min_position, local) if remembers else (0.0, 1.0, 0.0)
    assert len(layers) == model.config.num_hidden_layers
    for statistics in layers:
        for got, value in zip(statistics, want, strict=True):
            torch.testing.assert_close(got, torch.full_like(got, value))


def test_llama_statistics_of_uniform_attention(tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(save_llama_and_corpus(tmp_path) / "llama").eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    T, min_position, local = 30, 4, 3
    want = uniform_statistics(T, min_position, local)
    for statistics in attention_distance.layer_statistics(model, torch.randint(0, 256, (1, T)), min_position, local):
        for got, value in zip(statistics, want, strict=True):
            torch.testing.assert_close(got, torch.full_like(got, value))


def test_a_run_compares_a_llama_and_its_conversion_by_domain(tmp_path):
    from foxlm.conversion.llama import convert_llama_to_fox

    root = save_llama_and_corpus(tmp_path)
    convert_llama_to_fox(str(root / "llama"), root / "fox")
    attention_distance.main(["--model", str(root / "llama"), "--retrofit", str(root / "fox"), "--domains", "code",
                             "--length", "48", "--docs", "2", "--min-position", "8", "--out", str(root / "out")])
    [path] = (root / "out").glob("attention_distance_cpu_*.json")
    record = json.loads(path.read_text())
    assert record["documents"] == {"code": 2} and path.with_suffix(".png").exists()
    assert record["device"] == "cpu" and record["torch"] and record["foxlm_source_sha256"]  # the run record
    stats = record["domains"]["code"]
    assert set(stats) == {"original (RoPE)", "retrofit (FoX)"}
    for by_layer in stats.values():
        assert len(by_layer["mean_distance"]) == 2 and len(by_layer["mean_distance"][0]) == 4  # layers, heads
        assert all(0 <= d <= 47 for heads in by_layer["mean_distance"] for d in heads)
        assert all(0 < m <= 1 for heads in by_layer["local_mass"] for m in heads)
        assert all(0 <= m < 1 for heads in by_layer["first_token_mass"] for m in heads)
