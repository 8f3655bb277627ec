"""The `foxlm` command. Run `foxlm --help` or `foxlm COMMAND --help`."""

import argparse
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm


def stdlib_source_bytes(max_files=None, seed=0):
    """UTF-8 bytes of the Python standard library's own source files: real, long, offline text."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    return [f.read_bytes() for f in files[:max_files]]


def run_demo(args):
    """Pretrain a byte-level FoX (Pro) briefly on stdlib sources, save it with its code, reload and generate."""
    from transformers import AutoModelForCausalLM

    from foxlm import FoxConfig, FoxForCausalLM

    output_dir = Path(args.output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not args.force:
        sys.exit(f"error: {output_dir} exists and is not empty; pass --force to overwrite it.")
    torch.manual_seed(args.seed)
    offset = 3  # ids 0, 1, 2: pad, bos, eos; byte b is token b + 3
    stream = torch.cat([torch.tensor(list(doc), dtype=torch.long) + offset for doc in stdlib_source_bytes(200)])
    config = FoxConfig.fox_pro(
        vocab_size=256 + offset, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
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
    print(f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f} in {time.time() - start:.0f} s")

    model.save_pretrained(output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    prompt = torch.tensor([list(b"def ")]) + offset
    generated = reloaded.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    text = bytes((generated[0] - offset).clamp(0, 255).tolist()).decode("utf-8", errors="replace")
    print(f"saved to {output_dir} (weights + code: loads with trust_remote_code=True)\ngreedy sample:\n{text}")


def run_convert_llama(args):
    from foxlm.conversion import ConversionError, convert_llama_to_fox

    try:
        output_dir = convert_llama_to_fox(
            args.source, args.output_dir, keep_rope=args.keep_rope, dtype=args.dtype,
            max_shard_size=args.max_shard_size, force=args.force, gate_init=args.gate_init,
            gate_bias=args.gate_bias, decay_times=tuple(args.decay_times),
        )
    except ConversionError as error:
        sys.exit(f"error: {error}")
    print(f"saved a FoX model to {output_dir} (see its README.md); next: fine-tune it, "
          "e.g. examples/finetune_long_context.py")


def run_convert_official(args):
    from foxlm.conversion import ConversionError, convert_official_to_fox

    try:
        output_dir = convert_official_to_fox(
            args.source, args.output_dir, dtype=args.dtype, max_shard_size=args.max_shard_size, force=args.force
        )
    except ConversionError as error:
        sys.exit(f"error: {error}")
    print(f"saved the foxlm model to {output_dir}")


def add_convert_commands(commands):
    from foxlm.conversion.llama import DEFAULT_DECAY_TIMES, DEFAULT_GATE_BIAS, DEFAULT_GATE_INIT, GATE_INITS

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
        parser.add_argument("--max-shard-size", default="5GB",
                            help="largest safetensors file; bigger models are split (default: %(default)s)")
        parser.add_argument("--force", action="store_true", help="replace OUT if it exists (only once the new "
                            "model is fully written)")

    llama = kinds.add_parser(
        "llama", help="add forget gates to a LLaMA, SmolLM2, Mistral or Qwen2 checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Turn a pretrained LLaMA-family model into a Forgetting Transformer.\n\n"
                    "Every weight is kept; each attention head gets a forget gate (a small new projection), and RoPE\n"
                    "is dropped (FoX needs no position embedding; --keep-rope keeps it). The converted model starts\n"
                    "worse than the original, since its attention was trained with RoPE: fine-tune it on long\n"
                    "documents next (examples/finetune_long_context.py).\n\n"
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
    llama.add_argument("--keep-rope", action="store_true",
                       help="keep rotary position embeddings; with --gate-init open --gate-bias 30 (gates fully open) "
                            "the model computes what the original computes")
    llama.add_argument("--gate-init", choices=GATE_INITS, default=DEFAULT_GATE_INIT,
                       help="how the new forget gates start (weights are zero either way): decay-spread gives the "
                            "heads of each layer decay times log-spaced over --decay-times; open gives every head "
                            "bias --gate-bias (default: %(default)s)")
    llama.add_argument("--gate-bias", type=float, default=DEFAULT_GATE_BIAS,
                       help="forget-gate bias for --gate-init open; f = sigmoid(bias), 5 gives 0.993 "
                            "(default: %(default)s)")
    llama.add_argument("--decay-times", type=float, nargs=2, metavar=("MIN", "MAX"), default=DEFAULT_DECAY_TIMES,
                       help="shortest and longest decay time in tokens for --gate-init decay-spread "
                            "(default: %(default)s)")
    llama.set_defaults(func=run_convert_llama)

    official = kinds.add_parser(
        "official", help="import a checkpoint of the FoX paper (zhixuan-lin/forgetting-transformer format)",
        description="Import a checkpoint saved by the official forgetting_transformer code (model_type "
                    "'forgetting_transformer-project_fox', FoX Pro or FoX LLaMA) into foxlm, logits unchanged.",
    )
    official.add_argument("source", metavar="SRC", help="the checkpoint folder or Hub id")
    add_output_options(official)
    official.set_defaults(func=run_convert_official)


def build_parser():
    parser = argparse.ArgumentParser(prog="foxlm", description="Forgetting Transformer (FoX) tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a tiny byte-level FoX on Python's own sources, save, reload and generate",
        description="A one-minute tour on the CPU: builds a FoX (Pro) model, trains it on the Python standard "
                    "library's source files (bytes as tokens), saves it with its code, reloads it through "
                    "AutoModelForCausalLM and generates a few lines.",
    )
    demo.add_argument("--output-dir", default="foxlm-demo", help="where the trained model is saved")
    demo.add_argument("--force", action="store_true", help="overwrite a non-empty --output-dir")
    demo.add_argument("--steps", type=int, default=150, help="training steps")
    demo.add_argument("--batch-size", type=int, default=8)
    demo.add_argument("--context", type=int, default=256, help="training sequence length in bytes")
    demo.add_argument("--hidden-size", type=int, default=128)
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--lr", type=float, default=3e-3)
    demo.add_argument("--new-tokens", type=int, default=120, help="bytes to generate after the prompt 'def '")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=run_demo)
    add_convert_commands(commands)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
