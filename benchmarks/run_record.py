"""The record every benchmark writes: one JSON file per run, `<kind>_<device>_<UTC date-time>.json` in
benchmarks/results (or `--out`), that starts with what the run measured on: the device, the software versions and,
from a git checkout, the foxlm commit (marked `-dirty` with uncommitted changes)."""

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def new_record(**fields):
    """The run's device and software, then `fields`."""
    record = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("triton", "transformers"):
        try:
            record[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    commit = _foxlm_commit()
    if commit:
        record["foxlm_commit"] = commit
    record.update(fields)
    return record


def record_path(out_dir, kind, record):
    """`<out_dir>/<kind>_<device>_<YYYYmmdd-HHMM>.json`, the time being the record's (UTC)."""
    stamp = datetime.datetime.fromisoformat(record["date"]).strftime("%Y%m%d-%H%M")
    return os.path.join(out_dir, f"{kind}_{record['device'].replace(' ', '_')}_{stamp}.json")


def write_record(path, record):
    """Writes through a temporary file, so that a run stopped mid-write never leaves half a JSON file."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(partial, path)


def _foxlm_commit():
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (a copied tree)
        return None
