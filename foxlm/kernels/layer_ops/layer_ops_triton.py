"""Triton kernels of the layer ops (`layer_ops.py`) and their launches: one kernel forward and one backward per op,
fp32 arithmetic in registers. Kernels index tensors as contiguous (tokens, heads, head_dim): the model's inputs are
contiguous, anything else is copied once here."""

import torch
import triton
import triton.language as tl

from ..common import on_device_of
from ..dispatch import INTERPRET


def triton_head_rms_norm_forward(x, weight, gate_logits, eps):
    """Returns (y, rstd): rstd (x.shape[:-1]) fp32 is all the backward needs beyond the inputs."""
    x, weight = x.contiguous(), weight.contiguous()
    gate_logits = None if gate_logits is None else gate_logits.contiguous()
    H, D = x.shape[-2:]
    n_tokens = x.numel() // (H * D)
    y = torch.empty_like(x)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    block_t, block_d = _blocks(D)
    with on_device_of(x):
        _head_rms_norm_fwd_kernel[(triton.cdiv(n_tokens, block_t), H)](
            x, weight, x if gate_logits is None else gate_logits, y, rstd, n_tokens, H, eps,
            HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=block_d, HAS_GATE=gate_logits is not None,
        )
    return y, rstd


def triton_head_rms_norm_backward(dy, x, weight, gate_logits, rstd):
    """Returns (dx, dweight, dgate_logits); dgate_logits is empty without a gate."""
    dy, x, weight, rstd = dy.contiguous(), x.contiguous(), weight.contiguous(), rstd.contiguous()
    gate_logits = None if gate_logits is None else gate_logits.contiguous()
    H, D = x.shape[-2:]
    n_tokens = x.numel() // (H * D)
    block_t, block_d = _blocks(D)
    grid = (triton.cdiv(n_tokens, block_t), H)
    dx = torch.empty_like(x)
    dgate = torch.empty_like(gate_logits) if gate_logits is not None else x.new_empty(0)
    # dweight: one fp32 partial sum per program, then a sum over programs (deterministic, no atomics).
    dweight_partial = x.new_empty(grid[0], H, D, dtype=torch.float32)
    with on_device_of(x):
        _head_rms_norm_bwd_kernel[grid](
            dy, x, weight, x if gate_logits is None else gate_logits, rstd, dx, dgate, dweight_partial, n_tokens, H,
            HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=block_d, HAS_GATE=gate_logits is not None,
        )
    return dx, dweight_partial.sum(0).to(weight.dtype).view(weight.shape), dgate


def triton_token_shift_forward(raw, shift_logits, previous, doc_start):
    """Returns out, raw's shape and dtype."""
    raw, shift_logits, previous = raw.contiguous(), shift_logits.contiguous(), previous.contiguous()
    B, T, H, D = raw.shape
    out = torch.empty_like(raw)
    block_t, block_d = _blocks(D)
    with on_device_of(raw):
        _token_shift_fwd_kernel[(triton.cdiv(B * T, block_t), H)](
            raw, shift_logits, previous, _as_bytes(doc_start, raw), out, B * T, T, H,
            HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=block_d, HAS_DOC_START=doc_start is not None,
        )
    return out


def triton_token_shift_backward(dout, raw, shift_logits, previous, doc_start):
    """Returns (draw, dshift_logits, dprevious)."""
    dout, raw, shift_logits, previous = (t.contiguous() for t in (dout, raw, shift_logits, previous))
    B, T, H, D = raw.shape
    draw, dlogits, dprevious = torch.empty_like(raw), torch.empty_like(shift_logits), torch.empty_like(previous)
    block_t, block_d = _blocks(D)
    with on_device_of(raw):
        _token_shift_bwd_kernel[(triton.cdiv(B * T, block_t), H)](
            dout, raw, shift_logits, previous, _as_bytes(doc_start, raw), draw, dlogits, dprevious, B * T, T, H,
            HEAD_DIM=D, BLOCK_T=block_t, BLOCK_D=block_d, HAS_DOC_START=doc_start is not None,
        )
    return draw, dlogits, dprevious


def _as_bytes(doc_start, like):
    """doc_start as uint8 (a view, no copy): kernels read bytes, not i1 pointers; a dummy pointer when absent."""
    return like.new_empty(0, dtype=torch.uint8) if doc_start is None else doc_start.contiguous().view(torch.uint8)


def _blocks(head_dim):
    """(tokens, channels) per program. 2k-element tiles give each thread of the default 4 warps two 16-byte loads
    per bf16 tensor with under 80 registers (sm_90): many loads in flight per SM for these memory-bound kernels. The
    interpreter takes 4 tokens so that small tests cross tile boundaries."""
    block_d = triton.next_power_of_2(head_dim)
    return (4 if INTERPRET else max(1, 2048 // block_d)), block_d


# --------------------------------------------------------------------------------------------------------------
# Triton kernels. Each program owns BLOCK_T consecutive tokens of one head: per-token reductions (the RMS, the
# shift logit's gradient) stay in registers and dweight gets one partial sum per program.


@triton.jit
def _tile(n_tokens, num_heads, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tokens and head; for its (tokens, channels) tile of a (tokens, heads, HEAD_DIM) tensor, the
    int64 offset of the first element, int32 offsets from there (fewer registers than 64-bit ones) and the mask."""
    start_n = tl.program_id(0) * BLOCK_T
    h = tl.program_id(1)
    offs_n = start_n + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    base = (start_n.to(tl.int64) * num_heads + h) * HEAD_DIM
    offsets = tl.arange(0, BLOCK_T)[:, None] * (num_heads * HEAD_DIM) + offs_d[None, :]
    mask = (offs_n[:, None] < n_tokens) & (offs_d[None, :] < HEAD_DIM)
    return offs_n, h, offs_d, base, offsets, mask


@triton.jit
def _head_rms_norm_fwd_kernel(X, W, GATE, Y, RSTD, n_tokens, num_heads, eps, HEAD_DIM: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr):
    offs_n, h, offs_d, base, offsets, mask = _tile(n_tokens, num_heads, HEAD_DIM, BLOCK_T, BLOCK_D)
    x = tl.load(X + base + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
    w = tl.load(W + h * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HAS_GATE:
        y *= tl.sigmoid(tl.load(GATE + base + offsets, mask=mask, other=0.0).to(tl.float32))
    tl.store(Y + base + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + offs_n.to(tl.int64) * num_heads + h, rstd, mask=offs_n < n_tokens)


@triton.jit
def _head_rms_norm_bwd_kernel(DY, X, W, GATE, RSTD, DX, DGATE, DW_PARTIAL, n_tokens, num_heads,
                              HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                              HAS_GATE: tl.constexpr):
    offs_n, h, offs_d, base, offsets, mask = _tile(n_tokens, num_heads, HEAD_DIM, BLOCK_T, BLOCK_D)
    dy = tl.load(DY + base + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + base + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + offs_n.to(tl.int64) * num_heads + h, mask=offs_n < n_tokens, other=0.0)
    w = tl.load(W + h * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0).to(tl.float32)
    x_hat = x * rstd[:, None]
    if HAS_GATE:
        gate = tl.sigmoid(tl.load(GATE + base + offsets, mask=mask, other=0.0).to(tl.float32))
        dgate = dy * x_hat * w[None, :] * gate * (1.0 - gate)
        tl.store(DGATE + base + offsets, dgate.to(DGATE.dtype.element_ty), mask=mask)
        dy *= gate
    # y = x_hat * w with x_hat = x * rstd: dx = rstd * (dx_hat - x_hat * mean(dx_hat * x_hat)).
    dx_hat = dy * w[None, :]
    dx = (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, 1) / HEAD_DIM)[:, None]) * rstd[:, None]
    tl.store(DX + base + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    partial = DW_PARTIAL + (tl.program_id(0).to(tl.int64) * num_heads + h) * HEAD_DIM
    tl.store(partial + offs_d, tl.sum(dy * x_hat, 0), mask=offs_d < HEAD_DIM)


@triton.jit
def _previous_token(RAW, PREV, DOC_START, offs_n, t, h, offs_d, base, offsets, mask, n_tokens, seq_len,
                    num_heads, HEAD_DIM: tl.constexpr, HAS_DOC_START: tl.constexpr):
    """raw_{t-1} of each token (fp32 tile): the row one token back, `previous` for the chunk's first token, zero
    where a packed document starts. Also the tile's offsets into `previous` and which tokens read it."""
    if HAS_DOC_START:
        starts = tl.load(DOC_START + offs_n, mask=offs_n < n_tokens, other=0) != 0
        from_raw = (t > 0) & ~starts
        from_previous = (t == 0) & ~starts
    else:
        from_raw = t > 0
        from_previous = t == 0
    prev = tl.load(RAW + base - num_heads * HEAD_DIM + offsets, mask=mask & from_raw[:, None], other=0.0)
    prev_offsets = ((offs_n // seq_len) * num_heads + h)[:, None] * HEAD_DIM + offs_d[None, :]
    prev += tl.load(PREV + prev_offsets, mask=mask & from_previous[:, None], other=0.0)
    return prev.to(tl.float32), prev_offsets, from_previous


@triton.jit
def _token_shift_fwd_kernel(RAW, LOGITS, PREV, DOC_START, OUT, n_tokens, seq_len, num_heads,
                            HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_DOC_START: tl.constexpr):
    offs_n, h, offs_d, base, offsets, mask = _tile(n_tokens, num_heads, HEAD_DIM, BLOCK_T, BLOCK_D)
    t = offs_n % seq_len
    raw = tl.load(RAW + base + offsets, mask=mask, other=0.0).to(tl.float32)
    prev, _, _ = _previous_token(RAW, PREV, DOC_START, offs_n, t, h, offs_d, base, offsets, mask, n_tokens,
                                 seq_len, num_heads, HEAD_DIM, HAS_DOC_START)
    logits = tl.load(LOGITS + offs_n.to(tl.int64) * num_heads + h, mask=offs_n < n_tokens, other=0.0)
    alpha = tl.sigmoid(logits.to(tl.float32))[:, None]
    tl.store(OUT + base + offsets, (alpha * prev + (1.0 - alpha) * raw).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _token_shift_bwd_kernel(DOUT, RAW, LOGITS, PREV, DOC_START, DRAW, DLOGITS, DPREV, n_tokens, seq_len,
                            num_heads, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                            HAS_DOC_START: tl.constexpr):
    offs_n, h, offs_d, base, offsets, mask = _tile(n_tokens, num_heads, HEAD_DIM, BLOCK_T, BLOCK_D)
    t = offs_n % seq_len
    dout = tl.load(DOUT + base + offsets, mask=mask, other=0.0).to(tl.float32)
    raw = tl.load(RAW + base + offsets, mask=mask, other=0.0).to(tl.float32)
    prev, prev_offsets, from_previous = _previous_token(RAW, PREV, DOC_START, offs_n, t, h, offs_d, base,
                                                        offsets, mask, n_tokens, seq_len, num_heads, HEAD_DIM,
                                                        HAS_DOC_START)
    logit_offsets = offs_n.to(tl.int64) * num_heads + h
    alpha = tl.sigmoid(tl.load(LOGITS + logit_offsets, mask=offs_n < n_tokens, other=0.0).to(tl.float32))
    # raw_t also feeds out_{t+1} (weight alpha_{t+1}) unless t + 1 is past the chunk or starts a document.
    feeds_next = (offs_n < n_tokens) & (t + 1 < seq_len)
    if HAS_DOC_START:
        feeds_next &= tl.load(DOC_START + offs_n + 1, mask=feeds_next, other=1) == 0
    alpha_next = tl.sigmoid(tl.load(LOGITS + logit_offsets + num_heads, mask=feeds_next, other=0.0).to(tl.float32))
    # Zero where raw_t feeds no next token, which cancels alpha_next there.
    dout_next = tl.load(DOUT + base + num_heads * HEAD_DIM + offsets, mask=mask & feeds_next[:, None], other=0.0)
    draw = (1.0 - alpha)[:, None] * dout + alpha_next[:, None] * dout_next.to(tl.float32)
    tl.store(DRAW + base + offsets, draw.to(DRAW.dtype.element_ty), mask=mask)
    dlogits = tl.sum(dout * (prev - raw), 1) * alpha * (1.0 - alpha)
    tl.store(DLOGITS + logit_offsets, dlogits.to(DLOGITS.dtype.element_ty), mask=offs_n < n_tokens)
    # Every chunk-first token writes its sequence's dprevious: zero when it starts a document.
    dprev = tl.where(from_previous[:, None], alpha[:, None] * dout, 0.0)
    tl.store(DPREV + prev_offsets, dprev.to(DPREV.dtype.element_ty), mask=mask & (t == 0)[:, None])
