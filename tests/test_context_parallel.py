"""Context parallelism (foxlm/context_parallel.py) on two CPU processes over gloo: tests/context_parallel_worker.py
runs every case once under torchrun; each test reads its part of the result."""

import json
from pathlib import Path

import pytest
from conftest import torchrun
from context_parallel_worker import CASES

from foxlm.context_parallel import check_head_split, head_splits, kv_head_ranges

ROOT = Path(__file__).resolve().parents[1]


def run_worker(tmp_path, processes):
    torchrun(tmp_path, str(ROOT / "tests" / "context_parallel_worker.py"), str(tmp_path / "result.json"),
             str(tmp_path / "trainer"), processes=processes, timeout=300)
    return json.loads((tmp_path / "result.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("context_parallel"), 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_one_process_outputs_loss_and_gradients(results, case):
    result = results[case]
    assert result["size"] == 2 and result["slice_tokens"] == 12  # 23 tokens padded to 24
    assert result["logits"] < 1e-5 and result["loss"] < 1e-5
    # Every parameter and the input embeddings, summed over the ranks.
    assert result["parameters"] > 20 and not result["grad_presence_differs"]
    assert result["grad"] < 1e-5 and result["grad_scale"] > 1e-2
    # Each rank alone (no exchange) sees only its slice: far off.
    assert result["logits_without_exchange"] > 1e-2
    assert result["path"] == CASES[case].get("path", "even") and result["head_labels"]


def test_uneven_heads_split_into_contiguous_ranges_with_the_kv_heads_they_read():
    assert head_splits(9, 4) == [3, 2, 2, 2] and head_splits(8, 4) == [2, 2, 2, 2] and head_splits(5, 2) == [3, 2]
    # SmolLM2-135M over 4 ranks: query heads 0-2, 3-4, 5-6, 7-8 read kv heads 0, 1, 1 and 2, 2.
    assert kv_head_ranges(9, 3, 4) == [(0, 1), (1, 2), (1, 3), (2, 3)]
    assert kv_head_ranges(5, 1, 2) == [(0, 1), (0, 1)] and kv_head_ranges(9, 3, 2) == [(0, 2), (1, 3)]
    for heads, kv_heads, size in [(h, kv, p) for h in range(1, 17) for kv in range(1, h + 1) if h % kv == 0
                                  for p in range(1, h + 1)]:
        splits, ranges = head_splits(heads, size), kv_head_ranges(heads, kv_heads, size)
        assert sum(splits) == heads and max(splits) - min(splits) <= 1 and min(splits) >= 1
        first, group = 0, heads // kv_heads
        for count, (start, stop) in zip(splits, ranges):
            # Exactly the kv heads that the rank's query heads read (query head h reads kv head h // group).
            assert set(range(start, stop)) == {h // group for h in range(first, first + count)}
            first += count
        assert first == heads


def test_head_counts_that_cannot_split_name_the_numbers():
    check_head_split(9, 3, 4)
    check_head_split(3, 3, 3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) must be at least the group size \(4\)"):
        check_head_split(3, 1, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must divide num_attention_heads \(9\)"):
        check_head_split(9, 2, 4)


def test_unsupported_settings_fail_with_the_numbers(results):
    errors = results["errors"]
    assert "num_attention_heads (1)" in errors["heads"] and "group size (2)" in errors["heads"]
    assert "padding mask" in errors["padding_mask"]
    assert "use_cache=False" in errors["cache"]
    assert "FoxForCausalLM" in errors["classification"]


def test_trainer_with_context_parallelism_trains_like_one_process(results):
    result = results["trainer"]
    # Three SGD steps on packed batches of two documents (odd lengths: padded), DDP over the two processes.
    assert len(result["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(result["losses"], result["reference_losses"])) < 1e-5
    assert result["params"] < 1e-5
    # One group: both processes read all 3 batches, none repeated (accelerate would even out 3 batches over 2
    # data-parallel processes by repeating one).
    assert result["batches_per_epoch"] == 3
    assert "does not evaluate" in result["eval_error"]
    assert "needs a train_dataset with a length" in result["iterable_error"]


def test_trainer_with_two_context_parallel_groups_trains_like_one_process(tmp_path):
    # Four processes: two groups of two, each reading one of a step's two batches.
    result = run_worker(tmp_path, 4)["trainer"]
    assert len(result["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(result["losses"], result["reference_losses"])) < 1e-5
    assert result["params"] < 1e-5
    assert result["batches_per_epoch"] == 3  # 6 one-example batches over 2 groups
