"""Write the model code next to saved weights, so that a folder or Hub repository loads with
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` on machines without foxlm.

transformers copies remote code as flat files and resolves only sibling imports (`from .name import x`), so the
package's modules are written flat: `foxlm/kernels/attention/attention_reference.py` becomes `attention_reference.py`,
the import `from .kernels.attention.attention import x` in `modeling_fox.py` becomes `from .attention import x`, and
`from ..acp import x` in a kernel subfolder becomes `from .acp import x`. Module basenames are therefore unique across
the package's folders.
"""

import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# Package modules that make up the model, in package-relative form; their flat names are their basenames.
REMOTE_CODE_MODULES = (
    "configuration_fox.py",
    "modeling_fox.py",
    "cache_fox.py",
    "compat.py",
    "context_parallel.py",
    "kernels/common.py",
    "kernels/dispatch.py",
    "kernels/acp.py",
    "kernels/attention/attention.py",
    "kernels/attention/attention_reference.py",
    "kernels/attention/attention_launch.py",
    "kernels/attention/attention_triton.py",
    "kernels/attention/attention_gate_scan.py",
    "kernels/attention/attention_tuning.py",
    "kernels/attention/attention_hopper.py",
    "kernels/decode/decode.py",
    "kernels/decode/decode_reference.py",
    "kernels/decode/decode_triton.py",
    "kernels/layer_ops/layer_ops.py",
    "kernels/layer_ops/layer_ops_reference.py",
    "kernels/layer_ops/layer_ops_triton.py",
    "remote_code.py",
)
AUTO_MAP = {
    "AutoConfig": "configuration_fox.FoxConfig",
    "AutoModel": "modeling_fox.FoxModel",
    "AutoModelForCausalLM": "modeling_fox.FoxForCausalLM",
    "AutoModelForSequenceClassification": "modeling_fox.FoxForSequenceClassification",
}
_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+)\.([\w.]+)(\s+import\s)", flags=re.MULTILINE)


def flatten_imports(source):
    """Rewrite `from .a.b import x` to `from .b import x` and `from ..b import x` to `from .b import x` (every module
    lands in one folder); `from . import x` stays."""
    return _RELATIVE_IMPORT.sub(lambda m: f"{m.group(1)}.{m.group(2).rsplit('.', 1)[-1]}{m.group(3)}", source)


def write_remote_code(save_directory):
    """Copy the model's source files, flattened, into `save_directory`; returns the written paths."""
    save_directory = Path(save_directory)
    written = []
    for module in REMOTE_CODE_MODULES:
        source_path = PACKAGE_DIR / module
        if not source_path.exists():  # running from a flat remote-code copy: the module is a sibling
            source_path = PACKAGE_DIR / Path(module).name
        target = save_directory / source_path.name
        target.write_text(flatten_imports(source_path.read_text(encoding="utf-8")), encoding="utf-8")
        written.append(target)
    return written
