"""The package's layers, top to bottom: cli / _patching, converters -> serving, evaluation, hub -> engine -> speculative,
grammar -> attention, models -> cache, kv_memory -> kernels. No import, at module level or inside a function, runs up
this list: evaluation (measuring a model) and hub (model cards, publishing) may be used by the converters and the CLI,
never by the engine or anything below it. Inside the converters: convert -> stages -> options -> fitting, export ->
methods -> io. No two modules import each other, directly or around a circle, and no library file is over 400 lines
(docs/architecture.md draws these layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"hf_attn_patch": ROOT / "hf_attn_patch", "hf_attn_patch.converters": ROOT / "converters",
            "hf_attn_patch.kernels": ROOT / "kernels"}  # fmt: skip
LEVEL = {"kernels": 0, "extras": 0, "compat": 0, "kv_memory": 1, "devices": 1, "cache": 1, "attention": 2, "models": 2, "grammar": 3,
         "speculative": 3, "engine": 4, "serving": 5, "evaluation": 5, "hub": 5, "converters": 6, "cli": 6, "demo": 6, "_patching": 6,
         "assets": 0}  # fmt: skip
# lm-eval's loaders of the offline tasks live beside their YAMLs (lm-eval imports them by path): evaluation code, the
# evaluation layer, though the folder is the package's data
SUBLEVEL = {("assets", "lm_eval_tasks"): LEVEL["evaluation"]}
ROOT_LEVEL = 6  # the package root loads every layer's public names (and patch()): importing it is importing the top
# inside hf_attn_patch.converters, by role (its package root, like the package's, may load anything)
CONVERTER_LEVEL = {"io": 0, "methods": 1, "fitting": 2, "export": 2, "options": 3, "stages": 4, "convert": 5}
MAX_LINES = 400


def modules():
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            yield package.split(".") + [p for p in parts if p != "__init__"], path.name == "__init__.py", path


def layer_of(name: list[str]) -> int | None:
    """Layer of a module path ['hf_attn_patch', 'cache', 'manager']; None for the package root."""
    if len(name) == 1 or name[1] not in LEVEL:  # the root package itself, or a name defined in it
        return None if len(name) == 1 else ROOT_LEVEL
    return SUBLEVEL.get(tuple(name[1:3]), LEVEL[name[1]])


def imported(tree: ast.AST, name: list[str], is_package: bool):
    """Absolute module paths this module imports, anywhere in its body."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name[: len(name) - node.level + (1 if is_package else 0)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] == "hf_attn_patch":
                if node.module:
                    yield target, node.lineno
                else:  # from . import x: the module x, or a name x of the package
                    for alias in node.names:
                        yield target + [alias.name], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hf_attn_patch."):
                    yield alias.name.split("."), node.lineno


@pytest.mark.parametrize("name, is_package, path", list(modules()), ids=lambda v: ".".join(v) if isinstance(v, list) else "")
def test_no_import_runs_up_a_layer(name, is_package, path):
    own = layer_of(name)
    if own is None or own == ROOT_LEVEL:  # the root and the top layer may load anything
        return
    for target, line in imported(ast.parse(path.read_text()), name, is_package):
        other = layer_of(target)
        assert other is None or other <= own, f"{path.relative_to(ROOT)}:{line} imports {'.'.join(target)} (layer {other} > {own})"
        if name[1] == target[1] == "converters" and len(name) > 2 and len(target) > 2:
            mine, theirs = CONVERTER_LEVEL[name[2]], CONVERTER_LEVEL.get(target[2])
            assert theirs is None or theirs <= mine, (f"{path.relative_to(ROOT)}:{line} imports {'.'.join(target)}: "
                                                      f"converters/{target[2]} sits above converters/{name[2]}")  # fmt: skip


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports, at module level or inside a function}; `from pkg import x` counts as
    importing the module pkg.x when x is one, else the package pkg (its __init__)."""
    found = {".".join(name): (path, is_package) for name, is_package, path in modules()}
    graph = {}
    for module, (path, is_package) in found.items():
        edges = set()
        for target, _ in imported(ast.parse(path.read_text()), module.split("."), is_package):
            for k in range(len(target), 0, -1):  # the longest prefix that is a module: a name imported from it
                if ".".join(target[:k]) in found:
                    edges.add(".".join(target[:k]))
                    break
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan): every import circle lies in one."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("name, is_package, path", list(modules()), ids=lambda v: ".".join(v) if isinstance(v, list) else "")
def test_no_library_file_over_400_lines(name, is_package, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept"


@pytest.mark.parametrize("package", ["cache", "attention", "kv_memory", "models", "grammar", "speculative", "evaluation",
                                     "hub"])  # fmt: skip
def test_lower_layers_load_without_the_engine(package):
    code = (f"import hf_attn_patch.{package}, sys; "
            "assert not [m for m in sys.modules if m.startswith('hf_attn_patch.engine')]")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
