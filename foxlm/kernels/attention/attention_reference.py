"""Pure-PyTorch Forgetting Attention: the exact, memory-bounded reference path, forward and backward.

Runs on any device and dtype. It is the CPU implementation and the twin of the Triton kernels in tests. Queries
are processed in chunks, each chunk only against the keys it can see, so a long sequence never allocates a full
T x T score matrix; under autograd every chunk is recomputed in the backward pass (activation checkpointing) so
training memory stays bounded as well. Inside the custom op (`attention.py`), where autograd does not run, the
backward is written out (`attention_backward_reference`).
"""

import math

import torch
from torch.utils.checkpoint import checkpoint

from ..common import masked_softmax

# Scores held at once per chunk (batch * heads * queries * keys); 2**24 fp32 scores = 64 MiB.
_MAX_SCORES_PER_CHUNK = 2**24


def packed_token_bounds(cu_seqlens, total):
    """(start, end) of each token's own sequence in a packed batch of `total` tokens with boundaries `cu_seqlens`:
    two int64 tensors of length `total`, computed on the device without reading the boundaries (no host sync)."""
    bounds = cu_seqlens.long()
    sequence = torch.repeat_interleave(torch.arange(bounds.shape[0] - 1, device=bounds.device), bounds.diff(),
                                       output_size=total)
    return bounds[:-1][sequence], bounds[1:][sequence]


def fgate_cumsum_from_log_fgate(log_fgate, *, cu_seqlens=None, seq_start=None):
    """Inclusive cumulative sum of `log_fgate` (batch, seqlen, heads) along the sequence, in float64.

    The sum restarts at every sequence start given by `cu_seqlens` (packed batches), and positions before
    `seq_start[b]` (left padding) contribute nothing. float64 keeps `c_i - c_j` exact to fp32 precision even when
    |c| grows to ~1e5 at long T with strong decay. The scan runs over a (batch, heads, seqlen) copy (a scan along
    the last dim stays parallel on a GPU); the result is a (batch, seqlen, heads) view of it.
    """
    log_fgate = log_fgate.transpose(1, 2).double()
    if seq_start is not None:
        positions = torch.arange(log_fgate.shape[2], device=log_fgate.device)
        log_fgate = log_fgate.masked_fill(positions < seq_start[:, None, None], 0.0)
    cumsum = log_fgate.cumsum(-1)
    if cu_seqlens is not None:
        # Subtract, from every token, the cumulative sum just before its own sequence starts.
        start, _ = packed_token_bounds(cu_seqlens, cumsum.shape[-1])
        cumsum = cumsum - torch.nn.functional.pad(cumsum, (1, 0))[..., start]
    return cumsum.transpose(1, 2)


def _chunk_probabilities(q, k, cumsum_q, cumsum_k, key_valid, sm_scale, n_offset):
    """Attention probabilities (B, Hkv, G, M, N) of a query chunk: softmax(q k^T * sm_scale + c_i - c_j) over the
    visible keys (causal, the chunk's first query at key `n_offset`, and `key_valid` (B, N) unless None). q (B, Hkv,
    G, M, D) and k (B, Hkv, N, D) in the compute dtype; cumsum_q (B, Hkv, G, M) and cumsum_k (B, Hkv, G, N) float64.

    One GEMM per KV head for all of its query heads (q viewed as (G * M) rows: k is never expanded per query head),
    with the decay bias as the GEMM's addend."""
    B, Hkv, G, M, D = q.shape
    N = k.shape[-2]
    # Anchor the decay at the chunk's first query so that nearby entries keep full precision.
    anchor = cumsum_q[..., :1]
    bias = (cumsum_q - anchor).to(q.dtype)[..., :, None] - (cumsum_k - anchor).to(q.dtype)[..., None, :]
    scores = torch.baddbmm(bias.reshape(B * Hkv, G * M, N), q.reshape(B * Hkv, G * M, D),
                           k.reshape(B * Hkv, N, D).transpose(1, 2), alpha=sm_scale).view(B, Hkv, G, M, N)
    causal = torch.arange(N, device=q.device)[None, :] <= torch.arange(n_offset, n_offset + M, device=q.device)[:, None]
    if key_valid is None:  # every query sees at least itself: no empty rows
        return torch.softmax(scores.masked_fill_(~causal, float("-inf")), dim=-1)
    return masked_softmax(scores, causal[None, None, None] & key_valid[:, None, None, None, :])


def _attend_chunk(q, k, v, cumsum_q, cumsum_k, key_valid, sm_scale):
    """Attention of one query chunk against keys 0..N-1, N aligned so the last query sees the last key.

    q (B, Hkv, G, M, D), k/v (B, Hkv, N, D), cumsum_q (B, Hkv, G, M), cumsum_k (B, Hkv, G, N), key_valid (B, N) or
    None (no left padding).
    """
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    B, Hkv, G, M, _ = q.shape
    N = k.shape[-2]
    probs = _chunk_probabilities(q, k, cumsum_q, cumsum_k, key_valid, sm_scale, N - M)
    return torch.bmm(probs.reshape(B * Hkv, G * M, N), v.reshape(B * Hkv, N, -1)).view(B, Hkv, G, M, -1)


def _dense_forgetting_attention(q, k, v, cumsum, sm_scale, seq_start):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    offset = Tk - Tq
    # Grouped views: the query heads of one KV head share its K/V, nothing is repeated in memory.
    q = q.view(B, Tq, Hkv, group, D).permute(0, 2, 3, 1, 4)
    k = k.permute(0, 2, 1, 3)
    v = v.permute(0, 2, 1, 3)
    cumsum = cumsum.view(B, Tk, Hkv, group).permute(0, 2, 3, 1)
    key_valid = None if seq_start is None else torch.arange(Tk, device=q.device)[None, :] >= seq_start[:, None]
    chunk = max(1, _MAX_SCORES_PER_CHUNK // max(1, B * Hq * Tk))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, cumsum))
    outputs = []
    for start in range(0, Tq, chunk):
        end = min(start + chunk, Tq)
        n_keys = offset + end
        args = (
            q[:, :, :, start:end],
            k[:, :, :n_keys],
            v[:, :, :n_keys],
            cumsum[..., offset + start : offset + end],
            cumsum[..., :n_keys],
            None if key_valid is None else key_valid[:, :n_keys],
            sm_scale,
        )
        if needs_grad:
            outputs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outputs.append(_attend_chunk(*args))
    out = torch.cat(outputs, dim=3) if outputs else q.new_zeros(B, Hkv, group, 0, v.shape[-1])
    return out.permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, v.shape[-1])


def forgetting_attention_reference(
    q, k, v, log_fgate=None, *, fgate_cumsum=None, sm_scale=None, cu_seqlens=None, max_seqlen=None, seq_start=None
):
    """Reference Forgetting Attention; arguments as `foxlm.kernels.forgetting_attention` (validated there)."""
    del max_seqlen  # only a launch hint for the kernels
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if fgate_cumsum is None:
        fgate_cumsum = fgate_cumsum_from_log_fgate(log_fgate, cu_seqlens=cu_seqlens, seq_start=seq_start)
    if cu_seqlens is None:
        out = _dense_forgetting_attention(q, k, v, fgate_cumsum, sm_scale, seq_start)
        return out.to(q.dtype)
    bounds = cu_seqlens.tolist()
    pieces = [
        _dense_forgetting_attention(q[:, s:e], k[:, s:e], v[:, s:e], fgate_cumsum[:, s:e], sm_scale, None)
        for s, e in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(pieces, dim=1).to(q.dtype)


def fgate_cumsum_float64(gate, gate_is_cumsum, cu_seqlens, seq_start):
    """c in float64, laid out (B, Hq, Tk) and contiguous, from the gate (log f, or c itself when `gate_is_cumsum`), for
    the reference backward, which only reads it (the Triton path has `triton_gate_cumsum`)."""
    if gate_is_cumsum:
        return gate.transpose(1, 2).to(torch.float64, memory_format=torch.contiguous_format)
    return fgate_cumsum_from_log_fgate(gate, cu_seqlens=cu_seqlens, seq_start=seq_start).transpose(1, 2).contiguous()


def log_fgate_gradient_reference(dc, dtype, cu_seqlens, seq_start):
    """d log f (B, Tk, Hq) in `dtype` from dL/dc laid out (B, Hq, Tk): the reverse cumsum `d log f_t = sum_{k>=t} dc_k`
    within each sequence, summed directly in float64 (never `total - prefix` in fp32), zero before `seq_start`."""
    suffix = dc.double().flip(-1).cumsum(-1).flip(-1)
    if cu_seqlens is not None:
        # Remove what lies beyond each token's own sequence (float64; ~0 anyway, every sequence's dc sums to 0).
        _, end = packed_token_bounds(cu_seqlens, suffix.shape[-1])
        suffix = suffix - torch.nn.functional.pad(suffix, (0, 1))[..., end]
    if seq_start is not None:
        positions = torch.arange(dc.shape[2], device=dc.device)
        suffix = suffix.masked_fill(positions < seq_start[:, None, None], 0.0)
    return suffix.transpose(1, 2).to(dtype)


def attention_backward_reference(do, q, k, v, c, sm_scale, seq_start):
    """Explicit gradients of the reference for one dense batch: (dq, dk, dv, dL/dc), query chunk by query chunk;
    c and dL/dc laid out (B, Hq, Tk).

    Written out rather than recomputed under autograd because autograd does not run inside a custom op's kernel.
    """
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group, offset = Hq // Hkv, Tk - Tq
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(dtype).view(B, Tq, Hkv, group, D).permute(0, 2, 3, 1, 4)
    dog = do.to(dtype).view(B, Tq, Hkv, group, D).permute(0, 2, 3, 1, 4)
    kg = k.to(dtype).permute(0, 2, 1, 3).reshape(B * Hkv, Tk, D)
    vg = v.to(dtype).permute(0, 2, 1, 3).reshape(B * Hkv, Tk, -1)
    cg = c.view(B, Hkv, group, Tk)
    key_valid = None if seq_start is None else torch.arange(Tk, device=q.device)[None, :] >= seq_start[:, None]
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kg)
    dv = torch.zeros_like(vg)
    dc = torch.zeros_like(cg)
    chunk = max(1, 2**25 // max(1, B * Hq * Tk))
    for start in range(0, Tq, chunk):
        end = min(start + chunk, Tq)
        M, n = end - start, offset + end
        # The query heads of a KV head as (G * M) rows of one GEMM: K and V are never expanded per query head, and
        # the products that sum over the query heads (dK, dV) do so inside the GEMM.
        q_rows = qg[:, :, :, start:end].reshape(B * Hkv, group * M, D)
        do_rows = dog[:, :, :, start:end].reshape(B * Hkv, group * M, -1)
        probs = _chunk_probabilities(qg[:, :, :, start:end], kg[:, :n].view(B, Hkv, n, D), cg[..., offset + start:n],
                                     cg[..., :n], None if key_valid is None else key_valid[:, :n], sm_scale,
                                     offset + start).reshape(B * Hkv, group * M, n)
        dp = torch.bmm(do_rows, vg[:, :n].transpose(1, 2))
        ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
        dv[:, :n] += torch.bmm(probs.transpose(1, 2), do_rows)
        dq[:, :, :, start:end] = torch.bmm(ds, kg[:, :n]).view(B, Hkv, group, M, D) * sm_scale
        dk[:, :n] += torch.bmm(ds.transpose(1, 2), q_rows) * sm_scale
        ds = ds.view(B, Hkv, group, M, n)
        dc[..., :n] -= ds.sum(-2).to(dc.dtype)
        dc[..., offset + start : offset + end] += ds.sum(-1).to(dc.dtype)
    return (dq.permute(0, 3, 1, 2, 4).reshape(q.shape).to(q.dtype),
            dk.view(B, Hkv, Tk, D).transpose(1, 2).to(k.dtype), dv.view(B, Hkv, Tk, -1).transpose(1, 2).to(v.dtype),
            dc.reshape(B, Hq, Tk))
