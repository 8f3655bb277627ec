"""`foxlm finetune` under torchrun with context parallelism (two CPU processes over gloo) against the same runs in one
process. Two launches: tests/finetune_context_parallel_worker.py (the teacher on packed documents, and one run whose
next-token and KL terms it records on every rank), and `torchrun -m foxlm.cli finetune` itself; a third launch
trains with plain data parallelism (`--context-parallel 1`)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import finetune_args, save_llama_and_corpus, torchrun
from finetune_context_parallel_worker import CASES, RECORDED, case_args, record_terms
from packaging.version import Version
from safetensors.torch import load_file

from foxlm.cli import main as foxlm

ROOT = Path(__file__).resolve().parents[1]
LAUNCHED = next(name for name in CASES if name != RECORDED)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # Larger initial weights than the default 0.02, so that the original's predictions are far from uniform and the
    # KL term (about 0.3 here) weighs in the loss.
    return save_llama_and_corpus(tmp_path_factory.mktemp("finetune_cp"), initializer_range=0.3)


def run_folder(llama, name):
    """A folder beside the model and corpus for one set of runs (the corpus split depends on relative paths)."""
    root = llama / name
    root.mkdir()
    for entry in ("corpus", "llama"):
        (root / entry).symlink_to(llama / entry)
    return root


WORKER = str(ROOT / "tests" / "finetune_context_parallel_worker.py")


@pytest.fixture(scope="module")
def two_processes(llama):
    root = run_folder(llama, "two")
    out = torchrun(root, WORKER, str(root / "result.json"), str(root))
    out += torchrun(root, "-m", "foxlm.cli", "finetune", *case_args(root, LAUNCHED))
    return root, json.loads((root / "result.json").read_text()), out


@pytest.fixture(scope="module")
def one_process(llama):
    root = run_folder(llama, "one")
    with record_terms([]) as terms:
        foxlm(["finetune", *case_args(root, RECORDED)])
    foxlm(["finetune", *case_args(root, LAUNCHED)])
    return root, terms


def step_losses(run):
    return [entry["loss"] for entry in json.loads((run / "train_log.json").read_text()) if "loss" in entry]


def test_each_micro_batch_loss_sums_over_the_ranks_to_the_one_process_loss(two_processes, one_process):
    terms, alone = two_processes[1][RECORDED]["terms"], one_process[1]
    # Two steps of two blocks; the second step starts from weights updated by the first (AdamW, fp32).
    assert len(terms) == len(alone) == 4
    for ranks, [(ce, kl)] in zip(terms, alone):
        assert len(ranks) == 2 and ce > 1 and kl > 0.1
        assert abs(sum(rank[0] for rank in ranks) - ce) < 1e-5
        assert abs(sum(rank[1] for rank in ranks) - kl) < 1e-5
        assert all(rank[0] > 0.2 for rank in ranks)  # each rank's share of the next-token loss: half of each block
        # Teacher context 48 < the 64 tokens of each slice: every KL position is on rank 0.
        assert ranks[0][1] > 0.1 and ranks[1][1] == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_logged_step_losses_equal_the_one_process_run(two_processes, one_process, case):
    # For the launched case (teacher context 100), rank 1's positions 64-99 take the KL, their teacher reading
    # the tokens of rank 0's slice.
    two, one = step_losses(two_processes[0] / case), step_losses(one_process[0] / case)
    assert len(two) == len(one) == 2 and min(one) > 1
    assert max(abs(a - b) for a, b in zip(two, one)) < 1e-5


def test_the_teacher_sees_each_kl_positions_document_from_its_start(two_processes):
    packed = two_processes[1]["packed_teacher"]
    # Documents of 5, 15 and 4 tokens, KL below position 10: the second document's KL positions span both slices.
    assert packed["kl_positions"] == [11, 6]  # rank 1: 3 of the second document, 3 of the third
    assert max(packed["diff"]) < 1e-5
    # Rank 1's slice alone (no prefix from rank 0) gives other teacher predictions: the test can tell.
    assert packed["alone_diff"][1] > 1e-2


def test_rank_zero_alone_samples_saves_and_evaluates_a_model_that_runs_whole_sequences(two_processes):
    root, _, out = two_processes
    assert out.count("each sequence split over 2 processes") == 2 and out.count("sampled ") == 2  # rank 0's
    run = root / RECORDED
    for name in ("converted/config.json", "adapter/adapter_model.safetensors", "fine-tuned/model.safetensors",
                 "train_log.json", "evaluation.json", "summary.json"):
        assert (run / name).exists(), name
    summary = json.loads((run / "summary.json").read_text())
    assert summary["arguments"]["context_parallel"] == 2 and summary["training"]["steps"] == 2
    # The saved model keeps its cache (context parallelism turns it off only while training).
    assert json.loads((run / "fine-tuned" / "config.json").read_text())["use_cache"] is True
    assert (root / LAUNCHED / "fine-tuned" / "model.safetensors").exists()
    assert not (root / LAUNCHED / "evaluation.json").exists()  # --skip-eval


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.18"),
                    reason="transformers 5.17's Trainer loads the optimizer state of CPU processes with map_location "
                           "'cpu:0', which torch cannot restore (fixed in 5.18; GPUs are unaffected)")
def test_a_run_killed_under_torchrun_resumes_to_the_uninterrupted_runs_weights(llama, two_processes):
    # The launched case: full fine-tuning, 2 steps. Killed after its first checkpoint, then resumed: Trainer skips the
    # batches of step 1 (mid-epoch), which must stay split over the ranks.
    root = run_folder(llama, "killed")
    arguments = [*case_args(root, LAUNCHED), "--save-steps", "1"]
    torchrun(root, WORKER, "--killed-after", "1", *arguments, returncode=1)
    assert [p.name for p in (root / LAUNCHED / "checkpoints").iterdir()] == ["checkpoint-1"]
    torchrun(root, "-m", "foxlm.cli", "finetune", *arguments, "--resume")
    whole = load_file(two_processes[0] / LAUNCHED / "fine-tuned" / "model.safetensors")
    resumed = load_file(root / LAUNCHED / "fine-tuned" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert step_losses(root / LAUNCHED) == step_losses(two_processes[0] / LAUNCHED)


def test_plain_data_parallelism_takes_the_windowed_kl_past_the_context(llama):
    # --context-parallel 1: each process trains on whole blocks of its own, so the windowed teacher past position 48
    # (--kl-weight-past-context) runs as in one process; a step's two blocks are one on each rank.
    past = ["--teacher-context", "48", "--kl-weight-past-context", "2", "--context-parallel", "1", "--skip-eval",
            "--steps", "2", "--teacher-samples", "0"]
    two, one = run_folder(llama, "plain_two"), run_folder(llama, "plain_one")
    out = torchrun(two, "-m", "foxlm.cli", "finetune", *finetune_args(two, "past", *past))
    foxlm(["finetune", *finetune_args(one, "past", *past)])
    assert "2 x KL to the original over a sliding window of 48 beyond" in out
    assert "each sequence split" not in out
    losses = step_losses(two / "past"), step_losses(one / "past")
    assert len(losses[0]) == len(losses[1]) == 2 and min(losses[1]) > 1
    assert max(abs(a - b) for a, b in zip(*losses)) < 1e-5


def test_settings_that_cannot_split_are_refused_before_any_work(llama, monkeypatch):
    root = llama
    with pytest.raises(SystemExit, match=r"--context-parallel 2 must divide the number of processes \(1\)"):
        foxlm(["finetune", *case_args(root, LAUNCHED), "--context-parallel", "2"])
    assert not (root / LAUNCHED).exists()
    with monkeypatch.context() as patch:  # as torchrun would start it, without starting the other process
        patch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit, match=r"--context 127 must be divisible by the context-parallel group size "
                                             r"\(2\)"):
            foxlm(["finetune", *case_args(root, LAUNCHED), "--context", "127"])
        with pytest.raises(SystemExit):  # torchrun splits each sequence unless told --context-parallel 1
            foxlm(["finetune", *case_args(root, LAUNCHED), "--kl-weight-past-context", "1"])
    assert not (root / LAUNCHED).exists()


def test_heads_that_the_group_does_not_divide_split_unevenly_and_too_few_are_refused():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from foxlm.finetune import Processes

    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    Processes.check_heads(SimpleNamespace(size=4), smollm2)  # 4 GPUs: query heads 3, 2, 2, 2
    with pytest.raises(SystemExit, match=r"--context-parallel 16: .*num_attention_heads \(9\) must be at least the "
                                         r"group size \(16\)"):
        Processes.check_heads(SimpleNamespace(size=16), smollm2)
