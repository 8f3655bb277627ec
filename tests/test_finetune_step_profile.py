"""benchmarks/finetune_step_profile.py on a tiny LLaMA, on the CPU: the labelled parts of a fine-tuning step."""

import gzip
import json
import sys
from pathlib import Path

import pytest
from conftest import finetune_args, save_llama_and_corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from finetune_step_profile import main as profile  # noqa: E402

sys.path.pop(0)


def test_a_profiled_finetune_reports_its_step_time_and_labelled_parts(tmp_path):
    root = save_llama_and_corpus(tmp_path)
    options = finetune_args(root, "run", "--steps", "6", "--transfer-steps", "2", "--teacher-samples", "256",
                            "--skip-eval")
    profile(["--profile-steps", "2", "--keep-trace", "--out", str(tmp_path / "results"), "--", *options])
    [path] = (tmp_path / "results").glob("finetune_step_profile_cpu_*.json")
    result = json.loads(path.read_text())
    assert result["step_s"] > 0 and result["profiled_steps"] == 2 and "--" not in result["finetune_args"]
    assert set(result["per_step"]) == {"teacher forward", "student forward", "loss head"}
    assert all(part["host_ms"] > 0 and "gpu_span_ms" not in part for part in result["per_step"].values())
    assert len(result["top_cpu_ms_per_step"]) == 15
    with gzip.open(path.with_suffix(".trace.json.gz"), "rt") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert {"teacher forward", "student forward", "loss head"} <= names
    assert (root / "run" / "fine-tuned" / "model.safetensors").exists()


def test_too_few_steps_to_profile_are_named(tmp_path):
    root = save_llama_and_corpus(tmp_path)
    with pytest.raises(SystemExit, match="give --steps of at least 6"):
        profile(["--profile-steps", "2", "--out", str(tmp_path), "--",
                 *finetune_args(root, "short", "--steps", "3", "--transfer-steps", "0", "--teacher-samples", "0",
                                "--skip-eval")])
