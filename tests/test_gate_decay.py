"""benchmarks/gate_decay.py: the decay statistics against a brute-force count and against gates of known constant
value, the recording of every layer's log f, and a whole run on the conversion of a tiny LLaMA."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import save_llama_and_corpus, tiny_model

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gate_decay", ROOT / "benchmarks" / "gate_decay.py")
gate_decay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate_decay)


def test_decay_statistics_match_a_brute_force_sum_over_each_gap():
    torch.manual_seed(0)
    T, heads = 50, 3
    log_fgate = F.logsigmoid(torch.randn(T, heads) * 2 + torch.tensor([0.0, 3.0, 8.0]))
    statistics = gate_decay.decay_statistics(log_fgate, [1, 7, 20, 50, 64])
    assert list(statistics) == [1, 7, 20]  # gaps as long as the sequence have no query
    for gap, (median, within) in statistics.items():
        # A key gap tokens before query i is lowered by log f of keys i - gap + 1 .. i.
        decay = torch.stack([log_fgate[i - gap + 1 : i + 1].double().sum(0) for i in range(gap, T)])
        torch.testing.assert_close(median, decay.median(0).values)
        torch.testing.assert_close(within, (decay > -gate_decay.REACH_NATS).double().mean(0))
    assert statistics[1][1].tolist() == [1.0, 1.0, 1.0] and statistics[20][1][0] < 1


def test_every_layers_gates_are_recorded_and_measured_on_constant_gates():
    model = tiny_model()
    biases = torch.tensor([-1.0, 2.0, 6.0, 12.0])  # decays of 1.31, 0.127, 2.5e-3 and 6e-6 nats a token
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.fgate_proj.weight.zero_()
            layer.self_attn.fgate_proj.bias.copy_(biases)
    results = gate_decay.measure(model, {"text": [list(range(3, 70)), list(range(10, 77))]}, [4, 32])
    per_token = F.logsigmoid(biases.double())
    for gap in (4, 32):
        stats = results["text"][str(gap)]
        assert len(stats["median_decay"]) == model.config.num_hidden_layers
        for heads, reach in zip(stats["median_decay"], stats["within_reach"], strict=True):
            torch.testing.assert_close(torch.tensor(heads, dtype=torch.float64), gap * per_token, rtol=1e-5, atol=1e-6)
            assert reach == (gap * per_token > -gate_decay.REACH_NATS).double().tolist()
    assert gate_decay.heads_within_reach(results["text"]) == {"4": 3 * 2, "32": 3 * 2}  # 3 open heads, 2 layers
    assert all("log_fgate" not in vars(layer.self_attn) for layer in model.model.layers)  # the method is back


def test_a_run_on_a_converted_llama_writes_json_and_plot(tmp_path, capsys):
    from foxlm.conversion.llama import convert_llama_to_fox

    root = save_llama_and_corpus(tmp_path)
    convert_llama_to_fox(str(root / "llama"), root / "fox")
    gate_decay.main(["--model", str(root / "fox"), "--domains", "code", "--length", "1100", "--docs", "1",
                     "--out", str(root / "out")])
    [path] = (root / "out").glob("gate_decay_cpu_*.json")
    record = json.loads(path.read_text())
    assert record["documents"] == {"code": 1} and path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert list(record["domains"]["code"]) == ["512", "1024"]
    for stats in record["domains"]["code"].values():
        assert all(d <= 0 for heads in stats["median_decay"] for d in heads)
        assert all(0 <= r <= 1 for heads in stats["within_reach"] for r in heads)
    assert "code: heads of 8 with a median decay above -5 nats: 512 back " in capsys.readouterr().out


def test_a_model_without_forget_gates_is_refused(tmp_path, capsys):
    root = save_llama_and_corpus(tmp_path)
    with pytest.raises(SystemExit):
        gate_decay.main(["--model", str(root / "llama"), "--length", "600", "--out", str(root / "out")])
    assert "--model " in capsys.readouterr().err and not (root / "out").exists()
