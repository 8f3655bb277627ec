"""Triton Forgetting Attention for decoding: a few new queries against a long KV cache (flash-decoding).

Design:
- Split-K: the keys are cut into `num_splits` ranges and every (split, batch, kv head) program reduces its range to
  a partial output and log-sum-exp; a second small kernel combines the splits. A batch-1 step with few KV heads
  otherwise runs on a handful of SMs and cannot approach HBM bandwidth.
- GQA: one program owns a KV head and all its query heads (x the new query tokens) as the rows of one tile, so each
  K/V block is read from memory once for the whole group, and `q.k` is one `tl.dot`.
- The bias `c_q - c_k` is taken from the cache's running sum: fp32 in the dynamic cache, which keeps it small by
  rebasing (subtracting a per-row constant, exact), so the difference of two stored values keeps fp32 precision;
  float64 in the static cache, which cannot rebase without a host sync (the difference is rounded to fp32).
- A static cache passes its filled length as a device tensor (`kv_len`): the grid, split sizes and block sizes
  follow the buffer's static length, and the programs read the filled length on the device, so a decode step
  neither syncs nor recompiles as the cache fills; splits past the filled length exit at once.
- The launch is a custom op with a fake implementation, so torch.compile keeps it in the graph (no graph break) and
  CUDA graphs capture it.
- ACP (docs/acp.md): a key is pruned for a query when `c_q - c_k < delta`; a key block pruned for every row
  of the program is skipped before its K/V are loaded, so pruned keys cost 4 bytes of c per query head, not K/V.
- Scores in the exp2 domain; -inf-safe running max so fully masked rows (left padding, pruned splits) give 0.
"""

import functools

import torch
import triton
import triton.language as tl

from ..common import LOG2E

_LOG2E = tl.constexpr(LOG2E)  # the kernels' copy: jitted code reads only constexpr globals


@triton.jit
def _attend_block(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n, offs_d, bias, visible, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """One key block of the online softmax: loads K/V, updates (acc, l_i, m_i)."""
    kv_mask = visible.to(tl.int32).max(0)[:, None] > 0
    if HEAD_DIM != BLOCK_D:
        kv_mask = kv_mask & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + offs_n[:, None].to(tl.int64) * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale + bias * _LOG2E
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet: exp2(-inf - 0) = 0
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


# `num_splits` grows with the cache until it saturates: not specialising on it saves compiled variants (a compile
# stalls its step). `n_keys` and the gate strides stay specialised (divisibility by 16): a build without it had less
# bandwidth at head dim 64, the masks and c loads losing their alignment (benchmarks/NOTES_attention.md, "Figures
# from the kernel sources").
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    Q, K, V, C, SEQ_START, DELTA, KV_LEN, PART_O, PART_LSE,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_ct,
    n_keys, split_size, num_splits, qk_scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SEQ_START: tl.constexpr, USE_ACP: tl.constexpr, HAS_KV_LEN: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(0)
    if HAS_KV_LEN:  # a static cache: `n_keys` is the buffer's length, the filled part is on the device
        n_keys = tl.load(KV_LEN).to(tl.int32)
    pid_bh = tl.program_id(1)
    b = (pid_bh // NUM_KV_HEADS).to(tl.int64)
    kv_head = pid_bh % NUM_KV_HEADS
    # Row r of the tile is query token r % TQ of query head kv_head * GROUP + r // TQ.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_valid = offs_m < GROUP * TQ
    head = kv_head * GROUP + offs_m // TQ
    q_pos = n_keys - TQ + offs_m % TQ
    q_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b * stride_qb + (offs_m % TQ)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    c_rows = C + b * stride_cb + head.to(tl.int64) * stride_ch
    c_q = tl.load(c_rows + q_pos * stride_ct, mask=row_valid, other=0.0)
    if USE_ACP:
        delta = tl.load(DELTA + b * (NUM_KV_HEADS * GROUP) + head, mask=row_valid, other=0.0)

    lo = split * split_size
    hi = tl.minimum(lo + split_size, n_keys)
    if HAS_SEQ_START:
        lo = tl.maximum(lo, tl.load(SEQ_START + b).to(tl.int32))
    K += b * stride_kb + kv_head.to(tl.int64) * stride_kh
    V += b * stride_vb + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = row_valid[:, None] & (offs_n[None, :] < hi)
        c_k = tl.load(c_rows[:, None] + offs_n[None, :] * stride_ct, mask=in_range, other=0.0)
        bias = (c_q[:, None] - c_k).to(tl.float32)  # exact differences of float64 sums, then rounded
        visible = in_range & (offs_n[None, :] <= q_pos[:, None])
        if USE_ACP:
            visible = visible & (bias >= delta[:, None])
            if tl.max(visible.to(tl.int32)) > 0:  # a block pruned for every row is never read
                acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n, offs_d, bias,
                                              visible, qk_scale, HEAD_DIM, BLOCK_D, PRECISION)
        else:
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, K, V, stride_kt, stride_vt, offs_n, offs_d, bias,
                                          visible, qk_scale, HEAD_DIM, BLOCK_D, PRECISION)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (pid_bh.to(tl.int64) * num_splits + split) * BLOCK_M
    tl.store(PART_O + (part + offs_m)[:, None] * BLOCK_D + offs_d[None, :], out)
    tl.store(PART_LSE + part + offs_m, lse)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    PART_O, PART_LSE, OUT, stride_ob, stride_ot, stride_oh, num_splits,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    row = tl.program_id(1)
    b = (pid_bh // NUM_KV_HEADS).to(tl.int64)
    head = (pid_bh % NUM_KV_HEADS) * GROUP + row // TQ
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    part = (pid_bh.to(tl.int64) * num_splits + offs_s) * BLOCK_M + row
    lse = tl.load(PART_LSE + part, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    o = tl.load(PART_O + part[:, None] * BLOCK_D + offs_d[None, :], mask=(offs_s < num_splits)[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * stride_ob + (row % TQ) * stride_ot + head * stride_oh + offs_d,
             out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _max_splits(batch_kv_heads, device):
    """Enough (split, batch, kv head) programs for a few waves over the SMs."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return min(triton.cdiv(4 * sms, batch_kv_heads), 256)


def _num_splits(batch_kv_heads, n_keys, block_n, device):
    """`_max_splits`, but at least 4 key blocks per program."""
    return max(1, min(_max_splits(batch_kv_heads, device), triton.cdiv(n_keys, 4 * block_n)))


def triton_forgetting_decode(q, k, v, fgate_cumsum, sm_scale, seq_start=None, acp_delta=None, kv_len=None, *,
                             block_n=None, num_splits=None, num_warps=None, num_stages=None):
    """Decode attention; arguments as `forgetting_decode` (`decode.py`, validated there).

    q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D) with unit stride along D, fgate_cumsum (B, Tk, Hq) fp32 or float64 (any
    strides: the cache's (B, Hq, Tk) tensor transposed is read in place), acp_delta (B, Hq) fp32 or None, kv_len a
    0-d integer tensor (the filled part of a static cache) or None (all Tk keys). `block_n`, `num_splits`,
    `num_warps` and `num_stages` override the launch configuration (tests, configuration sweeps).
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the decode kernel needs q, k and v with unit stride along head_dim.")
    if acp_delta is not None:
        acp_delta = acp_delta.float().contiguous()
    seq_start = seq_start.contiguous() if seq_start is not None else None
    kv_len = kv_len.reshape(1) if kv_len is not None else None
    return _decode_launch(q, k, v, fgate_cumsum, float(sm_scale), seq_start, acp_delta, kv_len, block_n or 0,
                          num_splits or 0, num_warps or 0, num_stages or 0)


@torch.library.custom_op("foxlm::forgetting_decode", mutates_args=())
def _decode_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, sm_scale: float,
               seq_start: torch.Tensor | None, acp_delta: torch.Tensor | None, kv_len: torch.Tensor | None,
               block_n: int, num_splits: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """The launch: every host-side choice (splits, block sizes) reads shapes only, never tensor values, so that a
    captured CUDA graph stays valid as a static cache fills; a 0 for `block_n`, `num_splits`, `num_warps` or
    `num_stages` chooses automatically."""
    B, Tq, Hq, D = q.shape
    n_keys, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    interpret = q.device.type != "cuda"
    block_m = max(16, triton.next_power_of_2(group * Tq))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = block_n or (16 if interpret else 64)
    # Head dim 64 streams best with two warps and two stages, larger head dims with four and three (`bench_decode.py
    # --parts launch`; benchmarks/NOTES_attention.md, "Decode launch configuration").
    num_warps = num_warps or (2 if block_d <= 64 else 4)
    num_stages = num_stages or (2 if block_d <= 64 else 3)
    num_splits = num_splits or _num_splits(B * Hkv, n_keys, block_n, q.device)
    split_size = triton.cdiv(triton.cdiv(n_keys, num_splits), block_n) * block_n
    num_splits = triton.cdiv(n_keys, split_size)
    part_o = torch.empty(B * Hkv * num_splits * block_m, block_d, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(B * Hkv * num_splits * block_m, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(num_splits, B * Hkv)](
        q, k, v, c, seq_start, acp_delta, kv_len, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        c.stride(0), c.stride(2), c.stride(1),
        n_keys, split_size, num_splits, sm_scale * LOG2E,
        NUM_KV_HEADS=Hkv, GROUP=group, TQ=Tq, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_SEQ_START=seq_start is not None, USE_ACP=acp_delta is not None, HAS_KV_LEN=kv_len is not None,
        PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    _decode_combine_kernel[(B * Hkv, group * Tq)](
        part_o, part_lse, out, out.stride(0), out.stride(1), out.stride(2), num_splits,
        NUM_KV_HEADS=Hkv, GROUP=group, TQ=Tq, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d,
        # Sized for the most splits this batch can get, not for this step's: one compiled variant per generation.
        BLOCK_S=max(2, triton.next_power_of_2(max(num_splits, _max_splits(B * Hkv, q.device)))), num_warps=4,
    )
    return out


@_decode_launch.register_fake
def _(q, k, v, c, sm_scale, seq_start, acp_delta, kv_len, block_n, num_splits, num_warps, num_stages):
    return torch.empty_like(q)
