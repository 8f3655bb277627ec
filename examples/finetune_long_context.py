"""Convert a LLaMA-family model to FoX (partial RoPE), fine-tune it for a longer context, and compare per-token loss.

The job is `foxlm.finetune` (foxlm/finetune.py), so that an installed foxlm runs it too, as `foxlm finetune`; this
script takes the same options (`--help`).

    python examples/finetune_long_context.py --full --max-minutes 30
"""

import sys

from foxlm.cli import failures_reported
from foxlm.finetune import main

if __name__ == "__main__":
    with failures_reported(debug="--debug" in sys.argv):  # one `error:` line, as `foxlm finetune` ends a failure
        main([arg for arg in sys.argv[1:] if arg != "--debug"])
