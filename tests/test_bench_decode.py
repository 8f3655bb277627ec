"""foxlm.benchmarks.bench_decode's serving part on the CPU at a tiny size: its rows, their order, the eviction pair on
the same weights, a row that runs out of memory, the ratios and the table."""

import pytest
import torch

pytest.importorskip("triton")

SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.fixture(scope="module")
def bench():
    from foxlm.benchmarks import bench_decode

    return bench_decode


def tiny_models():
    """A FoX and a LLaMA of one size, and a FoX with QK-norm whose KV head 0 forgets fast, without and with eviction
    (the same seed: the same weights), as bench_serving labels them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foxlm import FoxConfig, FoxForCausalLM

    torch.manual_seed(0)
    models = {"fox": FoxForCausalLM(FoxConfig.fox_llama(**SIZES)),
              "llama": LlamaForCausalLM._from_config(LlamaConfig(**SIZES), attn_implementation="sdpa")}
    for evict, label in ((False, "fox-fast-heads"), (True, "fox-fast-heads+eviction")):
        torch.manual_seed(0)
        model = FoxForCausalLM(FoxConfig.fox_llama(**SIZES, qk_norm=True, decode_kv_eviction=evict))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.fgate_proj.bias.copy_(torch.tensor([-2.0, -2.0, 8.0, 8.0]))
        models[label] = model
    return {label: model.eval() for label, model in models.items()}


def test_serving_rows_measure_every_model_batch_and_prompt_smallest_first(bench, monkeypatch):
    from foxlm import FoxCacheLayer

    monkeypatch.setattr(FoxCacheLayer, "check_interval", 8)  # evict within a short prompt
    monkeypatch.setattr(FoxCacheLayer, "eviction_min_keep", 4)
    models = tiny_models()
    pair = [models[label].state_dict() for label in ("fox-fast-heads", "fox-fast-heads+eviction")]
    assert all(torch.equal(pair[0][name], pair[1][name]) for name in pair[0])
    rows = list(bench.measure_serving(models, batches=[2, 1], prompts=[40, 24], new_tokens=3, device="cpu",
                                      warmup_tokens=2))
    assert [(r["batch"], r["prompt"]) for r in rows[::4]] == [(1, 24), (1, 40), (2, 24), (2, 40)]
    assert [r["model"] for r in rows[:4]] == list(models)
    for row in rows:
        assert {"model", "decode_kv_eviction", "batch", "prompt", "new_tokens", "cache_implementation", "dtype",
                "prefill_s", "decode_s", "decode_tokens_per_s", "peak_memory_bytes", "cache_bytes"} <= set(row)
        assert row["decode_tokens_per_s"] > 0 and row["prefill_s"] > 0 and row["cache_bytes"] > 0, row
        assert row["cache_implementation"] == "dynamic" and row["peak_memory_bytes"] is None  # no CUDA
        assert "skipped" not in row
    same_shape = {r["model"]: r for r in rows if (r["batch"], r["prompt"]) == (2, 40)}
    assert not same_shape["fox-fast-heads"]["decode_kv_eviction"]
    assert same_shape["fox-fast-heads+eviction"]["decode_kv_eviction"]
    # The fast-forgetting head dropped most of its 42 tokens, the slow one kept them all.
    assert same_shape["fox-fast-heads+eviction"]["cache_bytes"] < 0.8 * same_shape["fox-fast-heads"]["cache_bytes"]
    # The FoX cache holds its gate sums beside K and V: more than LLaMA's K and V, less than twice as much.
    llama_bytes = same_shape["llama"]["cache_bytes"]
    assert llama_bytes < same_shape["fox"]["cache_bytes"] < 2 * llama_bytes
    summary = bench.serving_summary(rows)
    assert [(s["batch"], s["prompt"]) for s in summary] == [(1, 24), (1, 40), (2, 24), (2, 40)]
    assert all(s["fox_over_llama"] > 0 and s["eviction_over_no_eviction"] > 0 for s in summary)


def test_a_row_out_of_memory_is_skipped_and_the_run_goes_on(bench, monkeypatch, capsys):
    models = tiny_models()
    generate = models["llama"].generate

    def out_of_memory_at_batch_2(ids, **kwargs):
        if ids.shape[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore")
        return generate(ids, **kwargs)

    monkeypatch.setattr(models["llama"], "generate", out_of_memory_at_batch_2)
    rows = list(bench.measure_serving(models, batches=[1, 2], prompts=[16], new_tokens=2, device="cpu",
                                      warmup_tokens=1))
    assert len(rows) == 8
    skipped = [r for r in rows if "skipped" in r]
    assert [(r["model"], r["batch"]) for r in skipped] == [("llama", 2)]
    assert skipped[0]["skipped"] == "out of memory: CUDA out of memory. Tried to allocate 64.00 GiB"
    assert "decode_tokens_per_s" not in skipped[0]
    assert all(r["decode_tokens_per_s"] > 0 for r in rows if "skipped" not in r)  # the later models ran
    summary = bench.serving_summary(rows)
    assert summary[1]["fox_over_llama"] is None and summary[1]["eviction_over_no_eviction"] > 0
    bench.print_serving_table(summary)
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + len(summary) and table[-1].startswith("| 2 | 16 |") and "| skipped |" in table[-1]


def test_a_prefill_out_of_memory_is_tried_again_with_shorter_chunks(bench, monkeypatch):
    """A model whose prefill chunk does not fit gets chunks half as long, down to MIN_PREFILL_CHUNK; the row records
    the chunk it ran with, or stays skipped when none fits."""
    monkeypatch.setattr(bench, "MIN_PREFILL_CHUNK", 2)
    models = tiny_models()
    tried = {"llama": [], "fox": []}
    for label, largest in (("llama", 4), ("fox", 1)):
        generate = models[label].generate

        def fits_up_to(ids, label=label, largest=largest, generate=generate, **kwargs):
            tried[label].append(kwargs["prefill_chunk_size"])
            if kwargs["prefill_chunk_size"] > largest:
                raise torch.OutOfMemoryError(f"CUDA out of memory at chunk {kwargs['prefill_chunk_size']}")
            return generate(ids, **kwargs)

        monkeypatch.setattr(models[label], "generate", fits_up_to)
    rows = {r["model"]: r for r in bench.measure_serving(models, batches=[2], prompts=[24], new_tokens=3,
                                                         device="cpu", prefill_chunk_size=16, warmup_tokens=1)}
    assert rows["llama"]["prefill_chunk_size"] == 4 and "skipped" not in rows["llama"]
    assert rows["llama"]["decode_tokens_per_s"] > 0 and tried["llama"][:3] == [16, 8, 4]
    assert tried["fox"] == [16, 8, 4, 2] and rows["fox"]["skipped"] == "out of memory: CUDA out of memory at chunk 2"
    assert rows["fox-fast-heads"]["prefill_chunk_size"] == 16


def test_serving_rows_with_a_static_cache(bench):
    """FoX and LLaMA under the same static cache; eviction skips reads but frees nothing from fixed buffers."""
    models = tiny_models()
    rows = list(bench.measure_serving(models, batches=[2], prompts=[24], new_tokens=3, device="cpu",
                                      cache_implementation="static"))
    assert [r["model"] for r in rows] == list(models) and all(r["decode_tokens_per_s"] > 0 for r in rows)
    assert all(r["cache_implementation"] == "static" and "skipped" not in r for r in rows)
    by_model = {r["model"]: r for r in rows}
    assert by_model["fox-fast-heads+eviction"]["cache_bytes"] == by_model["fox-fast-heads"]["cache_bytes"]
    summary = bench.serving_summary(rows)
    assert [(s["cache_implementation"], s["batch"], s["prompt"]) for s in summary] == [("static", 2, 24)]


def test_serving_with_a_chunked_prefill_generates_the_same_tokens(bench, monkeypatch):
    """--prefill-chunk-size reaches every model's generate(), which then gives the tokens of a whole prefill."""
    models = tiny_models()
    outputs = {}
    for chunk in (None, 8):
        for label, model in models.items():
            generate = type(model).generate

            def record(ids, label=label, model=model, generate=generate, **kwargs):
                assert kwargs.get("prefill_chunk_size") == chunk
                out = generate(model, ids, **kwargs)
                outputs.setdefault((label, chunk), []).append(out.sequences if hasattr(out, "sequences") else out)
                return out

            monkeypatch.setattr(model, "generate", record)
        rows = list(bench.measure_serving(models, batches=[2], prompts=[24], new_tokens=3, device="cpu",
                                          cache_implementation="static", prefill_chunk_size=chunk))
        assert all(r["prefill_chunk_size"] == chunk and "skipped" not in r for r in rows)
    for label in models:
        assert all(torch.equal(a, b) for a, b in zip(outputs[(label, None)], outputs[(label, 8)], strict=True))


def test_serving_options(bench):
    args = bench.parse_args(["--parts", "serving", "--serving-batches", "1,2", "--serving-prompts", "64",
                             "--new-tokens", "4", "--cache-implementations", "dynamic,static"])
    assert (args.serving_batches, args.serving_prompts, args.new_tokens) == ([1, 2], [64], 4)
    assert args.cache_implementations == ["dynamic", "static"] and args.prefill_chunk_size is None
    assert bench.parse_args(["--prefill-chunk-size", "4096"]).prefill_chunk_size == 4096
    with pytest.raises(SystemExit):
        bench.parse_args(["--cache-implementations", "quantized"])
    defaults = bench.parse_args([])
    assert defaults.serving_batches == [1, 8, 32, 64] and defaults.serving_prompts == [4096, 32768]
    assert defaults.parts.split(",") == ["attention", "generate", "eviction"] and defaults.new_tokens == 256
    assert defaults.cache_implementations == ["dynamic"]
