"""`import foxlm` is light, yet registers model_type "fox" with the Auto classes before transformers first needs it."""

import subprocess
import sys

import pytest


def python(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_import_foxlm_loads_neither_torch_nor_transformers():
    assert python("import sys, foxlm; print(len({'torch', 'transformers'} & set(sys.modules)))") == ["0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from conftest import tiny_model

    path = tmp_path_factory.mktemp("registration") / "fox"
    tiny_model().save_pretrained(path)
    return path


# The Auto classes find foxlm's own classes, not the code saved beside the weights (which would need
# trust_remote_code), whichever of foxlm and transformers comes first and whatever else of transformers is loaded.
@pytest.mark.parametrize("imports", [
    "import foxlm; from transformers import AutoModelForCausalLM",
    "import foxlm; from transformers import LlamaForCausalLM, AutoModelForCausalLM",
    "from transformers import AutoModelForCausalLM; import foxlm",
    "from foxlm.modeling_fox import FoxModel; from transformers import AutoModelForCausalLM",
])
def test_auto_classes_load_a_saved_fox_after_import_foxlm(saved, imports):
    code = (f"{imports}; import foxlm.registration as r; before = r._registered; "
            f"model = AutoModelForCausalLM.from_pretrained({str(saved)!r}); "
            "print(before, type(model).__module__, type(model.config).__module__)")
    assert python(code) == ["False", "foxlm.modeling_fox", "foxlm.configuration_fox"]


def test_using_a_name_of_the_package_registers():
    code = ("import foxlm; foxlm.FoxConfig; from transformers import AutoConfig; "
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING; "
            "print(CONFIG_MAPPING._extra_content['fox'].__module__, type(CONFIG_MAPPING).__module__)")
    assert python(code) == ["foxlm.configuration_fox", "transformers.models.auto.configuration_auto"]
