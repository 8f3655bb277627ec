"""The elementwise work of a FoX (Pro) attention layer outside attention itself (fox-reference.md §2), fused:

- `head_rms_norm`: RMSNorm of each head's vector with one scale per (head, channel) — QK-norm, and the output norm
  with the output gate `sigmoid(gate_logits)` multiplied in when given;
- `token_shift`: the K/V shift `out_t = alpha_t * raw_{t-1} + (1 - alpha_t) * raw_t`, `alpha = sigmoid(logits)`.

Eager PyTorch runs each as several memory-bound kernels with fp32 round trips; the Triton path is one kernel forward
and one backward per op, with fp32 arithmetic in registers. Beside each op is its pure-PyTorch reference with the
same signature (the CPU path and the tests' oracle). Dispatch follows `forgetting_attention`: Triton for CUDA tensors
when it imports, the reference elsewhere, or what `backend` forces. The Triton path runs inside torch custom ops
(forward and backward), so `torch.compile(fullgraph=True)` sees one op; the reference is plain PyTorch, which autograd
and the compiler handle themselves.

Both paths return the input's dtype. Under `Trainer(bf16=True)` autocast the norm scales are fp32 and the activations
bf16, where eager `fp32 weight * bf16 x` would promote to fp32; nothing downstream needs fp32 (q and k are cast to
v's dtype, the output norm feeds o_proj, which autocast runs in bf16), and fla's fused norms in the official model
return the activation dtype too.
"""

import os
from typing import Optional

import torch

from .interface import on_device_of, runs_on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch builds, remote code on such machines): the references run
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def head_rms_norm(x, weight, eps, gate_logits=None, *, backend="auto"):
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim of `x` (..., heads, head_dim), times
    `sigmoid(gate_logits)` when given (the FoX (Pro) output norm and gate in one kernel).

    Args:
        x: (..., heads, head_dim).
        weight: (heads * head_dim,) or (heads, head_dim), one scale per head and channel.
        eps: added to the mean square.
        gate_logits: optional, (..., heads * head_dim) or x's shape: the output gate's logits (before sigmoid).
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "reference".

    Returns:
        x's shape and dtype; arithmetic in fp32.
    """
    H, D = x.shape[-2:]
    if weight.numel() != H * D:
        raise ValueError(f"`weight` must have heads * head_dim = {H * D} scales, got shape {tuple(weight.shape)}.")
    if gate_logits is not None:
        if gate_logits.shape not in (x.shape, x.shape[:-2] + (H * D,)):
            raise ValueError(f"`gate_logits` must have shape {tuple(x.shape[:-2]) + (H * D,)} or {tuple(x.shape)}, "
                             f"got {tuple(gate_logits.shape)}.")
        gate_logits = gate_logits.reshape(x.shape)
    if not runs_on_triton(backend, x, triton is not None, "the Triton layer ops"):
        return head_rms_norm_reference(x, weight, eps, gate_logits)
    return torch.ops.foxlm.head_rms_norm(x, weight, gate_logits, float(eps))[0]


def head_rms_norm_reference(x, weight, eps, gate_logits=None):
    """`head_rms_norm` in plain PyTorch (fp32, or float64 for float64 inputs)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute).view(x.shape[-2:])
    if gate_logits is not None:
        y = y * torch.sigmoid(gate_logits.to(compute).reshape(x.shape))
    return y.to(x.dtype)


def token_shift(raw, shift_logits, previous, doc_start=None, *, backend="auto"):
    """`out_t = alpha_t * raw_{t-1} + (1 - alpha_t) * raw_t` along dim 1, `alpha = sigmoid(shift_logits)` in fp32.

    Args:
        raw: (batch, seqlen, heads, head_dim), the projections before the shift.
        shift_logits: (batch, seqlen, heads), the mixing logits (before sigmoid).
        previous: (batch, 1, heads, head_dim), the raw projection of the token before this chunk (a cache's shift
            state; zeros at the start of a sequence).
        doc_start: optional (batch, seqlen) bool, tokens that begin a packed document: their previous token is zero.
        backend: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "reference".

    Returns:
        raw's shape and dtype.
    """
    B, T, H, D = raw.shape
    if shift_logits.shape != (B, T, H) or previous.shape != (B, 1, H, D):
        raise ValueError(f"`shift_logits` must have shape {(B, T, H)} and `previous` {(B, 1, H, D)}, got "
                         f"{tuple(shift_logits.shape)} and {tuple(previous.shape)}.")
    if doc_start is not None and (doc_start.shape != (B, T) or doc_start.dtype != torch.bool):
        raise ValueError(f"`doc_start` must be a bool tensor of shape {(B, T)}, got {doc_start.dtype} "
                         f"{tuple(doc_start.shape)}.")
    if not runs_on_triton(backend, raw, triton is not None, "the Triton layer ops"):
        return token_shift_reference(raw, shift_logits, previous, doc_start)
    return torch.ops.foxlm.token_shift(raw, shift_logits, previous, doc_start)


def token_shift_reference(raw, shift_logits, previous, doc_start=None):
    """`token_shift` in plain PyTorch (fp32, or float64 for float64 inputs)."""
    compute = torch.promote_types(raw.dtype, torch.float32)
    alpha = torch.sigmoid(shift_logits.to(compute))[..., None]
    shifted = torch.cat([previous.to(raw.dtype), raw[:, :-1]], dim=1)
    if doc_start is not None:
        shifted = shifted.masked_fill(doc_start[:, :, None, None], 0.0)
    return (alpha * shifted.to(compute) + (1 - alpha) * raw.to(compute)).to(raw.dtype)


# --------------------------------------------------------------------------------------------------------------
# The custom ops (Triton path only). Kernels index tensors as contiguous (tokens, heads, head_dim): the model's
# inputs are contiguous, anything else is copied once here.


@torch.library.custom_op("foxlm::head_rms_norm", mutates_args=())
def _head_rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, gate_logits: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
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


@_head_rms_norm_op.register_fake
def _(x, weight, gate_logits, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("foxlm::head_rms_norm_backward", mutates_args=())
def _head_rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gate_logits: Optional[torch.Tensor], rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@_head_rms_norm_backward_op.register_fake
def _(dy, x, weight, gate_logits, rstd):
    dgate = x.new_empty(0) if gate_logits is None else gate_logits.new_empty(gate_logits.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), dgate


def _head_rms_norm_setup_context(ctx, inputs, output):
    x, weight, gate_logits, _ = inputs
    ctx.save_for_backward(x, weight, gate_logits, output[1])


def _head_rms_norm_backward(ctx, dy, _drstd):
    x, weight, gate_logits, rstd = ctx.saved_tensors
    dx, dweight, dgate = torch.ops.foxlm.head_rms_norm_backward(dy, x, weight, gate_logits, rstd)
    return dx, dweight, None if gate_logits is None else dgate, None


_head_rms_norm_op.register_autograd(_head_rms_norm_backward, setup_context=_head_rms_norm_setup_context)


@torch.library.custom_op("foxlm::token_shift", mutates_args=())
def _token_shift_op(
    raw: torch.Tensor, shift_logits: torch.Tensor, previous: torch.Tensor, doc_start: Optional[torch.Tensor]
) -> torch.Tensor:
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


@_token_shift_op.register_fake
def _(raw, shift_logits, previous, doc_start):
    return raw.new_empty(raw.shape)


@torch.library.custom_op("foxlm::token_shift_backward", mutates_args=())
def _token_shift_backward_op(
    dout: torch.Tensor, raw: torch.Tensor, shift_logits: torch.Tensor, previous: torch.Tensor,
    doc_start: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@_token_shift_backward_op.register_fake
def _(dout, raw, shift_logits, previous, doc_start):
    return raw.new_empty(raw.shape), shift_logits.new_empty(shift_logits.shape), previous.new_empty(previous.shape)


def _token_shift_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _token_shift_backward(ctx, dout):
    draw, dlogits, dprevious = torch.ops.foxlm.token_shift_backward(dout, *ctx.saved_tensors)
    return draw, dlogits, dprevious, None


_token_shift_op.register_autograd(_token_shift_backward, setup_context=_token_shift_setup_context)


def _as_bytes(doc_start, like):
    """doc_start as uint8 (a view, no copy): kernels read bytes, not i1 pointers; a dummy pointer when absent."""
    return like.new_empty(0, dtype=torch.uint8) if doc_start is None else doc_start.contiguous().view(torch.uint8)


def _blocks(head_dim):
    """(tokens, channels) per program. 2k-element tiles give each thread of the default 4 warps two 16-byte loads
    per bf16 tensor with under 80 registers (sm_90): many loads in flight per SM for these memory-bound kernels. The
    interpreter takes 4 tokens so that small tests cross tile boundaries."""
    block_d = triton.next_power_of_2(head_dim)
    return (4 if _INTERPRET else max(1, 2048 // block_d)), block_d


# --------------------------------------------------------------------------------------------------------------
# Triton kernels. Each program owns BLOCK_T consecutive tokens of one head: per-token reductions (the RMS, the
# shift logit's gradient) stay in registers and dweight gets one partial sum per program.

if triton is not None:

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
