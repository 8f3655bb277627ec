"""Registers, spills and shared memory of the attention kernels, compiled for a GPU architecture on any machine.

No GPU needed: each kernel (forward, dQ, dK/dV; unpruned and pruned) is compiled by Triton for the target (default
sm_90, H100/H200) at every launch configuration in its autotune list, and the cubin's resource usage is read with
the cuobjdump that ships with Triton. Arguments are specialized as Triton's JIT specializes those of
`bench_attention.py`'s launches (aligned pointers, strides divisible by 16, a GQA group of 1), so the code is the
code that runs. Spill bytes are the per-thread local memory (spilled registers). The main loop is the kernel's
unmasked inner loop, where nearly all iterations run: its SASS instructions per iteration, and how many of them are
local-memory loads and stores (spill traffic where it costs). "wgmma serialized" gives ptxas's warning codes when it
found a reason to wait for every tensor-core instruction before the next (C7515, C7512), which costs the overlap of
the softmax with the matrix products. Candidates for the autotune lists can be screened here before spending device
time.

    python benchmarks/kernel_resources.py [--arch 90] [--head-dim 64 128] [--kernels fwd dq dkdv] [--prune]
        [--first-only] [--layout dense|packed|padded]
"""

import argparse
import os
import re
import subprocess
import tempfile

# The choices of --head-dim and --kernels, written here for --help, which answers without importing triton: the head
# dims of attention_tuning's launch-configuration lists and the keys of KERNELS (both checked below).
HEAD_DIMS = (64, 128, 256)
KERNEL_NAMES = ("fwd", "dq", "dkdv")
HOPPER_KERNEL_NAMES = ("hopper-fwd", "hopper-dkdv")  # attention_hopper.py's Gluon kernels: sm_90, one configuration


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: H100/H200)")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], choices=HEAD_DIMS)
    parser.add_argument("--kernels", nargs="+", default=list(KERNEL_NAMES), choices=KERNEL_NAMES + HOPPER_KERNEL_NAMES,
                        help="the Triton kernels (default), or the Hopper Gluon ones (head dims 64 and 128 only)")
    parser.add_argument("--group", type=int, default=1, help="query heads per K/V head (GQA)")
    parser.add_argument("--prune", action="store_true", help="also the pruned (ACP) variant of every kernel")
    parser.add_argument("--first-only", action="store_true", help="only the first (default) configuration per list")
    parser.add_argument("--layout", choices=["dense", "packed", "padded"], default="dense",
                        help="the kernel variant: equal-length sequences, packed ones (cu_seqlens) or left-padded ones")
    parser.add_argument("--loads", choices=["tma", "pointers"], default="tma",
                        help="how the forward and dQ loops load K/V tiles: TMA descriptors (Hopper and newer) or "
                             "pointers")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help and wrong options answer before triton loads; main() parses the options again
    parse_args()

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("kernel_resources.py compiles real kernels: unset TRITON_INTERPRET.")

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402  (what the JIT specializes arguments with)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend, get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from foxlm.kernels import dispatch  # noqa: E402
from foxlm.kernels.attention import attention_gate_scan, attention_hopper, attention_triton, attention_tuning  # noqa

KERNELS = {  # name: (jit function, autotune table); `.fn` is the kernel inside its autotuner
    "fwd": (attention_triton.fwd.fn, attention_tuning.FWD_CONFIGS),
    "dq": (attention_triton.bwd_q.fn, attention_tuning.BWD_Q_CONFIGS),
    "dkdv": (attention_triton.bwd_kv.fn, attention_tuning.BWD_KV_CONFIGS),
}
assert tuple(KERNELS) == KERNEL_NAMES and tuple(sorted(attention_tuning.FWD_CONFIGS)) == HEAD_DIMS, "update the choices"
HOPPER_KERNELS = {"hopper-fwd": "_hopper_fwd_kernel", "hopper-dkdv": "_hopper_dkdv_kernel"}
# Pointer arguments that are not bf16 (q, k, v, o and their gradients are).
POINTER_DTYPES = {"C": torch.float64, "C_SEG": torch.float32, "LSE": torch.float32, "DELTA": torch.float32,
                  "DELTA_CORRECTED": torch.float32, "DC": torch.float32, "BOUND": torch.float32,
                  "CU_SEQLENS": torch.int32, "SEQ_START": torch.int32, "PRUNED": torch.int32,
                  "ROW_ORDER": torch.int32}
FLOAT_ARGS = {"qk_scale": 0.125 * 1.4427, "sm_scale": 0.125, "log_eps": -10.0}


def launch_arguments(fn, head_dim, seqlen=16384, hidden=2048, group=1):
    """The non-constexpr arguments of `fn` as `bench_attention.py` launches it (batch 1, `seqlen` tokens,
    hidden // head_dim query heads, contiguous bf16 (B, T, H, D) tensors, c laid out (B, H, T)): Triton specializes
    the compiled code on them (16-byte aligned pointers, integers divisible by 16, integers equal to 1)."""
    heads = hidden // head_dim
    values = {}
    for name in fn.arg_names:
        if name.isupper():
            values[name] = torch.empty(16, dtype=POINTER_DTYPES.get(name, torch.bfloat16))  # only dtype and alignment
        elif name in FLOAT_ARGS:
            values[name] = FLOAT_ARGS[name]
        elif name.startswith("stride_c"):  # (B, H, T) with unit stride along T
            values[name] = {"b": heads * seqlen, "t": 1, "h": seqlen}[name[-1]]
        elif name.startswith("stride_u"):  # U broadcast over (B, H)
            values[name] = 0
        elif name.startswith("stride_"):  # (B, T, H, D)
            values[name] = {"b": seqlen * heads * head_dim, "t": heads * head_dim, "h": head_dim}[name[-1]]
        elif name in ("Tq", "Tk", "max_seqlen_q", "max_seqlen_k"):
            values[name] = seqlen
        elif name == "num_heads":
            values[name] = heads
        elif name == "group":
            values[name] = group
        elif name == "tune_seqlen":
            values[name] = attention_tuning.tune_seqlen(seqlen)
    return values


def hopper_launch_arguments(fn, head_dim, group, seqlen=16384, hidden=2048):
    """`launch_arguments` of a Hopper kernel: its q/k/v/dO operands are TMA descriptors (`attention_hopper._rows`), the
    dK/dV outputs fp32 with GQA (each query head's share)."""
    heads = hidden // head_dim
    q = torch.empty(1, seqlen, heads, head_dim, dtype=torch.bfloat16)
    kv = torch.empty(1, seqlen, heads // group, head_dim, dtype=torch.bfloat16)
    values = launch_arguments(fn, head_dim, seqlen, hidden, group)
    values.update(q_desc=attention_hopper._rows(q, 64), do_desc=attention_hopper._rows(q, 64),
                  k_desc=attention_hopper._rows(kv, attention_hopper.HOPPER_TILE),
                  v_desc=attention_hopper._rows(kv, attention_hopper.HOPPER_TILE), head_group=heads,
                  T=seqlen, stride_ot=heads * head_dim, stride_dkt=heads * head_dim, stride_dvt=heads * head_dim)
    if group > 1:
        values.update(DK=torch.empty(16), DV=torch.empty(16))
    return {name: values[name] for name in fn.arg_names if name in values}


def compile_hopper_kernel(name, head_dim, group, prune, arch):
    """Compile a Gluon kernel of attention_hopper.py for `arch` with the settings its launch uses."""
    fn = getattr(attention_hopper, HOPPER_KERNELS[name])
    launch = dict(attention_hopper.FWD_LAUNCH if name == "hopper-fwd" else attention_hopper.DKDV_LAUNCH)
    constexprs = dict(HEAD_DIM=head_dim, PRUNE=prune, ORDERED=False, num_warps=launch.pop("num_warps"))
    if "COUNT_PRUNED" in fn.arg_names:
        constexprs["COUNT_PRUNED"] = False
    return compile_kernel(fn, constexprs, constexprs["num_warps"], 1, arch,
                          hopper_launch_arguments(fn, head_dim, group), source=GluonASTSource, **launch)


def compile_kernel(fn, constexprs, num_warps, num_stages, arch, arguments=None, source=ASTSource, **options):
    """Compile `fn` for `arch` as the JIT would for `arguments` (default: `launch_arguments` at BLOCK_D)."""
    arguments = arguments or launch_arguments(fn, constexprs["BLOCK_D"])
    signature, attrs, constants = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        kind, specialization = native_specialize_impl(CUDABackend, arguments[name], False, True, True)
        signature[name] = kind
        if kind == "constexpr":  # integers equal to 1
            constants[name] = specialization
        elif isinstance(specialization, str):
            attrs[(i,)] = CUDABackend.parse_attr(specialization)
    source = source(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


def _cuobjdump(compiled, flag):
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled):
    """{"REG": n, "STACK": bytes per thread, "SHARED": bytes} from the cubin."""
    usage = dict((k, int(v)) for k, v in re.findall(r"(REG|STACK):(\d+)", _cuobjdump(compiled, "-res-usage")))
    usage["SHARED"] = compiled.metadata.shared  # Triton's dynamic shared memory (cuobjdump reports static only)
    return usage


def wgmma_serialized(compiled, arch):
    """ptxas's reasons for serializing the kernel's wgmma instructions, as its warning codes ("C7515": accumulator
    registers written by other instructions inside a pipeline stage, "C7512": too few registers); "" if it does
    not."""
    ptxas = get_ptxas(arch).path  # the one Triton compiled the kernel with
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", ptx.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True)
    lines = (report.stdout + report.stderr).splitlines()
    return " ".join(sorted({code for line in lines if "wgmma.mma_async instructions are serialized" in line
                            for code in re.findall(r"\((C\d+)\)", line)}))


def main_loop(compiled):
    """(instructions, local-memory loads and stores) per iteration of the main loop in the SASS: the shortest
    innermost loop that issues tensor-core instructions (HGMMA), i.e. the unmasked stage (the masked diagonal stage
    is longer); None if there is no such loop."""
    code = [(int(address, 16), text) for address, text in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(compiled, "-sass"))]
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []  # (first, last) instruction indices of each backward branch's body
    for i, (address, text) in enumerate(code):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            loops.append((index[int(target.group(1), 16)], i))
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    bodies = [[text for _, text in code[a : b + 1]] for a, b in innermost]
    bodies = [body for body in bodies if any("HGMMA" in text for text in body)]
    if not bodies:
        return None
    body = min(bodies, key=len)
    return len(body), sum(bool(re.search(r"\b(LDL|STL)\b", text)) for text in body)


def main():
    args = parse_args()
    print("| kernel | head dim | BLOCK_M x BLOCK_N | warps | stages | prune | registers | spill bytes/thread | "
          "shared KB | main loop instructions (local loads+stores) | wgmma serialized |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.kernels:
        if name in HOPPER_KERNEL_NAMES:
            for head_dim in args.head_dim:
                for prune in (False, True) if args.prune else (False,):
                    compiled = compile_hopper_kernel(name, head_dim, args.group, prune, args.arch)
                    usage, loop = resource_usage(compiled), main_loop(compiled)
                    tile = "128 x 128" if name == "hopper-fwd" else "64 x 128"
                    print(f"| {name} | {head_dim} | {tile} | {compiled.metadata.num_warps} | - | {prune} | "
                          f"{usage['REG']} | {usage['STACK']} | {usage['SHARED'] / 1024:.0f} | "
                          f"{'-' if loop is None else '%d (%d)' % loop} | "
                          f"{wgmma_serialized(compiled, args.arch) or 'no'} |", flush=True)
            continue
        fn, table = KERNELS[name]
        for head_dim in args.head_dim:
            configs = table[head_dim][:1] if args.first_only else table[head_dim]
            for config in configs:
                for prune in (False, True) if args.prune else (False,):
                    arguments = launch_arguments(fn, head_dim, group=args.group)
                    # As `_launch_settings` sets it; dK/dV programs walk (sequence, KV head) pairs, no more than that.
                    arguments["head_group"] = attention_tuning.head_group(prune, args.group, head_dim,
                                                                          arguments["num_heads"])
                    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, IS_VARLEN=args.layout == "packed",
                                      HAS_SEQ_START=args.layout == "padded",
                                      DOT_PRECISION="tf32", PRUNE=prune, SEARCH_WIDTH=attention_triton.SEARCH_WIDTH,
                                      **config.kwargs)
                    if "COUNT_PRUNED" in fn.arg_names:
                        constexprs["COUNT_PRUNED"] = False
                    if "ORDERED" in fn.arg_names:  # as `_launch_settings` sets it: pruned, rows in groups
                        constexprs["ORDERED"] = prune and arguments["head_group"] < arguments["num_heads"]
                    if "SEGMENT" in fn.arg_names:
                        constexprs["SEGMENT"] = attention_gate_scan.SEGMENT
                    if "USE_TMA" in fn.arg_names:
                        constexprs["USE_TMA"] = args.loads == "tma"
                    if "BIAS_TMA" in fn.arg_names:
                        constexprs["BIAS_TMA"] = args.loads == "tma" and dispatch.use_dq_bias_tma(
                            prune, head_dim, args.layout == "packed")
                    compiled = compile_kernel(fn, constexprs, config.num_warps, config.num_stages, args.arch,
                                              arguments)
                    usage, loop = resource_usage(compiled), main_loop(compiled)
                    print(f"| {name} | {head_dim} | {config.kwargs['BLOCK_M']} x {config.kwargs['BLOCK_N']} | "
                          f"{config.num_warps} | {config.num_stages} | {prune} | {usage['REG']} | {usage['STACK']} | "
                          f"{usage['SHARED'] / 1024:.0f} | {'-' if loop is None else '%d (%d)' % loop} | "
                          f"{wgmma_serialized(compiled, args.arch) or 'no'} |", flush=True)


if __name__ == "__main__":
    main()
