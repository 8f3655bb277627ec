"""`foxlm finetune` (foxlm/finetune.py; also examples/finetune_long_context.py): convert, fine-tune, save, evaluate,
plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import byte_tokenizer, finetune_args, kill_after_checkpoint, save_llama_and_corpus
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from foxlm import FoxForCausalLM, distillation

from foxlm.cli import main as foxlm
from foxlm.distillation import DistillationTrainer
from foxlm.data import split_files, text_files

LABELS = {"original (RoPE)", "original, sliding window", "converted, before fine-tuning", "converted, fine-tuned",
          "converted, fine-tuned, sliding window"}


@pytest.fixture(scope="module")
def llama_and_corpus(tmp_path_factory):
    root = save_llama_and_corpus(tmp_path_factory.mktemp("finetune"))
    train, held_out = split_files(text_files(str(root / "corpus" / "*.txt")))
    assert len(train) >= 6 and len(held_out) >= 2
    return root


def test_foxlm_finetune_converts_finetunes_with_lora_saves_and_evaluates(llama_and_corpus, capsys, monkeypatch):
    from foxlm import training

    root = llama_and_corpus
    compiled, compile_parts = [], training.compile_layer_parts
    # --compile with aot_eager, which traces and differentiates as inductor does without its minutes of codegen
    monkeypatch.setattr(training, "compile_layer_parts",
                        lambda model: compiled.append(compile_parts(model, backend="aot_eager")))
    foxlm(["finetune", *finetune_args(root, "lora", "--drop-rope", "--gradient-checkpointing", "--eval-domains",
                                      "prose", "--eval-length", "512", "--micro-batch-size", "2", "--compile",
                                      "--needle-haystacks", "prose,held-out")])
    assert compiled == [4 * 2]  # norms, attention and MLP of the tiny LLaMA's 2 layers
    run = root / "lora"
    for name in ("converted/config.json", "adapter/adapter_model.safetensors", "fine-tuned/model.safetensors",
                 "fine-tuned/tokenizer.json", "train_log.json", "evaluation.png", "evaluation.json", "needle.json",
                 "summary.json"):
        assert (run / name).exists(), name
    result = json.loads((run / "evaluation.json").read_text())
    assert result["reference"] == "original (RoPE)" and set(result["domains"]) == {"held-out", "prose"}
    for domain in result["domains"].values():
        assert set(domain["bands"]) == LABELS and domain["documents"] == 3
        assert list(domain["bands"]["converted, fine-tuned"]) == ["0-128", "128-512"]  # original context, length
        assert set(domain["agreement_bands"]) == LABELS - {"original (RoPE)"}
        assert all(len(curve) == 511 for curve in domain["per_token_loss"].values())
        # The original is also run over a sliding window of its 128 positions: the same up to 128, not past it.
        original, windowed = (np.array(domain["per_token_loss"][label], dtype=float)
                              for label in ("original (RoPE)", "original, sliding window"))
        np.testing.assert_allclose(windowed[:127], original[:127], rtol=1e-5)
        assert not np.allclose(windowed[128:], original[128:], rtol=1e-7, atol=0)
        # So is the fine-tuned model, to show what positions past 128 gain from reaching further back.
        fine_tuned, windowed = (np.array(domain["per_token_loss"][label], dtype=float)
                                for label in ("converted, fine-tuned", "converted, fine-tuned, sliding window"))
        np.testing.assert_allclose(windowed[:127], fine_tuned[:127], rtol=1e-4)
        assert not np.allclose(windowed[128:], fine_tuned[128:], rtol=1e-7, atol=0)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["within_original_context"] == 128 and summary["training"]["steps"] == 3
    assert set(summary["vs_original"]) == {"held-out", "prose"}
    assert all(0 <= v["top1_agreement"] <= 1 for v in summary["vs_original"].values())
    for domain, change in summary["vs_own_window"].items():
        bands = result["domains"][domain]["per_token_loss"]
        whole, own = (np.nanmean(np.array(bands[label][128:], dtype=float))
                      for label in ("converted, fine-tuned", "converted, fine-tuned, sliding window"))
        assert change["loss_change"] == pytest.approx(whole / own - 1)
    assert list(summary["needle"]) == ["prose", "held-out"]  # a test per haystack, in the order asked
    assert all(set(models) == {"original (RoPE)", "converted, fine-tuned"} for models in summary["needle"].values())
    needle = json.loads((run / "needle.json").read_text())
    for haystack in ("prose", "held-out"):
        models = needle["haystacks"][haystack]["models"]
        assert set(models) == {"original (RoPE)", "converted, fine-tuned"}
        assert all(len(m["answers"]) == 11 for m in models.values())
        assert summary["needle"][haystack]["original (RoPE)"] == models["original (RoPE)"]["accuracy_by_context"]
        by_distance = models["converted, fine-tuned"]["accuracy_by_distance"]
        assert summary["needle_by_distance"][haystack]["converted, fine-tuned"] == {
            band: pooled["accuracy"] for band, pooled in by_distance.items()}
    assert (run / "needle.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"plot: {run / 'evaluation.png'}" and f"needle plot: {run / 'needle.png'}" in out
    # Where the run's time went, stage by stage: in summary.json and the line before the plot's.
    stages = ["loading", "teacher samples", "conversion", "fine-tuning", "evaluation", "needle"]
    assert list(summary["seconds"]) == stages and all(seconds > 0 for seconds in summary["seconds"].values())
    assert out[-2] == "time by stage: " + ", ".join(f"{s} {summary['seconds'][s]:.0f} s" for s in stages)
    assert any(line.startswith("prose: fine-tuned vs original at positions < 128: loss ") for line in out)
    assert any(line.startswith("needle in a haystack (prose), converted, fine-tuned: 512") for line in out)
    assert any(line.startswith("needle in a haystack (held-out), converted, fine-tuned: 512") for line in out)
    # The recipe's stages with RoPE dropped: token shift, output gate and attention transfer while converting,
    # distillation while fine-tuning.
    assert "Attention transfer: 4 steps" in (run / "converted" / "README.md").read_text()
    converted = json.loads((run / "converted" / "config.json").read_text())
    assert converted["use_k_shift"] and converted["use_v_shift"] and converted["shift_bias"]
    assert converted["use_output_gate"] and not converted["use_rope"]
    # Text sampled from the original joins the training data (the CPU default: 1024 tokens, documents of <= 64).
    assert summary["teacher_samples"]["tokens"] >= 1024 and summary["teacher_samples"]["documents"] >= 1024 // 65
    assert any(line.startswith("sampled ") and "from the original" in line for line in out)
    assert any("3 steps of 256 tokens (2 blocks per pass)" in line for line in out)
    logged = [entry for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]
    # loss = ce + 30 kl (the default --kl-weight); the log rounds each term to 4 decimals (kl's error times 30)
    assert logged and all(entry["kl"] > 0 and abs(entry["loss"] - entry["ce"] - 30 * entry["kl"]) < 2e-3
                          for entry in logged), logged


def test_full_finetuning_and_evaluation_run_as_two_invocations_within_a_time_budget(llama_and_corpus, capsys,
                                                                                     monkeypatch):
    from foxlm import distillation

    root = llama_and_corpus
    run = root / "full"
    caches, sample = [], distillation.sample_documents
    monkeypatch.setattr(distillation, "sample_documents",
                        lambda *args, **kw: caches.append(kw["cache_implementation"]) or sample(*args, **kw))
    foxlm(["finetune", *finetune_args(root, "full", "--full", "--steps", "50", "--max-minutes", "1e-6",
                                      "--skip-eval", "--no-token-shift", "--no-output-gate", "--distill-only",
                                      "--sample-temperature", "0.7", "--drop-rope", "--sample-cache", "static")])
    assert caches == ["static"]
    out = capsys.readouterr().out
    assert "budget ended training after 1 steps" in out
    assert out.strip().splitlines()[-1].startswith("time by stage: loading ")  # without evaluation, the last line
    # Every training position lies inside the original's context (128): with --distill-only the KL alone trains.
    logged = [entry for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]
    assert logged and all(entry["ce"] == 0 and entry["kl"] > 0 for entry in logged), logged
    assert "KL(original || FoX) of the next-token distributions alone" in (run / "fine-tuned" / "README.md").read_text()
    config = json.loads((run / "fine-tuned" / "config.json").read_text())
    assert not config["use_k_shift"] and not config["use_output_gate"]
    assert not (run / "evaluation.json").exists() and not (run / "adapter").exists()
    # The fine-tuned folder is a complete model: it loads with the Auto classes and generates.
    model = AutoModelForCausalLM.from_pretrained(run / "fine-tuned")
    tokenizer = AutoTokenizer.from_pretrained(run / "fine-tuned")
    prompt = tokenizer("def ", return_tensors="pt")
    assert model.generate(**prompt, max_new_tokens=4, do_sample=False).shape[1] == prompt["input_ids"].shape[1] + 4

    foxlm(["finetune", *finetune_args(root, "full", "--eval-only", "--skip-original", "--no-needle")])
    result = json.loads((run / "evaluation.json").read_text())
    assert set(result["domains"]["held-out"]["bands"]) == LABELS - {"original (RoPE)", "original, sliding window"}


def test_a_run_takes_the_originals_results_from_an_earlier_run_of_the_same_documents(llama_and_corpus, monkeypatch,
                                                                                       capsys):
    from foxlm import evaluation

    root = llama_and_corpus
    run = root / "reuse"
    foxlm(["finetune", *finetune_args(root, "reuse", "--no-token-shift", "--needle-docs", "3")])
    first = {name: json.loads((run / name).read_text()) for name in ("evaluation.json", "needle.json")}
    sources = []
    monkeypatch.setattr(evaluation, "load_causal_lm", lambda source, *a, load=evaluation.load_causal_lm, **k: (
        sources.append(Path(source).name), load(source, *a, **k))[1])
    capsys.readouterr()
    foxlm(["finetune", *finetune_args(root, "reuse", "--eval-only", "--needle-docs", "3", "--reuse-original-from",
                                      str(run))])
    # The original (the folder "llama") is not loaded again; the report is the first one's to the last digit.
    assert "llama" not in sources and sources, sources
    for name, result in first.items():
        again = json.loads((run / name).read_text())
        assert again.pop("written_by") == result.pop("written_by") and again == result, name
    summary = json.loads((run / "summary.json").read_text())
    # 3 haystacks: each length's interval over them, the fine-tuned model's as needle.json has it.
    [(haystack, by_label)] = summary["needle_interval"].items()  # the held-out text's
    intervals = by_label["converted, fine-tuned"]
    models = json.loads((run / "needle.json").read_text())["haystacks"][haystack]["models"]
    fine_tuned = models["converted, fine-tuned"]
    assert intervals == fine_tuned["interval_by_context"] and list(intervals) == list(fine_tuned["accuracy_by_context"])
    assert summary["original_reused_from"] == {"evaluation": str(run / "original_evaluation.npz"),
                                               "needle": str(run / "original_needle.json")}
    assert f"the original's results taken from {run / 'original_evaluation.npz'}" in capsys.readouterr().out
    # Other documents (fewer), or no saved results: the original is evaluated again, and the log says why.
    sources.clear()
    foxlm(["finetune", *finetune_args(root, "reuse", "--eval-only", "--eval-docs", "2", "--needle-docs", "2",
                                      "--reuse-original-from", str(run))])
    assert sources.count("llama") == 2, sources  # once for the loss and its window, once for the needle
    assert "holds another source, other documents or other settings; the original is evaluated here" in (
        capsys.readouterr().out)
    foxlm(["finetune", *finetune_args(root, "reuse", "--eval-only", "--no-needle", "--reuse-original-from",
                                      str(root / "nowhere"))])
    assert f"--reuse-original-from: no {root / 'nowhere' / 'original_evaluation.npz'}; the original is evaluated" in (
        capsys.readouterr().out)
    assert json.loads((run / "summary.json").read_text())["original_reused_from"] == {"evaluation": None}
    (root / "broken").mkdir()
    (root / "broken" / "original_evaluation.npz").write_text("not an archive")
    foxlm(["finetune", *finetune_args(root, "reuse", "--eval-only", "--no-needle", "--reuse-original-from",
                                      str(root / "broken"))])
    assert f"{root / 'broken' / 'original_evaluation.npz'} cannot be read (" in capsys.readouterr().out


def test_resume_continues_from_the_last_checkpoint(llama_and_corpus):
    root = llama_and_corpus
    run = root / "resume"
    foxlm(["finetune", *finetune_args(root, "resume", "--steps", "2", "--save-steps", "1", "--skip-eval")])
    state_path = run / "checkpoints" / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["log_history"][0]["mark"] = "from checkpoint-2"
    state_path.write_text(json.dumps(state))
    foxlm(["finetune", *finetune_args(root, "resume", "--steps", "3", "--save-steps", "1", "--skip-eval",
                                      "--resume", "--max-minutes", "60")])  # more steps, a budget: both allowed
    history = json.loads((run / "train_log.json").read_text())
    assert history[0]["mark"] == "from checkpoint-2"  # the run went on from the checkpoint's state
    assert [entry["step"] for entry in history if "loss" in entry] == [1, 2, 3]
    assert json.loads((run / "training_options.json").read_text())["options"]["steps"] == 3  # the new total


class FolderPrepared(Exception):
    """Raised in place of `prepare_run_folder`: the options' check before it passed, and nothing was changed or
    trained (only the source's config and tokenizer were read)."""


def test_resume_refuses_options_that_shape_training_other_than_the_runs(llama_and_corpus, monkeypatch, capsys):
    from foxlm import outputs

    root = llama_and_corpus
    run = root / "resume-options"
    args = ["--steps", "2", "--save-steps", "1", "--skip-eval"]
    foxlm(["finetune", *finetune_args(root, "resume-options", *args)])
    before = {p: p.read_bytes() if p.is_file() else None for p in run.rglob("*")}
    for changed, messages in ((["--context", "64", "--lora-r", "8"],
                               ["--context: trained with 128, now 64", "--lora-r: trained with 4, now 8"]),
                              (["--full", "--steps", "1"], ["--full: trained with off, now on",
                                                            "--steps: trained with 2, now 1 (it may grow"])):
        with pytest.raises(SystemExit) as refused:
            foxlm(["finetune", *finetune_args(root, "resume-options", *args, "--resume", *changed)])
        message = str(refused.value)
        assert message.startswith("error: --resume: ") and "\n" not in message
        assert all(part in message for part in [*messages, "--output-dir", "training_options.json"]), message
        assert "--eval-length" not in message and "--max-minutes" not in message  # only what differs
        assert {p: p.read_bytes() if p.is_file() else None for p in run.rglob("*")} == before  # nothing changed

    # Options that do not shape training pass the check: it comes before anything is changed or trained.
    def prepared(*args, **kwargs):
        raise FolderPrepared

    monkeypatch.setattr(outputs, "prepare_run_folder", prepared)
    for changed in (["--max-minutes", "5"], ["--save-steps", "2", "--eval-length", "512", "--no-needle"]):
        with pytest.raises(FolderPrepared):
            foxlm(["finetune", *finetune_args(root, "resume-options", *args, "--resume", *changed)])
    # Options left off the command line continue as the run was started, whatever the defaults are now: the model,
    # the data and every option that shapes training come from the record, and the check passes.
    capsys.readouterr()
    with pytest.raises(FolderPrepared):
        foxlm(["finetune", "--output-dir", str(run), "--resume", "--skip-eval"])
    adopted = capsys.readouterr().out
    assert "--resume: continuing with the options the run was trained with" in adopted
    assert all(f"{option} {value}" in adopted for option, value in (
        ("--model", root / "llama"), ("--context", 128), ("--steps", 2), ("--lora-r", 4))), adopted
    # A run recorded before the default cut partial RoPE at half the original's context (128) cut it at that
    # context, and resumes so.
    record = json.loads((run / "training_options.json").read_text())
    assert (record["options"]["partial_rope"], record["options"]["slow_pairs_start"]) == (64, 128)
    earlier = {name: value for name, value in record["options"].items() if name != "slow_pairs_start"}
    (run / "training_options.json").write_text(json.dumps({**record, "options": {**earlier, "partial_rope": True}}))
    with pytest.raises(FolderPrepared):
        foxlm(["finetune", "--output-dir", str(run), "--resume", "--skip-eval"])
    adopted = capsys.readouterr().out
    assert "--partial-rope on" in adopted and "--slow-pairs-start" not in adopted, adopted
    # A run recorded before --slow-pairs existed dropped the slow pairs, and resumes so.
    del record["options"]["slow_pairs_start"]
    assert record["options"].pop("slow_pairs") == "clamp" and "interpolate_to" not in record["options"]
    (run / "training_options.json").write_text(json.dumps(record))
    with pytest.raises(FolderPrepared):
        foxlm(["finetune", "--output-dir", str(run), "--resume", "--skip-eval"])
    assert "--slow-pairs drop" in capsys.readouterr().out
    # One compressed before --interpolate-to existed compressed them to its --context.
    (run / "training_options.json").write_text(json.dumps({**record, "options": {**record["options"],
                                                                               "slow_pairs": "compress"}}))
    with pytest.raises(FolderPrepared):
        foxlm(["finetune", "--output-dir", str(run), "--resume", "--skip-eval"])
    assert "--interpolate-to 128" in capsys.readouterr().out
    # A run recorded before partial RoPE existed dropped RoPE whole, and resumes so.
    for name in ("partial_rope", "drop_rope", "keep_rope"):
        del record["options"][name]
    (run / "training_options.json").write_text(json.dumps(record))
    with pytest.raises(FolderPrepared):
        foxlm(["finetune", "--output-dir", str(run), "--resume", "--skip-eval"])
    adopted = capsys.readouterr().out
    assert "--partial-rope off" in adopted and "--drop-rope on" in adopted, adopted
    # A run an earlier foxlm started has no record: it resumes, with a warning.
    (run / "training_options.json").unlink()
    with pytest.raises(FolderPrepared):
        foxlm(["finetune", *finetune_args(root, "resume-options", *args, "--resume", "--context", "64")])
    assert "could not be checked" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [[], ["--full"]], ids=["lora", "full"])
def test_resuming_a_run_whose_training_ended_trains_no_more_and_saves_the_same_model(llama_and_corpus, mode):
    root = llama_and_corpus
    name = "ended-" + ("full" if mode else "lora")
    args = [*mode, "--steps", "2", "--save-steps", "1", "--skip-eval"]
    foxlm(["finetune", *finetune_args(root, name, *args)])
    run = root / name
    first_log = [entry for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]
    first = load_file(run / "fine-tuned" / "model.safetensors")
    (run / "train_log.json").unlink()  # as a run killed while saving its results leaves it (saves are staged)
    foxlm(["finetune", *finetune_args(root, name, *args, "--resume")])
    assert [entry for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry] == first_log
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["checkpoint-2"]
    again = load_file(run / "fine-tuned" / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[key], again[key]) for key in first)


@pytest.mark.parametrize("mode", [[], ["--full"]], ids=["lora", "full"])
def test_a_killed_run_resumed_ends_bit_identical_to_an_uninterrupted_one(llama_and_corpus, monkeypatch, mode):
    root = llama_and_corpus
    name = "resumed-" + ("full" if mode else "lora")
    args = [*mode, "--steps", "3", "--save-steps", "1", "--skip-eval"]
    foxlm(["finetune", *finetune_args(root, name + "-whole", *args)])
    with monkeypatch.context() as patch:
        class KilledTrainer(DistillationTrainer):
            def __init__(self, *args, callbacks, **kwargs):
                super().__init__(*args, callbacks=[*callbacks, kill_after_checkpoint(2)], **kwargs)

        patch.setattr(distillation, "DistillationTrainer", KilledTrainer)
        with pytest.raises(SystemExit) as stop:  # foxlm ends on Ctrl-C with exit status 130
            foxlm(["finetune", *finetune_args(root, name, *args)])
        assert stop.value.code == 130
    state_path = root / name / "checkpoints" / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["log_history"][0]["mark"] = "from the killed run"
    state_path.write_text(json.dumps(state))
    foxlm(["finetune", *finetune_args(root, name, *args, "--resume")])
    assert json.loads((root / name / "train_log.json").read_text())[0]["mark"] == "from the killed run"
    whole = load_file(root / (name + "-whole") / "fine-tuned" / "model.safetensors")
    resumed = load_file(root / name / "fine-tuned" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)


def test_partial_rope_with_slow_pairs_compressed_past_the_original_context_by_default_and_no_transfer(
        llama_and_corpus):
    root = llama_and_corpus
    foxlm(["finetune", *finetune_args(root, "partial-rope", "--steps", "1", "--skip-eval", "--teacher-samples", "0")])
    run = root / "partial-rope"
    # Cut at half the original's context (128), the slower pairs turning as in the original up to 128.
    config = json.loads((run / "fine-tuned" / "config.json").read_text())
    assert config["use_rope"] and config["fgate_bias_init"] == 7.0
    assert (config["rope_max_wavelength"], config["rope_slow_pairs_start"]) == (64, 128)
    assert "Partial RoPE" in (run / "converted" / "README.md").read_text()
    assert "Attention transfer" not in (run / "converted" / "README.md").read_text()
    options = json.loads((run / "training_options.json").read_text())["options"]
    assert (options["partial_rope"], options["slow_pairs_start"]) == (64, 128)
    assert options["transfer_steps"] == 0 and options["gate_bias"] == 7.0
    # --context 128 reaches no further than the original's context: nothing to compress for, clamped.
    assert options["slow_pairs"] == "clamp" and config["rope_slow_pairs"] == "clamp"
    # Within the original's context the default converts to what the original computes, as a cut there does.
    foxlm(["finetune", *finetune_args(root, "cut-at-context", "--partial-rope", "--steps", "1", "--skip-eval",
                                      "--teacher-samples", "0")])
    config = json.loads((root / "cut-at-context" / "converted" / "config.json").read_text())
    assert (config["rope_max_wavelength"], config.get("rope_slow_pairs_start")) == (128, None)
    assert json.loads((root / "cut-at-context" / "training_options.json").read_text())["options"]["partial_rope"]
    ids = torch.randint(0, 256, (1, 128))
    logits = [FoxForCausalLM.from_pretrained(root / name / "converted").eval()(ids).logits.detach()
              for name in ("partial-rope", "cut-at-context")]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
    # Past it, compressed by default, for twice --context: the slow pairs turn 2 × 256 / 128 times slower past 128.
    foxlm(["finetune", *finetune_args(root, "longer", "--context", "256", "--steps", "1", "--skip-eval",
                                      "--teacher-samples", "0")])
    config = json.loads((root / "longer" / "fine-tuned" / "config.json").read_text())
    assert (config["rope_slow_pairs"], config["rope_slow_pairs_factor"]) == ("compress", 4)
    options = json.loads((root / "longer" / "training_options.json").read_text())["options"]
    assert (options["slow_pairs"], options["interpolate_to"]) == ("compress", 512)
    foxlm(["finetune", *finetune_args(root, "dropped", "--slow-pairs", "drop", "--steps", "1", "--skip-eval",
                                      "--teacher-samples", "0")])
    config = json.loads((root / "dropped" / "fine-tuned" / "config.json").read_text())
    assert (config["rope_slow_pairs"], config["rope_max_wavelength"]) == ("drop", 128)  # the cut at the context
    assert json.loads((root / "dropped" / "training_options.json").read_text())["options"]["slow_pairs"] == "drop"
    # Interpolated, the slow pairs turn as far over --context as the original did over its context (128 here);
    # compressed, as many times slower past that context only, for twice --context.
    for slow_pairs, factor in (("interpolate", 2), ("compress", 4)):
        foxlm(["finetune", *finetune_args(root, slow_pairs, "--slow-pairs", slow_pairs, "--context", "256",
                                          "--steps", "1", "--skip-eval", "--teacher-samples", "0")])
        config = json.loads((root / slow_pairs / "fine-tuned" / "config.json").read_text())
        assert config["rope_slow_pairs"] == slow_pairs and config["rope_slow_pairs_factor"] == factor
    # --interpolate-to: a model meant for a longer context than it is trained on (compressed, given alone).
    foxlm(["finetune", *finetune_args(root, "meant-for-512", "--interpolate-to", "512", "--context", "256",
                                      "--steps", "1", "--skip-eval", "--teacher-samples", "0")])
    config = json.loads((root / "meant-for-512" / "fine-tuned" / "config.json").read_text())
    assert (config["rope_slow_pairs"], config["rope_slow_pairs_factor"]) == ("compress", 4)
    options = json.loads((root / "meant-for-512" / "training_options.json").read_text())["options"]
    assert (options["slow_pairs"], options["interpolate_to"]) == ("compress", 512)
    # --slow-pairs-start: the cut at 64 makes more pairs slow; they turn as in the original up to 128 all the same,
    # then 2 × 256 / 128 times slower.
    foxlm(["finetune", *finetune_args(root, "start-128", "--partial-rope", "64", "--slow-pairs-start", "128",
                                      "--context", "256", "--steps", "1", "--skip-eval", "--teacher-samples", "0")])
    config = json.loads((root / "start-128" / "fine-tuned" / "config.json").read_text())
    assert (config["rope_max_wavelength"], config["rope_slow_pairs_start"], config["rope_slow_pairs_factor"]) == (
        64, 128, 4)
    assert json.loads((root / "start-128" / "training_options.json").read_text())["options"]["slow_pairs_start"] == 128
    # --gate-bias sets the gates' start with RoPE kept, and is recorded.
    foxlm(["finetune", *finetune_args(root, "gate-bias", "--keep-rope", "--gate-bias", "10", "--steps", "1",
                                      "--skip-eval", "--teacher-samples", "0")])
    config = json.loads((root / "gate-bias" / "converted" / "config.json").read_text())
    assert config["use_rope"] and config["rope_max_wavelength"] is None and config["fgate_bias_init"] == 10.0
    assert json.loads((root / "gate-bias" / "training_options.json").read_text())["options"]["gate_bias"] == 10.0
    # --logn-scaling converts with the queries past the original's context (128) scaled, trains so, and is recorded.
    foxlm(["finetune", *finetune_args(root, "logn", "--logn-scaling", "--context", "256", "--steps", "1",
                                      "--skip-eval", "--teacher-samples", "0")])
    assert json.loads((root / "logn" / "fine-tuned" / "config.json").read_text())["logn_scaling_context"] == 128
    assert json.loads((root / "logn" / "training_options.json").read_text())["options"]["logn_scaling"] is True


def test_compressed_slow_pairs_are_meant_for_twice_the_context_by_default():
    from types import SimpleNamespace

    from foxlm import finetune

    smollm2 = SimpleNamespace(max_position_embeddings=8192)

    def resolved(*options):
        args = finetune.parse_args(["--model", "m.gguf", "--output-dir", "run", "--context", "32768",
                                    "--tokens-per-step", "65536", *options])
        finetune.resolve_rope(args, smollm2)
        return args.partial_rope, args.slow_pairs, args.slow_pairs_start, args.interpolate_to

    assert resolved() == (4096, "compress", 8192, 65536)
    assert resolved("--interpolate-to", "131072") == (4096, "compress", 8192, 131072)
    assert resolved("--slow-pairs", "interpolate") == (True, "interpolate", None, 32768)
    # Compressed on the original's own context: meant for twice it, so there is something past it to compress for.
    assert resolved("--slow-pairs", "compress", "--context", "8192") == (4096, "compress", 8192, 16384)
    assert resolved("--context", "8192")[1:] == ("clamp", 8192, None)


def test_bad_arguments_are_named_before_any_training(llama_and_corpus, capsys):
    root = llama_and_corpus
    with pytest.raises(SystemExit, match="--eval-only"):
        foxlm(["finetune", *finetune_args(root, "empty", "--eval-only")])
    with pytest.raises(SystemExit, match="--resume"):
        foxlm(["finetune", *finetune_args(root, "no-checkpoint", "--resume")])
    with pytest.raises(SystemExit, match="--context"):  # slower over the original's own context
        foxlm(["finetune", *finetune_args(root, "interpolate-128", "--slow-pairs", "interpolate")])
    with pytest.raises(SystemExit, match="--interpolate-to, by default --context.* got 100"):
        foxlm(["finetune", *finetune_args(root, "meant-for-100", "--interpolate-to", "100")])
    for options, named in ((["--slow-pairs", "clamp"], "--slow-pairs clamp"), (["--drop-rope"], "--drop-rope"),
                           (["--interpolate-to", "0"], "--interpolate-to must be a positive number, got 0.0")):
        with pytest.raises(SystemExit):
            foxlm(["finetune", *finetune_args(root, "bad-interpolate-to", "--interpolate-to", "512", *options)])
        assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "both-ropes", "--partial-rope", "--keep-rope")])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "drop-gates", "--drop-rope", "--gate-bias", "9")])
    assert "--gate-bias sets the gates' start with RoPE kept" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "keep-dropped", "--keep-rope", "--slow-pairs", "drop")])
    assert "--slow-pairs says what --partial-rope does" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "start-dropped", "--slow-pairs", "drop", "--slow-pairs-start", "256")])
    assert "--slow-pairs-start says where" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "inf-gates", "--gate-bias", "inf")])
    assert "--gate-bias must be a finite number, got inf" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--eval-length 100000"):
        foxlm(["finetune", *finetune_args(root, "too-long", "--eval-length", "100000")])
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "big-pass", "--micro-batch-size", "3")])
    assert "--micro-batch-size 3 blocks of --context 128 tokens exceed --tokens-per-step 256" in capsys.readouterr().err
    assert not (root / "too-long" / "checkpoints").exists()
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "copies", "--copy-spans", "1")])
    assert ("--copy-spans 1: blocks of --context 128 tokens hold at most 0 copied spans of up to 128 tokens"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "haystack", "--needle-haystacks", "held-out,code")])
    assert ("--needle-haystacks: 'code' is not a domain this run evaluates on; choose from held-out (--eval-domains "
            "adds others)" in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "copies", "--copy-spans", "-1")])
    assert "--copy-spans must be 0 or more, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "seeded", "--seed", "-1")])
    assert "--seed must be at least 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        foxlm(["finetune", *finetune_args(root, "needles", "--needle-docs", "4")])
    assert ("--needle-docs 4: the needle's haystacks are among the --eval-docs 3 held-out documents"
            in capsys.readouterr().err)


def test_train_domains_choose_the_default_corpora_that_train(monkeypatch, capsys):
    from foxlm import data, finetune

    for arguments, message in ((["--train-domains", "code,prose"], "--train-domains: 'prose' is not a training "
                                "domain; choose from code, docs, kernel (prose is never trained on)"),
                               (["--train-domains", "code", "--text-files", "*.txt"], "does not go with --text-files"),
                               (["--group-related", "--dataset", "x"], "--group-related groups the default corpora")):
        with pytest.raises(SystemExit):
            finetune.parse_args(arguments)
        assert message in capsys.readouterr().err
    chosen = []
    monkeypatch.setattr(data, "training_texts", lambda domains, corpus_dir=None, seed=0, group_related=False:
                        chosen.append((domains, group_related)) or ["x"])
    monkeypatch.setattr(data, "domain_texts", lambda domain, held_out, corpus_dir=None: ["y"])
    for arguments, domains, grouped in (([], ("code", "docs"), True),
                                        (["--train-domains", "kernel,code"], ["kernel", "code"], True),
                                        (["--no-group-related"], ("code", "docs"), False)):
        args = finetune.parse_args(["--eval-domains", "prose", *arguments])
        finetune.load_documents(args, byte_tokenizer())
        trained_domains, trained_grouped = chosen.pop()
        assert list(trained_domains) == list(domains) and trained_grouped == args.group_related == grouped
        assert finetune.training_options(args, finetune.Processes(args))["group_related"] == grouped


def test_the_example_script_takes_the_same_options():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(root / "examples" / "finetune_long_context.py"), "--help"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: finetune_long_context.py") and "--max-minutes" in done.stdout


def test_the_example_script_ends_a_failure_with_one_error_line(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(root / "examples" / "finetune_long_context.py"), "--model",
                           str(tmp_path / "missing"), "--output-dir", str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'missing'} does not exist (and is not a Hub " \
                                                   "model id); check the path."


def test_a_run_recorded_before_group_related_existed_resumes_with_its_files_shuffled_one_by_one(tmp_path):
    from foxlm import finetune
    from foxlm.evaluation import write_json

    options = {"model": "m", "train_domains": "code,docs", "partial_rope": True, "slow_pairs": "clamp"}
    write_json({"options": options}, tmp_path / finetune.OPTIONS_FILE)
    assert finetune.recorded_options(tmp_path)["group_related"] is False
    write_json({"options": {**options, "group_related": True}}, tmp_path / finetune.OPTIONS_FILE)
    assert finetune.recorded_options(tmp_path)["group_related"] is True
    write_json({"options": {"model": "m", "text_files": "/data/*.txt", "partial_rope": True, "slow_pairs": "clamp"}},
               tmp_path / finetune.OPTIONS_FILE)
    assert "group_related" not in finetune.recorded_options(tmp_path)  # it applies to the default corpora only


def test_copied_spans_go_into_the_training_blocks_and_the_record(llama_and_corpus, monkeypatch):
    from foxlm import finetune

    root, trained = llama_and_corpus, []
    monkeypatch.setattr(finetune, "fine_tune", lambda args, source, converted_dir, tokenizer, blocks, *rest:
                        trained.append(blocks))
    for spans in (0, 2):
        foxlm(["finetune", *finetune_args(root, f"copies-{spans}", "--context", "512", "--tokens-per-step", "512",
                                          "--copy-spans", str(spans), "--skip-eval", "--teacher-samples", "0")])
        options = json.loads((root / f"copies-{spans}" / "training_options.json").read_text())["options"]
        assert options["copy_spans"] == spans
    plain, copied = trained
    assert len(plain) == len(copied) and all(len(block) == 512 for block in copied)
    for before, after in zip(plain, copied):
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert 0 < len(changed) <= 2 * 128  # two copies of at most 128 tokens (a copied token may equal the old)
    # A run recorded before --copy-spans existed resumes without copies.
    from foxlm.evaluation import write_json

    write_json({"options": {"model": "m", "context": 512}}, root / "copies-0" / finetune.OPTIONS_FILE)
    assert finetune.recorded_options(root / "copies-0")["copy_spans"] == 0


def test_the_seed_chooses_the_training_text_order_samples_copies_and_transfer_start_and_is_recorded(
        llama_and_corpus, monkeypatch):
    from foxlm import conversion, finetune

    root, trained, transfer_seeds = llama_and_corpus, {}, []
    monkeypatch.setattr(finetune, "fine_tune", lambda args, source, converted_dir, tokenizer, blocks, *rest:
                        trained.setdefault(args.output_dir, blocks))
    convert = conversion.convert_llama_to_fox
    monkeypatch.setattr(conversion, "convert_llama_to_fox", lambda *args, **kwargs: (
        transfer_seeds.append(kwargs["transfer_seed"]), convert(*args, **kwargs))[1])
    runs = {"seed-0": 0, "seed-0-again": 0, "seed-1": 1}
    for name, seed in runs.items():
        foxlm(["finetune", *finetune_args(root, name, "--context", "512", "--tokens-per-step", "512", "--drop-rope",
                                          "--transfer-steps", "1", "--copy-spans", "2", "--seed", str(seed),
                                          "--skip-eval")])
        assert json.loads((root / name / "training_options.json").read_text())["options"]["seed"] == seed
    assert transfer_seeds == list(runs.values())
    blocks = {name: trained[str(root / name)] for name in runs}
    assert blocks["seed-0"] == blocks["seed-0-again"] and blocks["seed-0"] != blocks["seed-1"]
    samples = {name: finetune.saved_samples(root / name / finetune.SAMPLES_FILE) for name in runs}
    assert samples["seed-0"] == samples["seed-0-again"] and samples["seed-0"] != samples["seed-1"]
    # A run recorded before --seed existed was seeded with 0.
    from foxlm.evaluation import write_json

    write_json({"options": {"model": "m", "context": 512}}, root / "seed-1" / finetune.OPTIONS_FILE)
    assert finetune.recorded_options(root / "seed-1")["seed"] == 0


def test_the_defaults_copy_one_span_per_512_tokens_keep_related_files_together_and_weigh_the_kl_30():
    from foxlm import finetune

    default = finetune.parse_args([])  # a CPU: blocks of 512 tokens
    assert (default.context, default.copy_spans, default.group_related, default.kl_weight) == (512, 1, True, 30.0)
    assert finetune.parse_args(["--context", "4096", "--tokens-per-step", "4096"]).copy_spans == 8
    assert finetune.parse_args(["--context", "256"]).copy_spans == 0  # one span per whole 512 tokens: none
    own_files = finetune.parse_args(["--text-files", "x/*.txt"])
    assert own_files.copy_spans == 1 and own_files.group_related is False
    assert finetune.parse_args(["--copy-spans", "0", "--no-group-related"]).copy_spans == 0


def test_the_needle_in_several_held_out_documents_scores_the_fraction_passed(llama_and_corpus, capsys):
    root = llama_and_corpus
    foxlm(["finetune", *finetune_args(root, "needles", "--steps", "1", "--teacher-samples", "0", "--skip-original",
                                      "--eval-domains", "prose", "--eval-length", "512", "--needle-docs", "2")])
    [model] = json.loads((root / "needles" / "needle.json").read_text())["haystacks"]["prose"]["models"].values()
    assert model["haystacks"] == 2 and np.array(model["scores_by_haystack"]).shape == (2, 11, 1)
    np.testing.assert_allclose(model["scores"], np.mean(model["scores_by_haystack"], axis=0))
    assert np.array(model["answers_by_haystack"]).shape == (2, 11, 1)
    assert "needle in a haystack (prose, 2 documents), converted, fine-tuned: 512: " in capsys.readouterr().out


def test_a_kl_past_the_originals_context_trains_recorded_and_named(llama_and_corpus, capsys):
    from foxlm import finetune

    root = llama_and_corpus
    foxlm(["finetune", *finetune_args(root, "past", "--kl-weight-past-context", "2", "--teacher-context", "48",
                                      "--steps", "2", "--skip-eval", "--teacher-samples", "0")])
    out = capsys.readouterr().out
    assert "30 x KL to the original below position 48, 2 x KL to the original over a sliding window of 48 beyond" in out
    run = root / "past"
    assert json.loads((run / "training_options.json").read_text())["options"]["kl_weight_past_context"] == 2
    card = (run / "fine-tuned" / "README.md").read_text()
    assert "beyond it, 2 x KL to the original run over a sliding window" in card
    logged = [entry for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]
    assert logged and all(abs(entry["loss"] - entry["ce"] - 30 * entry["kl"]) < 2e-3 for entry in logged), logged
    # A run recorded before the option resumes without it.
    from foxlm.evaluation import write_json

    write_json({"options": {"model": "m", "kl_weight": 10.0}}, run / finetune.OPTIONS_FILE)
    assert finetune.recorded_options(run)["kl_weight_past_context"] == 0
    for arguments, message in ((["--kl-weight-past-context", "-1"], "must be 0 or a positive number, got -1"),
                               (["--kl-weight-past-context", "1", "--kl-weight", "0"], "needs a --kl-weight above 0"),
                               (["--kl-weight-past-context", "1", "--distill-only"], "does not go with --distill-only"),
                               (["--kl-weight-past-context", "1", "--context-parallel", "2"], "context parallelism")):
        with pytest.raises(SystemExit):
            finetune.parse_args(arguments)
        assert message in " ".join(capsys.readouterr().err.split())  # argparse wraps the message


def test_the_model_card_names_the_training_data_as_chosen():
    from foxlm import finetune
    from foxlm.model_card import training_data

    default = training_data(finetune.parse_args([]))  # on a CPU: blocks of 512 tokens, one span copied in each
    assert default.startswith("code: the Python standard library's sources; documentation: Python's and the Linux")
    assert "kernel" not in default
    assert default.endswith(", the files about one module kept together; in every training block, 1 span of 32-128 "
                            "tokens repeats text from earlier in it")
    chosen = training_data(finetune.parse_args(["--train-domains", "docs,kernel", "--no-group-related",
                                                "--copy-spans", "0"]))
    assert chosen.startswith("documentation: Python's and the Linux man pages; the Linux kernel's documentation (")
    assert chosen.endswith("by a hash of their path)")
    assert "`notes.txt`" in training_data(finetune.parse_args(["--text-files", "data/notes.txt", "--copy-spans", "0"]))
    copies = training_data(finetune.parse_args(["--text-files", "data/notes.txt", "--copy-spans", "2"]))
    assert copies.endswith("; in every training block, 2 spans of 32-128 tokens repeat text from earlier in it")
    assert "kept together" not in copies


def test_the_needles_haystack_is_prose_by_default_or_the_first_domain_evaluated():
    from foxlm import finetune

    for arguments, domains, haystacks in (([], ["code", "docs", "prose"], ["prose"]),
                                          (["--eval-domains", "code,docs"], ["code", "docs"], ["code"]),
                                          (["--text-files", "x/*.txt"], ["held-out"], ["held-out"]),
                                          (["--text-files", "x/*.txt", "--eval-domains", "prose"],
                                           ["held-out", "prose"], ["prose"]),
                                          (["--needle-haystacks", "docs,prose"], ["code", "docs", "prose"],
                                           ["docs", "prose"])):
        args = finetune.parse_args(arguments)
        assert finetune.evaluated_domains(args) == domains and finetune.needle_haystacks(args) == haystacks
