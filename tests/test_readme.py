"""The README as a newcomer uses it: every ```python snippet runs as written, each on its own, and every `foxlm`
command of a ```bash snippet parses. A snippet that cannot run here (it needs a GPU or the network) starts with a
`# not run by tests/test_readme.py: WHY` line; keep those rare."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SKIP = "# not run by tests/test_readme.py:"


def snippets(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)


def foxlm_commands():
    """Each `foxlm ...` command line of the bash snippets, continuation lines joined, comments dropped."""
    commands = []
    for snippet in snippets("bash"):
        for line in snippet.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["foxlm"]:
                    commands.append(words[1:])
    return commands


def test_the_readme_has_snippets_to_check():
    assert len(snippets("python")) >= 3 and len(foxlm_commands()) >= 10


@pytest.mark.parametrize("code", snippets("python"), ids=lambda code: code.splitlines()[0][:40])
def test_python_snippet_runs_as_written(code, tmp_path):
    if code.startswith(SKIP):
        pytest.skip(code.splitlines()[0][len(SKIP):].strip())
    # A new interpreter in an empty folder: nothing defined beforehand, files the snippet writes stay out of the
    # checkout. It sees the same foxlm as the tests, and no GPU.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, f"{code}\n--- stderr:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("argv", foxlm_commands(), ids=" ".join)
def test_foxlm_command_parses(argv):
    from foxlm.benchmarks import BENCHMARKS
    from foxlm.cli import build_parser

    args, extra = build_parser().parse_known_args(argv)
    if args.command == "finetune":
        from foxlm.finetune import parse_args

        parse_args(extra, prog="foxlm finetune")
    elif args.command == "bench":
        assert args.name is None or args.name in BENCHMARKS
    else:
        assert not extra, extra
