"""`python benchmarks/trainer_step_profile.py [options]` is `foxlm bench trainer-profile [options]`: the benchmark is
foxlm/benchmarks/trainer_step_profile.py."""

import sys

from foxlm.benchmarks import run

if __name__ == "__main__":
    sys.exit(run("trainer-profile", sys.argv[1:]))
