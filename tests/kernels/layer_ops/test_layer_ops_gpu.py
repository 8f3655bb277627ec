"""The fused layer ops compiled for a real GPU (not the interpreter): outputs and every gradient against the
reference in float64, at sizes that span many programs, with fp32 scales on bf16 activations as under autocast.

Run on a CUDA machine: `python -m pytest -m gpu tests -q` (marked `gpu`: skipped without CUDA).
"""

import pytest
import torch

from foxlm.kernels.layer_ops import head_rms_norm, head_rms_norm_reference, token_shift, token_shift_reference

pytestmark = pytest.mark.gpu


def outputs_and_grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def check(fn, reference, inputs, tol):
    grad_out = torch.randn(inputs[0].shape, device="cuda", dtype=torch.float64)
    got = outputs_and_grads(fn, inputs, grad_out)
    want = outputs_and_grads(reference, [t.double() for t in inputs], grad_out)
    for x, ref, dtype in zip(got, want, [inputs[0].dtype] + [t.dtype for t in inputs], strict=True):
        assert x.dtype == dtype and torch.isfinite(x).all()
        err = ((x.double() - ref).norm() / ref.norm()).item()
        assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("head_dim", [48, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_fused_ops_match_float64(head_dim, dtype, tol):
    B, T, H = 2, 1000, 5
    x = torch.randn(B, T, H, head_dim, device="cuda", dtype=dtype)
    weight = 1 + 0.1 * torch.randn(H * head_dim, device="cuda")
    gate_logits = torch.randn(B, T, H * head_dim, device="cuda", dtype=dtype)
    check(lambda x, w: head_rms_norm(x, w, 1e-5, backend="triton"),
          lambda x, w: head_rms_norm_reference(x, w, 1e-5), [x, weight], tol)
    check(lambda x, w, g: head_rms_norm(x, w, 1e-6, g, backend="triton"),
          lambda x, w, g: head_rms_norm_reference(x, w, 1e-6, g), [x, weight, gate_logits], tol)
    doc_start = torch.rand(B, T, device="cuda") < 0.01
    logits = torch.randn(B, T, H, device="cuda", dtype=dtype)
    previous = torch.randn(B, 1, H, head_dim, device="cuda", dtype=dtype)
    for starts in (None, doc_start):
        check(lambda r, a, p: token_shift(r, a, p, starts, backend="triton"),
              lambda r, a, p: token_shift_reference(r, a, p, starts), [x, logits, previous], tol)


def test_inductor_compiles_the_auto_dispatched_op_in_one_graph():
    x = torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(256, device="cuda", requires_grad=True)
    compiled = torch.compile(lambda x, w: head_rms_norm(x, w, 1e-5).float().square().sum(), fullgraph=True)
    compiled(x, weight).backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None
    head_rms_norm(x, weight, 1e-5, backend="triton").float().square().sum().backward()
    torch.testing.assert_close(grads, (x.grad, weight.grad))
