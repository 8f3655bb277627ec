"""FoX decoding speed and memory: the split-K decode kernel, generate() against LLaMA, KV eviction, batch serving.

One run on one GPU, bf16, in parts (`--parts`; the first three by default, serving on request: it takes longest):
- attention: one new token against a cache of L keys, batch B, 32 query / 8 KV heads, D = 64 and 128. Achieved HBM
  bandwidth = bytes of K and V read (2 * B * L * Hkv * D * 2) / time, for our kernel and for PyTorch SDPA
  (`enable_gqa`) on the same (B, Hkv, L, D) cache (SDPA without the forget bias: what plain decoding costs); times
  of CUDA-graph replays, without the host's launch time.
- launch: the decode kernel's launch configurations (keys per block, warps, pipeline stages, the default number of
  splits or twice it) at D = 64 and 128, L = 32k and 128k, B = 8 and 32, as bandwidth against SDPA on the same cache,
  each output checked against the default configuration's; on request only, what `_decode_launch`'s defaults come
  from.
- generate: tokens/s of `generate()` (greedy, batch 1, `--new-tokens` (256) new tokens after an 8k or 32k prompt,
  prefill included and reported apart) for a FoxForCausalLM and a LlamaForCausalLM (SDPA, default backend and flash
  forced) of the same size, with each cache of `--cache-implementations` (dynamic; "static": transformers' static
  cache, with which generate() on CUDA compiles the decode step, CUDA graphs included).
- eviction: cache memory after a 128k-token prompt and 64 new tokens (bf16), on a FoX model whose KV heads are 70%
  fast forgetting, with and without `decode_kv_eviction`; and whether greedy tokens stay the same (fp32, 16k prompt).
- serving: batch-serving throughput of greedy `generate()`: decode tokens/s ((new tokens - 1) x batch / decode time,
  the prefill and its first token timed apart) at every batch of `--serving-batches` (1,8,32,64) and prompt of
  `--serving-prompts` (4096,32768 tokens), `--new-tokens` new tokens, for the generate part's FoX and LLaMA (SDPA,
  default backend) and for the eviction part's model with and without `decode_kv_eviction` (the same weights), all
  with the same cache, each of `--cache-implementations` in turn (a static cache cannot free what eviction drops:
  there eviction only skips reads); peak GPU memory of each row and the bytes its cache holds after generation. A row
  that does not fit in GPU memory is recorded as skipped, with the reason, and the run goes on; the rows run from the
  fewest prompt tokens (batch x prompt) to the most. A table at the end gives FoX / LLaMA and eviction / no eviction.
Results go to benchmarks/results/decode_<device>_<date-time>.json (written after every part, and after every row of
the serving part) and are printed.

    python benchmarks/bench_decode.py [--parts attention,launch,generate,eviction,serving] [--new-tokens 256]
        [--serving-batches 1,8,32,64] [--serving-prompts 4096,32768] [--cache-implementations dynamic,static]
        [--prefill-chunk-size TOKENS] [--out DIR]
"""

import argparse
import contextlib
import gc
import itertools
import time

from . import comma_integers, comma_list
from .run_record import RESULTS_DIR, new_record, record_path, write_record

MIN_PREFILL_CHUNK = 512  # serving: the shortest prefill chunk tried after running out of memory


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="attention,generate,eviction",
                        help="comma-separated, of attention, launch, generate, eviction, serving "
                             "(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens per generate() (generate, serving)")
    parser.add_argument("--serving-batches", type=comma_integers, default=[1, 8, 32, 64],
                        help="comma-separated batch sizes (1,8,32,64)")
    parser.add_argument("--serving-prompts", type=comma_integers, default=[4096, 32768],
                        help="comma-separated prompt lengths in tokens (4096,32768)")
    parser.add_argument("--cache-implementations", type=comma_list, default=["dynamic"],
                        help="comma-separated generate() caches for the generate and serving parts, of dynamic, "
                             "static (default: dynamic)")
    parser.add_argument("--prefill-chunk-size", type=int, default=None, metavar="TOKENS",
                        help="serving: generate() prefills every model in chunks of this many tokens, which lets "
                             "large batches of long prompts fit; a model out of memory there is tried again with "
                             f"chunks half as long, down to {MIN_PREFILL_CHUNK} (default: the whole prompt at once)")
    parser.add_argument("--out", default=RESULTS_DIR)
    args = parser.parse_args(argv)
    unknown = set(args.cache_implementations) - set(CACHE_IMPLEMENTATIONS)
    if unknown:
        parser.error(f"--cache-implementations takes {', '.join(CACHE_IMPLEMENTATIONS)}; got {', '.join(unknown)}")
    return args


CACHE_IMPLEMENTATIONS = ("dynamic", "static")


if __name__ == "__main__":  # --help and wrong options answer before torch loads; main() parses the options again
    parse_args()

# Prefill takes the training kernel's first config, no autotuning: `foxlm bench decode` sets FOXLM_AUTOTUNE=0 (unless
# set) before foxlm imports its kernels (see foxlm.benchmarks.BENCHMARKS).

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from foxlm import FoxConfig, FoxForCausalLM  # noqa: E402
from foxlm.compat import CACHE_ARG  # noqa: E402
from foxlm.kernels.decode import forgetting_decode  # noqa: E402
from foxlm.kernels.decode.decode_triton import _num_splits, triton_forgetting_decode  # noqa: E402

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, SXM parts


def peak_bandwidth():
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def replay_ms(fn):
    """Median milliseconds of `fn` replayed from a CUDA graph, as a decode step runs with the static cache: the host's
    launch time stays out (a busy host stretched the launch-bound rows up to 3x when it was in)."""
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def decode_inputs(B, L, D, Hq, Hkv):
    """q (B, 1, Hq, D), k and v (B, Hkv, L, D) bf16, gate sums c (B, Hq, L) fp32, random, on the GPU."""
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(B, Hq, L, device="cuda").cumsum(-1) * 1e-3
    return torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16), k, torch.randn_like(k), c


def bench_launch(results, Hq=32, Hkv=8):
    """Every launch configuration of the decode kernel at the goal's shapes, as bandwidth against SDPA's."""
    rows = results.setdefault("launch", [])
    for D, L, B in itertools.product((64, 128), (32768, 131072), (8, 32)):
        kv_bytes = 2 * B * L * Hkv * D * 2
        q, k, v, c = decode_inputs(B, L, D, Hq, Hkv)
        args = (q, k.transpose(1, 2), v.transpose(1, 2), c.transpose(1, 2), D**-0.5)
        default = triton_forgetting_decode(*args)
        ms = replay_ms(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True))
        row = dict(D=D, L=L, B=B, sdpa_gbps=kv_bytes / ms / 1e6, configs=[])
        for block_n, num_warps, num_stages, split_factor in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4),
                                                                             (1, 2)):
            config = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                          num_splits=split_factor * _num_splits(B * Hkv, L, block_n, q.device))
            error = (triton_forgetting_decode(*args, **config).float() - default.float()).abs().max().item()
            ms = replay_ms(lambda: triton_forgetting_decode(*args, **config))
            row["configs"].append(dict(config, gbps=kv_bytes / ms / 1e6, max_abs_diff_from_default=error))
        best = max(row["configs"], key=lambda config: config["gbps"])
        print(f"D={D} L={L} B={B}: SDPA {row['sdpa_gbps']:.0f} GB/s, best {best}", flush=True)
        rows.append(row)
        q = k = v = c = default = None  # freed before the next shape's cache (a `del` would confuse linters)
        torch.cuda.empty_cache()


def bench_attention(results):
    peak = peak_bandwidth()
    rows = results.setdefault("attention", [])
    Hq, Hkv = 32, 8
    for D in (64, 128):
        for L in (4096, 32768, 131072):
            for B in (1, 8, 32):
                kv_bytes = 2 * B * L * Hkv * D * 2
                if kv_bytes > 24e9:
                    continue
                q, k, v, c = decode_inputs(B, L, D, Hq, Hkv)

                def fox():
                    return forgetting_decode(q, k.transpose(1, 2), v.transpose(1, 2), c.transpose(1, 2))

                def sdpa():
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)

                row = dict(B=B, L=L, D=D, Hq=Hq, Hkv=Hkv, kv_gbytes=kv_bytes / 1e9)
                for name, fn in (("fox", fox), ("sdpa", sdpa)):
                    ms = replay_ms(fn)
                    row[f"{name}_us"] = ms * 1e3
                    row[f"{name}_gbps"] = kv_bytes / ms / 1e6
                    row[f"{name}_pct_peak"] = 100 * kv_bytes / (ms * 1e-3) / peak if peak else None
                rows.append(row)
                print({key: round(val, 1) if isinstance(val, float) else val for key, val in row.items()}, flush=True)
                q = k = v = c = None
                torch.cuda.empty_cache()


def same_size_models():
    """A ~1B FoX (LLaMA variant, no RoPE) and the LLaMA it is converted from: hidden 2048, 16 layers, 32/8 heads."""
    sizes = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
    torch.manual_seed(0)
    with torch.device("cuda"):
        fox = FoxForCausalLM(FoxConfig.fox_llama(**sizes, fgate_bias_init=5.0))
        llama = LlamaForCausalLM._from_config(LlamaConfig(**sizes), attn_implementation="sdpa")
    return {"fox": fox, "llama": llama}


def warmup_tokens_for(cache_implementation, new_tokens, dynamic_warmup=17):
    """New tokens of the warm-up generate() at a shape: with a dynamic cache 17 (cache lengths with and without a
    factor of 16 run differently specialised decode kernels, so 17 steps compile both); with a static cache the
    timed run's count, since generate() sizes the cache for the longest run yet, and a longer later run would
    recompile (and record its CUDA graphs) inside the timed run."""
    return new_tokens if cache_implementation == "static" else dynamic_warmup


def bench_generate(results, new_tokens=256, cache_implementations=("dynamic",)):
    """generate() tokens/s. LLaMA runs twice: with SDPA's default backend choice (what `attn_implementation="sdpa"`
    gives users; on an H100 decoding picks cuDNN) and with SDPA's flash backend forced."""
    rows = results.setdefault("generate", [])
    for name, model in same_size_models().items():
        model = model.to("cuda", torch.bfloat16).eval()
        backends = {"fox": [None], "llama": [None, SDPBackend.FLASH_ATTENTION]}[name]
        for cache, backend, prompt in ((cache, backend, prompt) for cache in cache_implementations
                                       for prompt in (8192, 32768) for backend in backends):
            ids = torch.randint(3, 32000, (1, prompt), device="cuda")
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
            if cache != "dynamic":
                kwargs["cache_implementation"] = cache
            with torch.no_grad(), sdpa_kernel(backend) if backend else contextlib.nullcontext():
                # Warm up at this prompt length (autotuning, compiling).
                model.generate(ids, max_new_tokens=warmup_tokens_for(cache, new_tokens), **kwargs)
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=1, **kwargs)
                torch.cuda.synchronize()
                prefill_s = time.perf_counter() - start
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
                torch.cuda.synchronize()
                total_s = time.perf_counter() - start
            label = name if backend is None else f"{name} (SDPA flash forced)"
            row = dict(model=label, cache_implementation=cache, prompt=prompt, new_tokens=new_tokens,
                       prefill_s=prefill_s, total_s=total_s,
                       tokens_per_s=new_tokens / total_s,
                       decode_tokens_per_s=(new_tokens - 1) / max(total_s - prefill_s, 1e-9))
            rows.append(row)
            print(row, flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()


def eviction_model(evict, max_positions, dtype, fast_fraction=0.7, kv_heads=10):
    """A 4-layer FoX with QK-norm whose KV heads are 70% fast forgetting (log f ~ -2, ~20-token memory) and 30% slow
    (bias 8: they barely forget), with or without `decode_kv_eviction`."""
    config = FoxConfig.fox_llama(
        vocab_size=32000, hidden_size=1280, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=kv_heads,
        num_key_value_heads=kv_heads, qk_norm=True, max_position_embeddings=max_positions, decode_kv_eviction=evict,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FoxForCausalLM(config).to(dtype).eval()
    fast = round(fast_fraction * kv_heads)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.fgate_proj.bias.copy_(torch.tensor([-2.0] * fast + [8.0] * (kv_heads - fast)))
    return model, fast


def bench_eviction(results, prompt=131072, same_tokens_prompt=16384, new_tokens=64):
    """Cache memory after a 128k-token prompt with and without eviction (bf16), and whether greedy decoding gives
    the same tokens (fp32: a random-init model's top logits are near ties, which bf16 rounding alone can flip)."""
    rows = results.setdefault("eviction", [])
    for evict in (False, True):
        model, fast = eviction_model(evict, prompt, torch.bfloat16)
        weights = torch.cuda.memory_allocated()
        ids = torch.randint(3, 32000, (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                                 return_dict_in_generate=True)
        del ids
        gc.collect()
        torch.cuda.empty_cache()
        cache = getattr(out, CACHE_ARG)
        config = model.config
        row = dict(decode_kv_eviction=evict, prompt=prompt, fast_kv_heads=fast, kv_heads=config.num_key_value_heads,
                   layers=config.num_hidden_layers, cached_length=cache.get_seq_length(),
                   stored_tokens_per_layer=cache.layers[0].num_stored_tokens(),
                   cache_gbytes=(torch.cuda.memory_allocated() - weights) / 1e9)
        rows.append(row)
        print(row, flush=True)
        del model, out, cache
        gc.collect()
        torch.cuda.empty_cache()
    full, evicted = rows[-2:]
    results["eviction_memory_reduction_pct"] = 100 * (1 - evicted["cache_gbytes"] / max(full["cache_gbytes"], 1e-9))
    results["eviction_stored_tokens_reduction_pct"] = 100 * (
        1 - evicted["stored_tokens_per_layer"] / full["stored_tokens_per_layer"])
    tokens = {}
    for evict in (False, True):
        model, _ = eviction_model(evict, same_tokens_prompt, torch.float32)
        ids = torch.randint(3, 32000, (1, same_tokens_prompt), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(1))
        with torch.no_grad():
            tokens[evict] = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)[0, same_tokens_prompt:].tolist()
        del model
        torch.cuda.empty_cache()
    results["eviction_same_tokens"] = dict(prompt=same_tokens_prompt, new_tokens=new_tokens, dtype="float32",
                                           same=tokens[False] == tokens[True],
                                           first_difference=next((i for i, (a, b) in enumerate(zip(*tokens.values()))
                                                                  if a != b), None))
    print("eviction:", {key: results[key] for key in results if key.startswith("eviction_")}, flush=True)


# The serving part's models (labels of its rows) and the ratios its table gives: (numerator, denominator).
SERVING_RATIOS = {"fox_over_llama": ("fox", "llama"),
                  "eviction_over_no_eviction": ("fox-fast-heads+eviction", "fox-fast-heads")}


def cache_bytes(cache):
    """Bytes of the keys and values (and FoX's gate sums) that a generate() cache holds."""
    total = 0
    for layer in cache.layers:
        tensors = ([t for group in layer.kv_groups() for t in group[:3]] if hasattr(layer, "kv_groups")
                   else [layer.keys, layer.values])
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def timed_generate(model, ids, **kwargs):
    """(generate()'s output, seconds), the GPU synchronised around it."""
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0,
                         **kwargs)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def measure_serving(models, batches, prompts, new_tokens, device, cache_implementation="dynamic", warmup_tokens=17,
                    prefill_chunk_size=None):
    """Yield one row per (batch, prompt, model) of greedy generate(): decode tokens/s, prefill time, peak memory (CUDA:
    of everything allocated, the weights of all models held included; `allocated_before_bytes` is what was allocated
    when the timed run started) and the cache's bytes after generation. `models` maps labels to models, already on
    `device` in their dtype. The rows run from the fewest prompt tokens (batch x prompt) to the most, every model at
    one shape before the next; a row that runs out of memory comes back with `skipped` (the reason) and no timings.
    `prefill_chunk_size` has generate() prefill every model in chunks of that many tokens; a model that runs out of
    memory there is tried again with chunks half as long, down to `MIN_PREFILL_CHUNK` (a prefill chunk's memory can
    exceed what decoding needs: LLaMA's 4-D mask for a static cache is chunk x cache length per row); each row
    records the chunk it ran with."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    # "dynamic" is generate()'s default; with "static" generate() on CUDA compiles the decode step.
    cache_kwargs = {} if cache_implementation == "dynamic" else dict(cache_implementation=cache_implementation)
    chunks = [None]
    if prefill_chunk_size:
        chunks = [prefill_chunk_size]
        while chunks[-1] // 2 >= MIN_PREFILL_CHUNK:
            chunks.append(chunks[-1] // 2)
    warmup_tokens = warmup_tokens_for(cache_implementation, new_tokens, warmup_tokens)

    def release_memory():
        if cache_implementation != "dynamic":  # each shape compiles anew: drop the last graphs and their pools
            torch.compiler.reset()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    for batch, prompt in sorted(((b, p) for b in batches for p in prompts), key=lambda bp: (bp[0] * bp[1], bp[0])):
        for label, model in models.items():
            row = dict(model=label, decode_kv_eviction=getattr(model.config, "decode_kv_eviction", False), batch=batch,
                       prompt=prompt, new_tokens=new_tokens, cache_implementation=cache_implementation,
                       dtype=str(model.dtype).removeprefix("torch."))
            for chunk in chunks:
                row["prefill_chunk_size"] = chunk
                kwargs = cache_kwargs if chunk is None else dict(cache_kwargs, prefill_chunk_size=chunk)
                try:
                    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device=device,
                                        generator=torch.Generator(device).manual_seed(0))
                    with torch.no_grad():
                        # Warm-up at this shape (`warmup_tokens_for`).
                        timed_generate(model, ids, max_new_tokens=warmup_tokens, **kwargs)
                        _, prefill_s = timed_generate(model, ids, max_new_tokens=1, **kwargs)
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(device)
                            row["allocated_before_bytes"] = torch.cuda.memory_allocated(device)
                        out, total_s = timed_generate(model, ids, max_new_tokens=new_tokens,
                                                      min_new_tokens=new_tokens, return_dict_in_generate=True,
                                                      **kwargs)
                    decode_s = max(total_s - prefill_s, 1e-9)
                    row.pop("skipped", None)
                    row.update(prefill_s=prefill_s, decode_s=decode_s,
                               decode_tokens_per_s=(new_tokens - 1) * batch / decode_s,
                               peak_memory_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
                               cache_bytes=cache_bytes(getattr(out, CACHE_ARG)))
                    del out
                except torch.OutOfMemoryError as error:
                    row["skipped"] = f"out of memory: {str(error).splitlines()[0]}"
                ids = None
                release_memory()
                if "skipped" not in row:
                    break
            yield row


def serving_summary(rows):
    """Per (cache implementation, batch, prompt): every model's decode tokens/s (None where skipped) and the
    `SERVING_RATIOS`."""
    summary = []
    shape = lambda r: (r["cache_implementation"], r["batch"], r["prompt"])  # noqa: E731
    for cache, batch, prompt in dict.fromkeys(map(shape, rows)):
        speed = {r["model"]: r.get("decode_tokens_per_s") for r in rows if shape(r) == (cache, batch, prompt)}
        ratios = {name: speed[a] / speed[b] if speed.get(a) and speed.get(b) else None
                  for name, (a, b) in SERVING_RATIOS.items()}
        summary.append(dict(batch=batch, prompt=prompt, cache_implementation=cache, decode_tokens_per_s=speed,
                            **ratios))
    return summary


def print_serving_table(summary):
    def cell(value, digits=1):
        return "skipped" if value is None else f"{value:.{digits}f}"

    (fox, llama), (evicting, keeping) = SERVING_RATIOS.values()
    print("| batch | prompt | FoX tokens/s | LLaMA tokens/s | FoX / LLaMA | FoX 70% fast heads | with eviction "
          "| eviction / no eviction | cache |")
    print("|---|---|---|---|---|---|---|---|---|")
    for entry in summary:
        speed = entry["decode_tokens_per_s"]
        print(f"| {entry['batch']} | {entry['prompt']} | {cell(speed.get(fox))} | {cell(speed.get(llama))} "
              f"| {cell(entry['fox_over_llama'], 2)} | {cell(speed.get(keeping))} | {cell(speed.get(evicting))} "
              f"| {cell(entry['eviction_over_no_eviction'], 2)} | {entry['cache_implementation']} |")


def bench_serving(results, batches=(1, 8, 32, 64), prompts=(4096, 32768), new_tokens=256,
                  cache_implementations=("dynamic",), save=None, prefill_chunk_size=None):
    """Batch-serving decode throughput and memory (`measure_serving`) of the generate part's FoX and LLaMA and of the
    eviction part's model with and without eviction, bf16; `save()` after every row."""
    models = {label: model.to(torch.bfloat16).eval() for label, model in same_size_models().items()}
    for evict in (False, True):  # the same seed: the same weights
        model, _ = eviction_model(evict, max(prompts) + new_tokens, torch.bfloat16)
        models["fox-fast-heads+eviction" if evict else "fox-fast-heads"] = model
    gc.collect()
    torch.cuda.empty_cache()
    rows = results.setdefault("serving", [])
    for cache_implementation in cache_implementations:
        for row in measure_serving(models, batches, prompts, new_tokens, "cuda", cache_implementation,
                                   prefill_chunk_size=prefill_chunk_size):
            rows.append(row)
            print(row, flush=True)
            results["serving_summary"] = serving_summary(rows)
            if save:
                save()
    print_serving_table(results["serving_summary"])


def main():
    args = parse_args()
    results = new_record(peak_bandwidth_bytes_per_s=peak_bandwidth())
    path = record_path(args.out, "decode", results)
    caches = args.cache_implementations
    save = lambda: write_record(path, results)  # noqa: E731
    parts = {"attention": bench_attention,
             "launch": bench_launch,
             "generate": lambda results: bench_generate(results, args.new_tokens, caches),
             "eviction": bench_eviction,
             "serving": lambda results: bench_serving(results, args.serving_batches, args.serving_prompts,
                                                      args.new_tokens, caches, save=save,
                                                      prefill_chunk_size=args.prefill_chunk_size)}
    for part in args.parts.split(","):
        parts[part](results)
        write_record(path, results)
    print("wrote", path)


if __name__ == "__main__":
    main()
