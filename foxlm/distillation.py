"""Distillation from the original model while fine-tuning a retrofitted FoX model.

A converted model fine-tuned with next-token loss alone learns its training corpus, not the original's behaviour on
everything else. `DistillationTrainer` adds KL(original || FoX) of the next-token distributions, computed on the fly
from the original (the teacher: frozen, eval mode, no grad) in the same step, at the positions inside the original's
trained context. Beyond that context the teacher's predictions are broken: there only the next-token loss applies,
or, with `kl_weight_past_context`, also a KL to the teacher run over a sliding window of its context (`foxlm.evaluation.
sliding_windows`), the baseline the retrofit is measured against past the original's context.

The language-model head runs in chunks of `chunk_size` tokens under activation checkpointing, so a 16k-token sequence
never holds its (tokens x vocabulary) logits in fp32 at once, for the student or the teacher.

`sample_documents` draws text from the original itself, to distil on: the original's own distribution, whatever the
training corpus covers. Design: docs/retrofit.md.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm
from transformers import GenerationConfig, Trainer
from transformers.trainer_utils import unwrap_peft_model

from .training import ContextParallelTrainer

IGNORE_INDEX = -100


def chunked_distillation_loss(student_hidden, student_head, labels, *, teacher_hidden=None, teacher_head=None,
                              kl_mask=None, kl_scale=None, chunk_size=2048, shift_labels=None, kl_only=False):
    """Sums over the predicting positions of (next-token loss, KL(teacher || student)) and their counts.

    Args:
        student_hidden: (B, T, H) last hidden states of the student; `student_head` maps them to logits.
        labels: (B, T) target ids, unshifted as for `FoxForCausalLM` (position t predicts labels[t + 1]); -100 ignored.
        teacher_hidden, teacher_head: the teacher's last hidden states and head (no KL term when None).
        kl_mask: (B, T) bool, positions t whose prediction takes the KL term (default: all).
        kl_scale: (B, T) float, the factor of each position's KL in `kl_sum` (default: 1 everywhere).
        shift_labels: (B, T) targets already shifted (position t predicts shift_labels[t]), instead of `labels`: a
            context-parallel slice from `foxlm.context_parallel.shard_batch`, whose last token predicts the first
            token of the next rank's slice.
        kl_only: the positions that take the KL term take no next-token loss (pure distillation there); `tokens`
            still counts every predicting position, so each position weighs the same in either term.

    Returns (ce_sum, kl_sum, tokens, kl_tokens): fp32 scalars with the graph to the student, and the two counts as
    0-d tensors (read on the device: no host sync in a training step).
    """
    name, given = ("labels", labels) if shift_labels is None else ("shift_labels", shift_labels)
    if student_hidden.shape[:2] != given.shape:
        raise ValueError(f"`{name}` must be (batch, seq_len) = {tuple(student_hidden.shape[:2])}, "
                         f"got {tuple(given.shape)}.")
    # Position t predicts token t + 1.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if shift_labels is None else shift_labels
    predicting = targets != IGNORE_INDEX
    with_teacher = teacher_hidden is not None
    if not with_teacher:
        kl_positions = torch.zeros_like(predicting)
    else:
        kl_positions = predicting if kl_mask is None else predicting & kl_mask

    ce_targets = targets.masked_fill(kl_positions, IGNORE_INDEX) if kl_only else targets
    kl_factors = kl_positions if kl_scale is None else kl_positions * kl_scale

    def chunk_terms(hidden, target, teacher, use_kl):
        log_probs = F.log_softmax(student_head(hidden).float(), dim=-1)
        ce = F.nll_loss(log_probs, target, ignore_index=IGNORE_INDEX, reduction="sum")
        if teacher is None:
            return ce, log_probs.new_zeros(())
        with torch.no_grad():
            teacher_log_probs = F.log_softmax(teacher_head(teacher).float(), dim=-1)
        kl = (teacher_log_probs.exp() * (teacher_log_probs - log_probs)).sum(-1)
        return ce, (kl * use_kl).sum()

    ce_sum = kl_sum = student_hidden.new_zeros((), dtype=torch.float32)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    hidden, target, kl_flags = flat(student_hidden), flat(ce_targets), flat(kl_factors)
    teacher = flat(teacher_hidden) if with_teacher else None
    for start in range(0, hidden.shape[0], chunk_size):
        part = slice(start, start + chunk_size)
        args = (hidden[part], target[part], None if teacher is None else teacher[part], kl_flags[part])
        if torch.is_grad_enabled() and hidden.requires_grad:
            ce, kl = checkpoint(chunk_terms, *args, use_reentrant=False)
        else:
            ce, kl = chunk_terms(*args)
        ce_sum, kl_sum = ce_sum + ce, kl_sum + kl
    return ce_sum, kl_sum, predicting.sum(), kl_positions.sum()


def language_model_parts(model):
    """(decoder, lm_head) of a causal LM, through PEFT and accelerate wrappers."""
    model = unwrap_peft_model(model)
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if decoder is None or head is None:
        raise ValueError(f"expected a causal LM with `.model` and `.lm_head`, got {type(model).__name__}.")
    return decoder, head


def teacher_document_starts(positions):
    """(B, T) bool: where a document of the teacher's begins in rows of position ids, the first token of a row and
    every token whose position id does not follow the previous one's by 1 (transformers' packed sequences)."""
    return torch.diff(positions, prepend=positions[:, :1] - 2, dim=-1) != 1


def teacher_on_slice(cp, teacher_decoder, inputs, shift_labels, teacher_context):
    """The teacher's last hidden states on this rank's slice of the sequence (zeros where no KL applies; None
    when none does on this slice) and the slice's KL mask (None: everywhere), for a context-parallel student (`cp`,
    `inputs` and `shift_labels` from `foxlm.context_parallel.shard_batch`): the KL applies at positions below
    `teacher_context` (None: all) whose label is not ignored.

    The teacher (a model with no context parallelism) must see each KL position's true prefix, which may lie on
    earlier ranks: the group's token and position ids are gathered (integers) and the teacher runs on the
    window from the start of the first KL position's document to the slice's last KL position. Documents are
    those the teacher's own attention separates: runs of position ids stepping by 1 (transformers' packed
    sequences), or the whole row when an attention mask is given. Positions below `teacher_context` lie at the
    start of each document, so the window is at most `teacher_context` tokens longer than the slice."""
    input_ids = inputs.get("input_ids")
    if input_ids is None:
        raise ValueError("Distillation with context parallelism needs `input_ids`: the teacher embeds the tokens "
                         "of the whole sequence itself.")
    B, T_local = input_ids.shape
    offset, device = cp.rank * T_local, input_ids.device
    positions = inputs.get("position_ids")
    if positions is None:
        if inputs.get("cu_seq_lens_q") is not None:
            raise ValueError("Distillation with context parallelism reads packed documents from `position_ids`; "
                             "the batch has `cu_seq_lens_q` without them (DataCollatorWithFlattening gives both).")
        whole_positions = torch.arange(T_local * cp.size, device=device).expand(B, -1)
    else:
        whole_positions = cp.gather_sequence(positions.expand(B, -1))
    whole_ids = cp.gather_sequence(input_ids)
    local_positions = cp.local_tokens(whole_positions)
    kl_mask = None if teacher_context is None else local_positions < teacher_context
    needed = shift_labels != IGNORE_INDEX
    if kl_mask is not None:
        needed = needed & kl_mask
    rows, columns = needed.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return None, kl_mask
    with_mask = inputs.get("attention_mask") is not None  # context parallelism allows only 1s in it
    T = whole_positions.shape[1]
    if with_mask:
        document_start = torch.zeros_like(whole_positions)
    else:
        index = torch.arange(T, device=device).expand(B, -1)
        document_start = torch.where(teacher_document_starts(whole_positions), index, 0).cummax(-1).values
    start = int(document_start[rows, columns + offset].min())
    end = int(columns.max()) + offset + 1
    window = {"input_ids": whole_ids[:, start:end], "position_ids": whole_positions[:, start:end]}
    if with_mask:
        window["attention_mask"] = torch.ones_like(window["input_ids"])
    with torch.no_grad():
        hidden = teacher_decoder(**window, use_cache=False).last_hidden_state
    on_slice = hidden.new_zeros(B, T_local, hidden.shape[-1])
    first = max(start, offset)
    on_slice[:, first - offset: end - offset] = hidden[:, first - start:]
    return on_slice, kl_mask


MAX_TEACHER_CALLS = 4


def teacher_on_documents(teacher_decoder, inputs, teacher_context):
    """The teacher's last hidden states on a packed row (zeros where no KL applies; None when none does), computed
    only where the KL applies: over each document's first `teacher_context` positions, documents being runs of
    position ids stepping by 1 (what transformers' packed-sequence mask separates).

    A row that packs several training blocks (`DataCollatorWithFlattening` with more than one example per micro-batch)
    would otherwise take the teacher's packed mask: SDPA's masked kernel over the whole row, whose work grows with the
    square of the row. Here the windows of equal length run as one batch on the plain causal kernel, each over its
    true prefix, so the hidden states are those of the whole-row call at every KL position. Batches it cannot split
    so (several rows, an attention mask, windows of more than `MAX_TEACHER_CALLS` lengths) take the whole-row call."""
    input_ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
    splittable = (input_ids is not None and positions is not None and input_ids.shape[0] == 1
                  and set(inputs) == {"input_ids", "position_ids"})
    if splittable:
        row = positions[0]
        starts = torch.nonzero(teacher_document_starts(positions)[0]).flatten().tolist()  # one host sync
        ends = [*starts[1:], row.numel()]
        first_positions = row[starts].tolist()
        windows = {}  # length -> starts
        for start, end, first in zip(starts, ends, first_positions):
            length = end - start if teacher_context is None else min(end - start, teacher_context - first)
            if length > 0:
                windows.setdefault(length, []).append(start)
        splittable = len(windows) <= MAX_TEACHER_CALLS
    if not splittable:
        with torch.no_grad():
            return teacher_decoder(**inputs, use_cache=False).last_hidden_state
    hidden = None
    for length, window_starts in windows.items():
        index = (torch.tensor(window_starts, device=row.device)[:, None]
                 + torch.arange(length, device=row.device))
        with torch.no_grad():
            out = teacher_decoder(input_ids=input_ids[0][index], position_ids=row[index],
                                  use_cache=False).last_hidden_state
        if hidden is None:
            hidden = out.new_zeros(1, row.numel(), out.shape[-1])
        hidden[0, index.flatten()] = out.reshape(-1, out.shape[-1])
    return hidden


def teacher_on_windows(teacher_decoder, inputs, window, windows_per_call=8):
    """The teacher's last hidden states at the positions of each document from `window` on (zeros elsewhere; None
    when no document is longer), each position seen through a sliding window of `window` tokens
    (`foxlm.evaluation.sliding_windows`: between half a window and a window of the tokens before it), as the original
    is run past its context in the evaluation. Documents are runs of position ids stepping by 1 (transformers' packed
    sequences), or whole rows without position ids; each window runs as a document of its own (positions from 0),
    `windows_per_call` of them a batch."""
    from .evaluation import sliding_windows

    input_ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("The teacher past its context reads documents from packed rows (position ids); it does not "
                         "take padded batches.")
    B, T = input_ids.shape
    positions = inputs.get("position_ids")
    positions = torch.arange(T, device=input_ids.device) if positions is None else positions
    starts = teacher_document_starts(positions.expand(B, -1))
    if bool((positions.expand(B, -1)[starts] != 0).any()):
        raise ValueError("The teacher past its context needs every document to start at position 0 (a block that "
                         "continues a document has no prefix to slide the window over).")
    starts = starts.cpu()
    passes = []  # (row, start, keep, end) in the row's coordinates
    for row in range(B):
        first = torch.nonzero(starts[row]).flatten().tolist()
        for doc_start, doc_end in zip(first, [*first[1:], T]):
            passes += [(row, doc_start + start, doc_start + keep, doc_start + end)
                       for start, keep, end in sliding_windows(doc_end - doc_start, window)]
    hidden = None
    for i in range(0, len(passes), windows_per_call):
        group = passes[i : i + windows_per_call]
        rows = torch.tensor([row for row, *_ in group], device=input_ids.device)
        index = torch.tensor([start for _, start, _, _ in group], device=input_ids.device)[:, None] + torch.arange(
            window, device=input_ids.device)
        with torch.no_grad():
            out = teacher_decoder(input_ids=input_ids[rows[:, None], index], use_cache=False).last_hidden_state
        if hidden is None:
            hidden = out.new_zeros(B, T, out.shape[-1])
        for j, (row, start, keep, end) in enumerate(group):
            hidden[row, keep:end] = out[j, keep - start :]
    return hidden


class DistillationTrainer(Trainer):
    """`Trainer` whose loss is next-token loss plus `kl_weight` x KL(teacher || model) at positions below
    `teacher_context` (position ids, so per document in packed batches).

    Both terms are sums over the predicting positions divided by their number (`num_items_in_batch` under gradient
    accumulation, as the model's own loss), so `kl_weight=0` gives exactly the next-token loss. The teacher must share
    the model's tokenizer; it is moved to the training device, frozen and kept in eval mode. With `distill_only`,
    positions below `teacher_context` take the KL term alone (the student follows the teacher there, not the data's
    next tokens), and the next-token loss trains the positions beyond. The two terms are logged
    as `ce` and `kl` (means over the logging interval, summed over processes as the loss is).

    With `kl_weight_past_context` > 0, positions at or beyond `teacher_context` take `kl_weight_past_context` x KL to
    the teacher run over a sliding window of `teacher_context` tokens (`teacher_on_windows`); the logged `kl` then
    counts each such position's KL times `kl_weight_past_context / kl_weight`, so that the loss stays ce + kl_weight x
    kl. Not with context parallelism.

    With several processes (DDP, or `ContextParallelDistillationTrainer`) the student runs through the wrapped model
    so that its gradients are reduced, and the loss is scaled by the number of processes as `Trainer` scales its own.
    """

    def __init__(self, *args, teacher=None, kl_weight=1.0, teacher_context=None, chunk_size=2048, distill_only=False,
                 kl_weight_past_context=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        if not kl_weight >= 0:
            raise ValueError(f"`kl_weight` must be non-negative, got {kl_weight!r}.")
        if not kl_weight_past_context >= 0:
            raise ValueError(f"`kl_weight_past_context` must be non-negative, got {kl_weight_past_context!r}.")
        if kl_weight_past_context and not (kl_weight > 0 and teacher_context):
            raise ValueError("`kl_weight_past_context` needs a `kl_weight` > 0 and a `teacher_context`: the window "
                             "the teacher sees past it.")
        if kl_weight_past_context and distill_only:
            raise ValueError("`distill_only` keeps the next-token loss past the teacher's context, where "
                             "`kl_weight_past_context` adds the windowed KL: choose one.")
        if teacher is None and kl_weight > 0:
            raise ValueError("`kl_weight` > 0 needs a `teacher` model.")
        self.teacher = None if teacher is None or kl_weight == 0 else teacher.to(self.args.device).eval()
        if self.teacher is not None:
            self.teacher.requires_grad_(False)
        if distill_only and self.teacher is None:
            raise ValueError("`distill_only` needs a `teacher` and a `kl_weight` > 0.")
        self.kl_weight, self.teacher_context, self.chunk_size = kl_weight, teacher_context, chunk_size
        self.distill_only, self.kl_weight_past_context = distill_only, kl_weight_past_context
        self._terms = {"ce": [], "kl": []}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shift_labels = inputs.pop("shift_labels", None)
        unwrapped = self.accelerator.unwrap_model(model)
        decoder, head = language_model_parts(unwrapped)
        context_parallel = getattr(decoder, "context_parallel", None)
        teacher_hidden = teacher_head = kl_mask = kl_scale = None
        # The decoder is called directly, past the model's forward that accelerate wraps in autocast: without this,
        # bf16 training would run in fp32, where FoX's attention has no fast kernel.
        with self.accelerator.autocast():
            if model is unwrapped:
                hidden = decoder(**inputs, use_cache=False).last_hidden_state
            else:
                # DDP reduces gradients only after a forward through its wrapper: the model's forward, asked for no
                # logits (the head runs in chunks below) and for the hidden states, whose last is the decoder's.
                no_logits = torch.zeros(0, dtype=torch.long, device=labels.device)
                hidden = model(**inputs, use_cache=False, output_hidden_states=True,
                               logits_to_keep=no_logits).hidden_states[-1]
            if self.teacher is not None:
                teacher_decoder, teacher_head = language_model_parts(self.teacher)
                if context_parallel is not None:
                    teacher_hidden, kl_mask = teacher_on_slice(context_parallel, teacher_decoder, inputs,
                                                               shift_labels, self.teacher_context)
                else:
                    teacher_hidden = teacher_on_documents(teacher_decoder, inputs, self.teacher_context)
                    if self.teacher_context is not None:
                        positions = inputs.get("position_ids")
                        if positions is None:
                            positions = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
                        kl_mask = positions < self.teacher_context
                    past = teacher_on_windows(teacher_decoder, inputs, self.teacher_context) \
                        if self.kl_weight_past_context else None
                    if past is not None:
                        beyond = ~kl_mask.expand(past.shape[:2])
                        teacher_hidden = past if teacher_hidden is None else torch.where(beyond[..., None], past,
                                                                                         teacher_hidden)
                        kl_scale = torch.where(beyond, self.kl_weight_past_context / self.kl_weight, 1.0)
                        kl_mask = None
            ce, kl, tokens, _ = chunked_distillation_loss(hidden, head, labels, teacher_hidden=teacher_hidden,
                                                          teacher_head=teacher_head, kl_mask=kl_mask, kl_scale=kl_scale,
                                                          chunk_size=self.chunk_size, shift_labels=shift_labels,
                                                          kl_only=self.distill_only)
        count = num_items_in_batch if num_items_in_batch is not None else tokens.clamp_min(1)
        count = count.to(ce.device) if torch.is_tensor(count) else count
        ce, kl = ce / count, kl / count
        self._terms["ce"].append(ce.detach())
        self._terms["kl"].append(kl.detach())
        loss = ce + self.kl_weight * kl
        if self.args.average_tokens_across_devices and num_items_in_batch is not None \
                and self.accelerator.num_processes > 1:
            # The count is that of all processes, and DDP averages the gradients: as Trainer.compute_loss does.
            loss = loss * self.accelerator.num_processes
        return (loss, {"loss": loss}) if return_outputs else loss

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self._terms["ce"]:
            # Each micro-batch term is already divided by the whole step's token count: sum per step, mean of steps.
            steps = max(1, len(self._terms["ce"]) // max(1, self.args.gradient_accumulation_steps))
            sums = torch.stack([torch.stack(values).sum() for values in self._terms.values()])
            if self.accelerator.num_processes > 1:
                # Each process's terms are its share of the whole batch's (divided by all processes' token count).
                sums = self.accelerator.reduce(sums, reduction="sum")
            for name, value in zip(self._terms, sums.tolist()):
                logs[name] = round(value / steps, 4)
            self._terms = {"ce": [], "kl": []}
        super().log(logs, *args, **kwargs)


class ContextParallelDistillationTrainer(ContextParallelTrainer, DistillationTrainer):
    """`DistillationTrainer` with FoX context parallelism (`ContextParallelTrainer`): each rank of a group holds a
    slice of every sequence; the teacher, which has no context parallelism, runs on each rank for the positions of
    its slice that take the KL term, over their true prefix (the window from their document's start, gathered from
    the group). The summed loss over the group and its token counts equal one process's on the whole sequence.

        ContextParallelDistillationTrainer(model=fox, args=..., teacher=llama, teacher_context=8192,
                                           context_parallel_size=4)   # under torchrun
    """

    def __init__(self, *args, kl_weight_past_context=0.0, **kwargs):
        if kl_weight_past_context:  # the sliding windows would need the whole sequence on each rank
            raise ValueError("`kl_weight_past_context` does not go with context parallelism yet.")
        super().__init__(*args, **kwargs)


@torch.no_grad()
def sample_documents(model, *, num_tokens, eos_token_id, max_length=1024, batch_size=256, seed=0, temperature=1.0,
                     cache_implementation=None):
    """Documents sampled from `model`, about `num_tokens` tokens in all: token id lists, each ending with EOS.

    Each document starts after an EOS, as a new document does in packed pretraining data, and is sampled at
    `temperature` (1: the model's own distribution) without top-k or top-p truncation; below 1 the documents are
    more coherent and less varied. A document ends at the model's first EOS or after `max_length` tokens (EOS
    appended). Sampling uses its own random stream
    (`seed`), so the caller's is untouched and the same seed gives the same documents on the same machine.

    `cache_implementation` is `generate`'s: None for its default (a cache that grows with the batch), "static" for
    one of fixed size, whose decoding step transformers compiles on a GPU (CUDA graphs: fewer launches a step, after a
    compilation at the first batch). Both sample from the same distribution (on a CPU, the same documents).
    """
    for name, value in (("num_tokens", num_tokens), ("max_length", max_length), ("batch_size", batch_size)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
    if not (isinstance(temperature, (int, float)) and 0 < temperature < float("inf")):
        raise ValueError(f"`temperature` must be a positive number, got {temperature!r}.")
    if cache_implementation not in (None, "static"):
        raise ValueError(f"`cache_implementation` must be None or 'static', got {cache_implementation!r}.")
    device = model.device
    config = GenerationConfig(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0,
                              max_new_tokens=max_length, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                              cache_implementation=cache_implementation)
    documents, total = [], 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            tqdm(total=num_tokens, desc="sampling from the original", unit="tok") as progress:
        torch.manual_seed(seed)
        while total < num_tokens:
            start = torch.full((batch_size, 1), eos_token_id, device=device)
            sampled = model.generate(start, attention_mask=torch.ones_like(start), generation_config=config)[:, 1:]
            ends = sampled == eos_token_id
            # Up to and including the first EOS; a document that never ended gets one.
            lengths = torch.where(ends.any(-1), ends.int().argmax(-1) + 1, sampled.shape[1]).tolist()
            if bool(ends[:, 0].all()):
                raise RuntimeError("the model sampled only EOS tokens after EOS for a whole batch: it does not "
                                   "generate text on its own; train without samples from it.")
            for row, length in zip(sampled.tolist(), lengths):
                document = row[:length] if row[length - 1] == eos_token_id else row[:length] + [eos_token_id]
                if len(document) > 1:  # an EOS alone teaches nothing
                    documents.append(document)
                    total += len(document)
                    progress.update(len(document))
                if total >= num_tokens:
                    break
    return documents
