"""Fused layer ops against their eager PyTorch references, forward+backward: QK-norm (per-head RMSNorm), the output
norm with the output gate, and the K/V token shift (foxlm/kernels/layer_ops/).

One GPU, the 760M FoX (Pro) shape: B*T = 32k tokens (2 x 16k), 24 heads x 64, bf16 activations and fp32 norm scales
as under `Trainer(bf16=True)` autocast. Each op first has its output and every gradient checked against the
reference run in float64 (max |error| / max |value| over the output and gradients), then is timed with
triton.testing.do_bench (median ms): the Triton path (`backend="triton"`), the eager reference
(`backend="reference"`, the PyTorch the model runs without the kernels) and torch.compile of that reference (what
inductor makes of it). GB/s counts the least HBM traffic of forward+backward: every input read by the forward and
the backward and its gradient written, the output written and its gradient read. Results go to
benchmarks/results/layer_ops_<device>_<date>.json and a markdown table is printed.

    python benchmarks/bench_layer_ops.py [--tokens 32768] [--seqlen 16384] [--heads 24] [--head-dim 64] [--out DIR]
"""

import argparse
import time
from functools import partial

from .run_record import RESULTS_DIR, new_record, record_path, write_record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="B * T")
    parser.add_argument("--seqlen", type=int, default=16384, help="T")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    parser.add_argument("--out", default=RESULTS_DIR)
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help and wrong options answer before torch loads; main() parses the options again
    parse_args()

import torch  # noqa: E402
import triton  # noqa: E402

from foxlm.kernels.layer_ops import head_rms_norm, token_shift  # noqa: E402


def make_ops(tokens, seqlen, heads, head_dim, device="cuda"):
    """{op name: (function(*inputs, backend=...), inputs)} with bf16 activations and fp32 scales."""
    B, T, H, D = tokens // seqlen, seqlen, heads, head_dim

    def activations(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    scales = 1 + 0.1 * torch.randn(H * D, device=device)
    previous = torch.zeros(B, 1, H, D, device=device, dtype=torch.bfloat16)
    return {
        "qk_norm": (lambda x, w, backend: head_rms_norm(x, w, 1e-5, backend=backend),
                    [activations(B, T, H, D), scales]),
        "output_norm_gate": (lambda o, w, gate, backend: head_rms_norm(o, w, 1e-6, gate, backend=backend),
                             [activations(B, T, H, D), scales, activations(B, T, H * D)]),
        "token_shift": (lambda raw, logits, backend: token_shift(raw, logits, previous, backend=backend),
                        [activations(B, T, H, D), activations(B, T, H)]),
    }


def outputs_and_grads(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def max_relative_error(fn, inputs, grad_out, backend):
    """max |error| / max |value| over the output and every gradient, against the reference in float64."""
    got = outputs_and_grads(partial(fn, backend=backend), inputs, grad_out)
    want = outputs_and_grads(partial(fn, backend="reference"), [t.double() for t in inputs], grad_out.double())
    return max(((x.double() - ref).abs().max() / ref.abs().max()).item() for x, ref in zip(got, want))


def bench(fn):
    fn()  # compiles (Triton, torch.compile) outside the timed runs
    if not torch.cuda.is_available():  # CPU smoke runs (tests): one timed call
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # ms


def time_fwd_bwd(fn, inputs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def fwd():
        with torch.no_grad():
            fn(*leaves)

    def fwd_bwd():
        torch.autograd.grad(fn(*leaves), leaves, grad_out)

    return {"fwd_ms": bench(fwd), "fwd_bwd_ms": bench(fwd_bwd)}


def measure(name, fn, inputs, compiled=True):
    """One table row: accuracy, then times of the fused op, the eager reference and (`compiled`) its compiled form."""
    grad_out = torch.randn_like(fn(*inputs, backend="reference"))
    row = {"op": name, "shapes": [list(t.shape) for t in inputs],
           "max_rel_err_vs_float64": {b: max_relative_error(fn, inputs, grad_out, b) for b in ("triton", "reference")}}
    impls = {"fused": partial(fn, backend="triton"), "eager": partial(fn, backend="reference")}
    if compiled:
        impls["compiled"] = torch.compile(partial(fn, backend="reference"))
    for impl, run in impls.items():
        row[impl] = time_fwd_bwd(run, inputs, grad_out)
    traffic = 3 * sum(t.numel() * t.element_size() for t in inputs) + 2 * grad_out.numel() * grad_out.element_size()
    row["fused"]["fwd_bwd_GBps"] = traffic / row["fused"]["fwd_bwd_ms"] / 1e6
    return row


def print_table(rows):
    header = ("| op | fused fwd | fused fwd+bwd | fused GB/s | eager fwd+bwd | compiled fwd+bwd | eager / fused "
              "| compiled / fused | max rel err vs fp64 (fused / eager) |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for row in rows:
        fused, eager, compiled = row["fused"], row["eager"], row.get("compiled")
        err = row["max_rel_err_vs_float64"]
        cells = [row["op"], f"{fused['fwd_ms']:.3f}", f"{fused['fwd_bwd_ms']:.3f}", f"{fused['fwd_bwd_GBps']:.0f}",
                 f"{eager['fwd_bwd_ms']:.3f}", f"{compiled['fwd_bwd_ms']:.3f}" if compiled else "-",
                 f"{eager['fwd_bwd_ms'] / fused['fwd_bwd_ms']:.2f}",
                 f"{compiled['fwd_bwd_ms'] / fused['fwd_bwd_ms']:.2f}" if compiled else "-",
                 f"{err['triton']:.1e} / {err['reference']:.1e}"]
        print("| " + " | ".join(cells) + " |")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer_ops.py times CUDA kernels: run it on a GPU.")
    ops = make_ops(args.tokens, args.seqlen, args.heads, args.head_dim)
    rows = [measure(name, fn, inputs, compiled=not args.no_compile) for name, (fn, inputs) in ops.items()]
    record = new_record(tokens=args.tokens, seqlen=args.seqlen, heads=args.heads, head_dim=args.head_dim,
                        dtypes="bf16 activations, fp32 scales", rows=rows)
    path = record_path(args.out, "layer_ops", record)
    write_record(path, record)
    print(f"{record['device']}, torch {torch.__version__}, triton {triton.__version__}; B*T = {args.tokens}, "
          f"T = {args.seqlen}, {args.heads} heads x {args.head_dim}; times in ms (median); wrote {path}\n")
    print_table(rows)


if __name__ == "__main__":
    main()
