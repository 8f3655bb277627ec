"""What the converters share: their error, and the output options checked before any work (where and how the
converted folder is written is foxlm.outputs' policy)."""

import re

import torch

from ..errors import FoxlmError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The sizes `save_pretrained` takes as strings (huggingface_hub parses them): a number and a decimal unit.
_SHARD_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(KB|MB|GB|TB)\s*$", flags=re.IGNORECASE)
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


class ConversionError(FoxlmError):
    """A checkpoint cannot be converted; the message says why and what is supported. Nothing was written."""


def torch_dtype(dtype, source_dtype):
    """`"bf16" | "fp16" | "fp32"`, or `"auto"` for the source checkpoint's own dtype (fp32 when unknown)."""
    if dtype == "auto":
        return source_dtype if isinstance(source_dtype, torch.dtype) else torch.float32
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}.")
    return DTYPES[dtype]


def check_shard_size(max_shard_size):
    """`max_shard_size` as `save_pretrained` takes it, checked before any work: a positive number of bytes, or a
    string such as "5GB" (units KB, MB, GB, TB)."""
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        size = max_shard_size
    else:
        match = _SHARD_SIZE.match(max_shard_size) if isinstance(max_shard_size, str) else None
        size = float(match[1]) * _UNITS[match[2].upper()] if match else 0
    if size < 1:
        raise ConversionError(f"max shard size must be a positive size such as 5GB, 500MB or 100KB (units KB, MB, "
                              f"GB, TB) or a number of bytes, got {max_shard_size!r}.")
    return max_shard_size
