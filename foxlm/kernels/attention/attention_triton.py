"""Triton Forgetting Attention: the forward and backward kernels (launched by `attention_launch.py`).

`o_i = sum_j softmax_j(sm_scale * q_i.k_j + c_i - c_j) v_j`, c the inclusive cumsum of log f (docs/design.md §1).

Design (docs/design.md §3, §4 and §7):
- Scores live in the exp2 domain: `sm_scale * log2(e)` is folded into one multiplier and the decay bias is scaled
  by log2(e) once per key/query vector, so the inner loop costs one FMA and one FSUB per score over plain attention.
- No catastrophic cancellation: c is kept in float64 in memory (O(T) bytes) and every program subtracts a float64
  anchor (the c of its first query or key) before rounding to fp32, so `c_i - c_j` stays exact to fp32 precision
  however large |c| grows at long T with strong decay. The key biases that the forward and dQ main loops walk over
  come in two parts instead (`triton_gate_cumsum`): `c_j - c_s` in fp32, s the first key of j's SEGMENT-long segment,
  and `c_s - anchor`, one float64 subtraction per key block, not one per key (faster; benchmarks/NOTES_attention.md,
  "Figures from the kernel sources").
- The softmax ignores per-row constants, so the forward tracks its running max on `s - c_j` and adds `c_i` back only
  into the stored log-sum-exp.
- Masking rides on the bias vectors: keys before `seq_start` (left padding) get bias +inf, query rows past the end
  get LSE +inf, so off-diagonal blocks need no element-wise mask; only diagonal blocks (their own loop stage) do.
  The dK/dV pass also runs the last, partial query block apart, so that its main loop has no row mask at all.
- Backward, two passes and no atomics (deterministic): the query-stationary dQ pass runs first and also returns
  delta = rowsum(o * do) plus `sum_j dS_ij`, which is exactly its error when taken from the rounded output; the
  key-stationary dK/dV pass then uses the corrected delta. dK/dV programs loop over the query heads of their GQA group,
  so dK/dV are reduced in registers (no per-query-head copy), and they own `dc_j = -sum_i dS_ij` (the row sums of dS
  vanish, docs/design.md §3); `d log f` is then a float64 reverse cumsum.
- c and the key biases come from a float64 scan over the gates (`attention_gate_scan.py`), d log f from a reverse
  scan.
- 1-D grids (no 65535 limit on y/z), 64-bit base offsets, heavy blocks launched first (`_heaviest_first`), of
  all heads at once or of a few heads at a time (`attention_tuning.head_group`).
- On Hopper and newer, the forward and dQ loops load K/V through TMA descriptors made per program (`_row_tiles`:
  the copy engine computes addresses and zero-fills rows past the sequence and columns past head_dim, as the
  pointer tiles' masks do, so both paths give bit-identical results); the pruned D64 dQ loop loads its key biases
  that way too (`_bias_source`); `dispatch.use_tma` and `dispatch.use_dq_bias_tma` choose.
- Adaptive Computation Pruning (docs/acp.md), when `prune_eps` is given: a tile with first query i0
  and last key j1 has every bias `<= c_i0 - c_j1`, and is skipped when that is below `acp_delta` (`acp.py`; then
  each query loses at most eps of its attention mass). c is monotone, so the kept key blocks of a query block
  are a suffix and the kept query blocks of a key block a prefix: each program finds its boundary by a
  SEARCH_WIDTH-ary search over c (one vector load per round, two rounds at 16k), in the forward, dQ and dK/dV passes.
  A NaN bound prunes nothing. Without a given bound, U comes from one reduction over q and k
  (`acp.triton_max_square_norms`).
"""

import triton
import triton.language as tl

from ..acp import acp_row_delta
from ..common import sequence_bounds
from .attention_tuning import BWD_KV_CONFIGS, BWD_Q_CONFIGS, FWD_CONFIGS, autotuned

# Candidates per round of the pruning boundary search: 32^2 blocks (64k keys at 64-key blocks) in two rounds.
SEARCH_WIDTH = 32


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
def _heaviest_first(pid, num_blocks, head_group, ROW_ORDER, ORDERED: tl.constexpr):
    """(sequence * heads + head, i) of program `pid`, i = 0 for the block with the most causal work. The (sequence,
    head) pairs go in groups of `head_group` (the last group may be smaller), and within a group the heavy blocks of
    all its pairs go first, so the scheduler's last programs are short ones (list scheduling). 1: head by head.
    ORDERED: the pairs in the order of ROW_ORDER (`acp.row_order`: the least pruned first), else in index order."""
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
def _first_block(C, stride_ct, c_ref, acp_delta, lo, hi, first_pos, BLOCK: tl.constexpr, QUERY_BLOCKS: tl.constexpr,
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
            fails = c_cand - c_ref >= acp_delta
        else:
            fails = c_ref - c_cand < acp_delta
        n_before = tl.sum((in_range & fails).to(tl.int32), 0)
        # Candidates [0, n_before) fail, so the answer lies in (cand[n_before - 1], cand[n_before]].
        new_lo = tl.where(n_before > 0, lo + (n_before - 1) * step + 1, lo)
        hi = tl.minimum(lo + n_before * step, hi)
        lo = new_lo
    return lo


@triton.jit
def _first_kept_key(C, stride_ct, c_first_q, acp_delta, lo, first_q, BLOCK_N: tl.constexpr, SEARCH_WIDTH: tl.constexpr):
    """Start of the first key block (from key lo, a multiple of BLOCK_N) that a query block starting at query
    position first_q must visit; the block holding first_q itself always is (its bias bound is >= 0)."""
    first = _first_block(C, stride_ct, c_first_q, acp_delta, lo // BLOCK_N, first_q // BLOCK_N, BLOCK_N - 1, BLOCK_N,
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
    batch, bos, seq_q, seq_k, kv_start = sequence_bounds(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
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
        acp_delta = acp_row_delta(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
        lo = _first_kept_key(C, stride_ct, anchor, acp_delta, lo, p_seq + start_m, BLOCK_N, SEARCH_WIDTH)
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
    batch, bos, seq_q, seq_k, kv_start = sequence_bounds(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
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
            # Query blocks from the first whose first query is decayed past acp_delta against the last key are skipped.
            acp_delta = acp_row_delta(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
            c_last = tl.load(C_h + tl.minimum(start_n + BLOCK_N - 1, seq_k - 1).to(tl.int64) * stride_ct)
            end = _first_block(C_h, stride_ct, c_last, acp_delta, lo // BLOCK_M, tl.cdiv(seq_q, BLOCK_M), p_seq,
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
    bh, heavy_rank = _heaviest_first(pid, num_m, head_group, None, False)  # rows in index order: `acp.row_order`
    start_m = (num_m - 1 - heavy_rank) * BLOCK_M  # the longest causal rows first
    b = bh // num_heads
    h = bh % num_heads
    batch, bos, seq_q, seq_k, kv_start = sequence_bounds(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
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
        acp_delta = acp_row_delta(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
        lo = _first_kept_key(C, stride_ct, anchor, acp_delta, lo, p_seq + start_m, BLOCK_N, SEARCH_WIDTH)
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


# ----------------------------------------------------------------------------------------------------------------
# What the launchers call: the three main kernels autotuned over their launch configurations (`attention_tuning.py`),
# and the delta pass. Forward: Q resident, K and V pipelined. dK/dV: K and V resident, Q and dO pipelined. dQ: Q and
# dO resident.
fwd = autotuned(_fwd_kernel, FWD_CONFIGS, lambda m, n, d, stages: m * d + stages * 2 * n * d)
bwd_kv = autotuned(_bwd_kv_kernel, BWD_KV_CONFIGS, lambda m, n, d, stages: 2 * n * d + stages * 2 * m * d)
bwd_q = autotuned(_bwd_q_kernel, BWD_Q_CONFIGS, lambda m, n, d, stages: 2 * m * d + stages * 2 * n * d)
bwd_preprocess = _bwd_preprocess
