"""The pure-PyTorch reference against Forgetting Attention written straight from its definition."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from foxlm.kernels import forgetting_attention, forgetting_attention_reference
from foxlm.kernels.attention import attention as attention_module
from foxlm.kernels.attention import attention_reference as reference_module


def naive_forgetting_attention(q, k, v, log_fgate):
    """o_i = sum_j F_ij exp(q_i.k_j / sqrt(d)) v_j / sum_j F_ij exp(q_i.k_j / sqrt(d)), F_ij = prod_{l=j+1..i} f_l.

    One batch element, float64, loops over heads; queries are the last Tq of the Tk positions.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    out = torch.zeros(Tq, Hq, v.shape[-1], dtype=torch.float64)
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        for m in range(Tq):
            i = Tk - Tq + m
            decay = torch.stack([log_fgate[j + 1 : i + 1, h].sum() for j in range(i + 1)]).exp()
            weights = decay * torch.exp(k[: i + 1, kv] @ q[m, h] / math.sqrt(D))
            out[m, h] = weights @ v[: i + 1, kv] / weights.sum()
    return out


def random_inputs(B, Tq, Tk, Hq, Hkv, D, dtype=torch.float64, gate_logit_mean=2.0, requires_grad=False):
    q = torch.randn(B, Tq, Hq, D, dtype=dtype)
    k = torch.randn(B, Tk, Hkv, D, dtype=dtype)
    v = torch.randn(B, Tk, Hkv, D, dtype=dtype)
    log_fgate = F.logsigmoid(torch.randn(B, Tk, Hq, dtype=torch.float64) + gate_logit_mean)
    tensors = (q, k, v, log_fgate)
    return [t.requires_grad_(requires_grad) for t in tensors]


@pytest.mark.parametrize("Tq, Tk, Hq, Hkv", [(1, 1, 2, 2), (13, 13, 4, 2), (5, 13, 3, 1), (9, 9, 2, 2)])
def test_reference_matches_the_definition(Tq, Tk, Hq, Hkv):
    q, k, v, log_fgate = random_inputs(2, Tq, Tk, Hq, Hkv, 8)
    out = forgetting_attention(q, k, v, log_fgate)
    for b in range(2):
        expected = naive_forgetting_attention(q[b], k[b], v[b], log_fgate[b])
        torch.testing.assert_close(out[b], expected, rtol=1e-10, atol=1e-10)


def test_gradients_pass_gradcheck():
    inputs = random_inputs(1, 4, 6, 2, 1, 3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: forgetting_attention(*t), inputs)


def test_gradients_pass_gradcheck_through_fgate_cumsum_and_left_padding():
    q, k, v, log_fgate = random_inputs(2, 5, 5, 2, 2, 3, requires_grad=True)
    seq_start = torch.tensor([0, 2])
    assert torch.autograd.gradcheck(
        lambda *t: forgetting_attention(*t[:3], fgate_cumsum=t[3], seq_start=seq_start),
        (q, k, v, log_fgate.detach().cumsum(1).requires_grad_()),
    )


def test_no_decay_equals_causal_softmax_attention():
    q, k, v, _ = random_inputs(2, 11, 11, 4, 4, 8)
    out = forgetting_attention(q, k, v, torch.zeros(2, 11, 4, dtype=torch.float32))
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(out, expected.transpose(1, 2))


def test_strong_decay_attends_to_the_diagonal_only():
    q, k, v, _ = random_inputs(1, 7, 7, 2, 2, 4)
    out = forgetting_attention(q, k, v, torch.full((1, 7, 2), -60.0))
    torch.testing.assert_close(out, v, rtol=1e-12, atol=1e-12)


def test_packed_sequences_equal_separate_calls_and_restart_the_gate():
    lengths = [1, 6, 1, 9]
    q, k, v, log_fgate = random_inputs(1, sum(lengths), sum(lengths), 4, 2, 8)
    cu_seqlens = torch.tensor([0, 1, 7, 8, 17], dtype=torch.int32)
    out = forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, max_seqlen=9)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        piece = forgetting_attention(q[:, start:end], k[:, start:end], v[:, start:end], log_fgate[:, start:end])
        torch.testing.assert_close(out[:, start:end], piece)


def test_packed_token_bounds_skip_empty_sequences():
    start, end = reference_module.packed_token_bounds(torch.tensor([0, 2, 2, 5, 5, 6], dtype=torch.int32), 6)
    assert start.tolist() == [0, 0, 2, 2, 2, 5]
    assert end.tolist() == [2, 2, 5, 5, 5, 6]


def test_left_padding_ignores_pad_keys_and_their_gates():
    q, k, v, log_fgate = random_inputs(1, 8, 8, 2, 2, 8)
    pad = 3
    padded = [torch.cat([torch.randn(1, pad, *t.shape[2:], dtype=t.dtype), t], dim=1) for t in (q, k, v, log_fgate)]
    out = forgetting_attention(*padded, seq_start=torch.tensor([pad]))
    torch.testing.assert_close(out[:, pad:], forgetting_attention(q, k, v, log_fgate))
    assert torch.equal(out[:, :pad], torch.zeros_like(out[:, :pad]))  # queries that see no key output 0


def test_chunked_queries_equal_one_chunk_in_values_and_gradients(monkeypatch):
    inputs = random_inputs(2, 29, 37, 4, 2, 8, requires_grad=True)
    out = forgetting_attention(*inputs)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    monkeypatch.setattr(reference_module, "_MAX_SCORES_PER_CHUNK", 2 * 8 * 37)  # 2-query chunks
    chunked = forgetting_attention(*inputs)
    chunked_grads = torch.autograd.grad(chunked.square().sum(), inputs)
    torch.testing.assert_close(chunked, out)
    for g, expected in zip(chunked_grads, grads):
        torch.testing.assert_close(g, expected)


def test_long_sequence_never_allocates_a_full_score_matrix():
    # A 32k-token forward in a fresh process: a T x T fp32 matrix alone would be 4 GiB.
    script = """
import resource, torch
from foxlm.kernels import forgetting_attention
T = 32768
q, k, v = (torch.randn(1, T, 1, 16) for _ in range(3))
out = forgetting_attention(q, k, v, torch.full((1, T, 1), -0.01))
assert torch.isfinite(out).all()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""
    peak_mib = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                                  text=True).stdout.split()[-1])
    assert peak_mib < 2048, f"peak memory {peak_mib} MiB"


def test_strong_decay_over_long_sequences_keeps_precision():
    # |c| reaches ~1e5 at T = 20k with log f = -5: a plain fp32 c_i - c_j would lose ~1e-2 of the local bias.
    T = 20000
    q, k, v = (torch.randn(1, T, 1, 8) for _ in range(3))
    log_fgate = torch.full((1, T, 1), -5.0) + 0.1 * torch.randn(1, T, 1)
    out = forgetting_attention(q[:, -64:], k, v, log_fgate)
    window = slice(T - 200, T)
    expected = forgetting_attention(q[:, -64:].double(), k[:, window].double(), v[:, window].double(),
                                    log_fgate[:, window].double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q=torch.randn(1, 8, 3, 8), log_fgate=torch.zeros(1, 8, 3)), "multiple of key/value heads"),
        (dict(q=torch.randn(1, 9, 4, 8)), "Tq <= Tk"),
        (dict(k=torch.randn(1, 8, 2, 4)), "must match `q`"),
        (dict(q=torch.randn(1, 8, 4, 8, dtype=torch.float16)), "share a dtype"),
        (dict(log_fgate=torch.zeros(1, 8, 4, dtype=torch.bfloat16)), "float32"),
        (dict(log_fgate=torch.zeros(1, 8, 2)), "log_fgate"),
        (dict(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32)), "end at the packed length 8"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32)), "non-decreasing"),
        (dict(seq_start=torch.tensor([0, 1])), "length batch=1"),
        (dict(backend="flash"), "backend"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_the_argument(kwargs, message):
    args = dict(q=torch.randn(1, 8, 4, 8), k=torch.randn(1, 8, 2, 8), v=torch.randn(1, 8, 2, 8),
                log_fgate=torch.zeros(1, 8, 4))
    args.update(kwargs)
    q, k, v, log_fgate = (args.pop(n) for n in ("q", "k", "v", "log_fgate"))
    with pytest.raises(ValueError, match=message):
        forgetting_attention(q, k, v, log_fgate, **args)


def test_packed_boundaries_are_read_once_per_tensor_and_again_after_an_in_place_change(monkeypatch):
    q, k, v = (torch.randn(1, 8, 2, 8) for _ in range(3))
    log_fgate = torch.zeros(1, 8, 2)
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32)
    checks = []
    check = attention_module.packed_sequence_lengths
    monkeypatch.setattr(attention_module, "packed_sequence_lengths", lambda *args: checks.append(args) or check(*args))
    for max_seqlen in (None, 5, None):  # the layers of a model share one tensor: one read (a device sync on a GPU)
        forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend="reference")
    assert len(checks) == 1
    cu_seqlens[1] = 9
    with pytest.raises(ValueError, match="non-decreasing"):
        forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, max_seqlen=5, backend="reference")



def test_reference_is_the_cpu_path():
    q, k, v, log_fgate = random_inputs(1, 5, 5, 2, 2, 4)
    assert torch.equal(forgetting_attention(q, k, v, log_fgate), forgetting_attention_reference(q, k, v, log_fgate))
