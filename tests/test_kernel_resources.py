"""benchmarks/kernel_resources.py compiles a kernel for sm_90 on a machine without a GPU and reads its resources."""

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
    registers, spill, shared = (float(x) for x in re.findall(r"[\d.]+", rows[0].split("|", 7)[-1]))
    assert 0 < registers <= 255 and spill >= 0 and shared > 0


def test_refuses_to_run_in_the_interpreter():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=120)
    assert result.returncode != 0 and "unset TRITON_INTERPRET" in result.stderr
