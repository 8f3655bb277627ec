"""Pure-PyTorch Forgetting Attention for decoding: the twin of the split-K kernel (`decode_triton.py`) in tests and
the path of CPU tensors; arguments as `forgetting_decode` (validated there)."""

import math

import torch

from ..common import masked_softmax


def forgetting_decode_reference(q, k, v, fgate_cumsum, *, sm_scale=None, seq_start=None, acp_delta=None,
                                kv_len=None):
    """Pure-PyTorch twin of the decode kernel (float64 for float64 inputs, else float32). Reads nothing on the host
    (`kv_len` stays a tensor), so that torch.compile traces it as one graph."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(dtype).view(B, Tq, Hkv, group, D).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, Tq, D)
    kg, vg = (t.to(dtype).permute(0, 2, 1, 3).unsqueeze(2) for t in (k, v))  # (B, Hkv, 1, Tk, D)
    c = fgate_cumsum.transpose(1, 2).reshape(B, Hkv, group, Tk)
    keys = torch.arange(Tk, device=q.device)
    q_pos = keys[Tk - Tq :] if kv_len is None else kv_len.reshape(1) - Tq + keys[:Tq]
    bias = (c.index_select(-1, q_pos)[..., :, None] - c[..., None, :]).to(dtype)  # (B, Hkv, G, Tq, Tk)
    visible = (keys[None, :] <= q_pos[:, None]).expand(B, Hkv, group, Tq, Tk)
    if seq_start is not None:
        visible = visible & (keys >= seq_start[:, None, None, None, None])
    if acp_delta is not None:
        visible = visible & (bias >= acp_delta.view(B, Hkv, group, 1, 1))
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * sm_scale + bias
    out = torch.matmul(masked_softmax(scores, visible), vg)
    return out.permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, D).to(q.dtype)
