"""Launch configurations, their autotuning and the grouping of heads (`foxlm/kernels/attention/attention_tuning.py`);
helpers from test_attention_triton.py (which skips without Triton)."""

import pytest
import torch

from foxlm.kernels import dispatch, forgetting_attention
from tests.kernels.attention.test_attention_triton import DEVICE, make_inputs, outputs_and_grads

from foxlm.kernels.attention import attention_triton, attention_tuning  # noqa: E402  (after the Triton skip)


@pytest.mark.parametrize(
    "pruned, group, block_d, head_group",
    [(True, 1, 64, 12), (True, 1, 128, 2), (False, 4, 128, 12), (False, 1, 64, 12), (False, 1, 128, 1),
     (False, 1, 256, 1)],
)
def test_heads_are_grouped_as_measured_fastest(pruned, group, block_d, head_group):
    assert attention_tuning.head_group(pruned, group, block_d, 12) == head_group


def test_autotuning_runs_leave_results_unchanged(monkeypatch):
    # The autotuner times each candidate configuration by running the launch on the real arguments, several times
    # (Triton 3.6 even with a single candidate), so no autotuned kernel may change its own inputs. Here every kernel
    # has two candidates, each run twice instead of timed (the interpreter has no GPU timer).
    inputs = make_inputs(1, 40, 40, 2, 1, 16)
    grad_out = torch.randn(1, 40, 2, 16, device=DEVICE)
    want = outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    for table in (attention_tuning.FWD_CONFIGS, attention_tuning.BWD_Q_CONFIGS, attention_tuning.BWD_KV_CONFIGS):
        monkeypatch.setitem(table, 0, table[0] * 2)
    monkeypatch.setattr(dispatch, "AUTOTUNE", True)
    runs = []
    for tuner in (attention_triton.fwd, attention_triton.bwd_q, attention_triton.bwd_kv):
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(tuner, "_do_bench", lambda call, quantiles: [call(), call(), runs.append(1), [1.0] * 3][-1])
    got = outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    assert len(runs) == 6, "each kernel's two candidates were run"
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_autotuning_keys_on_the_length_class():
    # Powers of two from 1k to 16k: a process that runs several lengths retunes a few times, not at every length.
    lengths = (0, 1, 40, 1024, 1025, 5000, 16384, 16385, 100_000)
    assert [attention_tuning.tune_seqlen(n) for n in lengths] == [1024, 1024, 1024, 1024, 2048, 8192, 16384, 16384,
                                                                   16384]
    inputs = make_inputs(1, 40, 40, 2, 2, 16)
    grad_out = torch.randn(1, 40, 2, 16, device=DEVICE)
    outputs_and_grads(lambda *a: forgetting_attention(*a, backend="triton"), inputs, grad_out)
    for tuner in (attention_triton.fwd, attention_triton.bwd_q, attention_triton.bwd_kv):
        position = tuner.keys.index("tune_seqlen")
        assert 1024 in {key[position] for key in tuner.cache}
