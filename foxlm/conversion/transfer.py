"""Attention transfer: train a converted FoX model's attention to reproduce its source's attention, layer by layer.

The first stage of retrofitting, after LoLCATs (Zhang et al., ICLR 2025): the source LLaMA (the teacher, frozen) runs
on a batch, and at every layer the input of `self_attn` (the normalised hidden states) and its output (RoPE attention
through `o_proj`, before the residual add) are captured. Each FoX attention layer of the converted model (the student)
is fed its layer's captured input and trained to give the captured output. The loss of layer l depends only on layer
l's parameters, so every layer trains on the teacher's own hidden states at once, with no backward through the model.
The design, and why: docs/retrofit.md.
"""

import itertools
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from ..data import evenly_spaced, pack_into_blocks, tokenize_documents
from ..modeling_fox import FoxAttention, FoxAttentionLayout

DEFAULT_LR = 1e-2


@dataclass
class TransferRecord:
    """What `transfer_attention` did. Errors are per layer: mean squared error of the student's attention output
    against the teacher's, divided by the mean square of the teacher's (0 is exact, 1 is as far as outputting zeros),
    over the evaluation batches (the first training batch unless `eval_batches` was given)."""

    steps: int
    seconds: float
    trained_parameters: int
    qk_rank: int
    error_before: list[float] = field(default_factory=list)
    error_after: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # the training loss (mean over layers) at every step


class LowRankUpdate(nn.Module):
    """LoRA's update as a `torch.nn.utils.parametrize` parametrisation of a weight: `W + B A`, with B zero at first so
    the weight starts unchanged. A and B are fp32 (the master copy) whatever W's dtype; the sum is rounded to W's
    dtype, so training sees the weight that merging will store."""

    def __init__(self, weight, rank, generator):
        super().__init__()
        out_features, in_features = weight.shape
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)  # PEFT's default for A
        self.lora_A.data = self.lora_A.data.to(weight.device)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, dtype=torch.float32, device=weight.device))

    def forward(self, weight):
        return weight + (self.lora_B @ self.lora_A).to(weight.dtype)


def token_batches(tokenizer, texts, *, block_size, batch_size, max_blocks=None):
    """Training data for `transfer_attention`: (batch_size, block_size) input-id tensors of the texts, tokenized with
    EOS after each, packed and cut into blocks, at most `max_blocks` blocks spread over the stream. The last batch may
    hold fewer blocks."""
    documents = tokenize_documents(tokenizer, texts, add_bos=False)
    return document_batches(documents, block_size=block_size, batch_size=batch_size, max_blocks=max_blocks)


def document_batches(documents, *, block_size, batch_size, max_blocks=None):
    """`token_batches` of documents already tokenized (token id lists, each ending with EOS)."""
    blocks = evenly_spaced(pack_into_blocks(documents, block_size).tolist(), max_blocks)
    return list(torch.tensor(blocks).split(batch_size))


def decoder_layers(model, name):
    """The decoder layers of a transformers causal LM (or base model) whose layers each have `self_attn`."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError(f"`{name}` must be a decoder model whose `model.layers[i].self_attn` are its attention "
                         f"layers (LLaMA-family or FoX), got {type(model).__name__}.")
    return layers


def check_input_ids(batch, name):
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.dtype.is_floating_point or 0 in batch.shape:
        shape = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"`{name}` must hold (batch, seq_len) integer tensors of input ids, got {shape}.")
    return batch


@torch.no_grad()
def capture_attention(teacher, input_ids):
    """Run the teacher on `input_ids`; per layer, the input of `self_attn` and its output (before the residual add).

    The teacher builds its own masks and position embeddings; forward hooks read what its layers pass and return."""
    inputs, outputs, handles = {}, {}, []

    def hook(index):
        def capture(module, args, kwargs, output):
            inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            outputs[index] = output[0] if isinstance(output, tuple) else output
        return capture

    layers = decoder_layers(teacher, "teacher")
    try:
        for index, layer in enumerate(layers):
            handles.append(layer.self_attn.register_forward_hook(hook(index), with_kwargs=True))
        embeddings = teacher.get_input_embeddings()
        with autocast_like(embeddings):
            teacher.base_model(input_ids=input_ids.to(embeddings.weight.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [inputs[i] for i in range(len(layers))], [outputs[i] for i in range(len(layers))]


def layer_errors(student, captured_inputs, captured_outputs):
    """Yield, layer by layer, the student's attention-output error on the captured hidden states: (squared error sum,
    teacher square sum), fp32 scalars with the graph to the student's layer parameters when grad is on.

    Yielding one layer at a time lets the caller backpropagate a layer's loss before the next layer's forward, so only
    one layer's activations are held."""
    rotary = student.base_model.rotary_emb  # a student converted with RoPE kept needs the teacher's positions
    for attention, hidden, target in zip(fox_attention_layers(student), captured_inputs, captured_outputs):
        device = attention.q_proj.weight.device
        hidden, target = hidden.to(device), target.to(device).float()
        position_embeddings = None
        if rotary is not None:
            positions = torch.arange(hidden.shape[1], device=device)[None]
            position_embeddings = tuple(t.to(device) for t in rotary(hidden, positions))
        with autocast_like(attention.v_proj):
            output, _ = attention(hidden, layout=FoxAttentionLayout(), position_embeddings=position_embeddings)
        yield (output.float() - target).square().sum(), target.square().sum()


def fox_attention_layers(student):
    layers = [layer.self_attn for layer in decoder_layers(student, "student")]
    if not all(isinstance(attention, FoxAttention) for attention in layers):
        raise ValueError(f"`student` must be a FoX model (FoxAttention layers), got {type(student).__name__}.")
    return layers


def autocast_like(module):
    """Autocast to the compute dtype of `module`'s weights: their own dtype when it is a half type; bf16 for fp32
    weights on a GPU, where the attention kernels run in half precision (the trained parameters stay fp32 master
    weights either way); no autocast for fp32 weights on a CPU."""
    weight = next(module.parameters())
    if weight.dtype in (torch.float16, torch.bfloat16):
        return torch.autocast(weight.device.type, dtype=weight.dtype)
    return torch.autocast(weight.device.type, dtype=torch.bfloat16, enabled=weight.device.type == "cuda")


@torch.no_grad()
def attention_errors(teacher, student, batches):
    """Per-layer attention-output error of `student` against `teacher` on `batches` (input ids (B, T)): the squared
    error summed over the batches divided by the teacher output's summed square (see `TransferRecord`)."""
    errors = squares = None
    for batch in batches:
        inputs, outputs = capture_attention(teacher, check_input_ids(batch, "batches"))
        pairs = torch.tensor([[e.item(), s.item()] for e, s in layer_errors(student, inputs, outputs)],
                             dtype=torch.float64)
        errors = pairs[:, 0] if errors is None else errors + pairs[:, 0]
        squares = pairs[:, 1] if squares is None else squares + pairs[:, 1]
    if errors is None:
        raise ValueError("`batches` is empty: give at least one (batch, seq_len) tensor of input ids.")
    return (errors / squares.clamp_min(torch.finfo(torch.float64).tiny)).tolist()


def gate_parameters(attention):
    """The forget gate's parameters and, where the model has them, the token shift's and the output gate's."""
    gate = attention.fgate_proj if attention.fgate_proj is not None else attention.fgate_bias
    modules = [gate, attention.k_shift_proj, attention.v_shift_proj, attention.ogate_proj]
    return [p for module in modules if module is not None for p in module.parameters()]


def transfer_attention(teacher, student, batches, *, steps, lr=DEFAULT_LR, qk_rank=0, eval_batches=None, seed=0,
                       progress=True):
    """Train `student`'s attention layers (a FoX model converted from `teacher`) to reproduce `teacher`'s attention
    outputs on the teacher's own hidden states, every layer at once; returns a `TransferRecord`.

    Args:
        teacher: the source model (LLaMA family), never changed: run in eval mode without grad.
        student: a FoxForCausalLM (or FoxModel) with the teacher's layer count and hidden size, changed in place.
        batches: an iterable of (batch, seq_len) input-id tensors, cycled through when `steps` is larger.
        steps: optimizer steps (0 only measures the errors).
        lr: Adam's learning rate (constant; no weight decay).
        qk_rank: 0 trains the forget gates (and token shift, output gate) only; r > 0 also trains a rank-r update
            of each layer's q_proj and k_proj weights, merged into them at the end (the student stays a plain model).
        eval_batches: batches on which `error_before` and `error_after` are measured (default: the first batch).
        seed: seeds the low-rank updates' initialisation, the only randomness (the data order is the caller's).
        progress: show a tqdm bar with the loss.

    Trained: each layer's forget gate (`fgate_proj` weight and bias), token shift and output gate if the student has
    them (`k_shift_proj`, `v_shift_proj`, `ogate_proj`), in fp32 (cast back to the model's dtype at the end), plus
    the q/k updates with `qk_rank`; every other tensor stays bit-identical. The student runs in eval mode (no
    dropout) and gets back its training mode and `requires_grad` flags at the end. Teacher and student compute
    under autocast: to the model's dtype when it is bf16 or fp16, to bf16 for an fp32 model on a GPU.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"`steps` must be a non-negative integer, got {steps!r}.")
    if not lr > 0:
        raise ValueError(f"`lr` must be positive, got {lr!r}.")
    if isinstance(qk_rank, bool) or not isinstance(qk_rank, int) or qk_rank < 0:
        raise ValueError(f"`qk_rank` must be a non-negative integer, got {qk_rank!r}.")
    teacher_layers, attentions = decoder_layers(teacher, "teacher"), fox_attention_layers(student)
    if len(teacher_layers) != len(attentions):
        raise ValueError(f"`teacher` has {len(teacher_layers)} layers but `student` has {len(attentions)}; the "
                         "student must be converted from the teacher.")
    if teacher.config.hidden_size != student.config.hidden_size:
        raise ValueError(f"`teacher` has hidden size {teacher.config.hidden_size} but `student` has "
                         f"{student.config.hidden_size}; the student must be converted from the teacher.")
    iterator = iter(batches)
    first = next(iterator, None)
    if first is None:
        raise ValueError("`batches` is empty: give at least one (batch, seq_len) tensor of input ids.")
    eval_batches = [first] if eval_batches is None else list(eval_batches)
    if not eval_batches:
        raise ValueError("`eval_batches` is empty: leave it None (the first batch) or give input-id tensors.")

    was_training = teacher.training, student.training
    requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
    teacher.eval()
    student.eval()
    student.requires_grad_(False)
    gates = [p for attention in attentions for p in gate_parameters(attention)]
    gate_dtypes = [p.dtype for p in gates]
    updates = []
    try:
        for p in gates:
            p.data = p.data.float()
        if qk_rank:
            generator = torch.Generator().manual_seed(seed)
            for attention in attentions:
                for projection in (attention.q_proj, attention.k_proj):
                    update = LowRankUpdate(projection.weight, qk_rank, generator)
                    parametrize.register_parametrization(projection, "weight", update)
                    updates.append(projection)
        trained = gates + [p for projection in updates for p in projection.parametrizations.weight[0].parameters()]
        if not trained:
            raise ValueError("`student` has no forget gate to train and `qk_rank` is 0: nothing to transfer.")
        for p in trained:
            p.requires_grad_(True)

        error_before = attention_errors(teacher, student, eval_batches)
        optimizer = torch.optim.Adam(trained, lr=lr)
        losses, start = [], time.perf_counter()
        stream = itertools.cycle(itertools.chain([first], iterator))
        bar = tqdm(range(steps), desc="attention transfer", unit="step", disable=not progress)
        for _ in bar:
            inputs, outputs = capture_attention(teacher, check_input_ids(next(stream), "batches"))
            total = 0.0
            for error, square in layer_errors(student, inputs, outputs):
                # Normalised by the teacher output's mean square, so that every layer weighs alike whatever its scale.
                loss = error / square.clamp_min(torch.finfo(torch.float32).tiny)
                loss.backward()  # this layer's graph is freed before the next layer's forward
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total / len(attentions))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        seconds = time.perf_counter() - start
        error_after = attention_errors(teacher, student, eval_batches)
    finally:
        # Whatever happened, the student leaves as a plain model: updates merged (set_ gives each merged weight new
        # storage, so a teacher sharing the old one is untouched), gates in their dtype, flags and modes restored.
        for projection in updates:
            parametrize.remove_parametrizations(projection, "weight", leave_parametrized=True)
        for p, dtype in zip(gates, gate_dtypes):
            p.data = p.data.to(dtype)
            p.grad = None
        for name, p in student.named_parameters():
            p.requires_grad_(requires_grad.get(name, False))
        teacher.train(was_training[0])
        student.train(was_training[1])
    return TransferRecord(steps=steps, seconds=round(seconds, 3), qk_rank=qk_rank,
                          trained_parameters=sum(p.numel() for p in trained), error_before=error_before,
                          error_after=error_after, loss=losses)
