"""How far back each forget gate lets a head see, domain by domain: for a FoX model (a retrofit's fine-tuned/ folder,
say) on held-out documents of --length tokens, the decay its gate puts on a key `gap` tokens before the query,
c_i - c_(i-gap) = the sum of log f over the gap (nats by which the key's attention logit is lowered, whatever q.k
says), per layer and head, for gaps that double from 512 tokens. Per gap and head: the median decay over the queries
(i >= gap) and the fraction of queries for which it is above -REACH_NATS, averaged over the documents.

A head that keeps a needle 16k tokens back within reach has a median decay near 0 at gap 16384; comparing domains
shows whether the gates close more on text unlike what the model was fine-tuned on (docs/retrofit.md, Study).

    python benchmarks/gate_decay.py --model foxlm-long-context/fine-tuned --length 32768

Writes gate_decay_<device>_<date>.json (a `foxlm.benchmarks.run_record` record) and .png in --out.
"""

import argparse
import contextlib
from pathlib import Path

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record

# A key whose logit the gate lowers by more than this many nats keeps under 1% of the weight it would have without
# the gate (e^-5 = 0.7%).
REACH_NATS = 5.0


@contextlib.contextmanager
def recorded_log_fgates(model, record):
    """While open, every FoxAttention layer of `model` appends the log f (B, T, heads) it computes to `record`."""
    layers = [layer.self_attn for layer in model.model.layers]

    def recording(attention):
        compute = attention.log_fgate

        def log_fgate(hidden_states):
            record.append(compute(hidden_states))
            return record[-1]
        return log_fgate

    for attention in layers:
        attention.log_fgate = recording(attention)
    try:
        yield record
    finally:
        for attention in layers:
            del attention.log_fgate  # the class's method again


def decay_statistics(log_fgate, gaps):
    """{gap: (median decay, fraction of queries within REACH_NATS)}, each per head, for one sequence's log f (T, heads);
    gaps not shorter than T are left out."""
    import torch

    c = torch.nn.functional.pad(log_fgate.double().cumsum(0), (0, 0, 1, 0))  # c[i + 1] - c[j + 1]: decay from j to i
    statistics = {}
    for gap in gaps:
        if gap >= len(log_fgate):
            continue
        decay = c[gap + 1 :] - c[1 : -gap]  # queries i = gap .. T-1, keys i - gap
        statistics[gap] = (decay.median(0).values, (decay > -REACH_NATS).double().mean(0))
    return statistics


def measure(model, documents, gaps):
    """{domain: {gap: {"median_decay": [[per head] per layer], "within_reach": ...}}}, averaged over documents."""
    import torch
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    results = {}
    for domain, docs in documents.items():
        sums = {}  # {gap: (layers, 2 statistics, heads)}
        for doc in tqdm(docs, desc=domain, unit="document"):
            with torch.no_grad(), recorded_log_fgates(model, []) as per_layer:
                model.model(torch.tensor([doc], device=device), use_cache=False)
            layers = [decay_statistics(log_fgate[0], gaps) for log_fgate in per_layer]
            for gap in layers[0]:
                stats = torch.stack([torch.stack(layer[gap]) for layer in layers]).cpu()
                sums[gap] = sums[gap] + stats if gap in sums else stats
        results[domain] = {str(gap): {"median_decay": (stats[:, 0] / len(docs)).tolist(),
                                      "within_reach": (stats[:, 1] / len(docs)).tolist()}
                           for gap, stats in sums.items()}
    return results


def heads_within_reach(by_gap):
    """{gap: how many heads (of all layers) have a median decay above -REACH_NATS}."""
    return {gap: sum(d > -REACH_NATS for heads in stats["median_decay"] for d in heads)
            for gap, stats in by_gap.items()}


def plot(results, path):
    """Per domain, a heatmap (layer x head) of the median decay at the longest gap; and per domain, how many heads
    keep a key within reach at each gap."""
    from foxlm.evaluation import pyplot, save_figure, short_tokens

    plt = pyplot()
    fig, axes = plt.subplots(1, len(results) + 1, figsize=(4.5 * (len(results) + 1), 4.5), squeeze=False)
    for ax, (domain, by_gap) in zip(axes[0], results.items()):
        longest = max(by_gap, key=int)
        image = ax.imshow(by_gap[longest]["median_decay"], cmap="viridis", vmin=-4 * REACH_NATS, vmax=0, aspect="auto")
        ax.set(title=f"{domain}: median decay {short_tokens(int(longest))} back (nats)", xlabel="head", ylabel="layer")
        fig.colorbar(image, ax=ax)
    ax = axes[0][-1]
    for domain, by_gap in results.items():
        counts = heads_within_reach(by_gap)
        ax.plot(range(len(counts)), list(counts.values()), marker="o", label=domain)
        ax.set_xticks(range(len(counts)), [short_tokens(int(gap)) for gap in counts])
    ax.set(title=f"heads with a median decay above -{REACH_NATS:g} nats", xlabel="tokens back", ylabel="heads")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="the FoX model, e.g. a `foxlm finetune` run's fine-tuned/ folder (its tokenizer too)")
    parser.add_argument("--domains", default="code,docs,prose",
                        help="held-out domains of foxlm.data (default: %(default)s)")
    parser.add_argument("--length", type=int, default=32768, help="tokens per document (default: %(default)s)")
    parser.add_argument("--docs", type=int, default=4, help="documents per domain (default: %(default)s)")
    parser.add_argument("--corpus-dir", default=None, help="packed corpora (default: the installed packages)")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the results (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("length", "docs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    gaps = [512 * 2**k for k in range(32) if 512 * 2**k < args.length]
    if not gaps:
        parser.error(f"--length must be above 512 (the shortest gap), got {args.length}")
    import torch

    from foxlm import FoxForCausalLM
    from foxlm.data import held_out_documents
    from foxlm.evaluation import load_causal_lm, short_tokens

    on_gpu = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if on_gpu else (torch.float32, "cpu")
    model, tokenizer = load_causal_lm(args.model, dtype=dtype, device=device)
    if not isinstance(model, FoxForCausalLM) or model.config.fgate_type == "none":
        parser.error(f"--model {args.model}: not a FoX model with forget gates")
    documents = {}
    for domain in args.domains.split(","):
        documents[domain] = held_out_documents(tokenizer, domain, args.length, args.docs, args.corpus_dir)
        if not documents[domain]:
            parser.error(f"--domains: the held-out {domain} text has no {args.length} tokens; give a smaller --length")
    record = new_record(model=args.model, length=args.length, reach_nats=REACH_NATS,
                        documents={domain: len(docs) for domain, docs in documents.items()})
    record["domains"] = measure(model, documents, gaps)
    path = Path(record_path(args.out, "gate_decay", record))
    write_record(path, record)
    plot(record["domains"], path.with_suffix(".png"))
    heads = model.config.num_hidden_layers * model.config.num_attention_heads
    for domain, by_gap in record["domains"].items():
        counts = ", ".join(f"{short_tokens(int(gap))} back {n}" for gap, n in heads_within_reach(by_gap).items())
        print(f"{domain}: heads of {heads} with a median decay above -{REACH_NATS:g} nats: {counts}")
    print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
