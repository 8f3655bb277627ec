"""benchmarks/retrofit_study.py on a tiny LLaMA: recipes side by side, here two at the same time (`--gpus`, which
on a machine without CUDA runs each recipe's process on the CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finetune_args, save_llama_and_corpus

ROOT = Path(__file__).resolve().parents[1]
STUDY = str(ROOT / "benchmarks" / "retrofit_study.py")


def study(*arguments, cwd):
    return subprocess.run([sys.executable, STUDY, *arguments], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_recipes_run_at_the_same_time_and_land_in_one_record(tmp_path):
    root = save_llama_and_corpus(tmp_path)
    tiny = finetune_args(root, "unused", "--steps", "2", "--transfer-steps", "2", "--teacher-samples", "256",
                         "--no-needle", "--eval-docs", "2")
    done = study("--recipes", "default,no-kl", "--gpus", "0,1", "--minutes", "5", "--output-dir", str(root / "study"),
                 "--results", str(root / "results"), "--", *tiny, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = (root / "results").glob("retrofit_study_*_default__no-kl.json")
    record = json.loads(path.read_text())
    assert record["gpus"] == ["0", "1"] and set(record["runs"]) == {"default", "no-kl"}
    assert {run["gpu"] for run in record["runs"].values()} == {"0", "1"}
    assert "--kl-weight" in record["runs"]["no-kl"]["options"]
    for name, run in record["runs"].items():
        assert run["summary"]["training"]["steps"] == 2
        assert (root / "study" / name / "fine-tuned" / "model.safetensors").exists()
        assert "fine-tuning" in (root / "study" / f"{name}.log").read_text()
        assert f"| {name} | 2 (" in record["table"]  # steps, then each step's seconds


@pytest.mark.parametrize("gpus", ["0,0", "cuda:0"])
def test_gpus_that_are_not_distinct_indices_are_refused(tmp_path, gpus):
    done = study("--recipes", "default", "--gpus", gpus, cwd=tmp_path)
    assert done.returncode == 2 and "--gpus: give distinct CUDA device indices" in done.stderr
