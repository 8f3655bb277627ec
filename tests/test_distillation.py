import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, TrainingArguments

from foxlm import fox_lora_config
from foxlm.conversion import fox_from_llama
from foxlm.distillation import (MAX_TEACHER_CALLS, ContextParallelDistillationTrainer, DistillationTrainer,
                                chunked_distillation_loss, sample_documents, teacher_on_documents, teacher_on_windows)
from foxlm.evaluation import last_hidden_states

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def direct_terms(student_logits, teacher_logits, labels, kl_mask):
    """float64 next-token loss and KL(teacher || student), written the plain way."""
    s = F.log_softmax(student_logits.double()[:, :-1], -1)
    t = F.log_softmax(teacher_logits.double()[:, :-1], -1)
    target = labels[:, 1:]
    keep = target != -100
    ce = -s.gather(-1, target.clamp_min(0)[..., None])[..., 0][keep].sum()
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)[keep & kl_mask[:, :-1]].sum()
    return ce, kl, int(keep.sum()), int((keep & kl_mask[:, :-1]).sum())


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_chunked_loss_matches_direct_computation_with_gradients(chunk_size):
    torch.manual_seed(1)
    B, T, H, V = 2, 13, 8, 11
    student_hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(B, T, H, dtype=torch.float64)
    student_head, teacher_head = torch.nn.Linear(H, V).double(), torch.nn.Linear(H, V).double()
    labels = torch.randint(0, V, (B, T))
    labels[0, 4] = labels[1, 0] = -100  # a document boundary and an ignored token
    kl_mask = torch.arange(T).expand(B, T) < 9
    ce, kl, tokens, kl_tokens = chunked_distillation_loss(student_hidden, student_head, labels,
                                                          teacher_hidden=teacher_hidden, teacher_head=teacher_head,
                                                          kl_mask=kl_mask, chunk_size=chunk_size)
    ce_ref, kl_ref, tokens_ref, kl_tokens_ref = direct_terms(student_head(student_hidden), teacher_head(teacher_hidden),
                                                             labels, kl_mask)
    assert (tokens, kl_tokens) == (tokens_ref, kl_tokens_ref) == (B * (T - 1) - 1, 2 * 9 - 1)
    torch.testing.assert_close(ce.double(), ce_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl.double(), kl_ref, rtol=1e-6, atol=1e-6)
    grad = torch.autograd.grad(ce + 0.5 * kl, student_hidden)[0]
    grad_ref = torch.autograd.grad(ce_ref + 0.5 * kl_ref, student_hidden)[0]
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-6)
    assert kl > 0


def test_kl_only_positions_take_no_next_token_loss():
    torch.manual_seed(2)
    B, T, H, V = 2, 11, 8, 13
    student_hidden, teacher_hidden = (torch.randn(B, T, H, dtype=torch.float64) for _ in range(2))
    head = torch.nn.Linear(H, V).double()
    labels = torch.randint(0, V, (B, T))
    kl_mask = torch.arange(T).expand(B, T) < 6
    terms = dict(teacher_hidden=teacher_hidden, teacher_head=head, kl_mask=kl_mask, chunk_size=4)
    ce, kl, tokens, kl_tokens = chunked_distillation_loss(student_hidden, head, labels, kl_only=True, **terms)
    beyond = labels.clone()
    beyond[:, 1:7] = -100  # positions 0-5 predict tokens 1-6: those take the KL alone
    ce_ref, kl_ref, _, _ = direct_terms(head(student_hidden), head(teacher_hidden), beyond, torch.zeros_like(kl_mask))
    torch.testing.assert_close(ce.double(), ce_ref)
    assert (tokens, kl_tokens) == (B * (T - 1), B * 6)  # every position still counts once, in one term or the other
    full_ce, full_kl, _, _ = chunked_distillation_loss(student_hidden, head, labels, **terms)
    assert ce < full_ce and torch.equal(kl, full_kl)


def test_kl_is_zero_when_the_student_is_the_teacher_and_next_token_loss_matches_the_models_own():
    llama = tiny_llama()
    ids = torch.randint(0, TINY["vocab_size"], (2, 20))
    hidden = llama.model(ids).last_hidden_state
    ce, kl, tokens, _ = chunked_distillation_loss(hidden, llama.lm_head, ids, teacher_hidden=hidden,
                                                  teacher_head=llama.lm_head, chunk_size=8)
    assert abs(kl.item()) < 1e-6
    torch.testing.assert_close(ce / tokens, llama(ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


def test_labels_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="labels"):
        chunked_distillation_loss(torch.zeros(1, 4, 8), torch.nn.Linear(8, 5), torch.zeros(1, 5, dtype=torch.long))


def packed_examples(count=8, seed=3):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 24, (count,), generator=generator).tolist()
    return [{"input_ids": (ids := torch.randint(0, TINY["vocab_size"], (n,), generator=generator).tolist()),
             "labels": list(ids)} for n in lengths]


def make_trainer(tmp_path, kl_weight, steps=4, lora=True, **kwargs):
    teacher = tiny_llama()
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30)  # peaked predictions, far from the student's near-uniform ones
    student = fox_from_llama(tiny_llama())  # its own weights: the teacher is never trained
    model = get_peft_model(student, fox_lora_config(student, r=4)) if lora else student
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0)
    return DistillationTrainer(model=model, args=args, train_dataset=packed_examples(),
                               data_collator=DataCollatorWithFlattening(), teacher=teacher, kl_weight=kl_weight,
                               **kwargs), teacher


def test_without_kl_the_trainer_loss_is_the_models_next_token_loss(tmp_path):
    trainer, _ = make_trainer(tmp_path, kl_weight=0.0)
    batch = DataCollatorWithFlattening()(packed_examples()[:2])
    model = trainer.model
    expected = model(**batch).loss
    torch.testing.assert_close(trainer.compute_loss(model, batch), expected, rtol=1e-5, atol=1e-6)


def test_distillation_lowers_the_kl_and_leaves_the_teacher_unchanged(tmp_path):
    trainer, teacher = make_trainer(tmp_path, kl_weight=1.0, steps=6, teacher_context=12)
    trainer.args.learning_rate = 3e-2
    before = {name: p.clone() for name, p in teacher.state_dict().items()}
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "kl" in entry]
    assert len(logged) == 6 and logged[-1]["kl"] < logged[0]["kl"]
    assert all(abs(e["loss"] - (e["ce"] + e["kl"])) < 1e-3 for e in logged), logged
    assert all(torch.equal(p, before[name]) for name, p in teacher.state_dict().items())
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())


def loss_terms(trainer, batch, **settings):
    """(ce, kl) of one compute_loss on `batch`, after setting the trainer's attributes `settings`."""
    for name, value in settings.items():
        setattr(trainer, name, value)
    trainer.compute_loss(trainer.model, batch)
    return trainer._terms["ce"][-1], trainer._terms["kl"][-1]


def test_kl_applies_only_inside_the_teachers_context(tmp_path):
    trainer, _ = make_trainer(tmp_path, kl_weight=1.0, teacher_context=1)
    batch = DataCollatorWithFlattening()(packed_examples()[:2])
    # Position 0 of each document predicts token 1: only those positions take the KL term.
    _, inside = loss_terms(trainer, batch)
    assert 0 < inside < loss_terms(trainer, batch, teacher_context=None)[1]


def test_distill_only_trains_the_next_token_loss_beyond_the_teachers_context_alone(tmp_path):
    trainer, _ = make_trainer(tmp_path, kl_weight=1.0, teacher_context=4, distill_only=True)
    batch = DataCollatorWithFlattening()(packed_examples()[:2])
    ce_beyond, kl = loss_terms(trainer, batch)
    ce_everywhere, same_kl = loss_terms(trainer, batch, distill_only=False)
    assert 0 < ce_beyond < ce_everywhere and torch.equal(kl, same_kl)


def counted_calls(module):
    calls = []
    module.register_forward_hook(lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                 with_kwargs=True)
    return calls


@pytest.mark.parametrize("teacher_context", [None, 5, 12])
def test_the_teacher_on_documents_equals_the_whole_row_at_every_kl_position(teacher_context):
    """Blocks packed into one row: the teacher runs on each document's KL window (equal lengths batched, one call
    per length) and gives the whole-row call's hidden states wherever the KL applies. The third run of position ids
    starts mid-document (a block that continues one), as the whole-row call reads it."""
    teacher = tiny_llama().model
    lengths, firsts = [16, 16, 9, 16], [0, 0, 3, 0]
    positions = torch.cat([torch.arange(first, first + n) for n, first in zip(lengths, firsts)])[None]
    batch = {"input_ids": torch.randint(0, TINY["vocab_size"], positions.shape), "position_ids": positions}
    with torch.no_grad():
        whole = teacher(**batch, use_cache=False).last_hidden_state
    calls = counted_calls(teacher)
    hidden = teacher_on_documents(teacher, batch, teacher_context)
    kl = positions < (teacher_context or 10**9)
    windows = {min(n, (teacher_context or 10**9) - first) for n, first in zip(lengths, firsts)}
    # One call per window length, and the teacher runs on exactly the positions the KL takes.
    assert len(calls) == len(windows) and sum(s.numel() for s in calls) == kl.sum()
    torch.testing.assert_close(hidden[kl], whole[kl], rtol=1e-5, atol=1e-5)
    assert torch.all(hidden[~kl] == 0)


def test_the_teacher_takes_the_whole_row_when_its_documents_come_in_many_lengths():
    teacher = tiny_llama().model
    lengths = list(range(3, 3 + MAX_TEACHER_CALLS + 1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = {"input_ids": torch.randint(0, TINY["vocab_size"], positions.shape), "position_ids": positions}
    calls = counted_calls(teacher)
    hidden = teacher_on_documents(teacher, batch, None)
    assert calls == [positions.shape]
    with torch.no_grad():
        torch.testing.assert_close(hidden, teacher(**batch, use_cache=False).last_hidden_state)


@pytest.mark.parametrize("windows_per_call", [1, 2, 8])
def test_the_teacher_past_its_context_is_the_evaluations_sliding_window_per_document(windows_per_call):
    """Each packed document longer than the window gets, from the window on, the hidden states of the original run
    over a sliding window (the evaluation's `last_hidden_states`), zeros elsewhere; rows without position ids are
    one document each."""
    llama, window = tiny_llama(), 8
    teacher = llama.model
    lengths = [20, 7, 26, 9]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.randint(0, TINY["vocab_size"], positions.shape)
    hidden = teacher_on_windows(teacher, {"input_ids": ids, "position_ids": positions}, window, windows_per_call)
    expected, start = torch.zeros_like(hidden[0]), 0
    for n in lengths:
        with torch.no_grad():
            doc = last_hidden_states(llama, ids[:, start : start + n], window)
        expected[start + window : start + n] = doc[window:]
        start += n
    torch.testing.assert_close(hidden[0], expected, rtol=1e-5, atol=1e-5)
    rows = torch.randint(0, TINY["vocab_size"], (2, 21))
    unpacked = teacher_on_windows(teacher, {"input_ids": rows}, window, windows_per_call)
    with torch.no_grad():
        for row in range(2):
            torch.testing.assert_close(unpacked[row, window:], last_hidden_states(llama, rows[row : row + 1],
                                                                                 window)[window:])
    assert teacher_on_windows(teacher, {"input_ids": rows[:, :window]}, window) is None
    with pytest.raises(ValueError, match="start at position 0"):
        teacher_on_windows(teacher, {"input_ids": ids[:, :5], "position_ids": torch.arange(3, 8)[None]}, 2)


def test_the_kl_past_the_context_adds_its_weight_times_the_windowed_teachers_kl(tmp_path):
    """kl_weight_past_context w: the loss grows by w x KL(windowed teacher || student) summed over the positions at or
    beyond the teacher's context, over the same token count (float64 direct computation); inside it nothing moves."""
    context, weight = 6, 2.5
    trainer, teacher = make_trainer(tmp_path, kl_weight=3.0, teacher_context=context, lora=False)
    examples = packed_examples()[:2]
    batch = DataCollatorWithFlattening()(examples)
    model = trainer.model
    with torch.no_grad():
        base = trainer.compute_loss(model, batch)
        trainer.kl_weight_past_context = weight
        with_past = trainer.compute_loss(model, batch)
        past_kl, count = 0.0, 0
        for example in examples:
            ids = torch.tensor([example["input_ids"]])
            student = model(input_ids=ids).logits
            windowed = teacher.lm_head(last_hidden_states(teacher, ids, context))[None]
            beyond = torch.arange(ids.shape[1])[None] >= context
            _, kl, tokens, _ = direct_terms(student, windowed, ids, beyond)
            past_kl, count = past_kl + kl, count + tokens
    assert past_kl > 0
    torch.testing.assert_close(with_past.double() - base.double(), weight * past_kl / count, rtol=1e-4, atol=1e-6)
    for settings, message in (({"kl_weight": 0.0}, "needs a `kl_weight` > 0"), ({"distill_only": True}, "choose one")):
        with pytest.raises(ValueError, match=message):
            make_trainer(tmp_path, **{"kl_weight": 1.0, "teacher_context": context, "kl_weight_past_context": 1.0,
                                      **settings})


def test_blocks_packed_into_one_pass_give_the_loss_and_gradients_of_one_pass_each(tmp_path):
    """--micro-batch-size: two blocks in one row, or one per pass with gradient accumulation, train alike."""
    trainer, _ = make_trainer(tmp_path, kl_weight=1.0, teacher_context=12)
    model, examples, collate = trainer.model, packed_examples()[:2], DataCollatorWithFlattening()
    count = sum(len(e["input_ids"]) - 1 for e in examples)

    def loss_and_grads(batches):
        model.zero_grad()
        loss = sum(trainer.compute_loss(model, b, num_items_in_batch=count) for b in batches)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

    packed_loss, packed_grads = loss_and_grads([collate(examples)])
    separate_loss, separate_grads = loss_and_grads([collate([e]) for e in examples])
    torch.testing.assert_close(packed_loss, separate_loss, rtol=1e-5, atol=1e-6)
    for packed, separate in zip(packed_grads, separate_grads, strict=True):
        torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-6)


def test_a_kl_weight_without_teacher_is_refused(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="teacher"):
        DistillationTrainer(model=fox_from_llama(tiny_llama()), args=args, kl_weight=1.0)
    with pytest.raises(ValueError, match="distill_only"):
        DistillationTrainer(model=fox_from_llama(tiny_llama()), args=args, kl_weight=0.0, distill_only=True)


def test_a_kl_past_the_context_with_context_parallelism_is_refused_at_construction(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="kl_weight_past_context.*context parallelism"):
        ContextParallelDistillationTrainer(model=fox_from_llama(tiny_llama()), args=args, teacher=tiny_llama(),
                                           kl_weight=1.0, teacher_context=48, kl_weight_past_context=1.0,
                                           context_parallel_size=1)


def test_the_loss_runs_under_the_trainers_mixed_precision(tmp_path, monkeypatch):
    """The decoder is called past the forward that accelerate wraps in autocast: the trainer enters it itself."""
    trainer, _ = make_trainer(tmp_path, kl_weight=1.0)
    seen = []
    monkeypatch.setattr(trainer.accelerator, "autocast",
                        lambda: seen.append(True) or torch.autocast("cpu", enabled=False))
    trainer.compute_loss(trainer.model, DataCollatorWithFlattening()(packed_examples()[:2]))
    assert seen == [True]


@pytest.mark.gpu
def test_bf16_training_runs_the_models_attention_in_bf16(tmp_path, monkeypatch):
    import foxlm.modeling_fox as modeling

    dtypes, attention = [], modeling.forgetting_attention
    monkeypatch.setattr(modeling, "forgetting_attention",
                        lambda q, *a, **k: dtypes.append(q.dtype) or attention(q, *a, **k))
    teacher, student = tiny_llama(), fox_from_llama(tiny_llama())
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, report_to=[], save_strategy="no")
    trainer = DistillationTrainer(model=student, args=args, teacher=teacher, kl_weight=1.0)
    batch = {k: v.cuda() for k, v in DataCollatorWithFlattening()(packed_examples()[:2]).items()}
    trainer.compute_loss(trainer.model, batch).backward()
    assert dtypes and set(dtypes) == {torch.bfloat16}


def test_sampled_documents_follow_the_model_end_with_one_eos_and_leave_the_callers_random_stream_alone():
    model, eos = tiny_llama(), 5
    with torch.no_grad():  # make EOS likely enough that some documents end before max_length
        model.lm_head.bias = None
        model.lm_head.weight[eos] *= 0
        model.lm_head.weight[eos] += model.model.norm.weight.sign() * 0.5
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    documents = sample_documents(model, num_tokens=100, eos_token_id=eos, max_length=12, batch_size=4, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # sampling used its own random stream
    assert sum(map(len, documents)) >= 100
    assert all(1 < len(doc) <= 13 and doc[-1] == eos and eos not in doc[:-1] for doc in documents)
    assert any(len(doc) < 13 for doc in documents) and any(len(doc) == 13 for doc in documents)
    assert sample_documents(model, num_tokens=100, eos_token_id=eos, max_length=12, batch_size=4, seed=7) == documents
    assert sample_documents(model, num_tokens=100, eos_token_id=eos, max_length=12, batch_size=4, seed=8) != documents
    # A cache of fixed size (compiled on a GPU) samples the same documents.
    assert sample_documents(model, num_tokens=100, eos_token_id=eos, max_length=12, batch_size=4, seed=7,
                            cache_implementation="static") == documents


@pytest.mark.parametrize("temperature", [1.0, 0.2])  # at 0.2 a token's share moves by up to 0.02
def test_documents_are_sampled_from_the_models_whole_distribution(temperature):
    """No top-k or top-p: first tokens come as often as the model predicts them after EOS, at the temperature."""
    model, eos = tiny_llama(), 5
    documents = sample_documents(model, num_tokens=8000, eos_token_id=eos, max_length=1, batch_size=1000,
                                 temperature=temperature)
    with torch.no_grad():
        probs = (model(torch.tensor([[eos]])).logits[0, -1].double() / temperature).softmax(-1)
    probs[eos] = 0  # a document that is EOS alone is dropped
    probs /= probs.sum()
    counts = torch.bincount(torch.tensor([doc[0] for doc in documents]), minlength=len(probs)).double()
    frequencies = counts / counts.sum()
    assert (frequencies - probs).abs().max() < 0.01
    tail = probs.argsort()[: len(probs) // 2]  # what a top-k of half the vocabulary would never sample
    assert abs(frequencies[tail].sum() - probs[tail].sum()) < 0.02 and probs[tail].sum() > 0.1

def test_sampling_refuses_bad_sizes():
    with pytest.raises(ValueError, match="`num_tokens` must be a positive integer, got 0"):
        sample_documents(tiny_llama(), num_tokens=0, eos_token_id=1)
    with pytest.raises(ValueError, match="`batch_size` must be a positive integer"):
        sample_documents(tiny_llama(), num_tokens=10, eos_token_id=1, batch_size=2.5)
    with pytest.raises(ValueError, match="`temperature` must be a positive number, got 0"):
        sample_documents(tiny_llama(), num_tokens=10, eos_token_id=1, temperature=0)
    with pytest.raises(ValueError, match="`cache_implementation` must be None or 'static', got 'paged'"):
        sample_documents(tiny_llama(), num_tokens=10, eos_token_id=1, cache_implementation="paged")
