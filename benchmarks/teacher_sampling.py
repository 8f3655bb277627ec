"""How long sampling the original's own documents takes (`foxlm finetune --teacher-samples`), by document length cap
and method, in one process on one GPU, bf16: `batch` is `foxlm.distillation.sample_documents` (a batch at a time
through `model.generate`: every batch runs until its longest document ends); `static` is the same with a cache of
fixed size, whose decoding step transformers compiles (CUDA graphs; the compilation is in the run's time); `refill` is
a probe kept here, rows refilled as their documents end (`sample_with_refill`), so that long length caps need not
wait for a batch's longest document.

    python benchmarks/teacher_sampling.py --model SmolLM2.gguf --runs batch:1024:1024,static:1024:1024,static:4096:768

Each run is METHOD:MAX_LENGTH:BATCH_SIZE. The record (`foxlm.benchmarks.run_record`) is rewritten after every run,
so a run stopped by a time limit keeps the ones that finished.
"""

import argparse
import statistics
import time

from foxlm.benchmarks.run_record import RESULTS_DIR, new_record, record_path, write_record

METHODS = ("batch", "static", "refill")


def sample_with_refill(model, *, num_tokens, eos_token_id, max_length, batch_size, seed, temperature):
    """The documents `sample_documents` would draw (same length cap, same end, about `num_tokens` in all), each with
    the log-probabilities its tokens were sampled at, with rows refilled: a row whose document ends starts the next
    one at the following step (its earlier keys masked out, positions from 0 again). Once the documents started hold
    `num_tokens` tokens none starts; those running are finished, finished rows leave the batch, and the documents are
    kept in the order they started. The cache drops the slots no row reads (`drop_masked_slots`). `model`: a
    transformers causal LM whose cache is a `DynamicCache` (the LLaMA family's)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from foxlm.compat import cache_kwargs

    device = model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=model.config)
    # Per row: the document it samples (tokens, log-probabilities), its order of start, and the cache slot of its EOS.
    rows = [([], [], order) for order in range(batch_size)]
    starts = [0] * batch_size
    next_input = torch.full((batch_size,), eos_token_id, device=device)
    started, finished, lone_eos = batch_size, {}, 0
    committed = 0  # tokens of the documents kept and of those running
    with torch.no_grad(), tqdm(total=num_tokens, desc="sampling from the original", unit="tok") as progress:
        while rows:
            slot = cache.get_seq_length()  # the cache slot of this step's inputs
            positions = torch.tensor([len(tokens) for tokens, _, _ in rows], device=device)
            live = torch.arange(slot + 1, device=device)[None, :] >= torch.tensor(starts, device=device)[:, None]
            logits = model(input_ids=next_input[:, None], attention_mask=live.long(), position_ids=positions[:, None],
                           use_cache=True, **cache_kwargs(cache)).logits[:, -1].float()
            log_probs = (logits / temperature).log_softmax(-1)
            sampled = torch.multinomial(log_probs.exp(), 1, generator=generator)
            sampled_log_probs = log_probs.gather(-1, sampled)[:, 0].tolist()
            sampled = sampled[:, 0].tolist()
            committed += len(rows)
            keep, inputs = [], []
            for row, (token, log_prob) in enumerate(zip(sampled, sampled_log_probs)):
                tokens, token_log_probs, order = rows[row]
                tokens.append(token)
                token_log_probs.append(log_prob)
                if token != eos_token_id and len(tokens) < max_length:
                    keep.append(row)
                    inputs.append(token)
                    continue
                if token != eos_token_id:  # ended by max_length: EOS appended, not sampled
                    tokens.append(eos_token_id)
                    committed += 1
                if len(tokens) > 1:  # an EOS alone teaches nothing
                    finished[order] = (tokens, token_log_probs)
                    progress.update(len(tokens))
                else:
                    committed -= 1
                    lone_eos += 0 if finished else 1
                    if lone_eos >= batch_size:
                        raise RuntimeError("the model sampled only EOS tokens after EOS for a whole batch: it does "
                                           "not generate text on its own; train without samples from it.")
                if committed < num_tokens:
                    rows[row] = ([], [], started)  # the next document starts here, at the next step
                    started += 1
                    starts[row] = slot + 1
                    keep.append(row)
                    inputs.append(eos_token_id)
            rows = [rows[row] for row in keep]
            starts = [starts[row] for row in keep]
            if rows:
                next_input = torch.tensor(inputs, device=device)
                if len(keep) < len(sampled):
                    cache.batch_select_indices(torch.tensor(keep, device=device))
                drop_masked_slots(cache, starts)
    documents, total = [], 0
    for order in sorted(finished):
        if total >= num_tokens:
            break
        documents.append(finished[order])
        total += len(finished[order][0])
    return documents


def drop_masked_slots(cache, starts):
    """Drop the cache slots before every row's document (masked out for all rows) once they are a quarter of it, so
    the cache holds about the longest running document instead of every step; `starts` (each row's first slot)
    follows."""
    dead = min(starts)
    if dead < max(64, cache.get_seq_length() // 4):
        return
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., dead:, :], layer.values[..., dead:, :]
    starts[:] = [start - dead for start in starts]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the original: a folder, Hub id or .gguf file")
    parser.add_argument("--runs", default="batch:1024:1024,static:1024:1024,static:4096:768",
                        help="METHOD:MAX_LENGTH:BATCH_SIZE, comma-separated; METHOD is batch (foxlm's), static or "
                             "refill")
    parser.add_argument("--tokens", type=int, default=2 * 1024 * 1024,
                        help="tokens a run samples (default: %(default)s, foxlm finetune's on a GPU)")
    parser.add_argument("--out", default=RESULTS_DIR, help="folder of the JSON record (default: %(default)s)")
    args = parser.parse_args()
    runs = []
    for run in args.runs.split(","):
        method, *sizes = run.split(":")
        if method not in METHODS or len(sizes) != 2 or not all(size.isdigit() for size in sizes):
            parser.error(f"--runs: each run is METHOD:MAX_LENGTH:BATCH_SIZE with METHOD one of {', '.join(METHODS)}, "
                         f"got {run!r}")
        runs.append((method, int(sizes[0]), int(sizes[1])))

    import torch

    from foxlm.distillation import sample_documents
    from foxlm.evaluation import load_causal_lm

    model, tokenizer = load_causal_lm(args.model, dtype=torch.bfloat16, device="cuda")
    record = new_record(model=args.model, tokens=args.tokens, runs=[])
    path = record_path(args.out, "teacher_sampling", record)

    def refill(model, **kwargs):
        return [document for document, _ in sample_with_refill(model, temperature=1.0, **kwargs)]

    def static(model, **kwargs):
        return sample_documents(model, cache_implementation="static", **kwargs)

    sample = {"refill": refill, "batch": sample_documents, "static": static}
    for method, max_length, batch_size in runs:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        documents = sample[method](model, num_tokens=args.tokens, eos_token_id=tokenizer.eos_token_id,
                                   max_length=max_length, batch_size=batch_size, seed=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        lengths = sorted(map(len, documents))
        result = {"method": method, "max_length": max_length, "batch_size": batch_size, "seconds": round(seconds, 1),
                  "tokens": sum(lengths), "documents": len(lengths),
                  "tokens_per_second": round(sum(lengths) / seconds),
                  "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                  "length_mean": round(statistics.mean(lengths), 1), "length_median": statistics.median(lengths),
                  "length_p90": lengths[int(0.9 * (len(lengths) - 1))], "length_max": lengths[-1],
                  "share_at_cap": round(sum(length == max_length + 1 for length in lengths) / len(lengths), 4),
                  "share_of_tokens_in_documents_over_2k": round(
                      sum(length for length in lengths if length > 2048) / sum(lengths), 4)}
        record["runs"].append(result)
        write_record(path, record)
        print(result, flush=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
