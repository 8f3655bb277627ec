"""Which implementation runs a call (`foxlm/kernels/dispatch.py`): the scope of the Hopper Gluon kernels and of TMA
loads. The Hopper kernels themselves need an sm_90 GPU: they are checked against the Triton kernels and the float64
reference in tests/kernels/attention/test_attention_hopper_gpu.py."""

import importlib

import pytest
import torch

from foxlm.kernels import dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qk(T=256, H=4, Hkv=None, D=128, dtype=torch.bfloat16, Tk=None):
    return torch.empty(2, T, H, D, dtype=dtype), torch.empty(2, Tk or T, Hkv or H, D, dtype=dtype)


def test_scope_is_bf16_head_dims_64_and_128_with_or_without_gqa_equal_unpadded_lengths_in_128_blocks():
    assert dispatch.hopper_shape(*qk(), None, None)
    assert dispatch.hopper_shape(*qk(T=384), None, None)
    assert dispatch.hopper_shape(*qk(Hkv=2), None, None)  # GQA
    assert dispatch.hopper_shape(*qk(Hkv=1, D=64), None, None)  # multi-query
    assert not dispatch.hopper_shape(*qk(H=4, Hkv=3), None, None)
    assert not dispatch.hopper_shape(*qk(T=200), None, None)
    assert dispatch.hopper_shape(*qk(D=64), None, None)
    assert not dispatch.hopper_shape(*qk(D=32), None, None)
    assert not dispatch.hopper_shape(*qk(D=256), None, None)
    assert not dispatch.hopper_shape(*qk(dtype=torch.float16), None, None)
    assert not dispatch.hopper_shape(*qk(Tk=512), None, None)  # queries against a longer cache
    assert not dispatch.hopper_shape(*qk(), torch.tensor([0, 128, 256]), None)  # packed
    assert not dispatch.hopper_shape(*qk(), None, torch.zeros(2, dtype=torch.int32))  # left padding


def test_cpu_tensors_never_reach_them():
    attention_launch = pytest.importorskip("foxlm.kernels.attention.attention_launch")
    q, k = qk()
    c, key_bias = torch.zeros(2, 4, 256, dtype=torch.float64), torch.zeros(2, 4, 256)
    for stage in ("forward", "dkdv"):
        assert not attention_launch._runs_on_hopper(q, k, c, key_bias, None, None, stage)
        assert not dispatch.runs_on_hopper(q, k, c, key_bias, None, None, stage)
    with pytest.raises(ValueError, match="stage must be 'forward' or 'dkdv'"):
        dispatch.runs_on_hopper(q, k, c, key_bias, None, None, "dq")


def test_foxlm_gluon_0_switches_them_off(monkeypatch):
    monkeypatch.setenv("FOXLM_GLUON", "0")
    assert not importlib.reload(dispatch).HOPPER_KERNELS
    monkeypatch.delenv("FOXLM_GLUON")
    assert importlib.reload(dispatch).HOPPER_KERNELS


def test_tma_loads_only_for_16_byte_aligned_rows_and_a_triton_that_makes_descriptors(monkeypatch):
    pytest.importorskip("triton")
    buffer = torch.randn(300, device=DEVICE, dtype=torch.float16)
    q = buffer[:256].view(1, 8, 2, 16)
    assert dispatch.use_tma(q) == (dispatch.INTERPRET or torch.cuda.get_device_capability(q.device)[0] >= 9)
    assert not dispatch.use_tma(buffer[4:260].view(1, 8, 2, 16))  # starts 8 bytes past an aligned address
    assert not dispatch.use_tma(torch.randn(1, 8, 2, 20, device=DEVICE, dtype=torch.float16))  # 40-byte rows
    assert not dispatch.use_tma(q[..., :12])  # 24-byte rows
    strided = torch.randn(1, 8, 2, 20, device=DEVICE, dtype=torch.float16)[..., :16]
    assert not dispatch.use_tma(strided)  # 40-byte strides
    monkeypatch.setattr(dispatch, "_allocation", None)  # a Triton without in-kernel descriptors takes pointer tiles
    assert not dispatch.use_tma(q)
