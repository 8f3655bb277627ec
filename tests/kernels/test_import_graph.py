"""The layout rules of foxlm/kernels, read from the source: the modules import each other without a circle, never
import a sibling's private (`_name`) names, and only `dispatch.py` reads environment flags."""

import ast
from pathlib import Path

import foxlm.kernels

KERNELS = Path(foxlm.kernels.__file__).resolve().parent


def module_name(path):
    parts = ("foxlm", "kernels", *path.relative_to(KERNELS).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def relative_imports(path):
    """(imported module, imported names) of every `from .x import ...` in the file, inside functions too."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            names = [alias.name for alias in node.names]
            if node.module:
                yield f"{base}.{node.module}", names
            else:  # `from . import module`
                for name in names:
                    yield f"{base}.{name}", []


def import_graph():
    """{module: {imported module: imported names}} over every module of foxlm/kernels."""
    graph = {}
    for path in sorted(KERNELS.rglob("*.py")):
        edges = graph.setdefault(module_name(path), {})
        for target, names in relative_imports(path):
            edges.setdefault(target, []).extend(names)
    return graph


def test_kernel_modules_import_each_other_without_a_circle():
    graph = import_graph()
    assert "foxlm.kernels.dispatch" in graph and all(target in graph for edges in graph.values() for target in edges)
    state = {}  # module -> "visiting" while on the current path, "done" after

    def visit(module, path):
        state[module] = "visiting"
        for target in graph[module]:
            assert state.get(target) != "visiting", "import circle: " + " -> ".join(path + [module, target])
            if target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_no_module_imports_private_names_of_another():
    private = [(module, target, name) for module, edges in import_graph().items() for target, names in edges.items()
               for name in names if name.startswith("_")]
    assert private == []


def test_only_dispatch_reads_the_environment():
    readers = sorted(module_name(path) for path in KERNELS.rglob("*.py") if "os.environ" in path.read_text())
    assert readers == ["foxlm.kernels.dispatch"]
