"""Retrofit recipes side by side: `foxlm finetune` with each recipe's options at the same training budget.

    python benchmarks/retrofit_study.py --minutes 2 --recipes default,drop-rope,no-kl,kl-10 [--model SRC]

Every recipe runs the whole job (conversion with or without attention transfer, fine-tuning, evaluation on the
held-out domains with top-1 agreement and the needle test) in DIR/<recipe>, with `--max-minutes` as its training
budget; the documents are tokenized once for all. The summaries (each run's summary.json) go to
benchmarks/results/retrofit_study_<device>_<date>_<recipes>.json, each run's plots and needle results beside it
(retrofit_study_<device>_<date>_<recipe>{.png,_needle.json,_needle.png}), and a Markdown table of the headline numbers
is printed. With `--gpus 0,1,2,3` the recipes run at the same time, one per GPU (each in its own process, its output in
DIR/<recipe>.log; a GPU takes the next recipe when one ends), and one JSON holds them all. A GPU named twice
(`--gpus 0,1,0,1`) runs two recipes at once. The recipes that sample from the original alike share the first one's
samples: they start once it has saved them; samples given with `--samples-from` (another run's teacher_samples.npz)
serve them all from the start. Every recipe after the first takes the original's results (loss, sliding window, top-1
predictions, needle) from the first one's run where it saved them (`foxlm finetune --reuse-original-from`); with
`--original-from DIR` (an earlier run's folder) every recipe takes them from DIR.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from foxlm import finetune
from foxlm.benchmarks.run_record import new_record, record_path, write_record
from foxlm.evaluation import interval_text, short_tokens
from foxlm.outputs import write_file_atomic

RECIPES = {
    "default": [],
    # The default before 2026-11-29 (noon): 16k blocks (4 a pass), KL weight 10, files shuffled one by one, no copies.
    # Recipes below that name only some of these options were measured against it (each paragraph of the study
    # says which default it ran on).
    "context-16k-kl-10": ["--context", "16384", "--kl-weight", "10", "--no-group-related", "--copy-spans", "0"],
    # RoPE dropped whole, with the attention transfer: the default before 2026-11-28 (the study's "default" then).
    "drop-rope": ["--drop-rope"],
    "no-kl": ["--kl-weight", "0"],
    "no-transfer": ["--drop-rope", "--transfer-steps", "0"],
    "no-token-shift": ["--no-token-shift"],
    "gates-only-transfer": ["--drop-rope", "--transfer-qk-rank", "0"],
    "full": ["--full"],
    "no-samples": ["--teacher-samples", "0"],
    "attention-lora": ["--lora-modules", "attention"],
    "samples-4m": ["--teacher-samples", str(2**22)],
    "full-samples-4m": ["--full", "--teacher-samples", str(2**22)],
    "transfer-qk-rank-32": ["--drop-rope", "--transfer-qk-rank", "32"],
    "distill-only": ["--distill-only"],
    "samples-t0.7": ["--sample-temperature", "0.7"],
    "no-checkpointing": ["--no-gradient-checkpointing"],
    "lr-1e-3": ["--lr", "1e-3"],
    "context-4k": ["--context", "4096"],
    # Blocks of 32k (2 a pass, as many tokens): positions to 32k in training.
    "context-32k": ["--context", "32768", "--micro-batch-size", "2"],
    "distill-only-context-32k": ["--distill-only", "--context", "32768", "--micro-batch-size", "2"],
    "kernel-docs": ["--train-domains", "code,docs,kernel"],
    # The output gate is the default since 2026-11-27 (the study's "output-gate" recipe then; "default" was this one).
    "no-output-gate": ["--no-output-gate"],
    "transfer-800": ["--drop-rope", "--transfer-steps", "800"],
    # KL weight 10 is the default since 2026-11-28 (the study's "kl-10" recipe then); 3 was the default before it,
    # from 2026-11-27 (the study's "kl-3" recipe then), and 1 before that.
    "kl-1": ["--kl-weight", "1"],
    "kl-3": ["--kl-weight", "3"],
    # The transfer on blocks of the original's whole context (8k for SmolLM2): as many tokens a step as the default.
    "transfer-8k": ["--drop-rope", "--transfer-length", "8192", "--transfer-batch-size", "2"],
    # Partial RoPE is the default since 2026-11-28 (below the original's context, 8k for SmolLM2: the study's
    # "partial-rope" recipe then); these keep it on slower pairs too, or whole.
    "partial-rope-32k": ["--partial-rope", "32768"],
    "partial-rope-64k": ["--partial-rope", "65536"],
    # The cut below the original's context: the pairs of wavelength 4k-8k (1 of SmolLM2's 32: 5.8k) or 2k-8k (3:
    # 2.8k-5.8k) join the compressed slow pairs (past the cut 8 or 16 times slower), as YaRN stretches the pairs whose
    # wavelength nears the context instead of only those beyond it; left whole, they wrap around 3-11 times over
    # 16k-32k, so a key that far back can look as near as one a few tokens back. Within 8k the converted model then
    # differs from the original.
    "partial-rope-4k": ["--partial-rope", "4096"],
    "partial-rope-2k": ["--partial-rope", "2048"],
    # The same pairs joining the slow ones, compressed past the original's context only, as the default compresses
    # its slow pairs: within 8k the converted model computes the original's logits (measured 2026-11-30: the cuts
    # above moved the needle at 16k-32k and cost agreement within 8k; these separate the two). The cut at 4k is the
    # default since 2026-11-30 (evening; two seeds); "cut-at-context" is the default before it.
    "slow-pairs-from-4k": ["--partial-rope", "4096", "--slow-pairs-start", "8192"],
    "cut-at-context": ["--partial-rope"],
    "slow-pairs-from-2k": ["--partial-rope", "2048", "--slow-pairs-start", "8192"],
    "slow-pairs-from-4k-seed-1": ["--partial-rope", "4096", "--slow-pairs-start", "8192", "--seed", "1"],
    "slow-pairs-from-2k-seed-1": ["--partial-rope", "2048", "--slow-pairs-start", "8192", "--seed", "1"],
    "keep-rope": ["--keep-rope"],
    # Clamped slow pairs (they rotate up to the original's context and stop there) were the default from 2026-11-28
    # (evening: the study's "clamp-slow-pairs" recipe then) to 2026-11-30; "drop-slow-pairs" leaves them unrotated,
    # as before 2026-11-28.
    "drop-slow-pairs": ["--slow-pairs", "drop"],
    "clamp-slow-pairs": ["--slow-pairs", "clamp"],
    "clamp-slow-pairs-gate-bias-10": ["--slow-pairs", "clamp", "--gate-bias", "10"],
    # The gates' start with partial RoPE: decay times of about 8k and 22k tokens instead of 1,100 (on compressed slow
    # pairs, 2026-11-30: not the default).
    "gate-bias-9": ["--gate-bias", "9"],
    "gate-bias-10": ["--gate-bias", "10"],
    # The other way (a decay time of about 400 tokens): prose far past 8k rose more the more open the gates started,
    # so do gates that start more closed leave fewer far prose keys sharing the attention, and keep the needle?
    "gate-bias-6": ["--gate-bias", "6"],
    "kl-30": ["--kl-weight", "30"],
    "clamp-slow-pairs-kl-30": ["--slow-pairs", "clamp", "--kl-weight", "30"],
    # Blocks of 32k with a higher KL weight (the KL covers a quarter of a 32k block's positions, half of a 16k one's),
    # and with the files about one module kept together (a block holds text that refers back thousands of tokens).
    "context-32k-kl-30": ["--context", "32768", "--micro-batch-size", "2", "--kl-weight", "30"],
    "context-32k-group-related": ["--context", "32768", "--micro-batch-size", "2", "--group-related"],
    "context-32k-kl-30-group-related": ["--context", "32768", "--micro-batch-size", "2", "--kl-weight", "30",
                                        "--group-related", "--copy-spans", "0"],
    # The slow pairs interpolated (they turn 4 times slower, as far over 32k as the original's over 8k) instead of
    # clamped, with the 32k recipe above.
    "context-32k-kl-30-group-related-interpolate": ["--context", "32768", "--micro-batch-size", "2", "--kl-weight",
                                                    "30", "--group-related", "--slow-pairs", "interpolate",
                                                    "--copy-spans", "0"],
    # The same with 32 spans of each 32k block copied from earlier in it (about 8% of the tokens): training that
    # rewards retrieving from far back. 64 (one per 512 tokens) is the default since 2026-11-29 (noon).
    "context-32k-kl-30-group-related-copy-spans-32": ["--context", "32768", "--micro-batch-size", "2", "--kl-weight",
                                                      "30", "--group-related", "--copy-spans", "32"],
    "context-32k-kl-30-group-related-copy-spans-64": ["--context", "32768", "--micro-batch-size", "2", "--kl-weight",
                                                      "30", "--group-related", "--copy-spans", "64"],
    # The default before 2026-11-29 (noon; 16k blocks) with as large a share of copied tokens as 32 spans in 32k.
    "copy-spans-16": ["--context", "16384", "--kl-weight", "10", "--no-group-related", "--copy-spans", "16"],
    # Past the original's context, a KL to the original over a sliding window of its context as well (prose past 8k).
    "kl-past-context-1": ["--kl-weight-past-context", "1"],
    "kl-past-context-3": ["--kl-weight-past-context", "3"],
    # The default with the slow pairs interpolated instead of clamped (as "...-interpolate" above, which had no copies).
    "interpolate-slow-pairs": ["--slow-pairs", "interpolate"],
    # The slow pairs turning 4 times slower past 8k instead of stopping there: the default since 2026-11-30 (the
    # study's "compress-slow-pairs" recipe then, on the clamped default).
    "compress-slow-pairs": ["--slow-pairs", "compress"],
    # Compressed for a model meant for 32k or 128k (4 or 16 times slower past 8k) instead of twice --context (64k, 8
    # times slower: the default since 2026-12-01, the study's "compress-to-64k" recipe then), trained on 32k blocks.
    # 32k was the default before (--interpolate-to defaulted to --context); 128k ran on 2026-12-01 as compress-16x.
    "compress-to-32k": ["--interpolate-to", "32768"],
    "compress-to-128k": ["--interpolate-to", "131072"],
    # The two that moved the needle each way, together: slow pairs from 2k (16k: 58%, 2026-11-30, 22:59) 16 times slower
    # past 8k (32k: 45%, 2026-12-01).
    "slow-pairs-from-2k-16x": ["--partial-rope", "2048", "--slow-pairs-start", "8192", "--interpolate-to", "131072"],
    # Slow pairs as the original's to 6k, then 13.3 times slower (81,920 / 6,144): a key 32k back sits at most 8.1k
    # away on them, within the distances the original trained on, as with the cut at 4k of 2026-11-30 (15:11: at most
    # 7.5k, the needle at 32k found more often), while only the 6k-8k band leaves the original's angles within 8k.
    "slow-pairs-within-8k": ["--slow-pairs-start", "6144", "--interpolate-to", "81920"],
    # The default with twice its copied spans (128 a 32k block, the most a block holds): more training that rewards
    # retrieval from far back (measured on the clamped default, 2026-11-30).
    "copy-spans-128": ["--copy-spans", "128"],
    # The default with other seeds (training text order, samples, copied spans, LoRA's start): how far one run's
    # result moves from the next (the needle moved by up to 12 points between two runs of the same command).
    "seed-1": ["--seed", "1"],
    "seed-2": ["--seed", "2"],
    # The original's samples up to 4k or 8k tokens instead of 1k: long English of the original's own, nearer a novel
    # read 16k-32k tokens in (prose's worst band) than code and its documentation, the only long documents the default
    # trains on. A batch samples until its longest document ends and most documents reach the cap (78% at 1k), so
    # the batch is sized for one batch to hold the 2.1M tokens if documents average 2.7k / 5.2k tokens; its KV cache
    # (23 KB a token for SmolLM2) reaches about 72 GB, which an H200 holds.
    "sample-length-4k": ["--sample-length", "4096", "--sample-batch-size", "768"],
    "sample-length-8k": ["--sample-length", "8192", "--sample-batch-size", "400"],
    # Log-n attention scaling past the original's context (queries 1.08 times larger at 16k, 1.15 at 32k): against the
    # dilution of attention by keys the original never had (prose past 16k is worse with the whole context than in
    # the original's own window, and more open gates did not help the needle at 32k).
    "logn-scaling": ["--logn-scaling"],
    "logn-scaling-seed-1": ["--logn-scaling", "--seed", "1"],
    # A fifth more steps: the default's sampling and training take 10.8 of the goal's 15 minutes on an H200 (2026-11-30
    # 06:12 run; an H100 is slower), about 12.6 with these.
    "steps-360": ["--steps", "360"],
    # The same steps without recomputing the activations in the backward: its speed and memory decide whether the
    # goal's 15 minutes hold more steps than 360.
    "steps-360-no-checkpointing": ["--steps", "360", "--no-gradient-checkpointing"],
    # Blocks per pass on the 16k blocks of 2026-11-27 (four fill a step): one, eager, was the default before; four,
    # compiled, the default from then (2 of today's 32k blocks fill a step).
    "one-block-per-pass": ["--context", "16384", "--micro-batch-size", "1", "--no-compile"],
    "micro-batch-4": ["--context", "16384", "--micro-batch-size", "4", "--no-compile"],
    "micro-batch-4-compile": ["--context", "16384", "--micro-batch-size", "4", "--compile"],
}


def cached_documents():
    """`finetune.load_documents`, remembered per data option: tokenizing the corpus once saves minutes."""
    original, cache = finetune.load_documents, {}

    def load(args, tokenizer):
        key = (args.text_files, args.dataset, args.train_domains, args.group_related, args.eval_domains,
               args.corpus_dir, args.seed)
        if key not in cache:
            cache[key] = original(args, tokenizer)
        return cache[key]

    return load


def cached_samples():
    """`finetune.teacher_samples`, remembered per sampling option and copied into each run: sampling from the
    original once saves minutes. Each run's file keeps the time the sampling took."""
    original, cache = finetune.teacher_samples, {}

    def sample(args, source, run_dir):
        key = (source, args.teacher_samples, args.sample_length, args.sample_batch_size, args.sample_temperature,
               args.seed)
        if key not in cache:
            cache[key] = (original(args, source, run_dir), (run_dir / finetune.SAMPLES_FILE).read_bytes())
        documents, saved = cache[key]
        (run_dir / finetune.SAMPLES_FILE).write_bytes(saved)
        return documents

    return sample


def reused_samples(path):
    """`finetune.teacher_samples` that copies the samples another run saved (PATH, its teacher_samples.npz) into
    each run instead of sampling again."""
    saved = Path(path).read_bytes()

    def sample(args, source, run_dir):
        (run_dir / finetune.SAMPLES_FILE).write_bytes(saved)
        return finetune.saved_samples(run_dir / finetune.SAMPLES_FILE)

    return sample


SAMPLING_OPTIONS = ("--teacher-samples", "--sample-temperature", "--sample-length", "--sample-batch-size",
                    "--sample-cache", "--seed")


def sampling_options(recipe, finetune_args):
    """The options of `recipe`, with those every recipe of the study gets (`finetune_args`), that change what is
    sampled from the original."""
    options = [*RECIPES[recipe], *finetune_args]
    return [(option, value) for option, value in zip(options, options[1:]) if option in SAMPLING_OPTIONS]


def band_change(bands, label, reference, band):
    """`label`'s loss in `band` relative to `reference`'s, or None where either has none."""
    value, base = bands.get(label, {}).get(band), bands.get(reference, {}).get(band)
    return None if value is None or base is None else value / base - 1


def table(runs):
    """Markdown: one row per recipe, loss change vs the original below its context per domain, top-1 agreement,
    prose's worst band below the original's context against the original's, prose's worst band beyond it against
    its last band inside and against the original and the fine-tuned model run over a sliding window of the
    original's context (what the far tokens cost or gain), needle accuracy; then,
    for recipes run with several seeds (`seed_groups`), a row of each number's range over the seeds."""
    domains = sorted({d for run in runs.values() for d in run["summary"].get("vs_original", {})})
    header = (["recipe", "steps (seconds each), peak memory"] + [f"{d}: loss vs original" for d in domains]
              + [f"{d}: top-1 agreement" for d in domains]
              + ["prose: worst band below the original's context", "prose: worst band past the original's context",
                 "prose past it: worst band vs the original in a sliding window",
                 "prose past it: worst band vs the fine-tuned model in a sliding window", "needle",
                 "sampled from the original"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, run in runs.items():
        summary = run["summary"]
        training = summary.get("training", {})
        steps, seconds = training.get("steps"), training.get("seconds")
        row = [name, f"{steps} ({seconds / steps:.2f} s)" if steps and seconds else str(steps)]
        row[-1] += f", {training['peak_memory_gib']:g} GiB" if training.get("peak_memory_gib") else ""
        row += ["-" if value is None else style.format(value) for value, style in headline_numbers(summary, domains)]
        row.append(needle_text(summary.get("needle"), intervals=summary.get("needle_interval")))
        samples = summary.get("teacher_samples")
        row.append(f"{samples['tokens'] / 1e6:.1f}M tokens in {samples['seconds']:.0f} s" if samples else "-")
        lines.append("| " + " | ".join(row) + " |")
    for group in seed_groups(runs):
        numbers = [headline_numbers(runs[name]["summary"], domains) for name in group]
        row = [f"{', '.join(group)}: range over seeds", "-"]
        for column in zip(*numbers):
            values, style = [value for value, _ in column if value is not None], column[0][1]
            row.append(f"{style.format(min(values))} to {style.format(max(values))}" if values else "-")
        needles, ranges = [runs[name]["summary"].get("needle") or {} for name in group], {}
        for haystack, models in needles[0].items():
            for length in models.get(finetune.FINE_TUNED, {}):
                values = [needle.get(haystack, {}).get(finetune.FINE_TUNED, {}).get(length) for needle in needles]
                if None not in values:
                    ranges.setdefault(haystack, {finetune.FINE_TUNED: {}})[finetune.FINE_TUNED][length] = values
        row.append(needle_text(ranges, lambda values: f"{min(values):.0%}-{max(values):.0%}"))
        row.append("-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def headline_numbers(summary, domains):
    """The table's numeric columns of one run, each (value or None, its format string)."""
    vs = summary.get("vs_original", {})
    numbers = [(vs[d]["loss_change"] if d in vs else None, "{:+.1%}") for d in domains]
    numbers += [(vs[d]["top1_agreement"] if d in vs else None, "{:.1%}") for d in domains]
    loss = summary["domains"].get("prose", {}).get("loss", {})
    prose = loss.get(finetune.FINE_TUNED, {})
    within = summary.get("within_original_context")
    inside = [band for band, v in prose.items() if v is not None and int(band.split("-")[1]) <= within]
    beyond = [prose[band] for band, v in prose.items() if v is not None and int(band.split("-")[0]) >= within]
    changes = [band_change(loss, finetune.FINE_TUNED, finetune.ORIGINAL, band) for band in inside]
    numbers.append((max((change for change in changes if change is not None), default=None), "{:+.1%}"))
    numbers.append((max(beyond) - prose[inside[-1]] if inside and beyond else None, "{:+.3f} nats"))
    for reference in (finetune.ORIGINAL_WINDOWED, finetune.FINE_TUNED_WINDOWED):
        past = [band_change(loss, finetune.FINE_TUNED, reference, band) for band in prose
                if within and int(band.split("-")[0]) >= within]
        numbers.append((max((change for change in past if change is not None), default=None), "{:+.1%}"))
    return numbers


def needle_text(needle, percent=lambda accuracy: f"{accuracy:.0%}", intervals=None):
    """The fine-tuned model's needle accuracy by length, with the interval over haystacks where `intervals` (summary's
    needle_interval) has one, haystacks named when there are several; "-" without."""
    def interval(haystack, length):
        return interval_text(((intervals or {}).get(haystack, {}).get(finetune.FINE_TUNED) or {}).get(length))

    haystacks = {haystack: ", ".join(f"{short_tokens(int(length))} {percent(accuracy)}{interval(haystack, length)}"
                                     for length, accuracy in models.get(finetune.FINE_TUNED, {}).items())
                 for haystack, models in (needle or {}).items()}
    return "; ".join(text if len(haystacks) == 1 else f"{haystack}: {text}"
                     for haystack, text in haystacks.items()) or "-"


def seed_groups(runs):
    """Names of the runs whose recipes (RECIPES: the options besides those every recipe of a study shares) differ only
    in --seed, grouped: groups of two or more, in run order."""
    groups = {}
    for name in [name for name in runs if name in RECIPES]:
        options = RECIPES[name]
        seeds = {i for i, option in enumerate(options) if option == "--seed"}
        key = tuple(option for i, option in enumerate(options) if i not in seeds and i - 1 not in seeds)
        groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def reuse_original(name, recipes, args):
    """finetune's --reuse-original-from: --original-from's folder for every recipe, else the first recipe's run for
    every recipe but the first. The original is evaluated again where that folder does not hold its results yet, or
    where a recipe's options change the documents or the evaluation (finetune checks)."""
    if args.original_from:
        return ["--reuse-original-from", args.original_from]
    return [] if name == recipes[0] else ["--reuse-original-from", str(Path(args.output_dir) / recipes[0])]


def run_recipes(recipes, args, common, save):
    """Each recipe in turn in this process; `save(runs, recipe)` after each. Samples given (--samples-from) stand for
    the first recipe's: recipes that sample otherwise sample their own."""
    finetune.load_documents = cached_documents()
    own_samples = cached_samples()
    given = reused_samples(args.samples_from) if args.samples_from else own_samples
    first_options = sampling_options(recipes[0], args.finetune_args)
    runs = {}
    for name in recipes:
        same_samples = sampling_options(name, args.finetune_args) == first_options
        finetune.teacher_samples = given if same_samples else own_samples
        run_dir = Path(args.output_dir) / name
        options = [*RECIPES[name], *common, "--max-minutes", str(args.minutes), "--output-dir", str(run_dir),
                   "--force", *reuse_original(name, recipes, args)]
        start = time.time()
        finetune.main(options, prog=f"finetune ({name})")
        runs[name] = {"options": options, "seconds": round(time.time() - start, 1),
                      "summary": json.loads((run_dir / "summary.json").read_text())}
        print(table(runs))
        save(runs, name)
    return runs


# What each run writes that a reader of the results wants beside the study's JSON: the per-token loss plot, the
# needle's results and plot (`<stem>_<recipe><suffix>`).
RUN_FILES = {"evaluation.png": ".png", "needle.json": "_needle.json", "needle.png": "_needle.png"}


def copy_run_files(name, output_dir, stem):
    """The RUN_FILES that recipe `name`'s run wrote, as `stem`_<name><suffix>, each written whole or not at all."""
    for file, suffix in RUN_FILES.items():
        source = Path(output_dir) / name / file
        if source.exists():
            write_file_atomic(f"{stem}_{name}{suffix}", source.read_bytes())


def run_recipes_on_gpus(recipes, args, gpus, save):
    """Each recipe in a process of its own (this script, one recipe), one per slot of `gpus` at a time. Recipes that
    sample from the original as the first one does wait for its samples and reuse them."""
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    pending, running, runs = list(recipes), {}, {}
    sampler = recipes[0]
    # Samples given (--samples-from) stand for the first recipe's; without them the first recipe samples for the others.
    given = args.samples_from is not None
    samples = Path(args.samples_from) if given else output / sampler / finetune.SAMPLES_FILE
    sampler_started = time.time()
    samples_options = sampling_options(sampler, args.finetune_args)
    samples_wanted = ("--teacher-samples", "0") not in samples_options

    def sampled():  # given, or by this study's sampler, not an earlier study in this folder
        return given or (samples.exists() and samples.stat().st_mtime >= sampler_started)

    def ready(name):
        if name == sampler or not samples_wanted or sampled():
            return True
        sampler_ended = sampler not in [entry[0] for entry in running.values()]
        return sampling_options(name, args.finetune_args) != samples_options or sampler_ended

    while pending or running:
        for slot, gpu in enumerate(gpus):
            if slot in running or not pending or not ready(pending[0]):
                continue
            name = pending.pop(0)
            reuse = (given or name != sampler) and sampled() and (
                sampling_options(name, args.finetune_args) == samples_options)
            command = [sys.executable, __file__, "--recipes", name, "--minutes", str(args.minutes),
                       "--output-dir", str(output), "--results", str(output / f"{name}.result"),
                       *(["--model", args.model] if args.model else []),
                       *(["--samples-from", str(samples)] if reuse else []), "--", *args.finetune_args,
                       *reuse_original(name, recipes, args)]
            log = open(output / f"{name}.log", "w")
            print(f"{name}: GPU {gpu}, output in {log.name}"
                  + ((f", the samples in {samples}" if given else f", the samples of {sampler}") if reuse else ""))
            running[slot] = (name, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                        env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)))
        time.sleep(5)
        for slot, (name, log, process) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            del running[slot]
            if process.returncode:
                ended = (f"stopped by signal {-process.returncode}" if process.returncode < 0 else
                         f"failed (exit status {process.returncode})")
                print(f"{name} {ended}; see {log.name}")
                continue
            result = next((output / f"{name}.result").glob("retrofit_study_*.json"))
            runs[name] = {**json.loads(result.read_text())["runs"][name], "gpu": gpus[slot]}
            print(table(runs))
            save(runs, name)
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="default,no-kl,no-transfer,kl-3",
                        help=f"comma-separated, of {', '.join(RECIPES)} (default: %(default)s)")
    parser.add_argument("--minutes", type=float, default=2.0, help="training budget of each recipe")
    parser.add_argument("--model", default=None, help="source model (default: finetune's)")
    parser.add_argument("--output-dir", default="retrofit-study", help="where the runs go")
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"), help="where the JSON goes")
    parser.add_argument("--gpus", default=None, metavar="LIST",
                        help="comma-separated CUDA device indices: run the recipes at the same time, one per GPU; a "
                             "GPU named twice runs two at once (GPUs of one host share its CPUs and memory "
                             "bandwidth; the JSON says which ran where)")
    parser.add_argument("--samples-from", default=None, metavar="FILE",
                        help="the teacher samples another run saved (its teacher_samples.npz), used instead of "
                             "sampling from the original again, by every recipe that samples as the first one does")
    parser.add_argument("--original-from", default=None, metavar="DIR",
                        help="a folder holding the original's results of an earlier run (its original_evaluation.npz "
                             "and original_needle.json): every recipe takes them from there where they were computed "
                             "on the same documents with the same settings, the first recipe too")
    parser.add_argument("finetune_args", nargs=argparse.REMAINDER,
                        help="after --: options given to every recipe (e.g. -- --eval-length 16384)")
    args = parser.parse_args()
    args.finetune_args = [a for a in args.finetune_args if a != "--"]
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    gpus = args.gpus.split(",") if args.gpus else None
    if gpus is not None and not all(g.isdigit() for g in gpus):
        parser.error(f"--gpus: give CUDA device indices such as 0,1,2,3, not {args.gpus!r}")
    if args.samples_from and not Path(args.samples_from).is_file():
        parser.error(f"--samples-from: no file {args.samples_from}")
    if args.original_from and not Path(args.original_from).is_dir():
        parser.error(f"--original-from: no folder {args.original_from}")
    common = [*args.finetune_args, *(["--model", args.model] if args.model else [])]
    started = new_record(minutes=args.minutes, gpus=gpus)
    # The recipes in the name: studies started in the same minute keep their own files.
    stem = record_path(args.results, "retrofit_study", started).removesuffix(".json")
    path = Path(f"{stem}_{'__'.join(recipes)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)

    # After every recipe, whole or not at all (a study stopped mid-write keeps the last record).
    def save(runs, finished):
        write_record(path, {**started, "runs": runs, "table": table(runs)})
        copy_run_files(finished, args.output_dir, stem)

    runs = run_recipes_on_gpus(recipes, args, gpus, save) if gpus else run_recipes(recipes, args, common, save)
    print(f"\n{table(runs)}\n\nwrote {path}")
    if len(runs) < len(recipes):
        sys.exit(f"{len(recipes) - len(runs)} of {len(recipes)} recipes did not finish")


if __name__ == "__main__":
    main()
