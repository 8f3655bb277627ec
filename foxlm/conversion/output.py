"""Writing a converted model: an output folder that appears complete or not at all."""

import contextlib
import shutil
import tempfile
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message says why and what is supported. Nothing was written."""


def check_output_dir(output_dir, force):
    """Fail before any work when `output_dir` would be overwritten without `force`."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"{output_dir} exists and is not a folder.")
    if output_dir.exists() and any(output_dir.iterdir()) and not force:
        raise ConversionError(f"{output_dir} exists and is not empty; pass --force (force=True) to replace it.")


@contextlib.contextmanager
def atomic_output_dir(output_dir, force):
    """Yield a temporary folder next to `output_dir`; on success it replaces `output_dir`, on error it is removed.

    The temporary folder sits in the same parent so the final rename stays on one file system. An existing
    `output_dir` is only removed (with `force`) once the new one is complete.
    """
    output_dir = Path(output_dir).absolute()
    check_output_dir(output_dir, force)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.converting-", dir=output_dir.parent))
    try:
        yield staging
        if output_dir.exists():
            check_output_dir(output_dir, force)
            previous = output_dir.with_name(f"{staging.name}.previous")
            output_dir.rename(previous)
            staging.rename(output_dir)
            shutil.rmtree(previous)
        else:
            staging.rename(output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def torch_dtype(dtype, source_dtype):
    """`"bf16" | "fp16" | "fp32"`, or `"auto"` for the source checkpoint's own dtype (fp32 when unknown)."""
    if dtype == "auto":
        return source_dtype if isinstance(source_dtype, torch.dtype) else torch.float32
    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}.")
    return DTYPES[dtype]
