"""Pack the corpora that foxlm.data reads from Debian packages (Python's documentation, the Linux man pages, Jane
Austen's novels) for a machine without a package registry, such as a GPU box: a folder, or a .tar.gz of one.

    python benchmarks/pack_corpus.py corpus.tar.gz          # where the packages are (.ci/run installs them)
    # on the other machine, beside a checkout of foxlm:
    mkdir -p corpus && tar xzf corpus.tar.gz -C corpus && export FOXLM_CORPUS_DIR=$PWD/corpus

The standard library's sources (the code domain) are not packed: every machine's Python has them.
"""

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path

from foxlm.data import PACKED_CORPORA, write_corpus


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="a new folder, or a file ending in .tar.gz")
    parser.add_argument("--corpora", nargs="+", choices=PACKED_CORPORA, default=list(PACKED_CORPORA),
                        help="which corpora (default: all)")
    parser.add_argument("--force", action="store_true", help="replace an existing .tar.gz / write into a folder "
                        "that is not empty")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.force and (out.is_file() or any(out.iterdir())):
        sys.exit(f"error: {out} exists; pass --force to overwrite it")
    if not out.name.endswith(".tar.gz"):
        manifest = write_corpus(out, args.corpora)
    else:
        with tempfile.TemporaryDirectory() as folder:
            manifest = write_corpus(folder, args.corpora)
            partial = out.with_name(out.name + ".partial")
            with tarfile.open(partial, "w:gz") as archive:
                for name in [*args.corpora, "corpus.json"]:
                    archive.add(Path(folder) / name, arcname=name)
            partial.replace(out)
    for corpus, facts in manifest.items():
        print(f"{corpus}: {facts['files']} files, {facts['characters']:,} characters")
    print(f"wrote {out} ({sum(f.stat().st_size for f in [out, *out.rglob('*')] if f.is_file()) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
