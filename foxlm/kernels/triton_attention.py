"""Triton Forgetting Attention: forward and backward kernels.

`o_i = sum_j softmax_j(sm_scale * q_i.k_j + c_i - c_j) v_j`, c the inclusive cumsum of log f (fox-reference.md §1).

Design (fox-reference.md §3-4):
- Scores live in the exp2 domain: `sm_scale * log2(e)` is folded into one multiplier and the decay bias is scaled
  by log2(e) once per key/query vector, so the inner loop costs one FMA and one FSUB per score over plain attention.
- No catastrophic cancellation: c is kept in float64 in memory (O(T) bytes) and every program subtracts a float64
  anchor (the c of its first query or key) before rounding to fp32, so `c_i - c_j` stays exact to fp32 precision
  however large |c| grows at long T with strong decay. The key biases that the forward and dQ main loops walk over
  come in two parts instead (`triton_gate_cumsum`): `c_j - c_s` in fp32, s the first key of j's SEGMENT-long segment,
  and `c_s - anchor`, one float64 subtraction per key block, not one per key (8% off the D64 forward on an H100).
- The softmax ignores per-row constants, so the forward tracks its running max on `s - c_j` and adds `c_i` back only
  into the stored log-sum-exp.
- Masking rides on the bias vectors: keys before `seq_start` (left padding) get bias +inf, query rows past the end
  get LSE +inf, so off-diagonal blocks need no element-wise mask; only diagonal blocks (their own loop stage) do.
  The dK/dV pass also runs the last, partial query block apart, so that its main loop has no row mask at all.
- Backward, two passes and no atomics (deterministic): the query-stationary dQ pass runs first and also returns
  delta = rowsum(o * do) plus `sum_j dS_ij`, which is exactly its error when taken from the rounded output; the
  key-stationary dK/dV pass then uses the corrected delta. dK/dV programs loop over the query heads of their GQA group,
  so dK/dV are reduced in registers (no per-query-head copy), and they own `dc_j = -sum_i dS_ij` (the row sums of dS
  vanish, fox-reference.md §3); `d log f` is then a float64 reverse cumsum.
- c and the key biases come from a float64 scan over the gates (`triton_gate_cumsum`), d log f from a reverse scan
  (`triton_gate_gradient`), two launches each, in place of a dozen small torch ops (casts, scans, flips, gathers).
- 1-D grids (no 65535 limit on y/z), 64-bit base offsets, heavy blocks launched first (`_heaviest_first`), of
  all heads at once or of a few heads at a time (`_head_group`).
- On Hopper and newer, the forward and dQ loops load K/V through TMA descriptors made per program (`_row_tiles`:
  the copy engine computes addresses and zero-fills rows past the sequence and columns past head_dim, as the
  pointer tiles' masks do, so both paths give bit-identical results); the pruned D64 dQ loop loads its key biases
  that way too (`_bias_source`, `_dq_bias_tma`).
- Adaptive Computation Pruning (fox-reference.md §5), when `prune_eps` is given: a tile with first query i0
  and last key j1 has every bias `<= c_i0 - c_j1`, and is skipped when that is below `delta = log eps - 2U - log L`
  (then each query loses at most eps of its attention mass). c is monotone, so the kept key blocks of a query block
  are a suffix and the kept query blocks of a key block a prefix: each program finds its boundary by a
  SEARCH_WIDTH-ary search over c (one vector load per round, two rounds at 16k), in the forward, dQ and dK/dV passes.
  A NaN bound prunes nothing. Without a given bound, U comes from one reduction over q and k
  (`triton_max_square_norms`).
"""

import functools
import math
import os

import torch
import triton
import triton.language as tl

try:  # the scratch allocator of in-kernel TMA descriptors (older Triton has neither)
    from triton.runtime import _allocation
except ImportError:
    _allocation = None

from .reference import packed_token_bounds

LOG2E = 1.4426950408889634
# Candidates per round of the pruning boundary search: 32^2 blocks (64k keys at 64-key blocks) in two rounds.
SEARCH_WIDTH = 32
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Keys per segment of the key biases (`triton_gate_cumsum`): every key block of the forward and dQ passes lies in
# one segment, so it is a multiple of their BLOCK_N. The interpreter's small blocks get short segments, so that small
# test shapes cross segment boundaries.
SEGMENT = 32 if _INTERPRET else 128
# The forward and dQ main loops load K/V tiles through TMA descriptors where `_use_tma` allows: fewer instructions
# and registers than pointer tiles (D64 at 16k on an H100: forward -3%, dQ -11%). The dK/dV loop keeps pointer tiles
# for Q/dO (descriptors made it 6% slower at D128). Tests switch TMA off to check the pointer path, which older GPUs
# and unaligned inputs take.
TMA_LOADS = True
# FOXLM_AUTOTUNE=0 takes the first (expected best) configuration of each list instead of timing them all.
_AUTOTUNE = os.environ.get("FOXLM_AUTOTUNE", "1") != "0"


@triton.jit
def _load_tile(base, rows, n_rows, stride_row, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """A (rows, BLOCK_D) tile of a (seqlen, head_dim) matrix; zeros outside."""
    ptrs = base + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :]
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _row_tiles(base, n_rows, stride_row, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Where a main loop loads its (BLOCK_ROWS, BLOCK_D) tiles of a (n_rows, HEAD_DIM) matrix from: a TMA descriptor
    (the copy engine computes the addresses and fills zeros outside), or the base pointer itself."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                        block_shape=[BLOCK_ROWS, BLOCK_D])
    else:
        src = base
    return src


@triton.jit
def _bias_source(base, bos, seq_k, BLOCK_N: tl.constexpr, BIAS_TMA: tl.constexpr):
    """(source, origin) of a sequence's fp32 key biases, given the start of their row (unit stride): a TMA descriptor
    over the row up to the sequence's end (zeros past it) and the sequence's first index in it, or the pointer to the
    sequence's first bias and 0."""
    if BIAS_TMA:
        src = tl.make_tensor_descriptor(base, shape=[bos.to(tl.int32) + seq_k], strides=[1], block_shape=[BLOCK_N])
        origin = bos.to(tl.int32)
    else:
        src = base + bos
        origin = 0
    return src, origin


@triton.jit
def _load_rows(src, start, offs_rows, n_rows, stride_row, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """The tile of rows [start, start + BLOCK_ROWS) from a `_row_tiles` source (offs_rows = arange(BLOCK_ROWS))."""
    if USE_TMA:
        tile = src.load([start, 0])
    else:
        tile = _load_tile(src, start + offs_rows, n_rows, stride_row, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
    return tile


@triton.jit
def _store_tile(base, tile, rows, n_rows, stride_row, offs_d, HEAD_DIM: tl.constexpr):
    ptrs = base + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _sequence(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr):
    """(batch index, first token, query length, key length, first valid key) of sequence b."""
    if IS_VARLEN:
        bos = tl.load(CU_SEQLENS + b).to(tl.int64)
        seq_q = (tl.load(CU_SEQLENS + b + 1) - bos).to(tl.int32)
        seq_k = seq_q
        batch = b * 0
    else:
        bos = b.to(tl.int64) * 0
        seq_q = Tq
        seq_k = Tk
        batch = b
    if HAS_SEQ_START:
        kv_start = tl.load(SEQ_START + b).to(tl.int32)
    else:
        kv_start = b * 0
    return batch.to(tl.int64), bos, seq_q, seq_k, kv_start


@triton.jit
def _heaviest_first(pid, num_blocks, head_group, ROW_ORDER, ORDERED: tl.constexpr):
    """(sequence * heads + head, i) of program `pid`, i = 0 for the block with the most causal work. The (sequence,
    head) pairs go in groups of `head_group` (the last group may be smaller), and within a group the heavy blocks of
    all its pairs go first, so the scheduler's last programs are short ones (list scheduling). 1: head by head.
    ORDERED: the pairs in the order of ROW_ORDER (`_row_order`: the least pruned first), else in index order."""
    per_group = head_group * num_blocks
    g = pid // per_group
    size = tl.minimum(head_group, tl.num_programs(0) // num_blocks - g * head_group)
    # Subtractions, not `%`: with `pid % num_blocks` ptxas (Triton 3.6, sm_90) serialized the packed D128 dK/dV wgmma.
    r = pid - g * per_group
    rank = r // size
    row = g * head_group + (r - rank * size)
    if ORDERED:
        row = tl.load(ROW_ORDER + row)
    return row, rank


@triton.jit
def _prune_threshold(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start):
    """delta = log eps - 2U - log L (natural log), L the number of keys of this sequence."""
    u = tl.load(BOUND + batch * stride_ub + h * stride_uh)
    n_keys = tl.maximum(seq_k - kv_start, 1).to(tl.float32)
    delta = log_eps - 2.0 * u - tl.log(n_keys)
    # A NaN bound (NaN in q or k) prunes nothing: every comparison with a NaN delta is false, which the dK/dV
    # pass's search would read as "pruned from the first block on".
    return tl.where(delta == delta, delta, float("-inf")).to(tl.float64)


@triton.jit
def _first_block(C, stride_ct, c_ref, delta, lo, hi, first_pos, BLOCK: tl.constexpr, QUERY_BLOCKS: tl.constexpr,
                 SEARCH_WIDTH: tl.constexpr):
    """The first block index b in [lo, hi) whose tile against c_ref is pruned (QUERY_BLOCKS: b is a query block of
    a key block whose last key has c = c_ref, tile bias bound c[first_pos + b * BLOCK] - c_ref) or kept (key blocks of
    a query block whose first query has c = c_ref, bound c_ref - c[first_pos + b * BLOCK]); hi if none. The predicate
    is monotone in b, so each round narrows [lo, hi] to one of SEARCH_WIDTH intervals."""
    hi = tl.maximum(hi, lo)  # hi >= lo already; this makes it a tensor when the launch made it a constant
    while lo < hi:
        step = (hi - lo + SEARCH_WIDTH - 1) // SEARCH_WIDTH
        cand = lo + tl.arange(0, SEARCH_WIDTH) * step
        in_range = cand < hi
        c_cand = tl.load(C + (first_pos + cand * BLOCK).to(tl.int64) * stride_ct, mask=in_range, other=0.0)
        if QUERY_BLOCKS:
            fails = c_cand - c_ref >= delta
        else:
            fails = c_ref - c_cand < delta
        n_before = tl.sum((in_range & fails).to(tl.int32), 0)
        # Candidates [0, n_before) fail, so the answer lies in (cand[n_before - 1], cand[n_before]].
        new_lo = tl.where(n_before > 0, lo + (n_before - 1) * step + 1, lo)
        hi = tl.minimum(lo + n_before * step, hi)
        lo = new_lo
    return lo


@triton.jit
def _first_kept_key(C, stride_ct, c_first_q, delta, lo, first_q, BLOCK_N: tl.constexpr, SEARCH_WIDTH: tl.constexpr):
    """Start of the first key block (from key lo, a multiple of BLOCK_N) that a query block starting at query
    position first_q must visit; the block holding first_q itself always is (its bias bound is >= 0)."""
    first = _first_block(C, stride_ct, c_first_q, delta, lo // BLOCK_N, first_q // BLOCK_N, BLOCK_N - 1, BLOCK_N,
                         False, SEARCH_WIDTH)
    return first * BLOCK_N


@triton.jit
def _segment_shift(C, stride_ct, pos, anchor, SEGMENT: tl.constexpr):
    """(c_s - anchor) * log2(e) in fp32, s the first position of pos's segment: added to the key biases of
    `triton_gate_cumsum` it gives the log2-domain bias of a position against the anchor."""
    c_s = tl.load(C + tl.cast(pos // SEGMENT * SEGMENT, tl.int64) * stride_ct)
    return ((c_s - anchor) * 1.4426950408889634).to(tl.float32)


@triton.jit
def _key_block(K, V, C, C_SEG, bias_origin, stride_kt, stride_vt, stride_ct, anchor, kv_start, seq_k, start_n,
               offs_n, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               HAS_SEQ_START: tl.constexpr, SEGMENT: tl.constexpr, USE_TMA: tl.constexpr, BIAS_TMA: tl.constexpr):
    """(key positions, K tile, V tile, key bias in two parts) of the key block at start_n, as the query-stationary
    passes see it: the log2-domain bias of key j against the anchor is `c_seg[j] + shift`; keys before kv_start
    (left padding) get c_seg +inf. C_SEG and bias_origin come from `_bias_source`."""
    offs_k = start_n + offs_n
    k = _load_rows(K, start_n, offs_n, seq_k, stride_kt, offs_d, HEAD_DIM, BLOCK_D, MASKED, USE_TMA)
    v = _load_rows(V, start_n, offs_n, seq_k, stride_vt, offs_d, HEAD_DIM, BLOCK_D, MASKED, USE_TMA)
    if BIAS_TMA:
        c_seg = C_SEG.load([bias_origin + start_n])
    elif MASKED:
        c_seg = tl.load(C_SEG + offs_k.to(tl.int64) * stride_ct, mask=offs_k < seq_k, other=0.0)
    else:
        c_seg = tl.load(C_SEG + offs_k.to(tl.int64) * stride_ct)
    if HAS_SEQ_START:
        c_seg = tl.where(offs_k >= kv_start, c_seg, float("inf"))
    # A diagonal block may start at seq_k (fully masked, see the forward): its shift is read inside the sequence.
    shift = _segment_shift(C, stride_ct, tl.minimum(start_n, seq_k - 1), anchor, SEGMENT)
    return offs_k, k, v, c_seg, shift


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, C, C_SEG, stride_kt, stride_vt, stride_ct, anchor, q_pos, kv_start, seq_k,
               qk_scale, lo, hi, offs_n, offs_d,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               HAS_SEQ_START: tl.constexpr, DOT_PRECISION: tl.constexpr, SEGMENT: tl.constexpr,
               USE_TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_k, k, v, c_seg, shift = _key_block(K, V, C, C_SEG, 0, stride_kt, stride_vt, stride_ct, anchor,
                                                kv_start, seq_k, start_n, offs_n, offs_d, HEAD_DIM, BLOCK_D, MASKED,
                                                HAS_SEQ_START, SEGMENT, USE_TMA, False)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - (c_seg + shift)[None, :]
        if MASKED:
            s = tl.where(q_pos[:, None] >= offs_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps m = -inf; pivot on 0 so that exp2 never sees -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, C, C_SEG, O, LSE, CU_SEQLENS, SEQ_START, BOUND, ROW_ORDER, PRUNED,
                stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_ob, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_ub, stride_uh,
                Tq, Tk, max_seqlen_q, num_heads, group, head_group, tune_seqlen, qk_scale, log_eps,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
                HAS_SEQ_START: tl.constexpr, DOT_PRECISION: tl.constexpr, PRUNE: tl.constexpr,
                ORDERED: tl.constexpr, COUNT_PRUNED: tl.constexpr, SEARCH_WIDTH: tl.constexpr,
                SEGMENT: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(max_seqlen_q, BLOCK_M)
    bh, heavy_rank = _heaviest_first(pid, num_m, head_group, ROW_ORDER, ORDERED)
    start_m = (num_m - 1 - heavy_rank) * BLOCK_M  # the longest causal rows first
    b = bh // num_heads
    h = bh % num_heads
    batch, bos, seq_q, seq_k, kv_start = _sequence(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if start_m >= seq_q:
        return
    p_seq = seq_k - seq_q  # queries sit at the last seq_q key positions
    Q += batch * stride_qb + bos * stride_qt + h * stride_qh
    K = _row_tiles(K + batch * stride_kb + bos * stride_kt + (h // group) * stride_kh, seq_k, stride_kt, HEAD_DIM,
                   BLOCK_N, BLOCK_D, USE_TMA)
    V = _row_tiles(V + batch * stride_vb + bos * stride_vt + (h // group) * stride_vh, seq_k, stride_vt, HEAD_DIM,
                   BLOCK_N, BLOCK_D, USE_TMA)
    C += batch * stride_cb + bos * stride_ct + h * stride_ch
    C_SEG += batch * stride_cb + bos * stride_ct + h * stride_ch
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = p_seq + offs_m
    q = _load_tile(Q, offs_m, seq_q, stride_qt, offs_d, HEAD_DIM, BLOCK_D, True)
    anchor = tl.load(C + (p_seq + start_m).to(tl.int64) * stride_ct)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = kv_start // BLOCK_N * BLOCK_N
    if PRUNE:
        threshold = _prune_threshold(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
        lo = _first_kept_key(C, stride_ct, anchor, threshold, lo, p_seq + start_m, BLOCK_N, SEARCH_WIDTH)
    diag_lo = tl.maximum(lo, (p_seq + start_m + 1) // BLOCK_N * BLOCK_N)
    hi = tl.minimum(p_seq + start_m + BLOCK_M, seq_k)
    # Stage 1: the causal diagonal. Stage 2: key blocks every query of the block sees in full. The diagonal goes
    # first and the compiler is told that it runs at least once: when a loop that may run zero times comes first, its
    # zero accumulator reaches the pending tensor-core wait and the ptxas of Triton 3.6 serializes every wgmma of
    # the kernel (sm_90, warning C7515; `benchmarks/kernel_resources.py` reports it). It does run: when the block's
    # only query ends a key block, it gets the next key block, fully masked, which leaves the state as it is.
    diag_hi = tl.maximum(hi, diag_lo + BLOCK_N)
    tl.assume(diag_hi > diag_lo)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, C, C_SEG, stride_kt, stride_vt, stride_ct, anchor, q_pos,
                               kv_start, seq_k, qk_scale, diag_lo, diag_hi, offs_n, offs_d,
                               HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_SEQ_START, DOT_PRECISION, SEGMENT, USE_TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, C, C_SEG, stride_kt, stride_vt, stride_ct, anchor, q_pos,
                               kv_start, seq_k, qk_scale, lo, diag_lo, offs_n, offs_d,
                               HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_SEQ_START, DOT_PRECISION, SEGMENT, USE_TMA)

    c_q = tl.load(C + q_pos.to(tl.int64) * stride_ct, mask=offs_m < seq_q, other=0.0)
    q_bias = (c_q - anchor).to(tl.float32) * 1.4426950408889634
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    # Rows that see no key (left padding) output 0; their LSE is +inf so that the backward's P is exactly 0.
    lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe) + q_bias, float("inf"))
    _store_tile(O + batch * stride_ob + bos * stride_ot + h * stride_oh, acc / l_safe[:, None], offs_m, seq_q,
                stride_ot, offs_d, HEAD_DIM)
    tl.store(LSE + (batch * num_heads + h) * Tq + bos + offs_m, lse, mask=offs_m < seq_q)
    if COUNT_PRUNED:
        # Per query row: keys skipped, and keys visible (the denominator of the pruned fraction).
        rows = PRUNED + 2 * ((batch * num_heads + h) * Tq + bos + offs_m)
        tl.store(rows, tl.zeros([BLOCK_M], tl.int32) + tl.maximum(lo - kv_start, 0), mask=offs_m < seq_q)
        tl.store(rows + 1, tl.maximum(q_pos + 1 - kv_start, 0), mask=offs_m < seq_q)


@triton.jit
def _bwd_preprocess(O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh,
                    Tq, num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = rowsum(o_i * do_i), the row term of dS = P * (dP - delta)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(Tq, BLOCK_M)
    bh = pid // num_m
    b = (bh // num_heads).to(tl.int64)
    h = bh % num_heads
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(O + b * stride_ob + h * stride_oh, offs_m, Tq, stride_ot, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_tile(DO + b * stride_dob + h * stride_doh, offs_m, Tq, stride_dot, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Tq + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _bwd_kv_inner(dk, dv, dc, k, v, k_bias, Q, DO, C, LSE, DELTA, stride_qt, stride_dot, stride_ct, anchor,
                  offs_n, p_seq, seq_q, qk_scale, lo, hi, offs_d,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                  CHECK_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, offs_m, seq_q, stride_qt, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
        do = _load_tile(DO, offs_m, seq_q, stride_dot, offs_d, HEAD_DIM, BLOCK_D, CHECK_ROWS)
        if CHECK_ROWS:
            valid_m = offs_m < seq_q
            lse = tl.load(LSE + offs_m, mask=valid_m, other=float("inf"))
            delta = tl.load(DELTA + offs_m, mask=valid_m, other=0.0)
            c_q = tl.load(C + (p_seq + offs_m).to(tl.int64) * stride_ct, mask=valid_m, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(DELTA + offs_m)
            c_q = tl.load(C + (p_seq + offs_m).to(tl.int64) * stride_ct)
        q_row = (c_q - anchor).to(tl.float32) * 1.4426950408889634 - lse
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale + q_row[None, :] - k_bias[:, None]
        if MASKED:
            s_t = tl.where(offs_n[:, None] <= (p_seq + offs_m)[None, :], s_t, float("-inf"))
        p_t = tl.math.exp2(s_t)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
        dc += tl.sum(ds_t, 1)
    return dk, dv, dc


@triton.jit
def _bwd_kv_kernel(Q, K, V, C, DO, LSE, DELTA, DK, DV, DC, CU_SEQLENS, SEQ_START, BOUND, ROW_ORDER,
                   stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh,
                   stride_dvb, stride_dvt, stride_dvh, stride_cb, stride_ct, stride_ch, stride_ub, stride_uh,
                   Tq, Tk, max_seqlen_k, num_heads, group, head_group, tune_seqlen, qk_scale, sm_scale, log_eps,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
                   HAS_SEQ_START: tl.constexpr, DOT_PRECISION: tl.constexpr, PRUNE: tl.constexpr,
                   ORDERED: tl.constexpr, SEARCH_WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(max_seqlen_k, BLOCK_N)
    bh, heavy_rank = _heaviest_first(pid, num_n, head_group, ROW_ORDER, ORDERED)
    start_n = heavy_rank * BLOCK_N  # the earliest keys, seen by the most queries, first
    num_kv_heads = num_heads // group
    b = bh // num_kv_heads
    h_kv = bh % num_kv_heads
    batch, bos, seq_q, seq_k, kv_start = _sequence(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if start_n >= seq_k:
        return
    p_seq = seq_k - seq_q
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K + batch * stride_kb + bos * stride_kt + h_kv * stride_kh, offs_n, seq_k, stride_kt, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    v = _load_tile(V + batch * stride_vb + bos * stride_vt + h_kv * stride_vh, offs_n, seq_k, stride_vt, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    valid_n = (offs_n < seq_k) & (offs_n >= kv_start)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Query blocks [lo, mid) cross the causal diagonal of this key block; [mid, seq_q) see it in full.
    lo = tl.maximum(start_n - p_seq, 0) // BLOCK_M * BLOCK_M
    mid = tl.maximum(lo, (tl.maximum(start_n + BLOCK_N - 1 - p_seq, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    mid = tl.minimum(mid, seq_q)
    for g in range(0, group):
        h = h_kv * group + g
        Q_h = Q + batch * stride_qb + bos * stride_qt + h * stride_qh
        DO_h = DO + batch * stride_dob + bos * stride_dot + h * stride_doh
        C_h = C + batch * stride_cb + bos * stride_ct + h * stride_ch
        row = (batch * num_heads + h) * Tq + bos
        anchor = tl.load(C_h + start_n.to(tl.int64) * stride_ct)
        c_k = tl.load(C_h + offs_n.to(tl.int64) * stride_ct, mask=offs_n < seq_k, other=0.0)
        k_bias = tl.where(valid_n, (c_k - anchor).to(tl.float32) * 1.4426950408889634, float("inf"))
        dc = tl.zeros([BLOCK_N], tl.float32)
        end = seq_q
        if PRUNE:
            # Query blocks from the first whose first query is decayed past delta against the last key are skipped.
            threshold = _prune_threshold(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
            c_last = tl.load(C_h + tl.minimum(start_n + BLOCK_N - 1, seq_k - 1).to(tl.int64) * stride_ct)
            end = _first_block(C_h, stride_ct, c_last, threshold, lo // BLOCK_M, tl.cdiv(seq_q, BLOCK_M), p_seq,
                               BLOCK_M, True, SEARCH_WIDTH) * BLOCK_M
            end = tl.minimum(end, seq_q)
        dk, dv, dc = _bwd_kv_inner(dk, dv, dc, k, v, k_bias, Q_h, DO_h, C_h, LSE + row, DELTA + row, stride_qt,
                                   stride_dot, stride_ct, anchor, offs_n, p_seq, seq_q, qk_scale, lo,
                                   tl.minimum(mid, end), offs_d, HEAD_DIM, BLOCK_D, BLOCK_M, True, True, DOT_PRECISION)
        # Whole query blocks past the diagonal with no mask at all (most of the work: masks on rows cost a predicate
        # per element and block vectorized loads when seq_q comes from cu_seqlens), then the partial last block.
        full_end = tl.maximum(mid, tl.minimum(end, seq_q // BLOCK_M * BLOCK_M))
        dk, dv, dc = _bwd_kv_inner(dk, dv, dc, k, v, k_bias, Q_h, DO_h, C_h, LSE + row, DELTA + row, stride_qt,
                                   stride_dot, stride_ct, anchor, offs_n, p_seq, seq_q, qk_scale, mid, full_end, offs_d,
                                   HEAD_DIM, BLOCK_D, BLOCK_M, False, False, DOT_PRECISION)
        dk, dv, dc = _bwd_kv_inner(dk, dv, dc, k, v, k_bias, Q_h, DO_h, C_h, LSE + row, DELTA + row, stride_qt,
                                   stride_dot, stride_ct, anchor, offs_n, p_seq, seq_q, qk_scale, full_end, end, offs_d,
                                   HEAD_DIM, BLOCK_D, BLOCK_M, False, True, DOT_PRECISION)
        # dL/dc_j = -sum_i dS_ij; this program is the only owner of these keys, so no atomics.
        tl.store(DC + (batch * num_heads + h) * Tk + bos + offs_n, -dc, mask=offs_n < seq_k)
    _store_tile(DK + batch * stride_dkb + bos * stride_dkt + h_kv * stride_dkh, dk * sm_scale, offs_n, seq_k,
                stride_dkt, offs_d, HEAD_DIM)
    _store_tile(DV + batch * stride_dvb + bos * stride_dvt + h_kv * stride_dvh, dv, offs_n, seq_k, stride_dvt,
                offs_d, HEAD_DIM)


@triton.jit
def _bwd_q_inner(dq, row_err, q, do, q_row, delta, K, V, C, C_SEG, bias_origin, stride_kt, stride_vt, stride_ct,
                 anchor, q_pos, kv_start, seq_k, qk_scale, lo, hi, offs_n, offs_d,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 HAS_SEQ_START: tl.constexpr, DOT_PRECISION: tl.constexpr, SEGMENT: tl.constexpr,
                 USE_TMA: tl.constexpr, BIAS_TMA: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_k, k, v, c_seg, shift = _key_block(K, V, C, C_SEG, bias_origin, stride_kt, stride_vt, stride_ct, anchor,
                                                kv_start, seq_k, start_n, offs_n, offs_d, HEAD_DIM, BLOCK_D, MASKED,
                                                HAS_SEQ_START, SEGMENT, USE_TMA, BIAS_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale + (q_row - shift)[:, None] - c_seg[None, :]
        if MASKED:
            s = tl.where(q_pos[:, None] >= offs_k[None, :], s, float("-inf"))
        p = tl.math.exp2(s)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
        row_err += tl.sum(ds, 1)
    return dq, row_err


@triton.jit
def _bwd_q_kernel(Q, K, V, C, C_SEG, DO, LSE, DELTA, DQ, DELTA_CORRECTED, CU_SEQLENS, SEQ_START, BOUND,
                  stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh,
                  stride_cb, stride_ct, stride_ch, stride_ub, stride_uh,
                  Tq, Tk, max_seqlen_q, num_heads, group, head_group, tune_seqlen, qk_scale, sm_scale, log_eps,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
                  HAS_SEQ_START: tl.constexpr, DOT_PRECISION: tl.constexpr, PRUNE: tl.constexpr,
                  SEARCH_WIDTH: tl.constexpr, SEGMENT: tl.constexpr,
                  USE_TMA: tl.constexpr, BIAS_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(max_seqlen_q, BLOCK_M)
    bh, heavy_rank = _heaviest_first(pid, num_m, head_group, None, False)  # rows in index order: `_row_order`
    start_m = (num_m - 1 - heavy_rank) * BLOCK_M  # the longest causal rows first
    b = bh // num_heads
    h = bh % num_heads
    batch, bos, seq_q, seq_k, kv_start = _sequence(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if start_m >= seq_q:
        return
    p_seq = seq_k - seq_q
    K = _row_tiles(K + batch * stride_kb + bos * stride_kt + (h // group) * stride_kh, seq_k, stride_kt, HEAD_DIM,
                   BLOCK_N, BLOCK_D, USE_TMA)
    V = _row_tiles(V + batch * stride_vb + bos * stride_vt + (h // group) * stride_vh, seq_k, stride_vt, HEAD_DIM,
                   BLOCK_N, BLOCK_D, USE_TMA)
    C += batch * stride_cb + bos * stride_ct + h * stride_ch
    C_SEG, bias_origin = _bias_source(C_SEG + batch * stride_cb + h * stride_ch, bos, seq_k, BLOCK_N, BIAS_TMA)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    valid_m = offs_m < seq_q
    q_pos = p_seq + offs_m
    q = _load_tile(Q + batch * stride_qb + bos * stride_qt + h * stride_qh, offs_m, seq_q, stride_qt, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    do = _load_tile(DO + batch * stride_dob + bos * stride_dot + h * stride_doh, offs_m, seq_q, stride_dot, offs_d,
                    HEAD_DIM, BLOCK_D, True)
    row = (batch * num_heads + h) * Tq + bos
    lse = tl.load(LSE + row + offs_m, mask=valid_m, other=float("inf"))
    delta = tl.load(DELTA + row + offs_m, mask=valid_m, other=0.0)
    anchor = tl.load(C + (p_seq + start_m).to(tl.int64) * stride_ct)
    c_q = tl.load(C + q_pos.to(tl.int64) * stride_ct, mask=valid_m, other=0.0)
    q_row = (c_q - anchor).to(tl.float32) * 1.4426950408889634 - lse

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_err = tl.zeros([BLOCK_M], tl.float32)
    lo = kv_start // BLOCK_N * BLOCK_N
    if PRUNE:
        threshold = _prune_threshold(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
        lo = _first_kept_key(C, stride_ct, anchor, threshold, lo, p_seq + start_m, BLOCK_N, SEARCH_WIDTH)
    diag_lo = tl.maximum(lo, (p_seq + start_m + 1) // BLOCK_N * BLOCK_N)
    hi = tl.minimum(p_seq + start_m + BLOCK_M, seq_k)
    # The diagonal first, known to run at least once, as in the forward (keeps ptxas from serializing the wgmma).
    diag_hi = tl.maximum(hi, diag_lo + BLOCK_N)
    tl.assume(diag_hi > diag_lo)
    dq, row_err = _bwd_q_inner(dq, row_err, q, do, q_row, delta, K, V, C, C_SEG, bias_origin, stride_kt, stride_vt,
                               stride_ct, anchor, q_pos, kv_start, seq_k, qk_scale, diag_lo, diag_hi, offs_n, offs_d,
                               HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_SEQ_START, DOT_PRECISION, SEGMENT, USE_TMA,
                               BIAS_TMA)
    dq, row_err = _bwd_q_inner(dq, row_err, q, do, q_row, delta, K, V, C, C_SEG, bias_origin, stride_kt, stride_vt,
                               stride_ct, anchor, q_pos, kv_start, seq_k, qk_scale, lo, diag_lo, offs_n, offs_d,
                               HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_SEQ_START, DOT_PRECISION, SEGMENT, USE_TMA,
                               BIAS_TMA)
    _store_tile(DQ + batch * stride_dqb + bos * stride_dqt + h * stride_dqh, dq * sm_scale, offs_m, seq_q,
                stride_dqt, offs_d, HEAD_DIM)
    # sum_j dS_ij = sum_j P_ij dP_ij - delta_i: zero for the exact delta, but delta comes from the output rounded
    # to bf16. The dK/dV pass, launched next, uses the corrected delta, so dK and the column sums of dS (hence
    # d log f) do not inherit that rounding; it matters where P is nearly one-hot (strong decay). Stored apart, not
    # over delta: the autotuner runs a launch several times, and each run must see the same inputs.
    tl.store(DELTA_CORRECTED + row + offs_m, delta + row_err, mask=valid_m)


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
    chunk sums of the first pass. Forward: Y = c, the cumsum of log f X (X itself when CUMSUM_GIVEN; log f = 0
    before SEQ_START), and Y_SEG = `(c_t - c_s) * log2(e)` in fp32, s the first position of t's segment
    (`_key_block`). REVERSE: Y = the suffix sums of X (d log f from dL/dc), zero before SEQ_START."""
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
    x = _scan_input(X, u, T, stride_xt, kv_start, REVERSE, HAS_SEQ_START)
    if IS_VARLEN:
        first = tl.load(FIRST + t, mask=valid, other=0)
        first0 = tl.load(FIRST + (T - 1 - u0 if REVERSE else u0))
        if REVERSE:
            first, first0 = T - 1 - first, T - 1 - first0
    else:
        first, first0 = 0, 0
    if CUMSUM_GIVEN:  # forward only: c is X, and c_s is read where it lies
        y = x
        key = x - tl.load(X + (u - (u - first) % SEGMENT).to(tl.int64) * stride_xt, mask=valid, other=0.0)
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


@triton.jit
def _max_square_norms_kernel(Q, K, PARTIAL, Tq, Tk, Hq, Hkv, n_blocks, stride_qb, stride_qt, stride_qh, stride_kb,
                             stride_kt, stride_kh, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """PARTIAL[b, h, i] = max over the BLOCK_T positions t of block i of |x[b, t, h, :]|^2 in fp32, x = q (program
    axis 1 = 0) or k (1, heads Hq + h); NaN counts as +inf, so that a NaN input gives U = inf (nothing pruned)."""
    pid = tl.program_id(0)
    b = pid // n_blocks
    block = pid - b * n_blocks
    offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    if tl.program_id(1) == 0:
        x_ptrs = Q + b.to(tl.int64) * stride_qb + offs_t[:, None, None].to(tl.int64) * stride_qt
        x_ptrs += offs_h[None, :, None] * stride_qh + offs_d[None, None, :]
        length, heads, first_head = Tq, Hq, 0
    else:
        x_ptrs = K + b.to(tl.int64) * stride_kb + offs_t[:, None, None].to(tl.int64) * stride_kt
        x_ptrs += offs_h[None, :, None] * stride_kh + offs_d[None, None, :]
        length, heads, first_head = Tk, Hkv, Hq
    mask = (offs_t[:, None, None] < length) & (offs_h[None, :, None] < heads) & (offs_d[None, None, :] < HEAD_DIM)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    square_norms = tl.sum(x * x, 2)
    square_norms = tl.where(square_norms == square_norms, square_norms, float("inf"))
    rows = (b * (Hq + Hkv) + first_head + offs_h).to(tl.int64) * n_blocks + block
    tl.store(PARTIAL + rows, tl.max(square_norms, 0), mask=offs_h < heads)


# ----------------------------------------------------------------------------------------------------------------
# Launch configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dim, the fastest on an H100 at
# T = 4k and 16k first (`benchmarks/sweep_attention_configs.py`; FOXLM_AUTOTUNE=0 takes it alone), then the runners-up.
# Autotuned once per (head dim, GQA group, flags, length class): `tune_seqlen`, a kernel argument only the autotuner
# reads (`_tune_seqlen`). Pruned and unpruned launches share the choice, so that pruning nothing is bit-identical to
# not pruning. Configurations whose pipelined tiles do not fit the device's shared memory are dropped first, so that
# GPUs with ~100 KB per block (Ada, consumer Blackwell) get smaller tiles instead of an error.


@triton.jit
def _row_work(C, CU_SEQLENS, SEQ_START, BOUND, rows, stride_cb, stride_ct, stride_ch, stride_ub, stride_uh, Tq, Tk,
              num_heads, log_eps, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr):
    """floor(log2(share)) of each (sequence * heads + head) row in `rows` (all < the row count), share ~ the part
    of the row's causal work that pruning keeps: about 2|delta| / |c_last| for a head that forgets at a steady rate
    (c_last its sequence's total log forget gate), at most 1 (heads that keep everything, NaN bounds or gates);
    -inf for empty sequences. Classes of powers of two, so that rows of about the same work keep their index order:
    in the exact order of c_last the head-dim-64 passes ran 2-3% slower on an H100, in classes as in index order; at
    128 the two orders measured within 2% of each other (`benchmarks/results/row_order_ab_*.json`)."""
    b = rows // num_heads
    h = rows % num_heads
    batch, bos, seq_q, seq_k, kv_start = _sequence(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    threshold = _prune_threshold(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
    nonempty = rows * 0 + seq_k > 0  # a vector also where seq_k is the launch's scalar length
    c_last = tl.load(C + batch * stride_cb + h * stride_ch + (bos + tl.maximum(seq_k - 1, 0)) * stride_ct,
                     mask=nonempty, other=0.0)
    share = tl.minimum(2.0 * threshold / tl.minimum(c_last, -1e-30), 1.0)
    work = tl.floor(tl.log2(share.to(tl.float32)))
    return tl.where(nonempty, tl.where(work == work, work, 0.0), float("-inf"))


@triton.jit
def _row_order_kernel(C, CU_SEQLENS, SEQ_START, BOUND, ORDER, stride_cb, stride_ct, stride_ch, stride_ub, stride_uh,
                      Tq, Tk, num_heads, n_rows, log_eps, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr,
                      BLOCK: tl.constexpr):
    """ORDER[rank] = row for BLOCK rows: rank = the rows of more work (`_row_work`), and of the same work with a lower
    index, before it; a stable descending sort in one launch, counting over all rows in chunks of BLOCK."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = rows < n_rows
    work = _row_work(C, CU_SEQLENS, SEQ_START, BOUND, tl.minimum(rows, n_rows - 1), stride_cb, stride_ct, stride_ch,
                     stride_ub, stride_uh, Tq, Tk, num_heads, log_eps, IS_VARLEN, HAS_SEQ_START)
    rank = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        others = start + tl.arange(0, BLOCK)
        other_work = _row_work(C, CU_SEQLENS, SEQ_START, BOUND, tl.minimum(others, n_rows - 1), stride_cb, stride_ct,
                               stride_ch, stride_ub, stride_uh, Tq, Tk, num_heads, log_eps, IS_VARLEN, HAS_SEQ_START)
        before = (other_work[None, :] > work[:, None]) | ((other_work[None, :] == work[:, None])
                                                          & (others[None, :] < rows[:, None]))
        rank += tl.sum((before & (others[None, :] < n_rows)).to(tl.int32), 1)
    tl.store(ORDER + rank, rows, mask=valid)


def _configs(entries):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in entries]


if _INTERPRET:
    # The interpreter runs numpy per program: small, unequal blocks exercise every boundary case cheaply.
    _FWD_CONFIGS = {0: _configs([(32, 16, 4, 1)])}
    _BWD_KV_CONFIGS = {0: _configs([(16, 32, 4, 1)])}
    _BWD_Q_CONFIGS = {0: _configs([(32, 16, 4, 1)])}
else:
    _FWD_CONFIGS = {
        64: _configs([(128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3)]),
        128: _configs([(128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]),
        256: _configs([(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)]),
    }
    _BWD_KV_CONFIGS = {
        64: _configs([(32, 128, 4, 3), (32, 128, 4, 2), (64, 64, 4, 4), (32, 64, 4, 2)]),
        # 64 queries x 128 keys on 8 warps: 26% fewer instructions per score than 32 x 64, 1-7% faster dK/dV on
        # equal-length heads, 4-15% slower with GQA or packed sequences (`results/dkdv_config_ab_*.json`).
        128: _configs([(32, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 2)]),
        256: _configs([(32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 1)]),
    }
    _BWD_Q_CONFIGS = {
        64: _configs([(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3)]),
        128: _configs([(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)]),
        256: _configs([(64, 32, 4, 2), (64, 16, 4, 2), (32, 32, 4, 1)]),
    }
_FALLBACK = _configs([(16, 16, 4, 1)])
assert all(SEGMENT % c.kwargs["BLOCK_N"] == 0 for table in (_FWD_CONFIGS, _BWD_Q_CONFIGS)
           for c in sum(table.values(), _FALLBACK)), "every forward and dQ key block must lie in one SEGMENT"


def _pruner(table, tile_elements):
    """Configs for this head dim that fit in shared memory; tile_elements(BLOCK_M, BLOCK_N, BLOCK_D, stages)
    counts the elements of the tiles a kernel keeps in shared memory."""

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        candidates = table[0] if 0 in table else table[min(d for d in table if d >= block_d)]
        if not _INTERPRET:
            q = named_args["Q"]
            limit = triton.runtime.driver.active.utils.get_device_properties(q.device.index)["max_shared_mem"]
            candidates = [c for c in candidates if q.element_size() * tile_elements(
                c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], block_d, c.num_stages) <= limit] or _FALLBACK
        return candidates if _AUTOTUNE else candidates[:1]

    return prune


def _autotuned(kernel, table, tile_elements):
    configs = [c for entries in table.values() for c in entries] + _FALLBACK
    key = [name for name in ("BLOCK_D", "group", "HAS_SEQ_START", "IS_VARLEN", "USE_TMA", "tune_seqlen")
           if name in kernel.arg_names]  # the dK/dV kernel has no USE_TMA
    return triton.autotune(configs, key=key,
                           prune_configs_by={"early_config_prune": _pruner(table, tile_elements)})(kernel)


# Forward: Q resident, K and V pipelined. dK/dV: K and V resident, Q and dO pipelined. dQ: Q and dO resident.
_fwd = _autotuned(_fwd_kernel, _FWD_CONFIGS, lambda m, n, d, stages: m * d + stages * 2 * n * d)
_bwd_kv = _autotuned(_bwd_kv_kernel, _BWD_KV_CONFIGS, lambda m, n, d, stages: 2 * n * d + stages * 2 * m * d)
_bwd_q = _autotuned(_bwd_q_kernel, _BWD_Q_CONFIGS, lambda m, n, d, stages: 2 * m * d + stages * 2 * n * d)


# ----------------------------------------------------------------------------------------------------------------
# Host side.


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _tune_seqlen(max_seqlen):
    """The length class the autotuner keys on: the best tiles differ between short and long sequences, and one
    process may run both (a benchmark, prefill then training). Powers of two from 1k to 16k, so that a new length
    retunes at most five times per head dim; all of them divisible by 16, so the compiled code does not change."""
    return min(max(triton.next_power_of_2(max(int(max_seqlen), 1)), 1024), 16384)


def _use_tma(*tensors):
    """Whether the main loops load their tiles through TMA descriptors (`_row_tiles`): on Hopper and newer NVIDIA GPUs
    (and in the interpreter) with a Triton that makes them in kernels (`tl.make_tensor_descriptor`), when every row of
    these (batch, seqlen, heads, head_dim) tensors starts at a multiple of 16 bytes, as TMA requires. The descriptors
    live in a per-launch scratch buffer, which Triton takes from the allocator of `triton.set_allocator`: a torch one
    is set here unless the user set their own."""
    if not TMA_LOADS or _allocation is None or not hasattr(tl, "make_tensor_descriptor") or torch.version.hip:
        return False
    if not _INTERPRET and _compute_capability(tensors[0].device.index)[0] < 9:
        return False
    if not all(t.data_ptr() % 16 == 0 and all(n * t.element_size() % 16 == 0 for n in (*t.stride()[:-1], t.shape[-1]))
               for t in tensors):
        return False
    current = _allocation._allocator
    if hasattr(current, "get"):  # a ContextVar from Triton 3.5 on (per thread: autograd's threads start unset)
        current = current.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_scratch)
    return True


def _dq_bias_tma(pruned, block_d, packed):
    """Whether the dQ loop loads its key biases through a TMA descriptor (`_bias_source`) rather than pointers, where
    `_use_tma` allows it for them: only for the pruned kernel at head dim 64, whose main loop spilled the 64-bit
    addresses of the pointer loads (23 local-memory accesses per iteration, 9 through TMA;
    `benchmarks/kernel_resources.py --prune`): on an H100 at 16k that pass ran 9% faster on the ACP gate mix and 2%
    on open gates. Elsewhere it did not pay: unpruned D64 dQ 2% faster at 16k but 3% slower at 4k, D128 dQ 2-4%
    slower, the forward 1-4% slower (`benchmarks/results/bias_tma_ab_*.json`, `delta_in_dq_ab_*.json`). Never for
    packed sequences: a descriptor's tile must start 16-byte aligned, and their sequences start anywhere."""
    return pruned and block_d <= 64 and not packed


@functools.lru_cache
def _compute_capability(device_index):
    return torch.cuda.get_device_capability(device_index)  # a query per call costs host time on every launch


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cpu" if _INTERPRET else "cuda")  # the launch's current device


# Positions per program of the gate scans: every (row, chunk) is a program of each of two launches.
_SCAN_CHUNK, _SCAN_WARPS = (32, 1) if _INTERPRET else (1024, 4)


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
    itself when `gate_is_cumsum`), restarted at each packed sequence, log f = 0 before `seq_start`; key_bias the fp32
    `(c_t - c_s) * log2(e)`, s the first position of t's SEGMENT-long segment counted from its sequence's start (the
    kernels add `c_s - anchor` back once per key block, `_segment_shift`). Both (B, H, T), unit stride along T."""
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


_NORM_TILE = 4096  # elements of q per program of `triton_max_square_norms` (8 KB of bf16; 16 KB: up to 24% slower)


def triton_max_square_norms(q, k):
    """(max_t |q[b, t, h, :]|^2 (B, Hq), max_t |k[b, t, h, :]|^2 (B, Hkv)) in fp32 for (B, T, H, D) q and k, whose
    lengths may differ: one launch that reads each once (BLOCK_T positions of all heads per program), then a reduction
    of the block maxima along their contiguous axis; no host sync. ACP's measured U (`acp.measured_score_bound`)."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    longest = max(Tq, Tk)
    if B * longest == 0:
        return q.new_zeros(B, Hq, dtype=torch.float32), q.new_zeros(B, Hkv, dtype=torch.float32)
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    block_h, block_d = triton.next_power_of_2(Hq), triton.next_power_of_2(D)
    block_t = max(1, min(triton.next_power_of_2(longest), _NORM_TILE // (block_h * block_d)))
    n_blocks = triton.cdiv(longest, block_t)
    # Blocks past a tensor's length (q against a longer cache) store 0, a norm's lower bound.
    partial = torch.empty(B, Hq + Hkv, n_blocks, device=q.device, dtype=torch.float32)
    _max_square_norms_kernel[(B * n_blocks, 2)](q, k, partial, Tq, Tk, Hq, Hkv, n_blocks, *q.stride()[:3],
                                                *k.stride()[:3], HEAD_DIM=D, BLOCK_T=block_t, BLOCK_H=block_h,
                                                BLOCK_D=block_d)
    return partial.amax(-1).split((Hq, Hkv), dim=1)


def _head_group(pruned, group, block_d, num_bh):
    """How many of the launch's `num_bh` (sequence, query head) pairs run their heavy blocks first together
    (`_heaviest_first`). All of them: head by head, the heaviest blocks of the last heads start last, and the launch
    ends on them with SMs idle; that costs where heads differ in work (pruning: up to 100x), where programs are few
    per head (GQA: a dK/dV program loops over its group) and, measured, at head dim 64 (4-7% at 16k, 2-4% at 4k on an
    H100, `benchmarks/results/head_order_ab_*.json`). At head dim 128 and more without GQA, the K/V of all heads in
    flight at once (two pipeline stages to hide their misses) cost more: head by head was 3% faster at 16k, and with
    pruning, pairs of heads kept most of the all-heads gain on the ACP gate mix while matching the unpruned speed on
    open gates (`benchmarks/results/head_group_ab_*.json`); the pairs then come in the order of `_row_order`. The
    dK/dV launch takes the same count: its pairs are (sequence, KV head), no more than `num_bh`, and as many without
    GQA."""
    if group > 1 or block_d <= 64:
        return max(num_bh, 1)
    return 2 if pruned else 1


def _row_order(c, bound, log_eps, cu_seqlens, seq_start, Tq, Tk):
    """The (sequence, head) rows of a pruned launch, those expected to keep the most work first (`_row_work`), ties in
    index order; int32 (rows,), one launch (`_row_order_kernel`; a torch argsort took five), no host sync. Pruning
    leaves heads that forget fast a few blocks per program and heads that forget slowly nearly all of theirs; in
    index order the slow heads' heavy blocks can start last and the launch end on them. Used where rows go in groups
    smaller than all of them (`_head_group`: pruned head dim 128 without GQA), by the forward and the dK/dV pass:
    there, on the ACP gate mix, the forward ran 0.5-2% and the dK/dV pass 4-5% faster with it, the dQ pass 5-6%
    slower (H100; 2.5% less forward+backward with the slow heads at random places on an H200), and at head dim 64
    (all rows in one group) the whole call 0.5-1.5% slower (`benchmarks/results/row_order_ab_*.json`)."""
    n_seqs = c.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    num_heads = c.shape[1]
    n_rows = n_seqs * num_heads
    order = torch.empty(n_rows, device=c.device, dtype=torch.int32)
    block = min(max(triton.next_power_of_2(n_rows), 16), 128)  # a few rows: a small count, not 128 x 128
    _row_order_kernel[(triton.cdiv(n_rows, block),)](
        c, cu_seqlens, seq_start, bound, order, c.stride(0), c.stride(2), c.stride(1), *bound.stride(), Tq, Tk,
        num_heads, n_rows, log_eps, IS_VARLEN=cu_seqlens is not None, HAS_SEQ_START=seq_start is not None,
        BLOCK=block)
    return order


def _hopper_kernels(q, k, c, key_bias, cu_seqlens, seq_start):
    """`gluon_attention` where its Hopper kernels serve the call (the forward and the dK/dV pass: sm_90, bf16, head
    dim 128, no GQA, equal-length unpadded sequences of a multiple of 128 positions), else None. Triton versions
    without Gluon get None."""
    if _INTERPRET or not q.is_cuda or not (c.is_contiguous() and key_bias.is_contiguous()):
        return None
    try:
        from . import gluon_attention
    except ImportError:
        return None
    return gluon_attention if gluon_attention.eligible(q, k, cu_seqlens, seq_start) else None


def _common(q, k, c, cu_seqlens, max_seqlen, seq_start, prune_eps, score_bound):
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
    head_group = _head_group(prune_eps is not None, group, block_d, n_seqs * Hq)
    ordered = prune_eps is not None and head_group < n_seqs * Hq
    if prune_eps is None:
        bound = q.new_empty((1,), dtype=torch.float32).expand(B, Hq)
    else:
        bound = score_bound.to(device=q.device, dtype=torch.float32).expand(B, Hq)
    log_eps = 0.0 if prune_eps is None else math.log(prune_eps)
    row_order = (_row_order(c, bound, log_eps, cu_seqlens, seq_start, Tq, Tk) if ordered
                 else q.new_empty((1,), dtype=torch.int32))
    return dict(
        n_seqs=n_seqs, max_q=max_q, max_k=max_k, cu_seqlens=cu_seqlens, seq_start=seq_start,
        block_d=block_d, group=group, tune_seqlen=_tune_seqlen(max_k),
        dot_precision="ieee" if q.dtype == torch.float32 else "tf32",
        bound=bound, bound_strides=bound.stride(), row_order=row_order, ordered=ordered,
        log_eps=log_eps, head_group=head_group,
    )


def triton_attention_forward(q, k, v, c, key_bias, sm_scale, cu_seqlens=None, max_seqlen=None, seq_start=None,
                             prune_eps=None, score_bound=None, pruned_counts=None):
    """Returns (out (B, Tq, Hq, D), lse (B, Hq, Tq) fp32 in the log2 domain). `c` and `key_bias` come from
    `triton_gate_cumsum`. With `prune_eps`, tiles are pruned against `score_bound`
    (U >= |sm_scale q.k|, float32 broadcastable to (B, Hq)); `pruned_counts`, an int32 (B, Hq, Tq, 2) tensor, then
    receives each query row's (skipped keys, visible keys). The other arguments are those of
    `forgetting_attention`."""
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    cfg = _common(q, k, c, cu_seqlens, max_seqlen, seq_start, prune_eps, score_bound)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, Tq, device=q.device, dtype=torch.float32)
    if q.numel() == 0 or cfg["max_q"] == 0:
        return out.zero_(), lse.fill_(float("inf"))
    hopper = _hopper_kernels(q, k, c, key_bias, cu_seqlens, seq_start)
    if hopper is not None:
        hopper.forward(q, k, v, c, key_bias, out, lse, sm_scale, cfg["bound"], cfg["log_eps"], prune_eps is not None,
                       cfg["head_group"], cfg["row_order"], cfg["ordered"], pruned_counts)
        return out, lse
    grid = lambda meta: (triton.cdiv(cfg["max_q"], meta["BLOCK_M"]) * cfg["n_seqs"] * Hq,)  # noqa: E731
    _fwd[grid](
        q, k, v, c, key_bias, out, lse, cfg["cu_seqlens"], cfg["seq_start"], cfg["bound"], cfg["row_order"],
        q.new_empty((1,), dtype=torch.int32) if pruned_counts is None else pruned_counts,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], c.stride(0), c.stride(2), c.stride(1),
        *cfg["bound_strides"], Tq, Tk, cfg["max_q"], Hq, cfg["group"], cfg["head_group"], cfg["tune_seqlen"],
        sm_scale * LOG2E, cfg["log_eps"],
        HEAD_DIM=D, BLOCK_D=cfg["block_d"], IS_VARLEN=cu_seqlens is not None,
        HAS_SEQ_START=seq_start is not None, DOT_PRECISION=cfg["dot_precision"], PRUNE=prune_eps is not None,
        ORDERED=cfg["ordered"], COUNT_PRUNED=pruned_counts is not None, SEARCH_WIDTH=SEARCH_WIDTH,
        SEGMENT=SEGMENT, USE_TMA=_use_tma(k, v),
    )
    return out, lse


def triton_attention_backward(do, q, k, v, out, lse, c, key_bias, sm_scale, cu_seqlens=None, max_seqlen=None,
                              seq_start=None, prune_eps=None, score_bound=None):
    """Returns (dq, dk, dv, dc) with dc = dL/dc of shape (B, Hq, Tk) in fp32 (`triton_gate_gradient` turns it into
    d log f); c, key_bias and lse as the forward used or returned them."""
    q, k, v, out, do = (_last_dim_contiguous(t) for t in (q, k, v, out, do))
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    cfg = _common(q, k, c, cu_seqlens, max_seqlen, seq_start, prune_eps, score_bound)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dc = torch.empty(B, Hq, Tk, device=q.device, dtype=torch.float32)
    if q.numel() == 0 or cfg["max_q"] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dc.zero_()
    delta = torch.empty(B, Hq, Tq, device=q.device, dtype=torch.float32)
    delta_corrected = torch.empty_like(delta)
    block = 64
    _bwd_preprocess[(triton.cdiv(Tq, block) * B * Hq,)](
        out, do, delta, *out.stride()[:3], *do.stride()[:3], Tq, Hq,
        HEAD_DIM=D, BLOCK_D=cfg["block_d"], BLOCK_M=block,
    )
    common = dict(HEAD_DIM=D, BLOCK_D=cfg["block_d"], IS_VARLEN=cu_seqlens is not None,
                  HAS_SEQ_START=seq_start is not None, DOT_PRECISION=cfg["dot_precision"],
                  PRUNE=prune_eps is not None, SEARCH_WIDTH=SEARCH_WIDTH)
    c_strides = (c.stride(0), c.stride(2), c.stride(1))
    grid_q = lambda meta: (triton.cdiv(cfg["max_q"], meta["BLOCK_M"]) * cfg["n_seqs"] * Hq,)  # noqa: E731
    _bwd_q[grid_q](
        q, k, v, c, key_bias, do, lse, delta, dq, delta_corrected, cfg["cu_seqlens"], cfg["seq_start"], cfg["bound"],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3], *c_strides,
        *cfg["bound_strides"], Tq, Tk, cfg["max_q"], Hq, cfg["group"], cfg["head_group"], cfg["tune_seqlen"],
        sm_scale * LOG2E, sm_scale, cfg["log_eps"], SEGMENT=SEGMENT, USE_TMA=_use_tma(k, v),
        BIAS_TMA=_dq_bias_tma(prune_eps is not None, cfg["block_d"], cu_seqlens is not None) and _use_tma(key_bias),
        **common,
    )
    hopper = _hopper_kernels(q, k, c, key_bias, cu_seqlens, seq_start)
    if hopper is not None:  # the dK/dV pass only: the Triton dQ pass above was faster than a Gluon one (notes)
        hopper.dkdv(q, k, v, do, c, key_bias, lse, delta_corrected, dk, dv, dc, sm_scale, cfg["bound"], cfg["log_eps"],
                    prune_eps is not None, cfg["head_group"], cfg["row_order"], cfg["ordered"])
        return dq, dk, dv, dc
    grid_kv = lambda meta: (triton.cdiv(cfg["max_k"], meta["BLOCK_N"]) * cfg["n_seqs"] * Hkv,)  # noqa: E731
    _bwd_kv[grid_kv](
        q, k, v, c, do, lse, delta_corrected, dk, dv, dc, cfg["cu_seqlens"], cfg["seq_start"], cfg["bound"],
        cfg["row_order"],
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        *c_strides, *cfg["bound_strides"], Tq, Tk, cfg["max_k"], Hq, cfg["group"], cfg["head_group"],
        cfg["tune_seqlen"], sm_scale * LOG2E, sm_scale, cfg["log_eps"], ORDERED=cfg["ordered"], **common,
    )
    return dq, dk, dv, dc


def forgetting_attention_triton(q, k, v, log_fgate=None, *, fgate_cumsum=None, sm_scale=None, cu_seqlens=None,
                                max_seqlen=None, seq_start=None):
    """Triton Forgetting Attention, differentiable; the same as `forgetting_attention(..., backend="triton")`."""
    from .interface import forgetting_attention

    return forgetting_attention(q, k, v, log_fgate, fgate_cumsum=fgate_cumsum, sm_scale=sm_scale,
                                cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_start=seq_start, backend="triton")
