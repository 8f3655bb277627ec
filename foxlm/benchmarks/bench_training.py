"""End-to-end training speed and memory: FoX (LLaMA) and FoX (Pro) against a same-size LLaMA with SDPA.

One run on one GPU. Every row is one training configuration timed over whole steps (forward, backward, AdamW
step), after warmup steps, with `torch.cuda.synchronize()` around the timed ones:
- models: `llama-sdpa` (LlamaForCausalLM, `attn_implementation="sdpa"`, RoPE), `fox-llama`
  (`FoxConfig.fox_llama`: LLaMA without RoPE plus the forget gate) and `fox-pro` (`FoxConfig.fox_pro`: QK-norm,
  output norm and gate, K/V shift; its MLP is narrower, `hidden * 3.5 * 2/3`, as in the paper);
- sizes: the paper's 125M (12 layers x 768) and 760M (24 x 1536), head dim 64, LLaMA MLP width
  `256 * ceil(8/3 * hidden / 256)`, vocabulary 32000, untied embeddings for all three;
- context 4k and 16k at a fixed number of tokens per step (batch = tokens / context);
- gradient checkpointing off and on; ACP off and on for FoX (`acp_eps` e^-10; with QK-norm U comes from the norm
  scales, without it U is measured from q and k per call). Gates are as `FoxConfig` initialises them (bias 0,
  f ~ 0.5: they forget fast, the case where ACP prunes most); the pruned fraction of a forward is reported;
- `torch.compile(model)` rows (`--compile`, default 125m at 4k, checkpointing and ACP off).
Precision as `Trainer(bf16=True)`: fp32 parameters and AdamW state, bf16 autocast. An out-of-memory configuration
is a row with `"oom": true`. `--profile` adds a torch.profiler breakdown (top kernels and ops by GPU time, grouped
into attention / matmul / optimizer / other) of each model at one configuration, to see the time outside attention.
`summary` holds the ratios of the targets (FoX (LLaMA) / LLaMA at 16k without ACP, FoX (Pro) + ACP / LLaMA at 16k)
and the compile gains. Results go to benchmarks/results/training_<device>_<date-time>.json, written after every
row; rows are printed as they come, tables at the end.

    python benchmarks/bench_training.py [--profile] [--sizes 125m,760m] [--contexts 4096,16384]
        [--models llama-sdpa,fox-llama,fox-pro] [--checkpointing off,on] [--acp off,on]
        [--compile 125m:4096 | none] [--tokens-per-step 32768] [--warmup 2] [--steps 4] [--out DIR]
"""

import argparse
import gc
import json
import math
import time
import traceback

from . import comma_integers, comma_list
from .run_record import RESULTS_DIR, new_record, record_path, write_record

MODELS = {"llama-sdpa": "LLaMA (SDPA)", "fox-llama": "FoX (LLaMA)", "fox-pro": "FoX (Pro)"}
VOCAB_SIZE = 32000
SIZES = {
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12),
    "760m": dict(hidden_size=1536, num_hidden_layers=24, num_attention_heads=24),
    # Only for smoke tests (CPU): exercises every code path in seconds.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
}
# Ratios of the summary, FoX model / LLaMA at the longest context: (label, FoX model, ACP, target or None).
RATIOS = (
    ("fox_llama_over_llama", "fox-llama", False, 0.95),
    ("fox_pro_acp_over_llama", "fox-pro", True, 1.0),  # "faster than LLaMA"
    ("fox_pro_over_llama", "fox-pro", False, None),
    ("fox_llama_acp_over_llama", "fox-llama", True, None),
)
# Kernel name fragments -> group, first match wins; anything else is "other" (norms, gates, shifts, casts, loss).
KERNEL_GROUPS = (
    ("forgetting attention", ("_fwd_kernel", "_bwd_kv_kernel", "_bwd_q_kernel", "_bwd_preprocess")),
    ("sdpa attention", ("flash", "fmha", "cudnn", "attention")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_")),
    ("optimizer", ("adam", "multi_tensor")),
)


def on_off(text):
    return [{"off": False, "on": True}[item] for item in comma_list(text)]


def size_contexts(text):
    pairs = (item.split(":") for item in comma_list(text))
    return [] if text == "none" else [(size, int(context)) for size, context in pairs]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=comma_list, default=list(MODELS), help="default: all three")
    parser.add_argument("--sizes", type=comma_list, default=["125m", "760m"], help="125m, 760m (tiny: smoke tests)")
    parser.add_argument("--contexts", type=comma_integers, default=[4096, 16384])
    parser.add_argument("--checkpointing", type=on_off, default=[False, True], help="off,on (default: both)")
    parser.add_argument("--acp", type=on_off, default=[False, True], help="off,on for FoX rows (default: both)")
    parser.add_argument("--compile", type=size_contexts, default=[("125m", 4096)],
                        help="SIZE:CONTEXT list of torch.compile rows, or none (default: 125m:4096)")
    parser.add_argument("--compile-models", type=comma_list, default=["llama-sdpa", "fox-llama"],
                        help="models of the compile rows (default: llama-sdpa,fox-llama)")
    parser.add_argument("--tokens-per-step", type=int, default=32768, help="batch = this / context")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row (compile rows: at least 3)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row")
    parser.add_argument("--profile", action="store_true", help="add the profiler breakdown (--profile-config)")
    parser.add_argument("--profile-config", default="760m:16384:on",
                        help="SIZE:CONTEXT:CHECKPOINTING profiled for every model, ACP off (default: %(default)s)")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    for model in args.models + args.compile_models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    for size in args.sizes + [size for size, _ in args.compile]:
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    return args


if __name__ == "__main__":  # --help and wrong options answer before torch loads; main() parses the options again
    parse_args()

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foxlm import FoxConfig, FoxForCausalLM  # noqa: E402
from foxlm.compat import enable_activation_checkpointing  # noqa: E402
from foxlm.kernels.acp import DEFAULT_PRUNE_EPS, acp_statistics  # noqa: E402


def build_model(name, size, context, acp=False):
    """A model of `name` at `size` (a key of SIZES), fp32, with the benchmark's shared settings."""
    shape = SIZES[size]
    llama_mlp = 256 * math.ceil(8 / 3 * shape["hidden_size"] / 256)  # 2048 at 768, 4096 at 1536
    common = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=context, tie_word_embeddings=False, **shape)
    if name == "llama-sdpa":
        return LlamaForCausalLM._from_config(LlamaConfig(intermediate_size=llama_mlp, **common),
                                             attn_implementation="sdpa")
    acp_eps = DEFAULT_PRUNE_EPS if acp else None
    if name == "fox-llama":
        return FoxForCausalLM(FoxConfig.fox_llama(intermediate_size=llama_mlp, acp_eps=acp_eps, **common))
    if name == "fox-pro":
        return FoxForCausalLM(FoxConfig.fox_pro(acp_eps=acp_eps, **common))
    raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")


def enable_checkpointing(model):
    # transformers 5.23 renamed gradient checkpointing to activation checkpointing (the old name warns).
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable_activation_checkpointing(model, {"use_reentrant": False})


def train_step(model, optimizer, batch):
    """One optimizer step as `Trainer(bf16=True)` takes it: bf16 autocast over fp32 weights, AdamW."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(name, size, context, checkpointing=False, acp=False, compiled=False, tokens_per_step=32768, warmup=2,
            steps=4, device=None):
    """Time `steps` training steps after `warmup` ones; a row (dict) of the configuration and its measurements."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch_size = max(1, tokens_per_step // context)
    row = dict(model=name, size=size, context=context, batch=batch_size, tokens_per_step=batch_size * context,
               checkpointing=checkpointing, acp=acp, compiled=compiled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with device:
        model = build_model(name, size, context, acp).train()
    row["parameters"] = sum(p.numel() for p in model.parameters())
    if checkpointing:
        enable_checkpointing(model)
    step_model = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    batch = torch.randint(3, VOCAB_SIZE, (batch_size, context), device=device)

    start = time.perf_counter()
    for _ in range(warmup):
        train_step(step_model, optimizer, batch)
    synchronize(device)
    row["warmup_s"] = time.perf_counter() - start  # includes compilation and autotuning
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(step_model, optimizer, batch)
    synchronize(device)
    elapsed = time.perf_counter() - start
    row.update(step_ms=1e3 * elapsed / steps, tokens_per_s=row["tokens_per_step"] * steps / elapsed,
               loss=loss.item())
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if acp and name != "llama-sdpa":
        row["acp_pruned_fraction"] = pruned_fraction(model, batch[:1])
    return row


def pruned_fraction(model, batch):
    """Share of the causal (query, key) pairs the forward kernels skip (Triton only; None elsewhere)."""
    if batch.device.type != "cuda":
        return None
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), acp_statistics() as stats:
        model(input_ids=batch, use_cache=False)
    return stats.pruned_fraction


def measure_or_oom(**spec):
    """`measure`, or the configuration with `"oom": true` if it does not fit in GPU memory, or with the error if
    it fails otherwise (printed in full): one broken configuration does not cost the rest of the run."""
    try:
        return measure(**spec)
    except torch.OutOfMemoryError as error:
        failure = dict(oom=True, error=str(error).splitlines()[0])
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        failure = dict(error=f"{type(error).__name__}: {error}")
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row = dict(model=spec.pop("name"), **{k: v for k, v in spec.items() if k not in ("warmup", "steps", "device")})
    return dict({"checkpointing": False, "acp": False, "compiled": False}, **row, **failure)


def kernel_group(name):
    lowered = name.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(key in lowered for key in keys)), "other")


def profile(name, size, context, checkpointing, tokens_per_step, steps=2, top=25):
    """GPU time of `steps` profiled training steps (after two warmup ones): top kernels, top ops by the time of
    the kernels they launch themselves, and totals per kernel group. On a CPU, CPU time of the ops."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    torch.manual_seed(0)
    with device:
        model = build_model(name, size, context).train()
    if checkpointing:
        enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=on_gpu)
    batch = torch.randint(3, VOCAB_SIZE, (max(1, tokens_per_step // context), context), device=device)
    for _ in range(2):
        train_step(model, optimizer, batch)
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(model, optimizer, batch)
        synchronize(device)
    del model, optimizer
    events = prof.key_averages()
    kernel_device = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    # Per step, in ms. On a GPU, kernels are the device-side events; ops are the CPU-side ones, charged with the
    # kernels they launch directly (a Triton launch inside our custom op is charged to foxlm::forgetting_attention).
    kernels = [(e.key, e.count // steps, e.self_device_time_total / 1e3 / steps) for e in events
               if e.device_type == kernel_device and e.self_device_time_total > 0] if on_gpu else []
    op_time = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    ops = [(e.key, e.count // steps, op_time(e) / 1e3 / steps) for e in events
           if e.device_type == torch.autograd.DeviceType.CPU and op_time(e) > 0]
    groups = {}
    for kernel, _, ms in kernels:
        groups[kernel_group(kernel)] = groups.get(kernel_group(kernel), 0.0) + ms
    total = sum(ms for *_, ms in (kernels or ops))
    as_rows = lambda entries: [dict(name=n, calls_per_step=c, ms_per_step=ms)  # noqa: E731
                               for n, c, ms in sorted(entries, key=lambda entry: -entry[2])[:top]]
    return dict(model=name, size=size, context=context, checkpointing=checkpointing, profiled_steps=steps,
                total_ms_per_step=total, groups_ms_per_step=dict(sorted(groups.items(), key=lambda g: -g[1])),
                top_kernels=as_rows(kernels), top_ops=as_rows(ops))


def find(rows, include_oom=False, **match):
    """The first row with these values (a measured one, unless `include_oom`), or None."""
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())
                 and (include_oom or "tokens_per_s" in r)), None)


def summarize(rows):
    """Target ratios at the longest context, per size and checkpointing setting, and the compile gains."""
    summary = {}
    longest = max((r["context"] for r in rows), default=None)
    for size in dict.fromkeys(r["size"] for r in rows):
        for checkpointing in (False, True):
            eager = dict(size=size, context=longest, checkpointing=checkpointing, compiled=False)
            llama = find(rows, model="llama-sdpa", **eager)
            if llama is None:
                continue
            key = f"{size} ctx{longest} checkpointing={'on' if checkpointing else 'off'}"
            for label, model, acp, target in RATIOS:
                fox = find(rows, model=model, acp=acp, **eager)
                if fox is not None:
                    ratio = fox["tokens_per_s"] / llama["tokens_per_s"]
                    entry = dict(ratio=ratio) if target is None else dict(ratio=ratio, target=target,
                                                                          met=ratio >= target)
                    summary.setdefault(key, {})[label] = entry
    for compiled in (r for r in rows if r["compiled"] and "tokens_per_s" in r):
        eager = find(rows, model=compiled["model"], size=compiled["size"], context=compiled["context"],
                     checkpointing=compiled["checkpointing"], acp=compiled["acp"], compiled=False)
        if eager is not None:
            key = f"compile_gain {compiled['model']} {compiled['size']} ctx{compiled['context']}"
            summary[key] = compiled["tokens_per_s"] / eager["tokens_per_s"]
    return summary


def print_tables(rows):
    contexts = sorted({r["context"] for r in rows})
    columns = [(m, acp) for m in MODELS for acp in ((False,) if m == "llama-sdpa" else (False, True))]
    header = "| size | context | checkpointing | " + " | ".join(
        MODELS[m] + (" + ACP" if acp else "") for m, acp in columns) + " |"
    for title, text in (("tokens/s (x LLaMA)", _speed_text), ("peak memory GB", _memory_text)):
        print(f"\n{title}\n{header}\n" + "|---" * (header.count("|") - 1) + "|")
        for size in dict.fromkeys(r["size"] for r in rows):
            for context in contexts:
                for checkpointing in (False, True):
                    eager = dict(size=size, context=context, checkpointing=checkpointing, compiled=False)
                    if not any(all(r.get(k) == v for k, v in eager.items()) for r in rows):
                        continue
                    llama = find(rows, model="llama-sdpa", **eager)
                    cells = [_cell(find(rows, include_oom=True, model=m, acp=acp, **eager), llama, text)
                             for m, acp in columns]
                    length = f"{context // 1024}k" if context % 1024 == 0 else str(context)
                    print(f"| {size} | {length} | {'on' if checkpointing else 'off'} | "
                          + " | ".join(cells) + " |")


def _cell(row, llama, text):
    if row is None:
        return "-"
    if "tokens_per_s" not in row:
        return "OOM" if row.get("oom") else "error"
    return text(row, llama)


def _speed_text(row, llama):
    ratio = f" ({row['tokens_per_s'] / llama['tokens_per_s']:.2f}x)" if llama and row is not llama else ""
    return f"{row['tokens_per_s'] / 1e3:.1f}k{ratio}"


def _memory_text(row, llama):
    return f"{row['peak_memory_gb']:.1f}" if "peak_memory_gb" in row else "-"


def grid(args):
    """Row specifications in run order: the eager grid, then the compile rows."""
    specs = []
    for size in args.sizes:
        for context in args.contexts:
            for checkpointing in args.checkpointing:
                for model in args.models:
                    for acp in ((False,) if model == "llama-sdpa" else args.acp):
                        specs.append(dict(name=model, size=size, context=context, checkpointing=checkpointing,
                                          acp=acp))
    for size, context in args.compile:
        specs += [dict(name=model, size=size, context=context, compiled=True) for model in args.compile_models]
    return specs


def main(argv=None):
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    results = new_record(precision="fp32 parameters and AdamW state, bf16 autocast", vocab_size=VOCAB_SIZE,
                         tokens_per_step=args.tokens_per_step, warmup=args.warmup, steps=args.steps, rows=[])
    path = record_path(args.out, "training", results)

    def write():
        results["summary"] = summarize(results["rows"])
        write_record(path, results)

    for spec in grid(args):
        warmup = max(args.warmup, 3) if spec.get("compiled") else args.warmup
        row = measure_or_oom(**spec, tokens_per_step=args.tokens_per_step, warmup=warmup, steps=args.steps)
        results["rows"].append(row)
        print({key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()},
              flush=True)
        write()
    if args.profile:
        size, context, checkpointing = args.profile_config.split(":")
        results["profile"] = []
        for model in args.models:
            try:
                entry = profile(model, size, int(context), checkpointing == "on", args.tokens_per_step)
            except Exception as error:  # noqa: BLE001 (out of memory included: the rows are kept either way)
                traceback.print_exc()
                entry = dict(model=model, size=size, context=int(context), error=f"{type(error).__name__}: {error}")
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            results["profile"].append(entry)
            print({key: entry.get(key) for key in ("model", "total_ms_per_step", "groups_ms_per_step")}, flush=True)
            write()
    print_tables(results["rows"])
    print("\nsummary:", json.dumps(results["summary"], indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
