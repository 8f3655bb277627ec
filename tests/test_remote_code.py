"""A saved FoX folder loads with trust_remote_code=True in a Python where foxlm cannot be imported, and its
tokenizer without it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foxlm.remote_code import PACKAGE_DIR, REMOTE_CODE_MODULES, flatten_imports, write_remote_code

LOAD_WITHOUT_FOXLM = """
import sys
sys.modules["foxlm"] = None  # any `import foxlm` now raises ImportError
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert not type(model).__module__.startswith("foxlm"), type(model).__module__
ids = torch.load(sys.argv[2])
torch.save(model(ids).logits, sys.argv[3])
cached = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
torch.save(cached, sys.argv[4])
"""

LOAD_TOKENIZER_WITHOUT_FOXLM = """
import json, sys
sys.modules["foxlm"] = None  # any `import foxlm` now raises ImportError
from transformers import AutoTokenizer
loaded = [AutoTokenizer.from_pretrained(sys.argv[1]),
          AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=False)]
json.dump([[type(t).__module__, t(sys.argv[2])["input_ids"]] for t in loaded], open(sys.argv[3], "w"))
"""


def tokenize_without_foxlm(folder, text, tmp_path):
    """`AutoTokenizer.from_pretrained(folder)(text)` in a Python that cannot import foxlm, with stdin closed, without
    `trust_remote_code` and with `trust_remote_code=False`. Without it transformers asks `[y/N]` whether to run the
    folder's code (config.json has an `auto_map`); unanswered, it reads config.json through the base config class
    instead, as with False. Returns [tokenizer module, token ids] of each call."""
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", LOAD_TOKENIZER_WITHOUT_FOXLM, str(folder), text, str(tmp_path / "tokenized.json")],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "tokenized.json").read_text())


@pytest.mark.parametrize("rope", [{}, dict(use_rope=True, rope_max_wavelength=50.0),
                                  dict(use_rope=True, rope_max_wavelength=4.0, rope_slow_pairs="clamp"),
                                  dict(use_rope=True, rope_max_wavelength=4.0, rope_slow_pairs="interpolate",
                                       rope_slow_pairs_factor=4.0),
                                  dict(use_rope=True, rope_max_wavelength=4.0, rope_slow_pairs="compress",
                                       rope_slow_pairs_factor=4.0, rope_slow_pairs_start=6.0)],
                         ids=["no-rope", "partial-rope", "clamped-slow-pairs", "interpolated-slow-pairs",
                              "compressed-slow-pairs-from-6"])
def test_saved_folder_loads_as_remote_code_without_foxlm(make_model, tmp_path, rope):
    model = make_model(**rope)
    model.save_pretrained(tmp_path / "model")
    files = set(os.listdir(tmp_path / "model"))
    assert {"configuration_fox.py", "modeling_fox.py", "attention.py", "attention_reference.py", "acp.py"} <= files
    ids = torch.randint(3, 97, (2, 7))
    torch.save(ids, tmp_path / "ids.pt")
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_FOXLM, str(tmp_path / "model"), str(tmp_path / "ids.pt"),
         str(tmp_path / "logits.pt"), str(tmp_path / "generated.pt")],
        check=True, env=env, cwd=tmp_path,
    )
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), model(ids).logits)
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(torch.load(tmp_path / "generated.pt"), expected)


def test_saved_folder_tokenizer_loads_without_foxlm_or_trust_remote_code(make_model, tmp_path):
    from conftest import byte_tokenizer

    tokenizer = byte_tokenizer()
    make_model(vocab_size=258).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    expected = tokenizer("def f(x):\n    return x")["input_ids"]
    for module, ids in tokenize_without_foxlm(tmp_path / "model", "def f(x):\n    return x", tmp_path):
        assert module.startswith("transformers.") and ids == expected  # transformers' class, not the folder's code


def test_save_pretrained_can_leave_the_code_out(make_model, tmp_path):
    make_model().save_pretrained(tmp_path, save_remote_code=False)
    assert not list(tmp_path.glob("*.py"))


def test_flatten_imports_rewrites_package_relative_imports_only():
    source = ("from .kernels.attention.attention import forgetting_attention\nfrom .attention_reference import x\n"
              "from ..common import (LOG2E,\n    on_device_of)\n    from .attention_hopper import y  # in a function\n"
              "from . import z\nimport torch\n")
    assert flatten_imports(source) == (
        "from .attention import forgetting_attention\nfrom .attention_reference import x\n"
        "from .common import (LOG2E,\n    on_device_of)\n    from .attention_hopper import y  # in a function\n"
        "from . import z\nimport torch\n")


def test_remote_code_lists_every_module_the_model_imports_under_a_unique_name(tmp_path):
    # transformers copies a module's relative imports found by this pattern, recursively, from the saved folder.
    names = [Path(module).name for module in REMOTE_CODE_MODULES]
    assert len(set(names)) == len(names)
    written = {path.name for path in write_remote_code(tmp_path)}
    needed, todo = set(), ["modeling_fox"]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            source = (tmp_path / f"{name}.py").read_text()
            assert not re.search(r"^\s*from\s+\.\.", source, flags=re.MULTILINE), name
            todo += re.findall(r"^\s*from\s+\.(\S+)\s+import", source, flags=re.MULTILINE)
    assert {f"{name}.py" for name in needed} == written
    assert all((PACKAGE_DIR / module).exists() for module in REMOTE_CODE_MODULES)


def test_push_to_hub_uploads_the_code_with_the_weights(make_model, tmp_path, monkeypatch):
    # No network here: stand in for the Hub calls and keep what would have been uploaded.
    import shutil
    import types

    import transformers.utils.hub as hub

    uploaded = tmp_path / "uploaded"
    monkeypatch.setattr(hub, "hf_api", lambda: types.SimpleNamespace(
        create_repo=lambda repo_id, **kwargs: types.SimpleNamespace(repo_id=repo_id)))
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *args, **kwargs: types.SimpleNamespace(
        save=lambda path: open(path, "w").write("card")))
    model = make_model()
    monkeypatch.setattr(type(model), "_upload_modified_files",
                        lambda self, folder, *args, **kwargs: shutil.copytree(folder, uploaded))
    model.push_to_hub("someone/tiny-fox")
    files = {p.name for p in uploaded.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_fox.py", "configuration_fox.py"} <= files
    assert '"AutoModelForCausalLM": "modeling_fox.FoxForCausalLM"' in (uploaded / "config.json").read_text()


def test_saving_without_remote_code_drops_an_auto_map_from_an_earlier_save(tmp_path, make_model):
    from foxlm import FoxForCausalLM

    make_model().save_pretrained(tmp_path / "with-code")
    reloaded = FoxForCausalLM.from_pretrained(tmp_path / "with-code")  # its config has the folder's auto_map
    reloaded.save_pretrained(tmp_path / "without-code", save_remote_code=False)
    config = json.loads((tmp_path / "without-code" / "config.json").read_text())
    assert "auto_map" not in config and not (tmp_path / "without-code" / "modeling_fox.py").exists()
    assert reloaded.config.auto_map  # the model in memory keeps it
