"""Context (sequence) parallelism for FoX, the Ulysses scheme (docs/context-parallel.md).

Each rank of a process group holds one contiguous slice of every sequence, (batch, T / P, ...) for a group of P ranks.
Everything outside attention is per token and runs on the slice. In each attention layer, after the projections,
token shift, QK-norm and gate, one all-to-all turns q, k, v and log f from (T / P tokens, all heads) into (all T
tokens, heads / P); the unchanged attention (Triton kernel or reference: packed documents, ACP and the gate's running
sum over the whole sequence included) runs on the rank's heads, and a second all-to-all turns its output back into
the rank's slice. Heads that P does not divide split unevenly (9 over 4: 3, 2, 2, 2; `head_splits`), each rank
receiving the key/value heads its query heads read. The token shift reads the token before the slice from the
previous rank.

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
    """Raise a ValueError naming the numbers unless a group of `size` ranks can split the heads: at least one query
    head per rank, and query heads that are whole groups of the key/value heads (GQA)."""
    if num_heads < size:
        raise ValueError(f"context parallelism splits the attention heads over the group: num_attention_heads "
                         f"({num_heads}) must be at least the group size ({size}), one query head per rank.")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads}).")


def head_splits(num_heads, size):
    """How many query heads each of `size` ranks takes: contiguous ranges in rank order, sizes differing by at most
    one, the larger first (9 over 4: [3, 2, 2, 2])."""
    return [num_heads // size + (r < num_heads % size) for r in range(size)]


def kv_head_ranges(num_heads, num_kv_heads, size):
    """The key/value heads [start, stop) that each rank's query heads (`head_splits`) read: query head h reads kv
    head h // (num_heads / num_kv_heads). Neighbouring ranks share a kv head when a group straddles their ranges."""
    group, ranges, first = num_heads // num_kv_heads, [], 0
    for count in head_splits(num_heads, size):
        ranges.append((first // group, (first + count - 1) // group + 1))
        first += count
    return ranges


class ContextParallel:
    """The communication of one context-parallel group for a model's attention layers.

    Args:
        group: the process group whose ranks share each sequence (`torch.distributed.new_group`, or
            `device_mesh["cp"].get_group()`); its ranks hold consecutive slices in group-rank order.
        num_heads, num_kv_heads: the model's query and key/value heads; at least one query head per rank.

    When the ranks divide the query heads and divide, or are a multiple of, the key/value heads, every exchange
    moves equal parts (kv heads replicated first when fewer than the ranks). Otherwise rank r takes the query heads
    `head_splits` gives it and exactly the kv heads they read (`kv_head_ranges`; one straddling two ranks is sent
    to both), and exchanges use per-rank split sizes.
    """

    def __init__(self, group, num_heads, num_kv_heads):
        if not dist.is_initialized():
            raise RuntimeError("context parallelism needs torch.distributed initialized (init_process_group).")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        check_head_split(num_heads, num_kv_heads, self.size)
        self.even = num_heads % self.size == 0 and (num_kv_heads % self.size == 0 or self.size % num_kv_heads == 0)
        # Fewer kv heads than ranks: repeat each so that rank r's query heads find their kv head on rank r.
        self.kv_repeats = max(1, self.size // num_kv_heads)
        if not self.even:
            self.head_splits = head_splits(num_heads, self.size)
            self.first_head = sum(self.head_splits[: self.rank])
            ranges = kv_head_ranges(num_heads, num_kv_heads, self.size)
            self.kv_splits = [stop - start for start, stop in ranges]
            self.kv_sent = [h for start, stop in ranges for h in range(start, stop)]  # rank 0's kv heads first
            # The local kv head of each local query head; kept as GQA when it is the usual h // group pattern.
            group_size = num_heads // num_kv_heads
            heads = range(self.first_head, self.first_head + self.head_splits[self.rank])
            local = [h // group_size - ranges[self.rank][0] for h in heads]
            per_kv = len(local) // self.kv_splits[self.rank]
            uniform = len(local) % self.kv_splits[self.rank] == 0 and local == [i // per_kv for i in range(len(local))]
            self.kv_local_index = None if uniform else local
            self._indices = {}  # the index lists above as tensors, per device: no host-to-device copy per layer

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
        """The inverse of `to_heads`: (B, T, H / P, ...) -> (B, T / P, H, ...); with uneven heads, this rank's
        query heads back to every rank's slice."""
        B, T, Hl = x.shape[:3]
        rest = x.shape[3:]
        if not self.even:
            # One head per row: rank s's slice of this rank's heads goes to rank s; rank s's heads come back.
            rows = x.view(B, self.size, T // self.size, Hl, *rest).movedim(3, 0).movedim(2, 0)
            received = all_to_all(rows.reshape(self.size * Hl, B, T // self.size, *rest), self.group,
                                  self.head_splits, [Hl] * self.size)
            return received.movedim(0, 2).contiguous()  # as the even path's reshape gives it
        chunks = x.reshape(B, self.size, T // self.size, Hl, *rest).movedim(1, 0)
        # Row s of the output is this rank's slice for rank s's heads: in head order.
        received = all_to_all(chunks, self.group)
        return received.movedim(0, 2).reshape(B, T // self.size, self.size * Hl, *rest)

    def attention_inputs(self, q, k, v, log_fgate):
        """q, k, v (B, T / P, heads, D) and log f (B, T / P, heads) of the slice -> the whole sequence, this rank's
        heads (kv heads replicated first when they are fewer than the ranks)."""
        if not self.even:
            return self._uneven_attention_inputs(q, k, v, log_fgate)
        if self.kv_repeats > 1:
            k, v = k.repeat_interleave(self.kv_repeats, dim=2), v.repeat_interleave(self.kv_repeats, dim=2)
        return self.to_heads(q), self.to_heads(k), self.to_heads(v), self.to_heads(log_fgate[..., None])[..., 0]

    def local_heads(self, x):
        """This rank's query heads of a per-head tensor (B, heads), such as ACP's score bound."""
        if not self.even:
            return x[:, self.first_head: self.first_head + self.head_splits[self.rank]]
        return x.chunk(self.size, dim=1)[self.rank]

    def _heads_to_rows(self, x, send_splits, index=None):
        """(B, T / P, heads, ...) -> (B, T, received heads, ...) with one head per row of the exchange, so that the
        ranks can send different numbers of heads: `send_splits[r]` heads (those of `index`, in order, or all) to
        rank r, and as many of its slice back from every rank."""
        B, Tl = x.shape[:2]
        rest = x.shape[3:]
        rows = x.movedim(2, 0)
        if index is not None:  # repeated heads: the backward sums their gradients
            rows = rows.index_select(0, self._index(index, x.device))
        n = send_splits[self.rank]
        received = all_to_all(rows, self.group, [n] * self.size, send_splits)  # (P * n, B, T / P, ...)
        received = received.view(self.size, n, B, Tl, *rest).movedim(2, 0).movedim(2, 3)
        return received.reshape(B, self.size * Tl, n, *rest)

    def _index(self, values, device):
        key = (tuple(values), device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(values, device=device)
        return self._indices[key]

    def _uneven_attention_inputs(self, q, k, v, log_fgate):
        q = self._heads_to_rows(q, self.head_splits)
        log_fgate = self._heads_to_rows(log_fgate[..., None], self.head_splits)[..., 0]
        k, v = (self._heads_to_rows(x, self.kv_splits, self.kv_sent) for x in (k, v))
        if self.kv_local_index is not None:
            # This rank's query heads read their kv heads unevenly (5 heads over 2 kv heads: 3 and 2): no GQA group
            # size fits, so one kv head per query head, a local copy.
            index = self._index(self.kv_local_index, k.device)
            k, v = k.index_select(2, index), v.index_select(2, index)
        return q, k, v, log_fgate

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
    return slice_batch(batch, dist.get_rank(group), dist.get_world_size(group), pad_token_id)


def slice_batch(batch, rank, size, pad_token_id=0):
    """`shard_batch` for rank `rank` of a group of `size`, without the group (e.g. in a DataLoader worker)."""
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
