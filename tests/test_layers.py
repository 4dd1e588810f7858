"""The package's layers, top to bottom: cli / _patching / draft, converters -> serving, evaluation, hub -> engine ->
speculative, grammar -> attention, models -> cache, kv_memory -> kernels, variants (the attention variant registry,
which the variants fill). No import, at module level or inside a function, runs up this list: evaluation (measuring
a model) and hub (model cards, publishing) may be used by the converters and the CLI, never by the engine or
anything below it. Inside the converters: convert -> stages -> targets -> options -> fitting, export, drafting ->
methods -> io. Every module sits in one of these maps (a new one must be placed), no two modules import each other,
directly or around a circle, and no library file grows into a god file (over 600 lines; files hold one concept
each, whatever their length). A variant module (one that registers an attention variant) takes nothing private from
another: what two variants share lives in a module of its own (masks, RoPE, the paged backend's helpers).
docs/architecture.md draws these layers."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "hf_attn_patch": ROOT / "hf_attn_patch",
    "hf_attn_patch.converters": ROOT / "converters",
    "hf_attn_patch.kernels": ROOT / "kernels",
}
LEVEL = {"kernels": 0, "extras": 0, "compat": 0, "assets": 0, "variants": 0, "kv_memory": 1, "devices": 1, "cache": 1, "attention": 2,
         "models": 2, "grammar": 3, "speculative": 3, "engine": 4, "serving": 5, "evaluation": 5, "hub": 5,
         "converters": 6, "cli": 6, "demo": 6, "draft": 6, "_patching": 6}  # fmt: skip
# lm-eval's loaders of the offline tasks live beside their YAMLs (lm-eval imports them by path): evaluation code, the
# evaluation layer, though the folder is the package's data
SUBLEVEL = {("assets", "lm_eval_tasks"): LEVEL["evaluation"]}
ROOT_LEVEL = 6  # the package root loads every layer's public names (and patch()): importing it is importing the top
# inside hf_attn_patch.converters, by role (its package root, like the package's, may load anything); drafting builds a
# drafter from the source's samples (io) and trains it, beside fitting
CONVERTER_LEVEL = {
    "io": 0,
    "methods": 1,
    "fitting": 2,
    "export": 2,
    "drafting": 2,
    "options": 3,
    "targets": 4,
    "stages": 5,
    "convert": 6,
}
# the attention modules that register a variant (attention/gqa.py, mla.py, latent_kv.py)
VARIANT_MODULES = {
    path.stem
    for path in (ROOT / "hf_attn_patch" / "attention").glob("*.py")
    if re.search(r"register\(\s*Variant\(", path.read_text())
}
MAX_LINES = 600  # a god file: look for the concepts it holds (400 is a prompt to look again, not a reason to cut)


def modules():
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            yield package.split(".") + [p for p in parts if p != "__init__"], path.name == "__init__.py", path


def layer_of(name: list[str]) -> int | None:
    """Layer of a module path ['hf_attn_patch', 'cache', 'manager']; None for the package root; ROOT_LEVEL for a name
    the package root defines (`from hf_attn_patch import patch`)."""
    if len(name) == 1 or name[1] not in LEVEL:
        return None if len(name) == 1 else ROOT_LEVEL
    return SUBLEVEL.get(tuple(name[1:3]), LEVEL[name[1]])


def violations(name: list[str], is_package: bool, source: str) -> list[str]:
    """The imports of one module (its dotted path, whether it is a package's __init__, its source) that run up a
    layer of the package or, inside the converters, up a converter layer."""
    own, found = layer_of(name), []
    for target, line in imported(ast.parse(source), name, is_package):
        other = layer_of(target)
        if own not in (None, ROOT_LEVEL) and other is not None and other > own:  # the root and the top load anything
            found.append(f"line {line} imports {'.'.join(target)} (layer {other} > {own})")
        if name[1:2] == target[1:2] == ["converters"] and len(name) > 2 and len(target) > 2:
            mine, theirs = CONVERTER_LEVEL.get(name[2], 0), CONVERTER_LEVEL.get(target[2])
            if theirs is not None and theirs > mine:
                found.append(
                    f"line {line} imports {'.'.join(target)}: converters/{target[2]} sits above converters/{name[2]}"
                )
        if (
            name[:2] == target[:2] == ["hf_attn_patch", "attention"]
            and len(name) == 3
            and len(target) == 4
            and name[2] in VARIANT_MODULES
            and target[2] in VARIANT_MODULES - {name[2]}
            and target[3].startswith("_")
        ):
            found.append(f"line {line} imports {'.'.join(target)}: a private name of another variant")
    return found


def imported(tree: ast.AST, name: list[str], is_package: bool):
    """Absolute module paths this module imports, anywhere in its body."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name[: len(name) - node.level + (1 if is_package else 0)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] == "hf_attn_patch":  # from p import x: the module p.x, or a name x of p (a namespace
                for alias in node.names:  # package such as kernels has none: its modules are what is imported)
                    yield target + [alias.name], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hf_attn_patch."):
                    yield alias.name.split("."), node.lineno


MODULE_IDS = dict(ids=lambda v: ".".join(v) if isinstance(v, list) else "")


@pytest.mark.parametrize("name, is_package, path", list(modules()), **MODULE_IDS)
def test_no_import_runs_up_a_layer(name, is_package, path):
    assert violations(name, is_package, path.read_text()) == [], path.relative_to(ROOT)


@pytest.mark.parametrize("name, is_package, path", list(modules()), **MODULE_IDS)
def test_every_module_is_in_the_map(name, is_package, path):
    """A new module (or folder) is placed in LEVEL / CONVERTER_LEVEL, not let through as the package root."""
    if len(name) > 1:
        assert name[1] in LEVEL, f"{path.relative_to(ROOT)}: place hf_attn_patch.{name[1]} in LEVEL"
    if name[1:2] == ["converters"] and len(name) > 2:
        assert name[2] in CONVERTER_LEVEL, f"{path.relative_to(ROOT)}: place converters/{name[2]} in CONVERTER_LEVEL"


@pytest.mark.parametrize("name, source, caught", [
    # a converter module reading a stage (io sits under every other converter layer), at module level or in a function
    ("hf_attn_patch.converters.io.x", "from ..stages import layers", True),
    ("hf_attn_patch.converters.methods.x", "def f():\n    from hf_attn_patch.converters.options import X", True),
    ("hf_attn_patch.converters.options.x", "from ..stages.target import Target", True),
    ("hf_attn_patch.converters.stages.x", "from ..convert import convert", True),
    # the paged cache reaching into the engine, the attention into serving
    ("hf_attn_patch.cache.x", "from ..engine import core", True),
    ("hf_attn_patch.cache.x", "import hf_attn_patch.engine.scheduler", True),
    ("hf_attn_patch.attention.x", "def f():\n    from ..serving.app import App", True),
    # a variant taking another variant's private helper (shared helpers live in modules of their own)
    ("hf_attn_patch.attention.latent_kv", "from .mla import _joint_rows", True),
    ("hf_attn_patch.attention.mla", "def f():\n    from hf_attn_patch.attention.gqa import _private", True),
    ("hf_attn_patch.attention.latent_kv", "from .masks import mask_bias\nfrom .gqa import RMSNorm", False),
    # downward imports pass
    ("hf_attn_patch.converters.stages.x", "from ..methods import exact\nfrom ..options import ConvertOptions", False),
    ("hf_attn_patch.engine.x", "from ..cache.manager import KVManager\nfrom ..kernels import reference", False),
    ("hf_attn_patch.converters.io.x", "from ...models.pretrained import load_source", False),
])  # fmt: skip
def test_an_upward_import_is_caught(name, source, caught):
    assert {"gqa", "mla", "latent_kv"} <= VARIANT_MODULES
    assert bool(violations(name.split("."), False, source)) == caught


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


@pytest.mark.parametrize("name, is_package, path", list(modules()), **MODULE_IDS)
def test_no_god_file(name, is_package, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: find the concepts it holds"


@pytest.mark.parametrize(
    "package", ["cache", "attention", "kv_memory", "models", "grammar", "speculative", "evaluation", "hub"]
)
def test_lower_layers_load_without_the_engine(package):
    code = (
        f"import hf_attn_patch.{package}, sys; "
        "assert not [m for m in sys.modules if m.startswith('hf_attn_patch.engine')]"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
