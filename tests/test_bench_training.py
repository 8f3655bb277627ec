"""foxlm.benchmarks.bench_training: its grid, its training step on every model (CPU, tiny size), its JSON, summary."""

import json
import math

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    from foxlm.benchmarks import bench_training

    return bench_training


def test_default_grid_covers_models_sizes_contexts_checkpointing_acp_and_compile(bench):
    specs = bench.grid(bench.parse_args([]))
    eager = [s for s in specs if not s.get("compiled")]
    # 2 sizes x 2 contexts x 2 checkpointing x (LLaMA + 2 FoX models x ACP off/on)
    assert len(eager) == 2 * 2 * 2 * 5
    assert {(s["size"], s["context"]) for s in eager} == {(z, c) for z in ("125m", "760m") for c in (4096, 16384)}
    assert not any(s["acp"] for s in eager if s["name"] == "llama-sdpa")
    compiled = [(s["name"], s["size"], s["context"]) for s in specs if s.get("compiled")]
    assert compiled == [("llama-sdpa", "125m", 4096), ("fox-llama", "125m", 4096)]


def test_paper_sizes_have_head_dim_64_and_comparable_parameter_counts(bench):
    with torch.device("meta"):
        counts = {name: sum(p.numel() for p in bench.build_model(name, "760m", 4096).parameters())
                  for name in bench.MODELS}
        fox = bench.build_model("fox-pro", "760m", 4096)
    assert fox.config.head_dim == 64 and fox.config.intermediate_size == 3584
    assert all(abs(count / counts["llama-sdpa"] - 1) < 0.02 for count in counts.values()), counts


@pytest.mark.parametrize("name", ["llama-sdpa", "fox-llama", "fox-pro"])
def test_training_step_runs_under_bf16_autocast_with_checkpointing_and_acp(bench, name):
    row = bench.measure(name, "tiny", 32, checkpointing=True, acp=True, tokens_per_step=64, warmup=1, steps=1,
                        device="cpu")
    assert row["batch"] == 2 and row["tokens_per_step"] == 64
    assert row["tokens_per_s"] > 0 and math.isfinite(row["loss"])


def test_failures_become_rows_and_the_run_goes_on(bench, monkeypatch):
    def out_of_memory(**spec):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(bench, "measure", out_of_memory)
    row = bench.measure_or_oom(name="fox-pro", size="760m", context=16384, checkpointing=False, acp=True,
                               tokens_per_step=32768, warmup=2, steps=4)
    assert row["oom"] and row["model"] == "fox-pro" and row["error"].startswith("CUDA out of memory")
    assert "tokens_per_s" not in row


def test_summary_gives_the_target_ratios_at_the_longest_context(bench):
    common = dict(size="760m", checkpointing=False, compiled=False)
    rows = [dict(model="llama-sdpa", context=16384, acp=False, tokens_per_s=100.0, **common),
            dict(model="fox-llama", context=16384, acp=False, tokens_per_s=96.0, **common),
            dict(model="fox-pro", context=16384, acp=True, tokens_per_s=99.0, **common),
            dict(model="fox-pro", context=16384, acp=False, oom=True, **common),
            dict(model="llama-sdpa", context=4096, acp=False, tokens_per_s=300.0, **common)]
    summary = bench.summarize(rows)["760m ctx16384 checkpointing=off"]
    assert summary["fox_llama_over_llama"] == dict(ratio=0.96, target=0.95, met=True)
    assert summary["fox_pro_acp_over_llama"] == dict(ratio=0.99, target=1.0, met=False)
    assert "fox_pro_over_llama" not in summary  # out of memory: no ratio


def test_main_writes_rows_summary_and_profile(bench, tmp_path, capsys):
    bench.main(["--sizes", "tiny", "--contexts", "64", "--models", "llama-sdpa,fox-llama", "--checkpointing", "off",
                "--acp", "off", "--compile", "none", "--tokens-per-step", "64", "--warmup", "1", "--steps", "1",
                "--profile", "--profile-config", "tiny:64:off", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("training_cpu_*.json")
    results = json.loads(path.read_text())
    assert [row["model"] for row in results["rows"]] == ["llama-sdpa", "fox-llama"]
    assert "fox_llama_over_llama" in results["summary"]["tiny ctx64 checkpointing=off"]
    assert [entry["model"] for entry in results["profile"]] == ["llama-sdpa", "fox-llama"]
    assert all(entry["top_ops"] and entry["total_ms_per_step"] > 0 for entry in results["profile"])
    assert "| tiny | 64 | off |" in capsys.readouterr().out
