"""The split-K decode kernel (Triton interpreter on CPU) and its PyTorch twin against a float64 formula."""

import math

import pytest
import torch
import torch.nn.functional as F

from foxlm.kernels.acp import acp_threshold
from foxlm.kernels.decode import forgetting_decode, forgetting_decode_reference

pytest.importorskip("triton")
from foxlm.kernels.decode.decode_triton import triton_forgetting_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def naive_decode(q, k, v, c, seq_start=None, acp_delta=None):
    """softmax(q k^T / sqrt(d) + c_q - c_k) v in float64 over full matrices, K/V repeated for GQA."""
    q, k, v, c = (t.double() for t in (q, k, v, c))
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    k, v = (t.repeat_interleave(Hq // t.shape[2], dim=2) for t in (k, v))
    keys = torch.arange(Tk, device=q.device)
    bias = c[:, Tk - Tq :].transpose(1, 2)[..., :, None] - c.transpose(1, 2)[..., None, :]  # (B, Hq, Tq, Tk)
    visible = (keys[None, :] <= keys[Tk - Tq :, None])[None, None]
    if seq_start is not None:
        visible = visible & (keys >= seq_start[:, None, None, None])
    if acp_delta is not None:
        visible = visible & (bias >= acp_delta.double()[..., None, None])
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(D) + bias
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def make_cache(B, Tq, Tk, Hq, Hkv, D, dtype=torch.float32, gate_bias=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(DEVICE, dtype)
    # A (B, Hkv, Tk, D) cache read through a transposed view, as the model passes it.
    k = torch.randn(B, Hkv, Tk, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    v = torch.randn(B, Hkv, Tk, D, generator=g).to(DEVICE, dtype).transpose(1, 2)
    log_fgate = F.logsigmoid(torch.randn(B, Hq, Tk, generator=g) * 2 + gate_bias)
    c = log_fgate.double().cumsum(-1).float().to(DEVICE).transpose(1, 2)  # (B, Tk, Hq) view of (B, Hq, Tk)
    return q, k, v, c


def rel_error(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("B,Tq,Tk,Hq,Hkv,D", [
    (1, 1, 50, 2, 2, 16),     # MHA, one token, several key blocks and a ragged last block
    (2, 1, 70, 4, 1, 32),     # MQA
    (2, 3, 45, 6, 2, 24),     # GQA, several new tokens (causal among them), head_dim not a power of two
    (1, 16, 40, 2, 1, 8),     # the most new tokens, tiny head_dim
])
def test_decode_kernel_matches_float64(B, Tq, Tk, Hq, Hkv, D):
    q, k, v, c = make_cache(B, Tq, Tk, Hq, Hkv, D)
    ref = naive_decode(q, k, v, c)
    for num_splits in (1, 3):
        out = triton_forgetting_decode(q, k, v, c, 1 / math.sqrt(D), num_splits=num_splits)
        assert rel_error(out, ref) < 1e-5
    assert rel_error(forgetting_decode_reference(q, k, v, c), ref) < 1e-5


def test_ragged_left_padded_batch_ignores_padding():
    q, k, v, c = make_cache(3, 2, 48, 4, 2, 16)
    seq_start = torch.tensor([0, 17, 46], device=DEVICE)  # the last sequence sees only its own 2 tokens
    ref = naive_decode(q, k, v, c, seq_start=seq_start)
    out = triton_forgetting_decode(q, k, v, c, 0.25, seq_start, num_splits=4)
    assert rel_error(out, ref) < 1e-5
    alone = naive_decode(q[1:2], k[1:2, 17:], v[1:2, 17:], c[1:2, 17:])
    torch.testing.assert_close(out[1:2].double(), alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(DEVICE == "cpu", reason="no bf16 in the interpreter")),
    (torch.float16, 5e-3),
])
def test_half_precision_inputs(dtype, tol):
    q, k, v, c = make_cache(2, 2, 40, 4, 2, 32, dtype=dtype)
    assert rel_error(triton_forgetting_decode(q, k, v, c, 32**-0.5, num_splits=2), naive_decode(q, k, v, c)) < tol


def test_acp_skips_decayed_keys_within_eps():
    # Fast gates (log f ~ -3 per token): only the last few keys carry weight.
    q, k, v, c = make_cache(2, 1, 64, 4, 2, 16, gate_bias=-3.0)
    u = (q.float().norm(dim=-1).amax(1) * k.float().norm(dim=-1).amax(1).repeat_interleave(2, dim=1)) / 4
    delta = torch.tensor(acp_threshold(0.0, 64, math.exp(-10))) - 2 * u
    ref = naive_decode(q, k, v, c, acp_delta=delta)
    out = triton_forgetting_decode(q, k, v, c, 0.25, acp_delta=delta, num_splits=2)
    assert rel_error(out, ref) < 1e-5
    assert rel_error(forgetting_decode_reference(q, k, v, c, acp_delta=delta), ref) < 1e-5
    assert (out.double() - naive_decode(q, k, v, c)).abs().max() < math.exp(-10) * 2 * v.abs().max()
    assert ((c[:, -1:] - c) < delta[:, None]).float().mean() > 0.5  # most keys were pruned


def test_dispatch_and_argument_checks():
    q, k, v, c = make_cache(1, 2, 20, 2, 1, 8)
    torch.testing.assert_close(forgetting_decode(q, k, v, c, backend="triton").double(), naive_decode(q, k, v, c))
    with pytest.raises(ValueError, match="new queries"):
        forgetting_decode(q.repeat(1, 9, 1, 1), k, v, c)
    with pytest.raises(ValueError, match="fgate_cumsum"):
        forgetting_decode(q, k, v, c[..., :1])


def test_nan_propagates_on_the_reference_as_in_the_kernel_and_padding_rows_stay_zero():
    # The reference zeroed NaN (nan_to_num, meant for queries that see no key).
    q, k, v, c = make_cache(2, 2, 40, 2, 1, 16)
    q[1, 1, 0, 3] = float("nan")
    k[0, 30, 0, 5] = float("nan")
    seq_start = torch.tensor([0, 39], device=DEVICE)  # batch 1's first new token sees no key
    reference = forgetting_decode_reference(q, k, v, c, seq_start=seq_start)
    kernel = triton_forgetting_decode(q, k, v, c, 0.25, seq_start, None)
    assert reference.isnan().any() and torch.equal(reference.isnan(), kernel.isnan())
    assert torch.all(reference[1, 0] == 0) and torch.all(kernel[1, 0] == 0)


@pytest.mark.parametrize("Tq", [1, 3])
def test_static_cache_buffers_are_read_up_to_kv_len_only(Tq):
    # The static cache: buffers longer than the filled part, whose tail holds stale values, and a float64 running sum.
    B, Tk, Hq, Hkv, D, capacity = 2, 37, 4, 2, 16, 80
    q, k, v, c = make_cache(B, Tq, Tk, Hq, Hkv, D)
    seq_start = torch.tensor([0, 9], device=DEVICE)
    ref = naive_decode(q, k, v, c, seq_start=seq_start)

    def buffer(t, width):
        stale = torch.full((B, capacity - Tk, *t.shape[2:]), 1e4, device=DEVICE, dtype=width)
        return torch.cat([t.to(width), stale], dim=1)

    k_buf, v_buf, c_buf = buffer(k, k.dtype), buffer(v, v.dtype), buffer(c, torch.float64)
    kv_len = torch.tensor(Tk, device=DEVICE)
    for num_splits in (1, 4):  # 4: the last splits lie wholly past the filled length
        out = triton_forgetting_decode(q, k_buf, v_buf, c_buf, D**-0.5, seq_start, kv_len=kv_len, num_splits=num_splits)
        assert rel_error(out, ref) < 1e-5
    out = forgetting_decode(q, k_buf, v_buf, c_buf, seq_start=seq_start, kv_len=kv_len, backend="reference")
    assert rel_error(out, ref) < 1e-5
    with pytest.raises(ValueError, match="kv_len"):
        forgetting_decode(q, k_buf, v_buf, c_buf, kv_len=Tk)
