"""Every `foxlm` command ends a failure that is not a bug in foxlm with one line, `error: ...` and what to do, and a
non-zero exit; a traceback only with --debug."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foxlm.cli import main

from official_fox_format import official_config, write_official_checkpoint
from test_conversion import save_tiny


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Broken inputs beside a good tiny LLaMA."""
    root = tmp_path_factory.mktemp("inputs")
    save_tiny(root / "llama")
    weights = (root / "llama" / "model.safetensors").read_bytes()
    for name, content in (("truncated", weights[: len(weights) // 2]), ("corrupt", b"\x01" * len(weights))):
        save_tiny(root / name)
        (root / name / "model.safetensors").write_bytes(content)
    (root / "no-config").mkdir()
    (root / "no-config" / "model.safetensors").write_bytes(weights)
    config = official_config()
    write_official_checkpoint(root / "official-no-hidden-size", config)
    (root / "official-no-hidden-size" / "config.json").write_text(json.dumps(
        {key: value for key, value in config.items() if key != "hidden_size"}))
    write_official_checkpoint(root / "official-truncated", config)
    official_weights = next((root / "official-truncated").glob("*.safetensors"))
    official_weights.write_bytes(official_weights.read_bytes()[:100])
    write_official_checkpoint(root / "official-bad-json", config)
    (root / "official-bad-json" / "config.json").write_text("{not json")
    from conftest import byte_tokenizer, tiny_model

    tiny_model(vocab_size=258, bos_token_id=256, eos_token_id=257, pad_token_id=257).save_pretrained(root / "fox")
    byte_tokenizer().save_pretrained(root / "fox")
    (root / "docs").mkdir()
    (root / "docs" / "short.txt").write_text("a short document\n" * 10)
    return root


FAILURES = {  # name: (arguments, in which {root} is the fixture's folder, {out} a new output; what the line says)
    "truncated-safetensors": ("convert llama {root}/truncated {out}", "truncated or corrupt"),
    "corrupt-safetensors": ("convert llama {root}/corrupt {out}", "truncated or corrupt"),
    "missing-config": ("convert llama {root}/no-config {out}", "has no config.json"),
    "local-path-that-does-not-exist": ("convert llama {root}/gone/llama {out}", "does not exist"),
    "relative-path-that-does-not-exist": ("convert llama ./gone {out}", "does not exist"),
    "gguf-that-does-not-exist": ("convert llama {root}/model.gguf {out}", "does not exist"),
    "official-without-hidden-size": ("convert official {root}/official-no-hidden-size {out}", "hidden_size"),
    "official-truncated-safetensors": ("convert official {root}/official-truncated {out}", "truncated or corrupt"),
    "official-config-not-json": ("convert official {root}/official-bad-json {out}", "not valid JSON"),
    "official-folder-that-does-not-exist": ("convert official {root}/gone/deeper {out}", "neither a folder"),
    "output-is-a-file": ("convert llama {root}/llama {root}/llama/config.json", "is not a folder"),
    "decay-times-reversed": ("convert llama {root}/llama {out} --decay-times 512 2", "0 < MIN <= MAX"),
    "eval-model-that-does-not-exist": ("eval per-token-loss {root}/gone/model --output-dir {out}", "does not exist"),
    "eval-model-truncated": ("eval needle {root}/truncated --output-dir {out} --data {root}/*.txt",
                             "truncated or corrupt"),
    "eval-model-without-tokenizer": ("eval per-token-loss {root}/llama --output-dir {out}", "--tokenizer"),
    "eval-glob-matching-nothing": ("eval per-token-loss {root}/fox --data {root}/none/*.txt --output-dir {out}",
                                   "no files match"),
    "needle-haystack-too-short": ("eval needle {root}/fox --data {root}/docs/*.txt --context-lengths 100000 "
                                  "--output-dir {out}", "lower it or give more documents"),
    "demo-into-a-users-folder": ("demo --output-dir {root}/llama --force", "not written by foxlm"),
}


@pytest.mark.parametrize("name", FAILURES)
def test_failures_end_with_one_error_line(sources, tmp_path, name):
    arguments, says = FAILURES[name]
    with pytest.raises(SystemExit) as failure:
        main(arguments.format(root=sources, out=tmp_path / "out").split())
    message = str(failure.value)
    assert message.startswith("error: ") and "\n" not in message and says in message, message
    assert not (tmp_path / "out").exists()


ARGUMENT_ERRORS = {  # checked by the parser, before anything is loaded: usage, then one error line, exit 2
    "shard-size-garbage": ("convert llama {root}/llama {out} --max-shard-size garbage", "--max-shard-size"),
    "shard-size-zero": ("convert llama {root}/llama {out} --max-shard-size 0", "--max-shard-size"),
    "shard-size-negative": ("convert llama {root}/llama {out} --max-shard-size=-5MB", "--max-shard-size"),
    "gate-bias-nan": ("convert llama {root}/llama {out} --gate-bias nan", "--gate-bias"),
    "gate-bias-inf": ("convert llama {root}/llama {out} --gate-bias inf", "--gate-bias"),
    "max-length-zero": ("eval per-token-loss {root}/llama --max-length 0 --output-dir {out}", "--max-length"),
    "num-docs-zero": ("eval per-token-loss {root}/llama --num-docs 0 --output-dir {out}", "--num-docs"),
    "depth-out-of-range": ("eval needle {root}/llama --depths 0,2 --output-dir {out}", "--depths"),
    "context-length-zero": ("eval needle {root}/llama --context-lengths 0 --output-dir {out}", "--context-lengths"),
    "demo-steps-zero": ("demo --steps 0 --output-dir {out}", "--steps"),
    "demo-hidden-size": ("demo --hidden-size 40 --output-dir {out}", "--hidden-size"),
}


@pytest.mark.parametrize("name", ARGUMENT_ERRORS)
def test_bad_numbers_are_refused_by_the_parser(sources, tmp_path, capsys, name):
    arguments, option = ARGUMENT_ERRORS[name]
    with pytest.raises(SystemExit) as failure:
        main(arguments.format(root=sources, out=tmp_path / "out").split())
    assert failure.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: argument " + option in last, last
    assert not (tmp_path / "out").exists()


def run_foxlm(*arguments):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "foxlm.cli", *map(str, arguments)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_no_traceback_without_debug_and_one_with_it(sources, tmp_path):
    # A Hub id that is neither local nor cached (offline): the message says both were tried.
    done = run_foxlm("convert", "llama", "no-such-org/no-such-model", tmp_path / "out")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not read a model config from no-such-org/no-such-model (no local folder")
    done = run_foxlm("convert", "llama", sources / "truncated", tmp_path / "out", "--debug")
    assert done.returncode == 1 and "Traceback" in done.stderr and "SafetensorError" in done.stderr


def test_ctrl_c_ends_with_one_line_and_exit_130_and_a_traceback_only_with_debug(monkeypatch, capsys):
    import foxlm.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(foxlm.cli, "run_finetune", interrupted)
    with pytest.raises(SystemExit) as stop:
        main(["finetune"])
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    with pytest.raises(KeyboardInterrupt):
        main(["finetune", "--debug"])
