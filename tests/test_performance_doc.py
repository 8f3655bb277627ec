"""docs/performance.md is what benchmarks/make_performance_doc.py makes of the result files: it cannot drift."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    path = ROOT / "benchmarks" / "make_performance_doc.py"
    spec = importlib.util.spec_from_file_location("make_performance_doc", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_performance_doc_is_the_scripts_output():
    script = load_script()
    assert (ROOT / "docs" / "performance.md").read_text() == script.render(), (
        "docs/performance.md is stale: run `python benchmarks/make_performance_doc.py`")


def test_every_file_the_doc_is_made_from_is_committed_beside_it():
    for path in load_script().cited_files():
        assert path.is_file(), path
