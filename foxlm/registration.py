"""Registration of model_type "fox" with the transformers Auto classes, done late so that `import foxlm` stays light.

`import foxlm` imports neither torch nor transformers (the `foxlm` command answers `--help` at once). Registering
needs both, so it happens at whichever comes first:

- the first use of a name of the package (`from foxlm import FoxConfig`, `foxlm.FoxForCausalLM`, ...);
- the first look-up in transformers' table of model types (`AutoConfig.from_pretrained`, and through it every
  `AutoModel*.from_pretrained` and `pipeline`), so that `import foxlm` followed by
  `AutoModelForCausalLM.from_pretrained(fox_folder)` finds foxlm's classes, as it did when `import foxlm`
  registered eagerly.

Registering also registers the LoRA target modules of model_type "fox" with PEFT (`foxlm.training`).

For the second, transformers' `configuration_auto` module is watched: once it is loaded, its `CONFIG_MAPPING` is given
a subclass whose look-ups register foxlm first and then hand the mapping its own class back. A look-up while a module
of transformers, PEFT or foxlm is still being imported waits for the next one: registering then could import a
module that is half-initialised.
"""

import importlib
import importlib.abc
import sys

_CONFIGURATION_AUTO = "transformers.models.auto.configuration_auto"
_LOOKUPS = ("__getitem__", "__contains__", "__iter__", "keys", "values", "items", "get", "register")
_registered = False


def register():
    """Register FoxConfig and the model classes with the Auto classes (once; later calls return at once)."""
    global _registered
    if _registered:
        return
    _registered = True  # first: the registrations below look the mapping up again
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from . import training  # noqa: F401  (registers the LoRA target modules of model_type "fox" with PEFT)
    from .configuration_fox import FoxConfig
    from .modeling_fox import FoxForCausalLM, FoxForSequenceClassification, FoxModel

    watched = type(CONFIG_MAPPING)
    if getattr(watched, "_foxlm_watch", False):
        CONFIG_MAPPING.__class__ = watched.__base__
    AutoConfig.register("fox", FoxConfig, exist_ok=True)
    AutoModel.register(FoxConfig, FoxModel, exist_ok=True)
    AutoModelForCausalLM.register(FoxConfig, FoxForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(FoxConfig, FoxForSequenceClassification, exist_ok=True)
    # The Trainer's label smoother shifts labels only for names in this mapping.
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("fox", "FoxForCausalLM")


def _importing():
    """Whether a module that `register` imports from is being imported (its body has not finished running)."""
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in ("transformers", "foxlm", "peft"):
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                return True
    return False


def _register_on_first_lookup(configuration_auto):
    mapping = configuration_auto.CONFIG_MAPPING
    base = type(mapping)

    def looked_up(method):
        def lookup(self, *args, **kwargs):
            if not _registered and not _importing():
                register()
            return getattr(base, method)(self, *args, **kwargs)

        return lookup

    namespace = {method: looked_up(method) for method in _LOOKUPS if hasattr(base, method)}
    mapping.__class__ = type(base.__name__, (base,), {**namespace, "_foxlm_watch": True})


class _AfterImport(importlib.abc.Loader):
    """The loader of one module, running `then(module)` once the module's body has run."""

    def __init__(self, loader, then):
        self._loader, self._then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self._loader, name)


class _WatchConfigurationAuto(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _CONFIGURATION_AUTO:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                spec.loader = _AfterImport(spec.loader, _register_on_first_lookup)
                return spec
        return None


def register_when_needed():
    """Arrange for `register` to run at the first use of foxlm or of transformers' model types (see the module's
    docstring); called by `import foxlm`."""
    if _registered:
        return
    configuration_auto = sys.modules.get(_CONFIGURATION_AUTO)
    if configuration_auto is None:
        if not any(isinstance(finder, _WatchConfigurationAuto) for finder in sys.meta_path):
            sys.meta_path.insert(0, _WatchConfigurationAuto())
    elif not getattr(type(configuration_auto.CONFIG_MAPPING), "_foxlm_watch", False):
        _register_on_first_lookup(configuration_auto)
