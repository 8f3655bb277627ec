"""The Triton Forgetting Attention kernel (forward and all four gradients) against a naive float64 formula.

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


def test_packed_launch_without_max_seqlen_takes_the_longest_sequence_from_the_checked_boundaries(monkeypatch):
    from foxlm.kernels import interface

    launches = []
    forward = interface.triton_attention_forward
    monkeypatch.setattr(interface, "triton_attention_forward",
                        lambda *args, **kwargs: launches.append(args[7]) or forward(*args, **kwargs))
    cu_seqlens = torch.tensor([0, 1, 18, 19, 20, 51, 70], device=DEVICE, dtype=torch.int32)
    q, k, v, log_fgate = make_inputs(1, 70, 70, 4, 2, 16)
    forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, backend="triton")
    assert launches == [31]


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
    # The total key-side gradient is zero (fox-reference.md §3).
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
    from foxlm.kernels import triton_attention as ta

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
    monkeypatch.setattr(ta, "_use_tma", lambda *t, use=ta._use_tma: uses.append(use(*t)) or uses[-1])

    def run(q, k_buffer, v_buffer, log_fgate):
        k, v = (x[:, :Tk, :, :D] for x in (k_buffer, v_buffer))
        return forgetting_attention(q, k, v, log_fgate, backend="triton", **kwargs)

    with_tma = outputs_and_grads(run, (q, *buffers, log_fgate), grad_out)
    monkeypatch.setattr(ta, "TMA_LOADS", False)
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
    from foxlm.kernels import triton_attention as ta

    kwargs = launch_kwargs(kwargs)
    inputs = make_inputs(*shape, gate_scale=4.0)
    grad_out = torch.randn(*shape[:2], shape[3], shape[5], device=DEVICE)
    results = []
    for head_group in (1000, 1, 2, 4):
        monkeypatch.setattr(ta, "_head_group", lambda *args, size=head_group: size)
        results.append(outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton", **kwargs), inputs,
                                         grad_out))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.isfinite(x).all() and torch.equal(x, y)


@pytest.mark.parametrize(
    "pruned, group, block_d, head_group",
    [(True, 1, 64, 12), (True, 1, 128, 2), (False, 4, 128, 12), (False, 1, 64, 12), (False, 1, 128, 1),
     (False, 1, 256, 1)],
)
def test_heads_are_grouped_as_measured_fastest(pruned, group, block_d, head_group):
    from foxlm.kernels import triton_attention as ta

    assert ta._head_group(pruned, group, block_d, 12) == head_group


def test_tma_loads_only_for_16_byte_aligned_rows_and_a_triton_that_makes_descriptors(monkeypatch):
    from foxlm.kernels import triton_attention as ta

    buffer = torch.randn(300, device=DEVICE, dtype=torch.float16)
    q = buffer[:256].view(1, 8, 2, 16)
    assert ta._use_tma(q) == (ta._INTERPRET or torch.cuda.get_device_capability(q.device)[0] >= 9)
    assert not ta._use_tma(buffer[4:260].view(1, 8, 2, 16))  # starts 8 bytes past an aligned address
    assert not ta._use_tma(torch.randn(1, 8, 2, 20, device=DEVICE, dtype=torch.float16))  # 40-byte rows
    assert not ta._use_tma(q[..., :12])  # 24-byte rows
    assert not ta._use_tma(torch.randn(1, 8, 2, 20, device=DEVICE, dtype=torch.float16)[..., :16])  # 40-byte strides
    monkeypatch.setattr(ta, "_allocation", None)  # a Triton without in-kernel descriptors takes pointer tiles
    assert not ta._use_tma(q)


def test_forward_and_backward_each_scan_the_gates_once(monkeypatch):
    # c and the key biases come from one launch in the forward and are kept; the backward's one launch is d log f.
    from foxlm.kernels import interface

    calls = []
    for name in ("triton_gate_cumsum", "triton_gate_gradient"):
        original = getattr(interface, name)
        monkeypatch.setattr(interface, name, lambda *a, f=original, n=name: calls.append(n) or f(*a))
    inputs = make_inputs(1, 40, 40, 2, 1, 16)
    outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, torch.randn(1, 40, 2, 16))
    assert calls == ["triton_gate_cumsum", "triton_gate_gradient"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float64_cumsum_in_the_kernels_layout_is_accepted(backend):
    # fgate_cumsum_from_log_fgate returns a (B, T, H) view of a (B, H, T) float64 tensor: the op must not hand that
    # memory back as its own output.
    from foxlm.kernels.reference import fgate_cumsum_from_log_fgate

    q, k, v, log_fgate = make_inputs(1, 30, 30, 2, 1, 16)
    c = fgate_cumsum_from_log_fgate(log_fgate)
    got = outputs_and_grads(lambda q, k, v, c: forgetting_attention(q, k, v, fgate_cumsum=c, backend=backend),
                            (q, k, v, c), torch.randn(1, 30, 2, 16, device=DEVICE))
    want = forgetting_attention(q, k, v, log_fgate, backend=backend)
    torch.testing.assert_close(got[0], want)
    assert torch.isfinite(got[4]).all()


def test_autotuning_runs_leave_results_unchanged(monkeypatch):
    # The autotuner times each candidate configuration by running the launch on the real arguments, several times
    # (Triton 3.6 even with a single candidate), so no autotuned kernel may change its own inputs. Here every kernel
    # has two candidates, each run twice instead of timed (the interpreter has no GPU timer).
    from foxlm.kernels import triton_attention as ta

    inputs = make_inputs(1, 40, 40, 2, 1, 16)
    grad_out = torch.randn(1, 40, 2, 16, device=DEVICE)
    want = outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    for table in (ta._FWD_CONFIGS, ta._BWD_Q_CONFIGS, ta._BWD_KV_CONFIGS):
        monkeypatch.setitem(table, 0, table[0] * 2)
    monkeypatch.setattr(ta, "_AUTOTUNE", True)
    runs = []
    for tuner in (ta._fwd, ta._bwd_q, ta._bwd_kv):
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(tuner, "_do_bench", lambda call, quantiles: [call(), call(), runs.append(1), [1.0] * 3][-1])
    got = outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    assert len(runs) == 6, "each kernel's two candidates were run"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_autotuning_keys_on_the_length_class():
    from foxlm.kernels import triton_attention as ta

    # Powers of two from 1k to 16k: a process that runs several lengths retunes a few times, not at every length.
    lengths = (0, 1, 40, 1024, 1025, 5000, 16384, 16385, 100_000)
    assert [ta._tune_seqlen(n) for n in lengths] == [1024, 1024, 1024, 1024, 2048, 8192, 16384, 16384, 16384]
    inputs = make_inputs(1, 40, 40, 2, 2, 16)
    grad_out = torch.randn(1, 40, 2, 16, device=DEVICE)
    outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    for tuner in (ta._fwd, ta._bwd_q, ta._bwd_kv):
        position = tuner.keys.index("tune_seqlen")
        assert 1024 in {key[position] for key in tuner.cache}


@pytest.mark.parametrize("layout", ["dense", "left padding", "packed", "cumsum given", "packed cumsum given"])
def test_gate_scans_match_torch_across_chunks_sequences_and_segments(layout):
    # c, the key biases and d log f from the scan launches against torch ops in float64 (the interpreter's scan
    # chunks are 32 positions long, so T = 100 crosses chunks, segments and, packed, sequences inside a chunk).
    from foxlm.kernels import triton_attention as ta
    from foxlm.kernels.interface import _cumsum_float64, _gate_gradient

    packed, given = "packed" in layout, "given" in layout
    B, T, H = (1 if packed else 3), 100, 3
    bounds = [0, 5, 5, 33, 34, 70, 100] if packed else [0, T]
    cu_seqlens = torch.tensor(bounds, device=DEVICE, dtype=torch.int32) if packed else None
    seq_start = torch.tensor([0, 13, 40], device=DEVICE) if layout == "left padding" else None
    log_fgate = F.logsigmoid(torch.randn(B, T, H, device=DEVICE) * 3)
    c_want = _cumsum_float64(log_fgate, False, cu_seqlens, seq_start)
    gate = c_want.transpose(1, 2).float() if given else log_fgate
    if given:
        c_want = gate.transpose(1, 2).double()  # taken as given, after its rounding to fp32
    c, key_bias = ta.triton_gate_cumsum(gate, given, cu_seqlens, seq_start)
    assert c.dtype == torch.float64 and key_bias.dtype == torch.float32 and c.stride(-1) == key_bias.stride(-1) == 1
    torch.testing.assert_close(c, c_want, rtol=1e-13, atol=1e-13)
    segment_start = torch.cat([torch.arange(s, e) - (torch.arange(s, e) - s) % ta.SEGMENT
                               for s, e in zip(bounds[:-1], bounds[1:])]).to(DEVICE)
    key_want = ((c_want - c_want[..., segment_start]) * math.log2(math.e)).float()
    torch.testing.assert_close(key_bias, key_want, rtol=2e-7, atol=1e-6)
    dc = torch.randn(B, H, T, device=DEVICE)
    for dtype in (torch.float32, torch.float64):
        got = _gate_gradient(dc, gate.to(dtype), given, cu_seqlens, seq_start, True)
        want = _gate_gradient(dc, gate.to(dtype), given, cu_seqlens, seq_start, False)
        assert got.dtype == dtype and got.shape == (B, T, H)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_torch_compile_sees_one_op_without_graph_breaks():
    q, k, v, log_fgate = make_inputs(1, 24, 24, 2, 1, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_fgate)]

    def layer(q, k, v, log_fgate):
        return forgetting_attention(q * 1.5, k, v, log_fgate, backend="reference").square().sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(*leaves).backward()
    want = [t.clone().requires_grad_() for t in (q, k, v, log_fgate)]
    layer(*want).backward()
    for x, ref in zip(leaves, want):
        torch.testing.assert_close(x.grad, ref.grad)


def test_custom_op_registrations():
    q, k, v, log_fgate = make_inputs(1, 9, 12, 2, 1, 16)
    for args in [(q, k, v, log_fgate, False, 0.25, None, None, None, False),
                 (q, k, v, log_fgate.cumsum(1), True, 0.25, None, None, torch.tensor([3]), False)]:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        torch.library.opcheck(torch.ops.foxlm.forgetting_attention, args)


def test_custom_op_registrations_on_the_triton_path():
    q, k, v, log_fgate = make_inputs(1, 20, 20, 2, 1, 16)
    args = (q, k, v, log_fgate, False, 0.25, None, None, None, True)
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(torch.ops.foxlm.forgetting_attention, args)


def test_triton_backend_rejects_what_it_cannot_run():
    q, k, v, log_fgate = make_inputs(1, 4, 4, 1, 1, 272)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        forgetting_attention(q, k, v, log_fgate, backend="triton")
    with pytest.raises(ValueError, match="float64"):
        forgetting_attention(q.double(), k.double(), v.double(), log_fgate, backend="triton")
