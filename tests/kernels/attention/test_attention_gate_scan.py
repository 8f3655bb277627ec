"""The Triton gate scans (`foxlm/kernels/attention/attention_gate_scan.py`): c, the key biases and d log f against
torch ops in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from foxlm.kernels.attention.attention import _gate_gradient
from foxlm.kernels.attention.attention_reference import fgate_cumsum_float64

pytest.importorskip("triton")
from foxlm.kernels.attention.attention_gate_scan import SEGMENT, triton_gate_cumsum  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("layout", ["dense", "left padding", "packed", "cumsum given", "packed cumsum given",
                                    "left padding cumsum given"])
def test_gate_scans_match_torch_across_chunks_sequences_and_segments(layout):
    # c, the key biases and d log f from the scan launches against torch ops in float64 (the interpreter's scan
    # chunks are 32 positions long, so T = 100 crosses chunks, segments and, packed, sequences inside a chunk).
    packed, given = "packed" in layout, "given" in layout
    B, T, H = (1 if packed else 3), 100, 3
    bounds = [0, 5, 5, 33, 34, 70, 100] if packed else [0, T]
    cu_seqlens = torch.tensor(bounds, device=DEVICE, dtype=torch.int32) if packed else None
    seq_start = torch.tensor([0, 13, 40], device=DEVICE) if "left padding" in layout else None
    log_fgate = F.logsigmoid(torch.randn(B, T, H, device=DEVICE) * 3)
    c_want = fgate_cumsum_float64(log_fgate, False, cu_seqlens, seq_start)
    if given and seq_start is not None:  # a cache's c, rebased at its newest token: not 0 in the padding
        c_want = c_want - c_want[..., -1:]
    gate = c_want.transpose(1, 2).float() if given else log_fgate
    if given:
        c_want = gate.transpose(1, 2).double()  # taken as given, after its rounding to fp32
    c, key_bias = triton_gate_cumsum(gate, given, cu_seqlens, seq_start)
    assert c.dtype == torch.float64 and key_bias.dtype == torch.float32 and c.stride(-1) == key_bias.stride(-1) == 1
    torch.testing.assert_close(c, c_want, rtol=1e-13, atol=1e-13)
    segment_start = torch.cat([torch.arange(s, e) - (torch.arange(s, e) - s) % SEGMENT
                               for s, e in zip(bounds[:-1], bounds[1:])]).to(DEVICE)
    key_want = ((c_want - c_want[..., segment_start]) * math.log2(math.e)).float()
    torch.testing.assert_close(key_bias, key_want, rtol=2e-7, atol=1e-6)
    dc = torch.randn(B, H, T, device=DEVICE)
    for dtype in (torch.float32, torch.float64):
        got = _gate_gradient(dc, gate.to(dtype), given, cu_seqlens, seq_start, True)
        want = _gate_gradient(dc, gate.to(dtype), given, cu_seqlens, seq_start, False)
        assert got.dtype == dtype and got.shape == (B, T, H)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
