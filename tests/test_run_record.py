"""foxlm.benchmarks.run_record: the metadata and file of every benchmark's results."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import foxlm
from foxlm.benchmarks import run_record


def test_a_record_names_its_device_software_and_commit_and_is_written_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/bench_attention.py", "--quick"])
    monkeypatch.setenv("FOXLM_AUTOTUNE", "0")
    record = run_record.new_record(rows=[1, 2])
    assert record["device"] == "cpu" and record["rows"] == [1, 2]
    assert record["command"] == "bench_attention.py --quick" and record["environment"]["FOXLM_AUTOTUNE"] == "0"
    assert {"date", "python", "torch", "transformers"} <= set(record)
    assert len(record["foxlm_source_sha256"]) == 16 and int(record["foxlm_source_sha256"], 16) >= 0
    checkout = Path(foxlm.__file__).resolve().parents[1]
    if shutil.which("git") and (checkout / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                              text=True).stdout.strip()
        assert record["foxlm_commit"].split("-")[0] == head

    path = run_record.record_path(str(tmp_path / "results"), "attention", record)
    assert Path(path).name.startswith("attention_cpu_2") and path.endswith(".json")
    run_record.write_record(path, record)
    assert json.loads(Path(path).read_text()) == record
    assert [p.name for p in (tmp_path / "results").iterdir()] == [Path(path).name]  # no temporary file left


def test_results_go_to_benchmarks_results_of_the_checkout_that_foxlm_runs_from():
    checkout = Path(foxlm.__file__).resolve().parents[1]
    if not (checkout / "pyproject.toml").is_file():
        pytest.skip("foxlm is installed here, not run from its checkout (tests/test_install.py runs an installed one)")
    assert Path(run_record.RESULTS_DIR) == checkout / "benchmarks" / "results"


FIXED_NAME_SCRIPTS = ["corpus_tokens.py", "gate_init_smollm2.py", "partial_rope_smollm2.py", "slow_pairs_needle.py",
                      "transfer_smollm2.py"]


@pytest.mark.parametrize("script", FIXED_NAME_SCRIPTS)
def test_a_benchmark_that_writes_a_fixed_name_keeps_an_existing_result_unless_forced(script, tmp_path):
    """Refused at once, before the model loads, with the file as it was; --force is the way to replace it."""
    path = Path(foxlm.__file__).resolve().parents[1] / "benchmarks" / script
    if not path.is_file():
        pytest.skip("the benchmarks are not beside this foxlm")
    existing = tmp_path / "result.json"
    existing.write_text("an earlier result")
    done = subprocess.run([sys.executable, str(path), "--output", str(existing)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and f"--output {existing} exists already: pass --force" in done.stderr
    assert existing.read_text() == "an earlier result"


def test_refuse_existing_output_lets_a_new_path_or_force_through(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    run_record.refuse_existing_output(parser, tmp_path / "new.json", force=False)
    (tmp_path / "old.json").write_text("{}")
    run_record.refuse_existing_output(parser, tmp_path / "old.json", force=True)
    with pytest.raises(SystemExit):
        run_record.refuse_existing_output(parser, tmp_path / "old.json", force=False)
