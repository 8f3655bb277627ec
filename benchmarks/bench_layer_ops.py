"""`python benchmarks/bench_layer_ops.py [options]` is `foxlm bench layer-ops [options]`: the benchmark is
foxlm/benchmarks/bench_layer_ops.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("layer-ops", sys.argv[1:]))
