"""The Hopper Gluon kernels (forward, dK/dV) against the Triton kernels and the float64 reference, on an sm_90 GPU.

Run on an H100/H200: `python -m pytest tests/kernels/attention/test_attention_hopper_gpu.py -q -s` (marked `gpu`;
skipped elsewhere). Fresh random inputs every call; the caching allocator is filled with NaN before every kernel call,
so an output element the kernels fail to write shows up as NaN.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from foxlm.kernels import dispatch, forgetting_attention
from foxlm.kernels.acp import acp_statistics

hopper = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hopper, reason="needs a Hopper GPU (sm_90)")]
if hopper:
    from foxlm.kernels.attention.attention_gate_scan import triton_gate_cumsum
    from foxlm.kernels.attention.attention_launch import _runs_on_hopper


@pytest.fixture(autouse=True)
def one_launch_configuration(monkeypatch):
    """The first (tuned) launch configuration of each kernel, as FOXLM_AUTOTUNE=0 takes it: keeps compile time in
    budget."""
    monkeypatch.setattr(dispatch, "AUTOTUNE", False)


def poison_allocator(nbytes=2**31):
    junk = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32).fill_(float("nan"))
    del junk


def make_inputs(B, T, H, gate=(2.0, 2.0), Hkv=None, D=128):
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, T, Hkv or H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    log_f = F.logsigmoid(torch.randn(B, T, H, device="cuda") * gate[1] + gate[0])
    return q, k, v, log_f


def run(inputs, grad_out, gluon, backend="triton", **kwargs):
    dispatch.HOPPER_KERNELS = gluon
    try:
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        poison_allocator()
        out = forgetting_attention(*leaves, backend=backend, **kwargs)
        poison_allocator()
        out.backward(grad_out.to(out.dtype))
        return [out] + [t.grad for t in leaves]
    finally:
        dispatch.HOPPER_KERNELS = True


def relative(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def compare(inputs, reference_too=True, **kwargs):
    B, T, H, D = inputs[0].shape
    grad_out = torch.randn(B, T, H, D, device="cuda", dtype=torch.float64)
    names = ("out", "dq", "dk", "dv", "dlog_fgate")
    got = run(inputs, grad_out, True, **kwargs)
    triton = run(inputs, grad_out, False, **kwargs)
    for name, x in zip(names, got):
        assert not torch.isnan(x).any(), f"{name}: NaN"
    vs_triton = {n: relative(x, y) for n, x, y in zip(names, got, triton)}
    print("vs Triton", " ".join(f"{k}={v:.1e}" for k, v in vs_triton.items()))
    if reference_too:
        want = run([t.double() for t in inputs], grad_out, True, backend="reference", **kwargs)
        vs_ref = {n: relative(x, y) for n, x, y in zip(names, got, want)}
        ref_triton = {n: relative(x, y) for n, x, y in zip(names, triton, want)}
        print("vs float64", " ".join(f"{k}={v:.1e}" for k, v in vs_ref.items()))
        print("Triton vs float64", " ".join(f"{k}={v:.1e}" for k, v in ref_triton.items()))
        for name in names:  # as accurate as the Triton kernels, within bf16 noise
            assert vs_ref[name] < max(2 * ref_triton[name], 1e-2), (name, vs_ref[name], ref_triton[name])
    return vs_triton


@pytest.mark.parametrize("B, T, H, gate, Hkv, D", [
    (2, 2048, 4, (2.0, 2.0), None, 128),
    (3, 384, 2, (0.0, 1.0), None, 128),  # T a multiple of 128, not of 256
    (1, 128, 4, (2.0, 2.0), None, 128),  # one block
    (1, 4096, 2, (-8.0, 1.0), None, 128),  # strong decay: P nearly one-hot
    (1, 4096, 2, (8.0, 1.0), None, 128),  # weak decay
    (2, 2048, 4, (2.0, 2.0), None, 64),
    (3, 384, 2, (0.0, 1.0), None, 64),
    (1, 4096, 2, (-8.0, 1.0), None, 64),
    (1, 4096, 2, (8.0, 1.0), None, 64),
    (2, 1024, 8, (2.0, 2.0), 2, 128),  # GQA 4:1
    (1, 2048, 8, (8.0, 1.0), 2, 64),
    (2, 640, 4, (0.0, 1.0), 1, 64),  # multi-query
])
def test_matches_triton_kernels_and_float64(B, T, H, gate, Hkv, D):
    inputs = make_inputs(B, T, H, gate, Hkv=Hkv, D=D)
    stages = inputs[0], inputs[1], *triton_gate_cumsum(inputs[3], False), None, None
    assert _runs_on_hopper(*stages, "dkdv") and _runs_on_hopper(*stages, "forward") == (D == 128)
    errors = compare(inputs)
    assert errors["out"] < 1e-2 and errors["dv"] < 1e-2


@pytest.mark.parametrize("Hkv, D", [(None, 128), (2, 64)])
def test_pruned_launches_match_pruned_triton_kernels(Hkv, D):
    # The ACP gate mix (70% of heads forget fast): both paths prune the same blocks, so they agree to bf16 noise.
    T, H = 4096, 8
    q, k, v, _ = make_inputs(1, T, H, Hkv=Hkv, D=D)
    slow = torch.arange(H, device="cuda") >= round(H * 0.7)
    log_f = F.logsigmoid(torch.randn(1, T, H, device="cuda") + 8.0 * slow)
    bound = torch.tensor(D**0.5, device="cuda")
    errors = compare((q, k, v, log_f), reference_too=False, prune_eps=math.exp(-10), score_bound=bound)
    assert max(errors.values()) < 2e-2, errors
    fractions = []
    for gluon in (True, False):
        dispatch.HOPPER_KERNELS = gluon
        with torch.no_grad(), acp_statistics() as stats:
            forgetting_attention(q, k, v, log_f, backend="triton", prune_eps=math.exp(-10), score_bound=bound)
        dispatch.HOPPER_KERNELS = True
        fractions.append(stats.pruned_fraction)
    if D == 128:  # the same 128 x 128 tiles: the same blocks pruned
        assert fractions[0] == fractions[1] > 0.5, fractions
    else:  # the Triton forward's 64-key blocks prune finer than the Hopper forward's 128 (which D64 does not use)
        assert 0.5 < fractions[0] <= fractions[1] < fractions[0] + 0.05, fractions


def test_strided_inputs_from_a_fused_projection():
    B, T, H, D = 2, 512, 4, 128
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    log_f = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 2.0)
    compare((q, k, v, log_f), reference_too=False)


def test_other_shapes_keep_the_triton_kernels():
    q, k, v, log_f = make_inputs(1, 200, 4)  # not a multiple of 128
    c, key_bias = triton_gate_cumsum(log_f, False)
    assert not _runs_on_hopper(q, k, c, key_bias, None, None, "dkdv")
    q, k, v, log_f = make_inputs(1, 256, 4, D=256)
    c, key_bias = triton_gate_cumsum(log_f, False)
    assert not _runs_on_hopper(q, k, c, key_bias, None, None, "dkdv")
    q, k, v, log_f = make_inputs(1, 256, 4)
    c, key_bias = triton_gate_cumsum(log_f, False)
    cu = torch.tensor([0, 128, 256], device="cuda", dtype=torch.int32)
    assert not _runs_on_hopper(q, k, c, key_bias, cu, None, "dkdv")  # packed
    assert _runs_on_hopper(q, k, c, key_bias, None, None, "dkdv") and _runs_on_hopper(q, k, c, key_bias, None, None,
                                                                                        "forward")
