"""Token counts of foxlm.data's corpora with SmolLM2's tokenizer: each corpus's training and held-out files, the
default training mix, how many held-out documents of 8k, 16k and 32k tokens each domain packs into, and how much of
each split's text is in files at least 2k, 8k, 16k and 32k tokens long (single documents a packed block keeps whole).

    python benchmarks/corpus_tokens.py --force   # rewrites benchmarks/results/corpus_tokens.json
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from foxlm.benchmarks.run_record import add_output_arguments, refuse_existing_output, write_record
from foxlm.data import CORPORA, DOMAINS, TRAINING_DOMAINS, corpus_split, smollm2_gguf_path

LONG_FILE_TOKENS = (2048, 8192, 16384, 32768)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", default=None, help="read the packed corpora from here (pack_corpus.py)")
    add_output_arguments(parser, str(Path(__file__).parent / "results" / "corpus_tokens.json"))
    args = parser.parse_args()
    refuse_existing_output(parser, args.output, args.force)
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def file_tokens(texts):  # each file's, with the EOS that packing puts after it
        texts = list(texts)
        return [len(ids) + 1 for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []

    def in_long_files(lengths):
        return {n: sum(length for length in lengths if length >= n) for n in LONG_FILE_TOKENS}

    counts = {}
    for corpus, (domain, _) in CORPORA.items():
        counts[corpus] = {"domain": domain}
        for split, texts in zip(("train", "held_out"), corpus_split(corpus, args.corpus_dir)):
            lengths = file_tokens(texts.values())
            counts[corpus].update({f"{split}_files": len(lengths), f"{split}_tokens": sum(lengths),
                                   f"{split}_tokens_in_files_of_at_least": in_long_files(lengths)})
        print(corpus, counts[corpus], flush=True)
    domains = {}
    for domain, corpora in DOMAINS.items():
        domains[domain] = {split: sum(counts[c][f"{split}_tokens"] for c in corpora) for split in ("train", "held_out")}
        for split in ("train", "held_out"):
            total = domains[domain][split]
            domains[domain][f"{split}_share_in_files_of_at_least"] = {
                n: sum(counts[c][f"{split}_tokens_in_files_of_at_least"][n] for c in corpora) / total if total else 0
                for n in LONG_FILE_TOKENS}
    mix = sum(domains[d]["train"] for d in TRAINING_DOMAINS)
    for domain in DOMAINS:
        domains[domain]["share_of_training_mix"] = domains[domain]["train"] / mix if domain in TRAINING_DOMAINS else 0
        domains[domain]["held_out_documents"] = {n: domains[domain]["held_out"] // n for n in (8192, 16384, 32768)}
    mix_in_long_files = {n: sum(domains[d]["train"] * domains[d]["train_share_in_files_of_at_least"][n]
                                for d in TRAINING_DOMAINS) / mix for n in LONG_FILE_TOKENS}
    result = {"tokenizer": gguf.name, "corpora": counts, "domains": domains, "training_mix_tokens": mix,
              "training_mix_share_in_files_of_at_least": mix_in_long_files}
    write_record(args.output, result)
    print(json.dumps(domains, indent=2), f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
