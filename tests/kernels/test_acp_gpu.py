"""Adaptive Computation Pruning on a real GPU, at real sizes: the pruned kernels against the unpruned ones, and a
FoX (Pro) model's loss with ACP on and off. Run: `python -m pytest -m gpu tests -q` (marked `gpu`)."""

import math

import pytest
import torch
import torch.nn.functional as F

from foxlm import FoxConfig, FoxForCausalLM
from foxlm.kernels import forgetting_attention
from foxlm.kernels.acp import acp_statistics, measured_score_bound

pytestmark = pytest.mark.gpu
EPS = math.exp(-10)


def run(q, k, v, log_fgate, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, log_fgate)]
    out = forgetting_attention(*leaves, backend="triton", **kwargs)
    do = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=torch.Generator("cuda").manual_seed(1))
    (out * do).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def gate_mix(B, T, H):
    """70% of heads fast (logit ~ N(0, 1)), 30% slow (N(8, 1))."""
    return F.logsigmoid(torch.randn(B, T, H, device="cuda") + 8.0 * (torch.arange(H, device="cuda") >= 0.7 * H))


@pytest.mark.parametrize("varlen", [False, True])
def test_fast_gates_prune_most_work_and_stay_within_the_bound(varlen):
    torch.manual_seed(0)
    T, Hq, Hkv, D = 4096, 10, 2, 64
    q, k = (torch.randn(1, T, h, D, device="cuda", dtype=torch.bfloat16) * 0.5 for h in (Hq, Hkv))
    v = torch.randn(1, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    log_fgate = gate_mix(1, T, Hq)
    kwargs = {"cu_seqlens": torch.tensor([0, 1000, 3100, T], device="cuda", dtype=torch.int32)} if varlen else {}
    out, grads = run(q, k, v, log_fgate, **kwargs)
    with acp_statistics() as stats:
        out_p, grads_p = run(q, k, v, log_fgate, prune_eps=EPS, **kwargs)
    assert stats.pruned_fraction > 0.4
    # Kept tiles are computed as without pruning, so beyond ACP's bound only a bf16 rounding step can differ.
    rounding = 2**-8 * out.float().abs().max()
    assert (out_p.float() - out.float()).abs().max() <= 2 * EPS * v.float().abs().max() + rounding
    for g, g_p in zip(grads, grads_p):
        assert torch.isfinite(g_p).all()
        assert ((g_p.float() - g.float()).norm() / g.float().norm()).item() < 1e-3


@pytest.mark.parametrize("Hq, Hkv, D", [(32, 32, 64), (16, 4, 128)])
def test_measured_score_bound_at_real_sizes(Hq, Hkv, D):
    torch.manual_seed(0)
    B, T = 2, 16384
    q, k = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv))
    q[1, 12345, 3] *= 9  # one outlying token must set its head's bound
    norms = [torch.linalg.vector_norm(x.double(), dim=-1).amax(1) for x in (q, k)]
    expected = norms[0] * norms[1].repeat_interleave(Hq // Hkv, 1) * D**-0.5
    torch.testing.assert_close(measured_score_bound(q, k, D**-0.5).double(), expected, rtol=1e-6, atol=0)
    k[0, 77, 0, 5] = float("nan")
    bound = measured_score_bound(q, k, D**-0.5)
    assert bound[0, : Hq // Hkv].isinf().all() and bound[0, Hq // Hkv :].isfinite().all()


def test_open_gates_prune_nothing_and_are_bit_identical_in_bf16():
    torch.manual_seed(0)
    B, T, H, D = 2, 4096, 4, 128
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    log_fgate = torch.zeros(B, T, H, device="cuda")
    out, grads = run(q, k, v, log_fgate)
    with acp_statistics() as stats:
        out_p, grads_p = run(q, k, v, log_fgate, prune_eps=EPS)
    assert stats.pruned_fraction == 0.0
    assert torch.equal(out, out_p) and all(torch.equal(a, b) for a, b in zip(grads, grads_p))


def test_fox_pro_loss_with_and_without_acp_agrees():
    kwargs = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, pad_token_id=0)
    assert FoxConfig.fox_pro(**kwargs).acp_eps == EPS  # on by default with QK-norm
    torch.manual_seed(0)
    model = FoxForCausalLM(FoxConfig.fox_pro(**kwargs))
    with torch.no_grad():
        for layer in model.model.layers:  # two heads forget within tens of tokens, two barely
            layer.self_attn.fgate_proj.bias.copy_(torch.tensor([0.0, 0.5, 6.0, 8.0]))
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(3, 512, (2, 4096), device="cuda")
    with acp_statistics() as stats:
        pruned = model(ids, labels=ids, use_cache=False).loss
    model.config.acp_eps = None
    exact = model(ids, labels=ids, use_cache=False).loss
    assert stats.pruned_fraction > 0.2
    assert abs(pruned.item() - exact.item()) < 1e-3
