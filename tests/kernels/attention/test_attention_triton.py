"""The Triton Forgetting Attention kernels (forward and all four gradients) against a naive float64 formula.

On machines without a GPU the kernels run in Triton's interpreter (tests/conftest.py), so shapes stay small; the
kernel's interpreter block sizes are 16-32, so T = 37..70 already crosses several blocks and the causal diagonal.
The same checks run through the reference backend (the CPU path of the custom op) so both backward formulas are
covered.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from foxlm.kernels import forgetting_attention

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def naive_forgetting_attention(q, k, v, log_fgate, sm_scale=None, cu_seqlens=None, seq_start=None, max_seqlen=None):
    """o = softmax(sm_scale * q k^T + c_i - c_j) v in float64, full matrices, K/V heads repeated for GQA."""
    q, k, v, log_fgate = (t.double() for t in (q, k, v, log_fgate))
    B, Tq, Hq, D = q.shape
    Tk = k.shape[1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    k = k.repeat_interleave(Hq // k.shape[2], dim=2)
    v = v.repeat_interleave(Hq // v.shape[2], dim=2)
    keys = torch.arange(Tk, device=q.device)
    visible = keys[None, :] <= (keys[Tk - Tq:])[:, None]  # (Tq, Tk), queries aligned to the last keys
    visible = visible[None].expand(B, Tq, Tk)
    if seq_start is not None:
        log_fgate = log_fgate.masked_fill((keys[None, :] < seq_start[:, None])[..., None], 0.0)
        visible = visible & (keys[None, None, :] >= seq_start[:, None, None])
    if cu_seqlens is not None:
        seq_id = torch.bucketize(keys, cu_seqlens[1:].to(keys.device), right=True)
        visible = visible & (seq_id[None, :, None] == seq_id[None, None, :])
    c = log_fgate.cumsum(1)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()[seq_id]
        before = torch.cat([c.new_zeros(B, 1, Hq), c[:, :-1]], dim=1)
        c = c - before[:, starts]
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * sm_scale
    scores = scores + c[:, Tk - Tq:].transpose(1, 2)[..., :, None] - c.transpose(1, 2)[..., None, :]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def make_inputs(B, Tq, Tk, Hq, Hkv, D, dtype=torch.float32, gate_scale=1.0):
    q = torch.randn(B, Tq, Hq, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, Tk, Hkv, D, device=DEVICE, dtype=dtype)
    v = torch.randn(B, Tk, Hkv, D, device=DEVICE, dtype=dtype)
    log_fgate = F.logsigmoid(torch.randn(B, Tk, Hq, device=DEVICE) * 2 + 2) * gate_scale
    return q, k, v, log_fgate


def relative_error(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-2)).item()  # some true gradients are 0 (T = 1)


def outputs_and_grads(fn, inputs, grad_out, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, **kwargs)
    out.backward(grad_out.to(out.dtype))
    return [out] + [t.grad for t in leaves]


def check_against_naive(inputs, backend="triton", tol=1e-4, **kwargs):
    B, Tq, Hq, D = inputs[0].shape
    grad_out = torch.randn(B, Tq, Hq, D, device=DEVICE, dtype=torch.float64)
    got = outputs_and_grads(forgetting_attention, inputs, grad_out, backend=backend, **kwargs)
    want = outputs_and_grads(naive_forgetting_attention, [t.double() for t in inputs], grad_out, **kwargs)
    for name, x, ref in zip(("out", "dq", "dk", "dv", "dlog_fgate"), got, want):
        assert x.shape == ref.shape, name
        assert torch.isfinite(x).all(), f"{name} has NaN/inf"
        err = relative_error(x, ref)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"
    return got


BACKENDS = ["triton", "reference"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "B, Tq, Tk, Hq, Hkv, D",
    [
        (1, 1, 1, 1, 1, 16),  # a single token
        (2, 37, 37, 2, 2, 32),  # T not a multiple of any block size
        (1, 50, 50, 2, 2, 24),  # head dim not a power of two (padded to 32 with masks)
        (1, 33, 33, 1, 1, 80),  # head dim 80, padded to 128
        (1, 40, 40, 4, 2, 16),  # GQA
        (1, 40, 40, 3, 1, 16),  # MQA, odd group
        (2, 19, 53, 2, 1, 16),  # Tq < Tk: chunked prefill against a cache
        (1, 1, 45, 2, 2, 16),  # one decoding step
        (1, 33, 48, 2, 2, 16),  # last query block: one row, at a key-block end (all-masked first block)
    ],
)
def test_matches_float64_formula(backend, B, Tq, Tk, Hq, Hkv, D):
    check_against_naive(make_inputs(B, Tq, Tk, Hq, Hkv, D), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_with_length_one_sequences(backend):
    cu_seqlens = torch.tensor([0, 1, 18, 19, 20, 51, 70], device=DEVICE, dtype=torch.int32)
    inputs = make_inputs(1, 70, 70, 4, 2, 16)
    check_against_naive(inputs, backend=backend, cu_seqlens=cu_seqlens, max_seqlen=31)


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padding_is_ignored(backend):
    seq_start = torch.tensor([0, 13, 40], device=DEVICE)
    inputs = make_inputs(3, 45, 45, 2, 1, 16)
    out = check_against_naive(inputs, backend=backend, seq_start=seq_start)[0]
    assert (out[1, :13] == 0).all() and (out[2, :40] == 0).all(), "fully padded query rows must output 0"
    # Changing what sits in the padding changes nothing in the real tokens.
    q, k, v, log_fgate = inputs
    k2, v2, g2 = k.clone(), v.clone(), log_fgate.clone()
    k2[1, :13], v2[1, :13], g2[1, :13] = 100.0, -100.0, -50.0
    out2 = forgetting_attention(q, k2, v2, g2, seq_start=seq_start, backend=backend)
    torch.testing.assert_close(out2[1, 13:], out[1, 13:].detach())


@pytest.mark.parametrize("backend", BACKENDS)
def test_right_padding_needs_nothing(backend):
    q, k, v, log_fgate = make_inputs(1, 48, 48, 2, 2, 16)
    out = forgetting_attention(q, k, v, log_fgate, backend=backend)
    k2, v2 = k.clone(), v.clone()
    k2[:, 30:], v2[:, 30:] = 7.0, float("nan")  # pad tokens may hold anything, even NaN
    out2 = forgetting_attention(q[:, :30], k2[:, :30], v2[:, :30], log_fgate[:, :30], backend=backend)
    torch.testing.assert_close(out2, out[:, :30])
    check_against_naive((q[:, :30], k[:, :30], v[:, :30], log_fgate[:, :30]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strong_decay(backend):
    # log f ~ -10: each token sees almost only itself, and |c| reaches ~600 where fp32 cumsums lose digits.
    q, k, v, _ = make_inputs(1, 64, 64, 2, 2, 16)
    log_fgate = -10.0 + torch.rand(1, 64, 2, device=DEVICE)
    # dq and dk are tiny here (P is nearly the identity), so their fp32 relative error is larger.
    check_against_naive((q, k, v, log_fgate), backend=backend, tol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_decay_is_causal_softmax_attention(backend):
    q, k, v, _ = make_inputs(2, 41, 41, 2, 2, 32)
    out = forgetting_attention(q, k, v, torch.zeros(2, 41, 2, device=DEVICE), backend=backend)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_flows_to_a_given_cumsum(backend):
    q, k, v, log_fgate = make_inputs(1, 35, 35, 2, 1, 16)
    c = log_fgate.cumsum(1)
    grad_out = torch.randn_like(q)
    got = outputs_and_grads(lambda q, k, v, c: forgetting_attention(q, k, v, fgate_cumsum=c, backend=backend),
                            (q, k, v, c), grad_out)
    def naive_from_cumsum(q, k, v, c):
        return naive_forgetting_attention(q, k, v, torch.diff(c, dim=1, prepend=torch.zeros_like(c[:, :1])))

    want = outputs_and_grads(naive_from_cumsum, (q, k, v, c.double()), grad_out.double())
    for x, ref in zip(got, want):
        assert relative_error(x, ref) < 1e-4
    # The total key-side gradient is zero (docs/design.md §3).
    assert got[4].sum(1).abs().max() < 1e-4


def test_half_precision_inputs():
    q, k, v, log_fgate = make_inputs(1, 40, 40, 2, 2, 32, dtype=torch.float16)
    check_against_naive((q, k, v, log_fgate), tol=1e-2)


def test_backward_is_deterministic():
    inputs = make_inputs(1, 40, 40, 4, 2, 16)
    grad_out = torch.randn(1, 40, 4, 16, device=DEVICE)
    first = outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    second = outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    for x, y in zip(first, second):
        assert torch.equal(x, y)


# (B, Tq, Tk, Hq, Hkv, D) and keyword arguments (lists become int32 tensors) of launches that two kernel variants must
# agree on bit for bit.
LAUNCH_VARIANTS = [
    ((2, 37, 37, 2, 2, 24), {}),  # padded head dim: TMA fills the columns past head_dim with zeros
    ((2, 19, 52, 4, 2, 16), {}),  # GQA, Tq < Tk
    ((3, 44, 44, 2, 1, 16), {"seq_start": [0, 13, 40]}),
    ((1, 72, 72, 2, 2, 16), {"cu_seqlens": [0, 1, 18, 51, 72], "max_seqlen": 33}),  # bias rows aligned, offsets not
    ((2, 64, 64, 3, 3, 16), {"prune_eps": 1e-3}),
]


def launch_kwargs(kwargs):
    return {name: torch.tensor(value, device=DEVICE, dtype=torch.int32) if isinstance(value, list) else value
            for name, value in kwargs.items()}


@pytest.mark.parametrize("shape, kwargs", LAUNCH_VARIANTS)
def test_tma_and_pointer_loads_give_identical_results(monkeypatch, shape, kwargs):
    from foxlm.kernels import dispatch
    from foxlm.kernels.attention import attention_launch

    kwargs = launch_kwargs(kwargs)
    q, k, v, log_fgate = make_inputs(*shape, gate_scale=4.0)
    B, Tk, Hkv, D = k.shape
    # K and V are views into NaN-filled buffers (16 more rows, 8 more columns): a load past the sequence or past
    # head_dim that is not zero-filled turns the result into NaN.
    buffers = [torch.full((B, Tk + 16, Hkv, D + 8), float("nan"), device=DEVICE) for _ in range(2)]
    for buffer, x in zip(buffers, (k, v)):
        buffer[:, :Tk, :, :D] = x
    grad_out = torch.randn(*shape[:2], shape[3], shape[5], device=DEVICE)
    uses = []
    monkeypatch.setattr(attention_launch, "use_tma", lambda *t, use=dispatch.use_tma: uses.append(use(*t)) or uses[-1])

    def run(q, k_buffer, v_buffer, log_fgate):
        k, v = (x[:, :Tk, :, :D] for x in (k_buffer, v_buffer))
        return forgetting_attention(q, k, v, log_fgate, backend="triton", **kwargs)

    with_tma = outputs_and_grads(run, (q, *buffers, log_fgate), grad_out)
    monkeypatch.setattr(dispatch, "TMA_LOADS", False)
    with_pointers = outputs_and_grads(run, (q, *buffers, log_fgate), grad_out)
    # Forward K/V, dQ K/V, then the key biases of the pruned dQ pass (not packed): 16-byte rows when Tk % 4 == 0.
    bias = [Tk % 4 == 0] if "prune_eps" in kwargs and "cu_seqlens" not in kwargs else []
    assert uses == [True, True, *bias, False, False, *[False] * len(bias)]
    for x, y in zip(with_tma, with_pointers):
        assert torch.isfinite(x).all() and torch.equal(x, y)


@pytest.mark.parametrize("shape, kwargs", LAUNCH_VARIANTS)
def test_every_head_grouping_of_the_launch_order_gives_identical_results(monkeypatch, shape, kwargs):
    # All heads' heavy blocks first, head by head, and groups of 2 or 4 heads (the last group smaller: 6 and 9
    # (sequence, head) pairs here) compute the same blocks, only in another order.
    from foxlm.kernels.attention import attention_launch

    kwargs = launch_kwargs(kwargs)
    inputs = make_inputs(*shape, gate_scale=4.0)
    grad_out = torch.randn(*shape[:2], shape[3], shape[5], device=DEVICE)
    results = []
    for head_group in (1000, 1, 2, 4):
        monkeypatch.setattr(attention_launch, "head_group", lambda *args, size=head_group: size)
        results.append(outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton", **kwargs), inputs,
                                         grad_out))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.isfinite(x).all() and torch.equal(x, y)
