"""Adaptive Computation Pruning (ACP, docs/acp.md): every quantity of it, each computed in one place.

A (query block, key block) tile whose largest decay bias `c_i - c_j` is below the threshold delta is skipped; then
every query loses at most eps of its attention mass, so each output moves by at most `2 eps max|v|`. One name for
each quantity, from `FoxConfig.acp_eps` (the model passes it to the kernels as `prune_eps`) down to the kernels:

    prune_eps    eps in (0, 1), the tolerance; default e^-10 (`DEFAULT_PRUNE_EPS`, the paper's log eps = -10).
    log_eps      log eps, what the kernels take.
    score_bound  U >= |sm_scale q_i.k_j| for every pair, per (batch, query head): from the QK-norm scales
                 (`qk_norm_score_bound`), measured from q and k (`measured_score_bound`), or from new queries and a
                 cache's largest key norms (`cached_score_bound`).
    n_keys       L, the number of keys of the sequence.
    acp_delta    delta = log eps - 2U - log L (`compute_acp_delta`, the one formula): per (sequence, head) row inside
                 the kernels (`acp_row_delta`), per (batch, head) for decoding and KV eviction (`acp_threshold`).

Also here: which rows of a pruned launch go first (`row_order`) and the pruned-fraction statistics
(`acp_statistics`).
"""

import contextlib
import math

import torch

from .common import last_dim_contiguous
from .dispatch import norms_on_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the torch formulas below
    triton = None

DEFAULT_PRUNE_EPS = math.exp(-10)  # the paper's recommended tolerance (log eps = -10)
_active_stats = []


def compute_acp_delta(score_bound, n_keys, log_eps, log):
    """delta = log eps - 2U - log L (natural logs): keys with `c_q - c_k < delta` carry at most eps of the attention
    mass of query q together, when U bounds |sm_scale q.k| for every key and L keys exist. `log` is the natural log of
    the caller: `math.log` on the host; inside the kernels, which run this same function jitted (`_acp_delta` below,
    `attention_hopper._acp_delta`), `tl.log` or `gl.log` wrapped as a constexpr (how a jitted function takes a
    function). Taking L rather than log L keeps the kernels' order of operations, hence their compiled code."""
    return log_eps - 2.0 * score_bound - log(n_keys)


def acp_threshold(score_bound, n_keys, prune_eps):
    """acp_delta for decoding and KV eviction: `score_bound` a float or a (batch, query heads) tensor, `n_keys` the
    keys a query may see (at least 1 counted)."""
    return compute_acp_delta(score_bound, max(n_keys, 1), math.log(prune_eps), math.log)


def qk_norm_score_bound(q, q_norm_weight, k_norm_weight, sm_scale):
    """U per (batch, query head) from the QK-norm scales, for q (batch, seqlen, query heads, head_dim): valid for
    every query and key, future ones too. An RMSNorm output has norm <= max|w| sqrt(d); 2^-7 covers its rounding to
    bf16. RoPE keeps norms."""
    B, _, Hq, D = q.shape
    w_q = q_norm_weight.detach().view(Hq, -1).abs().amax(-1).float()
    w_k = k_norm_weight.detach().view(-1, D).abs().amax(-1).float()
    u = w_q * w_k.repeat_interleave(Hq // w_k.shape[0]) * D * sm_scale * (1 + 2**-7)
    return u.expand(B, -1)


def cached_score_bound(q, key_norm_max, sm_scale):
    """U per (batch, query head) of the new queries q (batch, seqlen, query heads, head_dim) against a cache whose
    largest key norm per (batch, KV head) is `key_norm_max`. NaN in q or k gives U = inf: nothing is pruned, so that
    the NaN is not hidden."""
    q_norm = q.detach().float().norm(dim=-1).amax(1)
    u = q_norm * key_norm_max.repeat_interleave(q.shape[2] // key_norm_max.shape[1], dim=1) * sm_scale
    return u.nan_to_num(nan=float("inf"))


def max_square_norms(q, k):
    """(max_t |q_t|^2 per (batch, head), the same for k) in fp32, NaN counted as +inf: on a GPU one Triton reduction
    that reads q and k once (`triton_max_square_norms`; the torch formula writes per-token norms and was slower,
    benchmarks/NOTES_attention.md, "Figures from the kernel sources"), on CPU tensors the torch formula."""
    if norms_on_triton(q, triton_max_square_norms is not None):
        return triton_max_square_norms(q, k)
    return tuple(torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).nan_to_num(nan=float("inf")).amax(1)
                 .square() for x in (q, k))


def measured_score_bound(q, k, sm_scale):
    """U = sm_scale * max_t |q_t| * max_t |k_t| per (batch, query head), by Cauchy-Schwarz; on the device, no sync.
    NaN in q or k gives U = inf: nothing is pruned, so the NaN shows in the output as without pruning."""
    B, _, Hq, _ = q.shape
    q_square, k_square = max_square_norms(q, k)
    return (q_square.view(B, k.shape[2], -1) * k_square[:, :, None]).sqrt_().view(B, Hq) * sm_scale


class PruningStats:
    """What the forward kernels pruned inside an `acp_statistics()` block: one entry per pruned Triton call (in call
    order, so per layer for one model forward), each a (query heads, 2) int64 tensor of (skipped, visible) causal
    (query, key) pairs. Reading a fraction synchronises with the device; recording does not."""

    def __init__(self):
        self.calls = []

    def record(self, counts):
        self.calls.append(counts.sum(dim=(0, 2), dtype=torch.int64))

    def per_call(self):
        """Pruned fraction per call and head: a list of (query heads,) float tensors."""
        return [c[:, 0].double() / c[:, 1].clamp_min(1) for c in self.calls]

    @property
    def pruned_fraction(self):
        """Skipped over visible (query, key) pairs, all calls and heads together (0.0 if nothing was recorded)."""
        if not self.calls:
            return 0.0
        skipped, visible = torch.stack(self.calls).sum(dim=(0, 1)).tolist()
        return skipped / max(visible, 1)


@contextlib.contextmanager
def acp_statistics():
    """Record the pruned fraction of every pruned `forgetting_attention` call (Triton path) inside the block:

        with acp_statistics() as stats:
            model(input_ids)
        print(stats.pruned_fraction, stats.per_call())

    Outside such a block the kernels count nothing (the counting is a compile-time branch of the kernel)."""
    stats = PruningStats()
    _active_stats.append(stats)
    try:
        yield stats
    finally:
        _active_stats.remove(stats)


def recording_pruned_counts():
    return bool(_active_stats)


def record_pruned_counts(counts):
    for stats in _active_stats:
        stats.record(counts)


# ----------------------------------------------------------------------------------------------------------------
# Triton: acp_delta inside the kernels, U in one reduction, and the order of a pruned launch's rows.

if triton is None:
    triton_max_square_norms = None
else:
    from .common import sequence_bounds

    _acp_delta = triton.jit(compute_acp_delta)  # the same formula, compiled into the kernels that call it

    @triton.jit
    def acp_row_delta(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start):
        """acp_delta of (sequence, head) row (batch, h) in float64, L the number of keys of its sequence."""
        u = tl.load(BOUND + batch * stride_ub + h * stride_uh)
        n_keys = tl.maximum(seq_k - kv_start, 1).to(tl.float32)
        delta = _acp_delta(u, n_keys, log_eps, tl.constexpr(tl.log))
        # A NaN bound (NaN in q or k) prunes nothing: every comparison with a NaN delta is false, which the dK/dV
        # pass's search would read as "pruned from the first block on".
        return tl.where(delta == delta, delta, float("-inf")).to(tl.float64)

    @triton.jit
    def _max_square_norms_kernel(Q, K, PARTIAL, Tq, Tk, Hq, Hkv, n_blocks, stride_qb, stride_qt, stride_qh,
                                 stride_kb, stride_kt, stride_kh, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """PARTIAL[b, h, i] = max over the BLOCK_T positions t of block i of |x[b, t, h, :]|^2 in fp32, x = q
        (program axis 1 = 0) or k (1, heads Hq + h); NaN counts as +inf, so that a NaN input gives U = inf (nothing
        pruned)."""
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
        mask = ((offs_t[:, None, None] < length) & (offs_h[None, :, None] < heads)
                & (offs_d[None, None, :] < HEAD_DIM))
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        square_norms = tl.sum(x * x, 2)
        square_norms = tl.where(square_norms == square_norms, square_norms, float("inf"))
        rows = (b * (Hq + Hkv) + first_head + offs_h).to(tl.int64) * n_blocks + block
        tl.store(PARTIAL + rows, tl.max(square_norms, 0), mask=offs_h < heads)

    @triton.jit
    def _row_work(C, CU_SEQLENS, SEQ_START, BOUND, rows, stride_cb, stride_ct, stride_ch, stride_ub, stride_uh, Tq, Tk,
                  num_heads, log_eps, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr):
        """floor(log2(share)) of each (sequence * heads + head) row in `rows` (all < the row count), share ~ the
        part of the row's causal work that pruning keeps: about 2|acp_delta| / |c_last| for a head that forgets at a
        steady rate (c_last its sequence's total log forget gate), at most 1 (heads that keep everything, NaN bounds or
        gates); -inf for empty sequences. Classes of powers of two, so that rows of about the same work keep their
        index order: the exact order of c_last was slower at head dim 64 on an H100 (benchmarks/NOTES_attention.md,
        "Figures from the kernel sources")."""
        b = rows // num_heads
        h = rows % num_heads
        batch, bos, seq_q, seq_k, kv_start = sequence_bounds(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN,
                                                             HAS_SEQ_START)
        acp_delta = acp_row_delta(BOUND, stride_ub, stride_uh, batch, h, log_eps, seq_k, kv_start)
        nonempty = rows * 0 + seq_k > 0  # a vector also where seq_k is the launch's scalar length
        c_last = tl.load(C + batch * stride_cb + h * stride_ch + (bos + tl.maximum(seq_k - 1, 0)) * stride_ct,
                         mask=nonempty, other=0.0)
        share = tl.minimum(2.0 * acp_delta / tl.minimum(c_last, -1e-30), 1.0)
        work = tl.floor(tl.log2(share.to(tl.float32)))
        return tl.where(nonempty, tl.where(work == work, work, 0.0), float("-inf"))

    @triton.jit
    def _row_order_kernel(C, CU_SEQLENS, SEQ_START, BOUND, ORDER, stride_cb, stride_ct, stride_ch, stride_ub,
                          stride_uh, Tq, Tk, num_heads, n_rows, log_eps, IS_VARLEN: tl.constexpr,
                          HAS_SEQ_START: tl.constexpr, BLOCK: tl.constexpr):
        """ORDER[rank] = row for BLOCK rows: rank = the rows of more work (`_row_work`), and of the same work with a
        lower index, before it; a stable descending sort in one launch, counting over all rows in chunks of BLOCK."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = rows < n_rows
        work = _row_work(C, CU_SEQLENS, SEQ_START, BOUND, tl.minimum(rows, n_rows - 1), stride_cb, stride_ct,
                         stride_ch, stride_ub, stride_uh, Tq, Tk, num_heads, log_eps, IS_VARLEN, HAS_SEQ_START)
        rank = tl.zeros([BLOCK], tl.int32)
        for start in range(0, n_rows, BLOCK):
            others = start + tl.arange(0, BLOCK)
            other_work = _row_work(C, CU_SEQLENS, SEQ_START, BOUND, tl.minimum(others, n_rows - 1), stride_cb,
                                   stride_ct, stride_ch, stride_ub, stride_uh, Tq, Tk, num_heads, log_eps, IS_VARLEN,
                                   HAS_SEQ_START)
            before = (other_work[None, :] > work[:, None]) | ((other_work[None, :] == work[:, None])
                                                              & (others[None, :] < rows[:, None]))
            rank += tl.sum((before & (others[None, :] < n_rows)).to(tl.int32), 1)
        tl.store(ORDER + rank, rows, mask=valid)

    _NORM_TILE = 4096  # elements of q per program of `triton_max_square_norms` (8 KB of bf16; larger: slower)

    def triton_max_square_norms(q, k):
        """(max_t |q[b, t, h, :]|^2 (B, Hq), max_t |k[b, t, h, :]|^2 (B, Hkv)) in fp32 for (B, T, H, D) q and k,
        whose lengths may differ: one launch that reads each once (BLOCK_T positions of all heads per program), then a
        reduction of the block maxima along their contiguous axis; no host sync. ACP's measured U
        (`measured_score_bound`)."""
        B, Tq, Hq, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        longest = max(Tq, Tk)
        if B * longest == 0:
            return q.new_zeros(B, Hq, dtype=torch.float32), q.new_zeros(B, Hkv, dtype=torch.float32)
        q, k = last_dim_contiguous(q), last_dim_contiguous(k)
        block_h, block_d = triton.next_power_of_2(Hq), triton.next_power_of_2(D)
        block_t = max(1, min(triton.next_power_of_2(longest), _NORM_TILE // (block_h * block_d)))
        n_blocks = triton.cdiv(longest, block_t)
        # Blocks past a tensor's length (q against a longer cache) store 0, a norm's lower bound.
        partial = torch.empty(B, Hq + Hkv, n_blocks, device=q.device, dtype=torch.float32)
        _max_square_norms_kernel[(B * n_blocks, 2)](q, k, partial, Tq, Tk, Hq, Hkv, n_blocks, *q.stride()[:3],
                                                    *k.stride()[:3], HEAD_DIM=D, BLOCK_T=block_t, BLOCK_H=block_h,
                                                    BLOCK_D=block_d)
        return partial.amax(-1).split((Hq, Hkv), dim=1)

    def row_order(c, bound, log_eps, cu_seqlens, seq_start, Tq, Tk):
        """The (sequence, head) rows of a pruned launch, those expected to keep the most work first (`_row_work`),
        ties in index order; int32 (rows,), one launch (`_row_order_kernel`; a torch argsort took five), no host sync.
        Pruning leaves heads that forget fast a few blocks per program and heads that forget slowly nearly all of
        theirs; in index order the slow heads' heavy blocks can start last and the launch end on them. Used where rows
        go in groups smaller than all of them (`attention_tuning.head_group`: pruned head dim 128 without GQA), by the
        forward and the dK/dV pass, where it was faster on the ACP gate mix; not by the dQ pass, nor at head dim 64
        (all rows in one group), where it was slower (benchmarks/NOTES_attention.md, "Figures from the kernel
        sources")."""
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
