"""foxlm: the Forgetting Transformer (FoX) for Hugging Face transformers.

Importing foxlm registers model_type "fox" with the transformers Auto classes. The import itself is light: the names
below load on first use, and the registration happens then or at transformers' first look-up of a model type
(`foxlm.registration` says how).
"""

import importlib

from .registration import register, register_when_needed

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

_EXPORTS = {  # name -> module of the package that defines it
    "FoxCacheLayer": "cache_fox",
    "FoxConfig": "configuration_fox",
    "FoxForCausalLM": "modeling_fox",
    "FoxForSequenceClassification": "modeling_fox",
    "FoxModel": "modeling_fox",
    "FoxStaticCacheLayer": "cache_fox",
    "FoxPreTrainedModel": "modeling_fox",
    "forgetting_attention": "kernels",
    "compile_layer_parts": "training",
    "fox_lora_config": "training",
    "optimizer_param_groups": "training",
    "write_remote_code": "remote_code",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register()
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


register_when_needed()
