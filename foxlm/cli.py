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
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
