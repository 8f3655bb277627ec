"""FoX decoding speed and memory: the split-K decode kernel, generate() against LLaMA, and KV eviction.

One run on one GPU, bf16, three parts (each can be skipped):
- attention: one new token against a cache of L keys, batch B, 32 query / 8 KV heads, D = 64 and 128. Achieved HBM
  bandwidth = bytes of K and V read (2 * B * L * Hkv * D * 2) / time, for our kernel and for PyTorch SDPA
  (`enable_gqa`) on the same (B, Hkv, L, D) cache (SDPA without the forget bias: what plain decoding costs).
- generate: tokens/s of `generate()` (greedy, batch 1, 256 new tokens after an 8k or 32k prompt, prefill included
  and reported apart) for a FoxForCausalLM and a LlamaForCausalLM (SDPA, default backend and flash forced) of the
  same size.
- eviction: cache memory after a 128k-token prompt and 64 new tokens (bf16), on a FoX model whose KV heads are 70%
  fast forgetting, with and without `decode_kv_eviction`; and whether greedy tokens stay the same (fp32, 16k prompt).
Results go to benchmarks/results/decode_<device>_<date-time>.json (written after every part) and are printed.

    python benchmarks/bench_decode.py [--parts attention,generate,eviction] [--out DIR]
"""

import argparse
import contextlib
import gc
import time

from .run_record import RESULTS_DIR, new_record, record_path, write_record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="attention,generate,eviction")
    parser.add_argument("--out", default=RESULTS_DIR)
    return parser.parse_args(argv)


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

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s, SXM parts


def peak_bandwidth():
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


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
                k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                c = torch.randn(B, Hq, L, device="cuda").cumsum(-1) * 1e-3
                q = torch.randn(B, 1, Hq, D, device="cuda", dtype=torch.bfloat16)

                def fox():
                    return forgetting_decode(q, k.transpose(1, 2), v.transpose(1, 2), c.transpose(1, 2))

                def sdpa():
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)

                row = dict(B=B, L=L, D=D, Hq=Hq, Hkv=Hkv, kv_gbytes=kv_bytes / 1e9)
                for name, fn in (("fox", fox), ("sdpa", sdpa)):
                    ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
                    row[f"{name}_us"] = ms * 1e3
                    row[f"{name}_gbps"] = kv_bytes / ms / 1e6
                    row[f"{name}_pct_peak"] = 100 * kv_bytes / (ms * 1e-3) / peak if peak else None
                rows.append(row)
                print({key: round(val, 1) if isinstance(val, float) else val for key, val in row.items()}, flush=True)
                del k, v, c, q
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


def bench_generate(results, new_tokens=256):
    """generate() tokens/s. LLaMA runs twice: with SDPA's default backend choice (what `attn_implementation="sdpa"`
    gives users; on an H100 decoding picks cuDNN) and with SDPA's flash backend forced."""
    rows = results.setdefault("generate", [])
    for name, model in same_size_models().items():
        model = model.to("cuda", torch.bfloat16).eval()
        backends = {"fox": [None], "llama": [None, SDPBackend.FLASH_ATTENTION]}[name]
        for backend, prompt in ((backend, prompt) for prompt in (8192, 32768) for backend in backends):
            ids = torch.randint(3, 32000, (1, prompt), device="cuda")
            kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
            with torch.no_grad(), sdpa_kernel(backend) if backend else contextlib.nullcontext():
                # Warm up at this prompt length (autotuning; cache lengths with and without a factor of 16 run
                # differently specialised kernels, so 17 steps compile both before the timed runs).
                model.generate(ids, max_new_tokens=17, **kwargs)
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
            row = dict(model=label, prompt=prompt, new_tokens=new_tokens, prefill_s=prefill_s, total_s=total_s,
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


def main():
    args = parse_args()
    results = new_record(peak_bandwidth_bytes_per_s=peak_bandwidth())
    path = record_path(args.out, "decode", results)
    parts = {"attention": bench_attention, "generate": bench_generate, "eviction": bench_eviction}
    for part in args.parts.split(","):
        parts[part](results)
        write_record(path, results)
    print("wrote", path)


if __name__ == "__main__":
    main()
