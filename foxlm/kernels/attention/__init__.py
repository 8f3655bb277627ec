"""Forgetting Attention for training and prefill.

    attention.py            `forgetting_attention`: argument checks, dispatch, the torch custom ops (forward, backward)
    attention_reference.py  the pure-PyTorch reference, forward and backward
    attention_launch.py     the Triton path's host side: launches of the forward and backward kernels
    attention_triton.py     the Triton kernels (forward, dQ, dK/dV)
    attention_gate_scan.py  Triton scans of the gates: c and the key biases, d log f
    attention_tuning.py     launch configurations, autotuning, head grouping
    attention_hopper.py     Hopper (sm_90) Gluon kernels for the forward and the dK/dV pass
"""

from .attention import forgetting_attention
from .attention_reference import fgate_cumsum_from_log_fgate, forgetting_attention_reference

__all__ = ["forgetting_attention", "forgetting_attention_reference", "fgate_cumsum_from_log_fgate"]
