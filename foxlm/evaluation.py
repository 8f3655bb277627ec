"""Long-context evaluation: the per-token loss curve L(i), top-1 agreement with a reference model, and
needle-in-a-haystack (easy mode), with plots.

All work for any causal LM (FoX or not), so a converted model can be compared with its original, on several domains
of held-out text at once (`foxlm.data.held_out_documents`).
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
def loss_and_predictions(model, documents, max_length, device=None, chunk_size=4096, desc="per-token loss",
                         window=None):
    """L(i), the mean next-token loss at each position i over the documents (each truncated to `max_length`), and
    the model's top-1 prediction at every position of every document, from the same forward passes.

    Returns (loss, count, predictions): loss and count are float64 arrays of length max_length - 1; position i
    holds the loss of predicting token i + 1 from tokens 0..i, averaged over the `count[i]` documents long enough to
    have it. `predictions`: one int32 array per document, the argmax of the logits at each of its positions (for
    `top1_agreement`).

    The logits go through the output layer `chunk_size` positions at a time, from the base model's last hidden
    state: a whole 32k-token document's fp32 logits would take 6 GB with a 49k vocabulary. This is how LLaMA-family
    and FoX heads compute logits; models that scale or cap logits after the output layer are refused.

    `window`: each position sees at most that many tokens (`last_hidden_states`), as a model whose context is
    `window` would be run over a longer document; None: the whole document prefix.
    """
    if window is not None and window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window!r}")
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise ValueError(f"{type(model).__name__} transforms its logits after the output layer; per_token_loss "
                         "supports models whose logits are output_layer(last hidden state)")
    device = device or next(model.parameters()).device
    head = model.get_output_embeddings()
    total = np.zeros(max_length - 1)
    count = np.zeros(max_length - 1)
    predictions = []
    for doc in tqdm(documents, desc=desc):
        ids = torch.tensor(doc[:max_length], device=device)[None]
        if ids.shape[1] < 2:
            predictions.append(np.zeros(0, dtype=np.int32))
            continue
        hidden = last_hidden_states(model, ids, window)[:-1]
        losses, argmax = [], []
        for h, t in zip(hidden.split(chunk_size), ids[0, 1:].split(chunk_size)):
            logits = head(h).float()
            losses.append(F.cross_entropy(logits, t, reduction="none"))
            argmax.append(logits.argmax(-1))
        losses = torch.cat(losses).double().cpu().numpy()
        predictions.append(torch.cat(argmax).int().cpu().numpy())
        total[: len(losses)] += losses
        count[: len(losses)] += 1
    with np.errstate(invalid="ignore"):
        return total / count, count, predictions


def sliding_windows(length, window):
    """The passes of a sliding window over positions [window, length): (start, keep, end) each, a pass over
    [start, end) of `window` tokens whose positions [keep, end) it keeps. Passes move by half a window, so every
    kept position sees between half a window and a window of the tokens before it."""
    passes, done = [], window
    while done < length:
        end = min(done + window // 2, length)
        passes.append((end - window, done, end))
        done = end
    return passes


def last_hidden_states(model, ids, window=None):
    """The base model's last hidden state at each position of `ids` (1, T), as a (T, hidden) tensor. With `window`
    (T > window), a sliding window: the first `window` positions in one pass, then the passes of `sliding_windows`
    (a position of the first window sees all the tokens before it, as without a window)."""
    def forward(part):
        return model.base_model(input_ids=part, use_cache=False).last_hidden_state[0]

    if window is None or ids.shape[1] <= window:
        return forward(ids)
    parts = [forward(ids[:, :window])]
    for start, keep, end in sliding_windows(ids.shape[1], window):
        parts.append(forward(ids[:, start:end])[keep - start :])
    return torch.cat(parts)


def per_token_loss(model, documents, max_length, device=None, chunk_size=4096, desc="per-token loss"):
    """(loss, count) of `loss_and_predictions`."""
    loss, count, _ = loss_and_predictions(model, documents, max_length, device, chunk_size, desc)
    return loss, count


def top1_agreement(predictions, reference):
    """A(i): the fraction of documents whose top-1 prediction at position i equals the reference model's, from
    `loss_and_predictions` of two models on the same documents; NaN where no document reaches i."""
    if len(predictions) != len(reference):
        raise ValueError(f"{len(predictions)} documents against the reference's {len(reference)}")
    length = max((len(r) for r in reference), default=0)
    hits, count = np.zeros(length), np.zeros(length)
    for p, r in zip(predictions, reference):
        if len(p) != len(r):
            raise ValueError(f"predictions of {len(p)} positions against the reference's {len(r)}: not the same "
                             "documents")
        hits[: len(r)] += p == r
        count[: len(r)] += 1
    with np.errstate(invalid="ignore"):
        return hits / count


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


def band_edges(max_length, *contexts):
    """Position band edges: 0, 512, 2048 and its doubles below `max_length`, each given context (a training or the
    original model's context) and `max_length`."""
    edges = {0, 512, max_length} | {c for c in contexts if c}
    edges |= {2048 * 2**k for k in range(int(np.log2(max(max_length, 2048) / 2048)) + 1)}
    return sorted(e for e in edges if e <= max_length)


def mask_sparse_positions(curve, count, min_documents):
    """`curve` with NaN where fewer than `min_documents` documents reach the position: the tail of L(i), where one
    or two documents remain, is noise rather than a trend."""
    curve = np.array(curve, dtype=np.float64)
    curve[np.asarray(count) < min_documents] = np.nan
    return curve


def draw_per_token_loss(ax, curves, train_context=None, original_context=None, window=101, title="Per-token loss"):
    """One line per model (smoothed L(i)) on `ax`, log-scaled positions, training contexts marked."""
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
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_per_token_loss(curves, path, train_context=None, original_context=None, window=101):
    """One line per model (smoothed L(i)), log-scaled positions, training contexts marked; saved as PNG."""
    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    draw_per_token_loss(ax, curves, train_context, original_context, window)
    fig.tight_layout()
    return save_figure(fig, path)


def plot_domains(curves_by_domain, path, train_context=None, original_context=None, window=101):
    """`plot_per_token_loss` with one panel per domain ({domain: {model: L(i)}}), side by side."""
    fig, axes = pyplot().subplots(1, len(curves_by_domain), figsize=(6.5 * len(curves_by_domain), 4.5),
                                  squeeze=False)
    for ax, (domain, curves) in zip(axes[0], curves_by_domain.items()):
        draw_per_token_loss(ax, curves, train_context, original_context, window, title=f"Per-token loss: {domain}")
    fig.tight_layout()
    return save_figure(fig, path)


def evaluate_models(models, documents, max_length, reference=None, dtype=None, device=None, windows=None,
                    reference_predictions=None):
    """Per-token loss of several models on several domains' documents, and each model's top-1 agreement with
    `reference`, from the same forward passes.

    `models`: {label: a loaded model, or a folder / Hub id / .gguf file, loaded one at a time with `dtype` and
    `device`, once for labels in turn with the same source}; `documents`: {domain: token id lists}; `reference`: the
    label of the model (the original) whose top-1 predictions the others' are compared with, or None; `windows`:
    {label: tokens} for models run over a sliding window of that many tokens (`last_hidden_states`), e.g. the
    original within its trained context. `reference_predictions`: {domain: the reference's top-1 predictions} from an
    earlier call on the same documents (its results' "predictions"), when the reference is not run again.

    Returns {domain: {"loss": {label: L(i)}, "agreement": {label: A(i)} (models other than the reference),
    "count": documents per position, "predictions": the reference's top-1 predictions, when it ran}}; see
    `loss_and_predictions` and `top1_agreement`.
    """
    if reference is not None and reference not in models and reference_predictions is None:
        raise ValueError(f"reference {reference!r} is none of the models ({', '.join(models)})")
    results = {domain: {"loss": {}, "agreement": {}, "count": None} for domain in documents}
    reference_predictions = dict(reference_predictions or {})
    order = sorted(models, key=lambda label: label != reference)  # the reference's predictions come first
    model = None
    for label, following in zip(order, [*order[1:], None]):
        source = models[label]
        if isinstance(source, torch.nn.Module):
            model = source
        elif model is None:  # a label with the previous one's source (run over a window) reuses its loaded model
            model, _ = load_causal_lm(source, dtype=dtype, device=device, with_tokenizer=False)
        for domain, docs in documents.items():
            desc = label if domain is None else f"{label}: {domain}"
            loss, count, predictions = loss_and_predictions(model, docs, max_length, desc=desc,
                                                            window=(windows or {}).get(label))
            results[domain]["loss"][label], results[domain]["count"] = loss, count
            if label == reference:
                reference_predictions[domain] = results[domain]["predictions"] = predictions
            elif reference is not None:
                results[domain]["agreement"][label] = top1_agreement(predictions, reference_predictions[domain])
        if following is None or models[following] != source:
            model = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for result in results.values():  # in the order of `models`
        result["loss"] = {label: result["loss"][label] for label in models}
    return results


def compare_per_token_loss(sources, documents, max_length, dtype=None, device=None):
    """L(i) of several models on the same documents: ({label: curve}, count). `sources`: {label: folder, Hub id,
    .gguf file or loaded model}; models are loaded one at a time."""
    result = evaluate_models(sources, {None: documents}, max_length, dtype=dtype, device=device)[None]
    return result["loss"], result["count"]


def domain_report(losses, count, edges, min_documents, agreement=None):
    """The JSON section of one domain and the curves to plot: band means of L(i) (and of A(i)) over positions that
    at least `min_documents` documents reach (all documents, where there are fewer), raw L(i) per position."""
    min_documents = int(min(min_documents, count.max(initial=0)))
    shown = {label: mask_sparse_positions(curve, count, min_documents) for label, curve in losses.items()}
    section = {
        "documents": int(count.max(initial=0)), "min_documents": min_documents,
        "documents_per_position": count.astype(int).tolist(),
        "bands": {label: band_means(curve, edges) for label, curve in shown.items()},
        "agreement_bands": {label: band_means(mask_sparse_positions(curve, count, min_documents), edges)
                            for label, curve in (agreement or {}).items()},
        "per_token_loss": {label: [None if np.isnan(x) else float(x) for x in curve]
                           for label, curve in losses.items()},
    }
    return section, shown


def write_evaluation_report(results, json_path, png_path, train_context=None, original_context=None,
                            min_documents=3, reference=None, **metadata):
    """The JSON and the PNG (one panel per domain) of `evaluate_models`' results.

    JSON: the metadata, then under "domains" each domain's documents per position, band means of loss ("bands")
    and of top-1 agreement with `reference` ("agreement_bands"), and the raw L(i) (null where no document reaches).
    Band means and plot leave out positions reached by fewer than `min_documents` documents. Returns
    {domain: {"loss": band means, "agreement": band means}} for `format_report`.
    """
    max_length = len(next(iter(results.values()))["count"]) + 1
    edges = band_edges(max_length, original_context, train_context)
    sections, shown = {}, {}
    for domain, result in results.items():
        sections[domain], shown[domain] = domain_report(result["loss"], result["count"], edges, min_documents,
                                                        result.get("agreement"))
    write_json({**metadata, "max_length": max_length, "train_context": train_context,
                "original_context": original_context, "reference": reference, "domains": sections}, json_path)
    plot_domains(shown, png_path, train_context=train_context, original_context=original_context)
    return {domain: {"loss": section["bands"], "agreement": section["agreement_bands"]}
            for domain, section in sections.items()}


def write_per_token_loss_report(curves, count, json_path, png_path, train_context=None, original_context=None,
                                min_documents=3, **metadata):
    """The JSON (raw curves, documents per position, band means) and the PNG plot of a per-token loss comparison on
    one set of documents (`write_evaluation_report` for several domains and top-1 agreement).

    Plot and band means leave out positions reached by fewer than `min_documents` documents; the JSON keeps every
    raw value (null where no document reaches). Returns the band means {label: {"a-b": mean}}.
    """
    max_length = len(count) + 1
    section, shown = domain_report(curves, count, band_edges(max_length, original_context, train_context),
                                   min_documents)
    del section["agreement_bands"], section["documents"]
    write_json({**metadata, "max_length": max_length, "train_context": train_context,
                "original_context": original_context, **section}, json_path)
    plot_per_token_loss(shown, png_path, train_context=train_context, original_context=original_context)
    return section["bands"]


def format_bands(bands, value_format="{:.3f}"):
    """The band means as a text table, one row per model."""
    header = next(iter(bands.values()))
    width = max(34, *(len(label) + 1 for label in bands))
    lines = [f"{'model':<{width}}" + "".join(f"{band:>13}" for band in header)]
    for label, row in bands.items():
        lines.append(f"{label:<{width}}" + "".join(f"{'-' if v is None else value_format.format(v):>13}"
                                                   for v in row.values()))
    return "\n".join(lines)


def format_report(report, reference=None):
    """`write_evaluation_report`'s band means as text: per domain, mean loss by position band, then top-1
    agreement with `reference`."""
    parts = []
    for domain, bands in report.items():
        parts.append(f"{domain}: mean loss by position band\n{format_bands(bands['loss'])}")
        if bands["agreement"]:
            parts.append(f"{domain}: top-1 agreement with {reference}\n"
                         f"{format_bands(bands['agreement'], '{:.1%}')}")
    return "\n\n".join(parts)


NEEDLE_QUESTION = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
NEEDLE_ANSWER = " eat a sandwich and sit in Dolores Park on a sunny day."
# Eleven depths: a needle every tenth of the haystack, so a length's score moves in steps of 9%, not 20%.
NEEDLE_DEPTHS = tuple(i / 10 for i in range(11))
# Prompt tokens a batch of needle trials holds (4 prompts of 32k, 64 of 2k): a token budget bounds the batch's KV
# cache and activations whatever the length, and the ~20 decoding steps of a trial are shared by the batch.
NEEDLE_BATCH_TOKENS = 2**17
# Haystack resamples behind the accuracy intervals of several haystacks (`haystack_intervals`).
NEEDLE_INTERVAL_RESAMPLES = 2000


def needle_batch_size(length, batch_tokens=NEEDLE_BATCH_TOKENS):
    """Needle trials a batch holds at a context `length`: up to `batch_tokens` prompt tokens, at least one prompt."""
    return max(1, batch_tokens // length)


def needle_in_a_haystack(model, tokenizer, haystack_ids, context_lengths, depths, device=None, with_answers=False,
                         batch_tokens=NEEDLE_BATCH_TOKENS):
    """Easy-mode needle-in-a-haystack (Qin et al., 2024; the FoX paper's setting for models without instruction
    tuning): the needle is the question with its answer; the prompt ends with the question; a trial passes when
    greedy decoding reproduces the answer. Returns a (len(depths), len(context_lengths)) array of 0/1 scores, and
    with `with_answers` also the generated text of each trial (a nested list of the same shape): how a model fails
    tells more than that it does.

    `haystack_ids`: a long token id list the filler is cut from. Trials of one context length run as one batch of
    up to `batch_tokens` prompt tokens (every prompt of a length has the same length: no padding).
    """
    scores, answers = needle_over_haystacks(model, tokenizer, [haystack_ids], context_lengths, depths, device,
                                            batch_tokens)
    return (scores[0], answers[0]) if with_answers else scores[0]


@torch.no_grad()
def needle_over_haystacks(model, tokenizer, haystacks, context_lengths, depths, device=None,
                          batch_tokens=NEEDLE_BATCH_TOKENS):
    """`needle_in_a_haystack` in each of `haystacks` (token id lists), as `needle_summary` takes them: scores of
    shape (haystacks, depths, context lengths) and the answers nested alike. One haystack is a thin test (a depth
    moves a length's score by a ninth); several make it firmer. The trials of a context length, over depths and
    haystacks, run in batches of up to `batch_tokens` prompt tokens (at least one prompt a batch): a trial's prefill
    and few decoding steps cost little more in a batch than alone."""
    device = device or next(model.parameters()).device
    needle = tokenizer(" " + NEEDLE_QUESTION + NEEDLE_ANSWER + " ", add_special_tokens=False)["input_ids"]
    question = tokenizer("\n" + NEEDLE_QUESTION, add_special_tokens=False)["input_ids"]
    answer = tokenizer(NEEDLE_ANSWER, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    scores = np.zeros((len(haystacks), len(depths), len(context_lengths)))
    answers = [[[None] * len(context_lengths) for _ in depths] for _ in haystacks]
    trials = [(h, d) for h in range(len(haystacks)) for d in range(len(depths))]
    with tqdm(total=scores.size, desc="needle") as progress:
        for c, length in enumerate(context_lengths):
            filler_length = length - len(bos) - len(needle) - len(question)
            if filler_length < 0 or filler_length > min(len(haystack) for haystack in haystacks):
                raise ValueError(f"context length {length} does not fit the needle and the haystack")
            per_batch = needle_batch_size(length, batch_tokens)
            for first in range(0, len(trials), per_batch):
                batch = trials[first : first + per_batch]
                prompts = []
                for h, d in batch:
                    filler, at = haystacks[h][:filler_length], int(round(depths[d] * filler_length))
                    prompts.append(bos + filler[:at] + needle + filler[at:] + question)
                prompt = torch.tensor(prompts, device=device)
                generated = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                           max_new_tokens=len(answer) + 2, do_sample=False,
                                           pad_token_id=tokenizer.eos_token_id)
                for (h, d), tokens in zip(batch, generated[:, prompt.shape[1] :]):
                    answers[h][d][c] = tokenizer.decode(tokens, skip_special_tokens=True)
                    scores[h, d, c] = float(NEEDLE_ANSWER.strip().rstrip(".") in answers[h][d][c])
                progress.update(len(batch))
    return scores, answers


def held_out_haystacks(tokenizer, length, count, domain="prose", corpus_dir=None):
    """`count` fillers of `length` token ids that `needle_in_a_haystack` cuts its prompts from: held-out documents of
    a domain ("prose", "docs", "code"; see `foxlm.data`) spread over its text, the first always the same."""
    from .data import held_out_documents

    haystacks = held_out_documents(tokenizer, domain, length, num_docs=count, corpus_dir=corpus_dir)
    if len(haystacks) < count:
        raise ValueError(f"the held-out {domain} text gives {len(haystacks)} haystacks of {length} tokens, not {count}")
    return haystacks


def needle_haystack(tokenizer, length, domain="prose", corpus_dir=None):
    """`length` token ids of a domain's held-out text, the filler of the one-haystack test (`held_out_haystacks`)."""
    return held_out_haystacks(tokenizer, length, 1, domain, corpus_dir)[0]


def needle_summary(scores, context_lengths, depths, answers=None, distance_within=None):
    """The JSON-ready result of `needle_in_a_haystack`: the score grid, the overall accuracy, the accuracy at each
    context length (over depths) and, when given, the generated answers. Scores of several haystacks
    (`needle_over_haystacks`) give the fraction of haystacks passed in each cell of the grid, and each haystack's
    grid and answers as "scores_by_haystack" and "answers_by_haystack"; of one, the summary of that one. Also the
    accuracy pooled over the lengths by the needle's distance from the question (`accuracy_by_distance`): over the
    lengths up to `distance_within` only when given (a model's own context, past which it fails whatever the
    distance), recorded as "distance_within"."""
    scores = np.asarray(scores)
    if scores.ndim == 3 and len(scores) == 1:
        scores, answers = scores[0], None if answers is None else answers[0]
    grid = scores.mean(0) if scores.ndim == 3 else scores
    summary = {"context_lengths": list(context_lengths), "depths": list(depths), "scores": grid.tolist(),
               "accuracy": float(scores.mean()),
               "accuracy_by_context": {str(c): float(grid[:, i].mean()) for i, c in enumerate(context_lengths)}}
    pooled = [i for i, c in enumerate(context_lengths) if distance_within is None or c <= distance_within]
    summary["accuracy_by_distance"] = accuracy_by_distance(scores[..., pooled], [context_lengths[i] for i in pooled],
                                                           depths) if pooled else {}
    if distance_within is not None:
        summary["distance_within"] = distance_within
    if scores.ndim == 3:
        summary.update(haystacks=len(scores), scores_by_haystack=scores.tolist())
        if len(scores) >= 3:
            summary["interval_by_context"] = haystack_intervals(scores, context_lengths)
    if answers is not None:
        summary["answers_by_haystack" if scores.ndim == 3 else "answers"] = answers
    return summary


def haystack_intervals(scores, context_lengths, level=0.95, resamples=NEEDLE_INTERVAL_RESAMPLES):
    """Where the accuracy at each context length would fall with other haystacks of the same text: the central
    `level` of a bootstrap over haystacks, {"length": [low, high]} from scores of shape (haystacks, depths, lengths).
    Haystacks are resampled, not trials: the trials of one haystack share its text and pass or fail together more
    than trials of different ones. Seeded, so a result file always carries the same interval for the same scores.
    It does not cover a rerun's other rounding on a GPU, nor another training seed."""
    per_haystack = np.asarray(scores, dtype=float).mean(axis=1)  # (haystacks, lengths)
    picks = np.random.default_rng(0).integers(0, len(per_haystack), (resamples, len(per_haystack)))
    means = per_haystack[picks].mean(axis=1)  # (resamples, lengths)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail], axis=0)
    return {str(c): [float(low[i]), float(high[i])] for i, c in enumerate(context_lengths)}


def accuracy_by_distance(scores, context_lengths, depths):
    """The needle's accuracy pooled over context lengths (and haystacks) by how far before the end of the prompt it
    lies: (1 - depth) x context length tokens, to within the needle's and the question's few dozen. Bands double:
    {"0-512": {"accuracy": a, "trials": n}, "512-1024": ..., ...}, each (lo, hi] (the first [0, 512]), only the bands
    some trial falls in. Where retrieval fails is often a matter of distance more than of length."""
    scores = np.asarray(scores, dtype=float)
    scores = scores if scores.ndim == 3 else scores[None]
    distance = np.outer(1.0 - np.asarray(depths, dtype=float), np.asarray(context_lengths, dtype=float))
    edges = [0, 512]
    while edges[-1] < distance.max():
        edges.append(2 * edges[-1])
    band = np.maximum(np.searchsorted(edges, distance, side="left"), 1)
    return {f"{edges[i - 1]}-{edges[i]}": {"accuracy": float(scores[:, band == i].mean()),
                                           "trials": int(scores[:, band == i].size)}
            for i in np.unique(band).tolist()}


def accuracy_by_context_text(accuracy_by_context, separator=" ", intervals=None):
    """`needle_summary`'s accuracy_by_context in a line: "2k 100%, 4k 55%, ..." (lengths under 1k as they are), with
    its interval_by_context when given: "4k 55% (41-68%)"."""
    return ", ".join(f"{short_tokens(int(c))}{separator}{a:.0%}{interval_text((intervals or {}).get(c))}"
                     for c, a in accuracy_by_context.items())


def interval_text(bounds):
    """An interval of `haystack_intervals` as the tables write it after the accuracy: " (41-68%)"; "" for None."""
    return f" ({bounds[0] * 100:.0f}-{bounds[1]:.0%})" if bounds else ""


def accuracy_by_distance_text(accuracy_by_distance, separator=" "):
    """`needle_summary`'s accuracy_by_distance in a line: "0-512 100%, 512-1k 80%, 1k-2k 55%, ..."."""
    return ", ".join(f"{short_band(band)}{separator}{result['accuracy']:.0%}"
                     for band, result in accuracy_by_distance.items())


def short_tokens(count):
    """A token count as the tables write it: 512, 2k, 32k."""
    return f"{count // 1024}k" if count >= 1024 and count % 1024 == 0 else str(count)


def short_band(band):
    """A band "lo-hi" of token counts as "512-1k", "2k-4k"."""
    return "-".join(short_tokens(int(bound)) for bound in band.split("-"))


def plot_needle(results, path, title="Needle in a haystack (easy mode)"):
    """`needle_summary` results as one row of panels per haystack domain ({domain: {model: summary}}): a heatmap of
    pass (1) / fail (0), or the fraction of haystacks passed, over depth and context length for each model, and the
    accuracy of every model by the needle's distance from the question (`accuracy_by_distance`); saved as PNG."""
    plt = pyplot()
    columns = max(len(models) for models in results.values()) + 1
    lengths = max(len(summary["context_lengths"]) for models in results.values() for summary in models.values())
    fig, axes = plt.subplots(len(results), columns, figsize=(columns * max(3.0, 1 + 0.6 * lengths), 5 * len(results)),
                             squeeze=False)
    for row, (domain, models) in zip(axes, results.items()):
        for ax, (label, summary) in zip(row, models.items()):
            image = ax.imshow(summary["scores"], cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(summary["context_lengths"])),
                          [short_tokens(c) for c in summary["context_lengths"]])
            ax.set_yticks(range(len(summary["depths"])), [f"{d:.0%}" for d in summary["depths"]])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(f"needle depth ({domain} haystack)")
            ax.set_title(label, fontsize=10)
        ax = row[-1]
        bands = sorted({band for summary in models.values() for band in summary["accuracy_by_distance"]},
                       key=lambda band: int(band.split("-")[0]))  # models tested at other lengths share one axis
        for label, summary in models.items():
            by_distance, within = summary["accuracy_by_distance"], summary.get("distance_within")
            if within is not None and within < max(summary["context_lengths"]):
                label = f"{label}, haystacks up to {short_tokens(within)}"
            ax.plot([bands.index(band) for band in by_distance], [r["accuracy"] for r in by_distance.values()],
                    marker="o", label=label)
        ax.set_xticks(range(len(bands)), [short_band(band) for band in bands], rotation=45)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("needle to question (tokens)")
        ax.set_ylabel("accuracy, all lengths")
        ax.set_title("by distance", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        for ax in row[len(models):-1]:
            ax.axis("off")
        haystacks = next(iter(models.values())).get("haystacks")
        fig.colorbar(image, ax=row[len(models) - 1],
                     label=f"fraction of {haystacks} haystacks passed" if haystacks else "passed")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig, path):
    """Save a matplotlib figure as a PNG at `path`, renamed into place whole (a crash leaves the old plot or the
    new one), and close it."""
    from .outputs import stamp, write_file_atomic

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=120, format="png", metadata={"Software": stamp()})  # `foxlm eval --force` knows it
    pyplot().close(fig)
    return write_file_atomic(path, buffer.getvalue())


def write_json(data, path):
    """Write the dict `data` as JSON to `path`, stamped as foxlm's (`foxlm eval --force` replaces only such files) and
    renamed into place whole."""
    from .outputs import stamp, write_file_atomic

    return write_file_atomic(path, json.dumps({"written_by": stamp(), **data}, indent=2) + "\n")
