"""`python benchmarks/bench_attention.py [options]` is `foxlm bench attention [options]`: the benchmark is
foxlm/benchmarks/bench_attention.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("attention", sys.argv[1:]))
