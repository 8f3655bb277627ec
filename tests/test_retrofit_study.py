"""benchmarks/retrofit_study.py on a tiny LLaMA: recipes side by side, here two at the same time (`--gpus`, which
on a machine without CUDA runs each recipe's process on the CPU; naming a GPU twice gives it two recipes)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import finetune_args, save_llama_and_corpus

ROOT = Path(__file__).resolve().parents[1]
STUDY = str(ROOT / "benchmarks" / "retrofit_study.py")


def study(*arguments, cwd):
    return subprocess.run([sys.executable, STUDY, *arguments], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("gpus", ["0,1", "0,0"])
def test_recipes_run_at_the_same_time_share_the_samples_and_land_in_one_record(tmp_path, gpus):
    root = save_llama_and_corpus(tmp_path)
    tiny = finetune_args(root, "unused", "--steps", "2", "--transfer-steps", "2", "--teacher-samples", "256",
                         "--no-needle", "--eval-docs", "2")
    done = study("--recipes", "default,no-kl", "--gpus", gpus, "--minutes", "5", "--output-dir", str(root / "study"),
                 "--results", str(root / "results"), "--", *tiny, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = (root / "results").glob("retrofit_study_*_default__no-kl.json")
    record = json.loads(path.read_text())
    stem = str(path).removesuffix("_default__no-kl.json")
    for name in ("default", "no-kl"):  # each run's plot beside the record, byte for byte (no needle: none of its files)
        assert Path(f"{stem}_{name}.png").read_bytes() == (root / "study" / name / "evaluation.png").read_bytes()
        assert not Path(f"{stem}_{name}_needle.json").exists()
    assert record["gpus"] == gpus.split(",") and set(record["runs"]) == {"default", "no-kl"}
    assert record["device"] == "cpu" and record["transformers"] and record["foxlm_source_sha256"]  # the run record
    # A recipe that waits for the samples takes whichever slot is free then: tiny runs can end first.
    assert all(run["gpu"] in gpus.split(",") for run in record["runs"].values())
    assert "no-kl: GPU 0" in done.stdout or "no-kl: GPU 1" in done.stdout
    assert "the samples of default" in done.stdout
    samples = [(root / "study" / name / "teacher_samples.npz").read_bytes() for name in ("default", "no-kl")]
    assert samples[0] == samples[1]
    assert "--kl-weight" in record["runs"]["no-kl"]["options"]
    # The second recipe takes the original's results from the first's run if it saved them by then.
    options = record["runs"]["no-kl"]["options"]
    assert options[options.index("--reuse-original-from") + 1] == str(root / "study" / "default")
    assert "--reuse-original-from" not in record["runs"]["default"]["options"]
    for name, run in record["runs"].items():
        assert run["summary"]["training"]["steps"] == 2
        assert (root / "study" / name / "fine-tuned" / "model.safetensors").exists()
        assert "fine-tuning" in (root / "study" / f"{name}.log").read_text()
        assert f"| {name} | 2 (" in record["table"]  # steps, then each step's seconds


def test_samples_given_serve_the_recipes_run_in_their_own_process(tmp_path):
    import numpy as np

    root = save_llama_and_corpus(tmp_path)
    given = root / "samples.npz"
    documents = [[104, 105, 257], [111, 107, 33, 257]] * 40
    np.savez(given, tokens=np.concatenate(documents).astype(np.int32),
             lengths=np.array([len(document) for document in documents]), seconds=12.5)
    tiny = finetune_args(root, "unused", "--steps", "1", "--teacher-samples", "256", "--no-needle", "--eval-docs", "1")
    done = study("--recipes", "default", "--gpus", "0", "--samples-from", str(given), "--minutes", "5",
                 "--output-dir", str(root / "study"), "--results", str(root / "results"), "--", *tiny, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"the samples in {given}" in done.stdout
    assert (root / "study" / "default" / "teacher_samples.npz").read_bytes() == given.read_bytes()
    assert "sampling from the original" not in (root / "study" / "default.log").read_text()
    [path] = (root / "results").glob("retrofit_study_*_default.json")
    samples = json.loads(path.read_text())["runs"]["default"]["summary"]["teacher_samples"]
    assert samples["tokens"] == 280 and samples["seconds"] == 12.5


def test_samples_given_serve_only_the_recipes_that_sample_as_the_first_one_in_one_process(tmp_path, monkeypatch):
    """Without --gpus: a recipe with other sampling options (length, seed) samples its own, not the given file."""
    import argparse

    import numpy as np

    retrofit_study = load_study()
    finetune = retrofit_study.finetune
    for name in ("teacher_samples", "load_documents", "main"):  # restored after the test
        monkeypatch.setattr(finetune, name, getattr(finetune, name))
    given, documents = tmp_path / "samples.npz", [[104, 105, 257], [111, 107, 33, 257]]
    np.savez(given, tokens=np.concatenate(documents).astype(np.int32), lengths=np.array([3, 4]), seconds=1.0)
    samplers = {}

    options_of = {}

    def record_sampler(options, prog):
        samplers[prog.removeprefix("finetune (").removesuffix(")")] = finetune.teacher_samples
        options_of[prog.removeprefix("finetune (").removesuffix(")")] = options
        run_dir = Path(options[options.index("--output-dir") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text('{"domains": {}}')

    monkeypatch.setattr(finetune, "main", record_sampler)
    args = argparse.Namespace(samples_from=str(given), finetune_args=["--steps", "1"], minutes=1.0,
                              output_dir=str(tmp_path / "study"), original_from=None)
    retrofit_study.run_recipes(["default", "sample-length-4k", "no-kl", "seed-1"], args, [],
                               save=lambda runs, name: None)
    assert samplers["no-kl"] is samplers["default"]
    assert samplers["sample-length-4k"] is not samplers["default"] and samplers["seed-1"] is not samplers["default"]
    # Every recipe after the first takes the original's results from the first one's run.
    assert "--reuse-original-from" not in options_of["default"]
    assert all(options_of[name][-2:] == ["--reuse-original-from", str(tmp_path / "study" / "default")]
               for name in ("sample-length-4k", "no-kl", "seed-1"))
    run_dir = tmp_path / "no-kl"
    run_dir.mkdir()
    assert samplers["no-kl"](None, None, run_dir) == documents
    # --original-from: every recipe, the first too, takes the original's results from that folder.
    args.original_from, args.output_dir = str(tmp_path / "earlier"), str(tmp_path / "study-2")
    retrofit_study.run_recipes(["default", "no-kl"], args, [], save=lambda runs, name: None)
    assert all(options_of[name][-2:] == ["--reuse-original-from", str(tmp_path / "earlier")]
               for name in ("default", "no-kl"))


def test_each_runs_plots_and_needle_results_land_beside_the_record(tmp_path):
    retrofit_study = load_study()
    written = {"with-needle": {"evaluation.png": b"loss plot", "needle.json": b"{}", "needle.png": b"needle plot"},
               "without": {"evaluation.png": b"another plot"}}
    for name, files in written.items():
        (tmp_path / "study" / name).mkdir(parents=True)
        for file, data in files.items():
            (tmp_path / "study" / name / file).write_bytes(data)
    stem = tmp_path / "results" / "retrofit_study_cpu_20261130-2300"
    for name in written:
        retrofit_study.copy_run_files(name, tmp_path / "study", str(stem))
    assert sorted(p.name for p in stem.parent.iterdir()) == [
        "retrofit_study_cpu_20261130-2300_with-needle.png", "retrofit_study_cpu_20261130-2300_with-needle_needle.json",
        "retrofit_study_cpu_20261130-2300_with-needle_needle.png", "retrofit_study_cpu_20261130-2300_without.png"]
    assert (stem.parent / "retrofit_study_cpu_20261130-2300_with-needle_needle.png").read_bytes() == b"needle plot"


def load_study():
    spec = importlib.util.spec_from_file_location("retrofit_study", STUDY)
    retrofit_study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(retrofit_study)
    return retrofit_study


def test_every_recipe_is_a_command_line_that_foxlm_finetune_accepts():
    from foxlm import finetune

    # The GPU's block and step sizes first (the CPU's are too small for some recipes); a recipe's own come after.
    gpu_sizes = ["--context", "32768", "--tokens-per-step", "65536"]
    for name, options in load_study().RECIPES.items():
        args = finetune.parse_args([*gpu_sizes, *options, "--model", "m.gguf", "--output-dir", "run"])
        assert args.model == "m.gguf", name


def test_the_table_gives_prose_worst_bands_inside_and_past_the_originals_context():
    retrofit_study = load_study()
    edges = ["0-512", "512-2048", "2048-4096", "4096-8192", "8192-16384"]
    summary = {"within_original_context": 8192, "training": {"steps": 10, "seconds": 15.0},
               "vs_original": {"prose": {"loss_change": 0.03, "top1_agreement": 0.71}},
               "domains": {"prose": {"loss": {"original (RoPE)": dict(zip(edges, [3.5, 3.2, 3.2, 3.2, 4.6])),
                                               "original, sliding window": dict(zip(edges, [3.5, 3.2, 3.2, 3.2, 3.2])),
                                               "converted, fine-tuned": dict(zip(edges, [3.5, 3.36, 3.2, 3.3, 3.4])),
                                               "converted, fine-tuned, sliding window":
                                                   dict(zip(edges, [3.5, 3.36, 3.2, 3.3, 3.5]))}}}}
    row = retrofit_study.table({"r": {"summary": summary}}).splitlines()[-1].split(" | ")
    # 3.36 / 3.2; 3.4 - 3.3; 3.4 / 3.2; 3.4 / 3.5
    assert row[1:8] == ["10 (1.50 s)", "+3.0%", "71.0%", "+5.0%", "+0.100 nats", "+6.2%", "-2.9%"]
    assert row[8] == "-"  # no needle test
    summary["needle"] = {"prose": {"converted, fine-tuned": {"2048": 1.0, "16384": 0.25}}}
    assert retrofit_study.table({"r": {"summary": summary}}).splitlines()[-1].split(" | ")[8] == "2k 100%, 16k 25%"
    # With 3 haystacks or more, each length's interval over them.
    summary["needle_interval"] = {"prose": {"converted, fine-tuned": {"2048": None, "16384": [0.125, 0.4]}}}
    row = retrofit_study.table({"r": {"summary": summary}}).splitlines()[-1].split(" | ")
    assert row[8] == "2k 100%, 16k 25% (12-40%)"
    del summary["needle_interval"]
    summary["needle"]["docs"] = {"converted, fine-tuned": {"2048": 0.5}}  # haystacks named when there are several
    row = retrofit_study.table({"r": {"summary": summary}}).splitlines()[-1].split(" | ")
    assert row[8] == "prose: 2k 100%, 16k 25%; docs: 2k 50%"
    # The same recipe with other seeds: a last row with each number's range over them; other recipes stay out of it.
    again = {**summary, "vs_original": {"prose": {"loss_change": 0.01, "top1_agreement": 0.75}},
             "needle": {"prose": {"converted, fine-tuned": {"2048": 0.5, "16384": 0.75}}}}
    runs = {"default": {"summary": summary}, "no-kl": {"summary": again}, "seed-1": {"summary": again}}
    lines = retrofit_study.table(runs).splitlines()
    assert len(lines) == 2 + 3 + 1
    spread = lines[-1].split(" | ")
    assert spread[0] == "| default, seed-1: range over seeds"
    assert spread[2:9] == ["+1.0% to +3.0%", "71.0% to 75.0%", "+5.0% to +5.0%", "+0.100 nats to +0.100 nats",
                           "+6.2% to +6.2%", "-2.9% to -2.9%", "2k 50%-100%, 16k 25%-75%"]


@pytest.mark.parametrize("gpus", ["cuda:0", "0,,1"])
def test_gpus_that_are_not_indices_are_refused(tmp_path, gpus):
    done = study("--recipes", "default", "--gpus", gpus, cwd=tmp_path)
    assert done.returncode == 2 and "--gpus: give CUDA device indices" in done.stderr


def test_samples_from_a_missing_file_is_refused(tmp_path):
    done = study("--recipes", "default", "--samples-from", str(tmp_path / "none.npz"), cwd=tmp_path)
    assert done.returncode == 2 and "--samples-from: no file" in done.stderr


def test_original_from_serves_every_recipe_the_original_of_an_earlier_run(tmp_path):
    """--original-from: a later study's recipes, the first one too, take the original's results from an earlier run's
    folder (finetune checks they were computed on the same documents), in their own processes."""
    root = save_llama_and_corpus(tmp_path)
    tiny = finetune_args(root, "unused", "--steps", "1", "--teacher-samples", "0", "--no-needle", "--eval-docs", "1")
    earlier = study("--recipes", "default", "--minutes", "5", "--output-dir", str(root / "earlier"),
                    "--results", str(root / "results"), "--", *tiny, cwd=root)
    assert earlier.returncode == 0, earlier.stdout[-3000:] + earlier.stderr[-3000:]
    assert (root / "earlier" / "default" / "original_evaluation.npz").exists()
    later = study("--recipes", "no-kl", "--gpus", "0", "--original-from", str(root / "earlier" / "default"),
                  "--minutes", "5", "--output-dir", str(root / "later"), "--results", str(root / "results"), "--",
                  *tiny, cwd=root)
    assert later.returncode == 0, later.stdout[-3000:] + later.stderr[-3000:]
    log = (root / "later" / "no-kl.log").read_text()
    assert f"the original's results taken from {root / 'earlier' / 'default' / 'original_evaluation.npz'}" in log
    summary = json.loads((root / "later" / "no-kl" / "summary.json").read_text())
    assert summary["original_reused_from"]["evaluation"] == str(root / "earlier" / "default" /
                                                                "original_evaluation.npz")
    missing = study("--recipes", "default", "--original-from", str(root / "missing"), "--", *tiny, cwd=root)
    assert missing.returncode == 2 and f"--original-from: no folder {root / 'missing'}" in missing.stderr
