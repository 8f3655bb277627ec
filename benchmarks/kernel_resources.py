"""Registers, spills and shared memory of the attention kernels, compiled for a GPU architecture on any machine.

No GPU needed: each kernel (forward, dQ, dK/dV; unpruned and pruned) is compiled by Triton for the target (default
sm_90, H100/H200) at every launch configuration in its autotune list, and the cubin's resource usage is read with
the cuobjdump that ships with Triton. Spill bytes are the per-thread local memory (spilled registers). The main loop
is the kernel's unmasked inner loop, where nearly all iterations run: its SASS instructions per iteration, and how
many of them are local-memory loads and stores (spill traffic where it costs). A configuration that spills is not
necessarily slow (spills stay in L1 when they fit), but spills and main-loop length are the first things to look at
when a kernel runs below its peers; candidates for the autotune lists can be screened here before spending device
time.

    python benchmarks/kernel_resources.py [--arch 90] [--head-dim 64 128] [--kernels fwd dq dkdv] [--prune]
"""

import argparse
import os
import re
import subprocess
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("kernel_resources.py compiles real kernels: unset TRITON_INTERPRET.")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from foxlm.kernels import triton_attention as ta  # noqa: E402

KERNELS = {  # name: (jit function, autotune table)
    "fwd": (ta._fwd_kernel, ta._FWD_CONFIGS),
    "dq": (ta._bwd_q_kernel, ta._BWD_Q_CONFIGS),
    "dkdv": (ta._bwd_kv_kernel, ta._BWD_KV_CONFIGS),
}
POINTER_TYPES = {"C": "*fp64", "LSE": "*fp32", "DELTA": "*fp32", "DELTA_ERR": "*fp32", "DC": "*fp32",
                 "BOUND": "*fp32", "CU_SEQLENS": "*i32", "SEQ_START": "*i32", "PRUNED": "*i32"}
FLOAT_ARGS = {"qk_scale", "sm_scale", "log_eps"}


def compile_kernel(fn, constexprs, num_warps, num_stages, arch):
    """Compile `fn` for `arch` with bf16 q/k/v: pointer arguments are upper-case, scalars i32 unless float."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability as an integer (90: H100/H200)")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128], choices=sorted(ta._FWD_CONFIGS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--prune", action="store_true", help="also the pruned (ACP) variant of every kernel")
    parser.add_argument("--first-only", action="store_true", help="only the first (default) configuration per list")
    args = parser.parse_args()
    print("| kernel | head dim | BLOCK_M x BLOCK_N | warps | stages | prune | registers | spill bytes/thread | "
          "shared KB | main loop instructions (local loads+stores) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.kernels:
        fn, table = KERNELS[name]
        for head_dim in args.head_dim:
            configs = table[head_dim][:1] if args.first_only else table[head_dim]
            for config in configs:
                for prune in (False, True) if args.prune else (False,):
                    constexprs = dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, IS_VARLEN=False, HAS_SEQ_START=False,
                                      DOT_PRECISION="tf32", PRUNE=prune, SEARCH_WIDTH=ta.SEARCH_WIDTH, HEAD_GROUP=1,
                                      **config.kwargs)
                    if "COUNT_PRUNED" in fn.arg_names:
                        constexprs["COUNT_PRUNED"] = False
                    compiled = compile_kernel(fn, constexprs, config.num_warps, config.num_stages, args.arch)
                    usage, loop = resource_usage(compiled), main_loop(compiled)
                    print(f"| {name} | {head_dim} | {config.kwargs['BLOCK_M']} x {config.kwargs['BLOCK_N']} | "
                          f"{config.num_warps} | {config.num_stages} | {prune} | {usage['REG']} | {usage['STACK']} | "
                          f"{usage['SHARED'] / 1024:.0f} | {'-' if loop is None else '%d (%d)' % loop} |", flush=True)


if __name__ == "__main__":
    main()
