"""Constants and helpers shared by the kernel modules: host helpers, and (with Triton) the kernels' view of where a
sequence lies in a packed or padded batch. Environment flags are read in `dispatch.py`, not here."""

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch builds, remote code on such machines)
    triton = None

LOG2E = 1.4426950408889634  # scores live in the exp2 domain: exp(x) = exp2(x * LOG2E)
# The Hopper (Gluon) kernels' shapes (`attention/attention_hopper.py`): head dims 64 and 128, and 128 positions per
# tile (query rows per forward program, keys per dK/dV program, and the key-bias segment they read). The forward runs
# at head dim 128 only: at 64 the Triton forward was faster (benchmarks/NOTES_attention.md, 2026-11-28).
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_FORWARD_HEAD_DIMS = (128,)
HOPPER_TILE = 128


def on_device_of(x):
    """Makes x's GPU the current device for a kernel launch: Triton launches on the current device, which is not
    x's when a model is spread over several GPUs (`device_map="auto"`)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def masked_softmax(scores, visible):
    """softmax(scores) over the last dim, over the `visible` entries only. A row that sees no entry (left padding)
    is zero by construction, as in the Triton kernels; NaN and inf in visible scores stay NaN, never zeroed: a
    diverging model shows on every backend. The empty rows are computed on zeros, so that their gradient is zero, not
    NaN."""
    sees_some = visible.any(-1, keepdim=True)
    scores = scores.masked_fill(~visible, float("-inf")).masked_fill(~sees_some, 0.0)
    return torch.softmax(scores, dim=-1).masked_fill(~sees_some, 0.0)


def last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache
def compute_capability(device_index):
    return torch.cuda.get_device_capability(device_index)  # a query per call costs host time on every launch


if triton is not None:

    @triton.jit
    def sequence_bounds(CU_SEQLENS, SEQ_START, b, Tq, Tk, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr):
        """(batch index, first token, query length, key length, first valid key) of sequence b: packed along the
        batch's one row by CU_SEQLENS (IS_VARLEN), else batch row b, left-padded up to SEQ_START[b]."""
        if IS_VARLEN:
            bos = tl.load(CU_SEQLENS + b).to(tl.int64)
            seq_q = (tl.load(CU_SEQLENS + b + 1) - bos).to(tl.int32)
            seq_k = seq_q
            batch = b * 0
        else:
            bos = b.to(tl.int64) * 0
            seq_q = Tq
            seq_k = Tk
            batch = b
        if HAS_SEQ_START:
            kv_start = tl.load(SEQ_START + b).to(tl.int32)
        else:
            kv_start = b * 0
        return batch.to(tl.int64), bos, seq_q, seq_k, kv_start
