import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers import LlamaConfig, LlamaForCausalLM

from foxlm import FoxConfig, FoxForCausalLM, FoxForSequenceClassification, FoxModel
from foxlm.compat import enable_activation_checkpointing
from foxlm.modeling_fox import FoxForgetGateBias, fgate_bias_init_values


def test_auto_classes_resolve_fox(make_config):
    config = make_config()
    assert isinstance(AutoConfig.for_model("fox"), FoxConfig)
    assert type(AutoModel.from_config(config)) is FoxModel
    assert type(AutoModelForCausalLM.from_config(config)) is FoxForCausalLM
    assert type(AutoModelForSequenceClassification.from_config(config)) is FoxForSequenceClassification


def test_module_names_follow_llama(make_model):
    names = set(make_model().state_dict())
    for name in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                 "model.layers.0.self_attn.fgate_proj.weight", "model.layers.0.self_attn.fgate_proj.bias"]:
        assert name in names


def test_loss_is_shifted_cross_entropy_and_respects_num_items_in_batch(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (2, 12))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 97), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(100)).loss
    torch.testing.assert_close(summed, expected * (labels[:, 1:] != -100).sum() / 100)


def test_logits_to_keep_inputs_embeds_and_hidden_states(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (2, 10))
    full = model(ids, output_hidden_states=True)
    assert len(full.hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(model(ids, logits_to_keep=3).logits, full.logits[:, -3:])
    torch.testing.assert_close(model(ids, logits_to_keep=torch.tensor([0, 4])).logits, full.logits[:, [0, 4]])
    embeds = model.get_input_embeddings()(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, full.logits)


# With RoPE or log-n scaling, each sequence's positions (and so the clamp of the slow pairs, the queries' scale) count
# from its own first token.
ROPE = {"no-rope": {}, "clamped-slow-pairs": dict(use_rope=True, rope_max_wavelength=4.0, rope_slow_pairs="clamp"),
        "compressed-slow-pairs-from-6": dict(use_rope=True, rope_max_wavelength=4.0, rope_slow_pairs="compress",
                                             rope_slow_pairs_factor=4.0, rope_slow_pairs_start=6.0),
        "logn-scaling": dict(logn_scaling_context=3, acp_eps=None)}


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("rope", ROPE.values(), ids=ROPE.keys())
def test_padding_gives_the_logits_of_unpadded_sequences(make_model, side, rope):
    model = make_model(**rope)
    lengths = [9, 5, 7]
    seqs = [torch.randint(3, 97, (n,)) for n in lengths]
    T = max(lengths)
    ids = torch.randint(3, 97, (len(seqs), T))  # real tokens at pads: only the mask may hide them
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        where = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        ids[b, where], mask[b, where] = s, 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=position_ids).logits
    for b, s in enumerate(seqs):
        where = slice(T - len(s), T) if side == "left" else slice(0, len(s))
        torch.testing.assert_close(logits[b, where], model(s[None]).logits[0], rtol=1e-5, atol=1e-5)


def test_logn_scaling_multiplies_each_query_past_the_context_by_log_p_over_log_context(make_model, monkeypatch):
    from foxlm import modeling_fox

    queries, attention = [], modeling_fox.forgetting_attention
    monkeypatch.setattr(modeling_fox, "forgetting_attention", lambda q, *args, **kwargs: attention(
        queries.append(q) or q, *args, **kwargs))
    plain, scaled = make_model(acp_eps=None), make_model(acp_eps=None, logn_scaling_context=4)  # the same weights
    ids = torch.randint(3, 97, (1, 12))
    plain(ids)
    scaled(ids)
    first_layer_plain, first_layer_scaled = queries[0], queries[plain.config.num_hidden_layers]
    factor = (torch.log(torch.arange(1.0, 13.0)) / math.log(4)).clamp(min=1)  # position p sees p + 1 tokens
    assert factor[3] == 1 and factor[-1] > 1.7
    torch.testing.assert_close(first_layer_scaled, first_layer_plain * factor[None, :, None, None])
    # Within the context the model is the one without scaling.
    torch.testing.assert_close(scaled(ids[:, :4]).logits, plain(ids[:, :4]).logits, rtol=0, atol=0)


@pytest.mark.parametrize("rope", ROPE.values(), ids=ROPE.keys())
def test_packed_documents_do_not_see_each_other(make_model, rope):
    model = make_model(**rope)
    docs = [torch.randint(3, 97, (n,)) for n in (6, 1, 8)]
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
    bounds = torch.tensor([0, 6, 7, 15], dtype=torch.int32)
    from_kwargs = model(ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=bounds,
                        cu_seq_lens_k=bounds, max_length_q=8, max_length_k=8).logits[0]
    start = 0
    for d in docs:
        alone = model(d[None]).logits[0]
        torch.testing.assert_close(packed[start : start + len(d)], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(from_kwargs[start : start + len(d)], alone, rtol=1e-5, atol=1e-5)
        start += len(d)


def test_packed_boundaries_are_checked_once_per_forward_not_once_per_layer(make_model, monkeypatch):
    from foxlm.kernels.attention import attention as interface

    model = make_model()
    assert model.config.num_hidden_layers > 1
    layer_checks = []
    monkeypatch.setattr(interface, "packed_sequence_lengths", lambda *args: layer_checks.append(args))
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    model(torch.randint(3, 97, (1, 7)), position_ids=position_ids, use_cache=False)
    assert layer_checks == []  # the model's layout checked them (one device sync); its layers trust that


def test_gradient_checkpointing_gives_the_same_gradients(make_model):
    model = make_model().train()
    ids = torch.randint(3, 97, (2, 10))

    def grads():
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads()
    enable_activation_checkpointing(model)
    assert model.model.gradient_checkpointing or model.is_gradient_checkpointing
    checkpointed = grads()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)
    assert all(grad.abs().sum() > 0 for name, grad in plain.items() if "fgate" in name or "shift" in name)


PRO_PARTS = ["qk_norm", "use_output_gate", "use_output_norm", "use_k_shift", "use_v_shift"]


@pytest.mark.parametrize("part", PRO_PARTS)
def test_each_pro_part_changes_the_output_and_can_be_switched_off(make_model, part):
    ids = torch.randint(3, 97, (1, 12))
    with_part = make_model(seed=1)
    without_part = make_model(seed=1, **{part: False})
    # The same weights wherever both models have them: only `part` differs.
    missing, unexpected = without_part.load_state_dict(with_part.state_dict(), strict=False)
    assert not missing and unexpected
    with torch.no_grad():
        for module in with_part.modules():  # norm scales at 1 would make QK/output norm a no-op on scale only
            if "RMSNorm" in type(module).__name__:
                module.weight.mul_(1 + 0.1 * torch.randn_like(module.weight))
    assert not torch.allclose(with_part(ids).logits, without_part(ids).logits, atol=1e-4)


def test_gate_kinds_and_decay_time_initialisation(make_config):
    no_gate = FoxForCausalLM(make_config(fgate_type="none", **{p: False for p in PRO_PARTS}))
    assert no_gate.model.layers[0].self_attn.fgate_proj is None
    fixed = FoxForCausalLM(make_config(fgate_type="fixed", decay_time_min=2.0, decay_time_max=200.0))
    gate = fixed.model.layers[0].self_attn.fgate_bias
    assert isinstance(gate, FoxForgetGateBias) and "bias" in dict(gate.named_buffers())
    tau = torch.logspace(torch.log10(torch.tensor(2.0)), torch.log10(torch.tensor(200.0)), 4)
    torch.testing.assert_close(torch.sigmoid(gate.bias), torch.exp(-1 / tau))
    learned = FoxForCausalLM(make_config(fgate_type="data_independent", fgate_bias_init=3.0))
    assert learned.model.layers[0].self_attn.fgate_bias.bias.requires_grad
    assert torch.all(learned.model.layers[0].self_attn.fgate_bias.bias == 3.0)
    dependent = FoxForCausalLM(make_config(fgate_bias_init=5.0))
    assert torch.all(dependent.model.layers[1].self_attn.fgate_proj.bias == 5.0)
    torch.testing.assert_close(fgate_bias_init_values(make_config(decay_time_min=1.0, decay_time_max=1.0), 1),
                               -torch.log(torch.expm1(torch.tensor([1.0]))))


def test_no_gate_with_rope_equals_llama_loaded_from_its_checkpoint(tmp_path):
    llama_config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config).eval()
    llama.save_pretrained(tmp_path)
    fox_config = FoxConfig(**{k: getattr(llama_config, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "tie_word_embeddings", "rope_parameters")}, use_rope=True, fgate_type="none")
    fox = FoxForCausalLM.from_pretrained(tmp_path, config=fox_config).eval()
    ids = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(fox(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


def test_gate_parameters_missing_from_a_llama_checkpoint_get_their_configured_init(tmp_path):
    llama_config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4)
    LlamaForCausalLM(llama_config).save_pretrained(tmp_path)
    config = FoxConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, fgate_bias_init=5.0)
    fox = FoxForCausalLM.from_pretrained(tmp_path, config=config)
    for layer in fox.model.layers:
        assert torch.all(layer.self_attn.fgate_proj.bias == 5.0)
        assert layer.self_attn.fgate_proj.weight.abs().max() > 0


def test_sequence_classification_pools_the_last_real_token(make_config):
    torch.manual_seed(0)
    model = FoxForSequenceClassification(make_config(num_labels=3)).eval()
    ids = torch.randint(3, 97, (2, 6))
    ids[1, 4:] = 0  # right padding with pad_token_id
    out = model(ids, attention_mask=(ids != 0).long(), labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss.isfinite()
    alone = model(ids[1:, :4]).logits
    torch.testing.assert_close(out.logits[1:], alone, rtol=1e-5, atol=1e-5)


def test_save_and_load_round_trip_is_exact(make_model, tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    loaded = FoxForCausalLM.from_pretrained(tmp_path).eval()
    for (name, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), name
    ids = torch.randint(3, 97, (1, 8))
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is FoxForCausalLM
    fixed = copy.deepcopy(model.config)
    assert fixed.to_dict()["fgate_type"] == loaded.config.fgate_type


def test_torch_compile_captures_the_training_forward_in_one_graph(make_model):
    model = make_model().train()
    ids = torch.randint(3, 97, (2, 16))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(ids, labels=ids, use_cache=False).loss
    loss.backward()
    torch.testing.assert_close(loss, model(ids, labels=ids, use_cache=False).loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_models_of_different_head_dims_compile_one_after_the_other():
    """torch.compile makes a float that differs between compiles of the same code symbolic (automatic dynamic):
    the second model's attention scale then reaches the kernel wrapper as a symbol, which must not break the graph."""
    torch._dynamo.reset()
    for head_dim in (16, 8):
        torch.manual_seed(0)
        model = FoxForCausalLM(FoxConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim)).train()
        ids = torch.randint(0, 64, (1, 12))
        loss = torch.compile(model, fullgraph=True, backend="eager")(ids, labels=ids, use_cache=False).loss
        assert torch.allclose(loss, model(ids, labels=ids, use_cache=False).loss)
