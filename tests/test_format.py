"""The code is laid out by `ruff format` (pyproject.toml [tool.ruff]: line length 120), not by hand to fit a line
count; `# fmt: skip` is kept for tables only: a constant literal of four or more entries over three or more lines, or
a `pytest.mark.parametrize` list over three or more lines."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORMATTED = ("hf_attn_patch", "converters", "kernels", "tests", "scripts")
SKIP = "# fmt: skip"


def _ruff() -> str:
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return ruff


def table_ends(source: str) -> set[int]:
    """Line numbers that end a table: a literal of >= 4 entries assigned over >= 3 lines, or a parametrize
    decorator over >= 3 lines."""
    ends = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                if "parametrize" in ast.unparse(decorator) and decorator.end_lineno - decorator.lineno >= 2:
                    ends.add(decorator.end_lineno)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
            node.value, (ast.Dict, ast.List, ast.Tuple, ast.Set)
        ):
            entries = node.value.keys if isinstance(node.value, ast.Dict) else node.value.elts
            if len(entries) >= 4 and node.end_lineno - node.lineno >= 2:
                ends.add(node.end_lineno)
    return ends


def test_the_code_is_formatted():
    result = subprocess.run(
        [_ruff(), "format", "--check", *FORMATTED], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"run `ruff format {' '.join(FORMATTED)}`:\n{result.stdout}{result.stderr}"


def test_format_skips_are_tables():
    strays = []
    for folder in FORMATTED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = path.read_text()
            if SKIP not in source:
                continue
            tables = table_ends(source)
            for number, line in enumerate(source.splitlines(), 1):
                if line.rstrip().endswith(SKIP) and number not in tables:
                    strays.append(f"{path.relative_to(ROOT)}:{number}")
    assert strays == [], f"`{SKIP}` outside a table: {strays}"


def test_library_lines_fit():
    """The formatter wraps code; docstrings, comments and strings are wrapped by hand to the same 120."""
    long = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("hf_attn_patch", "converters", "kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if len(line) > 120
    ]
    assert long == []


def test_table_ends_tells_a_table_from_a_call():
    assert table_ends("X = {\n 'a': 1, 'b': 2,\n 'c': 3, 'd': 4,\n}\n") == {4}
    assert table_ends("x = f(1,\n      2)\n") == set()
