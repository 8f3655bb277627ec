"""Write docs/performance.md from the result files in benchmarks/results/ and examples/results/.

    python benchmarks/make_performance_doc.py            # rewrites docs/performance.md
    python benchmarks/make_performance_doc.py --check    # exit 1 if docs/performance.md is not this script's output

Every figure of the document comes from a result file, read here; nothing is typed in by hand, so the document cannot
drift from the files (tests/test_performance_doc.py checks that the committed one is this script's output). Each table
names its file, device, date, software and command. To publish a new run, put its file in `SOURCES` (or, for
training, `TRAINING`) in place of the one it replaces, delete the old file and run this script.
"""

import argparse
import json
import sys
import textwrap
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUTPUT = ROOT / "docs" / "performance.md"

# The result file behind each section and the command that wrote it (the files do not record their command line).
SOURCES = {
    "attention": ("attention_NVIDIA_H200_20261127-1550.json",
                  "FOXLM_AUTOTUNE=0 python benchmarks/bench_attention.py --quick"),
    # The same benchmark with the Triton kernels alone timed beside the dispatch (Hopper kernels where they apply).
    "hopper": ("attention_NVIDIA_H200_20261129-0003.json",
               "FOXLM_AUTOTUNE=0 python benchmarks/bench_attention.py --quick --no-reference --no-acp"),
    "packed": ("packed_as_batch_NVIDIA_H200_20261130-0024.json",
               "FOXLM_AUTOTUNE=0 python benchmarks/packed_as_batch.py"),
    "acp": [
        ("attention_acp_NVIDIA_H100_80GB_HBM3_20261126-1352.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_attention.py --acp-only"),
        ("attention_acp_NVIDIA_H200_20261124-0840.json", "python benchmarks/bench_attention.py --acp-only"),
        ("attention_NVIDIA_H200_20261127-1550.json", "FOXLM_AUTOTUNE=0 python benchmarks/bench_attention.py --quick"),
        ("attention_acp_NVIDIA_H200_20261129-0042.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_attention.py --acp-only"),
    ],
    # (file, command, the head dim whose rows it gives: each was measured with that head dim's launch defaults)
    "decode_attention": [
        ("decode_NVIDIA_H100_80GB_HBM3_20261127-0647.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts attention", 64),
        ("decode_NVIDIA_H100_80GB_HBM3_20261127-0647.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts attention", 128),
    ],
    "decode": ("decode_NVIDIA_H100_80GB_HBM3_2026-11-23.json", "python benchmarks/bench_decode.py"),
    "static_generate": ("decode_NVIDIA_H100_80GB_HBM3_20261126-1658.json",
                        "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts generate --cache-implementations "
                        "dynamic,static --new-tokens 128"),
    # (file, command[, a note on the run])
    "serving": [
        ("decode_NVIDIA_H100_80GB_HBM3_20261127-0010.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts serving --serving-batches 1,8,32,64 "
         "--serving-prompts 4096 --new-tokens 128 --cache-implementations static"),
        ("decode_NVIDIA_H100_80GB_HBM3_20261126-1734.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts serving --serving-batches 32 "
         "--serving-prompts 8192 --new-tokens 128 --cache-implementations static"),
        ("decode_NVIDIA_H100_80GB_HBM3_20261127-0008.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts attention,serving --serving-batches 8,32,64 "
         "--serving-prompts 32768 --new-tokens 128 --cache-implementations static"),
        ("decode_NVIDIA_H100_80GB_HBM3_20261127-0022.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts serving --serving-batches 16 "
         "--serving-prompts 32768 --new-tokens 128 --cache-implementations static"),
        ("decode_NVIDIA_H100_80GB_HBM3_20261127-0913.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts serving --serving-batches 32,64 "
         "--serving-prompts 32768 --prefill-chunk-size 4096 --new-tokens 128 --cache-implementations static"),
        ("decode_NVIDIA_H200_20261127-1550.json",
         "FOXLM_AUTOTUNE=0 python benchmarks/bench_decode.py --parts serving --serving-batches 32 "
         "--serving-prompts 32768 --prefill-chunk-size 4096 --new-tokens 128 --cache-implementations static",
         "One GPU of a 4-GPU host whose other three GPUs ran training (the host's CPUs shared)."),
    ],
    "layer_ops": ("layer_ops_NVIDIA_H100_80GB_HBM3_20261123-0922.json", "python benchmarks/bench_layer_ops.py"),
    "fsdp": [
        ("fsdp_scaling_760m_b8_NVIDIA_H200_20261124-0146.json", "bash benchmarks/run_fsdp_scaling.sh"),
        ("fsdp_scaling_760m_b4_NVIDIA_H200_20261124-0143.json", "BATCH=4 bash benchmarks/run_fsdp_scaling.sh"),
    ],
    "gate_init": "gate_init_smollm2.json",
    "transfer": ["transfer_smollm2.json", "transfer_smollm2_qk8.json"],
    "finetune": ("examples/results/per_token_loss_mean64.json",
                 "python examples/finetune_long_context.py --model SmolLM2-135M-Instruct.Q4_1.gguf --full "
                 "--max-minutes 5 --skip-eval"),
}
# Training runs; each row of the table comes from the newest of them that has all five models at its setting.
TRAINING = [
    "training_NVIDIA_H200_20261130-0104.json",
]
TRAINING_MODELS = [("llama-sdpa", False, "LLaMA (SDPA)"), ("fox-llama", False, "FoX (LLaMA)"),
                   ("fox-llama", True, "FoX (LLaMA) + ACP"), ("fox-pro", False, "FoX (Pro)"),
                   ("fox-pro", True, "FoX (Pro) + ACP")]

HEADER = """# Performance

Generated by `python benchmarks/make_performance_doc.py` from the result files it names; do not edit by hand. One
table per benchmark, the latest run of each. Kernel development history, A/B experiments and what was tried and not
kept: [benchmarks/NOTES_attention.md](../benchmarks/NOTES_attention.md) and
[benchmarks/NOTES.md](../benchmarks/NOTES.md).

Conventions: bf16 unless a table says otherwise; attention TFLOP/s count the full causal FLOPs (forward
`4·B·H·T²·D/2`, forward+backward 3.5× that), so with pruning they are *effective* rates; SDPA runs plain causal
attention without the forget bias (cuDNN is the FlashAttention-3-class ceiling on Hopper). "foxlm" in a table's
heading is the commit that ran (`-dirty`: with uncommitted changes), where the file records it. Runs of the same
command differ by a few percent from one to the next.
"""


def load(name):
    path = ROOT / name if "/" in name else RESULTS / name
    return json.loads(path.read_text())


def link(name):
    path = name if "/" in name else f"benchmarks/results/{name}"
    return f"[`{Path(path).name}`](../{path})"


def when(record, name):
    """The run's date and time (UTC) from the record, else from the file name."""
    if "date" in record:
        moment = datetime.fromisoformat(record["date"])
        return moment.strftime("%Y-%m-%d %H:%M UTC") if "T" in record["date"] else moment.strftime("%Y-%m-%d")
    stamp = Path(name).stem.rsplit("_", 1)[-1]
    return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]}" if len(stamp) > 8 else stamp


def provenance(record, name, command):
    software = ", ".join(f"{label} {record[key]}" for key, label in
                         (("torch", "torch"), ("triton", "Triton"), ("transformers", "transformers"),
                          ("foxlm_commit", "foxlm")) if record.get(key))
    device = record.get("device") or "CPU"
    return f"{link(name)}: {device}, {when(record, name)}{', ' + software if software else ''}; `{command}`."


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def results_by_impl(row):
    return {result["impl"]: result for result in row["results"]}


def shape_cells(row):
    """A bench_attention row's shape and its batch × heads (query/KV heads with GQA)."""
    heads = f"{row['Hq']}" if row["Hq"] == row["Hkv"] else f"{row['Hq']}/{row['Hkv']}"
    return [row["shape"], f"{row['B']} × {heads}"]


def fwd_bwd_cell(result):
    return f"{result['fwd_bwd_tflops']:.0f} ({result['fwd_bwd_ms']:.2f} ms)"


def attention_rows(key):
    """The result file of SOURCES[key] (a bench_attention run): its record, name and command, and each of its rows
    with the row's results by implementation."""
    name, command = SOURCES[key]
    record = load(name)
    return record, name, command, [(row, results_by_impl(row)) for row in record["rows"]]


def attention_section():
    record, name, command, measured = attention_rows("attention")
    rows = []
    for row, impls in measured:
        ours, cudnn, flash = impls["foxlm-triton"], impls.get("sdpa-cudnn"), impls.get("sdpa-flash")
        rows.append([
            *shape_cells(row), f"{ours['fwd_tflops']:.0f}", fwd_bwd_cell(ours),
            f"{cudnn['fwd_bwd_tflops']:.0f}" if cudnn else "–", f"{flash['fwd_bwd_tflops']:.0f}" if flash else "–",
            f"{ours['fwd_bwd_ms'] and cudnn['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}" if cudnn else "–",
            f"{row['max_rel_err_vs_float64']:.1e}",
        ])
    return "\n\n".join([
        "## Attention kernel",
        "`forgetting_attention` forward and forward+backward against SDPA, B·T = 16k tokens, hidden 2048 "
        "(H = 2048 / D). " + provenance(record, name, command),
        table(["shape", "batch × heads", "foxlm fwd TF/s", "foxlm fwd+bwd TF/s", "SDPA cuDNN fwd+bwd",
               "SDPA flash fwd+bwd", "fwd+bwd / cuDNN", "max rel. error vs float64"], rows),
        "On H100 and H200 the D128 rows' forward and dK/dV pass run on the Hopper (Gluon) kernels.",
    ])


def hopper_section():
    record, name, command, measured = attention_rows("hopper")
    rows = []
    for row, impls in measured:
        ours, triton_only, cudnn = impls["foxlm-triton"], impls.get("foxlm-triton-kernels"), impls.get("sdpa-cudnn")
        if not (triton_only and cudnn):
            continue
        rows.append([*shape_cells(row), fwd_bwd_cell(ours), fwd_bwd_cell(triton_only),
                     f"{triton_only['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}", f"{cudnn['fwd_bwd_tflops']:.0f}",
                     f"{cudnn['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}"])
    return "\n\n".join([
        "### Hopper kernels against the Triton kernels alone",
        "The same shapes with the Triton kernels alone timed beside the dispatch in one process (as `FOXLM_GLUON=0` "
        "runs): on an H100 or H200 the Hopper (Gluon) kernels take the forward at head dim 128 and the dK/dV pass at "
        "64 and 128, GQA included; the dQ pass is Triton's. " + provenance(record, name, command),
        table(["shape", "batch × heads", "foxlm fwd+bwd TF/s", "Triton kernels only", "foxlm ÷ Triton",
               "SDPA cuDNN fwd+bwd", "foxlm ÷ cuDNN"], rows),
    ])


def packed_section():
    name, command = SOURCES["packed"]
    record = load(name)
    rows = []
    for row in record["rows"]:
        cudnn = row["sdpa_cudnn"]["fwd_bwd_ms"]
        rows.append([row["shape"], *(f"{row[impl]['fwd_bwd_ms']:.2f} ms ({row[impl]['fwd_bwd_tflops']:.0f} TF/s)"
                                     for impl in ("as_batch", "packed_launch")), f"{row['fwd_bwd_speedup']:.2f}×",
                     f"{cudnn:.2f} ms", f"{cudnn / row['as_batch']['fwd_bwd_ms']:.2f}"])
    errors = ", ".join(f"{key} {value:.1e}" for key, value in record["accuracy"]["as_batch"].items())
    return "\n\n".join([
        "### Packed sequences of one length",
        "Packed sequences of one length (a padding-free batch of full training blocks, as `foxlm finetune` packs them) "
        "run as a batch: on the kernels for batches, Hopper ones included, instead of the packed (varlen) launch they "
        "took before, timed side by side in one process (70% of the heads forgetting fast). Largest error against "
        f"float64 as a batch (2 × 1,024 tokens): {errors}. " + provenance(record, name, command),
        table(["shape", "fwd+bwd as a batch", "packed launch", "speed-up", "SDPA cuDNN fwd+bwd", "as a batch ÷ cuDNN"],
              rows),
        "Sequences of several lengths and left padding take the packed and padded Triton launches.",
    ])


def acp_section():
    rows = []
    sources = []
    for name, command in SOURCES["acp"]:
        record = load(name)
        sources.append("- " + provenance(record, name, command))
        for row in record["acp_rows"]:
            impls = results_by_impl(row)
            cudnn = impls["sdpa-cudnn"]["fwd_bwd_ms"]

            def ms(label):
                return impls[f"foxlm-triton {label}"]["fwd_bwd_ms"]

            def versus(label, base):
                return f"{(ms(label) / ms(base) - 1) * 100:+.1f}%"

            pruned = impls["foxlm-triton gate mix 70/30, ACP, U given"]["pruned_fraction"]
            rows.append([
                f"{record['device'].replace('NVIDIA ', '')}, {record['date'][:10]}", row["D"], f"{cudnn:.2f}",
                f"{ms('gate mix 70/30, no ACP'):.2f}",
                f"{ms('gate mix 70/30, ACP, U measured'):.2f} ({cudnn / ms('gate mix 70/30, ACP, U measured'):.2f}×)",
                f"{ms('gate mix 70/30, ACP, U given'):.2f} (**{cudnn / ms('gate mix 70/30, ACP, U given'):.2f}×**)",
                f"{pruned:.1%}", f"{ms('open gates, no ACP'):.2f}",
                f"{versus('open gates, ACP, U measured', 'open gates, no ACP')} / "
                f"{versus('open gates, ACP, U given', 'open gates, no ACP')}",
            ])
    return "\n\n".join([
        "## Adaptive Computation Pruning",
        "Forward+backward in ms at T = 16k (B = 1, hidden 2048), ε = e^-10, and in brackets the speed-up over SDPA "
        "cuDNN's plain causal attention. Gate mix: 70% of the heads forget fast (gate logits N(0, 1)), 30% slowly "
        "(N(8, 1)), as in the ACP paper; open gates (log f = 0) have nothing to prune and show what pruning costs. "
        "\"U given\" is what a QK-norm model passes; \"U measured\" adds the bound's measurement from q and k.",
        "\n".join(sources),
        table(["GPU, date", "D", "SDPA cuDNN", "mix, no ACP", "mix, ACP, U measured", "mix, ACP, U given", "pruned",
               "open gates, no ACP", "open gates: ACP vs none (U measured / given)"], rows),
    ])


def training_rows():
    """{setting: (record, file)} with, for each setting, the newest run that has every model of TRAINING_MODELS."""
    chosen = {}
    for name in TRAINING:
        record = load(name)
        settings = {}
        for row in record["rows"]:
            if row.get("oom"):
                continue
            key = (row["size"], row["context"], row["checkpointing"], row["tokens_per_step"])
            settings.setdefault(key, {})[(row["model"], row["acp"])] = row
        for key, models in settings.items():
            if all((model, acp) in models for model, acp, _ in TRAINING_MODELS):
                if key not in chosen or record["date"] > chosen[key][0]["date"]:
                    chosen[key] = (record, name, models)
    return chosen


def training_command(record):
    rows = record["rows"]

    def values(key, render=str):
        return ",".join(dict.fromkeys(render(row[key]) for row in rows))

    on_off = {False: "off", True: "on"}.get
    return (f"python benchmarks/bench_training.py --models {values('model')} --sizes {values('size')} --contexts "
            f"{values('context')} --checkpointing {values('checkpointing', on_off)} --acp {values('acp', on_off)} "
            f"--compile none --tokens-per-step {record['tokens_per_step']} --warmup {record['warmup']} "
            f"--steps {record['steps']}")


def training_section():
    chosen = training_rows()
    runs = {name: index for index, name in enumerate(dict.fromkeys(name for _, name, _ in
                                                                   (chosen[k] for k in sorted(chosen))), 1)}
    rows = []
    for key in sorted(chosen):
        size, context, checkpointing, tokens = key
        record, name, models = chosen[key]
        llama = models[("llama-sdpa", False)]["tokens_per_s"]
        cells = [f"{models[(m, a)]['tokens_per_s'] / 1e3:.1f}k" + ("" if m == "llama-sdpa" else
                 f" ({models[(m, a)]['tokens_per_s'] / llama:.2f}×)") for m, a, _ in TRAINING_MODELS]
        memory = " / ".join(f"{models[(m, False)]['peak_memory_gb']:.1f}"
                            for m in ("llama-sdpa", "fox-llama", "fox-pro"))
        rows.append([size, f"{context // 1024}k", "on" if checkpointing else "off", f"{tokens // 1024}k", *cells,
                     memory, f"{record['device'].replace('NVIDIA ', '')} [{runs[name]}]"])
    sources = [f"{index}. " + provenance(load(name), name, training_command(load(name)))
               for name, index in runs.items()]
    out_of_memory = sorted({(row["size"], row["context"]) for name in TRAINING for row in load(name)["rows"]
                            if row.get("oom") and not row["checkpointing"] and "H100" in load(name)["device"]})
    notes = ("Out of memory on the 80 GB H100 at 32k tokens per step without checkpointing (hence the rows at 16k "
             "tokens per step): " + ", ".join(f"{s} at context {c // 1024}k" for s, c in out_of_memory) + "."
             if out_of_memory else "")
    return "\n\n".join([
        "## Training throughput against LLaMA",
        "Whole training steps (forward, backward, AdamW) of FoX (LLaMA), FoX (Pro) and a same-size "
        "`LlamaForCausalLM` with SDPA, tokens/s and in brackets × LLaMA in the same run. The paper's 125M (12 × 768) "
        "and 760M (24 × 1536) sizes, head dim 64, vocabulary 32000; FoX (Pro) has the paper's narrower MLP, so the "
        "three are within 2% in parameters. fp32 weights and AdamW state, bf16 autocast (as `Trainer(bf16=True)`). "
        "Gates as `FoxConfig` initialises them (f ≈ 0.5, fast forgetting): the best case for ACP. Each row is the "
        "newest run with all five models at that setting.",
        table(["size", "context", "checkpointing", "tokens/step", *(label for _, _, label in TRAINING_MODELS),
               "peak GB (LLaMA / FoX (LLaMA) / FoX (Pro))", "GPU [run]"], rows),
        "\n".join(sources),
        notes,
    ]).rstrip()


def decode_section():
    rows, sources = [], []
    for name, command, head_dim in SOURCES["decode_attention"]:
        record = load(name)
        rows += [[row["D"], f"{row['L'] // 1024}k", row["B"], f"{row['fox_pct_peak']:.0f}%",
                  f"{row['sdpa_pct_peak']:.0f}%", f"{row['fox_gbps'] / row['sdpa_gbps']:.2f}"]
                 for row in record["attention"] if row["D"] == head_dim]
        sources.append(f"Head dim {head_dim}: " + provenance(record, name, command))
    parts = ["## Decoding",
             "Decode attention: one new token, 32 query / 8 KV heads, bf16; bytes of K and V read per second as a "
             "share of the HBM peak (H100 SXM: 3.35 TB/s), against SDPA on the same cache without the forget bias. "
             "Both head dims with their launch defaults, timed as CUDA-graph replays; the run shared its host "
             "with training on the other GPUs, which the launch-bound rows (batch 1, 4k) feel most "
             "(benchmarks/NOTES_attention.md, \"Decode launch configuration\").",
             table(["head dim", "cached tokens", "batch", "foxlm", "SDPA", "foxlm / SDPA"], rows),
             "\n".join(sources),
             "(The 2026-11-23 run below measured decode attention too, on an intermediate build that did not "
             "specialise the kernel on the cache length; its rows are left out.)"]
    name, command = SOURCES["decode"]
    record = load(name)
    generate = {(row["model"], row["prompt"]): row for row in record["generate"]}
    prompts = sorted({prompt for _, prompt in generate})
    rows = [[f"{prompt // 1024}k"] + [f"{generate[(model, prompt)]['tokens_per_s']:.1f}" for model in
                                       ("fox", "llama", "llama (SDPA flash forced)")] for prompt in prompts]
    without, with_eviction = (next(row for row in record["eviction"] if row["decode_kv_eviction"] is flag)
                              for flag in (False, True))
    parts += [
        "`generate()`, greedy, batch 1, 256 new tokens, a ~1B FoX (LLaMA) against the same-size `LlamaForCausalLM` "
        "(hidden 2048, 16 layers, 32 / 8 heads), tokens/s including the prefill. " + provenance(record, name, command),
        table(["prompt", "FoX", "LLaMA, SDPA's default (cuDNN)", "LLaMA, SDPA flash forced"], rows),
        "Batch-1 decoding is bound by the host on that machine (Python and launches, not the GPU). KV eviction, same "
        f"run: a {without['layers']}-layer FoX with QK-norm, {without['fast_kv_heads']} of its {without['kv_heads']} "
        f"KV heads forgetting fast, after a {without['prompt'] // 1024}k-token prompt and decoding "
        f"({without['cached_length']:,} tokens cached): {without['cache_gbytes']:.2f} GB of cache without "
        f"eviction, {with_eviction['cache_gbytes']:.2f} GB with it "
        f"(−{record['eviction_memory_reduction_pct']:.0f}%).",
    ]
    return "\n\n".join(parts + static_cache_parts())


def static_cache_parts():
    name, command = SOURCES["static_generate"]
    record = load(name)
    rate = {(row["model"], row["cache_implementation"], row["prompt"]): row["decode_tokens_per_s"]
            for row in record["generate"]}
    rows = []
    for prompt in sorted({key[2] for key in rate}):
        fox, fox_static, llama_static = (rate[(model, cache, prompt)] for model, cache in
                                         (("fox", "dynamic"), ("fox", "static"), ("llama", "static")))
        rows.append([f"{prompt // 1024}k", f"{fox:.1f}", f"{fox_static:.1f}", f"{fox_static / fox:.2f}×",
                     f"{rate[('llama', 'dynamic', prompt)]:.1f}", f"{llama_static:.1f}",
                     f"{fox_static / llama_static:.2f}×"])
    parts = ["`generate()` with the static cache (`cache_implementation=\"static\"`: transformers compiles the decode "
             "step, CUDA graphs) against the dynamic cache, same models as above, greedy, batch 1, 128 new tokens; "
             "decode tokens/s without the prefill. " + provenance(record, name, command),
             table(["prompt", "FoX dynamic", "FoX static", "static / dynamic", "LLaMA dynamic (SDPA default)",
                    "LLaMA static", "FoX / LLaMA, static"], rows)]
    models = ("fox", "llama", "fox-fast-heads", "fox-fast-heads+eviction")
    rows, sources, llama_fits = [], [], []
    for run, (name, command, *note) in enumerate(SOURCES["serving"], 1):
        record = load(name)
        device = record["device"].replace("NVIDIA ", "")
        serving = {(row["model"], row["batch"], row["prompt"]): row for row in record["serving"]}
        chunk = record["serving"][0].get("prefill_chunk_size")
        prefill = f"chunks of {chunk // 1024}k" if chunk else "whole"
        for row in record["serving_summary"]:
            rate = row["decode_tokens_per_s"]
            cells = [f"{rate[model]:,.0f}" if rate.get(model) else "out of memory" for model in models]
            gib = [serving.get((model, row["batch"], row["prompt"]), {}).get("peak_memory_bytes")
                   for model in ("fox", "llama")]
            rows.append([row["batch"], f"{row['prompt'] // 1024}k", prefill, *cells,
                         f"{row['fox_over_llama']:.2f}×" if row["fox_over_llama"] else "–",
                         f"{rate['fox-fast-heads+eviction'] / rate['llama']:.2f}×"
                         if rate.get("fox-fast-heads+eviction") and rate.get("llama") else "–",
                         " / ".join(f"{value / 2**30:.0f}" if value else "–" for value in gib), f"{device} [{run}]"])
            if chunk and rate.get("llama"):
                prefill_s = [serving[(model, row["batch"], row["prompt"])]["prefill_s"] for model in ("fox", "llama")]
                llama_fits.append(f"On an {device} [{run}] LLaMA fits at batch {row['batch']}, "
                                  f"{row['prompt'] // 1024}k, and FoX decodes {row['fox_over_llama']:.2f}× as fast "
                                  f"(prefill {prefill_s[0]:.1f} s against LLaMA's {prefill_s[1]:.1f} s).")
        sources.append(f"{run}. " + " ".join([provenance(record, name, command), *note]))
    rows.sort(key=lambda row: (int(row[1][:-1]), row[0]))
    parts += [" ".join([
                  "Batch serving with the static cache, decode tokens/s of the whole batch, the same ~1B models; the "
                  "fast-heads FoX (head dim 128) has 70% of its heads forgetting fast (same weights with and without "
                  "eviction; with a static cache eviction frees no memory, the pruned keys are skipped as ACP skips "
                  "them). Peak memory holds the weights of all four models. With the whole prompt in one forward, "
                  "batch 32 at 32k did not fit in the H100's 80 GB (batch 64 was not tried after it). Prefilled in "
                  "chunks of 4,096 tokens on the H100, FoX fits at batch 32 and its fast-heads variant at 32 and 64; "
                  "LLaMA does not: each chunk allocates its 4-D attention mask for the static cache (8 GiB at batch "
                  "32, 4,096 x 32,768).", *llama_fits,
                  "The chunked rows time the decoding only. Their prompts have no padding; the fault of chunked "
                  "prefill with left padding on a GPU that a test found in the same session is fixed since "
                  "(docs/design.md, section 8)."]),
              table(["batch", "prompt", "prefill", "FoX", "LLaMA", "FoX, 70% fast heads", "with eviction",
                     "FoX / LLaMA", "fast heads with eviction / LLaMA", "peak GiB FoX / LLaMA", "GPU [run]"], rows),
              "\n".join(sources)]
    return parts


def layer_ops_section():
    name, command = SOURCES["layer_ops"]
    record = load(name)
    labels = {"qk_norm": "QK-norm (one of q, k)", "output_norm_gate": "output norm + gate",
              "token_shift": "token shift (one of k, v)"}
    rows = [[labels.get(row["op"], row["op"]), f"{row['fused']['fwd_bwd_ms']:.2f}", f"{row['eager']['fwd_bwd_ms']:.2f}",
             f"{row['compiled']['fwd_bwd_ms']:.2f}", f"{row['eager']['fwd_bwd_ms'] / row['fused']['fwd_bwd_ms']:.1f}×",
             f"{row['max_rel_err_vs_float64']['triton']:.1e}"] for row in record["rows"]]
    return "\n\n".join([
        "## Fused layer ops (FoX Pro)",
        f"Forward+backward in ms on the 760M shape ({record['tokens'] // 1024}k tokens, {record['heads']} heads × "
        f"{record['head_dim']}, {record['dtypes']}). " + provenance(record, name, command),
        table(["op", "fused (Triton)", "eager PyTorch", "`torch.compile`d reference", "eager / fused",
               "max rel. error vs float64"], rows),
    ])


def fsdp_section():
    rows, sources = [], []
    for name, command in SOURCES["fsdp"]:
        record = load(name)
        sources.append("- " + provenance(record, name, command))
        memory = " / ".join(f"{record['runs'][key]['peak_memory_gb']:.1f}" for key in ("plain", "fsdp1", "fsdp2")
                            if key in record["runs"])
        rows.append([record["per_device_batch"], f"{record['tokens_per_s_1gpu_no_fsdp'] / 1e3:.1f}k",
                     f"{record['tokens_per_s_1gpu'] / 1e3:.1f}k", f"{record['tokens_per_s_2gpu'] / 1e3:.1f}k",
                     f"**{record['scaling']:.2f}×** / {record['scaling_over_no_fsdp']:.2f}×", memory])
    return "\n\n".join([
        "## Multi-GPU training (FSDP2)",
        "FoX (Pro) 760M, context 4096, bf16, 30 steps of which the last 25 are timed, the same per-GPU batch on one "
        "and two GPUs, and one GPU without FSDP; tokens/s of the whole job. Every run's saved shards reloaded with "
        "the trained model's logits.",
        "\n".join(sources),
        table(["sequences per GPU", "1 GPU, no FSDP", "1 GPU, FSDP", "2 GPUs, FSDP",
               "2 GPUs over 1 (FSDP / no FSDP)", "peak GB per GPU (no FSDP / FSDP 1 / FSDP 2)"], rows),
    ])


def conversion_section():
    name = SOURCES["gate_init"]
    record = load(name)
    bands = list(next(iter(record["loss"].values())))
    order = sorted(record["loss"], key=lambda label: (not label.startswith("original"), label))
    rows = [[label] + [f"{record['loss'][label][band]:.2f}" for band in bands] for label in order]
    documents = ", ".join(f"{doc['file']}" for doc in record["documents"])
    parts = [
        "## Converted models before and after attention transfer (CPU)",
        f"{record['model']}: mean next-token loss (nats) by position band on {len(record['documents'])} standard "
        f"library files ({documents}, {record['documents'][0]['used']} tokens each), RoPE dropped, by forget-gate "
        f"initialisation, before any training. {link(name)}: `{record['command']}`, {record['torch_threads']} CPU "
        "threads.",
        table(["model"] + bands, rows),
    ]
    rows = []
    for name in SOURCES["transfer"]:
        record = load(name)
        loss = record["held_out_loss"]
        rows.append([f"`{record['command']}`", f"{record['trained_parameters'] / 1e3:.0f}k", record["steps"],
                     f"{record['transfer_seconds']:.0f} s", f"{loss['original']:.2f}", f"{loss['converted']:.2f}",
                     f"{loss['after_transfer']:.2f}", link(name)])
    parts += [
        f"Attention transfer ([retrofit.md](retrofit.md)) on the converted model: {record['data']}; held-out loss in "
        f"nats, {record['torch_threads']} CPU thread.",
        table(["command", "trained parameters", "steps", "time", "original", "converted", "after transfer", "file"],
              rows),
    ]
    return "\n\n".join(parts)


def finetune_section():
    name, command = SOURCES["finetune"]
    record = load(name)
    bands = list(next(iter(record["bands"].values())))
    rows = [[label] + [f"{value:.2f}" for value in record["bands"][label].values()] for label in record["bands"]]
    return "\n\n".join([
        "## Long-context fine-tuning (SmolLM2-135M at 16k)",
        f"Mean loss (nats) by position band on {record['documents']} held-out documents of "
        f"{record['max_length'] // 1024}k tokens: the original (RoPE, trained at "
        f"{record['original_context'] // 1024}k), "
        f"the converted model before fine-tuning, and after full fine-tuning at {record['train_context'] // 1024}k "
        f"tokens for 5 minutes on one H100 (2026-11-23). {link(name)} (bands and 64-position means; the plot beside "
        f"it): `{command}`, then the same with `--eval-only`.",
        table(["model"] + bands, rows),
    ])


def wrap(paragraph):
    """Prose at 120 columns; tables, lists and headings as they are."""
    if paragraph.startswith(("|", "#", "- ", "1.")) or "\n" in paragraph:
        return paragraph
    return textwrap.fill(paragraph, 120, break_long_words=False, break_on_hyphens=False)


def render():
    sections = [HEADER.rstrip(), attention_section(), hopper_section(), packed_section(), acp_section(),
                training_section(), decode_section(), layer_ops_section(), fsdp_section(), conversion_section(),
                finetune_section()]
    paragraphs = "\n\n".join(sections).split("\n\n")
    return "\n\n".join(wrap(paragraph) for paragraph in paragraphs) + "\n"


def cited_files():
    """Every result file the document is made from."""
    names = [SOURCES["attention"][0], SOURCES["hopper"][0], SOURCES["packed"][0], SOURCES["decode"][0],
             SOURCES["layer_ops"][0], SOURCES["static_generate"][0],
             *(source[0] for source in SOURCES["decode_attention"] + SOURCES["serving"]),
             SOURCES["gate_init"], SOURCES["finetune"][0], *SOURCES["transfer"], *TRAINING]
    names += [name for name, _ in SOURCES["acp"] + SOURCES["fsdp"]]
    return [ROOT / name if "/" in name else RESULTS / name for name in names]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with docs/performance.md instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            sys.exit(f"{OUTPUT.relative_to(ROOT)} is not the output of benchmarks/make_performance_doc.py: run it.")
        return
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
