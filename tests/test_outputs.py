"""The output policy of every foxlm command that writes (foxlm/outputs.py): refuse what exists unless --force,
--force only over what foxlm wrote, staged saves renamed into place, stale staging of dead processes cleaned."""

import errno
import json
import os
import subprocess
import sys

import pytest
from conftest import finetune_args, save_llama_and_corpus

from foxlm import outputs
from foxlm.cli import main as foxlm
from foxlm.outputs import (MARKER, OutputError, clean_stale_staging, last_complete_checkpoint, staged_folder,
                           write_file_atomic)


def dead_pid():
    """The id of a process that has ended (and been reaped)."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def staged_name(target, kind, pid, host=outputs._HOST):
    return f".{target}.foxlm-{kind}.{host}.{pid}.0badc0de"


def test_stale_staging_of_dead_processes_is_removed_and_an_interrupted_swap_undone(tmp_path):
    dead = dead_pid()
    left = {name: tmp_path / staged_name(name, "staging", dead) for name in ("fox", "results.json")}
    left["fox"].mkdir()
    (left["fox"] / "model.safetensors").write_bytes(b"half")
    left["results.json"].write_text("{")
    aside = tmp_path / staged_name("earlier", "replaced", dead)  # moved aside, its replacement never renamed in
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    alive = tmp_path / staged_name("busy", "staging", os.getpid())
    other_host = tmp_path / staged_name("remote", "staging", dead, host="another-machine")
    alive.mkdir(), other_host.mkdir()
    clean_stale_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, other_host.name, "earlier"])
    assert (tmp_path / "earlier" / "config.json").read_text() == "{}"


def test_a_killed_conversion_leaves_nothing_the_next_conversion_does_not_clean(tmp_path):
    from test_conversion import save_tiny

    save_tiny(tmp_path / "llama")
    stale = tmp_path / staged_name("fox", "staging", dead_pid())
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)  # was: a hidden 92 MB .fox.converting-* forever
    foxlm(["convert", "llama", str(tmp_path / "llama"), str(tmp_path / "fox")])
    assert not stale.exists() and (tmp_path / "fox" / MARKER).exists()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_a_staged_folder_replaces_only_a_folder_foxlm_wrote(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    with staged_folder(tmp_path / "out") as staging:
        (staging / "a.txt").write_text("first")
    with pytest.raises(OutputError, match="--force"):
        with staged_folder(tmp_path / "out"):
            pytest.fail("staged over an existing output without force")
    with staged_folder(tmp_path / "out", force=True) as staging:
        (staging / "b.txt").write_text("second")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "b.txt"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user data")
    with pytest.raises(OutputError, match="not written by foxlm"):
        with staged_folder(tmp_path / "mine", force=True):
            pass
    with pytest.raises(RuntimeError):
        with staged_folder(tmp_path / "out", force=True) as staging:
            (staging / "c.txt").write_text("third")
            raise RuntimeError("crash while saving")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MARKER, "b.txt"]


def test_atomic_files_are_whole_and_readable_by_others(tmp_path, monkeypatch):
    umask = os.umask(0o022)
    try:
        write_file_atomic(tmp_path / "r.json", "{}")
    finally:
        os.umask(umask)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644
    def full_disk(descriptor):  # the disk fills while the new content is flushed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_file_atomic(tmp_path / "r.json", "{\"new\": 1}")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"] and (tmp_path / "r.json").read_text() == "{}"


def test_resume_takes_the_last_complete_checkpoint_and_drops_ones_cut_short(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
    assert not (tmp_path / "checkpoint-6").exists() and (tmp_path / "checkpoint-2").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return save_llama_and_corpus(tmp_path_factory.mktemp("policy"))


def test_rerunning_finetune_refuses_unless_resume_or_force_and_force_replaces_only_its_own_run(corpus, capsys):
    # Before, a second run with the same --output-dir overwrote fine-tuned/ and deleted the last checkpoint.
    run = corpus / "run"
    foxlm(["finetune", *finetune_args(corpus, "run", "--steps", "2", "--skip-eval")])
    earlier = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as refused:
        foxlm(["finetune", *finetune_args(corpus, "run", "--steps", "2", "--skip-eval")])
    message = str(refused.value)
    assert message.startswith("error: ") and "\n" not in message
    assert all(option in message for option in ("--resume", "--force", "--eval-only", "--output-dir"))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == earlier
    with pytest.raises(SystemExit, match="give one of them"):
        foxlm(["finetune", *finetune_args(corpus, "run", "--force", "--resume")])

    foxlm(["finetune", *finetune_args(corpus, "run", "--steps", "1", "--skip-eval", "--force")])
    assert "removed the earlier run" in capsys.readouterr().out
    history = json.loads((run / "train_log.json").read_text())
    assert [entry["step"] for entry in history if "loss" in entry] == [1]  # a new run, not the earlier one resumed
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["checkpoint-1"]
    assert not [p for p in corpus.iterdir() if ".foxlm-" in p.name]

    (corpus / "mine").mkdir()
    (corpus / "mine" / "notes.txt").write_text("user data")
    with pytest.raises(SystemExit, match="not written by foxlm"):
        foxlm(["finetune", *finetune_args(corpus, "mine", "--steps", "1", "--skip-eval", "--force")])
    assert (corpus / "mine" / "notes.txt").read_text() == "user data"


def test_finetune_writes_a_card_in_every_model_folder(corpus):
    run = corpus / "cards"
    foxlm(["finetune", *finetune_args(corpus, "cards", "--steps", "2", "--skip-eval")])
    for folder in ("converted", "adapter", "fine-tuned"):
        card = (run / folder / "README.md").read_text()
        assert str(corpus) not in card and "pip install foxlm" not in card and "examples/" not in card, folder
        assert (run / folder / MARKER).exists()
    card = (run / "fine-tuned" / "README.md").read_text()
    assert "LoRA of rank 4" in card and "2 optimizer steps of 256 tokens" in card and "`llama`" in card
    assert "Conversion check: all" in card and "Training loss" in card and "at step 2" in card
    assert "library_name: peft" in (run / "adapter" / "README.md").read_text()


def test_eval_replaces_only_result_files_foxlm_wrote(tmp_path):
    from foxlm.evaluation import write_json

    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("user data")
    (out / "needle.json").write_text("{}")  # the user's, not foxlm's
    write_json({"accuracy": 1.0}, out / "per_token_loss.json")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="is a file"):
        foxlm(["eval", "needle", "some-model", "--output-dir", str(tmp_path / "file")])
    with pytest.raises(SystemExit, match="needle.json exists; pass --force"):
        foxlm(["eval", "needle", "some-model", "--output-dir", str(out)])
    with pytest.raises(SystemExit, match="needle.json was not written by foxlm"):
        foxlm(["eval", "needle", "some-model", "--output-dir", str(out), "--force"])
    assert (out / "notes.txt").read_text() == "user data" and (out / "needle.json").read_text() == "{}"
    assert outputs.check_result_files(out, ["per_token_loss.json"], force=True) == [out / "per_token_loss.json"]


def test_demo_saves_a_whole_model_folder_with_a_card_and_replaces_only_its_own(tmp_path):
    arguments = ["demo", "--steps", "2", "--batch-size", "1", "--context", "16", "--hidden-size", "32", "--layers",
                 "1", "--new-tokens", "2", "--output-dir", str(tmp_path / "demo")]
    foxlm(arguments)
    card = (tmp_path / "demo" / "README.md").read_text()
    assert "2 AdamW steps" in card and "Training loss" in card and (tmp_path / "demo" / MARKER).exists()
    foxlm([*arguments, "--force"])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("user data")
    with pytest.raises(SystemExit, match="not written by foxlm"):
        foxlm([*arguments[:-1], str(tmp_path / "mine"), "--force"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo", "mine"]
