"""Host side of the Triton attention path: the launches of the forward and backward kernels.

`triton_attention_forward` and `triton_attention_backward` take c and the key biases from the gate scan
(`attention_gate_scan.py`), launch the kernels of `attention_triton.py` (or, where `dispatch.runs_on_hopper` picks them,
the Hopper kernels of `attention_hopper.py` for the forward or the dK/dV pass) and return what the custom op of
`attention.py` needs. Launch settings shared by both passes come from `_launch_settings`.
"""

import functools
import math

import torch
import triton

from ..acp import row_order
from ..common import LOG2E, last_dim_contiguous
from ..dispatch import runs_on_hopper, use_dq_bias_tma, use_tma
from .attention_gate_scan import SEGMENT
from .attention_triton import SEARCH_WIDTH, bwd_kv, bwd_preprocess, bwd_q, fwd
from .attention_tuning import head_group, tune_seqlen


@functools.cache
def _gluon_available():
    """Whether the Hopper kernels import (a Triton with Gluon); asked when a call could first use them, so that
    `import foxlm` does not import Gluon."""
    try:
        from .attention_hopper import hopper_forward  # noqa: F401
    except ImportError:
        return False
    return True


def _runs_on_hopper(q, k, c, key_bias, cu_seqlens, seq_start, stage):
    """`dispatch.runs_on_hopper`, where this Triton has Gluon."""
    return runs_on_hopper(q, k, c, key_bias, cu_seqlens, seq_start, stage) and _gluon_available()


def _launch_settings(q, k, c, cu_seqlens, max_seqlen, seq_start, prune_eps, score_bound):
    """What the forward and backward launches share: sequence count and lengths, block and group sizes, the length
    class, U broadcast to (B, Hq), log eps, and the order and grouping of the (sequence, head) rows."""
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    if cu_seqlens is not None:
        n_seqs = cu_seqlens.shape[0] - 1
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if n_seqs > 0 else 0
        max_q = max_k = int(max_seqlen)
        cu_seqlens = cu_seqlens.to(torch.int32)
    else:
        n_seqs, max_q, max_k = B, Tq, Tk
    seq_start = None if seq_start is None else seq_start.to(device=q.device, dtype=torch.int32)
    # Pruning: U per (batch, query head), broadcast through strides. Unused pointers still get tensors of the same
    # dtypes: the autotuner keys on argument dtypes, and pruned and unpruned launches must share one configuration
    # (pruning nothing is then bit-identical to not pruning, at the same speed).
    block_d, group = max(16, triton.next_power_of_2(D)), Hq // k.shape[2]
    together = head_group(prune_eps is not None, group, block_d, n_seqs * Hq)
    ordered = prune_eps is not None and together < n_seqs * Hq
    if prune_eps is None:
        bound = q.new_empty((1,), dtype=torch.float32).expand(B, Hq)
    else:
        bound = score_bound.to(device=q.device, dtype=torch.float32).expand(B, Hq)
    log_eps = 0.0 if prune_eps is None else math.log(prune_eps)
    order = (row_order(c, bound, log_eps, cu_seqlens, seq_start, Tq, Tk) if ordered
             else q.new_empty((1,), dtype=torch.int32))
    return dict(
        n_seqs=n_seqs, max_q=max_q, max_k=max_k, cu_seqlens=cu_seqlens, seq_start=seq_start,
        block_d=block_d, group=group, tune_seqlen=tune_seqlen(max_k),
        dot_precision="ieee" if q.dtype == torch.float32 else "tf32",
        bound=bound, bound_strides=bound.stride(), row_order=order, ordered=ordered,
        log_eps=log_eps, head_group=together,
    )


def triton_attention_forward(q, k, v, c, key_bias, sm_scale, cu_seqlens=None, max_seqlen=None, seq_start=None,
                             prune_eps=None, score_bound=None, pruned_counts=None):
    """Returns (out (B, Tq, Hq, D), lse (B, Hq, Tq) fp32 in the log2 domain). `c` and `key_bias` come from
    `triton_gate_cumsum`. With `prune_eps`, tiles are pruned (`acp.py`) against `score_bound`
    (U >= |sm_scale q.k|, float32 broadcastable to (B, Hq)); `pruned_counts`, an int32 (B, Hq, Tq, 2) tensor, then
    receives each query row's (skipped keys, visible keys). The other arguments are those of
    `forgetting_attention`."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    cfg = _launch_settings(q, k, c, cu_seqlens, max_seqlen, seq_start, prune_eps, score_bound)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Tq, device=q.device, dtype=torch.float32)
    if q.numel() == 0 or cfg["max_q"] == 0:
        return out.zero_(), lse.fill_(float("inf"))
    if _runs_on_hopper(q, k, c, key_bias, cu_seqlens, seq_start, "forward"):
        from .attention_hopper import hopper_forward

        hopper_forward(q, k, v, c, key_bias, out, lse, sm_scale, cfg["bound"], cfg["log_eps"], prune_eps is not None,
                       cfg["head_group"], cfg["row_order"], cfg["ordered"], pruned_counts)
        return out, lse
    grid = lambda meta: (triton.cdiv(cfg["max_q"], meta["BLOCK_M"]) * cfg["n_seqs"] * Hq,)  # noqa: E731
    fwd[grid](
        q, k, v, c, key_bias, out, lse, cfg["cu_seqlens"], cfg["seq_start"], cfg["bound"], cfg["row_order"],
        q.new_empty((1,), dtype=torch.int32) if pruned_counts is None else pruned_counts,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], c.stride(0), c.stride(2), c.stride(1),
        *cfg["bound_strides"], Tq, Tk, cfg["max_q"], Hq, cfg["group"], cfg["head_group"], cfg["tune_seqlen"],
        sm_scale * LOG2E, cfg["log_eps"],
        HEAD_DIM=D, BLOCK_D=cfg["block_d"], IS_VARLEN=cu_seqlens is not None,
        HAS_SEQ_START=seq_start is not None, DOT_PRECISION=cfg["dot_precision"], PRUNE=prune_eps is not None,
        ORDERED=cfg["ordered"], COUNT_PRUNED=pruned_counts is not None, SEARCH_WIDTH=SEARCH_WIDTH,
        SEGMENT=SEGMENT, USE_TMA=use_tma(k, v),
    )
    return out, lse


def triton_attention_backward(do, q, k, v, out, lse, c, key_bias, sm_scale, cu_seqlens=None, max_seqlen=None,
                              seq_start=None, prune_eps=None, score_bound=None):
    """Returns (dq, dk, dv, dc) with dc = dL/dc of shape (B, Hq, Tk) in fp32 (`triton_gate_gradient` turns it into
    d log f); c, key_bias and lse as the forward used or returned them."""
    q, k, v, out, do = (last_dim_contiguous(t) for t in (q, k, v, out, do))
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    cfg = _launch_settings(q, k, c, cu_seqlens, max_seqlen, seq_start, prune_eps, score_bound)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dc = torch.empty(B, Hq, Tk, device=q.device, dtype=torch.float32)
    if q.numel() == 0 or cfg["max_q"] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dc.zero_()
    delta = torch.empty(B, Hq, Tq, device=q.device, dtype=torch.float32)
    delta_corrected = torch.empty_like(delta)
    block = 64
    bwd_preprocess[(triton.cdiv(Tq, block) * B * Hq,)](
        out, do, delta, *out.stride()[:3], *do.stride()[:3], Tq, Hq,
        HEAD_DIM=D, BLOCK_D=cfg["block_d"], BLOCK_M=block,
    )
    common = dict(HEAD_DIM=D, BLOCK_D=cfg["block_d"], IS_VARLEN=cu_seqlens is not None,
                  HAS_SEQ_START=seq_start is not None, DOT_PRECISION=cfg["dot_precision"],
                  PRUNE=prune_eps is not None, SEARCH_WIDTH=SEARCH_WIDTH)
    c_strides = (c.stride(0), c.stride(2), c.stride(1))
    grid_q = lambda meta: (triton.cdiv(cfg["max_q"], meta["BLOCK_M"]) * cfg["n_seqs"] * Hq,)  # noqa: E731
    bwd_q[grid_q](
        q, k, v, c, key_bias, do, lse, delta, dq, delta_corrected, cfg["cu_seqlens"], cfg["seq_start"], cfg["bound"],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *c_strides,
        *cfg["bound_strides"], Tq, Tk, cfg["max_q"], Hq, cfg["group"], cfg["head_group"], cfg["tune_seqlen"],
        sm_scale * LOG2E, sm_scale, cfg["log_eps"], SEGMENT=SEGMENT, USE_TMA=use_tma(k, v),
        BIAS_TMA=use_dq_bias_tma(prune_eps is not None, cfg["block_d"], cu_seqlens is not None) and use_tma(key_bias),
        **common,
    )
    # The dK/dV pass only: the Triton dQ pass above was faster than a Gluon one (benchmarks/NOTES_attention.md).
    if _runs_on_hopper(q, k, c, key_bias, cu_seqlens, seq_start, "dkdv"):
        from .attention_hopper import hopper_dkdv

        hopper_dkdv(q, k, v, do, c, key_bias, lse, delta_corrected, dk, dv, dc, sm_scale, cfg["bound"], cfg["log_eps"],
                    prune_eps is not None, cfg["head_group"], cfg["row_order"], cfg["ordered"])
        return dq, dk, dv, dc
    grid_kv = lambda meta: (triton.cdiv(cfg["max_k"], meta["BLOCK_N"]) * cfg["n_seqs"] * Hkv,)  # noqa: E731
    bwd_kv[grid_kv](
        q, k, v, c, do, lse, delta_corrected, dk, dv, dc, cfg["cu_seqlens"], cfg["seq_start"], cfg["bound"],
        cfg["row_order"],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        *c_strides, *cfg["bound_strides"], Tq, Tk, cfg["max_k"], Hq, cfg["group"], cfg["head_group"],
        cfg["tune_seqlen"], sm_scale * LOG2E, sm_scale, cfg["log_eps"], ORDERED=cfg["ordered"], **common,
    )
    return dq, dk, dv, dc
