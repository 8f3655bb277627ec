"""Time every candidate launch configuration of the attention kernels on this GPU, to choose their autotune lists.

For D = 64 and 128 at T = 16k (or the lengths of --seqlens; B*T = 16k tokens, hidden 2048, bf16), the autotune
lists of the forward, dQ and dK/dV kernels are extended with the candidates below (screen new ones with
`kernel_resources.py` first), one forward+backward autotunes them all, and each kernel's time per configuration is
printed and written to benchmarks/results/config_sweep_<device>_<date-time>.json, beside the tuned forward+backward
time and SDPA-cuDNN's; the winners are first checked against float64 (one head at the same length). The winners
then belong first in the lists of foxlm/kernels/attention/attention_tuning.py (FOXLM_AUTOTUNE=0 takes the first
alone).

    python benchmarks/sweep_attention_configs.py [--seqlens 16384 4096] [--out DIR]
"""

import argparse
import os

from .run_record import RESULTS_DIR, new_record, record_path, write_record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=RESULTS_DIR, help="folder for the JSON record (default: %(default)s)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[16384],
                        help="sequence lengths to sweep at, each timed afresh (default: 16384)")
    return parser.parse_args(argv)


if __name__ == "__main__":  # --help and wrong options answer before torch loads; main() parses the options again
    parse_args()

if os.environ.get("FOXLM_AUTOTUNE") == "0":
    raise SystemExit("sweep_attention_configs.py times every configuration of the autotune lists: unset "
                     "FOXLM_AUTOTUNE (0 takes the first configuration of each list alone).")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from foxlm.kernels import forgetting_attention  # noqa: E402
from foxlm.kernels.attention import attention_triton, attention_tuning  # noqa: E402

from .bench_attention import accuracy, bench, causal_flops, make, sdpa  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages) beyond the autotune lists (those already listed are skipped).
CANDIDATES = {
    "fwd": (attention_triton.fwd, attention_tuning.FWD_CONFIGS, {
        64: [(128, 64, 4, 4), (128, 64, 4, 2), (256, 64, 8, 3), (256, 64, 8, 2), (256, 32, 8, 3)],
        128: [(128, 64, 8, 3), (64, 128, 4, 3)]}),
    "dq": (attention_triton.bwd_q, attention_tuning.BWD_Q_CONFIGS, {
        64: [(128, 64, 4, 4), (128, 32, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3)],
        128: [(64, 64, 4, 3), (64, 128, 8, 2), (128, 32, 4, 4)]}),
    "dkdv": (attention_triton.bwd_kv, attention_tuning.BWD_KV_CONFIGS, {
        64: [(32, 128, 4, 4), (32, 128, 4, 2), (32, 256, 8, 3), (16, 128, 4, 3), (32, 64, 4, 3)],
        128: [(32, 64, 4, 3), (32, 64, 4, 5), (16, 64, 4, 4), (32, 128, 8, 1), (32, 128, 8, 2)]}),
}


def config_times(tuner):
    """{"MxN wW sS": ms} of the configurations the autotuner timed (Triton keeps them in `configs_timings`)."""
    times = getattr(tuner, "configs_timings", None) or {}
    return {f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}":
            (t[0] if isinstance(t, (list, tuple)) else t) for c, t in times.items()}


def main():
    args = parse_args()
    for _, table, extra in CANDIDATES.values():
        for head_dim, entries in extra.items():
            listed = {str(c) for c in table[head_dim]}
            table[head_dim].extend(c for c in attention_tuning.launch_configs(entries) if str(c) not in listed)
    rows = []
    for D, T in ((D, T) for D in (64, 128) for T in args.seqlens):
        H, B = 2048 // D, max(1, 16384 // T)
        for tuner, _, _ in CANDIDATES.values():
            tuner.cache.clear()
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        log_fgate = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 3.0).requires_grad_()

        def ours():
            out = forgetting_attention(q, k, v, log_fgate, backend="triton")
            torch.autograd.grad(out, (q, k, v, log_fgate), do)

        def cudnn():
            out = sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v, None)
            torch.autograd.grad(out, (q, k, v), do)

        ours()  # autotunes every kernel over its candidates
        row = {"D": D, "T": T, "B": B,
               "kernels_ms": {name: config_times(tuner) for name, (tuner, _, _) in CANDIDATES.items()}}
        # The winners against float64 on fresh inputs, before any timing: one head at the same length has the same
        # autotune key (the head count is not in it), and the float64 reference handles it quickly.
        row["max_rel_err_vs_float64"] = accuracy(*make(1, T, 1, 1, D), {})
        assert row["max_rel_err_vs_float64"] < 2e-2, row["max_rel_err_vs_float64"]
        row["ours_fwd_bwd_ms"], row["cudnn_fwd_bwd_ms"] = bench(ours), bench(cudnn)
        row["ours_tflops"] = 3.5 * causal_flops(B, H, T, D) / row["ours_fwd_bwd_ms"] / 1e9
        rows.append(row)
        for name, times in row["kernels_ms"].items():
            ranked = sorted(times.items(), key=lambda item: item[1])
            print(f"D{D} T{T} {name}: " + ", ".join(f"{cfg} {ms:.3f}" for cfg, ms in ranked), flush=True)
        print(f"D{D} T{T}: fwd+bwd {row['ours_fwd_bwd_ms']:.2f} ms ({row['ours_tflops']:.0f} TF/s), cuDNN "
              f"{row['cudnn_fwd_bwd_ms']:.2f} ms: {row['cudnn_fwd_bwd_ms'] / row['ours_fwd_bwd_ms']:.2f}x", flush=True)
    record = new_record(rows=rows)
    path = record_path(args.out, "config_sweep", record)
    write_record(path, record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
