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


@pytest.fixture
def op_calls(monkeypatch):
    """(q's shape, cu_seqlens) of each call of the forward custom op."""
    calls = []
    op = torch.ops.foxlm.forgetting_attention
    monkeypatch.setattr(torch.ops.foxlm, "forgetting_attention", lambda *a: calls.append((a[0].shape, a[6])) or op(*a))
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("given", ["log_fgate", "fgate_cumsum"])
def test_packed_sequences_of_one_length_run_as_a_batch(op_calls, backend, given):
    # Three sequences of 24: the op sees a batch of 3 without boundaries, and outputs and all gradients are the
    # batch's (a cumsum given restarts at each sequence, as packing has it).
    q, k, v, log_fgate = make_inputs(3, 24, 24, 4, 2, 16)
    gate = fgate_cumsum_from_log_fgate(log_fgate) if given == "fgate_cumsum" else log_fgate
    grad_out = torch.randn(3, 24, 4, 16, device=DEVICE)
    cu_seqlens = torch.tensor([0, 24, 48, 72], device=DEVICE, dtype=torch.int32)

    def packed(q, k, v, gate):
        flat = (t.reshape(1, 72, *t.shape[2:]) for t in (q, k, v))
        out = forgetting_attention(*flat, cu_seqlens=cu_seqlens, backend=backend, **{given: gate.reshape(1, 72, 4)})
        return out.reshape(3, 24, 4, 16)

    got = outputs_and_grads(packed, (q, k, v, gate), grad_out)
    assert op_calls == [(torch.Size([3, 24, 4, 16]), None)]
    want = outputs_and_grads(lambda q, k, v, g: forgetting_attention(q, k, v, backend=backend, **{given: g}),
                             (q, k, v, gate), grad_out)
    for x, ref in zip(got, want):
        torch.testing.assert_close(x, ref, rtol=0, atol=0)


def test_packed_sequences_of_one_length_run_as_a_batch_under_torch_compile():
    # As in a compiled FoX layer (`foxlm.training.compile_layer_parts`): reading the boundaries breaks the graph, and
    # the op in the graph after the break still takes the batch.
    q, k, v, log_fgate = make_inputs(1, 48, 48, 2, 2, 16)
    cu_seqlens = torch.tensor([0, 24, 48], device=DEVICE, dtype=torch.int32)

    def layer(q, k, v, log_fgate):
        return forgetting_attention(q * 1.5, k, v, log_fgate, cu_seqlens=cu_seqlens, backend="reference")

    torch._dynamo.reset()
    graphs = torch._dynamo.explain(layer)(q, k, v, log_fgate).graphs
    [query] = [node.args[0] for graph in graphs for node in graph.graph.nodes
               if node.op == "call_function" and "foxlm.forgetting_attention" in str(node.target)]
    assert tuple(query.meta["example_value"].shape) == (2, 24, 2, 16)
    got = torch.compile(layer, backend="aot_eager")(q, k, v, log_fgate)
    torch.testing.assert_close(got, layer(q, k, v, log_fgate))


def test_packed_sequences_of_several_lengths_keep_their_boundaries(op_calls):
    q, k, v, log_fgate = make_inputs(1, 48, 48, 2, 2, 16)
    for bounds in ([0, 24, 48], [0, 20, 48], [0, 0, 48, 48]):  # one length; two; an empty sequence among them
        cu_seqlens = torch.tensor(bounds, device=DEVICE, dtype=torch.int32)
        forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, backend="reference")
    assert [shape[:2] for shape, _ in op_calls] == [(2, 24), (1, 48), (1, 48)]
    assert op_calls[0][1] is None and op_calls[1][1] is not None and op_calls[2][1] is not None


def test_forward_and_backward_each_scan_the_gates_once(monkeypatch):
    # c and the key biases come from one launch in the forward and are kept; the backward's one launch is d log f.
    calls = []
    for name in ("triton_gate_cumsum", "triton_gate_gradient"):
        original = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name, lambda *a, f=original, n=name: calls.append(n) or f(*a))
    inputs = make_inputs(1, 40, 40, 2, 1, 16)
    grad_out = torch.randn(1, 40, 2, 16, device=DEVICE)
    outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
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
                 (q, k, v, log_fgate.cumsum(1), True, 0.25, None, None, torch.tensor([3], device=DEVICE), False)]:
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


@pytest.mark.parametrize("where, value", [
    ("q", float("nan")), ("k", float("nan")), ("log_fgate", float("nan")), ("q", float("inf")), ("k", float("inf")),
    ("log_fgate", float("-inf")),
])
def test_nan_and_inf_propagate_on_the_reference_as_in_the_triton_kernel(where, value):
    # The reference's nan_to_num, meant for rows that see no key, used to turn these into zeros with finite
    # gradients: a diverging run looked healthy on the CPU.
    torch.manual_seed(0)
    q, k, v, log_fgate = make_inputs(2, 40, 40, 2, 1, 16)
    inputs = dict(q=q, k=k, v=v, log_fgate=log_fgate)
    inputs[where][(1, 20, 0, 3) if where != "log_fgate" else (1, 20, 0)] = value
    seq_start = torch.tensor([0, 7], device=DEVICE)
    grad_out = torch.randn(2, 40, 2, 16, device=DEVICE)
    results = {backend: outputs_and_grads(lambda *a, b=backend: forgetting_attention(
        *a, backend=b, seq_start=seq_start), list(inputs.values()), grad_out) for backend in BACKENDS}
    triton, reference = results["triton"], results["reference"]
    assert reference[0].isnan().any() and torch.equal(reference[0].isnan(), triton[0].isnan())
    torch.testing.assert_close(reference[0].nan_to_num(), triton[0].nan_to_num(), atol=1e-4, rtol=1e-4)
    assert torch.all(reference[0][1, :7] == 0) and torch.all(reference[0][0].isfinite())  # zero rows stay zero
    for name, got, want in zip(inputs, reference[1:], triton[1:]):  # the step's gradients show it on both
        assert got.isnan().any() == want.isnan().any(), name


def test_v_must_have_the_head_dim_of_q_and_k_and_sm_scale_be_finite():
    # The Triton path read v out of bounds with a narrower v; a NaN sm_scale was zeroed on the reference path.
    q, k, v, log_fgate = make_inputs(1, 8, 8, 2, 1, 16)
    with pytest.raises(ValueError, match="`v` .* must have the head_dim of `q` and `k` \\(16\\)"):
        forgetting_attention(q, k, v[..., :8], log_fgate, backend="reference")
    for sm_scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="`sm_scale` must be a finite number"):
            forgetting_attention(q, k, v, log_fgate, sm_scale=sm_scale)
