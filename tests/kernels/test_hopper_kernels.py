"""Which calls the Hopper Gluon kernels serve. The kernels themselves need an sm_90 GPU: they are checked against the
Triton kernels and the float64 reference in tests/gpu/test_gluon_attention_gpu.py."""

import importlib

import pytest
import torch

gluon_attention = pytest.importorskip("foxlm.kernels.gluon_attention")  # a Triton without Gluon: Triton serves all
from foxlm.kernels import triton_attention as ta  # noqa: E402


def qk(T=256, H=4, Hkv=None, D=128, dtype=torch.bfloat16, Tk=None):
    return torch.empty(2, T, H, D, dtype=dtype), torch.empty(2, Tk or T, Hkv or H, D, dtype=dtype)


def test_scope_is_bf16_head_dim_128_no_gqa_equal_unpadded_lengths_in_128_blocks():
    assert gluon_attention._eligible_shape(*qk(), None, None)
    assert gluon_attention._eligible_shape(*qk(T=384), None, None)
    assert not gluon_attention._eligible_shape(*qk(Hkv=2), None, None)  # GQA
    assert not gluon_attention._eligible_shape(*qk(T=200), None, None)
    assert not gluon_attention._eligible_shape(*qk(D=64), None, None)
    assert not gluon_attention._eligible_shape(*qk(dtype=torch.float16), None, None)
    assert not gluon_attention._eligible_shape(*qk(Tk=512), None, None)  # queries against a longer cache
    assert not gluon_attention._eligible_shape(*qk(), torch.tensor([0, 128, 256]), None)  # packed
    assert not gluon_attention._eligible_shape(*qk(), None, torch.zeros(2, dtype=torch.int32))  # left padding


def test_cpu_tensors_never_reach_them():
    q, k = qk()
    c, key_bias = torch.zeros(2, 4, 256, dtype=torch.float64), torch.zeros(2, 4, 256)
    assert ta._hopper_kernels(q, k, c, key_bias, None, None) is None
    assert not gluon_attention.eligible(q, k, None, None)


def test_foxlm_gluon_0_switches_them_off(monkeypatch):
    monkeypatch.setenv("FOXLM_GLUON", "0")
    assert not importlib.reload(gluon_attention).ENABLED
    monkeypatch.delenv("FOXLM_GLUON")
    assert importlib.reload(gluon_attention).ENABLED
