"""Forgetting Attention kernels. Nothing here knows about transformers."""

from .decode import forgetting_decode
from .interface import forgetting_attention
from .reference import fgate_cumsum_from_log_fgate, forgetting_attention_reference

__all__ = ["forgetting_attention", "forgetting_decode", "forgetting_attention_reference", "fgate_cumsum_from_log_fgate"]
