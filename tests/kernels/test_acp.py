"""Adaptive Computation Pruning in the Triton kernels, against the same kernels unpruned.

The guarantee (docs/acp.md): every query loses at most eps of its attention mass, so the output moves by at
most 2 eps max|v|. Gradient bounds follow from the same row bound: sum_j |dP_ij| <= 2 eps, hence
sum_j |d dS_ij| <= 6 eps M with M = max |do_i.v_j|. q and k are scaled down so that U is small and pruning starts
where the dropped weights are still visible in fp32. Runs in Triton's interpreter on CPU (tests/conftest.py).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from foxlm.kernels import forgetting_attention
from foxlm.kernels import acp
from foxlm.kernels.acp import acp_statistics, max_square_norms, measured_score_bound

pytest.importorskip("triton")
from foxlm.kernels.attention.attention_gate_scan import triton_gate_cumsum  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 0.02


def run(q, k, v, log_fgate, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_fgate)]
    out = forgetting_attention(*leaves, backend="triton", **kwargs)
    torch.manual_seed(1)
    do = torch.randn_like(out)
    (out * do).sum().backward()
    return out.detach(), do, [t.grad for t in leaves]


def assert_within_acp_bound(exact, pruned, q, k, v, eps, sm_scale):
    (out, do, (dq, dk, dv, dlogf)), (out_p, _, (dq_p, dk_p, dv_p, dlogf_p)) = exact, pruned
    group = q.shape[2] // k.shape[2]
    v_rep = v.repeat_interleave(group, 2)
    m = torch.einsum("bihd,bjhd->bhij", do, v_rep).abs().amax()  # M >= |do_i.v_j|
    row = 6 * eps * m  # >= sum_j |change of dS_ij| for every query row
    slack = 1e-5
    assert (out_p - out).abs().max() <= 2 * eps * v.abs().max() + slack
    assert (dq_p - dq).abs().max() <= sm_scale * row * k.abs().max() + slack
    # Per key, summed over keys: each query row spreads its change over the keys it sees.
    rows_l1 = lambda x: x.abs().amax(-1).sum()  # noqa: E731
    assert rows_l1(dv_p - dv) <= 2 * eps * rows_l1(do) + slack
    assert rows_l1(dk_p - dk) <= sm_scale * row * rows_l1(q) + slack
    assert (dlogf_p - dlogf).abs().max() <= row * q.shape[1] + slack


def fast_and_slow_gates(B, T, H, fast_logit=1.0):
    """Heads alternate between forgetting fast (gate logit ~ N(fast_logit, 1); f ~ 0.7 by default) and barely
    forgetting (f ~ 0.999)."""
    logits = torch.randn(B, T, H, device=DEVICE) + torch.tensor([fast_logit, 7.0] * (H // 2), device=DEVICE)
    return F.logsigmoid(logits)


def test_fast_decay_prunes_most_tiles_within_the_bound_with_gqa_and_left_padding():
    torch.manual_seed(0)
    B, T, Hq, Hkv, D = 2, 128, 6, 3, 16
    q = torch.randn(B, T, Hq, D, device=DEVICE) * 0.3
    k = torch.randn(B, T, Hkv, D, device=DEVICE) * 0.3
    v = torch.randn(B, T, Hkv, D, device=DEVICE)
    log_fgate = fast_and_slow_gates(B, T, Hq)
    seq_start = torch.tensor([0, 21], device=DEVICE)
    exact = run(q, k, v, log_fgate, seq_start=seq_start)
    with acp_statistics() as stats:
        pruned = run(q, k, v, log_fgate, seq_start=seq_start, prune_eps=EPS)
    assert_within_acp_bound(exact, pruned, q, k, v, EPS, D**-0.5)
    (per_head,) = stats.per_call()
    assert per_head[0::2].min() > 0.3 and per_head[1::2].max() == 0  # fast heads pruned, slow heads not
    assert 0.15 < stats.pruned_fraction < 0.5
    assert not torch.equal(exact[0], pruned[0])  # pruning happened where it is visible in fp32


def test_varlen_prunes_per_sequence_within_the_bound():
    torch.manual_seed(0)
    T, H, D = 112, 2, 16
    cu_seqlens = torch.tensor([0, 17, 80, 112], device=DEVICE, dtype=torch.int32)
    q = torch.randn(1, T, H, D, device=DEVICE) * 0.3
    k = torch.randn(1, T, H, D, device=DEVICE) * 0.3
    v = torch.randn(1, T, H, D, device=DEVICE)
    log_fgate = fast_and_slow_gates(1, T, H, fast_logit=-1.0)
    bound = measured_score_bound(q, k, D**-0.5).max().item()  # a float U, as from QK-norm scales
    exact = run(q, k, v, log_fgate, cu_seqlens=cu_seqlens)
    with acp_statistics() as stats:
        pruned = run(q, k, v, log_fgate, cu_seqlens=cu_seqlens, prune_eps=EPS, score_bound=bound)
    assert_within_acp_bound(exact, pruned, q, k, v, EPS, D**-0.5)
    assert stats.per_call()[0][0] > 0.1


def test_open_gates_prune_nothing_and_match_the_unpruned_kernel_bit_for_bit():
    torch.manual_seed(0)
    B, T, Hq, Hkv, D = 1, 80, 2, 1, 16
    q, k, v = (torch.randn(B, T, h, D, device=DEVICE) for h in (Hq, Hkv, Hkv))
    log_fgate = torch.zeros(B, T, Hq, device=DEVICE)
    exact = run(q, k, v, log_fgate)
    with acp_statistics() as stats:
        pruned = run(q, k, v, log_fgate, prune_eps=math.exp(-10))
    assert stats.pruned_fraction == 0.0
    assert torch.equal(exact[0], pruned[0])
    for g, g_p in zip(exact[2], pruned[2]):
        assert torch.equal(g, g_p)


def test_pruned_launches_start_the_rows_with_the_most_work_and_give_the_same_results(monkeypatch):
    from foxlm.kernels.attention import attention_launch

    torch.manual_seed(0)
    B, T, H, D = 2, 96, 4, 128  # head dim above 64 without GQA: rows go in pairs, in this order (`_launch_settings`)
    log_fgate = fast_and_slow_gates(B, T, H)  # heads 0, 2 forget fast, 1, 3 barely
    log_fgate[0, :, 1] = log_fgate[0, :, 0]
    c, _ = triton_gate_cumsum(log_fgate, False)
    order = acp.row_order(c, torch.ones(B, H, device=DEVICE), math.log(EPS), None, None, T, T)
    assert order.dtype == torch.int32
    assert order.tolist()[:3] == [3, 5, 7] and sorted(order.tolist()[3:]) == [0, 1, 2, 4, 6]  # ties: index order
    cu_seqlens = torch.tensor([0, 30, 30, 96], device=DEVICE, dtype=torch.int32)  # the second sequence is empty
    c_packed, _ = triton_gate_cumsum(log_fgate[:1], False, cu_seqlens)
    order_packed = acp.row_order(c_packed, torch.ones(1, H, device=DEVICE), math.log(EPS), cu_seqlens, None, T, T)
    # Sequence 0 is too short to prune, sequence 2 prunes its fast heads 0-2, the empty one has no work.
    assert order_packed.tolist() == [0, 1, 2, 3, 11, 8, 9, 10, 4, 5, 6, 7]

    q, k, v = (torch.randn(B, T, H, D, device=DEVICE) * 0.3 for _ in range(3))
    orders = []
    monkeypatch.setattr(attention_launch, "row_order", lambda *args: orders.append(order) or order)
    sorted_rows = run(q, k, v, log_fgate, prune_eps=EPS)
    index_order = torch.arange(B * H, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(attention_launch, "row_order", lambda *args: orders.append(index_order) or index_order)
    index_rows = run(q, k, v, log_fgate, prune_eps=EPS)
    assert len(orders) == 4  # the forward and the backward of each call
    assert torch.equal(sorted_rows[0], index_rows[0])
    for g, g_index in zip(sorted_rows[2], index_rows[2]):
        assert torch.equal(g, g_index)


def test_row_order_is_a_stable_descending_sort_of_the_rows_work_over_several_launch_blocks():
    # 3 x 100 rows: more than one program's block (128) and several chunks of the count; heads in pairs of equal
    # gates (ties), decay rates spread over classes, one left-padded sequence, one NaN bound, one NaN gate.
    torch.manual_seed(0)
    B, T, H = 3, 24, 100
    log_fgate = F.logsigmoid(torch.randn(B, T, H // 2, device=DEVICE) + torch.linspace(-9, 3, H // 2, device=DEVICE))
    log_fgate = log_fgate.repeat_interleave(2, dim=2)  # five classes, 33-76 rows each
    log_fgate[1, 5, 7] = float("nan")
    bound = torch.rand(B, H, device=DEVICE)
    bound[2, 11] = float("nan")
    seq_start = torch.tensor([0, 9, 0], device=DEVICE, dtype=torch.int32)
    c, _ = triton_gate_cumsum(log_fgate, False, None, seq_start)
    order = acp.row_order(c, bound, math.log(EPS), None, seq_start, T, T)
    # The classes as `_row_work` defines them, in float64 where the kernel has fp32 past the division.
    n_keys = (T - seq_start).double()[:, None]
    acp_delta = (math.log(EPS) - 2 * bound.double() - n_keys.log()).nan_to_num(nan=-math.inf)
    share = (2 * acp_delta / c[:, :, -1].clamp(max=-1e-30)).clamp(max=1.0)
    work = share.float().log2().floor().nan_to_num(nan=0.0).flatten()
    assert sorted(order.tolist()) == list(range(B * H))
    assert torch.equal(order.long(), torch.argsort(work, descending=True, stable=True))


def test_statistics_record_only_pruned_calls_inside_the_block():
    q, k, v = (torch.randn(1, 40, 2, 16, device=DEVICE) for _ in range(3))
    log_fgate = torch.full((1, 40, 2), -3.0, device=DEVICE)
    forgetting_attention(q, k, v, log_fgate, backend="triton", prune_eps=0.5)
    with acp_statistics() as stats:
        forgetting_attention(q, k, v, log_fgate, backend="triton")
        forgetting_attention(q, k, v, log_fgate, backend="triton", prune_eps=0.5)
    assert len(stats.calls) == 1 and stats.pruned_fraction > 0


@pytest.mark.parametrize("Tq, Tk, H, D", [(1, 1, 1, 16), (37, 37, 3, 24), (130, 130, 9, 64), (5, 70, 2, 16),
                                          (70, 5, 2, 16)])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_measured_score_bound_matches_float64_norms(Tq, Tk, H, D, path, monkeypatch):
    if path == "torch":  # what runs without Triton, or on CPU tensors outside the interpreter
        monkeypatch.setattr(acp, "triton_max_square_norms", None)
    torch.manual_seed(0)
    # Strided views, as a fused projection hands them over: q and k are slices of one tensor. Tq != Tk: queries
    # against a cache (the largest key norms lie past Tq).
    qkv = torch.randn(2, max(Tq, Tk), 4 * H, D, device=DEVICE) * torch.linspace(0.1, 3, max(Tq, Tk))[:, None, None]
    q, k = qkv[:, -Tq:, : 3 * H], qkv[:, -Tk:, 3 * H :]
    expected = [torch.linalg.vector_norm(x.double(), dim=-1).amax(1) for x in (q, k)]
    for got, want in zip(max_square_norms(q, k), expected):
        torch.testing.assert_close(got.double(), want.square(), rtol=1e-6, atol=0)
    bound = measured_score_bound(q, k, 0.125)
    assert bound.shape == (2, 3 * H) and bound.dtype == torch.float32
    torch.testing.assert_close(bound.double(), expected[0] * expected[1].repeat_interleave(3, 1) * 0.125,
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("bound", ["measured", "measured by torch", "nan"])
def test_nan_inputs_are_not_hidden_by_pruning(bound, monkeypatch):
    # A NaN key must reach every output and gradient that it reaches without pruning: its measured U is inf, and a
    # NaN bound prunes nothing (else the dK/dV pass would skip every query block and return zeros).
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, device=DEVICE) for _ in range(3))
    k[0, 9, 1] = float("nan")
    log_fgate = torch.full((1, 64, 2), -2.0, device=DEVICE)
    if bound == "measured by torch":
        monkeypatch.setattr(acp, "triton_max_square_norms", None)
    score_bound = float("nan") if bound == "nan" else None
    if score_bound is None:
        assert measured_score_bound(q, k, 0.25)[0].isinf().tolist() == [False, True]
    exact = run(q, k, v, log_fgate)
    pruned = run(q, k, v, log_fgate, prune_eps=0.5, score_bound=score_bound)
    assert exact[0].isnan().any()
    for a, b in zip((exact[0], *exact[2]), (pruned[0], *pruned[2])):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


def test_prune_eps_must_be_a_probability():
    q, k, v = (torch.randn(1, 4, 1, 16, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="prune_eps"):
        forgetting_attention(q, k, v, torch.zeros(1, 4, 1, device=DEVICE), prune_eps=1.0)


def test_custom_op_registrations_with_pruning():
    q, k, v = (torch.randn(1, 20, 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    log_fgate = torch.full((1, 20, 2), -2.0, device=DEVICE, requires_grad=True)
    args = (q, k, v, log_fgate, False, 0.25, None, None, None, True, 1e-3, torch.ones(1, 2, device=DEVICE), True)
    torch.library.opcheck(torch.ops.foxlm.forgetting_attention, args)


@pytest.mark.parametrize("gate_is_cumsum", [False, True], ids=["log_fgate", "fgate_cumsum"])
def test_heads_whose_gate_rises_are_not_pruned(gate_is_cumsum):
    # ACP's bound needs c never to rise (f <= 1). With one log f = +80 the kernels skipped the keys it revives
    # (an output error of 2.7 against a bound of 0.17); now that head runs exact, the others are still pruned.
    torch.manual_seed(0)
    B, T, H, D = 1, 128, 2, 16
    q, k = (torch.randn(B, T, H, D, device=DEVICE) * 0.3 for _ in range(2))
    v = torch.randn(B, T, H, D, device=DEVICE)
    log_fgate = torch.full((B, T, H), -1.0, device=DEVICE)
    log_fgate[0, 20, 0] = 80.0
    gate = dict(fgate_cumsum=log_fgate.cumsum(1)) if gate_is_cumsum else dict(log_fgate=log_fgate)
    exact = forgetting_attention(q, k, v, backend="triton", **gate)
    with acp_statistics() as stats:
        pruned = forgetting_attention(q, k, v, backend="triton", prune_eps=EPS, **gate)
    assert (pruned - exact).abs().max() <= 2 * EPS * v.abs().max()
    (per_head,) = stats.per_call()
    assert per_head[0] == 0 and per_head[1] > 0.5
