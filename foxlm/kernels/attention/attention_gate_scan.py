"""The gate scans of the Triton attention path: c and the key biases from the gates, d log f from dL/dc.

A float64 scan along time per (batch, head) row, restarted at every packed sequence, in two launches: the sums of
CHUNK positions, then each chunk's scan from those sums. They replace a dozen small torch ops (casts, scans, flips,
gathers) per call. `attention_reference.fgate_cumsum_from_log_fgate` is the same forward scan in torch.
"""

import torch
import triton
import triton.language as tl

from ..common import HOPPER_TILE
from ..dispatch import INTERPRET
from .attention_reference import packed_token_bounds

# Keys per segment of the key biases (`triton_gate_cumsum`): every key block of the forward and dQ passes lies in
# one segment, so it is a multiple of their BLOCK_N; on a GPU it is the Hopper kernels' tile, whose key-bias loads
# read one segment per block. The interpreter's small blocks get short segments, so that small test shapes cross
# segment boundaries (the Hopper kernels never run there).
SEGMENT = 32 if INTERPRET else HOPPER_TILE


@triton.jit
def _combine_segmented(value_a, restart_a, value_b, restart_b):
    """Addition that restarts where a segment does: (a then b) sums both unless b holds a restart."""
    return tl.where(restart_b, value_b, value_a + value_b), restart_a | restart_b


@triton.jit
def _scan_row(X, row, num_heads, stride_xb, stride_xh, SEQ_START, HAS_SEQ_START: tl.constexpr):
    """(row base of X, first valid position) of (batch * heads + head) row `row`."""
    b = row // num_heads
    kv_start = tl.load(SEQ_START + b) if HAS_SEQ_START else 0
    return X + b.to(tl.int64) * stride_xb + (row % num_heads) * stride_xh, kv_start


@triton.jit
def _scan_input(X, u, T, stride_xt, kv_start, REVERSE: tl.constexpr, HAS_SEQ_START: tl.constexpr):
    """x at scan positions u (time T - 1 - u when REVERSE) in float64, 0 outside [0, T) and, forward, before
    kv_start (left padding: log f = 0 there)."""
    t = T - 1 - u if REVERSE else u
    x = tl.load(X + t.to(tl.int64) * stride_xt, mask=(u >= 0) & (u < T), other=0.0).to(tl.float64)
    if HAS_SEQ_START and not REVERSE:
        x = tl.where(t >= kv_start, x, 0.0)
    return x


@triton.jit
def _gate_chunk_sums_kernel(X, SUMS, SEQ_START, T, num_heads, n_chunks, stride_xb, stride_xh, stride_xt,
                            REVERSE: tl.constexpr, HAS_SEQ_START: tl.constexpr, CHUNK: tl.constexpr):
    """First pass of `_gate_scan_kernel`: the float64 sum of every CHUNK positions of every row."""
    pid = tl.program_id(0)
    row = pid // n_chunks
    X, kv_start = _scan_row(X, row, num_heads, stride_xb, stride_xh, SEQ_START, HAS_SEQ_START)
    u = (pid - row * n_chunks) * CHUNK + tl.arange(0, CHUNK)
    tl.store(SUMS + pid, tl.sum(_scan_input(X, u, T, stride_xt, kv_start, REVERSE, HAS_SEQ_START), 0))


@triton.jit
def _gate_scan_kernel(X, Y, Y_SEG, SUMS, FIRST, SEQ_START, T, num_heads, n_chunks, stride_xb, stride_xh, stride_xt,
                      stride_yb, stride_yh, stride_yt, CUMSUM_GIVEN: tl.constexpr, REVERSE: tl.constexpr,
                      IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, SEGMENT: tl.constexpr,
                      CHUNK: tl.constexpr, SUMS_BLOCK: tl.constexpr):
    """A float64 scan along time of CHUNK positions of one (batch, head) row, restarting at each packed sequence
    (FIRST: the first position of each token's sequence in scan order); what precedes the chunk comes from the
    chunk sums of the first pass. Forward: Y = c, the cumsum of log f X (X itself, before SEQ_START too, when
    CUMSUM_GIVEN; else log f = 0 before SEQ_START), and Y_SEG = `(c_t - c_s) * log2(e)` in fp32, s the first
    position of t's segment (`attention_triton._key_block`). REVERSE: Y = the suffix sums of X (d log f from dL/dc),
    zero before SEQ_START."""
    pid = tl.program_id(0)
    row = pid // n_chunks
    chunk = pid - row * n_chunks
    X, kv_start = _scan_row(X, row, num_heads, stride_xb, stride_xh, SEQ_START, HAS_SEQ_START)
    y_row = (row // num_heads).to(tl.int64) * stride_yb + (row % num_heads) * stride_yh  # Y_SEG shares Y's strides
    Y += y_row
    Y_SEG += y_row
    u0 = chunk * CHUNK
    u = u0 + tl.arange(0, CHUNK)  # scan order; time t = T - 1 - u when REVERSE
    t = T - 1 - u if REVERSE else u
    valid = u < T
    # A given c is kept as it is before kv_start too (see the CUMSUM_GIVEN branch): only log f is zeroed there.
    x = _scan_input(X, u, T, stride_xt, kv_start, REVERSE, HAS_SEQ_START and not CUMSUM_GIVEN)
    if IS_VARLEN:
        first = tl.load(FIRST + t, mask=valid, other=0)
        first0 = tl.load(FIRST + (T - 1 - u0 if REVERSE else u0))
        if REVERSE:
            first, first0 = T - 1 - first, T - 1 - first0
    else:
        first, first0 = 0, 0
    if CUMSUM_GIVEN:
        # Forward only: c is X as given, and c_s is read where it lies. The kernels add c_s from Y back to the key
        # biases (`attention_triton._segment_shift`), so Y must hold the c_s that the key biases left out, also where
        # a segment starts in the left padding: a cache's c is not 0 there (the static cache's `filled_part` rebases
        # it, the dynamic cache's `_move_masked_first` fills it).
        y = x
        key = y - tl.load(X + (u - (u - first) % SEGMENT).to(tl.int64) * stride_xt, mask=valid, other=0.0)
    else:
        # Carry into the chunk: the sum from the start of its first position's sequence, whole chunks by their
        # sums less the part of the first one before that start.
        carry = tl.zeros([], tl.float64)
        for j in range(first0 // CHUNK, chunk, SUMS_BLOCK):
            js = j + tl.arange(0, SUMS_BLOCK)
            carry += tl.sum(tl.load(SUMS + row * n_chunks + js, mask=js < chunk, other=0.0), 0)
        if IS_VARLEN:
            before = first0 // CHUNK * CHUNK + tl.arange(0, CHUNK)
            x_before = _scan_input(X, before, T, stride_xt, kv_start, REVERSE, HAS_SEQ_START)
            carry -= tl.sum(tl.where(before < first0, x_before, 0.0), 0)
        y, restarted = tl.associative_scan((x, u == first), 0, _combine_segmented)
        y = tl.where(restarted, y, y + carry)
        if not REVERSE:
            # Key biases: sums since the segment start (excluded), carried from the segment's part before u0.
            segment_start = (u - first) % SEGMENT == 0
            key, restarted = tl.associative_scan((tl.where(segment_start, 0.0, x), segment_start), 0,
                                                 _combine_segmented)
            behind = u0 - 1 - tl.arange(0, SEGMENT)
            x_behind = _scan_input(X, behind, T, stride_xt, kv_start, REVERSE, HAS_SEQ_START)
            carry_seg = tl.sum(tl.where(behind > u0 - (u0 - first0) % SEGMENT, x_behind, 0.0), 0)
            key = tl.where(restarted, key, key + carry_seg)
    if HAS_SEQ_START and REVERSE:
        y = tl.where(t >= kv_start, y, 0.0)
    tl.store(Y + t.to(tl.int64) * stride_yt, y.to(Y.dtype.element_ty), mask=valid)
    if not REVERSE:
        tl.store(Y_SEG + t.to(tl.int64) * stride_yt, (key * 1.4426950408889634).to(tl.float32), mask=valid)


# Positions per program of the gate scans: every (row, chunk) is a program of each of two launches.
_SCAN_CHUNK, _SCAN_WARPS = (32, 1) if INTERPRET else (1024, 4)


def _gate_scan(x, x_strides, y, y_strides, y_seg, batch, heads, length, cu_seqlens, seq_start, cumsum_given, reverse):
    """Launches the gate scan over the batch * heads rows of `length` positions: chunk sums, then the chunks'
    scans (`_gate_scan_kernel`); strides are (batch, head, time) in elements, y_seg shares y's."""
    if batch * heads * length == 0:
        return
    n_chunks = triton.cdiv(length, _SCAN_CHUNK)
    grid = (batch * heads * n_chunks,)
    sums = None
    if not cumsum_given:
        sums = torch.empty(grid[0], device=x.device, dtype=torch.float64)
        _gate_chunk_sums_kernel[grid](x, sums, seq_start, length, heads, n_chunks, *x_strides, REVERSE=reverse,
                                      HAS_SEQ_START=seq_start is not None, CHUNK=_SCAN_CHUNK, num_warps=_SCAN_WARPS)
    first = None
    if cu_seqlens is not None:
        start, end = packed_token_bounds(cu_seqlens, length)
        first = end - 1 if reverse else start
    _gate_scan_kernel[grid](
        x, y, y_seg, sums, first, seq_start, length, heads, n_chunks, *x_strides, *y_strides,
        CUMSUM_GIVEN=cumsum_given, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
        HAS_SEQ_START=seq_start is not None, SEGMENT=SEGMENT, CHUNK=_SCAN_CHUNK, SUMS_BLOCK=128,
        num_warps=_SCAN_WARPS,
    )


def triton_gate_cumsum(gate, gate_is_cumsum, cu_seqlens=None, seq_start=None):
    """(c, key_bias) for the kernels from a (B, T, H) gate (`_gate_scan`): c the float64 cumsum of log f (the gate
    itself when `gate_is_cumsum`, before `seq_start` too), restarted at each packed sequence, log f = 0 before
    `seq_start`; key_bias the fp32 `(c_t - c_s) * log2(e)`, s the first position of t's SEGMENT-long segment counted
    from its sequence's start (the kernels add `c_s - anchor` back once per key block,
    `attention_triton._segment_shift`). Both (B, H, T), unit stride along T."""
    B, T, H = gate.shape
    c = torch.empty(B, H, T, device=gate.device, dtype=torch.float64)
    key_bias = torch.empty(B, H, T, device=gate.device, dtype=torch.float32)
    _gate_scan(gate, (gate.stride(0), gate.stride(2), gate.stride(1)), c, c.stride(), key_bias, B, H, T, cu_seqlens,
               seq_start, gate_is_cumsum, False)
    return c, key_bias


def triton_gate_gradient(dc, dtype, cu_seqlens=None, seq_start=None):
    """d log f (B, T, H) in `dtype` from dL/dc (B, H, T) (`_gate_scan`): `d log f_t = sum_{k >= t} dc_k` within t's
    sequence, summed in float64 (never `total - prefix` in fp32), zero before `seq_start`."""
    B, H, T = dc.shape
    dgate = torch.empty(B, T, H, device=dc.device, dtype=dtype)
    _gate_scan(dc, dc.stride(), dgate, (dgate.stride(0), dgate.stride(2), dgate.stride(1)), dgate, B, H, T,
               cu_seqlens, seq_start, False, True)
    return dgate
