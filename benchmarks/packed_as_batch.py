"""Packed sequences of one length, as `foxlm finetune` packs its blocks: through `forgetting_attention` (which runs
them as a batch) against the packed (varlen) launch they took before, side by side in one process (GPU).

    FOXLM_AUTOTUNE=0 python benchmarks/packed_as_batch.py [--out DIR]

First the accuracy of both against the float64 reference on fresh random inputs (out, dq, dk, dv, d log f; bf16,
two sequences of 1,024), then forward and forward+backward times of each shape. The record goes to
`packed_as_batch_<device>_<date>.json` in --out (benchmarks/results by default).
"""

import argparse
import math

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record

DEVICE = "cuda"
# (name, sequences, length, query heads, K/V heads, head dim)
SHAPES = [
    ("SmolLM2 retrofit: 2 x 32k, 9q/3kv D64", 2, 32768, 9, 3, 64),
    ("D64 4 x 4k, 32 heads", 4, 4096, 32, 32, 64),
    ("D128 4 x 4k, 16 heads", 4, 4096, 16, 16, 128),
    ("D128 2 x 8k, 16 heads", 2, 8192, 16, 16, 128),
]


def inputs(sequences, length, hq, hkv, d, dtype):
    import torch
    import torch.nn.functional as F

    total = sequences * length
    q = torch.randn(1, total, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(1, total, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.randn(1, total, hkv, d, device=DEVICE, dtype=dtype)
    # 70% of the heads forget fast, 30% slowly (bench_attention's mix)
    bias = torch.where(torch.arange(hq, device=DEVICE) < int(0.7 * hq), 2.0, 6.0)
    log_fgate = F.logsigmoid(torch.randn(1, total, hq, device=DEVICE) + bias)
    cu_seqlens = torch.arange(0, total + 1, length, device=DEVICE, dtype=torch.int32)
    return (q, k, v, log_fgate), cu_seqlens


def as_batch(q, k, v, log_fgate, cu_seqlens):
    from foxlm.kernels import forgetting_attention

    return forgetting_attention(q, k, v, log_fgate, cu_seqlens=cu_seqlens, backend="triton")


def packed_launch(q, k, v, log_fgate, cu_seqlens):
    """The custom op with the boundaries: the varlen kernels, as every packed call ran before."""
    import torch

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return torch.ops.foxlm.forgetting_attention(q, k, v, log_fgate, False, 1 / math.sqrt(q.shape[-1]), cu_seqlens,
                                                longest, None, True)[0]


def gradients(fn, tensors, cu_seqlens, grad_out):
    import torch

    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, cu_seqlens)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]


def accuracy(fn):
    """Largest relative error (max |x - ref| / max |ref|) of out, dq, dk, dv, d log f against float64."""
    import torch

    from foxlm.kernels import forgetting_attention

    torch.manual_seed(1)
    tensors, cu_seqlens = inputs(2, 1024, 8, 2, 64, torch.bfloat16)
    grad_out = torch.randn(tensors[0].shape, device=DEVICE)
    got = gradients(fn, tensors, cu_seqlens, grad_out)
    want = gradients(lambda q, k, v, g, cu: forgetting_attention(q, k, v, g, cu_seqlens=cu, backend="reference"),
                     [t.double() for t in tensors], cu_seqlens, grad_out)
    errors = [((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip(got, want)]
    if not all(math.isfinite(e) for e in errors):
        raise SystemExit(f"{fn.__name__}: non-finite error {errors}")
    return dict(zip(("out", "dq", "dk", "dv", "dlogf"), errors))


def timed(fn, tensors, cu_seqlens, grad_out, iters=10):
    """Median milliseconds of the forward and of forward+backward."""
    import torch

    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def fwd():
        with torch.no_grad():
            fn(*leaves, cu_seqlens)

    def fwd_bwd():
        torch.autograd.grad(fn(*leaves, cu_seqlens), leaves, grad_out)

    medians = []
    for step in (fwd, fwd_bwd):
        for _ in range(3):
            step()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        medians.append(sorted(times)[len(times) // 2])
    return medians


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the JSON record (default: %(default)s)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("packed_as_batch.py times GPU kernels: no CUDA device here")
    record = new_record(accuracy={}, rows=[])
    for fn in (as_batch, packed_launch):
        record["accuracy"][fn.__name__] = accuracy(fn)
        print(fn.__name__, "max relative error vs float64:", record["accuracy"][fn.__name__], flush=True)
    for name, sequences, length, hq, hkv, d in SHAPES:
        torch.manual_seed(0)
        tensors, cu_seqlens = inputs(sequences, length, hq, hkv, d, torch.bfloat16)
        grad_out = torch.randn_like(tensors[0])
        flops = 4 * sequences * hq * length * length * d / 2  # causal forward (FlashAttention's count)
        row = {"shape": name, "sequences": sequences, "length": length, "Hq": hq, "Hkv": hkv, "D": d}
        for fn in (as_batch, packed_launch):
            fwd, fwd_bwd = timed(fn, tensors, cu_seqlens, grad_out)
            row[fn.__name__] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "fwd_tflops": flops / fwd / 1e9,
                                "fwd_bwd_tflops": 3.5 * flops / fwd_bwd / 1e9}
        row["fwd_bwd_speedup"] = row["packed_launch"]["fwd_bwd_ms"] / row["as_batch"]["fwd_bwd_ms"]
        record["rows"].append(row)
        print(f"{name}: fwd+bwd {row['as_batch']['fwd_bwd_ms']:.2f} ms as a batch, "
              f"{row['packed_launch']['fwd_bwd_ms']:.2f} ms packed: {row['fwd_bwd_speedup']:.2f}x", flush=True)
    path = record_path(args.out, "packed_as_batch", record)
    write_record(path, record)
    print("wrote", path)


if __name__ == "__main__":
    main()
