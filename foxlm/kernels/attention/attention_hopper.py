"""Forgetting Attention forward and dK/dV pass for Hopper GPUs (sm_90), written in Gluon (Triton's lower-level
language), with FlashAttention-3's warp specialization.

`attention_launch.py` calls these kernels where `dispatch.runs_on_hopper` picks them and the Triton kernels everywhere
else (the dQ pass is always Triton's); `FOXLM_GLUON=0` turns them off. The math is the Triton kernels': scores in the
log2 domain, key biases in two parts (fp32 within a 128-position segment plus one float64 shift per block), the same
pruning rule (`acp.compute_acp_delta`), searches and pruned-fraction counts, the same order of programs (heaviest
blocks first). They are faster than the Triton forward and dK/dV pass on an H100 at D128; a Gluon dQ pass of an
earlier design was slower than the Triton one and is not used (figures: `benchmarks/NOTES_attention.md`, sections
of 2026-11-24, and "Figures from the kernel sources").

Forward: one program per 128 query rows; two consumer warpgroups (64 rows each, each its own partition) take turns
on the tensor cores, one's softmax under the other's matrix products (the turn passes through two mbarriers), and a
producer warp loads K and V through TMA into two-slot rings that both consumers release, and computes each key block's
biases into shared memory beside K. Key blocks wholly before a warpgroup's queries run without the causal mask.
dK/dV: one program per 128 keys on two warpgroups, K and V resident in shared memory, 64-query blocks of Q and dO
through a two-slot TMA ring, S^T and dP^T issued together, P^T and dS^T fed from registers to the dV and dK products,
the diagonal's query blocks apart from the rest. Neither issues float64 arithmetic while its products are in flight:
there it waited for them (Nsight Compute, notes).

Scope (`dispatch.hopper_shape`): bf16, head dim 64 or 128, as many K/V heads as query heads or fewer (GQA: the
forward reads each query head's K/V head in place; the dK/dV pass writes each query head's share in fp32 and the host
sums each group), equal-length unpadded sequences whose length is a multiple of 128 (queries and keys alike).
`dispatch.runs_on_hopper` takes the forward at head dim 128 only: at 64 the Triton forward was faster.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..acp import compute_acp_delta
from ..common import HOPPER_TILE

# Names that later Tritons changed (3.6, the oldest supported, has the second of each): TMA's global-to-shared copy
# and the barrier of a CTA's threads.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# Launch settings (also `foxlm bench kernel-resources --kernels hopper-fwd hopper-dkdv`): the forward's consumer
# warpgroups get the registers the producer warp does not need.
FWD_LAUNCH = dict(num_warps=4, maxnreg=168)
DKDV_LAUNCH = dict(num_warps=8)
WG_ROWS = gl.constexpr(64)  # query rows per forward consumer warpgroup
BLOCK_M_BWD = 64  # query rows per dK/dV iteration
SEARCH_WIDTH = gl.constexpr(32)
_acp_delta = gluon.jit(compute_acp_delta)  # the one formula of acp_delta, compiled into these kernels


def _rows(x, block_rows):
    """A TMA descriptor over (B, T, H, D) as a (B*T, H*D) matrix, `block_rows` x D tiles; copies only tensors that
    TMA cannot read so (a non-unit last stride, a batch stride that is not T row strides, a row stride or base address
    that is not 16-byte aligned)."""
    B, T, H, D = x.shape
    if (x.stride(3) != 1 or x.stride(2) != D or x.stride(0) != T * x.stride(1) or x.stride(1) % 8
            or x.data_ptr() % 16):
        x = x.contiguous()
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, D], gl.bfloat16)
    return TensorDescriptor(x, [B * T, H * D], [x.stride(1), 1], [block_rows, D], layout)


@gluon.jit
def _heaviest_first(pid, num_blocks, head_group, ROW_ORDER, ORDERED: gl.constexpr):
    """As `attention_triton._heaviest_first`: ((sequence, head) row, rank), rank 0 the block with the most work."""
    per_group = head_group * num_blocks
    g = pid // per_group
    size = gl.minimum(head_group, gl.num_programs(0) // num_blocks - g * head_group)
    r = pid - g * per_group
    rank = r // size
    row = g * head_group + (r - rank * size)
    if ORDERED:
        row = gl.load(ROW_ORDER + row)
    return row, rank


@gluon.jit
def _acp_row_delta(BOUND, stride_ub, stride_uh, b, h, log_eps, T):
    """acp_delta of (sequence, head) row (b, h) in float64; -inf (nothing pruned) for a NaN bound."""
    u = gl.load(BOUND + b * stride_ub + h * stride_uh)
    delta = _acp_delta(u, T.to(gl.float32), log_eps, gl.constexpr(gl.log))
    return gl.where(delta == delta, delta, float("-inf")).to(gl.float64)


@gluon.jit
def _first_block(C_row, c_ref, acp_delta, lo, hi, first_pos, BLOCK: gl.constexpr, QUERY_BLOCKS: gl.constexpr,
                 num_warps: gl.constexpr):
    """As `attention_triton._first_block`: the first block index in [lo, hi) whose tile is pruned (QUERY_BLOCKS)
    or kept (key blocks), by rounds that narrow the interval to one of SEARCH_WIDTH candidates."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    hi = gl.maximum(hi, lo)
    while lo < hi:
        step = (hi - lo + SEARCH_WIDTH - 1) // SEARCH_WIDTH
        cand = lo + gl.arange(0, SEARCH_WIDTH, layout=layout) * step
        in_range = cand < hi
        c_cand = gl.load(C_row + (first_pos + cand * BLOCK).to(gl.int64), mask=in_range, other=0.0)
        if QUERY_BLOCKS:
            fails = c_cand - c_ref >= acp_delta
        else:
            fails = c_ref - c_cand < acp_delta
        n_before = gl.sum((in_range & fails).to(gl.int32), 0)
        new_lo = gl.where(n_before > 0, lo + (n_before - 1) * step + 1, lo)
        hi = gl.minimum(lo + n_before * step, hi)
        lo = new_lo
    return lo


# ----------------------------------------------------------------------------------------------------------------
# Forward.


@gluon.jit
def _fwd_step(it, j0, wg: gl.constexpr, q, k_smem, v_smem, kb_smem, k_ready, k_empty, v_ready, v_empty, turn, acc,
              m_i, l_i, p_op, offs_m, qk_scale, MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
              p_layout: gl.constexpr):
    slot = it % 2
    start_n = (j0 + it) * 128
    zero_s = gl.zeros([WG_ROWS, 128], gl.float32, layout=s_layout)
    # This warpgroup's turn on the tensor cores: S = Q K_it^T and O += P_{it-1} V_{it-1}, then the other's.
    mbarrier.wait(turn.index(wg), (it & 1) ^ (1 - wg))
    mbarrier.wait(k_ready.index(slot), (it // 2) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if it > 0:
        prev = (it - 1) % 2
        mbarrier.wait(v_ready.index(prev), ((it - 1) // 2) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - wg), count=1)
        s, acc, p_op = warpgroup_mma_wait(0, deps=[s_tok, acc_tok, p_op])
        mbarrier.arrive(v_empty.index(prev), count=1)
    else:
        mbarrier.arrive(turn.index(1 - wg), count=1)
        s = warpgroup_mma_wait(0, deps=[s_tok])
    # The block's log2-domain key biases against the anchor, which the producer put beside K (`_fwd_producer`).
    key_bias = kb_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    mbarrier.arrive(k_empty.index(slot), count=1)
    s = s * qk_scale - key_bias[None, :]
    offs_n = start_n + gl.arange(0, 128, layout=gl.SliceLayout(0, s_layout))
    if MASK:
        s = gl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return acc, m_new, l_i, p_op


@gluon.jit
def _fwd_producer(k_desc, v_desc, k_smem, v_smem, kb_smem, k_ready, k_empty, v_ready, v_empty, C_row, C_SEG_row,
                  anchor, row0, kv_col0, j0, n_iter):
    keys: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
    for it in range(n_iter):
        slot = it % 2
        phase = (it // 2) & 1
        start_n = (j0 + it) * 128
        # Log2-domain key biases against the anchor: fp32 within the segment plus one float64 shift per block,
        # computed here, off the consumers' path (there, the shift's global load and float64 subtraction after each
        # product's wait showed in a warpgroup's stall samples: notes), and stored beside K before its barrier's
        # arrival publishes both.
        segment = gl.load(C_SEG_row + start_n + gl.arange(0, 128, layout=keys))
        shift = ((gl.load(C_row + start_n) - anchor) * 1.4426950408889634).to(gl.float32)
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        kb_smem.index(slot).store(segment + shift)
        _thread_barrier()
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        _tma_load(k_desc, [row0 + start_n, kv_col0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        _tma_load(v_desc, [row0 + start_n, kv_col0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _fwd_consumer(wg: gl.constexpr, q_smem, k_smem, v_smem, kb_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn,
                  O, LSE, C_row, anchor, row0, col0, lse_row, start_m, j0, n_iter, stride_ot, qk_scale,
                  HEAD_DIM: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])  # O: 64 x head dim
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    my_start = start_m + wg * WG_ROWS
    offs_m = my_start + gl.arange(0, WG_ROWS, layout=row_s)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([WG_ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    p_op = gl.zeros([WG_ROWS, 128], gl.bfloat16, layout=p_layout)
    q = q_smem.index(wg)
    mbarrier.wait(q_bar, 0)
    n_full = start_m // 128 - j0  # key blocks wholly before both warpgroups' queries: no mask
    for it in range(n_full):
        acc, m_i, l_i, p_op = _fwd_step(it, j0, wg, q, k_smem, v_smem, kb_smem, k_ready, k_empty, v_ready, v_empty,
                                        turn, acc, m_i, l_i, p_op, offs_m, qk_scale, False, s_layout, o_layout,
                                        p_layout)
    for it in range(n_full, n_iter):
        acc, m_i, l_i, p_op = _fwd_step(it, j0, wg, q, k_smem, v_smem, kb_smem, k_ready, k_empty, v_ready, v_empty,
                                        turn, acc, m_i, l_i, p_op, offs_m, qk_scale, True, s_layout, o_layout,
                                        p_layout)
    last = (n_iter - 1) % 2
    mbarrier.wait(turn.index(wg), (n_iter & 1) ^ (1 - wg))
    mbarrier.wait(v_ready.index(last), ((n_iter - 1) // 2) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    mbarrier.arrive(turn.index(1 - wg), count=1)
    acc = warpgroup_mma_wait(0, deps=[acc_tok])
    mbarrier.arrive(v_empty.index(last), count=1)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
    offs_mo = my_start + gl.arange(0, WG_ROWS, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(O + (row0 + offs_mo).to(gl.int64)[:, None] * stride_ot + col0 + offs_d[None, :], acc.to(gl.bfloat16))
    q_bias = ((gl.load(C_row + offs_m) - anchor) * 1.4426950408889634).to(gl.float32)
    gl.store(LSE + lse_row + offs_m, m_i + gl.log2(l_i) + q_bias)


@gluon.jit
def _hopper_fwd_kernel(q_desc, k_desc, v_desc, C, C_SEG, O, LSE, BOUND, ROW_ORDER, PRUNED, stride_ub, stride_uh, T,
                       num_heads, group, head_group, stride_ot, qk_scale, log_eps, HEAD_DIM: gl.constexpr,
                       PRUNE: gl.constexpr, ORDERED: gl.constexpr, COUNT_PRUNED: gl.constexpr,
                       num_warps: gl.constexpr):
    n_m = T // 128
    bh, rank = _heaviest_first(gl.program_id(0), n_m, head_group, ROW_ORDER, ORDERED)
    start_m = (n_m - 1 - rank) * 128  # the longest causal rows first
    b = bh // num_heads
    h = bh % num_heads
    row0 = b * T
    col0 = h * HEAD_DIM
    kv_col0 = h // group * HEAD_DIM  # GQA: the query head's key-value head
    lse_row = bh.to(gl.int64) * T
    C_row = C + lse_row
    C_SEG_row = C_SEG + lse_row
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, WG_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, 128, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, 128, HEAD_DIM], v_desc.layout)
    kb_smem = gl.allocate_shared_memory(gl.float32, [2, 128], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers release a slot
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    fence_async_shared()
    # Q loads while the pruning search runs.
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [row0 + start_m, col0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [row0 + start_m + WG_ROWS, col0], q_bar, q_smem.index(1))
    anchor = gl.load(C_row + start_m)
    j0 = start_m * 0
    if PRUNE:
        acp_delta = _acp_row_delta(BOUND, stride_ub, stride_uh, b, h, log_eps, T)
        j0 = _first_block(C_row, anchor, acp_delta, j0, start_m // 128, 127, 128, False, num_warps)
    n_iter = start_m // 128 + 1 - j0
    if COUNT_PRUNED:
        # Per query row: keys skipped, and keys visible (the denominator of the pruned fraction).
        offs = start_m + gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        rows = PRUNED + 2 * (lse_row + offs)
        gl.store(rows, gl.zeros_like(offs) + j0 * 128)
        gl.store(rows + 1, offs + 1)
    gl.warp_specialize([
        (_fwd_consumer, (0, q_smem, k_smem, v_smem, kb_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, O, LSE,
                         C_row, anchor, row0, col0, lse_row, start_m, j0, n_iter, stride_ot, qk_scale, HEAD_DIM)),
        (_fwd_consumer, (1, q_smem, k_smem, v_smem, kb_smem, q_bar, k_ready, k_empty, v_ready, v_empty, turn, O, LSE,
                         C_row, anchor, row0, col0, lse_row, start_m, j0, n_iter, stride_ot, qk_scale, HEAD_DIM)),
        (_fwd_producer, (k_desc, v_desc, k_smem, v_smem, kb_smem, k_ready, k_empty, v_ready, v_empty, C_row,
                         C_SEG_row, anchor, row0, kv_col0, j0, n_iter)),
    ], [4, 1], [240, 24])


def hopper_forward(q, k, v, c, key_bias, out, lse, sm_scale, bound, log_eps, prune, head_group, row_order, ordered,
                   pruned_counts=None):
    """Fills out (B, T, H, D), lse (B, H, T) and pruned_counts (if given) as `triton_attention_forward` does, for
    k and v of H or H / group heads (GQA); c and key_bias (B, H, T) contiguous; programs in the order of row_order
    (`acp.row_order`) if `ordered`."""
    B, T, H, D = q.shape
    grid = (T // HOPPER_TILE * B * H,)
    counts = q.new_empty((1,), dtype=torch.int32) if pruned_counts is None else pruned_counts
    _hopper_fwd_kernel[grid](_rows(q, 64), _rows(k, HOPPER_TILE), _rows(v, HOPPER_TILE), c, key_bias, out, lse,
                             bound, row_order, counts, *bound.stride(), T, H, H // k.shape[2], head_group,
                             out.stride(1), sm_scale * 1.4426950408889634, log_eps, HEAD_DIM=D, PRUNE=prune,
                             ORDERED=ordered,
                             COUNT_PRUNED=pruned_counts is not None, **FWD_LAUNCH)


# ----------------------------------------------------------------------------------------------------------------
# dK/dV.


@gluon.jit
def _kv_step(it, dk, dv, dc, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, q_bar, do_bar, C_row, Q_BIAS_row,
             DELTA_row, row0, col0, start_n, n_iter, T, anchor, k_bias, offs_n, qk_scale, shift, q_bias, delta_in,
             MASK: gl.constexpr, st_layout: gl.constexpr, op_layout: gl.constexpr, num_warps: gl.constexpr):
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    qs_l: gl.constexpr = gl.SliceLayout(0, st_layout)
    slot = it % 2
    phase = (it // 2) & 1
    start_m = start_n + it * 64
    zero_st = gl.zeros([128, 64], gl.float32, layout=st_layout)
    # Query biases: fp32 (c_t - c_s) log2(e) - lse_t per query plus one shift per block (s the segment start),
    # loaded (`_kv_vectors`) and the shift computed by the step before, or the prologue for the first.
    mbarrier.wait(q_bar.index(slot), phase)
    st_tok = warpgroup_mma(k_smem, q_smem.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
    mbarrier.wait(do_bar.index(slot), phase)
    dpt_tok = warpgroup_mma(v_smem, do_smem.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
    q_row = gl.convert_layout(q_bias, qs_l) + shift
    delta = gl.convert_layout(delta_in, qs_l)
    c_seg, q_bias, delta_in = _kv_vectors(C_row, Q_BIAS_row, DELTA_row, gl.minimum(start_m + 64, T - 64), vec_l)
    st = warpgroup_mma_wait(1, deps=[st_tok])
    st = st * qk_scale + q_row[None, :] - k_bias[:, None]
    if MASK:
        offs_m = start_m + gl.arange(0, 64, layout=qs_l)
        st = gl.where(offs_n[:, None] <= offs_m[None, :], st, float("-inf"))
    pt = gl.exp2(st)
    pt_op = gl.convert_layout(pt.to(gl.bfloat16), op_layout)
    dv_tok = warpgroup_mma(pt_op, do_smem.index(slot), dv, is_async=True)
    dpt, pt_op = warpgroup_mma_wait(1, deps=[dpt_tok, pt_op])
    dst = pt * (dpt - delta[None, :])
    dc += gl.sum(dst, 1)
    dst_op = gl.convert_layout(dst.to(gl.bfloat16), op_layout)
    dk_tok = warpgroup_mma(dst_op, q_smem.index(slot), dk, is_async=True)
    dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, pt_op, dst_op])
    # The next block's float64 shift here, with no product in flight and the barrier below keeping it there: issued
    # while products ran, it waited for them on its pipe (stall samples, Nsight Compute on an H100: notes).
    shift = ((c_seg - anchor) * 1.4426950408889634).to(gl.float32)
    _thread_barrier()  # both warpgroups are done with this slot: refill it with query block it + 2
    if it + 2 < n_iter:
        mbarrier.expect(q_bar.index(slot), q_desc.block_type.nbytes)
        _tma_load(q_desc, [row0 + start_m + 128, col0], q_bar.index(slot), q_smem.index(slot))
        mbarrier.expect(do_bar.index(slot), do_desc.block_type.nbytes)
        _tma_load(do_desc, [row0 + start_m + 128, col0], do_bar.index(slot),
                                        do_smem.index(slot))
    return dk, dv, dc, shift, q_bias, delta_in


@gluon.jit
def _kv_vectors(C_row, Q_BIAS_row, DELTA_row, start_m, layout: gl.constexpr):
    """What `_kv_step` needs of the query block at start_m: c at its segment's start, its query biases and deltas."""
    offs = start_m + gl.arange(0, 64, layout=layout)
    return gl.load(C_row + start_m // 128 * 128), gl.load(Q_BIAS_row + offs), gl.load(DELTA_row + offs)


@gluon.jit
def _hopper_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, C, Q_BIAS, DELTA, DK, DV, DC, BOUND, ROW_ORDER, stride_ub,
                        stride_uh, T, num_heads, group, head_group, stride_dkt, stride_dvt, qk_scale, sm_scale, log_eps,
                        HEAD_DIM: gl.constexpr, PRUNE: gl.constexpr, ORDERED: gl.constexpr,
                        num_warps: gl.constexpr):
    # S^T, dP^T: (keys, queries); dK, dV: (keys, d); each warpgroup its 64 keys. One query head per program: with
    # GQA, dK and dV go to that query head's slot of (B, T, H, D) buffers that the host sums over each group.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, 64, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    keys_l: gl.constexpr = gl.SliceLayout(1, st_layout)
    n_n = T // 128
    bh, rank = _heaviest_first(gl.program_id(0), n_n, head_group, ROW_ORDER, ORDERED)
    start_n = rank * 128  # the earliest keys (seen by the most queries) first
    b = bh // num_heads
    h = bh % num_heads
    row0 = b * T
    col0 = h * HEAD_DIM
    kv_col0 = h // group * HEAD_DIM
    vec_row = bh.to(gl.int64) * T
    C_row = C + vec_row
    anchor = gl.load(C_row + start_n)
    end = T
    if PRUNE:
        # Query blocks from the first whose first query is decayed past acp_delta against the last key are skipped.
        acp_delta = _acp_row_delta(BOUND, stride_ub, stride_uh, b, h, log_eps, T)
        c_last = gl.load(C_row + start_n + 127)
        end = gl.minimum(_first_block(C_row, c_last, acp_delta, start_n // 64, T // 64, 0, 64, True, num_warps) * 64,
                         T)
    n_iter = (end - start_n) // 64

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [128, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [128, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 64, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, 64, HEAD_DIM], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(do_bar.index(i), count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [row0 + start_n, kv_col0], kv_bar, k_smem)
    _tma_load(v_desc, [row0 + start_n, kv_col0], kv_bar, v_smem)
    for i in gl.static_range(2):
        if i < n_iter:
            mbarrier.expect(q_bar.index(i), q_desc.block_type.nbytes)
            _tma_load(q_desc, [row0 + start_n + i * 64, col0], q_bar.index(i), q_smem.index(i))
            mbarrier.expect(do_bar.index(i), do_desc.block_type.nbytes)
            _tma_load(do_desc, [row0 + start_n + i * 64, col0], do_bar.index(i),
                                            do_smem.index(i))

    offs_n = start_n + gl.arange(0, 128, layout=keys_l)
    k_bias = ((gl.load(C_row + offs_n) - anchor) * 1.4426950408889634).to(gl.float32)
    dk = gl.zeros([128, HEAD_DIM], gl.float32, layout=kv_layout)
    dv = gl.zeros([128, HEAD_DIM], gl.float32, layout=kv_layout)
    dc = gl.zeros([128], gl.float32, layout=keys_l)
    mbarrier.wait(kv_bar, 0)
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    c_seg, q_bias, delta = _kv_vectors(C_row, Q_BIAS + vec_row, DELTA + vec_row, start_n, vec_l)
    shift = ((c_seg - anchor) * 1.4426950408889634).to(gl.float32)
    # The two query blocks that cross this key block's diagonal (never pruned: their bias bound is >= 0).
    for it in range(2):
        dk, dv, dc, shift, q_bias, delta = _kv_step(
            it, dk, dv, dc, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, q_bar, do_bar, C_row, Q_BIAS + vec_row,
            DELTA + vec_row, row0, col0, start_n, n_iter, T, anchor, k_bias, offs_n, qk_scale, shift, q_bias, delta,
            True, st_layout, op_layout, num_warps)
    for it in range(2, n_iter):
        dk, dv, dc, shift, q_bias, delta = _kv_step(
            it, dk, dv, dc, q_desc, do_desc, q_smem, do_smem, k_smem, v_smem, q_bar, do_bar, C_row, Q_BIAS + vec_row,
            DELTA + vec_row, row0, col0, start_n, n_iter, T, anchor, k_bias, offs_n, qk_scale, shift, q_bias, delta,
            False, st_layout, op_layout, num_warps)
    offs_kn = start_n + gl.arange(0, 128, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    rows = (row0 + offs_kn).to(gl.int64)[:, None]
    gl.store(DK + rows * stride_dkt + col0 + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty))
    gl.store(DV + rows * stride_dvt + col0 + offs_d[None, :], dv.to(DV.dtype.element_ty))
    gl.store(DC + vec_row + offs_n, -dc)  # dL/dc_j = -sum_i dS_ij; with the corrected delta the row sums vanish
    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(i))
        mbarrier.invalidate(do_bar.index(i))


def hopper_dkdv(q, k, v, do, c, key_bias, lse, delta, dk, dv, dc, sm_scale, bound, log_eps, prune, head_group,
                row_order, ordered):
    """Fills dk, dv (B, T, Hkv, D) and dc (B, H, T) as the Triton dK/dV pass does; delta corrected by the dQ pass.
    With GQA (Hkv < H) each query head's share goes to fp32 buffers of H heads, summed here over each group."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    grid = (T // HOPPER_TILE * B * H,)
    # Query biases (c_t - c_s) log2(e) - lse_t in fp32 (s the segment start), one vector for the loop to read.
    q_bias = key_bias - lse
    shares = (dk, dv) if group == 1 else (q.new_empty(B, T, H, D, dtype=torch.float32) for _ in range(2))
    dk_out, dv_out = shares
    _hopper_dkdv_kernel[grid](_rows(q, BLOCK_M_BWD), _rows(k, HOPPER_TILE), _rows(v, HOPPER_TILE),
                              _rows(do, BLOCK_M_BWD), c, q_bias, delta, dk_out, dv_out, dc, bound, row_order,
                              *bound.stride(), T, H, group, head_group, dk_out.stride(1), dv_out.stride(1),
                              sm_scale * 1.4426950408889634, sm_scale, log_eps, HEAD_DIM=D, PRUNE=prune,
                              ORDERED=ordered, **DKDV_LAUNCH)
    if group > 1:
        dk.copy_(dk_out.view(B, T, H // group, group, D).sum(3))
        dv.copy_(dv_out.view(B, T, H // group, group, D).sum(3))


__all__ = ["hopper_forward", "hopper_dkdv", "FWD_LAUNCH", "DKDV_LAUNCH"]
