"""The elementwise work of a FoX (Pro) attention layer outside attention itself (docs/design.md §2 and §9), fused:

- `head_rms_norm`: RMSNorm of each head's vector with one scale per (head, channel) — QK-norm, and the output norm
  with the output gate `sigmoid(gate_logits)` multiplied in when given;
- `token_shift`: the K/V shift `out_t = alpha_t * raw_{t-1} + (1 - alpha_t) * raw_t`, `alpha = sigmoid(logits)`.

Eager PyTorch runs each as several memory-bound kernels with fp32 round trips; the Triton path is one kernel forward
and one backward per op, with fp32 arithmetic in registers (`layer_ops_triton.py`). Beside them is each op's
pure-PyTorch reference with the same signature (`layer_ops_reference.py`: the CPU path and the tests' oracle).
Dispatch follows `forgetting_attention` (`dispatch.runs_on_triton`): Triton for CUDA tensors when it imports, the
reference elsewhere, or what `backend` forces. The Triton path runs inside torch custom ops (forward and backward),
so `torch.compile(fullgraph=True)` sees one op; the reference is plain PyTorch, which autograd and the compiler handle
themselves.

Both paths return the input's dtype. Under `Trainer(bf16=True)` autocast the norm scales are fp32 and the activations
bf16, where eager `fp32 weight * bf16 x` would promote to fp32; nothing downstream needs fp32 (q and k are cast to
v's dtype, the output norm feeds o_proj, which autocast runs in bf16), and fla's fused norms in the official model
return the activation dtype too.
"""

from typing import Optional

import torch

from ..dispatch import runs_on_triton
from .layer_ops_reference import head_rms_norm_reference, token_shift_reference

try:
    from .layer_ops_triton import (triton_head_rms_norm_backward, triton_head_rms_norm_forward,
                                   triton_token_shift_backward, triton_token_shift_forward)
except ImportError:  # no Triton (CPU-only torch builds, remote code on such machines): the references run
    triton_head_rms_norm_forward = None


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
    if not runs_on_triton(backend, x, triton_head_rms_norm_forward is not None, "the Triton layer ops"):
        return head_rms_norm_reference(x, weight, eps, gate_logits)
    return torch.ops.foxlm.head_rms_norm(x, weight, gate_logits, float(eps))[0]


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
    if not runs_on_triton(backend, raw, triton_head_rms_norm_forward is not None, "the Triton layer ops"):
        return token_shift_reference(raw, shift_logits, previous, doc_start)
    return torch.ops.foxlm.token_shift(raw, shift_logits, previous, doc_start)


# --------------------------------------------------------------------------------------------------------------
# The custom ops (Triton path only), around the launchers of `layer_ops_triton.py`.


@torch.library.custom_op("foxlm::head_rms_norm", mutates_args=())
def _head_rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, gate_logits: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd): rstd (x.shape[:-1]) fp32 is all the backward needs beyond the inputs."""
    return triton_head_rms_norm_forward(x, weight, gate_logits, eps)


@_head_rms_norm_op.register_fake
def _(x, weight, gate_logits, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("foxlm::head_rms_norm_backward", mutates_args=())
def _head_rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gate_logits: Optional[torch.Tensor], rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dgate_logits); dgate_logits is empty without a gate."""
    return triton_head_rms_norm_backward(dy, x, weight, gate_logits, rstd)


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
    return triton_token_shift_forward(raw, shift_logits, previous, doc_start)


@_token_shift_op.register_fake
def _(raw, shift_logits, previous, doc_start):
    return raw.new_empty(raw.shape)


@torch.library.custom_op("foxlm::token_shift_backward", mutates_args=())
def _token_shift_backward_op(
    dout: torch.Tensor, raw: torch.Tensor, shift_logits: torch.Tensor, previous: torch.Tensor,
    doc_start: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (draw, dshift_logits, dprevious)."""
    return triton_token_shift_backward(dout, raw, shift_logits, previous, doc_start)


@_token_shift_backward_op.register_fake
def _(dout, raw, shift_logits, previous, doc_start):
    return raw.new_empty(raw.shape), shift_logits.new_empty(shift_logits.shape), previous.new_empty(previous.shape)


def _token_shift_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _token_shift_backward(ctx, dout):
    draw, dlogits, dprevious = torch.ops.foxlm.token_shift_backward(dout, *ctx.saved_tensors)
    return draw, dlogits, dprevious, None


_token_shift_op.register_autograd(_token_shift_backward, setup_context=_token_shift_setup_context)
