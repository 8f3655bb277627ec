"""Forgetting Attention for decoding: a few new tokens against a KV cache.

    decode.py            `forgetting_decode`: argument checks and dispatch
    decode_reference.py  the pure-PyTorch reference
    decode_triton.py     the split-K Triton kernel and its launch
"""

from .decode import MAX_DECODE_QUERIES, forgetting_decode
from .decode_reference import forgetting_decode_reference

__all__ = ["MAX_DECODE_QUERIES", "forgetting_decode", "forgetting_decode_reference"]
