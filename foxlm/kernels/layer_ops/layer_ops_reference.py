"""The layer ops in plain PyTorch: the CPU path of `head_rms_norm` and `token_shift` and the tests' oracle of their
Triton kernels, with the same signatures (fp32 arithmetic, or float64 for float64 inputs; the input's dtype out)."""

import torch


def head_rms_norm_reference(x, weight, eps, gate_logits=None):
    """`head_rms_norm` in plain PyTorch (fp32, or float64 for float64 inputs)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute).view(x.shape[-2:])
    if gate_logits is not None:
        y = y * torch.sigmoid(gate_logits.to(compute).reshape(x.shape))
    return y.to(x.dtype)


def token_shift_reference(raw, shift_logits, previous, doc_start=None):
    """`token_shift` in plain PyTorch (fp32, or float64 for float64 inputs)."""
    compute = torch.promote_types(raw.dtype, torch.float32)
    alpha = torch.sigmoid(shift_logits.to(compute))[..., None]
    shifted = torch.cat([previous.to(raw.dtype), raw[:, :-1]], dim=1)
    if doc_start is not None:
        shifted = shifted.masked_fill(doc_start[:, :, None, None], 0.0)
    return (alpha * shifted.to(compute) + (1 - alpha) * raw.to(compute)).to(raw.dtype)
