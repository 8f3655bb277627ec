"""foxlm.benchmarks.bench_layer_ops on the CPU at a tiny size: every op is checked and timed on both paths."""

import pytest

pytest.importorskip("triton")


def test_every_op_is_accurate_and_timed_on_the_fused_and_eager_paths(capsys):
    from foxlm.benchmarks import bench_layer_ops as bench

    ops = bench.make_ops(tokens=12, seqlen=6, heads=3, head_dim=48, device="cpu")
    assert set(ops) == {"qk_norm", "output_norm_gate", "token_shift"}
    rows = [bench.measure(name, fn, inputs, compiled=False) for name, (fn, inputs) in ops.items()]
    for row in rows:
        assert all(err < 1e-2 for err in row["max_rel_err_vs_float64"].values()), row  # bf16 inputs and outputs
        assert row["fused"]["fwd_bwd_ms"] > 0 and row["eager"]["fwd_bwd_ms"] > 0 and row["fused"]["fwd_bwd_GBps"] > 0
    bench.print_table(rows)
    table = capsys.readouterr().out
    assert table.count("\n") == 2 + len(rows) and "| token_shift |" in table
