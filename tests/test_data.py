"""The corpora of foxlm.data: the default training mix, the held-out domains, the packed corpus folder, and the
errors where a corpus is missing. The Debian packages are installed by .ci/run."""

import hashlib
import re
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import byte_tokenizer

from foxlm import data
from foxlm.data import (
    CORPORA,
    CORPUS_DIR_VARIABLE,
    DEBIAN_PACKAGES,
    DOMAINS,
    corpus_split,
    corpus_texts,
    domain_texts,
    held_out_documents,
    is_held_out,
    max_copied_spans,
    render_man_page,
    topic,
    training_texts,
    with_copied_spans,
)

ROOT = Path(__file__).resolve().parents[1]


def digests(texts):
    return sorted(hashlib.sha256(text.encode()).hexdigest() for text in texts)


def test_the_readme_test_command_that_ci_runs_installs_the_debian_packages_of_every_corpus():
    assert "sed -n 2p" in (ROOT / ".ci" / "run").read_text()  # .ci/run runs the line after "# The test suite"
    readme = (ROOT / "README.md").read_text().splitlines()
    command = readme[readme.index(next(line for line in readme if line.startswith("# The test suite"))) + 1]
    installed = set(re.search(r"apt-get install -y --no-install-recommends ([^&]*)&&", command).group(1).split())
    assert set(DEBIAN_PACKAGES) <= installed and {"python3-doc", "r-cran-janeaustenr"} <= set(DEBIAN_PACKAGES)


def test_default_training_text_mixes_code_and_docs_and_holds_no_held_out_or_prose_text():
    texts = training_texts()
    assert texts == training_texts()  # a fixed shuffle
    code, docs = domain_texts("code", False), domain_texts("docs", False)
    assert digests(texts) == digests(code + docs)
    held_out = [t for domain in DOMAINS for t in domain_texts(domain, True) if len(t) > 1000]  # no empty __init__.py
    assert not set(digests(texts)) & set(digests(held_out))
    assert corpus_split("austen")[0] == {} and len(corpus_split("austen")[1]) == 6  # prose: never trained on
    # Shuffled: every stretch of 40 files holds both domains, so every long block does.
    code = set(digests(code))
    kinds = ["code" if digests([text])[0] in code else "docs" for text in texts]
    assert all(set(kinds[i : i + 40]) == {"code", "docs"} for i in range(0, len(kinds) - 40, 40))


def test_corpora_are_keyed_by_their_path_relative_to_the_corpus_root_and_split_by_its_hash():
    for corpus, pattern in (("python-docs", r"([\w-]+/)*[\w.-]+\.rst\.txt"), ("man-pages", r"man\d/[\w.:+-]+\.\d\w*"),
                            ("austen", r"[a-z]+\.txt"), ("stdlib", r"([\w.-]+/)*[\w.-]+\.py"),
                            ("kernel-docs", r"([\w.,+-]+/)*[\w.,+-]+\.rst")):
        train, held_out = corpus_split(corpus)
        names = list(train) + list(held_out)
        assert names and all(re.fullmatch(pattern, name) for name in names), corpus
        if corpus != "austen":
            assert train and held_out and all(is_held_out(name) for name in held_out)
            assert not any(is_held_out(name) for name in train)
    assert "library/os.rst.txt" in corpus_texts("python-docs")
    assert "open, openat, creat - open and possibly create a file" in corpus_texts("man-pages")["man2/open.2"]
    assert corpus_texts("austen")["prideprejudice.txt"].count("Elizabeth") > 500
    kernel = corpus_texts("kernel-docs")
    assert "Linux kernel coding style" in kernel["process/coding-style.rst"]  # read from the gzipped source
    assert not any(name.startswith("translations/") for name in kernel)


def test_topics_name_the_module_a_file_implements_or_documents():
    assert {topic("stdlib", "json/decoder.py"), topic("stdlib", "json/__init__.py"), topic("python-docs",
            "library/json.rst.txt")} == {"json"}
    assert topic("stdlib", "os.py") == topic("python-docs", "library/os.path.rst.txt") == "os"
    assert topic("python-docs", "library/asyncio-task.rst.txt") == topic("stdlib", "asyncio/tasks.py") == "asyncio"
    assert topic("man-pages", "man2/socket.2") == topic("stdlib", "socket.py") == "socket"
    assert topic("kernel-docs", "filesystems/ext4/index.rst") == "filesystems/ext4"


def test_grouped_training_text_keeps_a_modules_files_together_and_holds_the_same_files():
    texts, grouped = training_texts(), training_texts(group_related=True)
    assert digests(grouped) == digests(texts) and grouped == training_texts(group_related=True)
    train = {corpus: corpus_split(corpus)[0] for corpus in ("stdlib", "python-docs", "man-pages")}
    position = {text: i for i, text in enumerate(grouped)}
    json_files = sorted(position[text] for corpus, files in train.items() for path, text in files.items()
                        if topic(corpus, path) == "json")
    assert len(json_files) >= 3 and json_files == list(range(json_files[0], json_files[0] + len(json_files)))
    # The topics are shuffled: code and documentation still alternate along the stream.
    code = set(digests(domain_texts("code", False)))
    kinds = ["code" if digests([text])[0] in code else "docs" for text in grouped]
    assert all(set(kinds[i : i + 200]) == {"code", "docs"} for i in range(0, len(kinds) - 200, 200))


def test_the_kernel_documentation_trains_only_when_asked():
    default, with_kernel = training_texts(), training_texts(("code", "docs", "kernel"))
    kernel = domain_texts("kernel", False)
    assert len(kernel) > 1000 and not set(digests(default)) & set(digests(kernel))
    assert digests(with_kernel) == digests(default + kernel)
    assert not set(digests(with_kernel)) & set(digests(domain_texts("kernel", True)))


def test_held_out_documents_of_each_domain_have_the_full_length():
    tokenizer = byte_tokenizer()
    for domain, words in (("stdlib", "def "), ("docs", "The "), ("prose", " Mr. ")):  # stdlib: code's alias
        documents = held_out_documents(tokenizer, domain, 4096, num_docs=3)
        assert len(documents) == 3 and all(len(doc) == 4096 for doc in documents)
        assert all(words in tokenizer.decode(doc) for doc in documents), domain
    with pytest.raises(ValueError, match="unknown domain 'books'"):
        held_out_documents(tokenizer, "books", 4096)


def test_man_pages_render_to_plain_unjustified_text():
    source = (".TH DEMO 7 2024-01-01 demo\n.SH NAME\ndemo \\- a d\u00e9mo page\n.SH DESCRIPTION\n"
              + "A sentence long enough to wrap over more than one line of the terminal's eighty columns. " * 4
              + "\n.TS\nallbox;\nl l.\nkey\tvalue\n.TE\n").encode()
    text = render_man_page(source)
    assert "demo - a d\u00e9mo page" in text and "\x1b" not in text and "\b" not in text
    assert "DESCRIPTION\n       A sentence long enough" in text
    assert not re.search(r"\w  +\w", text.split("DESCRIPTION")[1].split("key")[0])  # left-adjusted, no runs
    assert re.search(r"key\s*\u2502\s*value", text)  # the table, through tbl
    assert data.SO_REDIRECT.match(b'.\\" comment\n.so man3/other.3\n')
    assert not data.SO_REDIRECT.match(source)


def test_a_packed_corpus_reads_back_the_same_texts_on_a_machine_without_the_packages(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from pack_corpus import main as pack
    finally:
        sys.path.pop(0)
    pack([str(tmp_path / "corpus.tar.gz")])
    assert (tmp_path / "corpus.tar.gz").stat().st_size < 60 * 2**20
    with tarfile.open(tmp_path / "corpus.tar.gz") as archive:
        archive.extractall(tmp_path / "corpus")
    expected = {corpus: corpus_texts(corpus) for corpus in data.PACKED_CORPORA}  # from the packages
    monkeypatch.setenv(CORPUS_DIR_VARIABLE, str(tmp_path / "corpus"))
    monkeypatch.setattr(data, "installed_texts", None)  # reading the packages now fails
    assert {corpus: corpus_texts(corpus) for corpus in data.PACKED_CORPORA} == expected
    assert domain_texts("docs", True) and domain_texts("prose", True)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="has no austen/.*pack_corpus.py"):
        corpus_texts("austen", corpus_dir=tmp_path)
    with pytest.raises(SystemExit, match="exists"):
        pack([str(tmp_path / "corpus.tar.gz")])


def test_missing_corpora_name_the_apt_get_command(monkeypatch, tmp_path):
    monkeypatch.setattr(data.glob, "glob", lambda pattern: [])
    with pytest.raises(FileNotFoundError, match="apt-get install --no-install-recommends python3-doc"):
        data.python_docs_texts()
    with pytest.raises(FileNotFoundError, match="no /usr/share/doc/linux-doc-X.Y/Documentation.*apt-get install "
                                                "--no-install-recommends linux-doc"):
        data.kernel_docs_texts()
    with pytest.raises(FileNotFoundError, match="manpages is not installed.*apt-get install --no-install-recommends "
                                                "manpages manpages-dev groff-base"):
        data.man_page_files()
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(tmp_path))  # no Rscript, no groff
    with pytest.raises(FileNotFoundError, match="Rscript is not installed.*apt-get install --no-install-recommends "
                                                "r-cran-janeaustenr"):
        data.austen_texts()
    with pytest.raises(FileNotFoundError, match="groff is not installed"):
        render_man_page(b".TH X 1\n")
    with pytest.raises(ValueError, match="unknown corpus 'books'"):
        corpus_texts("books")
    assert set(CORPORA) == {c for corpora in DOMAINS.values() for c in corpora}


def test_copied_spans_repeat_earlier_text_of_their_block_exactly_at_distances_over_the_whole_block():
    blocks = [list(range(b * 10_000, b * 10_000 + 4096)) for b in range(40)]  # every token unique in its block
    copied = with_copied_spans(blocks, 8)
    assert blocks[0] == list(range(4096)) and copied == with_copied_spans(blocks, 8)  # inputs kept; deterministic
    assert copied != with_copied_spans(blocks, 8, seed=1)
    distances = []
    for block, original in zip(copied, blocks):
        assert len(block) == len(original)
        changed = [i for i, (a, b) in enumerate(zip(block, original)) if a != b]
        spans = [[changed[0]]]
        for i in changed[1:]:
            if i == spans[-1][-1] + 1 and block[i] == block[i - 1] + 1:
                spans[-1].append(i)
            else:
                spans.append([i])
        assert len(spans) == 8  # one run of consecutive source tokens per copy
        for span in spans:
            source = block[span[0]] - original[0]
            assert 32 <= len(span) <= 128 and source + len(span) <= span[0]  # earlier in the block, not overlapping
            assert block[span[0] : span[-1] + 1] == original[source : source + len(span)]
            assert not set(range(source, source + len(span))) & set(changed)  # copied from text left as it was
            distances.append(span[0] - source)
    assert min(distances) < 512 and max(distances) > 3072  # near and far


def test_copied_spans_that_do_not_fit_their_block_are_an_error():
    assert max_copied_spans(32768) == 128 and max_copied_spans(512) == 2 and max_copied_spans(128) == 0
    assert len(with_copied_spans([list(range(512))], 2)[0]) == 512
    with pytest.raises(ValueError, match="3 copied spans of up to 128 tokens do not fit a block of 512 tokens"):
        with_copied_spans([list(range(512))], 3)
    with pytest.raises(ValueError, match="span_lengths"):
        with_copied_spans([list(range(512))], 1, span_lengths=(64, 32))
