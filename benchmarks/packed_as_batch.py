"""Packed sequences of one length, as `foxlm finetune` packs its blocks: through `forgetting_attention` (which runs
them as a batch) against the packed (varlen) launch they took before and SDPA cuDNN's plain causal attention on the
same sequences as a batch (no gate), side by side in one process (GPU).

    FOXLM_AUTOTUNE=0 python benchmarks/packed_as_batch.py [--out DIR]

First the accuracy of both foxlm paths against the float64 reference on fresh random inputs (out, dq, dk, dv, d log f;
two sequences of 1,024), then forward and forward+backward times of each shape, with the harness, inputs (bf16, its
gate mix) and FLOP count of foxlm/benchmarks/bench_attention.py. The record goes to
`packed_as_batch_<device>_<date>.json` in --out (benchmarks/results by default).
"""

import argparse
import math

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record

# (name, sequences, length, query heads, K/V heads, head dim)
SHAPES = [
    ("SmolLM2 retrofit: 2 x 32k, 9q/3kv D64", 2, 32768, 9, 3, 64),
    ("D64 4 x 4k, 32 heads", 4, 4096, 32, 32, 64),
    ("D128 4 x 4k, 16 heads", 4, 4096, 16, 16, 128),
    ("D128 2 x 8k, 16 heads", 2, 8192, 16, 16, 128),
]


def packed_inputs(sequences, length, hq, hkv, d):
    """q, k, v (1, sequences * length, heads, d) and log f (bench_attention's gate mix), all leaves, a gradient of the
    output, and the boundaries of the packed sequences."""
    import torch

    from foxlm.benchmarks.bench_attention import gate_mix, make

    total = sequences * length
    (q, k, v, _), grad_out = make(1, total, hq, hkv, d)
    log_fgate = gate_mix(1, total, hq).requires_grad_()
    return (q, k, v, log_fgate), grad_out, torch.arange(0, total + 1, length, device="cuda", dtype=torch.int32)


def as_batch(q, k, v, log_fgate, cu_seqlens):
    from foxlm.benchmarks.bench_attention import ours

    return ours(q, k, v, log_fgate, cu_seqlens=cu_seqlens)


def packed_launch(q, k, v, log_fgate, cu_seqlens):
    """The custom op with the boundaries: the varlen kernels, as every packed call ran before."""
    import torch

    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return torch.ops.foxlm.forgetting_attention(q, k, v, log_fgate, False, 1 / math.sqrt(q.shape[-1]), cu_seqlens,
                                                longest, None, True)[0]


def accuracy(fn):
    """Largest relative error (max |x - ref| / max |ref|) of out, dq, dk, dv, d log f against float64."""
    import torch

    from foxlm.benchmarks.bench_attention import reference

    def run(forward, tensors):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out = forward(*leaves, cu_seqlens=cu_seqlens)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]

    torch.manual_seed(1)
    tensors, grad_out, cu_seqlens = packed_inputs(2, 1024, 8, 2, 64)
    got, want = run(fn, tensors), run(reference, [t.double() for t in tensors])
    errors = [((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip(got, want)]
    if not all(math.isfinite(e) for e in errors):
        raise SystemExit(f"{fn.__name__}: non-finite error {errors}")
    return dict(zip(("out", "dq", "dk", "dv", "dlogf"), errors))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the JSON record (default: %(default)s)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("packed_as_batch.py times GPU kernels: no CUDA device here")
    from torch.nn.attention import SDPBackend

    from foxlm.benchmarks.bench_attention import causal_flops, measure, sdpa

    record = new_record(accuracy={}, rows=[])
    for fn in (as_batch, packed_launch):
        record["accuracy"][fn.__name__] = accuracy(fn)
        print(fn.__name__, "max relative error vs float64:", record["accuracy"][fn.__name__], flush=True)
    for name, sequences, length, hq, hkv, d in SHAPES:
        torch.manual_seed(0)
        inputs, grad_out, cu_seqlens = packed_inputs(sequences, length, hq, hkv, d)
        flops = causal_flops(sequences, hq, length, d)
        row = {"shape": name, "sequences": sequences, "length": length, "Hq": hq, "Hkv": hkv, "D": d}
        for fn in (as_batch, packed_launch):
            row[fn.__name__] = measure(fn.__name__, fn, inputs, grad_out, flops, {"cu_seqlens": cu_seqlens})
        batch = [t.detach().unflatten(1, (sequences, length)).squeeze(0).requires_grad_() for t in inputs]
        row["sdpa_cudnn"] = measure("sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, hq != hkv), batch,
                                    grad_out.unflatten(1, (sequences, length)).squeeze(0), flops)
        row["fwd_bwd_speedup"] = row["packed_launch"]["fwd_bwd_ms"] / row["as_batch"]["fwd_bwd_ms"]
        record["rows"].append(row)
        print(f"{name}: fwd+bwd {row['as_batch']['fwd_bwd_ms']:.2f} ms as a batch, "
              f"{row['packed_launch']['fwd_bwd_ms']:.2f} ms packed ({row['fwd_bwd_speedup']:.2f}x), SDPA cuDNN "
              f"{row['sdpa_cudnn'].get('fwd_bwd_ms', float('nan')):.2f} ms", flush=True)
    path = record_path(args.out, "packed_as_batch", record)
    write_record(path, record)
    print("wrote", path)


if __name__ == "__main__":
    main()
