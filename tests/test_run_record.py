"""benchmarks/run_record.py: the metadata and file of every benchmark's results."""

import json
import shutil
import subprocess
from pathlib import Path

from conftest import load_script

RUN_RECORD = Path(__file__).resolve().parents[1] / "benchmarks" / "run_record.py"


def test_a_record_names_its_device_software_and_commit_and_is_written_whole(tmp_path):
    run_record = load_script(RUN_RECORD)
    record = run_record.new_record(rows=[1, 2])
    assert record["device"] == "cpu" and record["rows"] == [1, 2]
    assert {"date", "python", "torch", "transformers"} <= set(record)
    assert len(record["foxlm_source_sha256"]) == 16 and int(record["foxlm_source_sha256"], 16) >= 0
    checkout = RUN_RECORD.parents[1]
    if shutil.which("git") and (checkout / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                              text=True).stdout.strip()
        assert record["foxlm_commit"].split("-")[0] == head

    path = run_record.record_path(str(tmp_path / "results"), "attention", record)
    assert Path(path).name.startswith("attention_cpu_2") and path.endswith(".json")
    run_record.write_record(path, record)
    assert json.loads(Path(path).read_text()) == record
    assert [p.name for p in (tmp_path / "results").iterdir()] == [Path(path).name]  # no temporary file left
