"""The fused elementwise ops of a FoX (Pro) attention layer: per-head RMSNorm (with the output gate) and token shift.

    layer_ops.py            `head_rms_norm`, `token_shift`: argument checks, dispatch, the torch custom ops
    layer_ops_reference.py  the pure-PyTorch references
    layer_ops_triton.py     the Triton kernels and their launches
"""

from .layer_ops import head_rms_norm, token_shift
from .layer_ops_reference import head_rms_norm_reference, token_shift_reference

__all__ = ["head_rms_norm", "token_shift", "head_rms_norm_reference", "token_shift_reference"]
