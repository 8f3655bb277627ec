"""Retrofit recipes side by side: `foxlm finetune` with each recipe's options at the same training budget.

    python benchmarks/retrofit_study.py --minutes 2 --recipes default,no-kl,no-transfer,kl-3 [--model SRC]

Every recipe runs the whole job (conversion with or without attention transfer, fine-tuning, evaluation on the
held-out domains with top-1 agreement and the needle test) in DIR/<recipe>, with `--max-minutes` as its training
budget; the documents are tokenized once for all. The summaries (each run's summary.json) go to
benchmarks/results/retrofit_study_<device>_<date>.json, and a Markdown table of the headline numbers is printed.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from foxlm import finetune

RECIPES = {
    "default": [],
    "no-kl": ["--kl-weight", "0"],
    "kl-3": ["--kl-weight", "3"],
    "no-transfer": ["--transfer-steps", "0"],
    "no-token-shift": ["--no-token-shift"],
    "gates-only-transfer": ["--transfer-qk-rank", "0"],
    "full": ["--full"],
    "no-samples": ["--teacher-samples", "0"],
    "attention-lora": ["--lora-modules", "attention"],
    "samples-4m": ["--teacher-samples", str(2**22)],
    "full-samples-4m": ["--full", "--teacher-samples", str(2**22)],
    "transfer-qk-rank-32": ["--transfer-qk-rank", "32"],
    "distill-only": ["--distill-only"],
    "samples-t0.7": ["--sample-temperature", "0.7"],
    "no-checkpointing": ["--no-gradient-checkpointing"],
}


def cached_documents():
    """`finetune.load_documents`, remembered per data option: tokenizing the corpus once saves minutes."""
    original, cache = finetune.load_documents, {}

    def load(args, tokenizer):
        key = (args.text_files, args.dataset, args.eval_domains, args.corpus_dir)
        if key not in cache:
            cache[key] = original(args, tokenizer)
        return cache[key]

    return load


def cached_samples():
    """`finetune.teacher_samples`, remembered per sampling option and copied into each run: sampling from the
    original once saves minutes. Each run's file keeps the time the sampling took."""
    original, cache = finetune.teacher_samples, {}

    def sample(args, source, run_dir):
        key = (source, args.teacher_samples, args.sample_length, args.sample_batch_size, args.sample_temperature)
        if key not in cache:
            cache[key] = (original(args, source, run_dir), (run_dir / finetune.SAMPLES_FILE).read_bytes())
        documents, saved = cache[key]
        (run_dir / finetune.SAMPLES_FILE).write_bytes(saved)
        return documents

    return sample


def band_change(bands, label, reference, band):
    value, base = bands[label].get(band), bands[reference].get(band)
    return None if value is None or base is None else value / base - 1


def table(runs):
    """Markdown: one row per recipe, loss change vs the original below its context per domain, top-1 agreement,
    the worst band beyond the original's context against its last band (prose), needle accuracy."""
    domains = sorted({d for run in runs.values() for d in run["summary"].get("vs_original", {})})
    header = (["recipe", "steps"] + [f"{d}: loss vs original" for d in domains]
              + [f"{d}: top-1 agreement" for d in domains]
              + ["prose: worst band past the original's context", "needle", "sampled from the original"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, run in runs.items():
        summary = run["summary"]
        vs = summary.get("vs_original", {})
        row = [name, str(summary.get("training", {}).get("steps"))]
        row += [f"{vs[d]['loss_change']:+.1%}" if d in vs else "-" for d in domains]
        row += [f"{vs[d]['top1_agreement']:.1%}" if d in vs else "-" for d in domains]
        prose = summary["domains"].get("prose", {}).get("loss", {}).get(finetune.FINE_TUNED, {})
        within = summary.get("within_original_context")
        inside = [v for band, v in prose.items() if v is not None and int(band.split("-")[1]) <= within]
        beyond = [v for band, v in prose.items() if v is not None and int(band.split("-")[0]) >= within]
        row.append(f"{max(beyond) - inside[-1]:+.3f} nats" if inside and beyond else "-")
        needle = (summary.get("needle") or {}).get(finetune.FINE_TUNED, {})
        row.append(", ".join(f"{int(c) // 1024}k {a:.0%}" if int(c) >= 1024 else f"{c} {a:.0%}"
                             for c, a in needle.items()) or "-")
        samples = summary.get("teacher_samples")
        row.append(f"{samples['tokens'] / 1e6:.1f}M tokens in {samples['seconds']:.0f} s" if samples else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="default,no-kl,no-transfer,kl-3",
                        help=f"comma-separated, of {', '.join(RECIPES)} (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=2.0, help="training budget of each recipe")
    parser.add_argument("--model", default=None, help="source model (default: finetune's)")
    parser.add_argument("--output-dir", default="retrofit-study", help="where the runs go")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"), help="where the JSON goes")
    parser.add_argument("finetune_args", nargs=argparse.REMAINDER,
                        help="after --: options given to every recipe (e.g. -- --eval-length 16384)")
    args = parser.parse_args()
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    common = [a for a in args.finetune_args if a != "--"] + (["--model", args.model] if args.model else [])
    finetune.load_documents = cached_documents()
    finetune.teacher_samples = cached_samples()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    # The recipes in the name: studies started in the same minute (one per GPU) keep their own files.
    path = Path(args.results) / (f"retrofit_study_{device.replace(' ', '_')}_{time.strftime('%Y%m%d-%H%M')}_"
                                 f"{'+'.join(recipes)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in recipes:
        run_dir = Path(args.output_dir) / name
        options = [*RECIPES[name], *common, "--max-minutes", str(args.minutes), "--output-dir", str(run_dir),
                   "--force"]
        start = time.time()
        finetune.main(options, prog=f"finetune ({name})")
        runs[name] = {"options": options, "seconds": round(time.time() - start, 1),
                      "summary": json.loads((run_dir / "summary.json").read_text())}
        print(table(runs))
        path.write_text(json.dumps({"device": device, "torch": torch.__version__, "minutes": args.minutes,
                                    "runs": runs, "table": table(runs)}, indent=2) + "\n")  # after every recipe
    print(f"\n{table(runs)}\n\nwrote {path}")


if __name__ == "__main__":
    main()
