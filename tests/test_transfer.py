import pytest
import torch
from torch.nn.utils import parametrize
from transformers import LlamaConfig, LlamaForCausalLM

from foxlm import FoxForCausalLM
from foxlm.conversion import ConversionError, convert_llama_to_fox, fox_from_llama, transfer_attention
from foxlm.conversion.transfer import attention_errors, capture_attention

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
OPEN_GATES_WITH_ROPE = dict(keep_rope=True, gate_init="open", gate_bias=30.0)  # the LLaMA's own attention, exactly
FAST = dict(steps=30, lr=3e-2, progress=False)


def tiny_llama(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).to(dtype).eval()


def token_batches(count, seed, shape=(4, 32)):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], shape, generator=generator) for _ in range(count)]


def snapshot(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def changed(before, model):
    return {name for name, tensor in model.state_dict().items() if not torch.equal(tensor, before[name])}


def test_transfer_more_than_halves_every_layers_error_on_held_out_batches():
    llama = tiny_llama()
    fox = fox_from_llama(llama)
    held_out = token_batches(2, seed=2)
    before = attention_errors(llama, fox, held_out)
    record = transfer_attention(llama, fox, token_batches(4, seed=1), eval_batches=held_out, **FAST)
    after = attention_errors(llama, fox, held_out)
    assert all(a < 0.5 * b for a, b in zip(after, before)), (before, after)
    assert record.error_before == before and record.error_after == after
    assert record.steps == 30 and len(record.loss) == 30 and record.loss[-1] < record.loss[0]
    assert record.trained_parameters == 2 * (4 * 32 + 4) and record.seconds > 0


def test_errors_compare_each_student_layer_with_the_same_teacher_layer_fed_the_teachers_hidden_states():
    llama = tiny_llama()
    batches = token_batches(1, seed=1)
    # With RoPE kept and the gates fully open, each FoX attention layer computes the LLaMA's: zero error.
    exact = fox_from_llama(llama, **OPEN_GATES_WITH_ROPE)
    assert max(attention_errors(llama, exact, batches)) < 1e-10
    # The student's MLPs play no part: its layers are fed the teacher's hidden states, not its own.
    exact_attention = fox_from_llama(llama, **OPEN_GATES_WITH_ROPE)
    with torch.no_grad():
        for layer in exact_attention.model.layers:
            layer.mlp.down_proj.weight = torch.nn.Parameter(torch.randn_like(layer.mlp.down_proj.weight))
    assert max(attention_errors(llama, exact_attention, batches)) < 1e-10
    # A wrong target shows: the same layers paired with the other layer's teacher outputs.
    swapped = fox_from_llama(llama, **OPEN_GATES_WITH_ROPE)
    swapped.model.layers = torch.nn.ModuleList(reversed(swapped.model.layers))
    assert min(attention_errors(llama, swapped, batches)) > 0.1


def test_captured_tensors_are_the_input_and_output_of_each_teachers_self_attn():
    llama = tiny_llama()
    ids = token_batches(1, seed=1)[0]
    inputs, outputs = capture_attention(llama, ids)
    with torch.no_grad():
        hidden = llama.model.embed_tokens(ids)
        layer = llama.model.layers[0]
        normed = layer.input_layernorm(hidden)
        positions = llama.model.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
        attention, _ = layer.self_attn(normed, position_embeddings=positions, attention_mask=None)
    torch.testing.assert_close(inputs[0], normed)
    torch.testing.assert_close(outputs[0], attention)
    assert len(inputs) == len(outputs) == 2 and not torch.equal(outputs[1], outputs[0])


def test_only_the_forget_gates_change_and_the_student_gets_its_flags_and_mode_back():
    llama = tiny_llama()
    fox = fox_from_llama(llama).train()
    fox.model.embed_tokens.weight.requires_grad_(False)
    before = snapshot(fox)
    transfer_attention(llama, fox, token_batches(2, seed=1), **FAST)
    assert changed(before, fox) == {f"model.layers.{i}.self_attn.fgate_proj.{p}" for i in (0, 1)
                                    for p in ("weight", "bias")}
    assert fox.training and not llama.training
    assert not fox.model.embed_tokens.weight.requires_grad and fox.model.layers[0].mlp.up_proj.weight.requires_grad
    assert all(p.grad is None for p in fox.parameters())


def test_a_token_shift_is_trained_with_the_gates():
    llama = tiny_llama()
    fox = fox_from_llama(llama, token_shift=True)
    held_out = token_batches(2, seed=2)
    before = snapshot(fox)
    record = transfer_attention(llama, fox, token_batches(4, seed=1), eval_batches=held_out, **FAST)
    assert changed(before, fox) == {f"model.layers.{i}.self_attn.{m}.{p}" for i in (0, 1)
                                    for m in ("fgate_proj", "k_shift_proj", "v_shift_proj") for p in ("weight", "bias")}
    assert record.trained_parameters == 2 * (4 * 32 + 4) + 2 * 2 * (2 * 32 + 2)
    assert all(a < 0.5 * b for a, b in zip(record.error_after, record.error_before)), record


def test_an_output_gate_starts_as_no_gate_leaves_the_source_alone_and_is_trained_with_the_gates():
    llama = tiny_llama()
    source = snapshot(llama)
    plain, gated = fox_from_llama(llama), fox_from_llama(llama, output_gate=True)
    assert not changed(source, llama)  # o_proj is doubled in new storage
    ids = token_batches(1, seed=3)[0]
    with torch.no_grad():  # sigmoid(0) = 1/2 times a doubled o_proj: the plain conversion's attention
        torch.testing.assert_close(gated(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    before = snapshot(gated)
    record = transfer_attention(llama, gated, token_batches(4, seed=1), eval_batches=token_batches(2, seed=2),
                                **FAST)
    assert changed(before, gated) == {f"model.layers.{i}.self_attn.{m}" for i in (0, 1)
                                      for m in ("fgate_proj.weight", "fgate_proj.bias", "ogate_proj.weight")}
    assert record.trained_parameters == 2 * (4 * 32 + 4) + 2 * 32 * 32
    assert not changed(source, llama)


def test_the_teacher_gets_no_gradient_and_stays_bit_identical():
    llama = tiny_llama()
    before = snapshot(llama)
    fox = fox_from_llama(llama)  # shares every pretrained tensor with the LLaMA
    transfer_attention(llama, fox, token_batches(2, seed=1), qk_rank=2, **FAST)
    assert not changed(before, llama)
    assert all(p.grad is None for p in llama.parameters())
    assert not torch.equal(fox.model.layers[0].self_attn.q_proj.weight, llama.model.layers[0].self_attn.q_proj.weight)


def test_qk_low_rank_updates_change_q_and_k_by_rank_r_and_merge_into_a_plain_model(tmp_path):
    llama = tiny_llama()
    fox = fox_from_llama(llama)
    before = snapshot(fox)
    record = transfer_attention(llama, fox, token_batches(2, seed=1), qk_rank=2, **FAST)
    assert changed(before, fox) == {f"model.layers.{i}.self_attn.{m}.{p}" for i in (0, 1)
                                    for m, p in [("fgate_proj", "weight"), ("fgate_proj", "bias"),
                                                 ("q_proj", "weight"), ("k_proj", "weight")]}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.linalg.matrix_rank(fox.state_dict()[name] - before[name]) == 2
    assert record.qk_rank == 2 and record.trained_parameters == 2 * (4 * 32 + 4 + 2 * (32 + 32) + 2 * (32 + 16))
    assert not any(parametrize.is_parametrized(module) for module in fox.modules())
    assert set(fox.state_dict()) == set(before)

    fox.save_pretrained(tmp_path / "fox")
    reloaded = FoxForCausalLM.from_pretrained(tmp_path / "fox").eval()
    ids = token_batches(1, seed=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, fox(ids).logits, rtol=0, atol=1e-6)


def test_transfer_is_deterministic_given_a_seed():
    llama = tiny_llama()
    runs = {}
    for name, seed in (("first", 0), ("again", 0), ("other seed", 1)):
        fox = fox_from_llama(llama)
        transfer_attention(llama, fox, token_batches(2, seed=1), qk_rank=2, seed=seed, steps=5, progress=False)
        runs[name] = fox.state_dict()
    assert all(torch.equal(runs["first"][name], runs["again"][name]) for name in runs["first"])
    assert not torch.equal(runs["first"]["model.layers.0.self_attn.q_proj.weight"],
                           runs["other seed"]["model.layers.0.self_attn.q_proj.weight"])


def test_a_bf16_model_trains_fp32_gates_under_autocast_and_keeps_its_dtype():
    llama = tiny_llama(dtype=torch.bfloat16)
    fox = fox_from_llama(llama)
    assert fox.dtype == torch.bfloat16
    before = snapshot(fox)
    record = transfer_attention(llama, fox, token_batches(2, seed=1), qk_rank=2, **FAST)
    assert all(p.dtype == torch.bfloat16 for p in fox.parameters())
    assert "model.layers.0.self_attn.fgate_proj.weight" in changed(before, fox)
    assert all(a < 0.5 * b for a, b in zip(record.error_after, record.error_before))


def test_a_one_pass_iterable_of_batches_is_cycled():
    llama = tiny_llama()
    record = transfer_attention(llama, fox_from_llama(llama), iter(token_batches(2, seed=1)), steps=5,
                                progress=False)
    assert len(record.loss) == 5


@pytest.mark.parametrize("change, message", [
    (dict(steps=-1), "`steps`"),
    (dict(steps=2.5), "`steps`"),
    (dict(lr=0.0), "`lr`"),
    (dict(qk_rank=-2), "`qk_rank`"),
    (dict(batches=[]), "`batches` is empty"),
    (dict(eval_batches=[]), "`eval_batches` is empty"),
    (dict(batches=[torch.zeros(32, dtype=torch.long)]), "`batches` must hold"),
    (dict(batches=[torch.zeros(2, 8)]), "`batches` must hold"),
    (dict(teacher=dict(num_hidden_layers=3)), "`teacher` has 3 layers but `student` has 2"),
    (dict(teacher=dict(hidden_size=48)), "`teacher` has hidden size 48 but `student` has 32"),
    (dict(student="llama"), "`student` must be a FoX model"),
], ids=["negative-steps", "fractional-steps", "zero-lr", "negative-rank", "no-batches", "no-eval-batches",
        "1-d-batch", "float-batch", "layer-count", "hidden-size", "llama-student"])
def test_bad_arguments_are_value_errors_naming_them(change, message):
    llama = tiny_llama()
    arguments = dict(teacher=llama, student=fox_from_llama(llama), batches=token_batches(1, seed=1), steps=1,
                     progress=False)
    if isinstance(change.get("teacher"), dict):
        change = dict(teacher=tiny_llama(**change["teacher"]))
    if change.get("student") == "llama":
        change = dict(student=tiny_llama())
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        transfer_attention(**arguments)


def test_convert_with_transfer_steps_writes_the_trained_gates_and_says_so_in_the_model_card(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "llama")
    plain = FoxForCausalLM.from_pretrained(convert_llama_to_fox(tmp_path / "llama", tmp_path / "plain"))
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", transfer_steps=5,
                               transfer_data=token_batches(2, seed=1), transfer_qk_rank=2, transfer_device="cpu")
    fox = FoxForCausalLM.from_pretrained(out)
    for name in ("fgate_proj.weight", "q_proj.weight"):
        assert not torch.equal(fox.get_parameter(f"model.layers.0.self_attn.{name}"),
                               plain.get_parameter(f"model.layers.0.self_attn.{name}"))
    assert torch.equal(fox.model.layers[0].self_attn.v_proj.weight, plain.model.layers[0].self_attn.v_proj.weight)
    assert "Attention transfer: 5 steps" in (out / "README.md").read_text()


@pytest.mark.parametrize("options, message", [
    (dict(transfer_steps=5), "needs both transfer_steps > 0 and transfer_data"),
    (dict(transfer_data=[torch.zeros(1, 4, dtype=torch.long)]), "needs both transfer_steps > 0 and transfer_data"),
    (dict(transfer_steps=-1), "transfer_steps must be a non-negative integer"),
])
def test_convert_refuses_half_given_transfer_options_before_writing(tmp_path, options, message):
    tiny_llama().save_pretrained(tmp_path / "llama")
    with pytest.raises(ConversionError, match=message):
        convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", **options)
    assert not (tmp_path / "fox").exists()


def test_foxlm_convert_llama_runs_the_transfer_on_text_files_with_the_sources_tokenizer(tmp_path, capsys):
    from conftest import save_llama_and_corpus

    from foxlm.cli import main as foxlm

    root = save_llama_and_corpus(tmp_path)
    foxlm(["convert", "llama", str(root / "llama"), str(root / "fox"), "--transfer-steps", "3", "--transfer-data",
           str(root / "corpus" / "*.txt"), "--transfer-length", "1000", "--transfer-batch-size", "2",
           "--transfer-qk-rank", "2"])
    card = (root / "fox" / "README.md").read_text()
    assert "Attention transfer: 3 steps" in card and "rank-2 q/k updates" in card
    fox = FoxForCausalLM.from_pretrained(root / "fox")
    assert fox.model.layers[1].self_attn.fgate_proj.weight.abs().sum() > 0  # zero when converted without transfer
    # --seed draws the q/k updates' start anew: the same data and steps end elsewhere.
    foxlm(["convert", "llama", str(root / "llama"), str(root / "fox-seed-1"), "--transfer-steps", "3",
           "--transfer-data", str(root / "corpus" / "*.txt"), "--transfer-length", "1000", "--transfer-batch-size",
           "2", "--transfer-qk-rank", "2", "--seed", "1"])
    other = FoxForCausalLM.from_pretrained(root / "fox-seed-1")
    query = [model.model.layers[1].self_attn.q_proj.weight for model in (fox, other)]
    assert not torch.equal(*query)


@pytest.mark.parametrize("flag, value", [("--transfer-steps", "-1"), ("--transfer-lr", "nan"),
                                         ("--transfer-length", "0"), ("--transfer-batch-size", "0"), ("--seed", "-1")])
def test_foxlm_convert_llama_names_a_bad_transfer_option(tmp_path, capsys, flag, value):
    from foxlm.cli import main as foxlm

    with pytest.raises(SystemExit):
        foxlm(["convert", "llama", str(tmp_path / "missing"), str(tmp_path / "fox"), flag, value])
    assert f"argument {flag}" in capsys.readouterr().err
    assert not (tmp_path / "fox").exists()
