"""`python benchmarks/bench_decode.py [options]` is `foxlm bench decode [options]`: the benchmark is
foxlm/benchmarks/bench_decode.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("decode", sys.argv[1:]))
