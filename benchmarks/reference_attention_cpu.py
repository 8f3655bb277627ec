"""Speed of the pure-PyTorch Forgetting Attention (the CPU path) at small-model shapes: forward, and forward plus
backward, per call, the best of three after two warm-up calls.

    OMP_NUM_THREADS=2 python benchmarks/reference_attention_cpu.py --label after
    # the same against another checkout, to compare: PYTHONPATH=/path/to/other/foxlm python ... --label before

Writes reference_attention_cpu_<label>_cpu_<date>.json in --out with the machine, the threads and the commit and
source digest of the foxlm it imported (foxlm.benchmarks.run_record).
"""

import argparse
import os
import platform
import time

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record

SHAPES = [(4, 512, 9, 3, 64), (1, 2048, 9, 3, 64), (2, 1024, 8, 8, 64)]  # B, T, query heads, KV heads, D


def best_of(run, repeats=3, warmup=2):
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return round(min(times) * 1000, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="names the result file, e.g. before or after")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the result (default: %(default)s)")
    args = parser.parse_args()
    import torch

    from foxlm.kernels import forgetting_attention

    torch.manual_seed(0)
    rows = []
    for B, T, Hq, Hkv, D in SHAPES:
        q, k, v = (torch.randn(B, T, h, D, requires_grad=True) for h in (Hq, Hkv, Hkv))
        log_f = torch.nn.functional.logsigmoid(torch.randn(B, T, Hq) + 3).requires_grad_()
        with torch.no_grad():
            forward_ms = best_of(lambda: forgetting_attention(q, k, v, log_f))
        both_ms = best_of(lambda: forgetting_attention(q, k, v, log_f).sum().backward())
        rows.append({"batch": B, "seqlen": T, "query_heads": Hq, "kv_heads": Hkv, "head_dim": D,
                     "forward_ms": forward_ms, "forward_backward_ms": both_ms})
        print(rows[-1], flush=True)
    record = new_record(label=args.label, cpu=platform.processor() or platform.machine(),
                        threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"), rows=rows)
    path = record_path(args.out, f"reference_attention_cpu_{args.label}", record)
    write_record(path, record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
