"""foxlm's benchmarks, modules of the package so that an installed foxlm has them: `foxlm bench NAME [options]` runs
one (in a source checkout `python benchmarks/<module>.py [options]` does the same). Each writes a JSON record to
`--out`: benchmarks/results where foxlm runs from its source checkout, else the working directory (`run_record`).
Each parses its options (`parse_args`) before it imports torch, triton or transformers, so that `--help` answers at
once (tests/test_cli.py checks it)."""

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = {  # `foxlm bench NAME`: module of this package, what it measures, environment defaults it runs with
    "attention": ("bench_attention", "attention kernel vs SDPA cuDNN/flash, ACP rows (GPU)", {}),
    # Prefill takes the training kernel's first config, no autotuning.
    "decode": ("bench_decode", "decode attention bandwidth, generate() and batch-serving tokens/s vs LLaMA (GPU)",
               {"FOXLM_AUTOTUNE": "0"}),
    "training": ("bench_training", "training tokens/s and memory vs LlamaForCausalLM (GPU)", {}),
    "layer-ops": ("bench_layer_ops", "fused QK-norm, output norm+gate and token shift vs PyTorch (GPU)", {}),
    "kernel-resources": ("kernel_resources", "registers and spills of every kernel config (no GPU needed)", {}),
    "sweep-configs": ("sweep_attention_configs", "time candidate kernel launch configurations (GPU)", {}),
    "trainer-profile": ("trainer_step_profile", "how busy the GPU is in a Trainer step, kernels per step (GPU)", {}),
}

def comma_list(text):
    """An option type the benchmarks share: comma-separated items (no torch needed, for their --help)."""
    return [item for item in text.split(",") if item]


def comma_integers(text):
    return [int(item) for item in comma_list(text)]


# Run by `run` in a new interpreter: the working directory, first on the path of `python -c`, gives way to the folder
# of the foxlm that called it (unless that folder is on the path already: site-packages stays behind the standard
# library), so that both run the same foxlm.
_LAUNCH = ("import runpy, sys; root = {root!r}; sys.path[:1] = [] if root in sys.path[1:] else [root]; "
           "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def run(name, argv):
    """Run benchmark `name` with the command-line options `argv` and return its exit status.

    It runs in a new Python process because foxlm's kernels read their settings (FOXLM_AUTOTUNE) from the environment
    when foxlm is imported, which the caller has done already; the benchmark's defaults go into the new process's
    environment, where the caller's own settings win.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    module, _, environment = BENCHMARKS[name]
    code = _LAUNCH.format(root=str(Path(__file__).resolve().parents[2]), module=f"{__name__}.{module}")
    return subprocess.run([sys.executable, "-c", code, *argv], env={**environment, **os.environ}).returncode
