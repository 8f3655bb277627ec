"""Long-context data, the LoRA setup, the training budget, and the per-token-loss / needle evaluations."""

import json
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import byte_tokenizer
from peft import PeftModel, get_peft_model
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from foxlm.data import (
    held_out_documents,
    is_held_out,
    pack_into_blocks,
    padding_free_examples,
    read_texts,
    split_files,
    stdlib_root,
    stdlib_split,
    text_files,
    tokenize_documents,
)
from foxlm.evaluation import (
    NEEDLE_ANSWER,
    NEEDLE_DEPTHS,
    NEEDLE_QUESTION,
    accuracy_by_context_text,
    accuracy_by_distance,
    accuracy_by_distance_text,
    band_edges,
    band_means,
    evaluate_models,
    format_report,
    haystack_intervals,
    held_out_haystacks,
    needle_haystack,
    needle_in_a_haystack,
    needle_over_haystacks,
    needle_summary,
    per_token_loss,
    plot_needle,
    plot_per_token_loss,
    smooth,
    top1_agreement,
    write_evaluation_report,
    write_per_token_loss_report,
)
from foxlm.training import ATTENTION_PROJECTIONS, TrainingBudget, fox_lora_config, optimizer_param_groups


def test_split_hashes_paths_relative_to_the_corpus_root_so_it_is_the_same_on_every_python(tmp_path):
    names = [f"mod{i}.py" for i in range(40)] + [f"pkg/sub{i}.py" for i in range(40)]
    splits = []
    for version in ("python3.11", "python3.12"):  # the stdlib's folder name differs between machines
        for name in names:
            (tmp_path / version / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / version / name).write_text(name)
        train, held_out = split_files(text_files(str(tmp_path / version / "**" / "*.py")))  # root: their folder
        splits.append(sorted(p.relative_to(tmp_path / version).as_posix() for p in held_out))
        assert train and held_out and not set(train) & set(held_out)
    assert splits[0] == splits[1] == sorted(n for n in names if is_held_out(n))


def test_stdlib_held_out_files_are_never_trained_on_and_fill_long_documents():
    train, held_out = stdlib_split()
    assert len(train) > 300 and not set(train) & set(held_out)
    assert all(is_held_out(p.relative_to(stdlib_root())) for p in held_out)
    assert not any(is_held_out(p.relative_to(stdlib_root())) for p in train)
    assert not any("encodings" in p.parts or "test" in p.parts for p in train + held_out)
    # Enough held-out text for 6 documents of 32k tokens at 4 bytes a token (SmolLM2's tokenizer: 3.6 on this code;
    # 10 documents on Python 3.12, 14 on 3.11).
    assert sum(p.stat().st_size for p in held_out) > 6 * 32768 * 4
    documents = held_out_documents(byte_tokenizer(), "stdlib", 4096, num_docs=5)
    assert len(documents) == 5 and all(len(doc) == 4096 for doc in documents)


def test_packed_training_blocks_hold_no_held_out_text(tmp_path):
    for i in range(30):
        (tmp_path / f"file{i:02d}.txt").write_text(f"<file{i:02d}>" * (5 + i))
    train, held_out = split_files(text_files(str(tmp_path / "*.txt")))
    assert train and held_out
    tokenizer = byte_tokenizer()
    blocks = pack_into_blocks(tokenize_documents(tokenizer, read_texts(train), add_bos=False), 64)
    text = "".join(tokenizer.decode(block) for block in blocks.tolist())
    assert not any(f"<{p.stem}>" in text for p in held_out)
    assert all(f"<{p.stem}>" in text for p in train[:-1])  # only the tail of the stream is dropped
    assert text.count("</s>") >= len(train) - 1  # EOS separates the packed files


def test_pack_into_blocks_keeps_every_token_in_order():
    docs = [[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 2]]
    blocks = pack_into_blocks(docs, 4)
    assert blocks.tolist() == [[1, 5, 6, 2], [1, 7, 2, 1], [8, 9, 10, 2]]
    with pytest.raises(ValueError, match="block"):
        pack_into_blocks([[1, 2]], 4)


def test_padding_free_batches_do_not_leak_across_documents(make_model):
    model = make_model()
    docs = [torch.randint(3, 97, (n,)).tolist() for n in (9, 4, 13)]
    examples = padding_free_examples(docs, max_length=8)
    assert [len(e["input_ids"]) for e in examples] == [8, 4, 8, 5]  # the 9-token document's 1-token tail dropped
    batch = DataCollatorWithFlattening()(examples)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    start = 0
    for example in examples:
        n = len(example["input_ids"])
        alone = model(torch.tensor([example["input_ids"]])).logits[0]
        torch.testing.assert_close(logits[start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_lora_setup_trains_adapters_and_fox_modules_only_and_round_trips(make_model, tmp_path):
    base = make_model()
    ids = torch.randint(3, 97, (1, 12))
    peft_model = get_peft_model(base, fox_lora_config(base, r=4))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("fgate_proj" in n and "modules_to_save" in n for n in trainable)
    assert not any("embed_tokens" in n or "lm_head" in n for n in trainable)
    with torch.no_grad():  # make the adapter and the gate do something
        for name, param in peft_model.named_parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    expected = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(make_model(), tmp_path / "adapter")
    torch.testing.assert_close(reloaded(ids).logits, expected)
    merged = reloaded.merge_and_unload()
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_lora_on_the_attention_projections_only_leaves_the_mlps_frozen(make_model):
    base = make_model()
    peft_model = get_peft_model(base, fox_lora_config(base, r=4, target_modules=ATTENTION_PROJECTIONS))
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in peft_model.named_parameters() if "lora_" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not any(p.requires_grad for n, p in peft_model.named_parameters() if ".mlp." in n)


def test_optimizer_groups_exempt_biases_norms_and_gate_biases(make_model):
    model = make_model(fgate_type="data_independent", fgate_bias_init=2.0)
    decay, no_decay = optimizer_param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert any(n.endswith("fgate_bias.bias") for n in no_decay_names)
    assert any("norm" in n for n in no_decay_names)
    assert all(names[id(p)].endswith("weight") and "norm" not in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == sum(1 for _ in model.parameters())


def test_trainer_on_padding_free_batches_with_lora_lowers_the_loss_and_saves(make_model, tmp_path):
    model = make_model().train()
    torch.manual_seed(0)
    pattern = torch.randint(3, 97, (6,)).tolist()  # a learnable sequence: repeated pattern
    examples = padding_free_examples([pattern * 5 for _ in range(16)], max_length=24)
    peft_model = get_peft_model(model, fox_lora_config(model, r=8))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=5,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True)
    trainer = Trainer(model=peft_model, args=args, train_dataset=examples, data_collator=DataCollatorWithFlattening())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < losses[0]
    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


@pytest.mark.parametrize("kind", ["fox", "llama"])
def test_per_token_loss_matches_a_direct_computation(make_model, kind):
    model = make_model() if kind == "fox" else tiny_llama()
    docs = [torch.randint(3, 97, (n,)).tolist() for n in (12, 7, 20)]
    curve, count = per_token_loss(model, docs, max_length=16, chunk_size=5)  # chunks of the output layer's input
    assert count.tolist() == [3] * 6 + [2] * 5 + [1] * 4
    direct = []
    for doc in docs:
        ids = torch.tensor(doc[:16])
        logits = model(ids[None]).logits[0, :-1]
        direct.append(F.cross_entropy(logits, ids[1:], reduction="none"))
    expected = [np.mean([float(d[i]) for d in direct if len(d) > i]) for i in range(15)]
    np.testing.assert_allclose(curve, expected, rtol=1e-5)
    assert band_means(curve, [0, 5, 15]) == pytest.approx({"0-5": np.mean(curve[:5]), "5-15": np.mean(curve[5:])})
    np.testing.assert_allclose(smooth(np.array([1.0, 2.0, 3.0, 5.0, np.nan, 7.0]), window=3), [1, 2, 10 / 3, 4, 6, 7])


def test_per_token_loss_refuses_models_that_transform_logits_after_the_output_layer():
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="output layer"):
        per_token_loss(model, [[1, 2, 3]], max_length=3)


def test_training_budget_warms_up_then_decays_to_zero_with_the_steps_or_the_clock():
    budget = TrainingBudget(max_steps=10, warmup_steps=2)
    assert budget.lr_factor(0) == pytest.approx(0.5 * 0.5 * (1 + np.cos(0)))
    assert budget.lr_factor(5) == pytest.approx(0.5)
    assert budget.lr_factor(10) == pytest.approx(0.0)
    timed = TrainingBudget(max_steps=1000, max_minutes=1.0)
    timed.start = time.monotonic() - 30  # half the minute spent, 1% of the steps
    assert timed.lr_factor(10) == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError, match="max_minutes"):
        TrainingBudget(max_steps=10, max_minutes=0)


def test_training_budget_stops_a_trainer_run_when_its_time_is_spent(make_model, tmp_path):
    model = make_model().train()
    examples = padding_free_examples([torch.randint(3, 97, (40,)).tolist() for _ in range(8)], max_length=20)
    budget = TrainingBudget(max_steps=100, max_minutes=1e-6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, budget.lr_factor)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=100,
                             save_strategy="no", report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=DataCollatorWithFlattening(),
                      optimizers=(optimizer, scheduler), callbacks=[budget])
    trainer.train()
    assert trainer.state.global_step == 1 and budget.stopped_by_time
    assert scheduler.get_last_lr()[0] == 0.0  # the schedule ended with the budget


def test_plots_are_written_as_png(tmp_path):
    curves = {"a": np.linspace(3, 2, 500), "b": np.linspace(3, 2.5, 400)}
    path = plot_per_token_loss(curves, tmp_path / "loss.png", train_context=256, original_context=128)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = needle_summary(np.eye(3), [1024, 2048, 4096], [0.0, 0.5, 1.0])
    two = needle_summary(np.ones((2, 2)), [1024, 2048], [0.0, 1.0])
    within = needle_summary(np.eye(3), [1024, 2048, 4096], [0.0, 0.5, 1.0], distance_within=512)  # no band: no line
    path = plot_needle({"prose": {"a": one, "b": two, "c": within}, "code": {"a": one}}, tmp_path / "needle.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_needle_accuracy_pooled_by_distance_from_the_question():
    # Needles (1 - depth) x length tokens before the question: depth 0 at 1k and 4k, 1k and 4k back; depth 0.5, 512
    # and 2k; depth 1, 0 and 0. Bands double from 512, each (lo, hi]; two haystacks pool their trials.
    first = np.array([[1, 0], [1, 1], [1, 1]], dtype=float)
    second = np.array([[0, 0], [0, 1], [1, 0]], dtype=float)
    by_distance = accuracy_by_distance(np.stack([first, second]), [1024, 4096], [0.0, 0.5, 1.0])
    assert by_distance == {"0-512": {"accuracy": pytest.approx(4 / 6), "trials": 6},
                           "512-1024": {"accuracy": 0.5, "trials": 2},
                           "1024-2048": {"accuracy": 1.0, "trials": 2},
                           "2048-4096": {"accuracy": 0.0, "trials": 2}}
    assert needle_summary(first, [1024, 4096], [0.0, 0.5, 1.0])["accuracy_by_distance"] == accuracy_by_distance(
        first, [1024, 4096], [0.0, 0.5, 1.0])
    assert accuracy_by_distance_text(by_distance) == "0-512 67%, 512-1k 50%, 1k-2k 100%, 2k-4k 0%"
    # Within a model's own context only (here 1k): the 4k haystacks' trials are left out of the bands, not the grid.
    within = needle_summary(np.stack([first, second]), [1024, 4096], [0.0, 0.5, 1.0], distance_within=1024)
    assert within["accuracy_by_distance"] == {"0-512": {"accuracy": 0.75, "trials": 4},
                                              "512-1024": {"accuracy": 0.5, "trials": 2}}
    assert within["distance_within"] == 1024 and within["accuracy"] == pytest.approx(7 / 12)
    assert needle_summary(first, [1024, 4096], [0.0, 0.5, 1.0], distance_within=512)["accuracy_by_distance"] == {}


def test_report_leaves_sparse_positions_out_of_bands_and_plot_but_keeps_them_raw(tmp_path):
    count = np.array([3] * 6 + [2] * 5 + [1] * 4)
    curve = np.arange(15, dtype=np.float64)
    curve[12] = np.nan  # no document there
    bands = write_per_token_loss_report({"m": curve}, count, tmp_path / "r.json", tmp_path / "r.png",
                                        train_context=8, min_documents=2)
    assert bands == {"m": {"0-8": pytest.approx(3.5), "8-16": pytest.approx(9.0)}}  # positions 8..10 only
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["per_token_loss"]["m"][11] == 11.0 and saved["per_token_loss"]["m"][12] is None
    assert saved["documents_per_position"] == count.tolist()
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_needle_scores_have_one_cell_per_depth_and_context(make_config):
    from foxlm import FoxForCausalLM

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = FoxForCausalLM(make_config(vocab_size=258, bos_token_id=256, eos_token_id=257, pad_token_id=257)).eval()
    haystack = tokenizer("def f(x):\n    return x\n" * 40, add_special_tokens=False)["input_ids"]
    scores = needle_in_a_haystack(model, tokenizer, haystack, context_lengths=[300, 400], depths=[0.0, 0.5, 1.0])
    assert scores.shape == (3, 2) and set(np.unique(scores)) <= {0.0, 1.0}
    again, answers = needle_in_a_haystack(model, tokenizer, haystack, [300, 400], [0.0, 0.5, 1.0], with_answers=True)
    assert np.array_equal(again, scores) and [len(row) for row in answers] == [2, 2, 2]
    assert all(isinstance(answer, str) and answer for row in answers for answer in row)
    summary = needle_summary(again, [300, 400], [0.0, 0.5, 1.0], answers)
    assert summary["answers"] == answers and json.loads(json.dumps(summary)) == summary
    with pytest.raises(ValueError, match="does not fit"):
        needle_in_a_haystack(model, tokenizer, haystack, context_lengths=[50], depths=[0.5])


class NeedleReader(torch.nn.Module):
    """A stand-in model whose greedy answer is right when the needle lies in the last `reach` tokens of the prompt:
    which trials pass is known, so batching must keep every answer with its trial."""

    def __init__(self, tokenizer, reach):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # the device the prompts go to
        self.tokenizer, self.reach, self.batches = tokenizer, reach, []
        self.needle = tokenizer(" " + NEEDLE_QUESTION + NEEDLE_ANSWER, add_special_tokens=False)["input_ids"]

    def generate(self, prompt, attention_mask, max_new_tokens, **kwargs):
        assert attention_mask.shape == prompt.shape and bool(attention_mask.all())
        self.batches.append(tuple(prompt.shape))
        rows = []
        for row in prompt.tolist():
            at = next(i for i in range(len(row)) if row[i : i + len(self.needle)] == self.needle)
            text = NEEDLE_ANSWER if len(row) - at <= self.reach else " go to the beach."
            new = self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(row + new + [self.tokenizer.eos_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_needle_trials_run_in_batches_of_one_length_and_keep_each_answer_with_its_trial():
    tokenizer = byte_tokenizer()
    haystacks = [tokenizer(text * 40, add_special_tokens=False)["input_ids"]
                 for text in ("def f(x):\n    return x\n", "Emma was handsome, clever, and rich. ")]
    lengths, depths = [400, 800], [0.0, 0.25, 0.5, 0.75, 1.0]
    results = {}
    for batch_tokens in (1, 1600, 10**6):
        model = NeedleReader(tokenizer, reach=600)
        results[batch_tokens] = needle_over_haystacks(model, tokenizer, haystacks, lengths, depths,
                                                      batch_tokens=batch_tokens)
        # Every batch holds prompts of one length, as many as fit (one at least); all trials run once.
        per_batch = {400: max(1, batch_tokens // 400), 800: max(1, batch_tokens // 800)}
        assert all(rows <= per_batch[length] for rows, length in model.batches)
        assert sum(rows for rows, _ in model.batches) == len(haystacks) * len(depths) * len(lengths)
        assert len(model.batches) == sum(-(-len(haystacks) * len(depths) // n) for n in per_batch.values())
    scores, answers = results[1]
    # At 400 tokens every needle lies within reach; at 800 those at depth >= 0.5 do (at most ~520 tokens back).
    expected = np.array([[1, 0], [1, 0], [1, 1], [1, 1], [1, 1]], dtype=float)
    assert np.array_equal(scores, np.stack([expected, expected]))
    assert answers[0][0][1] == " go to the beach." and answers[1][4][0].startswith(NEEDLE_ANSWER[:20])
    for other, other_answers in (results[1600], results[10**6]):
        assert np.array_equal(other, scores) and other_answers == answers


def test_the_needle_in_several_haystacks_keeps_each_and_scores_the_fraction_passed(make_config):
    from foxlm import FoxForCausalLM

    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    model = FoxForCausalLM(make_config(vocab_size=258, bos_token_id=256, eos_token_id=257, pad_token_id=257)).eval()
    haystacks = [tokenizer(text * 40, add_special_tokens=False)["input_ids"]
                 for text in ("def f(x):\n    return x\n", "Emma was handsome, clever, and rich. ")]
    scores, answers = needle_over_haystacks(model, tokenizer, haystacks, [300, 400], [0.0, 1.0])
    assert scores.shape == (2, 2, 2)
    for haystack, its_scores, its_answers in zip(haystacks, scores, answers, strict=True):
        one, one_answers = needle_in_a_haystack(model, tokenizer, haystack, [300, 400], [0.0, 1.0], with_answers=True)
        assert np.array_equal(its_scores, one) and its_answers == one_answers
    grid = np.array([[[1, 0], [1, 1]], [[0, 0], [1, 0]], [[1, 0], [1, 1]]], dtype=float)
    cells = [["a", "b"], ["c", "d"]]
    summary = needle_summary(grid, [2048, 4096], [0.0, 1.0], [cells] * 3)
    np.testing.assert_allclose(summary["scores"], [[2 / 3, 0], [1, 2 / 3]])
    assert summary["accuracy"] == pytest.approx(7 / 12) and summary["haystacks"] == 3
    assert summary["accuracy_by_context"] == {"2048": pytest.approx(5 / 6), "4096": pytest.approx(1 / 3)}
    assert summary["scores_by_haystack"] == grid.tolist() and summary["answers_by_haystack"] == [cells] * 3
    assert "answers" not in summary and json.loads(json.dumps(summary)) == summary
    # Each haystack's accuracy at 2k is 1, 1/2, 1 and at 4k 1/2, 0, 1/2: resampled, the means stay within those.
    (low_2k, high_2k), (low_4k, high_4k) = summary["interval_by_context"].values()
    assert 0.5 <= low_2k <= 5 / 6 <= high_2k == 1.0 and 0.0 <= low_4k <= 1 / 3 <= high_4k == 0.5
    # One haystack's summary is the plain one.
    assert needle_summary(grid[:1], [2048, 4096], [0.0, 1.0], [cells]) == needle_summary(grid[0], [2048, 4096],
                                                                                         [0.0, 1.0], cells)


def test_needle_intervals_resample_haystacks():
    rng = np.random.default_rng(1)
    scores = (rng.random((30, 11, 2)) < [0.2, 0.7]).astype(float)  # 30 haystacks, 11 depths, two lengths
    intervals = haystack_intervals(scores, [2048, 4096])
    assert intervals == haystack_intervals(scores, [2048, 4096])  # seeded: the same scores, the same interval
    narrow = haystack_intervals(scores, [2048, 4096], level=0.5)
    for length, accuracy in zip(["2048", "4096"], scores.mean(axis=(0, 1)), strict=True):
        low, high = intervals[length]
        assert low < narrow[length][0] <= accuracy <= narrow[length][1] < high
        assert high - low < 0.2  # 330 trials a length
    # Haystacks alike leave nothing to resample; two haystacks give no interval.
    same = np.repeat(scores[:1], 5, axis=0)
    assert haystack_intervals(same, [2048, 4096]) == {
        length: [accuracy, accuracy] for length, accuracy in zip(["2048", "4096"], same[0].mean(axis=0).tolist())}
    assert "interval_by_context" not in needle_summary(scores[:2], [2048, 4096], NEEDLE_DEPTHS)
    summary = needle_summary(scores, [2048, 4096], NEEDLE_DEPTHS)
    text = accuracy_by_context_text(summary["accuracy_by_context"], " ", summary["interval_by_context"])
    low, high = summary["interval_by_context"]["4096"]
    assert text.endswith(f"4k {summary['accuracy_by_context']['4096']:.0%} ({low * 100:.0f}-{high:.0%})")


def test_several_needle_haystacks_come_from_other_parts_of_held_out_prose():
    tokenizer = byte_tokenizer()
    haystacks = held_out_haystacks(tokenizer, 600, 3)
    assert [len(h) for h in haystacks] == [600] * 3 and haystacks[0] == needle_haystack(tokenizer, 600)
    assert len({tuple(h) for h in haystacks}) == 3
    with pytest.raises(ValueError, match="haystacks of 600 tokens, not 1000000"):
        held_out_haystacks(tokenizer, 600, 10**6)


def test_top1_agreement_with_a_reference_comes_from_the_loss_passes_on_every_domain(make_model):
    fox, noisy, llama = make_model(), make_model(), tiny_llama()
    with torch.no_grad():  # a model that agrees with fox at some positions, not all
        for param in noisy.parameters():
            param.add_(0.003 * torch.randn_like(param))
    documents = {"a": [torch.randint(3, 97, (n,)).tolist() for n in (12, 7, 20)],
                 "b": [torch.randint(3, 97, (n,)).tolist() for n in (16, 9)]}
    results = evaluate_models({"noisy": noisy, "llama": llama, "fox": fox, "fox again": fox}, documents,
                              max_length=16, reference="fox")
    for domain, docs in documents.items():
        result = results[domain]
        assert list(result["loss"]) == ["noisy", "llama", "fox", "fox again"]
        assert set(result["agreement"]) == {"noisy", "llama", "fox again"}
        curve, count = per_token_loss(noisy, docs, 16)
        np.testing.assert_allclose(result["loss"]["noisy"], curve)
        assert result["count"].tolist() == count.tolist()
        # A(i) from the models' logits directly.
        same = [(fox(torch.tensor([d[:16]])).logits[0, :-1].argmax(-1)
                 == noisy(torch.tensor([d[:16]])).logits[0, :-1].argmax(-1)).numpy() for d in docs]
        expected = [np.mean([s[i] for s in same if len(s) > i]) for i in range(15)]
        np.testing.assert_allclose(result["agreement"]["noisy"], expected)
        assert (result["agreement"]["fox again"] == 1).all()
    assert 0 < np.mean(results["a"]["agreement"]["noisy"]) < 1
    with pytest.raises(ValueError, match="reference 'original' is none of the models"):
        evaluate_models({"fox": fox}, documents, max_length=16, reference="original")
    np.testing.assert_array_equal(top1_agreement([np.array([1, 2, 3]), np.array([4])],
                                                 [np.array([1, 0, 3]), np.array([4])]), [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="not the same documents"):
        top1_agreement([np.array([1, 2])], [np.array([1])])


def test_band_edges_double_from_2k_and_include_the_contexts():
    assert band_edges(32768, 8192, 16384) == [0, 512, 2048, 4096, 8192, 16384, 32768]
    assert band_edges(40000, 6000) == [0, 512, 2048, 4096, 6000, 8192, 16384, 32768, 40000]
    assert band_edges(200, None, 100) == [0, 100, 200]


def test_evaluation_report_has_a_section_per_domain_and_is_written_whole(tmp_path):
    count = np.array([3] * 6 + [2] * 5 + [1] * 4)
    results = {domain: {"loss": {"orig": np.full(15, 2.0), "fox": np.arange(15, dtype=np.float64)},
                        "agreement": {"fox": np.linspace(1, 0, 15)}, "count": count} for domain in ("code", "prose")}
    report = write_evaluation_report(results, tmp_path / "r.json", tmp_path / "r.png", train_context=8,
                                     min_documents=2, reference="orig", data="code,prose")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["reference"] == "orig" and saved["data"] == "code,prose"
    assert list(saved["domains"]) == ["code", "prose"]
    section = saved["domains"]["prose"]
    assert section["bands"]["fox"] == {"0-8": pytest.approx(3.5), "8-16": pytest.approx(9.0)}  # positions 8..10
    assert section["agreement_bands"] == {"fox": {"0-8": pytest.approx(np.linspace(1, 0, 15)[:8].mean()),
                                                  "8-16": pytest.approx(np.linspace(1, 0, 15)[8:11].mean())}}
    assert report["code"] == {"loss": section["bands"], "agreement": section["agreement_bands"]}
    table = format_report(report, "orig")
    assert "prose: top-1 agreement with orig" in table and "75.0%" in table  # positions 0..7 of the line 1 -> 0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]  # no partial files left


def test_needle_haystack_is_held_out_prose_and_its_summary_has_each_context():
    tokenizer = byte_tokenizer()
    haystack = needle_haystack(tokenizer, 600)
    assert len(haystack) == 600 and tokenizer.decode(haystack).startswith("EMMA\n\nBy Jane Austen")
    summary = needle_summary(np.array([[1.0, 0.0], [1.0, 1.0]]), [2048, 4096], [0.0, 1.0])
    assert summary["accuracy"] == 0.75 and summary["accuracy_by_context"] == {"2048": 1.0, "4096": 0.5}
