"""Token counts of foxlm.data's corpora with SmolLM2's tokenizer: each corpus's training and held-out files, the
default training mix, and how many held-out documents of 8k, 16k and 32k tokens each domain packs into.

    python benchmarks/corpus_tokens.py        # writes benchmarks/results/corpus_tokens.json
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from foxlm.benchmarks.run_record import write_record
from foxlm.data import CORPORA, DOMAINS, TRAINING_DOMAINS, corpus_split, smollm2_gguf_path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", default=None, help="read the packed corpora from here (pack_corpus.py)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "corpus_tokens.json"))
    args = parser.parse_args()
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def tokens(texts):  # with the EOS that packing puts after each file
        texts = list(texts)
        return sum(len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]) if texts else 0

    counts = {}
    for corpus, (domain, _) in CORPORA.items():
        train, held_out = corpus_split(corpus, args.corpus_dir)
        counts[corpus] = {"domain": domain, "train_files": len(train), "held_out_files": len(held_out),
                          "train_tokens": tokens(train.values()), "held_out_tokens": tokens(held_out.values())}
        print(corpus, counts[corpus], flush=True)
    domains = {domain: {split: sum(counts[c][f"{split}_tokens"] for c in DOMAINS[domain])
                        for split in ("train", "held_out")} for domain in DOMAINS}
    mix = sum(domains[d]["train"] for d in TRAINING_DOMAINS)
    for domain in DOMAINS:
        domains[domain]["share_of_training_mix"] = domains[domain]["train"] / mix if domain in TRAINING_DOMAINS else 0
        domains[domain]["held_out_documents"] = {n: domains[domain]["held_out"] // n for n in (8192, 16384, 32768)}
    result = {"tokenizer": gguf.name, "corpora": counts, "domains": domains, "training_mix_tokens": mix}
    write_record(args.output, result)
    print(json.dumps(domains, indent=2), f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
