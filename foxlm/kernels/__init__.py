"""Forgetting Attention kernels and the fused elementwise ops around them. Nothing here knows about transformers.

One folder per operation, each with its entry point (`<op>/<op>.py`: argument checks, dispatch, the torch custom
op), its pure-PyTorch reference (`<op>_reference.py`) and its fast versions (`<op>_triton.py`, ...):

    attention/   forgetting_attention (training and prefill): Triton kernels, their launches, gate scans, launch
                 configurations, and Hopper (Gluon) kernels for the forward and dK/dV pass
    decode/      forgetting_decode: a few new tokens against a KV cache (split-K Triton kernel)
    layer_ops/   head_rms_norm, token_shift: the elementwise work of a FoX (Pro) layer

Beside them: `dispatch.py` (which implementation runs a call; every environment flag), `acp.py` (Adaptive
Computation Pruning: its threshold, score bound, statistics and row order) and `common.py` (constants, helpers).
"""

from .attention.attention import forgetting_attention
from .attention.attention_reference import fgate_cumsum_from_log_fgate, forgetting_attention_reference
from .decode.decode import forgetting_decode
from .layer_ops.layer_ops import head_rms_norm, token_shift

__all__ = ["forgetting_attention", "forgetting_decode", "forgetting_attention_reference", "fgate_cumsum_from_log_fgate",
           "head_rms_norm", "token_shift"]
