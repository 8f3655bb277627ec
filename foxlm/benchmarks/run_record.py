"""The record every benchmark writes: one JSON file per run, `<kind>_<device>_<UTC date-time>.json` in `--out`
(`RESULTS_DIR` by default: benchmarks/results where foxlm runs from its source checkout, else the working directory),
that starts with what the run measured on: the device, the software versions, the command line and the FOXLM_*
environment, a digest of the foxlm sources that ran and, from a git checkout, the foxlm commit (marked `-dirty` with
uncommitted changes). The digest identifies the code even where the commit cannot: a copied tree may carry a stale
`.git`. The few benchmarks that write to a fixed name instead (`--output`) keep an existing file there unless given
--force (`add_output_arguments`, `refuse_existing_output`)."""

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # foxlm/
_ROOT = PACKAGE.parent
# The source checkout foxlm runs from (an editable install or PYTHONPATH), or None where it is installed.
CHECKOUT = _ROOT if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "benchmarks").is_dir() else None
RESULTS_DIR = str(CHECKOUT / "benchmarks" / "results") if CHECKOUT else os.curdir


def new_record(**fields):
    """The run's device and software, then `fields`."""
    import torch  # here, not at the top: the benchmarks read RESULTS_DIR for their --help, which does not wait for it

    record = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # What ran, with its options and the environment switches that change the kernels.
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "environment": {name: value for name, value in os.environ.items() if name.startswith("FOXLM_")},
    }
    for package in ("triton", "transformers"):
        try:
            record[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    record["foxlm_source_sha256"] = _foxlm_source_digest()
    commit = _foxlm_commit()
    if commit:
        record["foxlm_commit"] = commit
    record.update(fields)
    return record


def record_path(out_dir, kind, record):
    """`<out_dir>/<kind>_<device>_<YYYYmmdd-HHMM>.json`, the time being the record's (UTC)."""
    stamp = datetime.datetime.fromisoformat(record["date"]).strftime("%Y%m%d-%H%M")
    return os.path.join(out_dir, f"{kind}_{record['device'].replace(' ', '_')}_{stamp}.json")


def add_output_arguments(parser, default, what="the JSON record"):
    """--output (`default` unless given) and --force, for a benchmark that writes to a path of fixed name: its
    earlier result there is kept unless the user asks for it to be replaced (`refuse_existing_output`)."""
    parser.add_argument("--output", default=default, help=f"{what} (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace --output where it exists already")


def refuse_existing_output(parser, path, force):
    """Exit with a usage error, before any work, when `path` exists and --force was not given."""
    if not force and os.path.exists(path):
        parser.error(f"--output {path} exists already: pass --force to replace it, or give another --output")


def write_record(path, record):
    """Writes through a staged file renamed into place (`foxlm.outputs`), so that a run stopped mid-write never leaves
    half a JSON file."""
    from ..outputs import write_file_atomic

    write_file_atomic(path, json.dumps(record, indent=1))


def _foxlm_source_digest():
    """sha256 of the package's Python files (paths and contents), the first 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _foxlm_commit():
    if CHECKOUT is None:  # installed: whatever repository holds site-packages is not foxlm's
        return None
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (a copied tree)
        return None
