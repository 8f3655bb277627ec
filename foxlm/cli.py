"""The `foxlm` command. Run `foxlm --help` or `foxlm COMMAND --help`.

torch, transformers and the model load only inside the commands: building the parser and answering `--help` or
`--version` import none of them.
"""

import argparse
import contextlib
import errno
import math
import random
import sys
import time
from pathlib import Path

from foxlm import __version__
from foxlm.benchmarks import BENCHMARKS, run as run_benchmark
from foxlm.errors import FoxlmError

# `foxlm convert llama` defaults and choices (also `foxlm finetune`'s --slow-pairs). They are foxlm.conversion.llama's
# and foxlm.configuration_fox's (tests/test_cli.py checks that they agree), written here because those import torch.
GATE_INITS = ("open", "decay-spread")
SLOW_PAIRS = ("drop", "clamp", "interpolate", "compress")
SLOWER_SLOW_PAIRS = ("interpolate", "compress")  # the two that --interpolate-to sets
POSITION_MAPPED_SLOW_PAIRS = ("clamp", "compress")  # the two that --slow-pairs-start sets
SLOW_PAIRS_START_HELP = ("with the slow pairs clamped or compressed, the position up to which they turn as in the "
                         "original, instead of partial RoPE's cut (compressed, CONTEXT / POSITION times slower past "
                         "it): --partial-rope 4096 --slow-pairs-start 8192 on an 8k original compresses the pairs of "
                         "wavelength 4k-8k too, past 8k only, so that within 8k the converted model still computes "
                         "what the original does")
DEFAULT_GATE_INIT = "decay-spread"
DEFAULT_GATE_BIAS = 5.0
DEFAULT_DECAY_TIMES = (2.0, 512.0)
BYTE_OFFSET = 3  # the demo's ids 0, 1, 2 are pad, bos, eos; byte b is token b + 3


def stdlib_source_bytes(files, max_files=None, seed=0):
    """UTF-8 bytes of up to `max_files` of the given standard library files, in a random order."""
    files = list(files)
    random.Random(seed).shuffle(files)
    return [f.read_bytes() for f in files[:max_files]]


def demo_prompt(files, max_bytes=240):
    """The opening of the first function of a standard library file the demo does not train on: its lines up to and
    including the first `def` line."""
    for path in files:
        lines = path.read_bytes().splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.lstrip().startswith(b"def ") and line.rstrip().endswith(b":"):
                prompt = b"".join(lines[max(0, i - 4) : i + 1])[-max_bytes:]
                return path, prompt
    raise RuntimeError("no function found in the held-out standard library files")


def run_demo(args):
    """Pretrain a byte-level FoX (Pro) briefly on stdlib sources, save it with its code, reload it and continue a
    function of a file it did not train on."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from foxlm import FoxConfig, FoxForCausalLM
    from foxlm.data import stdlib_split
    from foxlm.model_card import demo_card
    from foxlm.outputs import check_target, save_model_folder

    output_dir = Path(args.output_dir)
    check_target(output_dir, force=args.force)
    torch.manual_seed(args.seed)
    train_files, held_out_files = stdlib_split()
    stream = torch.cat([torch.tensor(list(doc), dtype=torch.long) + BYTE_OFFSET
                        for doc in stdlib_source_bytes(train_files, 200, args.seed)])
    config = FoxConfig.fox_pro(
        vocab_size=256 + BYTE_OFFSET, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden_size // 32), pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = FoxForCausalLM(config).train()
    print(f"FoX (Pro): {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"context {args.context}, {args.steps} steps of {args.batch_size} sequences")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    losses, start = [], time.time()
    for _ in (bar := tqdm(range(args.steps), desc="training")):
        starts = torch.randint(0, len(stream) - args.context, (args.batch_size,))
        batch = torch.stack([stream[s : s + args.context] for s in starts.tolist()])
        loss = model(batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    final = sum(losses[-10:]) / len(losses[-10:])
    print(f"loss {losses[0]:.2f} -> {final:.2f} nats per byte in {time.time() - start:.0f} s "
          f"(a uniform guess over 256 bytes: {math.log(256):.2f})")

    card = demo_card(name=output_dir.name, steps=args.steps, context=args.context, losses=losses,
                     parameters=sum(p.numel() for p in model.parameters()))
    save_model_folder(output_dir, model, card=card, force=args.force)
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    path, prompt = demo_prompt(held_out_files)
    generated = reloaded.generate(
        torch.tensor([list(prompt)]) + BYTE_OFFSET, max_new_tokens=args.new_tokens, do_sample=True,
        temperature=args.temperature, top_k=20, pad_token_id=0,
    )
    text = bytes((generated[0, len(prompt) :] - BYTE_OFFSET).clamp(0, 255).tolist())
    print(f"saved to {output_dir} (weights + code: loads with trust_remote_code=True)\n\n"
          f"The opening of a function from {path.name}, a file it did not train on, and {args.new_tokens} bytes "
          f"sampled after it (temperature {args.temperature}, top-k 20), between the lines:\n"
          f"{'-' * 78}\n{prompt.decode('utf-8', errors='replace')}"
          f"{text.decode('utf-8', errors='replace')}\n{'-' * 78}\n"
          "A few minutes of training on bytes teach the look of Python (indentation, keywords, names, "
          "brackets),\nnot working code: the sample should read like Python, not make sense. More --steps, a "
          "larger --hidden-size and more --layers go further.")


def run_convert_llama(args):
    from foxlm.conversion import convert_llama_to_fox

    try:
        transfer = transfer_options(args) if args.transfer_steps else {}
    except FileNotFoundError as error:  # a corpus that is not installed
        raise FoxlmError(str(error)) from error
    output_dir = convert_llama_to_fox(
        args.source, args.output_dir, keep_rope=args.keep_rope, partial_rope=args.partial_rope,
        slow_pairs=args.slow_pairs, interpolate_to=args.interpolate_to, slow_pairs_start=args.slow_pairs_start,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size, force=args.force, gate_init=args.gate_init, gate_bias=args.gate_bias,
        decay_times=tuple(args.decay_times), token_shift=args.token_shift, output_gate=args.output_gate,
        logn_scaling=args.logn_scaling, **transfer,
    )
    print(f"saved a FoX model to {output_dir} (see its README.md); next: fine-tune it on long documents "
          f"(`foxlm finetune --model {args.source}` converts and fine-tunes in one go)")


def transfer_options(args):
    """`convert_llama_to_fox`'s attention-transfer arguments: --transfer-data (default: `foxlm finetune`'s training
    text) tokenized by the source's tokenizer, cut as `foxlm finetune` cuts it."""
    from transformers import AutoConfig, AutoTokenizer

    from foxlm.conversion.llama import resolve_source
    from foxlm.data import read_texts, text_files, tokenize_documents, training_texts
    from foxlm.finetune import transfer_options as finetune_transfer_options
    from foxlm.outputs import check_target

    check_target(args.output_dir, force=args.force, sources=[args.source])  # before tokenizing a corpus for nothing
    name_or_path, kwargs = resolve_source(args.source)
    context = getattr(AutoConfig.from_pretrained(name_or_path, **kwargs), "max_position_embeddings", None)
    texts = read_texts(text_files(args.transfer_data)) if args.transfer_data else training_texts()
    documents = tokenize_documents(AutoTokenizer.from_pretrained(name_or_path, **kwargs), texts, add_bos=False)
    return finetune_transfer_options(args, documents, context)


def run_convert_official(args):
    from foxlm.conversion import convert_official_to_fox

    output_dir = convert_official_to_fox(args.source, args.output_dir, dtype=args.dtype,
                                         max_shard_size=args.max_shard_size, force=args.force)
    print(f"saved the foxlm model to {output_dir}")


def add_convert_commands(commands):
    convert = commands.add_parser(
        "convert", help="turn a LLaMA-family or an official FoX checkpoint into a foxlm model folder",
        description="Convert checkpoints into foxlm FoX models. `foxlm convert llama` retrofits forget gates onto "
                    "a pretrained LLaMA-family model; `foxlm convert official` imports the FoX paper's checkpoints.",
    )
    kinds = convert.add_subparsers(dest="kind", required=True)

    def add_output_options(parser):
        parser.add_argument("output_dir", metavar="OUT", help="folder to write; must be empty or absent (see --force)")
        parser.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                            help="dtype of the saved weights; auto keeps the source's (default: %(default)s)")
        parser.add_argument("--max-shard-size", default="5GB", type=shard_size,
                            help="largest safetensors file, e.g. 500MB; bigger models are split (default: "
                                 "%(default)s)")
        parser.add_argument("--force", action="store_true",
                            help="replace OUT if foxlm wrote it (an earlier conversion), once the new model is fully "
                                 "written; never a folder that holds SRC or the working directory")

    llama = kinds.add_parser(
        "llama", help="add forget gates to a LLaMA, SmolLM2, Mistral or Qwen2 checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Turn a pretrained LLaMA-family model into a Forgetting Transformer.\n\n"
                    "Every weight is kept; each attention head gets a forget gate (a small new projection), and RoPE\n"
                    "is dropped (FoX needs no position embedding; --keep-rope keeps it). The converted model starts\n"
                    "worse than the original, since its attention was trained with RoPE: fine-tune it on long\n"
                    "documents next (`foxlm finetune --model SRC` converts and fine-tunes in one go).\n\n"
                    "Supported: LlamaForCausalLM (Llama 2/3, SmolLM2), MistralForCausalLM (sliding window dropped),\n"
                    "Qwen2ForCausalLM (q/k/v biases). OUT gets the model (safetensors), its config, tokenizer,\n"
                    "generation config and a README.md model card.\n\n"
                    "examples:\n"
                    "  foxlm convert llama HuggingFaceTB/SmolLM2-135M smollm2-fox\n"
                    "  foxlm convert llama ./my-llama my-llama-fox --dtype bf16\n"
                    "  foxlm convert llama SmolLM2-135M-Instruct.Q4_1.gguf smollm2-fox --dtype fp32",
    )
    llama.add_argument("source", metavar="SRC",
                       help="a model folder, a Hub id (read through the Hugging Face cache; works offline once "
                            "cached) or a .gguf file")
    add_output_options(llama)
    rope = llama.add_mutually_exclusive_group()
    rope.add_argument("--keep-rope", action="store_true",
                      help="keep rotary position embeddings; with --gate-init open --gate-bias 30 (gates fully open) "
                           "the model computes what the original computes")
    rope.add_argument("--partial-rope", nargs="?", type=positive_float, const=True, default=False, metavar="TOKENS",
                      help="keep RoPE only on the channel pairs whose wavelength is shorter than TOKENS (default: the "
                           "source's context, max_position_embeddings) and drop it on the slower ones, whose angles "
                           "beyond the context were never trained: the converted model starts close to the source "
                           "(docs/retrofit.md)")
    llama.add_argument("--slow-pairs", choices=SLOW_PAIRS, default=None,
                       help="with --partial-rope, the pairs slower than TOKENS: clamp their rotation, rotating them "
                            "as the source does up to position TOKENS and no further, so that within TOKENS the "
                            "model computes what the source does (the default), drop it, interpolate it (turn "
                            "them as far over --interpolate-to tokens as the source did over TOKENS), or compress "
                            "it (as the source up to position TOKENS, CONTEXT / TOKENS times slower past it)")
    llama.add_argument("--interpolate-to", type=positive_float, default=None, metavar="CONTEXT",
                       help="with --slow-pairs interpolate or compress, the context the model is meant for, in tokens "
                            "(above TOKENS): the slow pairs turn CONTEXT / TOKENS times slower")
    llama.add_argument("--slow-pairs-start", type=positive_float, default=None, metavar="POSITION",
                       help=SLOW_PAIRS_START_HELP)
    llama.add_argument("--gate-init", choices=GATE_INITS, default=DEFAULT_GATE_INIT,
                       help="how the new forget gates start (weights are zero either way): decay-spread gives the "
                            "heads of each layer decay times log-spaced over --decay-times; open gives every head "
                            "bias --gate-bias (default: %(default)s)")
    llama.add_argument("--gate-bias", type=finite_float, default=DEFAULT_GATE_BIAS,
                       help="forget-gate bias for --gate-init open; f = sigmoid(bias), 5 gives 0.993 "
                            "(default: %(default)s)")
    llama.add_argument("--decay-times", type=positive_float, nargs=2, metavar=("MIN", "MAX"),
                       default=DEFAULT_DECAY_TIMES,
                       help="shortest and longest decay time in tokens for --gate-init decay-spread "
                            "(default: %(default)s)")
    llama.add_argument("--token-shift", action="store_true",
                       help="add FoX Pro's key and value token shift (starting near no shift; the attention transfer "
                            "trains it): it gives back the previous-token information RoPE carried. `foxlm finetune` "
                            "converts with it")
    llama.add_argument("--output-gate", action="store_true",
                       help="add FoX Pro's output gate (starting as no gate; the attention transfer trains it): a "
                            "head can scale its output token by token, as softmax attention does by parking its "
                            "weight on the first token, which a forget gate lets decay. `foxlm finetune` converts "
                            "with it")
    llama.add_argument("--logn-scaling", action="store_true",
                       help="scale each query past the source's context by log(position) / log(context), so that "
                            "its attention is not diluted by more keys than the source ever saw (Qwen's log-n "
                            "attention; docs/retrofit.md)")
    transfer = llama.add_argument_group(
        "attention transfer (docs/retrofit.md)",
        "Train each layer's forget gate (and token shift, output gate), and a low-rank update of q_proj/k_proj with "
        "--transfer-qk-rank, to reproduce "
        "the source's attention outputs on the source's hidden states before saving. Minutes on a GPU; recovers much "
        "of what dropping RoPE loses, before any fine-tuning.")
    transfer.add_argument("--transfer-steps", type=at_least(0), default=0,
                          help="optimizer steps; 0 converts without transfer (default: %(default)s)")
    transfer.add_argument("--transfer-data", default=None, metavar="GLOB",
                          help="text files to run the source on (default: the training text of `foxlm finetune`: "
                               "code and documentation)")
    transfer.add_argument("--transfer-qk-rank", type=at_least(0), default=8,
                          help="rank of the q/k updates, merged into the weights; 0 trains the gates only "
                               "(default: %(default)s)")
    transfer.add_argument("--transfer-lr", type=positive_float, default=1e-2,
                          help="Adam's learning rate (default: %(default)s)")
    transfer.add_argument("--transfer-length", type=at_least(1), default=2048,
                          help="tokens per sequence, capped at the source's context (default: %(default)s)")
    transfer.add_argument("--transfer-batch-size", type=at_least(1), default=8,
                          help="sequences per step (default: %(default)s)")
    transfer.add_argument("--seed", type=at_least(0), default=0,
                          help="seeds the q/k updates' initialisation (default: %(default)s)")
    llama.set_defaults(func=run_convert_llama)

    official = kinds.add_parser(
        "official", help="import a checkpoint of the FoX paper (zhixuan-lin/forgetting-transformer format)",
        description="Import a checkpoint saved by the official forgetting_transformer code (model_type "
                    "'forgetting_transformer-project_fox', FoX Pro or FoX LLaMA) into foxlm, logits unchanged.",
    )
    official.add_argument("source", metavar="SRC", help="the checkpoint folder or Hub id")
    add_output_options(official)
    official.set_defaults(func=run_convert_official)


def documents_for_eval(args, tokenizer, length, data):
    """Evaluation token id lists for one `--data` item: a domain of foxlm.data (code, docs, kernel, prose; stdlib =
    code: its held-out files packed into `length`-token documents), a glob of text files or a `datasets` name (one
    document each, longest first; `--pack` packs them)."""
    from foxlm.data import DOMAIN_ALIASES, DOMAINS, held_out_documents, packed_documents, read_texts, text_files
    from foxlm.data import tokenize_documents

    try:
        if data in DOMAINS or data in DOMAIN_ALIASES:
            return held_out_documents(tokenizer, data, length, args.num_docs, corpus_dir=args.corpus_dir)
        if any(ch in data for ch in "*?[") or Path(data).exists():
            texts = read_texts(text_files(data))
        else:
            from datasets import load_dataset

            texts = load_dataset(data, split=args.split)[args.text_column]
        if args.pack:
            return packed_documents(tokenizer, texts, length, args.num_docs)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: --data {data}: {error}")
    texts = sorted(texts, key=len, reverse=True)[: args.num_docs]  # the longest reach furthest
    # No EOS on unpacked documents: predicting a document's end is not what the curve measures, and it spikes the tail.
    return tokenize_documents(tokenizer, texts, add_bos=False, add_eos=False)


def eval_output_paths(args, *names):
    """The files an eval command writes (`check_result_files`: existing ones only with --force, and only if foxlm
    wrote them)."""
    from foxlm.outputs import check_result_files

    return check_result_files(args.output_dir, names, force=args.force)


def run_per_token_loss(args):
    """L(i) of each model on each --data's documents, with top-1 agreement with --reference, to JSON and a PNG."""
    import torch

    from transformers import AutoTokenizer

    from foxlm.benchmarks.run_record import new_record
    from foxlm.conversion.llama import resolve_source
    from foxlm.evaluation import evaluate_models, format_report, write_evaluation_report

    labels = args.labels.split(",") if args.labels else [str(source) for source in args.models]
    if len(labels) != len(args.models):
        sys.exit(f"error: --labels names {len(labels)} models, but {len(args.models)} MODELs were given.")
    reference = args.reference or (labels[0] if len(labels) > 1 else None)
    if reference is not None and reference not in labels:
        sys.exit(f"error: --reference {reference!r} is none of the models' labels ({', '.join(labels)}).")
    models, windows = dict(zip(labels, args.models)), {}
    if args.sliding_window:
        windowed = reference or labels[0]
        windows = {f"{windowed}, sliding window": args.sliding_window}
        models.update({label: models[windowed] for label in windows})
    json_path, png_path = eval_output_paths(args, "per_token_loss.json", "per_token_loss.png")
    source = args.tokenizer or args.models[0]
    name_or_path, kwargs = resolve_source(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as error:
        message = " ".join(str(error).split())
        raise FoxlmError(f"could not load a tokenizer from {source} ({message}); give one with --tokenizer.") from error
    documents = {data: documents_for_eval(args, tokenizer, args.max_length, data) for data in args.data.split(",")}
    on_gpu = torch.cuda.is_available()
    results = evaluate_models(models, documents, args.max_length, reference=reference, windows=windows,
                              dtype=torch.bfloat16 if on_gpu else torch.float32, device="cuda" if on_gpu else "cpu")
    report = write_evaluation_report(results, json_path, png_path, train_context=args.train_context,
                                     min_documents=args.min_documents, reference=reference, data=args.data,
                                     models={label: str(source) for label, source in zip(labels, args.models)},
                                     run=new_record())
    counts = ", ".join(f"{data} {len(docs)}" for data, docs in documents.items())
    print(f"documents: {counts} (bands average the positions that at least {args.min_documents} reach)\n\n"
          f"{format_report(report, reference)}\n\nwrote {json_path} and {png_path}")


def run_needle(args):
    """Easy-mode needle-in-a-haystack over context lengths and depths, to JSON and a PNG heatmap."""
    import torch

    from foxlm.benchmarks.run_record import new_record
    from foxlm.data import DOMAIN_ALIASES, DOMAINS
    from foxlm.evaluation import NEEDLE_BATCH_TOKENS, NEEDLE_DEPTHS, accuracy_by_context_text
    from foxlm.evaluation import accuracy_by_distance_text, held_out_haystacks
    from foxlm.evaluation import load_causal_lm
    from foxlm.evaluation import needle_over_haystacks, needle_summary, plot_needle, write_json

    json_path, png_path = eval_output_paths(args, "needle.json", "needle.png")
    args.depths = args.depths or list(NEEDLE_DEPTHS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_causal_lm(args.model, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                      device=device)
    length = max(args.context_lengths)
    if args.data in DOMAINS or args.data in DOMAIN_ALIASES:
        try:
            haystacks = held_out_haystacks(tokenizer, length, args.haystacks, args.data, corpus_dir=args.corpus_dir)
        except (FileNotFoundError, ValueError) as error:
            sys.exit(f"error: --data {args.data}: {error}")
    else:
        stream = [t for doc in documents_for_eval(args, tokenizer, length, args.data) for t in doc]
        if len(stream) < length * args.haystacks:
            longest = f"the longest of --context-lengths ({length})"
            wanted, lower = (longest, "it") if args.haystacks == 1 else (f"--haystacks {args.haystacks} x {longest}",
                                                                          "them")
            raise FoxlmError(f"--data {args.data} gives {len(stream)} tokens, fewer than {wanted}; lower {lower} or "
                             "give more documents.")
        haystacks = [stream[i * length : (i + 1) * length] for i in range(args.haystacks)]
    scores, answers = needle_over_haystacks(model, tokenizer, haystacks, args.context_lengths, args.depths,
                                            batch_tokens=args.batch_tokens or NEEDLE_BATCH_TOKENS)
    summary = needle_summary(scores, args.context_lengths, args.depths, answers)
    write_json({"model": str(args.model), "data": args.data, "run": new_record(), **summary}, json_path)
    plot_needle({args.data: {str(args.model): summary}}, png_path, title=f"Needle in a haystack: {args.model}")
    by_context = accuracy_by_context_text(summary["accuracy_by_context"], ": ", summary.get("interval_by_context"))
    print(f"accuracy {scores.mean():.2f} over {scores.size} trials in {args.haystacks} haystack"
          f"{'s' if args.haystacks > 1 else ''} (by context length: {by_context}; by tokens between the needle and "
          f"the question: {accuracy_by_distance_text(summary['accuracy_by_distance'], ': ')}); wrote {json_path} "
          f"and {png_path}")


def at_least(minimum):
    """An argparse type: a whole number >= `minimum`."""
    def whole_number(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value

    return whole_number


def finite_float(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text):
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def shard_size(text):
    from foxlm.conversion.output import ConversionError, check_shard_size

    try:
        return check_shard_size(text)
    except ConversionError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def int_list(text):
    """Comma-separated whole numbers >= 1."""
    return [at_least(1)(x) for x in text.split(",")]


def depth_list(text):
    """Comma-separated fractions in [0, 1]."""
    depths = [finite_float(x) for x in text.split(",")]
    if not all(0 <= depth <= 1 for depth in depths):
        raise argparse.ArgumentTypeError(f"expected fractions between 0 and 1, got {text!r}")
    return depths


def hidden_size(text):
    value = at_least(32)(text)
    if value % 32:
        raise argparse.ArgumentTypeError(f"expected a multiple of 32 (heads of size 32), got {text!r}")
    return value


def add_eval_commands(commands):
    evaluate = commands.add_parser("eval", help="long-context evaluation: per-token loss, needle in a haystack")
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)

    def add_data_args(parser, num_docs, default, several):
        parser.add_argument(
            "--data", default=default,
            help=("comma-separated; each " if several else "") + "a domain of held-out text: code (the Python "
                 "standard library's files that fine-tuning holds out; 'stdlib' also works), docs (Python's "
                 "documentation and the Linux man pages, held out likewise), kernel (the Linux kernel's "
                 "documentation, held out likewise), prose (Jane Austen's novels, used nowhere in training), each "
                 "packed into long documents; or a glob of text files, or a `datasets` "
                 "name (default: %(default)s)")
        parser.add_argument("--corpus-dir", default=None,
                            help="read the Debian corpora from this folder (benchmarks/pack_corpus.py) "
                                 "instead of the installed Debian packages (default: $FOXLM_CORPUS_DIR)")
        parser.add_argument("--split", default="validation", help="split of a `datasets` --data (default: %(default)s)")
        parser.add_argument("--text-column", default="text",
                            help="text column of a `datasets` --data (default: %(default)s)")
        parser.add_argument("--pack", action="store_true",
                            help="pack a glob or `datasets` --data (EOS between documents) into documents of the "
                                 "full length, as the domains are; without it each file or record is one document")
        parser.add_argument("--num-docs", type=at_least(1), default=num_docs,
                            help="documents to use: the longest, or spread over the corpus when packed "
                                 "(default: %(default)s)")
        parser.add_argument("--output-dir", default="foxlm-eval",
                            help="where the JSON and PNG go (default: %(default)s)")
        parser.add_argument("--force", action="store_true", help="replace this command's results already in "
                            "--output-dir (nothing else there is touched)")

    loss = kinds.add_parser(
        "per-token-loss", help="the paper's L(i) curve for one or more causal LMs, as JSON and a PNG plot",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Mean next-token loss at each position i over long documents, for any causal LM (FoX or\n"
                    "not): compare a converted model with its original. MODEL: folder, Hub id or .gguf file.\n"
                    "A curve that keeps falling with i means the model uses the long context. With several\n"
                    "MODELs, also the top-1 agreement with --reference: the fraction of positions where a\n"
                    "model's most likely next token is the reference's. By default on three held-out domains:\n"
                    "code and docs (held out from fine-tuning's training data) and prose (used nowhere).\n\n"
                    "examples:\n"
                    "  foxlm eval per-token-loss SmolLM2-135M-Instruct.gguf smollm2-fox --labels original,fox\n"
                    "  foxlm eval per-token-loss ORIGINAL.gguf smollm2-fox --data prose --max-length 32768 \\\n"
                    "      --sliding-window 8192\n"
                    "  foxlm eval per-token-loss my-fox --data 'books/*.txt' --max-length 32768 --train-context 16384",
    )
    loss.add_argument("models", nargs="+", metavar="MODEL")
    loss.add_argument("--max-length", type=at_least(2), default=8192,
                      help="positions to evaluate, in tokens per document (default: %(default)s)")
    loss.add_argument("--train-context", type=at_least(1), default=None,
                      help="mark this training context on the plot (default: none)")
    loss.add_argument("--tokenizer", default=None, help="tokenizer source (default: the first MODEL's); every "
                      "MODEL must share it")
    loss.add_argument("--min-documents", type=at_least(1), default=3, help="leave positions reached by fewer documents "
                      "out of the plot and the band means; the JSON keeps them (default: %(default)s)")
    loss.add_argument("--labels", default=None, help="comma-separated legend names, one per MODEL (default: "
                      "the MODEL arguments)")
    loss.add_argument("--reference", default=None, help="the label of the model (the original) whose top-1 "
                      "predictions the others' are compared with (default: the first MODEL's, with several)")
    loss.add_argument("--sliding-window", type=at_least(2), default=None, metavar="TOKENS",
                      help="also run the reference (or the only MODEL) over a sliding window of TOKENS, e.g. its "
                           "trained context: each position sees the TOKENS/2 to TOKENS tokens before it, the fair "
                           "baseline past that context, where the model run whole breaks down (default: off)")
    add_data_args(loss, num_docs=16, default="code,docs,prose", several=True)
    loss.set_defaults(func=run_per_token_loss)

    needle = kinds.add_parser(
        "needle", help="needle-in-a-haystack (easy mode) over context lengths and depths, JSON + PNG heatmaps",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The FoX paper's easy mode: the needle carries its question, the prompt ends with the\n"
                    "question, and a trial passes when greedy decoding completes the answer. The haystack is\n"
                    "cut from the --data documents (default: held-out prose). The results give the accuracy\n"
                    "by context length and, pooled over lengths, by the tokens between the needle and the\n"
                    "question (bands doubling from 512): retrieval often fails at a distance, not a length.\n\n"
                    "example:\n"
                    "  foxlm eval needle my-fox --context-lengths 2048,4096,8192,16384,32768 --depths 0,0.5,1\n"
                    "  foxlm eval needle my-fox --context-lengths 4096,16384 --haystacks 3  # 33 trials a length",
    )
    needle.add_argument("model", metavar="MODEL")
    needle.add_argument("--context-lengths", type=int_list, default=[1024, 2048, 4096, 8192],
                        help="comma-separated prompt lengths in tokens (default: 1024,2048,4096,8192)")
    needle.add_argument("--depths", type=depth_list, default=None,
                        help="comma-separated needle depths, 0 = start of the haystack (default: every tenth, "
                             "0,0.1,...,1)")
    needle.add_argument("--haystacks", type=at_least(1), default=1, metavar="N",
                        help="test in N haystacks, each from another part of --data; a cell's score is the fraction "
                             "of them passed (default: %(default)s)")
    needle.add_argument("--batch-tokens", type=at_least(1), default=None, metavar="N",
                        help="prompt tokens a batch of trials holds (one prompt at least): lower it if a long context "
                             "runs out of memory (default: 131072, foxlm.evaluation.NEEDLE_BATCH_TOKENS)")
    add_data_args(needle, num_docs=64, default="prose", several=False)
    needle.set_defaults(func=run_needle)


def run_finetune(script_args):
    """`foxlm finetune ARGS`: the job of foxlm/finetune.py with ARGS (also `python examples/finetune_long_context.py
    ARGS` in a source checkout)."""
    from foxlm.finetune import main as finetune

    finetune(script_args, prog="foxlm finetune")


def run_bench(name, script_args):
    """`foxlm bench NAME ARGS` runs the benchmark module of foxlm.benchmarks named NAME with ARGS."""
    if name is None:
        listing = "\n".join(f"  {n:<17} {what}" for n, (_, what, _) in BENCHMARKS.items())
        message = (f"usage: foxlm bench NAME [options]\n\nRuns a benchmark of foxlm.benchmarks (`foxlm bench NAME "
                   f"--help` for its options):\n{listing}\n\nResults go to --out: benchmarks/results where foxlm "
                   "runs from its source checkout, else the working directory.")
        if {"-h", "--help"} & set(script_args):
            print(message)
            sys.exit(0)
        sys.exit(message)
    status = run_benchmark(name, script_args)
    if status:
        sys.exit(status)


def build_parser():
    parser = argparse.ArgumentParser(prog="foxlm", description="Forgetting Transformer (FoX) tools.")
    parser.add_argument("--version", action="version", version=f"foxlm {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure, not only its one-line "
                        "error (also taken after the command)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "finetune", add_help=False,
        help="the main job: convert SmolLM2 to FoX, fine-tune it for long context, plot per-token loss "
             "(`foxlm finetune --help` lists its options)",
    )
    bench = commands.add_parser(
        "bench", add_help=False,
        help="run a benchmark: " + ", ".join(BENCHMARKS) + " (`foxlm bench --help` says what each measures)",
    )
    bench.add_argument("name", nargs="?", choices=list(BENCHMARKS))
    demo = commands.add_parser(
        "demo", help="train a tiny byte-level FoX on Python's own sources, save, reload and generate",
        description="A short tour on the CPU (minutes on two cores): builds a FoX (Pro) model, trains it on the "
                    "Python standard library's source files (bytes as tokens), saves it with its code, reloads it "
                    "through AutoModelForCausalLM and continues the opening of a function from a file it did not "
                    "train on.",
    )
    demo.add_argument("--output-dir", default="foxlm-demo", help="where the trained model is saved "
                      "(default: %(default)s)")
    demo.add_argument("--force", action="store_true", help="replace --output-dir if foxlm wrote it (an earlier demo)")
    demo.add_argument("--steps", type=at_least(1), default=150, help="training steps (default: %(default)s)")
    demo.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per step (default: %(default)s)")
    demo.add_argument("--context", type=at_least(2), default=256, help="training sequence length in bytes "
                      "(default: %(default)s)")
    demo.add_argument("--hidden-size", type=hidden_size, default=128, help="model width; one head per 32 "
                      "(default: %(default)s)")
    demo.add_argument("--layers", type=at_least(1), default=4, help="decoder layers (default: %(default)s)")
    demo.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate, cosine decay "
                      "(default: %(default)s)")
    demo.add_argument("--new-tokens", type=at_least(0), default=160, help="bytes to sample after the prompt "
                      "(default: %(default)s)")
    demo.add_argument("--temperature", type=positive_float, default=0.7, help="sampling temperature "
                      "(default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the data order, weights and sampling "
                      "(default: %(default)s)")
    demo.set_defaults(func=run_demo)
    add_convert_commands(commands)
    add_eval_commands(commands)
    return parser


def is_user_failure(error):
    """Whether a failure is the input's or the machine's (one line), not a bug in foxlm (a traceback)."""
    import torch  # here, not at the top: --help and --version do not wait for it
    from safetensors import SafetensorError

    return isinstance(error, (FoxlmError, OSError, SafetensorError, torch.OutOfMemoryError))


def failure_message(error):
    """One line saying what went wrong and what to do, for a failure that is not a bug in foxlm."""
    import torch
    from safetensors import SafetensorError

    text = " ".join(str(error).split())  # some libraries' messages span lines
    if isinstance(error, FoxlmError):
        return text
    if isinstance(error, torch.OutOfMemoryError):
        return f"out of memory ({text[:200]}); lower the sizes (--context, --eval-length, ...) or use a larger GPU."
    if isinstance(error, SafetensorError):
        return f"a safetensors file could not be read ({text}): it is truncated or corrupt; download or save it again."
    where = f" {error.filename}" if error.filename else ""
    if error.errno == errno.ENOSPC:
        return (f"no space left on the device (writing{where}); free some space or write to another disk. Outputs are "
                "renamed into place only when complete: nothing half-written was kept.")
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"cannot write{where}: {error.strerror}; choose a folder you can write to."
    if error.errno == errno.ENOENT:
        return f"{error.filename or 'a file'} does not exist: check the path."
    return text


@contextlib.contextmanager
def failures_reported(debug=False):
    """Turn what is not a bug in foxlm into one line on stderr and a non-zero exit; `debug` keeps the traceback."""
    try:
        yield
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a failure: no traceback. Saves are staged, so nothing half-written stays.
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        # Bad input, or the disk: one line and a non-zero exit. Anything else is a bug and shows its traceback.
        if debug or not is_user_failure(error):
            raise
        sys.exit(f"error: {failure_message(error)}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # --debug belongs to the command wherever it stands: finetune and bench parse the rest of their options themselves.
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    parser = build_parser()
    # finetune's and bench's options belong to the job and the benchmarks they run, which parse them themselves.
    args, extra = parser.parse_known_args(argv)
    with failures_reported(debug):
        if args.command == "finetune":
            run_finetune(extra)
        elif args.command == "bench":
            run_bench(args.name, extra)
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        else:
            args.func(args)


if __name__ == "__main__":
    main()
