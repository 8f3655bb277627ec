"""foxlm.benchmarks.trainer_step_profile: the GPU busy time it reads off a trace, and its refusal without a GPU."""

import pytest
import torch

from foxlm.benchmarks import trainer_step_profile as profile


def test_busy_time_is_the_union_of_kernel_intervals():
    events = [
        dict(cat="kernel", ts=0, dur=10), dict(cat="kernel", ts=5, dur=10),  # overlap: 0-15
        dict(cat="kernel", ts=20, dur=5), dict(cat="kernel", ts=21, dur=1),  # nested: 20-25
        dict(cat="cuda_runtime", ts=0, dur=100), dict(ph="M", name="process_name"),  # not kernels
    ]
    busy, kernels = profile.busy_seconds(events)
    assert busy == pytest.approx(20e-6) and kernels == 4
    assert profile.busy_seconds([]) == (0.0, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on a machine without a GPU")
def test_refuses_to_run_without_a_gpu(monkeypatch):
    monkeypatch.setattr("sys.argv", ["trainer_step_profile.py", "--size", "tiny"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile.main()
