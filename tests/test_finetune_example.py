"""examples/finetune_long_context.py runs end to end: convert, fine-tune with LoRA, save, evaluate, plot."""

import json
from pathlib import Path

import torch
from conftest import byte_tokenizer, load_script
from transformers import LlamaConfig, LlamaForCausalLM

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_long_context.py"


def load_example():
    return load_script(EXAMPLE)


def test_convert_finetune_evaluate_on_a_tiny_llama(tmp_path):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=256,
                                         eos_token_id=257, max_position_embeddings=128))
    llama.save_pretrained(tmp_path / "llama")
    byte_tokenizer().save_pretrained(tmp_path / "llama")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i}\n" * 30)
    run = tmp_path / "run"
    load_example().main(["--model", str(tmp_path / "llama"), "--output-dir", str(run), "--text-files",
                         str(corpus / "*.txt"), "--context", "128", "--steps", "3", "--tokens-per-step", "256",
                         "--lora-r", "4", "--eval-length", "256", "--eval-docs", "2"])
    for name in ("converted/config.json", "adapter/adapter_model.safetensors", "fine-tuned/model.safetensors",
                 "per_token_loss.png", "per_token_loss.json"):
        assert (run / name).exists(), name
    result = json.loads((run / "per_token_loss.json").read_text())
    assert set(result["bands"]) == {"original (RoPE)", "converted, before fine-tuning", "converted, fine-tuned"}
    assert all(len(curve) == 255 for curve in result["per_token_loss"].values())
