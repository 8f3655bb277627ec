"""Long-context evaluation: the per-token loss curve L(i) and needle-in-a-haystack (easy mode), with plots.

Both work for any causal LM (FoX or not), so a converted model can be compared with its original.
"""

import io
import json
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .errors import FoxlmError


def load_causal_lm(source, dtype=None, device=None, with_tokenizer=True):
    """Any causal LM from a folder, a Hub id or a .gguf file (FoX models included), and its tokenizer."""
    from .conversion.llama import resolve_source

    name_or_path, kwargs = resolve_source(str(source))
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs).eval()
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs) if with_tokenizer else None
    except (OSError, ValueError, SafetensorError) as error:
        advice = ("its weights are truncated or corrupt: download or save the model again" if
                  isinstance(error, SafetensorError) else "give a causal LM's folder, Hub id or .gguf file")
        message = " ".join(str(error).split())
        raise FoxlmError(f"could not load {source} as a causal language model ({message}); {advice}.") from error
    if device is not None:
        model = model.to(device)
    return model, tokenizer


@torch.no_grad()
def per_token_loss(model, documents, max_length, device=None, chunk_size=4096, desc="per-token loss"):
    """L(i): the mean next-token loss at each position i over the documents (each truncated to `max_length`).

    Returns (loss, count): float64 arrays of length max_length - 1; position i holds the loss of predicting token
    i + 1 from tokens 0..i, averaged over the `count[i]` documents long enough to have it.

    The logits go through the output layer `chunk_size` positions at a time, from the base model's last hidden
    state: a whole 32k-token document's fp32 logits would take 6 GB with a 49k vocabulary. This is how LLaMA-family
    and FoX heads compute logits; models that scale or cap logits after the output layer are refused.
    """
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise ValueError(f"{type(model).__name__} transforms its logits after the output layer; per_token_loss "
                         "supports models whose logits are output_layer(last hidden state)")
    device = device or next(model.parameters()).device
    head = model.get_output_embeddings()
    total = np.zeros(max_length - 1)
    count = np.zeros(max_length - 1)
    for doc in tqdm(documents, desc=desc):
        ids = torch.tensor(doc[:max_length], device=device)[None]
        if ids.shape[1] < 2:
            continue
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        targets = ids[0, 1:]
        losses = torch.cat([F.cross_entropy(head(h).float(), t, reduction="none")
                            for h, t in zip(hidden.split(chunk_size), targets.split(chunk_size))])
        losses = losses.double().cpu().numpy()
        total[: len(losses)] += losses
        count[: len(losses)] += 1
    with np.errstate(invalid="ignore"):
        return total / count, count


def smooth(curve, window=101):
    """Centred moving average over `window` tokens (the paper's smoothing of L(i)), ignoring NaN positions.

    Near the start the window shrinks to about half the position, so a log-scaled plot keeps its early detail.
    """
    curve = np.asarray(curve, dtype=np.float64)
    valid = ~np.isnan(curve)
    sums = np.concatenate([[0.0], np.cumsum(np.where(valid, curve, 0.0))])
    counts = np.concatenate([[0.0], np.cumsum(valid)])
    positions = np.arange(len(curve))
    half = np.minimum(window // 2, positions // 2)
    lo, hi = np.maximum(positions - half, 0), np.minimum(positions + half + 1, len(curve))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[hi] - sums[lo]) / (counts[hi] - counts[lo])


def band_means(curve, edges):
    """Mean of `curve` over position bands [a, b) for consecutive `edges`: {"a-b": mean}, None where no position of
    the band has a value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN band is reported as None
        means = {f"{a}-{b}": float(np.nanmean(curve[a:b])) for a, b in zip(edges[:-1], edges[1:]) if a < len(curve)}
    return {band: None if np.isnan(mean) else mean for band, mean in means.items()}


def mask_sparse_positions(curve, count, min_documents):
    """`curve` with NaN where fewer than `min_documents` documents reach the position: the tail of L(i), where one
    or two documents remain, is noise rather than a trend."""
    curve = np.array(curve, dtype=np.float64)
    curve[np.asarray(count) < min_documents] = np.nan
    return curve


def plot_per_token_loss(curves, path, train_context=None, original_context=None, window=101):
    """One line per model (smoothed L(i)), log-scaled positions, training contexts marked; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    longest = max(len(curve) for curve in curves.values())
    for name, curve in curves.items():
        positions = np.arange(1, len(curve) + 1)
        ax.plot(positions, smooth(curve, window), label=name, linewidth=1.5)
    for context, label, style in ((original_context, "original model's context", ":"),
                                  (train_context, "fine-tuning context", "--")):
        if context and context <= longest:  # a line past the curves would stretch the axis
            ax.axvline(context, color="grey", linestyle=style, linewidth=1, label=f"{label} ({context})")
    ax.set_xscale("log")
    ax.set_xlabel("token position i")
    ax.set_ylabel(f"loss L(i) (moving average over {window} tokens)")
    ax.set_title("Per-token loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def compare_per_token_loss(sources, documents, max_length, dtype=None, device=None):
    """L(i) of several models on the same documents: ({label: curve}, count). `sources`: {label: folder, Hub id or
    .gguf file}; models are loaded one at a time."""
    curves, count = {}, None
    for label, source in sources.items():
        model, _ = load_causal_lm(source, dtype=dtype, device=device, with_tokenizer=False)
        curves[label], count = per_token_loss(model, documents, max_length, desc=label)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return curves, count


def write_per_token_loss_report(curves, count, json_path, png_path, train_context=None, original_context=None,
                                min_documents=3, **metadata):
    """The JSON (raw curves, documents per position, band means) and the PNG plot of a per-token loss comparison.

    Plot and band means leave out positions reached by fewer than `min_documents` documents; the JSON keeps every
    raw value (null where no document reaches). Returns the band means {label: {"a-b": mean}}.
    """
    max_length = len(count) + 1
    edges = sorted({0} | {e for e in (512, 2048, original_context, train_context, max_length) if e and e <= max_length})
    shown = {label: mask_sparse_positions(curve, count, min_documents) for label, curve in curves.items()}
    bands = {label: band_means(curve, edges) for label, curve in shown.items()}
    raw = {label: [None if np.isnan(x) else float(x) for x in curve] for label, curve in curves.items()}
    write_json({**metadata, "max_length": max_length, "train_context": train_context,
                "original_context": original_context, "min_documents": min_documents,
                "documents_per_position": count.astype(int).tolist(), "bands": bands, "per_token_loss": raw},
               json_path)
    plot_per_token_loss(shown, png_path, train_context=train_context, original_context=original_context)
    return bands


def format_bands(bands):
    """The band means as a text table, one row per model."""
    header = next(iter(bands.values()))
    lines = [f"{'model':<34}" + "".join(f"{band:>13}" for band in header)]
    for label, row in bands.items():
        lines.append(f"{label:<34}" + "".join(f"{'-' if v is None else f'{v:.3f}':>13}" for v in row.values()))
    return "\n".join(lines)


NEEDLE_QUESTION = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
NEEDLE_ANSWER = " eat a sandwich and sit in Dolores Park on a sunny day."


@torch.no_grad()
def needle_in_a_haystack(model, tokenizer, haystack_ids, context_lengths, depths, device=None):
    """Easy-mode needle-in-a-haystack (Qin et al., 2024; the FoX paper's setting for models without instruction
    tuning): the needle is the question with its answer; the prompt ends with the question; a trial passes when
    greedy decoding reproduces the answer. Returns a (len(depths), len(context_lengths)) array of 0/1 scores.

    `haystack_ids`: a long token id list the filler is cut from.
    """
    device = device or next(model.parameters()).device
    needle = tokenizer(" " + NEEDLE_QUESTION + NEEDLE_ANSWER + " ", add_special_tokens=False)["input_ids"]
    question = tokenizer("\n" + NEEDLE_QUESTION, add_special_tokens=False)["input_ids"]
    answer = tokenizer(NEEDLE_ANSWER, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    scores = np.zeros((len(depths), len(context_lengths)))
    trials = [(d, c) for d in range(len(depths)) for c in range(len(context_lengths))]
    for d, c in tqdm(trials, desc="needle"):
        filler_length = context_lengths[c] - len(bos) - len(needle) - len(question)
        if filler_length < 0 or filler_length > len(haystack_ids):
            raise ValueError(f"context length {context_lengths[c]} does not fit the needle and the haystack")
        filler = haystack_ids[:filler_length]
        at = int(round(depths[d] * filler_length))
        prompt = torch.tensor([bos + filler[:at] + needle + filler[at:] + question], device=device)
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(answer) + 2,
                                   do_sample=False, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(generated[0, prompt.shape[1] :], skip_special_tokens=True)
        scores[d, c] = float(NEEDLE_ANSWER.strip().rstrip(".") in text)
    return scores


def plot_needle(scores, context_lengths, depths, path, title="Needle in a haystack (easy mode)"):
    """Heatmap of pass (1) / fail (0) over depth (rows) and context length (columns); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1 + 0.6 * len(context_lengths), 1 + 0.4 * len(depths)))
    ax.imshow(scores, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(context_lengths)), [f"{c // 1024}k" if c >= 1024 else str(c) for c in context_lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def save_figure(fig, path):
    """Save a matplotlib figure as a PNG at `path`, renamed into place whole (a crash leaves the old plot or the
    new one), and close it."""
    import matplotlib.pyplot as plt

    from .outputs import stamp, write_file_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=120, format="png", metadata={"Software": stamp()})  # `foxlm eval --force` knows it
    plt.close(fig)
    return write_file_atomic(path, buffer.getvalue())


def write_json(data, path):
    """Write the dict `data` as JSON to `path`, stamped as foxlm's (`foxlm eval --force` replaces only such files) and
    renamed into place whole."""
    from .outputs import stamp, write_file_atomic

    return write_file_atomic(path, json.dumps({"written_by": stamp(), **data}, indent=2) + "\n")
