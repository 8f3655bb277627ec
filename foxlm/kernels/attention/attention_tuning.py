"""How the Triton attention kernels are launched: launch configurations and their autotuning, the length classes
the autotuner keys on, and how many heads' heavy blocks go first together.

Launch configurations: (BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dim, the fastest on an H100 at
T = 4k and 16k first (`benchmarks/sweep_attention_configs.py`; FOXLM_AUTOTUNE=0 takes it alone), then the runners-up.
Autotuned once per (head dim, GQA group, flags, length class): `tune_seqlen`, a kernel argument only the autotuner
reads (`tune_seqlen()` below). Pruned and unpruned launches share the choice, so that pruning nothing is
bit-identical to not pruning. Configurations whose pipelined tiles do not fit the device's shared memory are dropped
first, so that GPUs with ~100 KB per block (Ada, consumer Blackwell) get smaller tiles instead of an error.
"""

import triton

from ..dispatch import INTERPRET, autotune_candidates
from .attention_gate_scan import SEGMENT


def launch_configs(entries):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in entries]


if INTERPRET:
    # The interpreter runs numpy per program: small, unequal blocks exercise every boundary case cheaply.
    FWD_CONFIGS = {0: launch_configs([(32, 16, 4, 1)])}
    BWD_KV_CONFIGS = {0: launch_configs([(16, 32, 4, 1)])}
    BWD_Q_CONFIGS = {0: launch_configs([(32, 16, 4, 1)])}
else:
    FWD_CONFIGS = {
        64: launch_configs([(128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3)]),
        128: launch_configs([(128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]),
        256: launch_configs([(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)]),
    }
    BWD_KV_CONFIGS = {
        64: launch_configs([(32, 128, 4, 3), (32, 128, 4, 2), (64, 64, 4, 4), (32, 64, 4, 2)]),
        # 64 queries x 128 keys on 8 warps: fewer instructions per score than 32 x 64, faster dK/dV on equal-length
        # heads, slower with GQA or packed sequences (benchmarks/NOTES_attention.md, "Figures from the kernel
        # sources").
        128: launch_configs([(32, 64, 4, 3), (64, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 2)]),
        256: launch_configs([(32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 1)]),
    }
    BWD_Q_CONFIGS = {
        64: launch_configs([(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3)]),
        128: launch_configs([(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)]),
        256: launch_configs([(64, 32, 4, 2), (64, 16, 4, 2), (32, 32, 4, 1)]),
    }
FALLBACK_CONFIGS = launch_configs([(16, 16, 4, 1)])
assert all(SEGMENT % c.kwargs["BLOCK_N"] == 0 for table in (FWD_CONFIGS, BWD_Q_CONFIGS)
           for c in sum(table.values(), FALLBACK_CONFIGS)), "every forward and dQ key block must lie in one SEGMENT"


def _pruner(table, tile_elements):
    """Configs for this head dim that fit in shared memory; tile_elements(BLOCK_M, BLOCK_N, BLOCK_D, stages)
    counts the elements of the tiles a kernel keeps in shared memory."""

    def prune(configs, named_args, **kwargs):
        block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
        candidates = table[0] if 0 in table else table[min(d for d in table if d >= block_d)]
        if not INTERPRET:
            q = named_args["Q"]
            limit = triton.runtime.driver.active.utils.get_device_properties(q.device.index)["max_shared_mem"]
            candidates = [c for c in candidates if q.element_size() * tile_elements(
                c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], block_d, c.num_stages) <= limit] or FALLBACK_CONFIGS
        return autotune_candidates(candidates)

    return prune


def autotuned(kernel, table, tile_elements):
    """`kernel` autotuned over the configurations of `table` for its head dim (`_pruner`)."""
    configs = [c for entries in table.values() for c in entries] + FALLBACK_CONFIGS
    key = [name for name in ("BLOCK_D", "group", "HAS_SEQ_START", "IS_VARLEN", "USE_TMA", "tune_seqlen")
           if name in kernel.arg_names]  # the dK/dV kernel has no USE_TMA
    return triton.autotune(configs, key=key,
                           prune_configs_by={"early_config_prune": _pruner(table, tile_elements)})(kernel)


def tune_seqlen(max_seqlen):
    """The length class the autotuner keys on: the best tiles differ between short and long sequences, and one
    process may run both (a benchmark, prefill then training). Powers of two from 1k to 16k, so that a new length
    retunes at most five times per head dim; all of them divisible by 16, so the compiled code does not change."""
    return min(max(triton.next_power_of_2(max(int(max_seqlen), 1)), 1024), 16384)


def head_group(pruned, group, block_d, num_bh):
    """How many of the launch's `num_bh` (sequence, query head) pairs run their heavy blocks first together
    (`attention_triton._heaviest_first`). All of them: head by head, the heaviest blocks of the last heads start
    last, and the launch ends on them with SMs idle; that costs where heads differ in work (pruning), where programs
    are few per head (GQA: a dK/dV program loops over its group) and, measured on an H100, at head dim 64. At head dim
    128 and more without GQA, the K/V of all heads in flight at once (two pipeline stages to hide their misses) cost
    more: head by head was faster, and with pruning, pairs of heads kept most of the all-heads gain on the ACP gate
    mix while matching the unpruned speed on open gates (figures: benchmarks/NOTES_attention.md, "Figures from the
    kernel sources"); the pairs then come in the order of `acp.row_order`. The dK/dV launch takes the same count: its
    pairs are (sequence, KV head), no more than `num_bh`, and as many without GQA."""
    if group > 1 or block_d <= 64:
        return max(num_bh, 1)
    return 2 if pruned else 1
