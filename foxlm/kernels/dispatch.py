"""Which implementation runs a kernel call: the one place that chooses, and that reads every environment flag.

- Reference (pure PyTorch) or Triton, for every op: `runs_on_triton` ("auto" takes Triton for CUDA tensors it can run,
  the reference elsewhere; `backend="triton"` or `"reference"` forces one), `norms_on_triton` for ACP's U.
- Triton or Hopper (Gluon) kernels for attention's forward and for its dK/dV pass: `runs_on_hopper`.
- Pointer or TMA loads inside the Triton attention kernels: `use_tma`, `use_dq_bias_tma`.
- Every autotune candidate or only the first: `autotune_candidates`.

Environment flags, read once at import:
    TRITON_INTERPRET=1  Triton runs the kernels in its interpreter, on the CPU (`INTERPRET`; the tests use it).
    FOXLM_AUTOTUNE=0    each kernel takes the first (expected best) launch configuration of its list instead of
                        timing them all (`AUTOTUNE`).
    FOXLM_GLUON=0       every attention call stays on the Triton kernels (`HOPPER_KERNELS`).
The choices read `AUTOTUNE`, `HOPPER_KERNELS` and `TMA_LOADS` when called, so tests can switch them.

Nothing here imports a kernel module: they all import this one.
"""

import os

import torch

from .common import HOPPER_FORWARD_HEAD_DIMS, HOPPER_HEAD_DIMS, HOPPER_TILE, compute_capability

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch builds, remote code on such machines)
    triton = tl = None
try:  # the scratch allocator of in-kernel TMA descriptors (older Triton has neither)
    from triton.runtime import _allocation
except ImportError:
    _allocation = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
AUTOTUNE = os.environ.get("FOXLM_AUTOTUNE", "1") != "0"
HOPPER_KERNELS = os.environ.get("FOXLM_GLUON", "1") != "0"
# The forward and dQ main loops load K/V tiles through TMA descriptors where `use_tma` allows: fewer instructions and
# registers than pointer tiles, and faster on an H100; the dK/dV loop keeps pointer tiles for Q/dO, where descriptors
# were slower (benchmarks/NOTES_attention.md, "Figures from the kernel sources"). Tests switch TMA off to check the
# pointer path, which older GPUs and unaligned inputs take.
TMA_LOADS = True

BACKENDS = ("auto", "triton", "reference")
MAX_TRITON_HEAD_DIM = 256


def runs_on_triton(backend, x, has_triton, what="the Triton kernel", max_head_dim=MAX_TRITON_HEAD_DIM):
    """Whether `backend` ("auto", "triton", "reference") runs `x` (..., head_dim) on Triton: "auto" does for CUDA
    tensors of fp16/bf16/fp32 with head_dim <= `max_head_dim` (None: any) when the op's Triton module imports
    (`has_triton`). A forced "triton" that cannot run raises; float64 has no tensor-core path and larger head dims
    no kernel configuration."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")
    fits = x.dtype in (torch.float16, torch.bfloat16, torch.float32) and (
        max_head_dim is None or x.shape[-1] <= max_head_dim)
    if backend == "triton":
        if not has_triton:
            raise RuntimeError("backend='triton' was requested but Triton is not installed.")
        if not fits:
            limit = "" if max_head_dim is None else f" and head_dim <= {max_head_dim}"
            raise ValueError(f"{what} takes float16/bfloat16/float32{limit}, got {x.dtype} and head_dim "
                             f"{x.shape[-1]}; use backend='reference'.")
        return True
    return backend == "auto" and x.is_cuda and has_triton and fits


def norms_on_triton(x, has_triton):
    """Whether ACP's largest-norm reduction over `x` runs as a Triton kernel (`has_triton`: it imports): on CUDA
    tensors and in the interpreter; torch ops on other CPU tensors."""
    return has_triton and (x.is_cuda or INTERPRET)


def hopper_shape(q, k, cu_seqlens, seq_start):
    """Whether the Hopper kernels take these shapes: bf16, head dim 64 or 128, query heads a multiple of the K/V
    heads (GQA), equal-length unpadded sequences whose length is a multiple of 128 (queries and keys alike)."""
    B, Tq, Hq, D = q.shape
    return (q.dtype == torch.bfloat16 and D in HOPPER_HEAD_DIMS and Hq % k.shape[2] == 0 and k.shape[1] == Tq
            and Tq % HOPPER_TILE == 0 and Tq > 0 and cu_seqlens is None and seq_start is None)


def runs_on_hopper(q, k, c, key_bias, cu_seqlens, seq_start, stage):
    """Whether a Hopper (Gluon) kernel runs `stage` ("forward" or "dkdv") of this Triton call instead of the Triton
    kernel (the dQ pass is always Triton's): on an sm_90 GPU (H100/H200), for `hopper_shape` (the forward at
    HOPPER_FORWARD_HEAD_DIMS only), with c and the key biases of `triton_gate_cumsum` contiguous, unless
    FOXLM_GLUON=0. A Triton without Gluon keeps the Triton kernels (`attention_launch.py`)."""
    if stage not in ("forward", "dkdv"):
        raise ValueError(f"stage must be 'forward' or 'dkdv', got {stage!r}")
    return (HOPPER_KERNELS and not INTERPRET and q.is_cuda and c.is_contiguous() and key_bias.is_contiguous()
            and compute_capability(q.device.index) == (9, 0) and hopper_shape(q, k, cu_seqlens, seq_start)
            and (stage == "dkdv" or q.shape[-1] in HOPPER_FORWARD_HEAD_DIMS))


def use_tma(*tensors):
    """Whether the Triton attention kernels' main loops load their tiles through TMA descriptors (`_row_tiles`): on
    Hopper and newer NVIDIA GPUs (and in the interpreter) with a Triton that makes them in kernels
    (`tl.make_tensor_descriptor`), when every row of these (batch, seqlen, heads, head_dim) tensors starts at a
    multiple of 16 bytes, as TMA requires. The descriptors live in a per-launch scratch buffer, which Triton takes
    from the allocator of `triton.set_allocator`: a torch one is set here unless the user set their own."""
    if not TMA_LOADS or _allocation is None or not hasattr(tl, "make_tensor_descriptor") or torch.version.hip:
        return False
    if not INTERPRET and compute_capability(tensors[0].device.index)[0] < 9:
        return False
    if not all(t.data_ptr() % 16 == 0 and all(n * t.element_size() % 16 == 0 for n in (*t.stride()[:-1], t.shape[-1]))
               for t in tensors):
        return False
    current = _allocation._allocator
    if hasattr(current, "get"):  # a ContextVar from Triton 3.5 on (per thread: autograd's threads start unset)
        current = current.get()
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_scratch)
    return True


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")  # the launch's current device


def use_dq_bias_tma(pruned, block_d, packed):
    """Whether the dQ loop loads its key biases through a TMA descriptor (`_bias_source`) rather than pointers, where
    `use_tma` allows it for them: only for the pruned kernel at head dim 64, whose main loop spilled the 64-bit
    addresses of the pointer loads (`benchmarks/kernel_resources.py --prune` counts its local-memory accesses); that
    pass then ran faster on an H100, and elsewhere TMA bias loads did not pay (benchmarks/NOTES_attention.md,
    "Figures from the kernel sources"). Never for packed sequences: a descriptor's tile must start 16-byte aligned,
    and their sequences start anywhere."""
    return pruned and block_d <= 64 and not packed


def autotune_candidates(configs):
    """The launch configurations the autotuner times: all of them, or with FOXLM_AUTOTUNE=0 the first alone (each
    list puts the fastest measured first)."""
    return configs if AUTOTUNE else configs[:1]
