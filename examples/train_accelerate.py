"""Pretrain a FoX model with `Trainer` on one or several GPUs through `accelerate launch` (DDP or FSDP), save it
sharded, and check that the saved model reloads with the logits of the trained one.

The code is `foxlm.pretrain` (foxlm/pretrain.py, which documents the options), so that an installed foxlm has it:
`foxlm bench trainer-profile` profiles its training step.

    accelerate launch --config_file examples/accelerate/fsdp.yaml --num_processes 2 \\
        examples/train_accelerate.py --size 760m --context 4096 --batch-size 4 --steps 40
    python examples/train_accelerate.py --size tiny --steps 20        # one process, GPU or CPU
"""

from foxlm.pretrain import main

if __name__ == "__main__":
    main()
