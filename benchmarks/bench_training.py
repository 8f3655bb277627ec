"""`python benchmarks/bench_training.py [options]` is `foxlm bench training [options]`: the benchmark is
foxlm/benchmarks/bench_training.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("training", sys.argv[1:]))
