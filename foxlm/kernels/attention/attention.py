"""`forgetting_attention`: the one entry point through which every FoX layer computes attention.

It validates the arguments once and dispatches (`dispatch.runs_on_triton`): the Triton kernels for CUDA tensors
(`attention_launch.py`), the pure-PyTorch reference otherwise (`attention_reference.py`), or what `backend` forces.
Both run inside one torch custom op, `torch.ops.foxlm.forgetting_attention`, with a registered fake (meta)
implementation and autograd formula, so `torch.compile(fullgraph=True)` sees a single op and no graph break; its
backward is a second custom op.
"""

import logging
import math
import weakref
from typing import Optional

import torch

from ..acp import measured_score_bound, record_pruned_counts, recording_pruned_counts
from ..common import on_device_of
from ..dispatch import runs_on_triton
from .attention_reference import (attention_backward_reference, fgate_cumsum_float64,
                                  forgetting_attention_reference, log_fgate_gradient_reference)

try:
    from .attention_gate_scan import triton_gate_cumsum, triton_gate_gradient
    from .attention_launch import triton_attention_backward, triton_attention_forward
except ImportError:  # no Triton (CPU-only torch builds, remote code on such machines)
    triton_attention_forward = triton_attention_backward = triton_gate_cumsum = triton_gate_gradient = None

logger = logging.getLogger(__name__)

_warned_reference_on_gpu = False
# The packed-sequence boundaries checked last, as (weak reference, tensor version, packed length, longest sequence):
# every layer of a forward passes the same tensor, and reading its values is a device-to-host copy (a sync), so it
# is read once.
_checked_cu_seqlens = (None, -1, -1, 0)


def _check_inputs(q, k, v, log_fgate, fgate_cumsum, cu_seqlens, seq_start):
    """Raises ValueError on a bad argument; returns the longest packed sequence (None without `cu_seqlens`), which
    checking the boundaries reads anyway."""
    longest = None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"`{name}` must be a 4-D tensor (batch, seqlen, heads, head_dim), got {_describe(t)}.")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"`{name}` must be float16, bfloat16, float32 or float64, got {t.dtype}.")
        if t.device != q.device:
            raise ValueError(f"`{name}` is on {t.device} but `q` is on {q.device}; all inputs must share a device.")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"`q`, `k` and `v` must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    B, Tq, Hq, D = q.shape
    Bk, Tk, Hkv, Dk = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"`v` must match `k` in (batch, seqlen, heads): got {tuple(v.shape)} and {tuple(k.shape)}.")
    if Bk != B or Dk != D:
        raise ValueError(f"`k` {tuple(k.shape)} must match `q` {tuple(q.shape)} in batch and head_dim.")
    if v.shape[3] != D:
        raise ValueError(f"`v` {tuple(v.shape)} must have the head_dim of `q` and `k` ({D}); the kernels read v "
                         "tiles of that width.")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}).")
    if Tq > Tk:
        raise ValueError(f"`q` has {Tq} tokens but `k` only {Tk}; queries align to the last keys, so Tq <= Tk.")
    if (log_fgate is None) == (fgate_cumsum is None):
        raise ValueError("pass exactly one of `log_fgate` and `fgate_cumsum`.")
    gate_name, gate = ("log_fgate", log_fgate) if log_fgate is not None else ("fgate_cumsum", fgate_cumsum)
    if not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (B, Tk, Hq):
        raise ValueError(f"`{gate_name}` must have shape (batch, key seqlen, query heads) = {(B, Tk, Hq)}, "
                         f"got {_describe(gate)}.")
    if gate.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`{gate_name}` must be float32 (compute it as logsigmoid(logit.float())), got {gate.dtype}.")
    if gate.device != q.device:
        raise ValueError(f"`{gate_name}` is on {gate.device} but `q` is on {q.device}.")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64) or len(cu_seqlens) < 2:
            raise ValueError(f"`cu_seqlens` must be a 1-D int32/int64 tensor of sequence boundaries "
                             f"[0, ..., total], got {_describe(cu_seqlens)}.")
        if B != 1 or Tq != Tk:
            raise ValueError(f"with `cu_seqlens`, sequences are packed along dim 1 of batch 1 and Tq == Tk; "
                             f"got q {tuple(q.shape)}, k {tuple(k.shape)}.")
        if cu_seqlens.device != q.device:
            raise ValueError(f"`cu_seqlens` is on {cu_seqlens.device} but `q` is on {q.device}.")
        if seq_start is not None:
            raise ValueError("`seq_start` (left padding) cannot be combined with `cu_seqlens`: packed batches "
                             "have no padding.")
        longest = _longest_packed_sequence(cu_seqlens, Tq)
    if seq_start is not None:
        if seq_start.dim() != 1 or seq_start.shape[0] != B or seq_start.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"`seq_start` must be a 1-D int tensor of length batch={B}, got {_describe(seq_start)}.")
        if seq_start.device != q.device:
            raise ValueError(f"`seq_start` is on {seq_start.device} but `q` is on {q.device}.")
    return longest


def rising_gate_heads(gate, gate_is_cumsum, cu_seqlens, seq_start):
    """(batch, query heads) bool: where some used log f is > 0 (c rises). ACP's bound assumes c never rises (a
    forget gate f <= 1), so the caller prunes nothing there (U = inf): exact, on the device, without a sync."""
    rise = gate.detach()
    if gate_is_cumsum:  # log f_t = c_t - c_{t-1}; only differences within a sequence matter, not where c starts
        rise = torch.nn.functional.pad(rise.diff(dim=1), (0, 0, 1, 0))
        if cu_seqlens is not None:
            starts = torch.zeros(rise.shape[1] + 1, dtype=torch.bool, device=rise.device)
            starts[cu_seqlens[:-1].long()] = True  # on the device: no sync for the boundaries
            rise = rise.masked_fill(starts[None, :-1, None], 0.0)
    if seq_start is not None:  # keys before seq_start are unused; with c given, so is the step into seq_start
        positions = torch.arange(rise.shape[1], device=rise.device)[None, :]
        unused = positions <= seq_start[:, None] if gate_is_cumsum else positions < seq_start[:, None]
        rise = rise.masked_fill(unused[:, :, None], 0.0)
    return (rise > 0).any(dim=1)


def packed_sequence_lengths(cu_seqlens, total):
    """The lengths of packed sequences, after checking their boundaries `cu_seqlens`: a 1-D int tensor that starts at
    0, never decreases and ends at `total`. Reading the boundaries syncs with the device, so the tensor is remembered
    as checked: the layers of a model that share one `cu_seqlens` cost one sync per forward, not one each."""
    global _checked_cu_seqlens
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"`cu_seqlens` must start at 0, be non-decreasing and end at the packed length {total}, "
                         f"got {bounds}.")
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    _checked_cu_seqlens = (weakref.ref(cu_seqlens), cu_seqlens._version, total, max(lengths))
    return lengths


def _longest_packed_sequence(cu_seqlens, total):
    """The longest packed sequence, from `packed_sequence_lengths` unless this very tensor, unchanged, was read last."""
    ref, version, checked_total, longest = _checked_cu_seqlens
    if ref is not None and ref() is cu_seqlens and version == cu_seqlens._version and checked_total == total:
        return longest
    return max(packed_sequence_lengths(cu_seqlens, total))


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def forgetting_attention(
    q,
    k,
    v,
    log_fgate=None,
    *,
    fgate_cumsum=None,
    sm_scale=None,
    cu_seqlens=None,
    max_seqlen=None,
    seq_start=None,
    backend="auto",
    prune_eps=None,
    score_bound=None,
):
    """Causal Forgetting Attention: `o_i = sum_j softmax_j(sm_scale * q_i.k_j + c_i - c_j) v_j`.

    Args:
        q: (batch, q_len, query_heads, head_dim).
        k, v: (batch, k_len, kv_heads, head_dim) with `kv_heads` dividing `query_heads` (GQA/MQA) and
            `q_len <= k_len`; the queries are the last `q_len` positions (chunked prefill against a cache).
        log_fgate: (batch, k_len, query_heads) float32, log of the forget gate of every key position.
            `c` is its inclusive cumulative sum, restarted at every packed sequence.
        fgate_cumsum: alternatively, `c` itself (batch, k_len, query_heads) float32, as a cache keeps it.
        sm_scale: multiplies q.k only (default 1/sqrt(head_dim)); the decay bias is added unscaled.
        cu_seqlens: (num_seqs + 1,) int boundaries of sequences packed along dim 1 (batch must be 1). Sequences
            of one length run as a batch (the same result, on the faster kernels for batches).
        max_seqlen: longest packed sequence (a launch hint; taken from `cu_seqlens` when omitted).
        seq_start: (batch,) int, left padding: keys before `seq_start[b]` are ignored and their gates unused.
            Right padding needs nothing: causal queries never see later positions.
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" or "reference".
        prune_eps: Adaptive Computation Pruning tolerance in (0, 1) (docs/acp.md): the Triton kernels skip
            tiles whose decay proves their attention weight negligible, so that each query loses at most `prune_eps`
            of its attention mass (output error <= 2 * prune_eps * max|v|; `foxlm.kernels.acp`). A head whose log f
            is > 0 somewhere (the bound's premise fails) is computed without pruning. The
            reference backend computes everything (exact). Read what was skipped with
            `foxlm.kernels.acp.acp_statistics()`.
        score_bound: U >= |sm_scale * q_i.k_j| for every pair, a float or a float tensor broadcastable to
            (batch, query_heads), e.g. from QK-norm scales; default: measured from the largest norms of q and k.

    Returns:
        (batch, q_len, query_heads, head_dim) in the dtype of `q`.
    """
    longest_packed = _check_inputs(q, k, v, log_fgate, fgate_cumsum, cu_seqlens, seq_start)
    if max_seqlen is None:
        max_seqlen = longest_packed  # read by the check: no second sync
    packed_length = q.shape[1]
    as_batch = _equal_packed_sequences(cu_seqlens, longest_packed, packed_length)
    if as_batch:
        # Sequences of one length are a batch: the kernels for batches (the Hopper ones among them) take them.
        count = len(cu_seqlens) - 1
        q, k, v, log_fgate, fgate_cumsum = (None if t is None else t.unflatten(1, (count, longest_packed)).squeeze(0)
                                            for t in (q, k, v, log_fgate, fgate_cumsum))
        cu_seqlens = max_seqlen = None
    has_triton = triton_attention_forward is not None
    on_triton = runs_on_triton(backend, q, has_triton)
    if q.is_cuda and not on_triton:
        global _warned_reference_on_gpu
        if not _warned_reference_on_gpu:
            _warned_reference_on_gpu = True
            logger.warning("Forgetting Attention is running on the slow pure-PyTorch reference path on a GPU "
                           "(backend=%r, Triton available: %s).", backend, has_triton)
    if prune_eps is not None and not 0 < prune_eps < 1:
        raise ValueError(f"`prune_eps` must be in (0, 1) or None, got {prune_eps}.")
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    # Checked eagerly only: torch.compile makes a float that varied between compiles symbolic, which math cannot read.
    if not torch.compiler.is_compiling() and not math.isfinite(sm_scale):
        raise ValueError(f"`sm_scale` must be a finite number, got {sm_scale}.")
    prune = on_triton and prune_eps is not None
    if prune:
        if score_bound is None:
            score_bound = measured_score_bound(q.detach(), k.detach(), sm_scale)
        elif not isinstance(score_bound, torch.Tensor):  # a fill, not a host-to-device copy (no sync)
            score_bound = torch.full((), float(score_bound), device=q.device)
        score_bound = score_bound.detach().to(device=q.device, dtype=torch.float32)
        rising = rising_gate_heads(log_fgate if log_fgate is not None else fgate_cumsum, log_fgate is None,
                                   cu_seqlens, seq_start)
        score_bound = score_bound.expand(rising.shape).masked_fill(rising, float("inf"))
    gate_is_cumsum = log_fgate is None
    out, _, pruned_counts, _, _ = torch.ops.foxlm.forgetting_attention(
        q, k, v, fgate_cumsum if gate_is_cumsum else log_fgate, gate_is_cumsum, sm_scale,
        cu_seqlens, None if max_seqlen is None else int(max_seqlen), seq_start, on_triton,
        float(prune_eps) if prune else None, score_bound if prune else None, prune and recording_pruned_counts(),
    )
    if pruned_counts.numel():
        record_pruned_counts(pruned_counts)
    return out.reshape(1, packed_length, *out.shape[2:]) if as_batch else out


def _equal_packed_sequences(cu_seqlens, longest, total):
    """Whether `cu_seqlens` packs sequences of one length (`longest`, which the check read) into `total` positions."""
    return (cu_seqlens is not None and longest is not None and longest > 0
            and longest * (len(cu_seqlens) - 1) == total)


# --------------------------------------------------------------------------------------------------------------
# The custom ops. `gate` is log f, or c itself when `gate_is_cumsum`; gradients flow to whichever was given.


def _gate_gradient(dc, gate, gate_is_cumsum, cu_seqlens, seq_start, use_triton):
    """dL/d(gate), (B, Tk, Hq) in the gate's dtype, from dL/dc laid out (B, Hq, Tk): dc itself, or for log f the
    reverse cumsum `d log f_t = sum_{k>=t} dc_k` within each sequence, summed directly in float64 (never
    `total - prefix` in fp32): Triton scan launches on the Triton path (`triton_gate_gradient`), torch ops otherwise
    (`log_fgate_gradient_reference`).
    """
    if gate_is_cumsum:
        return dc.transpose(1, 2).to(gate.dtype)
    if use_triton:
        return triton_gate_gradient(dc, gate.dtype, cu_seqlens, seq_start)
    return log_fgate_gradient_reference(dc, gate.dtype, cu_seqlens, seq_start)


@torch.library.custom_op("foxlm::forgetting_attention", mutates_args=())
def _forgetting_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, gate_is_cumsum: bool, sm_scale: float,
    cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[int], seq_start: Optional[torch.Tensor], use_triton: bool,
    prune_eps: Optional[float] = None, score_bound: Optional[torch.Tensor] = None, count_pruned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out, lse, pruned_counts, c, key_bias); lse (B, Hq, Tq) is the kernel's log2-domain log-sum-exp
    (unused by the reference); pruned_counts is (B, Hq, Tq, 2) int32 (skipped, visible keys per query) with
    `count_pruned`, else empty. c (float64) and key_bias (the kernels' fp32 segment parts of it) are (B, Hq, Tk),
    kept for the backward so that it does not compute them again; empty on the reference path."""
    counts = q.new_empty(_counts_shape(q, count_pruned), dtype=torch.int32)
    if use_triton:
        with on_device_of(q):
            c, key_bias = triton_gate_cumsum(gate, gate_is_cumsum, cu_seqlens, seq_start)
            out, lse = triton_attention_forward(q, k, v, c, key_bias, sm_scale, cu_seqlens, max_seqlen, seq_start,
                                                prune_eps, score_bound, counts if count_pruned else None)
        return out, lse, counts, c, key_bias
    gates = dict(fgate_cumsum=gate) if gate_is_cumsum else dict(log_fgate=gate)
    out = forgetting_attention_reference(q, k, v, **gates, sm_scale=sm_scale, cu_seqlens=cu_seqlens,
                                         seq_start=seq_start)
    lse = q.new_zeros(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
    return out.contiguous(), lse, counts.zero_(), gate.new_empty((0,), dtype=torch.float64), lse.new_empty((0,))


def _counts_shape(q, count_pruned):
    return (q.shape[0], q.shape[2], q.shape[1], 2) if count_pruned else (0,)


@_forgetting_attention_op.register_fake
def _(q, k, v, gate, gate_is_cumsum, sm_scale, cu_seqlens, max_seqlen, seq_start, use_triton, prune_eps=None,
      score_bound=None, count_pruned=False):
    c_shape = (q.shape[0], q.shape[2], k.shape[1]) if use_triton else (0,)
    return (q.new_empty(q.shape), q.new_empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32),
            q.new_empty(_counts_shape(q, count_pruned), dtype=torch.int32), q.new_empty(c_shape, dtype=torch.float64),
            q.new_empty(c_shape, dtype=torch.float32))


@torch.library.custom_op("foxlm::forgetting_attention_backward", mutates_args=())
def _forgetting_attention_backward_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, c: torch.Tensor, key_bias: torch.Tensor, gate_is_cumsum: bool, sm_scale: float,
    cu_seqlens: Optional[torch.Tensor], max_seqlen: Optional[int], seq_start: Optional[torch.Tensor],
    use_triton: bool, prune_eps: Optional[float] = None, score_bound: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the forward op's inputs; c and key_bias as the forward returned them."""
    if use_triton:
        with on_device_of(q):
            dq, dk, dv, dc = triton_attention_backward(do, q, k, v, out, lse, c, key_bias, sm_scale, cu_seqlens,
                                                       max_seqlen, seq_start, prune_eps, score_bound)
            dgate = _gate_gradient(dc, gate, gate_is_cumsum, cu_seqlens, seq_start, True)
    else:  # the reference path returns no c from the forward
        c = fgate_cumsum_float64(gate, gate_is_cumsum, cu_seqlens, seq_start)
        if cu_seqlens is None:
            dq, dk, dv, dc = attention_backward_reference(do, q, k, v, c, sm_scale, seq_start)
        else:
            bounds = cu_seqlens.tolist()
            pieces = [attention_backward_reference(do[:, s:e], q[:, s:e], k[:, s:e], v[:, s:e], c[..., s:e], sm_scale,
                                                   None) for s, e in zip(bounds[:-1], bounds[1:])]
            dq, dk, dv, dc = (torch.cat(parts, dim=dim) for parts, dim in zip(zip(*pieces), (1, 1, 1, 2)))
        dgate = _gate_gradient(dc, gate, gate_is_cumsum, cu_seqlens, seq_start, False)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dgate.contiguous()


@_forgetting_attention_backward_op.register_fake
def _(do, q, k, v, gate, out, lse, c, key_bias, gate_is_cumsum, sm_scale, cu_seqlens, max_seqlen, seq_start,
      use_triton, prune_eps=None, score_bound=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), gate.new_empty(gate.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, gate, gate_is_cumsum, sm_scale, cu_seqlens, max_seqlen, seq_start, use_triton, *prune = inputs
    prune_eps, score_bound = (prune + [None, None])[:2]
    out, lse, counts, c, key_bias = output
    ctx.save_for_backward(q, k, v, gate, out, lse, c, key_bias, cu_seqlens, seq_start, score_bound)
    ctx.args = (gate_is_cumsum, sm_scale, max_seqlen, use_triton, prune_eps)
    # Only `out` is differentiable, and its gradient is never materialized as zeros: autograd would otherwise fill
    # zero gradients of lse, c and key_bias in three launches per backward.
    ctx.mark_non_differentiable(lse, counts, c, key_bias)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, _dlse, _dcounts, _dc, _dkey_bias):
    if do is None:  # `out` had no gradient (autograd passes None: grads are not materialized)
        return (None,) * 13
    q, k, v, gate, out, lse, c, key_bias, cu_seqlens, seq_start, score_bound = ctx.saved_tensors
    gate_is_cumsum, sm_scale, max_seqlen, use_triton, prune_eps = ctx.args
    dq, dk, dv, dgate = torch.ops.foxlm.forgetting_attention_backward(
        do, q, k, v, gate, out, lse, c, key_bias, gate_is_cumsum, sm_scale, cu_seqlens, max_seqlen, seq_start,
        use_triton, prune_eps, score_bound)
    return dq, dk, dv, dgate, None, None, None, None, None, None, None, None, None


_forgetting_attention_op.register_autograd(_backward, setup_context=_setup_context)
