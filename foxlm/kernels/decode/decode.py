"""`forgetting_decode`: Forgetting Attention of a few new query tokens against a KV cache.

The Triton split-K kernel (`decode_triton.py`) runs on CUDA tensors; the pure-PyTorch reference
(`decode_reference.py`) runs everywhere else and is the kernel's twin in tests (`dispatch.runs_on_triton` chooses). Same
argument order and layout as `forgetting_attention`, except that the gate is always the cache's running sum `c` (a
decode step never recomputes a cumulative sum).
"""

import math

import torch

from ..common import on_device_of
from ..dispatch import runs_on_triton
from .decode_reference import forgetting_decode_reference

try:
    from .decode_triton import triton_forgetting_decode
except ImportError:  # no Triton (CPU-only torch builds, remote code on such machines)
    triton_forgetting_decode = None

MAX_DECODE_QUERIES = 16  # new tokens per decode call; longer chunks go through `forgetting_attention`


def _check_inputs(q, k, v, fgate_cumsum, seq_start, acp_delta, kv_len):
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in (q, k, v)):
        raise ValueError("`q`, `k` and `v` must be 4-D tensors (batch, seqlen, heads, head_dim).")
    B, Tq, Hq, D = q.shape
    Bk, Tk, Hkv, Dk = k.shape
    if v.shape != k.shape or Bk != B or Dk != D or q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"k and v must be (batch, k_len, kv_heads, head_dim) matching q in batch, head_dim and "
                         f"dtype; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"v {tuple(v.shape)} {v.dtype}.")
    if Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}).")
    if not 1 <= Tq <= min(Tk, MAX_DECODE_QUERIES):
        raise ValueError(f"decoding takes 1 to {MAX_DECODE_QUERIES} new queries and at least as many keys; got "
                         f"{Tq} queries, {Tk} keys (use `forgetting_attention` for longer chunks).")
    if tuple(fgate_cumsum.shape) != (B, Tk, Hq) or fgate_cumsum.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"`fgate_cumsum` must be float32 or float64 of shape (batch, k_len, query heads) = "
                         f"{(B, Tk, Hq)}, got "
                         f"{tuple(fgate_cumsum.shape)} {fgate_cumsum.dtype}.")
    if seq_start is not None and tuple(seq_start.shape) != (B,):
        raise ValueError(f"`seq_start` must have shape ({B},), got {tuple(seq_start.shape)}.")
    if acp_delta is not None and tuple(acp_delta.shape) != (B, Hq):
        raise ValueError(f"`acp_delta` must have shape (batch, query heads) = {(B, Hq)}, got "
                         f"{tuple(acp_delta.shape)}.")
    if kv_len is not None and (not isinstance(kv_len, torch.Tensor) or kv_len.numel() != 1
                               or kv_len.dtype.is_floating_point or kv_len.device != q.device):
        raise ValueError(f"`kv_len` must be a one-element integer tensor on {q.device} (the filled length of a "
                         f"static cache), got {kv_len!r}.")


def forgetting_decode(q, k, v, fgate_cumsum, *, sm_scale=None, seq_start=None, acp_delta=None, kv_len=None,
                      backend="auto"):
    """Forgetting Attention of the last `q_len` (1 to 16) tokens against all `k_len` cached keys (the first `kv_len`
    with a static cache), themselves included.

    Args:
        q: (batch, q_len, query_heads, head_dim); query m sits at key position `k_len - q_len + m` (causal among
            the new tokens).
        k, v: (batch, k_len, kv_heads, head_dim), the cache (a transposed (batch, kv_heads, k_len, head_dim) cache
            tensor is read in place).
        fgate_cumsum: (batch, k_len, query_heads) float32 or float64, the running sum `c` of log f as the cache
            keeps it.
        sm_scale: multiplies q.k only (default 1/sqrt(head_dim)).
        seq_start: (batch,) int, left padding: keys before `seq_start[b]` are ignored.
        acp_delta: (batch, query_heads) float32 ACP threshold (`foxlm.kernels.acp.acp_threshold`): keys with
            `c_q - c_k < acp_delta` are skipped (whole blocks of them are never read by the kernel). None: no pruning.
        kv_len: a one-element integer tensor on q's device, or None: only the first `kv_len` of the `k_len` keys are
            filled (a static cache, whose buffers keep their shape) and query m sits at `kv_len - q_len + m`. A
            tensor, so that neither path reads it on the host: no sync, and one compiled graph for every length.
        backend: "auto" (Triton on CUDA, reference elsewhere), "triton" or "reference".

    Returns:
        (batch, q_len, query_heads, head_dim) in the dtype of `q`.
    """
    _check_inputs(q, k, v, fgate_cumsum, seq_start, acp_delta, kv_len)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    if runs_on_triton(backend, q, triton_forgetting_decode is not None, "the Triton decode kernel", max_head_dim=None):
        with on_device_of(q):
            return triton_forgetting_decode(q, k, v, fgate_cumsum, sm_scale, seq_start, acp_delta, kv_len)
    return forgetting_decode_reference(q, k, v, fgate_cumsum, sm_scale=sm_scale, seq_start=seq_start,
                                       acp_delta=acp_delta, kv_len=kv_len)
