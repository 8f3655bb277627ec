"""Faults while foxlm saves: a SIGKILL at each stage of `foxlm convert` and `foxlm finetune` saves (a subprocess that
tests/fault_injection_worker.py kills at the chosen moment), a full disk and a read-only folder (injected OSErrors).
Each leaves the previous output as it was (or, killed after the final rename, the new one complete), and the next
run leaves no staging behind."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finetune_args, save_llama_and_corpus
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from foxlm.cli import main as foxlm
from foxlm.outputs import clean_stale_staging

from test_conversion import save_tiny

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "fault_injection_worker.py"


def killed(moment, *arguments):
    """Run `foxlm ARGUMENTS` in a new process that SIGKILLs itself at `moment` (see the worker)."""
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(WORKER), moment, *map(str, arguments)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, f"exit {done.returncode}: {done.stderr[-3000:]}"


def files(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def staging(folder):
    """What foxlm staged under `folder` and left there."""
    return sorted(str(p) for p in Path(folder).rglob("*") if any(f".foxlm-{kind}." in p.name
                                                                  for kind in ("staging", "replaced")))


@pytest.mark.parametrize("moment", ["half-written", "staged", "swapped", "gap"])
def test_a_conversion_killed_while_saving_leaves_a_whole_model_and_the_next_run_cleans_up(tmp_path, moment):
    save_tiny(tmp_path / "llama")
    out = tmp_path / "out-model"
    foxlm(["convert", "llama", str(tmp_path / "llama"), str(out)])
    previous = files(out)
    foxlm(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "new"), "--keep-rope"])
    new = files(tmp_path / "new")

    where = ".out-model.foxlm-staging" if moment == "half-written" else "out-model"
    killed(f"{moment}:{where}", "convert", "llama", tmp_path / "llama", out, "--force", "--keep-rope")
    if moment == "gap":  # the previous model was moved aside: any next run puts it back first
        assert not out.exists()
        clean_stale_staging(tmp_path)
    if moment == "swapped":  # the new model is complete in place; the previous one waits under a staging name
        without_card = lambda snapshot: {k: v for k, v in snapshot.items() if k != "README.md"}  # noqa: E731
        assert without_card(files(out)) == without_card(new)
    else:
        assert files(out) == previous

    foxlm(["convert", "llama", str(tmp_path / "llama"), str(out), "--force"])
    assert json.loads((out / "config.json").read_text())["use_rope"] is False
    assert staging(tmp_path) == []


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny fine-tuning run (2 steps, a checkpoint each) that ended: the previous output of the runs killed below."""
    root = save_llama_and_corpus(tmp_path_factory.mktemp("faults"))
    foxlm(["finetune", *finetune_args(root, "finished", "--steps", "2", "--save-steps", "1", "--skip-eval")])
    return root


# (moment, name, outputs saved before that moment): each kills `--resume --steps 4` of a copy of the finished run.
FINETUNE_MOMENTS = [
    ("half-written:checkpoint-3/optimizer.pt", "checkpoint", []),  # Trainer's own checkpoint, cut short
    ("half-written:.adapter.foxlm-staging", "adapter", []),
    ("half-written:.fine-tuned.foxlm-staging", "merged", ["adapter"]),
    ("staged:fine-tuned", "merged-staged", ["adapter"]),
    ("file:train_log.json", "train-log", ["adapter", "fine-tuned"]),
]
OUTPUTS = ["converted", "adapter", "fine-tuned", "train_log.json"]


@pytest.mark.parametrize("moment, name, saved", FINETUNE_MOMENTS, ids=[name for _, name, _ in FINETUNE_MOMENTS])
def test_a_finetune_killed_while_saving_leaves_whole_models_and_resumes_cleanly(finished_run, moment, name, saved):
    root = finished_run
    run = root / name
    shutil.copytree(root / "finished", run)
    previous = files(run)
    arguments = finetune_args(root, name, "--steps", "4", "--save-steps", "1", "--skip-eval", "--resume")
    killed(moment, "finetune", *arguments)
    after = files(run)
    for output in OUTPUTS:  # as before, or (saved before the kill) replaced whole
        kept = {path: data for path, data in previous.items() if path.split("/")[0] == output}
        now = {path: data for path, data in after.items() if path.split("/")[0] == output}
        assert (now != kept) == (output in saved), output
        if output in saved:
            assert ".foxlm-output" in {Path(path).name for path in now}
            safetensors = [path for path in now if path.endswith(".safetensors")]
            assert safetensors and all(load_file(run / path) for path in safetensors)
    if name == "checkpoint":
        assert all(after[path] == data for path, data in previous.items() if path.startswith("checkpoints/"))

    foxlm(["finetune", *arguments])  # the next run: resumes from the last complete checkpoint
    assert staging(run) == [] and staging(root) == []
    checkpoints = list((run / "checkpoints").iterdir())
    assert checkpoints and all((c / "trainer_state.json").exists() for c in checkpoints)
    history = json.loads((run / "train_log.json").read_text())
    steps = [entry["step"] for entry in history if "loss" in entry]
    assert steps[:4] == [1, 2, 3, 4] and steps == list(range(1, len(steps) + 1))  # one history, no step twice
    AutoModelForCausalLM.from_pretrained(run / "fine-tuned")


def test_evaluation_results_killed_while_written_stay_whole(finished_run):
    root = finished_run
    out = root / "eval"
    arguments = ["eval", "per-token-loss", root / "finished" / "fine-tuned", "--data", root / "corpus" / "*.txt",
                 "--max-length", "64", "--num-docs", "2", "--output-dir", out]
    foxlm(list(map(str, arguments)))
    previous = files(out)
    killed("file:per_token_loss.json", *arguments, "--force")
    assert {path: data for path, data in files(out).items() if ".foxlm-staging." not in path} == previous
    foxlm(list(map(str, [*arguments, "--force"])))
    assert staging(out) == [] and json.loads((out / "per_token_loss.json").read_text())["domains"][
        str(root / "corpus" / "*.txt")]["documents"] == 2


def test_a_full_disk_while_saving_the_fine_tuned_model_keeps_the_previous_one(finished_run, monkeypatch, capsys):
    root = finished_run
    run = root / "disk-full"
    shutil.copytree(root / "finished", run)
    previous = files(run / "fine-tuned")
    from transformers import modeling_utils

    write = modeling_utils.safe_save_file

    def full_disk(tensors, path, *args, **kwargs):
        if ".fine-tuned.foxlm-staging" in str(path):
            Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write(tensors, path, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", full_disk)
    with pytest.raises(SystemExit) as failure:
        foxlm(["finetune", *finetune_args(root, "disk-full", "--steps", "3", "--skip-eval", "--resume")])
    message = str(failure.value)
    assert message.startswith("error: no space left on the device") and "\n" not in message
    assert files(run / "fine-tuned") == previous and staging(run) == []


def test_a_read_only_output_folder_is_an_error_line_and_changes_nothing(tmp_path, monkeypatch):
    save_tiny(tmp_path / "llama")
    out = tmp_path / "fox"
    foxlm(["convert", "llama", str(tmp_path / "llama"), str(out)])
    previous = files(out)
    mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):  # what a read-only mount answers (root ignores permission bits)
        if self.parent == tmp_path:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(SystemExit) as failure:
        foxlm(["convert", "llama", str(tmp_path / "llama"), str(out), "--force"])
    message = str(failure.value)
    assert message.startswith("error: cannot write") and "Read-only file system" in message and "\n" not in message
    assert files(out) == previous and staging(tmp_path) == []
