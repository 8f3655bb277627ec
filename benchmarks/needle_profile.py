"""Where a needle-in-a-haystack batch spends its time: --batch prompts of --length random tokens (by default the
batch that `foxlm eval needle` and `foxlm finetune` run at that length), timed as a forward without a cache, a forward
filling a cache, and `generate` of 8 tokens called as the needle test calls it (which decodes its answer's length
plus 2); then torch.profiler's table of one `generate`.

    python benchmarks/needle_profile.py foxlm-long-context/fine-tuned --out /tmp/profile

Prints the timings and writes them with the profile's tables (by device time, then by host time) to
needle_profile.txt in --out. On a CPU (no GPU) it runs in float32, for small --length only.
"""

import argparse
import time
from pathlib import Path

import torch

from foxlm.evaluation import load_causal_lm, needle_batch_size
from foxlm.outputs import write_file_atomic

NEW_TOKENS = 8


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a causal LM's folder (a FoX model, say)")
    parser.add_argument("--out", required=True, help="folder of needle_profile.txt")
    parser.add_argument("--length", type=int, default=32768, help="tokens a prompt (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=None,
                        help="prompts a batch (default: the needle test's at --length, 4 at 32k)")
    args = parser.parse_args(argv)
    batch = args.batch or needle_batch_size(args.length)
    on_gpu = torch.cuda.is_available()
    device, sync = ("cuda", torch.cuda.synchronize) if on_gpu else ("cpu", lambda: None)
    model, tokenizer = load_causal_lm(args.model, dtype=torch.bfloat16 if on_gpu else torch.float32, device=device)
    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch, args.length), device=device)
    mask = torch.ones_like(prompt)
    lines = []

    def timed(name, fn, repeats=3):
        fn()
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if on_gpu else ""
        lines.append(f"{name}: {min(times):.3f} s (min of {repeats}){peak}")
        print(lines[-1], flush=True)

    def generate():
        return model.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)

    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        timed("forward, no cache, logits_to_keep=1", lambda: model(prompt, use_cache=False, logits_to_keep=1))
        timed("forward, cache, logits_to_keep=1",
              lambda: model(prompt, attention_mask=mask, use_cache=True, logits_to_keep=1))
        timed(f"generate {NEW_TOKENS} tokens", generate)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
            generate()
            sync()
    averages = prof.key_averages()
    by_device = averages.table(sort_by="cuda_time_total" if on_gpu else "cpu_time_total", row_limit=30)
    print(by_device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n\n" + by_device + "\n\n" + averages.table(sort_by="cpu_time_total", row_limit=30)
    write_file_atomic(out / "needle_profile.txt", text + "\n")


if __name__ == "__main__":
    main()
