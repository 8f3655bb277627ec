"""`python benchmarks/kernel_resources.py [options]` is `foxlm bench kernel-resources [options]`: the benchmark is
foxlm/benchmarks/kernel_resources.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("kernel-resources", sys.argv[1:]))
