"""foxlm installed from a wheel, not run from its checkout: `foxlm finetune` and `foxlm bench` in a new virtual
environment, from a working directory outside the checkout."""

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from conftest import finetune_args, save_llama_and_corpus

from foxlm.benchmarks.run_record import _foxlm_source_digest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.install


def run(command, cwd):
    # Without PYTHONPATH, which may point at the checkout.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin folder, working directory) of a virtual environment where foxlm is a wheel built from this checkout; the
    other packages (torch, transformers, ...) are this interpreter's, nothing is downloaded."""
    pytest.importorskip("setuptools", minversion="70.1", reason="builds the wheel offline, without the wheel package")
    root = tmp_path_factory.mktemp("install")
    # The wheel is built from a copy of what it needs, so that setuptools' build/ and egg-info stay out of the
    # checkout and no stale build/ of it slips into the wheel.
    source = root / "source"
    shutil.copytree(ROOT / "foxlm", source / "foxlm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", "-w",
         root / "dist", source], cwd=root)
    (wheel,) = (root / "dist").glob("foxlm-*.whl")
    venv = root / "venv"
    # The base interpreter's pip installs into the environment (seen through --system-site-packages).
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=root)
    # Behind its own site-packages, this interpreter's: also those of a virtual environment it may be (CI's run on the
    # oldest transformers), which --system-site-packages alone would skip for the base interpreter's.
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    (site_packages / "outer_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", wheel], cwd=root)
    work = root / "work"
    work.mkdir()
    return venv / "bin", work


def test_the_environment_imports_the_installed_foxlm_with_the_checkouts_code_and_this_transformers(installed):
    bin_dir, work = installed
    code = ("import foxlm, transformers; from foxlm.benchmarks.run_record import _foxlm_source_digest as digest; "
            "print(foxlm.__file__, digest(), transformers.__version__)")
    location, digest, version = run([bin_dir / "python", "-c", code], cwd=work).split()
    assert version == transformers.__version__
    # Its own site-packages, ahead of the base's (where an editable install of a checkout may be).
    assert Path(location).resolve().is_relative_to((bin_dir.parent / "lib").resolve()), location
    assert not Path(location).resolve().is_relative_to(ROOT)
    assert digest == _foxlm_source_digest()  # every Python file of the package is in the wheel


def test_foxlm_finetune_runs_from_the_installed_package(installed):
    bin_dir, work = installed
    assert run([bin_dir / "foxlm", "finetune", "--help"], cwd=work).startswith("usage: foxlm finetune")
    save_llama_and_corpus(work)
    out = run([bin_dir / "foxlm", "finetune", *finetune_args(work, "run")], cwd=work)
    assert out.strip().splitlines()[-1] == f"plot: {work / 'run' / 'evaluation.png'}"
    for name in ("converted/config.json", "adapter/adapter_model.safetensors", "fine-tuned/model.safetensors",
                 "train_log.json", "evaluation.png", "evaluation.json", "summary.json"):
        assert (work / "run" / name).exists(), name


def test_foxlm_bench_runs_from_the_installed_package_and_writes_to_the_working_directory(installed):
    bin_dir, work = installed
    listing = run([bin_dir / "foxlm", "bench", "--help"], cwd=work)
    assert "training" in listing and "kernel-resources" in listing
    run([bin_dir / "foxlm", "bench", "training", "--sizes", "tiny", "--contexts", "64", "--models", "fox-llama",
         "--checkpointing", "off", "--acp", "off", "--compile", "none", "--tokens-per-step", "64", "--warmup", "1",
         "--steps", "1"], cwd=work)
    (path,) = work.glob("training_cpu_*.json")
    record = json.loads(path.read_text())
    assert [row["model"] for row in record["rows"]] == ["fox-llama"] and record["rows"][0]["tokens_per_s"] > 0
    assert "foxlm_commit" not in record  # installed: no checkout, no commit
