import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import foxlm
from foxlm.benchmarks import BENCHMARKS
from foxlm.cli import main


def test_the_parser_and_help_import_neither_torch_nor_transformers():
    code = ("import sys, foxlm.cli; parser = foxlm.cli.build_parser(); parser.format_help(); "
            "print(sorted({'torch', 'transformers', 'triton'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_finetune_help_imports_neither_torch_nor_transformers():
    code = ("import sys, contextlib, io; from foxlm.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: main(['finetune', '--help'])\n"
            "    except SystemExit: pass\n"
            "assert '--transfer-steps' in out.getvalue() and '%%' not in out.getvalue()\n"
            "print(sorted({'torch', 'transformers', 'triton'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"foxlm {foxlm.__version__}\n"


def test_the_convert_defaults_are_the_converters():
    from foxlm import cli
    from foxlm.conversion import llama

    for name in ("GATE_INITS", "DEFAULT_GATE_INIT", "DEFAULT_GATE_BIAS", "DEFAULT_DECAY_TIMES", "SLOW_PAIRS",
                 "SLOWER_SLOW_PAIRS", "POSITION_MAPPED_SLOW_PAIRS"):
        assert getattr(cli, name) == getattr(llama, name), name


def test_demo_trains_saves_reloads_and_generates(tmp_path, capsys):
    main(["demo", "--output-dir", str(tmp_path / "demo"), "--steps", "3", "--batch-size", "2", "--context", "32",
          "--hidden-size", "32", "--layers", "1", "--new-tokens", "8"])
    out = capsys.readouterr().out
    assert "nats per byte" in out and "a file it did not train on" in out and "def " in out
    assert (tmp_path / "demo" / "modeling_fox.py").exists() and (tmp_path / "demo" / "config.json").exists()


def test_demo_refuses_to_overwrite_without_force(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(SystemExit, match="--force"):
        main(["demo", "--output-dir", str(tmp_path)])
    assert (tmp_path / "keep.txt").read_text() == "user data"


@pytest.fixture
def saved_models(tmp_path):
    """A tiny LLaMA and a tiny FoX saved with one byte-level tokenizer, and a folder of text documents."""
    from conftest import byte_tokenizer, tiny_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=256,
                                         eos_token_id=257, pad_token_id=257))
    fox = tiny_model(vocab_size=258, bos_token_id=256, eos_token_id=257, pad_token_id=257)
    for name, model in (("llama", llama), ("fox", fox)):
        model.save_pretrained(tmp_path / name)
        byte_tokenizer().save_pretrained(tmp_path / name)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"doc{i}.txt").write_text(f"class Thing{i}:\n    value = {i}\n" * (10 + 10 * i))
    return tmp_path


def test_eval_per_token_loss_compares_models_and_matches_the_library_function(saved_models, capsys):
    from foxlm.data import tokenize_documents
    from foxlm.evaluation import load_causal_lm, loss_and_predictions, top1_agreement

    out = saved_models / "eval"
    data = str(saved_models / "docs" / "*.txt")
    main(["eval", "per-token-loss", str(saved_models / "fox"), str(saved_models / "llama"), "--labels",
          "fox,llama", "--data", data, "--max-length", "200", "--train-context", "100", "--output-dir", str(out)])
    result = json.loads((out / "per_token_loss.json").read_text())
    assert (out / "per_token_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert result["reference"] == "fox" and list(result["domains"]) == [data]  # the first model is the reference
    # What was compared, and on what: the models by label, the device and the software.
    assert result["models"] == {"fox": str(saved_models / "fox"), "llama": str(saved_models / "llama")}
    assert result["run"]["device"] == "cpu" and result["run"]["transformers"] == transformers.__version__
    domain = result["domains"][data]
    assert set(domain["per_token_loss"]) == {"llama", "fox"} and domain["documents"] == 3
    assert list(domain["bands"]["fox"]) == ["0-100", "100-200"] and list(domain["agreement_bands"]) == ["llama"]
    # The CLI's curves are the library's on the same documents (longest first: all three here), tokenized by the
    # first MODEL's tokenizer.
    model, tokenizer = load_causal_lm(saved_models / "fox")
    docs = tokenize_documents(tokenizer, [(saved_models / "docs" / f"doc{i}.txt").read_text() for i in (2, 1, 0)],
                              add_bos=False, add_eos=False)
    expected, count, fox_predictions = loss_and_predictions(model, docs, 200)
    np.testing.assert_allclose(domain["per_token_loss"]["fox"], expected, rtol=1e-5)
    assert domain["documents_per_position"] == count.tolist()
    llama_predictions = loss_and_predictions(load_causal_lm(saved_models / "llama")[0], docs, 200)[2]
    agreement = top1_agreement(llama_predictions, fox_predictions)
    assert domain["agreement_bands"]["llama"]["0-100"] == pytest.approx(np.mean(agreement[:100]))
    table = capsys.readouterr().out
    assert "0-100" in table and "\nllama " in table and "top-1 agreement with fox" in table

    with pytest.raises(SystemExit, match="--force"):  # results are not replaced silently
        main(["eval", "per-token-loss", str(saved_models / "fox"), "--data", data, "--output-dir", str(out)])
    with pytest.raises(SystemExit, match="--labels"):
        main(["eval", "per-token-loss", str(saved_models / "fox"), "--labels", "a,b", "--output-dir",
              str(saved_models / "other")])
    with pytest.raises(SystemExit, match="--reference 'original' is none"):
        main(["eval", "per-token-loss", str(saved_models / "fox"), "--reference", "original", "--output-dir",
              str(saved_models / "other")])


def test_eval_per_token_loss_adds_the_reference_over_a_sliding_window(saved_models, capsys):
    out = saved_models / "eval-window"
    main(["eval", "per-token-loss", str(saved_models / "llama"), str(saved_models / "fox"), "--labels",
          "original,fox", "--data", str(saved_models / "docs" / "*.txt"), "--max-length", "200", "--train-context",
          "64", "--sliding-window", "64", "--output-dir", str(out)])
    domain = next(iter(json.loads((out / "per_token_loss.json").read_text())["domains"].values()))
    assert set(domain["per_token_loss"]) == {"original", "original, sliding window", "fox"}
    original, windowed = (np.array(domain["per_token_loss"][label], dtype=float)
                          for label in ("original", "original, sliding window"))
    np.testing.assert_allclose(windowed[:63], original[:63], rtol=1e-5)  # the first window sees what the whole does
    assert not np.allclose(windowed[64:], original[64:], rtol=1e-7, atol=0)
    assert "\noriginal, sliding window " in capsys.readouterr().out


def test_eval_needle_writes_a_score_grid_and_heatmap(saved_models):
    out = saved_models / "needle"
    main(["eval", "needle", str(saved_models / "fox"), "--data", str(saved_models / "docs" / "*.txt"),
          "--context-lengths", "400,800", "--depths", "0,1", "--output-dir", str(out)])
    result = json.loads((out / "needle.json").read_text())
    assert np.array(result["scores"]).shape == (2, 2) and 0.0 <= result["accuracy"] <= 1.0
    assert list(result["accuracy_by_context"]) == ["400", "800"]
    # Needles 0, 400 and 800 tokens before the question: two distance bands, 3 trials and 1.
    assert {band: r["trials"] for band, r in result["accuracy_by_distance"].items()} == {"0-512": 3, "512-1024": 1}
    assert np.array(result["answers"]).shape == (2, 2)  # what the model generated in each trial
    assert result["run"]["device"] == "cpu" and result["run"]["torch"] == torch.__version__
    assert (out / "needle.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_needle_in_several_haystacks_cut_one_after_another_from_the_data(saved_models, capsys):
    out, data = saved_models / "needles", str(saved_models / "docs" / "*.txt")
    main(["eval", "needle", str(saved_models / "fox"), "--data", data, "--context-lengths", "300", "--depths", "0,1",
          "--haystacks", "2", "--output-dir", str(out)])
    result = json.loads((out / "needle.json").read_text())
    assert result["haystacks"] == 2 and np.array(result["scores_by_haystack"]).shape == (2, 2, 1)
    np.testing.assert_allclose(result["scores"], np.mean(result["scores_by_haystack"], axis=0))
    assert "in 2 haystacks" in capsys.readouterr().out
    # One trial a batch: the same answers as the default's one batch of all four.
    main(["eval", "needle", str(saved_models / "fox"), "--data", data, "--context-lengths", "300", "--depths", "0,1",
          "--haystacks", "2", "--batch-tokens", "300", "--output-dir", str(out), "--force"])
    one_by_one = json.loads((out / "needle.json").read_text())
    assert one_by_one["answers_by_haystack"] == result["answers_by_haystack"]
    from foxlm.evaluation import NEEDLE_BATCH_TOKENS

    with pytest.raises(SystemExit):
        main(["eval", "needle", "--help"])
    assert f"(default: {NEEDLE_BATCH_TOKENS}, foxlm.evaluation.NEEDLE_BATCH_TOKENS)" in " ".join(
        capsys.readouterr().out.split())
    with pytest.raises(SystemExit, match="fewer than --haystacks 1000 x the longest of --context-lengths"):
        main(["eval", "needle", str(saved_models / "fox"), "--data", data, "--context-lengths", "300",
              "--haystacks", "1000", "--output-dir", str(saved_models / "too-many"), "--force"])


def test_eval_needle_cuts_its_haystack_from_held_out_prose_at_every_tenth_of_it_by_default(saved_models):
    out = saved_models / "needle-prose"
    main(["eval", "needle", str(saved_models / "fox"), "--context-lengths", "300,600", "--output-dir", str(out)])
    result = json.loads((out / "needle.json").read_text())
    assert result["data"] == "prose" and np.array(result["scores"]).shape == (11, 2)
    assert result["depths"] == [i / 10 for i in range(11)]


def test_eval_per_token_loss_packs_documents_to_the_full_length(saved_models):
    out = saved_models / "packed"
    data = str(saved_models / "docs" / "*.txt")
    main(["eval", "per-token-loss", str(saved_models / "fox"), "--data", data, "--pack", "--max-length", "128",
          "--num-docs", "4", "--output-dir", str(out)])
    result = json.loads((out / "per_token_loss.json").read_text())
    assert result["domains"][data]["documents"] == 4 and result["domains"][data]["documents_per_position"] == [4] * 127


def test_eval_per_token_loss_defaults_to_the_three_held_out_domains(saved_models, capsys):
    from foxlm.cli import build_parser

    assert build_parser().parse_args(["eval", "per-token-loss", "m"]).data == "code,docs,prose"
    out = saved_models / "domains"
    main(["eval", "per-token-loss", str(saved_models / "fox"), str(saved_models / "fox"), "--labels", "a,b",
          "--reference", "b", "--data", "stdlib,prose", "--max-length", "256", "--num-docs", "2", "--output-dir",
          str(out)])
    result = json.loads((out / "per_token_loss.json").read_text())
    assert result["data"] == "stdlib,prose" and list(result["domains"]) == ["stdlib", "prose"]
    for domain in result["domains"].values():
        assert domain["documents_per_position"] == [2] * 255 and domain["min_documents"] == 2
        assert domain["bands"]["a"]["0-256"] is not None  # two documents are all there is: none left out
        assert domain["agreement_bands"] == {"a": {"0-256": 1.0}}  # the same model agrees with itself
    assert "prose: top-1 agreement with b" in capsys.readouterr().out


def test_finetune_help_lists_the_example_script_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: foxlm finetune") and "--max-minutes" in out and "--eval-only" in out


def test_finetune_refuses_distillation_alone_without_a_kl_weight(capsys):
    from foxlm.finetune import parse_args

    assert parse_args(["--distill-only"]).distill_only
    with pytest.raises(SystemExit):
        parse_args(["--distill-only", "--kl-weight", "0"])
    assert "--distill-only" in capsys.readouterr().err


def test_finetune_packs_blocks_and_compiles_on_a_gpu_only_where_it_can(monkeypatch):
    import torch

    from foxlm.finetune import GPU_MICRO_BATCH, parse_args

    def resolved(*argv):
        args = parse_args(list(argv))
        return args.micro_batch_size, args.compile

    assert resolved() == (1, False)  # this machine: a CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolved() == (2, True)  # 2 blocks of 32k: the default step of 64k tokens, one pass
    assert resolved("--context", "16384") == (GPU_MICRO_BATCH, True)  # as many blocks as the step holds (4)
    assert resolved("--context", "65536", "--tokens-per-step", "65536") == (1, True)
    assert resolved("--micro-batch-size", "2", "--no-compile") == (2, False)
    assert resolved("--context-parallel", "2") == (1, False)  # one block per pass, eager, under context parallelism
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolved() == (1, False)


def test_other_commands_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--no-such-option"])
    assert "--no-such-option" in capsys.readouterr().err


def test_bench_lists_the_benchmarks_and_passes_options_to_their_modules(capfd):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capfd.readouterr().out
    assert "attention" in out and "kernel-resources" in out and "training" in out and "trainer-profile" in out
    main(["bench", "layer-ops", "--help"])  # in a new process, which writes to the file descriptors
    out = capfd.readouterr().out
    assert out.startswith("usage: bench_layer_ops.py") and "--tokens" in out
    with pytest.raises(SystemExit):
        main(["bench", "no-such-benchmark"])


def test_every_benchmarks_help_lists_its_options_without_importing_torch_transformers_or_triton():
    """`foxlm bench NAME --help` (and `python benchmarks/<module>.py --help`, the same launch) answers before the
    benchmark imports its libraries. Python's import-time report, which the benchmark's process inherits through the
    environment, names every module that either process imported."""
    for name, (module, _, _) in BENCHMARKS.items():
        done = subprocess.run([sys.executable, "-m", "foxlm.cli", "bench", name, "--help"], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}, timeout=60, check=True)
        imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                    if line.startswith("import time:")]
        assert imported.count("foxlm.benchmarks") == 2, done.stderr  # reported by foxlm's process and the benchmark's
        heavy = {"torch", "transformers", "triton"} & {package.split(".")[0] for package in imported}
        assert not heavy, f"`foxlm bench {name} --help` imported {sorted(heavy)}"
        source = (Path(foxlm.__file__).parent / "benchmarks" / f"{module}.py").read_text()
        options = re.findall(r'add_argument\("(--[a-z-]+)"', source)
        assert done.stdout.startswith(f"usage: {module}.py") and options, done.stdout
        assert all(option in done.stdout for option in options), (name, options)


def test_a_benchmark_runs_the_callers_foxlm_not_one_in_the_working_directory(tmp_path, monkeypatch, capfd):
    (tmp_path / "foxlm").mkdir()
    (tmp_path / "foxlm" / "__init__.py").write_text("raise ImportError('the working directory\'s foxlm')\n")
    monkeypatch.chdir(tmp_path)
    main(["bench", "training", "--help"])
    assert capfd.readouterr().out.startswith("usage: bench_training.py")


def test_a_benchmark_gets_its_environment_defaults_under_the_callers_settings(monkeypatch):
    calls = []

    def record(command, env):
        calls.append(env)
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(subprocess, "run", record)
    monkeypatch.delenv("FOXLM_AUTOTUNE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--parts", "attention"])
    assert exit_info.value.code == 3  # the benchmark's exit status is the command's
    monkeypatch.setenv("FOXLM_AUTOTUNE", "1")
    with pytest.raises(SystemExit):
        main(["bench", "decode"])
    assert [env["FOXLM_AUTOTUNE"] for env in calls] == ["0", "1"]


def test_the_config_sweep_refuses_to_run_without_autotuning(monkeypatch, capfd):
    monkeypatch.setenv("FOXLM_AUTOTUNE", "0")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "sweep-configs"])
    assert exit_info.value.code == 1 and "unset FOXLM_AUTOTUNE" in capfd.readouterr().err
