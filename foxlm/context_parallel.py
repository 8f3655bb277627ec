"""Context (sequence) parallelism for FoX, the Ulysses scheme (docs/context-parallel.md).

Each rank of a process group holds one contiguous slice of every sequence, (batch, T / P, ...) for a group of P ranks.
Everything outside attention is per token and runs on the slice. In each attention layer, after the projections,
token shift, QK-norm and gate, one all-to-all turns q, k, v and log f from (T / P tokens, all heads) into (all T
tokens, heads / P); the unchanged attention (Triton kernel or reference: packed documents, ACP and the gate's running
sum over the whole sequence included) runs on the rank's heads, and a second all-to-all turns its output back into
the rank's slice. The token shift reads the token before the slice from the previous rank.

`ContextParallel` does the communication (autograd-aware: the backward of an all-to-all is the reverse all-to-all);
`FoxPreTrainedModel.enable_context_parallel(group)` switches a model to it. `shard_batch` cuts a batch into the
rank's slice, labels shifted before the cut, and `token_count` gives the loss's global divisor. torch only: this
module is part of the model's remote code.
"""

import torch
import torch.distributed as dist

IGNORE_INDEX = -100  # the label transformers' losses skip
# Keys of a batch that describe packed documents over the whole sequence: `shard_batch` keeps them for every rank,
# since the model reads the whole sequence's layout (`FoxModel.forward`).
WHOLE_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` along dim 0 whose backward is the reverse exchange (torch's own autograd version,
    `torch.distributed.nn.functional.all_to_all_single`, is deprecated; its successor is a private module)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None


def all_to_all(x, group, output_splits=None, input_splits=None):
    """Rows of x (dim 0) exchanged over `group`: `input_splits[r]` rows go to rank r, `output_splits[r]` come from
    it (equal parts by default); differentiable."""
    size = dist.get_world_size(group)
    input_splits = input_splits or [x.shape[0] // size] * size
    output_splits = output_splits or input_splits
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def check_head_split(num_heads, num_kv_heads, size):
    """Raise a ValueError naming the numbers unless a group of `size` ranks can split the heads: query heads
    divisible by it, key/value heads divisible by it or dividing it."""
    if num_heads % size:
        raise ValueError(f"context parallelism splits the attention heads over the group: num_attention_heads "
                         f"({num_heads}) must be divisible by the group size ({size}).")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be divisible by the context-parallel group "
                         f"size ({size}), or divide it (then each kv head is replicated).")


class ContextParallel:
    """The communication of one context-parallel group for a model's attention layers.

    Args:
        group: the process group whose ranks share each sequence (`torch.distributed.new_group`, or
            `device_mesh["cp"].get_group()`); its ranks hold consecutive slices in group-rank order.
        num_heads, num_kv_heads: the model's query and key/value heads. Query heads must divide among the ranks;
            key/value heads too, or (fewer kv heads than ranks) the ranks must be a multiple of them, and each kv head
            is then replicated so that every rank holds one.
    """

    def __init__(self, group, num_heads, num_kv_heads):
        if not dist.is_initialized():
            raise RuntimeError("context parallelism needs torch.distributed initialized (init_process_group).")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        check_head_split(num_heads, num_kv_heads, self.size)
        # Fewer kv heads than ranks: repeat each so that rank r's query heads find their kv head on rank r.
        self.kv_repeats = max(1, self.size // num_kv_heads)

    def __repr__(self):
        return f"ContextParallel(rank {self.rank} of {self.size})"

    def to_heads(self, x):
        """(B, T / P, H, ...) of this rank's slice -> (B, T, H / P, ...): the whole sequence, this rank's heads."""
        B, Tl, H = x.shape[:3]
        rest = x.shape[3:]
        chunks = x.reshape(B, Tl, self.size, H // self.size, *rest).movedim(2, 0)
        # Row s of the output is rank s's slice of the sequence for this rank's heads: in sequence order.
        received = all_to_all(chunks, self.group)
        return received.movedim(0, 1).reshape(B, self.size * Tl, H // self.size, *rest)

    def to_sequence(self, x):
        """The inverse of `to_heads`: (B, T, H / P, ...) -> (B, T / P, H, ...)."""
        B, T, Hl = x.shape[:3]
        rest = x.shape[3:]
        chunks = x.reshape(B, self.size, T // self.size, Hl, *rest).movedim(1, 0)
        # Row s of the output is this rank's slice for rank s's heads: in head order.
        received = all_to_all(chunks, self.group)
        return received.movedim(0, 2).reshape(B, T // self.size, self.size * Hl, *rest)

    def attention_inputs(self, q, k, v, log_fgate):
        """q, k, v (B, T / P, heads, D) and log f (B, T / P, heads) of the slice -> the whole sequence, this rank's
        heads (kv heads replicated first when they are fewer than the ranks)."""
        if self.kv_repeats > 1:
            k, v = k.repeat_interleave(self.kv_repeats, dim=2), v.repeat_interleave(self.kv_repeats, dim=2)
        return self.to_heads(q), self.to_heads(k), self.to_heads(v), self.to_heads(log_fgate[..., None])[..., 0]

    def local_heads(self, x):
        """This rank's query heads of a per-head tensor (B, heads), such as ACP's score bound."""
        return x.chunk(self.size, dim=1)[self.rank]

    def previous_token(self, last):
        """The token before this rank's slice: `last` (B, 1, ...) is this slice's last token, sent to the next rank;
        the first rank gets zeros (the start of the sequence). Gradients flow back to the sender."""
        to_next = [int(r == self.rank + 1) for r in range(self.size)]
        from_previous = [int(r == self.rank - 1) for r in range(self.size)]
        send = last.movedim(1, 0)[: sum(to_next)]
        received = all_to_all(send, self.group, output_splits=from_previous, input_splits=to_next)
        # The first rank receives nothing and takes zeros, through `received` all the same: every rank must run the
        # exchange's backward (itself an all-to-all), and autograd runs it only for outputs that were used.
        return torch.cat([received, torch.zeros_like(last.movedim(1, 0))])[:1].movedim(0, 1)

    def gather_sequence(self, x):
        """(B, T / P) -> (B, T), no gradient: the whole sequence's position ids or mask, from every rank's slice."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def local_tokens(self, x):
        """This rank's slice (B, T / P, ...) of a whole-sequence tensor (B, T, ...)."""
        return x.chunk(self.size, dim=1)[self.rank]


def shard_batch(batch, group, pad_token_id=0):
    """This rank's slice of a causal-LM batch for a context-parallel model (`enable_context_parallel(group)`).

    - `labels` are shifted before the cut (token t predicts label t + 1, as transformers' loss does), and the slice is
      returned as `shift_labels` (what the loss reads) and as `labels` (what `Trainer` counts).
    - `input_ids`, `inputs_embeds`, `position_ids`, `attention_mask` and a given `shift_labels` are cut along the
      sequence; `cu_seq_lens_*` and `max_length_*` describe the whole sequence and are kept.
    - A sequence length that the group size does not divide is padded at the end: pad tokens (`pad_token_id`) whose
      positions continue the last document and whose labels are ignored, so that no real token's output or loss
      changes (causal attention never looks ahead). With `cu_seq_lens_*` (one packed row) the last document grows.

    Returns a new dict; other keys are copied unchanged. The loss of each rank, with `num_items_in_batch` from
    `token_count`, is its part of the single-process loss: their sum is that loss, and the sum of the ranks'
    gradients is its gradient (docs/context-parallel.md, "Loss and gradients").
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens = batch.get("input_ids", batch.get("inputs_embeds"))
    if tokens is None:
        raise ValueError("shard_batch needs `input_ids` or `inputs_embeds` in the batch.")
    B, T = tokens.shape[:2]
    pad = -T % size
    batch = dict(batch)
    labels, shift_labels = batch.pop("labels", None), batch.pop("shift_labels", None)
    if shift_labels is None and labels is not None:
        shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if pad:
        batch.update(_padded(batch, B, T, pad, pad_token_id))
        if shift_labels is not None:
            shift_labels = torch.nn.functional.pad(shift_labels, (0, pad), value=IGNORE_INDEX)
    if shift_labels is not None:
        batch["labels"] = batch["shift_labels"] = shift_labels
    out = {}
    for key, value in batch.items():
        if key in WHOLE_SEQUENCE_KEYS or not isinstance(value, torch.Tensor) or value.dim() < 2:
            out[key] = value
        elif value.shape[1] == T + pad:
            out[key] = value.chunk(size, dim=1)[rank].contiguous()
        elif key == "position_ids" and value.shape[1] == 1:
            out[key] = value
        else:
            raise ValueError(f"shard_batch: `{key}` has {value.shape[1]} positions along dim 1, not the batch's "
                             f"sequence length {T}; cannot cut it into the rank's slice.")
    return out


def _padded(batch, B, T, pad, pad_token_id):
    """The batch's per-token tensors with `pad` tokens appended to each row (see `shard_batch`)."""
    out = {}
    if "input_ids" in batch:
        out["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, pad), value=pad_token_id)
    if "inputs_embeds" in batch:
        out["inputs_embeds"] = torch.nn.functional.pad(batch["inputs_embeds"], (0, 0, 0, pad))
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = torch.nn.functional.pad(batch["attention_mask"], (0, pad), value=1)
    position_ids = batch.get("position_ids")
    if position_ids is not None:
        tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
        out["position_ids"] = torch.cat([position_ids, tail], dim=1)
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if batch.get(key) is not None:
            if B != 1:
                raise ValueError(f"shard_batch pads sequences to a multiple of the group size; with `{key}` the "
                                 f"batch must be one packed row, got {B} rows of {T} tokens.")
            out[key] = batch[key].clone()
            out[key][-1] += pad
    # The last document grew; FoX reads the longest document off the boundaries, never these hints.
    out.update({key: None for key in ("max_length_q", "max_length_k") if key in batch})
    return out


def token_count(shift_labels, group):
    """The loss's divisor: labels not ignored in `shift_labels` (this rank's slice, from `shard_batch`) summed over
    the group, as a tensor. Pass it to the model as `num_items_in_batch`."""
    count = shift_labels.ne(IGNORE_INDEX).sum()
    dist.all_reduce(count, group=group)
    return count
