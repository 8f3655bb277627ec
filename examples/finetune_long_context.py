"""Convert a LLaMA-family model to FoX (RoPE dropped), fine-tune it for a longer context, and compare per-token loss.

The job is `foxlm.finetune` (foxlm/finetune.py), so that an installed foxlm runs it too, as `foxlm finetune`; this
script takes the same options (`--help`).

    python examples/finetune_long_context.py --full --max-minutes 30
"""

from foxlm.finetune import main

if __name__ == "__main__":
    main()
