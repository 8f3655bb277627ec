"""`python benchmarks/sweep_attention_configs.py [options]` is `foxlm bench sweep-configs [options]`: the benchmark is
foxlm/benchmarks/sweep_attention_configs.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("sweep-configs", sys.argv[1:]))
