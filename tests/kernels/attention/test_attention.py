"""`forgetting_attention` and its torch custom ops (`foxlm/kernels/attention/attention.py`): what reaches the
launches, the custom op registrations, torch.compile, and what the Triton backend refuses. Helpers and the float64
formula are those of test_attention_triton.py."""

import pytest
import torch

from foxlm.kernels import forgetting_attention
from foxlm.kernels.attention import attention as attention_module
from foxlm.kernels.attention.attention_reference import fgate_cumsum_from_log_fgate
from tests.kernels.attention.test_attention_triton import BACKENDS, DEVICE, make_inputs, outputs_and_grads


def test_packed_launch_without_max_seqlen_takes_the_longest_sequence_from_the_checked_boundaries(monkeypatch):
    launches = []
    forward = attention_module.triton_attention_forward
    monkeypatch.setattr(attention_module, "triton_attention_forward",
                        lambda *args, **kwargs: launches.append(args[7]) or forward(*args, **kwargs))
    cu_seqlens = torch.tensor([0, 1, 18, 19, 20, 51, 70], device=DEVICE, dtype=torch.int32)
    q, k, v, log_fgate = make_inputs(1, 70, 70, 4, 2, 16)
    forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, backend="triton")
    assert launches == [31]


def test_forward_and_backward_each_scan_the_gates_once(monkeypatch):
    # c and the key biases come from one launch in the forward and are kept; the backward's one launch is d log f.
    calls = []
    for name in ("triton_gate_cumsum", "triton_gate_gradient"):
        original = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name, lambda *a, f=original, n=name: calls.append(n) or f(*a))
    inputs = make_inputs(1, 40, 40, 2, 1, 16)
    outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, torch.randn(1, 40, 2, 16))
    assert calls == ["triton_gate_cumsum", "triton_gate_gradient"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float64_cumsum_in_the_kernels_layout_is_accepted(backend):
    # fgate_cumsum_from_log_fgate returns a (B, T, H) view of a (B, H, T) float64 tensor: the op must not hand that
    # memory back as its own output.
    q, k, v, log_fgate = make_inputs(1, 30, 30, 2, 1, 16)
    c = fgate_cumsum_from_log_fgate(log_fgate)
    got = outputs_and_grads(lambda q, k, v, c: forgetting_attention(q, k, v, fgate_cumsum=c, backend=backend),
                            (q, k, v, c), torch.randn(1, 30, 2, 16, device=DEVICE))
    want = forgetting_attention(q, k, v, log_fgate, backend=backend)
    torch.testing.assert_close(got[0], want)
    assert torch.isfinite(got[4]).all()


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
