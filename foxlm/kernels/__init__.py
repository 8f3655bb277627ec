"""Forgetting Attention kernels and the fused elementwise ops around them. Nothing here knows about transformers."""

from .decode import forgetting_decode
from .interface import forgetting_attention
from .layer_ops import head_rms_norm, token_shift
from .reference import fgate_cumsum_from_log_fgate, forgetting_attention_reference

__all__ = ["forgetting_attention", "forgetting_decode", "forgetting_attention_reference", "fgate_cumsum_from_log_fgate",
           "head_rms_norm", "token_shift"]
