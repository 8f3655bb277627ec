"""benchmarks/kernel_resources.py compiles a kernel for sm_90 on a machine without a GPU and reads its resources and
the length of its main loop."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"


def test_reports_registers_spills_and_shared_memory_of_the_default_forward_configuration():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--head-dim", "64", "--kernels", "fwd", "--first-only"],
                         capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| fwd |")]
    assert len(rows) == 1, out
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    registers, spill, shared = (float(cell) for cell in cells[6:9])
    instructions, local_memory = (int(x) for x in re.findall(r"\d+", cells[9]))
    assert 0 < registers <= 255 and spill >= 0 and shared > 0 and instructions > 100 and local_memory >= 0


def test_refuses_to_run_in_the_interpreter():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert result.returncode != 0 and "unset TRITON_INTERPRET" in result.stderr


def test_pruning_leaves_the_main_loops_of_the_forward_and_dq_passes_as_short_as_without():
    """ACP computes the first kept key block at run time. Unless the compiler knows that bound is non-negative, the
    pruned dQ pass's main loop recomputes 64-bit addresses and grows by a quarter at D128 (sm_90), a cost paid even
    when nothing is pruned."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--head-dim", "128", "--kernels", "fwd", "dq", "--first-only",
                          "--prune"], capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    loops = {}
    for row in out.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if cells[0] in ("fwd", "dq"):
            loops[cells[0], cells[5] == "True"] = int(cells[-1].split()[0])
    assert len(loops) == 4, out
    for kernel in ("fwd", "dq"):
        assert loops[kernel, True] <= 1.02 * loops[kernel, False], (kernel, loops)
