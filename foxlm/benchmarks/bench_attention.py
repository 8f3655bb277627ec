"""Forgetting Attention speed: our Triton kernel vs PyTorch SDPA (cuDNN and flash backends, plain causal).

One run on one GPU. bf16, B*T = 16k tokens, hidden 2048 (H = 2048 / D), D = 64 and 128, T = 2k..16k, plus a packed
variable-length row and GQA rows. On an H100/H200, where the Hopper (Gluon) kernels take a shape, the Triton kernels
alone (as with FOXLM_GLUON=0) are timed beside them ("foxlm-triton-kernels"). TFLOP/s count full causal FLOPs:
forward 4*B*H*T^2*D/2, forward+backward 3.5x that (the FlashAttention convention). Per-stage times of our kernel
(forward, dK/dV, dQ) come from the profiler. Results go to benchmarks/results/attention_<device>_<date>.json and a
table is printed.

ACP rows (also alone with --acp-only, T = 16k): Adaptive Computation Pruning at eps = e^-10 on gates where 70% of
the heads forget fast (logits ~ N(0, 1)) and 30% slowly (N(8, 1)), and on fully open gates (log f = 0, the
overhead case), with U measured from q and k per call ("U measured") or given ("U given", as the model passes it
from its QK-norm scales). Effective TFLOP/s still count the full causal FLOPs; the pruned fraction of the
forward's (query, key) pairs sits beside each time.

    python benchmarks/bench_attention.py [--quick] [--acp-only | --no-acp] [--out DIR]
"""

import argparse

from .run_record import RESULTS_DIR, new_record, record_path, write_record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only T = 4k and 16k")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference path and accuracy check")
    parser.add_argument("--acp-only", action="store_true", help="only the ACP rows (T = 16k, D = 64 and 128)")
    parser.add_argument("--no-acp", action="store_true", help="without the ACP rows")
    parser.add_argument("--out", default=RESULTS_DIR)
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help and wrong options answer before torch loads; main() parses the options again
    parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from foxlm.kernels import dispatch, forgetting_attention  # noqa: E402
from foxlm.kernels.acp import DEFAULT_PRUNE_EPS, acp_statistics, measured_score_bound  # noqa: E402

STAGES = {"_fwd_kernel": "fwd", "_bwd_kv_kernel": "dkdv", "_hopper_dkdv_kernel": "dkdv", "_bwd_q_kernel": "dq",
          "_bwd_preprocess": "delta"}  # "_fwd_kernel" also names the Hopper forward


def causal_flops(B, H, T, D):
    return 4 * B * H * T * T * D / 2


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # ms


def time_fwd_bwd(forward, inputs, grad_out, n_differentiated):
    def fwd():
        with torch.no_grad():
            forward(*inputs)

    def fwd_bwd():
        out = forward(*inputs)
        torch.autograd.grad(out, inputs[:n_differentiated], grad_out)

    return bench(fwd), bench(fwd_bwd)


def ours(q, k, v, log_fgate, **kwargs):
    return forgetting_attention(q, k, v, log_fgate, backend="triton", **kwargs)


def reference(q, k, v, log_fgate, **kwargs):
    return forgetting_attention(q, k, v, log_fgate, backend="reference", **kwargs)


def sdpa(backend, enable_gqa=False):
    def run(q, k, v, _log_fgate):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    return run


def stage_times(inputs, grad_out, kwargs, iters=10):
    """Mean device time per kernel over `iters` forward+backward passes, from the profiler."""
    out = ours(*inputs, **kwargs)
    torch.autograd.grad(out, inputs, grad_out)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            out = ours(*inputs, **kwargs)
            torch.autograd.grad(out, inputs, grad_out)
        torch.cuda.synchronize()
    totals = {}
    for event in prof.key_averages():
        for name, stage in STAGES.items():
            if name in event.key:
                totals[stage] = totals.get(stage, 0.0) + event.device_time_total / iters / 1e3  # ms
    return totals


def accuracy(inputs, grad_out, kwargs):
    """Largest relative error of out, dq, dk, dv, d log f against the float64 reference: the timed configuration
    (autotuned in this process) is also the checked one."""
    def run(fn, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = fn(*leaves, **kwargs)
        return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]

    got = run(ours, inputs)
    want = run(reference, [t.double() for t in inputs])
    return max(((x.double() - y).norm() / y.norm()).item() for x, y in zip(got, want))


def make(B, T, Hq, Hkv, D, dtype=torch.bfloat16):
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
    log_fgate = F.logsigmoid(torch.randn(B, T, Hq, device="cuda") + 3.0).requires_grad_()
    return (q, k, v, log_fgate), torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)


def gate_mix(B, T, H, slow_share=0.3):
    """log f with 70% of the heads fast (logit ~ N(0, 1), f ~ 0.5) and 30% slow (N(8, 1)), as in the ACP paper."""
    slow = torch.arange(H, device="cuda") >= round(H * (1 - slow_share))
    logits = torch.randn(B, T, H, device="cuda") + 8.0 * slow
    return F.logsigmoid(logits)


def acp_rows(D, T=16384, tokens=16384, hidden=2048):
    """ACP on the gate mix and on open gates at one shape, against SDPA cuDNN and our unpruned kernel."""
    B, H = tokens // T, hidden // D
    (q, k, v, _), grad_out = make(B, T, H, H, D)
    flops = causal_flops(B, H, T, D)
    given = measured_score_bound(q.detach(), k.detach(), D**-0.5)
    entry = {"shape": f"ACP D{D} T{T // 1024}k", "B": B, "T": T, "Hq": H, "Hkv": H, "D": D, "eps": DEFAULT_PRUNE_EPS,
             "results": [measure("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION), (q, k, v, None), grad_out, flops)]}
    open_gates = torch.zeros(B, T, H, device="cuda")
    for gates_name, gates in (("gate mix 70/30", gate_mix(B, T, H)), ("open gates", open_gates)):
        inputs = (q, k, v, gates.requires_grad_())
        variants = (("no ACP", {}), ("ACP, U measured", {"prune_eps": DEFAULT_PRUNE_EPS}),
                    ("ACP, U given", {"prune_eps": DEFAULT_PRUNE_EPS, "score_bound": given}))
        for variant, kwargs in variants:
            result = measure(f"foxlm-triton {gates_name}, {variant}", ours, inputs, grad_out, flops, kwargs)
            if kwargs:
                with torch.no_grad(), acp_statistics() as stats:
                    pruned_out = ours(*inputs, **kwargs)
                result["pruned_fraction"] = stats.pruned_fraction
                with torch.no_grad():
                    exact = ours(*inputs)
                result["max_abs_diff_vs_unpruned"] = (pruned_out.float() - exact.float()).abs().max().item()
                result["acp_output_bound"] = 2 * DEFAULT_PRUNE_EPS * v.abs().max().item()
            entry["results"].append(result)
    rows_print = [f"{r['impl']} {r['fwd_tflops']:.0f}/{r['fwd_bwd_tflops']:.0f}"
                  + (f" (pruned {r['pruned_fraction']:.2f})" if "pruned_fraction" in r else "")
                  for r in entry["results"] if "error" not in r]
    print(f"{entry['shape']}: " + "; ".join(rows_print), flush=True)
    return entry


def print_acp_table(rows):
    print("| shape | impl | fwd ms | fwd+bwd ms | effective fwd+bwd TF/s | vs cuDNN | pruned fraction |")
    print("|---|---|---|---|---|---|---|")
    for entry in rows:
        cudnn = _result(entry, "sdpa-cudnn")
        for r in entry["results"]:
            if "error" in r:
                print(f"| {entry['shape']} | {r['impl']} | error: {r['error'][:80]} | | | | |")
                continue
            ratio = f"{r['fwd_bwd_tflops'] / cudnn['fwd_bwd_tflops']:.2f}" if cudnn else "-"
            pruned = f"{r['pruned_fraction']:.3f}" if "pruned_fraction" in r else "-"
            print(f"| {entry['shape']} | {r['impl']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
                  f"{r['fwd_bwd_tflops']:.0f} | {ratio} | {pruned} |")


def hopper_applies(inputs, kwargs):
    """Whether a Hopper kernel runs a pass of this call (`dispatch.hopper_shape` on an sm_90 GPU, FOXLM_GLUON not 0)."""
    q, k = inputs[:2]
    return (dispatch.HOPPER_KERNELS and torch.cuda.get_device_capability() == (9, 0)
            and dispatch.hopper_shape(q, k, kwargs.get("cu_seqlens"), None))


def triton_kernels_only(measurement):
    """`measurement()` with the Hopper kernels off, as FOXLM_GLUON=0 runs: both paths timed in one process."""
    saved, dispatch.HOPPER_KERNELS = dispatch.HOPPER_KERNELS, False
    try:
        return measurement()
    finally:
        dispatch.HOPPER_KERNELS = saved


def measure(name, fn, inputs, grad_out, flops, kwargs=None):
    kwargs = kwargs or {}
    n_differentiated = 3 if name.startswith("sdpa") else 4  # SDPA has no gate
    try:
        fwd_ms, fwd_bwd_ms = time_fwd_bwd(lambda *a: fn(*a, **kwargs), inputs, grad_out, n_differentiated)
    except Exception as error:  # a backend that cannot run this shape (e.g. out of memory) is reported, not fatal
        torch.cuda.empty_cache()
        return {"impl": name, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {"impl": name, "fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_tflops": flops / fwd_ms / 1e9, "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_ms / 1e9}


def main():
    args = parse_args()
    tokens, hidden = 16384, 2048
    seqlens = [4096, 16384] if args.quick else [2048, 4096, 8192, 16384]
    rows = []

    def shape_row(label, B, T, Hq, Hkv, D, kwargs=None, flops=None, reference_fits=False, gqa=False):
        inputs, grad_out = make(B, T, Hq, Hkv, D)
        flops = flops or causal_flops(B, Hq, T, D)
        entry = {"shape": label, "B": B, "T": T, "Hq": Hq, "Hkv": Hkv, "D": D, "results": []}
        entry["results"].append(measure("foxlm-triton", ours, inputs, grad_out, flops, kwargs))
        if hopper_applies(inputs, kwargs or {}):
            entry["results"].append(triton_kernels_only(
                lambda: measure("foxlm-triton-kernels", ours, inputs, grad_out, flops, kwargs)))
        entry["stages_ms"] = stage_times(inputs, grad_out, kwargs or {})
        if kwargs is None:
            for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                entry["results"].append(measure(name, sdpa(backend, gqa), inputs, grad_out, flops))
        if reference_fits:
            entry["results"].append(measure("foxlm-reference", reference, inputs, grad_out, flops, kwargs))
        if not args.no_reference:
            # The whole input where the float64 reference is quick, else one sequence and one K/V head with its query
            # heads at the same length: neither count is in the autotune key, so the timed configuration is checked.
            checked = (inputs, grad_out) if reference_fits else make(1, T, Hq // Hkv, 1, D)
            entry["max_rel_err_vs_float64"] = accuracy(*checked, kwargs or {})
        rows.append(entry)
        print_row(entry, flops)

    if not args.acp_only:
        for D in (64, 128):
            for T in seqlens:
                shape_row(f"D{D} T{T // 1024}k", tokens // T, T, hidden // D, hidden // D, D,
                          reference_fits=T <= 4096 and not args.no_reference)
        # Packed documents of uneven lengths (16k tokens), counted as the sum of their own causal FLOPs.
        lengths = [512, 1536, 2048, 4096, 8192]
        cu_seqlens = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        shape_row("varlen D128 (0.5k..8k)", 1, sum(lengths), 16, 16, 128,
                  kwargs={"cu_seqlens": cu_seqlens, "max_seqlen": max(lengths)},
                  flops=sum(causal_flops(1, 16, n, 128) for n in lengths))
        shape_row("GQA D128 T4k 16q/4kv", 4, 4096, 16, 4, 128, gqa=True)
        shape_row("GQA D64 T4k 32q/8kv", 4, 4096, 32, 8, 64, gqa=True)
    acp = [] if args.no_acp else [acp_rows(D) for D in (64, 128)]

    record = new_record(dtype="bfloat16", flops="causal 4*B*H*T^2*D/2 forward, x3.5 forward+backward", rows=rows,
                        acp_rows=acp)
    path = record_path(args.out, "attention_acp" if args.acp_only else "attention", record)
    write_record(path, record)
    print(f"\n{record['device']}, torch {torch.__version__}, triton {triton.__version__}; wrote {path}\n")
    if rows:
        print_table(rows)
    if acp:
        print_acp_table(acp)


def _result(entry, impl):
    return next((r for r in entry["results"] if r["impl"] == impl and "error" not in r), None)


def print_row(entry, flops):
    stages = ", ".join(f"{k} {v:.3f} ms ({_stage_tflops(k, v, flops):.0f} TF/s)" for k, v in entry["stages_ms"].items())
    if "max_rel_err_vs_float64" in entry:
        stages += f" | max rel err vs float64 {entry['max_rel_err_vs_float64']:.1e}"
    print(f"{entry['shape']}: " + "; ".join(
        f"{r['impl']} {r['fwd_tflops']:.0f}/{r['fwd_bwd_tflops']:.0f}" if "error" not in r else f"{r['impl']} error"
        for r in entry["results"]) + f" | stages: {stages}", flush=True)


def _stage_tflops(stage, ms, flops):
    # Forward: 2 matmuls; dK/dV: 4 (QK^T recompute, dV, dP, dK); dQ: 3 (QK^T, dP, dQ) -> 2.5x forward in total
    # counts dK/dV as 2x and dQ as 1.5x the forward's FLOPs (the recompute of QK^T is done twice).
    factor = {"fwd": 1.0, "dkdv": 2.0, "dq": 1.5, "delta": 0.0}[stage]
    return factor * flops / ms / 1e9


def print_table(rows):
    header = ("| shape | ours fwd | ours fwd+bwd | Triton kernels only fwd | Triton kernels only fwd+bwd | cuDNN fwd | "
              "cuDNN fwd+bwd | flash fwd | flash fwd+bwd | ref fwd+bwd | fwd+bwd / cuDNN |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for entry in rows:
        cells = [entry["shape"]]
        for impl in ("foxlm-triton", "foxlm-triton-kernels", "sdpa-cudnn", "sdpa-flash"):
            r = _result(entry, impl)
            cells += [f"{r['fwd_tflops']:.0f}", f"{r['fwd_bwd_tflops']:.0f}"] if r else ["-", "-"]
        ref = _result(entry, "foxlm-reference")
        cells.append(f"{ref['fwd_bwd_tflops']:.0f}" if ref else "-")
        ours_r, cudnn = _result(entry, "foxlm-triton"), _result(entry, "sdpa-cudnn")
        cells.append(f"{ours_r['fwd_bwd_tflops'] / cudnn['fwd_bwd_tflops']:.2f}" if ours_r and cudnn else "-")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
